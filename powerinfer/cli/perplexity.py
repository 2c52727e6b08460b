"""`powerinfer perplexity`: llama.cpp's perplexity of a text file, and the cost of sparsity vs dense."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from powerinfer.app.perplexity import PerplexityRun, run_perplexity
from powerinfer.app.pipeline import serve_if_worker
from powerinfer.cli.common import err_console, run_guarded, setup_logging
from powerinfer.cli.options import EngineArgs, LogDisableOpt, SeedOpt, random_seed, takes
from powerinfer.errors import InputError
from powerinfer.eval import PerplexityOptions, context_size


@takes(EngineArgs, skip=("n_gpu_layers",))
def perplexity_command(
    engine: EngineArgs,
    file: Annotated[Path | None, typer.Option("-f", "--file", help="Text file to score.")] = None,
    seed: SeedOpt = -1,
    chunks: Annotated[int, typer.Option("--chunks", help="Score at most this many chunks (-1 = all).")] = -1,
    ppl_stride: Annotated[
        int,
        typer.Option(
            "--ppl-stride", help="Strided perplexity: score the last S tokens of windows S apart (0 = off)."
        ),
    ] = 0,
    kl_divergence: Annotated[
        bool,
        typer.Option(
            "--kl-divergence",
            help="PowerInfer files: also run the dense FFN and report KL divergence, top-1 agreement "
            "and per-layer predictor recall.",
        ),
    ] = False,
    kl_divergence_base: Annotated[
        Path | None,
        typer.Option(
            "--kl-divergence-base",
            help="Without --kl-divergence: write this run's top-64 log-probabilities to FILE. "
            "With it: compare against FILE instead of the dense FFN.",
        ),
    ] = None,
    log_disable: LogDisableOpt = False,
) -> None:
    """Perplexity of a text (llama.cpp `perplexity`); with --kl-divergence the cost of sparsity vs dense."""
    setup_logging(log_disable)
    err_console.quiet = log_disable

    def body() -> None:
        if file is None:
            raise InputError("no text given: pass -f FILE")
        if ppl_stride < 0:
            raise InputError(f"--ppl-stride must be >= 0 (got {ppl_stride})")
        if engine.ctx_size <= 0:
            raise InputError("perplexity needs an explicit context size: pass -c N (N > 0)")
        n_ctx = context_size(engine.ctx_size, ppl_stride)
        run = PerplexityRun(
            model=engine.model_path(),
            text_file=file,
            ppl=PerplexityOptions(n_ctx=engine.ctx_size, n_chunks=chunks, stride=ppl_stride),
            engine=engine.options(n_ctx=n_ctx, n_batch=min(engine.batch_size, n_ctx)),
            kl_divergence=kl_divergence,
            kl_base=kl_divergence_base,
            seed=random_seed(seed),
        )
        if run.engine.pipeline is not None and (kl_divergence or kl_divergence_base is not None):
            raise InputError("--kl-divergence and --kl-divergence-base do not run in a pipeline (torchrun)")
        if not serve_if_worker(run.model, run.engine):  # ranks > 0 of a pipeline serve rank 0, then exit
            run_perplexity(run)

    run_guarded(body)
