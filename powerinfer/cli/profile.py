"""`powerinfer profile`: count how often each FFN neuron fires over a corpus (activation/ folder)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress
from rich.table import Table

from powerinfer.cli.common import (
    CtxOpt,
    LogDisableOpt,
    ModelOpt,
    ThreadsOpt,
    err_console,
    progress_bar,
    resolve_model,
    run_guarded,
    setup_logging,
    threads,
)
from powerinfer.profile import ActivationProfile, ProfileOptions, run_profile
from powerinfer.profile.experts import ExpertProfile

CorpusOpt = Annotated[
    Path, typer.Option("-f", "--file", help="Corpus: a UTF-8 text file.", show_default=False)
]


def token_progress(description: str) -> Progress:
    """A progress bar over tokens on stderr."""
    return progress_bar(description, "tokens")


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


def profile(
    model: ModelOpt = None,
    file: CorpusOpt = ...,  # type: ignore[assignment]
    ctx_size: CtxOpt = 0,
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "-o",
            "--output",
            help="Folder for activation/, profile.json and the plot (default: the model's folder).",
            show_default=False,
        ),
    ] = None,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Use at most this many corpus tokens (0 = all).")
    ] = 0,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="Do not write activation_curve.png.")] = False,
    threads_: ThreadsOpt = 0,
    log_disable: LogDisableOpt = False,
) -> None:
    """Profile FFN activations of a ReLU model over a corpus and write activation/activation_<N>.pt (MoE models:
    expert selections per layer, into profile.json)."""
    setup_logging(log_disable)
    err_console.quiet = log_disable

    def body() -> None:
        path = resolve_model(model)
        opts = ProfileOptions(
            model=path,
            corpus=file,
            out_dir=out_dir if out_dir is not None else path.parent,
            n_ctx=ctx_size,
            n_threads=threads(threads_),
            max_tokens=max_tokens,
            plot=not no_plot,
        )
        with token_progress("profiling") as bar:
            task = bar.add_task("profile", total=None)
            result, paths = run_profile(
                opts, lambda done, total: bar.update(task, completed=done, total=total)
            )
        err_console.print(
            expert_table(result) if isinstance(result, ExpertProfile) else profile_table(result)
        )
        for kind, p in paths.items():
            err_console.print(f"profile: wrote {kind} {p}", markup=False)
        sys.stdout.write(json.dumps(result.summary()) + "\n")

    run_guarded(body)
