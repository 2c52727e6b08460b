"""`powerinfer batched`: decode several sequences in parallel (llama.cpp's `batched` example)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from powerinfer.app.batched import BatchedOptions, run_batched_main
from powerinfer.app.pipeline import serve_if_worker
from powerinfer.cli.common import err_console, run_guarded, setup_logging, utf8_argument
from powerinfer.cli.options import EngineArgs, LogDisableOpt, SamplingArgs, takes, threads
from powerinfer.errors import InputError
from powerinfer.printable import printable
from powerinfer.textfile import read_text_file

# -t and --vram-budget here fall back on the positionals, and the sampling options take the original's defaults
NOT_SHARED = ("batch_size", "threads", "vram_budget", "n_gpu_layers", "reset_gpu_index", "disable_gpu_index")


@takes(EngineArgs, skip=NOT_SHARED, ctx_size=0)
def batched(
    engine: EngineArgs,
    model_path: Annotated[
        Path | None,
        typer.Argument(help="Model file (as the original's first positional).", show_default=False),
    ] = None,
    prompt_arg: Annotated[str | None, typer.Argument(metavar="[PROMPT]", show_default=False)] = None,
    parallel_arg: Annotated[int | None, typer.Argument(metavar="[PARALLEL]", show_default=False)] = None,
    len_arg: Annotated[int | None, typer.Argument(metavar="[LEN]", show_default=False)] = None,
    threads_arg: Annotated[int | None, typer.Argument(metavar="[N_THREAD]", show_default=False)] = None,
    vram_arg: Annotated[float | None, typer.Argument(metavar="[VRAM_BUDGET]", show_default=False)] = None,
    prompt: Annotated[str | None, typer.Option("-p", "--prompt", help="Prompt of every stream.")] = None,
    prompt_file: Annotated[
        Path | None, typer.Option("--prompt-file", help="One prompt per line, cycled over the streams.")
    ] = None,
    n_parallel: Annotated[int | None, typer.Option("-np", "--parallel", help="Parallel sequences.")] = None,
    n_len: Annotated[
        int | None, typer.Option("-n", "--n-len", help="Total tokens per sequence (prompt incl.).")
    ] = None,
    threads_: Annotated[int | None, typer.Option("-t", "--threads", help="CPU threads.")] = None,
    vram_budget: Annotated[float | None, typer.Option("--vram-budget", help="VRAM budget (GiB).")] = None,
    temp: Annotated[float, typer.Option("--temp")] = 0.4,
    top_k: Annotated[int, typer.Option("--top-k")] = 40,
    top_p: Annotated[float, typer.Option("--top-p")] = 0.9,
    seed: Annotated[int, typer.Option("-s", "--seed")] = 1234,
    log_disable: LogDisableOpt = False,
) -> None:
    """Decode PARALLEL sequences of LEN tokens together (llama.cpp batched)."""
    setup_logging(log_disable)
    err_console.quiet = log_disable

    def body() -> None:
        given = prompt if prompt is not None else prompt_arg or "Hello my name is"
        prompts: tuple[str, ...] = (utf8_argument(given, "the prompt"),)
        if prompt_file is not None:
            text = read_text_file(prompt_file, "prompt file")
            lines = [ln for ln in text.splitlines() if ln.strip()]
            if not lines:
                raise InputError(f"prompt file {printable(str(prompt_file))} has no prompts")
            prompts = tuple(lines)
        parallel = n_parallel if n_parallel is not None else (parallel_arg if parallel_arg is not None else 1)
        length = n_len if n_len is not None else (len_arg if len_arg is not None else 32)
        n_threads = threads(threads_ if threads_ is not None else (threads_arg or 0))
        budget = vram_budget if vram_budget is not None else (vram_arg if vram_arg is not None else -1.0)
        args = replace(engine, model=engine.model or model_path, threads=n_threads, vram_budget=budget)
        path = args.model_path()
        if parallel < 1:
            raise InputError(f"PARALLEL must be >= 1 (got {parallel})")
        opts = BatchedOptions(
            model=path,
            prompts=prompts,
            n_parallel=parallel,
            n_len=length,
            # every stream has its own KV slot, so a slot needs only LEN positions
            engine=args.options(
                reset_gpu_index=True,
                n_ctx=engine.ctx_size if engine.ctx_size > 0 else length,
                n_batch=max(length, parallel),
                n_seq=parallel,
            ),
            sampling=SamplingArgs(
                seed=seed, temp=temp, top_k=top_k, top_p=top_p, min_p=0.0, repeat_penalty=1.0
            ).params(),
        )
        if not serve_if_worker(opts.model, opts.engine):  # ranks > 0 of a pipeline serve rank 0, then exit
            run_batched_main(opts)

    run_guarded(body)
