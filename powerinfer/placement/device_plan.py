"""Where every weight, KV cache and residual stream lives: one plan for dense offload and the sparse pool.

Pure data, no device is touched: the runtime's loader carries a DevicePlan out. Two plans exist:
- `layers_plan` (`-ngl N`): the last N layers whole (weights in their block format, residual stream, norms, KV
  cache, compute) on the pool device; with N > n_layer also the final norm and the output head (llama.cpp's rule).
- `sparse_plan` (PowerInfer files under a VRAM budget): the planner's dense tensors (whole attention layers,
  predictors, the output head) and, per layer, the hot FFN neurons' rows on the pool device; residual on the CPU.
The sparse plan is the same mechanism with per-neuron granularity.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from powerinfer.errors import PlacementError
from powerinfer.gguf.constants import TensorNames
from powerinfer.placement.experts import ExpertPlan
from powerinfer.placement.planner import Placement

_ATTN = (TensorNames.ATTN_Q, TensorNames.ATTN_K, TensorNames.ATTN_V, TensorNames.ATTN_OUT)
# the vectors an attention block computes with beside its matrices (Qwen2 biases, Qwen3 QK-norms): they move
# with it, or a device attention would add CPU tensors; names a file lacks are never asked for
_ATTN_VECTORS = (
    TensorNames.ATTN_Q_BIAS,
    TensorNames.ATTN_K_BIAS,
    TensorNames.ATTN_V_BIAS,
    TensorNames.ATTN_Q_NORM,
    TensorNames.ATTN_K_NORM,
)
_PRED = (TensorNames.PRED_FC1, TensorNames.PRED_FC2)


@dataclass(frozen=True)
class DevicePlan:
    """device: the pool device ("cuda", "cuda:1", "cpu" as a stand-in), None for everything on the CPU.

    tensors: names of whole tensors kept on the device. layers: layers whose residual stream and norms are
    computed there. backend: the kernels of the device's weights ("triton" on CUDA, "kernels": the C kernels
    of the CPU stand-in). kv_layers: layers whose KV cache is there (their attention runs there). head: the final
    norm and output projection run there. neurons: per layer, the FFN neuron ids whose rows the pool holds.
    experts: MoE files, the experts each layer keeps whole in the pool (placement.experts).
    """

    device: str | None = None
    tensors: frozenset[str] = frozenset()
    backend: str | None = None  # how the device computes: "triton" (CUDA) or "kernels" (the CPU stand-in)
    layers: frozenset[int] = frozenset()
    kv_layers: frozenset[int] = frozenset()
    head: bool = False
    neurons: tuple[np.ndarray | None, ...] = ()
    reason: str = "everything on the CPU"
    placement: Placement | None = field(default=None, compare=False)  # the sparse planner's result, if any
    experts: ExpertPlan | None = field(default=None, compare=False)  # MoE files: the experts in the pool

    def __post_init__(self) -> None:
        if self.device is not None and self.backend is None:
            object.__setattr__(self, "backend", "triton" if self.device.startswith("cuda") else "kernels")

    def on_device(self, name: str) -> bool:
        return self.device is not None and name in self.tensors

    def pool_neurons(self, layer: int) -> np.ndarray | None:
        if self.device is None or layer >= len(self.neurons):
            return None
        ids = self.neurons[layer]
        return ids if ids is not None and len(ids) else None

    def pool_experts(self, layer: int) -> np.ndarray | None:
        """The ids of layer's experts held whole in the pool (None: none)."""
        if self.device is None or self.experts is None or layer >= len(self.experts.experts):
            return None
        ids = self.experts.experts[layer]
        return ids if len(ids) else None

    def pool_expert_neurons(self, layer: int) -> dict[int, np.ndarray]:
        """Layer's experts of which some neurons (not the whole expert) are in the pool: id -> neuron ids."""
        if self.device is None or self.experts is None or layer >= len(self.experts.neurons):
            return {}
        return self.experts.neurons[layer]


def layers_plan(names: Iterable[str], n_layer: int, n_gpu_layers: int, device: str) -> DevicePlan:
    """`-ngl N`: the last N layers (and, for N > n_layer, the head) on `device`."""
    if n_gpu_layers < 0:
        raise PlacementError(f"-ngl must be >= 0 (got {n_gpu_layers})")
    n = min(n_gpu_layers, n_layer)
    layers = frozenset(range(n_layer - n, n_layer))
    prefixes = tuple(f"blk.{bid}." for bid in layers)
    head = n_gpu_layers > n_layer
    tensors = {name for name in names if name.startswith(prefixes)}
    if head:
        tensors |= {TensorNames.OUTPUT_NORM, TensorNames.OUTPUT}
    return DevicePlan(
        device,
        frozenset(tensors),
        layers=layers,
        kv_layers=layers,
        head=head,
        reason=f"{n} of {n_layer} layers{' and the output head' if head else ''} on {device}",
    )


def sparse_plan(
    placement: Placement, pool_neurons: list[np.ndarray], n_layer: int, device: str
) -> DevicePlan:
    """The sparse planner's result as a device plan.

    A layer's attention moves only when all four of its matrices were planned there and the plan budgeted the KV
    cache (its KV cache and its bias / QK-norm vectors go with it: attention on the device reads its cache there),
    a predictor only as fc1 and fc2 together.
    """
    planned = set(placement.gpu_tensors)
    tensors: set[str] = set()
    kv_layers = set()
    for bid in range(n_layer):
        attn = {t.format(bid=bid) for t in _ATTN}
        if attn <= planned and placement.kv_on_gpu:
            tensors |= attn | {t.format(bid=bid) for t in _ATTN_VECTORS}
            kv_layers.add(bid)
        pred = {t.format(bid=bid) for t in _PRED}
        if pred <= planned:
            tensors |= pred
    if TensorNames.OUTPUT in planned:
        tensors.add(TensorNames.OUTPUT)
    return DevicePlan(
        device,
        frozenset(tensors),
        kv_layers=frozenset(kv_layers),
        neurons=tuple(pool_neurons),
        reason=placement.reason,
        placement=placement,
    )


def neurons_plan(pool_neurons: list[np.ndarray], device: str, reason: str) -> DevicePlan:
    """Only FFN neurons on the pool (an explicit GPU index file)."""
    return DevicePlan(device, neurons=tuple(pool_neurons), reason=reason)
