"""The sparse FFN block: a selector marks the active neurons, the pool part and the CPU part compute them.

Per layer and token t (spec sections 2 and 4), with PowerInfer's predictor as the selector:
  score_t = fc2 . ReLU(fc1 . x_t)    x_t is the pre-norm residual (ffn_inp)
  active  = score_t >= threshold
  h_j     = act(gate_j . u_t) * up_j . u_t   for active j, 0 otherwise   (u_t = ffn_norm(x_t))
  y_t     = sum_j h_j * down_t[j]
The activation is the FFN spec's (relu, silu, gelu, gelu_tanh): the kernels take it as an argument, so a SiLU
PowerInfer file computes SiLU. Where the placement put some neurons' rows in a device pool (`HotPart`), those
are computed there and the CPU computes the other active neurons straight from the memory-mapped file; the two
partial outputs are summed. Other selectors plug in through `Selector`.

`ThresholdFFN` is CATS's training-free sparsity for SiLU/GELU models (`powerinfer sparsify`): no predictor; the
gate rows are computed for every neuron, a neuron is active when |act(gate_j . u_t)| > its threshold (one per
neuron: the layer's threshold over the neuron's mean |up . u|), and only the active neurons' up and down rows are
read; a sequence's first token (position 0, the attention sink) runs dense. The pool part decides its own neurons
on its device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from powerinfer import ops
from powerinfer.device import Pending
from powerinfer.errors import ConfigError
from powerinfer.model.batch import StepBatch
from powerinfer.model.specs import FFNSpec
from powerinfer.model.workspace import Workspace

if TYPE_CHECKING:
    from powerinfer.model.blocks import Norm

# a batch whose union of active CPU rows exceeds this share of n_ff runs the CPU part densely
DENSE_UNION_SHARE = 0.6


@dataclass
class SparseStats:
    """Per-layer counters (numpy int64: an element update costs far less than a torch op per layer)."""

    tokens: np.ndarray  # (n_layer,) tokens seen
    active: np.ndarray  # (n_layer,) predicted active (token, neuron) pairs
    active_gpu: np.ndarray  # (n_layer,) of which served by the pool
    up_read: np.ndarray  # (n_layer,) pairs whose up row was read (CATS's gate stage; = active otherwise)
    predictor_ms: float = 0.0  # the predictor's time in Python-driven steps
    # (n_layer,) float64: the predictor's seconds the fused decode kernel adds up (SparseFFN.fuse)
    predictor_s: np.ndarray | None = None
    # recall measurement (off unless track_recall() was called): truly active pairs, act(gate) > 0,
    # and of those the ones the selector marked active
    true_active: np.ndarray | None = None
    true_hit: np.ndarray | None = None
    # (n_layer,) int64 each: the tokens a TEAL file's layers computed and the bytes of the transposed rows their
    # input-sparse products read (ops.InputMeter)
    input_tokens: np.ndarray | None = None
    input_bytes: np.ndarray | None = None

    @classmethod
    def zeros(cls, n_layer: int) -> SparseStats:
        stats = cls(*(np.zeros(n_layer, dtype=np.int64) for _ in range(4)))
        stats.predictor_s = np.zeros(n_layer, dtype=np.float64)
        stats.input_tokens = np.zeros(n_layer, dtype=np.int64)
        stats.input_bytes = np.zeros(n_layer, dtype=np.int64)
        return stats

    @property
    def predictor_total_ms(self) -> float:
        """The predictor's time over every step, Python-driven or fused."""
        fused = 0.0 if self.predictor_s is None else float(self.predictor_s.sum()) * 1e3
        return self.predictor_ms + fused

    def track_recall(self) -> None:
        """Also compute every neuron's gate per token and count the truly active ones the selector found."""
        n_layer = self.tokens.size
        self.true_active = np.zeros(n_layer, dtype=np.int64)
        self.true_hit = np.zeros(n_layer, dtype=np.int64)


def check_sparse_spec(spec: FFNSpec) -> None:
    """Threshold-selected (CATS) FFNs compute gated FFNs without biases (gate, up, down_t); ConfigError
    otherwise. Predictor-selected FFNs (SparseFFN) also take ungated FFNs with biases (Falcon, OPT)."""
    if not spec.gated:
        raise ConfigError("sparse FFNs need a gated FFN (gate, up, down_t); this model's FFN has no gate")
    if spec.bias:
        raise ConfigError("sparse FFNs with biases are not supported")


class Selector(Protocol):
    """Decides the active neurons of a layer per token."""

    def select(self, x_residual: torch.Tensor) -> torch.Tensor:
        """Active mask (T, n_ff) from the pre-norm residual (T, D)."""
        ...


class PredictorSelector:
    """PowerInfer's per-layer MLP predictor: active = fc2 . ReLU(fc1 . x) >= threshold."""

    def __init__(
        self,
        fc1: ops.QWeight | ops.DeviceWeight,
        fc2: ops.QWeight | ops.DeviceWeight,
        threshold: float,
        kc: ops.KernelContext,
    ) -> None:
        self.fc1, self.fc2, self.threshold, self.kc = fc1, fc2, threshold, kc  # (r, D), (n_ff, r)

    def select(self, x_residual: torch.Tensor) -> torch.Tensor:
        # fc2's rows are short (rank 128: 4 blocks): float activations take the kernels' several-rows dot path,
        # 2.3x faster than int8 rows one at a time there (5632 x 128, a 4-bit block type, one token: 147 against
        # 337 us; docs/kernels.md), and exact; fc1 (long rows) keeps the context's precision
        hidden = F.relu(ops.linear(x_residual, self.fc1, self.kc))
        score = ops.linear(hidden, self.fc2, self.kc.exact)
        return (score >= self.threshold).to(x_residual.device)


class FusedSparseFFN:
    """A layer's sparse FFN block (norm and residual add included) as one kernel call for one token; with recall
    tracking on (perplexity's KL runs) it runs op by op, since the kernel does not count the truly active neurons."""

    def __init__(self, ffn: SparseFFN, norm: Norm, block: ops.SparseFFNBlock) -> None:
        self.ffn, self.norm, self.block = ffn, norm, block

    def scratch_bytes(self) -> int:
        return self.block.scratch_bytes()

    def __call__(self, x: torch.Tensor, scratch: torch.Tensor, first: bool = False) -> None:
        """x (1, n_embd) float32 contiguous CPU, updated in place; `first` (the token opens its sequence) changes
        nothing: the predictor selects at every position."""
        if self.ffn.stats.true_active is None:
            self.block(x, scratch)
        else:
            x += self.ffn(self.norm(x), x)


class FusedThresholdFFN:
    """A layer's CATS FFN block (norm and residual add included) as one kernel call for one token; with recall
    tracking on it runs op by op, as FusedSparseFFN."""

    def __init__(self, ffn: ThresholdFFN, norm: Norm, block: ops.CATSFFNBlock) -> None:
        self.ffn, self.norm, self.block = ffn, norm, block

    def scratch_bytes(self) -> int:
        return self.block.scratch_bytes()

    def __call__(self, x: torch.Tensor, scratch: torch.Tensor, first: bool = False) -> None:
        """x (1, n_embd) float32 contiguous CPU, updated in place; `first`: the token opens its sequence (position
        0, the attention sink), and runs dense."""
        if self.ffn.stats.true_active is None:
            self.block(x, scratch, first)
        else:
            x += self.ffn(self.norm(x), x, first=first)


class HotPart(Protocol):
    """The pool part of one layer (device.pool.HotRows): some neurons' rows on the pool device."""

    ids: torch.Tensor  # (k,) neuron ids, ascending
    device: torch.device  # where the rows live

    def compute(self, u: torch.Tensor, active: torch.Tensor, act: str, relu_up: bool) -> torch.Tensor:
        """y (T, D) on the pool device of u (T, D) and the active mask (T, k), both there, on the current stream."""
        ...

    def launch(self, u: torch.Tensor, active: torch.Tensor, act: str, relu_up: bool) -> Pending[torch.Tensor]:
        """Queue the hot part for u (T, D) with its active mask (T, k); y (T, D) on the CPU when ready."""
        ...

    def launch_threshold(
        self,
        u: torch.Tensor,
        thresholds: torch.Tensor,
        out_thresholds: torch.Tensor | None,
        dense_rows: torch.Tensor | None,
        act: str,
        relu_up: bool,
    ) -> Pending[tuple[torch.Tensor, torch.Tensor]]:
        """Queue the hot part with CATS's selection (|act(gate)| > thresholds (k,) and, with out_thresholds (k,),
        |act(gate) * up| > out_thresholds, both on the pool device; every neuron for the tokens dense_rows (T,)
        marks), decided on the pool device; when ready, y (T, D) and the counts (2,) of active (token, neuron)
        pairs and of pairs passing the gate stage, both on the CPU."""
        ...


class SparseFFN:
    """Selector-driven FFN of one layer, split between a pool part and the CPU: gated (gate, up, down_t) or, with
    gate None, ungated act(up . u + b_up) (Falcon, OPT); OPT's biases b_up (n_ff,) and b_down (D,) as the
    original adds them: b_up to the active neurons' up values, b_down to the output."""

    def __init__(
        self,
        spec: FFNSpec,
        bid: int,
        selector: Selector,
        gate: ops.QWeight | None,
        up: ops.QWeight,
        down_t: ops.QWeight,
        hot: HotPart | None,
        stats: SparseStats,
        kc: ops.KernelContext,
        workspace: Workspace | None = None,
        biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),  # up (n_ff,), down (D,)
    ) -> None:
        if (gate is None) == spec.gated:
            raise ConfigError("sparse FFN: give a gate matrix exactly when the spec is gated")
        if (biases != (None, None)) != spec.bias:
            raise ConfigError("sparse FFN: biases given do not match the spec")
        self.spec, self.bid, self.selector = spec, bid, selector
        self.gate, self.up, self.down_t = gate, up, down_t  # (n_ff, D) each, down_t transposed
        self.b_up, self.b_down = biases
        self.hot, self.stats, self.kc = hot, stats, kc
        self.n_ff = up.shape[0]
        self.cpu_rows = torch.ones(self.n_ff, dtype=torch.bool)  # False where the pool owns the neuron
        if hot is not None:
            self.cpu_rows[hot.ids] = False
        # decode with every neuron on the CPU runs predictor + FFN as one kernel call (the same bits as
        # select() then rows()); False forces the separate steps (tests that compare the two)
        self.fused_decode = (
            hot is None
            and gate is not None
            and not spec.bias
            and isinstance(selector, PredictorSelector)
            and isinstance(selector.fc1, ops.QWeight)
            and isinstance(selector.fc2, ops.QWeight)
        )
        self.workspace = workspace or Workspace()
        rank = selector.fc1.shape[0] if isinstance(selector, PredictorSelector) else 0
        self.workspace.reserve("ffn", ops.ffn_scratch_bytes(self.n_ff, up.shape[1], rank))

    def fuse(self, norm: Norm) -> FusedSparseFFN | None:
        """This block behind `norm` as one fused op for one token (norm, predictor, FFN rows, residual add, the
        layer's counters: ops.sparse_ffn_block); None where the one-call decode does not apply."""
        sel = self.selector
        if not self.fused_decode or norm.spec.kind == "layer" or not isinstance(sel, PredictorSelector):
            return None
        assert isinstance(sel.fc1, ops.QWeight) and isinstance(sel.fc2, ops.QWeight) and self.gate is not None
        s, b = self.stats, self.bid
        if s is None or s.predictor_s is None:
            return None
        block = ops.sparse_ffn_block(
            norm.weight, norm.spec.eps, sel.fc1, sel.fc2, sel.threshold, self.gate, self.up, self.down_t,
            self.spec.act, self.spec.relu_up, (s.tokens[b : b + 1], s.active[b : b + 1], s.predictor_s[b : b + 1]),
            self.kc,
        )  # fmt: skip
        return None if block is None else FusedSparseFFN(self, norm, block)

    def __call__(
        self, x_norm: torch.Tensor, x_residual: torch.Tensor, batch: StepBatch | None = None
    ) -> torch.Tensor:
        s, spec = self.stats, self.spec
        if self.fused_decode and x_norm.shape[0] == 1 and s.true_active is None:
            sel = self.selector
            assert isinstance(sel, PredictorSelector)
            assert self.gate is not None
            # None where the kernel does not apply (non-kernel weight types, a K-quant fc1 in q8, pool weights)
            fused = ops.predict_ffn(
                x_residual, x_norm, sel.fc1, sel.fc2, sel.threshold, self.gate, self.up, self.down_t,
                spec.act, spec.relu_up, self.kc, scratch=self.workspace.get("ffn"),
            )  # fmt: skip
            if fused is not None:
                y, n_active, seconds = fused
                s.predictor_ms += seconds * 1e3
                s.tokens[self.bid] += 1
                s.active[self.bid] += n_active
                return y
        t0 = time.perf_counter()
        active = self.selector.select(x_residual)  # (T, n_ff)
        s.predictor_ms += (time.perf_counter() - t0) * 1e3
        T = x_norm.shape[0]
        y_hot = None
        if self.hot is None:
            cpu_active = active
        else:
            hot_active = active[:, self.hot.ids]  # (T, k)
            y_hot = self.hot.launch(x_norm, hot_active, spec.act, spec.relu_up)
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
            truth = (self._pre_act(x_norm) > 0).to(active.device)  # (T, n_ff), PowerInfer's label
            s.true_active[self.bid] += int(truth.sum())
            s.true_hit[self.bid] += int((truth & active).sum())
        if self.b_down is not None:
            y = y + self.b_down
        if y_hot is None or self.hot is None:
            s.active[self.bid] += n_cpu
            return y
        n_hot = int(hot_active.sum())
        s.active[self.bid] += n_cpu + n_hot
        s.active_gpu[self.bid] += n_hot
        return y + y_hot.result()

    def _pre_act(self, u: torch.Tensor) -> torch.Tensor:
        """What decides whether a neuron fires: gate . u (gated) or up . u + b_up (ungated), (T, n_ff)."""
        if self.gate is not None:
            return ops.linear(u, self.gate, self.kc)
        v = ops.linear(u, self.up, self.kc)
        return v if self.b_up is None else v + self.b_up

    def _hidden(self, u: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
        """Activations (T, M) of the neurons idx (None: all) for every token."""
        spec, kc = self.spec, self.kc
        up = ops.linear(u, self.up, kc) if idx is None else ops.rows_matmul(u, self.up, idx, kc)
        if self.gate is None:
            if self.b_up is not None:
                up = up + (self.b_up if idx is None else self.b_up[idx])
            return ops.act(spec.act, up)
        g = ops.linear(u, self.gate, kc) if idx is None else ops.rows_matmul(u, self.gate, idx, kc)
        return ops.gated(g, up, spec.act, spec.relu_up)

    def rows(self, u: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """FFN output (T, D) of the neurons idx computed for every token (no mask, no down bias)."""
        spec = self.spec
        if u.shape[0] == 1 and self.gate is not None:
            # decode: one fused kernel call (bit-identical to the unfused ops below)
            return ops.ffn_rows(
                u, self.gate, self.up, self.down_t, idx, spec.act, spec.relu_up, self.kc
            )  # (1, D)
        return ops.rows_axpy(self._hidden(u, idx), self.down_t, idx, self.kc)  # (T, D)

    def cold(self, u: torch.Tensor, cpu_active: torch.Tensor) -> torch.Tensor:
        """The CPU part: only rows active for some token (per-token masks applied), dense if most are."""
        union = cpu_active.any(dim=0)  # (n_ff,)
        idx = torch.nonzero(union).squeeze(1)  # (M,)
        if idx.numel() >= DENSE_UNION_SHARE * self.n_ff:
            h, idx_down = self._hidden(u, None) * cpu_active, None
        else:
            h, idx_down = self._hidden(u, idx) * cpu_active[:, idx], idx
        return ops.rows_axpy(h, self.down_t, idx_down, self.kc)  # (T, D)


def neuron_thresholds(bid: int, values: torch.Tensor, n_ff: int) -> torch.Tensor:
    """(n_ff,) float32 contiguous thresholds of layer bid; ConfigError for a wrong count or a NaN."""
    t = values.detach().to("cpu", torch.float32).reshape(-1).contiguous()
    if t.numel() != n_ff:
        raise ConfigError(f"layer {bid}: {t.numel()} sparsity thresholds for {n_ff} neurons")
    if bool(t.isnan().any()):
        raise ConfigError(f"layer {bid}: a sparsity threshold is NaN")
    return t


class ThresholdFFN:
    """CATS's thresholded gated FFN of one layer: dense gate, then the up rows of the neurons with
    |act(gate . u)| > thresholds, and the down rows of those (or, with out_thresholds, of those whose
    |act(gate . u) * up . u| > out_thresholds too); split between a pool part (hot neurons) and the CPU like
    SparseFFN."""

    def __init__(
        self,
        spec: FFNSpec,
        bid: int,
        thresholds: torch.Tensor,
        gate: ops.QWeight,
        up: ops.QWeight,
        down_t: ops.QWeight,
        hot: HotPart | None,
        stats: SparseStats,
        kc: ops.KernelContext,
        workspace: Workspace | None = None,
        out_thresholds: torch.Tensor | None = None,
    ) -> None:
        check_sparse_spec(spec)
        self.n_ff = gate.shape[0]
        self.spec, self.bid = spec, bid
        self.thresholds = neuron_thresholds(bid, thresholds, self.n_ff)  # (n_ff,) one per neuron
        self.out_thresholds = (
            None if out_thresholds is None else neuron_thresholds(bid, out_thresholds, self.n_ff)
        )
        self.gate, self.up, self.down_t = gate, up, down_t  # (n_ff, D) each, down_t transposed
        self.hot, self.stats, self.kc = hot, stats, kc
        self.hot_thresholds = None if hot is None else self.thresholds[hot.ids].to(hot.device)
        self.hot_out_thresholds = (
            None
            if hot is None or self.out_thresholds is None
            else self.out_thresholds[hot.ids].to(hot.device)
        )
        # the CPU's candidate neurons: None = all of them; else those the pool does not hold
        self.cpu_ids: torch.Tensor | None = None
        if hot is not None:
            cpu_rows = torch.ones(self.n_ff, dtype=torch.bool)
            cpu_rows[hot.ids] = False
            self.cpu_ids = cpu_rows.nonzero().view(-1)
        self.workspace = workspace or Workspace()
        self.workspace.reserve("ffn", ops.cats_scratch_bytes(self.n_ff, gate.shape[1]))

    def fuse(self, norm: Norm) -> FusedThresholdFFN | None:
        """This block behind `norm` as one fused op for one token (norm, CATS FFN, residual add, the layer's
        counters: ops.cats_ffn_block); None where the one-call decode does not apply (a pool part)."""
        s, b = self.stats, self.bid
        if self.hot is not None or norm.spec.kind == "layer":
            return None
        block = ops.cats_ffn_block(
            norm.weight, norm.spec.eps, self.thresholds, self.out_thresholds, self.gate, self.up, self.down_t,
            self.spec.act, self.spec.relu_up, (s.tokens[b : b + 1], s.active[b : b + 1], s.up_read[b : b + 1]),
            self.kc,
        )  # fmt: skip
        return None if block is None else FusedThresholdFFN(self, norm, block)

    def __call__(
        self,
        x_norm: torch.Tensor,
        x_residual: torch.Tensor,
        batch: StepBatch | None = None,
        first: bool = False,
    ) -> torch.Tensor:
        """FFN output (T, D) of x_norm (T, D); the first token of a sequence (position 0 in `batch`, or T = 1 and
        `first`) runs dense."""
        s, spec = self.stats, self.spec
        T = x_norm.shape[0]
        # the first token of a sequence (the attention sink every later token reads) runs dense
        dense_rows = None
        if first and T == 1:
            dense_rows = torch.ones(1, dtype=torch.bool)
        elif (
            batch is not None
            and batch.positions.shape[0] == T
            and any(seg.pos == 0 for seg in batch.segments)
        ):
            dense_rows = batch.positions == 0
        hot_out = None
        if self.hot is not None:
            assert self.hot_thresholds is not None
            hot_out = self.hot.launch_threshold(
                x_norm, self.hot_thresholds, self.hot_out_thresholds, dense_rows, spec.act, spec.relu_up
            )
        y, n_cpu, up_cpu = ops.cats_ffn(
            x_norm, self.gate, self.up, self.down_t, self.cpu_ids, self.thresholds, spec.act, spec.relu_up,
            self.kc, dense_rows=dense_rows, out_thresholds=self.out_thresholds,
            scratch=self.workspace.get("ffn") if T == 1 else None,
        )  # fmt: skip
        s.tokens[self.bid] += T
        if hot_out is None or self.hot is None:
            s.active[self.bid] += n_cpu
            s.up_read[self.bid] += up_cpu
            return y
        y_hot, counts = hot_out.result()
        n_hot, up_hot = (int(v) for v in counts.tolist())
        s.active[self.bid] += n_cpu + n_hot
        s.active_gpu[self.bid] += n_hot
        s.up_read[self.bid] += up_cpu + up_hot
        return y + y_hot
