#!/usr/bin/env python3
"""Decode speed of a `powerinfer sparsify` file against the dense path of our own engine, side by side.

Rows, measured alternately in one process (run r of every row before run r + 1 of any), medians of --runs:
  dense      the dense input file (ffn_down as stored)
  same-dense the sparse file with every neuron computed (--dense-ffn: the same weights, ffn_down_t densely)
  sparse     the sparse file (CATS: dense gate, the up rows of the neurons passing the gate stage, the active
             neurons' down rows)
Reports tokens/s, the speedup of sparse over both dense rows, the active share (and the share of up rows read),
and the weight bytes read per token by the sparse path against the ideal for the file's target S (gate + (1 - S)
of up and down).

Usage: python scripts/bench_sparsify.py --dense MODEL.gguf --sparse MODEL.sparse.powerinfer.gguf [-t 2]
                                        [--runs 5] [--n-gen 32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from powerinfer.gguf.constants import Keys
from powerinfer.runtime.engine import Engine, EngineOptions

PROMPT = "The history of the city begins with a small settlement on the river, where"


def decode_rate(engine: Engine, n_gen: int) -> float:
    engine.reset()
    ids = engine.tokenizer.encode(PROMPT, add_bos=True)
    logits = engine.eval(ids)
    token = int(logits.argmax())
    t0 = time.perf_counter()
    for _ in range(n_gen):
        token = int(engine.eval([token]).argmax())
    return n_gen / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dense", type=Path, required=True)
    ap.add_argument("--sparse", type=Path, required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--n-gen", type=int, default=32)
    args = ap.parse_args()
    opts = EngineOptions(act_precision="f32", n_ctx=256, n_threads=args.threads)
    engines = {
        "dense": Engine(args.dense, opts),
        "same-dense": Engine(
            args.sparse, EngineOptions(act_precision="f32", n_ctx=256, n_threads=args.threads, dense_ffn=True)
        ),
        "sparse": Engine(args.sparse, opts),
    }
    for e in engines.values():
        decode_rate(e, 4)  # warm the page cache and the kernels
    rates: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(args.runs):
        for name, e in engines.items():
            rates[name].append(decode_rate(e, args.n_gen))
    med = {k: statistics.median(v) for k, v in rates.items()}
    sparse = engines["sparse"]
    s = sparse.sparse_stats
    assert s is not None
    c = sparse.config
    active = float(s.active.sum()) / float(s.tokens.sum() * c.n_ff)
    up_read = float(s.up_read.sum()) / float(s.tokens.sum() * c.n_ff)
    tensors = sparse.gguf.tensors
    ffn_up = sum(t.n_bytes for n, t in tensors.items() if n.endswith("ffn_up.weight"))
    ffn_down = sum(t.n_bytes for n, t in tensors.items() if n.endswith("ffn_down_t.weight"))
    ffn_ud = ffn_up + ffn_down
    embd = tensors["token_embd.weight"].n_bytes if "output.weight" in tensors else 0
    read_all = (
        sparse.weight_bytes - embd
    )  # the embedding is read one row per token (unless tied to the output)
    target = float(sparse.gguf.metadata.get(Keys.SPARSITY_TARGET, 0.0))
    measured = read_all - ffn_up * (1 - up_read) - ffn_down * (1 - active)
    ideal = read_all - ffn_ud * target
    print(f"threads {args.threads}, {args.runs} runs of {args.n_gen} tokens, medians (tokens/s):")
    for name, rate in med.items():
        print(f"  {name:10s} {rate:8.2f}   runs: {' '.join(f'{r:.2f}' for r in rates[name])}")
    print(
        f"  sparse / dense {med['sparse'] / med['dense']:.3f}x, sparse / same-dense "
        f"{med['sparse'] / med['same-dense']:.3f}x"
    )
    print(
        f"  active share {active:.3f} (up rows read {up_read:.3f}, target S {target:.2f}); weight bytes per "
        f"token: sparse "
        f"{measured / 2**20:.1f} MiB, ideal for S {ideal / 2**20:.1f} MiB, dense {read_all / 2**20:.1f} MiB; "
        f"sparse reads at {measured * med['sparse'] / 1e9:.1f} GB/s"
    )


if __name__ == "__main__":
    main()
