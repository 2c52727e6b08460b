"""`powerinfer profile` on MoE models: how often each expert of each layer is selected over a corpus (the MoE
analogue of neuron activation counts) and how skewed the selections are (the share of (token, slot) selections
served by the top 10% of a layer's experts; uniform routing gives about 10%)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from powerinfer import stamps
from powerinfer.gguf.writer import write_file_atomically
from powerinfer.model.moe import MoEFFN
from powerinfer.profile.collect import Progress, run_windows
from powerinfer.runtime.engine import Engine

TOP_SHARE = 0.10


@dataclass
class ExpertProfile:
    """Selections per expert, per layer (n_layer x (n_expert,) int64) over n_tokens tokens."""

    counts: list[np.ndarray]
    n_tokens: int
    n_used: int
    neurons: np.ndarray | None = None  # ReLU experts: (n_layer, n_expert, n_ff) positive-gate counts

    @property
    def n_expert(self) -> int:
        return int(self.counts[0].shape[0])

    def skew(self, share: float = TOP_SHARE) -> np.ndarray:
        """Per layer: the share of selections that went to the ceil(share * n_expert) most selected experts."""
        k = max(1, math.ceil(share * self.n_expert))
        out = [np.sort(c)[::-1][:k].sum() / max(1, c.sum()) for c in self.counts]
        return np.array(out, dtype=np.float64)

    def summary(self) -> dict[str, object]:
        return {
            "n_tokens": self.n_tokens,
            "n_layer": len(self.counts),
            "n_expert": self.n_expert,
            "n_expert_used": self.n_used,
            "top10_share": [round(float(s), 6) for s in self.skew()],
            "expert_counts": [c.astype(int).tolist() for c in self.counts],
        }


def moe_ffns(engine: Engine) -> list[MoEFFN] | None:
    """The engine's MoE FFN blocks, or None when its model has no MoE layers."""
    ffns = [layer.ffn for layer in engine.model.layers]
    if not all(isinstance(f, MoEFFN) for f in ffns):
        return None
    return ffns  # type: ignore[return-value]


def profile_experts(
    engine: Engine, windows: list[list[int]], progress: Progress | None = None
) -> ExpertProfile:
    """Run the windows and count each layer's expert selections (every token of every window)."""
    ffns = moe_ffns(engine)
    if ffns is None:
        raise ValueError("profile_experts needs a MoE model")
    relu = all(ffn.spec.act == "relu" for ffn in ffns)
    for ffn in ffns:
        ffn.counts = torch.zeros(ffn.spec.n_expert, dtype=torch.int64)
        if relu:
            ffn.neuron_counts = torch.zeros(ffn.spec.n_expert, ffn.spec.n_ff_exp, dtype=torch.int64)
    try:
        n_tokens = run_windows(engine, windows, progress)
        counts = [ffn.counts.numpy().copy() for ffn in ffns if ffn.counts is not None]
        neurons = None
        if relu:
            neurons = np.stack([ffn.neuron_counts.numpy() for ffn in ffns if ffn.neuron_counts is not None])
    finally:
        for ffn in ffns:
            ffn.counts = ffn.neuron_counts = None
    return ExpertProfile(counts, n_tokens, ffns[0].spec.n_expert_used, neurons)


def write_neuron_counts(path: Path, counts: np.ndarray) -> Path:
    """The per-neuron counts of ReLU experts as an .npy file (placement.experts reads it beside the model)."""
    write_file_atomically(path, lambda f: np.save(f, counts.astype(np.int64), allow_pickle=False))
    return path


def write_expert_report(path: Path, summary: dict[str, object]) -> Path:
    data = (json.dumps({**summary, "stamp": stamps.header("profile")}, indent=1) + "\n").encode()
    write_file_atomically(path, lambda f: f.write(data))
    return path
