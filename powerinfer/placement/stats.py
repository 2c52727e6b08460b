"""Activation statistics: `activation/activation_<N>.pt`, one 1-D count tensor of length n_ff per layer."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from powerinfer import stamps
from powerinfer.errors import FormatError, PlacementError
from powerinfer.printable import printable


def activation_file(folder: str | os.PathLike[str], layer: int) -> Path:
    """Path of the statistics file of `layer` inside `folder`."""
    return Path(folder) / f"activation_{layer}.pt"


def load_activation_stats(folder: str | os.PathLike[str], n_layer: int, n_ff: int) -> list[np.ndarray]:
    """Load per-layer activation counts as float64 arrays of shape (n_ff,), layer 0 first.

    Files are addressed by their numeric layer index (`activation_<l>.pt` for l = 0..n_layer-1), never by
    sorting names, so `activation_10.pt` is layer 10 (spec 8.9). A missing folder or file raises
    PlacementError; a file that is not a finite, non-negative 1-D tensor of length n_ff raises FormatError.
    """
    import torch  # torch is needed only to unpickle the .pt files

    root = Path(folder)
    if not root.is_dir():
        raise PlacementError(f"activation statistics folder {root} does not exist")
    stamps.check_folder(root, "profile", "activation statistics folder")
    stats: list[np.ndarray] = []
    for layer in range(n_layer):
        path = activation_file(root, layer)
        if not path.is_file():
            raise PlacementError(f"activation statistics of layer {layer} are missing: {path} does not exist")
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # unpickling errors come in many types
            raise FormatError(f"{path}: cannot load activation statistics: {printable(str(e))}") from None
        if not isinstance(obj, torch.Tensor):
            raise FormatError(f"{path}: expected a tensor, found {type(obj).__name__}")
        if obj.dim() != 1:
            raise FormatError(f"{path}: expected a 1-D tensor of length {n_ff}, found {tuple(obj.shape)}")
        if obj.shape[0] != n_ff:
            raise FormatError(f"{path}: expected {n_ff} counts (the model's FFN size), found {obj.shape[0]}")
        if obj.is_complex() or obj.dtype == torch.bool:
            raise FormatError(f"{path}: counts have unsupported dtype {obj.dtype}")
        counts = obj.detach().to(torch.float64).numpy().copy()
        if not np.all(np.isfinite(counts)):
            raise FormatError(f"{path}: counts contain NaN or infinite values")
        if np.any(counts < 0):
            raise FormatError(f"{path}: counts contain negative values (min {counts.min()})")
        stats.append(counts)
    return stats


def check_stats(
    stats: Sequence[np.ndarray], n_layer: int | None = None, n_ff: int | None = None
) -> tuple[int, int]:
    """Validate in-memory statistics (finite, non-negative, equal 1-D lengths); returns (n_layer, n_ff)."""
    if len(stats) == 0:
        raise PlacementError("activation statistics are empty (no layers)")
    if n_layer is not None and len(stats) != n_layer:
        raise PlacementError(f"activation statistics cover {len(stats)} layers, the model has {n_layer}")
    first = np.asarray(stats[0])
    width = n_ff if n_ff is not None else (first.shape[0] if first.ndim == 1 else -1)
    for layer, counts in enumerate(stats):
        arr = np.asarray(counts)
        if arr.ndim != 1 or arr.shape[0] != width:
            raise PlacementError(
                f"activation statistics of layer {layer} have shape {arr.shape}, expected ({width},)"
            )
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise PlacementError(f"activation statistics of layer {layer} hold negative or non-finite values")
    return len(stats), width
