"""Prompt and decode speed while other CPU-bound processes share the cores.

Usage: python scripts/bench_shared_cores.py MODEL.gguf [--prompt 64] [--gen 32] [--reps 3]

For 0, 1 and 2 competing busy processes (`python -c "while True: pass"`, started here and killed after), runs
a prompt of --prompt tokens and --gen decode steps at -t 1 and -t 2 (q8, the thread governor on, as the CLI runs)
and prints medians of --reps: the "Shared cores" table of docs/benchmarks.md. Then the first prompt of a fresh
engine (5 tokens) under each load, the case the governor's load check is for. Run it on an otherwise quiet
machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from powerinfer.runtime.engine import Engine, EngineOptions


def busy(k: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    engines = {t: Engine(a.model, EngineOptions(n_ctx=256, n_threads=t, act_precision="q8")) for t in (1, 2)}
    prompt = [1] + [100 + (i * 37) % 4000 for i in range(a.prompt - 1)]
    print(
        "| competing busy processes | -t 1 prompt ms | -t 2 prompt ms | -t 1 decode tok/s | -t 2 decode tok/s |"
    )
    print("|---:|---:|---:|---:|---:|")
    for k in (0, 1, 2):
        procs = busy(k)
        time.sleep(0.5)
        try:
            row = {}
            for t, e in engines.items():
                pp, tg = [], []
                for _ in range(a.reps):
                    e.reset()
                    t0 = time.perf_counter()
                    tok = int(e.eval(prompt).argmax())
                    pp.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    for _ in range(a.gen):
                        tok = int(e.eval([tok]).argmax())
                    tg.append(time.perf_counter() - t0)
                row[t] = (statistics.median(pp) * 1e3, a.gen / statistics.median(tg))
            print(
                f"| {k} | {row[1][0]:.0f} | {row[2][0]:.0f} | {row[1][1]:.1f} | {row[2][1]:.1f} |", flush=True
            )
            for t in (1, 2):
                fresh = Engine(a.model, EngineOptions(n_ctx=256, n_threads=t, act_precision="q8"))
                t0 = time.perf_counter()
                fresh.eval(prompt[:5])
                print(
                    f"  first 5-token prompt of a fresh engine, -t {t}: {(time.perf_counter() - t0) * 1e3:.0f} ms"
                )
        finally:
            for p in procs:
                p.kill()


if __name__ == "__main__":
    main()
