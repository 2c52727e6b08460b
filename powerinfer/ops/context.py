"""KernelContext: how the ops run (threads, activation precision, SIMD variant, kernels on or off), as a value.

A context is immutable and shared: the engine builds one from its options and passes it to every op; two
contexts with different settings can be used side by side in one process. It resolves the ctypes kernels it
will call once, when it is made, so an op does one mapping lookup per call. Ops given no context use
`default_context()`: the defaults below with torch's current thread count.

Activation precision of the quant kernels (the block-32 types; the super-block types in dense matmuls, the
K-quants' sparse row kernels being always exact; which types each kernel takes: powerinfer.quant.types):
- "f32" (default, exact mode): x stays float32; each weight block is decoded in registers to the reference
  dequantiser's floats and multiplied in float32. Equal to x @ dequant(W).T up to summation order, as
  transformers computes it.
- "q8": x is rounded to int8 blocks of 32 (the super-block types: int8 super-blocks of 256) and the block dot
  products are integer (llama.cpp's arithmetic): faster, slightly less precise.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from powerinfer.gguf.constants import GGMLType
from powerinfer.ops import library

__all__ = ["ACT_PRECISIONS", "MAX_THREADS", "KernelContext", "ThreadCell", "default_context"]

ACT_PRECISIONS = ("f32", "q8")
MAX_THREADS = 1024  # the kernels clamp above this (PI_MAX_THREADS)

_EMPTY: Mapping[Any, Any] = MappingProxyType({})


class ThreadCell:
    """The threads the kernels of a context run now: the context's n_threads unless the runtime lowered it
    while the cores are shared with other busy processes (runtime.threads.ThreadGovernor). The one mutable
    part of a context; contexts made from one another by replace() share it when their n_threads agree."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __repr__(self) -> str:
        return f"ThreadCell({self.n})"


@dataclass(frozen=True, eq=False)
class _Resolved:
    """The kernels a context calls (empty mappings / None: the torch reference)."""

    matmul: Mapping[GGMLType, Any]
    get_rows: Mapping[GGMLType, Any]
    rows_matmul: Mapping[GGMLType, Any]
    rows_axpy: Mapping[GGMLType, Any]
    ffn_rows: Any
    predict_ffn: Any
    cats_ffn: Any
    attn_decode: Any
    attn_prefill: Any
    attn_decode_batch: Any
    ffn_kinds: Mapping[GGMLType, int]  # weight kind codes of ffn_rows / predict_ffn
    attn_block: Any  # fused decode blocks (one token)
    ffn_block: Any
    sparse_ffn_block: Any
    cats_ffn_block: Any
    teal_layer: Any
    rms_norm: Any
    moe_experts: Any  # one token's selected experts of a MoE FFN
    moe_route: Any  # router logits -> top-k experts
    moe_ffn_block: Any  # one token's MoE FFN block
    grouped_matmul: Any  # matmul over token groups, one parallel region
    moe_grouped_ffn: Any  # a prompt's MoE experts grouped by expert, one call


_NONE = _Resolved(
    _EMPTY, _EMPTY, _EMPTY, _EMPTY, None, None, None, None, None, None, _EMPTY, None, None, None, None, None, None, None,
    None, None, None, None,
)  # fmt: skip


@functools.cache
def _resolve(lib: library.Library | None, enabled: bool, act_precision: str) -> _Resolved:
    if lib is None or not enabled:
        return _NONE
    f32 = act_precision == "f32"
    return _Resolved(
        matmul=lib.matmul_f if f32 else lib.matmul,
        get_rows=lib.get_rows,
        rows_matmul=lib.rows_matmul_f if f32 else lib.rows_matmul,
        rows_axpy=lib.rows_axpy,
        ffn_rows=lib.ffn_rows,
        predict_ffn=lib.predict_ffn,
        cats_ffn=lib.cats_ffn,
        attn_decode=lib.attn_decode,
        attn_prefill=lib.attn_prefill,
        attn_decode_batch=lib.attn_decode_batch,
        ffn_kinds=library.FFN_KINDS,
        attn_block=lib.attn_block,
        ffn_block=lib.ffn_block,
        sparse_ffn_block=lib.sparse_ffn_block,
        cats_ffn_block=lib.cats_ffn_block,
        teal_layer=lib.teal_layer,
        rms_norm=lib.rms_norm,
        moe_experts=lib.moe_experts,
        moe_route=lib.moe_route,
        moe_ffn_block=lib.moe_ffn_block,
        grouped_matmul=lib.grouped_matmul,
        moe_grouped_ffn=lib.moe_grouped_ffn,
    )


@dataclass(frozen=True)
class KernelContext:
    """Settings of the CPU kernels, fixed at construction.

    n_threads: threads of each kernel call (1..MAX_THREADS; default torch.get_num_threads() when made); the
        most they use: `threads.n` is what they use now (see ThreadCell).
    act_precision: "f32" (exact) or "q8" (int8 activation blocks) for the quant matmuls.
    isa: SIMD variant "scalar", "avx2" or "avx512"; None = the best this CPU has. A variant above it is a
        ValueError (the kernels are compiled for each; the CPU decides what runs).
    enabled: False forces the pure-torch reference (the oracle in tests).
    """

    n_threads: int = field(default_factory=torch.get_num_threads)
    act_precision: str = "f32"
    isa: str | None = None
    enabled: bool = True
    # resolved in __post_init__; not compared, not set by callers
    level: int = field(init=False, repr=False, compare=False)  # the kernels' isa argument
    kernels: _Resolved = field(init=False, repr=False, compare=False)
    threads: ThreadCell = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = self.n_threads
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_THREADS:
            raise ValueError(f"thread count must be an integer in 1..{MAX_THREADS}, got {n!r}")
        if self.act_precision not in ACT_PRECISIONS:
            raise ValueError(
                f"activation precision must be one of {ACT_PRECISIONS}, got {self.act_precision!r}"
            )
        if self.isa is not None and self.isa not in library.ISA_NAMES:
            raise ValueError(f"SIMD variant must be one of {library.ISA_NAMES} or None, got {self.isa!r}")
        lib = library.load()
        best = lib.isa_best if lib is not None else 0
        level = best if self.isa is None else library.ISA_NAMES.index(self.isa)
        if lib is not None and level > best:
            raise ValueError(
                f"SIMD variant {self.isa!r} is not available on this CPU (best: {library.ISA_NAMES[best]!r})"
            )
        object.__setattr__(self, "level", level)
        object.__setattr__(self, "kernels", _resolve(lib, bool(self.enabled), self.act_precision))
        object.__setattr__(self, "threads", ThreadCell(n))

    def replace(self, **changes: Any) -> KernelContext:
        """A copy with some settings changed, e.g. kc.replace(act_precision="q8"); it shares this context's
        ThreadCell when its n_threads is the same."""
        new = dataclasses.replace(self, **changes)
        if new.n_threads == self.n_threads:
            object.__setattr__(new, "threads", self.threads)
        return new

    @property
    def threads_now(self) -> int:
        """Threads of the next kernel call (threads.n)."""
        return self.threads.n

    @functools.cached_property
    def exact(self) -> KernelContext:
        """This context with f32 activations (itself when it has them): the arithmetic of the sparse row kernels
        of the types that have no int8-activation row kernels (K-quants), made once per context."""
        return self if self.act_precision == "f32" else self.replace(act_precision="f32")

    def supported_types(self) -> frozenset[GGMLType]:
        """ggml types the C kernels compute in this context (empty when they are missing or disabled)."""
        return frozenset(self.kernels.matmul)

    @property
    def uses_kernels(self) -> bool:
        """True when the ops of this context call the C kernels (built and enabled)."""
        return self.kernels is not _NONE

    @property
    def isa_name(self) -> str | None:
        """The SIMD variant the kernels run in this context; None when they are not used."""
        return library.ISA_NAMES[self.level] if self.uses_kernels else None


@functools.cache
def _default_for(torch_threads: int) -> KernelContext:
    return KernelContext(n_threads=min(max(torch_threads, 1), MAX_THREADS))


def default_context() -> KernelContext:
    """The context of ops called without one: the defaults with torch's current thread count (cached)."""
    return _default_for(torch.get_num_threads())
