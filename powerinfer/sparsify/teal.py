"""TEAL (Liu et al. 2024): a magnitude threshold on the input of every matrix of every layer.

Each of a layer's seven matrices W (q, k, v, o, gate, up, down) skips the inputs x_k with |x_k| <= t_W: the file
holds W transposed (one row per input, TensorNames.TEAL_MATRICES), so a skipped input is a row not read, and the
engine computes y = sum over |x_k| > t_W of x_k * W_t[k] (ops.InputSparseWeight). q, k and v read one input (the
attention norm's output), gate and up another (the FFN norm's); o reads the attention output, down the neurons'
activations act(gate u) * up u.

t_W is the S-quantile of |x| for its input over the calibration tokens (uniform allocation: every matrix skips the
share S of its inputs there), read from a dense run in which each of the four inputs of every layer is tapped.
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
# the four inputs of a layer, and the matrices that read each (TensorNames.TEAL_MATRICES order: q k v o gate up down)
INPUTS = ("attn", "attn_out", "ffn", "ffn_hidden")
READERS = {"attn": (0, 1, 2), "attn_out": (3,), "ffn": (4, 5), "ffn_hidden": (6,)}

Progress = Callable[[int, int], None]


class InputTap:
    """A weight that keeps magnitudes of the inputs it is given, then computes as the weight it wraps (the ops
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
    """Per layer and input (INPUTS), the kept tokens' |x| (n_kept, width) float16."""

    values: list[dict[str, torch.Tensor]]
    n_tokens: int


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
    return TealCalibration([{name: tap.values for name, tap in t.items()} for t in taps], n_tokens)


def teal_thresholds(calib: TealCalibration, sparsity: np.ndarray) -> tuple[dict[str, float], np.ndarray]:
    """Each TEAL matrix's input threshold at its layer's sparsity s_l (tensor name -> t), and per layer and input
    the share of the kept calibration inputs above it ((n_layer, 4), the rows the matrices read)."""
    thresholds: dict[str, float] = {}
    kept = np.zeros((len(calib.values), len(INPUTS)))
    for bid, inputs in enumerate(calib.values):
        for i, name in enumerate(INPUTS):
            values = inputs[name].float()
            t = quantile(values, float(sparsity[bid]))
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
    "teal_blocks",
    "teal_thresholds",
    "threshold_tensors",
]
