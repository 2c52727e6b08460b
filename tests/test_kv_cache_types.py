"""KV cache types (-ctk / -ctv: f32, f16, bf16, q8_0, q4_0): the rows' bytes against the gguf package's reference
quantisers, the attention kernels on typed caches against a dequantise-then-attend reference (and bit for bit
against the f32 kernel on the decoded rows), the memory formula, and the flags from the CLI to the cache."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from typer.testing import CliRunner

from powerinfer import ops
from powerinfer.cli import app
from powerinfer.errors import InputError
from powerinfer.ops.kv_types import KV_TYPES, hadamard, kv_decode, kv_dims, kv_encode, kv_rotation, kv_type_of
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.kv_cache import KVCache, kv_cache_bytes
from tests.conftest import random_llama_state, write_llama_gguf

TYPES = list(KV_TYPES)
TYPED = [t for t in TYPES if t != "f32"]
GGUF_TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
runner = CliRunner()
needs_kernels = pytest.mark.skipif(not ops.kernels_available(), reason="powerinfer._kernels is not built")


def rows_for_blocks(n: int, D: int, seed: int) -> torch.Tensor:
    """n rows of D floats with the corner cases of the block formats: an all-zero block, one tiny element, ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=gen) * 2.5
    x[0, :32] = 0.0  # scale 0
    x[1, 3] = 1e-30  # a block whose scale underflows f16
    x[2, :32] = torch.arange(32) - 16.0  # q4_0: the largest magnitude is negative; q8_0 ties at .5
    x[3, :32] = 0.5 * torch.arange(32)
    return x


def reference_bytes(x: torch.Tensor, name: str) -> torch.Tensor:
    """The bytes llama.cpp's reference quantiser (as the gguf package reproduces it) or conversion gives."""
    if name in GGUF_TYPES:
        return torch.from_numpy(gguf_quants.quantize(x.numpy(), GGUF_TYPES[name]).reshape(-1).copy())
    dtype = KV_TYPES[name].dtype
    assert dtype is not None
    return x.to(dtype).contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("name", TYPES)
def test_encode_matches_reference_bytes(name):
    x = rows_for_blocks(6, 128, seed=0)
    enc = kv_encode(x.view(6, 2, 64), KV_TYPES[name])
    assert kv_type_of(enc) is KV_TYPES[name] and kv_dims(enc) == (6, 2, 64)
    assert torch.equal(enc.contiguous().view(torch.uint8).reshape(-1), reference_bytes(x, name))
    if name in GGUF_TYPES:  # decoding: the gguf package's dequantiser, exactly
        want = gguf_quants.dequantize(reference_bytes(x, name).numpy(), GGUF_TYPES[name]).reshape(6, 128)
        assert torch.equal(kv_decode(enc).reshape(6, 128), torch.from_numpy(want))
        # a decoded row encodes to the same values (read_slot / write_slot, session files; an all-zero q4_0
        # block may come back with a scale of +0 for -0)
        assert torch.equal(kv_decode(kv_encode(kv_decode(enc), KV_TYPES[name])), kv_decode(enc))


def identity_rope(D: int) -> torch.Tensor:
    pairs = torch.zeros(D // 2, 2)
    pairs[:, 0] = 1.0  # (cos, sin) = (1, 0): the kernel writes k unrotated, so its row is comparable
    return pairs


def typed_cache(name: str, n_ctx: int, H_kv: int, D: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return kv_encode(torch.randn(n_ctx, H_kv, D, generator=gen), KV_TYPES[name]).contiguous()


@needs_kernels
@pytest.mark.parametrize("name", TYPED)
def test_kernel_writes_reference_bytes(name, isa):
    """The kernel's row write (pi_attn_decode, and pi_attn_prefill for several rows) = the reference bytes (heads of
    32: stored unrotated, as llama.cpp does below 64)."""
    H, H_kv, D, n_ctx = 4, 4, 32, 24
    kc = ops.KernelContext(n_threads=1, isa=isa)
    k_cache, v_cache = typed_cache(name, n_ctx, H_kv, D, 1), typed_cache(name, n_ctx, H_kv, D, 2)
    assert kv_rotation(KV_TYPES[name], D, False) == kv_rotation(KV_TYPES[name], D, True) == 0
    x = rows_for_blocks(8, H_kv * D, seed=3)
    q = torch.randn(1, H * D)
    ops.attn_decode(q, x[:1], x[1:2], identity_rope(D), k_cache, v_cache, 5, kc)
    assert torch.equal(k_cache[5].view(torch.uint8).reshape(-1), reference_bytes(x[:1], name))
    assert torch.equal(v_cache[5].view(torch.uint8).reshape(-1), reference_bytes(x[1:2], name))
    rope = identity_rope(D).expand(4, D // 2, 2).contiguous()
    ops.attn_prefill(torch.randn(4, H * D), x[:4], x[4:8], rope, k_cache, v_cache, 10, kc)
    assert torch.equal(k_cache[10:14].view(torch.uint8).reshape(-1), reference_bytes(x[:4], name))
    assert torch.equal(v_cache[10:14].view(torch.uint8).reshape(-1), reference_bytes(x[4:8], name))


@needs_kernels
@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
@pytest.mark.parametrize("D", [64, 128, 192])
def test_kernel_stores_block_heads_rotated(name, D, isa):
    """Heads of D % 64 == 0 go into q8_0 / q4_0 rotated (llama.cpp's attention rotation): keys by the Walsh-Hadamard
    blocks of the largest power of two dividing D, values by blocks of 64; a decoded row rotated back is the row
    within the format's error (measured max |error| / max |x| over seeds: q8_0 0.0069, q4_0 0.124; bounds 2x), and
    most stored heads are the bytes of the torch rotation then the reference quantiser (the C transform rounds
    differently from torch's matrix product, which moves a rounding tie now and then: measured >= 87.5% of heads)."""
    t = KV_TYPES[name]
    rot_k, rot_v = kv_rotation(t, D, False), kv_rotation(t, D, True)
    assert rot_v == 64 and rot_k == {64: 64, 128: 128, 192: 64}[D]
    k_cache, v_cache = typed_cache(name, 8, 2, D, 1), typed_cache(name, 8, 2, D, 2)
    x = torch.randn(2, 2 * D, generator=torch.Generator().manual_seed(7)) * 2
    ops.attn_decode(
        torch.randn(1, 4 * D), x[:1], x[1:], identity_rope(D), k_cache, v_cache, 3, ops.KernelContext(isa=isa)
    )
    bound = {"q8_0": 0.014, "q4_0": 0.25}[name] * x.abs().max()
    for rows, rot, want in ((k_cache, rot_k, x[0]), (v_cache, rot_v, x[1])):
        got = kv_decode(rows[3], rot).reshape(-1)
        assert (got - want).abs().max() < bound
        assert (kv_decode(rows[3]).reshape(-1) - want).abs().max() > bound  # stored rotated, not as is
        ref = kv_encode(hadamard(want.view(2, D), rot), t)
        assert (ref == rows[3]).all(dim=-1).float().mean() >= 0.75


@needs_kernels
@pytest.mark.parametrize("name", TYPED)
@pytest.mark.parametrize(("H", "H_kv", "D"), [(9, 3, 64), (4, 4, 32), (8, 1, 128), (6, 2, 96)])
def test_decode_attention_on_typed_cache(name, H, H_kv, D, isa):
    """pi_attn_decode reading a typed cache = torch's attention over its decoded rows (rotated back where the
    block types store heads rotated; measured max |error| 2.4e-6 on outputs of size ~1 at D = 128, the f32
    kernel's own rounding; bound 6e-6), = the f32 kernel over those decoded rows bit for bit where nothing is
    rotated, and the same bits on 1-3 threads (the team path past 128 positions included)."""
    n_ctx = 203
    for pos in (0, 7, 130, n_ctx - 1):
        gen = torch.Generator().manual_seed(pos)
        q = torch.randn(1, H * D, generator=gen) * 3
        k, v = torch.randn(1, H_kv * D, generator=gen), torch.randn(1, H_kv * D, generator=gen)
        outs = []
        for threads in (1, 2, 3):
            k_cache, v_cache = typed_cache(name, n_ctx, H_kv, D, 1), typed_cache(name, n_ctx, H_kv, D, 2)
            kc = ops.KernelContext(n_threads=threads, isa=isa)
            outs.append(ops.attn_decode(q, k, v, identity_rope(D), k_cache, v_cache, pos, kc))
        assert all(torch.equal(outs[0], o) for o in outs[1:]), pos
        rot_k, rot_v = kv_rotation(KV_TYPES[name], D, False), kv_rotation(KV_TYPES[name], D, True)
        keys, values = kv_decode(k_cache[: pos + 1], rot_k), kv_decode(v_cache[: pos + 1], rot_v)
        want = ops.decode_attention(q.view(1, H, D), keys, values)
        torch.testing.assert_close(outs[0], want, rtol=6e-6, atol=6e-6)
        if (
            rot_k or rot_v
        ):  # the kernel rotates q and the output instead of the rows: equal in exact arithmetic
            continue
        # the f32 kernel on a decoded copy, the new row written as the decoded one: the same bits
        kf, vf = kv_decode(k_cache).contiguous(), kv_decode(v_cache).contiguous()
        kc = ops.KernelContext(n_threads=1, isa=isa)
        f32 = ops.attn_decode(
            q, kf[pos].reshape(1, -1), vf[pos].reshape(1, -1), identity_rope(D), kf, vf, pos, kc
        )
        assert torch.equal(outs[0], f32), pos


@needs_kernels
@pytest.mark.parametrize("name", TYPED)
def test_prefill_equals_decode_steps_on_typed_cache(name, isa):
    """A prompt in one pi_attn_prefill call = the same tokens decoded one by one: outputs and cache bytes."""
    H, H_kv, D, n_ctx, T = 6, 2, 64, 48, 40
    gen = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(T, H * D, generator=gen),
        torch.randn(T, H_kv * D, generator=gen),
        torch.randn(T, H_kv * D),
    )
    angles = torch.rand(n_ctx, D // 2, generator=gen) * 6
    pairs = torch.stack((angles.cos(), angles.sin()), dim=-1).contiguous()
    kc = ops.KernelContext(n_threads=2, isa=isa)
    empty = kv_encode(torch.zeros(n_ctx, H_kv, D), KV_TYPES[name]).contiguous()
    k1, v1, k2, v2 = (empty.clone() for _ in range(4))
    whole = ops.attn_prefill(q, k, v, pairs[:T], k1, v1, 0, kc)
    steps = torch.cat(
        [ops.attn_decode(q[t : t + 1], k[t : t + 1], v[t : t + 1], pairs[t], k2, v2, t, kc) for t in range(T)]
    )
    assert torch.equal(whole, steps)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("type_k", TYPES)
@pytest.mark.parametrize("type_v", ["f32", "q8_0", "q4_0"])
def test_memory_formula(type_k, type_v):
    per_element = {"f32": Fraction(4), "f16": Fraction(2), "bf16": Fraction(2)}
    per_element |= {"q8_0": Fraction(34, 32), "q4_0": Fraction(18, 32)}
    n_layer, n_ctx, H_kv, D, n_seq = 3, 40, 2, 64, 2
    want = n_layer * n_ctx * H_kv * D * n_seq * (per_element[type_k] + per_element[type_v])
    assert want.denominator == 1
    assert kv_cache_bytes(n_layer, n_ctx, H_kv * D, n_seq, type_k, type_v) == want
    kv = KVCache(n_layer, n_ctx, H_kv, D, n_seq=n_seq, type_k=type_k, type_v=type_v)
    assert kv.n_bytes == want


def test_block_types_need_whole_blocks():
    with pytest.raises(ValueError, match="blocks of 32"):
        KVCache(1, 8, 2, 48, type_k="q8_0")
    KVCache(1, 8, 2, 48, type_k="f16", type_v="bf16")  # any head size


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A Llama file with heads of 32 (q8_0 / q4_0 blocks fit)."""
    sd = random_llama_state(n_embd=128, n_head=4, n_head_kv=2, n_ff=128, seed=4)
    return write_llama_gguf(tmp_path_factory.mktemp("kvtypes") / "tiny.gguf", sd, n_head=4, n_head_kv=2)


def test_session_rows_round_trip(tiny):
    """read_slot decodes, write_slot encodes: a typed cache gets its own bytes back (session files)."""
    e = Engine(tiny, EngineOptions(n_ctx=32, n_threads=1, cache_type_k="q8_0", cache_type_v="q4_0"))
    e.step([0] * 9, list(range(3, 12)), list(range(9)))
    before = [(view.k[0, :9].clone(), view.v[0, :9].clone()) for view in e.kv.layers]
    keys, values = e.kv.read_slot(0, 9)
    e.kv.write_slot(0, keys * 1.0, values * 1.0)
    for view, (k, v) in zip(e.kv.layers, before, strict=True):
        assert torch.equal(kv_decode(view.k[0, :9]), kv_decode(k)) and torch.equal(view.v[0, :9], v)


def test_typed_cache_logits_near_f32(tiny):
    """The tiny (random) model's logits with each cache type against the f32 cache: errors grow with the format's
    step (measured max |diff| on logits up to 3.2: f16 1.5e-3, bf16 1.6e-2, q8_0 4.2e-2, q4_0 0.62; bounds 3x
    those), and are not zero (the cache really is stored in the type)."""
    tokens = list(range(3, 30))
    logits = {}
    for name in TYPES:
        e = Engine(tiny, EngineOptions(n_ctx=32, n_threads=1, cache_type_k=name, cache_type_v=name))
        logits[name] = e.step([0] * len(tokens), tokens, list(range(len(tokens))), all_logits=True)
    bounds = {"f16": 4.5e-3, "bf16": 4.8e-2, "q8_0": 0.13, "q4_0": 1.9}
    diffs = [(logits[name] - logits["f32"]).abs().max().item() for name in bounds]
    assert all(0 < d < b for d, b in zip(diffs, bounds.values(), strict=True)), diffs
    assert diffs == sorted(diffs), diffs


def test_cli_flags_reach_the_cache(tiny):
    result = runner.invoke(
        app, ["perplexity", "-m", str(tiny), "-f", str(Path(__file__).parent / "data" / "python-reference-prose.txt"),
              "-c", "64", "--chunks", "1", "-t", "1", "-ctk", "q8_0", "--cache-type-v", "q4_0"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    kb, vb = 64 * 2 * 64 * 34 // 32, 64 * 2 * 64 * 18 // 32  # 2 layers x 64 cells x 64 features
    assert f"K (q8_0): {kb / 2**20:.2f} MiB, V (q4_0): {vb / 2**20:.2f} MiB" in result.stderr


@pytest.mark.parametrize("command", ["main", "perplexity", "batched", "bench", "server"])
def test_every_engine_command_passes_the_types(command, tiny, monkeypatch):
    """main, perplexity, batched, bench and server hand -ctk / -ctv to the engine options (assembly refused
    here with the values it got: the command prints that line and exits 1)."""

    def refuse(path, options):
        raise InputError(f"got {options.cache_type_k}/{options.cache_type_v}")

    monkeypatch.setattr("powerinfer.runtime.engine.assemble", refuse)
    prose = str(Path(__file__).parent / "data" / "python-reference-prose.txt")
    args = {
        "main": ["-p", "x", "-n", "1"],
        "perplexity": ["-f", prose],
        "batched": ["-p", "x"],
        "bench": ["-p", "8"],
    }
    result = runner.invoke(
        app, [command, "-m", str(tiny), "-ctk", "bf16", "-ctv", "q8_0", *args.get(command, [])]
    )
    assert result.exit_code == 1, result.output
    assert "error: got bf16/q8_0" in result.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["-ctk", "q5_0"],
            "error: --cache-type-k 'q5_0' is not a KV cache type: choose one of f32, f16, bf16, q8_0",
        ),
        (["-ctv", "F16"], "error: --cache-type-v 'F16' is not a KV cache type"),
    ],
)
def test_bad_cache_type_is_one_error_line(tiny, flags, message):
    result = runner.invoke(app, ["main", "-m", str(tiny), "-p", "x", "-n", "1", *flags])
    assert result.exit_code == 1
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_heads_not_in_whole_blocks_are_refused(tmp_path):
    sd = random_llama_state(n_embd=64, n_head=4, n_head_kv=2, seed=1)  # heads of 16
    path = write_llama_gguf(tmp_path / "h16.gguf", sd, n_head=4, n_head_kv=2)
    with pytest.raises(InputError, match="--cache-type-v q4_0: q4_0 stores heads in blocks of 32"):
        Engine(path, EngineOptions(n_ctx=16, cache_type_v="q4_0"))
    Engine(path, EngineOptions(n_ctx=16, cache_type_k="f16", cache_type_v="bf16"))


def test_pool_device_layers_refuse_typed_caches(tiny):
    with pytest.raises(InputError, match="pool device"):
        Engine(tiny, EngineOptions(n_ctx=16, pool_device="cpu", n_gpu_layers=1, cache_type_k="q8_0"))
    Engine(tiny, EngineOptions(n_ctx=16, pool_device="cpu", n_gpu_layers=1))  # f32 there


def test_numpy_reference_is_what_gguf_exposes():
    # the oracle above: gguf's Q8_0 / Q4_0 classes quantise 32-element blocks (guards an API change)
    x = np.linspace(-1, 1, 32, dtype=np.float32)[None]
    assert gguf_quants.quantize(x, GGMLQuantizationType.Q8_0).shape == (1, 34)
    assert gguf_quants.quantize(x, GGMLQuantizationType.Q4_0).shape == (1, 18)
