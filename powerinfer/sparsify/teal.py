"""TEAL (Liu et al. 2024): a magnitude threshold on the input of every matrix of every layer.

Each of a layer's seven matrices W (q, k, v, o, gate, up, down) skips the inputs x_k with |x_k| <= t_W: the file
holds W transposed (one row per input, TensorNames.TEAL_MATRICES), so a skipped input is a row not read, and the
engine computes y = sum over |x_k| > t_W of x_k * W_t[k] (ops.InputSparseWeight). q, k and v read one input (the
attention norm's output), gate and up another (the FFN norm's); o reads the attention output, down the neurons'
activations act(gate u) * up u.

t_W is the s-quantile of |x| for its input over the calibration tokens, read from a dense run in which each of the
four inputs of every layer is tapped. s is S for every input (uniform allocation), or, as TEAL allocates (greedy),
built up in small steps, each to the input whose relative output error (over the matrices reading it) grows least
per byte it saves, until the bytes skipped are the share S of the layers' matrix bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from powerinfer import ops
from powerinfer.errors import ConfigError
from powerinfer.gguf.constants import TensorNames
from powerinfer.model.blocks import Attention, DenseFFN
from powerinfer.profile.collect import run_windows
from powerinfer.runtime.engine import Engine
from powerinfer.sparsify.calibrate import FLOAT16_MAX, quantile, spread

SAMPLE_TOKENS = 512  # tokens whose inputs are kept per tapped input (evenly spaced over the calibration run)
ERROR_TOKENS = 64  # of which the error curves of the greedy allocation are measured on
# the four inputs of a layer, and the matrices that read each (TensorNames.TEAL_MATRICES order: q k v o gate up down)
INPUTS = ("attn", "attn_out", "ffn", "ffn_hidden")
READERS = {"attn": (0, 1, 2), "attn_out": (3,), "ffn": (4, 5), "ffn_hidden": (6,)}

Progress = Callable[[int, int], None]


class InputTap:
    """A weight that keeps the inputs it is given (float16), then computes as the weight it wraps (the ops
    hand it to its own linear, as they do a device weight). Tokens arrive in run order; `keep` marks the ones
    kept."""

    on_device = True

    def __init__(self, inner: ops.QWeight, keep: np.ndarray) -> None:
        self.inner = inner
        self.shape, self.ggml_type = inner.shape, inner.ggml_type
        self.keep = keep
        self.slot = np.cumsum(keep) - 1
        self.seen = 0
        self.values = torch.empty(int(keep.sum()), inner.shape[1], dtype=torch.float16)

    def linear(self, x: torch.Tensor, kc: ops.KernelContext | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.shape[1])
        span = slice(self.seen, self.seen + x2.shape[0])
        self.seen += x2.shape[0]
        keep = self.keep[span]
        if keep.any():
            rows = torch.from_numpy(np.flatnonzero(keep))
            slots = torch.from_numpy(self.slot[span][keep])
            self.values[slots] = (
                x2.detach().to("cpu", torch.float32)[rows].abs().clamp(max=FLOAT16_MAX).half()
            )
        return ops.linear(x, self.inner, kc)

    def axpy(self, h: torch.Tensor, kc: ops.KernelContext | None = None) -> torch.Tensor:
        raise NotImplementedError("an input tap only computes linear products")


@dataclass
class TealCalibration:
    """Per layer and input (INPUTS), the kept tokens' x (n_kept, width) float16, and the matrices that read it."""

    values: list[dict[str, torch.Tensor]]
    n_tokens: int
    readers: list[dict[str, list[ops.QWeight]]]


def teal_blocks(engine: Engine) -> list[tuple[Attention, DenseFFN]]:
    """Every layer's attention and dense gated FFN with separate q/k/v and an untransposed down; ConfigError
    for a model TEAL is not built for."""
    blocks = []
    for layer in engine.model.layers:
        attn, ffn = layer.attn, layer.ffn
        if (
            layer.parallel
            or layer.ffn_norm is None
            or not isinstance(ffn, DenseFFN)
            or ffn.gate is None
            or ffn.down is None
            or attn.wq is None
        ):
            raise ConfigError(
                f"--method teal is built for Llama-layout models (separate q/k/v, gated FFN); not for "
                f"{engine.config.arch}"
            )
        blocks.append((attn, ffn))
    return blocks


def calibrate_teal(
    engine: Engine, windows: list[list[int]], progress: Progress | None = None
) -> TealCalibration:
    """Run the windows through the dense engine with every layer's four inputs tapped (see the module docstring)."""
    blocks = teal_blocks(engine)
    n_tokens = sum(len(w) for w in windows)
    keep = np.zeros(n_tokens, dtype=bool)
    keep[spread(n_tokens, SAMPLE_TOKENS)] = True
    model = engine.model
    taps: list[dict[str, InputTap]] = []
    saved = []
    for attn, ffn in blocks:
        assert attn.wq is not None and ffn.gate is not None and ffn.down is not None
        saved.append((attn.wq, attn.wo, ffn.gate, ffn.down))
        t = {name: InputTap(w, keep) for name, w in zip(INPUTS, saved[-1], strict=True)}  # type: ignore[arg-type]
        attn.wq, attn.wo, ffn.gate, ffn.down = t["attn"], t["attn_out"], t["ffn"], t["ffn_hidden"]  # type: ignore[assignment]
        taps.append(t)
    try:
        model.setup(
            engine.n_ctx, model.placed
        )  # no fused block reads the tapped weights: every layer runs op by op
        run_windows(engine, windows, progress)
    finally:
        for (attn, ffn), (wq, wo, gate, down) in zip(blocks, saved, strict=True):
            attn.wq, attn.wo, ffn.gate, ffn.down = wq, wo, gate, down
        model.setup(engine.n_ctx, model.placed)
    if any(tap.seen != n_tokens for t in taps for tap in t.values()):
        raise ConfigError("the model's layers did not compute every calibration token through their matrices")
    readers = [
        {
            "attn": [attn.wq, attn.wk, attn.wv],
            "attn_out": [attn.wo],
            "ffn": [ffn.gate, ffn.up],
            "ffn_hidden": [ffn.down],
        }
        for attn, ffn in blocks
    ]
    return TealCalibration(
        [{name: tap.values for name, tap in t.items()} for t in taps],
        n_tokens,
        readers,  # type: ignore[arg-type]
    )


def unit_weights(calib: TealCalibration) -> np.ndarray:
    """(n_layer, 4) the elements of the matrices reading each input: what skipping a share of it saves."""
    return np.array(
        [[sum(w.shape[0] * w.shape[1] for w in layer[name]) for name in INPUTS] for layer in calib.readers],
        dtype=np.float64,
    )


def error_curves(
    calib: TealCalibration, grid: np.ndarray, kc: ops.KernelContext, progress: Progress | None = None
) -> np.ndarray:
    """(n_layer, 4, G) each input's relative output error at the sparsities `grid`: over ERROR_TOKENS of its kept
    tokens, sum_W ||W (x - x_masked)||^2 / sum_W ||W x||^2 over the matrices W that read it, x_masked the input with
    the entries at or below the grid's threshold zeroed (TEAL's per-block error, the allocation's cost)."""
    n_layer = len(calib.values)
    curves = np.zeros((n_layer, len(INPUTS), len(grid)))
    for bid in range(n_layer):
        for i, name in enumerate(INPUTS):
            x = calib.values[bid][name].float()
            ordered = (
                x.abs().reshape(-1).sort().values
            )  # quantile(|x|, s) = ordered[round(s n) - 1] (0 at s n < 1)
            rows = x[torch.from_numpy(spread(x.shape[0], ERROR_TOKENS))]
            matrices = calib.readers[bid][name]
            whole = sum(float(ops.linear(rows, w, kc).square().sum()) for w in matrices)
            for g, share in enumerate(grid):
                k = min(int(round(float(share) * ordered.numel())), ordered.numel())
                t = float(ordered[k - 1]) if k > 0 else 0.0
                dropped = rows.masked_fill(rows.abs() > t, 0.0)
                lost = sum(float(ops.linear(dropped, w, kc).square().sum()) for w in matrices)
                curves[bid, i, g] = lost / max(whole, 1e-30)
        if progress is not None:
            progress(bid + 1, n_layer)
    return curves


def teal_thresholds(calib: TealCalibration, sparsity: np.ndarray) -> tuple[dict[str, float], np.ndarray]:
    """Each TEAL matrix's input threshold at its input's sparsity (sparsity (n_layer, 4), or (n_layer,) for every
    input of a layer at its s_l): tensor name -> t; and per layer and input the share of the kept calibration inputs
    above it ((n_layer, 4), the rows the matrices read)."""
    shares = np.asarray(sparsity, dtype=np.float64)
    if shares.ndim == 1:
        shares = np.repeat(shares[:, None], len(INPUTS), axis=1)
    thresholds: dict[str, float] = {}
    kept = np.zeros((len(calib.values), len(INPUTS)))
    for bid, inputs in enumerate(calib.values):
        for i, name in enumerate(INPUTS):
            values = inputs[name].float().abs()
            t = quantile(values, float(shares[bid, i]))
            kept[bid, i] = float((values > t).float().mean())
            for m in READERS[name]:
                thresholds[TensorNames.TEAL_MATRICES[m].format(bid=bid)] = t
    return thresholds, kept


def threshold_tensors(thresholds: dict[str, float]) -> dict[str, np.ndarray]:
    """The file's threshold tensors: for each matrix name, its F32 (1,) input threshold."""
    return {
        TensorNames.input_threshold(name): np.array([t], dtype=np.float32) for name, t in thresholds.items()
    }


__all__ = [
    "INPUTS",
    "InputTap",
    "TealCalibration",
    "calibrate_teal",
    "error_curves",
    "teal_blocks",
    "teal_thresholds",
    "threshold_tensors",
    "unit_weights",
]
