"""GPU placement: activation statistics, the GPU index file and the VRAM-budget planner (pure data)."""

from powerinfer.placement.gpu_index import (
    GPUIndex,
    gpu_index_matches_budget,
    gpu_index_path,
    load_cached_gpu_index,
    read_gpu_index,
    write_gpu_index,
)
from powerinfer.placement.planner import (
    CATEGORIES,
    DEFAULT_GROUP,
    DEFAULT_RESERVE_BYTES,
    DenseTensor,
    ModelFootprint,
    Placement,
    choose_groups,
    default_reserve_bytes,
    expected_gpu_hit_rate,
    footprint_from_gguf,
    group_sums,
    kv_cache_bytes,
    plan,
    select_gpu_neurons,
    solve_neuron_counts,
)
from powerinfer.placement.stats import check_stats, load_activation_stats

__all__ = [
    "CATEGORIES",
    "DEFAULT_GROUP",
    "DEFAULT_RESERVE_BYTES",
    "DenseTensor",
    "GPUIndex",
    "ModelFootprint",
    "Placement",
    "check_stats",
    "choose_groups",
    "default_reserve_bytes",
    "expected_gpu_hit_rate",
    "footprint_from_gguf",
    "gpu_index_matches_budget",
    "gpu_index_path",
    "group_sums",
    "kv_cache_bytes",
    "load_activation_stats",
    "load_cached_gpu_index",
    "plan",
    "read_gpu_index",
    "select_gpu_neurons",
    "solve_neuron_counts",
    "write_gpu_index",
]
