#!/usr/bin/env python3
"""One token's listed rows against the dense matrix-vector product, from DRAM (docs/sparsity.md).

Twelve random Q4_0 matrices (5632 x 2048 by default, 6.5 MB each, 78 MB in all: more than the caches) are
read one after the other, so every product streams its weights from memory. Per round and per case, the time of
one matrix (mean over the twelve); the table gives the median over --reps rounds, the cases alternating within each
round:

- `dense`: the dense product (ops.linear) of every row;
- `listed F`: ops.rows_matmul over a random share F of the rows, in ascending order (CATS's up rows, PWRI's rows);
- `axpy F`: ops.rows_axpy of a random share F of the rows of the same matrices read as a transposed down
  projection (CATS's and PWRI's down rows), `axpy 1` every row.

int8 activations (the CLI's q8 precision). Usage:
    python scripts/bench_rows.py [-t 1] [--reps 9] [--fractions 0.25,0.5,0.75] [--rows 5632] [--cols 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from powerinfer.gguf.constants import GGMLType
from powerinfer.ops.context import KernelContext
from powerinfer.ops.dense import linear
from powerinfer.ops.qweight import QWeight
from powerinfer.ops.sparse import rows_axpy, rows_matmul


def random_q4_0(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """n rows of k random Q4_0 weights: random nibbles, every block's scale 0.01"""
    blocks = rng.integers(0, 256, size=(n, k // 32, 18), dtype=np.uint8)
    blocks[:, :, 0:2] = np.full((n, k // 32), 0.01, np.float16).view(np.uint8).reshape(n, k // 32, 2)
    return blocks.reshape(n, k // 32 * 18)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--fractions", default="0.25,0.5,0.75")
    ap.add_argument("--rows", type=int, default=5632)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--matrices", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, k = args.rows, args.cols
    rng = np.random.default_rng(0)
    weights = [
        QWeight.from_numpy(random_q4_0(rng, n, k), GGMLType.Q4_0, (n, k)) for _ in range(args.matrices)
    ]
    kc = KernelContext(n_threads=args.threads, act_precision="q8")
    x = torch.randn(k)
    fractions = [float(f) for f in args.fractions.split(",")]
    lists = {
        f: [
            torch.from_numpy(np.sort(rng.choice(n, int(n * f), replace=False)).astype(np.int64))
            for _ in weights
        ]
        for f in fractions + [1.0]
    }
    coefs = {f: [torch.randn(len(idx)) for idx in lists[f]] for f in lists}
    cases = ["dense"] + [f"listed {f:g}" for f in fractions] + [f"axpy {f:g}" for f in [1.0] + fractions]
    times: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(args.reps):
        for case in cases:
            t0 = time.perf_counter()
            for m, w in enumerate(weights):
                if case == "dense":
                    linear(x, w, kc)
                elif case.startswith("listed"):
                    rows_matmul(x, w, lists[float(case.split()[1])][m], kc)
                else:
                    f = float(case.split()[1])
                    rows_axpy(coefs[f][m], w, lists[f][m], kc)
            times[case].append((time.perf_counter() - t0) * 1e3 / len(weights))
    dense = statistics.median(times["dense"])
    print(f"{len(weights)} matrices of {n} x {k} (Q4_0), -t {args.threads}, medians of {args.reps}")
    print(f"{'case':<14} {'ms / matrix':>12} {'vs dense':>9}")
    for case in cases:
        med = statistics.median(times[case])
        print(f"{case:<14} {med:>12.3f} {med / dense:>8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
