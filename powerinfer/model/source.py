"""What an architecture file gets to build its model: placed weights, devices and the sparsity choice.

The runtime's loader (runtime.loader.Loader) implements `WeightSource` by carrying out a placement plan; the
architecture asks for tensors by name and never learns where they live.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from powerinfer import ops
from powerinfer.model.sparse import HotPart, SparseStats
from powerinfer.model.workspace import Workspace

if TYPE_CHECKING:
    from powerinfer.model.moe import ExpertPart, ExpertSource


@dataclass(frozen=True)
class Sparsity:
    """How FFNs are built: "none" (dense), "predictor" (PowerInfer's per-layer MLP predictors), "cats"
    (per-layer thresholds on |act(gate)|, the config's sparse_thresholds) or "teal" (dense blocks whose matrices
    skip small inputs: the source gives them as ops.InputSparseWeight)."""

    selector: str = "none"
    threshold: float = 0.0


class WeightSource(Protocol):
    kc: ops.KernelContext
    sparsity: Sparsity
    stats: SparseStats | None
    workspace: Workspace

    def has(self, name: str) -> bool: ...

    def matrix(
        self, name: str, shape: tuple[int, int] | None = None
    ) -> ops.QWeight | ops.DeviceWeight | ops.InputSparseWeight:
        """A 2-D weight where the plan put it (checked against `shape` when given); in TEAL files, the matrices
        kept transposed with an input threshold (ops.InputSparseWeight)."""
        ...

    def host_matrix(self, name: str, shape: tuple[int, int] | None = None) -> ops.QWeight:
        """A 2-D weight in the memory-mapped file (the CPU part of a split FFN, the embedding)."""
        ...

    def host_stack(self, name: str, shape: tuple[int, int, int]) -> ops.QWeight:
        """A 3-D weight (n, rows, cols) in the memory-mapped file as one 2-D weight (n * rows, cols): the stacked
        experts of a MoE layer."""
        ...

    def vector(self, name: str, n: int) -> torch.Tensor:
        """A 1-D float32 tensor of n elements on the device the plan gave its tensor."""
        ...

    def hot_rows(
        self,
        layer: int,
        gate: ops.QWeight | None,
        up: ops.QWeight,
        down_t: ops.QWeight,
        b_up: torch.Tensor | None = None,
    ) -> HotPart | None:
        """The pool part of a layer's sparse FFN (None: every neuron on the CPU)."""
        ...

    def pool_experts(
        self, layer: int, gate: ops.QWeight, up: ops.QWeight, down: ops.QWeight, n_expert: int, act: str
    ) -> ExpertPart | None:
        """The experts of a MoE layer the plan keeps whole in the pool (None: every expert on the CPU)."""
        ...

    def stored_experts(self, layer: int) -> ExpertSource | None:
        """A MoE layer's experts held apart from the file mapping under a memory limit (None: the mapping)."""
        ...

    def layer_device(self, layer: int) -> torch.device: ...

    def head_device(self) -> torch.device: ...
