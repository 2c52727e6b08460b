"""`powerinfer profile`: count how often each FFN neuron fires over a corpus (activation/ folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from powerinfer.app.profile import run_profile_report
from powerinfer.cli.common import err_console, resolve_model, run_guarded, setup_logging
from powerinfer.cli.options import CtxOpt, LogDisableOpt, ModelOpt, ThreadsOpt, threads
from powerinfer.profile import ProfileOptions

CorpusOpt = Annotated[
    Path, typer.Option("-f", "--file", help="Corpus: a UTF-8 text file.", show_default=False)
]


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
        run_profile_report(opts)

    run_guarded(body)
