"""`profile` and `train-predictor`: the runs with their progress bars, per-layer tables on stderr and one JSON
line of results on stdout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from powerinfer.app.console import err_console, progress_bar
from powerinfer.gguf.writer import write_file_atomically
from powerinfer.printable import printable
from powerinfer.profile import (
    ActivationProfile,
    PredictorOptions,
    PredictorReport,
    ProfileOptions,
    run_profile,
    train_predictors,
    write_predictor_folder,
)
from powerinfer.profile.experts import ExpertProfile


def expert_table(profile: ExpertProfile) -> Table:
    table = Table(
        title=f"Expert selections over {profile.n_tokens} tokens ({profile.n_used} of {profile.n_expert} per token)"
    )
    for name in ("layer", "top 10% of experts serve", "most selected", "never selected"):
        table.add_column(name, justify="right")
    for layer, (counts, skew) in enumerate(zip(profile.counts, profile.skew(), strict=True)):
        table.add_row(str(layer), f"{skew:.1%}", str(int(counts.argmax())), str(int((counts == 0).sum())))
    return table


def profile_table(profile: ActivationProfile) -> Table:
    table = Table(title=f"FFN activations over {profile.n_tokens} tokens ({profile.n_ff} neurons per layer)")
    for name in ("layer", "fired", "sparsity", "neurons for 80% of firings", "never fired"):
        table.add_column(name, justify="right")
    hot = profile.hot_share(0.8)
    for layer, (counts, sparsity) in enumerate(zip(profile.counts, profile.sparsity(), strict=True)):
        table.add_row(
            str(layer),
            f"{1 - sparsity:.1%}",
            f"{sparsity:.1%}",
            f"{hot[layer]:.1%}",
            str(int((counts == 0).sum())),
        )
    return table


def run_profile_report(opts: ProfileOptions) -> None:
    """Profile with a progress bar over tokens; the table and the files written on stderr, the summary on stdout."""
    with progress_bar("profiling", "tokens") as bar:
        task = bar.add_task("profile", total=None)
        result, paths = run_profile(opts, lambda done, total: bar.update(task, completed=done, total=total))
    err_console.print(expert_table(result) if isinstance(result, ExpertProfile) else profile_table(result))
    for kind, p in paths.items():
        err_console.print(f"profile: wrote {kind} {p}", markup=False)
    sys.stdout.write(json.dumps(result.summary()) + "\n")


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


def run_train_predictor_report(opts: PredictorOptions) -> None:
    """Train with a progress bar per layer, write the predictor folder and its report.json; the table on stderr,
    the summary on stdout."""
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


def is_moe_file(path: Path) -> bool:
    """Whether the GGUF at path is a mixture-of-experts model (its header and config only)."""
    from powerinfer.arch import load_config
    from powerinfer.gguf.reader import read_gguf

    return getattr(load_config(read_gguf(path)), "moe", None) is not None


def run_router_predictor_report(
    model: Path, corpus: Path, folder: Path, n_ctx: int, max_tokens: int, n_threads: int | None
) -> None:
    """MoE files: fit the next-layer router predictors, write router_predictor.npz (and its report) into folder; the
    accuracy table on stderr, the summary on stdout."""
    from powerinfer.profile.router_predictor import train_router_predictors, write_router_predictors

    with progress_bar("collecting", "tokens") as bar:
        task = bar.add_task("run", total=None)
        result = train_router_predictors(
            model, corpus, n_ctx, max_tokens, n_threads, lambda d, t: bar.update(task, completed=d, total=t)
        )
    table = Table(
        title=f"Next-layer expert prediction on {result.n_test} held-out tokens (fitted on {result.n_train})"
    )
    for name in ("layer", "trained predictor", "next layer's router (fallback)"):
        table.add_column(name, justify="right")
    for bid, (a, b) in enumerate(zip(result.accuracy, result.baseline, strict=True)):
        table.add_row(f"{bid} -> {bid + 1}", f"{a:.3f}", f"{b:.3f}")
    err_console.print(table)
    path = write_router_predictors(folder, result)
    err_console.print(f"train-predictor: wrote {printable(str(path))}", markup=False)
    sys.stdout.write(json.dumps(result.summary()) + "\n")
