"""The sparsify pipeline: options, checks, calibration -> allocation -> thresholds -> files, result."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from powerinfer.errors import ConfigError, InputError
from powerinfer.gguf import GGMLType, read_gguf
from powerinfer.gguf.constants import TensorNames
from powerinfer.model.blocks import Head
from powerinfer.model.head import HeadScreen, screen_pays
from powerinfer.model.moe import MoEFFN
from powerinfer.ops.weights import QWeight
from powerinfer.printable import printable
from powerinfer.profile.collect import check_output_folder, make_windows, read_corpus, tokenize_corpus
from powerinfer.quant.types import DOWN_T_TYPES
from powerinfer.quantize import _check_output as check_output_file
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sparsify.allocate import (
    MAX_LAYER_SPARSITY,
    allocate_greedy,
    allocate_uniform,
    interpolate,
)
from powerinfer.sparsify.calibrate import (
    GRID,
    Calibration,
    LayerThreshold,
    calibrate,
    dense_ffn,
    down_norms,
    error_curve,
    grid_thresholds,
    layer_threshold,
    magnitudes,
    up_scales,
)
from powerinfer.sparsify.moe import MIN_EXPERT_TOKENS, expert_layer_threshold, moe_ffn
from powerinfer.sparsify.quality import TextQuality, measure, split_held_out
from powerinfer.sparsify.teal import INPUTS, calibrate_teal, teal_blocks, teal_thresholds, unit_weights
from powerinfer.sparsify.teal import error_curves as teal_error_curves
from powerinfer.sparsify.write import (
    SPARSITY_KEYS,
    write_activation_folder,
    write_moe_gguf,
    write_sparse_gguf,
    write_teal_gguf,
)
from powerinfer.texts import calibration_mix

METHODS = ("cats", "teal", "predictor")
ALLOCATIONS = ("greedy", "uniform")
# types sparsify writes ffn_down_t in (--down-type; kernels read them as sparse rows, 32-element blocks)
DOWN_TYPES = tuple(t.name for t in DOWN_T_TYPES)
MIN_TOKENS = 256  # calibration tokens needed at least

# (stage, done, total): stage "calibrate" counts tokens; "allocate", "threshold" and "write" count layers
StageProgress = Callable[[str, int, int], None]
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class SparsifyOptions:
    model: Path
    corpus: Path
    output: Path
    sparsity: float  # target mean share S of skipped FFN neurons, in [0, 0.95]
    method: str = "cats"
    # uniform: with two stages, greedy on the per-layer error curves measured no better on SmolLM2 (S = 0.4:
    # +1.65% against +1.46% uniform; S = 0.5: +2.81% against +2.65%), and it costs the curves
    allocation: str = "uniform"
    up_ratio: float = 0.5  # share of a layer's skipped neurons whose up rows are skipped too (1: one stage)
    n_ctx: int = 512  # calibration window (BOS + n_ctx-1 tokens)
    n_threads: int | None = None
    max_tokens: int = 4096  # calibration tokens used (0 = the whole file)
    down_type: str | None = None  # ffn_down_t's ggml type name (None: write.transposed_type's choice)
    sparse_head: bool = True  # also write the output head's screen (model.head), where it pays
    # also calibrate the thresholds on the packaged mix (calibration_windows), for thresholds that transfer
    mix: bool = False
    quality: bool = (
        False  # score the output against the input on held-out texts (sparsify.quality; the CLI's default)
    )


@dataclass
class SparsifyResult:
    output: Path
    activation: Path | None  # None: MoE files (no neuron placement for experts)
    target: float
    allocation: str
    thresholds: np.ndarray  # (n_layer,) t_l
    layer_sparsity: np.ndarray  # (n_layer,) s_l
    active_share: np.ndarray  # (n_layer,) share of calibration pairs active
    up_share: np.ndarray  # (n_layer,) share of calibration pairs whose up row is read
    up_ratio: float
    est_error: np.ndarray | None  # (n_layer,) estimated ||y_dense - y_sparse||^2 / ||x||^2 at s_l (greedy)
    n_tokens: int  # calibration tokens run
    n_kept: int  # of which kept for the thresholds and counts (all unless the sample budget was reached)
    n_ff: int
    down_types: dict[str, str] = field(default_factory=dict)
    head_screen_rank: int = 0  # rank of the output head's screen written (0: none)
    seconds: dict[str, float] = field(default_factory=dict)
    # MoE files: per layer, the experts routed fewer than MIN_EXPERT_TOKENS calibration tokens (the layer's
    # fallback thresholds); None for dense files
    fallback_experts: list[int] | None = None
    method: str = "cats"
    # TEAL: per layer, the share of the calibration inputs above each input's threshold (columns: teal.INPUTS)
    input_kept: np.ndarray | None = None
    quality: list[TextQuality] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        """The JSON line the command prints."""
        return {
            "output": str(self.output),
            "activation": None if self.activation is None else str(self.activation),
            "method": self.method,
            "allocation": self.allocation,
            "target": self.target,
            "n_tokens": self.n_tokens,
            "n_kept": self.n_kept,
            "n_layer": len(self.thresholds),
            "n_ff": self.n_ff,
            "mean_sparsity": round(float(np.mean(self.layer_sparsity)), 6),
            "layer_sparsity": [round(float(s), 6) for s in self.layer_sparsity],
            "thresholds": [float(np.float32(t)) for t in self.thresholds],
            "active_share": [round(float(a), 6) for a in self.active_share],
            "up_ratio": self.up_ratio,
            "up_share": [round(float(a), 6) for a in self.up_share],
            "est_error": None if self.est_error is None else [round(float(e), 8) for e in self.est_error],
            "down_t_types": sorted(set(self.down_types.values())),
            "head_screen_rank": self.head_screen_rank,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            **({} if self.fallback_experts is None else {"fallback_experts": self.fallback_experts}),
            **({"quality": {q.name: q.summary() for q in self.quality}} if self.quality else {}),
            **(
                {}
                if self.input_kept is None
                else {
                    "input_kept": {
                        name: [round(float(k), 6) for k in self.input_kept[:, i]]
                        for i, name in enumerate(INPUTS)
                    }
                }
            ),
        }


def stage_progress(progress: StageProgress | None, stage: str) -> Progress | None:
    """A stage's (done, total) callback reporting to progress(stage, done, total)."""
    return None if progress is None else (lambda done, total: progress(stage, done, total))


def default_output(model: Path) -> Path:
    """IN.gguf -> IN.sparse.powerinfer.gguf beside it."""
    name = model.name[: -len(".gguf")] if model.name.endswith(".gguf") else model.name
    return model.with_name(name + ".sparse.powerinfer.gguf")


def check_options(opts: SparsifyOptions) -> None:
    """InputError for a method not built, a target outside [0, MAX_LAYER_SPARSITY], a bad allocation or count."""
    if opts.method not in METHODS:
        raise InputError(f"unknown --method {printable(opts.method)} (expected one of {', '.join(METHODS)})")
    if opts.method == "predictor":
        raise InputError("--method predictor is not implemented yet; use cats or teal")
    if opts.allocation not in ALLOCATIONS:
        raise InputError(
            f"unknown --allocation {printable(opts.allocation)} (expected one of {', '.join(ALLOCATIONS)})"
        )
    if math.isnan(opts.up_ratio) or not 0.0 <= opts.up_ratio <= 1.0:
        raise InputError(f"--up-ratio must be in [0, 1], got {opts.up_ratio}")
    s = opts.sparsity
    if math.isnan(s) or not 0.0 <= s < 1.0:
        raise InputError(f"--sparsity must be in [0, 1), got {s}")
    if s > MAX_LAYER_SPARSITY:
        raise InputError(
            f"--sparsity {s} cannot be reached: every layer keeps at least {1 - MAX_LAYER_SPARSITY:.0%} of "
            f"its neurons (at most {MAX_LAYER_SPARSITY})"
        )
    if opts.max_tokens < 0:
        raise InputError(f"--max-tokens must be >= 0 (0 = all), got {opts.max_tokens}")
    if opts.down_type is not None and opts.down_type not in DOWN_TYPES:
        raise InputError(
            f"--down-type {printable(opts.down_type)} is not a type ffn_down_t can be written in "
            f"({', '.join(DOWN_TYPES)})"
        )


def check_paths(opts: SparsifyOptions) -> None:
    """Refuse, before any work, an output that cannot be written or that is the input itself."""
    out, model = Path(opts.output), Path(opts.model)
    if out.exists() and model.exists() and out.resolve() == model.resolve():
        raise InputError(f"output {printable(str(out))} is the input model: choose another -o")
    check_output_file(out)
    check_output_folder(out.absolute().parent / "activation")


def check_input(opts: SparsifyOptions) -> None:
    """Refuse an input that is already sparse: a PowerInfer (PWRI) file or one carrying sparsity keys."""
    header = read_gguf(opts.model)
    if header.is_sparse or any(key in header.metadata for key in SPARSITY_KEYS):
        raise InputError(
            f"{printable(str(opts.model))} is already sparse (a PowerInfer file): sparsify needs a dense GGUF"
        )


def calibration_windows(
    engine: Engine, text: str, max_tokens: int, mix: bool = False
) -> tuple[list[list[int]], list[int]]:
    """The calibration text as windows of the engine's context, and the slice of it held out for scoring
    (sparsify.quality.split_held_out); InputError below MIN_TOKENS tokens. With `mix`, the text gives at most half
    of max_tokens and the packaged calibration mix (powerinfer.texts) as many tokens again, an equal share from
    each of its kinds."""
    ids = tokenize_corpus(engine, text)
    n_all = len(ids)
    budget = max_tokens // 2 if mix and max_tokens > 0 else max_tokens
    ids, held_out = split_held_out(ids, budget, engine.n_ctx, MIN_TOKENS)
    if len(ids) < MIN_TOKENS:
        limit = f" (--max-tokens {max_tokens})" if len(ids) < n_all else ""
        raise InputError(
            f"calibration text too short: {len(ids)} tokens{limit}, sparsify needs at least {MIN_TOKENS}"
        )
    bos = engine.tokenizer.bos_id
    windows = make_windows(ids, engine.n_ctx, bos)
    if mix:
        kinds = calibration_mix()
        share = max(1, len(ids) // len(kinds))
        for _, mix_text in kinds:
            windows += make_windows(tokenize_corpus(engine, mix_text)[:share], engine.n_ctx, bos)
    return windows, held_out


def error_curves(
    engine: Engine,
    calib: Calibration,
    up_ratio: float,
    progress: Progress | None = None,
    curves_too: bool = True,
) -> tuple[np.ndarray | None, list[torch.Tensor], list[torch.Tensor | None]]:
    """Per layer, the output error of skipping each GRID share of the neurons (n_layer, len(GRID)) (None unless
    curves_too), and the layers' score scales: the gate stage's (mean |up . u| per neuron) and, for two stages
    (up_ratio < 1), the output stage's (the norms of the down columns), else None."""
    n_layer = engine.config.n_layer
    curves = np.zeros((n_layer, len(GRID))) if curves_too else None
    scales: list[torch.Tensor] = []
    out_scales: list[torch.Tensor | None] = []
    for bid in range(n_layer):
        ffn = dense_ffn(engine, bid)
        scale = up_scales(ffn, calib.u[bid], engine.kc)
        out_scale = down_norms(ffn, engine.kc) if up_ratio < 1.0 else None
        if curves is not None:
            score, out_score = magnitudes(ffn, calib.u[bid], engine.kc, scale, out_scale)
            t1, t2 = grid_thresholds(score, out_score, GRID, up_ratio, seed=bid)
            del score, out_score
            curves[bid] = error_curve(
                ffn, calib.error_u[bid], calib.error_x[bid], t1, t2, engine.kc, scale, out_scale
            )
        scales.append(scale)
        out_scales.append(out_scale)
        if progress is not None:
            progress(bid + 1, n_layer)
    return curves, scales, out_scales


def head_screen(engine: Engine, text: str) -> HeadScreen | None:
    """The output head's screen from final hidden states over the calibration text and the packaged mix (an equal
    share of SCREEN_TOKENS each: Engine.calibrated_screen), or None where the model's head is too small for one to
    pay."""
    head = engine.model.head
    if not isinstance(head, Head) or not isinstance(head.output, QWeight) or not screen_pays(head.output):
        return None
    return engine.calibrated_screen(head.output, [text])


def run_sparsify(opts: SparsifyOptions, progress: StageProgress | None = None) -> SparsifyResult:
    """Calibrate, allocate per-layer sparsity, write the PWRI file and activation/ beside it.

    Every check on the options, the input, the calibration text and the output paths runs before the
    calibration; nothing is written unless all of it succeeds."""

    def report(stage: str) -> Progress | None:
        return stage_progress(progress, stage)

    check_options(opts)
    text = read_corpus(opts.corpus)
    check_input(opts)
    check_paths(opts)

    t0 = time.perf_counter()
    # exact activations (f32): statistics of the model itself, not of int8-rounded inputs
    engine = Engine(
        opts.model, EngineOptions(act_precision="f32", n_ctx=opts.n_ctx, n_threads=opts.n_threads)
    )
    c = engine.config
    if not c.ffn.gated:
        raise ConfigError(
            f"the model's FFN is not gated (down(act(up x))): CATS thresholds act(gate x), so sparsify "
            f"needs a gated FFN ({c.arch})"
        )
    moe = isinstance(engine.model.layers[0].ffn, MoEFFN)
    if opts.method == "teal":
        teal_blocks(engine)  # refuse a model TEAL is not built for before the calibration
    if moe:
        for bid in range(c.n_layer):
            moe_ffn(engine, bid)  # refuse ReGLU experts before the calibration
        if opts.allocation != "uniform":
            raise InputError("--allocation greedy is not built for MoE files: use uniform")
    windows, held_out = calibration_windows(engine, text, opts.max_tokens, opts.mix)
    if opts.method == "teal":
        return with_quality(opts, sparsify_teal(opts, engine, windows, text, t0, progress), held_out, engine)
    calib = calibrate(engine, windows, report("calibrate"))
    t1 = time.perf_counter()
    if moe:
        return sparsify_moe(opts, engine, calib, t0, t1, progress)

    # uniform needs no error curves (the slow part of allocation): only the scales
    curves, scales, out_scales = error_curves(
        engine, calib, opts.up_ratio, report("allocate"), curves_too=opts.allocation == "greedy"
    )
    if curves is None:
        sparsity = allocate_uniform(opts.sparsity, c.n_layer)
    else:
        sparsity = allocate_greedy(curves, GRID, opts.sparsity)
    t2 = time.perf_counter()
    layers: list[LayerThreshold] = []
    for bid in range(c.n_layer):
        ffn = dense_ffn(engine, bid)
        layers.append(
            layer_threshold(
                ffn,
                calib.u[bid],
                float(sparsity[bid]),
                engine.kc,
                scales[bid],
                opts.up_ratio,
                out_scales[bid],
            )
        )
        if progress is not None:
            progress("threshold", bid + 1, c.n_layer)
    n_tokens, n_kept = calib.n_tokens, calib.n_kept
    del calib
    screen = head_screen(engine, text) if opts.sparse_head else None
    t3 = time.perf_counter()

    thresholds = np.array([lt.threshold for lt in layers], dtype=np.float64)
    # two stages in the file when any layer has them; a layer without (s_l = 0) keeps every neuron there
    out_thresholds = None
    if any(lt.out_neurons is not None for lt in layers):
        out_thresholds = [
            np.full(c.n_ff, -1.0, dtype=np.float32) if lt.out_neurons is None else lt.out_neurons
            for lt in layers
        ]
    out = Path(opts.output)
    types = write_sparse_gguf(
        engine.gguf,
        out,
        activation=c.activation,
        target=opts.sparsity,
        thresholds=thresholds,
        neuron_thresholds=[lt.neurons for lt in layers],
        layer_sparsity=sparsity,
        out_thresholds=out_thresholds,
        up_sparsity=None if out_thresholds is None else 1.0 - np.array([lt.up_share for lt in layers]),
        n_threads=opts.n_threads or 1,
        progress=report("write"),
        extra=[] if screen is None else screen.tensors(c.n_vocab, c.n_embd),
        down_type=None if opts.down_type is None else GGMLType[opts.down_type],
    )
    try:
        folder = write_activation_folder(out.absolute().parent / "activation", [lt.counts for lt in layers])
    except BaseException:  # no model file without its activation/ folder
        out.unlink(missing_ok=True)
        raise
    t4 = time.perf_counter()
    result = SparsifyResult(
        output=out,
        activation=folder,
        target=opts.sparsity,
        allocation=opts.allocation,
        thresholds=thresholds,
        layer_sparsity=sparsity,
        active_share=np.array([lt.active_share for lt in layers]),
        up_share=np.array([lt.up_share for lt in layers]),
        up_ratio=opts.up_ratio,
        est_error=None if curves is None else interpolate(curves, GRID, sparsity),
        n_tokens=n_tokens,
        n_kept=n_kept,
        n_ff=c.n_ff,
        down_types={k: v.name for k, v in types.items()},
        head_screen_rank=0 if screen is None else screen.rank,
        seconds={
            "load_calibrate": t1 - t0,
            "allocate": t2 - t1,
            "threshold": t3 - t2,
            "write": t4 - t3,
        },
    )
    return with_quality(opts, result, held_out, engine)


def with_quality(
    opts: SparsifyOptions, result: SparsifyResult, held_out: list[int], engine: Engine
) -> SparsifyResult:
    """The result with the output's quality against the input (sparsify.quality) where opts.quality asks."""
    if not opts.quality:
        return result
    n_ctx = engine.n_ctx
    t = time.perf_counter()
    result.quality = measure(result.output, Path(opts.model), held_out, n_ctx, opts.n_threads)
    result.seconds["quality"] = time.perf_counter() - t
    return result


def sparsify_moe(
    opts: SparsifyOptions,
    engine: Engine,
    calib: Calibration,
    t0: float,
    t1: float,
    progress: StageProgress | None = None,
) -> SparsifyResult:
    """A MoE file's experts: one-stage CATS thresholds per expert (sparsify.moe), written into a copy of the
    GGUF (keys only, llama.cpp still loads it); uniform sparsity, no activation/ folder, no head screen."""
    c = engine.config
    sparsity = allocate_uniform(opts.sparsity, c.n_layer)
    layers = []
    for bid in range(c.n_layer):
        layers.append(
            expert_layer_threshold(moe_ffn(engine, bid), calib.u[bid], float(sparsity[bid]), engine.kc)
        )
        if progress is not None:
            progress("threshold", bid + 1, c.n_layer)
    n_tokens, n_kept = calib.n_tokens, calib.n_kept
    del calib
    t2 = time.perf_counter()
    thresholds = np.array([lt.fallback for lt in layers], dtype=np.float64)
    out = Path(opts.output)
    write_moe_gguf(
        engine.gguf,
        out,
        target=opts.sparsity,
        thresholds=thresholds,
        expert_thresholds=np.stack([lt.neurons for lt in layers]),
        layer_sparsity=sparsity,
    )
    if progress is not None:
        progress("write", c.n_layer, c.n_layer)
    t3 = time.perf_counter()
    active = np.array([lt.active_share for lt in layers])
    return SparsifyResult(
        output=out,
        activation=None,
        target=opts.sparsity,
        allocation="uniform",
        thresholds=thresholds,
        layer_sparsity=sparsity,
        active_share=active,
        up_share=active,
        up_ratio=1.0,
        est_error=None,
        n_tokens=n_tokens,
        n_kept=n_kept,
        n_ff=engine.config.experts.n_ff_exp,  # type: ignore[attr-defined]
        fallback_experts=[int((lt.tokens < MIN_EXPERT_TOKENS).sum()) for lt in layers],
        seconds={"load_calibrate": t1 - t0, "threshold": t2 - t1, "write": t3 - t2},
    )


def sparsify_teal(
    opts: SparsifyOptions,
    engine: Engine,
    windows: list[list[int]],
    text: str,
    t0: float,
    progress: StageProgress | None = None,
) -> SparsifyResult:
    """TEAL (sparsify.teal): a threshold on the input of every matrix, uniform or greedy per input; the
    matrices written transposed (write.write_teal_gguf) with the output head's screen where it pays. No
    activation/ folder: TEAL files place nothing on a device."""

    def report(stage: str) -> Progress | None:
        return stage_progress(progress, stage)

    c = engine.config
    calib = calibrate_teal(engine, windows, report("calibrate"))
    t1 = time.perf_counter()
    est_error = None
    # TEAL's block-wise greedy: each layer at S, shared among its inputs by their error per byte
    if opts.allocation == "greedy":
        weights = unit_weights(calib)
        curves = teal_error_curves(calib, GRID, engine.kc, report("allocate"))
        units = np.stack(
            [allocate_greedy(curves[b], GRID, opts.sparsity, weights[b]) for b in range(c.n_layer)]
        )
        sparsity = (units * weights).sum(axis=1) / weights.sum(axis=1)
        est_error = np.array([interpolate(curves[b], GRID, units[b]).sum() for b in range(c.n_layer)])
    else:
        units = sparsity = allocate_uniform(opts.sparsity, c.n_layer)
    thresholds, kept = teal_thresholds(calib, units)
    if progress is not None:
        progress("threshold", c.n_layer, c.n_layer)
    n_tokens = calib.n_tokens
    n_kept = int(calib.values[0]["attn"].shape[0])
    del calib
    screen = head_screen(engine, text) if opts.sparse_head else None
    t2 = time.perf_counter()
    out = Path(opts.output)
    types = write_teal_gguf(
        engine.gguf,
        out,
        activation=c.activation,
        target=opts.sparsity,
        thresholds=thresholds,
        layer_sparsity=sparsity,
        n_threads=opts.n_threads or 1,
        progress=report("write"),
        extra=[] if screen is None else screen.tensors(c.n_vocab, c.n_embd),
        down_type=None if opts.down_type is None else GGMLType[opts.down_type],
    )
    t3 = time.perf_counter()
    # the summary's per-layer threshold: q/k/v's (the layer's first input)
    q_thresholds = np.array([thresholds[TensorNames.ATTN_Q.format(bid=bid)] for bid in range(c.n_layer)])
    return SparsifyResult(
        output=out,
        activation=None,
        target=opts.sparsity,
        allocation=opts.allocation,
        thresholds=q_thresholds,
        layer_sparsity=sparsity,
        active_share=kept.mean(axis=1),
        up_share=kept[:, 2],
        up_ratio=1.0,
        est_error=est_error,
        n_tokens=n_tokens,
        n_kept=n_kept,
        n_ff=c.n_ff,
        down_types={k: v.name for k, v in types.items()},
        head_screen_rank=0 if screen is None else screen.rank,
        seconds={"load_calibrate": t1 - t0, "threshold": t2 - t1, "write": t3 - t2},
        method="teal",
        input_kept=kept,
    )
