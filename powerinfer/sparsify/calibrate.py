"""Calibration for CATS: the FFN inputs of a dense run, then per-layer score statistics.

A neuron's gate score for a token is |act(gate_n . u)| * w_n, w_n its mean |up_n . u| over the calibration
tokens (relu'd where the model's up is): |act(gate)| alone ranks neurons whose up output is always small above
those whose up output is large. Measured on SmolLM2-135M at S = 0.4 (uniform per layer, held-out text): +11.7%
perplexity with |act| alone, +6.9% with the weighted score, +9.0% weighting by the down columns' norms as well.
Its output score is |h_n| * d_n (h_n = act(gate_n . u) * up_n . u, d_n the norm of its down column): the size
of what it adds to the residual. Selecting on the output score alone (reading every up row) costs +1.0% at
S = 0.4; two stages (the gate score picks the up rows to read, here half of the skipped share, the output score
the active ones among them) +1.3% in the same float study, against +7.0% for the gate score alone.
The thresholds are quantiles of the scores; the engine compares |act(gate_n . u)| with t_l / w_n and |h_n| with
t2_l / d_n.

A dense engine runs over the calibration windows while one observer per layer keeps that layer's FFN input u
(x_norm) in float16, for at most SAMPLE_BUDGET_BYTES over all layers (evenly spaced tokens past that), and, for
a few hundred evenly spaced tokens, u and the residual x in float32 for the error curves. Everything after the
run works one layer at a time from these samples: |act(gate u)| is recomputed with the FFN's own weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from powerinfer import ops
from powerinfer.errors import ConfigError
from powerinfer.model.blocks import DenseFFN
from powerinfer.profile.collect import run_windows
from powerinfer.runtime.engine import Engine

SAMPLE_BUDGET_BYTES = 1 << 30  # float16 FFN inputs kept over all layers
MAX_ERROR_TOKENS = 256  # tokens the error curves are measured on
FLOAT16_MAX = 65504.0
GRID = np.round(np.arange(0.0, 0.951, 0.05), 2)  # sparsity grid of the error curves: 0, 0.05, ..., 0.95
CHUNK_TOKENS = 512  # tokens per gate matmul when recomputing |act|
QUANTILE_SAMPLE = 1 << 20  # |act| values (sampled) the grid thresholds are read from

Progress = Callable[[int, int], None]  # (done, total)


def spread(n_total: int, n_pick: int) -> np.ndarray:
    """`n_pick` evenly spaced indices of range(n_total) (all of them when n_pick >= n_total)."""
    if n_pick >= n_total:
        return np.arange(n_total)
    return np.unique(np.linspace(0, n_total - 1, n_pick).round().astype(np.int64))


@dataclass
class Calibration:
    """What the dense run left per layer: FFN inputs of the kept tokens and the error-curve tokens."""

    u: list[torch.Tensor]  # n_layer x (n_kept, n_embd) float16
    error_u: list[torch.Tensor]  # n_layer x (n_error, n_embd) float32
    error_x: list[
        torch.Tensor
    ]  # n_layer x (n_error, n_embd) float32: the residual the FFN output is added to
    n_tokens: int  # tokens run

    @property
    def n_kept(self) -> int:
        return int(self.u[0].shape[0])


class InputRecorder:
    """The observer of every layer's FFN input: copies the selected tokens into preallocated buffers."""

    def __init__(self, n_layer: int, n_embd: int, n_tokens: int, keep: np.ndarray, error: np.ndarray) -> None:
        self.keep = np.zeros(n_tokens, dtype=bool)
        self.keep[keep] = True
        self.error = np.zeros(n_tokens, dtype=bool)
        self.error[error] = True
        # running position of each token in the buffers: cumulative counts of the masks
        self.keep_slot = np.cumsum(self.keep) - 1
        self.error_slot = np.cumsum(self.error) - 1
        self.u = [torch.empty(len(keep), n_embd, dtype=torch.float16) for _ in range(n_layer)]
        self.error_u = [torch.empty(len(error), n_embd) for _ in range(n_layer)]
        self.error_x = [torch.empty(len(error), n_embd) for _ in range(n_layer)]
        self.seen = [0] * n_layer  # tokens observed per layer

    def __call__(self, bid: int, x_norm: torch.Tensor, x_residual: torch.Tensor) -> None:
        start = self.seen[bid]
        T = x_norm.shape[0]
        self.seen[bid] = start + T
        span = slice(start, start + T)
        keep = self.keep[span]
        if keep.any():
            rows = torch.from_numpy(np.flatnonzero(keep))
            slots = torch.from_numpy(self.keep_slot[span][keep])
            u = x_norm.detach().to("cpu", torch.float32)[rows]
            self.u[bid][slots] = u.clamp(-FLOAT16_MAX, FLOAT16_MAX).to(torch.float16)
        error = self.error[span]
        if error.any():
            rows = torch.from_numpy(np.flatnonzero(error))
            slots = torch.from_numpy(self.error_slot[span][error])
            self.error_u[bid][slots] = x_norm.detach().to("cpu", torch.float32)[rows]
            self.error_x[bid][slots] = x_residual.detach().to("cpu", torch.float32)[rows]


def calibrate(engine: Engine, windows: list[list[int]], progress: Progress | None = None) -> Calibration:
    """Run the windows through the dense engine and keep each layer's FFN inputs (see the module docstring)."""
    c = engine.config
    if any(layer.ffn_norm is None or layer.parallel for layer in engine.model.layers):
        raise ConfigError(
            f"sparsify needs sequential blocks with an FFN norm; {c.arch} runs attention and FFN in parallel"
        )
    n_tokens = sum(len(w) for w in windows)
    cap = max(MAX_ERROR_TOKENS, SAMPLE_BUDGET_BYTES // (c.n_layer * c.n_embd * 2))
    # never a window's first token: the engine runs position 0 dense (and its residual is an outlier in most
    # models), so it takes no part in the thresholds or the error curves
    starts = np.cumsum([0] + [len(w) for w in windows[:-1]])
    candidates = np.ones(n_tokens, dtype=bool)
    candidates[starts] = False
    pool = np.flatnonzero(candidates)
    keep = pool[spread(len(pool), cap)]
    error = pool[spread(len(pool), MAX_ERROR_TOKENS)]
    recorder = InputRecorder(c.n_layer, c.n_embd, n_tokens, keep, error)
    model = engine.model
    model.observers.append(recorder)
    try:
        run_windows(engine, windows, progress)
    finally:
        model.observers.remove(recorder)
    if any(seen != n_tokens for seen in recorder.seen):
        raise ConfigError("the model's layers did not report their FFN inputs for every token")
    return Calibration(recorder.u, recorder.error_u, recorder.error_x, n_tokens)


def dense_ffn(engine: Engine, bid: int) -> DenseFFN:
    """Layer bid's dense FFN, with the gate that CATS thresholds."""
    ffn = engine.model.layers[bid].ffn
    if not isinstance(ffn, DenseFFN) or ffn.gate is None:
        raise ConfigError("sparsify needs the dense gated FFN of every layer")
    return ffn


def up_scales(ffn: DenseFFN, u: torch.Tensor, kc: ops.KernelContext) -> torch.Tensor:
    """w (n_ff,) float32: each neuron's mean |up . u| (relu'd where the model's up is) over FFN inputs u."""
    n_ff = ffn.up.shape[0]
    total = torch.zeros(n_ff, dtype=torch.float64)
    for i in range(0, u.shape[0], CHUNK_TOKENS):
        v = ops.linear(u[i : i + CHUNK_TOKENS].to(torch.float32).contiguous(), ffn.up, kc)
        if ffn.b_up is not None:
            v = v + ffn.b_up
        total += (torch.relu(v) if ffn.spec.relu_up else v.abs()).sum(0, dtype=torch.float64)
    return (total / max(1, u.shape[0])).to(torch.float32)


def down_norms(ffn: DenseFFN, kc: ops.KernelContext) -> torch.Tensor:
    """||down[:, n]|| (n_ff,) float32: the size of neuron n's output per unit of its activation, read through
    the FFN's own down weight (one identity chunk at a time)."""
    n_ff = ffn.up.shape[0]
    out = torch.empty(n_ff)
    for i in range(0, n_ff, CHUNK_TOKENS):
        n = min(CHUNK_TOKENS, n_ff - i)
        eye = torch.zeros(n, n_ff)
        eye[torch.arange(n), torch.arange(i, i + n)] = 1.0
        out[i : i + n] = down_project(ffn, eye, kc).norm(dim=-1)
    return out


def magnitudes(
    ffn: DenseFFN,
    u: torch.Tensor,
    kc: ops.KernelContext,
    scale: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores of FFN inputs u (N, n_embd), computed in chunks of CHUNK_TOKENS: the gate stage's
    |act(gate u)| * scale (N, n_ff) float32 (scale None: 1) and, with out_scale, the output stage's
    |h| * out_scale (h = act(gate u) * up u, the neuron's activation), else None."""
    assert ffn.gate is not None
    n_ff = ffn.gate.shape[0]
    out = torch.empty(u.shape[0], n_ff)
    out2 = None if out_scale is None else torch.empty(u.shape[0], n_ff)
    for i in range(0, u.shape[0], CHUNK_TOKENS):
        chunk = u[i : i + CHUNK_TOKENS].to(torch.float32).contiguous()
        g = ops.linear(chunk, ffn.gate, kc)
        if out2 is not None and out_scale is not None:  # h as DenseFFN.hidden computes it, from the same g
            v = ops.linear(chunk, ffn.up, kc)
            if ffn.b_up is not None:
                v = v + ffn.b_up
            out2[i : i + CHUNK_TOKENS] = (
                ops.gated(g, v, ffn.spec.act, ffn.spec.relu_up).abs_().mul_(out_scale)
            )
        a = ops.act(ffn.spec.act, g).abs_()
        out[i : i + CHUNK_TOKENS] = a if scale is None else a.mul_(scale)
    return out, out2


def neuron_thresholds(threshold: float, scale: torch.Tensor) -> np.ndarray:
    """The engine's per-neuron thresholds on |act(gate)| for the layer threshold on the scores: t / w_n (+inf
    where w_n is 0: such a neuron's up output was always 0, so it contributes nothing); 0 -> every nonzero
    activation."""
    w = scale.double().numpy()
    if threshold <= 0:
        return np.zeros(w.shape, dtype=np.float32)
    with np.errstate(divide="ignore"):
        return np.where(w > 0, threshold / w, np.inf).astype(np.float32)


def quantile(values: torch.Tensor, s: float) -> float:
    """The threshold t with round(s * numel) values <= t: the k-th smallest value (0.0 for k = 0)."""
    flat = values.reshape(-1)
    k = int(round(s * flat.numel()))
    if k <= 0:
        return 0.0
    return float(torch.kthvalue(flat, min(k, flat.numel())).values)


def stage_thresholds(
    score: torch.Tensor, out_score: torch.Tensor | None, s: float, up_ratio: float
) -> tuple[float, float | None]:
    """(t1, t2) skipping the share s of the (token, neuron) pairs: t1 the (up_ratio * s)-quantile of the gate
    stage's scores; t2 the s-quantile of the output stage's scores with the pairs below t1 counted as skipped
    (None for one stage: out_score None or up_ratio >= 1, t1 then the s-quantile)."""
    if out_score is None or up_ratio >= 1.0:
        return quantile(score, s), None
    t1 = quantile(score, up_ratio * s)
    passed = torch.where(score > t1, out_score, torch.full_like(out_score, -1.0))
    return t1, quantile(passed, s)


def grid_thresholds(
    score: torch.Tensor, out_score: torch.Tensor | None, grid: np.ndarray, up_ratio: float, seed: int = 0
) -> tuple[np.ndarray, np.ndarray | None]:
    """stage_thresholds at each grid point, read from the same sample of at most QUANTILE_SAMPLE (token, neuron)
    pairs of both scores: the error curves need no more precision than that."""
    flat = score.reshape(-1)
    flat2 = None if out_score is None else out_score.reshape(-1)
    if flat.numel() > QUANTILE_SAMPLE:
        gen = torch.Generator().manual_seed(seed)
        pick = torch.randint(0, flat.numel(), (QUANTILE_SAMPLE,), generator=gen)
        flat, flat2 = flat[pick], None if flat2 is None else flat2[pick]
    pairs = [stage_thresholds(flat, flat2, float(g), up_ratio) for g in grid]
    t1 = np.array([p[0] for p in pairs], dtype=np.float64)
    if pairs[0][1] is None:
        return t1, None
    return t1, np.array([p[1] for p in pairs], dtype=np.float64)


def down_project(ffn: DenseFFN, h: torch.Tensor, kc: ops.KernelContext) -> torch.Tensor:
    """down · h (T, n_embd) through the FFN's own down weight (ffn_down or the transposed ffn_down_t)."""
    if ffn.down is not None:
        return ops.linear(h, ffn.down, kc)
    w = ffn.down_t
    assert w is not None
    return ops.rows_axpy(h, w, None, kc) if isinstance(w, ops.QWeight) else w.axpy(h, kc)


def error_curve(
    ffn: DenseFFN,
    u: torch.Tensor,
    x_residual: torch.Tensor,
    thresholds: np.ndarray,
    out_thresholds: np.ndarray | None,
    kc: ops.KernelContext,
    scale: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> np.ndarray:
    """Mean over tokens of ||y_dense - y_sparse||^2 / ||x||^2 at each (t1, t2) (a neuron is kept when its gate
    score |act| * scale > t1 and, with out_thresholds, its output score |h| * out_scale > t2).

    u, x_residual: (E, n_embd) float32; one value per threshold."""
    score, out_score = magnitudes(ffn, u, kc, scale, out_scale if out_thresholds is not None else None)
    h = ffn.hidden(u)  # (E, n_ff)
    E = u.shape[0]
    dropped = []
    for i, t in enumerate(thresholds):
        keep = score > float(t)
        if out_thresholds is not None and out_score is not None:
            keep &= out_score > float(out_thresholds[i])
        dropped.append(h * ~keep)  # the skipped neurons' part
    y = down_project(ffn, torch.cat(dropped).contiguous(), kc).view(len(thresholds), E, -1)  # (G, E, n_embd)
    norm = x_residual.pow(2).sum(-1).clamp_min(1e-12)  # (E,)
    return (y.pow(2).sum(-1) / norm).mean(-1).double().numpy()


@dataclass
class LayerThreshold:
    threshold: float  # t_l on the gate scores |act| * w
    neurons: np.ndarray  # (n_ff,) float32: the engine's thresholds on |act|, t_l / w_n
    counts: np.ndarray  # (n_ff,) tokens each neuron was active for
    active_share: float  # share of (token, neuron) pairs active
    up_share: float  # share of (token, neuron) pairs whose up row is read (passing the gate stage)
    out_threshold: float | None = None  # t2_l on the output scores |h| * ||down_n|| (two stages)
    out_neurons: np.ndarray | None = (
        None  # (n_ff,) float32: the engine's thresholds on |h|, t2_l / ||down_n||
    )


def layer_threshold(
    ffn: DenseFFN,
    u: torch.Tensor,
    s: float,
    kc: ops.KernelContext,
    scale: torch.Tensor,
    up_ratio: float = 1.0,
    out_scale: torch.Tensor | None = None,
) -> LayerThreshold:
    """Thresholds skipping the share s of the (token, neuron) pairs of u: one stage (up_ratio >= 1 or no
    out_scale), t_l the s-quantile of the gate scores |act(gate u)| * scale; else two (stage_thresholds)."""
    two = out_scale is not None and up_ratio < 1.0 and s > 0
    score, out_score = magnitudes(ffn, u, kc, scale, out_scale if two else None)
    t1, t2 = stage_thresholds(score, out_score, s, up_ratio) if s > 0 else (0.0, None)
    passed = score > t1
    active = passed if t2 is None or out_score is None else passed & (out_score > t2)
    counts = active.sum(dim=0).numpy().astype(np.int64)
    n = max(1, score.numel())
    out_neurons = None
    if t2 is not None and out_scale is not None:
        out_neurons = neuron_thresholds(t2, out_scale)
    return LayerThreshold(
        t1,
        neuron_thresholds(t1, scale),
        counts,
        float(counts.sum()) / n,
        float(passed.sum()) / n,
        t2,
        out_neurons,
    )
