"""The pool device: which device holds it and the plan of what it holds.

The planner (powerinfer.placement) only returns data; this module resolves the budget, reads or writes the
cached GPU index and turns the result into a DevicePlan, which the loader carries out with the pool's parts of
each layer (powerinfer.device.pool: HotRows, PoolExperts).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from powerinfer import quant
from powerinfer.errors import PlacementError, PowerInferError
from powerinfer.gguf.reader import GGUFFile
from powerinfer.model.config import ModelConfig
from powerinfer.placement import (
    footprint_from_gguf,
    gpu_index_path,
    kv_cache_bytes,
    load_activation_stats,
    load_cached_gpu_index,
    plan,
    read_gpu_index,
    write_gpu_index,
)
from powerinfer.placement.device_plan import DevicePlan, layers_plan, neurons_plan, sparse_plan
from powerinfer.placement.experts import (
    EXPERT_TENSORS,
    ExpertRequest,
    load_expert_counts,
    load_neuron_counts,
    plan_experts,
)

log = logging.getLogger(__name__)

KV_BYTES_PER_ELEMENT = 4  # the KV cache is float32


@dataclass(frozen=True)
class PoolRequest:
    """What the user asked for: device, budget (GiB, None = free memory) and GPU index handling."""

    device: str | None
    budget_gib: float | None
    gpu_index_path: str | None = None
    reset_gpu_index: bool = False
    disable_gpu_index: bool = False


def pool_device(request: PoolRequest) -> torch.device | None:
    """The pool's device: as asked, else CUDA when a budget is given and a GPU exists, else no pool."""
    if request.device is not None:
        device = torch.device(request.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise PlacementError(f"pool device {request.device} requested but no CUDA device is available")
        return device
    if request.budget_gib is not None and torch.cuda.is_available():
        return torch.device("cuda")
    return None


def budget_bytes(request: PoolRequest, device: torch.device) -> int:
    """The VRAM budget in bytes: the requested GiB, or the device's free memory minus 256 MiB."""
    gib = request.budget_gib
    if gib is not None:
        if gib < 0 or gib != gib:
            raise PlacementError(f"--vram-budget must be >= 0 GiB (got {gib})")
        return int(gib * 2**30)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(0, free - 256 * 2**20)
    raise PlacementError("the CPU stand-in pool needs an explicit --vram-budget")


def plan_pool(
    gguf: GGUFFile,
    config: ModelConfig,
    request: PoolRequest,
    device: torch.device,
    n_ctx: int,
    layers: range | None = None,
    n_seq: int = 1,
) -> DevicePlan:
    """The device plan of a sparse model: an explicit GPU index, else the cached or a new plan; the KV cache
    budgeted is that of n_seq sequences (the engine allocates one per sequence).

    layers: the file's layers a pipeline stage holds (config and gguf then describe them as layers 0..k-1);
    the stage plans them alone, under its own budget, and does not share the cached GPU index."""
    c = config
    first = 0 if layers is None else layers.start
    if request.gpu_index_path is not None:
        index = read_gpu_index(request.gpu_index_path, c.n_layer if layers is None else None, c.n_ff)
        if layers is not None:
            if len(index.gpu_bucket) < layers.stop:
                raise PlacementError(
                    f"GPU index {request.gpu_index_path} has fewer than {layers.stop} layers"
                )
        buckets = index.gpu_bucket[first : first + c.n_layer]
        neurons = [np.asarray(b, dtype=np.int64) for b in buckets]
        return neurons_plan(neurons, str(device), f"FFN neurons from {request.gpu_index_path}")
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    model_path = Path(gguf.path)
    try:
        stats = load_activation_stats(model_path.parent / "activation", first + c.n_layer, c.n_ff)[first:]
    except PowerInferError as e:
        log.warning("%s; every FFN neuron stays on the CPU", e)
        stats = None
    cache = gpu_index_path(model_path)
    cached = None
    if layers is None:
        cached = load_cached_gpu_index(cache, n_layer=c.n_layer, n_ff=c.n_ff, reset=request.reset_gpu_index)
    kv_bytes = n_seq * kv_cache_bytes(c.n_layer, n_ctx, c.n_embd_gqa, bytes_per_element=KV_BYTES_PER_ELEMENT)
    placement = plan(
        footprint_from_gguf(gguf, c.n_layer, c.n_ff),
        budget_bytes=budget_bytes(request, device),
        kv_bytes=kv_bytes,
        stats=stats,
        device_total_bytes=total,
        cached_index=cached,
        ffn_offload=not request.disable_gpu_index,
    )
    if placement.ffn_source == "solved" and layers is None:
        try:
            write_gpu_index(cache, placement.to_gpu_index())
        except (OSError, PowerInferError) as e:
            log.warning("cannot cache the GPU index at %s: %s", cache, e)
    neurons = [np.asarray(ids, dtype=np.int64) for ids in placement.gpu_neurons]
    return sparse_plan(placement, neurons, c.n_layer, str(device))


def dense_layer_bytes(gguf: GGUFFile, bid: int) -> int:
    """Pool bytes of layer bid's tensors but its stacked experts: matrices as DeviceWeight stores them, vectors
    as float32."""
    prefix, experts = f"blk.{bid}.", {t.format(bid=bid) for t in EXPERT_TENSORS}
    total = 0
    for name, info in gguf.tensors.items():
        if name.startswith(prefix) and name not in experts:
            shape = tuple(info.shape)
            total += quant.pool_bytes(info.ggml_type, shape) if len(shape) == 2 else 4 * int(np.prod(shape))
    return total


def plan_moe_pool(
    gguf: GGUFFile,
    config: ModelConfig,
    n_expert: int,
    device: torch.device,
    n_ctx: int,
    n_gpu_layers: int,
    budget: int | None,
    request: ExpertRequest,
    n_seq: int = 1,
) -> DevicePlan:
    """The device plan of a MoE file: the last -ngl layers' dense parts (attention, norms, router, shared expert)
    and KV caches on the pool, and the experts placement.experts chooses. With a budget and no -ngl, as many of
    the last layers' dense parts as fit; the experts then share the bytes left, hottest first."""
    c = config
    dev = str(device)
    counts = load_expert_counts(Path(gguf.path), c.n_layer, n_expert)  # None without a profile
    if budget is None:
        base = layers_plan(gguf.tensors, c.n_layer, n_gpu_layers, dev)
        experts = plan_experts(
            gguf, c.n_layer, n_expert, request, dev, default_layers=base.layers, counts=counts
        )
    else:
        kv = n_seq * kv_cache_bytes(1, n_ctx, c.n_embd_gqa, bytes_per_element=KV_BYTES_PER_ELEMENT)
        need = [dense_layer_bytes(gguf, bid) + kv for bid in range(c.n_layer)]
        n, used = n_gpu_layers, 0
        if n <= 0:
            while n < c.n_layer and used + need[c.n_layer - 1 - n] <= budget:
                used += need[c.n_layer - 1 - n]
                n += 1
        else:
            used = sum(need[max(0, c.n_layer - n) :])
        base = layers_plan(gguf.tensors, c.n_layer, n, dev)
        left = max(0, budget - used)
        moe = getattr(c, "moe", None)
        neuron_counts = None
        if moe is not None and moe.act == "relu":
            neuron_counts = load_neuron_counts(Path(gguf.path), c.n_layer, n_expert, moe.n_ff_exp)
        experts = plan_experts(
            gguf, c.n_layer, n_expert, request, dev, budget=left, counts=counts, neuron_counts=neuron_counts
        )
    if (
        getattr(c, "expert_thresholds", None) is not None
    ):  # CATS experts run on the CPU (the pool's are dense)
        return dataclasses.replace(base, reason=f"{base.reason}; experts on the CPU (CATS thresholds)")
    return dataclasses.replace(base, experts=experts, reason=f"{base.reason}; {experts.describe()}")
