#!/usr/bin/env python3
"""The one-token MoE experts kernel alone (pi_moe_experts, kernels/cpu/moe.c), per decoded token (issue 48).

Loads a MoE GGUF (e.g. bench_moe.py's Qwen3-MoE-shaped file), then calls every layer's experts kernel as a decoded
token does, with k random experts per layer (seeded; a new draw per layer and token, so the rows come from DRAM as
in decode), and prints per token: wall and CPU ms, the bytes the selected experts' rows make (gate, up, down) and
the GB/s that is. `--resident` calls layer 0 with experts 0 .. k - 1 every time instead (a few MB that stay in the
caches): the kernel's compute rate without DRAM. `--stream` also times a plain read of the same pattern (as many
random regions of one expert matrix's size as a token reads, summed by torch) for the machine's rate.

Usage: python scripts/bench_moe_experts.py -m FILE [-t 1] [-n 32] [-r 5] [--resident] [--stream]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from powerinfer.ops.moe import MoEExperts
from powerinfer.runtime.engine import Engine, EngineOptions


def experts_kernels(engine: Engine) -> list[MoEExperts]:
    kernels = []
    for layer in engine.model.layers:
        experts = getattr(getattr(layer.ffn, "experts", None), "kernel", None)
        if isinstance(experts, MoEExperts):
            kernels.append(experts)
    if not kernels:
        raise SystemExit("no one-token experts kernel in this file's layers (not a MoE file on the CPU?)")
    return kernels


def stream_rate(region_bytes: int, n_regions: int, reps: int) -> float:
    """GB/s of a plain read (torch sum) of n_regions random regions of region_bytes in a 1 GiB buffer."""
    buf = torch.ones(2**28, dtype=torch.float32)
    words = region_bytes // 4
    g = torch.Generator().manual_seed(1)
    best = float("inf")
    for _ in range(reps):
        starts = torch.randint(0, buf.numel() - words, (n_regions,), generator=g).tolist()
        t0 = time.perf_counter()
        for s in starts:
            buf[s : s + words].sum()
        best = min(best, time.perf_counter() - t0)
    return region_bytes * n_regions / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-n", "--tokens", type=int, default=32, help="tokens per repetition")
    ap.add_argument("-r", "--runs", type=int, default=5)
    ap.add_argument("--resident", action="store_true", help="layer 0, experts 0..k-1 every call (in cache)")
    ap.add_argument("--stream", action="store_true", help="also a plain read of the same access pattern")
    args = ap.parse_args()
    options = EngineOptions(
        n_ctx=64, n_batch=64, n_threads=args.threads, act_precision="q8", fixed_threads=True
    )
    engine = Engine(args.model, options)
    kernels = experts_kernels(engine)
    L = len(kernels)
    if args.resident:
        kernels = [kernels[0]] * L
    d = kernels[0].desc
    k, E, NE = kernels[0].n_used, int(d.n_embd), int(d.n_expert)
    per_token = (d.gate.stride * d.n_ff + d.up.stride * d.n_ff + d.down.stride * d.n_embd) * k * L
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, E, generator=g) * 0.5
    y = torch.zeros(1, E)
    w = torch.full((1, k), 1.0 / k)
    fixed = torch.arange(k).view(1, k)
    walls, cpus = [], []
    gc.disable()
    for _ in range(args.runs):
        ids = [
            fixed if args.resident else torch.sort(torch.randperm(NE, generator=g)[:k]).values.view(1, k)
            for _ in range(args.tokens * L)
        ]
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(args.tokens * L):
            kernels[i % L](x, ids[i], w, y)
        walls.append((time.perf_counter() - t0) / args.tokens)
        cpus.append((time.process_time() - c0) / args.tokens)
    gc.enable()
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    where = "layer 0, experts 0..k-1 (resident)" if args.resident else f"{L} layers, {k} random experts each"
    print(
        f"experts kernel, -t {args.threads}, {where}: {per_token / 1e6:.1f} MB a token, "
        f"median of {args.runs}: {wall * 1e3:.2f} ms wall ({per_token / wall / 1e9:.2f} GB/s), "
        f"{cpu * 1e3:.2f} ms CPU"
    )
    if args.stream:
        torch.set_num_threads(1)
        region = int(d.gate.stride * d.n_ff)
        rate = stream_rate(region, per_token // region, args.runs)
        print(
            f"plain read of {per_token // region} random regions of {region / 1024:.0f} KiB (1 thread): {rate:.2f} GB/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
