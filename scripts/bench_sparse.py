#!/usr/bin/env python3
"""Decode speed of the sparse (predictor-driven) FFN against the dense FFN on the same PowerInfer file (CPU).

For each synthetic model in --dir (F16 and Q4_0 written by scripts/make_synthetic_model.py, the other types and
mixes by `powerinfer quantize` of the F16 file, see FILES), runs alternate:
a sparse engine (`Engine(path, EngineOptions(n_ctx, n_threads, act_precision="f32"))`), then a dense one on the same
weights (`EngineOptions(..., dense_ffn=True)`), each loaded fresh so only one engine is in memory at a time. Each run
evaluates a short prompt (untimed) and then decodes --n-gen tokens greedily, one eval per token (timed). One
untimed warm-up round comes first. Reported per file and mode (median of --runs):

- decode tokens/s, and the ratio sparse / dense,
- the predicted-active share of the timed decode steps (from engine.sparse_stats),
- effective GB/s: bytes read per token x tokens/s, where bytes per token = attention matrices + norms + one
  embedding row + output matrix, plus for sparse the predictor (fc1, fc2) and the active share of the FFN
  matrices (gate, up, down_t), for dense all FFN bytes. KV-cache reads are left out (short context).
  Compared with the machine's memory read bandwidth measured here (torch sum of a 1 GiB array, same threads).

`--act` picks the activation precision of our quant kernels (as in bench_decode.py): f32 (exact mode, the
default), q8 (int8 activation blocks, llama.cpp's arithmetic) or both. It applies to the matmuls and the
sparse rows_matmul; rows_axpy is exact in both.

The issues' floors: sparse >= 2.0x dense for Q4_0 and >= 1.9x for Q4_K_M at 10% active; the exit status is 2
when one is not met.

Usage: python scripts/bench_sparse.py [--dir DIR] [-t 2] [--runs 5] [--n-gen 32] [--files f16,q4_0,...]
                                     [--act f32|q8|both]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

# f16 and q4_0 come from make_synthetic_model.py; the others from `powerinfer quantize` of the f16 file, e.g.
#   powerinfer quantize DIR/synthetic-1.1b.powerinfer.gguf DIR/synthetic-1.1b.q8_0.powerinfer.gguf Q8_0 2
FILES = {
    "f16": "synthetic-1.1b.powerinfer.gguf",
    "q4_0": "synthetic-1.1b.q4.powerinfer.gguf",
    "q4_1": "synthetic-1.1b.q4_1.powerinfer.gguf",
    "q8_0": "synthetic-1.1b.q8_0.powerinfer.gguf",
    "bf16": "synthetic-1.1b.bf16.powerinfer.gguf",
    "q5_0": "synthetic-1.1b.q5_0.powerinfer.gguf",
    "q5_1": "synthetic-1.1b.q5_1.powerinfer.gguf",
    # powerinfer quantize DIR/synthetic-1.1b.powerinfer.gguf DIR/synthetic-1.1b.q4_k_m.powerinfer.gguf Q4_K_M
    "q4_k_m": "synthetic-1.1b.q4_k_m.powerinfer.gguf",
}
PROMPT = "The quick brown fox jumps over the lazy dog, then runs into the forest."
FLOORS = {"q4_0": 2.0, "q4_k_m": 1.9}  # sparse / dense decode speed required at 10% active


def memory_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: best of `repeats` sums over a `gib` GiB float32 array."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
        a.sum()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            a.sum()
            best = min(best, time.perf_counter() - t)
        return a.numel() * 4 / best / 1e9
    finally:
        torch.set_num_threads(previous)


def token_bytes(gguf, n_vocab: int) -> dict[str, float]:
    """Bytes of the tensors a decode step reads, by group."""
    groups = {"attn": 0.0, "pred": 0.0, "ffn": 0.0, "other": 0.0}
    for name, info in gguf.tensors.items():
        n = float(info.n_bytes)
        if name == "token_embd.weight":
            groups["other"] += n / n_vocab  # one row per token
        elif name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down_t.weight", "ffn_down.weight")):
            groups["ffn"] += n
        elif name.endswith(("fc1.weight", "fc2.weight")):
            groups["pred"] += n
        elif ".attn_" in name:
            groups["attn"] += n
        else:
            groups["other"] += n  # output, ffn_norm, output_norm
    return groups


def one_run(path: Path, dense: bool, threads: int, n_gen: int, act: str) -> dict[str, float]:
    """Load an engine (activation precision `act`), prefill the prompt, time n_gen greedy decode steps: tok/s,
    share, bytes/token."""
    from powerinfer.runtime.engine import Engine, EngineOptions

    options = EngineOptions(n_ctx=128 + n_gen, n_threads=threads, dense_ffn=dense, act_precision=act)
    engine = Engine(path, options)
    try:
        prompt = engine.tokenizer.encode(PROMPT, add_bos=True)[:128]
        token = int(engine.eval(prompt).argmax())
        stats = engine.sparse_stats
        if stats is not None:
            active0, tokens0 = int(stats.active.sum()), int(stats.tokens.sum())
        t = time.perf_counter()
        for _ in range(n_gen):
            token = int(engine.eval([token]).argmax())
        seconds = time.perf_counter() - t
        share = 1.0
        if stats is not None:
            n_pairs = (int(stats.tokens.sum()) - tokens0) * engine.config.n_ff
            share = (int(stats.active.sum()) - active0) / n_pairs
        g = token_bytes(engine.gguf, engine.config.n_vocab)
        per_token = g["attn"] + g["other"] + (g["pred"] + share * g["ffn"] if not dense else g["ffn"])
        return {"tps": n_gen / seconds, "share": share, "bytes": per_token}
    finally:
        del engine
        gc.collect()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dir",
        type=Path,
        default=Path("/tmp/synthetic-1.1b"),
        help="folder written by make_synthetic_model.py (default /tmp/synthetic-1.1b)",
    )
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument(
        "--files",
        default="f16,q4_0",
        help="comma-separated subset of f16,bf16,q4_0,q4_1,q5_0,q5_1,q8_0,q4_k_m",
    )
    ap.add_argument("--shape", default="1.1b", help="file name infix (synthetic-<shape>...), default 1.1b")
    ap.add_argument(
        "--act",
        choices=("f32", "q8", "both"),
        default="f32",
        help="activation precision of our quant kernels (default f32, exact mode)",
    )
    args = ap.parse_args()
    kinds = [k.strip() for k in args.files.split(",") if k.strip()]
    if not kinds or any(k not in FILES for k in kinds):
        ap.error(f"--files: choose from {sorted(FILES)}")
    paths = {k: args.dir / FILES[k].replace("1.1b", args.shape) for k in kinds}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        print(
            f"missing {', '.join(missing)}; run scripts/make_synthetic_model.py --out {args.dir}",
            file=sys.stderr,
        )
        return 1

    from powerinfer import ops

    acts = ("f32", "q8") if args.act == "both" else (args.act,)
    bw = memory_bandwidth(args.threads)
    print(
        f"threads: {args.threads}, decode: {args.n_gen} tokens after a {len(PROMPT)}-char prompt, "
        f"median of {args.runs} runs (sparse and dense alternate, one engine loaded at a time)"
    )
    print(f"memory read bandwidth (torch sum of 1 GiB, {args.threads} threads): {bw:.1f} GB/s")
    print(
        f"kernels: {'C' if ops.kernels_available() else 'torch reference (extension not built)'}, "
        f"activation precision: {', '.join(acts)}"
    )
    print(
        f"{'file':<36} {'mode':<10} {'tok/s':>8} {'ms/tok':>8} {'active':>7} {'MB/tok':>8} {'GB/s':>7} "
        f"{'of bw':>6}"
    )
    verdicts = []
    for kind, path in paths.items():
        for act in acts:  # each engine builds its kernel context with this precision
            verdicts += bench_file(kind, path, act, args, bw)
    return 0 if all(verdicts) else 2


def bench_file(kind: str, path: Path, act: str, args: argparse.Namespace, bw: float) -> list[bool]:
    """Alternating sparse/dense runs on one file; prints its rows; returns the floor verdict (Q4_0, Q4_K_M)."""
    results: dict[str, list[dict[str, float]]] = {"sparse": [], "dense": []}
    for run in range(args.runs + 1):  # run 0 warms the page cache and is not counted
        for mode in ("sparse", "dense"):
            r = one_run(path, mode == "dense", args.threads, args.n_gen, act)
            if run:
                results[mode].append(r)
    med = {}
    for mode, rs in results.items():
        tps = statistics.median(r["tps"] for r in rs)
        share = statistics.median(r["share"] for r in rs)
        nbytes = statistics.median(r["bytes"] for r in rs)
        med[mode] = tps
        gbs = tps * nbytes / 1e9
        share_txt = f"{share:7.3f}" if mode == "sparse" else f"{'1':>7}"
        print(
            f"{path.name:<36} {mode + ' ' + act:<10} {tps:8.2f} {1e3 / tps:8.1f} {share_txt} "
            f"{nbytes / 1e6:8.1f} {gbs:7.2f} {gbs / bw:6.0%}"
        )
    ratio = med["sparse"] / med["dense"]
    print(f"{path.name:<36} {act:<10} ratio sparse/dense: {ratio:.2f}x")
    floor = FLOORS.get(kind)
    if floor is None:
        return []
    verdict = "met" if ratio >= floor else "NOT met"
    print(f"floor ({kind.upper()}, {act}): sparse >= {floor:.1f}x dense: {verdict} ({ratio:.2f}x)")
    return [ratio >= floor]


if __name__ == "__main__":
    sys.exit(main())
