#!/usr/bin/env python3
"""Time quantizing one matrix to Q2_K..Q6_K, IQ4_NL and IQ4_XS: ours (pi_quantize_rows) and llama.cpp's.

llama.cpp's side is ggml_quantize_chunk of llama-cpp-python's ggml-base (imatrix NULL), on 1 thread or split
into row chunks over Python threads (ctypes drops the GIL), as llama.cpp's `quantize` tool splits a tensor over
its threads. Both sides also check that their blocks are equal. Prints seconds (median of --repeat) per type.

Usage: python scripts/bench_kquant_quantize.py [--rows 2048] [--cols 5632] [--threads 1,2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from powerinfer.ops.encode import quantize
from powerinfer.quant import C_QUANTIZABLE, row_bytes


def llama_cpp_quantizer():
    """make_kquant_golden.ggml_quantizer (its llama.cpp oracle), or None without llama-cpp-python."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    spec = importlib.util.spec_from_file_location(
        "make_kquant_golden", Path(__file__).with_name("make_kquant_golden.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ggml_quantizer()


def chunked(fn, x: np.ndarray, n_threads: int) -> np.ndarray:
    """fn over n_threads row chunks of x in parallel, concatenated."""
    if n_threads == 1:
        return fn(x)
    parts = np.array_split(x, n_threads)
    with ThreadPoolExecutor(n_threads) as pool:
        return np.concatenate(list(pool.map(fn, parts)))


def timed(fn, repeat: int, *args) -> tuple[float, np.ndarray]:
    """(median seconds of fn(*args) over `repeat` runs, its last result)"""
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def ours(x: np.ndarray, ggml_type, n_threads: int) -> np.ndarray:
    return quantize(x, ggml_type, n_threads=n_threads)


def theirs(oracle, x: np.ndarray, ggml_type, n_threads: int) -> np.ndarray:
    return chunked(functools.partial(oracle, ggml_type), x, n_threads)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=5632)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    x = (np.random.default_rng(0).standard_normal((args.rows, args.cols)) * 0.02).astype(np.float32)
    oracle = llama_cpp_quantizer()
    quantize(x[:1], sorted(C_QUANTIZABLE)[0])  # load the kernels outside the timings
    header = "type    " + "".join(f"  ours -t{t}  llama.cpp -t{t}" for t in threads)
    print(f"{args.rows} x {args.cols} float32, seconds (median of {args.repeat})\n{header}")
    for ggml_type in sorted(C_QUANTIZABLE):
        row_bytes(ggml_type, args.cols)
        cells = []
        for n_threads in threads:
            ours_s, blocks = timed(ours, args.repeat, x, ggml_type, n_threads)
            theirs_s = float("nan")
            if oracle is not None:
                theirs_s, want = timed(theirs, args.repeat, oracle, x, ggml_type, n_threads)
                assert np.array_equal(blocks, want), f"{ggml_type.name}: blocks differ from llama.cpp's"
            cells.append(f"  {ours_s:10.3f}  {theirs_s:13.3f}")
        print(f"{ggml_type.name:8}" + "".join(cells), flush=True)


if __name__ == "__main__":
    main()
