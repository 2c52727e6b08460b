"""Whole experts stacked on a compute device (`StackedExperts`): the pool's experts of a MoE layer, slot after slot,
and their step over the (token, expert) pairs the router picked, in a fixed number of op calls whatever the
experts, their number or k; `ExpertNeurons`, some neurons of some experts, likewise.

Backends as DeviceWeight's: "triton" (CUDA, or the Triton interpreter on CPU tensors) runs
powerinfer.ops.triton_experts' pair kernel for gate, up and down; "kernels" (the CPU standing in for the pool)
runs the CPU's own grouped MoE kernel (pi_moe_grouped_ffn, kernels/cpu/moe.c) over a table of the slots' row
addresses: the kernel that computes a prompt's experts on the CPU, so the stand-in gives the CPU's bits per pair.
Without the C kernels, a torch path over rows gathered per pair (get_rows), with no per-expert loop either.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np
import torch

from powerinfer.ops.activation import gated, gated_ref
from powerinfer.ops.context import KernelContext
from powerinfer.ops.dense import get_rows
from powerinfer.ops.moe import MoEExperts, moe_experts
from powerinfer.ops.qweight import QWeight
from powerinfer.ops.weights import DeviceWeight, triton_kernels

__all__ = ["ExpertNeurons", "StackedExperts"]


class StackedExperts:
    """Experts `ids` (S,) of n_expert stacked gated FFNs (gate and up (n_expert * n_ff, n_embd), down
    (n_expert * n_embd, n_ff)), copied to `device` slot after slot: one DeviceWeight per matrix (S * n_ff or
    S * n_embd rows, the file's blocks) and `slot` (n_expert,) int64 on the device, expert id -> slot (-1: not
    here)."""

    def __init__(
        self,
        gate: QWeight,
        up: QWeight,
        down: QWeight,
        ids: torch.Tensor,
        n_expert: int,
        act: str,
        device: torch.device,
        kc: KernelContext,
        backend: str | None = None,
    ) -> None:
        n_ff, n_embd = down.shape[1], gate.shape[1]
        ids = ids.to("cpu", torch.int64).reshape(-1)
        self.n_expert, self.n_ff, self.n_embd, self.act, self.kc = n_expert, n_ff, n_embd, act, kc
        rows_ff = (ids[:, None] * n_ff + torch.arange(n_ff)).reshape(-1)  # (S n_ff,) the slots' rows in order
        rows_embd = (ids[:, None] * n_embd + torch.arange(n_embd)).reshape(-1)
        self.gate = DeviceWeight.from_qweight(gate, device, rows_ff, backend, kc)
        self.up = DeviceWeight.from_qweight(up, device, rows_ff, backend, kc)
        self.down = DeviceWeight.from_qweight(down, device, rows_embd, backend, kc)
        slot = torch.full((n_expert,), -1, dtype=torch.int64)
        slot[ids] = torch.arange(len(ids))
        self.slot = slot.to(device)
        self.backend = self.gate.backend
        self.table: np.ndarray | None = None
        self._kernels: dict[int, MoEExperts | None] = {}  # the CPU's grouped kernel per k, made on first use
        self._pairs: ModuleType | None = None  # powerinfer.ops.triton_experts (the triton backend)
        if self.backend == "triton" and len(ids):
            triton_kernels()  # a PlacementError naming the cause without triton
            self._pairs = importlib.import_module("powerinfer.ops.triton_experts")
        if self.backend == "kernels" and len(ids):
            # (3, n_expert) addresses of each pooled expert's rows in the stacks (0: not here), as the CPU's MoE
            # kernels read a table (ops.moe_experts)
            table = np.zeros((3, n_expert), dtype=np.int64)
            for m, (w, n) in enumerate(((self.gate, n_ff), (self.up, n_ff), (self.down, n_embd))):
                slots = np.arange(len(ids), dtype=np.int64)
                table[m, ids.numpy()] = w.raw.data_ptr() + slots * n * w.raw.stride(0)
            self.table = table

    @property
    def n_bytes(self) -> int:
        return self.gate.n_bytes + self.up.n_bytes + self.down.n_bytes

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """sum over j of the pairs (t, j) with mask[t, j] whose expert ids[t, j] is here of weights[t, j] *
        expert(x[t]), in j order: (T, n_embd) float32, for x (T, n_embd), ids, weights, mask (T, k), all on this
        device."""
        T, k = ids.shape
        slots = self.slot[ids].masked_fill(~mask, -1)  # (T, k)
        if self.table is not None:
            kernel = self._kernel(k)
            if kernel is not None:  # the pairs outside the pool marked -1: one kernel call
                out = kernel.grouped(x, ids.masked_fill(slots < 0, -1), weights)
                if out is not None:
                    return out
            return self._torch(x, slots, weights)
        if self._pairs is None:
            return torch.zeros(T, self.n_embd, dtype=torch.float32, device=x.device)
        flat = slots.reshape(-1)  # (T k,) pair p = t k + j
        order = flat.argsort()  # the programs take an expert's pairs one after another (its rows in L2)
        mm = self._pairs.pairs_matmul
        g = mm(x, flat, self.gate._packed, self.n_ff, k, order)  # (T k, n_ff)
        u = mm(x, flat, self.up._packed, self.n_ff, k, order)
        y = mm(gated_ref(g, u, self.act, False), flat, self.down._packed, self.n_embd, 1, order)
        return self._pairs.pairs_sum(y, weights.float().masked_fill(slots < 0, 0.0))

    def _kernel(self, k: int) -> MoEExperts | None:
        if k not in self._kernels:  # once per k (a model has one)
            host = [w._host for w in (self.gate, self.up, self.down)]
            assert host[0] is not None and host[1] is not None and host[2] is not None
            self._kernels[k] = moe_experts(
                host[0], host[1], host[2], self.n_expert, k, self.act, False, self.kc, table=self.table
            )
        return self._kernels[k]

    def _torch(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The CPU stand-in without the C kernels: each pair's rows decoded (get_rows) and multiplied, batched."""
        T, k = slots.shape
        F, D, P = self.n_ff, self.n_embd, T * k
        s = slots.reshape(-1).clamp(min=0)  # (P,): a pair outside the pool reads slot 0, weighted 0
        xs = x[torch.arange(P) // k].float()  # (P, D)

        def rows(w: DeviceWeight, n: int) -> torch.Tensor:
            assert w._host is not None
            return get_rows(w._host, (s[:, None] * n + torch.arange(n)).reshape(-1), self.kc).view(P, n, -1)

        g = torch.bmm(rows(self.gate, F), xs[:, :, None])[..., 0]  # (P, F)
        u = torch.bmm(rows(self.up, F), xs[:, :, None])[..., 0]
        y = torch.bmm(rows(self.down, D), gated_ref(g, u, self.act, False)[:, :, None])[..., 0]  # (P, D)
        w = weights.float().masked_fill(slots < 0, 0.0)
        return (y.view(T, k, D) * w[:, :, None]).sum(dim=1)


class ExpertNeurons:
    """Some neurons of some experts on a compute device (ReLU experts partly in the pool): their gate and up rows
    in the file's blocks and their down columns as float32 rows (`down_t`), the rows grouped by expert in id
    order (`experts` (n_rows,) int64, ascending: each row's expert); `start` and `count` (n_expert,) int64 on the
    device: expert e's rows (count 0: none here).

    A step's pairs whose expert has rows here compute those neurons only, weighted by the pair's router weight:
    on "triton" one program per (pair, row block) reads only the rows of the pair's expert
    (ops.triton_experts.pairs_rows_matmul, then pairs_axpy for the down columns); on the CPU stand-in
    ("kernels") every row here for every token, through the C kernels (linear, gated, axpy: the bits of a sparse
    FFN's pool part), each token's rows weighted by its router weight of their expert (0 where not picked)."""

    def __init__(
        self,
        gate: QWeight,
        up: QWeight,
        down_t: QWeight,
        experts: np.ndarray,
        n_expert: int,
        act: str,
        device: torch.device,
        kc: KernelContext,
        backend: str | None = None,
    ) -> None:
        experts = np.asarray(experts, dtype=np.int64)
        if len(experts) != gate.shape[0] or np.any(np.diff(experts) < 0):
            raise ValueError("ExpertNeurons: one expert id per row, in ascending order")
        self.act, self.kc, self.n_expert, self.n_embd = act, kc, n_expert, down_t.shape[1]
        self.gate = DeviceWeight.from_qweight(gate, device, None, backend, kc)
        self.up = DeviceWeight.from_qweight(up, device, None, backend, kc)
        self.down_t = DeviceWeight.from_qweight(down_t, device, None, backend, kc)
        counts = np.bincount(experts, minlength=n_expert)
        self.width = int(counts.max()) if len(experts) else 0  # most rows of one expert
        self.start = torch.from_numpy(np.cumsum(counts) - counts).to(device)
        self.count = torch.from_numpy(counts).to(device)
        self.experts = torch.from_numpy(experts).to(device)
        self.backend = self.gate.backend
        self._pairs: ModuleType | None = None
        if self.backend == "triton":
            triton_kernels()
            self._pairs = importlib.import_module("powerinfer.ops.triton_experts")

    @property
    def n_bytes(self) -> int:
        return self.gate.n_bytes + self.up.n_bytes + self.down_t.n_bytes

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """sum over the pairs (t, j) with mask[t, j] of weights[t, j] * (the neurons here of expert ids[t, j])(x[t]):
        (T, n_embd) float32, all on this device; a token's k ids differ."""
        T, k = ids.shape
        if self._pairs is None:
            picked = torch.zeros(T, self.n_expert, dtype=torch.float32, device=x.device)
            picked.scatter_(1, ids, weights.float().masked_fill(~mask, 0.0))
            g, u = self.gate.linear(x, self.kc), self.up.linear(x, self.kc)
            return self.down_t.axpy(gated(g, u, self.act, False).mul_(picked[:, self.experts]), self.kc)
        count = self.count[ids].masked_fill(~mask, 0).reshape(-1)  # (T k,) rows of each pair's expert here
        start = self.start[ids].reshape(-1)
        order = start.masked_fill(count == 0, -1).argsort()  # an expert's pairs one after another
        mm = self._pairs.pairs_rows_matmul
        g = mm(x, start, count, self.gate._packed, self.width, k, order)  # (T k, width), 0 past the count
        u = mm(x, start, count, self.up._packed, self.width, k, order)
        y = self._pairs.pairs_axpy(gated_ref(g, u, self.act, False), start, count, self.down_t._packed)
        return self._pairs.pairs_sum(y, weights.float().masked_fill(count.view(T, k) == 0, 0.0))
