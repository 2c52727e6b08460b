"""`powerinfer batched`: decode several sequences in parallel (llama.cpp's `batched` example)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
import typer

from powerinfer.cli.common import (
    DEFAULT_ACT_PRECISION,
    ActPrecisionOpt,
    CtxOpt,
    FixedThreadsOpt,
    LogDisableOpt,
    MmapOpt,
    ModelOpt,
    PoolDeviceOpt,
    SparseHeadOpt,
    engine_options,
    err_console,
    read_text_file,
    resolve_model,
    run_guarded,
    sampling_params,
    setup_logging,
    threads,
    utf8_argument,
)
from powerinfer.cli.distributed import (
    DEFAULT_DIST_TIMEOUT,
    DistTimeoutOpt,
    PipelineSplitOpt,
    pipeline,
    serve_if_worker,
)
from powerinfer.errors import InputError
from powerinfer.printable import printable
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.generate import Generator, GenParams
from powerinfer.sampling import Sampler, SamplingParams


@dataclass(frozen=True)
class BatchedOptions:
    model: Path
    prompts: tuple[str, ...]  # one per stream, cycled
    n_parallel: int
    n_len: int  # total length of each sequence, prompt included
    engine: EngineOptions
    sampling: SamplingParams


@dataclass
class BatchedResult:
    sequences: list[list[int]]  # generated ids per stream
    prompt_ids: list[list[int]]
    n_decoded: int
    seconds: float


def run_batched(opts: BatchedOptions, engine: Engine | None = None) -> BatchedResult:
    """Prefill each distinct prompt once, fork it into its streams, then decode all streams together."""
    if opts.n_parallel < 1:
        raise InputError(f"PARALLEL must be >= 1 (got {opts.n_parallel})")
    engine = engine or Engine(opts.model, opts.engine)
    tok = engine.tokenizer
    prompts = [tok.encode(opts.prompts[i % len(opts.prompts)], add_bos=True) for i in range(opts.n_parallel)]
    longest = max(len(p) for p in prompts)
    if opts.n_len <= longest:
        raise InputError(f"LEN {opts.n_len} must be longer than the prompt ({longest} tokens)")
    if opts.n_len > engine.n_ctx:
        raise InputError(f"LEN {opts.n_len} exceeds the context size {engine.n_ctx}")
    gen = Generator(engine)
    sampler = Sampler(opts.sampling)  # one RNG for all streams, as the original
    t0 = time.perf_counter()
    # each distinct prompt is evaluated once; streams with the same prompt copy its KV slot
    first_slot: dict[tuple[int, ...], int] = {}
    last: dict[int, torch.Tensor] = {}
    for slot, ids in enumerate(prompts):
        src = first_slot.setdefault(tuple(ids), slot)
        if src == slot:
            last[slot] = engine.prefill(slot, ids)
        else:
            engine.fork(src, slot)
    streams: list[list[int]] = [[] for _ in prompts]
    events = []
    for slot, ids in enumerate(prompts):
        params = GenParams(opts.sampling, n_predict=opts.n_len - len(ids))
        events += gen.start(slot, ids, params, sampler, logits=last[first_slot[tuple(ids)]])
    n_decoded = 0
    while True:
        for ev in events:
            if ev.token is not None:
                streams[ev.slot].append(ev.token)
                n_decoded += 1
            if ev.end is not None:
                n_cur = len(prompts[ev.slot]) + len(streams[ev.slot])
                err_console.print(f"main: stream {ev.slot} finished at n_cur = {n_cur}")
        if not gen.live:
            break
        events = gen.step()
    return BatchedResult(streams, prompts, n_decoded, time.perf_counter() - t0)


def batched(
    model_path: Annotated[
        Path | None,
        typer.Argument(help="Model file (as the original's first positional).", show_default=False),
    ] = None,
    prompt_arg: Annotated[str | None, typer.Argument(metavar="[PROMPT]", show_default=False)] = None,
    parallel_arg: Annotated[int | None, typer.Argument(metavar="[PARALLEL]", show_default=False)] = None,
    len_arg: Annotated[int | None, typer.Argument(metavar="[LEN]", show_default=False)] = None,
    threads_arg: Annotated[int | None, typer.Argument(metavar="[N_THREAD]", show_default=False)] = None,
    vram_arg: Annotated[float | None, typer.Argument(metavar="[VRAM_BUDGET]", show_default=False)] = None,
    model: ModelOpt = None,
    prompt: Annotated[str | None, typer.Option("-p", "--prompt", help="Prompt of every stream.")] = None,
    prompt_file: Annotated[
        Path | None, typer.Option("--prompt-file", help="One prompt per line, cycled over the streams.")
    ] = None,
    n_parallel: Annotated[int | None, typer.Option("-np", "--parallel", help="Parallel sequences.")] = None,
    n_len: Annotated[
        int | None, typer.Option("-n", "--n-len", help="Total tokens per sequence (prompt incl.).")
    ] = None,
    threads_: Annotated[int | None, typer.Option("-t", "--threads", help="CPU threads.")] = None,
    fixed_threads: FixedThreadsOpt = False,
    mmap: MmapOpt = None,
    sparse_head: SparseHeadOpt = None,
    act_precision: ActPrecisionOpt = DEFAULT_ACT_PRECISION,
    vram_budget: Annotated[float | None, typer.Option("--vram-budget", help="VRAM budget (GiB).")] = None,
    ctx_size: CtxOpt = 0,
    temp: Annotated[float, typer.Option("--temp")] = 0.4,
    top_k: Annotated[int, typer.Option("--top-k")] = 40,
    top_p: Annotated[float, typer.Option("--top-p")] = 0.9,
    seed: Annotated[int, typer.Option("-s", "--seed")] = 1234,
    pool_device: PoolDeviceOpt = None,
    pipeline_split: PipelineSplitOpt = None,
    dist_timeout: DistTimeoutOpt = DEFAULT_DIST_TIMEOUT,
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
        path = resolve_model(model or model_path)
        if parallel < 1:
            raise InputError(f"PARALLEL must be >= 1 (got {parallel})")
        opts = BatchedOptions(
            model=path,
            prompts=prompts,
            n_parallel=parallel,
            n_len=length,
            # every stream has its own KV slot, so a slot needs only LEN positions
            engine=engine_options(
                threads_=n_threads,
                fixed_threads=fixed_threads,
                mmap=mmap,
                sparse_head=sparse_head,
                act_precision=act_precision,
                vram_budget=budget,
                pool_device=pool_device,
                reset_gpu_index=True,
                n_ctx=ctx_size if ctx_size > 0 else length,
                n_batch=max(length, parallel),
                n_seq=parallel,
                pipeline=pipeline(pipeline_split, dist_timeout),
            ),
            sampling=sampling_params(
                temp=temp, top_k=top_k, top_p=top_p, min_p=0.0, repeat_penalty=1.0, seed_=seed
            ),
        )
        serve_if_worker(opts.model, opts.engine)  # ranks > 0 of a pipeline serve rank 0 and exit
        out = sys.stdout
        out.write(
            f"params: model = {path}, prompt = {prompts[0]}, n_parallel = {parallel}, n_len = {length}, "
            f"n_threads = {n_threads}, vram_budget = {max(budget, -1.0):.2f} GiB, reset_gpu_index = true\n"
        )
        engine = Engine(opts.model, opts.engine)
        err_console.print(
            f"main: n_len = {length}, n_ctx = {engine.n_ctx}, n_batch = {opts.engine.n_batch}, "
            f"n_parallel = {parallel}, n_kv_req = {engine.n_ctx * parallel}, "
            f"n_threads = {engine.kc.n_threads}"
        )
        if parallel > 1:
            err_console.print(f"main: generating {parallel} sequences ...")
        result = run_batched(opts, engine)
        tok = engine.tokenizer
        for i, (ids, gen) in enumerate(zip(result.prompt_ids, result.sequences, strict=False)):
            text = tok.decode(ids) + tok.decode(gen, strip_leading_space=False)
            out.write(f"\nsequence {i}:\n\n{text}\n")
        out.flush()
        speed = result.n_decoded / result.seconds if result.seconds > 0 else float("nan")
        err_console.print(
            f"main: decoded {result.n_decoded} tokens in {result.seconds:.2f} s, speed: {speed:.2f} t/s",
            markup=False,
        )
        for line in engine.sparse_report():
            err_console.print(line, markup=False)

    run_guarded(body)
