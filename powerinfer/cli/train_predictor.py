"""`powerinfer train-predictor`: train PowerInfer's per-layer activation predictors on a corpus."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from powerinfer.app.profile import is_moe_file, run_router_predictor_report, run_train_predictor_report
from powerinfer.cli.common import err_console, resolve_model, run_guarded, setup_logging
from powerinfer.cli.options import CtxOpt, LogDisableOpt, ModelOpt, ThreadsOpt, threads
from powerinfer.cli.profile import CorpusOpt
from powerinfer.errors import InputError
from powerinfer.placement.requests import resolve_device
from powerinfer.profile import PredictorOptions
from powerinfer.profile.collect import check_output_folder


def train_predictor(
    model: ModelOpt = None,
    file: CorpusOpt = ...,  # type: ignore[assignment]
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "-o",
            "--output",
            help="Predictor folder to write (default: predictor; MoE files: the model's folder, where "
            "--memory-limit reads router_predictor.npz).",
        ),
    ] = None,
    rank: Annotated[int, typer.Option("--rank", help="Predictor rank r, a multiple of 32 (0 = auto).")] = 0,
    target_recall: Annotated[
        float,
        typer.Option(
            "--target-recall",
            help="Share of firing neurons the threshold must keep, per layer (on calibration data).",
        ),
    ] = 0.95,
    ctx_size: CtxOpt = 0,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Corpus tokens used (train + held-out).")
    ] = 65536,
    steps: Annotated[int, typer.Option("--steps", help="Optimizer steps per layer.")] = 1500,
    pos_weight: Annotated[
        float, typer.Option("--pos-weight", help="BCE weight of firing neurons (> 1 favours recall).")
    ] = 3.0,
    device: Annotated[
        str | None, typer.Option("--device", help="Training device (default: cuda if present).")
    ] = None,
    threads_: ThreadsOpt = 0,
    log_disable: LogDisableOpt = False,
) -> None:
    """Train activation predictors (fc1/fc2 per layer) and write model_<N>.pt and config.json."""
    setup_logging(log_disable)
    err_console.quiet = log_disable

    def body() -> None:
        model_path = resolve_model(model)
        if is_moe_file(
            model_path
        ):  # a predictor of the next layer's experts, for --memory-limit's read-ahead
            folder = out_dir if out_dir is not None else model_path.parent
            check_output_folder(folder)
            run_router_predictor_report(model_path, file, folder, ctx_size, max_tokens, threads(threads_))
            return
        out = out_dir if out_dir is not None else Path("predictor")
        check_output_folder(out)  # before the training: a bad -o must not cost the run
        if not math.isfinite(pos_weight) or pos_weight <= 0:
            raise InputError(f"--pos-weight must be a finite number > 0, got {pos_weight}")
        opts = PredictorOptions(
            model=model_path,
            corpus=file,
            out_dir=out,
            rank=rank,
            target_recall=target_recall,
            n_ctx=ctx_size,
            n_threads=threads(threads_),
            max_tokens=max_tokens,
            steps=steps,
            pos_weight=pos_weight,
            device=resolve_device(device, "--device"),
        )
        run_train_predictor_report(opts)

    run_guarded(body)
