"""Dense ops: y = x @ W.T (`linear`) and the embedding lookup (`get_rows`).

Kernel types (`KernelContext.supported_types()`) are computed by the C kernels from the raw bytes. Other types
(K-quants, ...) and contexts without kernels use `powerinfer.ops.reference`; a non-kernel type is decoded to a
float32 copy on first use, cached on the QWeight.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from powerinfer.ops import library, reference
from powerinfer.ops.context import KernelContext, default_context
from powerinfer.ops.library import check_status
from powerinfer.quant import KERNEL_TYPES

if TYPE_CHECKING:
    from powerinfer.ops.qweight import OnDeviceWeight, QWeight

__all__ = ["get_rows", "linear"]


def dense_cached(w: QWeight) -> torch.Tensor:
    """The whole weight decoded to float32 (N, K), decoded once and kept on the weight."""
    dense = w._dense.get("f32")
    if dense is None:
        dense = w._dense["f32"] = reference.dense(w)
    return dense


def output(x: torch.Tensor, n_out: int) -> tuple[int, torch.Tensor]:
    """Token count of a (T, K) or (K,) input and an empty float32 output (T, n_out) or (n_out,)."""
    if x.dim() == 2:
        return x.shape[0], torch.empty(x.shape[0], n_out, dtype=torch.float32)
    return 1, torch.empty(n_out, dtype=torch.float32)


def _linear_fallback(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    if w.ggml_type in KERNEL_TYPES:
        return reference.linear(x, w)
    return x.to(torch.float32) @ dense_cached(w).to(x.device).T


def linear(x: torch.Tensor, w: QWeight | OnDeviceWeight, kc: KernelContext | None = None) -> torch.Tensor:
    """y = x @ W.T for x of shape (..., K) float32; returns (..., N) float32 (T = 1 is the decode matvec).

    A device weight (ops.weights.DeviceWeight) computes on its own device and returns the result there.
    """
    # lean path: about 200 calls per token, so every attribute access here counts
    if kc is None:
        kc = default_context()
    if w.on_device:
        return w.linear(x, kc)
    n_rows, n_cols = w.shape
    kernel = kc.kernels.matmul.get(w.ggml_type)
    if kernel is None or not x.is_cpu:
        if x.shape[-1] != n_cols:
            raise ValueError(f"linear: x has {x.shape[-1]} features, weight {w.shape} expects {n_cols}")
        return _linear_fallback(x, w)
    ndim = x.dim()
    if x.dtype is not torch.float32 or not x.is_contiguous() or ndim > 2:
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()  # (T, K)
        return linear(x2, w, kc).view(*x.shape[:-1], n_rows)
    if x.shape[-1] != n_cols:
        raise ValueError(f"linear: x has {x.shape[-1]} features, weight {w.shape} expects {n_cols}")
    n_tokens, y = output(x, n_rows)
    status = kernel(
        w._raw_ptr, w._raw_stride, n_rows, n_cols, x.data_ptr(), n_cols, n_tokens, y.data_ptr(), n_rows,
        kc.threads_now, kc.level,
    )  # fmt: skip
    if status:
        check_status(status, "linear")
    return y


def get_rows(w: QWeight, ids: torch.Tensor, kc: KernelContext | None = None) -> torch.Tensor:
    """Rows `ids` (int64 token ids) of W decoded to float32: shape ids.shape + (K,)."""
    if kc is None:
        kc = default_context()
    kernel = kc.kernels.get_rows.get(w.ggml_type)
    if kernel is None:
        if w.ggml_type in KERNEL_TYPES:
            return reference.get_rows(w, ids.reshape(-1)).view(*ids.shape, w.shape[1])
        return dense_cached(w)[ids.to(torch.int64)]
    flat = ids
    if ids.dtype is not torch.int64 or ids.dim() != 1 or not ids.is_contiguous() or not ids.is_cpu:
        flat = ids.to(device="cpu", dtype=torch.int64).reshape(-1).contiguous()  # (n_ids,)
    n_ids, n_cols = flat.shape[0], w.shape[1]
    y = torch.empty(n_ids, n_cols, dtype=torch.float32)
    status = kernel(
        w._raw_ptr, w._raw_stride, w.shape[0], n_cols, flat.data_ptr(), n_ids, y.data_ptr(), n_cols,
        kc.threads_now, kc.level,
    )  # fmt: skip
    if status:
        check_status(status, "get_rows")
    return y if ids.dim() == 1 else y.view(*ids.shape, n_cols)


def top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, float]:
    """The indices (k,) int64 of the k largest of values (n,) float32, in increasing index order (ties: lower
    indices first; NaN smallest), and the largest value left out (-inf when k == n). The C kernel; torch's topk
    (then sorted by index) without it."""
    n = values.shape[0]
    if not 0 < k <= n or values.dim() != 1:
        raise ValueError(f"top_k: k = {k} of {tuple(values.shape)}")
    lib = library.load()
    if lib is None or not values.is_cpu or values.dtype is not torch.float32:
        keys = torch.nan_to_num(values.float(), nan=float("-inf"))
        top = keys.topk(min(k + 1, n))
        ids = top.indices[:k].sort().values
        return ids, float(top.values[k]) if k < n else float("-inf")
    values = values.contiguous()
    ids = torch.empty(k, dtype=torch.int64)
    scratch = torch.empty(n, dtype=torch.float32)
    left = ctypes.c_float()
    status = lib.top_k(values.data_ptr(), n, k, ids.data_ptr(), ctypes.byref(left), scratch.data_ptr())
    if status:
        check_status(status, "top_k")
    return ids, float(left.value)


def top_about_k(values: torch.Tensor, k: int, isa: int | None = None) -> tuple[torch.Tensor, float]:
    """About k of the largest of values (n,) float32, for a set of large values and the largest value left out:
    the indices (m,) int64 in increasing order of every value >= a threshold taken from every 16th value (its
    ceil(k / 16)-th largest), m at most 4k (else exactly top_k's k), and the largest value below (-inf when
    none). Depends only on the values (and not on isa, the SIMD level of the pass: the best by default). top_k
    where the kernels are missing."""
    n = values.shape[0]
    if not 0 < k <= n or values.dim() != 1:
        raise ValueError(f"top_about_k: k = {k} of {tuple(values.shape)}")
    lib = library.load()
    if lib is None or not values.is_cpu or values.dtype is not torch.float32:
        return top_k(values, k)
    values = values.contiguous()
    ids = torch.empty(4 * k, dtype=torch.int64)
    scratch = torch.empty(n, dtype=torch.float32)
    m, left = ctypes.c_int64(), ctypes.c_float()
    status = lib.top_about_k(
        values.data_ptr(), n, k, ids.data_ptr(), ctypes.byref(m), ctypes.byref(left), scratch.data_ptr(),
        lib.isa_best if isa is None else isa,
    )  # fmt: skip
    if status:
        check_status(status, "top_about_k")
    return ids[: m.value], float(left.value)
