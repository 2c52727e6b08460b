"""Fused decode blocks (kernels/cpu/layer.c): one kernel call per attention block and per dense FFN block of a
token must give the bits of the same layer run op by op, in both activation precisions, at any thread count, for
every weight type the kernels read; plus the RMSNorm and gating kernels against torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import random_llama_state, random_predictors, write_llama_gguf

from powerinfer import ops
from powerinfer.gguf.constants import GGMLType
from powerinfer.quantize import QuantizeOptions, quantize_model, require_file_type
from powerinfer.runtime.engine import Engine, EngineOptions

needs_kernels = pytest.mark.skipif(not ops.kernels_available(), reason="C kernels not built")

PROMPT = [5, 9, 14, 3]
DECODE = [7, 11, 4, 20, 6, 8]


def decode_logits(engine: Engine) -> torch.Tensor:
    engine.reset()
    engine.eval(PROMPT)
    return torch.stack([engine.eval([t]).clone() for t in DECODE])


def fused_and_op_by_op(engine: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode logits with the fused blocks, then with every layer op by op (the fusion switched off)."""
    fused = decode_logits(engine)
    for layer in engine.model.layers:
        layer.fused_attn = layer.fused_ffn = None
    return fused, decode_logits(engine)


@pytest.fixture(scope="module")
def mixed_files(tmp_path_factory) -> dict[str, Path]:
    """A 256-wide Llama (GQA 8:2, 2 layers) as F32, and quantized to mixes covering every kind the fused kernels
    read: Q4_K_M (Q4_K, Q6_K), Q3_K_M (Q3_K, Q4_K, Q5_K), Q2_K (Q2_K, Q3_K, Q4_K), Q5_1, Q4_0, Q4_1, Q8_0, Q5_0,
    F16, BF16."""
    folder = tmp_path_factory.mktemp("fused")
    sd = random_llama_state(n_embd=256, n_ff=512, n_head=8, n_head_kv=2, seed=3)
    f32 = write_llama_gguf(folder / "f32.gguf", sd, n_head=8, n_head_kv=2)
    files = {"F32": f32}
    for name in ("Q4_K_M", "Q3_K_M", "Q2_K", "Q5_1", "Q4_0", "Q4_1", "Q8_0", "Q5_0", "F16", "BF16"):
        out = folder / f"{name}.gguf"
        quantize_model(QuantizeOptions(f32, out, require_file_type(name), allow_requantize=True))
        files[name] = out
    return files


@needs_kernels
@pytest.mark.parametrize(
    "name", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "Q4_K_M"]
)
def test_fused_blocks_equal_op_by_op(mixed_files, name, act):
    """Logits of 6 decode steps: the fused blocks == the same layers op by op, bit for bit (1 and 2 threads)."""
    for threads in (1, 2):
        engine = Engine(mixed_files[name], EngineOptions(n_ctx=32, n_threads=threads, act_precision=act))
        assert all(
            layer.fused_attn is not None and layer.fused_ffn is not None for layer in engine.model.layers
        )
        fused, op_by_op = fused_and_op_by_op(engine)
        assert torch.equal(fused, op_by_op), (name, act, threads)
        assert fused.abs().max() > 0


@needs_kernels
@pytest.mark.parametrize("name", ["F32", "Q4_0", "Q4_K_M"])
def test_decode_stack_equals_blocks_one_by_one(mixed_files, name, act):
    """Every layer of a decode token in one kernel call (ops.decode_stack) gives the bits of the fused blocks
    called one by one from Python (1 and 2 threads); a layer whose fused blocks change is not chained stale."""
    for threads in (1, 2):
        engine = Engine(mixed_files[name], EngineOptions(n_ctx=32, n_threads=threads, act_precision=act))
        model = engine.model
        assert isinstance(model.stack_for(engine.kv, 0), ops.DecodeStack)
        stacked = decode_logits(engine)
        model.stack_decode = False
        assert model.stack_for(engine.kv, 0) is None
        assert torch.equal(stacked, decode_logits(engine)), (name, act, threads)
        model.stack_decode = True
        model.layers[1].fused_ffn = None  # that layer's FFN op by op: no stack
        assert model.stack_for(engine.kv, 0) is None
        assert torch.equal(stacked, decode_logits(engine))


@needs_kernels
def test_fused_blocks_thread_count_independent(mixed_files, act):
    runs = [
        decode_logits(Engine(mixed_files["Q4_K_M"], EngineOptions(n_ctx=32, n_threads=t, act_precision=act)))
        for t in (1, 2, 3)
    ]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


@needs_kernels
@pytest.mark.parametrize("name", ["F32", "Q4_0"])
def test_sparse_layers_fuse_whole_blocks(tmp_path, name, act):
    """A PowerInfer file: attention blocks and predicted sparse FFN blocks (norm, predictor, rows, residual add) each
    one kernel call; the same logits, and the same per-layer token and active-neuron counts, as op by op."""
    sd = random_llama_state(n_embd=64, n_ff=128, n_head=4, n_head_kv=2, seed=5)
    path = write_llama_gguf(
        tmp_path / "sparse.powerinfer.gguf",
        sd,
        n_head=4,
        n_head_kv=2,
        predictors=random_predictors(sd),
        act="relu",
    )
    if name != "F32":
        out = tmp_path / f"sparse.{name}.powerinfer.gguf"
        quantize_model(QuantizeOptions(path, out, require_file_type(name), allow_requantize=True))
        path = out
    engine = Engine(path, EngineOptions(n_ctx=32, n_threads=2, act_precision=act))
    assert all(layer.fused_attn is not None and layer.fused_ffn is not None for layer in engine.model.layers)
    assert isinstance(engine.model.stack_for(engine.kv, 0), ops.DecodeStack)  # the layers chained in one call
    stats = engine.sparse_stats
    assert stats is not None and stats.predictor_s is not None
    fused = decode_logits(engine)
    counts = (stats.tokens.copy(), stats.active.copy())
    assert stats.predictor_s.sum() > 0 and counts[1].sum() > 0
    stats.tokens[:] = 0
    stats.active[:] = 0
    fused_again, op_by_op = fused_and_op_by_op(engine)
    assert torch.equal(fused, fused_again) and torch.equal(fused, op_by_op)
    # the fused run's counts (one decode pass) are half of the two passes just made (fused, then op by op)
    assert (stats.tokens == 2 * counts[0]).all() and (stats.active == 2 * counts[1]).all()


@needs_kernels
def test_fused_blocks_at_long_positions(tmp_path):
    """300 positions (several 64-row value blocks and a tail of the 8-position score blocks): still the op-by-op
    bits."""
    sd = random_llama_state(n_embd=64, n_ff=128, n_head=4, n_head_kv=2, seed=6)
    path = write_llama_gguf(tmp_path / "long.gguf", sd, n_head=4, n_head_kv=2, n_ctx=320)
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=320, n_threads=2))
    prompt = [(7 * i) % 28 + 3 for i in range(293)]
    engine.eval(prompt)
    fused = torch.stack([engine.eval([t]).clone() for t in DECODE])
    for layer in engine.model.layers:
        layer.fused_attn = layer.fused_ffn = None
    engine.reset()
    engine.eval(prompt)
    op_by_op = torch.stack([engine.eval([t]).clone() for t in DECODE])
    assert torch.equal(fused, op_by_op)


@needs_kernels
def test_rms_norm_kernel_matches_torch():
    # measured: 2.2e-7 relative per element (ours rounds once; torch's float arithmetic two or three times)
    gen = torch.Generator().manual_seed(0)
    for shape in ((1, 576), (7, 64), (3, 4, 48)):
        x = torch.randn(*shape, generator=gen) * 3
        w = torch.rand(shape[-1], generator=gen) + 0.5
        got = ops.rms_norm(x, w, 1e-5)
        want = F.rms_norm(x, (shape[-1],), w, 1e-5)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ops.rms_norm(x, None, 1e-6), F.rms_norm(x, (shape[-1],), None, 1e-6))
        # a strided view is read correctly
        xt = torch.randn(shape[-1], 5, generator=gen).T
        torch.testing.assert_close(ops.rms_norm(xt, w, 1e-5), F.rms_norm(xt, (shape[-1],), w, 1e-5))


@needs_kernels
def test_gated_kernel_matches_torch():
    gen = torch.Generator().manual_seed(1)
    g, u = torch.randn(4, 300, generator=gen) * 4, torch.randn(4, 300, generator=gen)
    for act in ops.ACTIVATIONS:
        for relu_up in (False, True):
            got, want = ops.gated(g, u, act, relu_up), ops.gated_ref(g, u, act, relu_up)
            if act == "relu":
                assert torch.equal(got, want)
                continue
            # libm vs torch's vectorised activation: |act_kernel(g) - act_torch(g)| <= 1e-6 |g| (test_sparse_ops'
            # ACT_TOL: measured 1e-7 .. 2.9e-7 |g|), times |up|; gelu near -5.5 cancels differently
            up = torch.relu(u) if relu_up else u
            assert ((got - want).abs() <= 1e-6 * g.abs() * up.abs() + 1e-30).all(), (act, relu_up)


@needs_kernels
def test_fused_block_rejects_mismatched_buffers(mixed_files):
    engine = Engine(mixed_files["Q4_0"], EngineOptions(act_precision="f32", n_ctx=32, n_threads=1))
    layer = engine.model.layers[0]
    k_cache, v_cache = engine.kv.layer_view(0).slot(0)
    scratch = layer.attn.workspace.get("attn_block")
    pairs = layer.attn.rope.pairs
    x = torch.zeros(1, 256)
    with pytest.raises(ValueError, match="attn_block"):
        layer.fused_attn(torch.zeros(1, 128), k_cache, v_cache, 0, pairs, scratch)
    with pytest.raises(ValueError, match="attn_block"):
        layer.fused_attn(x, k_cache, v_cache, 32, pairs, scratch)  # past the cache
    with pytest.raises(ValueError, match="scratch buffer of 16 bytes is too small"):
        layer.fused_attn(x, k_cache, v_cache, 0, pairs, torch.empty(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="ffn_block"):
        layer.fused_ffn(torch.zeros(1, 255), layer.attn.workspace.get("ffn_block"))
    # a weight the kernels cannot read (a device weight, an unknown kind) is no fused block: None, not an error
    assert (
        ops.ffn_block(torch.ones(4), 1e-5, layer.ffn.gate, layer.ffn.up, layer.ffn.gate, "silu", False)
        is None
    )
    assert GGMLType.Q4_0 in ops.default_context().kernels.ffn_kinds


@needs_kernels
@pytest.mark.parametrize("name", ["F32", "Q4_0", "Q4_K_M"])
def test_logits_do_not_depend_on_the_batch_split(mixed_files, name, act):
    """A prompt evaluated whole, in pieces, or token by token: the last token's logits bit for bit (the prompt
    attention computes each token as the one-token kernel does, every other op is per token), at 1 and 2 threads.
    Before the prompt attention kernel, torch's SDPA gave ~1e-5 differences, which int8 activations amplified to
    logit differences of up to 1.2 on SmolLM2 (enough to change greedy replies between interactive turns)."""
    prompt = [(5 * i) % 29 + 3 for i in range(21)]
    for threads in (1, 2):
        engine = Engine(mixed_files[name], EngineOptions(n_ctx=32, n_threads=threads, act_precision=act))
        whole = engine.eval(prompt)[-1].clone()
        for cuts in ((7,), (3, 11, 20), tuple(range(1, 21))):
            engine.reset()
            bounds = (0, *cuts, len(prompt))
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                last = engine.eval(prompt[lo:hi])[-1].clone()
            assert torch.equal(whole, last), (name, act, threads, cuts)


@needs_kernels
@pytest.mark.parametrize(
    "name", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "Q4_K_M"]
)
def test_a_few_tokens_through_the_stack_equal_each_token_alone(mixed_files, name, act):
    """A speculative step's few tokens of one sequence go through the decode stack in one call
    (DecodeStack.tokens: the products over all of them, attention and norms per token): every token's logits are
    the bits of the same tokens decoded one at a time, at 1 and 2 threads, for runs of 2, 5 and 17 tokens, after
    a prompt, with the f32 cache and a q8_0 one."""
    for threads, cache in ((1, "f32"), (2, "f32"), (2, "q8_0")):
        engine = Engine(
            mixed_files[name],
            EngineOptions(
                n_ctx=32, n_threads=threads, act_precision=act, cache_type_k=cache, cache_type_v=cache
            ),
        )
        stack = engine.model.stack_for(engine.kv, 0)
        assert stack is not None and stack.takes_tokens
        for n in (2, 5, 17):
            run = [(3 * i + n) % 29 + 2 for i in range(n)]
            engine.reset()
            engine.eval(PROMPT)
            start = len(PROMPT)
            together = engine.step([0] * n, run, list(range(start, start + n)), all_logits=True).clone()
            engine.keep(0, start)
            alone = torch.stack([engine.step([0], [t], [start + i])[0] for i, t in enumerate(run)])
            assert torch.equal(together, alone), (name, act, threads, cache, n)
            assert together.abs().max() > 0
