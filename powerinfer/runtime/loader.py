"""Carrying out a device plan: the weights an architecture asks for, each where the plan put it.

Implements `powerinfer.model.source.WeightSource`. Matrices stay in their ggml blocks: a QWeight over the
memory-mapped file on the CPU, a DeviceWeight (the same blocks copied) on the pool device. Every tensor is
checked against the shape the architecture expects before any kernel sees it.
"""

from __future__ import annotations

import numpy as np
import torch

from powerinfer import ops, quant
from powerinfer.device.pool import HotRows, PoolExperts
from powerinfer.errors import FormatError
from powerinfer.gguf.constants import GGMLType, Keys, TensorNames
from powerinfer.gguf.reader import GGUFFile, TensorInfo
from powerinfer.model.source import Sparsity
from powerinfer.model.sparse import HotPart, SparseStats
from powerinfer.model.workspace import Workspace
from powerinfer.placement.device_plan import DevicePlan
from powerinfer.printable import printable
from powerinfer.runtime.expert_store import ExpertStore, StoredExperts


class Loader:
    """The weights of one GGUF file placed by `plan`, for the kernels of `kc`."""

    def __init__(
        self,
        gguf: GGUFFile,
        plan: DevicePlan,
        kc: ops.KernelContext,
        sparsity: Sparsity,
        stats: SparseStats | None,
    ) -> None:
        self.gguf, self.plan, self.kc, self.sparsity, self.stats = gguf, plan, kc, sparsity, stats
        self.device = torch.device(plan.device) if plan.device is not None else None
        self.workspace = Workspace()
        self.hot: list[HotRows] = []
        self.experts: list[PoolExperts] = []
        self.device_weights: list[ops.DeviceWeight] = []
        self.device_vectors: list[torch.Tensor] = []
        self.store: ExpertStore | None = None  # the experts under --memory-limit (runtime.assembly sets it)
        # TEAL files: matrices asked for by name come from their transposes, as ops.InputSparseWeight (threshold
        # 0, every input, when the file runs dense: --dense-ffn)
        self.teal = gguf.is_sparse and gguf.metadata.get(Keys.SPARSITY_METHOD) == "teal"

    @property
    def device_bytes(self) -> int:
        """Bytes the plan's tensors and hot rows take on the pool device."""
        return (
            sum(w.n_bytes for w in self.device_weights)
            + sum(h.n_bytes for h in self.hot)
            + self.expert_bytes
            + sum(v.nbytes for v in self.device_vectors)
        )

    @property
    def expert_bytes(self) -> int:
        """Bytes the MoE experts held whole take on the pool device."""
        return sum(e.n_bytes for e in self.experts)

    def _info(self, name: str) -> TensorInfo:
        info = self.gguf.tensors.get(name)
        if info is None:
            raise FormatError(f"missing required tensor '{printable(name)}'")
        quant.check_weight_type(info.ggml_type, name)
        return info

    def has(self, name: str) -> bool:
        tensors = self.gguf.tensors
        return name in tensors or (self.teal and TensorNames.transposed(name) in tensors)

    def _input_sparse(self, name: str, shape: tuple[int, int] | None) -> ops.InputSparseWeight:
        """A TEAL matrix: its transpose (K, N) and its input threshold."""
        w_t = self.host_matrix(TensorNames.transposed(name), None if shape is None else (shape[1], shape[0]))
        threshold = 0.0
        if self.sparsity.selector == "teal":
            thr_name = TensorNames.input_threshold(name)
            threshold = float(self.vector(thr_name, 1)[0])
            if not 0.0 <= threshold < float("inf"):
                raise FormatError(
                    f"tensor '{printable(thr_name)}' holds {threshold}: expected a finite value >= 0"
                )
        return ops.InputSparseWeight(w_t, threshold, *self._input_meter(name))

    def _input_meter(self, name: str) -> tuple[ops.InputMeter | None, bool]:
        """The counters of the layer a TEAL matrix belongs to (its bytes read, and its tokens when the matrix is
        the layer's first, q), or None where nothing counts."""
        stats = self.stats
        if stats is None or stats.input_tokens is None or stats.input_bytes is None:
            return None, False
        for bid in range(stats.input_tokens.size):
            first, *rest = (t.format(bid=bid) for t in TensorNames.TEAL_MATRICES)
            if name == first or name in rest:
                span = slice(bid, bid + 1)
                return ops.InputMeter(stats.input_tokens[span], stats.input_bytes[span]), name == first
        return None, False

    def host_matrix(self, name: str, shape: tuple[int, int] | None = None) -> ops.QWeight:
        info = self._info(name)
        if len(info.shape) != 2:
            raise FormatError(f"tensor '{printable(name)}' should be 2-D, has shape {info.shape}")
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise FormatError(
                f"tensor '{printable(name)}' has shape {tuple(info.shape)}, expected {tuple(shape)}"
            )
        return ops.QWeight.from_numpy(info.data, info.ggml_type, info.shape)

    def host_stack(self, name: str, shape: tuple[int, int, int]) -> ops.QWeight:
        info = self._info(name)
        if tuple(info.shape) != tuple(shape):
            raise FormatError(
                f"tensor '{printable(name)}' has shape {tuple(info.shape)}, expected {tuple(shape)}"
            )
        n, rows, cols = shape
        return ops.QWeight.from_numpy(info.data, info.ggml_type, (n * rows, cols))

    def matrix(
        self, name: str, shape: tuple[int, int] | None = None
    ) -> ops.QWeight | ops.DeviceWeight | ops.InputSparseWeight:
        if self.teal and name not in self.gguf.tensors and TensorNames.transposed(name) in self.gguf.tensors:
            return self._input_sparse(name, shape)
        w = self.host_matrix(name, shape)
        if self.device is None or not self.plan.on_device(name):
            return w
        dw = ops.DeviceWeight.from_qweight(w, self.device, backend=self.plan.backend, kc=self.kc)
        self.device_weights.append(dw)
        return dw

    def vector(self, name: str, n: int) -> torch.Tensor:
        info = self._info(name)
        if tuple(info.shape) != (n,):
            raise FormatError(f"tensor '{printable(name)}' has shape {tuple(info.shape)}, expected ({n},)")
        if info.ggml_type == GGMLType.F32:  # a zero-copy view of the file
            v = torch.from_numpy(info.data.view("<f4").reshape(n))
        else:
            v = torch.from_numpy(quant.dequantize(info.data, info.ggml_type, info.shape)).reshape(n)
        if self.device is not None and self.plan.on_device(name):
            v = v.to(self.device)
            self.device_vectors.append(v)
        return v

    def hot_rows(
        self,
        layer: int,
        gate: ops.QWeight | None,
        up: ops.QWeight,
        down_t: ops.QWeight,
        b_up: torch.Tensor | None = None,
    ) -> HotPart | None:
        ids = self.plan.pool_neurons(layer)
        if ids is None or self.device is None:
            return None
        hot = HotRows(gate, up, down_t, ids, self.device, self.kc, self.plan.backend, b_up)
        self.hot.append(hot)
        return hot

    def pool_experts(
        self, layer: int, gate: ops.QWeight, up: ops.QWeight, down: ops.QWeight, n_expert: int, act: str
    ) -> PoolExperts | None:
        ids = self.plan.pool_experts(layer)
        partial = self.plan.pool_expert_neurons(layer)
        if (ids is None and not partial) or self.device is None:
            return None
        if ids is None:
            ids = np.zeros(0, dtype=np.int64)
        part = PoolExperts(
            gate, up, down, ids, n_expert, act, self.device, self.kc, self.plan.backend, partial=partial
        )
        self.experts.append(part)
        return part

    def stored_experts(self, layer: int) -> StoredExperts | None:
        return None if self.store is None else self.store.layer(layer)

    def layer_device(self, layer: int) -> torch.device:
        if self.device is not None and layer in self.plan.layers:
            return self.device
        return torch.device("cpu")

    def kv_device(self, layer: int) -> torch.device:
        if self.device is not None and layer in self.plan.kv_layers:
            return self.device
        return torch.device("cpu")

    def head_device(self) -> torch.device:
        if self.device is not None and self.plan.head:
            return self.device
        return torch.device("cpu")


__all__ = ["Loader", "TensorNames"]
