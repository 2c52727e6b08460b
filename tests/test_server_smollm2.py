"""The real `openai` client against a live server on SmolLM2 (its GGUF chat template): greedy answers
equal the engine's solo greedy output for the same prompt and template."""

from __future__ import annotations

import pytest
from conftest import smollm2_path
from server_helpers import live_server

from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sampling import Sampler, SamplingParams
from powerinfer.server import ServerOptions
from powerinfer.server.chat import ChatFormatter

N = 8


@pytest.fixture(scope="module")
def smol():
    path = smollm2_path()
    openai = pytest.importorskip("openai")
    engine = Engine(path, EngineOptions(n_ctx=256, n_threads=2))
    opts = ServerOptions(model=path, engine=EngineOptions(n_ctx=256, n_seq=2, n_threads=2))
    with live_server(opts) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        yield srv, client, engine


def _greedy(engine: Engine, prompt: list[int]) -> str:
    ids = list(engine.generate(prompt, Sampler(SamplingParams(temp=0.0)), n_predict=N))
    return engine.tokenizer.decode(ids, strip_leading_space=False)


def test_chat_uses_the_gguf_template_and_matches_the_engine(smol):
    srv, client, engine = smol
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    formatter = ChatFormatter(engine.tokenizer)
    assert not formatter.fallback
    assert formatter.render(messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    want = _greedy(engine, formatter.tokens(messages))
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=N, temperature=0)
    assert out.choices[0].message.content == want and want.strip()
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=N, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want


def test_completion_matches_the_engine(smol):
    srv, client, engine = smol
    prompt = "The capital of France is"
    want = _greedy(engine, engine.tokenizer.encode(prompt))
    out = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt, max_tokens=N, temperature=0
    )
    assert out.choices[0].text == want
    assert out.usage.completion_tokens == N
