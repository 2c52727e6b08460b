"""C kernels against the torch reference (powerinfer.ops.reference), per type and shape.

Tolerances:
- F32, F16: max|y - ref| <= 1e-5 * (|x| @ |W|.T), the float32 rounding scale of each output.
- Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, activation precision "f32" (default, exact mode): x stays float32, so the same
  bound as F32/F16 against x @ dequant(W).T.
- Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, activation precision "q8": the kernels quantise x to int8 blocks of 32 (scale
  amax/127), as ggml does. Against the plain reference: |y - ref| <= 1e-2 * ||x_t|| * ||W_n|| per output and
  NMSE <= 1e-3.
  Against the reference fed the same int8-rounded x: max|y - ref| <= 1e-5 * (|x_q| @ |W|.T), i.e. the
  integer block arithmetic is exact and only float summation order differs.
"""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from powerinfer import ops, quant
from powerinfer.gguf.constants import GGMLType
from powerinfer.ops import reference
from powerinfer.quant import dequantize, quantize

KERNEL_TYPES = sorted(quant.KERNEL_TYPES)  # every type the C kernels compute on
# rows of 32-element blocks: exact (f32) and int8 (q8) kernels
QUANT_TYPES = {GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q5_1}
BLOCK_TYPES = QUANT_TYPES
SHAPES_K = [32, 64, 576, 1536]
SHAPES_N = [1, 7, 64, 300]
SHAPES_T = [1, 3, 17]
TESTS = Path(__file__).resolve().parent

needs_kernels = pytest.mark.skipif(not ops.kernels_available(), reason="powerinfer._kernels is not built")


def needs_isa(name: str):
    """Skip unless this CPU runs the SIMD variant `name` (a variant is never compared with itself)."""
    best = ops.isa_best()
    has = best is not None and ops.ISA_NAMES.index(name) <= ops.ISA_NAMES.index(best)
    return pytest.mark.skipif(not has, reason=f"this CPU has no {name} (best SIMD variant: {best})")


def make_weight(ggml_type: GGMLType, n_rows: int, n_cols: int, seed: int = 0) -> ops.QWeight:
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    data[:, :3] = 0.0  # an all-zero-ish start exercises zero scales in the first block
    return ops.QWeight.from_numpy(quantize(data, ggml_type), ggml_type, (n_rows, n_cols))


def make_x(n_tokens: int, n_cols: int, seed: int = 1) -> torch.Tensor:
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((n_tokens, n_cols)).astype(np.float32))
    if n_cols >= 64:
        x[0, 32:64] = 0.0  # an all-zero block: activation scale 0
    return x


def fake_quant_act(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernels round activations: per 32-block, round(x * 127 / amax) * amax / 127."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(x.shape)


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_linear_matches_reference(ggml_type, isa, act):
    kc = ops.KernelContext(act_precision=act, isa=isa)
    for n_cols, n_rows in itertools.product(SHAPES_K, SHAPES_N):
        w = make_weight(ggml_type, n_rows, n_cols)
        dense = reference.dense(w).double()
        for n_tokens in SHAPES_T:
            x = make_x(n_tokens, n_cols)
            y = ops.linear(x, w, kc)
            assert y.shape == (n_tokens, n_rows) and y.dtype == torch.float32
            where = f"{ggml_type.name} {isa} {act} N={n_rows} K={n_cols} T={n_tokens}"
            if ggml_type in QUANT_TYPES and act == "q8":
                ref = reference.linear(x, w).double()
                diff = (y.double() - ref).abs()
                norms = x.double().norm(dim=1, keepdim=True) * dense.norm(dim=1)  # (T, N)
                assert (diff <= 1e-2 * norms).all(), where
                assert (diff.square().sum() / ref.square().sum()) <= 1e-3, where
                x = fake_quant_act(x)
            exact = x.double() @ dense.T
            scale = x.double().abs() @ dense.abs().T
            assert ((y.double() - exact).abs() <= 1e-5 * scale + 1e-30).all(), where


@needs_kernels
@pytest.mark.parametrize("ggml_type", [GGMLType.F32, GGMLType.F16, GGMLType.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize(("n_rows", "n_cols"), [(37, 83), (19, 8), (33, 40)])
def test_float_row_pairs_equal_single_rows(ggml_type, n_rows, n_cols, isa):
    """Prompts of float weights go in row pairs x 3 tokens: an odd row left over, a vector tail and a scalar tail
    (K = 83, 8, 40) give the bits of one token at a time, and stay within float error of the reference."""
    w = make_weight(ggml_type, n_rows, n_cols)
    x = make_x(8, n_cols)
    kc = ops.KernelContext(n_threads=2, isa=isa)
    batch = ops.linear(x, w, kc)
    single = torch.stack([ops.linear(x[t], w, kc) for t in range(x.shape[0])])
    assert torch.equal(batch, single)
    dense = reference.dense(w).double()
    scale = x.double().abs() @ dense.abs().T
    assert ((batch.double() - x.double() @ dense.T).abs() <= 1e-5 * scale + 1e-30).all()


@needs_kernels
@pytest.mark.parametrize(
    "ggml_type",
    [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0],
    ids=lambda t: t.name,
)
@pytest.mark.parametrize(
    ("n_rows", "n_cols", "n_tokens"),
    [(27, 416, 4), (27, 512, 13), (8, 32, 12), (61, 768, 6), (43, 256, 1), (19, 160, 1), (40, 576, 15)],
)
def test_quant_panels_equal_single_rows(ggml_type, n_rows, n_cols, n_tokens, isa):
    """From 4 tokens the rows of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 go by panels of 16 (AVX-512) and 8 rows (rows
    in vector lanes, 4 tokens per panel load), and for one token over rows of at most 8 blocks (Q4_0, Q4_1: a
    sparse head's screen), the last N % 16 and N % 8 rows, token counts that are not multiples of 4 and the last
    nb % 8 blocks included: the bits of one token at a time, dense and through a sparse row list, with rows of
    all-15 (Q4) or all-31 (Q5) values or of +-127 (Q8_0) against activations of -127, the largest int16 pair
    sums the AVX2 panels add up."""
    rng = np.random.default_rng(3)
    data = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    # the largest value everywhere but the first of each block (-1: the smallest; Q4_1, Q5_1: m = -1):
    # Q4 d = 1/8 (nibble 15 from 0.875), Q5 d = 1/16 (31 from 0.9375)
    q5 = ggml_type in (GGMLType.Q5_0, GGMLType.Q5_1)
    data[1] = 0.9375 if q5 else 0.875
    data[1, ::32] = -1.0
    w = ops.QWeight.from_numpy(quantize(data, ggml_type), ggml_type, (n_rows, n_cols))
    x = make_x(n_tokens, n_cols)
    x[-1] = -1.0
    kc = ops.KernelContext(n_threads=2, act_precision="q8", isa=isa)
    batch = ops.linear(x, w, kc)
    single = torch.stack([ops.linear(x[t], w, kc) for t in range(n_tokens)])
    assert torch.equal(batch, single)
    idx = torch.from_numpy(rng.permutation(n_rows)[: max(9, n_rows - 5)].astype(np.int64))
    assert torch.equal(ops.rows_matmul(x, w, idx, kc), single[:, idx])
    dense = reference.dense(w).double()
    xq = fake_quant_act(x).double()
    scale = xq.abs() @ dense.abs().T
    assert ((batch.double() - xq @ dense.T).abs() <= 1e-5 * scale + 1e-30).all()


@needs_kernels
@pytest.mark.parametrize(("n_rows", "n_cols"), [(64, 256), (48, 96), (8, 544), (4096, 256)])
def test_rows_repacked_by_8_have_the_bits_of_the_matvec(n_rows, n_cols, isa):
    """The sparse head's screen repacked by 8 rows (pi_repack_rows8 / pi_matvec_rows8: one token, q8): the
    bits of the type's int8 matmul at T = 1 over the same rows (panels of 8 rows up to 8 blocks, tiles beyond; a block
    count that is odd, 3, and past 8, 17), at 1 and 2 threads, with a row of all-15 nibbles against -127
    activations; a row count that is not a multiple of 8 is refused."""
    from powerinfer.ops import library
    from powerinfer.ops.head import repacked_screen

    lib = library.load()
    rng = np.random.default_rng(5)
    data = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    data[1] = 0.875
    data[1, ::32] = -1.0
    w = ops.QWeight.from_numpy(quantize(data, GGMLType.Q4_0), GGMLType.Q4_0, (n_rows, n_cols))
    x = make_x(1, n_cols)
    x[0, : n_cols // 2] = -1.0
    for threads in (1, 2):
        kc = ops.KernelContext(n_threads=threads, act_precision="q8", isa=isa)
        packed = repacked_screen(w, kc)
        assert packed is not None
        y = torch.empty(n_rows, dtype=torch.float32)
        status = lib.matvec_rows8(
            int(GGMLType.Q4_0),
            packed.data_ptr(),
            n_rows,
            n_cols,
            x.data_ptr(),
            y.data_ptr(),
            threads,
            ops.ISA_NAMES.index(isa),
        )
        assert status == 0
        assert torch.equal(y, ops.linear(x, w, kc)[0])
    assert repacked_screen(w, kc.replace(act_precision="f32")) is None
    odd = ops.QWeight.from_numpy(quantize(data[:-1], GGMLType.Q4_0), GGMLType.Q4_0, (n_rows - 1, n_cols))
    assert repacked_screen(odd, kc) is None
    assert lib.repack_rows8(
        int(GGMLType.Q4_0), odd._raw_ptr, odd._raw_stride, n_rows - 1, n_cols, packed.data_ptr()
    )
    q8 = ops.QWeight.from_numpy(quantize(data, GGMLType.Q8_0), GGMLType.Q8_0, (n_rows, n_cols))
    assert repacked_screen(q8, kc) is None  # not a rows8 type: the kernels refuse it too
    assert lib.repack_rows8(
        int(GGMLType.Q8_0), q8._raw_ptr, q8._raw_stride, n_rows, n_cols, packed.data_ptr()
    )


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_linear_independent_of_threads_and_batch(ggml_type, isa, act):
    w = make_weight(ggml_type, 300, 576)
    x = make_x(17, 576)
    kc1 = ops.KernelContext(n_threads=1, act_precision=act, isa=isa)
    kc2 = kc1.replace(n_threads=2)
    one = ops.linear(x, w, kc1)
    two = ops.linear(x, w, kc2)
    assert torch.equal(one, two)
    # a token's result does not depend on the batch it is computed in (decode == prefill row)
    single = torch.stack([ops.linear(x[t], w, kc2) for t in range(x.shape[0])])
    assert torch.equal(single, two)


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_linear_short_rows_decode_equals_batch(ggml_type, isa, act):
    # one token with short rows runs the grouped rows_dot path (several rows per call), and in exact mode with long
    # rows (K = 1536) one row per rows_dot call: same bits as the tiles
    cols = [32, 96, 128, 1536] if ggml_type in BLOCK_TYPES else [1, 7, 33, 100]
    for n_cols, n_rows in itertools.product(cols, [1, 3, 301]):
        w = make_weight(ggml_type, n_rows, n_cols)
        x = make_x(5, n_cols)
        batch = ops.linear(x, w, ops.KernelContext(act_precision=act, isa=isa))
        for threads in (1, 2):
            kc = ops.KernelContext(n_threads=threads, act_precision=act, isa=isa)
            single = torch.stack([ops.linear(x[t], w, kc) for t in range(x.shape[0])])
            assert torch.equal(single, batch), (n_cols, n_rows, threads)


@needs_kernels
@needs_isa("avx512")
def test_q4_0_one_token_rows_kernel_has_the_tile_bits():
    """One token over Q4_0 rows of a multiple of 8 blocks runs the AVX-512 rows kernel (rows_q4_0: activations
    rearranged once per call, 4 blocks per 512-bit vector; from 64 rows the two halves read in turns); its bits are
    those of the tiles of a batch (panels of 16 and 8 rows, 4-token tiles) and of the AVX2 variant (the row tile, one
    row per call), at 1 and 2 threads, group counts with and without a specialised body, odd and even row counts,
    and rows of other block counts (the fallback)."""
    avx2 = ops.KernelContext(act_precision="q8", isa="avx2")
    for n_cols, n_rows in itertools.product([256, 512, 768, 1024, 2048, 4096, 288], [1, 37, 129, 512]):
        w = make_weight(GGMLType.Q4_0, n_rows, n_cols, seed=n_cols + n_rows)
        x = make_x(5, n_cols, seed=n_rows)
        batch = ops.linear(x, w, avx2.replace(isa="avx512"))
        for threads in (1, 2):
            kc = avx2.replace(isa="avx512", n_threads=threads)
            single = torch.stack([ops.linear(x[t], w, kc) for t in range(x.shape[0])])
            assert torch.equal(single, batch), (n_cols, n_rows, threads)
            assert torch.equal(single, ops.linear(x, w, avx2.replace(n_threads=threads))), (
                n_cols,
                n_rows,
                threads,
            )


@needs_kernels
@pytest.mark.parametrize(
    ("n_head", "n_head_kv", "head_dim"), [(9, 3, 64), (6, 3, 24), (15, 5, 32), (4, 1, 64)]
)
def test_attn_decode_heads_shared_by_threads(n_head, n_head_kv, head_dim, isa):
    """Past 128 positions, KV heads that do not split evenly over the threads are shared by all of them (scores
    by position groups, softmax by query head, values by output lanes): the bits of one thread, at group-aligned
    and ragged lengths, and torch's attention within float error (2e-6, as above)."""
    n_ctx = 203
    gen, rot, pairs, k_cache, v_cache = attn_case(n_head, n_head_kv, head_dim, n_ctx, seed=2)
    for pos in (126, 127, 135, 200, n_ctx - 1):
        q, k, v = qkv(gen, n_head, n_head_kv, head_dim)
        outs = []
        for threads in (1, 2, 3, 4):
            kc, vc = k_cache.clone(), v_cache.clone()
            ctx = ops.KernelContext(n_threads=threads, isa=isa)
            outs.append(ops.attn_decode(q, k, v, pairs[pos], kc, vc, pos, ctx))
        assert all(torch.equal(outs[0], o) for o in outs[1:]), pos
        qr = ops.apply_rope(q.view(1, n_head, head_dim), rot[pos : pos + 1])
        keys, values = kc[: pos + 1].transpose(0, 1), vc[: pos + 1].transpose(0, 1)
        want = F.scaled_dot_product_attention(qr.transpose(0, 1), keys, values, enable_gqa=True)
        torch.testing.assert_close(outs[0], want.transpose(0, 1).reshape(1, -1), rtol=2e-6, atol=2e-6)


@needs_kernels
@needs_isa("avx512")
def test_simd_variants_agree_on_quant_types():
    # q8: AVX2 and AVX-512 use the same integer dot products and float accumulation order (AVX-512 takes Q4
    # blocks two per 512-bit vector: an odd block count leaves a 256-bit tail block; Q5 and Q8_0 take the 256-bit
    # steps with dpbusd for maddubs + madd; one token or a batch).
    # The variant is an argument of each call: the two contexts alternate on the same data.
    avx2 = ops.KernelContext(act_precision="q8", isa="avx2")
    avx512 = avx2.replace(isa="avx512")
    assert (avx2.isa_name, avx512.isa_name) == ("avx2", "avx512")
    for ggml_type, n_cols, n_tokens in itertools.product(
        sorted(QUANT_TYPES), [32, 64, 96, 576, 1568], [1, 5]
    ):
        w = make_weight(ggml_type, 64, n_cols)
        x = make_x(n_tokens, n_cols)
        y2, y512 = ops.linear(x, w, avx2), ops.linear(x, w, avx512)
        assert torch.equal(y2, y512), (ggml_type.name, n_cols, n_tokens)
        assert torch.equal(ops.linear(x, w, avx2), y2)


@needs_kernels
@needs_isa("avx512")
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_avx2_and_avx512_per_call(ggml_type):
    # exact mode: both variants within the float32 rounding bound of the reference (F32/F16 take 16-lane vectors
    # in AVX-512, so summation order and bits may differ), and each one reproduces itself when they alternate
    avx2 = ops.KernelContext(isa="avx2")
    avx512 = avx2.replace(isa="avx512")
    w = make_weight(ggml_type, 70, 576)
    x = make_x(5, 576)
    dense = reference.dense(w).double()
    exact, scale = x.double() @ dense.T, x.double().abs() @ dense.abs().T
    first = {kc.isa: ops.linear(x, w, kc) for kc in (avx2, avx512)}
    for kc in (avx512, avx2, avx512):
        y = ops.linear(x, w, kc)
        assert torch.equal(y, first[kc.isa]), kc.isa
        assert ((y.double() - exact).abs() <= 1e-5 * scale + 1e-30).all(), kc.isa


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_get_rows_exact(ggml_type):
    w = make_weight(ggml_type, 300, 576)
    ids = torch.tensor([0, 299, 17, 17, 150], dtype=torch.int64)
    rows = ops.get_rows(w, ids, ops.KernelContext(n_threads=2))
    expected = dequantize(w.raw.numpy(), ggml_type, w.shape)[ids.numpy()]
    assert rows.dtype == torch.float32 and rows.shape == (5, 576)
    assert np.array_equal(rows.numpy(), expected)
    with pytest.raises(IndexError):
        ops.get_rows(w, torch.tensor([300]))


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_fallback_matches_kernels(ggml_type, act):
    w = make_weight(ggml_type, 64, 576)
    x = make_x(3, 576)
    ids = torch.tensor([5, 1, 63])
    kc = ops.KernelContext(act_precision=act)
    off = kc.replace(enabled=False)
    assert ggml_type in kc.supported_types() and kc.uses_kernels
    kernel_y, kernel_rows = ops.linear(x, w, kc), ops.get_rows(w, ids, kc)
    assert off.supported_types() == frozenset() and not off.uses_kernels and off.isa_name is None
    fallback_y, fallback_rows = ops.linear(x, w, off), ops.get_rows(w, ids, off)
    assert torch.equal(kernel_rows, fallback_rows)
    tol = 2e-2 if ggml_type in QUANT_TYPES and act == "q8" else 1e-5
    assert (kernel_y - fallback_y).abs().max() <= tol * fallback_y.abs().max()


def random_tq2_0(n_rows: int, n_cols: int, seed: int = 0) -> np.ndarray:
    """Raw TQ2_0 blocks (a type without kernels): random 2-bit ternary codes, fp16 scales 0.01 (last 2 bytes)."""
    blocks = np.random.default_rng(seed).integers(0, 256, size=(n_rows, n_cols // 256, 66), dtype=np.uint8)
    blocks[:, :, 64:] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return blocks.reshape(n_rows, -1)


def test_non_kernel_types_use_cached_dense_copy():
    w = ops.QWeight.from_numpy(random_tq2_0(7, 256), GGMLType.TQ2_0, (7, 256))
    x = make_x(3, 256)
    y = ops.linear(x, w)
    torch.testing.assert_close(y, reference.linear(x, w), rtol=1e-5, atol=1e-5)
    assert "f32" in w._dense  # decoded once, reused by the next call
    ids = torch.tensor([6, 0])
    assert torch.equal(ops.get_rows(w, ids), reference.get_rows(w, ids))


def test_linear_shapes_and_validation():
    w = make_weight(GGMLType.Q4_1, 7, 64)
    assert ops.linear(make_x(1, 64)[0], w).shape == (7,)
    assert ops.linear(make_x(6, 64).reshape(2, 3, 64), w).shape == (2, 3, 7)
    with pytest.raises(ValueError):
        ops.linear(make_x(1, 32), w)
    with pytest.raises(ValueError):
        ops.QWeight(w.raw[:, :-1], GGMLType.Q4_1, (7, 64))


def test_kernel_context_settings_and_validation():
    kc = ops.KernelContext()
    assert (
        kc.act_precision == "f32" and kc.isa is None and kc.enabled
    )  # the defaults: exact mode, best variant
    assert kc.n_threads == torch.get_num_threads()
    assert ops.KernelContext(n_threads=3).n_threads == 3
    assert kc.replace(act_precision="q8") == ops.KernelContext(n_threads=kc.n_threads, act_precision="q8")
    assert kc.replace(act_precision="q8").act_precision == "q8" and kc.act_precision == "f32"  # a copy
    with pytest.raises(dataclasses.FrozenInstanceError):
        kc.n_threads = 4  # type: ignore[misc]
    bad = [
        ({"n_threads": 0}, "thread count"),
        ({"n_threads": 1025}, "thread count"),
        ({"n_threads": 2.0}, "thread count"),
        ({"act_precision": "int8"}, "activation precision"),
        ({"isa": "sse4"}, "SIMD variant"),
    ]
    for kwargs, needle in bad:
        with pytest.raises(ValueError, match=needle) as info:
            ops.KernelContext(**kwargs)
        assert "\n" not in str(info.value)
    # ops called without a context use the default one: the defaults with torch's thread count
    default = ops.default_context()
    assert (
        default == ops.KernelContext(n_threads=torch.get_num_threads()) and default is ops.default_context()
    )


@needs_kernels
def test_kernel_context_isa():
    best = ops.isa_best()
    assert ops.KernelContext().isa_name == best
    assert ops.KernelContext(isa="scalar").isa_name == "scalar"
    above = ops.ISA_NAMES[ops.ISA_NAMES.index(best) + 1 :]
    for name in above:  # a variant the CPU lacks is refused, not silently capped
        with pytest.raises(ValueError, match=f"SIMD variant '{name}' is not available on this CPU"):
            ops.KernelContext(isa=name)


def test_missing_extension_means_reference(monkeypatch):
    from powerinfer.ops import library

    # the loader warns once when the extension is missing (load() caches its answer for the process)
    monkeypatch.setattr(library.importlib.util, "find_spec", lambda name: None)
    with pytest.warns(RuntimeWarning, match="not built"):
        assert library._load() is None
    monkeypatch.undo()
    # a context made without the library runs the torch reference
    monkeypatch.setattr(library, "load", lambda: None)
    kc = ops.KernelContext(isa="avx512")  # no library: the variant is not checked, nothing runs it
    assert not kc.uses_kernels and kc.supported_types() == frozenset()
    w, x = make_weight(GGMLType.Q4_0, 20, 64), make_x(2, 64)
    assert torch.equal(ops.linear(x, w, kc), reference.linear(x, w))


@needs_kernels
@pytest.mark.parametrize("ggml_type", sorted(QUANT_TYPES), ids=lambda t: t.name)
def test_contexts_alternate_in_one_process(ggml_type, tmp_path):
    """f32 and q8 contexts used in turn on the same weight: each gives its own result, the one a fresh process
    computes with that context alone (no setting leaks from one call into the next)."""
    w = make_weight(ggml_type, 64, 576)
    x = make_x(4, 576)
    exact, q8 = ops.KernelContext(act_precision="f32"), ops.KernelContext(act_precision="q8")
    alone = {kc.act_precision: ops.linear(x, w, kc) for kc in (exact, q8)}
    assert not torch.equal(alone["f32"], alone["q8"])  # they do differ
    for kc in (q8, exact, q8, exact, exact, q8):
        assert torch.equal(ops.linear(x, w, kc), alone[kc.act_precision]), kc.act_precision
        assert torch.equal(ops.linear(x[0], w, kc), alone[kc.act_precision][0]), kc.act_precision
    # a fresh process that starts with q8 (this one started with f32) gives the same bits for both
    out = tmp_path / "out.pt"
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); import test_ops as t; "
        "from powerinfer import ops; from powerinfer.gguf.constants import GGMLType; "
        f"w = t.make_weight(GGMLType({int(ggml_type)}), 64, 576); x = t.make_x(4, 576); "
        "q8 = ops.linear(x, w, ops.KernelContext(act_precision='q8')); "
        "f32 = ops.linear(x, w, ops.KernelContext(act_precision='f32')); torch.save((q8, f32), sys.argv[2])"
    )
    subprocess.run([sys.executable, "-c", code, str(TESTS), str(out)], check=True, timeout=120)
    q8, f32 = torch.load(out)
    assert torch.equal(q8, alone["q8"]) and torch.equal(f32, alone["f32"])


@needs_kernels
@pytest.mark.parametrize("ggml_type", sorted(QUANT_TYPES), ids=lambda t: t.name)
def test_precisions_select_different_kernels(ggml_type):
    # f32 computes on float x (tight bound); q8 rounds x to int8 blocks, visibly further from the reference
    w = make_weight(ggml_type, 64, 576)
    x = make_x(4, 576)
    exact = x.double() @ reference.dense(w).double().T
    scale = x.double().abs() @ reference.dense(w).double().abs().T
    err_f32 = (
        (ops.linear(x, w, ops.KernelContext(act_precision="f32")).double() - exact).abs() / scale
    ).max()
    err_q8 = ((ops.linear(x, w, ops.KernelContext(act_precision="q8")).double() - exact).abs() / scale).max()
    assert err_f32 <= 1e-5 < err_q8


@needs_kernels
@pytest.mark.parametrize("ggml_type", sorted(BLOCK_TYPES), ids=lambda t: t.name)
def test_exact_mode_long_batches_and_shapes(ggml_type, isa):
    # token counts around the tile sizes (4 and 8) and a K that is one block: tiles never change a token's result
    kc = ops.KernelContext(act_precision="f32", isa=isa)
    w = make_weight(ggml_type, 33, 32 * 37)
    dense = reference.dense(w).double()
    x = make_x(29, 32 * 37, seed=3)
    y = ops.linear(x, w, kc)
    exact, scale = x.double() @ dense.T, x.double().abs() @ dense.abs().T
    assert ((y.double() - exact).abs() <= 1e-5 * scale + 1e-30).all()
    for n_tokens in (1, 5, 8, 9, 16):
        assert torch.equal(ops.linear(x[:n_tokens], w, kc), y[:n_tokens]), n_tokens


def attn_case(n_head: int, n_head_kv: int, head_dim: int = 16, n_ctx: int = 40, seed: int = 0):
    """Random RoPE rotations (complex (n_ctx, D/2) and as float pairs) and a random KV cache."""
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(n_ctx, head_dim // 2, generator=gen, dtype=torch.float64) * 6.0
    rot = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)  # (n_ctx, D/2)
    pairs = torch.view_as_real(rot).contiguous()  # (n_ctx, D/2, 2)
    k_cache = torch.randn(n_ctx, n_head_kv, head_dim, generator=gen)
    v_cache = torch.randn(n_ctx, n_head_kv, head_dim, generator=gen)
    return gen, rot, pairs, k_cache, v_cache


def qkv(gen: torch.Generator, n_head: int, n_head_kv: int, head_dim: int = 16):
    q = torch.randn(1, n_head * head_dim, generator=gen) * 3
    k = torch.randn(1, n_head_kv * head_dim, generator=gen)
    v = torch.randn(1, n_head_kv * head_dim, generator=gen)
    return q, k, v


@needs_kernels
@pytest.mark.parametrize(("n_head", "n_head_kv"), [(4, 4), (8, 2), (9, 3), (6, 1)])
def test_attn_decode_equals_the_tensor_ops(n_head, n_head_kv, isa):
    """pi_attn_decode (RoPE, KV write, grouped-query softmax attention of one token) == torch's ops."""
    head_dim, n_ctx = 16, 40
    gen, rot, pairs, k_cache, v_cache = attn_case(n_head, n_head_kv, head_dim, n_ctx)
    scratch = torch.empty(ops.attn_scratch_bytes(n_ctx, n_head), dtype=torch.uint8)  # one buffer, every call
    for pos in (0, 1, 17, n_ctx - 1):
        q, k, v = qkv(gen, n_head, n_head_kv, head_dim)
        kc, vc = k_cache.clone(), v_cache.clone()
        for threads in (1, 2):
            ctx = ops.KernelContext(n_threads=threads, isa=isa)
            got = ops.attn_decode(q, k, v, pairs[pos], kc, vc, pos, ctx, scratch=scratch)
            assert torch.equal(got, ops.attn_decode(q, k, v, pairs[pos], kc.clone(), vc.clone(), pos, ctx))
            qr = ops.apply_rope(q.view(1, n_head, head_dim), rot[pos : pos + 1])
            kr = ops.apply_rope(k.view(1, n_head_kv, head_dim), rot[pos : pos + 1])
            # the complex product in float, possibly not torch's rounding order: within an ulp or two
            torch.testing.assert_close(kc[pos], kr[0], rtol=1e-6, atol=1e-6)
            assert torch.equal(vc[pos], v.view(n_head_kv, head_dim))
            keys, values = kc[: pos + 1].transpose(0, 1), vc[: pos + 1].transpose(0, 1)  # (H_kv, L, D)
            want = F.scaled_dot_product_attention(qr.transpose(0, 1), keys, values, enable_gqa=True)
            torch.testing.assert_close(got, want.transpose(0, 1).reshape(1, -1), rtol=2e-6, atol=2e-6)
        assert torch.equal(kc[pos + 1 :], k_cache[pos + 1 :])  # only row pos written
    assert ops.attn_decode(q, k, v, pairs[0], kc, vc, n_ctx) is None  # a position past the cache: no kernel
    assert ops.attn_decode(q, k, v, pairs[0], kc, vc, 0, ops.KernelContext(enabled=False)) is None


@needs_kernels
@needs_isa("avx512")
def test_attn_decode_avx2_and_avx512_per_call():
    # the same C body compiled for each target (16- or 8-lane reductions): within float32 rounding of each other,
    # each variant reproducing itself when they alternate
    n_head, n_head_kv, n_ctx = 8, 2, 200
    gen, _, pairs, k_cache, v_cache = attn_case(n_head, n_head_kv, 64, n_ctx, seed=1)
    q, k, v = qkv(gen, n_head, n_head_kv, 64)
    avx2, avx512 = ops.KernelContext(isa="avx2"), ops.KernelContext(isa="avx512")
    runs = {}
    for kc in (avx2, avx512, avx2, avx512):
        out = ops.attn_decode(q, k, v, pairs[n_ctx - 1], k_cache.clone(), v_cache.clone(), n_ctx - 1, kc)
        assert kc.isa not in runs or torch.equal(out, runs[kc.isa]), kc.isa
        runs[kc.isa] = out
    torch.testing.assert_close(runs["avx2"], runs["avx512"], rtol=2e-6, atol=2e-6)


@needs_kernels
def test_attn_decode_scratch_too_small():
    n_head, n_head_kv, n_ctx = 4, 2, 40
    gen, _, pairs, k_cache, v_cache = attn_case(n_head, n_head_kv, 16, n_ctx)
    q, k, v = qkv(gen, n_head, n_head_kv)
    need = ops.attn_scratch_bytes(n_ctx, n_head)
    assert need >= n_head * n_ctx * 4
    pos = n_ctx - 1
    for small in (torch.empty(0, dtype=torch.uint8), torch.empty(need - 64 * 2, dtype=torch.uint8)):
        kc = k_cache.clone()
        with pytest.raises(ValueError, match="attn_decode: scratch buffer of .* bytes is too small") as info:
            ops.attn_decode(q, k, v, pairs[pos], kc, v_cache.clone(), pos, scratch=small)
        assert "attn_scratch_bytes" in str(info.value)
        assert torch.equal(kc, k_cache)  # rejected before any write
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        strided = torch.empty(2 * need, dtype=torch.uint8)[::2]
        ops.attn_decode(q, k, v, pairs[pos], k_cache.clone(), v_cache.clone(), pos, scratch=strided)
    # a float32 buffer of the right size in bytes, at an odd offset: the kernel aligns it
    buf = torch.empty(need // 4 + 1, dtype=torch.float32).view(torch.uint8)[1 : need + 1]
    assert (
        ops.attn_decode(q, k, v, pairs[pos], k_cache.clone(), v_cache.clone(), pos, scratch=buf) is not None
    )


def arch_attention_one_token(q, k, v, rot, k_cache, v_cache, pos):
    """What the Llama forward computed for one token before `attend_one` (arch/llama.py at afe7801): RoPE on the
    complex table, the cache write of kv.update, decode_attention."""
    n_ctx, n_head_kv, head_dim = k_cache.shape
    n_head = q.shape[-1] // head_dim
    qr = ops.apply_rope(q.view(1, n_head, head_dim), rot[pos : pos + 1])
    kr = ops.apply_rope(k.view(1, n_head_kv, head_dim), rot[pos : pos + 1])
    k_cache[pos : pos + 1] = kr
    v_cache[pos : pos + 1] = v.view(1, n_head_kv, head_dim)
    return ops.decode_attention(qr, k_cache[: pos + 1], v_cache[: pos + 1])


@pytest.mark.parametrize(("n_head", "n_head_kv"), [(4, 4), (8, 2)])
def test_attend_one_chooses_kernel_or_tensor_ops(n_head, n_head_kv, monkeypatch):
    # the switch point lowered to 256 (the real one is far out, where float32 sums of 65536 terms drift apart)
    monkeypatch.setattr(ops.attention, "ATTN_KERNEL_MAX_POS", 256)
    limit = ops.attention.ATTN_KERNEL_MAX_POS
    n_ctx = limit + 8
    gen, rot, pairs, k_cache, v_cache = attn_case(n_head, n_head_kv, 16, n_ctx)
    q, k, v = qkv(gen, n_head, n_head_kv)
    for pos in (0, 5, limit - 1, limit, n_ctx - 1):
        for kc in (ops.KernelContext(), ops.KernelContext(enabled=False)):
            kc_a, vc_a, kc_b, vc_b = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
            got = ops.attend_one(q, k, v, pairs[pos], kc_a, vc_a, pos, kc)
            assert got.shape == (1, n_head * 16)
            if kc.uses_kernels and pos < limit:  # the kernel, bit for bit
                want = ops.attn_decode(q, k, v, pairs[pos], kc_b, vc_b, pos, kc)
                assert torch.equal(got, want) and torch.equal(kc_a, kc_b) and torch.equal(vc_a, vc_b)
                # and the tensor ops within float32 rounding
                ref = arch_attention_one_token(q, k, v, rot, k_cache.clone(), v_cache.clone(), pos)
                torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)
            else:  # the tensor ops of the Llama forward, bit for bit
                want = arch_attention_one_token(q, k, v, rot, kc_b, vc_b, pos)
                assert torch.equal(got, want) and torch.equal(kc_a, kc_b) and torch.equal(vc_a, vc_b)
