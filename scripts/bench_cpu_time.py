#!/usr/bin/env python3
"""Prompt or decode tokens per second of one thread, timed by this process's CPU time (issue 48).

On a machine whose cores other work shares, wall-clock rates (powerinfer bench, bench_vs_llamacpp.py) drift with
the load; one thread's CPU time does not count the time it waited for a core, so two builds compare at a steady
rate (it still feels the caches the other work shares). The test is llama-bench's: ppN evaluates N tokens from an
empty cache in one batch, tgN decodes N tokens one at a time; one warm-up, then the median of --reps. The rate is
ours only: llama.cpp's side needs the wall clock (bench_vs_llamacpp.py).

Usage: python scripts/bench_cpu_time.py MODEL [MODEL ...] [-p 64] [-n 0] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from powerinfer.bench import prompt_tokens
from powerinfer.runtime.engine import Engine, EngineOptions


def one(engine: Engine, tokens: list[int], n_prompt: int, n_gen: int) -> float:
    """CPU seconds of one repetition from an empty cache."""
    engine.reset()
    start = time.process_time()
    if n_prompt:
        engine.eval(tokens[:n_prompt])
    for token in tokens[:n_gen]:
        engine.eval([token])
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("models", nargs="+")
    parser.add_argument("-p", "--n-prompt", type=int, default=64)
    parser.add_argument("-n", "--n-gen", type=int, default=0)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n_tokens = max(args.n_prompt, args.n_gen, 1)
    for path in args.models:
        options = EngineOptions(
            n_ctx=n_tokens + 8, n_batch=512, n_threads=1, act_precision="q8", fixed_threads=True
        )
        engine = Engine(path, options)
        tokens = prompt_tokens(engine.config.n_vocab, n_tokens)

        one(engine, tokens, args.n_prompt, args.n_gen)
        seconds = statistics.median(one(engine, tokens, args.n_prompt, args.n_gen) for _ in range(args.reps))
        test = f"pp{args.n_prompt}" if args.n_prompt else f"tg{args.n_gen}"
        print(f"{path}  {test}  {(args.n_prompt or args.n_gen) / seconds:.1f} tok/s (1 thread, CPU time)")


if __name__ == "__main__":
    main()
