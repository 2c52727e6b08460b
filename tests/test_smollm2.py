"""The real SmolLM2-135M-Instruct Q4_1 GGUF against transformers loading the same file."""

from __future__ import annotations

import pytest
import torch
from conftest import smollm2_path
from typer.testing import CliRunner

from powerinfer import ops
from powerinfer.cli import app
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sampling import Sampler, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
N_PREDICT = 32


@pytest.fixture(scope="module")
def hf_greedy(hf_model):
    """transformers' greedy continuation of each prompt, with llama.cpp main's default repeat penalty 1.1."""
    tok, model = hf_model
    out = {}
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            gen = model.generate(
                ids,
                max_new_tokens=N_PREDICT,
                do_sample=False,
                repetition_penalty=1.1,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
        out[prompt] = (ids[0].tolist(), gen[0, ids.shape[1] :].tolist())
    return out


@pytest.fixture(scope="module")
def engine():
    return Engine(smollm2_path(), EngineOptions(n_ctx=256, n_threads=2))


@pytest.mark.slow
def test_prefill_logits_close_to_transformers(engine, hf_model):
    tok, model = hf_model
    ids = tok("The capital of France is Paris. It is known for", add_special_tokens=False).input_ids
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    # the torch reference ops compute in float32 on the dequantized weights: equal to transformers
    previous = ops.use_kernels(False)
    try:
        engine.reset()
        exact = engine.logits_all(ids)
    finally:
        ops.use_kernels(previous)
    assert (exact - ref).abs().max().item() < 1e-3
    # the C kernels quantize activations to int8 blocks (as llama.cpp does), which costs a little precision
    engine.reset()
    ours = engine.logits_all(ids)
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel < 0.06, rel
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.slow
def test_greedy_tokens_match_transformers(engine, hf_greedy):
    for prompt in PROMPTS:
        prompt_ids, ref = hf_greedy[prompt]
        assert engine.tokenizer.encode(prompt, add_bos=None) == prompt_ids
        ours = list(engine.generate(prompt_ids, Sampler(SamplingParams(temp=0)), n_predict=N_PREDICT))
        assert ours == ref, prompt


@pytest.mark.slow
def test_cli_main_greedy_text(hf_model, hf_greedy):
    tok, _ = hf_model
    prompt = PROMPTS[0]
    result = CliRunner().invoke(
        app,
        [
            "main",
            "-m",
            str(smollm2_path()),
            "-p",
            prompt,
            "-n",
            str(N_PREDICT),
            "--temp",
            "0",
            "-t",
            "2",
            "-c",
            "256",
        ],
    )
    assert result.exit_code == 0, result.stderr
    expected_text = prompt + tok.decode(hf_greedy[prompt][1], skip_special_tokens=True)
    assert result.stdout.rstrip("\n") == expected_text.rstrip("\n")
    assert "llama_print_timings:        eval time" in result.stderr
