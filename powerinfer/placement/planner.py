"""Hot/cold split under a VRAM byte budget: which dense tensors, whether the KV cache, and which FFN neurons
go to the GPU (spec 3.1). Pure data: the planner never touches a device; the runtime carries the plan out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from powerinfer.errors import FormatError, PlacementError
from powerinfer.gguf import GGUFFile, TensorNames
from powerinfer.placement.gpu_index import GPUIndex, gpu_index_matches_budget
from powerinfer.placement.stats import check_stats
from powerinfer.quant import pool_bytes

log = logging.getLogger(__name__)

MiB = 1024 * 1024
DEFAULT_RESERVE_BYTES = 256 * MiB
DEFAULT_GROUP = 32
# mixed per-layer neuron costs: exact DP when n_layer x (groups + 1) x (byte units + 1) stays below this
EXACT_MAX_CELLS = 20_000_000

CATEGORIES = ("reserve", "attn", "pred", "ffn_io", "output", "kv", "ffn")

# offload order inside each level, per layer (spec 3.1); only tensors present in the file are used
_ATTN_SUFFIXES = (
    "attn_norm",
    "attn_norm_2",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_qkv",
    "attn_q_norm",
    "attn_k_norm",
    "attn_output",
    "post_attention_norm",
)
_PRED_SUFFIXES = ("fc1", "fc2")
_FFN_IO_SUFFIXES = ("ffn_norm", "post_ffw_norm")


@dataclass(frozen=True)
class DenseTensor:
    """A tensor placed whole: its GGUF name and byte size."""

    name: str
    n_bytes: int


@dataclass(frozen=True)
class ModelFootprint:
    """Byte sizes the planner needs, by offload level (spec 3.1).

    `neuron_bytes[l]`: bytes of one FFN neuron of layer l on the GPU (gate row + up row + down_t row, from
    the real tensor types and shapes). `attn`, `pred`, `ffn_io`, `output`: dense tensors in offload order.
    Sizes are what the device pool stores: the file's own blocks (`quant.pool_bytes`; F16 for the few types
    the pool does not compute on).
    """

    n_ff: int
    neuron_bytes: tuple[int, ...]
    attn: tuple[DenseTensor, ...] = ()
    pred: tuple[DenseTensor, ...] = ()
    ffn_io: tuple[DenseTensor, ...] = ()
    output: tuple[DenseTensor, ...] = ()

    def __post_init__(self) -> None:
        if self.n_ff <= 0 or not self.neuron_bytes:
            raise PlacementError(f"model footprint needs n_ff > 0 and at least one layer (n_ff={self.n_ff})")
        if any(int(b) <= 0 for b in self.neuron_bytes):
            raise PlacementError(f"FFN neuron byte sizes must be positive: {self.neuron_bytes}")
        for t in (*self.attn, *self.pred, *self.ffn_io, *self.output):
            if t.n_bytes < 0:
                raise PlacementError(f"tensor {t.name} has a negative byte size {t.n_bytes}")

    @property
    def n_layer(self) -> int:
        return len(self.neuron_bytes)

    @property
    def levels(self) -> tuple[tuple[str, tuple[DenseTensor, ...]], ...]:
        """Dense offload levels in order: ATTN, MLP_PRED, FFN_IO, OUTPUT."""
        return (("attn", self.attn), ("pred", self.pred), ("ffn_io", self.ffn_io), ("output", self.output))

    @property
    def dense_bytes(self) -> int:
        return sum(t.n_bytes for _, level in self.levels for t in level)

    @property
    def ffn_bytes(self) -> int:
        return self.n_ff * sum(self.neuron_bytes)


def footprint_from_gguf(gguf: GGUFFile, n_layer: int, n_ff: int) -> ModelFootprint:
    """Read the pool byte sizes of a sparse (PWRI) model's tensors from its tensor table."""
    tensors = gguf.tensors

    def present(template: str, bid: int | None = None) -> list[DenseTensor]:
        out = []
        for kind in ("weight", "bias"):
            name = template.format(bid=bid) + "." + kind
            if name in tensors:
                info = tensors[name]
                out.append(DenseTensor(name, pool_bytes(info.ggml_type, info.shape)))
        return out

    def per_layer(suffixes: tuple[str, ...]) -> tuple[DenseTensor, ...]:
        return tuple(t for bid in range(n_layer) for s in suffixes for t in present("blk.{bid}." + s, bid))

    neuron_bytes = []
    for bid in range(n_layer):
        total = 0
        for template, required in (
            (TensorNames.FFN_GATE, False),
            (TensorNames.FFN_UP, True),
            (TensorNames.FFN_DOWN_T, False),
        ):
            name = template.format(bid=bid)
            if name not in tensors:
                if template == TensorNames.FFN_DOWN_T and TensorNames.FFN_DOWN.format(bid=bid) in tensors:
                    name = TensorNames.FFN_DOWN.format(bid=bid)
                elif required or template == TensorNames.FFN_DOWN_T:
                    raise FormatError(f"{gguf.path}: tensor {name} is missing")
                else:
                    continue
            info = tensors[name]
            # a fused gate_up (Phi-3: ffn_up of 2 n_ff rows, no ffn_gate) holds both halves of each neuron
            if n_ff not in info.shape and 2 * n_ff not in info.shape:
                raise FormatError(f"{gguf.path}: tensor {name} shape {info.shape} lacks the FFN size {n_ff}")
            total += -(-pool_bytes(info.ggml_type, info.shape) // n_ff)  # ceil: byte share of one neuron
        neuron_bytes.append(total)
    output = tuple(present("output_norm") + present("output"))
    return ModelFootprint(
        n_ff=n_ff,
        neuron_bytes=tuple(neuron_bytes),
        attn=per_layer(_ATTN_SUFFIXES),
        pred=per_layer(_PRED_SUFFIXES),
        ffn_io=per_layer(_FFN_IO_SUFFIXES),
        output=output,
    )


def kv_cache_bytes(n_layer: int, n_ctx: int, n_embd_gqa: int, bytes_per_element: int = 2) -> int:
    """Bytes of the K and V caches together: 2 x n_layer x n_ctx x n_embd_gqa x element size."""
    return 2 * n_layer * n_ctx * n_embd_gqa * bytes_per_element


def default_reserve_bytes(footprint: ModelFootprint) -> int:
    """Compute-buffer reserve: 256 MiB, or an eighth of the model's offloadable bytes if that is smaller."""
    return min(DEFAULT_RESERVE_BYTES, (footprint.dense_bytes + footprint.ffn_bytes) // 8)


@dataclass(frozen=True, eq=False)
class Placement:
    """The plan: what goes to the GPU, and the bytes it takes.

    `gpu_neurons[l]` are the sorted GPU neuron ids (int32) of layer l. `bytes_by_category` has the keys of
    CATEGORIES; `total_bytes` is their sum and never exceeds `budget_bytes`. `ffn_budget_bytes` is what was
    left for FFN neurons (recorded as `split.vram_capacity` in the GPU index; 0 when FFN offload was
    skipped). `ffn_source` is "solved", "cache" or "none". `reason` says how the FFN offload ended.
    """

    budget_bytes: int
    gpu_tensors: tuple[str, ...]
    kv_on_gpu: bool
    gpu_neurons: tuple[np.ndarray, ...]
    bytes_by_category: Mapping[str, int]
    total_bytes: int
    ffn_budget_bytes: int
    n_ff: int
    group: int
    ffn_source: str
    reason: str
    gpu_frequency_share: float = field(default=0.0)

    @property
    def n_gpu_neurons(self) -> int:
        return int(sum(ids.size for ids in self.gpu_neurons))

    def to_gpu_index(self) -> GPUIndex:
        """The GPU index file content of this plan (vram_capacity = ffn_budget_bytes)."""
        return GPUIndex.from_neurons(self.gpu_neurons, self.n_ff, self.ffn_budget_bytes)


def _check_group(n_ff: int, group: int) -> int:
    if group <= 0:
        raise PlacementError(f"neuron group size must be positive, got {group}")
    if n_ff % group:
        raise PlacementError(f"FFN size {n_ff} is not a multiple of the neuron group size {group}")
    return n_ff // group


def group_sums(stats: Sequence[np.ndarray], group: int) -> np.ndarray:
    """(n_layer, n_ff // group): per layer, counts sorted descending and summed in consecutive groups."""
    n_layer, n_ff = check_stats(stats)
    n_groups = _check_group(n_ff, group)
    ordered = -np.sort(-np.stack([np.asarray(s, dtype=np.float64) for s in stats]), axis=1)
    return ordered.reshape(n_layer, n_groups, group).sum(axis=2)


def _rank(values: np.ndarray) -> np.ndarray:
    """Flat indices of `values` (n_layer, n_groups), largest first; ties by layer, then group."""
    return np.argsort(-values.ravel(), kind="stable")


def solve_neuron_counts(stats: Sequence[np.ndarray], capacity_neurons: int, group: int) -> list[int]:
    """PowerInfer's solver result (spec 3.5): GPU neuron count per layer for a capacity in neurons.

    Per layer the counts are sorted descending and summed in consecutive groups of `group`; the
    floor(capacity / group) globally largest group sums are taken. Greedy is the exact optimum of the
    original ILP: every group costs the same, so any feasible choice of m groups can be turned into the
    greedy one by exchanging a chosen group for an unchosen one with a larger or equal sum, never lowering
    the objective; and since sums are non-increasing within a layer, the greedy choice is a prefix of each
    layer's groups, i.e. a count per layer. Ties go to the earlier layer, then the earlier group.
    """
    if capacity_neurons < 0:
        raise PlacementError(f"neuron capacity must be >= 0, got {capacity_neurons}")
    sums = group_sums(stats, group)
    n_layer, n_groups = sums.shape
    n_pick = min(int(capacity_neurons) // group, sums.size)
    chosen = _rank(sums)[:n_pick]
    return [int(c) * group for c in np.bincount(chosen // n_groups, minlength=n_layer)]


def select_gpu_neurons(stats: Sequence[np.ndarray], counts: Sequence[int]) -> list[np.ndarray]:
    """Per layer, the counts[l] hottest neuron ids (higher count, then lower id first), sorted, int32."""
    n_layer, n_ff = check_stats(stats)
    if len(counts) != n_layer:
        raise PlacementError(f"{len(counts)} neuron counts for {n_layer} layers")
    out = []
    for layer, (s, k) in enumerate(zip(stats, counts, strict=True)):
        if not 0 <= int(k) <= n_ff:
            raise PlacementError(f"layer {layer}: neuron count {k} is outside 0..{n_ff}")
        order = np.lexsort((np.arange(n_ff), -np.asarray(s, dtype=np.float64)))
        out.append(np.sort(order[: int(k)]).astype(np.int32))
    return out


def expected_gpu_hit_rate(stats: Sequence[np.ndarray], gpu_neurons: Sequence[np.ndarray]) -> float:
    """Share of all activation frequency that falls on GPU neurons (0.0 when no neuron ever fired)."""
    total = float(sum(np.asarray(s, dtype=np.float64).sum() for s in stats))
    if total <= 0:
        return 0.0
    on_gpu = sum(
        float(np.asarray(s, dtype=np.float64)[np.asarray(ids, dtype=np.int64)].sum())
        for s, ids in zip(stats, gpu_neurons, strict=True)
    )
    return on_gpu / total


def choose_groups(
    sums: np.ndarray, group_bytes: Sequence[int], budget_bytes: int, exact_max_cells: int = EXACT_MAX_CELLS
) -> list[int]:
    """Number of groups per layer maximising the chosen group sums with total bytes <= budget_bytes.

    `sums` (n_layer, n_groups) is non-increasing along each row; `group_bytes[l]` is the cost of one group
    of layer l. Any optimal choice can be taken as a prefix of each row (swap a chosen group for an earlier
    unchosen one of the same layer: same cost, sum not lower). Equal costs everywhere: greedy by sum is
    exact (exchange argument, see `solve_neuron_counts`). Mixed costs: exact DP over layers and byte units
    (units = gcd of the costs) when n_layer x (n_groups + 1) x (units + 1) <= exact_max_cells, judged on
    the whole FFN so the method does not change with the budget; otherwise greedy by sum per byte, which
    also takes later groups that still fit. That greedy is within one group's sum of the optimum (greedy
    prefix + the first group that did not fit >= the LP relaxation >= optimum) and never decreases when
    the budget grows. Ties: earlier layer, then earlier group.
    """
    n_layer, n_groups = sums.shape
    costs = [int(c) for c in group_bytes]
    budget = max(0, int(budget_bytes))
    if len(set(costs)) == 1:
        n_pick = min(budget // costs[0], sums.size)
        chosen = _rank(sums)[:n_pick]
        return [int(c) for c in np.bincount(chosen // n_groups, minlength=n_layer)]
    unit = math.gcd(*costs)
    model_units = sum(costs) * n_groups // unit
    if n_layer * (n_groups + 1) * (model_units + 1) <= exact_max_cells:
        return _choose_groups_dp(sums, [c // unit for c in costs], min(budget, sum(costs) * n_groups) // unit)
    return _choose_groups_greedy(sums, costs, budget)


def _choose_groups_dp(sums: np.ndarray, unit_costs: list[int], units: int) -> list[int]:
    n_layer, n_groups = sums.shape
    best = np.zeros(units + 1)  # best[b]: largest sum with cost <= b units over the layers so far
    choice = np.zeros((n_layer, units + 1), dtype=np.int32)
    for layer in range(n_layer):
        prefix = np.concatenate(([0.0], np.cumsum(sums[layer])))
        new = best.copy()
        for k in range(1, n_groups + 1):
            shift = k * unit_costs[layer]
            if shift > units:
                break
            cand = best[: units + 1 - shift] + prefix[k]
            better = cand > new[shift:]  # strict: fewer groups in later layers on ties
            new[shift:][better] = cand[better]
            choice[layer, shift:][better] = k
        best = new
    counts = [0] * n_layer
    b = units
    for layer in reversed(range(n_layer)):
        counts[layer] = int(choice[layer, b])
        b -= counts[layer] * unit_costs[layer]
    return counts


def _choose_groups_greedy(sums: np.ndarray, costs: list[int], budget: int) -> list[int]:
    n_layer, n_groups = sums.shape
    cost = np.repeat(np.asarray(costs, dtype=np.float64), n_groups).reshape(n_layer, n_groups)
    counts = [0] * n_layer
    left = budget
    for flat in _rank(sums / cost):
        layer = int(flat) // n_groups
        if costs[layer] <= left:  # equal costs in a layer: a skipped group means the rest of it is skipped
            counts[layer] += 1
            left -= costs[layer]
    return counts


def _fmt(n_bytes: int) -> str:
    return f"{n_bytes / MiB:.2f} MiB"


def plan(
    footprint: ModelFootprint,
    *,
    budget_bytes: int,
    kv_bytes: int,
    stats: Sequence[np.ndarray] | None,
    reserve_bytes: int | None = None,
    group: int = DEFAULT_GROUP,
    device_total_bytes: int | None = None,
    ffn_offload: bool = True,
    cached_index: GPUIndex | None = None,
    exact_max_cells: int = EXACT_MAX_CELLS,
) -> Placement:
    """Plan the GPU placement of a sparse model within `budget_bytes` (spec 3.1 order).

    Order: compute reserve; dense tensors level by level (ATTN, MLP_PRED, FFN_IO, OUTPUT), stopping at the
    first that does not fit; then the KV cache; then, only if all of that fit, FFN neurons in groups of
    `group` per layer chosen to maximise the activation frequency on the GPU with the remaining bytes. A
    budget too small for any step degrades (the rest stays on the CPU) and `reason` says where it stopped.
    `budget_bytes` must already be resolved (-1 = all free memory is the caller's business).
    `cached_index` is used instead of solving when it matches the model and was made for exactly the
    remaining FFN budget. `reserve_bytes` None means `default_reserve_bytes(footprint)`.
    """
    if budget_bytes < 0:
        raise PlacementError(
            f"VRAM budget must be >= 0 bytes, got {budget_bytes} (resolve -1 to the free memory first)"
        )
    if device_total_bytes is not None and budget_bytes > device_total_bytes:
        raise PlacementError(
            f"VRAM budget {_fmt(budget_bytes)} exceeds the device's total memory {_fmt(device_total_bytes)}"
        )
    if kv_bytes < 0:
        raise PlacementError(f"KV cache size must be >= 0 bytes, got {kv_bytes}")
    reserve = default_reserve_bytes(footprint) if reserve_bytes is None else int(reserve_bytes)
    if reserve < 0:
        raise PlacementError(f"compute reserve must be >= 0 bytes, got {reserve}")
    n_layer, n_ff = footprint.n_layer, footprint.n_ff
    _check_group(n_ff, group)
    if stats is not None:
        check_stats(stats, n_layer, n_ff)

    used = dict.fromkeys(CATEGORIES, 0)
    gpu_tensors: list[str] = []
    empty = tuple(np.zeros(0, dtype=np.int32) for _ in range(n_layer))

    def result(
        kv_on_gpu: bool, neurons: tuple[np.ndarray, ...], ffn_budget: int, source: str, reason: str
    ) -> Placement:
        share = expected_gpu_hit_rate(stats, neurons) if stats is not None else 0.0
        total = sum(used.values())
        log.info("placement: %s", reason)
        return Placement(
            budget_bytes=int(budget_bytes),
            gpu_tensors=tuple(gpu_tensors),
            kv_on_gpu=kv_on_gpu,
            gpu_neurons=neurons,
            bytes_by_category=MappingProxyType(dict(used)),
            total_bytes=total,
            ffn_budget_bytes=ffn_budget,
            n_ff=n_ff,
            group=group,
            ffn_source=source,
            reason=reason,
            gpu_frequency_share=share,
        )

    if budget_bytes < reserve:
        return result(
            False,
            empty,
            0,
            "none",
            f"VRAM budget {_fmt(budget_bytes)} is smaller than the "
            f"compute reserve {_fmt(reserve)}: everything stays on the CPU",
        )
    left = int(budget_bytes) - reserve
    used["reserve"] = reserve
    for category, tensors in footprint.levels:
        for t in tensors:
            if t.n_bytes > left:
                return result(
                    False,
                    empty,
                    0,
                    "none",
                    f"{t.name} ({_fmt(t.n_bytes)}) does not fit in the "
                    f"remaining {_fmt(left)}: dense offload stopped there, FFN stays on the CPU",
                )
            left -= t.n_bytes
            used[category] += t.n_bytes
            gpu_tensors.append(t.name)
    if kv_bytes > left:
        return result(
            False,
            empty,
            0,
            "none",
            f"KV cache ({_fmt(kv_bytes)}) does not fit in the remaining "
            f"{_fmt(left)}: KV cache and FFN stay on the CPU",
        )
    left -= kv_bytes
    used["kv"] = kv_bytes
    if not ffn_offload:
        return result(True, empty, 0, "none", "GPU index disabled: FFN stays on the CPU")

    ffn_budget = left
    neuron_cost = footprint.neuron_bytes
    if cached_index is not None:
        cached = _usable_cache(cached_index, n_layer, n_ff, ffn_budget, neuron_cost)
        if cached is not None:
            used["ffn"] = sum(ids.size * c for ids, c in zip(cached, neuron_cost, strict=True))
            n_gpu = sum(ids.size for ids in cached)
            return result(
                True,
                cached,
                ffn_budget,
                "cache",
                f"FFN: {n_gpu} of {n_layer * n_ff} neurons on the GPU from the cached GPU index "
                f"({_fmt(used['ffn'])} of {_fmt(ffn_budget)})",
            )
    if stats is None:
        return result(True, empty, ffn_budget, "none", "no activation statistics: FFN stays on the CPU")

    sums = group_sums(stats, group)
    n_chosen = choose_groups(sums, [group * c for c in neuron_cost], ffn_budget, exact_max_cells)
    counts = [k * group for k in n_chosen]
    neurons = tuple(select_gpu_neurons(stats, counts))
    used["ffn"] = sum(k * c for k, c in zip(counts, neuron_cost, strict=True))
    n_gpu = sum(counts)
    if n_gpu == n_layer * n_ff:
        reason = f"all {n_gpu} FFN neurons fit on the GPU ({_fmt(used['ffn'])} of {_fmt(ffn_budget)})"
    else:
        reason = (
            f"FFN: {n_gpu} of {n_layer * n_ff} neurons on the GPU in groups of {group} "
            f"({_fmt(used['ffn'])} of {_fmt(ffn_budget)} left for the FFN)"
        )
    return result(True, neurons, ffn_budget, "solved", reason)


def _usable_cache(
    index: GPUIndex, n_layer: int, n_ff: int, ffn_budget: int, neuron_cost: tuple[int, ...]
) -> tuple[np.ndarray, ...] | None:
    if index.n_layer != n_layer or index.n_ff != n_ff:
        log.info(
            "GPU index cache is for %d layers x %d neurons, the model has %d x %d: regenerating",
            index.n_layer,
            index.n_ff,
            n_layer,
            n_ff,
        )
        return None
    if not gpu_index_matches_budget(index, ffn_budget):
        log.info(
            "GPU index cache was made for %d bytes, the FFN budget is now %d: regenerating",
            index.vram_capacity,
            ffn_budget,
        )
        return None
    n_bytes = sum(b.size * c for b, c in zip(index.gpu_bucket, neuron_cost, strict=True))
    if n_bytes > ffn_budget:
        log.info(
            "GPU index cache needs %d bytes, more than the FFN budget %d: regenerating", n_bytes, ffn_budget
        )
        return None
    return tuple(b.astype(np.int32) for b in index.gpu_bucket)
