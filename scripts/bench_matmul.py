#!/usr/bin/env python3
"""Dense int8-activation matmuls (the CLI's q8 precision) of the block-32 types at a model's shapes (issue 48).

For each type and shape, the median time of ops.linear over --reps calls at each token count, and the rate in
multiply-adds per second (N * K * T / time). At -t 1 the time is this process's CPU time (steadier than wall time
when other work shares the cores), else wall time. The shapes are one layer's matrices: SmolLM2-135M's (576 wide, 1536
FFN) by default, `--shape 1.1b` TinyLlama-1.1B's (2048, 5632). The weights are random (quant.quantize of normal
values); only the time counts.

Usage:
    python scripts/bench_matmul.py [--types Q8_0,Q5_0] [--shape smollm2|1.1b] [-T 1,4,64] [-t 1] [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from powerinfer.errors import FormatError
from powerinfer.gguf.constants import GGMLType
from powerinfer.ops.context import KernelContext
from powerinfer.ops.dense import linear
from powerinfer.ops.qweight import QWeight
from powerinfer.quant import quantize, row_bytes

SHAPES = {  # (rows, cols) of one layer: q, k, v, o, gate, up, down
    "smollm2": [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)],
    "1.1b": [(2048, 2048), (256, 2048), (256, 2048), (2048, 2048), (5632, 2048), (5632, 2048), (2048, 5632)],
}


def random_rows(rng: np.random.Generator, ggml_type: GGMLType, n: int, k: int) -> np.ndarray:
    """n rows of k weights: quant.quantize of normal values, or (types it does not write: the K-quants) random
    bytes with every half-precision scale set to 2^-10 (a finite value; only the time counts)"""
    try:
        return quantize(rng.standard_normal((n, k)).astype(np.float32), ggml_type)
    except FormatError:
        raw = rng.integers(0, 256, size=(n, row_bytes(ggml_type, k)), dtype=np.uint8)
        raw.view(np.uint16)[:, :] &= 0x3FFF  # no half reads as inf or nan: exponent below 31
        return raw


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q5_1,Q8_0")
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("-T", "--tokens", default="1,4,64")
    parser.add_argument("-t", "--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--wall", action="store_true", help="wall time (default at -t 1: this process's CPU time)"
    )
    args = parser.parse_args()
    # CPU time of one thread is steadier than wall time on a shared machine; several threads need the wall clock
    clock = time.perf_counter if args.wall or args.threads > 1 else time.process_time
    torch.set_num_threads(args.threads)
    kc = KernelContext(n_threads=args.threads, act_precision="q8")
    rng = np.random.default_rng(0)
    shapes = SHAPES[args.shape]
    print(f"{'type':6} {'T':>4} {'layer ms':>9} {'G mul-add/s':>12}")
    for name in args.types.split(","):
        ggml_type = GGMLType[name]
        weights = []
        for n, k in shapes:
            weights.append(QWeight.from_numpy(random_rows(rng, ggml_type, n, k), ggml_type, (n, k)))
        for n_tokens in (int(v) for v in args.tokens.split(",")):
            xs = [torch.randn(n_tokens, k) for _, k in shapes]
            times = []
            for _ in range(args.reps):
                start = clock()
                for w, x in zip(weights, xs, strict=True):
                    linear(x, w, kc)
                times.append(clock() - start)
            best = statistics.median(times)
            macs = sum(n * k for n, k in shapes) * n_tokens
            print(f"{name:6} {n_tokens:>4} {best * 1e3:>9.3f} {macs / best / 1e9:>12.1f}")


if __name__ == "__main__":
    main()
