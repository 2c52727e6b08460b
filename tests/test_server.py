"""`powerinfer server` against a live uvicorn on 127.0.0.1: the OpenAI client, llama.cpp endpoints, continuous
batching under concurrent load, and the robustness cases (each answer's status and error body, then a good
request still works)."""

from __future__ import annotations

import asyncio
import http.client
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import random_llama_state, write_llama_gguf
from server_helpers import live_server, request, sse_events

from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.generate import _stop_holdback
from powerinfer.sampling import Sampler, SamplingParams
from powerinfer.server import ServerOptions
from powerinfer.server.chat import ChatFormatter

N_CTX = 128
GREEDY = SamplingParams(temp=0.0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("server") / "tiny.gguf"
    return write_llama_gguf(path, random_llama_state(n_head_kv=2, seed=3), n_head=4, n_head_kv=2)


@pytest.fixture(scope="module")
def live(tiny_model: Path):
    opts = ServerOptions(
        model=tiny_model,
        engine=EngineOptions(act_precision="f32", n_ctx=N_CTX, n_seq=4, n_threads=1),
        alias="tiny",
        max_queue=16,
        max_body_bytes=64 * 1024,
    )
    with live_server(opts) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_model: Path):
    """Solo greedy generation with the plain Engine: (prompt ids, n) -> (token ids, text)."""
    engine = Engine(tiny_model, EngineOptions(act_precision="f32", n_ctx=N_CTX, n_threads=1))

    def run(prompt: list[int], n: int, stop: tuple[str, ...] = ()) -> tuple[list[int], str]:
        ids = list(engine.generate(prompt, Sampler(GREEDY), n_predict=n))
        text = engine.tokenizer.decode(ids, strip_leading_space=False)
        for s in stop:
            if s in text:
                text = text[: text.index(s)]
        return ids, text

    run.tokenizer = engine.tokenizer  # type: ignore[attr-defined]
    return run


def _client(live):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)


# ---------------------------------------------------------------------- OpenAI client
def test_openai_models_and_completions(live, reference):
    client = _client(live)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    prompt = "Hello there"
    ids, text = reference(reference.tokenizer.encode(prompt), 12)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == text
    assert out.usage.completion_tokens == len(ids)
    assert out.usage.prompt_tokens == len(reference.tokenizer.encode(prompt))
    assert out.choices[0].finish_reason == ("length" if len(ids) == 12 else "stop")
    streamed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text


def test_openai_chat_streamed_and_not(live, reference):
    client = _client(live)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    formatter = ChatFormatter(reference.tokenizer)
    assert formatter.fallback  # the tiny model has no template: ChatML
    assert formatter.render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        "What is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids, text = reference(formatter.tokens(messages), 10, stop=("<|im_end|>",))
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == text
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == out.choices[0].finish_reason


def test_any_model_name_is_served_and_answered_with_the_alias(live, reference):
    client = _client(live)
    prompt = "Hello there"
    _, text = reference(reference.tokenizer.encode(prompt), 3)
    messages = [{"role": "user", "content": "hi"}]
    chat_want = None
    for name in ("default", "gpt-4o", "tiny"):
        out = client.completions.create(model=name, prompt=prompt, max_tokens=3, temperature=0)
        assert out.model == "tiny" and out.choices[0].text == text
        chat = client.chat.completions.create(model=name, messages=messages, max_tokens=3, temperature=0)
        assert chat.model == "tiny"
        chat_want = chat_want or chat.choices[0].message.content
        assert chat.choices[0].message.content == chat_want


def test_openai_client_errors(live):
    openai = pytest.importorskip("openai")
    client = _client(live)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=-3)
    assert "max_tokens" in e.value.body["message"]


# ---------------------------------------------------------------------- llama.cpp endpoints
def test_llama_completion_fields_and_stream(live, reference):
    prompt = "The answer is"
    ids, text = reference(reference.tokenizer.encode(prompt), 9)
    status, body, _ = request(
        live, "POST", "/completion", {"prompt": prompt, "n_predict": 9, "temperature": 0}
    )
    assert status == 200
    assert body["content"] == text and body["stop"] is True
    assert body["tokens_predicted"] == len(ids) and body["tokens_evaluated"] == len(
        reference.tokenizer.encode(prompt)
    )
    assert body["stopped_limit"] == (len(ids) == 9) and body["generation_settings"]["temperature"] == 0
    assert body["timings"]["predicted_n"] == len(ids) and body["timings"]["prompt_ms"] > 0
    status, raw, headers = request(
        live, "POST", "/completion", {"prompt": prompt, "n_predict": 9, "temperature": 0, "stream": True}
    )
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == text
    assert events[-1]["timings"]["predicted_n"] == len(ids)


def test_llama_stop_words(live):
    # logit_bias keeps the tiny model on printable letters; the stop word is cut from the unstopped text
    letters = [[3 + ord(c), 30.0] for c in "abcdefgh "]
    base = {"prompt": "Once upon", "n_predict": 24, "temperature": 0, "logit_bias": letters}
    status, body, _ = request(live, "POST", "/completion", base)
    text = body["content"]
    assert status == 200 and len(text) == 24 and set(text) <= set("abcdefgh ")
    word = text[10:12]
    want = text[: text.index(word)]
    for stream in (False, True):
        status, body, _ = request(
            live, "POST", "/completion", {**base, "stop": ["zz", word], "stream": stream}
        )
        assert status == 200
        final = sse_events(body)[-1] if stream else body
        content = "".join(e["content"] for e in sse_events(body)) if stream else body["content"]
        assert content == want
        assert final["stopped_word"] is True and final["stopping_word"] == word


def test_tokenize_detokenize_health_props_metrics(live, reference):
    status, body, _ = request(live, "POST", "/tokenize", {"content": "hi!"})
    assert status == 200 and body["tokens"] == reference.tokenizer.encode("hi!", add_bos=False)
    status, body, _ = request(live, "POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and body["content"] == reference.tokenizer.decode(reference.tokenizer.encode("hi!"))
    status, body, _ = request(live, "POST", "/detokenize", {"tokens": [10**6]})
    assert status == 400 and "out of range" in body["error"]["message"]
    status, body, _ = request(live, "GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["slots_idle"] + body["slots_processing"] == 4
    status, body, _ = request(live, "GET", "/props")
    assert body["total_slots"] == 4 and body["n_ctx"] == N_CTX and body["chat_template_fallback"] is True
    request(live, "POST", "/completion", {"prompt": "ab", "n_predict": 3})
    status, text, headers = request(live, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    values = dict(line.split(" ") for line in text.splitlines() if not line.startswith("#"))
    assert float(values["powerinfer_tokens_predicted_total"]) >= 1
    assert float(values["powerinfer_predicted_tokens_seconds"]) > 0
    status, schema, _ = request(live, "GET", "/openapi.json")
    assert status == 200 and {"/completion", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])


# ---------------------------------------------------------------------- continuous batching
def test_sixteen_concurrent_greedy_requests_match_solo(live, reference):
    prompts = [f"Prompt number {i}: " + "xyz"[: i % 3] for i in range(16)]
    n = 10
    want = [reference(reference.tokenizer.encode(p), n)[1] for p in prompts]

    def one(p: str) -> str:
        status, body, _ = request(
            live, "POST", "/completion", {"prompt": p, "n_predict": n, "temperature": 0}
        )
        assert status == 200, body
        return body["content"]

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, prompts))
    assert got == want
    assert request(live, "GET", "/health")[1]["slots_processing"] == 0


# ---------------------------------------------------------------------- robustness
BAD = [
    # (path, raw body, status, words in the message)
    ("/completion", b'{"prompt": "x", ', 400, "malformed JSON"),
    ("/v1/chat/completions", b"not json at all", 400, "malformed JSON"),
    ("/completion", json.dumps({"prompt": 17}).encode(), 400, "prompt"),
    ("/completion", json.dumps({"prompt": "x", "n_predict": "many"}).encode(), 400, "n_predict"),
    ("/completion", json.dumps({"n_predict": 3}).encode(), 400, "missing field 'prompt'"),
    ("/v1/chat/completions", json.dumps({"model": "tiny"}).encode(), 400, "missing field 'messages'"),
    (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(),
        400,
        "messages.0.role",
    ),
    ("/v1/chat/completions", json.dumps({"messages": "hello"}).encode(), 400, "messages"),
    (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": 7}).encode(),
        400,
        "temperature",
    ),
    ("/completion", json.dumps({"prompt": "x", "n_predict": -5}).encode(), 400, "n_predict must be >= -2"),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "x" * 500}).encode(), 400, "context size"),
    ("/completion", json.dumps({"prompt": "x" * 500}).encode(), 400, "context size"),
    ("/completion", json.dumps({"prompt": [1, 99999]}).encode(), 400, "out of range"),
    ("/v1/completions", json.dumps({"prompt": ["a", "b"]}).encode(), 400, "one prompt"),
    ("/nowhere", b"{}", 404, "Not Found"),
]


@pytest.mark.parametrize("path, raw, status, words", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_status_and_error_body(live, reference, path, raw, status, words):
    got, body, _ = request(live, "POST", path, raw=raw)
    assert got == status, body
    err = body["error"]
    assert words in err["message"] and set(err) == {"message", "type", "param", "code"}
    # the server keeps serving correctly
    _, text = reference(reference.tokenizer.encode("ok"), 4)
    got, body, _ = request(live, "POST", "/completion", {"prompt": "ok", "n_predict": 4, "temperature": 0})
    assert got == 200 and body["content"] == text


def test_huge_n_predict_is_clamped_to_the_context(live, reference):
    prompt = reference.tokenizer.encode("z" * 100)
    ids, text = reference(prompt, -1)
    for path, key in (("/completion", "n_predict"), ("/v1/completions", "max_tokens")):
        status, body, _ = request(live, "POST", path, {"prompt": "z" * 100, key: 10**9, "temperature": 0})
        assert status == 200
        content = body["content"] if path == "/completion" else body["choices"][0]["text"]
        assert content == text and len(prompt) + len(ids) == N_CTX + 1  # the last token needs no KV entry


def test_body_over_the_limit_gets_413(live):
    big = json.dumps({"prompt": "a" * 70_000}).encode()
    status, body, _ = request(live, "POST", "/completion", raw=big)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    # the same body sent chunked (no Content-Length)
    conn = http.client.HTTPConnection(live.host, live.port, timeout=30)
    conn.request(
        "POST",
        "/completion",
        body=iter([big[i : i + 8192] for i in range(0, len(big), 8192)]),
        headers={"Content-Type": "application/json"},
        encode_chunked=True,
    )
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"
    conn.close()
    assert request(live, "POST", "/completion", {"prompt": "a", "n_predict": 2})[0] == 200


def test_api_key(tiny_model):
    opts = ServerOptions(
        model=tiny_model,
        engine=EngineOptions(act_precision="f32", n_ctx=N_CTX, n_seq=1, n_threads=1),
        api_key="s3cret",
    )
    with live_server(opts) as srv:
        body = {"prompt": "a", "n_predict": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, err, h = request(srv, "POST", "/completion", body, headers)
            assert (
                status == 401
                and err["error"]["code"] == "invalid_api_key"
                and h["www-authenticate"] == "Bearer"
            )
        assert request(srv, "GET", "/v1/models")[0] == 401
        assert request(srv, "GET", "/health")[0] == 200  # public: health and the chat page
        assert request(srv, "GET", "/")[0] == 200
        status, out, _ = request(srv, "POST", "/completion", body, {"Authorization": "Bearer s3cret"})
        assert status == 200 and out["tokens_predicted"] >= 1
        openai = pytest.importorskip("openai")
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.models.list().data[0].id == "tiny.gguf"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="bad", max_retries=0).models.list()


def _open_stream(srv, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    conn.request(
        "POST",
        "/completion",
        body=json.dumps({**body, "stream": True}),
        headers={"Content-Type": "application/json"},
    )
    return conn, conn.getresponse()


def _wait(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_disconnect_mid_stream_frees_the_slot_and_queue_full_gets_503(tiny_model, reference):
    opts = ServerOptions(
        model=tiny_model,
        engine=EngineOptions(act_precision="f32", n_ctx=N_CTX, n_seq=1, n_threads=1),
        max_queue=1,
    )
    with live_server(opts, step_delay_s=0.05) as srv:
        worker = srv.server.worker
        conn, resp = _open_stream(srv, {"prompt": "long", "n_predict": -1, "ignore_eos": True})
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # generation is running
        # one slot busy, one request may wait, the next is refused
        waiting = threading.Thread(
            target=request, args=(srv, "POST", "/completion", {"prompt": "w", "n_predict": 2})
        )
        waiting.start()
        assert _wait(lambda: worker.metrics.deferred == 1)
        status, body, headers = request(srv, "POST", "/completion", {"prompt": "x", "n_predict": 2})
        assert (
            status == 503 and body["error"]["type"] == "unavailable_error" and headers["retry-after"] == "1"
        )
        conn.close()  # client goes away mid-stream
        assert _wait(lambda: worker.metrics.requests_cancelled == 1)
        waiting.join(30)
        assert _wait(lambda: worker.slots_busy() == 0)
        _, text = reference(reference.tokenizer.encode("next"), 5)
        status, body, _ = request(
            srv, "POST", "/completion", {"prompt": "next", "n_predict": 5, "temperature": 0}
        )
        assert status == 200 and body["content"] == text


def test_stop_holdback():
    assert _stop_holdback("abc<|im", ("<|im_end|>",)) == 4
    assert _stop_holdback("abc", ("<|im_end|>",)) == 0
    assert _stop_holdback("say STO", ("STOP", "TOP")) == 3


def test_metrics_report_sparsity_and_pool_share(tmp_path):
    from conftest import random_predictors, write_activation_stats

    sd = random_llama_state(n_head_kv=2, seed=4)
    path = write_llama_gguf(
        tmp_path / "sparse.gguf",
        sd,
        n_head=4,
        n_head_kv=2,
        act="relu",
        predictors=random_predictors(sd),
        threshold=0.0,
    )
    write_activation_stats(tmp_path / "activation", 2, 128)
    opts = ServerOptions(
        model=path,
        engine=EngineOptions(
            act_precision="f32", n_ctx=N_CTX, n_seq=2, n_threads=1, pool_device="cpu", vram_budget_gib=0.01
        ),
    )
    with live_server(opts) as srv:
        assert request(srv, "POST", "/completion", {"prompt": "abc", "n_predict": 4})[0] == 200
        text = request(srv, "GET", "/metrics")[1]
        values = {k: float(v) for k, v in (line.split(" ") for line in text.splitlines() if line[0] != "#")}
        stats = srv.server.engine.sparse_stats
        active = float(stats.active.sum())
        assert values["powerinfer_sparse_predicted_active_ratio"] == pytest.approx(
            active / (float(stats.tokens.sum()) * 128)
        )
        assert 0 < values["powerinfer_sparse_predicted_active_ratio"] < 1
        assert values["powerinfer_sparse_gpu_active_share"] == pytest.approx(
            float(stats.active_gpu.sum()) / active
        )
        assert values["powerinfer_sparse_gpu_active_share"] > 0


def test_constrained_requests_without_xgrammar_get_one_line_naming_the_package(live, reference, monkeypatch):
    from powerinfer.server.errors import ApiError
    from powerinfer.server.grammar import Grammars

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import fails as if it were not installed
    with pytest.raises(ApiError) as e:
        asyncio.run(Grammars(reference.tokenizer).compile("json", None, "response_format"))
    assert e.value.status == 501 and "pip install xgrammar" in e.value.message and "\n" not in e.value.message


def test_grammar_on_the_tiny_model_ends_where_the_grammar_does(live):
    for ignore_eos in (False, True):
        payload = {"prompt": "x", "grammar": 'root ::= "ab" [0-9]', "n_predict": 8, "ignore_eos": ignore_eos}
        status, body, _ = request(live, "POST", "/completion", {**payload, "temperature": 0})
        assert status == 200 and body["content"][:2] == "ab" and body["content"][2:].isdigit(), body
        assert len(body["content"]) == 3 and body["stopped_eos"]
