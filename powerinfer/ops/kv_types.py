"""KV cache row types (-ctk / -ctv): f32, f16, bf16 and ggml's q8_0 / q4_0 blocks, with the pure-torch encoder and
decoder that are the reference of the attention kernels' cache writes and reads (kernels/cpu/attention.c).

A cache of `n_ctx` positions of H_kv heads of D elements is stored per sequence as
  f32 / f16 / bf16: (n_ctx, H_kv, D) of that dtype;
  q8_0 / q4_0:      (n_ctx, H_kv, D / 32, 34 or 18) uint8, each head D / 32 whole blocks of ggml's layout
                    (f16 scale d, then 32 int8 q: x = q d; or 16 bytes of nibbles, element j < 16 the low nibble of
                    byte j, j >= 16 the high one of byte j - 16: x = (nibble - 8) d).
The last dimension tells a block type from the other (34 bytes q8_0, 18 q4_0), so a cache tensor carries its type.
Rows are encoded as ggml's reference quantisers do (gguf.quants gives the same bytes): a row's bytes depend on its
floats alone, whichever path wrote it.

The block types store heads rotated, as llama.cpp does (its attention rotation): each head of D % 64 == 0 elements
times the orthonormal Walsh-Hadamard matrix in blocks of `kv_rotation` elements, which spreads an outlier over its
block before the rounding (SmolLM2, -c 256: q4_0 perplexity +14% unrotated, +2.2% rotated; docs/generation.md). The kernels rotate the
queries alike and the attention output back; the tensor paths here rotate a row before encoding it and after
decoding it (`kv_encode` / `kv_decode` with `rot`), the same attention in exact arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from powerinfer.gguf.constants import GGMLType

__all__ = [
    "KV_TYPES",
    "KVType",
    "kv_decode",
    "kv_dims",
    "hadamard",
    "kv_encode",
    "kv_rotation",
    "kv_type",
    "kv_type_of",
]

QK = 32  # elements per q8_0 / q4_0 block


@dataclass(frozen=True)
class KVType:
    """One cache type: its llama.cpp name, ggml id (the kernels' `type_k` / `type_v`), elements and bytes per block,
    and the torch dtype of a float type (None: uint8 blocks)."""

    name: str
    ggml_type: GGMLType
    block_elems: int
    block_bytes: int
    dtype: torch.dtype | None

    def row_bytes(self, n_elements: int) -> int:
        """Bytes of n_elements (a multiple of block_elems)."""
        return n_elements // self.block_elems * self.block_bytes

    def shape(self, n_ctx: int, n_head_kv: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one sequence's rows of one layer."""
        if self.dtype is not None:
            return (n_ctx, n_head_kv, head_dim)
        return (n_ctx, n_head_kv, head_dim // QK, self.block_bytes)

    def fits(self, head_dim: int) -> str | None:
        """Why heads of head_dim cannot be stored in this type, or None."""
        if self.block_elems > 1 and head_dim % self.block_elems != 0:
            return f"{self.name} stores heads in blocks of {self.block_elems} elements (head size {head_dim})"
        if self.name != "f32" and head_dim > MAX_HEAD_DIM:
            return f"{self.name} caches take heads of at most {MAX_HEAD_DIM} elements (head size {head_dim})"
        return None


MAX_HEAD_DIM = 512  # PI_KV_MAX_D of kernels/cpu/attention.h: typed rows are decoded in tiles on the stack

KV_TYPES: dict[str, KVType] = {
    t.name: t
    for t in (
        KVType("f32", GGMLType.F32, 1, 4, torch.float32),
        KVType("f16", GGMLType.F16, 1, 2, torch.float16),
        KVType("bf16", GGMLType.BF16, 1, 2, torch.bfloat16),
        KVType("q8_0", GGMLType.Q8_0, QK, 34, None),
        KVType("q4_0", GGMLType.Q4_0, QK, 18, None),
    )
}
_BY_DTYPE = {t.dtype: t for t in KV_TYPES.values() if t.dtype is not None}
_BY_BLOCK = {t.block_bytes: t for t in KV_TYPES.values() if t.dtype is None}


def kv_type(name: str) -> KVType:
    """The type named `name` (ValueError naming the choices otherwise)."""
    try:
        return KV_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown KV cache type {name!r}: choose one of {', '.join(KV_TYPES)}") from None


def kv_type_of(rows: torch.Tensor) -> KVType | None:
    """The type of a cache tensor laid out as the module docstring says; None for any other tensor."""
    if rows.dtype is torch.uint8:
        return _BY_BLOCK.get(rows.shape[-1]) if rows.dim() >= 2 else None
    return _BY_DTYPE.get(rows.dtype)


def kv_dims(rows: torch.Tensor) -> tuple[int, int, int]:
    """(n_ctx, H_kv, D) of one sequence's rows of one layer, whatever its type."""
    if rows.dtype is torch.uint8:
        n_ctx, n_head_kv, n_blocks, _ = rows.shape
        return n_ctx, n_head_kv, n_blocks * QK
    n_ctx, n_head_kv, head_dim = rows.shape
    return n_ctx, n_head_kv, head_dim


def kv_rotation(t: KVType, head_dim: int, values: bool) -> int:
    """Size of the Walsh-Hadamard blocks a head of keys (values: of values) is stored rotated by; 0: none
    (float types, heads not a multiple of 64). Keys: the largest power of two >= 64 dividing head_dim; values: 64."""
    if t.dtype is not None or head_dim % 64 != 0:
        return 0
    n = 64
    while not values and head_dim % (2 * n) == 0:
        n *= 2
    return n


def hadamard(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (..., D) times the orthonormal Walsh-Hadamard matrix of size n (Sylvester order) in blocks of n; its own
    inverse. n = 0: x."""
    if n == 0:
        return x
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    h = (h / n**0.5).to(torch.float32)
    return (x.reshape(*x.shape[:-1], -1, n) @ h).reshape(x.shape)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: to the nearest integer, halves away from zero (exact for every float32)."""
    a = x.abs()
    floored = torch.floor(a)
    return torch.sign(x) * (floored + torch.floor(2 * (a - floored)))


def _f16_bytes(d: torch.Tensor) -> torch.Tensor:
    """Float32 scales (..., 1) as little-endian f16 bytes (..., 2)."""
    return d.to(torch.float16).view(torch.uint8)


def kv_encode(x: torch.Tensor, t: KVType, rot: int = 0) -> torch.Tensor:
    """Rows x (..., D) as type t: (..., D) of t's dtype, or (..., D / 32, block_bytes) uint8 blocks; rot: rotated
    first (kv_rotation)."""
    x = hadamard(x.to(torch.float32), rot)
    if t.dtype is not None:
        return x.to(t.dtype)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // QK, QK)
    if t.name == "q8_0":
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = _roundf(blocks * inv).to(torch.int8).view(torch.uint8)
        return torch.cat((_f16_bytes(d), q), dim=-1)
    # q4_0: d = -(the element of largest magnitude, the first) / 8
    top = torch.gather(blocks, -1, blocks.abs().argmax(dim=-1, keepdim=True))
    d = top / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(blocks * inv + 8.5).clamp(0, 15).to(torch.uint8)
    packed = q[..., : QK // 2] | (q[..., QK // 2 :] << 4)
    return torch.cat((_f16_bytes(d), packed), dim=-1)


def kv_decode(rows: torch.Tensor, rot: int = 0) -> torch.Tensor:
    """Cache rows of any type (kv_type_of) as float32 (..., D); rot: rotated back (kv_rotation)."""
    t = kv_type_of(rows)
    if t is None:
        raise ValueError(f"kv_decode: not a cache tensor ({rows.dtype}, {tuple(rows.shape)})")
    if t.dtype is not None:
        return rows.to(torch.float32)
    d = rows[..., :2].contiguous().view(torch.float16).to(torch.float32)  # (..., n_blocks, 1)
    if t.name == "q8_0":
        q = rows[..., 2:].contiguous().view(torch.int8).to(torch.float32)
    else:
        qs = rows[..., 2:]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).to(torch.float32) - 8
    x = q * d
    return hadamard(x.reshape(*x.shape[:-2], x.shape[-2] * QK), rot)
