"""Carrying out a placement: which device holds the pool, what the plan puts there, and moving it there.

The planner (powerinfer.placement) only returns data; this module resolves the budget, reads or writes the
cached GPU index, and materialises the planned tensors on the pool device: whole attention layers,
predictors and the output head as DeviceWeight, the hot FFN rows through SparseFFN. Both keep the file's
blocks (the bytes the planner budgeted); a CUDA pool computes on them with Triton kernels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from powerinfer import ops
from powerinfer.arch.llama import LlamaModel
from powerinfer.errors import PlacementError, PowerInferError
from powerinfer.gguf.constants import TensorNames
from powerinfer.gguf.reader import GGUFFile
from powerinfer.placement import (
    Placement,
    footprint_from_gguf,
    gpu_index_path,
    kv_cache_bytes,
    load_activation_stats,
    load_cached_gpu_index,
    plan,
    read_gpu_index,
    write_gpu_index,
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
    gguf: GGUFFile, model: LlamaModel, request: PoolRequest, device: torch.device, n_ctx: int
) -> tuple[Placement | None, list[np.ndarray]]:
    """The placement and per-layer pool neuron ids: an explicit GPU index, else the cached or a new plan."""
    c = model.config
    if request.gpu_index_path is not None:
        index = read_gpu_index(request.gpu_index_path, c.n_layer, c.n_ff)
        return None, [np.asarray(b, dtype=np.int64) for b in index.gpu_bucket]
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    model_path = Path(gguf.path)
    try:
        stats = load_activation_stats(model_path.parent / "activation", c.n_layer, c.n_ff)
    except PowerInferError as e:
        log.warning("%s; every FFN neuron stays on the CPU", e)
        stats = None
    cache = gpu_index_path(model_path)
    cached = load_cached_gpu_index(cache, n_layer=c.n_layer, n_ff=c.n_ff, reset=request.reset_gpu_index)
    kv_bytes = kv_cache_bytes(c.n_layer, n_ctx, c.n_embd_gqa, bytes_per_element=KV_BYTES_PER_ELEMENT)
    placement = plan(
        footprint_from_gguf(gguf, c.n_layer, c.n_ff),
        budget_bytes=budget_bytes(request, device),
        kv_bytes=kv_bytes,
        stats=stats,
        device_total_bytes=total,
        cached_index=cached,
        ffn_offload=not request.disable_gpu_index,
    )
    if placement.ffn_source == "solved":
        try:
            write_gpu_index(cache, placement.to_gpu_index())
        except (OSError, PowerInferError) as e:
            log.warning("cannot cache the GPU index at %s: %s", cache, e)
    return placement, [np.asarray(ids, dtype=np.int64) for ids in placement.gpu_neurons]


def offload_dense(model: LlamaModel, placement: Placement, device: torch.device) -> bool:
    """Move what the plan puts on the device: whole attention layers, predictors, the output head.

    A layer's attention moves only when all four of its matrices were planned there. Returns True when every
    layer's attention is on the device, i.e. the KV cache may live there too.
    """
    names = set(placement.gpu_tensors)
    all_layers = True
    for bid, layer in enumerate(model.layers):
        attn = [
            t.format(bid=bid)
            for t in (TensorNames.ATTN_Q, TensorNames.ATTN_K, TensorNames.ATTN_V, TensorNames.ATTN_OUT)
        ]
        if all(n in names for n in attn):
            for attr in ("wq", "wk", "wv", "wo"):
                setattr(layer, attr, ops.DeviceWeight.from_qweight(getattr(layer, attr), device))
        else:
            all_layers = False
        ffn = model.ffns[bid]
        pred = (TensorNames.PRED_FC1.format(bid=bid), TensorNames.PRED_FC2.format(bid=bid))
        if hasattr(ffn, "fc1") and all(n in names for n in pred):
            ffn.fc1 = ops.DeviceWeight.from_qweight(ffn.fc1, device)
            ffn.fc2 = ops.DeviceWeight.from_qweight(ffn.fc2, device)
    if (
        TensorNames.OUTPUT in names
        and isinstance(model.output, ops.QWeight)
        and model.output is not model.tok_embd
    ):
        model.output = ops.DeviceWeight.from_qweight(model.output, device)
    return all_layers
