"""What an assembled model reads per token and how its sparse parts did: the lines `-v` and `--verbose-prompt`
print after a run, and the byte counts behind them.

Every function reads an `AssembledModel` (runtime.assembly) and the counters its blocks keep (the sparse FFN's
SparseStats, the sparse head's HeadStats); tensors are found by their name templates (gguf.constants.TensorNames)
per layer, not by matching names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from powerinfer.gguf.constants import Keys, TensorNames
from powerinfer.model.head import SCREEN, SCREEN_PROJ, SparseHead

if TYPE_CHECKING:
    from powerinfer.model.config import ModelConfig
    from powerinfer.runtime.assembly import AssembledModel

# the matrices of one mixture-of-experts layer, all experts stacked; a token reads k of n_expert of each
EXPERT_MATRICES = (TensorNames.FFN_GATE_EXPS, TensorNames.FFN_UP_EXPS, TensorNames.FFN_DOWN_EXPS)
# every FFN matrix of a layer: their bytes on the pool device are a dense plan's share of the FFN work
FFN_MATRICES = (
    TensorNames.FFN_GATE,
    TensorNames.FFN_UP,
    TensorNames.FFN_DOWN,
    TensorNames.FFN_DOWN_T,
    *EXPERT_MATRICES,
    TensorNames.FFN_GATE_SHEXP,
    TensorNames.FFN_UP_SHEXP,
    TensorNames.FFN_DOWN_SHEXP,
)
# the backend of a run whose pool is the CPU standing in for a GPU (--pool-device cpu)
STAND_IN = "CPU (stand-in pool)"


def weight_bytes(m: AssembledModel) -> int:
    """Bytes of tensor data in the model file (read once per decoded token)."""
    return sum(t.n_bytes for t in m.gguf.tensors.values())


def _layer_bytes(m: AssembledModel, template: str) -> int:
    """Bytes of one tensor kind over every layer of the file (0 where a layer has none)."""
    tensors = m.gguf.tensors
    names = (template.format(bid=bid) for bid in range(m.config.n_layer))
    return sum(tensors[name].n_bytes for name in names if name in tensors)


def sparse_head(m: AssembledModel) -> SparseHead | None:
    head = m.model.head
    return head if isinstance(head, SparseHead) else None


def head_read_bytes(m: AssembledModel) -> int:
    """Weight bytes the sparse head reads per token: its screen and candidates, the rows it widened to and the
    whole head for its fallbacks (averaged over its tokens); 0 without a sparse head."""
    head = sparse_head(m)
    if head is None:
        return 0
    st = head.stats
    whole = head.output.raw.numel()
    extra = st.extra_rows * head.output.raw.shape[1]
    return int(head.read_bytes() + (st.fallbacks * whole + extra) / max(1, st.tokens))


def sparse_mode(config: ModelConfig) -> str:
    """The mode line's name for a sparse file."""
    return "sparse (PWRI, TEAL)" if config.sparse_method == "teal" else "sparse (PWRI)"


def teal_counted(m: AssembledModel) -> bool:
    """Whether every layer of a TEAL file has counted the rows its tokens read (ops.InputMeter)."""
    s = m.sparse_stats
    return s is not None and s.input_tokens is not None and bool((s.input_tokens > 0).all())


def teal_skipped_bytes(m: AssembledModel) -> float:
    """Bytes of a TEAL file's transposed matrices a token skips: counted (the rows the products read, per token of
    each layer) once every layer has computed a token, else estimated at each layer's calibrated sparsity (the
    share of inputs below the thresholds on the calibration text)."""
    tensors = m.gguf.tensors
    s = m.sparse_stats
    if teal_counted(m):
        assert s is not None and s.input_tokens is not None and s.input_bytes is not None
        whole = sum(
            info.n_bytes
            for bid in range(m.config.n_layer)
            for template in TensorNames.TEAL_MATRICES
            if (info := tensors.get(TensorNames.transposed(template.format(bid=bid)))) is not None
        )
        return whole - float((s.input_bytes / s.input_tokens).sum())
    shares = m.gguf.metadata.get(Keys.SPARSITY_LAYER_SPARSITY)
    if not isinstance(shares, np.ndarray) or shares.shape != (m.config.n_layer,):
        return 0.0
    skipped = 0.0
    for bid, share in enumerate(shares.tolist()):
        for template in TensorNames.TEAL_MATRICES:
            info = tensors.get(TensorNames.transposed(template.format(bid=bid)))
            if info is not None:
                skipped += info.n_bytes * min(max(float(share), 0.0), 1.0)
    return skipped


def read_bytes_per_token(m: AssembledModel) -> float:
    """Weight bytes one decoded token reads: the file's tensors, less the FFN rows sparsity skips (by the
    measured shares), the head as head_read_bytes (the file's screen tensors only when in use)."""
    per_token = float(weight_bytes(m))
    for name in (SCREEN, SCREEN_PROJ):
        if name in m.gguf.tensors:
            per_token -= m.gguf.tensors[name].n_bytes
    head = sparse_head(m)
    if head is not None:
        per_token += head_read_bytes(m) - head.output.raw.numel()
    c = m.config
    moe = getattr(c, "moe", None)
    if moe is not None:  # a token reads the rows of its k experts of n_expert only
        experts = sum(_layer_bytes(m, template) for template in EXPERT_MATRICES)
        per_token -= experts * (1.0 - moe.n_expert_used / moe.n_expert)
    if c.sparse and c.sparse_method == "teal" and m.sparse_stats is not None:
        per_token -= teal_skipped_bytes(m)
    s = m.sparse_stats
    if s is None or int(s.tokens.sum()) == 0:
        return per_token
    cats = c.sparse_method == "cats"
    active = s.active / (np.maximum(s.tokens, 1) * c.n_ff)
    share = float(active.mean())
    up_share = float((s.up_read / (np.maximum(s.tokens, 1) * c.n_ff)).mean()) if cats else share
    read = {TensorNames.FFN_UP: up_share, TensorNames.FFN_DOWN_T: share}
    if not cats:
        read[TensorNames.FFN_GATE] = share
    for template, fraction in read.items():
        per_token -= _layer_bytes(m, template) * (1.0 - fraction)
    return per_token


def head_report(m: AssembledModel) -> list[str]:
    """The sparse head's line: candidates, fallbacks, bytes read against the whole head."""
    head = sparse_head(m)
    if head is None or head.stats.tokens == 0:
        return []
    stats = head.stats
    return [
        f"head: sparse (screen of rank {head.proj.shape[0]}, {head.n_candidates} exact candidates), "
        f"of {stats.tokens} tokens {stats.spread / stats.tokens:.1%} widened for their spread probability, "
        f"{stats.widened / stats.tokens:.1%} for their margin (mean "
        f"{stats.extra_rows / max(1, stats.widened + stats.spread):.0f} rows more), {stats.fallbacks / stats.tokens:.1%} "
        "computed whole; "
        f"~{head_read_bytes(m) / 2**20:.1f} MiB read per token (whole head: "
        f"{head.output.raw.numel() / 2**20:.1f} MiB)"
    ]


def sparse_report(m: AssembledModel) -> list[str]:
    """Telemetry lines of sparse mode: predicted active share per layer, pool share, bytes per token, and
    the sparse head's line (MoE files: the experts' share of the bytes a token reads)."""
    s = m.sparse_stats
    file_mib = weight_bytes(m) / 2**20
    if s is None or int(s.tokens.sum()) == 0:
        head_lines = head_report(m)
        moe = getattr(m.config, "moe", None)
        if moe is not None:
            head_lines.append(
                f"moe: {moe.n_expert_used} of {moe.n_expert} experts per token: "
                f"~{read_bytes_per_token(m) / 2**20:.1f} MiB of weights read per token (the file: "
                f"{file_mib:.1f} MiB)"
            )
            return head_lines + cats_expert_report(m) + expert_report(m)
        teal = m.config.sparse and m.config.sparse_method == "teal" and s is not None
        if not head_lines and not teal:
            return []
        target = m.gguf.metadata.get(Keys.SPARSITY_TARGET)
        how = ""
        if teal:
            count = "counted" if teal_counted(m) else "estimated"
            how = f", {count}; TEAL input thresholds at the calibrated sparsity {target:.2f}"
        return [
            *head_lines,
            f"sparse: ~{read_bytes_per_token(m) / 2**20:.1f} MiB of "
            f"weights read per token (the file: {file_mib:.1f} MiB){how}",
        ]
    c = m.config
    active = (s.active / (np.maximum(s.tokens, 1) * c.n_ff)).tolist()  # per layer
    pool = float(s.active_gpu.sum()) / max(1.0, float(s.active.sum()))
    # cats: the gate is read for every neuron, up for those passing the gate stage, down for the active ones
    cats = c.sparse_method == "cats"
    up_share = (s.up_read / (np.maximum(s.tokens, 1) * c.n_ff)).tolist() if cats else active
    share = sum(active) / len(active)
    per_token = read_bytes_per_token(m)
    per_layer = " ".join(f"{a:.2f}" for a in active)
    target = m.gguf.metadata.get(Keys.SPARSITY_TARGET)
    shown = f" {target:.2f}" if isinstance(target, (int, float)) and not isinstance(target, bool) else ""
    selection = (
        f"cats thresholds (target sparsity{shown})"
        if cats
        else f"predictor {s.predictor_total_ms:.2f} ms in total"
    )
    up_note = ""
    if cats and sum(up_share) > sum(active) + 1e-9:
        up_note = f" (up rows read for {sum(up_share) / len(up_share):.1%})"
    pool_device = m.pool_device
    lines = [
        f"sparse: {'active' if cats else 'predicted active'} {share:.1%} of FFN neurons{up_note}, "
        f"per layer: {per_layer}",
        f"sparse: {pool:.1%} of active neurons served by the pool"
        + (f" on {pool_device}" if pool_device is not None else " (no pool: all on the CPU)"),
        *head_report(m),
        f"sparse: ~{per_token / 2**20:.1f} MiB of weights read per token "
        f"(the file: {file_mib:.1f} MiB), {selection}",
    ]
    if m.placement is not None:
        lines.append(f"placement: {m.placement.reason}")
    return lines


def placement_report(m: AssembledModel) -> list[str]:
    """What the device plan put on the pool device, and its bytes there."""
    store = m.loader.store
    lines = [f"placement: {store.plan.describe(store.n_expert)}"] if store is not None else []
    if m.pool_device is None:
        return lines
    return [f"placement: {m.plan.reason}; {m.loader.device_bytes / 2**20:.2f} MiB on {m.pool_device}", *lines]


def expert_calls(m: AssembledModel) -> tuple[int, int]:
    """(token, expert) calls of the MoE layers so far, and those the pool served."""
    calls = pool = 0
    for layer in m.model.layers:
        experts = getattr(layer.ffn, "experts", None)
        if experts is not None:
            calls, pool = calls + experts.calls, pool + experts.pool_calls
    return calls, pool


def cats_expert_report(m: AssembledModel) -> list[str]:
    """MoE files with CATS thresholds: the share of the selected experts' neurons active and of their up rows
    read, over the one-token steps so far."""
    counts = []
    for layer in m.model.layers:
        kernel = getattr(getattr(layer.ffn, "experts", None), "kernel", None)
        if kernel is not None and kernel.counts is not None:
            counts.append(kernel.counts)
    if not counts:
        return []
    active, read, total = (int(v) for v in torch.stack(counts).sum(0))
    if total == 0:
        return []
    return [
        f"moe: cats thresholds: {active / total:.1%} of the selected experts' neurons active, up rows read for "
        f"{read / total:.1%} (one-token steps)"
    ]


def expert_report(m: AssembledModel) -> list[str]:
    """MoE files with experts in the pool: the share of expert calls the pool served, and the plan's."""
    plan = m.plan.experts
    calls, pool = expert_calls(m)
    if m.loader.store is not None and calls:
        return store_report(m)
    if plan is None or calls == 0:
        return []
    return [
        f"moe: {pool / calls:.1%} of {calls} expert calls served by the pool on {m.pool_device} "
        f"(planned {plan.expected_share:.1%}, {plan.source})"
    ]


def store_report(m: AssembledModel) -> list[str]:
    """MoE files under --memory-limit: where the expert calls were served (pinned, cache, read ahead, read on
    demand), the bytes read from the file per token, the cache's hit rate and the prefetch's accuracy."""
    store = m.loader.store
    assert store is not None
    st = store.stats
    moe = getattr(m.config, "moe", None)
    per_token = max(1, len(store.layers) * (moe.n_expert_used if moe is not None else 1))
    tokens = max(1, st.calls // per_token)
    calls = max(1, st.calls)
    accuracy = st.prefetch_accuracy
    ahead = "no prefetch" if accuracy is None else f"prefetch accuracy {accuracy:.1%} of {st.prefetch_issued}"
    return [
        f"moe: {st.calls} expert calls: {st.pinned / calls:.1%} pinned in RAM, {st.cached / calls:.1%} from the "
        f"cache, {st.prefetched / calls:.1%} read ahead, {st.disk / calls:.1%} read on demand from the file",
        f"moe: {st.bytes_read / tokens / 2**20:.2f} MiB read from the file per token, cache hit rate "
        f"{st.hit_rate:.1%} (calls not pinned), {ahead}",
    ]


# ------------------------------------------------------------------------------------------------ pool summary


@dataclass(frozen=True)
class PoolSummary:
    """Where a run's work went: the bench row's backend and pool columns, and `main`'s pool line.

    backend: "CPU" (nothing on a device), "CUDA" (every layer, the head and all FFN rows on it), "CUDA+CPU"
    (both compute), or STAND_IN for the CPU pool. device_bytes: what the loader put on the pool device;
    allocated_bytes: torch.cuda.memory_allocated there (KV cache and scratch included), None off CUDA.
    plan_bytes: the weight bytes the plan put there; budget_bytes: the VRAM budget it was made under (None
    for -ngl). ffn_device_share: the share of FFN work the device did (0 to 1).
    """

    backend: str
    device: str | None
    device_bytes: int
    allocated_bytes: int | None
    plan_bytes: int
    budget_bytes: int | None
    ffn_device_share: float

    def line(self) -> str:
        """`main`'s one line: backend, bytes on the device against the plan, the FFN work's share there."""
        if self.device is None:
            return "pool: CPU, no pool device"
        allocated = (
            "" if self.allocated_bytes is None else f" ({self.allocated_bytes / 2**20:.1f} MiB allocated)"
        )
        budget = "" if self.budget_bytes is None else f" under a {self.budget_bytes / 2**30:.3g} GiB budget"
        return (
            f"pool: {self.backend}, {self.device_bytes / 2**20:.1f} MiB on {self.device}{allocated}, "
            f"{self.plan_bytes / 2**20:.1f} MiB planned{budget}, FFN work {self.ffn_device_share:.1%} on the device"
        )


def ffn_work(m: AssembledModel) -> tuple[int, int]:
    """FFN work counted so far, (on the pool device, in all): a sparse file's active (token, neuron) pairs, a
    MoE file's expert calls; (0, 0) where nothing is counted (dense files)."""
    s = m.sparse_stats
    if s is not None and int(s.active.sum()):
        return int(s.active_gpu.sum()), int(s.active.sum())
    calls, pool = expert_calls(m)
    return pool, calls


def ffn_bytes_share(m: AssembledModel) -> float:
    """The share of the FFN weights the plan put on the pool device: a sparse plan's pooled neurons, else the
    bytes of whole FFN tensors (-ngl) and pooled experts."""
    plan = m.plan
    if plan.device is None:
        return 0.0
    c = m.config
    if plan.neurons:
        pooled = sum(len(ids) for ids in plan.neurons if ids is not None)
        return min(1.0, pooled / max(1, c.n_layer * c.n_ff))
    tensors = m.gguf.tensors
    names = {t.format(bid=bid) for t in FFN_MATRICES for bid in range(c.n_layer)} & tensors.keys()
    total = sum(tensors[name].n_bytes for name in names)
    if total == 0:
        return 0.0
    on_device = sum(tensors[name].n_bytes for name in names & plan.tensors)
    if plan.experts is not None:
        on_device += plan.experts.bytes
    return min(1.0, on_device / total)


def plan_bytes(m: AssembledModel) -> tuple[int, int | None]:
    """(weight bytes the plan puts on the pool device, the VRAM budget it was made under or None)."""
    p = m.placement
    if p is not None:  # the sparse planner's: its total less the compute reserve and the KV cache
        used = p.bytes_by_category
        return p.total_bytes - used.get("reserve", 0) - used.get("kv", 0), p.budget_bytes
    tensors = m.gguf.tensors
    planned = sum(tensors[name].n_bytes for name in m.plan.tensors if name in tensors)
    planned += sum(h.n_bytes for h in m.loader.hot)  # an explicit GPU index: its rows
    if m.plan.experts is not None:
        planned += m.plan.experts.bytes
    gib = m.options.vram_budget_gib
    return planned, None if gib is None or m.plan.device is None else int(gib * 2**30)


def pool_summary(m: AssembledModel, since: tuple[int, int] = (0, 0)) -> PoolSummary:
    """Where the work of a run went. since: ffn_work(m) at the run's start (the counted FFN work is taken from
    then on; where none was counted, the share of FFN weight bytes on the device stands for it)."""
    device = m.pool_device
    static_share = ffn_bytes_share(m)
    done, total = (now - then for now, then in zip(ffn_work(m), since, strict=True))
    share = done / total if total > 0 else static_share
    device_bytes = m.loader.device_bytes
    planned, budget = plan_bytes(m)
    if device is None or device_bytes == 0:
        backend = "CPU"
    elif device.type == "cpu":
        backend = STAND_IN
    else:
        name = "CUDA" if device.type == "cuda" else device.type.upper()
        every_layer = set(range(m.config.n_layer)) <= m.plan.kv_layers
        head = m.plan.head or TensorNames.OUTPUT in m.plan.tensors
        backend = name if every_layer and head and static_share >= 1.0 else f"{name}+CPU"
    allocated = None
    if device is not None and device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
    return PoolSummary(
        backend,
        None if device is None else str(device),
        device_bytes,
        allocated,
        planned,
        budget,
        share,
    )
