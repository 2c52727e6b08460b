"""The real `openai` client against a live server on SmolLM2 (its GGUF chat template): greedy answers
equal the engine's solo greedy output for the same prompt and template; log-probabilities equal the
engine's; structured output across 4 slots; prompt reuse across the turns of a chat."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import smollm2_path
from server_helpers import live_server, request, sse_events

from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sampling import Sampler, SamplingParams
from powerinfer.server import ServerOptions
from powerinfer.server.chat import ChatFormatter

N = 8


@pytest.fixture(scope="module")
def smol():
    path = smollm2_path()
    openai = pytest.importorskip("openai")
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=256, n_threads=2))
    opts = ServerOptions(
        model=path, engine=EngineOptions(act_precision="f32", n_ctx=512, n_seq=4, n_threads=2), embedding=True
    )
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


def _reference_logprobs(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens (the server's default penalties apply) and the log-softmax of the raw logits each was
    chosen from (prefill, then one token a step)."""
    engine.reset()
    logits = engine.eval(prompt)
    ids: list[int] = []
    rows = []
    sampler = Sampler(SamplingParams(temp=0.0))
    for _ in range(n):
        row = torch.log_softmax(logits.float(), dim=-1)
        ids.append(sampler(logits, prompt + ids))
        rows.append(row)
        logits = engine.eval([ids[-1]])
    return ids, rows


def test_logprobs_equal_the_engines_log_softmax(smol):
    srv, client, engine = smol
    tok = engine.tokenizer
    messages = [{"role": "user", "content": "Name a colour."}]
    ids, rows = _reference_logprobs(engine, ChatFormatter(tok).tokens(messages), 4)
    out = client.chat.completions.create(
        model="x", messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert [bytes(c.bytes) for c in content] == [tok.token_bytes(t) for t in ids]
    for c, t, row in zip(content, ids, rows, strict=True):
        assert abs(c.logprob - float(row[t])) < 1e-4
        best = torch.topk(row, 3)
        assert [bytes(x.bytes) for x in c.top_logprobs] == [tok.token_bytes(i) for i in best.indices.tolist()]
        assert all(
            abs(x.logprob - v) < 1e-4 for x, v in zip(c.top_logprobs, best.values.tolist(), strict=True)
        )
    stream = client.chat.completions.create(
        model="x", messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [
        c
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content
    ]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content, strict=True))

    prompt = "The capital of France is"
    ids, rows = _reference_logprobs(engine, tok.encode(prompt), 3)
    text = client.completions.create(model="x", prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    assert all(abs(a - float(row[t])) < 1e-4 for a, t, row in zip(lp.token_logprobs, ids, rows, strict=True))
    assert len(lp.top_logprobs[0]) == 2 and lp.text_offset[0] == 0
    for stream in (False, True):
        status, body, _ = request(
            srv,
            "POST",
            "/completion",
            {"prompt": prompt, "n_predict": 3, "temperature": 0, "n_probs": 2, "stream": stream},
        )
        assert status == 200
        events = sse_events(body) if stream else [body]
        probs = [p for ev in events for p in ev.get("completion_probabilities", [])]
        assert [p["id"] for p in probs] == ids
        assert all(
            abs(p["logprob"] - float(row[t])) < 1e-4 for p, t, row in zip(probs, ids, rows, strict=True)
        )
        assert [p["top_logprobs"][0]["id"] for p in probs] == ids


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 1, "maximum": 99},
        "colour": {"enum": ["red", "green", "blue"]},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
        "home": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "floor": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["city", "floor"],
        },
    },
    "required": ["name", "age", "colour", "pets", "home"],
}


@pytest.mark.slow
def test_json_schema_answers_from_four_slots_all_validate(smol):
    jsonschema = pytest.importorskip("jsonschema")
    srv, client, engine = smol
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    def ask(i: int) -> str:
        out = client.chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "user", "content": f"Describe person number {i} as JSON."}],
            max_tokens=72,
            temperature=0.7,
            seed=i,
            response_format=fmt,
        )
        assert out.choices[0].finish_reason == "stop"
        return out.choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(20)))
    for answer in answers:
        jsonschema.validate(json.loads(answer), SCHEMA)
    status, body, _ = request(
        srv,
        "POST",
        "/completion",
        {
            "prompt": "Is it raining?",
            "n_predict": 3,
            "response_format": None,
            "json_schema": {"type": "object"},
            "temperature": 0,
        },
    )
    assert status == 200 and body["content"].startswith("{")


def test_gbnf_grammar_and_bad_constraints(smol):
    srv, client, engine = smol
    grammar = 'root ::= ("yes" | "no") (" " [0-9] [0-9]?)?'
    for seed in range(3):
        status, body, _ = request(
            srv,
            "POST",
            "/completion",
            {
                "prompt": "Is the sky blue? Answer:",
                "grammar": grammar,
                "n_predict": 8,
                "temperature": 1.0,
                "seed": seed,
            },
        )
        assert status == 200 and re.fullmatch(r"(yes|no)( [0-9][0-9]?)?", body["content"]), body["content"]
        assert body["stopped_eos"]
    bad = [
        ("/completion", {"prompt": "x", "grammar": "root ::= undefined"}, "grammar"),
        ("/completion", {"prompt": "x", "json_schema": {"type": "no-such-type"}}, "json_schema"),
        ("/completion", {"prompt": "x", "grammar": 'root ::= "a"', "json_schema": {}}, "json_schema"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_schema", "json_schema": {"schema": 3}},
            },
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}},
            "response_format",
        ),
    ]
    for path, payload, field in bad:
        status, body, _ = request(srv, "POST", path, payload)
        assert status == 400 and body["error"]["param"] == field, body


def test_chat_turns_evaluate_only_their_new_tokens(smol):
    srv, client, engine = smol
    formatter = ChatFormatter(engine.tokenizer)
    messages: list[dict[str, str]] = []
    previous = 0
    for turn in range(5):
        messages.append({"role": "user", "content": f"Tell me fact number {turn + 1} about cats."})
        status, body, _ = request(
            srv, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0}
        )
        assert status == 200
        n_prompt = len(formatter.tokens(messages))
        timing = body["timings"]
        assert body["usage"]["prompt_tokens"] == n_prompt
        assert timing["prompt_n"] + timing["cache_n"] == n_prompt
        if turn:  # the previous prompt and answer came from the cache: only this turn's message was evaluated
            assert timing["cache_n"] >= previous and timing["prompt_n"] <= n_prompt - previous
        previous = n_prompt
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    status, again, _ = request(
        srv,
        "POST",
        "/v1/chat/completions",
        {"messages": messages[:-1], "max_tokens": 6, "temperature": 0, "cache_prompt": False},
    )
    assert (
        again["timings"]["prompt_n"] == previous
        and again["choices"][0]["message"] == body["choices"][0]["message"]
    )


def test_embeddings_equal_mean_pooled_transformers_hidden_states(smol, hf_model):
    """hf_model (conftest, shared by the session): transformers' model loaded from the same GGUF; its base
    model's last_hidden_state is the final norm's output."""
    srv, client, engine = smol
    model = hf_model[1].model
    texts = ["The cat sat on the mat.", "Paris is the capital of France"]
    out = client.embeddings.create(model="text-embedding-3-small", input=texts)
    assert [d.index for d in out.data] == [0, 1]
    for text, item in zip(texts, out.data, strict=True):
        ids = engine.tokenizer.encode(text)
        with torch.no_grad():
            want = model(torch.tensor([ids])).last_hidden_state[0].mean(dim=0)
        got = torch.tensor(item.embedding)
        assert abs(float(got.norm()) - 1) < 1e-5
        assert 1 - float(torch.nn.functional.cosine_similarity(got, want, dim=0)) < 1e-4
    status, body, _ = request(srv, "POST", "/embedding", {"content": texts[0]})
    assert status == 200 and torch.allclose(
        torch.tensor(body["embedding"]), torch.tensor(out.data[0].embedding), atol=1e-5
    )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}


def test_tool_calls(smol):
    srv, client, engine = smol
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = client.chat.completions.create(
        model="x", messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=40, temperature=0
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(
        json.loads(call.function.arguments)["city"], str
    )
    stream = client.chat.completions.create(
        model="x",
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    last = chunks[-1]
    assert (
        last.finish_reason == "tool_calls"
        and last.delta.tool_calls[0].function.arguments == call.function.arguments
    )
    assert "".join(c.delta.content or "" for c in chunks) == ""  # the call's text is not streamed as content
    # the call and its result go back into the prompt for the next turn
    follow = client.chat.completions.create(
        model="x",
        messages=[
            *messages,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
        ],
        tools=[WEATHER],
        max_tokens=4,
        temperature=0,
    )
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_call_parsing():
    from powerinfer.server import tools

    content, calls = tools.parse('Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert content == "Sure." and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert tools.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    stream = tools.ContentStream()
    assert [stream.feed(p) for p in ("Hi <", "tool", "_call>{}", "x")] == ["Hi ", "", "", ""]
    assert stream.rest() == "<tool_call>{}x"


@pytest.fixture(scope="module")
def default_file(tmp_path_factory) -> Path:
    """The default model (no -m): the wheel's SmolLM2 with its sparse head's screen, made in a test folder."""
    from powerinfer.sparsify import default as default_mod

    d = default_mod.DefaultModel(src=smollm2_path(), output=tmp_path_factory.mktemp("default") / "head.gguf")
    default_mod.make(d)
    return d.output


@pytest.mark.parametrize("which", ["dense", "default"])
def test_the_same_request_gets_the_same_answer_whatever_else_happens(which, default_file):
    """The same greedy chat request 5 times (the prompt reused from the cache after the first), streamed and
    not, then 8 copies at once on 8 slots: every answer is the first one (the CLI's q8 precision)."""
    path = smollm2_path() if which == "dense" else default_file
    opts = ServerOptions(
        model=path, engine=EngineOptions(n_ctx=512, n_seq=8, n_threads=2, act_precision="q8")
    )
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16, "temperature": 0}

    def ask(stream: bool) -> str:
        status, out, _ = request(srv, "POST", "/v1/chat/completions", {**body, "stream": stream}, timeout=300)
        assert status == 200, out
        if not stream:
            return out["choices"][0]["message"]["content"]
        return "".join(
            e["choices"][0]["delta"].get("content") or ""
            for e in sse_events(out)
            if e != "[DONE]" and e["choices"]
        )

    with live_server(opts) as srv:
        solo = ask(False)
        assert solo.strip()
        assert [ask(i % 2 == 1) for i in range(5)] == [solo] * 5
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(ask, [False, True] * 4)) == [solo] * 8
