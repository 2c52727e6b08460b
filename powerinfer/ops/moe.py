"""MoE ops: one token's selected experts, read from the stacked ffn_{gate,up,down}_exps blocks.

`experts_matmul` runs each selected expert's rows through the dense matmul kernel (the one `linear` calls, so each
output is bit for bit what `linear` gives on the expert's row slice) into one preallocated output, without a
`linear` call, weight slice or output tensor per expert; `experts_matmul_ref` is `linear` on each slice.
`grouped_matmul` does the same for a batch's tokens grouped by expert: one matmul call per group, all of them in
one kernel call (pi_grouped_matmul) whose threads share the groups.

`moe_experts` describes a layer's stacked experts once (a C struct of weight pointers, kernels/cpu/moe.c); each
call of the `MoEExperts` it returns then runs one token's k selected experts (gate, up, activation, down, the
weighted sum in expert order) in one kernel call and one parallel region: the bits of `experts_matmul` on each
matrix, `gated` and torch's `out += y_j * w_j`.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from powerinfer.ops import library
from powerinfer.ops.activation import activation_code
from powerinfer.ops.context import KernelContext, default_context
from powerinfer.ops.dense import linear
from powerinfer.ops.layer import _Mat, _mat, _norm_weight
from powerinfer.ops.library import check_status
from powerinfer.ops.weights import QWeight, weight_rows

__all__ = [
    "MoEExperts",
    "MoEFFNBlock",
    "experts_matmul",
    "experts_matmul_ref",
    "grouped_matmul",
    "grouped_matmul_ref",
    "moe_experts",
    "moe_ffn_block",
    "moe_route",
]


def experts_matmul_ref(
    x: torch.Tensor, w: QWeight, n_rows: int, experts: list[int], kc: KernelContext | None = None
) -> torch.Tensor:
    """y[j] = W_{experts[j]} @ x[j] (x[0] for every j when x has one row) with `linear` on each expert's rows."""
    shared = x.shape[0] == 1
    return torch.cat(
        [
            linear(x[0:1] if shared else x[j : j + 1], weight_rows(w, e * n_rows, (e + 1) * n_rows), kc)
            for j, e in enumerate(experts)
        ]
    )


def experts_matmul(
    x: torch.Tensor, w: QWeight, n_rows: int, experts: list[int], kc: KernelContext | None = None
) -> torch.Tensor:
    """y[j] = W_{experts[j]} @ x[j]: w the stack (n_expert * n_rows, K) of n_rows-row matrices, x (k, K) one input
    per expert or (1, K) one for all, float32 -> (k, n_rows) float32."""
    if kc is None:
        kc = default_context()
    k, K = len(experts), w.shape[1]
    n_expert = w.shape[0] // n_rows
    if (
        any(not 0 <= e < n_expert for e in experts)
        or x.shape[-1] != K
        or x.shape[0] not in (1, k)
        or x.dim() != 2
    ):
        raise ValueError(f"experts_matmul: experts {experts} of {n_expert}, x {tuple(x.shape)}, w {w.shape}")
    kernel = kc.kernels.matmul.get(w.ggml_type)
    if kernel is None or x.dtype is not torch.float32 or not x.is_contiguous() or not x.is_cpu:
        return experts_matmul_ref(x.to("cpu", torch.float32), w, n_rows, experts, kc)
    y = torch.empty(k, n_rows, dtype=torch.float32)
    base, stride, x_ptr, out = w._raw_ptr, w._raw_stride, x.data_ptr(), y.data_ptr()
    x_step = 0 if x.shape[0] == 1 else 4 * K
    threads, level = kc.threads_now, kc.level
    for j, e in enumerate(experts):
        status = kernel(
            base + e * n_rows * stride, stride, n_rows, K, x_ptr + j * x_step, K, 1, out + 4 * j * n_rows,
            n_rows, threads, level,
        )  # fmt: skip
        if status:
            check_status(status, "experts_matmul")
    return y


def grouped_matmul_ref(
    x: torch.Tensor,
    w: QWeight,
    n_rows: int,
    experts: list[int],
    counts: list[int],
    kc: KernelContext | None = None,
) -> torch.Tensor:
    """`grouped_matmul` with `linear` on each group and expert slice."""
    out, start = [], 0
    for e, n in zip(experts, counts, strict=True):
        out.append(linear(x[start : start + n], weight_rows(w, e * n_rows, (e + 1) * n_rows), kc))
        start += n
    return torch.cat(out) if out else torch.empty(0, n_rows)


def grouped_matmul(
    x: torch.Tensor,
    w: QWeight,
    n_rows: int,
    experts: list[int],
    counts: list[int],
    kc: KernelContext | None = None,
) -> torch.Tensor:
    """A batch's tokens grouped by expert: rows start_j .. start_j + counts[j] of x (N, K) times expert experts[j]'s
    matrix of the stack w (n_expert * n_rows, K), each group in one matmul kernel call (bit for bit `linear`):
    (N, n_rows) float32, N = sum(counts)."""
    if kc is None:
        kc = default_context()
    K = w.shape[1]
    n_expert = w.shape[0] // n_rows
    if (
        any(not 0 <= e < n_expert for e in experts)
        or len(counts) != len(experts)
        or any(n < 0 for n in counts)
        or x.dim() != 2
        or x.shape != (sum(counts), K)
    ):
        raise ValueError(
            f"grouped_matmul: experts {experts} of {n_expert}, counts {counts}, x {tuple(x.shape)}"
        )
    kernel = kc.kernels.matmul.get(w.ggml_type)
    if kernel is None or x.dtype is not torch.float32 or not x.is_contiguous() or not x.is_cpu:
        return grouped_matmul_ref(x.to("cpu", torch.float32), w, n_rows, experts, counts, kc)
    y = torch.empty(x.shape[0], n_rows, dtype=torch.float32)
    base, stride, x_ptr, out = w._raw_ptr, w._raw_stride, x.data_ptr(), y.data_ptr()
    threads, level = kc.threads_now, kc.level
    grouped = kc.kernels.grouped_matmul
    if grouped is not None:  # one call: the groups shared by the threads, each group one matmul call on one
        ids, sizes = torch.tensor(experts, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64)
        status = grouped(
            ctypes.cast(kernel, ctypes.c_void_p).value, base, stride, n_rows, K, n_expert, x_ptr, x.shape[0],
            ids.data_ptr(), sizes.data_ptr(), len(experts), out, threads, level,
        )  # fmt: skip
        if status:
            check_status(status, "grouped_matmul")
        return y
    start = 0
    for e, n in zip(experts, counts, strict=True):
        if n:
            status = kernel(
                base + e * n_rows * stride, stride, n_rows, K, x_ptr + 4 * start * K, K, n, out + 4 * start * n_rows,
                n_rows, threads, level,
            )  # fmt: skip
            if status:
                check_status(status, "grouped_matmul")
        start += n
    return y


_i64, _i32 = ctypes.c_int64, ctypes.c_int32


class _MoEDesc(ctypes.Structure):  # pi_moe_desc
    _fields_ = [
        ("n_embd", _i64), ("n_ff", _i64), ("n_expert", _i64), ("act", _i32), ("sparse", _i32),
        ("gate", _Mat), ("up", _Mat), ("down", _Mat),
        ("norm", ctypes.c_void_p), ("eps", ctypes.c_float), ("weights_scale", ctypes.c_float), ("router", _Mat),
        ("n_used", _i64), ("gating", _i32), ("norm_weights", _i32), ("experts", ctypes.c_void_p),
        ("thresholds", ctypes.c_void_p), ("counts", ctypes.c_void_p),
    ]  # fmt: skip


GATINGS = ("softmax", "sigmoid")  # pi_moe_route's gating codes
MAX_ROUTE_EXPERTS = 4096  # MOE_ROUTE_MAX_EXPERTS


def moe_route(
    logits: torch.Tensor, k: int, gating: str, norm: bool, scale: float, kc: KernelContext | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Router logits (T, n) -> the k experts (T, k) int64 of each token in increasing id order and their weights
    (T, k) float32 (the gating's probabilities of the k largest, divided by their sum when `norm`, times `scale`) in
    one kernel call: the routing of the one-token MoE block (`moe_ffn_block`). None where the kernel does not
    apply (no kernels, logits not float32 on the CPU)."""
    kc = kc or default_context()
    kernel = kc.kernels.moe_route
    if kernel is None or logits.dtype is not torch.float32 or not logits.is_cpu or logits.dim() != 2:
        return None
    T, n = logits.shape
    if not 0 < k <= n <= MAX_ROUTE_EXPERTS:
        return None
    logits = logits.contiguous()
    ids = torch.empty(T, k, dtype=torch.int64)
    weights = torch.empty(T, k, dtype=torch.float32)
    status = kernel(
        logits.data_ptr(),
        T,
        n,
        k,
        GATINGS.index(gating),
        int(norm),
        scale,
        ids.data_ptr(),
        weights.data_ptr(),
    )
    if status:
        check_status(status, "moe_route")
    return ids, weights


class MoEExperts:
    """A layer's stacked experts for one token: y += sum_j w_j * down_j(act(gate_j x) * up_j x) over the selected
    experts j, in one kernel call."""

    def __init__(self, desc: _MoEDesc, keep: tuple[object, ...], n_used: int, kc: KernelContext) -> None:
        self.desc, self._keep, self.kc = desc, keep, kc
        self._desc_ref = ctypes.byref(desc)
        self.n_embd, self.n_used = int(desc.n_embd), n_used
        # CATS: (active neurons, up rows read, neurons) the one-token kernel has seen (None: no thresholds)
        self.counts: torch.Tensor | None = None
        n = int(library.load().moe_experts_scratch_bytes(desc.n_embd, desc.n_ff, n_used))
        self.scratch = torch.empty(n, dtype=torch.uint8)  # this layer's, reused by every call

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, y: torch.Tensor) -> None:
        """x (1, n_embd) float32 the normed input; ids (1, k) int64 and weights (1, k) float32 the experts in the
        order their products are added; y (1, n_embd) float32 contiguous CPU, added to in place."""
        k, E = self.n_used, self.n_embd
        if (
            x.numel() != E
            or y.numel() != E
            or ids.numel() != k
            or weights.numel() != k
            or x.dtype is not torch.float32
            or y.dtype is not torch.float32
            or ids.dtype is not torch.int64
            or weights.dtype is not torch.float32
            or not (
                x.is_contiguous() and y.is_contiguous() and ids.is_contiguous() and weights.is_contiguous()
            )
            or not (x.is_cpu and y.is_cpu and ids.is_cpu and weights.is_cpu)
        ):
            raise ValueError("moe_experts: x, ids, weights or y do not match the experts")
        kc = self.kc
        status = kc.kernels.moe_experts(
            self._desc_ref, x.data_ptr(), ids.data_ptr(), weights.data_ptr(), k, y.data_ptr(),
            self.scratch.data_ptr(), self.scratch.numel(), kc.act_precision == "q8", kc.threads_now, kc.level,
        )  # fmt: skip
        if status:
            check_status(status, "moe_experts")

    def grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """The experts of T tokens at once: (T, n_embd) float32, row t = sum_j weights[t, j] *
        expert_{ids[t, j]}(x[t]) in j order, the bits this kernel adds for the token alone (pi_moe_grouped_ffn:
        the tokens grouped by expert, each group's matrices in the matmul kernels `linear` calls, the threads
        sharing groups and row ranges of them). x (T, n_embd) float32, ids (T, k) int64 (-1: the pair left out),
        weights (T, k) float32; None where the kernels lack it."""
        kc = self.kc
        kernel, mm = kc.kernels.moe_grouped_ffn, kc.kernels.matmul
        fns = [mm.get(w.ggml_type) for w in self._keep[:3]]  # type: ignore[attr-defined]
        if kernel is None or any(f is None for f in fns):
            return None
        T, k, E = x.shape[0], self.n_used, self.n_embd
        if x.shape != (T, E) or ids.shape != (T, k) or weights.shape != (T, k):
            raise ValueError("moe_experts: x, ids or weights do not match the experts")
        x = x.to("cpu", torch.float32).contiguous()
        ids = ids.to("cpu", torch.int64).contiguous()
        weights = weights.to("cpu", torch.float32).contiguous()
        out = torch.empty(T, E, dtype=torch.float32)
        ptrs = [ctypes.cast(f, ctypes.c_void_p).value for f in fns]
        status = kernel(
            self._desc_ref, *ptrs, x.data_ptr(), T, ids.data_ptr(), weights.data_ptr(), out.data_ptr(),
            kc.threads_now, kc.level,
        )  # fmt: skip
        if status:
            check_status(status, "moe_grouped_ffn")
        return out


def moe_experts(
    gate: QWeight,
    up: QWeight,
    down: QWeight,
    n_expert: int,
    n_used: int,
    act: str,
    sparse: bool,
    kc: KernelContext | None = None,
    thresholds: torch.Tensor | None = None,
    table: np.ndarray | None = None,
) -> MoEExperts | None:
    """The one-token kernel of n_expert stacked experts (gate and up (n_expert * n_ff, n_embd), down
    (n_expert * n_embd, n_ff)) of which n_used are selected per token; `sparse` (ReGLU): the up rows of neurons
    whose gate is <= 0 are not read; `thresholds` (CATS): (n_expert, n_ff) float32, a neuron of expert e is
    active where |act(gate)| > thresholds[e, n] (h = 0 and its up row not read elsewhere), in the one-token and
    the grouped kernel alike. `table`: None (each expert's rows in the stack), or a C-contiguous int64 array
    (3, n_expert) of addresses where expert e's gate, up and down rows start (laid out as in the stack), 0 for an
    expert not resident, which the owner (runtime.expert_store, device.pool) fills before each call and keeps
    alive; with a table the stacks may hold the rows of another number of experts (the table's addresses point
    into them: their type and row stride are the kernel's). None where the kernels cannot run it (a weight on a
    device or of a type without a kernel kind)."""
    kc = kc or default_context()
    if kc.kernels.moe_experts is None:
        return None
    mats = [_mat(w, kc) for w in (gate, up, down)]
    if any(m is None for m in mats):
        return None
    n_embd, n_ff = gate.shape[1], down.shape[1]
    # experts the stacks hold: n_expert, or with a table any number (a pool's experts in slot order)
    held = gate.shape[0] // n_ff if n_ff > 0 else 0
    if n_expert <= 0 or not 0 < n_used <= n_expert or held <= 0 or (table is None and held != n_expert):
        return None
    if gate.shape != (held * n_ff, n_embd) or up.shape != gate.shape or down.shape != (held * n_embd, n_ff):
        return None
    mats[0].n_rows = mats[1].n_rows = n_expert * n_ff  # type: ignore[union-attr]
    mats[2].n_rows = n_expert * n_embd  # type: ignore[union-attr]
    desc = _MoEDesc(n_embd, n_ff, n_expert, activation_code(act), int(sparse), *mats)
    desc.n_used = n_used  # the experts per token of the grouped kernel
    if table is not None:
        if table.shape != (3, n_expert) or table.dtype != np.int64 or not table.flags.c_contiguous:
            raise ValueError(f"moe_experts: an expert table must be int64 (3, {n_expert}), C-contiguous")
        desc.experts = table.ctypes.data
    keep: tuple[object, ...] = (gate, up, down)
    counts = None
    if thresholds is not None:
        if thresholds.shape != (n_expert, n_ff):
            raise ValueError(
                f"moe_experts: thresholds {tuple(thresholds.shape)}, expected ({n_expert}, {n_ff})"
            )
        thresholds = thresholds.to("cpu", torch.float32).contiguous()
        counts = torch.zeros(
            3, dtype=torch.int64
        )  # (active neurons, up rows read, neurons): the one-token kernel's
        desc.thresholds, desc.counts = thresholds.data_ptr(), counts.data_ptr()
        keep = (*keep, thresholds, counts)
    experts = MoEExperts(desc, keep, n_used, kc)
    experts.counts = counts
    return experts


class MoEFFNBlock:
    """A layer's MoE FFN block for one token: x += experts(n, route(router . n)), n = norm(x), in one kernel
    call; the router logits may be given instead (a router that reads the layer input)."""

    def __init__(self, desc: _MoEDesc, keep: tuple[object, ...], kc: KernelContext) -> None:
        self.desc, self._keep, self.kc = desc, keep, kc
        self._desc_ref = ctypes.byref(desc)
        self.n_embd, self.n_expert, self.k = int(desc.n_embd), int(desc.n_expert), int(desc.n_used)
        n = library.load().moe_ffn_block_scratch_bytes(desc.n_embd, desc.n_expert, desc.n_ff, desc.n_used)
        self.scratch = torch.empty(int(n), dtype=torch.uint8)  # this layer's, reused by every call

    def __call__(
        self, x: torch.Tensor, logits: torch.Tensor | None = None, ids_out: torch.Tensor | None = None
    ) -> None:
        """x (1, n_embd) float32 contiguous CPU, updated in place; logits (1, n_expert) float32 contiguous CPU or
        None (the router's, from the normed x); ids_out: (k,) int64 contiguous CPU taking the chosen experts."""
        if x.numel() != self.n_embd or x.dtype is not torch.float32 or not x.is_contiguous() or not x.is_cpu:
            raise ValueError("moe_ffn_block: x does not match the block")
        if logits is not None and (
            logits.numel() != self.n_expert
            or logits.dtype is not torch.float32
            or not logits.is_contiguous()
            or not logits.is_cpu
        ):
            raise ValueError("moe_ffn_block: logits do not match the router")
        if ids_out is not None and (
            ids_out.numel() != self.k or ids_out.dtype is not torch.int64 or not ids_out.is_contiguous()
        ):
            raise ValueError("moe_ffn_block: ids_out does not match the experts used")
        kc = self.kc
        status = kc.kernels.moe_ffn_block(
            self._desc_ref, x.data_ptr(), None if logits is None else logits.data_ptr(),
            None if ids_out is None else ids_out.data_ptr(), self.scratch.data_ptr(), self.scratch.numel(),
            kc.act_precision == "q8", kc.threads_now, kc.level,
        )  # fmt: skip
        if status:
            check_status(status, "moe_ffn_block")


def moe_ffn_block(
    norm: torch.Tensor,
    eps: float,
    router: QWeight | None,
    experts: MoEExperts,
    gating: str,
    norm_weights: bool,
    weights_scale: float,
    kc: KernelContext | None = None,
) -> MoEFFNBlock | None:
    """The one-token MoE FFN block of an RMSNorm weight `norm` (n_embd,), a router (n_expert, n_embd) (None: the
    logits are given on each call) and the experts of `moe_experts`, routed as `moe_route`; None where the kernels
    cannot run it."""
    kc = kc or default_context()
    if kc.kernels.moe_ffn_block is None or gating not in GATINGS:
        return None
    d = experts.desc
    if d.n_expert > MAX_ROUTE_EXPERTS:
        return None
    weight = _norm_weight(norm, int(d.n_embd))
    mat = _Mat(None, 0, 0, 0, 0, 0) if router is None else _mat(router, kc)
    if weight is None or mat is None or (router is not None and router.shape != (d.n_expert, d.n_embd)):
        return None
    desc = _MoEDesc(
        d.n_embd, d.n_ff, d.n_expert, d.act, d.sparse, d.gate, d.up, d.down, weight.data_ptr(), eps,
        weights_scale, mat, experts.n_used, GATINGS.index(gating), int(norm_weights), d.experts, d.thresholds,
        d.counts,
    )  # fmt: skip
    return MoEFFNBlock(desc, (weight, router, experts), kc)
