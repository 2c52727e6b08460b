"""QWeight: a 2-D ggml weight as raw rows in host memory, the operand of every op; and OnDeviceWeight, what the
ops know of a weight that computes on its own device (powerinfer.ops.weights.DeviceWeight).

A leaf of powerinfer.ops: the ops (dense, sparse, reference) import their operand types from here, and
powerinfer.ops.weights, which computes through the ops, imports them from here too, so no import circle forms.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np
import torch

from powerinfer.gguf.constants import GGMLType
from powerinfer.quant import row_bytes

if TYPE_CHECKING:
    from powerinfer.ops.context import KernelContext

__all__ = ["OnDeviceWeight", "QWeight"]


class OnDeviceWeight(Protocol):
    """A weight kept on a compute device (powerinfer.ops.weights.DeviceWeight): `on_device` is True, and the ops
    hand it to its own `linear` (y = x @ W.T) or `axpy` (y = h @ W), which return float32 on its device."""

    on_device: ClassVar[bool]
    ggml_type: GGMLType
    shape: tuple[int, int]

    def linear(self, x: torch.Tensor, kc: KernelContext | None = None) -> torch.Tensor: ...

    def axpy(self, h: torch.Tensor, kc: KernelContext | None = None) -> torch.Tensor: ...


@dataclass(frozen=True, eq=False)
class QWeight:
    """A 2-D ggml weight kept as its raw bytes.

    raw: uint8 tensor (N, row_bytes), usually a zero-copy view of the memory-mapped model file.
    shape: (N, K) in elements. Only non-kernel types ever get a dequantised copy (`_dense`, built lazily).
    """

    on_device: ClassVar[bool] = False  # the ops compute it with the C kernels (or the torch reference)
    raw: torch.Tensor
    ggml_type: GGMLType
    shape: tuple[int, int]
    _dense: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _raw_ptr: int = field(init=False, repr=False)  # address and row stride (bytes) of raw, for the kernels
    _raw_stride: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ggml_type", GGMLType(self.ggml_type))
        object.__setattr__(self, "shape", (int(self.shape[0]), int(self.shape[1])))
        n_rows, n_cols = self.shape
        expected = (n_rows, row_bytes(self.ggml_type, n_cols))
        if (
            self.raw.dtype != torch.uint8
            or tuple(self.raw.shape) != expected
            or self.raw.device.type != "cpu"
        ):
            raise ValueError(
                f"raw must be a CPU uint8 tensor of shape {expected} for a {self.ggml_type.name} weight of "
                f"shape {self.shape}, got {self.raw.dtype} {tuple(self.raw.shape)} on {self.raw.device}"
            )
        if n_rows > 1 and self.raw.stride(1) != 1:
            raise ValueError("raw rows must be contiguous")
        object.__setattr__(self, "_raw_ptr", self.raw.data_ptr())
        object.__setattr__(self, "_raw_stride", self.raw.stride(0))

    @classmethod
    def from_numpy(cls, raw: np.ndarray, ggml_type: GGMLType, shape: tuple[int, int]) -> QWeight:
        """Wrap raw tensor bytes (e.g. a read-only memmap) without copying."""
        ggml_type = GGMLType(ggml_type)
        rows = raw.reshape(-1).view(np.uint8).reshape(int(shape[0]), row_bytes(ggml_type, int(shape[1])))
        with warnings.catch_warnings():
            # memmaps are read-only; the ops never write to weights
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(rows)
        return cls(tensor, ggml_type, (int(shape[0]), int(shape[1])))
