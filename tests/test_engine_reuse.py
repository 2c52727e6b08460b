"""Engine pieces the server builds on: hidden states (embeddings) and keeping a sequence's prefix (prompt
reuse), on the tiny random model."""

from __future__ import annotations

import torch
from conftest import random_llama_state, write_llama_gguf

from powerinfer import ops
from powerinfer.runtime.engine import Engine, EngineOptions


def _engine(tmp_path) -> Engine:
    path = write_llama_gguf(
        tmp_path / "m.gguf", random_llama_state(n_head_kv=2, seed=5), n_head=4, n_head_kv=2
    )
    return Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_batch=4, n_seq=2, n_threads=1))


def test_hidden_states_are_what_the_head_projects_and_keep_reuses_a_prefix(tmp_path):
    e = _engine(tmp_path)
    tokens = [1, 17, 33, 9, 120, 5, 77, 200, 3, 41]
    logits = e.logits_all(tokens)  # sequence 0, one token a row
    hidden = e.hidden_states(1, tokens)  # sequence 1, in chunks of n_batch
    assert hidden.shape == (len(tokens), e.config.n_embd) and e.kv.n_past[1] == len(tokens)
    head = e.model.head
    torch.testing.assert_close(ops.linear(hidden, head.output, head.kc), logits, atol=1e-4, rtol=1e-4)
    # sequence 1 freed, then its first 6 positions kept: evaluating the rest gives the full prompt's logits
    e.free(1)
    e.keep(1, 6)
    last = e.prefill(1, tokens[6:], 6)
    torch.testing.assert_close(last, logits[-1], atol=1e-4, rtol=1e-4)
