"""--memory-limit for MoE files: what stays in RAM when the model does not fit, as data.

The process under a memory limit holds (a) the runtime (the interpreter, torch and the kernels, measured when the
plan is made), the KV cache and a margin for activations and allocator slack, (b) the dense weights (everything
but the stacked experts), mapped from the file and read every token, and (c) the experts: the hottest ones pinned
(read once at load, in order of selections per byte from the profile's `expert_counts`, as the pool planner ranks
them) and a bounded cache of slots that the other experts pass through, read from the model file on demand or
ahead of need (runtime.expert_store). The cache keeps at least one layer's worth of slots (a prompt step may
select every expert of a layer) and a fifth of the experts' bytes; the rest is pinned. Without a profile nothing is
pinned and the whole budget is cache (recency alone). When every expert fits, every expert is pinned.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from powerinfer.errors import PlacementError

PAGE = 4096
MIN_CACHE_SHARE = 0.2  # of the experts' bytes, at least, kept as cache slots when a profile pins the rest
MARGIN_BYTES = 96 << 20  # activations, scratch, allocator slack
MARGIN_SHARE = 0.03  # of the limit, on top


def runtime_bytes(limit: int, base: int, kv: int) -> int:
    """What the plan sets aside besides the weights: the process's own bytes (`base`: interpreter, torch, the
    kernels), the KV cache and a margin for activations, scratch buffers and allocator slack."""
    return base + kv + MARGIN_BYTES + int(MARGIN_SHARE * limit)


def slot_bytes(expert_bytes: tuple[int, int, int]) -> int:
    """Bytes one cache slot takes for an expert of (gate, up, down) byte sizes: each read whole pages at both ends
    (direct reads start and end on a page boundary)."""
    return sum((n + 2 * PAGE - 1) // PAGE * PAGE + PAGE for n in expert_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    """The experts under a memory limit: per layer the pinned ids (ascending), the number of cache slots and the
    bytes each part takes; `share` the profile's expected share of expert calls the pinned experts serve."""

    limit: int
    runtime: int
    dense: int
    pinned: tuple[np.ndarray, ...]
    pinned_bytes: int
    n_slots: int
    slot_bytes: int
    share: float
    source: str  # "profile" or "none"

    @property
    def cache_bytes(self) -> int:
        return self.n_slots * self.slot_bytes

    @property
    def n_pinned(self) -> int:
        return sum(len(p) for p in self.pinned)

    def describe(self, n_expert: int) -> str:
        total = n_expert * len(self.pinned)
        gib = 2**30
        return (
            f"memory limit {self.limit / gib:.3g} GiB: dense weights {self.dense / gib:.3g} GiB, runtime "
            f"{self.runtime / gib:.3g} GiB, {self.n_pinned}/{total} experts pinned ({self.pinned_bytes / gib:.3g} "
            f"GiB, expected {self.share:.1%} of calls, {self.source}), cache of {self.n_slots} experts "
            f"({self.cache_bytes / gib:.3g} GiB), the rest read from the file"
        )


def plan_memory(
    limit: int,
    runtime: int,
    dense: int,
    expert_bytes: list[tuple[int, int, int]],
    n_expert: int,
    counts: np.ndarray | None = None,
) -> MemoryPlan:
    """The plan for `limit` bytes given the runtime's and the dense weights' bytes and, per layer, one expert's
    (gate, up, down) bytes; `counts` (n_layer, n_expert) the profile's selections. PlacementError when the limit
    cannot hold the runtime, the dense weights and one layer's experts."""
    n_layer = len(expert_bytes)
    slot = max(slot_bytes(b) for b in expert_bytes)
    per_expert = [slot_bytes(b) for b in expert_bytes]  # pinned ones are read as the cache's are
    budget = limit - runtime - dense
    need = runtime + dense + n_expert * slot
    if budget < n_expert * slot:
        gib = 2**30
        raise PlacementError(
            f"--memory-limit {limit / gib:.3g} GiB is too small: the runtime ({runtime / gib:.3g} GiB), the dense "
            f"weights ({dense / gib:.3g} GiB) and a cache of one layer's {n_expert} experts need "
            f"{need / gib:.3g} GiB"
        )
    everything = sum(per_expert) * n_expert
    pinned = [np.zeros(n_expert, dtype=bool) for _ in range(n_layer)]
    if everything <= budget:
        for p in pinned:
            p[:] = True
        used, n_slots, source = everything, 0, "all fit"
    elif counts is None or counts.sum() <= 0:
        used, n_slots, source = 0, budget // slot, "none"
    else:
        cache = max(n_expert * slot, int(MIN_CACHE_SHARE * sum(per_expert) * n_expert))
        room = max(0, budget - cache)
        cand = sorted(
            ((bid, e) for bid in range(n_layer) for e in range(n_expert)),
            key=lambda be: (-counts[be[0], be[1]] / max(1, per_expert[be[0]]), -be[0], be[1]),
        )
        used = 0
        for bid, e in cand:
            if counts[bid, e] <= 0:
                break
            if used + per_expert[bid] <= room:
                pinned[bid][e] = True
                used += per_expert[bid]
        n_slots, source = (budget - used) // slot, "profile"
    if counts is not None and counts.sum() > 0:
        share = float(sum(counts[bid][p].sum() for bid, p in enumerate(pinned)) / counts.sum())
    else:
        share = sum(int(p.sum()) for p in pinned) / max(1, n_layer * n_expert)
    ids = tuple(np.flatnonzero(p).astype(np.int64) for p in pinned)
    return MemoryPlan(limit, runtime, dense, ids, used, int(n_slots), slot, share, source)
