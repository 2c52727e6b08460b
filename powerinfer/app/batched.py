"""`batched`: several sequences decoded in parallel (llama.cpp's `batched` example); the sequences on stdout,
progress and speed on stderr."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from powerinfer.app.console import err_console
from powerinfer.errors import InputError
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


def run_batched_main(opts: BatchedOptions) -> None:
    """The run as the original prints it: its parameters, then each sequence on stdout; speed on stderr."""
    out = sys.stdout
    e = opts.engine
    budget = -1.0 if e.vram_budget_gib is None else e.vram_budget_gib
    out.write(
        f"params: model = {opts.model}, prompt = {opts.prompts[0]}, n_parallel = {opts.n_parallel}, "
        f"n_len = {opts.n_len}, n_threads = {e.n_threads}, vram_budget = {budget:.2f} GiB, reset_gpu_index = "
        f"{'true' if e.reset_gpu_index else 'false'}\n"
    )
    engine = Engine(opts.model, e)
    err_console.print(
        f"main: n_len = {opts.n_len}, n_ctx = {engine.n_ctx}, n_batch = {e.n_batch}, "
        f"n_parallel = {opts.n_parallel}, n_kv_req = {engine.n_ctx * opts.n_parallel}, "
        f"n_threads = {engine.kc.n_threads}"
    )
    if opts.n_parallel > 1:
        err_console.print(f"main: generating {opts.n_parallel} sequences ...")
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
