"""K-quant and IQ4 mixes of the real SmolLM2 made by our quantize: run against transformers, made against
llama.cpp's quantize.

SmolLM2 (n_embd 576, not a multiple of 256) exercises the mixes' fallbacks: its attention and gate/up matrices
fall back to 32-element types, its ffn_down matrices (rows of 1536) take the K-quant / IQ4 types, output.weight
(tied to token_embd) Q8_0.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import smollm2_path

from powerinfer.eval import PerplexityOptions, perplexity, plan_chunks, tokenize_text
from powerinfer.gguf import GGMLType, read_gguf
from powerinfer.quantize import QuantizeOptions, quantize_model, require_file_type
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sampling import Sampler, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
N_PREDICT = 32
TEXT = Path(__file__).parent / "data" / "python-reference-prose.txt"
# perplexity (f32 activations, -c 256, 2 chunks) vs transformers on the same file: measured +2.5e-7 (Q4_K_M) and
# +3.8e-7 (IQ4_XS) relative over 4 chunks (AVX2 kernels); the bound is 2.5x the larger. q8 activations miss it
# by >1000x (SmolLM2 Q4_1: 4e-3).
PPL_REL_F32 = 1e-6


@pytest.fixture(scope="module")
def smollm2_f32(tmp_path_factory) -> Path:
    """SmolLM2 converted to F32 by our quantize (from the wheel's Q4_1 file): the source of every mix."""
    out = tmp_path_factory.mktemp("f32") / "smollm2-f32.gguf"
    opts = QuantizeOptions(smollm2_path(), out, require_file_type("F32"), n_threads=2, allow_requantize=True)
    quantize_model(opts)
    return out


def _mix(src: Path, folder: Path, name: str) -> Path:
    path = folder / name / f"{name}.gguf"
    path.parent.mkdir(parents=True)
    quantize_model(QuantizeOptions(src, path, require_file_type(name), n_threads=2))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "mix", ["Q4_K_M"]
)  # IQ4_XS measured the same (scripts/compare_kquant_transformers.py)
def test_mix_runs_as_transformers_does(smollm2_f32, tmp_path, mix):
    """Greedy ids (3 prompts x 32 tokens, f32 activations) equal transformers' on the same file (which decodes
    K-quant and IQ4 blocks with the gguf package); perplexity within PPL_REL_F32 of transformers'."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = _mix(smollm2_f32, tmp_path, mix)
    types = {t.ggml_type for t in read_gguf(path).tensors.values()}
    want = {GGMLType.Q4_K, GGMLType.Q6_K} if mix == "Q4_K_M" else {GGMLType.IQ4_XS, GGMLType.IQ4_NL}
    assert want <= types
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    engine = Engine(path, EngineOptions(n_ctx=256, n_batch=256, n_threads=2, act_precision="f32"))
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            gen = hf.generate(
                ids,
                max_new_tokens=N_PREDICT,
                do_sample=False,
                repetition_penalty=1.1,  # llama.cpp main's default, which our Sampler applies
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
        ref = gen[0, ids.shape[1] :].tolist()
        engine.reset()
        ours = list(engine.generate(ids[0].tolist(), Sampler(SamplingParams(temp=0)), n_predict=N_PREDICT))
        assert ours == ref, prompt
    engine.reset()
    tokens = tokenize_text(engine, TEXT.read_text(encoding="utf-8").removesuffix("\n"))
    opts = PerplexityOptions(n_ctx=256, n_chunks=2)
    ppl = perplexity(engine, tokens, opts).ppl
    nll, count = 0.0, 0
    with torch.inference_mode():
        for ch in plan_chunks(tokens, opts, engine.tokenizer.bos_id if engine.tokenizer.add_bos else None):
            logits = hf(torch.tensor([ch.tokens])).logits[0, ch.first : ch.first + len(ch.targets)]
            logp = torch.log_softmax(logits.double(), dim=-1)
            nll -= float(logp.gather(1, torch.tensor(ch.targets)[:, None]).sum())
            count += len(ch.targets)
    assert abs(ppl / float(np.exp(nll / count)) - 1) < PPL_REL_F32


def _llama_cpp():
    """llama-cpp-python's module when it is installed and importable (a peer for comparisons, never a dependency)."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    try:
        import llama_cpp
    except ImportError as e:  # installed without its own dependencies
        pytest.skip(f"llama_cpp cannot be imported: {e}")
    return llama_cpp


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q3_K_M", "IQ4_XS"])
def test_mix_bytes_equal_llama_cpp_quantize(smollm2_f32, tmp_path, mix):
    """The same F32 file quantized by llama.cpp's llama_model_quantize (llama-cpp-python, when installed): every
    tensor in the same type with the same bytes (measured: 272/272 for all 11 mixes on SmolLM2, and 201/201 on the
    TinyLlama-1.1B shape for Q2_K, Q3_K_M, Q4_K_S, Q4_K_M, Q5_K_M, Q6_K and IQ4_XS)."""
    llama_cpp = _llama_cpp()
    ours = _mix(smollm2_f32, tmp_path, mix)
    theirs = tmp_path / f"llama.{mix}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 2
    params.ftype = require_file_type(mix).ftype
    assert (
        llama_cpp.llama_model_quantize(str(smollm2_f32).encode(), str(theirs).encode(), ctypes.byref(params))
        == 0
    )
    a, b = read_gguf(ours), read_gguf(theirs)
    assert set(a.tensors) == set(b.tensors)
    for name, ta in a.tensors.items():
        tb = b.tensors[name]
        assert ta.ggml_type == tb.ggml_type, name
        assert np.array_equal(np.asarray(ta.data).view(np.uint8), np.asarray(tb.data).view(np.uint8)), name
