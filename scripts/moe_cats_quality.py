#!/usr/bin/env python3
"""What per-expert CATS costs a MoE file: `powerinfer sparsify` at each S, then perplexity, KL divergence and top-1
agreement against the dense file on held-out text (windows of --ctx tokens, the second half of each scored), and
the share of the selected experts' neurons active and of their up rows read over one-token decode steps.

Usage: python scripts/moe_cats_quality.py -m MOE.gguf [-f CALIBRATION] [--heldout TEXT] [--sparsity 0,0.3,0.5]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from powerinfer.profile.collect import tokenize_corpus
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sparsify import SparsifyOptions, run_sparsify

REPO = Path(__file__).resolve().parents[1]


def windows(engine: Engine, text: str, n_ctx: int, n_windows: int) -> list[list[int]]:
    ids = tokenize_corpus(engine, text)
    bos = engine.tokenizer.bos_id
    step = n_ctx - 1
    return [[bos, *ids[i : i + step]] for i in range(0, len(ids) - step, step)][:n_windows]


def score(engine: Engine, dense: Engine, wins: list[list[int]]) -> dict[str, float]:
    """Perplexity of `engine`, its mean KL divergence from `dense` and top-1 agreement, second halves scored."""
    nll = kld = agree = n = 0.0
    for w in wins:
        engine.reset()
        half = len(w) // 2
        lp = torch.log_softmax(engine.logits_all(w).double(), -1)[half:-1]
        dense.reset()
        lq = lp if dense is engine else torch.log_softmax(dense.logits_all(w).double(), -1)[half:-1]
        target = torch.tensor(w[half + 1 :])
        nll -= float(lp.gather(-1, target[:, None]).sum())
        kld += float((lq.exp() * (lq - lp)).sum())
        agree += float((lp.argmax(-1) == lq.argmax(-1)).sum())
        n += len(target)
    return {"ppl": float(torch.tensor(nll / n).exp()), "kld": kld / n, "top1": agree / n}


def decode_shares(engine: Engine, ids: list[int]) -> tuple[float, float]:
    """(active, up rows read) shares of the selected experts' neurons over one-token steps of ids."""
    engine.reset()
    for t in ids:
        engine.eval([t])
    counts = [la.ffn.experts.kernel.counts for la in engine.model.layers]
    active, read, total = (int(v) for v in sum(counts))
    return active / total, read / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", type=Path, required=True)
    p.add_argument("-f", "--calibration", type=Path, default=REPO / "powerinfer" / "data" / "calibration.txt")
    p.add_argument("--heldout", type=Path, default=REPO / "tests" / "data" / "python-reference-prose.txt")
    p.add_argument("--sparsity", default="0,0.3,0.5")
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("-t", "--threads", type=int, default=1)
    args = p.parse_args()
    opts = EngineOptions(n_ctx=args.ctx, n_threads=args.threads)
    dense = Engine(args.model, opts)
    wins = windows(dense, args.heldout.read_text(), args.ctx, args.windows)
    print(json.dumps({"S": "dense", **score(dense, dense, wins)}))
    with tempfile.TemporaryDirectory() as tmp:
        for s in (float(v) for v in args.sparsity.split(",")):
            out = Path(tmp) / f"s{s}.gguf"
            run_sparsify(
                SparsifyOptions(
                    model=args.model,
                    corpus=args.calibration,
                    output=out,
                    sparsity=s,
                    n_ctx=args.ctx,
                    n_threads=args.threads,
                    max_tokens=args.max_tokens,
                )
            )
            engine = Engine(out, opts)
            row = score(engine, dense, wins)
            active, read = decode_shares(engine, wins[0])
            print(json.dumps({"S": s, **row, "active": active, "up_read": read}))


if __name__ == "__main__":
    main()
