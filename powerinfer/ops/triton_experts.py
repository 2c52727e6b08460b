"""Triton kernels of the CUDA pool's experts: the products of a step's (token, expert) pairs with the rows of each
pair's expert, read from experts stacked slot by slot (`pairs_matmul`) or from row ranges per pair
(`pairs_rows_matmul`: some neurons of some experts), and `pairs_axpy`, a pair's float32 rows weighted by its h.

One program per (pair, block of rows): it reads the pair's first row and row count (0: the pair is not in the
pool, or left out; its output row is 0 and no weight row is read), then those rows, block after block of 32
columns, decoded in registers by triton_quant's decoders, times the pair's input row; float32 fma per element,
summed over the 32 columns once at the end. pairs_axpy: one program per (pair, 128 columns), rows added in order.
A pair's output depends on its own input and rows only: the other pairs of a step, their number, the order the
programs take them in and the grid never change its bits. Each launch has a fixed shape (pairs x row blocks): no
host sync, no per-expert Python, whatever experts the router picked.

A pair's expert rows are read once per pair, so a prompt step reads an expert once per token routed to it from
memory or, since the programs take the pairs sorted by expert, mostly from the L2 cache (an expert-grouped tiling
that reads them once per step is not done yet); decode, one token of k pairs, reads each selected expert once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from powerinfer.gguf.constants import GGMLType
from powerinfer.ops.triton_quant import _KINDS, PackedWeight, _as_f32, _block_q, _quants, _scales

__all__ = ["pairs_axpy", "pairs_matmul", "pairs_rows_matmul", "pairs_sum"]

_BLOCK_N = 32  # rows per program
_AXPY_COLS = 128  # columns per program of pairs_axpy and pairs_sum


@triton.jit(do_not_specialize=["N", "x_div"])
def _pairs_matmul_kernel(
    x_ptr, base_ptr, count_ptr, order_ptr, w_ptr, y_ptr, N, K, x_div, stride_x, stride_w,
    KIND: tl.constexpr, WORDS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """y[p, n] = W[base[p] + n] . x[p // x_div] for the rows n < count[p] of the program's block, 0 for
    count[p] <= n < N; p = order[program]."""
    p = tl.load(order_ptr + tl.program_id(0))
    pid_n = tl.program_id(1)
    base = tl.load(base_ptr + p)
    count = tl.load(count_ptr + p)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = (base + tl.minimum(rows, tl.maximum(count, 1) - 1)).to(tl.int64)
    row = r[:, None] * stride_w  # (BN, 1): rows past count read the last one, their sums not kept
    x_row = x_ptr + (p // x_div).to(tl.int64) * stride_x
    n_blocks = tl.where(pid_n * BLOCK_N < count, tl.cdiv(K, 32), 0)  # no row of the block: nothing read
    j = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_N, 32), dtype=tl.float32)
    for blk in range(0, n_blocks):
        k = blk * 32 + j
        xv = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)  # (32,)
        if KIND == 2 or KIND == 3 or KIND == 8:  # Q4_0, Q4_1, Q8_0: the block's quants as words
            q = _block_q(w_ptr, row, blk, KIND, WORDS).to(tl.float32)  # (BN, 32)
            scale, mn = _scales(w_ptr, row, blk, 0, K, KIND)  # (BN, 1)
            v = tl.fma(q, scale, mn)
        elif KIND == 0 or KIND == 1 or KIND == 30:  # F32, F16, BF16 elements
            v = tl.load(w_ptr + row + tl.minimum(k, K - 1)[None, :]).to(tl.float32)
        else:  # Q5_0, Q5_1, the K-quants: byte by byte, two halves of 16
            half = (j % 16)[None, :]
            s0, m0 = _scales(w_ptr, row, blk, 0, K, KIND)
            s1, m1 = _scales(w_ptr, row, blk, 1, K, KIND)
            v0 = tl.fma(_as_f32(_quants(w_ptr, row, blk, half, 0, K, KIND)), s0, m0)
            v1 = tl.fma(_as_f32(_quants(w_ptr, row, blk, half, 1, K, KIND)), s1, m1)
            v = tl.where(j[None, :] < 16, v0, v1)
        acc = tl.fma(v, xv[None, :], acc)
    y = tl.where(rows < count, tl.sum(acc, axis=1), 0.0)
    tl.store(y_ptr + p.to(tl.int64) * N + rows, y, mask=rows < N)


@triton.jit(do_not_specialize=["N", "D"])
def _pairs_axpy_kernel(h_ptr, base_ptr, count_ptr, w_ptr, y_ptr, N, D, stride_w, BLOCK_D: tl.constexpr):
    """y[p, cols] = sum over n < count[p] of h[p, n] * W[base[p] + n, cols], n in order (float32 rows W); one
    program per (pair, BLOCK_D columns)."""
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    base = tl.load(base_ptr + p)
    count = tl.load(count_ptr + p)
    h_row = h_ptr + p.to(tl.int64) * N
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for n in range(0, count):
        w = tl.load(w_ptr + (base + n).to(tl.int64) * stride_w + cols, mask=cols < D, other=0.0)
        acc = tl.fma(tl.load(h_row + n), w, acc)
    tl.store(y_ptr + p.to(tl.int64) * D + cols, acc, mask=cols < D)


def pairs_rows_matmul(
    x: torch.Tensor,
    base: torch.Tensor,
    count: torch.Tensor,
    w: PackedWeight,
    n_out: int,
    x_div: int,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[p, n] = W[base[p] + n] . x[p // x_div] for n < count[p] (<= n_out), 0 after: x (M, K) float32, base and
    count (P,) int64 on w's device; (P, n_out) float32. order (P,) int64, a permutation of the pairs (e.g. by
    expert): the programs take the pairs in that order, so neighbouring programs read the same rows while they
    are in the L2 cache; a pair's bits do not depend on it."""
    K = w.K
    P = base.shape[0]
    if x.dim() != 2 or x.shape[1] != K or base.shape != count.shape or base.dim() != 1 or n_out <= 0:
        raise ValueError(f"pairs_matmul: x {tuple(x.shape)}, {P} pairs, {w.n_rows} rows of {K}")
    y = torch.empty(P, n_out, dtype=torch.float32, device=x.device)
    if P == 0:
        return y
    x = x.float().contiguous()
    if order is None:
        order = torch.arange(P, device=base.device)
    wt, stride_w, words = w.weight_arg()
    # the grid's first axis runs fastest: the pairs of one row block, in `order`, then the next block
    _pairs_matmul_kernel[(P, triton.cdiv(n_out, _BLOCK_N))](
        x, base.to(torch.int64).contiguous(), count.to(torch.int64).contiguous(), order.to(torch.int64).contiguous(),
        wt, y, n_out, K, x_div, x.stride(0), stride_w,
        KIND=_KINDS[w.ggml_type], WORDS=words, BLOCK_N=_BLOCK_N, num_warps=4,
    )  # fmt: skip
    return y


def pairs_matmul(
    x: torch.Tensor,
    slots: torch.Tensor,
    w: PackedWeight,
    n_rows: int,
    x_div: int,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[p] = W_{slots[p]} @ x[p // x_div] for the pairs p: w the stack (n_slot * n_rows, K) of n_rows-row
    matrices slot after slot, x (M, K) float32, slots (P,) int64 (-1: y[p] = 0); (P, n_rows) float32 on w's
    device (`pairs_rows_matmul` over the slots' rows; order as there)."""
    if slots.dim() != 1 or w.n_rows % n_rows:
        raise ValueError(f"pairs_matmul: slots {tuple(slots.shape)}, {w.n_rows} rows in matrices of {n_rows}")
    here = slots >= 0
    base = slots.clamp(min=0) * n_rows
    return pairs_rows_matmul(x, base, here.to(torch.int64) * n_rows, w, n_rows, x_div, order)


def pairs_axpy(h: torch.Tensor, base: torch.Tensor, count: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """y[p] = sum over n < count[p] of h[p, n] * W[base[p] + n] for float32 rows W (N, D) (e.g. transposed down
    columns): h (P, M) float32, base and count (P,) int64 on w's device; (P, D) float32."""
    if w.ggml_type != GGMLType.F32:
        raise ValueError(f"pairs_axpy: float32 rows only, got {w.ggml_type.name}")
    D, P = w.K, h.shape[0]
    y = torch.empty(P, D, dtype=torch.float32, device=h.device)
    if P == 0:
        return y
    h = h.float().contiguous()
    wt, stride_w, _ = w.weight_arg()
    _pairs_axpy_kernel[(P, triton.cdiv(D, _AXPY_COLS))](
        h, base.to(torch.int64).contiguous(), count.to(torch.int64).contiguous(), wt, y, h.shape[1], D, stride_w,
        BLOCK_D=_AXPY_COLS, num_warps=4,
    )  # fmt: skip
    return y


@triton.jit(do_not_specialize=["k", "D"])
def _pairs_sum_kernel(y_ptr, w_ptr, out_ptr, k, D, BLOCK_D: tl.constexpr):
    """out[t, cols] = ((0 + w[t, 0] y[t k]) + w[t, 1] y[t k + 1]) + ..., j in order; one program per (token,
    BLOCK_D columns)."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(0, k):
        p = t.to(tl.int64) * k + j
        acc += tl.load(w_ptr + p) * tl.load(y_ptr + p * D + cols, mask=cols < D, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * D + cols, acc, mask=cols < D)


def pairs_sum(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum over j of weights[t, j] * y[t k + j], the pairs of a token added in j order whatever T (a
    torch reduction may pick another order by shape): y (T k, D) and weights (T, k) float32 on one device;
    (T, D) float32."""
    T, k = weights.shape
    D = y.shape[1]
    out = torch.empty(T, D, dtype=torch.float32, device=y.device)
    if T == 0:
        return out
    _pairs_sum_kernel[(T, triton.cdiv(D, _AXPY_COLS))](
        y.float().contiguous(), weights.float().contiguous(), out, k, D, BLOCK_D=_AXPY_COLS, num_warps=4
    )
    return out
