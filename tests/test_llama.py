"""Llama forward vs transformers' LlamaForCausalLM on the same weights (written by our GGUF writer)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hf_llama, write_hf_llama_gguf

from powerinfer.gguf import GGMLType
from powerinfer.runtime.engine import Engine, EngineOptions

CASES = [
    # (n_head, n_head_kv, activation, weight type)
    (4, 4, "silu", GGMLType.F32),
    (4, 2, "silu", GGMLType.F32),
    (4, 1, "relu", GGMLType.F32),
    (4, 4, "relu", GGMLType.F16),
    (8, 2, "silu", GGMLType.F16),
]


@pytest.mark.parametrize(("n_head", "n_head_kv", "act", "dtype"), CASES)
def test_logits_match_transformers(tmp_path, n_head, n_head_kv, act, dtype):
    hf = tiny_hf_llama(
        n_head=n_head,
        n_head_kv=n_head_kv,
        act=act,
        seed=n_head * 10 + n_head_kv,
        fp16_values=dtype == GGMLType.F16,
    )
    path = write_hf_llama_gguf(hf, tmp_path / "tiny.gguf", dtype, act=act)
    tokens = torch.randint(
        0, hf.config.vocab_size, (24,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]

    # full sequence in one pass, then in prompt chunks of 5
    for n_batch in (512, 5):
        engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_batch=n_batch, n_threads=2))
        ours = engine.logits_all(tokens)
        assert ours.shape == ref.shape
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-4, f"n_batch={n_batch}: max abs diff {diff}"

    # token-by-token decode through the KV cache
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1))
    step = torch.stack([engine.eval([t]) for t in tokens])
    diff = (step - ref).abs().max().item()
    assert diff <= 1e-4, f"decode: max abs diff {diff}"
    assert engine.n_past == len(tokens)


def test_prefill_then_decode_matches_full(tmp_path):
    hf = tiny_hf_llama(n_head=4, n_head_kv=2, seed=3)
    path = write_hf_llama_gguf(hf, tmp_path / "tiny.gguf")
    tokens = list(range(5, 25))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=32, n_threads=2))
    last = engine.eval(tokens[:12])
    torch.testing.assert_close(last, ref[11], atol=1e-4, rtol=0)
    for i in range(12, 20):
        torch.testing.assert_close(engine.eval([tokens[i]]), ref[i], atol=1e-4, rtol=0)
