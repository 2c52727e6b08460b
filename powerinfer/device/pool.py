"""The pool's parts of a layer on the device: `HotRows`, the hot neurons' rows of a sparse FFN layer, and
`PoolExperts`, the experts of a MoE layer held in the pool. Both keep their rows in the file's block format
(ops.DeviceWeight: the Triton kernels on CUDA, the C kernels on the CPU stand-in) and queue their work on their own
stream, handing back a `Pending` result. runtime.loader builds them where the plan (runtime.pool) put rows.
"""

from __future__ import annotations

import numpy as np
import torch

from powerinfer import ops, quant
from powerinfer.device.pending import Pending
from powerinfer.errors import ConfigError
from powerinfer.gguf.constants import GGMLType


class HotRows:
    """The pool part of one layer: hot neurons' gate/up/down_t rows, contiguous on `device`.

    The rows stay in the file's block format (ops.DeviceWeight): on the CPU stand-in the C kernels compute
    on them, on CUDA the Triton kernels, both decoding blocks in registers. So the pool takes exactly the
    bytes the planner budgeted for these neurons (`n_bytes`).
    """

    def __init__(
        self,
        gate: ops.QWeight | None,
        up: ops.QWeight,
        down_t: ops.QWeight,
        ids: np.ndarray,
        device: torch.device,
        kc: ops.KernelContext,
        backend: str | None = None,
        b_up: torch.Tensor | None = None,
    ) -> None:
        self.device = device
        self.kc = kc
        self.ids = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))  # (k,) neuron ids, ascending
        # only the hot rows' blocks are copied: no second full copy of the FFN on the device; gate None: an
        # ungated FFN act(up . u + b_up) (Falcon, OPT)
        self.gate = (
            None if gate is None else ops.DeviceWeight.from_qweight(gate, device, self.ids, backend, kc)
        )
        self.up = ops.DeviceWeight.from_qweight(up, device, self.ids, backend, kc)  # (k, D)
        self.down_t = ops.DeviceWeight.from_qweight(down_t, device, self.ids, backend, kc)  # (k, D)
        self.b_up = None if b_up is None else b_up.to("cpu")[self.ids].to(device)  # (k,)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def n_bytes(self) -> int:
        gate = 0 if self.gate is None else self.gate.n_bytes
        bias = 0 if self.b_up is None else self.b_up.numel() * 4
        return gate + self.up.n_bytes + self.down_t.n_bytes + bias

    def launch(self, u: torch.Tensor, active: torch.Tensor, act: str, relu_up: bool) -> Pending[torch.Tensor]:
        """Queue the hot part for u (T, D) with its active mask (T, k); y (T, D) on the CPU when ready."""
        if self.stream is None:
            return Pending(self.compute(u, active, act, relu_up))
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            y = self.compute(
                u.to(self.device, non_blocking=True), active.to(self.device, non_blocking=True), act, relu_up
            )
            return Pending.queued(y.to("cpu", non_blocking=True), self.stream)

    def launch_threshold(
        self,
        u: torch.Tensor,
        thresholds: torch.Tensor,
        out_thresholds: torch.Tensor | None,
        dense_rows: torch.Tensor | None,
        act: str,
        relu_up: bool,
    ) -> Pending[tuple[torch.Tensor, torch.Tensor]]:
        """Queue the hot part with CATS's selection: neurons with |act(gate . u)| > thresholds (k,) (on this
        device) and, with out_thresholds (k,), |act(gate . u) * up . u| > out_thresholds; every neuron for the
        tokens dense_rows (T,) marks; decided here. When ready: y (T, D) and the counts (2,) int64 of active
        (token, neuron) pairs and of pairs passing the gate stage (whose up rows a sparse kernel reads), on the
        CPU."""
        if self.stream is None:
            return Pending(self._compute_threshold(u, thresholds, out_thresholds, dense_rows, act, relu_up))
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if dense_rows is not None:
                dense_rows = dense_rows.to(self.device, non_blocking=True)
            u = u.to(self.device, non_blocking=True)
            y, n = self._compute_threshold(u, thresholds, out_thresholds, dense_rows, act, relu_up)
            out = (y.to("cpu", non_blocking=True), n.to("cpu", non_blocking=True))
            return Pending.queued(out, self.stream)

    def _compute_threshold(
        self,
        u: torch.Tensor,
        thresholds: torch.Tensor,
        out_thresholds: torch.Tensor | None,
        dense_rows: torch.Tensor | None,
        act: str,
        relu_up: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.gate is None:
            raise ConfigError("threshold (CATS) sparsity needs a gated FFN")
        a = ops.act(act, ops.linear(u, self.gate, self.kc))  # (T, k) float32
        passed = a.abs() > thresholds
        if dense_rows is not None:
            passed[dense_rows] = True
        v = ops.linear(u, self.up, self.kc)
        h = a.mul_(torch.relu(v) if relu_up else v)
        mask = passed
        if out_thresholds is not None:
            mask = passed & (h.abs() > out_thresholds)
            if dense_rows is not None:
                mask[dense_rows] = True
        return self.down_t.axpy(h.mul_(mask), self.kc), torch.stack([mask.sum(), passed.sum()])

    def compute(self, u: torch.Tensor, active: torch.Tensor, act: str, relu_up: bool) -> torch.Tensor:
        """y (T, D) float32 on this device of u (T, D) and the active mask (T, k), both here: queued on the
        current stream (a device span captures it in its graph)."""
        up = ops.linear(u, self.up, self.kc)  # (T, k) float32
        if self.gate is None:
            h = ops.act(act, up if self.b_up is None else up + self.b_up).mul_(active)
        else:
            h = ops.gated(ops.linear(u, self.gate, self.kc), up, act, relu_up).mul_(active)
        return self.down_t.axpy(h, self.kc)  # (T, D) float32


class PoolExperts:
    """The experts of one MoE layer in the pool: the experts held whole, stacked slot after slot in the file's
    block format on `device` (ops.StackedExperts, the bytes placement.experts planned), and the pooled neurons of
    partial experts (ops.ExpertNeurons).

    `member` (n_expert,) bool on the CPU marks the whole ones; `launch` computes the (token, expert) pairs a mask
    selects and returns their weighted sum per token on the CPU, in a fixed number of op calls per layer whatever
    the experts, their number or k, with no host sync; a CUDA pool queues them on its own stream.

    `partial` (expert id -> neuron ids): experts of which only some neurons are here (placement.experts, ReLU
    experts): their pooled neurons' gate and up rows as stored and their down columns in float32 (rows of a
    transposed copy), all partial experts' rows in one ops.ExpertNeurons; `partial_member` marks them.
    `cpu_table` is the (3, n_expert) table of row addresses the CPU's MoE kernel reads instead of the stacked
    tensors: the stacked rows, except a copy of each partial expert's gate with its pooled neurons' rows zeroed
    (ReLU(0) = 0: the CPU computes the other neurons only)."""

    def __init__(
        self,
        gate: ops.QWeight,
        up: ops.QWeight,
        down: ops.QWeight,
        ids: np.ndarray,
        n_expert: int,
        act: str,
        device: torch.device,
        kc: ops.KernelContext,
        backend: str | None = None,
        partial: dict[int, np.ndarray] | None = None,
    ) -> None:
        self.device, self.kc, self.act, self.n_embd = device, kc, act, gate.shape[1]
        self.ids = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
        self.member = torch.zeros(n_expert, dtype=torch.bool)
        self.member[self.ids] = True
        self.whole: ops.StackedExperts | None = None
        if len(self.ids):
            self.whole = ops.StackedExperts(gate, up, down, self.ids, n_expert, act, device, kc, backend)
        self.partial_member = torch.zeros(n_expert, dtype=torch.bool)
        self.cpu_table: np.ndarray | None = None
        self.hot: ops.ExpertNeurons | None = None
        if partial:
            self._setup_partial(gate, up, down, partial, n_expert, gate.shape[0] // n_expert, backend)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _setup_partial(
        self,
        gate: ops.QWeight,
        up: ops.QWeight,
        down: ops.QWeight,
        partial: dict[int, np.ndarray],
        n_expert: int,
        n_ff: int,
        backend: str | None,
    ) -> None:
        n_embd = self.n_embd
        table = np.zeros((3, n_expert), dtype=np.int64)
        for m, (w, n) in enumerate(((gate, n_ff), (up, n_ff), (down, n_embd))):
            table[m] = w._raw_ptr + np.arange(n_expert, dtype=np.int64) * n * w._raw_stride
        self._gate_copies: list[np.ndarray] = []
        rows, downs, experts = [], [], []
        for e, ids in sorted(partial.items()):  # build time grows with experts, a step does not
            g = ops.weight_rows(gate, e * n_ff, (e + 1) * n_ff)
            d = ops.weight_rows(down, e * n_embd, (e + 1) * n_embd)
            # the pooled neurons' down columns as float32 rows, exactly the stored values
            dense_down = quant.dequantize(d.raw.numpy(), d.ggml_type, (n_embd, n_ff)).reshape(n_embd, n_ff)
            downs.append(np.ascontiguousarray(dense_down[:, ids].T, dtype=np.float32))  # (n_e, n_embd)
            rows.append(e * n_ff + np.asarray(ids, dtype=np.int64))
            experts.append(np.full(len(ids), e, dtype=np.int64))
            copy = np.array(g.raw.numpy(), copy=True, order="C")  # (n_ff, row bytes), never the file's bytes
            copy[ids] = 0  # every ggml type decodes all-zero bytes to 0
            self._gate_copies.append(copy)
            assert copy.strides[0] == gate._raw_stride
            table[0, e] = copy.ctypes.data
            self.partial_member[e] = True
        self.cpu_table = table
        pooled = torch.from_numpy(
            np.concatenate(rows)
        )  # (n_rows,) the pooled rows of the stacked gate and up
        # host copies of those rows alone, for the pool to take
        hot_gate = ops.QWeight(gate.raw[pooled], gate.ggml_type, (len(pooled), gate.shape[1]))
        hot_up = ops.QWeight(up.raw[pooled], up.ggml_type, (len(pooled), up.shape[1]))
        down_t = np.concatenate(downs)
        hot_down_t = ops.QWeight.from_numpy(down_t, GGMLType.F32, down_t.shape)
        self.hot = ops.ExpertNeurons(
            hot_gate,
            hot_up,
            hot_down_t,
            np.concatenate(experts),
            n_expert,
            self.act,
            self.device,
            self.kc,
            backend,
        )

    @property
    def n_bytes(self) -> int:
        whole = 0 if self.whole is None else self.whole.n_bytes
        return whole + (0 if self.hot is None else self.hot.n_bytes)

    def launch(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor
    ) -> Pending[torch.Tensor]:
        """sum over the pairs (t, j) with mask[t, j] of weights[t, j] * expert_{ids[t, j]}(x[t]) (the pooled
        neurons of a partial expert), for x (T, n_embd) float32 on the CPU and ids, weights, mask (T, k):
        (T, n_embd) float32 on the CPU when ready."""
        if self.stream is None:
            return Pending(self.compute(x, ids, weights, mask))
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            d = self.device
            y = self.compute(
                x.to(d, non_blocking=True), ids.to(d, non_blocking=True), weights.to(d, non_blocking=True),
                mask.to(d, non_blocking=True),
            )  # fmt: skip
            return Pending.queued(y.to("cpu", non_blocking=True), self.stream)

    def compute(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """`launch`'s sum (T, n_embd) float32 on this device of x, ids, weights and mask on this device, queued on
        the current stream."""
        out = None
        if self.whole is not None:
            out = self.whole(x, ids, weights, mask)
        if self.hot is not None:
            y = self.hot(x, ids, weights, mask)
            out = y if out is None else out.add_(y)
        if out is None:
            out = torch.zeros(x.shape[0], self.n_embd, dtype=torch.float32, device=x.device)
        return out
