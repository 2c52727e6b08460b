"""Weights as the ops take them: QWeight (raw ggml rows in host memory, powerinfer.ops.qweight) and DeviceWeight
(rows on a compute device).

A DeviceWeight computes through the ops (`linear`, `axpy` call powerinfer.ops.dense and powerinfer.ops.sparse on
its host view), so this module sits above them in the import graph; the ops know a device weight only as the
`OnDeviceWeight` protocol of powerinfer.ops.qweight, and hand it back to its own `linear` / `axpy`.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import ClassVar

import numpy as np
import torch

from powerinfer.errors import PlacementError
from powerinfer.gguf.constants import GGMLType
from powerinfer.ops.context import KernelContext
from powerinfer.ops.dense import get_rows, linear
from powerinfer.ops.qweight import QWeight
from powerinfer.ops.sparse import rows_axpy
from powerinfer.quant import POOL_TYPES, row_bytes

__all__ = ["DeviceWeight", "InputSparseWeight", "QWeight", "weight_rows"]


_BACKENDS = ("kernels", "triton")


def triton_kernels() -> ModuleType:
    """powerinfer.ops.triton_quant, imported on use (only a CUDA pool, or a test, needs triton); a
    PlacementError when triton cannot be imported."""
    try:
        return importlib.import_module("powerinfer.ops.triton_quant")
    except ImportError as e:
        raise PlacementError(
            f"the CUDA pool computes on quantized weights with Triton kernels, but triton cannot be "
            f"imported ({e}); install it (pip install 'powerinfer[cuda]'; CUDA builds of torch ship it)"
        ) from e


@dataclass(frozen=True, eq=False)
class DeviceWeight:
    """A weight, or some of its rows, kept on a compute device (the GPU pool, or the CPU standing in for it)
    in the file's own block format: no dequantised copy is resident, blocks are decoded inside the kernels.

    raw: uint8 (N, row_bytes) on the device, the ggml blocks of the rows (n_bytes = what the planner
    budgets, `quant.pool_bytes`); for the "triton" backend the same bytes repacked row by row as its kernels
    read them (triton_quant.pack; `from_qweight` does it). Types outside `quant.POOL_TYPES` are stored as F16.
    backend: "kernels" (CPU stand-in: the C kernels through a QWeight over raw) or "triton" (CUDA; the
    kernels of powerinfer.ops.triton_quant, which the Triton interpreter also runs on CPU tensors in tests).
    `linear` (y = x @ W.T) and `axpy` (y = h @ W) run on the weight's device and return float32 there; they
    move their input to that device.
    """

    on_device: ClassVar[bool] = True  # the ops hand it to its own linear / axpy
    raw: torch.Tensor
    ggml_type: GGMLType
    shape: tuple[int, int]
    backend: str = "kernels"
    _host: QWeight | None = field(default=None, init=False, repr=False)  # the C kernels' view of raw
    _triton: ModuleType | None = field(default=None, init=False, repr=False)  # triton_quant (triton backend)
    _packed: object = field(default=None, init=False, repr=False)  # triton_quant.PackedWeight over raw

    def __post_init__(self) -> None:
        object.__setattr__(self, "ggml_type", GGMLType(self.ggml_type))
        object.__setattr__(self, "shape", (int(self.shape[0]), int(self.shape[1])))
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {self.backend!r}")
        expected = (self.shape[0], row_bytes(self.ggml_type, self.shape[1]))
        if self.raw.dtype != torch.uint8 or tuple(self.raw.shape) != expected:
            raise ValueError(
                f"raw must be uint8 {expected} for a {self.ggml_type.name} weight of shape {self.shape}, "
                f"got {self.raw.dtype} {tuple(self.raw.shape)}"
            )
        if self.backend == "kernels":
            # raises unless raw is a CPU tensor with contiguous rows; keeps raw alive with the weight
            object.__setattr__(self, "_host", QWeight(self.raw, self.ggml_type, self.shape))
        else:
            kernels = triton_kernels()
            if self.ggml_type not in kernels.SUPPORTED_TYPES:
                raise ValueError(f"no Triton kernel for {self.ggml_type.name} weights")
            object.__setattr__(self, "_triton", kernels)
            object.__setattr__(self, "_packed", kernels.PackedWeight(self.raw, self.ggml_type, self.shape[1]))

    @classmethod
    def from_qweight(
        cls,
        w: QWeight,
        device: torch.device,
        rows: torch.Tensor | None = None,
        backend: str | None = None,
        kc: KernelContext | None = None,
    ) -> DeviceWeight:
        """Copy the raw blocks of `rows` of w (int64 ids; None = all rows) to `device`.

        Rows are gathered from the memory-mapped bytes with one index op; types outside POOL_TYPES are
        decoded to F16 blocks first (with `kc`'s kernels); for the "triton" backend they are repacked.
        backend None: "triton" on CUDA, "kernels" on the CPU.
        """
        device = torch.device(device)
        if backend is None:
            backend = "triton" if device.type == "cuda" else "kernels"
        if backend == "triton":
            triton_kernels()
        ids = None if rows is None else rows.to(device="cpu", dtype=torch.int64).reshape(-1)
        n_rows = w.shape[0] if ids is None else int(ids.shape[0])
        if w.ggml_type in POOL_TYPES:
            ggml_type = w.ggml_type
            raw = w.raw.clone() if ids is None else w.raw[ids]  # (n_rows, row_bytes), a contiguous copy
        else:
            ggml_type = GGMLType.F16
            every = torch.arange(w.shape[0], dtype=torch.int64) if ids is None else ids
            raw = get_rows(w, every, kc).to(torch.float16).view(torch.uint8)  # (n_rows, 2 K)
        if backend == "triton":  # repacked on the host: no second copy on the device, even for a moment
            raw = triton_kernels().pack(raw, ggml_type, w.shape[1]).data
        return cls(raw.to(device), ggml_type, (n_rows, w.shape[1]), backend)

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def n_bytes(self) -> int:
        return self.raw.nbytes

    def linear(self, x: torch.Tensor, kc: KernelContext | None = None) -> torch.Tensor:
        """y = x @ W.T: x (..., K) -> (..., N) float32 on the weight's device (kc: the C kernels' context)."""
        host = self._host
        if host is not None:
            return linear(x.to("cpu"), host, kc)
        x = x.to(self.raw.device, non_blocking=True)
        return self._triton.matmul(x, self._packed)

    def axpy(self, h: torch.Tensor, kc: KernelContext | None = None) -> torch.Tensor:
        """y = h @ W (W holds transposed rows, e.g. ffn_down_t): h (..., N) -> (..., K) float32 on the device."""
        host = self._host
        if host is not None:
            return rows_axpy(h.to("cpu"), host, None, kc)
        h = h.to(self.raw.device, non_blocking=True)
        return self._triton.axpy(h, self._packed)


@dataclass(frozen=True, eq=False)
class InputMeter:
    """One layer's counters of its input-sparse products (views of one element each into SparseStats's
    `input_tokens` and `input_bytes`, int64): the tokens the layer computed (counted by the product that reads the
    layer's input, `counts_tokens`) and the bytes of the transposed rows the products read."""

    tokens: np.ndarray
    bytes_read: np.ndarray


@dataclass(frozen=True, eq=False)
class InputSparseWeight:
    """A matrix W (N, K) kept transposed, w_t = W.T (K, N) in its file's ggml blocks, whose product skips the
    inputs with |x_k| <= threshold (TEAL, Liu et al. 2024): y = sum over |x_k| > threshold of x_k * w_t[k], so a
    skipped input is a row of w_t not read. Each token's inputs are selected alone and summed in the fixed chains
    of ops.rows_axpy, so a token's output does not depend on the other tokens of its batch.

    The ops hand it to its own `linear`, as they do a device weight (`on_device`); the fused blocks, which read
    W's rows, leave it out, and the layer runs op by op. It computes on the CPU.
    """

    on_device: ClassVar[bool] = True  # the ops hand it to its own linear / axpy
    w_t: QWeight
    threshold: float
    meter: InputMeter | None = None  # where `linear` counts the rows it reads (None: not counted)
    counts_tokens: bool = False  # `linear` also counts its tokens as the layer's (the layer's first product)

    def __post_init__(self) -> None:
        t = float(self.threshold)
        if not 0.0 <= t < float("inf"):
            raise ValueError(f"an input threshold must be finite and >= 0, got {t}")
        object.__setattr__(self, "threshold", t)

    @property
    def shape(self) -> tuple[int, int]:
        return self.w_t.shape[1], self.w_t.shape[0]

    @property
    def ggml_type(self) -> GGMLType:
        return self.w_t.ggml_type

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def n_bytes(self) -> int:
        return self.w_t.raw.nbytes

    @classmethod
    def concat(cls, parts: list[InputSparseWeight]) -> InputSparseWeight | None:
        """One weight whose product is the products of `parts` side by side (q, k and v; gate and up): they must
        read one input (one K), skip at one threshold and share a ggml type, else None. Each output element is
        the same chain of the same terms as in its part alone (rows_axpy's chains split by input row), so the
        bits are the parts' one by one; a skipped input skips one longer row. The rows are copied."""
        first = parts[0]
        n_in, kind = first.w_t.shape[0], first.ggml_type
        if any(
            p.threshold != first.threshold or p.ggml_type != kind or p.w_t.shape[0] != n_in for p in parts
        ):
            return None
        raw = torch.cat([p.w_t.raw for p in parts], dim=1)
        w_t = QWeight(raw, kind, (n_in, sum(p.w_t.shape[1] for p in parts)))
        return cls(w_t, first.threshold, first.meter, any(p.counts_tokens for p in parts))

    def linear(self, x: torch.Tensor, kc: KernelContext | None = None) -> torch.Tensor:
        """y = x_masked @ W.T: x (..., K) -> (..., N) float32, the inputs at or below the threshold skipped."""
        n_cols = self.w_t.shape[0]
        if x.shape[-1] != n_cols:
            raise ValueError(f"linear: x has {x.shape[-1]} features, weight {self.shape} expects {n_cols}")
        x2 = x.reshape(-1, n_cols).to("cpu")
        meter = self.meter
        if meter is not None:  # rows_axpy's own test of an input it reads: h != 0 and not |h| <= threshold
            read = int(((x2 != 0) & ~(x2.abs() <= self.threshold)).sum())
            meter.bytes_read[0] += read * self.w_t.raw.stride(0)
            if self.counts_tokens:
                meter.tokens[0] += x2.shape[0]
        return rows_axpy(x2, self.w_t, None, kc, self.threshold).view(*x.shape[:-1], self.w_t.shape[1])

    def axpy(self, h: torch.Tensor, kc: KernelContext | None = None) -> torch.Tensor:
        """y = h @ W: h (..., N) -> (..., K) float32, every row (no input skipped)."""
        return linear(h.to("cpu"), self.w_t, kc)


def weight_rows(w: QWeight | DeviceWeight, start: int, stop: int) -> QWeight | DeviceWeight:
    """Rows start..stop-1 of w as a weight of the same kind and device, sharing its bytes (no copy): one half
    of a fused matrix such as Phi-3's gate_up."""
    if not 0 <= start < stop <= w.shape[0]:
        raise ValueError(f"rows {start}..{stop} outside a weight of {w.shape[0]} rows")
    return dataclasses.replace(w, raw=w.raw[start:stop], shape=(stop - start, w.shape[1]))
