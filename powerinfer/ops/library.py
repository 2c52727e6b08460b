"""The C kernels: the built extension `powerinfer._kernels`, loaded once per process, and its ctypes symbols.

Everything here is fixed once the library is loaded: the symbol tables are read-only mappings, and the SIMD
variant, the thread count and the activation precision are arguments of every call (see `KernelContext`).
When the extension is missing (a plain checkout, no build), `load()` returns None and every op runs its
pure-torch reference.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import platform
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NoReturn

from powerinfer.gguf.constants import GGMLType
from powerinfer.quant import KERNEL_TYPES
from powerinfer.quant.types import TYPES, types_where

__all__ = ["ISA_NAMES", "Library", "check_status", "isa_best", "kernels_available", "load"]

log = logging.getLogger(__name__)

ISA_NAMES = ("scalar", "avx2", "avx512")  # index = the kernels' `isa` level (enum pi_isa)
# platform.machine() of the CPUs the AVX2 and AVX-512 variants are compiled for (PI_X86 in kernels/cpu/common.h);
# elsewhere the library holds the scalar variant only
X86_64_MACHINES = frozenset({"x86_64", "amd64"})


def isa_ceiling(machine: str) -> int:
    """The highest SIMD level (index into ISA_NAMES) the kernels can have on a CPU named `machine`
    (platform.machine()): every level on x86-64, the scalar one elsewhere, whatever the library reports."""
    return len(ISA_NAMES) - 1 if machine.lower() in X86_64_MACHINES else 0


# ggml type -> suffix of the C symbols pi_matmul_<suffix> and pi_get_rows_<suffix>: the plain and block-of-32 types
C_NAMES: Mapping[GGMLType, str] = MappingProxyType({t: TYPES[t].c_name for t in sorted(KERNEL_TYPES)})
# super-block types (K-quants, IQ4): the row decoder pi_get_rows_<suffix>, the "q8" matmul pi_matmul_<suffix> (int8
# super-blocks of 256, or blocks of 32 for a 32-element IQ4) and the exact (float activation) one pi_matmul_<suffix>_f. Those with
# sparse_rows (the K-quants) also have pi_rows_matmul_<suffix>_f / pi_rows_axpy_<suffix> (rows of whole
# super-blocks of 256), the exact ones in both precisions; IQ4 sparse ops decode the rows they need
K_TYPES: Mapping[GGMLType, str] = MappingProxyType(
    {t: row.c_name for t, row in sorted(TYPES.items()) if row.dense == "super" and row.c_name}
)
K_SPARSE_TYPES = frozenset(t for t in K_TYPES if TYPES[t].sparse_rows)
# types whose matmul has an exact (float activation) kernel pi_matmul_<suffix>_f next to the int8 one: every block
# type of 32 elements
QUANT_TYPES = types_where(dense="block32")
# weight kinds of pi_ffn_rows / pi_predict_ffn / pi_cats_ffn: the ggml type number (enum pi_type, kernels/cpu/quants.h)
FFN_KINDS: Mapping[GGMLType, int] = MappingProxyType(
    {t: int(t) for t in sorted(types_where(sparse_rows=True))}
)

# status codes (enum pi_status in kernels/cpu/common.h)
PI_ERR_SHAPE, PI_ERR_ALLOC, PI_ERR_INDEX, PI_ERR_SCRATCH = 1, 2, 3, 4

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
# (w, w_stride_bytes, N, K, x, x_stride, T, y, y_stride, n_threads, isa)
_MATMUL_ARGTYPES = (_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i32, _i32)
# (w, w_stride_bytes, N, K, ids, n_ids, y, y_stride, n_threads, isa)
_GET_ROWS_ARGTYPES = (_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i32, _i32)
# rows_matmul (w, w_stride_bytes, N, K, idx, M, x, x_stride, T, y, y_stride, n_threads, isa)
_SPARSE_ARGTYPES = (_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _i32, _i32)
# rows_axpy (w_t, w_stride_bytes, N, D, idx or NULL, M, h, h_stride, T, y, y_stride, q8_act, h_min, n_threads, isa)
_AXPY_ARGTYPES = (_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _i32, ctypes.c_float, _i32, _i32)  # fmt: skip
# ffn_rows (u, K, D, N, gate, gate_stride, gate_kind, up, .., down_t, .., idx, M, act, relu_up, q8_act, y,
#           scratch, scratch_bytes, n_threads, isa)
_FFN_ROWS_ARGTYPES = (
    (_ptr, _i64, _i64, _i64)
    + (_ptr, _i64, _i32) * 3
    + (_ptr, _i64, _i32, _i32, _i32, _ptr, _ptr, _i64, _i32, _i32)
)
# predict_ffn (x, u, K, D, N, fc1, fc1_stride, fc1_kind, rank, fc2, fc2_stride, fc2_kind, threshold,
#              gate, .., up, .., down_t, .., act, relu_up, q8_act, idx, n_active, predictor_seconds, y,
#              scratch, scratch_bytes, n_threads, isa)
_PREDICT_FFN_ARGTYPES = (
    (_ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _i32, _i64, _ptr, _i64, _i32, ctypes.c_float)
    + (_ptr, _i64, _i32) * 3
    + (_i32, _i32, _i32, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i32, _i32)
)
# cats_ffn (u, K, D, N, gate, gate_stride, gate_kind, up, .., down_t, .., cand, C, thresholds, out_thresholds,
#           act, relu_up, q8_act, idx, n_active, n_up, y, scratch, scratch_bytes, n_threads, isa)
_CATS_FFN_ARGTYPES = (
    (_ptr, _i64, _i64, _i64)
    + (_ptr, _i64, _i32) * 3
    + (_ptr, _i64, _ptr, _ptr, _i32, _i32, _i32, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i32, _i32)
)
# attn_prefill (q, k, v, rope, k_cache, v_cache, type_k, type_v, n_ctx, pos, T, H, H_kv, D, scale, out, neox,
#               n_threads, isa)
_ATTN_PREFILL_ARGTYPES = (_ptr,) * 6 + (_i32, _i32) + (_i64,) * 6 + (ctypes.c_float, _ptr, _i32, _i32, _i32)
# attn_decode_batch (q, k, v, rope, k_cache, v_cache, type_k, type_v, n_seq, n_ctx, seqs, pos, B, H, H_kv, D, scale,
#                    out, neox, n_threads, isa)
_ATTN_DECODE_BATCH_ARGTYPES = (
    (_ptr,) * 6
    + (_i32, _i32, _i64, _i64, _ptr, _ptr)
    + (_i64,) * 4
    + (ctypes.c_float, _ptr, _i32, _i32, _i32)
)
# attn_decode (q, k, v, rope, k_cache, v_cache, type_k, type_v, n_ctx, pos, H, H_kv, D, scale, out, scratch,
#              scratch_bytes, neox, n_threads, isa)
_ATTN_DECODE_ARGTYPES = (
    (_ptr,) * 6 + (_i32, _i32) + (_i64,) * 5 + (ctypes.c_float, _ptr, _ptr, _i64, _i32, _i32, _i32)
)
# quantize_rows (ggml_type, src, n_rows, n_cols, dst, n_threads): float rows -> blocks (kernels/cpu/quantize_k.c)
_QUANTIZE_ROWS_ARGTYPES = (_i32, _ptr, _i64, _i64, _ptr, _i32)
# attn_block and teal_layer (desc, x, k_cache, v_cache, type_k, type_v, n_ctx, pos, rope, scratch, scratch_bytes, q8,
#                             n_threads, isa)
_ATTN_BLOCK_ARGTYPES = (_ptr,) * 4 + (_i32, _i32, _i64, _i64, _ptr, _ptr, _i64, _i32, _i32, _i32)
# ffn_block and sparse_ffn_block (desc, x, scratch, scratch_bytes, q8, n_threads, isa)
_FFN_BLOCK_ARGTYPES = (_ptr, _ptr, _ptr, _i64, _i32, _i32, _i32)
# cats_ffn_block (desc, x, dense, scratch, scratch_bytes, q8, n_threads, isa)
_CATS_FFN_BLOCK_ARGTYPES = (_ptr, _ptr, _i32, _ptr, _i64, _i32, _i32, _i32)
# moe_experts (desc, xn, ids, weights, k, y, scratch, scratch_bytes, q8, n_threads, isa)
_MOE_EXPERTS_ARGTYPES = (_ptr,) * 4 + (_i64, _ptr, _ptr, _i64, _i32, _i32, _i32)
# moe_route (logits, T, n, k, gating, norm, scale, ids, weights)
_MOE_ROUTE_ARGTYPES = (_ptr, _i64, _i64, _i64, _i32, _i32, ctypes.c_float, _ptr, _ptr)
# moe_ffn_block (desc, x, logits or NULL, ids_out or NULL, scratch, scratch_bytes, q8, n_threads, isa)
_MOE_FFN_BLOCK_ARGTYPES = (_ptr,) * 5 + (_i64, _i32, _i32, _i32)
# grouped_matmul (matmul kernel, w, w_stride, n_rows, K, n_expert, x, N, experts, counts, n_groups, y, n_threads,
#                 isa)
_GROUPED_MATMUL_ARGTYPES = (
    _ptr,
    _ptr,
    _i64,
    _i64,
    _i64,
    _i64,
    _ptr,
    _i64,
    _ptr,
    _ptr,
    _i64,
    _ptr,
    _i32,
    _i32,
)
# moe_grouped_ffn (desc, gate matmul, up matmul, down matmul, x, T, ids, weights, out, n_threads, isa)
_MOE_GROUPED_FFN_ARGTYPES = (_ptr,) * 5 + (_i64, _ptr, _ptr, _ptr, _i32, _i32)
# rms_norm (x, T, D, x_stride, w or NULL, eps, out, out_stride)
_RMS_NORM_ARGTYPES = (_ptr, _i64, _i64, _i64, _ptr, ctypes.c_float, _ptr, _i64)


@dataclass(frozen=True, eq=False)
class Library:
    """ctypes handles of the built kernels, resolved once per process.

    matmul / rows_matmul: int8 activations for the quant types ("q8" precision; the exact kernel for the others);
    matmul_f / rows_matmul_f: float activations ("f32" precision) for every type.
    """

    path: str
    isa_best: int  # the best level this CPU runs (an index into ISA_NAMES)
    matmul: Mapping[GGMLType, Any]
    matmul_f: Mapping[GGMLType, Any]
    get_rows: Mapping[GGMLType, Any]
    rows_matmul: Mapping[GGMLType, Any]
    rows_matmul_f: Mapping[GGMLType, Any]
    rows_axpy: Mapping[GGMLType, Any]
    ffn_rows: Any  # fused decode FFN over a row list (one token)
    predict_ffn: Any  # predictor + fused decode FFN (one token)
    cats_ffn: Any  # dense gate, threshold on |act(gate)|, active up/down rows (one token)
    attn_decode: Any  # RoPE + KV write + attention of one token
    attn_prefill: Any  # the same for T consecutive tokens of one sequence, each as attn_decode computes it
    attn_decode_batch: Any  # the same for one token of each of B sequences
    ffn_rows_scratch_bytes: Any
    predict_ffn_scratch_bytes: Any
    cats_ffn_scratch_bytes: Any
    attn_decode_scratch_bytes: Any
    # float32 rows -> blocks of the types our C produces (types_where(producer="c")), bit-exact with llama.cpp's quantizers (no imatrix)
    quantize_rows: Any
    # fused decode blocks of one token (kernels/cpu/layer.c) and RMSNorm
    attn_block: Any
    ffn_block: Any
    sparse_ffn_block: (
        Any  # predictor + sparse FFN block of one token (norm, residual add, the layer's counters)
    )
    cats_ffn_block: Any  # CATS FFN block of one token (norm, residual add, the layer's counters)
    attn_block_scratch_bytes: Any
    teal_layer: (
        Any  # a TEAL layer of one token (transposed input-sparse matrices, attention, both residual adds)
    )
    teal_layer_scratch_bytes: Any
    ffn_block_scratch_bytes: Any
    cats_ffn_block_scratch_bytes: Any
    sparse_ffn_block_scratch_bytes: Any
    rms_norm: Any
    moe_experts: Any  # one token's selected experts of a MoE FFN (kernels/cpu/moe.c)
    moe_experts_scratch_bytes: Any
    moe_route: Any  # router logits -> top-k experts and weights (the decode block's routing)
    moe_ffn_block: Any  # one token's MoE FFN block: norm, router, routing, experts, residual add
    moe_ffn_block_scratch_bytes: Any
    grouped_matmul: (
        Any  # a matmul kernel over a prompt's tokens grouped by expert, the groups shared by the threads
    )
    moe_grouped_ffn: Any  # a prompt's MoE experts, tokens grouped by expert, in one call
    gated: Any  # h = act(g) * up, the fused kernels' gating
    top_k: Any  # the k largest of a vector, in index order (kernels/cpu/select.c)
    top_about_k: Any  # about k of the largest, by a sampled threshold
    decode_stack: Any  # every layer's fused blocks for one token (kernels/cpu/layer.c)
    decode_stack_tokens: Any  # a few tokens of one sequence through dense layers
    decode_stack_tokens_scratch_bytes: Any
    head_t1: Any  # the sparse output head's chain for one token (kernels/cpu/head.c)
    head_pick: Any  # its rows for one token of a step whose screen was computed over all tokens
    head_scratch_bytes: Any
    head_ids_room: Any
    repack_rows8: Any  # a matrix's rows repacked by 8 (kernels/cpu/matmul.c; the registry's rows8 types)
    matvec_rows8: Any  # one token over them, the q8 precision


def _symbol(lib: ctypes.CDLL, name: str, argtypes: tuple[Any, ...], restype: Any = _i32) -> Any:
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _open(path: str) -> Library:
    lib = ctypes.CDLL(path)
    matmul, matmul_f, get_rows, rows_matmul, rows_matmul_f, rows_axpy = {}, {}, {}, {}, {}, {}
    for ggml_type, name in C_NAMES.items():
        # "q8" precision: int8 kernels for the quant types, the float ones for the rest; "f32": the exact ones
        f32_suffix = "_f" if ggml_type in QUANT_TYPES else ""
        matmul[ggml_type] = _symbol(lib, f"pi_matmul_{name}", _MATMUL_ARGTYPES)
        matmul_f[ggml_type] = _symbol(lib, f"pi_matmul_{name}{f32_suffix}", _MATMUL_ARGTYPES)
        get_rows[ggml_type] = _symbol(lib, f"pi_get_rows_{name}", _GET_ROWS_ARGTYPES)
        rows_matmul[ggml_type] = _symbol(lib, f"pi_rows_matmul_{name}", _SPARSE_ARGTYPES)
        rows_matmul_f[ggml_type] = _symbol(lib, f"pi_rows_matmul_{name}{f32_suffix}", _SPARSE_ARGTYPES)
        rows_axpy[ggml_type] = _symbol(lib, f"pi_rows_axpy_{name}", _AXPY_ARGTYPES)
    for ggml_type, name in K_TYPES.items():
        get_rows[ggml_type] = _symbol(lib, f"pi_get_rows_{name}", _GET_ROWS_ARGTYPES)
        matmul[ggml_type] = _symbol(lib, f"pi_matmul_{name}", _MATMUL_ARGTYPES)
        matmul_f[ggml_type] = _symbol(lib, f"pi_matmul_{name}_f", _MATMUL_ARGTYPES)
    for ggml_type, name in K_TYPES.items():  # sparse rows: the exact kernel of both precisions
        if ggml_type in K_SPARSE_TYPES:
            rows_matmul[ggml_type] = rows_matmul_f[ggml_type] = _symbol(
                lib, f"pi_rows_matmul_{name}_f", _SPARSE_ARGTYPES
            )
            rows_axpy[ggml_type] = _symbol(lib, f"pi_rows_axpy_{name}", _AXPY_ARGTYPES)
    return Library(
        path=path,
        isa_best=min(int(_symbol(lib, "pi_kernels_isa_best", ())()), isa_ceiling(platform.machine())),
        matmul=MappingProxyType(matmul),
        matmul_f=MappingProxyType(matmul_f),
        get_rows=MappingProxyType(get_rows),
        rows_matmul=MappingProxyType(rows_matmul),
        rows_matmul_f=MappingProxyType(rows_matmul_f),
        rows_axpy=MappingProxyType(rows_axpy),
        ffn_rows=_symbol(lib, "pi_ffn_rows", _FFN_ROWS_ARGTYPES),
        predict_ffn=_symbol(lib, "pi_predict_ffn", _PREDICT_FFN_ARGTYPES),
        cats_ffn=_symbol(lib, "pi_cats_ffn", _CATS_FFN_ARGTYPES),
        attn_decode=_symbol(lib, "pi_attn_decode", _ATTN_DECODE_ARGTYPES),
        attn_prefill=_symbol(lib, "pi_attn_prefill", _ATTN_PREFILL_ARGTYPES),
        attn_decode_batch=_symbol(lib, "pi_attn_decode_batch", _ATTN_DECODE_BATCH_ARGTYPES),
        ffn_rows_scratch_bytes=_symbol(lib, "pi_ffn_rows_scratch_bytes", (_i64, _i64, _i32), _i64),
        predict_ffn_scratch_bytes=_symbol(
            lib, "pi_predict_ffn_scratch_bytes", (_i64, _i64, _i64, _i32), _i64
        ),
        cats_ffn_scratch_bytes=_symbol(lib, "pi_cats_ffn_scratch_bytes", (_i64, _i64, _i32), _i64),
        attn_decode_scratch_bytes=_symbol(lib, "pi_attn_decode_scratch_bytes", (_i64, _i64), _i64),
        quantize_rows=_symbol(lib, "pi_quantize_rows", _QUANTIZE_ROWS_ARGTYPES),
        attn_block=_symbol(lib, "pi_attn_block", _ATTN_BLOCK_ARGTYPES),
        ffn_block=_symbol(lib, "pi_ffn_block", _FFN_BLOCK_ARGTYPES),
        sparse_ffn_block=_symbol(lib, "pi_sparse_ffn_block", _FFN_BLOCK_ARGTYPES),
        cats_ffn_block=_symbol(lib, "pi_cats_ffn_block", _CATS_FFN_BLOCK_ARGTYPES),
        attn_block_scratch_bytes=_symbol(lib, "pi_attn_block_scratch_bytes", (_i64,) * 5, _i64),
        teal_layer=_symbol(lib, "pi_teal_layer", _ATTN_BLOCK_ARGTYPES),
        teal_layer_scratch_bytes=_symbol(lib, "pi_teal_layer_scratch_bytes", (_i64,) * 6, _i64),
        cats_ffn_block_scratch_bytes=_symbol(lib, "pi_cats_ffn_block_scratch_bytes", (_i64, _i64), _i64),
        ffn_block_scratch_bytes=_symbol(lib, "pi_ffn_block_scratch_bytes", (_i64, _i64), _i64),
        sparse_ffn_block_scratch_bytes=_symbol(lib, "pi_sparse_ffn_block_scratch_bytes", (_i64,) * 3, _i64),
        rms_norm=_symbol(lib, "pi_rms_norm", _RMS_NORM_ARGTYPES),
        moe_experts=_symbol(lib, "pi_moe_experts", _MOE_EXPERTS_ARGTYPES),
        moe_experts_scratch_bytes=_symbol(lib, "pi_moe_experts_scratch_bytes", (_i64,) * 3, _i64),
        moe_route=_symbol(lib, "pi_moe_route", _MOE_ROUTE_ARGTYPES),
        moe_ffn_block=_symbol(lib, "pi_moe_ffn_block", _MOE_FFN_BLOCK_ARGTYPES),
        moe_ffn_block_scratch_bytes=_symbol(lib, "pi_moe_ffn_block_scratch_bytes", (_i64,) * 4, _i64),
        grouped_matmul=_symbol(lib, "pi_grouped_matmul", _GROUPED_MATMUL_ARGTYPES),
        moe_grouped_ffn=_symbol(lib, "pi_moe_grouped_ffn", _MOE_GROUPED_FFN_ARGTYPES),
        gated=_symbol(lib, "pi_gated", (_ptr, _ptr, _i64, _i32, _i32, _ptr)),
        top_k=_symbol(lib, "pi_top_k", (_ptr, _i64, _i64, _ptr, _ptr, _ptr)),
        top_about_k=_symbol(lib, "pi_top_about_k", (_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i32)),
        decode_stack=_symbol(
            lib, "pi_decode_stack", (_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i32, _i32, _i32)
        ),
        decode_stack_tokens=_symbol(
            lib, "pi_decode_stack_tokens", (_ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _i32, _i32)
        ),
        decode_stack_tokens_scratch_bytes=_symbol(
            lib, "pi_decode_stack_tokens_scratch_bytes", (_ptr, _ptr, _i64, _i64), _i64
        ),
        head_t1=_symbol(lib, "pi_head_t1", (_ptr,) * 7 + (_i64, _i32, _i32)),
        head_pick=_symbol(lib, "pi_head_pick", (_ptr,) * 6 + (_i64, _i32, _i32)),
        head_scratch_bytes=_symbol(lib, "pi_head_scratch_bytes", (_ptr,), _i64),
        head_ids_room=_symbol(lib, "pi_head_ids_room", (_ptr,), _i64),
        repack_rows8=_symbol(lib, "pi_repack_rows8", (_i32, _ptr, _i64, _i64, _i64, _ptr)),
        matvec_rows8=_symbol(lib, "pi_matvec_rows8", (_i32, _ptr, _i64, _i64, _ptr, _ptr, _i32, _i32)),
    )


def _load() -> Library | None:
    try:
        spec = importlib.util.find_spec("powerinfer._kernels")
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        warnings.warn(
            "powerinfer._kernels is not built: ops run the slow pure-torch reference (build it with `pip install -e .`)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    try:
        library = _open(spec.origin)
    except (OSError, AttributeError) as exc:
        warnings.warn(
            f"cannot load {spec.origin} ({exc}): ops run the slow pure-torch reference (rebuild it with "
            "`pip install -e .`)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    log.debug("loaded kernels from %s (best SIMD variant %s)", spec.origin, ISA_NAMES[library.isa_best])
    return library


@functools.cache
def load() -> Library | None:
    """The kernels, loaded on first use (once per process); None when the extension is missing (warns once)."""
    return _load()


def kernels_available() -> bool:
    """True when the C kernels are built and loaded."""
    return load() is not None


def isa_best() -> str | None:
    """The best SIMD variant of the kernels on this CPU ("scalar", "avx2", "avx512"); None without kernels."""
    library = load()
    return None if library is None else ISA_NAMES[library.isa_best]


def check_status(
    status: int, op: str, scratch_bytes: int = 0, scratch_needed: int = 0, sizer: str = ""
) -> NoReturn:
    """Raise the Python error of a kernel's non-zero status (for PI_ERR_SCRATCH: the buffer's size, the size
    needed and the ops function that computes it)."""
    if status == PI_ERR_INDEX:
        raise IndexError(f"{op}: row id out of range")
    if status == PI_ERR_ALLOC:
        raise MemoryError(f"{op}: scratch allocation failed")
    if status == PI_ERR_SCRATCH:
        raise ValueError(
            f"{op}: scratch buffer of {scratch_bytes} bytes is too small, {scratch_needed} bytes needed "
            f"(size it with powerinfer.ops.{sizer})"
        )
    raise ValueError(f"{op}: kernel rejected the arguments (status {status})")
