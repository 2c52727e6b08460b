"""CUDA pool: the same sparse FFN with hot rows on a real GPU (skipped without one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_llama_state, random_predictors, write_activation_stats, write_llama_gguf

from powerinfer.gguf import GGMLType
from powerinfer.placement import GPUIndex, write_gpu_index
from powerinfer.runtime.engine import Engine, EngineOptions

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
N_FF = 128
TOKENS = [1, 5, 17, 99, 200, 3, 41, 250]


@pytest.mark.parametrize("dtype", [GGMLType.F16, GGMLType.Q4_0])
def test_cuda_pool_matches_cpu_stand_in(tmp_path, dtype):
    sd = random_llama_state(n_ff=N_FF, seed=1)
    path = write_llama_gguf(
        tmp_path / "m.powerinfer.gguf",
        sd,
        n_head=4,
        n_head_kv=4,
        dtype=dtype,
        act="relu",
        predictors=random_predictors(sd),
    )
    rng = np.random.default_rng(0)
    index = tmp_path / "split.gpuidx"
    neurons = [np.sort(rng.choice(N_FF, 64, replace=False)).astype(np.int32) for _ in range(2)]
    write_gpu_index(index, GPUIndex.from_neurons(neurons, N_FF, 0))
    logits = {}
    for device in ("cpu", "cuda"):
        engine = Engine(
            path, EngineOptions(n_ctx=64, n_threads=2, pool_device=device, gpu_index_path=str(index))
        )
        assert all(f.hot.gate.device.type == device for f in engine.model.ffns)
        logits[device] = engine.logits_all(TOKENS)
    # the CUDA pool keeps fp16 rows: a small rounding difference is expected
    assert (logits["cuda"] - logits["cpu"]).abs().max().item() < 2e-2


def test_cuda_budget_plan(tmp_path):
    sd = random_llama_state(n_ff=N_FF, seed=2)
    path = write_llama_gguf(
        tmp_path / "m.powerinfer.gguf",
        sd,
        n_head=4,
        n_head_kv=4,
        act="relu",
        predictors=random_predictors(sd),
    )
    write_activation_stats(tmp_path / "activation", 2, N_FF)
    engine = Engine(path, EngineOptions(n_ctx=64, n_threads=2, vram_budget_gib=0.01))
    assert engine.pool_device is not None and engine.pool_device.type == "cuda"
    assert engine.placement is not None and engine.placement.total_bytes <= engine.placement.budget_bytes
    before = torch.cuda.memory_allocated()
    assert before <= engine.placement.budget_bytes
    assert engine.logits_all(TOKENS).isfinite().all()
