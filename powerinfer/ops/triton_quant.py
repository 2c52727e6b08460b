"""Triton kernels of the CUDA pool: products with weights kept in their file's block format.

The pool keeps the raw ggml blocks of its rows on the GPU (uint8, (N, row_bytes)); these kernels decode the
blocks in registers and accumulate in float32, so no dequantised copy of a weight is ever resident:

- `matmul(x, raw, ggml_type, K)`: y = x @ W.T, x (T, K) -> (T, N) float32 (gate/up rows, attention, output).
- `axpy(h, raw, ggml_type, K)`: y = h @ W, h (T, N) -> (T, K) float32 (the transposed down projection): the
  programs split the K columns and the N rows; each writes a partial sum and the partials are added in a fixed
  order (deterministic, no atomics).

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (block layouts in kernels/cpu/quants.h), the K-quants Q2_K..Q6_K (super-blocks
of 256, kernels/cpu/kquants.h), F16, BF16 and F32. Each program decodes a tile of `BLOCKS` blocks of 32 elements
per row as two halves: column c of a half is element 32 * (c // 16) + c % 16 (low half) or that + 16 (high
half), which is how Q4 blocks pack their nibbles; a K-quant block of 32 is one eighth of its super-block, each
element decoded with its sub-block's scale (and min) from the super-block's header. Few tokens (decode) multiply
by broadcasting and summing; more tokens use tl.dot in IEEE float32 (no TF32). Both sum in float32: results
equal x @ dequant(W).T up to summation order (relative error ~1e-6).

Importing this module imports triton; powerinfer imports it only for a CUDA pool (or in tests, where the
Triton interpreter, TRITON_INTERPRET=1, runs the same kernels on CPU tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from powerinfer.gguf.constants import GGMLType
from powerinfer.quant import row_bytes
from powerinfer.quant.types import TYPES

__all__ = ["SUPPORTED_TYPES", "axpy", "matmul"]

# kernel codes of the weight types: their ggml numbers (as the C kernels' enum pi_type), as _decode reads them
_KINDS: dict[GGMLType, int] = {t: int(t) for t, row in TYPES.items() if row.sparse_rows}
SUPPORTED_TYPES = frozenset(_KINDS)
# dtype the float weights are passed as (the kernel reads elements, not bytes)
_FLOAT_VIEW = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}
# token counts up to this multiply by broadcast-and-sum, more use tl.dot
_SMALL_T = 8


@triton.jit
def _fp16_at(ptr, mask):
    """The little-endian fp16 at byte pointers ptr (any shape) as float32 (0 where mask is False)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.int16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.int16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q5_high_bits(qh_ptr, j, mask):
    """Bits j and j + 16 of the little-endian u32 qh at qh_ptr, as 0 or 16 (the fifth bit of a Q5 value)."""
    b0 = tl.load(qh_ptr, mask=mask, other=0).to(tl.int32)
    b1 = tl.load(qh_ptr + 1, mask=mask, other=0).to(tl.int32)
    b2 = tl.load(qh_ptr + 2, mask=mask, other=0).to(tl.int32)
    b3 = tl.load(qh_ptr + 3, mask=mask, other=0).to(tl.int32)
    qh_lo = b0 | (b1 << 8)  # bits 0..15
    qh_hi = b2 | (b3 << 8)  # bits 16..31
    return ((qh_lo >> j) & 1) << 4, ((qh_hi >> j) & 1) << 4


@triton.jit
def _byte_at(ptr, mask):
    """The uint8 at byte pointers ptr as int32 (0 where mask is False)."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _kq_value(sb, e, m, KIND: tl.constexpr):
    """Element e (0..255, any shape) of the K-quant super-blocks at byte pointers sb, as float32 (0 where m is
    False): the reference dequantiser's formula (kernels/cpu/kquants.h has the layouts)."""
    if KIND == 12 or KIND == 13:  # Q4_K / Q5_K {fp16 d, dmin; u8 scales[12]; (Q5_K: u8 qh[32];) u8 qs[128]}
        d = _fp16_at(sb, m)
        dmin = _fp16_at(sb + 2, m)
        j = e // 32  # sub-block: 6-bit scale and min j, nibbles of qs[32 * (j // 2) ..]
        el = e % 32
        s_j = _byte_at(sb + 4 + j, m)
        s_j4 = _byte_at(sb + 8 + j, m)
        s_jm4 = _byte_at(sb + 4 + tl.where(j >= 4, j - 4, j), m)
        sc = tl.where(j < 4, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4))
        mn = tl.where(j < 4, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
        if KIND == 12:
            b = _byte_at(sb + 16 + (j // 2) * 32 + el, m)
            q = tl.where(j % 2 == 0, b & 15, b >> 4)
        else:
            b = _byte_at(sb + 48 + (j // 2) * 32 + el, m)
            q = tl.where(j % 2 == 0, b & 15, b >> 4) | (((_byte_at(sb + 16 + el, m) >> j) & 1) << 4)
        value = (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * mn.to(tl.float32)
    elif KIND == 14:  # Q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; fp16 d}: halves of 128, quarters of 32
        n = e // 128
        quarter = (e % 128) // 32
        el = e % 32
        b = _byte_at(sb + n * 64 + el + (quarter % 2) * 32, m)
        hb = (_byte_at(sb + 128 + n * 32 + el, m) >> (2 * quarter)) & 3
        q = (tl.where(quarter < 2, b & 15, b >> 4) | (hb << 4)) - 32
        sc = tl.load(sb + 192 + n * 8 + el // 16 + 2 * quarter, mask=m, other=0).to(tl.int8, bitcast=True)
        value = (_fp16_at(sb + 208, m) * sc.to(tl.float32)) * q.to(tl.float32)
    else:  # Q2_K / Q3_K: halves of 128, 2-bit fields (shift 2 s) of 32 bytes, scales per 16 elements
        n = e // 128
        sh = (e % 128) // 32
        el = e % 32
        j = n * 8 + sh * 2 + el // 16  # the scale of these 16 elements
        if KIND == 10:  # Q2_K {u8 scales[16] (low nibble scale, high nibble min); u8 qs[64]; fp16 d, dmin}
            q = (_byte_at(sb + 16 + n * 32 + el, m) >> (2 * sh)) & 3
            s = _byte_at(sb + j, m)
            d = _fp16_at(sb + 80, m)
            dmin = _fp16_at(sb + 82, m)
            value = (d * (s & 15).to(tl.float32)) * q.to(tl.float32) - dmin * (s >> 4).to(tl.float32)
        else:  # Q3_K {u8 hmask[32]; u8 qs[64]; u8 scales[12] (6-bit, biased by 32); fp16 d}
            q = (_byte_at(sb + 32 + n * 32 + el, m) >> (2 * sh)) & 3
            q = q - tl.where(((_byte_at(sb + el, m) >> (n * 4 + sh)) & 1) != 0, 0, 4)
            low = tl.where(j < 8, _byte_at(sb + 96 + j % 8, m) & 15, _byte_at(sb + 96 + j % 8, m) >> 4)
            high = (_byte_at(sb + 104 + (j & 3), m) >> (2 * (j >> 2))) & 3
            sc = (low | (high << 4)) - 32
            value = (_fp16_at(sb + 108, m) * sc.to(tl.float32)) * q.to(tl.float32)
    return value


@triton.jit
def _decode(w_ptr, rows, row_mask, stride_w, blk, j, K, KIND: tl.constexpr):
    """Tile of W: rows (R,) x columns (C,) -> (lo, hi) float32 (R, C) at elements blk*32 + j and blk*32 + 16 + j.

    Masked rows and columns (past K) load zero bytes and so decode to 0. stride_w is the row stride in bytes for the quant
    types, in elements for F16/F32 (whose pointer is typed).
    """
    e_lo = blk * 32 + j  # (C,)
    e_hi = e_lo + 16
    base = w_ptr + rows.to(tl.int64)[:, None] * stride_w  # (R, 1)
    if KIND == 0 or KIND == 1 or KIND == 30:  # F32, F16, BF16: plain elements
        m_lo = row_mask[:, None] & (e_lo < K)[None, :]
        m_hi = row_mask[:, None] & (e_hi < K)[None, :]
        lo = tl.load(base + e_lo[None, :], mask=m_lo, other=0.0).to(tl.float32)
        hi = tl.load(base + e_hi[None, :], mask=m_hi, other=0.0).to(tl.float32)
    else:
        m = row_mask[:, None] & (blk < K // 32)[None, :]
        if KIND == 2:  # Q4_0 {fp16 d; u8 qs[16]}
            blk_ptr = base + (blk * 18)[None, :]
            d = _fp16_at(blk_ptr, m)
            q = tl.load(blk_ptr + 2 + j[None, :], mask=m, other=0)
            lo = ((q & 15).to(tl.int32) - 8).to(tl.float32) * d
            hi = ((q >> 4).to(tl.int32) - 8).to(tl.float32) * d
        elif KIND == 3:  # Q4_1 {fp16 d; fp16 m; u8 qs[16]}
            blk_ptr = base + (blk * 20)[None, :]
            d = _fp16_at(blk_ptr, m)
            mn = _fp16_at(blk_ptr + 2, m)
            q = tl.load(blk_ptr + 4 + j[None, :], mask=m, other=0)
            lo = (q & 15).to(tl.float32) * d + mn
            hi = (q >> 4).to(tl.float32) * d + mn
        elif KIND == 6:  # Q5_0 {fp16 d; u8 qh[4]; u8 qs[16]}: (q - 16) * d
            blk_ptr = base + (blk * 22)[None, :]
            d = _fp16_at(blk_ptr, m)
            b_lo, b_hi = _q5_high_bits(blk_ptr + 2, j[None, :], m)
            q = tl.load(blk_ptr + 6 + j[None, :], mask=m, other=0).to(tl.int32)
            lo = (((q & 15) | b_lo) - 16).to(tl.float32) * d
            hi = (((q >> 4) | b_hi) - 16).to(tl.float32) * d
        elif KIND == 7:  # Q5_1 {fp16 d; fp16 m; u8 qh[4]; u8 qs[16]}: q * d + m
            blk_ptr = base + (blk * 24)[None, :]
            d = _fp16_at(blk_ptr, m)
            mn = _fp16_at(blk_ptr + 2, m)
            b_lo, b_hi = _q5_high_bits(blk_ptr + 4, j[None, :], m)
            q = tl.load(blk_ptr + 8 + j[None, :], mask=m, other=0).to(tl.int32)
            lo = ((q & 15) | b_lo).to(tl.float32) * d + mn
            hi = ((q >> 4) | b_hi).to(tl.float32) * d + mn
        elif KIND >= 10:  # K-quants: block blk is elements 32 * (blk % 8).. of super-block blk // 8
            if KIND == 10:
                sb_bytes = 84
            elif KIND == 11:
                sb_bytes = 110
            elif KIND == 12:
                sb_bytes = 144
            elif KIND == 13:
                sb_bytes = 176
            else:
                sb_bytes = 210
            sb_ptr = base + ((blk // 8) * sb_bytes)[None, :]
            e = ((blk % 8) * 32 + j)[None, :]
            lo = _kq_value(sb_ptr, e, m, KIND)
            hi = _kq_value(sb_ptr, e + 16, m, KIND)
        else:  # Q8_0 {fp16 d; i8 qs[32]}
            blk_ptr = base + (blk * 34)[None, :]
            d = _fp16_at(blk_ptr, m)
            q_lo = tl.load(blk_ptr + 2 + j[None, :], mask=m, other=0).to(tl.int8, bitcast=True)
            q_hi = tl.load(blk_ptr + 18 + j[None, :], mask=m, other=0).to(tl.int8, bitcast=True)
            lo = q_lo.to(tl.float32) * d
            hi = q_hi.to(tl.float32) * d
    return lo, hi


@triton.jit(do_not_specialize=["T"])  # no recompiling for the divisibility of each new token count
def _matmul_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    T,
    N,
    K,
    stride_xt,
    stride_w,
    stride_yt,
    KIND: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    """y[t, n] = sum_k x[t, k] * W[n, k]; one program per (BLOCK_N rows, BLOCK_T tokens)."""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = toks < T
    c = tl.arange(0, BLOCKS * 16)
    j = c % 16
    blk_of = c // 16
    x_rows = x_ptr + toks.to(tl.int64)[:, None] * stride_xt  # (BT, 1)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for b in range(0, tl.cdiv(K, 32), BLOCKS):
        blk = b + blk_of
        lo, hi = _decode(w_ptr, rows, row_mask, stride_w, blk, j, K, KIND)  # (BN, C)
        e_lo = blk * 32 + j
        e_hi = e_lo + 16
        x_lo = tl.load(x_rows + e_lo[None, :], mask=tok_mask[:, None] & (e_lo < K)[None, :], other=0.0)
        x_hi = tl.load(x_rows + e_hi[None, :], mask=tok_mask[:, None] & (e_hi < K)[None, :], other=0.0)
        x_lo = x_lo.to(tl.float32)  # (BT, C)
        x_hi = x_hi.to(tl.float32)
        if USE_DOT:
            acc += tl.dot(x_lo, tl.trans(lo), input_precision="ieee")
            acc += tl.dot(x_hi, tl.trans(hi), input_precision="ieee")
        else:
            acc += tl.sum(x_lo[:, None, :] * lo[None, :, :], axis=2)
            acc += tl.sum(x_hi[:, None, :] * hi[None, :, :], axis=2)
    y = y_ptr + toks.to(tl.int64)[:, None] * stride_yt + rows[None, :]
    tl.store(y, acc, mask=tok_mask[:, None] & row_mask[None, :])


@triton.jit(do_not_specialize=["T"])  # no recompiling for the divisibility of each new token count
def _axpy_kernel(
    h_ptr,
    w_ptr,
    part_ptr,
    T,
    N,
    K,
    stride_ht,
    stride_w,
    rows_per_split,
    KIND: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    """part[s, t, k] = sum over rows n of split s of h[t, n] * W[n, k]; one program per (BLOCKS * 32 columns,
    split of rows_per_split rows, BLOCK_T tokens)."""
    pid_k = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_t = tl.program_id(2)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = toks < T
    c = tl.arange(0, BLOCKS * 16)
    j = c % 16
    blk = pid_k * BLOCKS + c // 16
    h_rows = h_ptr + toks.to(tl.int64)[:, None] * stride_ht  # (BT, 1)
    acc_lo = tl.zeros((BLOCK_T, BLOCKS * 16), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_T, BLOCKS * 16), dtype=tl.float32)
    first = pid_s * rows_per_split
    end = tl.minimum(first + rows_per_split, N)
    for r in range(first, end, BLOCK_N):
        rows = r + tl.arange(0, BLOCK_N)
        row_mask = rows < end
        lo, hi = _decode(w_ptr, rows, row_mask, stride_w, blk, j, K, KIND)  # (BN, C)
        hv = tl.load(h_rows + rows[None, :], mask=tok_mask[:, None] & row_mask[None, :], other=0.0)
        hv = hv.to(tl.float32)  # (BT, BN)
        if USE_DOT:
            acc_lo += tl.dot(hv, lo, input_precision="ieee")
            acc_hi += tl.dot(hv, hi, input_precision="ieee")
        else:
            acc_lo += tl.sum(hv[:, :, None] * lo[None, :, :], axis=1)
            acc_hi += tl.sum(hv[:, :, None] * hi[None, :, :], axis=1)
    e_lo = blk * 32 + j
    e_hi = e_lo + 16
    out = part_ptr + (pid_s * T + toks.to(tl.int64))[:, None] * K  # (BT, 1)
    tl.store(out + e_lo[None, :], acc_lo, mask=tok_mask[:, None] & (e_lo < K)[None, :])
    tl.store(out + e_hi[None, :], acc_hi, mask=tok_mask[:, None] & (e_hi < K)[None, :])


def _weight_arg(raw: torch.Tensor, ggml_type: GGMLType, K: int) -> tuple[torch.Tensor, int, int]:
    """(tensor passed as the weight pointer, its row stride in its own units, kernel code)."""
    kind = _KINDS.get(ggml_type)
    if kind is None:
        raise ValueError(f"no Triton kernel for {ggml_type.name} weights")
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != row_bytes(ggml_type, K):
        raise ValueError(
            f"raw must be uint8 (N, {row_bytes(ggml_type, K)}) for {ggml_type.name} rows of {K} elements, "
            f"got {raw.dtype} {tuple(raw.shape)}"
        )
    if raw.shape[0] > 1 and raw.stride(1) != 1:
        raise ValueError("raw rows must be contiguous")
    view = _FLOAT_VIEW.get(ggml_type)
    if view is None:
        return raw, raw.stride(0), kind
    w = raw.view(view)  # (N, K): the F16/F32 kernels read typed elements
    return w, w.stride(0), kind


def _tokens_2d(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        x2 = x2.float()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def _block_t(T: int) -> int:
    """Tokens per program: T rounded up to a power of two; 16..64 for tl.dot (its minimum tile is 16)."""
    if T <= _SMALL_T:
        return triton.next_power_of_2(max(T, 1))
    return min(max(triton.next_power_of_2(T), 16), 64)


def matmul(x: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLType, K: int) -> torch.Tensor:
    """y = x @ W.T for x (..., K) and W (N, K) given as raw blocks on x's device; returns (..., N) float32."""
    ggml_type = GGMLType(ggml_type)
    if x.shape[-1] != K:
        raise ValueError(f"matmul: x has {x.shape[-1]} features, the weight has {K}")
    w, stride_w, kind = _weight_arg(raw, ggml_type, K)
    x2 = _tokens_2d(x)
    T, N = x2.shape[0], raw.shape[0]
    y = torch.empty(T, N, dtype=torch.float32, device=x2.device)
    if T and N:
        block_t = _block_t(T)
        small = T <= _SMALL_T
        block_n, blocks = (32, 2) if small else (64, 2)
        grid = (triton.cdiv(N, block_n), triton.cdiv(T, block_t))
        _matmul_kernel[grid](
            x2, w, y, T, N, K, x2.stride(0), stride_w, N,
            KIND=kind, BLOCK_T=block_t, BLOCK_N=block_n, BLOCKS=blocks, USE_DOT=not small,
        )  # fmt: skip
    return y.view(*x.shape[:-1], N)


_SM_COUNT: dict[int, int] = {}


def _programs_wanted(device: torch.device) -> int:
    """About four programs per streaming multiprocessor (a fixed 16 off the GPU, i.e. in the interpreter)."""
    if device.type != "cuda":
        return 16
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return 4 * _SM_COUNT[index]


def axpy(
    h: torch.Tensor, raw: torch.Tensor, ggml_type: GGMLType, K: int, n_split: int | None = None
) -> torch.Tensor:
    """y = h @ W for h (..., N) and W (N, K) given as raw blocks on h's device; returns (..., K) float32.

    The N rows are cut into `n_split` ranges (None: enough programs to fill the device), each summed by its
    own programs into a partial result; the partials are then added in order.
    """
    ggml_type = GGMLType(ggml_type)
    w, stride_w, kind = _weight_arg(raw, ggml_type, K)
    N = raw.shape[0]
    if h.shape[-1] != N:
        raise ValueError(f"axpy: h has {h.shape[-1]} activations for {N} rows")
    h2 = _tokens_2d(h)
    T = h2.shape[0]
    if T == 0 or N == 0:
        return torch.zeros(*h.shape[:-1], K, dtype=torch.float32, device=h2.device)
    block_t = _block_t(T)
    small = T <= _SMALL_T
    block_n, blocks = 32, 2
    col_tiles, t_tiles = triton.cdiv(K, 32 * blocks), triton.cdiv(T, block_t)
    row_tiles = triton.cdiv(N, block_n)
    if n_split is None:
        n_split = triton.cdiv(_programs_wanted(h2.device), col_tiles * t_tiles)
    n_split = max(1, min(int(n_split), row_tiles))
    rows_per_split = triton.cdiv(row_tiles, n_split) * block_n
    n_split = triton.cdiv(N, rows_per_split)
    part = torch.empty(n_split, T, K, dtype=torch.float32, device=h2.device)
    _axpy_kernel[(col_tiles, n_split, t_tiles)](
        h2, w, part, T, N, K, h2.stride(0), stride_w, rows_per_split,
        KIND=kind, BLOCK_T=block_t, BLOCK_N=block_n, BLOCKS=blocks, USE_DOT=not small,
    )  # fmt: skip
    y = part[0] if n_split == 1 else part.sum(dim=0)
    return y.view(*h.shape[:-1], K)
