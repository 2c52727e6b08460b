#!/usr/bin/env python3
"""MoE prompt and decode speed, ours side by side with llama.cpp in one run (issue 34).

On the synthetic Qwen3-MoE-shaped and SmallThinker-shaped Q4_0 files of scripts/make_synthetic_moe.py (`bench`
shape: 24 layers, n_embd 1024, 64 experts of 512, top 8; written into --dir when missing), at each thread count:
repetitions alternate ours / llama.cpp (each a prompt of --n-prompt tokens from an empty cache, then --n-gen greedy
decode steps), and the medians are compared. Also printed: the weight bytes one decoded token reads (the k selected
experts' rows, every other tensor whole except the embedding table, of which one row) and the GB/s that makes at
each side's decode speed, against the machine's read bandwidth measured here (a sum over a 512 MiB buffer).

llama.cpp runs through llama-cpp-python in a subprocess of the Python given by --llama-python (default: this
interpreter when it can import llama_cpp; 0.3.16 knows qwen3moe and smallthinker), so it may live in its own venv.

Usage: python scripts/bench_moe.py [--dir DIR | -m FILE ...] [-t 1,2] [-r 5] [--n-prompt 64] [--n-gen 32]
                                   [--llama-python PYTHON] [--no-llama-cpp]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def prompt_tokens(n_vocab: int, n: int) -> list[int]:
    # a fixed, deterministic token sequence away from the special ids (powerinfer.bench.prompt_tokens)
    low = min(1000, n_vocab // 2)
    return [(low + 7919 * i) % (n_vocab - low) + low for i in range(n)]


# ---- the llama.cpp side (run as a worker process: one JSON request per line on stdin, one answer per line) ----


def llama_worker(model: str, threads: int, n_ctx: int) -> int:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(
        model_path=model, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
        n_gpu_layers=0, verbose=False, logits_all=False,
    )  # fmt: skip
    n_vocab = llm.n_vocab()
    print(json.dumps({"ready": True, "n_vocab": n_vocab}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        tokens = prompt_tokens(n_vocab, req["n_prompt"])
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(tokens)
        pp = time.perf_counter() - t0
        token = int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).argmax())
        t0 = time.perf_counter()
        for _ in range(req["n_gen"]):
            llm.eval([token])
            token = int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,)).argmax())
        tg = time.perf_counter() - t0
        print(json.dumps({"pp": pp, "tg": tg}), flush=True)
    return 0


class LlamaCpp:
    """A llama.cpp worker process holding one model at one thread count."""

    def __init__(self, python: str, model: Path, threads: int, n_ctx: int) -> None:
        cmd = [python, str(Path(__file__).resolve()), "--llama-worker", str(model), str(threads), str(n_ctx)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._read()
        self.pause()

    def pause(self) -> None:
        """Stop the worker between its runs: its idle threads must not take cycles from our side's runs."""
        self.proc.send_signal(signal.SIGSTOP)

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the llama.cpp worker exited (see its error above)")
        return json.loads(line)

    def run(self, n_prompt: int, n_gen: int) -> tuple[float, float]:
        assert self.proc.stdin is not None
        self.proc.send_signal(signal.SIGCONT)
        self.proc.stdin.write(json.dumps({"n_prompt": n_prompt, "n_gen": n_gen}) + "\n")
        self.proc.stdin.flush()
        r = self._read()
        self.pause()
        return r["pp"], r["tg"]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.send_signal(signal.SIGCONT)
        self.proc.stdin.close()
        self.proc.wait()


# ---- our side ----


class Ours:
    def __init__(self, model: Path, threads: int, n_ctx: int) -> None:
        from powerinfer.runtime.engine import Engine, EngineOptions

        # int8 activation blocks (the CLI's default, llama.cpp's arithmetic); a fixed thread count, as llama.cpp's:
        # the governor would read the llama.cpp worker's last moments as load and start a step on fewer threads
        options = EngineOptions(
            n_ctx=n_ctx, n_batch=512, n_threads=threads, act_precision="q8", fixed_threads=True
        )
        self.engine = Engine(model, options)
        self.engine.eval(prompt_tokens(self.engine.config.n_vocab, 8))  # page cache, thread pool

    def run(self, n_prompt: int, n_gen: int) -> tuple[float, float]:
        engine = self.engine
        tokens = prompt_tokens(engine.config.n_vocab, n_prompt)
        engine.reset()
        t0 = time.perf_counter()
        token = int(engine.eval(tokens).argmax())
        pp = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(n_gen):
            token = int(engine.eval([token]).argmax())
        return pp, time.perf_counter() - t0

    def bytes_per_token(self) -> float:
        """Weight bytes a decoded token reads: the engine's count (k of n_expert experts' rows, other tensors
        whole), less the embedding table but one row when the file has its own output matrix."""
        engine = self.engine
        per_token = engine.read_bytes_per_token()
        tensors = engine.gguf.tensors
        embd = tensors.get("token_embd.weight")
        if embd is not None and "output.weight" in tensors:
            per_token -= embd.n_bytes * (1.0 - 1.0 / engine.config.n_vocab)
        return per_token


def read_bandwidth(threads: int) -> float:
    """GB/s of a sum over a 512 MiB float32 buffer at `threads` (best of 5)."""
    import torch

    torch.set_num_threads(threads)
    buf = torch.ones(128 * 2**20, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def llama_python(given: str | None) -> str | None:
    if given:
        return given
    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None


def bench_files(directory: Path) -> list[Path]:
    spec = importlib.util.spec_from_file_location("make_synthetic_moe", HERE / "make_synthetic_moe.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_synthetic_moe"] = mod
    spec.loader.exec_module(mod)
    archs = ("qwen3moe", "smallthinker")
    paths = [directory / mod.filename(a, "bench", "q4_0") for a in archs]
    missing = [a for a, p in zip(archs, paths, strict=True) if not p.exists()]
    if missing:
        print(f"writing the bench files of {', '.join(missing)} into {directory} ...", flush=True)
        mod.generate(directory, missing, "bench", ["q4_0"])
    return paths


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--llama-worker":
        return llama_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("moe-bench"), help="folder of the bench files")
    ap.add_argument("-m", "--model", type=Path, action="append", help="a MoE GGUF file instead (repeatable)")
    ap.add_argument("-t", "--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("-r", "--runs", type=int, default=5, help="repetitions per side (medians)")
    ap.add_argument("--n-prompt", type=int, default=64)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--llama-python", help="a Python that imports llama_cpp (default: this one, if it can)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    models = args.model or bench_files(args.dir)
    python = None if args.no_llama_cpp else llama_python(args.llama_python)
    if python is None and not args.no_llama_cpp:
        print("llama_cpp is not importable here: pass --llama-python, or --no-llama-cpp", file=sys.stderr)
        return 1
    n_ctx = args.n_prompt + args.n_gen + 8
    with open("/proc/loadavg", encoding="ascii") as f:
        load = f.read().split()[0]
    print(
        f"prompt {args.n_prompt} tokens, decode {args.n_gen} tokens, medians of {args.runs} alternating runs, "
        f"load average at start {load}"
    )
    header = (
        f"{'model':<34} {'t':>2} | {'pp ours':>8} {'pp llama':>8} {'ratio':>6} | {'tg ours':>8} {'tg llama':>8} "
        f"{'ratio':>6} | {'MB/tok':>7} {'GB/s ours':>9} {'GB/s llama':>10} {'GB/s mem':>8}"
    )
    print(header)
    print("-" * len(header))
    for model in models:
        for t in threads:
            bandwidth = read_bandwidth(t)
            ours = Ours(model, t, n_ctx)
            llama = None if python is None else LlamaCpp(python, model, t, n_ctx)
            samples: dict[str, list[float]] = {"pp": [], "tg": [], "lpp": [], "ltg": []}
            for _ in range(args.runs):
                pp, tg = ours.run(args.n_prompt, args.n_gen)
                samples["pp"].append(args.n_prompt / pp)
                samples["tg"].append(args.n_gen / tg)
                if llama is not None:
                    pp, tg = llama.run(args.n_prompt, args.n_gen)
                    samples["lpp"].append(args.n_prompt / pp)
                    samples["ltg"].append(args.n_gen / tg)
            if llama is not None:
                llama.close()
            med = {k: statistics.median(v) if v else float("nan") for k, v in samples.items()}
            per_token = ours.bytes_per_token()
            del ours
            print(
                f"{model.name:<34} {t:>2} | {med['pp']:>8.1f} {med['lpp']:>8.1f} {med['pp'] / med['lpp']:>6.2f} | "
                f"{med['tg']:>8.1f} {med['ltg']:>8.1f} {med['tg'] / med['ltg']:>6.2f} | {per_token / 1e6:>7.1f} "
                f"{per_token * med['tg'] / 1e9:>9.2f} {per_token * med['ltg'] / 1e9:>10.2f} {bandwidth:>8.1f}",
                flush=True,
            )
    with open("/proc/loadavg", encoding="ascii") as f:
        print(f"load average at the end {f.read().split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
