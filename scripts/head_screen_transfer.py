#!/usr/bin/env python3
"""Does the sparse head's screen transfer? Screens calibrated on different texts, scored on texts of other kinds.

For each screen of --screens (calibrated on: --narrow alone, the packaged docstrings alone, the packaged mix alone
(the default model's screen), the narrow text with the mix (what sparsify writes)), perplexity and KL divergence of the sparse head against the whole head on the held-out slices
of the packaged prose, code documentation and dialogue texts and on tests/data/python-reference-prose.txt: windows
of --ctx tokens (BOS first), the second half of each scored, as `powerinfer perplexity` does. The body runs once per
window (q8 activations, as the engine's default); both heads see the same final hidden states.

Usage: python scripts/head_screen_transfer.py [-m MODEL] [--narrow TEXT] [--ctx 256] [--chunks 8] [-t 2]
                                            [--screens mix,narrow+mix] [--widen-mass 0.05]
Without --narrow, the narrow text is Python source code: the standard library modules listed in NARROW_MODULES.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
from pathlib import Path

import torch

from powerinfer import ops
from powerinfer.model.blocks import Head
from powerinfer.model.head import HEAD_CANDIDATES, WIDEN_MASS, SparseHead, build_head_screen
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.head_cache import screen_hidden
from powerinfer.sparsify.default import smollm2_gguf
from powerinfer.texts import HELD_OUT_KINDS, calibration_mix, held_out_text

ROOT = Path(__file__).resolve().parents[1]
NARROW_MODULES = ("heapq", "bisect", "fractions", "textwrap", "shlex", "difflib", "statistics")


def narrow_default() -> str:
    return "\n".join(inspect.getsource(importlib.import_module(m)) for m in NARROW_MODULES)


def windows(engine: Engine, text: str, ctx: int, chunks: int) -> list[list[int]]:
    ids = engine.tokenizer.encode(text, add_bos=False)
    bos, step = engine.tokenizer.bos_id, ctx - 1
    n = min(chunks, len(ids) // step)
    return [[bos] + ids[i * step : (i + 1) * step] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("--narrow", type=Path, default=None)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--screens", default="narrow,docstrings,mix,narrow+mix", help="which screens to score")
    ap.add_argument("--widen-mass", type=float, default=WIDEN_MASS)
    ap.add_argument(
        "--rank", type=int, default=None, help="the screen's rank (default: screen_rank of the width)"
    )
    ap.add_argument(
        "--candidates", type=int, default=HEAD_CANDIDATES, help="rows computed exactly before widening"
    )
    args = ap.parse_args()
    model = args.model or smollm2_gguf()
    narrow = args.narrow.read_text() if args.narrow else narrow_default()
    calib = Engine(
        model, EngineOptions(act_precision="f32", n_ctx=512, sparse_head=False, n_threads=args.threads)
    )
    output = calib.model.head.output
    docstrings = dict(calibration_mix())["docstrings"]
    mix = [t for _, t in calibration_mix()]
    sources = {"narrow": [narrow], "docstrings": [docstrings], "mix": mix, "narrow+mix": [narrow, *mix]}
    sources = {name: sources[name] for name in args.screens.split(",")}
    screens = {
        name: build_head_screen(output, screen_hidden(calib, texts), args.rank)
        for name, texts in sources.items()
    }
    del calib
    engine = Engine(model, EngineOptions(n_ctx=args.ctx, sparse_head=False, n_threads=args.threads))
    head = engine.model.head
    assert isinstance(head, Head)
    kc = engine.kc
    n_vocab, n_embd = head.output.shape
    plain = Head(lambda x: x, head.output, kc)  # type: ignore[arg-type]
    heads = {
        name: SparseHead(
            plain, *s.weights(n_vocab, n_embd), kc, n_candidates=args.candidates, widen_mass=args.widen_mass
        )  # type: ignore[arg-type]
        for name, s in screens.items()
    }
    evals = {k: held_out_text(k) for k in HELD_OUT_KINDS}
    evals["python-reference"] = (ROOT / "tests" / "data" / "python-reference-prose.txt").read_text()
    print(f"| screen calibrated on | {' | '.join(evals)} | widened for spread, for margin, whole |")
    print(f"|---|{'---|' * (len(evals) + 1)}")
    results: dict[str, list[str]] = {name: [] for name in heads}
    for ev_name, text in evals.items():
        nll = {name: 0.0 for name in heads}
        nll_dense, kld = 0.0, {name: 0.0 for name in heads}
        count = 0
        for w in windows(engine, text, args.ctx, args.chunks):
            engine.reset()
            u = engine.step([0] * len(w), w, list(range(len(w))), all_logits=True, hidden=True)
            first = len(w) // 2
            targets = torch.tensor(w[first + 1 :])
            rows = u[first : len(w) - 1].contiguous()
            ref = torch.log_softmax(ops.linear(rows, head.output, kc).double(), -1)
            nll_dense -= float(ref.gather(1, targets[:, None]).sum())
            for name, sh in heads.items():
                lp = torch.log_softmax(sh(rows).double(), -1)
                nll[name] -= float(lp.gather(1, targets[:, None]).sum())
                kld[name] += float((ref.exp() * (ref - lp)).sum())
            count += targets.numel()
        base = math.exp(nll_dense / count)
        for name in heads:
            ppl = math.exp(nll[name] / count)
            results[name].append(f"{ppl:.3f} ({ppl / base - 1:+.2%}, KLD {kld[name] / count:.4f})")
        print(f"# {ev_name}: whole head PPL {base:.3f} over {count} tokens", flush=True)
    for name, cells in results.items():
        st = heads[name].stats
        print(
            f"| {name} | {' | '.join(cells)} | {st.spread / st.tokens:.1%}, {st.widened / st.tokens:.1%}, "
            f"{st.fallbacks / st.tokens:.1%} |"
        )


if __name__ == "__main__":
    main()
