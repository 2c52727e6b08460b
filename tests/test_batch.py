"""Batched decoding equals decoding each sequence alone."""

from __future__ import annotations

import pytest
import torch
from conftest import random_llama_state, random_predictors, write_llama_gguf

from powerinfer.runtime.engine import Engine, EngineOptions

PROMPTS = [[1, 5, 9, 33], [1, 200, 7], [1, 42, 42, 42, 42, 17], [1, 3]]


def _greedy_alone(path, prompt, n):
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1))
    logits = engine.eval(prompt)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = engine.eval([out[-1]])
    return out


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_batched_greedy_equals_solo(tmp_path, sparse):
    sd = random_llama_state(n_head=4, n_head_kv=2, n_ff=128, seed=5)
    extra = {"predictors": random_predictors(sd), "threshold": 0.0} if sparse else {}
    path = write_llama_gguf(tmp_path / "m.gguf", sd, n_head=4, n_head_kv=2, act="relu", **extra)
    n = 10
    want = [_greedy_alone(path, p, n) for p in PROMPTS]
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2, n_seq=4))
    batch = engine
    last = [int(batch.prefill(slot, p).argmax()) for slot, p in enumerate(PROMPTS)]
    got = [[t] for t in last]
    for _ in range(n - 1):
        logits = batch.decode([0, 1, 2, 3], last)
        last = [int(x) for x in logits.argmax(-1)]
        for seq, t in zip(got, last, strict=False):
            seq.append(t)
    assert got == want
    # a slot can be freed and reused while others continue
    batch.free(1)
    torch.testing.assert_close(
        batch.prefill(1, PROMPTS[1]),
        Engine(path, EngineOptions(act_precision="f32", n_ctx=64)).eval(PROMPTS[1]),
        atol=1e-4,
        rtol=0,
    )
