#!/usr/bin/env python3
"""Time one MoE layer's pooled experts (device.pool.PoolExperts): a step's (token, expert) pairs in the pool's
grouped call, against the same pairs on the CPU (model.moe.Experts without a pool), and count the Python calls of
a step.

Synthetic Q4_0 experts (random blocks, shapes of Qwen3-30B-A3B's layers by default: 2048 x 768, top 8), half of
them whole in the pool; tokens routed uniformly at random. For each T: the median time of a step of the pool
alone (`launch` from CPU tensors to the sum back on the CPU), of the all-CPU experts for the same pairs, and the Python-level calls
(sys.setprofile) of the pool's step, which stay the same for every T, n_expert and k.

Usage: python scripts/bench_moe_pool.py [--device cpu|cuda] [--experts 64] [--pooled 32] [-k 8] [--n-embd 2048]
[--n-ff 768] [--tokens 1,8,64] [--runs 5] [-t 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch


def random_q4_0(n_rows: int, n_cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 blocks (n_rows, n_cols / 32 * 18): random nibbles, scales of about 0.02."""
    blocks = rng.integers(0, 256, (n_rows, n_cols // 32, 18), dtype=np.uint8)
    scale = (rng.uniform(0.01, 0.03, (n_rows, n_cols // 32))).astype(np.float16)
    blocks[:, :, :2] = scale.view(np.uint8).reshape(n_rows, n_cols // 32, 2)
    return blocks.reshape(n_rows, -1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--pooled", type=int, default=32)
    ap.add_argument("-k", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=2048)
    ap.add_argument("--n-ff", type=int, default=768)
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()

    from powerinfer import ops
    from powerinfer.device.pool import PoolExperts
    from powerinfer.gguf import GGMLType
    from powerinfer.model.moe import Experts, MoESpec

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 0
    E, D, F, k = args.experts, args.n_embd, args.n_ff, args.k
    rng = np.random.default_rng(0)
    t = GGMLType.Q4_0
    gate = ops.QWeight.from_numpy(random_q4_0(E * F, D, rng), t, (E * F, D))
    up = ops.QWeight.from_numpy(random_q4_0(E * F, D, rng), t, (E * F, D))
    down = ops.QWeight.from_numpy(random_q4_0(E * D, F, rng), t, (E * D, F))
    kc = ops.KernelContext(n_threads=args.threads)
    pooled = np.sort(rng.choice(E, args.pooled, replace=False)).astype(np.int64)
    pool = PoolExperts(gate, up, down, pooled, E, "silu", device, kc)
    cpu = Experts(MoESpec(n_expert=E, n_expert_used=k, n_ff_exp=F), gate, up, down, kc)
    print(
        f"{E} experts of {D} x {F} Q4_0, top {k}, {args.pooled} in the pool on {device} ({pool.n_bytes >> 20} MiB)"
    )
    print("| T | pairs in the pool | pool step ms | all-CPU step ms | Python calls of a pool step |")
    print("|---|---|---|---|---|")

    for T in (int(v) for v in args.tokens.split(",")):
        g = torch.Generator().manual_seed(T)
        ids = torch.stack([torch.randperm(E, generator=g)[:k].sort().values for _ in range(T)])
        w = torch.rand(T, k, generator=g)
        x = torch.randn(T, D, generator=g)
        mask = pool.member[ids]
        pool.launch(x, ids, w, mask).result()  # first use: kernel descriptions, Triton compiles
        times, cpu_times = [], []
        for _ in range(args.runs):
            start = time.perf_counter()
            pool.launch(x, ids, w, mask).result()
            times.append(time.perf_counter() - start)
            start = time.perf_counter()
            cpu(x, ids, w)
            cpu_times.append(time.perf_counter() - start)
        calls = 0

        def profile(frame, event, arg) -> None:  # noqa: ARG001
            nonlocal calls
            calls += event in ("call", "c_call")

        sys.setprofile(profile)
        pool.launch(x, ids, w, mask).result()
        sys.setprofile(None)
        print(
            f"| {T} | {int(mask.sum())} | {statistics.median(times) * 1e3:.3f} | "
            f"{statistics.median(cpu_times) * 1e3:.3f} | {calls} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
