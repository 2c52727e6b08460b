"""Triton kernel of the CUDA pool's experts: the products of a step's (token, expert) pairs with the rows of
each pair's expert, read from experts stacked slot by slot (`pairs_matmul`).

One program per (pair, block of rows): it reads the pair's slot (-1: the pair is not in the pool, or left out; its
output row is 0 and no weight row is read), then the rows of that slot's matrix, block after block of 32
columns, decoded in registers by triton_quant's decoders, times the pair's input row; float32 fma per element,
summed over the 32 columns once at the end. A pair's output depends on its own input and slot only: the other
pairs of a step, their number and the grid never change its bits. The launch has a fixed shape (pairs x row
blocks): no host sync, no per-expert Python, whatever experts the router picked.

A pair's expert rows are read once per pair, so a prompt step reads an expert once per token routed to it from
memory or, since the programs take the pairs sorted by slot, mostly from the L2 cache (an expert-grouped tiling
that reads them once per step is not done yet); decode, one token of k pairs, reads each selected expert once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from powerinfer.ops.triton_quant import _KINDS, PackedWeight, _as_f32, _block_q, _quants, _scales

__all__ = ["pairs_matmul"]

_BLOCK_N = 32  # rows per program


@triton.jit(do_not_specialize=["N", "x_div"])
def _pairs_matmul_kernel(
    x_ptr, slot_ptr, order_ptr, w_ptr, y_ptr, N, K, x_div, stride_x, stride_w,
    KIND: tl.constexpr, WORDS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """y[p, n] = W[slot[p] * N + n] . x[p // x_div] for rows n of the program's block, p = order[program];
    y[p] = 0 where slot[p] < 0."""
    p = tl.load(order_ptr + tl.program_id(0))
    pid_n = tl.program_id(1)
    s = tl.load(slot_ptr + p)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = (tl.maximum(s, 0) * N + tl.minimum(rows, N - 1)).to(tl.int64)
    row = r[:, None] * stride_w  # (BN, 1): rows past N read row N - 1, their sums not stored
    x_row = x_ptr + (p // x_div).to(tl.int64) * stride_x
    n_blocks = tl.where(s >= 0, tl.cdiv(K, 32), 0)  # a pair outside the pool reads nothing
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
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + p.to(tl.int64) * N + rows, y, mask=rows < N)


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
    device. order (P,) int64, a permutation of the pairs (e.g. by slot): the programs take the pairs in that
    order, so neighbouring programs read the same expert's rows while they are in the L2 cache; a pair's bits do
    not depend on it."""
    K = w.K
    if x.dim() != 2 or x.shape[1] != K or slots.dim() != 1 or n_rows <= 0 or w.n_rows % n_rows:
        raise ValueError(
            f"pairs_matmul: x {tuple(x.shape)}, slots {tuple(slots.shape)}, {w.n_rows} rows of {K}"
        )
    P = slots.shape[0]
    y = torch.empty(P, n_rows, dtype=torch.float32, device=x.device)
    if P == 0:
        return y
    x = x.float().contiguous()
    slots = slots.to(torch.int64).contiguous()
    if order is None:
        order = torch.arange(P, device=slots.device)
    order = order.to(torch.int64).contiguous()
    wt, stride_w, words = w.weight_arg()
    # the grid's first axis runs fastest: the pairs of one row block, in `order`, then the next block
    _pairs_matmul_kernel[(P, triton.cdiv(n_rows, _BLOCK_N))](
        x, slots, order, wt, y, n_rows, K, x_div, x.stride(0), stride_w,
        KIND=_KINDS[w.ggml_type], WORDS=words, BLOCK_N=_BLOCK_N, num_warps=4,
    )  # fmt: skip
    return y
