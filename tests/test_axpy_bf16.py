"""Q4_0 down rows in the q8 precision (kernels/cpu/sparse.h, axpy_coef_bf16): y += c * (q - 8) per element, rows
in order in each of the AXPY_CHAINS chains (axpy_chains), c = bfloat16(h * d) rounded to nearest even. The product is exact in float, so the chain is defined to
the bit; the oracle below computes it in torch one row at a time (float32 adds of exact products) and every
SIMD variant (vdpbf16ps pairs on AVX512-BF16 CPUs, float FMAs elsewhere), the tiled T > 1 path and every thread
count must give exactly its bits. The f32 precision keeps the float chain of the other types."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from test_sparse_ops import available_isas, needs_kernels

from powerinfer import ops
from powerinfer.gguf.constants import GGMLType
from powerinfer.ops import library, sparse
from powerinfer.quant import quantize


def q4_0_parts(raw: np.ndarray, n_rows: int, n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q - 8) as float32 (n_rows, n_cols) and d as float32 (n_rows, n_cols / 32) of a Q4_0 matrix."""
    blocks = raw.reshape(n_rows, n_cols // 32, 18)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32) - 8.0  # elements 0..15, then 16..31
    return torch.from_numpy(q.reshape(n_rows, n_cols)), torch.from_numpy(d)


def random_q4_0(n_rows: int, n_cols: int, seed: int) -> tuple[ops.QWeight, torch.Tensor, torch.Tensor]:
    """A random Q4_0 matrix, its (q - 8) and its d."""
    rng = np.random.default_rng(seed)
    raw = quantize(rng.standard_normal((n_rows, n_cols)).astype(np.float32), GGMLType.Q4_0)
    return ops.QWeight.from_numpy(raw, GGMLType.Q4_0, (n_rows, n_cols)), *q4_0_parts(raw, n_rows, n_cols)


AXPY_CHAINS = 2  # kernels/cpu/sparse.h


def chain(h: torch.Tensor, q: torch.Tensor, d: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The defined sum for one token: AXPY_CHAINS chains, chain p over the listed rows with an id in
    [N p / P, N (p + 1) / P) (N rows), each the rows with h != 0 in list order from 0, then chain 0 + chain 1 + ...
    in that order."""
    n_rows, rows = q.shape[0], idx.tolist()
    total = None
    for p in range(AXPY_CHAINS):
        lo, hi = n_rows * p // AXPY_CHAINS, n_rows * (p + 1) // AXPY_CHAINS
        y = torch.zeros(q.shape[1], dtype=torch.float32)
        for m, row in enumerate(rows):
            if h[m] == 0 or not lo <= row < hi:
                continue
            c = (h[m] * d[row]).to(torch.bfloat16).to(torch.float32)  # float product, then RNE to bfloat16
            y = y + c.repeat_interleave(32) * q[row]  # exact products, one rounding per add
        total = y if total is None else total + y
    return total


@needs_kernels
def test_q4_0_rows_in_q8_follow_the_bfloat16_chain_in_every_variant():
    w, q, d = random_q4_0(70, 256, seed=5)
    rng = np.random.default_rng(5)
    idx = torch.tensor(
        [3, 0, 69, 8, 9, 10, 11, 12, 40, 3, 55, 21, 22], dtype=torch.int64
    )  # repeats, odd count
    h = torch.from_numpy(rng.standard_normal((3, idx.numel())).astype(np.float32))
    h[0, 4] = h[1, ::3] = 0.0  # skipped rows shift the pairs
    want = torch.stack([chain(h[t], q, d, idx) for t in range(3)])
    # the bfloat16 coefficient moves the sum by up to 2^-8 of |h| @ |W|: not the float chain's bits
    f32 = sparse.rows_axpy(h[0], w, idx, ops.KernelContext(act_precision="f32"))
    assert not torch.equal(f32, want[0])
    for isa in available_isas():
        for n_threads in (1, 2, 3):
            kc = ops.KernelContext(n_threads=n_threads, isa=isa, act_precision="q8")
            assert torch.equal(sparse.rows_axpy(h, w, idx, kc), want), (isa, n_threads)  # tiled T > 1
            for t in range(3):
                assert torch.equal(sparse.rows_axpy(h[t], w, idx, kc), want[t]), (isa, n_threads, t)


@needs_kernels
def test_long_lists_cross_the_chunks_with_the_same_bits():
    """More active rows than one chunk of the listed-rows path (256) and than one prefetch window, all rows."""
    n_rows = 600
    w, q, d = random_q4_0(n_rows, 64, seed=6)
    rng = np.random.default_rng(6)
    h = torch.from_numpy(rng.standard_normal(n_rows).astype(np.float32))
    h[rng.random(n_rows) < 0.3] = 0.0
    want = chain(h, q, d, torch.arange(n_rows))
    for isa in available_isas():
        kc = ops.KernelContext(n_threads=2, isa=isa, act_precision="q8")
        assert torch.equal(sparse.rows_axpy(h, w, None, kc), want), isa


@needs_kernels
def test_wide_rows_and_every_list_length_keep_the_bits():
    """Rows of 85 units (a block of 64 coefficients, a full run of 16 and 5 more) and lists of 1-9 rows (two pairs
    at a time, then a pair, then a row with a +0 partner), as one chain (one thread) and split."""
    n_rows, n_cols = 40, 32 * 85
    w, q, d = random_q4_0(n_rows, n_cols, seed=7)
    rng = np.random.default_rng(7)
    for n in range(1, 10):
        idx = torch.from_numpy(np.sort(rng.choice(n_rows, n, replace=False)).astype(np.int64))
        h = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        want = chain(h, q, d, idx)
        for isa in available_isas():
            for n_threads in (1, 2):
                kc = ops.KernelContext(n_threads=n_threads, isa=isa, act_precision="q8")
                assert torch.equal(sparse.rows_axpy(h, w, idx, kc), want), (n, isa, n_threads)


@needs_kernels
def test_the_bf16_dot_report_matches_the_cpu():
    lib = ctypes.CDLL(library.load().path)
    flags = open("/proc/cpuinfo").read() if library.load().isa_best == 2 else ""
    has = "avx512_bf16" in flags and "avx512vbmi" in flags
    # where the CPU has the instructions, the self-test at load must have accepted them (else they are unused)
    assert lib.pi_kernels_bf16_dot() == int(has)


@pytest.mark.parametrize("value", [1e-39, -1e-39, 0.0, float("inf")])
def test_special_coefficients(value):
    """Subnormal products become signed zeros (vdpbf16ps reads bfloat16 subnormals as zero), infinities stay."""
    n_cols = 32
    raw = quantize(np.linspace(-1, 1, n_cols, dtype=np.float32)[None, :], GGMLType.Q4_0)
    w = ops.QWeight.from_numpy(raw, GGMLType.Q4_0, (1, n_cols))
    q, d = q4_0_parts(raw, 1, n_cols)
    h = torch.tensor([value / float(d[0, 0])], dtype=torch.float32)
    y = sparse.rows_axpy(h, w, None, ops.KernelContext(act_precision="q8"))
    if value == float("inf"):
        assert torch.equal(torch.isinf(y), q[0] != 0)
    else:
        assert torch.equal(y, torch.zeros(n_cols))
