"""PowerInfer's fixture in sparse mode: our predictor-driven FFN reproduces the original's greedy output and the
fixture's predicted-active shares, on the CPU alone and with the original GPU index's neurons in a CPU pool."""

from __future__ import annotations

import json
import re

import pytest
from conftest import fixture_dir

from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sampling import Sampler, SamplingParams

MODELS = {"f16": "tiny.powerinfer.gguf", "q4_0": "tiny.q4.powerinfer.gguf"}
GPU_INDEX = "tiny.powerinfer.gguf.generated.gpuidx"  # PowerInfer's solver: 320/256/128/64 neurons (README 3)


@pytest.fixture(scope="module")
def expected():
    return json.loads((fixture_dir() / "expected.json").read_text())


def _engine(model: str, split: bool, n_ctx: int = 256) -> Engine:
    d = fixture_dir()
    opts = EngineOptions(act_precision="f32", n_ctx=n_ctx, n_threads=1)
    if split:
        opts = EngineOptions(
            act_precision="f32",
            n_ctx=n_ctx,
            n_threads=1,
            pool_device="cpu",
            gpu_index_path=str(d / GPU_INDEX),
        )
    return Engine(d / MODELS[model], opts)


def _report(engine: Engine) -> tuple[list[float], float]:
    """Per-layer predicted-active shares and the share served by the pool (%), from the sparse report."""
    text = "\n".join(engine.sparse_report())
    per_layer = re.search(r"per layer: ([\d. ]+)$", text, re.M)
    pool = re.search(r"([\d.]+)% of active neurons served by the pool", text)
    assert per_layer and pool, text
    return [float(v) for v in per_layer.group(1).split()], float(pool.group(1))


@pytest.mark.parametrize("split", [False, True], ids=["all-cpu", "split"])
@pytest.mark.parametrize("model", ["f16", "q4_0"])
def test_greedy_matches_original_server(expected, model, split):
    """Pure-greedy /completion continuations (n_predict 8 -> 9 tokens) of the original -t 1 server."""
    engine = _engine(model, split)
    tok = engine.tokenizer
    for case in expected["server_t1"][model]["completion_stream_no_penalty"]:
        prompt = case["request"]["prompt"]
        ids = [tok.bos_id] + tok.encode(prompt, add_bos=False)
        out = list(engine.generate(ids, Sampler(SamplingParams(temp=0, repeat_penalty=1.0)), n_predict=9))
        pieces = [tok.decode([t], strip_leading_space=False) for t in out]
        assert "".join(pieces) == case["content"], (model, prompt, pieces)
    _, pool = _report(engine)
    # share of the predicted-active neurons that the pool served over these three prompts: measured 42.8 % (f16)
    # and 42.4 % (q4_0) with the original index (768 of 2048 neurons, the hottest); all on the CPU without one.
    # Bound: 2 units of the printed 0.1 %; an index holding every neuron gives 100 %
    assert pool == (pytest.approx({"f16": 42.8, "q4_0": 42.4}[model], abs=0.2) if split else 0.0)


@pytest.mark.parametrize("split", [False, True], ids=["all-cpu", "split"])
def test_predicted_active_shares_match_readme(expected, split):
    """Over the 33 perplexity chunks of text.txt (2112 tokens) the predictor marks the share of neurons per layer
    that the fixture README (section 2) gives: 0.5578 0.5114 0.4363 0.383; placing neurons in a pool changes none."""
    engine = _engine("f16", split, n_ctx=64)
    tokens = [1] + expected["perplexity_tokens"]
    for i in range(len(tokens) // 64):
        chunk = tokens[i * 64 : (i + 1) * 64]
        chunk[0] = 1
        engine.reset()
        engine.logits_all(chunk)
    shares, pool = _report(engine)
    # the report prints 2 decimals: the README's values rounded to 2 decimals, exactly (ours, unrounded, are
    # within 7.4e-5 of README's; the 4-decimal comparison is test_perplexity::test_fixture_kl_divergence_report)
    assert shares == [round(v, 2) for v in (0.5578, 0.5114, 0.4363, 0.383)] == [0.56, 0.51, 0.44, 0.38]
    # measured 44.0 % served by the pool with the original index; 2 printed units
    assert pool == (pytest.approx(44.0, abs=0.2) if split else 0.0)
