"""Triton kernels of the CUDA pool: products with weights kept in their file's quantization, repacked at load.

`pack(raw, ggml_type, K)` turns the ggml blocks of a weight's rows (uint8 (N, row_bytes)) into a `PackedWeight` of
the same bytes; `matmul(x, w)` is y = x @ W.T (x (T, K) -> (T, N)), `axpy(h, w)` is y = h @ W (h (T, N) -> (T, K),
the transposed down projection over sparse neurons); both return float32. No dequantised copy is ever resident.

Packed rows: the same bytes as the blocks (the planner's budget stays exact) and each row still its own bytes (a
row slice is a weight). Blocks of 32 become planes, row by row: Q4_0 [qs K/2][d K/32 fp16], Q4_1 [qs][d, m],
Q5_0 [qs][qh K/8][d], Q5_1 [qs][qh][d, m], Q8_0 [qs K][d]. Q4_0, Q4_1 and Q8_0 also reorder a block's quants
inside its 16 (32) bytes so that 32-bit words decode in pairs (_SLOT_ELEMENT): nibbles n and n + 4 of a word
(bytes b and b + 2 for Q8_0) are two neighbouring elements, so `(w >> 4n) & 0x000F000F | 0x64006400` holds both
as the fp16 pair 1024 + q, one paired subtract away from the quants: three instructions per two weights, and a
block's quants for a row are one 16-byte load. Q5_0/Q5_1 keep ggml's order (byte j: elements j and j + 16); the
K-quant super-blocks, F16, BF16 and F32 rows stay as stored.

matmul (every T: one kernel, one order of operations per output, so a token's bits depend neither on the other
tokens nor on T): tensor cores with exact operands. A weight enters tl.dot as its integer quant (|q| <= 128,
exact in fp16) or as its fp16 element (F16); a block's scale (and min) multiply the fp32 result of that block's
dot. The activation is split once per call (`_split_x_kernel`, per token): x' = x * 2^E_t, the power of two that
brings max |x_t| into [2^14, 2^15), then hi = fp16(x'), lo = fp16(x' - hi), so x' = hi + lo to 22 bits (relative
2^-22, or 2^-39 of the row's max where lo is subnormal) and nothing overflows fp16. fp16 products are exact in
the fp32 accumulator, so the result is x @ dequant(W).T up to float32 summation, in another order than the CPU's
f32 step (measured here against float64: a few 1e-7 of max |y|). The alternatives cost more for the same
accuracy: three bf16 pieces (no scaling) are three dots, TF32x3 three at half the rate; a bare fp16 or bf16 x is
2^-11 or 2^-8 off, far outside float32 tolerance. hi and lo are two columns of the dot (column 2t + p of the
token tile), added once after the K loop and scaled by 2^-E_t (exact). The loop is one dot of K = 32 per block of
32 (two of K = 16 for the types with a scale per 16), in block order; the token tile (8, 16 or 32 tokens, by T)
only sets how many mma.sync m16n8k16 run side by side for the same K chain: two warps of 16 rows each keep Triton
on MMAv2 for every tile (MMAv3, whose instruction shape would follow the tile, needs a multiple of 4 warps), and
16 rows per warp let the packed words go from shared memory straight into the MMA operand's registers. Split-K
depends on N and K only (about 8 programs per SM), its partial sums are added in split order by
`_sum_splits_kernel` (no atomics). BF16 and F32 weights, not exact in fp16, take `_matmul_fma_kernel`: CUDA cores,
one fixed tile of 8 tokens whatever T.

axpy (every T): CUDA cores, row after row. A program owns 32 * BLOCKS columns and a range of rows (split by N and
K only), and adds h[t, n] * W[n, cols] with fma into per-token accumulators: every operation is elementwise, so
the token tile never changes a token's bits, and rows are added in the same order whatever T. Q4_0/Q4_1/Q8_0 rows
are read a word per thread, h[t, n] * scale once per word. Rows whose h is zero for every token of the tile are
skipped 8 at a time (adding 0 would not change a bit either). Partial sums are added in split order.
Tensor cores for axpy would need the per-(row, block) scale folded into h before the dot (the reduction runs over
rows): not done yet, so axpy at T >= 16 is CUDA-core bound.

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
# types whose quants are reordered inside a block to be decoded from 32-bit words (`_block_q`): the element each
# quant slot holds, slot = 8 w + nibble (4-bit) or 4 w + byte (8-bit) of word w
_SLOT_ELEMENT = {
    GGMLType.Q4_0: [8 * (s // 8) + 2 * (s % 4) + (s % 8) // 4 for s in range(32)],
    GGMLType.Q4_1: [8 * (s // 8) + 2 * (s % 4) + (s % 8) // 4 for s in range(32)],
    GGMLType.Q8_0: [4 * (s // 4) + 2 * (s % 2) + (s % 4) // 2 for s in range(32)],
}
# types whose value is q * scale + min (the min term needs the activation's sums per 16 elements)
_MINS = frozenset({GGMLType.Q4_1, GGMLType.Q5_1, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.Q5_K})
# types with a scale per 16 elements (two per block of 32)
_SCALE16 = frozenset({GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q6_K})
# weights not exact in fp16: matmul on CUDA cores
_FMA_TYPES = frozenset({GGMLType.BF16, GGMLType.F32})

# matmul (tensor cores): rows per program and warps (16 rows per warp: the packed words go straight from shared
# memory into the MMA operand's registers; 2 warps: MMAv2 for every token tile), blocks of 32 per loop step
_DOT_ROWS, _DOT_WARPS, _DOT_UNROLL = 32, 2, 4
# split-K: at least this many blocks of 32 per split (a multiple of _DOT_UNROLL); programs per SM wanted
_MIN_SPLIT_BLOCKS, _PROGRAMS_PER_SM = 8, 8
# partial sums of one launch at most this many bytes (larger T runs in slabs of tokens)
_PART_BYTES = 64 << 20
# matmul of BF16/F32 weights (CUDA cores): fixed tile, tokens x rows x columns
_FMA_TILE = (8, 16, 64)
# axpy: blocks of 32 columns per program (about a word or 8 elements per thread), rows per skip check
_AXPY_BLOCKS = {GGMLType.Q4_0: 32, GGMLType.Q4_1: 32, GGMLType.Q8_0: 16}
_AXPY_OTHER_BLOCKS, _AXPY_ROWS = 16, 8
# axpy: the words of a block of the types read as words (the others: 32 elements)
_AXPY_PER = {GGMLType.Q4_0: 4, GGMLType.Q4_1: 4, GGMLType.Q8_0: 8}


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

    def weight_arg(self) -> tuple[torch.Tensor, int, bool]:
        """(tensor passed as the weight pointer, its row stride in its own units: elements for float types,
        whether 32-bit words of the rows may be loaded as such: rows start 4-byte aligned)."""
        view = _FLOAT_VIEW.get(self.ggml_type)
        w = self.data if view is None else self.data.view(view)
        words = self.data.stride(0) % 4 == 0 and self.data.data_ptr() % 4 == 0
        return w, w.stride(0), words


def _quant_bytes(blocks: torch.Tensor, ggml_type: GGMLType, to_slots: bool) -> torch.Tensor:
    """A block's quant bytes (..., 16 or 32) from ggml's element order to the slot order of _SLOT_ELEMENT (or
    back, to_slots False)."""
    order = torch.tensor(_SLOT_ELEMENT[ggml_type], device=blocks.device)
    if ggml_type == GGMLType.Q8_0:
        out = torch.empty_like(blocks)
        if to_slots:
            out[..., :] = blocks[..., order]
        else:
            out[..., order] = blocks
        return out
    if to_slots:  # ggml byte j: elements j (low nibble) and j + 16 (high); slot byte k: slots 2k, 2k + 1
        values = torch.cat([blocks & 15, blocks >> 4], dim=-1)[..., order]
        return values[..., 0::2] | (values[..., 1::2] << 4)
    slots = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)
    values = torch.empty_like(slots)
    values[..., order] = slots
    return values[..., :16] | (values[..., 16:] << 4)


def pack(raw: torch.Tensor, ggml_type: GGMLType, K: int) -> PackedWeight:
    """The ggml blocks of rows (uint8 (N, row_bytes), any device) repacked into planes; a new tensor on raw's
    device for the repacked types, raw itself (made contiguous) for the others."""
    ggml_type = GGMLType(ggml_type)
    planes = _PLANES.get(ggml_type)
    if planes is None or raw.shape[0] == 0:
        return PackedWeight(raw.contiguous(), ggml_type, K)
    N, n_blocks = raw.shape[0], K // 32
    blocks = raw.contiguous().view(N, n_blocks, row_bytes(ggml_type, 32))
    parts = [blocks[:, :, off : off + n] for off, n in planes]
    if ggml_type in _SLOT_ELEMENT:
        parts[0] = _quant_bytes(parts[0], ggml_type, to_slots=True)
    return PackedWeight(torch.cat([part.reshape(N, -1) for part in parts], dim=1), ggml_type, K)


def unpack(w: PackedWeight) -> torch.Tensor:
    """The ggml blocks of packed rows (pack's inverse)."""
    planes = _PLANES.get(w.ggml_type)
    if planes is None or w.n_rows == 0:
        return w.data
    n_blocks, N = w.K // 32, w.n_rows
    blocks = torch.empty(N, n_blocks, row_bytes(w.ggml_type, 32), dtype=torch.uint8, device=w.data.device)
    start = 0
    for i, (off, n) in enumerate(planes):
        part = w.data[:, start : start + n_blocks * n].reshape(N, n_blocks, n)
        if i == 0 and w.ggml_type in _SLOT_ELEMENT:
            part = _quant_bytes(part, w.ggml_type, to_slots=False)
        blocks[:, :, off : off + n] = part
        start += n_blocks * n
    return blocks.view(N, -1)


# ------------------------------------------------------------------------------------------------ decoders
# Every load is in bounds by construction (rows and blocks past the end are clamped to the last one and their
# products are zeroed by the activation side), so the decoders take no masks.


@triton.jit
def _byte_at(ptr):
    """The uint8 at byte pointers ptr as int32."""
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _half_at(ptr):
    """The fp16 at byte pointers ptr (even addresses; any shape) as float32."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16))).to(tl.float32)


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
def _words(ptr, w, WORDS: tl.constexpr):
    """The little-endian u32 words w (a word index, broadcast against ptr) from byte pointers ptr, as int32."""
    if WORDS:  # rows start 4-byte aligned: one wide load
        out = tl.load(ptr.to(tl.pointer_type(tl.int32)) + w)
    else:
        at = ptr + 4 * w
        out = _byte_at(at) | (_byte_at(at + 1) << 8) | (_byte_at(at + 2) << 16) | (_byte_at(at + 3) << 24)
    return out


@triton.jit
def _f16_pair(p, OFFSET: tl.constexpr):
    """The two fp16 halves of int32 p, each minus OFFSET: (low, high)."""
    lo = p.to(tl.int16).to(tl.float16, bitcast=True) - OFFSET
    hi = (p >> 16).to(tl.int16).to(tl.float16, bitcast=True) - OFFSET
    return lo, hi


@triton.jit
def _nibble_pairs(W, OFFSET: tl.constexpr):
    """(R, 4, 2, 2, 2) float16 nibbles of words W (R, 4), minus OFFSET: element 8w + 4i + 2j + k = nibble
    2i + j + 4k of word w."""
    l0, h0 = _f16_pair((W & 0x000F000F) | 0x64006400, OFFSET)  # elements 8w, 8w + 1
    l1, h1 = _f16_pair(((W >> 4) & 0x000F000F) | 0x64006400, OFFSET)  # 8w + 2, 8w + 3
    l2, h2 = _f16_pair(((W >> 8) & 0x000F000F) | 0x64006400, OFFSET)
    l3, h3 = _f16_pair(((W >> 12) & 0x000F000F) | 0x64006400, OFFSET)
    lo = tl.join(tl.join(l0, l2), tl.join(l1, l3))  # (R, 4, 2, 2): element 8w + 2 (2i + j)
    hi = tl.join(tl.join(h0, h2), tl.join(h1, h3))
    return tl.join(lo, hi)


@triton.jit
def _block_q(w_ptr, row, blk, KIND: tl.constexpr, WORDS: tl.constexpr):
    """(BN, 32) float16: the integer quants (Q4_0: q - 8, Q8_0: signed) of block blk of the packed rows at byte
    offsets row (BN, 1), in element order. Two quants become an fp16 pair in three instructions (shift, and-or,
    a paired fp16 subtract): a 16-bit lane holding 0x6400 | u is the fp16 1024 + u (u < 1024)."""
    if KIND == 8:  # byte b of word w: element 4w + 2 (b % 2) + b // 2
        W = _words(w_ptr + row + blk * 32, tl.arange(0, 8)[None, :], WORDS)  # (BN, 8)
        l0, h0 = _f16_pair((W & 0x00FF00FF) ^ 0x64806480, 1152.0)  # elements 4w, 4w + 1 (u = q + 128)
        l1, h1 = _f16_pair(((W >> 8) & 0x00FF00FF) ^ 0x64806480, 1152.0)  # 4w + 2, 4w + 3
        a = tl.join(tl.join(l0, l1), tl.join(h0, h1))  # (BN, 8, 2, 2): element 4w + 2i + j
    else:  # nibble n of word w: element 8w + 2 (n % 4) + n // 4
        W = _words(w_ptr + row + blk * 16, tl.arange(0, 4)[None, :], WORDS)  # (BN, 4)
        if KIND == 2:
            a = _nibble_pairs(W, 1032.0)  # q - 8
        else:
            a = _nibble_pairs(W, 1024.0)
    return tl.reshape(a, (a.shape[0], 32))


@triton.jit
def _quants(w_ptr, row, blk, j, HALF: tl.constexpr, K, KIND: tl.constexpr):
    """The integer quants q (int32) of elements 32 * blk + 16 * HALF + j of the packed rows at byte offsets row
    (row, blk and j broadcast to the result's shape), for the types decoded byte by byte (Q5_0, Q5_1, the
    K-quants). The element's value is q * scale + min with `_scales`'s scale and min."""
    if KIND == 6 or KIND == 7:  # Q5_0, Q5_1: nibbles at qs + 16 blk, byte j: elements j and j + 16
        b = _byte_at(w_ptr + row + blk * 16 + j)
        if HALF == 0:
            q = b & 15
        else:
            q = b >> 4
        bit = 16 * HALF + j  # fifth bit: bit 16 HALF + j of the block's u32 qh (plane at K / 2)
        q = q | (((_byte_at(w_ptr + row + K // 2 + blk * 4 + bit // 8) >> (bit % 8)) & 1) << 4)
        if KIND == 6:
            q = q - 16
    else:  # K-quants (kernels/cpu/kquants.h): block blk is elements 32 (blk % 8).. of super-block blk // 8
        sub = blk % 8
        el = 16 * HALF + j  # element within the block of 32
        if KIND == 12 or KIND == 13:
            # Q4_K / Q5_K {fp16 d, dmin; u8 scales[12]; (Q5_K: u8 qh[32];) u8 qs[128]}
            if KIND == 12:
                sb = w_ptr + row + (blk // 8) * 144
                b = _byte_at(sb + 16 + (sub // 2) * 32 + el)
            else:
                sb = w_ptr + row + (blk // 8) * 176
                b = _byte_at(sb + 48 + (sub // 2) * 32 + el)
            q = tl.where(sub % 2 == 0, b & 15, b >> 4)
            if KIND == 13:
                q = q | (((_byte_at(sb + 16 + el) >> sub) & 1) << 4)
        elif KIND == 14:  # Q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; fp16 d}: halves of 128, quarters of 32
            sb = w_ptr + row + (blk // 8) * 210
            n = sub // 4
            quarter = sub % 4
            b = _byte_at(sb + n * 64 + el + (quarter % 2) * 32)
            hb = (_byte_at(sb + 128 + n * 32 + el) >> (2 * quarter)) & 3
            q = (tl.where(quarter < 2, b & 15, b >> 4) | (hb << 4)) - 32
        elif KIND == 10:  # Q2_K {u8 scales[16]; u8 qs[64]; fp16 d, dmin}: 2-bit fields of 32 bytes
            sb = w_ptr + row + (blk // 8) * 84
            q = (_byte_at(sb + 16 + (sub // 4) * 32 + el) >> (2 * (sub % 4))) & 3
        else:  # Q3_K {u8 hmask[32]; u8 qs[64]; u8 scales[12]; fp16 d}
            sb = w_ptr + row + (blk // 8) * 110
            n = sub // 4
            sh = sub % 4
            q = (_byte_at(sb + 32 + n * 32 + el) >> (2 * sh)) & 3
            q = q - tl.where(((_byte_at(sb + el) >> (n * 4 + sh)) & 1) != 0, 0, 4)
    return q


@triton.jit
def _scales(w_ptr, row, blk, HALF: tl.constexpr, K, KIND: tl.constexpr):
    """(scale, min) float32 of elements 32 * blk + 16 * HALF .. + 15 of the packed rows at byte offsets row (row
    and blk broadcast): value = q * scale + min."""
    if KIND == 2:  # Q4_0: d plane at K / 2
        scale = _half_at(w_ptr + row + K // 2 + blk * 2)
        mn = tl.zeros_like(scale)
    elif KIND == 3:  # Q4_1: (d, m) plane at K / 2
        scale = _half_at(w_ptr + row + K // 2 + blk * 4)
        mn = _half_at(w_ptr + row + K // 2 + blk * 4 + 2)
    elif KIND == 6:  # Q5_0: d plane after qs and qh
        scale = _half_at(w_ptr + row + K // 2 + K // 8 + blk * 2)
        mn = tl.zeros_like(scale)
    elif KIND == 7:  # Q5_1: (d, m) plane after qs and qh
        scale = _half_at(w_ptr + row + K // 2 + K // 8 + blk * 4)
        mn = _half_at(w_ptr + row + K // 2 + K // 8 + blk * 4 + 2)
    elif KIND == 8:  # Q8_0: d plane at K
        scale = _half_at(w_ptr + row + K + blk * 2)
        mn = tl.zeros_like(scale)
    else:
        sub = blk % 8
        if KIND == 12 or KIND == 13:  # 6-bit scale and min of sub-block `sub`, times d and dmin
            if KIND == 12:
                sb = w_ptr + row + (blk // 8) * 144
            else:
                sb = w_ptr + row + (blk // 8) * 176
            s_j = _byte_at(sb + 4 + sub)
            s_j4 = _byte_at(sb + 8 + sub)
            s_jm4 = _byte_at(sb + 4 + tl.where(sub >= 4, sub - 4, sub))
            sc = tl.where(sub < 4, s_j & 63, (s_j4 & 15) | ((s_jm4 >> 6) << 4))
            mc = tl.where(sub < 4, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
            scale = _half_at(sb) * _as_f32(sc)
            mn = -(_half_at(sb + 2) * _as_f32(mc))
        elif KIND == 14:  # Q6_K: int8 scale per 16 elements, times d
            sb = w_ptr + row + (blk // 8) * 210
            idx = (sub // 4) * 8 + HALF + 2 * (sub % 4)
            sc = tl.load(sb + 192 + idx).to(tl.int8, bitcast=True).to(tl.int32)
            scale = _half_at(sb + 208) * _as_f32(sc)
            mn = tl.zeros_like(scale)
        elif KIND == 10:  # Q2_K: scale (low nibble) and min (high nibble) per 16 elements
            sb = w_ptr + row + (blk // 8) * 84
            s = _byte_at(sb + (sub // 4) * 8 + (sub % 4) * 2 + HALF)
            scale = _half_at(sb + 80) * _as_f32(s & 15)
            mn = -(_half_at(sb + 82) * _as_f32(s >> 4))
        else:  # Q3_K: 6-bit scales biased by 32, per 16 elements, times d
            sb = w_ptr + row + (blk // 8) * 110
            idx = (sub // 4) * 8 + (sub % 4) * 2 + HALF
            packed = _byte_at(sb + 96 + idx % 8)
            low = tl.where(idx < 8, packed & 15, packed >> 4)
            high = (_byte_at(sb + 104 + (idx & 3)) >> (2 * (idx >> 2))) & 3
            scale = _half_at(sb + 108) * _as_f32((low | (high << 4)) - 32)
            mn = tl.zeros_like(scale)
    return scale, mn


# ------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _split_x_kernel(
    x_ptr, xs_ptr, xsum_ptr, inv_ptr, T, K, K_pad, stride_x, stride_xs, MINS: tl.constexpr, BK: tl.constexpr
):
    """Token t = program: xs[k, 2t] = hi, xs[k, 2t + 1] = lo (fp16) with hi + lo = x[t, k] * 2^E (module
    docstring), 0 for K <= k < K_pad; inv[t] = 2^-E; with MINS, xsum[c, 2t + p] = the sum of piece p over
    elements 16c .. 16c + 15."""
    t = tl.program_id(0)  # tokens T.. of the last tile are zeros
    x_row = x_ptr + tl.minimum(t, T - 1).to(tl.int64) * stride_x
    k_end = tl.where(t < T, K, 0)
    big = tl.zeros((BK,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        big = tl.maximum(big, tl.abs(tl.load(x_row + k, mask=k < k_end, other=0.0).to(tl.float32)))
    biased = (tl.max(big, axis=0).to(tl.int32, bitcast=True) >> 23) & 255  # exponent of max |x| + 127
    e = tl.minimum(tl.maximum(141 - biased, -126), 126)  # max |x| * 2^e in [2^14, 2^15)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    tl.store(inv_ptr + t, ((127 - e) << 23).to(tl.float32, bitcast=True))
    for k0 in range(0, K_pad, BK):  # K_pad is a multiple of BK
        k = k0 + tl.arange(0, BK)
        v = tl.load(x_row + k, mask=k < k_end, other=0.0).to(tl.float32) * scale
        hi = v.to(tl.float16)
        lo = (v - hi.to(tl.float32)).to(tl.float16)
        tl.store(xs_ptr + k.to(tl.int64) * stride_xs + 2 * t, hi)
        tl.store(xs_ptr + k.to(tl.int64) * stride_xs + 2 * t + 1, lo)
        if MINS:
            sums = xsum_ptr + (k0 // 16 + tl.arange(0, BK // 16)).to(tl.int64) * stride_xs + 2 * t
            tl.store(sums, tl.sum(tl.reshape(hi.to(tl.float32), (BK // 16, 16)), axis=1))
            tl.store(sums + 1, tl.sum(tl.reshape(lo.to(tl.float32), (BK // 16, 16)), axis=1))


@triton.jit(do_not_specialize=["T", "N", "stride_part", "blocks_per_split"])  # no recompiling per T or N
def _matmul_dot_kernel(
    xs_ptr, xsum_ptr, inv_ptr, w_ptr, out_ptr, T, N, K, stride_xs, stride_w, stride_part, blocks_per_split,
    KIND: tl.constexpr, MINS: tl.constexpr, SCALE16: tl.constexpr, WORDS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    """out[s, t, n] = sum over the blocks of split s of x[t] . W[n] (x given as _split_x_kernel's pieces, rows
    padded with zeros to whole loop steps); one program per (BLOCK_N rows, split s, BLOCK_T tokens), UNROLL
    blocks of 32 per loop step."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_t = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_w  # (BN, 1): rows past N read row N - 1
    cols = pid_t * 2 * BLOCK_T + tl.arange(0, 2 * BLOCK_T)[None, :]  # xs columns 2t + p
    x_at = xs_ptr + tl.arange(0, 32)[:, None].to(tl.int64) * stride_xs + cols  # (32, 2 BT)
    x16_at = xs_ptr + tl.arange(0, 16)[:, None].to(tl.int64) * stride_xs + cols  # (16, 2 BT)
    n_blocks = tl.cdiv(K, 32)
    acc = tl.zeros((BLOCK_N, 2 * BLOCK_T), dtype=tl.float32)
    first = pid_s * blocks_per_split
    for b0 in range(first, tl.minimum(first + blocks_per_split, n_blocks), UNROLL):
        for u in tl.static_range(UNROLL):
            blk = b0 + u  # past the last block: x is 0 there, the weight side reads the last block again
            wblk = tl.minimum(blk, n_blocks - 1)
            x_blk = x_at + blk * 32 * stride_xs
            if KIND == 1:  # F16: the elements themselves, accumulated in the dot
                e = wblk * 32 + tl.arange(0, 32)[None, :]
                if not EVEN_K:
                    e = tl.minimum(e, K - 1)
                acc = tl.dot(tl.load(w_ptr + row + e), tl.load(x_blk), acc)
            elif (
                KIND == 2 or KIND == 3 or KIND == 8
            ):  # integer quants; the block's scale (and min) on its dot
                s, m = _scales(w_ptr, row, wblk, 0, K, KIND)  # (BN, 1)
                acc = tl.fma(tl.dot(_block_q(w_ptr, row, wblk, KIND, WORDS), tl.load(x_blk)), s, acc)
                if MINS:  # + min * (sum of the block's x): xsum rows 2 blk, 2 blk + 1
                    sums = xsum_ptr + 2 * blk * stride_xs + cols  # (1, 2 BT)
                    acc = tl.fma(m, tl.load(sums) + tl.load(sums + stride_xs), acc)
            else:  # quants decoded byte by byte, as two halves of 16
                j = tl.arange(0, 16)[None, :]
                x0 = tl.load(x16_at + blk * 32 * stride_xs)  # (16, 2 BT)
                x1 = tl.load(x16_at + (blk * 32 + 16) * stride_xs)
                a0 = _as_f16(_quants(w_ptr, row, wblk, j, 0, K, KIND))  # (BN, 16)
                a1 = _as_f16(_quants(w_ptr, row, wblk, j, 1, K, KIND))
                s0, m0 = _scales(w_ptr, row, wblk, 0, K, KIND)  # (BN, 1)
                if SCALE16:
                    s1, m1 = _scales(w_ptr, row, wblk, 1, K, KIND)
                    acc = tl.fma(tl.dot(a0, x0), s0, acc)
                    acc = tl.fma(tl.dot(a1, x1), s1, acc)
                else:
                    acc = tl.fma(tl.dot(a1, x1, tl.dot(a0, x0)), s0, acc)
                if MINS:
                    sums = xsum_ptr + 2 * blk * stride_xs + cols  # (1, 2 BT)
                    if SCALE16:
                        acc = tl.fma(m0, tl.load(sums), acc)
                        acc = tl.fma(m1, tl.load(sums + stride_xs), acc)
                    else:
                        acc = tl.fma(m0, tl.load(sums) + tl.load(sums + stride_xs), acc)
    hi, lo = tl.split(tl.reshape(acc, (BLOCK_N, BLOCK_T, 2)))  # columns 2t and 2t + 1
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    inv = tl.load(inv_ptr + toks, mask=toks < T, other=0.0)
    out = out_ptr + pid_s.to(tl.int64) * stride_part + toks.to(tl.int64)[None, :] * N + rows[:, None]
    tl.store(out, (hi + lo) * inv[None, :], mask=(rows < N)[:, None] & (toks < T)[None, :])


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


@triton.jit
def _word_quant(W, n: tl.constexpr, KIND: tl.constexpr):
    """Float32 integer quant n of packed words W (Q4_0: nibble n, q - 8; Q4_1: nibble n; Q8_0: byte n, signed)."""
    U = W.to(tl.uint32, bitcast=True)  # logical shifts
    if KIND == 8:
        q = ((((U >> (8 * n)) & 255) ^ 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    elif KIND == 2:
        q = (((U >> (4 * n)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    else:
        q = (((U >> (4 * n)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return q


@triton.jit
def _word_store(out, acc, blocks, c, n: tl.constexpr, mask, KIND: tl.constexpr):
    """Store acc (BT, C), the sums of quant n of the program's words c (C,) of blocks `blocks` (C,), at their
    elements (_SLOT_ELEMENT)."""
    if KIND == 8:  # word w = c % 8 of its block; slot 4w + n
        e = blocks * 32 + 4 * (c % 8) + 2 * (n % 2) + n // 2
    else:  # word w = c % 4; slot 8w + n
        e = blocks * 32 + 8 * (c % 4) + 2 * (n % 4) + n // 4
    tl.store(out + e[None, :], acc, mask=mask)


@triton.jit(do_not_specialize=["T", "N", "stride_part", "rows_per_split"])
def _axpy_kernel(
    h_ptr, w_ptr, out_ptr, T, N, K, stride_h, stride_w, stride_part, rows_per_split,
    KIND: tl.constexpr, WORDS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCKS: tl.constexpr,
    PER: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """out[s, t, k] = sum over rows n of split s of h[t, n] * W[n, k], row after row (elementwise fma, so a
    token's sums never depend on the tile); one program per (32 BLOCKS columns, split s, BLOCK_T tokens). Q4_0,
    Q4_1 and Q8_0 rows are read as words (PER words per block), one accumulator per quant of a word
    (acc0..acc7); the other types as elements (PER = 32), in acc0."""
    pid_c = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_t = tl.program_id(2)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    h_rows = h_ptr + toks.to(tl.int64) * stride_h  # (BT,)
    n_blocks = tl.cdiv(K, 32)
    c = tl.arange(0, BLOCKS * PER)  # the program's words (elements)
    blocks = pid_c * BLOCKS + c // PER
    wblk = tl.minimum(blocks, n_blocks - 1)  # columns past K read the last block
    at = wblk * (4 * PER) + 4 * (c % PER)  # byte of the word in the quant plane
    acc0 = tl.zeros((BLOCK_T, BLOCKS * PER), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_T, BLOCKS * PER), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_T, BLOCKS * PER), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_T, BLOCKS * PER), dtype=tl.float32)
    acc4 = tl.zeros((BLOCK_T, BLOCKS * PER), dtype=tl.float32)
    acc5 = tl.zeros((BLOCK_T, BLOCKS * PER), dtype=tl.float32)
    acc6 = tl.zeros((BLOCK_T, BLOCKS * PER), dtype=tl.float32)
    acc7 = tl.zeros((BLOCK_T, BLOCKS * PER), dtype=tl.float32)
    first = pid_s * rows_per_split
    end = tl.minimum(first + rows_per_split, N)
    for n0 in range(first, end, ROWS):
        r = n0 + tl.arange(0, ROWS)
        hv = tl.load(h_rows[:, None] + r[None, :], mask=(toks < T)[:, None] & (r < end)[None, :], other=0.0)
        if tl.sum((hv != 0).to(tl.int32)) > 0:  # a chunk of rows all zero for these tokens adds nothing
            for i in tl.static_range(ROWS):
                n = n0 + i  # rows past `end` read row end - 1 and add it times h = 0
                hn = tl.load(h_rows + n, mask=(toks < T) & (n + 0 * toks < end), other=0.0).to(tl.float32)
                hn = hn[:, None]  # (BT, 1)
                row = tl.minimum(n, end - 1).to(tl.int64) * stride_w
                if KIND == 2 or KIND == 3 or KIND == 8:  # h times the block's scale, times each quant
                    W = _words(w_ptr + row + at, 0, WORDS)  # (C,)
                    s, m = _scales(w_ptr, row, wblk, 0, K, KIND)
                    hs = hn * s[None, :]  # (BT, C)
                    acc0 = tl.fma(hs, _word_quant(W, 0, KIND)[None, :], acc0)
                    acc1 = tl.fma(hs, _word_quant(W, 1, KIND)[None, :], acc1)
                    acc2 = tl.fma(hs, _word_quant(W, 2, KIND)[None, :], acc2)
                    acc3 = tl.fma(hs, _word_quant(W, 3, KIND)[None, :], acc3)
                    if KIND != 8:
                        acc4 = tl.fma(hs, _word_quant(W, 4, KIND)[None, :], acc4)
                        acc5 = tl.fma(hs, _word_quant(W, 5, KIND)[None, :], acc5)
                        acc6 = tl.fma(hs, _word_quant(W, 6, KIND)[None, :], acc6)
                        acc7 = tl.fma(hs, _word_quant(W, 7, KIND)[None, :], acc7)
                    if KIND == 3:  # + h * min on every element
                        hm = hn * m[None, :]
                        acc0 += hm
                        acc1 += hm
                        acc2 += hm
                        acc3 += hm
                        acc4 += hm
                        acc5 += hm
                        acc6 += hm
                        acc7 += hm
                elif KIND == 0 or KIND == 1 or KIND == 30:  # F32, F16, BF16 elements
                    e = wblk * 32 + c % 32
                    if not EVEN_K:
                        e = tl.minimum(e, K - 1)
                    acc0 = tl.fma(hn, tl.load(w_ptr + row + e).to(tl.float32)[None, :], acc0)
                else:  # byte by byte: element c % 32 of block wblk
                    el = c % 32
                    s0, m0 = _scales(w_ptr, row, wblk, 0, K, KIND)
                    s1, m1 = _scales(w_ptr, row, wblk, 1, K, KIND)
                    v0 = tl.fma(_as_f32(_quants(w_ptr, row, wblk, el % 16, 0, K, KIND)), s0, m0)
                    v1 = tl.fma(_as_f32(_quants(w_ptr, row, wblk, el % 16, 1, K, KIND)), s1, m1)
                    acc0 = tl.fma(hn, tl.where(el < 16, v0, v1)[None, :], acc0)
    out = out_ptr + pid_s.to(tl.int64) * stride_part + toks.to(tl.int64)[:, None] * K
    mask = (toks < T)[:, None] & (blocks < n_blocks)[None, :]
    if KIND == 2 or KIND == 3 or KIND == 8:
        _word_store(out, acc0, blocks, c, 0, mask, KIND)
        _word_store(out, acc1, blocks, c, 1, mask, KIND)
        _word_store(out, acc2, blocks, c, 2, mask, KIND)
        _word_store(out, acc3, blocks, c, 3, mask, KIND)
        if KIND != 8:
            _word_store(out, acc4, blocks, c, 4, mask, KIND)
            _word_store(out, acc5, blocks, c, 5, mask, KIND)
            _word_store(out, acc6, blocks, c, 6, mask, KIND)
            _word_store(out, acc7, blocks, c, 7, mask, KIND)
    else:
        e = blocks * 32 + c % 32
        tl.store(out + e[None, :], acc0, mask=mask & (e < K)[None, :])


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
    wt, stride_w, words = w.weight_arg()
    if w.ggml_type in _FMA_TYPES:
        bt, bn, bk = _FMA_TILE
        _matmul_fma_kernel[(triton.cdiv(N, bn), triton.cdiv(T, bt))](
            x2, wt, y, T, N, K, x2.stride(0), stride_w, BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk, num_warps=4
        )
        return y.view(*x.shape[:-1], N)
    n_tiles = triton.cdiv(N, _DOT_ROWS)
    n_split, per_split = _splits(n_tiles, triton.cdiv(K, 32), _MIN_SPLIT_BLOCKS, x2.device)
    mins = w.ggml_type in _MINS
    k_pad = triton.cdiv(K, 32 * _MIN_SPLIT_BLOCKS) * 32 * _MIN_SPLIT_BLOCKS  # whole loop steps, zero-padded
    slab = _slab(T, n_split, N)
    for t0 in range(0, T, slab):
        xt, yt = x2[t0 : t0 + slab], y[t0 : t0 + slab]
        Tt = xt.shape[0]
        bt = 8 if Tt <= 8 else 16 if Tt <= 16 else 32
        t_tiles = triton.cdiv(Tt, bt)
        width = 2 * bt * t_tiles  # xs columns: (token, piece)
        xs = torch.empty(k_pad, width, dtype=torch.float16, device=xt.device)
        xsum = torch.empty(k_pad // 16, width, dtype=torch.float32, device=xt.device) if mins else xs
        inv = torch.empty(bt * t_tiles, dtype=torch.float32, device=xt.device)
        _split_x_kernel[(bt * t_tiles,)](
            xt, xs, xsum, inv, Tt, K, k_pad, xt.stride(0), width, MINS=mins, BK=256
        )
        part = yt if n_split == 1 else torch.empty(n_split, Tt, N, dtype=torch.float32, device=xt.device)
        _matmul_dot_kernel[(n_tiles, n_split, t_tiles)](
            xs, xsum, inv, wt, part, Tt, N, K, width, stride_w, Tt * N, per_split,
            KIND=_KINDS[w.ggml_type], MINS=mins, SCALE16=w.ggml_type in _SCALE16, WORDS=words, EVEN_K=K % 32 == 0,
            BLOCK_N=_DOT_ROWS, BLOCK_T=bt, UNROLL=_DOT_UNROLL, num_warps=_DOT_WARPS,
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
    wt, stride_w, words = w.weight_arg()
    blocks = _AXPY_BLOCKS.get(w.ggml_type, _AXPY_OTHER_BLOCKS)
    col_tiles = triton.cdiv(K, 32 * blocks)
    n_split, per_split = _splits(col_tiles, N, 4 * _AXPY_ROWS, h2.device)
    y = torch.empty(T, K, dtype=torch.float32, device=h2.device)
    slab = _slab(T, n_split, K)
    for t0 in range(0, T, slab):
        ht, yt = h2[t0 : t0 + slab], y[t0 : t0 + slab]
        Tt = ht.shape[0]
        bt = 1 if Tt == 1 else 4 if Tt <= 4 else 8
        part = yt if n_split == 1 else torch.empty(n_split, Tt, K, dtype=torch.float32, device=ht.device)
        _axpy_kernel[(col_tiles, n_split, triton.cdiv(Tt, bt))](
            ht, wt, part, Tt, N, K, ht.stride(0), stride_w, Tt * K, per_split,
            KIND=_KINDS[w.ggml_type], WORDS=words, EVEN_K=K % 32 == 0, BLOCK_T=bt, BLOCKS=blocks,
            PER=_AXPY_PER.get(w.ggml_type, 32), ROWS=_AXPY_ROWS, num_warps=4,
        )  # fmt: skip
        if n_split > 1:
            _sum_splits(part, yt)
    return y.view(*h.shape[:-1], K)
