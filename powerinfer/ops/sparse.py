"""Sparse FFN ops over a subset of neurons (rows), with pure-torch references.

`rows_matmul` computes selected rows of W x (gate/up for the active neurons); `rows_axpy` accumulates selected
rows of a transposed down projection scaled by their activations. Rows are given as an int64 index tensor, so the
Python work per call is constant whatever the number of neurons.

Both run the C kernels of kernels/cpu/sparse.c for every kernel type:
- rows_matmul uses the dense matmul's arithmetic for the context's activation precision, so with idx = all rows
  it is bit-identical to `linear`. Only the selected rows are read.
- rows_axpy decodes rows in registers to float32 (exact for every activation precision) and sums each output
  element in index order over the rows with h != 0; threads split the output dimension, so the result does not
  depend on the thread count (the original reduces per-thread buffers racily, spec 4.3).
`ffn_rows` is the whole CPU FFN of one token over a row list in one kernel call (one parallel region): gate and
up rows, the gating act(g) * up, then the down rows; bit-identical to the three calls above plus the torch
gating for ReLU, within a few float32 ulps of it for the other activations (`powerinfer.ops.activation`).
`predict_ffn` adds the predictor in front. `cats_ffn` is the thresholded FFN of CATS (training-free sparsity for
SiLU/GELU models): the gate rows of every candidate neuron, then the up and down rows of the neurons whose
|act(gate)| exceeds the layer's threshold; one kernel call for one token. Both work in a caller-owned scratch buffer (`ffn_scratch_bytes`).
Other weight types, non-CPU tensors and contexts without kernels use the references below.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from powerinfer.ops import activation, library
from powerinfer.ops.activation import activation_code, gated, gated_ref
from powerinfer.ops.context import KernelContext, default_context
from powerinfer.ops.dense import linear, output
from powerinfer.ops.library import check_status
from powerinfer.quant import K_QUANT_TYPES, dequantize

if TYPE_CHECKING:
    from powerinfer.ops.qweight import QWeight

__all__ = [
    "CATS_DENSE_UNION_SHARE",
    "cats_ffn",
    "cats_ffn_ref",
    "cats_scratch_bytes",
    "cats_thresholds",
    "decode_rows",
    "ffn_rows",
    "ffn_rows_ref",
    "ffn_scratch_bytes",
    "predict_ffn",
    "rows_axpy",
    "rows_axpy_ref",
    "rows_matmul",
    "rows_matmul_ref",
]


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


def _as_idx(idx: torch.Tensor) -> torch.Tensor:
    if idx.dtype is not torch.int64 or idx.dim() != 1 or not idx.is_contiguous() or not idx.is_cpu:
        idx = idx.to(device="cpu", dtype=torch.int64).reshape(-1).contiguous()
    return idx


def _scratch_size(scratch: torch.Tensor, op: str) -> int:
    """Bytes of a caller's scratch tensor, which must be contiguous on the CPU."""
    if not (scratch.is_cpu and scratch.is_contiguous()):
        raise ValueError(f"{op}: scratch must be a contiguous CPU tensor")
    return scratch.numel() * scratch.element_size()


def _all_rows(u: torch.Tensor, w: QWeight, kc: KernelContext) -> torch.Tensor:
    """Every row of `w` with the arithmetic of rows_matmul: K-quant rows are exact in both precisions (there are
    no int8-activation K-quant row kernels), while their dense "q8" matmul has its own int8 kernels."""
    return linear(u, w, kc.exact if w.ggml_type in library.K_SPARSE_TYPES else kc)


def rows_matmul(
    x: torch.Tensor, w: QWeight, idx: torch.Tensor, kc: KernelContext | None = None
) -> torch.Tensor:
    """Selected rows of W times x: (T, K) -> (T, M) ((K,) -> (M,))."""
    if kc is None:
        kc = default_context()
    kernel = kc.kernels.rows_matmul.get(w.ggml_type)
    n_cols = w.shape[1]
    if x.shape[-1] != n_cols:
        raise ValueError(f"rows_matmul: x has {x.shape[-1]} features, weight {w.shape} expects {n_cols}")
    if kernel is None or not x.is_cpu or x.dim() > 2:
        return rows_matmul_ref(x.to(torch.float32), w, idx)
    if x.dtype is not torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    idx = _as_idx(idx)
    n_sel = idx.shape[0]
    n_tokens, y = output(x, n_sel)
    status = kernel(
        w._raw_ptr, w._raw_stride, w.shape[0], n_cols, idx.data_ptr(), n_sel, x.data_ptr(), n_cols, n_tokens,
        y.data_ptr(), n_sel, kc.threads_now, kc.level,
    )  # fmt: skip
    if status:
        check_status(status, "rows_matmul")
    return y


def rows_axpy(
    h: torch.Tensor,
    w_t: QWeight,
    idx: torch.Tensor | None,
    kc: KernelContext | None = None,
    h_min: float = 0.0,
) -> torch.Tensor:
    """Sum of selected rows of W_t weighted by h: (T, M) -> (T, D) ((M,) -> (D,)); rows with |h| <= h_min
    (h_min >= 0; 0: the rows with h == 0) contribute nothing and are not read, NaN is kept. idx None means all N
    rows (the dense down projection of a transposed ffn_down; with h_min > 0, TEAL's input-sparse product)."""
    if kc is None:
        kc = default_context()
    if not h_min >= 0.0:
        raise ValueError(f"rows_axpy: h_min must be >= 0, got {h_min}")
    if (
        w_t.on_device
    ):  # a device weight (the -ngl layers of a PWRI file run dense): its own axpy over every row
        if idx is not None or h_min != 0.0:
            raise ValueError("rows_axpy: a device weight takes every row (idx None, h_min 0)")
        return w_t.axpy(h, kc)  # type: ignore[attr-defined]
    kernel = kc.kernels.rows_axpy.get(w_t.ggml_type)
    n_rows, n_out = w_t.shape
    if idx is not None:
        idx = _as_idx(idx)
    n_sel = n_rows if idx is None else idx.shape[0]
    if h.shape[-1] != n_sel:
        raise ValueError(f"rows_axpy: h has {h.shape[-1]} activations for {n_sel} rows")
    if kernel is None or not h.is_cpu or h.dim() > 2:
        h = h.to(torch.float32)
        return rows_axpy_ref(h if h_min == 0.0 else h.masked_fill(h.abs() <= h_min, 0.0), w_t, idx)
    if h.dtype is not torch.float32 or not h.is_contiguous():
        h = h.to(torch.float32).contiguous()
    if n_sel == 0:  # an empty idx may have no data pointer (NULL would mean "all rows")
        return torch.zeros(*h.shape[:-1], n_out, dtype=torch.float32)
    n_tokens, y = output(h, n_out)
    status = kernel(
        w_t._raw_ptr, w_t._raw_stride, n_rows, n_out, None if idx is None else idx.data_ptr(), n_sel,
        h.data_ptr(), n_sel, n_tokens, y.data_ptr(), n_out, int(kc.act_precision == "q8"), h_min, kc.threads_now,
        kc.level,
    )  # fmt: skip
    if status:
        check_status(status, "rows_axpy")
    return y


def ffn_scratch_bytes(n_rows: int, n_cols: int, rank: int = 0) -> int:
    """Bytes of scratch that serve `ffn_rows` over up to n_rows neurons of n_cols inputs (either activation
    precision) and `predict_ffn` over n_rows neurons with a rank-`rank` predictor: allocate it once per engine.
    0 when the kernels are not built (the references need none)."""
    lib = library.load()
    if lib is None:
        return 0
    if n_rows < 0 or n_cols < 0 or rank < 0:
        raise ValueError(f"ffn_scratch_bytes: negative size ({n_rows}, {n_cols}, {rank})")
    return max(
        lib.ffn_rows_scratch_bytes(n_rows, n_cols, 1), lib.predict_ffn_scratch_bytes(n_rows, n_cols, rank, 1)
    )


def ffn_rows_ref(
    u: torch.Tensor,
    gate: QWeight,
    up: QWeight,
    down_t: QWeight,
    idx: torch.Tensor,
    act: str = "relu",
    relu_up: bool = False,
) -> torch.Tensor:
    """sum_j h_j * down_t[idx_j] with h = act(gate[idx] . u) * (relu(up[idx] . u) if relu_up else up[idx] . u);
    u (K,) -> (D,), (T, K) -> (T, D)."""
    u = u.to(torch.float32)
    h = gated_ref(rows_matmul_ref(u, gate, idx), rows_matmul_ref(u, up, idx), act, relu_up)
    return rows_axpy_ref(h, down_t, idx)


def ffn_rows(
    u: torch.Tensor,
    gate: QWeight,
    up: QWeight,
    down_t: QWeight,
    idx: torch.Tensor,
    act: str = "relu",
    relu_up: bool = False,
    kc: KernelContext | None = None,
    *,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """FFN output of the neurons idx for one token: u (K,) -> (D,), or (1, K) -> (1, D).

    gate and up are (N, K), down_t is (N, D) (the transposed down projection); act is one of
    `activation.ACTIVATIONS`. One kernel call when the three weights are kernel types; otherwise, and for T > 1,
    the unfused ops (rows_matmul, gating, rows_axpy). scratch: a contiguous CPU tensor of at least
    `ffn_scratch_bytes(N, K)` bytes, reused across calls (None: one is allocated for this call).
    """
    if kc is None:
        kc = default_context()
    act_code = activation_code(act)
    kinds = kc.kernels.ffn_kinds
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
        h = gated(rows_matmul(u, gate, idx, kc), rows_matmul(u, up, idx, kc), act, relu_up)
        return rows_axpy(h, down_t, idx, kc)
    if u.dtype is not torch.float32 or not u.is_contiguous():
        u = u.to(torch.float32).contiguous()
    idx = _as_idx(idx)
    n_sel = idx.shape[0]
    q8 = kc.act_precision == "q8"
    if scratch is None:
        scratch = torch.empty(library.load().ffn_rows_scratch_bytes(n_sel, n_cols, q8), dtype=torch.uint8)
    scratch_bytes = _scratch_size(scratch, "ffn_rows")
    y = torch.empty(*u.shape[:-1], n_out, dtype=torch.float32)
    status = kc.kernels.ffn_rows(
        u.data_ptr(), n_cols, n_out, n_rows,
        gate._raw_ptr, gate._raw_stride, gate_kind,
        up._raw_ptr, up._raw_stride, up_kind,
        down_t._raw_ptr, down_t._raw_stride, down_kind,
        idx.data_ptr(), n_sel, act_code, bool(relu_up), q8, y.data_ptr(), scratch.data_ptr(), scratch_bytes,
        kc.threads_now, kc.level,
    )  # fmt: skip
    if status:
        needed = library.load().ffn_rows_scratch_bytes(n_sel, n_cols, q8)
        check_status(status, "ffn_rows", scratch_bytes, needed, "ffn_scratch_bytes")
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
    act: str = "relu",
    relu_up: bool = False,
    kc: KernelContext | None = None,
    *,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int, float] | None:
    """Predictor and sparse FFN of one token in one kernel call; None where the kernel does not apply.

    x (1, K) is the predictor's input (pre-norm residual), u (1, K) the FFN's. Returns y (1, D), the number of
    active neurons and the predictor's share of the time in seconds. Bit-identical to
    `ffn_rows(u, gate, up, down_t, nonzero(linear(relu(linear(x, fc1)), fc2') >= threshold), act, relu_up)` in
    the context's precision, fc2' in the exact one (its rows are short: the float several-rows dot); applies to
    kernel types on the CPU (in the q8 precision, not to a K-quant fc1, whose q8 matmul takes int8 super-blocks).
    scratch: as for `ffn_rows` (`ffn_scratch_bytes(N, K, rank)` bytes).
    """
    if kc is None:
        kc = default_context()
    act_code = activation_code(act)
    kernel = kc.kernels.predict_ffn
    kinds = kc.kernels.ffn_kinds
    codes = [kinds.get(w.ggml_type) for w in (fc1, fc2, gate, up, down_t)]
    q8 = kc.act_precision == "q8"
    if kernel is None or None in codes or not (x.is_cpu and u.is_cpu) or x.shape[0] != 1 or u.shape[0] != 1:
        return None
    if q8 and fc1.ggml_type in K_QUANT_TYPES:
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
    if scratch is None:
        scratch = torch.empty(
            library.load().predict_ffn_scratch_bytes(n_rows, n_cols, rank, q8), dtype=torch.uint8
        )
    scratch_bytes = _scratch_size(scratch, "predict_ffn")
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
        act_code, bool(relu_up), q8, idx.data_ptr(), ctypes.byref(n_active), ctypes.byref(seconds), y.data_ptr(),
        scratch.data_ptr(), scratch_bytes, kc.threads_now, kc.level,
    )  # fmt: skip
    if status:
        needed = library.load().predict_ffn_scratch_bytes(n_rows, n_cols, rank, q8)
        check_status(status, "predict_ffn", scratch_bytes, needed, "ffn_scratch_bytes")
    return y, int(n_active.value), float(seconds.value)


# T > 1: when the union of the tokens' active neurons exceeds this share of the candidates, up runs densely
CATS_DENSE_UNION_SHARE = 0.6


def cats_scratch_bytes(n_rows: int, n_cols: int) -> int:
    """Bytes of scratch that serve `cats_ffn` over up to n_rows candidate neurons of n_cols inputs (either
    precision); 0 when the kernels are not built."""
    lib = library.load()
    if lib is None:
        return 0
    if n_rows < 0 or n_cols < 0:
        raise ValueError(f"cats_scratch_bytes: negative size ({n_rows}, {n_cols})")
    return int(lib.cats_ffn_scratch_bytes(n_rows, n_cols, 1))


def cats_thresholds(thresholds: float | torch.Tensor, n_rows: int) -> torch.Tensor:
    """Per-row thresholds (n_rows,) float32, contiguous on the CPU, from one value (NaN refused) or a tensor of
    n_rows (taken as it is: a row whose threshold is NaN is never active; loaders refuse NaN)."""
    if isinstance(thresholds, torch.Tensor):
        t = thresholds
        if t.dtype is not torch.float32 or not t.is_cpu or t.dim() != 1 or not t.is_contiguous():
            t = t.detach().to("cpu", torch.float32).reshape(-1).contiguous()
        if t.numel() != n_rows:
            raise ValueError(f"cats_ffn: {t.numel()} thresholds for {n_rows} rows")
        return t
    if thresholds != thresholds:
        raise ValueError("cats_ffn: threshold is NaN")
    return torch.full((n_rows,), float(thresholds), dtype=torch.float32)


def cats_ffn_ref(
    u: torch.Tensor,
    gate: QWeight,
    up: QWeight,
    down_t: QWeight,
    cand: torch.Tensor | None,
    thresholds: float | torch.Tensor,
    act: str = "silu",
    relu_up: bool = False,
    dense_rows: torch.Tensor | None = None,
    out_thresholds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked dense reference of `cats_ffn`: (y (T, D), mask (T, C)) with a = act(gate[cand] u),
    h = a * up . u, mask = |a| > thresholds[cand] and (with out_thresholds) |h| > out_thresholds[cand] (every
    candidate for the tokens dense_rows marks), y = sum over the candidates of h * mask times their down_t rows."""
    u = u.to(torch.float32)
    if u.dim() == 1:
        u = u[None]
    t = cats_thresholds(thresholds, gate.shape[0])
    t_out = None if out_thresholds is None else cats_thresholds(out_thresholds, gate.shape[0])
    if cand is not None:
        t = t[cand]
        t_out = None if t_out is None else t_out[cand]
    wg, wu = decode_rows(gate, cand), decode_rows(up, cand)
    a = activation.act(act, u @ wg.T)
    v = u @ wu.T
    h = a * (torch.relu(v) if relu_up else v)
    mask = a.abs() > t
    if t_out is not None:
        mask &= h.abs() > t_out
    if dense_rows is not None:
        mask[dense_rows.to("cpu", torch.bool).reshape(-1)] = True
    return (h * mask) @ decode_rows(down_t, cand), mask


def cats_ffn(
    u: torch.Tensor,
    gate: QWeight,
    up: QWeight,
    down_t: QWeight,
    cand: torch.Tensor | None,
    thresholds: float | torch.Tensor,
    act: str = "silu",
    relu_up: bool = False,
    kc: KernelContext | None = None,
    *,
    dense_rows: torch.Tensor | None = None,
    out_thresholds: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int, int]:
    """CATS FFN of u (T, K) over the candidate neurons `cand` (None: all rows): (y (T, D), active pairs, pairs
    whose up row was read).

    thresholds: one value, or one per row of the weights (n_rows,). A neuron passes the gate stage for a token
    when |act(gate_n . u)| > thresholds[n]; its up row is then read and h_n = a_n * (up_n . u) (relu on up . u
    when relu_up). It is active when it passed, and, with out_thresholds (n_rows,), when |h_n| > out_thresholds[n]
    too (the second stage); for the tokens that dense_rows (bool (T,)) marks every neuron is active. y sums
    h_n * down_t[n] over the active ones. Only the gate rows of the candidates, the up rows of those passing the
    gate stage and the down rows of active neurons are read. One token with kernel weight types on the CPU: one
    kernel call (scratch: a contiguous CPU tensor of at least `cats_scratch_bytes(C, K)` bytes, reused across
    calls); otherwise the row ops (rows_matmul / linear, the masks in torch, rows_axpy) with per-token masks.
    """
    if kc is None:
        kc = default_context()
    act_code = activation_code(act)
    n_rows, n_cols = gate.shape
    thresholds = cats_thresholds(thresholds, n_rows)
    if out_thresholds is not None:
        out_thresholds = cats_thresholds(out_thresholds, n_rows)
    n_out = down_t.shape[1]
    if u.shape[-1] != n_cols:
        raise ValueError(f"cats_ffn: u has {u.shape[-1]} features, gate {gate.shape} expects {n_cols}")
    if up.shape != gate.shape or down_t.shape[0] != n_rows:
        raise ValueError(f"cats_ffn: gate {gate.shape}, up {up.shape} and down_t {down_t.shape} do not match")
    if u.dim() == 1:
        u = u[None]
    if dense_rows is not None:
        dense_rows = dense_rows.to("cpu", torch.bool).reshape(-1)
        if dense_rows.numel() != u.shape[0]:
            raise ValueError(f"cats_ffn: dense_rows marks {dense_rows.numel()} tokens of {u.shape[0]}")
        if not bool(dense_rows.any()):
            dense_rows = None
    kinds = kc.kernels.ffn_kinds
    codes = [kinds.get(w.ggml_type) for w in (gate, up, down_t)]
    kernel = kc.kernels.cats_ffn
    if kernel is not None and None not in codes and u.is_cpu and u.shape[0] == 1:
        u = u.to(torch.float32).contiguous()
        if cand is not None:
            cand = _as_idx(cand)
        n_cand = n_rows if cand is None else cand.shape[0]
        q8 = kc.act_precision == "q8"
        if scratch is None:
            scratch = torch.empty(
                library.load().cats_ffn_scratch_bytes(n_cand, n_cols, q8), dtype=torch.uint8
            )
        scratch_bytes = _scratch_size(scratch, "cats_ffn")
        idx = torch.empty(max(n_cand, 1), dtype=torch.int64)
        y = torch.empty(1, n_out, dtype=torch.float32)
        n_active, n_up = ctypes.c_int64(), ctypes.c_int64()
        if dense_rows is not None:  # the one token runs dense: every neuron passes
            thresholds, out_thresholds = torch.full_like(thresholds, -1.0), None
        status = kernel(
            u.data_ptr(), n_cols, n_out, n_rows,
            gate._raw_ptr, gate._raw_stride, codes[0],
            up._raw_ptr, up._raw_stride, codes[1],
            down_t._raw_ptr, down_t._raw_stride, codes[2],
            None if cand is None or n_cand == 0 else cand.data_ptr(), n_cand, thresholds.data_ptr(),
            None if out_thresholds is None else out_thresholds.data_ptr(), act_code,
            bool(relu_up), q8, idx.data_ptr(), ctypes.byref(n_active), ctypes.byref(n_up), y.data_ptr(),
            scratch.data_ptr(), scratch_bytes, kc.threads_now, kc.level,
        )  # fmt: skip
        if status:
            needed = library.load().cats_ffn_scratch_bytes(n_cand, n_cols, q8)
            check_status(status, "cats_ffn", scratch_bytes, needed, "cats_scratch_bytes")
        return y, int(n_active.value), int(n_up.value)
    if cand is not None:
        cand = _as_idx(cand)
    g = _all_rows(u, gate, kc) if cand is None else rows_matmul(u, gate, cand, kc)  # (T, C)
    # the kernel's activation (libm, not torch's: the masks and h of each token are the one-token kernel's bits);
    # act(g) * 1 is exact
    a = gated(g, torch.ones_like(g), act, False)
    mask = a.abs() > (thresholds if cand is None else thresholds[cand])
    if dense_rows is not None:
        mask[dense_rows] = True
    n_up = int(mask.sum())
    union = mask.any(dim=0)
    sel = union.nonzero().view(-1)  # positions among the candidates
    n_cand = g.shape[1]
    if sel.numel() >= CATS_DENSE_UNION_SHARE * n_cand:
        rows = cand
        v = _all_rows(u, up, kc) if cand is None else rows_matmul(u, up, cand, kc)
    else:
        rows = sel if cand is None else cand[sel]
        a, mask = a[:, sel], mask[:, sel]
        v = rows_matmul(u, up, rows, kc)
    h = a.mul_(torch.relu(v) if relu_up else v)  # the kernels' gating: act(g) * (relu(v) or v), one rounding
    if out_thresholds is not None:
        t_out = out_thresholds if rows is None else out_thresholds[rows]
        keep = h.abs() > t_out
        if dense_rows is not None:
            keep[dense_rows] = True
        mask &= keep
    return rows_axpy(h.mul_(mask), down_t, rows, kc), int(mask.sum()), n_up
