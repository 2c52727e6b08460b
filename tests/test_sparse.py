"""Sparse FFN: equals the dense path when every neuron is active, and a masked dense reference for any mask,
for every placement (all CPU, all in the pool, split) and weight type."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import random_llama_state, random_predictors, write_activation_stats, write_llama_gguf

from powerinfer import quant
from powerinfer.gguf import GGMLType
from powerinfer.ops.sparse import decode_rows
from powerinfer.placement import GPUIndex, write_gpu_index
from powerinfer.runtime.engine import Engine, EngineOptions

N_HEAD, N_HEAD_KV, N_FF = 4, 2, 128
TOKENS = [5, 17, 99, 200, 3, 41, 250, 8]


def _sparse_file(
    tmp_path: Path, dtype: GGMLType = GGMLType.F32, threshold: float = 0.0, seed: int = 0
) -> Path:
    sd = random_llama_state(n_ff=N_FF, n_head=N_HEAD, n_head_kv=N_HEAD_KV, seed=seed)
    return write_llama_gguf(
        tmp_path / f"m-{dtype.name}.powerinfer.gguf",
        sd,
        n_head=N_HEAD,
        n_head_kv=N_HEAD_KV,
        dtype=dtype,
        act="relu",
        predictors=random_predictors(sd, seed=seed),
        threshold=threshold,
    )


def _index(tmp_path: Path, gpu_neurons: list[np.ndarray], name: str) -> str:
    path = tmp_path / name
    write_gpu_index(path, GPUIndex.from_neurons([np.asarray(g, np.int32) for g in gpu_neurons], N_FF, 0))
    return str(path)


def _placements(tmp_path: Path, n_layer: int = 2) -> dict[str, EngineOptions]:
    rng = np.random.default_rng(7)
    half = [np.sort(rng.choice(N_FF, N_FF // 2, replace=False)) for _ in range(n_layer)]
    base = {"n_ctx": 64, "n_threads": 2, "act_precision": "f32"}
    return {
        "all-cpu": EngineOptions(**base),
        "all-pool": EngineOptions(
            **base,
            pool_device="cpu",
            gpu_index_path=_index(tmp_path, [np.arange(N_FF)] * n_layer, "all.gpuidx"),
        ),
        "split": EngineOptions(
            **base, pool_device="cpu", gpu_index_path=_index(tmp_path, half, "half.gpuidx")
        ),
    }


def test_all_active_equals_dense(tmp_path, monkeypatch):
    """Threshold -inf: every neuron active; logits equal the dense GGUF of the same weights (F32)."""
    sd = random_llama_state(n_ff=N_FF, n_head=N_HEAD, n_head_kv=N_HEAD_KV, seed=3)
    dense = write_llama_gguf(tmp_path / "dense.gguf", sd, n_head=N_HEAD, n_head_kv=N_HEAD_KV, act="relu")
    sparse = write_llama_gguf(
        tmp_path / "m.powerinfer.gguf",
        sd,
        n_head=N_HEAD,
        n_head_kv=N_HEAD_KV,
        act="relu",
        predictors=random_predictors(sd),
        threshold=0.0,
    )
    ref = Engine(dense, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2)).logits_all(TOKENS)
    monkeypatch.setenv("LLAMA_SPARSE_PRED_THRESHOLD", "-inf")
    for name, opts in _placements(tmp_path).items():
        engine = Engine(sparse, opts)
        assert engine.sparse_stats is not None
        diff = (engine.logits_all(TOKENS) - ref).abs().max().item()
        assert diff <= 1e-4, (name, diff)
        assert engine.sparse_stats.active.sum().item() == 2 * len(TOKENS) * N_FF
    # the dense path of the PWRI file (ffn_down_t) agrees too
    forced_dense = Engine(sparse, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2, dense_ffn=True))
    assert (forced_dense.logits_all(TOKENS) - ref).abs().max().item() <= 1e-4


def _masked_reference(ffn, u: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    g = u @ decode_rows(ffn.gate, None).T
    up = u @ decode_rows(ffn.up, None).T
    h = F.relu(g) * (F.relu(up) if ffn.spec.relu_up else up) * active
    return h @ decode_rows(ffn.down_t, None)


def _predictor_reference(ffn, x: torch.Tensor) -> torch.Tensor:
    sel = ffn.selector
    score = F.relu(x @ decode_rows(_host(sel.fc1), None).T) @ decode_rows(_host(sel.fc2), None).T
    return score >= sel.threshold


def _host(w):
    """The blocks of a weight as a QWeight (DeviceWeights on the CPU stand-in hold them too)."""
    from powerinfer import ops

    return w if isinstance(w, ops.QWeight) else ops.QWeight(w.raw.cpu(), w.ggml_type, w.shape)


class _Fixed:
    """A selector that returns a given mask."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def select(self, x: torch.Tensor) -> torch.Tensor:
        return self.mask


def _ffns(engine):
    return [layer.ffn for layer in engine.model.layers]


# exact-mode kernels decode weights to the same floats as the reference; only summation order differs
TOLERANCE = {GGMLType.F32: 1e-5, GGMLType.F16: 1e-5, GGMLType.Q4_0: 1e-5}


@pytest.mark.parametrize("dtype", [GGMLType.F32, GGMLType.F16, GGMLType.Q4_0])
def test_sparse_ffn_equals_masked_reference(tmp_path, dtype):
    path = _sparse_file(tmp_path, dtype)
    gen = torch.Generator().manual_seed(0)
    for name, opts in _placements(tmp_path).items():
        engine = Engine(path, opts)
        for ffn in _ffns(engine):
            for T in (1, 5):
                u = torch.randn(T, 64, generator=gen)
                x = torch.randn(T, 64, generator=gen)
                # the predictor's own mask
                pred = _predictor_reference(ffn, x)
                assert torch.equal(ffn.selector.select(x), pred)
                want = _masked_reference(ffn, u, pred)
                got = ffn(u, x)
                scale = want.abs().max().item() + 1e-6
                assert (got - want).abs().max().item() <= TOLERANCE[dtype] * 10 * scale, (name, T)
                # random masks: 0 %, ~10 %, ~60 %, 100 % active
                ffn.fused_decode = False  # the fused decode kernel runs its own predictor
                selector = ffn.selector
                for p in (0.0, 0.1, 0.6, 1.0):
                    mask = torch.rand(T, N_FF, generator=gen) < p
                    ffn.selector = _Fixed(mask)
                    got = ffn(u, x)
                    want = _masked_reference(ffn, u, mask)
                    assert (got - want).abs().max().item() <= TOLERANCE[dtype] * 10 * (
                        want.abs().max().item() + 1
                    )
                ffn.selector = selector


@pytest.mark.parametrize("dtype", [GGMLType.F32, GGMLType.F16, GGMLType.Q4_0])
def test_placements_give_the_same_logits(tmp_path, dtype):
    path = _sparse_file(tmp_path, dtype)
    logits = {name: Engine(path, opts).logits_all(TOKENS) for name, opts in _placements(tmp_path).items()}
    ref = logits.pop("all-cpu")
    for name, value in logits.items():
        assert (value - ref).abs().max().item() <= 1e-4, name


def test_engine_plans_caches_and_resets_the_gpu_index(tmp_path):
    path = _sparse_file(tmp_path)
    write_activation_stats(tmp_path / "activation", 2, N_FF)
    cache = Path(str(path) + ".generated.gpuidx")
    opts = {"n_ctx": 64, "n_threads": 1, "pool_device": "cpu", "act_precision": "f32"}
    # budget large enough for the dense part and half of the FFN
    small = Engine(path, EngineOptions(**opts, vram_budget_gib=0.00045))
    assert small.placement is not None and small.placement.ffn_source == "solved"
    assert cache.is_file()
    hot = [0 if f.hot is None else f.hot.ids.numel() for f in _ffns(small)]
    assert 0 < sum(hot) < 2 * N_FF and all(h % 32 == 0 for h in hot)
    assert small.placement.total_bytes <= small.placement.budget_bytes
    again = Engine(path, EngineOptions(**opts, vram_budget_gib=0.00045))
    assert again.placement.ffn_source == "cache"
    reset = Engine(path, EngineOptions(**opts, vram_budget_gib=0.00045, reset_gpu_index=True))
    assert reset.placement.ffn_source == "solved"
    other = Engine(path, EngineOptions(**opts, vram_budget_gib=0.01))  # a different budget regenerates
    assert other.placement.ffn_source == "solved"
    assert all(f.hot is not None and f.hot.ids.numel() == N_FF for f in _ffns(other))
    off = Engine(path, EngineOptions(**opts, vram_budget_gib=0.01, disable_gpu_index=True))
    assert all(f.hot is None for f in _ffns(off))
    # same tokens whatever the placement
    ids = [1, 40, 41, 42]
    assert torch.allclose(small.logits_all(ids), off.logits_all(ids), atol=1e-4)


def test_plan_moves_attention_predictors_and_output_to_the_pool(tmp_path):
    """Everything the plan puts on the device runs there (the CPU stands in for it) and logits do not change."""
    from powerinfer import ops

    path = _sparse_file(tmp_path, GGMLType.F16)
    write_activation_stats(tmp_path / "activation", 2, N_FF)
    ref = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2)).logits_all(TOKENS)
    engine = Engine(
        path,
        EngineOptions(act_precision="f32", n_ctx=64, n_threads=2, pool_device="cpu", vram_budget_gib=0.01),
    )
    p = engine.placement
    assert p is not None and p.kv_on_gpu and "output.weight" in p.gpu_tensors
    assert all(isinstance(layer.attn.wq, ops.DeviceWeight) for layer in engine.model.layers)
    assert all(isinstance(f.selector.fc1, ops.DeviceWeight) for f in _ffns(engine))
    assert isinstance(engine.model.head.output, ops.DeviceWeight)
    assert (engine.logits_all(TOKENS) - ref).abs().max().item() <= 1e-4
    # --disable-gpu-index keeps the dense offload and skips only the FFN split
    off = Engine(
        path,
        EngineOptions(
            act_precision="f32",
            n_ctx=64,
            n_threads=2,
            pool_device="cpu",
            vram_budget_gib=0.01,
            disable_gpu_index=True,
        ),
    )
    assert all(f.hot is None for f in _ffns(off))
    assert all(isinstance(layer.attn.wq, ops.DeviceWeight) for layer in off.model.layers)


@pytest.mark.parametrize("dtype", sorted(quant.KERNEL_TYPES), ids=lambda t: t.name)
def test_fused_decode_equals_separate_steps(tmp_path, dtype):
    """pi_predict_ffn (predictor + row selection + FFN in one call) == predict() then rows(), bit for bit."""
    from powerinfer.ops import sparse as sparse_ops

    path = _sparse_file(tmp_path, dtype, threshold=0.05)
    gen = torch.Generator().manual_seed(3)
    for threads in (1, 2):
        engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=threads))
        for ffn in _ffns(engine):
            for _ in range(4):
                u, x = torch.randn(1, 64, generator=gen), torch.randn(1, 64, generator=gen)
                sel = ffn.selector
                fused = sparse_ops.predict_ffn(
                    x,
                    u,
                    sel.fc1,
                    sel.fc2,
                    sel.threshold,
                    ffn.gate,
                    ffn.up,
                    ffn.down_t,
                    "relu",
                    False,
                    engine.kc,
                )
                assert fused is not None
                y, n_active, seconds = fused
                idx = sel.select(x)[0].nonzero().view(-1)
                assert 0 < n_active < N_FF and n_active == idx.numel() and seconds >= 0.0
                assert torch.equal(y, ffn.rows(u, idx))
                # through the layer, with its counters
                before = int(engine.sparse_stats.active.sum())
                ffn.fused_decode = True
                via_layer = ffn(u, x)
                assert int(engine.sparse_stats.active.sum()) - before == n_active
                ffn.fused_decode = False
                assert torch.equal(via_layer, y) and torch.equal(ffn(u, x), y)
    # q8 precision (the CLI's default): the same, on int8 blocks
    engine = Engine(path, EngineOptions(n_ctx=64, n_threads=2, act_precision="q8"))
    ffn = _ffns(engine)[0]
    sel = ffn.selector
    args = (sel.fc1, sel.fc2, sel.threshold, ffn.gate, ffn.up, ffn.down_t, "relu", False)
    u, x = torch.randn(1, 64, generator=gen), torch.randn(1, 64, generator=gen)
    fused = sparse_ops.predict_ffn(x, u, *args, engine.kc)
    assert fused is not None and torch.equal(fused[0], ffn.rows(u, sel.select(x)[0].nonzero().view(-1)))
