"""Mixture-of-experts FFN: a router picks the top-k of n_expert FFNs per token, their outputs are summed with the
router's weights; an optional shared expert (Qwen2-MoE) is added, scaled by the sigmoid of its own gate.

The experts are the stacked ggml tensors `ffn_{gate,up,down}_exps` as the file stores them: gate and up
(n_expert * n_ff, n_embd), down (n_expert * n_embd, n_ff); expert e is a row slice of each (no copy, no float
copy, any type the dense kernels read). A step groups its tokens by expert: each selected expert runs its three
matrices once over the tokens routed to it, so its rows are read once per step and the Python work of a step is
one group per distinct selected expert (at most min(n_expert, tokens * k)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from powerinfer import ops
from powerinfer.device import Pending
from powerinfer.errors import ConfigError
from powerinfer.model.batch import StepBatch
from powerinfer.model.blocks import DenseFFN, Norm, Weight
from powerinfer.ops.moe import (
    MoEFFNBlock,
    experts_matmul,
    grouped_matmul,
    moe_experts,
    moe_ffn_block,
    moe_route,
)

GATING_FUNCS = ("softmax", "sigmoid")
ROUTE_INPUTS = ("ffn", "layer")  # the normed FFN input, or the layer input before attention (SmallThinker)
MAX_EXPERTS = 1024


@dataclass(frozen=True)
class MoESpec:
    """The router and experts of a MoE layer.

    gating: probabilities from the router logits (softmax over experts, or a sigmoid each); norm_weights: the
    top-k weights divided by their sum; weights_scale: a factor on them after that. act: the experts' gated
    activation (silu: SwiGLU, relu: ReGLU). n_ff_shexp: width of the shared expert (0: none)."""

    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    gating: str = "softmax"
    norm_weights: bool = False
    weights_scale: float = 1.0
    act: str = "silu"
    n_ff_shexp: int = 0
    route_input: str = "ffn"

    def __post_init__(self) -> None:
        if not 0 < self.n_expert <= MAX_EXPERTS:
            raise ConfigError(f"expert count must be 1..{MAX_EXPERTS} (got {self.n_expert})")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise ConfigError(
                f"experts used per token must be 1..{self.n_expert} (the expert count), got {self.n_expert_used}"
            )
        if self.n_ff_exp <= 0:
            raise ConfigError(f"expert feed-forward length must be positive (got {self.n_ff_exp})")
        if self.gating not in GATING_FUNCS:
            raise ConfigError(f"unknown expert gating '{self.gating}' (known: {', '.join(GATING_FUNCS)})")
        if self.route_input not in ROUTE_INPUTS:
            raise ConfigError(f"unknown router input '{self.route_input}'")
        if not self.weights_scale > 0:
            raise ConfigError(f"expert weights scale must be positive (got {self.weights_scale})")


def route(
    logits: torch.Tensor, spec: MoESpec, kc: ops.KernelContext | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts (T, k) int64 of each token, in increasing id order, and their weights (T, k) float32, from
    router logits (T, n_expert): top-k of the gating probabilities, renormalised and scaled as the spec says. The
    kernel where it applies (the one the one-token block routes with: a token's experts do not depend on its
    batch), else torch."""
    logits = logits.float()
    routed = moe_route(logits, spec.n_expert_used, spec.gating, spec.norm_weights, spec.weights_scale, kc)
    if routed is not None:
        return routed
    probs = torch.softmax(logits, dim=-1) if spec.gating == "softmax" else torch.sigmoid(logits)
    weights, ids = probs.topk(spec.n_expert_used, dim=-1)  # (T, k), largest first
    if spec.norm_weights:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.weights_scale != 1.0:
        weights = weights * spec.weights_scale
    # expert-id order: every path (one token, a prompt grouped by expert) sums a token's experts in one order
    ids, order = ids.sort(dim=-1)
    return ids, weights.gather(-1, order)


class ExpertPart(Protocol):
    """The experts of a layer held whole in the pool (device.pool.PoolExperts)."""

    member: torch.Tensor  # (n_expert,) bool on the CPU: which experts it holds whole
    partial_member: (
        torch.Tensor
    )  # (n_expert,) bool: experts of which it holds some neurons (the CPU the rest)
    cpu_table: (
        np.ndarray | None
    )  # with partial experts: the row addresses the CPU kernel reads (ops.moe_experts)

    def launch(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor
    ) -> Pending[torch.Tensor]:
        """The weighted sum per token (T, n_embd) on the CPU of the (token, expert) pairs mask (T, k) selects,
        when ready."""
        ...


class ExpertSource(Protocol):
    """A layer's experts held apart from the stacked tensors (runtime.expert_store, --memory-limit): `table`
    (3, n_expert) int64 the addresses of each expert's gate, up and down rows (0: not resident) that the kernels
    read; `ensure` makes a step's experts resident first, `prefetch` starts reading experts a prediction names,
    `routed` hands the routed input on to the next layer's predictor."""

    table: np.ndarray

    def ensure(self, ids: torch.Tensor) -> None: ...

    def prefetch(self, ids: torch.Tensor) -> None: ...

    def routed(self, x: torch.Tensor) -> None: ...


class Experts:
    """n_expert gated FFNs stored stacked: y_e = down_e(act(gate_e x) * up_e x).

    pool: the experts the pool holds whole (None: all on the CPU); a step then computes the pairs routed to
    them there, the rest here, and adds the pool's sum to the CPU's (a step with no pair in the pool runs as
    without one). calls / pool_calls count (token, expert) pairs and those the pool served. thresholds (CATS,
    `powerinfer sparsify`): (n_expert, n_ff) float32, neuron n of expert e active where |act(gate_n x)| >
    thresholds[e, n], h_n = 0 elsewhere (every path; the one-token kernel does not read those up rows)."""

    def __init__(
        self,
        spec: MoESpec,
        gate: ops.QWeight,
        up: ops.QWeight,
        down: ops.QWeight,
        kc: ops.KernelContext,
        sparse: bool | None = None,
        pool: ExpertPart | None = None,
        store: ExpertSource | None = None,
        thresholds: torch.Tensor | None = None,
    ) -> None:
        E, F = spec.n_expert, spec.n_ff_exp
        n_embd = gate.shape[1]
        if gate.shape != (E * F, n_embd) or up.shape != gate.shape or down.shape != (E * n_embd, F):
            raise ConfigError(
                f"expert tensors of shapes {gate.shape}, {up.shape}, {down.shape} do not fit {E} experts of "
                f"width {F}"
            )
        if thresholds is not None and thresholds.shape != (E, F):
            raise ConfigError(
                f"expert thresholds of shape {tuple(thresholds.shape)} do not fit {E} experts of {F}"
            )
        if thresholds is not None and pool is not None:
            raise ConfigError("experts with thresholds run on the CPU: the pool computes its experts dense")
        self.spec, self.kc = spec, kc
        self.thresholds = None if thresholds is None else thresholds.to("cpu", torch.float32).contiguous()
        # per-expert row views of the stacked bytes, made once (build time grows with experts, a step does not)
        self.gates = [ops.weight_rows(gate, e * F, (e + 1) * F) for e in range(E)]
        self.ups = [ops.weight_rows(up, e * F, (e + 1) * F) for e in range(E)]
        self.downs = [ops.weight_rows(down, e * n_embd, (e + 1) * n_embd) for e in range(E)]
        self.n_embd = n_embd
        self.gate, self.up, self.down = gate, up, down
        # one token: gate and up rows of its k experts in one rows_matmul call each where the kernels have one,
        # else ops.experts_matmul (each bit for bit the per-expert matmul); down through experts_matmul. One call
        # per matrix, not per expert: with two threads on busy cores every kernel call pays a thread rendezvous
        # (measured, 8 experts of 512 x 1024 of a 4-bit block type, -t 2, load 4.8 on 2 cores: median 3.2 ms one
        # rows_matmul call, 24 ms eight matmul calls; -t 1: 0.54 ms both; docs/kernels.md). ReGLU experts (sparse)
        # read only the up rows whose gate is > 0.
        matmul, rows = getattr(kc.kernels, "matmul", {}), getattr(kc.kernels, "rows_matmul", {})
        self.one_path = all(t.ggml_type in matmul for t in (gate, up, down))
        self.rows_path = gate.ggml_type in rows and up.ggml_type in rows
        self.sparse = ((spec.act == "relu") if sparse is None else sparse) and self.rows_path
        self.sparse = self.sparse and self.thresholds is None
        self.neurons = torch.arange(F)
        # one token in one kernel call (kernels/cpu/moe.c: gate, up, down of the k experts and their weighted sum,
        # the bits of the per-matrix calls below) where the kernels read all three types; else op by op
        relu = (spec.act == "relu") if sparse is None else sparse
        table = store.table if store is not None else (pool.cpu_table if pool is not None else None)
        self.kernel = moe_experts(
            gate, up, down, E, spec.n_expert_used, spec.act, relu, kc, self.thresholds, table=table
        )
        # with thresholds, a sequence's first token (the attention sink every later token reads) runs dense
        self.dense_kernel = (
            None
            if self.thresholds is None
            else moe_experts(gate, up, down, E, spec.n_expert_used, spec.act, relu, kc, table=table)
        )
        self.store = store
        grouped = getattr(kc.kernels, "moe_grouped_ffn", None) is not None and self.one_path
        if store is not None and (self.kernel is None or not grouped or pool is not None):
            raise ConfigError(
                "--memory-limit needs the MoE kernels for these expert types on the CPU, without a pool"
            )
        if table is not None and (self.kernel is None or not grouped):
            raise ConfigError("neurons of experts in the pool need the MoE kernels for these expert types")
        self.pool = pool
        self.calls = self.pool_calls = 0

    def hidden(
        self, g: torch.Tensor, u: torch.Tensor, experts: torch.Tensor, dense: bool = False
    ) -> torch.Tensor:
        """h = act(g) * u (n, n_ff) of rows computed by experts (n,) int64; with thresholds (unless dense), 0
        where |act(g)| is not above the row's expert's threshold (the kernels' h: act(g) then a product with u)."""
        if self.thresholds is None or dense:
            return ops.gated(g, u, self.spec.act, False)
        a = ops.gated(g, torch.ones_like(g), self.spec.act, False)
        return torch.where(a.abs() > self.thresholds[experts], a * u, torch.zeros_like(a))

    def expert(self, e: int, x: torch.Tensor, dense: bool = False) -> torch.Tensor:
        """Expert e over x (n, n_embd): (n, n_embd)."""
        kc = self.kc
        g, u = ops.linear(x, self.gates[e], kc), ops.linear(x, self.ups[e], kc)
        h = self.hidden(g, u, torch.full((x.shape[0],), e, dtype=torch.int64), dense)
        return ops.linear(h, self.downs[e], kc)

    def __call__(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        dense_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for x (T, n_embd), ids and weights (T, k); dense_rows
        (T,) bool: tokens computed without the thresholds (a sequence's first token)."""
        self.calls += ids.numel()
        if self.store is not None:  # the experts from the store: resident first, then the kernels (its table)
            self.store.ensure(ids)
            self.store.routed(x)
        if self.thresholds is not None and dense_rows is not None and bool(dense_rows.any()):
            first = dense_rows[:, None].expand_as(ids)  # each token's pairs whole in one of the two calls
            return self.pairs(x, ids, weights, ~first).add_(self.pairs(x, ids, weights, first, dense=True))
        if self.pool is None:
            return self.on_cpu(x, ids, weights)
        pooled = self.pool.member[ids]  # (T, k)
        partial = self.pool.partial_member[ids]  # the pool computes some of their neurons, the CPU the rest
        n_pool = int(pooled.sum())
        if n_pool == 0 and not bool(partial.any()):
            return self.on_cpu(x, ids, weights)
        self.pool_calls += n_pool
        y = self.pool.launch(x, ids, weights, pooled | partial)
        out = self.pairs(x, ids, weights, ~pooled)  # the CPU's pairs while the pool computes
        return out.add_(y.result())

    def pairs(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        mask: torch.Tensor,
        dense: bool = False,
    ) -> torch.Tensor:
        """The sum of the pairs (t, j) mask (T, k) selects, grouped by expert as a prompt step groups them
        (dense: without the thresholds)."""
        kernel = self.dense_kernel if dense else self.kernel
        if kernel is not None:  # one kernel call, the pairs left out marked -1
            grouped = kernel.grouped(x, ids.masked_fill(~mask, -1), weights)
            if grouped is not None:
                return grouped
        T, k = ids.shape
        out = torch.zeros(T, self.n_embd, dtype=torch.float32)
        slots = mask.reshape(-1).nonzero().reshape(-1)
        if slots.numel() == 0:
            return out
        chosen = ids.reshape(-1)[slots]
        order = chosen.argsort(stable=True)
        slots, chosen = slots[order], chosen[order]
        used, counts = torch.unique_consecutive(chosen, return_counts=True)
        tokens = slots // k
        xs = x[tokens]
        experts, sizes = used.tolist(), counts.tolist()
        if self.one_path:
            F, kc = self.spec.n_ff_exp, self.kc
            g = grouped_matmul(xs, self.gate, F, experts, sizes, kc)
            h = self.hidden(g, grouped_matmul(xs, self.up, F, experts, sizes, kc), chosen, dense)
            y = grouped_matmul(h, self.down, self.n_embd, experts, sizes, kc)
        else:
            y = torch.cat([self.expert(e, g, dense) for e, g in zip(experts, xs.split(sizes), strict=True)])
        out.index_add_(0, tokens, y * weights.reshape(-1)[slots, None])
        return out

    def on_cpu(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every selected expert on the CPU."""
        T, k = ids.shape
        out = torch.zeros(T, self.n_embd, dtype=torch.float32)
        if T == 1 and self.kernel is not None:
            self.kernel(x, ids, weights, out)
            return out
        if T == 1 and self.one_path:
            return self.one_token(x, ids, weights, out)
        if T == 1:
            for j, e in enumerate(ids[0].tolist()):
                out += self.expert(e, x) * weights[0, j]
            return out
        if self.kernel is not None:  # the whole step in one kernel call (gate, up, activation, down, sum)
            grouped = self.kernel.grouped(x, ids, weights)
            if grouped is not None:
                return grouped
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # (T k,) slots grouped by expert, tokens in order within a group
        counts = torch.bincount(flat, minlength=self.spec.n_expert)
        used = counts.nonzero().reshape(-1)
        tokens = order // k
        xs = x[tokens]  # (T k, n_embd): each group's tokens, the groups in expert-id order
        experts, sizes = used.tolist(), counts[used].tolist()
        if self.one_path:  # each matrix of each selected expert in one kernel call over its tokens
            F, kc = self.spec.n_ff_exp, self.kc
            g = grouped_matmul(xs, self.gate, F, experts, sizes, kc)
            h = self.hidden(g, grouped_matmul(xs, self.up, F, experts, sizes, kc), flat[order])
            y = grouped_matmul(h, self.down, self.n_embd, experts, sizes, kc)
        else:
            y = torch.cat([self.expert(e, g) for e, g in zip(experts, xs.split(sizes), strict=True)])
        # one add per (token, expert) in expert-id order per token, as one_token adds them
        out.index_add_(0, tokens, y * weights.reshape(-1)[order, None])
        return out

    def one_token(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """The experts of one token x (1, n_embd): gate, up and down of its k experts in one op call each; ReGLU
        experts compute only the up rows of neurons whose gate is positive."""
        kc, F = self.kc, self.spec.n_ff_exp
        experts = ids[0].tolist()
        if not self.rows_path or self.thresholds is not None:
            g, u = experts_matmul(x, self.gate, F, experts, kc), experts_matmul(x, self.up, F, experts, kc)
            h = self.hidden(g, u, ids[0])  # (k, F)
        else:
            rows = (ids[0, :, None] * F + self.neurons).reshape(-1)  # (k F,) rows of the stacked gate and up
            g = ops.rows_matmul(x, self.gate, rows, kc)[0]
            if self.sparse:
                active = (g > 0).nonzero().reshape(-1)  # relu(gate) = 0 elsewhere: their up rows are not read
                h = torch.zeros_like(g)
                if active.numel():
                    h[active] = torch.relu(g[active]) * ops.rows_matmul(x, self.up, rows[active], kc)[0]
            else:
                h = ops.gated(g, ops.rows_matmul(x, self.up, rows, kc)[0], self.spec.act, False)
            h = h.view(-1, F)
        y = experts_matmul(h, self.down, self.n_embd, experts, kc)  # (k, n_embd)
        w = weights[0].tolist()
        for j in range(len(experts)):  # in expert-id order, as the grouped path adds them
            out += y[j] * w[j]
        return out


class SharedExpert:
    """Qwen2-MoE's shared expert: a dense gated FFN scaled per token by sigmoid(gate_inp . x)."""

    def __init__(self, ffn: DenseFFN, gate_inp: torch.Tensor) -> None:
        self.ffn, self.gate_inp = ffn, gate_inp  # gate_inp (n_embd,)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # a row-wise product and sum (not a matvec, whose sums depend on T): each token's scale as if alone
        scale = torch.sigmoid((x * self.gate_inp).sum(dim=-1))  # (T,)
        return self.ffn(x, x) * scale[:, None]


class MoEFFN:
    """A layer's MoE FFN (the FFN protocol of powerinfer.model.blocks): router, experts, optional shared expert.

    With route_input "layer" the router reads the layer input, handed over by `route_early` before attention."""

    def __init__(
        self,
        spec: MoESpec,
        bid: int,
        router: Weight,
        experts: Experts,
        kc: ops.KernelContext,
        shared: SharedExpert | None = None,
    ) -> None:
        self.spec, self.bid, self.router, self.kc = spec, bid, router, kc
        self.experts, self.shared = experts, shared
        self._early: torch.Tensor | None = None  # router logits of the layer input (route_input "layer")
        self.counts: torch.Tensor | None = None  # selections per expert when counting (profile), else None
        # ReLU experts while profiling: (n_expert, n_ff) how often each neuron's gate was positive when selected
        self.neuron_counts: torch.Tensor | None = None
        self.record: list[tuple[torch.Tensor, torch.Tensor]] | None = (
            None  # (input, logits) per step, or None
        )

    def fuse(self, norm: Norm) -> FusedMoEFFN | None:
        """This block behind `norm` as one kernel call for one token (norm, router, routing, experts, residual add
        in place: ops.moe_ffn_block); None where that does not apply (no experts kernel, a shared expert, a
        LayerNorm, a placed router)."""
        experts = self.experts.kernel
        if (
            experts is None
            or self.shared is not None
            or norm.spec.kind == "layer"
            or self.router.on_device
            or self.experts.pool is not None
            or self.experts.store is not None
        ):
            return None
        s = self.spec
        router = None if s.route_input == "layer" else self.router
        assert not isinstance(router, ops.DeviceWeight)
        block = moe_ffn_block(
            norm.weight, norm.spec.eps, router, experts, s.gating, s.norm_weights, s.weights_scale, self.kc
        )
        dense = self.experts.dense_kernel
        dense_block = None
        if dense is not None:  # thresholds: a sequence's first token through the experts without them
            dense_block = moe_ffn_block(
                norm.weight, norm.spec.eps, router, dense, s.gating, s.norm_weights, s.weights_scale, self.kc
            )
            if dense_block is None:
                return None
        return None if block is None else FusedMoEFFN(self, block, dense_block)

    def route_early(self, x: torch.Tensor) -> None:
        """Router logits of the layer input x (T, n_embd), for the FFN call of the same step."""
        self._early = ops.linear(x if self.router.on_device else x.to("cpu"), self.router, self.kc)
        store = self.experts.store
        if store is not None:  # this step's experts are known now: read them while attention runs
            store.prefetch(route(self._early.to("cpu"), self.spec, self.kc)[0])

    def logits(self, x_norm: torch.Tensor) -> torch.Tensor:
        if self.spec.route_input == "layer":
            logits, self._early = self._early, None
            if logits is None:
                raise RuntimeError("MoE layer routed on the layer input was called without route_early")
            return logits
        return ops.linear(x_norm, self.router, self.kc)

    def __call__(
        self, x_norm: torch.Tensor, x_residual: torch.Tensor, batch: StepBatch | None = None
    ) -> torch.Tensor:
        x = x_norm.to("cpu").float().contiguous()
        logits = self.logits(x).to("cpu")
        if self.record is not None:  # train-predictor: this layer's routed input and its router's logits
            self.record.append((x.clone(), logits.clone()))
        ids, weights = route(logits, self.spec, self.kc)
        if self.counts is not None:
            self.counts += torch.bincount(ids.reshape(-1), minlength=self.spec.n_expert)
        if self.neuron_counts is not None:
            self.count_neurons(x, ids)
        dense_rows = None  # a sequence's first token runs without the thresholds (CATS files)
        if (
            batch is not None
            and batch.positions.shape[0] == x.shape[0]
            and any(g.pos == 0 for g in batch.segments)
        ):
            dense_rows = batch.positions == 0
        out = self.experts(x, ids, weights, dense_rows)
        if self.shared is not None:
            out = out + self.shared(x)
        return out

    def count_neurons(self, x: torch.Tensor, ids: torch.Tensor) -> None:
        """Profiling: add each selected expert's neurons with a positive gate (one gate matmul per distinct
        expert of the step, as the prompt path groups them)."""
        assert self.neuron_counts is not None
        T, k = ids.shape
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        used, sizes = torch.unique_consecutive(flat[order], return_counts=True)
        experts, counts = used.tolist(), sizes.tolist()
        g = grouped_matmul(x[order // k], self.experts.gate, self.spec.n_ff_exp, experts, counts, self.kc)
        for e, rows in zip(experts, (g > 0).split(counts), strict=True):
            self.neuron_counts[e] += rows.sum(dim=0)


class FusedMoEFFN:
    """A layer's MoE FFN block (norm and residual add included) as one kernel call for one token (the fused-FFN
    protocol of powerinfer.model.transformer)."""

    def __init__(self, ffn: MoEFFN, block: MoEFFNBlock, dense_block: MoEFFNBlock | None = None) -> None:
        self.ffn, self.block, self.dense_block = ffn, block, dense_block  # dense_block: a first token (CATS)
        self.ids = torch.empty(ffn.spec.n_expert_used, dtype=torch.int64)

    def scratch_bytes(self) -> int:
        return 0  # the block keeps its own

    def __call__(self, x: torch.Tensor, scratch: torch.Tensor | None, first: bool = False) -> None:
        """x (1, n_embd) float32 contiguous CPU, updated in place."""
        ffn = self.ffn
        logits = None
        if ffn.spec.route_input == "layer":
            logits, ffn._early = ffn._early, None
            if logits is None:
                raise RuntimeError("MoE layer routed on the layer input was called without route_early")
            logits = logits.contiguous()
        counting = ffn.counts is not None
        ffn.experts.calls += ffn.spec.n_expert_used
        block = self.dense_block if first and self.dense_block is not None else self.block
        block(x, logits, self.ids if counting else None)
        if ffn.counts is not None:
            ffn.counts += torch.bincount(self.ids, minlength=ffn.spec.n_expert)
