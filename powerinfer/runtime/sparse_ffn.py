"""PowerInfer's sparse FFN: predictor -> per-token active mask -> hot rows in a device pool || cold rows on the CPU.

Per layer and token t (spec section 2 and 4):
  score_t = fc2 . ReLU(fc1 . x_t)    x_t is the pre-norm residual (ffn_inp)
  active  = score_t >= threshold
  h_j     = act(gate_j . u_t) * up_j . u_t   for active j, 0 otherwise   (u_t = ffn_norm(x_t))
  y_t     = sum_j h_j * down_t[j]
The pool holds the gate/up/down_t rows of the hot (GPU-resident) neurons contiguously on its device; the CPU
computes the remaining active neurons straight from the memory-mapped file. Both partial outputs are summed.
With no CUDA device the pool runs on the CPU ("cpu" stand-in device) through the same code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from powerinfer import ops
from powerinfer.arch.llama import LlamaConfig, _qweight
from powerinfer.gguf.constants import TensorNames
from powerinfer.gguf.reader import TensorInfo
from powerinfer.ops import sparse as sparse_ops

# a batch whose union of active CPU rows exceeds this share of n_ff runs the CPU part densely
DENSE_UNION_SHARE = 0.6


@dataclass
class SparseStats:
    """Per-layer counters (numpy int64: an element update costs far less than a torch op per layer)."""

    tokens: np.ndarray  # (n_layer,) tokens seen
    active: np.ndarray  # (n_layer,) predicted active (token, neuron) pairs
    active_gpu: np.ndarray  # (n_layer,) of which served by the pool
    predictor_ms: float = 0.0
    # recall measurement (off unless track_recall() was called): truly active pairs, ReLU(gate) > 0,
    # and of those the ones the predictor marked active
    true_active: np.ndarray | None = None
    true_hit: np.ndarray | None = None

    @classmethod
    def zeros(cls, n_layer: int) -> SparseStats:
        return cls(*(np.zeros(n_layer, dtype=np.int64) for _ in range(3)))

    def track_recall(self) -> None:
        """Also compute every neuron's gate per token and count the truly active ones the predictor found."""
        n_layer = self.tokens.size
        self.true_active = np.zeros(n_layer, dtype=np.int64)
        self.true_hit = np.zeros(n_layer, dtype=np.int64)


class HotRows:
    """The pool part of one layer: hot neurons' gate/up/down_t rows, contiguous on `device`.

    The rows stay in the file's block format (ops.DeviceWeight): on the CPU stand-in the C kernels compute
    on them, on CUDA the Triton kernels, both decoding blocks in registers. So the pool takes exactly the
    bytes the planner budgeted for these neurons (`n_bytes`).
    """

    def __init__(
        self,
        gate: ops.QWeight,
        up: ops.QWeight,
        down_t: ops.QWeight,
        ids: np.ndarray,
        device: torch.device,
        backend: str | None = None,
    ) -> None:
        self.device = device
        self.ids = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))  # (k,) neuron ids, ascending
        # only the hot rows' blocks are copied: no second full copy of the FFN on the device
        self.gate = ops.DeviceWeight.from_qweight(gate, device, self.ids, backend)  # (k, D)
        self.up = ops.DeviceWeight.from_qweight(up, device, self.ids, backend)  # (k, D)
        self.down_t = ops.DeviceWeight.from_qweight(down_t, device, self.ids, backend)  # (k, D)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def n_bytes(self) -> int:
        return self.gate.n_bytes + self.up.n_bytes + self.down_t.n_bytes

    def launch(self, u: torch.Tensor, active: torch.Tensor, relu_up: bool) -> torch.Tensor:
        """Queue the hot part for u (T, D) with its active mask (T, k); returns y (T, D) on the CPU."""
        if self.stream is None:
            return self._compute(u, active, relu_up)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            y = self._compute(
                u.to(self.device, non_blocking=True), active.to(self.device, non_blocking=True), relu_up
            )
            return y.to("cpu", non_blocking=True)

    def _compute(self, u: torch.Tensor, active: torch.Tensor, relu_up: bool) -> torch.Tensor:
        g = self.gate.linear(u)  # (T, k) float32
        up = self.up.linear(u)
        h = F.relu(g).mul_(F.relu(up) if relu_up else up).mul_(active)
        return self.down_t.axpy(h)  # (T, D) float32

    def wait(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


class SparseFFN:
    """Predictor-driven FFN of one layer (llama: ReLU(gate) * up; bamboo: ReLU(gate) * ReLU(up))."""

    def __init__(
        self,
        config: LlamaConfig,
        tensors: dict[str, TensorInfo],
        bid: int,
        gpu_ids: np.ndarray | None,
        device: torch.device | None,
        stats: SparseStats,
    ) -> None:
        self.bid = bid
        self.fc1 = _qweight(tensors, TensorNames.PRED_FC1.format(bid=bid))  # (r, D)
        self.fc2 = _qweight(tensors, TensorNames.PRED_FC2.format(bid=bid))  # (n_ff, r)
        self.gate = _qweight(tensors, TensorNames.FFN_GATE.format(bid=bid))  # (n_ff, D)
        self.up = _qweight(tensors, TensorNames.FFN_UP.format(bid=bid))  # (n_ff, D)
        self.down_t = _qweight(tensors, TensorNames.FFN_DOWN_T.format(bid=bid))  # (n_ff, D)
        self.threshold = config.sparse_threshold
        self.relu_up = config.relu_up
        self.n_ff = config.n_ff
        self.stats = stats
        self.cpu_rows = torch.ones(self.n_ff, dtype=torch.bool)  # False where the pool owns the neuron
        self.hot: HotRows | None = None
        # decode with every neuron on the CPU runs predictor + FFN as one kernel call (pi_predict_ffn, the same
        # bits as predict() then rows()); False forces the separate steps (tests that replace predict())
        self.fused_decode = True
        if gpu_ids is not None and len(gpu_ids) and device is not None:
            self.hot = HotRows(self.gate, self.up, self.down_t, gpu_ids, device)
            self.cpu_rows[self.hot.ids] = False

    def predict(self, x_residual: torch.Tensor) -> torch.Tensor:
        """Active mask (T, n_ff) from the pre-norm residual (T, D)."""
        score = ops.linear(F.relu(ops.linear(x_residual, self.fc1)), self.fc2)
        return (score >= self.threshold).to(x_residual.device)

    def __call__(self, x_norm: torch.Tensor, x_residual: torch.Tensor) -> torch.Tensor:
        s = self.stats
        if (
            self.fused_decode
            and self.hot is None
            and x_norm.shape[0] == 1
            and s.true_active is None
            and isinstance(self.fc1, ops.QWeight)
            and isinstance(self.fc2, ops.QWeight)
        ):
            # None where the kernel does not apply (q8 precision, non-kernel weight types)
            fused = sparse_ops.predict_ffn(
                x_residual,
                x_norm,
                self.fc1,
                self.fc2,
                self.threshold,
                self.gate,
                self.up,
                self.down_t,
                self.relu_up,
            )
            if fused is not None:
                y, n_active, seconds = fused
                s.predictor_ms += seconds * 1e3
                s.tokens[self.bid] += 1
                s.active[self.bid] += n_active
                return y
        t0 = time.perf_counter()
        active = self.predict(x_residual)  # (T, n_ff)
        s.predictor_ms += (time.perf_counter() - t0) * 1e3
        T = x_norm.shape[0]
        y_hot = None
        if self.hot is None:
            cpu_active = active
        else:
            hot_active = active[:, self.hot.ids]  # (T, k)
            y_hot = self.hot.launch(x_norm, hot_active, self.relu_up)
            cpu_active = active & self.cpu_rows
        if T == 1:
            # decode: the selected rows are exactly the active ones, no per-token mask needed
            idx = cpu_active[0].nonzero().view(-1)  # (M,)
            y = self.rows(x_norm, idx)
            n_cpu = idx.numel()
        else:
            y = self.cold(x_norm, cpu_active)
            n_cpu = int(cpu_active.sum())
        s.tokens[self.bid] += T
        if s.true_active is not None and s.true_hit is not None:
            truth = (ops.linear(x_norm, self.gate) > 0).to(active.device)  # (T, n_ff), PowerInfer's label
            s.true_active[self.bid] += int(truth.sum())
            s.true_hit[self.bid] += int((truth & active).sum())
        if y_hot is None:
            s.active[self.bid] += n_cpu
            return y
        n_hot = int(hot_active.sum())
        s.active[self.bid] += n_cpu + n_hot
        s.active_gpu[self.bid] += n_hot
        self.hot.wait()
        return y + y_hot

    def rows(self, u: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """FFN output (T, D) of the neurons idx computed for every token (no mask)."""
        if u.shape[0] == 1:  # decode: one fused kernel call (bit-identical to the unfused ops below)
            return sparse_ops.ffn_rows(u, self.gate, self.up, self.down_t, idx, self.relu_up)  # (1, D)
        g = sparse_ops.rows_matmul(u, self.gate, idx)  # (T, M)
        up = sparse_ops.rows_matmul(u, self.up, idx)
        h = F.relu(g).mul_(F.relu(up) if self.relu_up else up)
        return sparse_ops.rows_axpy(h, self.down_t, idx)  # (T, D)

    def cold(self, u: torch.Tensor, cpu_active: torch.Tensor) -> torch.Tensor:
        """The CPU part: only rows active for some token (per-token masks applied), dense if most are."""
        union = cpu_active.any(dim=0)  # (n_ff,)
        idx = torch.nonzero(union).squeeze(1)  # (M,)
        if idx.numel() >= DENSE_UNION_SHARE * self.n_ff:
            g, up, mask, idx_down = ops.linear(u, self.gate), ops.linear(u, self.up), cpu_active, None
        else:
            g = sparse_ops.rows_matmul(u, self.gate, idx)  # (T, M)
            up = sparse_ops.rows_matmul(u, self.up, idx)
            mask, idx_down = cpu_active[:, idx], idx
        h = F.relu(g) * (F.relu(up) if self.relu_up else up) * mask
        return sparse_ops.rows_axpy(h, self.down_t, idx_down)  # (T, D)
