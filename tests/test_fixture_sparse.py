"""PowerInfer's fixture in sparse mode: our predictor-driven FFN reproduces the original's greedy output."""

from __future__ import annotations

import json

import pytest
from conftest import fixture_dir

from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sampling import Sampler, SamplingParams

MODELS = {"f16": "tiny.powerinfer.gguf", "q4_0": "tiny.q4.powerinfer.gguf"}
GPU_INDEX = "tiny.powerinfer.gguf.generated.gpuidx"


@pytest.fixture(scope="module")
def expected():
    return json.loads((fixture_dir() / "expected.json").read_text())


def _engine(model: str, split: bool) -> Engine:
    d = fixture_dir()
    opts = EngineOptions(n_ctx=256, n_threads=1)
    if split:
        opts = EngineOptions(n_ctx=256, n_threads=1, pool_device="cpu", gpu_index_path=str(d / GPU_INDEX))
    return Engine(d / MODELS[model], opts)


@pytest.mark.parametrize("split", [False, True], ids=["all-cpu", "split"])
@pytest.mark.parametrize("model", ["f16", "q4_0"])
def test_greedy_matches_original_server(expected, model, split):
    """Pure-greedy /completion continuations (n_predict 8 -> 9 tokens) of the original -t 1 server."""
    engine = _engine(model, split)
    assert engine.sparse_stats is not None
    if split:
        hot = [ffn.hot.ids.numel() for ffn in engine.model.ffns]
        assert hot == [320, 256, 128, 64]
    tok = engine.tokenizer
    for case in expected["server_t1"][model]["completion_stream_no_penalty"]:
        prompt = case["request"]["prompt"]
        ids = [tok.bos_id] + tok.encode(prompt, add_bos=False)
        out = list(engine.generate(ids, Sampler(SamplingParams(temp=0, repeat_penalty=1.0)), n_predict=9))
        pieces = [tok.decode([t], strip_leading_space=False) for t in out]
        assert "".join(pieces) == case["content"], (model, prompt, pieces)
    stats = engine.sparse_stats
    assert int(stats.tokens.sum()) > 0
    share = stats.active.sum().item() / (stats.tokens.sum().item() * engine.config.n_ff)
    assert 0.2 < share < 0.8  # the fixture's predictors mark about 40-55 % of neurons active
    if split:
        assert int(stats.active_gpu.sum()) > 0
