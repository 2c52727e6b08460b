"""Every placement decodes, not only prefills, and gives the all-CPU logits: the CPU stand-in pool (the same step
code a CUDA pool runs) under -ngl for PWRI files run dense, and under VRAM budgets for sparse ones; the layers left
on the CPU keep their fused blocks and chain into decode stacks whatever the other layers do."""

from __future__ import annotations

import pytest
import torch
from conftest import random_llama_state, write_llama_gguf, write_relu_sparse_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from powerinfer import ops
from powerinfer.device.span import DeviceSpan
from powerinfer.gguf import GGMLType
from powerinfer.runtime.engine import Engine, EngineOptions

TOKENS = [1, 17, 42, 99, 3, 250, 7, 64]
N_LAYER = 2  # write_relu_sparse_model's


def _opts(**kw) -> EngineOptions:
    return EngineOptions(act_precision="f32", n_ctx=64, n_threads=2, **kw)


def _prefill_decode(engine: Engine) -> torch.Tensor:
    """Logits of a prompt's tokens then of four decoded tokens, (len(TOKENS) + 4, n_vocab)."""
    rows = [engine.logits_all(TOKENS[:4])]
    for t in TOKENS[4:]:
        rows.append(engine.eval([t])[None])
    return torch.cat(rows)


@pytest.fixture(scope="module")
def sparse_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("placed")
    return write_relu_sparse_model(
        d / "relu.powerinfer.gguf", n_ff=256, seed=3, ffn_dtype=GGMLType.Q4_0, stats=True
    )


@pytest.mark.parametrize("n_gpu_layers", [1, N_LAYER, N_LAYER + 1])
def test_dense_ffn_of_a_pwri_file_under_ngl(sparse_file, n_gpu_layers):
    """The dense-FFN engine (perplexity --kl-divergence's reference, profile) on a PWRI file with -ngl: the down
    projection's transposed rows on the device go through the device weight's own product (was a crash)."""
    ref = _prefill_decode(Engine(sparse_file, _opts(dense_ffn=True)))
    engine = Engine(sparse_file, _opts(dense_ffn=True, pool_device="cpu", n_gpu_layers=n_gpu_layers))
    assert isinstance(engine.model.layers[-1].ffn.down_t, ops.DeviceWeight)
    got = _prefill_decode(engine)
    # measured: identical (the stand-in runs the same C kernels on the copied blocks)
    assert (got - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()


# nothing; a predictor only (the KV cache does not fit: the attention stays); attention, KV and 352 of 512 neurons;
# everything; attention and KV with no neuron (--disable-gpu-index: hybrid layers whose FFN is all on the CPU)
@pytest.mark.parametrize(
    "budget, no_index", [(0.0, False), (2e-4, False), (4e-4, False), (1.0, False), (1.0, True)]
)
def test_sparse_file_decodes_under_every_budget(sparse_file, budget, no_index):
    """Nothing, some and every neuron (and the attention) in the stand-in pool: the CPU's logits, prompt and
    decode; with nothing pooled the layers chain into one decode stack, as without a pool."""
    cpu = Engine(sparse_file, _opts())
    ref = _prefill_decode(cpu)
    engine = Engine(
        sparse_file,
        _opts(pool_device="cpu", vram_budget_gib=budget, disable_gpu_index=no_index, reset_gpu_index=True),
    )
    pooled = engine.loader.device_bytes
    assert (pooled == 0) == (budget == 0.0)
    got = _prefill_decode(engine)
    # measured: <= 3.5e-7 of the largest logit (seeds 3 and 4; hot and cold parts summed apart, then added; the
    # resident layers' attention in the span's order)
    assert (got - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()
    spans = engine.model.spans_for(engine.kv, 0)
    if budget == 0.0:
        assert isinstance(engine.model.stack_for(engine.kv, 0), ops.DecodeStack)
    plan = engine.loader.plan
    for start, stop, span in spans:
        for bid in range(start, stop):
            layer = engine.model.layers[bid]
            on_device = (
                plan.pool_neurons(bid) is not None
                or bid in plan.kv_layers
                or isinstance(layer.ffn.selector.fc1, ops.DeviceWeight)
            )
            if not on_device:
                assert isinstance(span, ops.DecodeStack) and layer.fused_attn is not None, (budget, bid)
                continue
            # attention on the device with its predictor: the layer is resident (hybrid FFN), else op by op
            resident = bid in plan.kv_layers and isinstance(layer.ffn.selector.fc1, ops.DeviceWeight)
            assert isinstance(span, DeviceSpan) == resident, (budget, bid)
    # every token counted once per layer, the same active neurons as on the CPU, the pool's share where it served
    s, c = engine.sparse_stats, cpu.sparse_stats
    assert (s.tokens == len(TOKENS)).all() and (s.active == c.active).all()
    if budget == 4e-4:
        assert 0 < s.active_gpu.sum() < s.active.sum()
    if budget == 1.0 and not no_index:  # every neuron pooled
        assert (s.active_gpu == s.active).all()


@pytest.mark.parametrize("n_gpu_layers", [1, N_LAYER, N_LAYER + 1])
def test_cpu_stack_and_device_span_side_by_side(tmp_path, n_gpu_layers):
    """-ngl of a 2-layer dense file: the CPU layers decode through their fused blocks as a stack, the device
    layers as one device span (the residual stays on the device, attention at a device-side position over the
    whole cache); prompt and decode give the all-CPU logits."""
    sd = random_llama_state(n_ff=128, seed=5, n_head_kv=2)  # grouped-query attention
    path = write_llama_gguf(tmp_path / "dense.gguf", sd, n_head=4, n_head_kv=2)
    ref = _prefill_decode(Engine(path, _opts()))
    engine = Engine(path, _opts(pool_device="cpu", n_gpu_layers=n_gpu_layers))
    got = _prefill_decode(engine)
    # measured: <= 3.8e-7 of the largest logit (seeds 5-7, 4/2/1 KV heads; the span's attention sums in another
    # order than the CPU kernel)
    assert (got - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()
    kinds = [(a, b, type(s).__name__) for a, b, s in engine.model.spans_for(engine.kv, 0)]
    n_cpu = N_LAYER - min(n_gpu_layers, N_LAYER)
    want = ([(0, n_cpu, "DecodeStack")] if n_cpu else []) + [(n_cpu, N_LAYER, "DeviceSpan")]
    assert kinds == want


def test_device_span_attention_masks_the_rest_of_the_cache(tmp_path):
    """The span reads every row of its KV cache: rows past the position are masked, whatever they hold (the
    device caches start zeroed; rows left by a longer earlier sequence are finite and must not count)."""
    sd = random_llama_state(n_ff=128, seed=6)
    path = write_llama_gguf(tmp_path / "dense.gguf", sd, n_head=4, n_head_kv=4)
    cpu = Engine(path, _opts())
    engine = Engine(path, _opts(pool_device="cpu", n_gpu_layers=N_LAYER))
    assert all(bool((engine.kv.layer_view(b).k == 0).all()) for b in range(N_LAYER))
    _prefill_decode(engine)  # a sequence of 8 tokens leaves rows 0..7 written
    engine.reset()
    want = cpu.logits_all(TOKENS[:2])
    got = torch.cat([engine.eval([TOKENS[0]])[None], engine.eval([TOKENS[1]])[None]])
    assert (got - want).abs().max().item() <= 2e-6 * want.abs().max().item()


def test_the_plan_budgets_the_kv_cache_of_every_sequence(sparse_file):
    """The engine allocates a KV cache per sequence: the pool's plan budgets n_seq of them (was one)."""
    one = Engine(sparse_file, _opts(pool_device="cpu", vram_budget_gib=1.0, reset_gpu_index=True))
    three = Engine(sparse_file, _opts(pool_device="cpu", vram_budget_gib=1.0, n_seq=3, reset_gpu_index=True))
    kv1, kv3 = (e.placement.bytes_by_category["kv"] for e in (one, three))
    assert kv1 > 0 and kv3 == 3 * kv1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("n_gpu_layers", [1, N_LAYER + 1])
def test_device_span_on_cuda_decodes_the_cpu_logits(tmp_path, n_gpu_layers):
    """On CUDA the span is a captured graph replayed per token: prompt and decode give the CPU's logits, and a
    second sequence after a reset replays the same graph over the rewritten cache."""
    sd = random_llama_state(n_ff=128, seed=5, n_head_kv=2)
    path = write_llama_gguf(tmp_path / "dense.gguf", sd, n_head=4, n_head_kv=2, dtype=GGMLType.Q8_0)
    ref = _prefill_decode(Engine(path, _opts()))
    engine = Engine(path, _opts(pool_device="cuda", n_gpu_layers=n_gpu_layers))
    for _ in range(2):
        engine.reset()
        got = _prefill_decode(engine)
        # f32 on both sides, summed in other orders: bounded as the -ngl prefill test on CUDA bounds it
        assert (got - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
    spans = engine.model.spans_for(engine.kv, 0)
    assert spans[-1][2].captured  # captured, not run op by op


def test_attention_stays_on_the_cpu_when_its_kv_cache_was_not_budgeted(sparse_file):
    """A plan whose KV cache does not fit keeps every layer's attention on the CPU: attention on the device reads
    its cache there, which the budget would not hold (the loader used to move both)."""
    engine = Engine(sparse_file, _opts(pool_device="cpu", vram_budget_gib=2e-4, reset_gpu_index=True))
    assert not engine.placement.kv_on_gpu and not engine.plan.kv_layers
    assert not any(isinstance(layer.attn.wq, ops.DeviceWeight) for layer in engine.model.layers)
    assert engine.loader.device_bytes <= engine.placement.budget_bytes


# every placement of the stand-in pool: CPU stacks, -ngl device spans, hybrid spans (hot + cold, cold only, all hot)
PLACEMENTS = {
    "ngl-1": ("dense", dict(n_gpu_layers=1)),
    "ngl-all": ("dense", dict(n_gpu_layers=N_LAYER + 1)),
    "hybrid": ("sparse", dict(vram_budget_gib=4e-4)),
    "hybrid-cold": ("sparse", dict(vram_budget_gib=1.0, disable_gpu_index=True)),
    "all-pooled": ("sparse", dict(vram_budget_gib=1.0)),
}


@pytest.fixture(scope="module")
def placed_engines(sparse_file, tmp_path_factory):
    dense = write_llama_gguf(
        tmp_path_factory.mktemp("dense") / "dense.gguf",
        random_llama_state(n_ff=128, seed=5, n_head_kv=2),
        n_head=4,
        n_head_kv=2,
    )
    files = {"dense": dense, "sparse": sparse_file}
    engines = {}
    for name, (kind, kw) in PLACEMENTS.items():
        o = EngineOptions(
            act_precision="q8", n_ctx=64, n_threads=2, pool_device="cpu", reset_gpu_index=True, **kw
        )
        engines[name] = Engine(files[kind], o)
    return engines


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    placement=st.sampled_from(sorted(PLACEMENTS)),
    cuts=st.lists(st.integers(min_value=1, max_value=len(TOKENS) - 1), max_size=4, unique=True),
)
def test_placed_logits_do_not_depend_on_how_a_token_arrives(placed_engines, placement, cuts):
    """A token's logits are the same bits whether it came in one prompt, in chunks or one decode step at a time
    (the device spans' decode and the op-by-op prompts of the placed layers compute alike on the stand-in)."""
    engine = placed_engines[placement]
    engine.reset()
    want = engine.logits_all(TOKENS)
    engine.reset()
    bounds = [0, *sorted(cuts), len(TOKENS)]
    got = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        chunk = TOKENS[a:b]
        got.append(engine.eval(chunk)[None] if len(chunk) == 1 else engine.logits_all(chunk))
    assert torch.equal(torch.cat(got), want)


@pytest.mark.parametrize("n_head_kv, neox", [(4, False), (2, True), (1, False)])
def test_masked_attention_is_the_one_token_kernel(n_head_kv, neox):
    """The CUDA span's attention (over the whole cache at a device-side position, later rows masked; run here on
    CPU tensors) against the CPU's one-token kernel, with rows past the position holding junk."""
    from powerinfer.device.span import masked_attention
    from powerinfer.model.blocks import Rope
    from powerinfer.model.specs import AttentionSpec, RopeSpec

    g = torch.Generator().manual_seed(n_head_kv)
    H, D, n_ctx = 4, 16, 32
    spec = AttentionSpec(n_head=H, n_head_kv=n_head_kv, head_dim=D)
    pairs = Rope(RopeSpec(kind="neox" if neox else "adjacent", n_rot=D), n_ctx).pairs
    k_cache = torch.randn(n_ctx, n_head_kv, D, generator=g)
    v_cache = torch.randn(n_ctx, n_head_kv, D, generator=g)
    for pos in (0, 5, n_ctx - 1):
        q = torch.randn(1, H * D, generator=g)
        k, v = torch.randn(2, 1, n_head_kv * D, generator=g)
        kc, vc = k_cache.clone(), v_cache.clone()
        want = ops.attend_one(q, k, v, pairs[pos], kc, vc, pos, neox=neox)
        kd, vd = k_cache.clone(), v_cache.clone()
        rows = torch.arange(n_ctx)
        one = torch.tensor([0])  # a stack of one sequence, as a one-sequence span holds it
        got = masked_attention(q, k, v, kd[None], vd[None], pairs, one, torch.tensor([pos]), rows, spec, neox)
        # measured: <= 4.8e-7 absolute over 20 seeds (outputs of order 1); the key rows written within 2.4e-7
        assert (got - want).abs().max().item() <= 2e-6
        assert torch.allclose(kd[pos], kc[pos], rtol=1e-6, atol=1e-6) and torch.equal(vd, vc)
