"""Triton kernels of the CUDA pool: products with weights kept in their file's quantization, repacked at load.

`pack(raw, ggml_type, K)` turns the ggml blocks of a weight's rows (uint8 (N, row_bytes)) into a `PackedWeight` of
the same bytes; `matmul(x, w)` is y = x @ W.T (x (T, K) -> (T, N)), `axpy(h, w)` is y = h @ W (h (T, N) -> (T, K),
the transposed down projection over sparse neurons); both return float32. No dequantised copy is ever resident.

Packed rows (same bytes as the blocks, so the planner's budget stays exact; each row still its own bytes, so row
slices are weights). Blocks of 32 become planes, row by row: Q4_0 [qs K/2][d K/32 fp16], Q4_1 [qs][d, m],
Q5_0 [qs][qh K/8][d], Q5_1 [qs][qh][d, m], Q8_0 [qs K][d], each block's 16 (32) quant bytes in ggml's order (byte
j holds elements j and j + 16), now 16-byte aligned and contiguous: a program reads a block's quants for 64 rows
as 128-bit loads. K-quant super-blocks stay as stored (Q4_K/Q5_K quants are 16-byte aligned runs already), as do
F16, BF16 and F32 rows.

matmul, every T (one kernel and one order per row, so a token's bits do not depend on the other tokens, nor on
T): tensor cores, exact operands. A weight enters tl.dot as its integer quant (|q| <= 128: exact in fp16), or its
fp16 element (F16); the block's scale (and min) are applied to the fp32 result of the block's dot. The
activation is split once per call (`_split_x_kernel`, per token): x * 2^E_t with E_t the power of two that brings
max |x_t| into [2^14, 2^15), then hi = fp16(x'), lo = fp16(x' - hi): x' = hi + lo to 22 bits (relative 2^-22, or
2^-39 of the row's max where lo is subnormal), never overflowing fp16. fp16 x fp16 products are exact in the fp32
accumulator, so the result is x @ dequant(W).T up to float32 summation (what the CPU's f32 step computes, in
another order); bf16 pieces would need three dots for the same 22 bits, TF32x3 three at half the rate, and a bare
fp16 / bf16 x fails float32 tolerance. hi and lo are two columns of the dot (column 2t + p of the token tile),
summed once after the K loop, then scaled by 2^-E_t (exact). Each 16-element chunk is one dot of K = 16, so a
row's sum is a fixed chain over K; the token tile (8, 16 or 32 tokens by T) only changes how many m16n8k16
instructions run side by side: two warps per program keep Triton on MMAv2 (mma.sync m16n8k16) for every tile
(MMAv3 needs a multiple of 4 warps), so each output element is the same instruction sequence whatever T is.
Programs: 64 rows x a range of K (split-K by N and K only, never T: ~6 programs per SM), partial sums added in
split order by `_sum_splits_kernel` (no atomics). BF16 and F32 weights (not exact in fp16) take a CUDA-core
kernel with a fixed tile of 8 tokens, whatever T.

axpy, every T: CUDA cores, one row at a time. Each program owns 32 * BLOCKS columns and a range of rows (split
by N and K), adds h[t, n] * W[n, cols] row after row with fma into (tokens, cols) accumulators: every operation
is elementwise, so the token tile never changes a token's bits. A chunk of 8 rows whose h is zero for every token
of the tile is skipped (adding 0 would not change a bit either). Partials are summed in split order.

Importing this module imports triton; powerinfer imports it only for a CUDA pool (or in tests, where the Triton
interpreter, TRITON_INTERPRET=1, runs the same kernels on CPU tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from powerinfer.gguf.constants import GGMLType
from powerinfer.quant import row_bytes
from powerinfer.quant.types import TYPES

__all__ = ["SUPPORTED_TYPES", "PackedWeight", "axpy", "matmul", "pack", "unpack"]

# kernel codes of the weight types: their ggml numbers (as the C kernels' enum pi_type), as the decoders read them
_KINDS: dict[GGMLType, int] = {t: int(t) for t, row in TYPES.items() if row.sparse_rows}
SUPPORTED_TYPES = frozenset(_KINDS)
# dtype the float weights are passed as (the kernels read elements, not bytes)
_FLOAT_VIEW = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}
# the planes of a repacked row: (offset, length) of each part of a ggml block, in the row's plane order
_PLANES: dict[GGMLType, tuple[tuple[int, int], ...]] = {
    GGMLType.Q4_0: ((2, 16), (0, 2)),
    GGMLType.Q4_1: ((4, 16), (0, 4)),
    GGMLType.Q5_0: ((6, 16), (2, 4), (0, 2)),
    GGMLType.Q5_1: ((8, 16), (4, 4), (0, 4)),
    GGMLType.Q8_0: ((2, 32), (0, 2)),
}
# types whose value is q * scale + min (the min term needs the activation's sums per 16 elements)
_MINS = frozenset({GGMLType.Q4_1, GGMLType.Q5_1, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.Q5_K})
# types with a scale per 16 elements (two per block of 32)
_SCALE16 = frozenset({GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q6_K})
# weights not exact in fp16: matmul on CUDA cores
_FMA_TYPES = frozenset({GGMLType.BF16, GGMLType.F32})

# matmul (tensor cores): rows per program, warps (2: MMAv2 for every token tile), token tiles by T
_DOT_ROWS, _DOT_WARPS = 64, 2
# split-K: at least this many blocks of 32 per split; about this many programs per SM
_MIN_SPLIT_BLOCKS, _PROGRAMS_PER_SM = 8, 6
# partial sums of one launch at most this many bytes (larger T runs in slabs of tokens)
_PART_BYTES = 64 << 20
# matmul of BF16/F32 weights (CUDA cores): fixed tile, tokens x rows x columns
_FMA_TILE = (8, 16, 64)
# axpy: blocks of 32 columns per program, rows per skip check, token tile at most
_AXPY_BLOCKS, _AXPY_ROWS, _AXPY_MAX_T = 8, 8, 16


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A weight's rows as the kernels read them: `data` uint8 (N, row_bytes) on the device, each row in the packed
    layout of `ggml_type` (see the module docstring; `pack` makes it), rows of K elements."""

    data: torch.Tensor
    ggml_type: GGMLType
    K: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "ggml_type", GGMLType(self.ggml_type))
        if self.ggml_type not in _KINDS:
            raise ValueError(f"no Triton kernel for {self.ggml_type.name} weights")
        rb = row_bytes(self.ggml_type, self.K)
        d = self.data
        if (
            d.dtype != torch.uint8
            or d.dim() != 2
            or d.shape[1] != rb
            or (d.shape[0] > 1 and d.stride(1) != 1)
        ):
            raise ValueError(
                f"packed rows must be uint8 (N, {rb}) with contiguous rows for {self.ggml_type.name} rows of "
                f"{self.K} elements, got {d.dtype} {tuple(d.shape)}"
            )

    @property
    def n_rows(self) -> int:
        return self.data.shape[0]

    def weight_arg(self) -> tuple[torch.Tensor, int]:
        """(tensor passed as the weight pointer, its row stride in its own units: elements for float types)."""
        view = _FLOAT_VIEW.get(self.ggml_type)
        w = self.data if view is None else self.data.view(view)
        return w, w.stride(0)


def pack(raw: torch.Tensor, ggml_type: GGMLType, K: int) -> PackedWeight:
    """The ggml blocks of rows (uint8 (N, row_bytes), any device) repacked into planes; a new tensor on raw's
    device for the repacked types, raw itself (made contiguous) for the others."""
    ggml_type = GGMLType(ggml_type)
    planes = _PLANES.get(ggml_type)
    if planes is None or raw.shape[0] == 0:
        return PackedWeight(raw.contiguous(), ggml_type, K)
    n_blocks, block_bytes = K // 32, row_bytes(ggml_type, 32)
    blocks = raw.contiguous().view(raw.shape[0], n_blocks, block_bytes)
    parts = [blocks[:, :, off : off + n].reshape(raw.shape[0], n_blocks * n) for off, n in planes]
    return PackedWeight(torch.cat(parts, dim=1), ggml_type, K)


def unpack(w: PackedWeight) -> torch.Tensor:
    """The ggml blocks of packed rows (pack's inverse)."""
    planes = _PLANES.get(w.ggml_type)
    if planes is None or w.n_rows == 0:
        return w.data
    n_blocks, N = w.K // 32, w.n_rows
    blocks = torch.empty(N, n_blocks, row_bytes(w.ggml_type, 32), dtype=torch.uint8, device=w.data.device)
    start = 0
    for off, n in planes:
        blocks[:, :, off : off + n] = w.data[:, start : start + n_blocks * n].reshape(N, n_blocks, n)
        start += n_blocks * n
    return blocks.view(N, -1)


# ------------------------------------------------------------------------------------------------ decoders


@triton.jit
def _byte_at(ptr, mask):
    """The uint8 at byte pointers ptr as int32 (0 where mask is False)."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _fp16_at(ptr, mask):
    """The little-endian fp16 at byte pointers ptr (any shape) as float32 (0 where mask is False)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.int16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.int16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _as_f16(q):
    """Integers q in [-128, 127] (int32) as float16, exactly: 1024 + 128 + q is an fp16 with q + 128 as its
    mantissa, no int-to-float conversion (a quarter-rate instruction)."""
    bits = ((q + 128) | 0x6400).to(tl.int16)
    return bits.to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def _as_f32(q):
    """Integers q in [-128, 127] (int32) as float32, exactly (2^23 + 128 + q, then the offset subtracted)."""
    return ((q + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _quants(w_ptr, row, blk, j, HALF: tl.constexpr, mask, K, KIND: tl.constexpr):
    """The integer quants q (int32) of elements 32 * blk + 16 * HALF + j of the packed rows at byte offsets `row`
    (row, blk, j and mask broadcast to the result's shape; masked elements load 0 bytes). The element's value is
    q * scale + min with `_scales`'s scale and min."""
    if KIND == 2 or KIND == 3 or KIND == 6 or KIND == 7:  # Q4_0, Q4_1, Q5_0, Q5_1: nibbles at qs + 16 blk
        b = _byte_at(w_ptr + row + blk * 16 + j, mask)
        if HALF == 0:
            q = b & 15
        else:
            q = b >> 4
        if KIND == 6 or KIND == 7:  # fifth bit: bit 16 HALF + j of the block's u32 qh (plane at K / 2)
            bit = 16 * HALF + j
            qh = _byte_at(w_ptr + row + K // 2 + blk * 4 + bit // 8, mask)
            q = q | (((qh >> (bit % 8)) & 1) << 4)
        if KIND == 2:
            q = q - 8
        elif KIND == 6:
            q = q - 16
    elif KIND == 8:  # Q8_0: int8 at qs + 32 blk
        b = tl.load(w_ptr + row + blk * 32 + 16 * HALF + j, mask=mask, other=0)
        q = b.to(tl.int8, bitcast=True).to(tl.int32)
    else:  # K-quants (kernels/cpu/kquants.h): block blk is elements 32 (blk % 8).. of super-block blk // 8
        sub = blk % 8
        el = 16 * HALF + j  # element within the block of 32
        if KIND == 12 or KIND == 13:
            # Q4_K / Q5_K {fp16 d, dmin; u8 scales[12]; (Q5_K: u8 qh[32];) u8 qs[128]}
            if KIND == 12:
                sb = w_ptr + row + (blk // 8) * 144
                b = _byte_at(sb + 16 + (sub // 2) * 32 + el, mask)
            else:
                sb = w_ptr + row + (blk // 8) * 176
                b = _byte_at(sb + 48 + (sub // 2) * 32 + el, mask)
            q = tl.where(sub % 2 == 0, b & 15, b >> 4)
            if KIND == 13:
                q = q | (((_byte_at(sb + 16 + el, mask) >> sub) & 1) << 4)
        elif KIND == 14:  # Q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; fp16 d}: halves of 128, quarters of 32
            sb = w_ptr + row + (blk // 8) * 210
            n = sub // 4
            quarter = sub % 4
            b = _byte_at(sb + n * 64 + el + (quarter % 2) * 32, mask)
            hb = (_byte_at(sb + 128 + n * 32 + el, mask) >> (2 * quarter)) & 3
            q = (tl.where(quarter < 2, b & 15, b >> 4) | (hb << 4)) - 32
        elif KIND == 10:  # Q2_K {u8 scales[16]; u8 qs[64]; fp16 d, dmin}: 2-bit fields of 32 bytes
            sb = w_ptr + row + (blk // 8) * 84
            q = (_byte_at(sb + 16 + (sub // 4) * 32 + el, mask) >> (2 * (sub % 4))) & 3
        else:  # Q3_K {u8 hmask[32]; u8 qs[64]; u8 scales[12]; fp16 d}
            sb = w_ptr + row + (blk // 8) * 110
            n = sub // 4
            sh = sub % 4
            q = (_byte_at(sb + 32 + n * 32 + el, mask) >> (2 * sh)) & 3
            q = q - tl.where(((_byte_at(sb + el, mask) >> (n * 4 + sh)) & 1) != 0, 0, 4)
    return q


@triton.jit
def _scales(w_ptr, row, blk, HALF: tl.constexpr, mask, K, KIND: tl.constexpr):
    """(scale, min) float32 of elements 32 * blk + 16 * HALF .. + 15 of the packed rows at byte offsets `row`
    (row, blk and mask broadcast; 0 where mask is False): value = q * scale + min."""
    if KIND == 2:  # Q4_0: d plane at K / 2
        scale = _fp16_at(w_ptr + row + K // 2 + blk * 2, mask)
        mn = tl.zeros_like(scale)
    elif KIND == 3:  # Q4_1: (d, m) plane at K / 2
        scale = _fp16_at(w_ptr + row + K // 2 + blk * 4, mask)
        mn = _fp16_at(w_ptr + row + K // 2 + blk * 4 + 2, mask)
    elif KIND == 6:  # Q5_0: d plane after qs and qh
        scale = _fp16_at(w_ptr + row + K // 2 + K // 8 + blk * 2, mask)
        mn = tl.zeros_like(scale)
    elif KIND == 7:  # Q5_1: (d, m) plane after qs and qh
        scale = _fp16_at(w_ptr + row + K // 2 + K // 8 + blk * 4, mask)
        mn = _fp16_at(w_ptr + row + K // 2 + K // 8 + blk * 4 + 2, mask)
    elif KIND == 8:  # Q8_0: d plane at K
        scale = _fp16_at(w_ptr + row + K + blk * 2, mask)
        mn = tl.zeros_like(scale)
    else:
        sub = blk % 8
        if KIND == 12 or KIND == 13:  # 6-bit scale and min of sub-block `sub`, times d and dmin
            if KIND == 12:
                sb = w_ptr + row + (blk // 8) * 144
            else:
                sb = w_ptr + row + (blk // 8) * 176
            s_j = _byte_at(sb + 4 + sub, mask)
            s_j4 = _byte_at(sb + 8 + sub, mask)
            s_jm4 = _byte_at(sb + 4 + tl.where(sub >= 4, sub - 4, sub), mask)
            sc = tl.where(sub < 4, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4))
            mc = tl.where(sub < 4, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
            scale = _fp16_at(sb, mask) * _as_f32(sc)
            mn = -(_fp16_at(sb + 2, mask) * _as_f32(mc))
        elif KIND == 14:  # Q6_K: int8 scale per 16 elements, times d
            sb = w_ptr + row + (blk // 8) * 210
            idx = (sub // 4) * 8 + HALF + 2 * (sub % 4)
            sc = tl.load(sb + 192 + idx, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.int32)
            scale = _fp16_at(sb + 208, mask) * _as_f32(sc)
            mn = tl.zeros_like(scale)
        elif KIND == 10:  # Q2_K: scale (low nibble) and min (high nibble) per 16 elements
            sb = w_ptr + row + (blk // 8) * 84
            s = _byte_at(sb + (sub // 4) * 8 + (sub % 4) * 2 + HALF, mask)
            scale = _fp16_at(sb + 80, mask) * _as_f32(s & 15)
            mn = -(_fp16_at(sb + 82, mask) * _as_f32(s >> 4))
        else:  # Q3_K: 6-bit scales biased by 32, per 16 elements, times d
            sb = w_ptr + row + (blk // 8) * 110
            idx = (sub // 4) * 8 + (sub % 4) * 2 + HALF
            packed = _byte_at(sb + 96 + idx % 8, mask)
            low = tl.where(idx < 8, packed & 15, packed >> 4)
            high = (_byte_at(sb + 104 + (idx & 3), mask) >> (2 * (idx >> 2))) & 3
            scale = _fp16_at(sb + 108, mask) * _as_f32((low | (high << 4)) - 32)
            mn = tl.zeros_like(scale)
    return scale, mn


@triton.jit
def _values(w_ptr, row, blk, j, HALF: tl.constexpr, mask, K, KIND: tl.constexpr):
    """Float32 values of elements 32 * blk + 16 * HALF + j of the rows at `row` (bytes; elements of the typed
    pointer for F16/BF16/F32), 0 where mask is False or past K."""
    if KIND == 0 or KIND == 1 or KIND == 30:  # F32, F16, BF16
        e = blk * 32 + 16 * HALF + j
        v = tl.load(w_ptr + row + e, mask=mask & (e < K), other=0.0).to(tl.float32)
    else:
        scale, mn = _scales(w_ptr, row, blk, HALF, mask, K, KIND)
        v = tl.fma(_as_f32(_quants(w_ptr, row, blk, j, HALF, mask, K, KIND)), scale, mn)
    return v


# ------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _split_x_kernel(
    x_ptr, xs_ptr, xsum_ptr, inv_ptr, K, stride_x, stride_xs, MINS: tl.constexpr, BK: tl.constexpr
):
    """Token t = program: xs[k, 2t] = hi, xs[k, 2t + 1] = lo (fp16) with hi + lo = x[t, k] * 2^E (module
    docstring), inv[t] = 2^-E; with MINS, xsum[c, 2t + p] = the sum of piece p over elements 16c .. 16c + 15."""
    t = tl.program_id(0)
    x_row = x_ptr + t.to(tl.int64) * stride_x
    big = tl.zeros((BK,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        big = tl.maximum(big, tl.abs(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)))
    biased = (tl.max(big, axis=0).to(tl.int32, bitcast=True) >> 23) & 255  # exponent of max |x| + 127
    e = tl.minimum(tl.maximum(141 - biased, -126), 126)  # max |x| * 2^e in [2^14, 2^15)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    tl.store(inv_ptr + t, ((127 - e) << 23).to(tl.float32, bitcast=True))
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        v = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32) * scale
        hi = v.to(tl.float16)
        lo = (v - hi.to(tl.float32)).to(tl.float16)
        tl.store(xs_ptr + k.to(tl.int64) * stride_xs + 2 * t, hi, mask=k < K)
        tl.store(xs_ptr + k.to(tl.int64) * stride_xs + 2 * t + 1, lo, mask=k < K)
        if MINS:  # K is a multiple of 32 here
            c = k0 // 16 + tl.arange(0, BK // 16)
            sums = xsum_ptr + c.to(tl.int64) * stride_xs + 2 * t
            in_k = c < K // 16
            tl.store(sums, tl.sum(tl.reshape(hi.to(tl.float32), (BK // 16, 16)), axis=1), mask=in_k)
            tl.store(sums + 1, tl.sum(tl.reshape(lo.to(tl.float32), (BK // 16, 16)), axis=1), mask=in_k)


@triton.jit(do_not_specialize=["T"])  # no recompiling for the divisibility of each new token count
def _matmul_dot_kernel(
    xs_ptr, xsum_ptr, inv_ptr, w_ptr, out_ptr, T, N, K, stride_xs, stride_w, stride_part, blocks_per_split,
    KIND: tl.constexpr, MINS: tl.constexpr, SCALE16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """out[s, t, n] = sum over the blocks of split s of x[t] . W[n] (x given as _split_x_kernel's pieces); one
    program per (BLOCK_N rows, split s, BLOCK_T tokens)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_t = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = (rows < N)[:, None]  # (BN, 1)
    row = rows.to(tl.int64)[:, None] * stride_w
    j = tl.arange(0, 16)[None, :]  # (1, 16): element of a chunk, as a weight column
    kk = tl.arange(0, 16)[:, None]  # (16, 1): element of a chunk, as an activation row
    cols = pid_t * 2 * BLOCK_T + tl.arange(0, 2 * BLOCK_T)  # xs columns 2t + p
    col_mask = (cols < 2 * T)[None, :]
    acc = tl.zeros((BLOCK_N, 2 * BLOCK_T), dtype=tl.float32)
    first = pid_s * blocks_per_split
    for blk in range(first, tl.minimum(first + blocks_per_split, tl.cdiv(K, 32))):
        k0 = blk * 32 + kk
        x_at = xs_ptr + k0.to(tl.int64) * stride_xs + cols[None, :]  # (16, 2 BT)
        x0 = tl.load(x_at, mask=(k0 < K) & col_mask, other=0.0)
        x1 = tl.load(x_at + 16 * stride_xs, mask=(k0 + 16 < K) & col_mask, other=0.0)
        if KIND == 1:  # F16: the elements themselves, accumulated in the dot
            e = blk * 32 + j
            a0 = tl.load(w_ptr + row + e, mask=row_mask & (e < K), other=0.0)
            a1 = tl.load(w_ptr + row + e + 16, mask=row_mask & (e + 16 < K), other=0.0)
            acc = tl.dot(a0, x0, acc)
            acc = tl.dot(a1, x1, acc)
        else:  # integer quants; the block's (chunk's) scale and min applied to its dot
            a0 = _as_f16(_quants(w_ptr, row, blk, j, 0, row_mask, K, KIND))  # (BN, 16)
            a1 = _as_f16(_quants(w_ptr, row, blk, j, 1, row_mask, K, KIND))
            s0, m0 = _scales(w_ptr, row, blk, 0, row_mask, K, KIND)  # (BN, 1)
            if SCALE16:
                s1, m1 = _scales(w_ptr, row, blk, 1, row_mask, K, KIND)
                acc = tl.fma(tl.dot(a0, x0), s0, acc)
                acc = tl.fma(tl.dot(a1, x1), s1, acc)
            else:
                acc = tl.fma(tl.dot(a1, x1, tl.dot(a0, x0)), s0, acc)
            if MINS:
                sums = xsum_ptr + 2 * blk * stride_xs + cols[None, :]
                c0 = tl.load(sums, mask=col_mask, other=0.0)  # (1, 2 BT)
                c1 = tl.load(sums + stride_xs, mask=col_mask, other=0.0)
                if SCALE16:
                    acc = tl.fma(m0, c0, acc)
                    acc = tl.fma(m1, c1, acc)
                else:
                    acc = tl.fma(m0, c0 + c1, acc)
    hi, lo = tl.split(tl.reshape(acc, (BLOCK_N, BLOCK_T, 2)))  # columns 2t and 2t + 1
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    inv = tl.load(inv_ptr + toks, mask=toks < T, other=0.0)
    out = out_ptr + pid_s.to(tl.int64) * stride_part + toks.to(tl.int64)[None, :] * N + rows[:, None]
    tl.store(out, (hi + lo) * inv[None, :], mask=row_mask & (toks < T)[None, :])


@triton.jit(do_not_specialize=["T"])
def _matmul_fma_kernel(
    x_ptr, w_ptr, y_ptr, T, N, K, stride_x, stride_w,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """y[t, n] = x[t] . W[n] for float weights on CUDA cores; one fixed tile shape for every T."""
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_K), dtype=tl.float32)
    x_rows = x_ptr + toks.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]
        xv = tl.load(x_rows + k, mask=(toks < T)[:, None] & (k < K), other=0.0)
        wv = tl.load(w_rows + k, mask=(rows < N)[:, None] & (k < K), other=0.0)
        acc = tl.fma(xv.to(tl.float32)[:, None, :], wv.to(tl.float32)[None, :, :], acc)
    y = y_ptr + toks.to(tl.int64)[:, None] * N + rows[None, :]
    tl.store(y, tl.sum(acc, axis=2), mask=(toks < T)[:, None] & (rows < N)[None, :])


@triton.jit(do_not_specialize=["T"])
def _axpy_kernel(
    h_ptr, w_ptr, out_ptr, T, N, K, stride_h, stride_w, stride_part, rows_per_split,
    KIND: tl.constexpr, BLOCK_T: tl.constexpr, BLOCKS: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """out[s, t, k] = sum over rows n of split s of h[t, n] * W[n, k], row after row; one program per (32 BLOCKS
    columns, split s, BLOCK_T tokens)."""
    pid_c = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_t = tl.program_id(2)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = toks < T
    h_rows = h_ptr + toks.to(tl.int64) * stride_h  # (BT,)
    blk = pid_c * BLOCKS + tl.arange(0, BLOCKS)[:, None]  # (B, 1)
    j = tl.arange(0, 16)[None, :]  # (1, 16)
    col_mask = blk < tl.cdiv(K, 32)
    acc0 = tl.zeros((BLOCK_T, BLOCKS, 16), dtype=tl.float32)  # elements 32 blk + j
    acc1 = tl.zeros((BLOCK_T, BLOCKS, 16), dtype=tl.float32)  # elements 32 blk + 16 + j
    first = pid_s * rows_per_split
    end = tl.minimum(first + rows_per_split, N)
    for n0 in range(first, end, ROWS):
        r = n0 + tl.arange(0, ROWS)
        hv = tl.load(h_rows[:, None] + r[None, :], mask=tok_mask[:, None] & (r < end)[None, :], other=0.0)
        if tl.sum((hv != 0).to(tl.int32)) > 0:  # a chunk of rows all zero for these tokens adds nothing
            for i in tl.static_range(ROWS):
                n = n0 + i  # rows past `end` read row end - 1 and add it times h = 0
                hn = tl.load(h_rows + n, mask=tok_mask & (n + tl.zeros_like(toks) < end), other=0.0)
                hn = hn.to(tl.float32)[:, None, None]
                row = tl.minimum(n, end - 1).to(tl.int64) * stride_w
                v0 = _values(w_ptr, row, blk, j, 0, col_mask, K, KIND)  # (B, 16)
                v1 = _values(w_ptr, row, blk, j, 1, col_mask, K, KIND)
                acc0 = tl.fma(hn, v0[None, :, :], acc0)
                acc1 = tl.fma(hn, v1[None, :, :], acc1)
    e = (blk * 32 + j)[None, :, :]
    out = out_ptr + pid_s.to(tl.int64) * stride_part + toks.to(tl.int64)[:, None, None] * K + e
    m = tok_mask[:, None, None]
    tl.store(out, acc0, mask=m & (e < K))
    tl.store(out + 16, acc1, mask=m & (e + 16 < K))


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, n_split, M, BLOCK: tl.constexpr):
    """y[i] = part[0, i] + part[1, i] + ... in split order (part (n_split, M))."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < M
    acc = tl.load(part_ptr + i, mask=mask, other=0.0)
    for s in range(1, n_split):
        acc += tl.load(part_ptr + s * M + i, mask=mask, other=0.0)
    tl.store(y_ptr + i, acc, mask=mask)


# ------------------------------------------------------------------------------------------------- callers

_SM_COUNT: dict[int, int] = {}


def _programs_wanted(device: torch.device) -> int:
    """_PROGRAMS_PER_SM per streaming multiprocessor (a fixed 16 off the GPU, i.e. in the interpreter)."""
    if device.type != "cuda":
        return 16
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _PROGRAMS_PER_SM * _SM_COUNT[index]


def _splits(n_tiles: int, n_units: int, min_units: int, device: torch.device) -> tuple[int, int]:
    """(number of splits, units per split: a multiple of min_units) of n_units (blocks or rows) so that n_tiles
    programs per split fill the device: a function of the weight's shape only, never of T."""
    want = triton.cdiv(_programs_wanted(device), n_tiles)
    n_split = max(1, min(want, n_units // min_units))
    per_split = triton.cdiv(triton.cdiv(n_units, n_split), min_units) * min_units
    return triton.cdiv(n_units, per_split), per_split


def _tokens_2d(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        x2 = x2.float()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def _slab(T: int, n_split: int, width: int) -> int:
    """Tokens per launch: all of them, unless the partial sums of n_split splits would pass _PART_BYTES."""
    if n_split == 1:
        return max(T, 1)
    return max(32, _PART_BYTES // (4 * n_split * width) // 32 * 32)


def _sum_splits(part: torch.Tensor, y: torch.Tensor) -> None:
    M = y.numel()
    _sum_splits_kernel[(triton.cdiv(M, 1024),)](part, y, part.shape[0], M, BLOCK=1024)


def matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """y = x @ W.T for x (..., K) on w's device; returns (..., N) float32."""
    K, N = w.K, w.n_rows
    if x.shape[-1] != K:
        raise ValueError(f"matmul: x has {x.shape[-1]} features, the weight has {K}")
    x2 = _tokens_2d(x)
    T = x2.shape[0]
    y = torch.empty(T, N, dtype=torch.float32, device=x2.device)
    if T == 0 or N == 0:
        return y.view(*x.shape[:-1], N)
    wt, stride_w = w.weight_arg()
    if w.ggml_type in _FMA_TYPES:
        bt, bn, bk = _FMA_TILE
        _matmul_fma_kernel[(triton.cdiv(N, bn), triton.cdiv(T, bt))](
            x2, wt, y, T, N, K, x2.stride(0), stride_w, BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk, num_warps=4
        )
        return y.view(*x.shape[:-1], N)
    n_tiles = triton.cdiv(N, _DOT_ROWS)
    n_split, per_split = _splits(n_tiles, triton.cdiv(K, 32), _MIN_SPLIT_BLOCKS, x2.device)
    mins = w.ggml_type in _MINS
    slab = _slab(T, n_split, N)
    for t0 in range(0, T, slab):
        xt, yt = x2[t0 : t0 + slab], y[t0 : t0 + slab]
        Tt = xt.shape[0]
        bt = 8 if Tt <= 8 else 16 if Tt <= 16 else 32
        t_tiles = triton.cdiv(Tt, bt)
        width = 2 * bt * t_tiles  # xs columns: (token, piece)
        xs = torch.empty(K, width, dtype=torch.float16, device=xt.device)
        xsum = torch.empty(K // 16, width, dtype=torch.float32, device=xt.device) if mins else xs
        inv = torch.empty(bt * t_tiles, dtype=torch.float32, device=xt.device)
        _split_x_kernel[(Tt,)](xt, xs, xsum, inv, K, xt.stride(0), width, MINS=mins, BK=256)
        part = yt if n_split == 1 else torch.empty(n_split, Tt, N, dtype=torch.float32, device=xt.device)
        _matmul_dot_kernel[(n_tiles, n_split, t_tiles)](
            xs, xsum, inv, wt, part, Tt, N, K, width, stride_w, Tt * N, per_split,
            KIND=_KINDS[w.ggml_type], MINS=mins, SCALE16=w.ggml_type in _SCALE16,
            BLOCK_N=_DOT_ROWS, BLOCK_T=bt, num_warps=_DOT_WARPS,
        )  # fmt: skip
        if n_split > 1:
            _sum_splits(part, yt)
    return y.view(*x.shape[:-1], N)


def axpy(h: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """y = h @ W for h (..., N) on w's device (W holds transposed rows, e.g. ffn_down_t); returns (..., K)
    float32. Rows whose h is zero for every token of a tile are skipped a chunk at a time."""
    K, N = w.K, w.n_rows
    if h.shape[-1] != N:
        raise ValueError(f"axpy: h has {h.shape[-1]} activations for {N} rows")
    h2 = _tokens_2d(h)
    T = h2.shape[0]
    if T == 0 or N == 0:
        return torch.zeros(*h.shape[:-1], K, dtype=torch.float32, device=h2.device)
    wt, stride_w = w.weight_arg()
    col_tiles = triton.cdiv(K, 32 * _AXPY_BLOCKS)
    n_split, per_split = _splits(col_tiles, N, 4 * _AXPY_ROWS, h2.device)
    y = torch.empty(T, K, dtype=torch.float32, device=h2.device)
    slab = _slab(T, n_split, K)
    for t0 in range(0, T, slab):
        ht, yt = h2[t0 : t0 + slab], y[t0 : t0 + slab]
        Tt = ht.shape[0]
        bt = min(triton.next_power_of_2(Tt), _AXPY_MAX_T)
        part = yt if n_split == 1 else torch.empty(n_split, Tt, K, dtype=torch.float32, device=ht.device)
        _axpy_kernel[(col_tiles, n_split, triton.cdiv(Tt, bt))](
            ht, wt, part, Tt, N, K, ht.stride(0), stride_w, Tt * K, per_split,
            KIND=_KINDS[w.ggml_type], BLOCK_T=bt, BLOCKS=_AXPY_BLOCKS, ROWS=_AXPY_ROWS, num_warps=4,
        )  # fmt: skip
        if n_split > 1:
            _sum_splits(part, yt)
    return y.view(*h.shape[:-1], K)
