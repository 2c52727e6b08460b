"""`powerinfer train-predictor`: train PowerInfer's per-layer activation predictors on a corpus."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from powerinfer.cli.common import (
    CtxOpt,
    LogDisableOpt,
    ModelOpt,
    ThreadsOpt,
    err_console,
    resolve_device,
    resolve_model,
    run_guarded,
    setup_logging,
    threads,
)
from powerinfer.cli.profile import CorpusOpt
from powerinfer.errors import InputError
from powerinfer.gguf.writer import write_file_atomically
from powerinfer.printable import printable
from powerinfer.profile import PredictorOptions, PredictorReport, train_predictors, write_predictor_folder
from powerinfer.profile.collect import check_output_folder


def metrics_table(report: PredictorReport) -> Table:
    n = report.n_tokens
    table = Table(
        title=f"Predictors (rank {report.rank}, threshold {report.predictors.threshold:.4g}) on "
        f"{n['test']} held-out tokens (trained on {n['train']}, calibrated on {n['calibration']})"
    )
    for name in ("layer", "recall", "precision", "true sparsity", "predicted sparsity", "ratio"):
        table.add_column(name, justify="right")
    for layer, m in enumerate(report.test):
        ratio = m.predicted_sparsity / m.true_sparsity if m.true_sparsity > 0 else float("nan")
        table.add_row(
            str(layer),
            f"{m.recall:.4f}",
            f"{m.precision:.4f}",
            f"{m.true_sparsity:.4f}",
            f"{m.predicted_sparsity:.4f}",
            f"{ratio:.3f}",
        )
    return table


def train_predictor(
    model: ModelOpt = None,
    file: CorpusOpt = ...,  # type: ignore[assignment]
    out_dir: Annotated[Path, typer.Option("-o", "--output", help="Predictor folder to write.")] = Path(
        "predictor"
    ),
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
        check_output_folder(out_dir)  # before the training: a bad -o must not cost the run
        if not math.isfinite(pos_weight) or pos_weight <= 0:
            raise InputError(f"--pos-weight must be a finite number > 0, got {pos_weight}")
        opts = PredictorOptions(
            model=resolve_model(model),
            corpus=file,
            out_dir=out_dir,
            rank=rank,
            target_recall=target_recall,
            n_ctx=ctx_size,
            n_threads=threads(threads_),
            max_tokens=max_tokens,
            steps=steps,
            pos_weight=pos_weight,
            device=resolve_device(device, "--device"),
        )
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=err_console, transient=True) as bar:
            collect = bar.add_task("dense run (tokens)", total=None)
            layers: dict[int, int] = {}

            def on_train(stage: str, layer: int, step: int, total: int) -> None:
                if layer not in layers:
                    layers[layer] = bar.add_task(f"layer {layer} ({stage})", total=total)
                bar.update(layers[layer], completed=step)

            report = train_predictors(opts, lambda d, t: bar.update(collect, completed=d, total=t), on_train)
        folder = write_predictor_folder(opts.out_dir, report.predictors)
        summary = report.summary()
        report_bytes = (json.dumps(summary, indent=1) + "\n").encode()
        write_file_atomically(folder / "report.json", lambda f: f.write(report_bytes))
        err_console.print(metrics_table(report))
        err_console.print(
            f"train-predictor: mean recall {summary['mean_recall']:.4f}, worst layer "
            f"{summary['min_recall']:.4f}; wrote {printable(str(folder))} (one global sparse_threshold "
            f"{report.predictors.threshold:.4g}; per-layer thresholds folded into fc2)",
            markup=False,
        )
        sys.stdout.write(
            json.dumps({k: summary[k] for k in ("rank", "threshold", "mean_recall", "min_recall")}) + "\n"
        )

    run_guarded(body)
