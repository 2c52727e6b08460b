"""PowerInfer predictor folders: `model_<N>.pt` (fc1/fc2 state dicts, no biases), optional config.json."""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerinfer.convert.vocab import read_json
from powerinfer.errors import FormatError, InputError
from powerinfer.printable import printable


@dataclass(frozen=True)
class Predictors:
    """Per-layer predictor weights: fc1 (r, n_embd) and fc2 (n_ff, r), as stored by torch."""

    fc1: list[np.ndarray]
    fc2: list[np.ndarray]
    threshold: float | None  # `sparse_threshold` of config.json, when present


def _load_state(path: Path) -> dict[str, np.ndarray]:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as e:
        raise FormatError(
            f"{printable(str(path))}: cannot read the predictor state dict: {printable(str(e).splitlines()[0] if str(e) else type(e).__name__)}"
        ) from None
    if not isinstance(state, dict):
        raise FormatError(f"{printable(str(path))}: expected a state dict, found a {type(state).__name__}")
    out = {}
    for key in ("fc1.weight", "fc2.weight"):
        t = state.get(key)
        if not isinstance(t, torch.Tensor):
            raise FormatError(f"{printable(str(path))}: no tensor '{key}'")
        out[key] = t.detach().to(torch.float32 if t.dtype == torch.bfloat16 else t.dtype).numpy()
    return out


def load_predictors(folder: Path, n_layer: int, n_embd: int, n_ff: int) -> Predictors:
    """Read and check every layer's predictor: fc1 must be (r, n_embd) and fc2 (n_ff, r), one r per layer."""
    if not folder.is_dir():
        raise InputError(f"predictor folder {printable(str(folder))} does not exist")
    fc1, fc2 = [], []
    for layer in range(n_layer):
        path = folder / f"model_{layer}.pt"
        if not path.is_file():
            raise FormatError(
                f"predictor folder {folder} has no model_{layer}.pt (the model has {n_layer} layers)"
            )
        state = _load_state(path)
        w1, w2 = state["fc1.weight"], state["fc2.weight"]
        if w1.ndim != 2 or w1.shape[1] != n_embd:
            raise FormatError(
                f"{printable(str(path))}: fc1.weight has shape {tuple(w1.shape)}, expected (r, {n_embd})"
            )
        rank = w1.shape[0]
        if w2.shape != (n_ff, rank):
            raise FormatError(
                f"{printable(str(path))}: fc2.weight has shape {tuple(w2.shape)}, expected ({n_ff}, {rank})"
            )
        fc1.append(w1)
        fc2.append(w2)
    threshold = None
    config_path = folder / "config.json"
    if config_path.is_file():
        value = read_json(config_path).get("sparse_threshold")
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise FormatError(
                    f"{printable(str(config_path))}: sparse_threshold must be a number, got {printable(value)}"
                )
            threshold = float(value)
    return Predictors(fc1, fc2, threshold)
