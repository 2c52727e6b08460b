"""CUDA pool: the same sparse FFN with hot rows on a real GPU (skipped without one).

The pool keeps the file's blocks on the GPU (repacked row by row, the same bytes) and the Triton kernels
(powerinfer.ops.triton_quant) decode them in registers, summing in float32 like the CPU stand-in's C kernels: the
two agree up to summation order. A token's outputs are the same bits whatever the other tokens of its call."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from conftest import write_activation_stats, write_relu_sparse_model

from powerinfer import ops, quant
from powerinfer.gguf import GGMLType
from powerinfer.ops import sparse as sparse_ops
from powerinfer.ops.encode import quantize  # the K-quants too (C quantizers; the gguf package has none)
from powerinfer.placement import GPUIndex, footprint_from_gguf, write_gpu_index
from powerinfer.runtime.engine import Engine, EngineOptions

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
N_FF = 128
TOKENS = [1, 5, 17, 99, 200, 3, 41, 250]


POOL_TYPES = sorted(quant.POOL_TYPES)  # the types the pool keeps as blocks


def _k_cols(ggml_type: GGMLType, n_cols: int) -> int:
    """A row length the type allows: K-quant rows are whole super-blocks of 256."""
    return max(256, n_cols // 256 * 256) if ggml_type in quant.K_QUANT_TYPES else n_cols


@pytest.mark.parametrize("ggml_type", POOL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("n_rows", "n_cols"), [(4103, 4096), (11008, 64), (37, 2048), (300, 96)])
def test_triton_kernels_equal_the_c_kernels(ggml_type, n_rows, n_cols):
    """y = x @ W.T and y = h @ W on the GPU (packed rows) against the stand-in's C kernels on the same blocks."""
    n_cols = _k_cols(ggml_type, n_cols)
    rng = np.random.default_rng(n_rows)
    w = ops.QWeight.from_numpy(
        quantize(rng.normal(0, 1, (n_rows, n_cols)).astype(np.float32), ggml_type),
        ggml_type,
        (n_rows, n_cols),
    )
    dw = ops.DeviceWeight.from_qweight(w, torch.device("cuda"))
    assert dw.backend == "triton" and dw.raw.is_cuda and dw.n_bytes == w.raw.nbytes
    for T in (1, 3, 17, 64, 200):
        x = torch.randn(T, n_cols)
        want = ops.linear(x, w)
        got = ops.linear(x.cuda(), dw).cpu()
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), ("matmul", T)
        h = torch.randn(T, n_rows) * (torch.rand(T, n_rows) < 0.3)
        want = sparse_ops.rows_axpy(h, w, None)
        got = dw.axpy(h.cuda()).cpu()
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), ("axpy", T)


@pytest.mark.parametrize("dtype", POOL_TYPES, ids=lambda t: t.name)
def test_cuda_pool_matches_cpu_stand_in(tmp_path, dtype):
    path = write_relu_sparse_model(tmp_path / "m.powerinfer.gguf", n_ff=N_FF, seed=1, dtype=dtype)
    rng = np.random.default_rng(0)
    index = tmp_path / "split.gpuidx"
    neurons = [np.sort(rng.choice(N_FF, 64, replace=False)).astype(np.int32) for _ in range(2)]
    write_gpu_index(index, GPUIndex.from_neurons(neurons, N_FF, 0))
    logits, n_bytes = {}, {}
    for device in ("cpu", "cuda"):
        engine = Engine(
            path,
            EngineOptions(
                act_precision="f32", n_ctx=64, n_threads=2, pool_device=device, gpu_index_path=str(index)
            ),
        )
        assert all(f.hot.gate.device.type == device for f in engine.model.ffns)
        assert all(
            f.hot.gate.raw.dtype == torch.uint8 and f.hot.gate.ggml_type == dtype for f in engine.model.ffns
        )
        n_bytes[device] = [f.hot.n_bytes for f in engine.model.ffns]
        # a 16-token prefill (the kernels' tl.dot path), then decode steps (one token, broadcast path)
        logits[device] = torch.cat(
            [engine.logits_all(TOKENS * 2)] + [engine.logits_all([t]) for t in TOKENS[:4]]
        )
    fp = footprint_from_gguf(engine.gguf, 2, N_FF)
    assert n_bytes["cuda"] == n_bytes["cpu"] == [64 * b for b in fp.neuron_bytes]
    # both sum the same decoded floats in float32: only the summation order differs
    assert (logits["cuda"] - logits["cpu"]).abs().max().item() < 1e-3


def test_cuda_budget_plan(tmp_path):
    path = write_relu_sparse_model(tmp_path / "m.powerinfer.gguf", n_ff=N_FF, seed=2)
    write_activation_stats(tmp_path / "activation", 2, N_FF)
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2, vram_budget_gib=0.01))
    assert engine.pool_device is not None and engine.pool_device.type == "cuda"
    assert engine.placement is not None and engine.placement.total_bytes <= engine.placement.budget_bytes
    before = torch.cuda.memory_allocated()
    assert before <= engine.placement.budget_bytes
    hot = [f.hot for f in engine.model.ffns if f.hot is not None]
    assert sum(h.n_bytes for h in hot) == engine.placement.bytes_by_category["ffn"]
    assert engine.logits_all(TOKENS).isfinite().all()


def test_cuda_q4_0_pool_memory_is_the_planned_bytes(tmp_path):
    """All of a Q4_0 model's FFN in the pool: the GPU holds the blocks (18 bytes per 32 weights), not F16."""
    path = write_relu_sparse_model(tmp_path / "m.powerinfer.gguf", n_ff=N_FF, seed=3, dtype=GGMLType.Q4_0)
    index = tmp_path / "all.gpuidx"
    write_gpu_index(index, GPUIndex.from_neurons([np.arange(N_FF, dtype=np.int32)] * 2, N_FF, 0))
    gc.collect()  # earlier tests' engines must not be freed while this one is measured
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = Engine(
        path,
        EngineOptions(
            act_precision="f32", n_ctx=64, n_threads=2, pool_device="cuda", gpu_index_path=str(index)
        ),
    )
    held = torch.cuda.memory_allocated() - before
    planned = 2 * N_FF * footprint_from_gguf(engine.gguf, 2, N_FF).neuron_bytes[0]
    assert planned == 2 * N_FF * 3 * 64 * 18 // 32
    assert sum(f.hot.n_bytes for f in engine.model.ffns) == planned
    # the caching allocator rounds each of the 6 blocks up to 512 bytes at most
    assert planned <= held <= planned + 6 * 512


@pytest.mark.parametrize("ggml_type", POOL_TYPES, ids=lambda t: t.name)
def test_triton_kernels_give_a_token_the_same_bits_in_any_batch(ggml_type):
    """Rows of one call of 64 (or 200) tokens against calls of 1, 3 and 17 tokens: the token tile changes with T
    (8, 16 or 32 tokens; axpy 1, 4 or 8), the bits of a token's row must not (matmul and axpy, split-K both)."""
    n_rows, n_cols = 1000, _k_cols(ggml_type, 4096)
    rng = np.random.default_rng(5)
    w = ops.QWeight.from_numpy(
        quantize(rng.normal(0, 1, (n_rows, n_cols)).astype(np.float32), ggml_type),
        ggml_type,
        (n_rows, n_cols),
    )
    dw = ops.DeviceWeight.from_qweight(w, torch.device("cuda"))
    x = torch.randn(200, n_cols, device="cuda")
    h = torch.randn(200, n_rows, device="cuda") * (torch.rand(200, n_rows, device="cuda") < 0.3)
    y, z = dw.linear(x[:64]), dw.axpy(h[:64])
    y_long, z_long = dw.linear(x), dw.axpy(h)
    assert torch.equal(y_long[:64], y) and torch.equal(z_long[:64], z)
    for T in (1, 3, 17):
        for t0 in (0, 30):
            assert torch.equal(dw.linear(x[t0 : t0 + T]), y[t0 : t0 + T]), ("matmul", T, t0)
            assert torch.equal(dw.axpy(h[t0 : t0 + T]), z[t0 : t0 + T]), ("axpy", T, t0)
    # and the products are right: against float64 on the reference decoding of the same blocks
    dense = (
        torch.from_numpy(quant.dequantize(w.raw.numpy(), ggml_type, (n_rows, n_cols)).copy()).double().cuda()
    )
    for got, want in ((y, x[:64].double() @ dense.T), (z, h[:64].double() @ dense)):
        assert (got.double() - want).abs().max().item() <= 2e-6 * want.abs().max().item()


def test_triton_axpy_of_zero_activations_is_exactly_zero():
    n_rows, n_cols = 512, 4096
    rng = np.random.default_rng(6)
    w = ops.QWeight.from_numpy(
        quantize(rng.normal(0, 1, (n_rows, n_cols)).astype(np.float32), GGMLType.Q4_0),
        GGMLType.Q4_0,
        (n_rows, n_cols),
    )
    dw = ops.DeviceWeight.from_qweight(w, torch.device("cuda"))
    h = torch.randn(5, n_rows, device="cuda")
    h[1] = 0.0
    h[:, 64:200] = 0.0
    z = dw.axpy(h)
    assert torch.equal(z[1], torch.zeros(n_cols, device="cuda"))
    assert torch.equal(z[0], dw.axpy(h[:1])[0])
