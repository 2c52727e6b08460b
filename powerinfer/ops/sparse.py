"""Sparse FFN ops over a subset of neurons (rows), with pure-torch references.

`rows_matmul` computes selected rows of W x (gate/up for the active neurons); `rows_axpy` accumulates selected
rows of a transposed down projection scaled by their activations. Rows are given as an int64 index tensor, so the
Python work per call is constant whatever the number of neurons.

Both run the C kernels of kernels/cpu/sparse.c for F32, F16, Q4_0, Q4_1 and Q8_0 weights:
- rows_matmul uses the dense matmul's arithmetic for the current activation precision (`ops.set_activation_
  precision`), so with idx = all rows it is bit-identical to `ops.linear`. Only the selected rows are read.
- rows_axpy decodes rows in registers to float32 (exact for every activation precision) and sums each output
  element in index order over the rows with h != 0; threads split the output dimension, so the result does not
  depend on the thread count (the original reduces per-thread buffers racily, spec 4.3).
`ffn_rows` is the whole CPU FFN of one token over a row list in one kernel call (one parallel region): gate and
up rows, ReLU * mul, then the down rows; bit-identical to the three calls above plus the torch ReLU/mul.
Other weight types, non-CPU tensors and `ops.use_kernels(False)` use the references below. When the extension is
not built, the first sparse op that falls back for that reason warns once.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import TYPE_CHECKING

import torch

from powerinfer import ops as _ops
from powerinfer.quant import dequantize

if TYPE_CHECKING:
    from powerinfer.ops import QWeight

__all__ = [
    "decode_rows",
    "ffn_rows",
    "ffn_rows_ref",
    "predict_ffn",
    "rows_axpy",
    "rows_axpy_ref",
    "rows_matmul",
    "rows_matmul_ref",
]

_settings = _ops._settings
_warned_missing = False


def decode_rows(w: QWeight, idx: torch.Tensor | None) -> torch.Tensor:
    """Rows idx of W (all rows when idx is None) decoded to float32, shape (M, K)."""
    raw = w.raw if idx is None else w.raw[idx]
    n = raw.shape[0]
    if n == 0:  # the numpy dequantisers reject empty block arrays
        return torch.zeros(0, w.shape[1], dtype=torch.float32)
    return torch.from_numpy(dequantize(raw.numpy(), w.ggml_type, (n, w.shape[1])).copy())


def rows_matmul_ref(x: torch.Tensor, w: QWeight, idx: torch.Tensor) -> torch.Tensor:
    """y[t, m] = W[idx[m]] . x[t]; x (T, K) float32 -> (T, M)."""
    return x @ decode_rows(w, idx).T


def rows_axpy_ref(h: torch.Tensor, w_t: QWeight, idx: torch.Tensor | None) -> torch.Tensor:
    """y[t] = sum_m h[t, m] * W_t[idx[m]]; h (T, M), W_t (N, D) -> (T, D). idx None means all rows."""
    return h @ decode_rows(w_t, idx)


def _note_fallback() -> None:
    global _warned_missing
    if _ops._KERNELS is None and not _warned_missing:
        _warned_missing = True
        warnings.warn(
            "powerinfer._kernels is not built: sparse FFN ops run the slow pure-torch reference "
            "(build it with `pip install -e .`)",
            RuntimeWarning,
            stacklevel=3,
        )


def _as_idx(idx: torch.Tensor) -> torch.Tensor:
    if idx.dtype is not torch.int64 or idx.dim() != 1 or not idx.is_contiguous() or not idx.is_cpu:
        idx = idx.to(device="cpu", dtype=torch.int64).reshape(-1).contiguous()
    return idx


def rows_matmul(x: torch.Tensor, w: QWeight, idx: torch.Tensor) -> torch.Tensor:
    """Selected rows of W times x: (T, K) -> (T, M) ((K,) -> (M,))."""
    kernel = _settings.rows_matmul.get(w.ggml_type)
    n_cols = w.shape[1]
    if x.shape[-1] != n_cols:
        raise ValueError(f"rows_matmul: x has {x.shape[-1]} features, weight {w.shape} expects {n_cols}")
    if kernel is None or not x.is_cpu or x.dim() > 2:
        _note_fallback()
        return rows_matmul_ref(x.to(torch.float32), w, idx)
    if x.dtype is not torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    idx = _as_idx(idx)
    n_sel = idx.shape[0]
    n_tokens, y = _ops._output(x, n_sel)
    status = kernel(
        w._raw_ptr,
        w._raw_stride,
        w.shape[0],
        n_cols,
        idx.data_ptr(),
        n_sel,
        x.data_ptr(),
        n_cols,
        n_tokens,
        y.data_ptr(),
        n_sel,
        _settings.n_threads,
    )
    if status:
        _ops._check_status(status, "rows_matmul")
    return y


def rows_axpy(h: torch.Tensor, w_t: QWeight, idx: torch.Tensor | None) -> torch.Tensor:
    """Sum of selected rows of W_t weighted by h: (T, M) -> (T, D) ((M,) -> (D,)); rows with h == 0 contribute
    nothing. idx None means all N rows (the dense down projection of a transposed ffn_down)."""
    kernel = _settings.rows_axpy.get(w_t.ggml_type)
    n_rows, n_out = w_t.shape
    if idx is not None:
        idx = _as_idx(idx)
    n_sel = n_rows if idx is None else idx.shape[0]
    if h.shape[-1] != n_sel:
        raise ValueError(f"rows_axpy: h has {h.shape[-1]} activations for {n_sel} rows")
    if kernel is None or not h.is_cpu or h.dim() > 2:
        _note_fallback()
        return rows_axpy_ref(h.to(torch.float32), w_t, idx)
    if h.dtype is not torch.float32 or not h.is_contiguous():
        h = h.to(torch.float32).contiguous()
    if n_sel == 0:  # an empty idx may have no data pointer (NULL would mean "all rows")
        return torch.zeros(*h.shape[:-1], n_out, dtype=torch.float32)
    n_tokens, y = _ops._output(h, n_out)
    status = kernel(
        w_t._raw_ptr,
        w_t._raw_stride,
        n_rows,
        n_out,
        None if idx is None else idx.data_ptr(),
        n_sel,
        h.data_ptr(),
        n_sel,
        n_tokens,
        y.data_ptr(),
        n_out,
        _settings.n_threads,
    )
    if status:
        _ops._check_status(status, "rows_axpy")
    return y


def _relu_mul(g: torch.Tensor, up: torch.Tensor, relu_up: bool) -> torch.Tensor:
    return torch.relu(g).mul_(torch.relu(up) if relu_up else up)


def ffn_rows_ref(
    u: torch.Tensor, gate: QWeight, up: QWeight, down_t: QWeight, idx: torch.Tensor, relu_up: bool
) -> torch.Tensor:
    """sum_j h_j * down_t[idx_j] with h = relu(gate[idx] . u) * (relu(up[idx] . u) if relu_up else up[idx] . u);
    u (K,) -> (D,), (T, K) -> (T, D)."""
    u = u.to(torch.float32)
    h = _relu_mul(rows_matmul_ref(u, gate, idx), rows_matmul_ref(u, up, idx), relu_up)
    return rows_axpy_ref(h, down_t, idx)


def ffn_rows(
    u: torch.Tensor, gate: QWeight, up: QWeight, down_t: QWeight, idx: torch.Tensor, relu_up: bool
) -> torch.Tensor:
    """FFN output of the neurons idx for one token: u (K,) -> (D,), or (1, K) -> (1, D).

    gate and up are (N, K), down_t is (N, D) (the transposed down projection). One kernel call when the three
    weights are kernel types; otherwise, and for T > 1, the unfused ops (rows_matmul, ReLU * mul, rows_axpy),
    whose result the kernel reproduces bit for bit.
    """
    kinds = _settings.ffn_kinds
    gate_kind, up_kind, down_kind = (
        kinds.get(gate.ggml_type),
        kinds.get(up.ggml_type),
        kinds.get(down_t.ggml_type),
    )
    n_rows, n_cols = gate.shape
    n_out = down_t.shape[1]
    if u.shape[-1] != n_cols:
        raise ValueError(f"ffn_rows: u has {u.shape[-1]} features, gate {gate.shape} expects {n_cols}")
    if up.shape != gate.shape or down_t.shape[0] != n_rows:
        raise ValueError(f"ffn_rows: gate {gate.shape}, up {up.shape} and down_t {down_t.shape} do not match")
    one_token = u.dim() == 1 or (u.dim() == 2 and u.shape[0] == 1)
    if gate_kind is None or up_kind is None or down_kind is None or not u.is_cpu or not one_token:
        h = _relu_mul(rows_matmul(u, gate, idx), rows_matmul(u, up, idx), relu_up)
        return rows_axpy(h, down_t, idx)
    if u.dtype is not torch.float32 or not u.is_contiguous():
        u = u.to(torch.float32).contiguous()
    idx = _as_idx(idx)
    y = torch.empty(*u.shape[:-1], n_out, dtype=torch.float32)
    status = _settings.ffn_rows(
        u.data_ptr(), n_cols, n_out, n_rows,
        gate._raw_ptr, gate._raw_stride, gate_kind,
        up._raw_ptr, up._raw_stride, up_kind,
        down_t._raw_ptr, down_t._raw_stride, down_kind,
        idx.data_ptr(), idx.shape[0], bool(relu_up), _settings.act == "q8", y.data_ptr(), _settings.n_threads,
    )  # fmt: skip
    if status:
        _ops._check_status(status, "ffn_rows")
    return y


def predict_ffn(
    x: torch.Tensor,
    u: torch.Tensor,
    fc1: QWeight,
    fc2: QWeight,
    threshold: float,
    gate: QWeight,
    up: QWeight,
    down_t: QWeight,
    relu_up: bool,
) -> tuple[torch.Tensor, int, float] | None:
    """Predictor and sparse FFN of one token in one kernel call; None where the kernel does not apply.

    x (1, K) is the predictor's input (pre-norm residual), u (1, K) the FFN's. Returns y (1, D), the number of
    active neurons and the predictor's share of the time in seconds. Bit-identical to
    `ffn_rows(u, gate, up, down_t, nonzero(linear(relu(linear(x, fc1)), fc2) >= threshold))` in f32 precision;
    applies only there, to kernel types, on the CPU.
    """
    kernel = _settings.predict_ffn
    kinds = _settings.ffn_kinds
    codes = [kinds.get(w.ggml_type) for w in (fc1, fc2, gate, up, down_t)]
    if kernel is None or None in codes or not (x.is_cpu and u.is_cpu) or x.shape[0] != 1 or u.shape[0] != 1:
        return None
    n_rows, n_cols = gate.shape
    rank = fc1.shape[0]
    if (
        fc1.shape[1] != n_cols
        or fc2.shape != (n_rows, rank)
        or up.shape != gate.shape
        or down_t.shape[0] != n_rows
    ):
        raise ValueError(
            f"predict_ffn: fc1 {fc1.shape}, fc2 {fc2.shape}, gate {gate.shape}, up {up.shape} and down_t "
            f"{down_t.shape} do not match"
        )
    x = x.to(torch.float32).contiguous()
    u = u.to(torch.float32).contiguous()
    n_out = down_t.shape[1]
    idx = torch.empty(n_rows, dtype=torch.int64)
    y = torch.empty(1, n_out, dtype=torch.float32)
    n_active = ctypes.c_int64()
    seconds = ctypes.c_double()
    status = kernel(
        x.data_ptr(), u.data_ptr(), n_cols, n_out, n_rows,
        fc1._raw_ptr, fc1._raw_stride, codes[0], rank,
        fc2._raw_ptr, fc2._raw_stride, codes[1], threshold,
        gate._raw_ptr, gate._raw_stride, codes[2],
        up._raw_ptr, up._raw_stride, codes[3],
        down_t._raw_ptr, down_t._raw_stride, codes[4],
        bool(relu_up), idx.data_ptr(), ctypes.byref(n_active), ctypes.byref(seconds), y.data_ptr(),
        _settings.n_threads,
    )  # fmt: skip
    if status:
        _ops._check_status(status, "predict_ffn")
    return y, int(n_active.value), float(seconds.value)
