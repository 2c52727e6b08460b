"""K-quant (Q2_K..Q6_K) sparse kernels: what the shared parametrisations of tests/test_sparse_ops.py and
tests/test_cats_ops.py do not cover.

- rows_axpy with one-hot activations writes fma(1, w, 0) = w: the decoded rows themselves, which must be
  bit-equal to the gguf package's dequantizer in every SIMD variant (the SIMD super-block decoders of
  kernels/cpu/kquants_x86.h against the reference), whatever the thread count;
- rows whose length is not a whole number of super-blocks are refused by the kernels themselves (PI_ERR_SHAPE
  before any row is read), not only by QWeight;
- the "q8" precision runs the exact kernels for K-quants: the same bits as "f32".
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from test_kquant_kernels import K_TYPES, random_k_blocks
from test_sparse_ops import needs_kernels

from powerinfer import ops
from powerinfer.errors import FormatError
from powerinfer.ops import library, sparse
from powerinfer.quant import dequantize

KQ = list(K_TYPES)


def k_weight(ggml_type, n_rows: int, n_cols: int, seed: int = 0) -> tuple[np.ndarray, ops.QWeight]:
    raw = random_k_blocks(ggml_type, n_rows, n_cols, seed)
    return raw, ops.QWeight.from_numpy(raw, ggml_type, (n_rows, n_cols))


@needs_kernels
@pytest.mark.parametrize("ggml_type", KQ, ids=lambda t: t.name)
def test_rows_axpy_one_hot_gives_the_reference_rows(ggml_type, isa):
    n_rows, n_cols = 24, 1024
    raw, w = k_weight(ggml_type, n_rows, n_cols, seed=int(ggml_type))
    # the sum starts from +0: fma(1, w, +0) is w except that -0 becomes +0
    expected = dequantize(raw, ggml_type, (n_rows, n_cols)).astype(np.float32) + np.float32(0.0)
    assert np.isfinite(expected).all() and (expected != 0).any()
    idx = torch.tensor([7, 0, 23, 7, 12], dtype=torch.int64)
    h = torch.zeros(idx.numel(), idx.numel())
    h[torch.arange(idx.numel()), torch.arange(idx.numel())] = 1.0  # token t selects row idx[t]
    for n_threads in (1, 2):
        kc = ops.KernelContext(n_threads=n_threads, isa=isa)
        y = sparse.rows_axpy(h, w, idx, kc)  # T > 1: the tiled path
        assert np.array_equal(y.numpy().view(np.uint32), expected[idx.numpy()].view(np.uint32))
        for t in range(idx.numel()):  # T = 1: the listed-rows path
            y1 = sparse.rows_axpy(h[t], w, idx, kc)
            assert np.array_equal(y1.numpy().view(np.uint32), expected[idx[t]].view(np.uint32)), t


@needs_kernels
@pytest.mark.parametrize("ggml_type", KQ, ids=lambda t: t.name)
def test_q8_precision_runs_the_exact_kernels(ggml_type):
    f32, q8 = ops.KernelContext(), ops.KernelContext(act_precision="q8")
    assert q8.kernels.rows_matmul[ggml_type] is f32.kernels.rows_matmul[ggml_type]
    _, gate = k_weight(ggml_type, 64, 512, 1)
    _, up = k_weight(ggml_type, 64, 512, 2)
    _, down_t = k_weight(ggml_type, 64, 256, 3)
    u = torch.randn(512)
    idx = torch.tensor([3, 9, 10, 40, 63])
    assert torch.equal(
        sparse.ffn_rows(u, gate, up, down_t, idx, "silu", False, q8),
        sparse.ffn_rows(u, gate, up, down_t, idx, "silu", False, f32),
    )
    y_q8, n_q8, _ = ops.cats_ffn(u, gate, up, down_t, None, 0.01, "silu", False, q8)
    y_f32, n_f32, _ = ops.cats_ffn(u, gate, up, down_t, None, 0.01, "silu", False, f32)
    assert n_q8 == n_f32 and torch.equal(y_q8, y_f32)


@needs_kernels
@pytest.mark.parametrize("ggml_type", KQ, ids=lambda t: t.name)
def test_partial_super_blocks_are_refused_by_the_kernels(ggml_type):
    """Row lengths of 288 (a multiple of 32, not of 256) through the ctypes symbols: PI_ERR_SHAPE (1) from every
    kernel, with buffers large enough that a kernel reading past the check would still not fault."""
    lib = library.load()
    block_bytes = K_TYPES[ggml_type][0]
    n_rows, bad = 8, 288
    big = np.zeros(n_rows * 4 * block_bytes, dtype=np.uint8)  # 4 super-blocks per row of room
    stride = 4 * block_bytes
    floats = np.zeros(4096, dtype=np.float32)
    out = np.zeros(4096, dtype=np.float32)
    idx = np.array([1, 5], dtype=np.int64)
    w, x, y, ids = big.ctypes.data, floats.ctypes.data, out.ctypes.data, idx.ctypes.data
    for T in (1, 3):
        assert lib.rows_matmul_f[ggml_type](w, stride, n_rows, bad, ids, 2, x, bad, T, y, 2, 1, 1) == 1
        assert lib.rows_axpy[ggml_type](w, stride, n_rows, bad, ids, 2, x, 2, T, y, bad, 0, 0.0, 1, 1) == 1
    kind = library.FFN_KINDS[ggml_type]
    scratch = np.zeros(1 << 16, dtype=np.uint8)
    s = scratch.ctypes.data
    for k, d in ((bad, 256), (256, bad)):  # gate/up rows, then down_t rows, of a partial super-block
        args = (x, k, d, n_rows, w, stride, kind, w, stride, kind, w, stride, kind, ids, 2, 0, 0, 0, y, s)
        assert lib.ffn_rows(*args, scratch.nbytes, 1, 1) == 1
        n_active, n_up = ctypes.c_int64(), ctypes.c_int64()
        thresholds, active = np.zeros(n_rows, dtype=np.float32), np.zeros(n_rows, dtype=np.int64)
        cats = (x, k, d, n_rows, w, stride, kind, w, stride, kind, w, stride, kind, ids, 2)
        cats += (thresholds.ctypes.data, None, 0, 0, 0, active.ctypes.data, ctypes.byref(n_active))
        assert lib.cats_ffn(*cats, ctypes.byref(n_up), y, s, scratch.nbytes, 1, 1) == 1
    # QWeight refuses such a shape before any kernel sees it
    with pytest.raises(FormatError, match="block size 256"):
        ops.QWeight.from_numpy(big[: n_rows * block_bytes], ggml_type, (n_rows, bad))
