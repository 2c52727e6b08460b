"""Hostile clients against a live server: NaN-making sampling parameters interleaved with normal requests,
half-open (slowloris) connections, the connection cap, clients that vanish mid-stream, invalid Unicode, failures
injected into the generation worker, and bad --port/--host values. After each, the server keeps answering and
normal greedy requests give the solo answer."""

from __future__ import annotations

import asyncio
import http.client
import json
import selectors
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import assert_one_error_line, random_llama_state, write_llama_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import live_server, request, sse_events

import powerinfer.runtime.generate as generate_module
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sampling import Sampler, SamplingError, SamplingParams
from powerinfer.server import ServerOptions
from powerinfer.server.limits import protocol_class

N_CTX = 128
READ_TIMEOUT = 2.0
PROMPTS = [f"normal request {i}" + "!?"[: i % 3] for i in range(8)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "tiny.gguf"
    return write_llama_gguf(path, random_llama_state(n_head_kv=2, seed=3), n_head=4, n_head_kv=2)


@pytest.fixture(scope="module")
def reference(tiny_model: Path):
    """Solo greedy text of a prompt with the plain Engine (cached)."""
    engine = Engine(tiny_model, EngineOptions(act_precision="f32", n_ctx=N_CTX, n_threads=1))
    cache: dict[tuple[str, int, bool], str] = {}

    def run(prompt: str, n: int, ignore_eos: bool = False) -> str:
        key = (prompt, n, ignore_eos)
        if key not in cache:
            ids = engine.tokenizer.encode(prompt)
            out = list(engine.generate(ids, Sampler(SamplingParams(temp=0.0)), n, ignore_eos))
            cache[key] = engine.tokenizer.decode(out, strip_leading_space=False)
        return cache[key]

    return run


@pytest.fixture(scope="module")
def live(tiny_model: Path):
    opts = ServerOptions(
        model=tiny_model,
        engine=EngineOptions(act_precision="f32", n_ctx=N_CTX, n_seq=4, n_threads=1),
        max_queue=64,
        read_timeout_s=READ_TIMEOUT,
        embedding=True,
    )
    with live_server(opts) as srv:
        yield srv


def _greedy(live, prompt: str, n: int = 6) -> tuple[int, str]:
    status, body, _ = request(
        live, "POST", "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0}
    )
    return status, body["content"] if status == 200 else body


def _post_raw(live, path: str, raw: str | bytes) -> tuple[int, dict]:
    data = raw.encode() if isinstance(raw, str) else raw
    status, body, _ = request(live, "POST", path, raw=data)
    return status, body


def _healthy(live) -> None:
    status, body, _ = request(live, "GET", "/health")
    assert status == 200 and body["status"] == "ok", body
    assert live.server.worker.alive


# ---------------------------------------------------------------------- (a) NaN-making parameters
ALL_BANNED = json.dumps({"prompt": "a", "n_predict": 3, "logit_bias": [[i, False] for i in range(259)]})
# (path, raw JSON body, expected status, words in the error message or a check of the 200 body)
HOSTILE = [
    (
        "/completion",
        '{"prompt": "a", "n_predict": 4, "repeat_penalty": 0, "temperature": 0.8}',
        400,
        "repeat_penalty",
    ),
    ("/completion", '{"prompt": "a", "n_predict": 4, "repeat_penalty": 1e-45}', 400, "repeat_penalty"),
    ("/completion", '{"prompt": "a", "n_predict": 4, "repeat_penalty": -1.5}', 400, "repeat_penalty"),
    ("/completion", '{"prompt": "a", "n_predict": 4, "temperature": NaN}', 400, "NaN is not a JSON number"),
    ("/completion", '{"prompt": "a", "n_predict": 4, "temperature": Infinity}', 400, "Infinity"),
    ("/completion", '{"prompt": "a", "n_predict": 4, "temperature": 1e309}', 400, "temperature"),
    ("/completion", '{"prompt": "a", "n_predict": 4, "temperature": -1e309}', 400, "temperature"),
    ("/completion", '{"prompt": "a", "n_predict": 4, "top_p": NaN}', 400, "NaN"),
    ("/completion", '{"prompt": "a", "n_predict": 4, "top_p": 1e309}', 400, "top_p"),
    ("/completion", '{"prompt": "a", "n_predict": 4, "min_p": -Infinity}', 400, "Infinity"),
    ("/completion", '{"prompt": "a", "n_predict": 4, "frequency_penalty": 1e309}', 400, "frequency_penalty"),
    ("/completion", '{"prompt": "a", "n_predict": 4, "presence_penalty": -1e400}', 400, "presence_penalty"),
    ("/completion", '{"prompt": "a", "temperature": 0.7, "logit_bias": [[5, 1e309]]}', 400, "logit_bias"),
    ("/completion", '{"prompt": "a", "temperature": 0.7, "logit_bias": [[5, NaN]]}', 400, "NaN"),
    ("/completion", '{"prompt": "a", "logit_bias": [[1180591620717411303424, 1.0]]}', 400, "out of range"),
    ("/completion", '{"prompt": "a", "repeat_last_n": -2}', 400, "repeat_last_n"),
    ("/completion", '{"prompt": "a", "n_predict": -1000000000000000000000000000000}', 400, "n_predict"),
    ("/completion", '{"prompt": "a", "n_predict": 1e309}', 400, "n_predict"),
    ("/completion", ALL_BANNED, 400, "no token can be sampled"),
    ("/completion", '{"prompt": "\\ud800 x"}', 400, "lone UTF-16 surrogate"),
    ("/v1/completions", '{"prompt": "a", "logit_bias": {"5": 1e309}}', 400, "logit_bias"),
    ("/v1/completions", '{"prompt": "a", "max_tokens": 1e309}', 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "a", "seed": NaN}', 400, "NaN"),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}',
        400,
        "NaN",
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": "a"}], "top_p": 1e309}',
        400,
        "top_p",
    ),
    # llama.cpp's reductions and clamps: a clean completion
    (
        "/completion",
        '{"prompt": "a", "n_predict": 3, "temperature": 0.9, "seed": 1180591620717411303429}',
        200,
        5,
    ),
    (
        "/completion",
        '{"prompt": "a", "n_predict": 3, "temperature": 0.9, "seed": -1180591620717411303427}',
        200,
        2**32 - 3,
    ),
    (
        "/completion",
        '{"prompt": "a", "n_predict": 5, "temperature": 0.8, "logit_bias": [[5, 1e39]]}',
        200,
        "\x02" * 5,
    ),
    (
        "/completion",
        '{"prompt": "zz", "n_predict": 1000000000000000000000000000000, "temperature": 0, "ignore_eos": true}',
        200,
        "full",
    ),
    ("/completion", '{"prompt": "a", "n_predict": 6, "temperature": 1e-45}', 200, ("a", 6)),
    ("/completion", '{"prompt": "a", "n_predict": 6, "temperature": -5}', 200, ("a", 6)),
    (
        "/completion",
        '{"prompt": "a", "n_predict": 6, "temperature": 0, "top_k": 1180591620717411303424}',
        200,
        ("a", 6),
    ),
    (
        "/completion",
        '{"prompt": "a", "n_predict": 4, "temperature": 0, "repeat_last_n": 1180591620717411303424}',
        200,
        None,
    ),
]


def test_nan_making_parameters_interleaved_with_normal_requests(live, reference):
    bad = [HOSTILE[i % len(HOSTILE)] for i in range(50)]
    jobs: list[tuple[str, object]] = []
    for i, case in enumerate(bad):
        jobs.append(("bad", case))
        if i % 2 == 0:
            jobs.append(("normal", PROMPTS[i % len(PROMPTS)]))
    want = {p: reference(p, 6) for p in PROMPTS}

    def run(job):
        kind, what = job
        if kind == "normal":
            return _greedy(live, what)
        path, raw, _, _ = what
        return _post_raw(live, path, raw)

    t0 = time.monotonic()
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(run, jobs))
    elapsed = time.monotonic() - t0
    for (kind, what), (status, body) in zip(jobs, results, strict=True):
        if kind == "normal":
            assert status == 200 and body == want[what], (what, status, body)
            continue
        path, raw, want_status, check = what
        assert status == want_status, (raw, status, body)
        if status != 200:
            err = body["error"]
            assert check in err["message"] and set(err) == {"message", "type", "param", "code"}, (raw, err)
        elif isinstance(check, int):  # the seed, reduced to uint32
            assert body["generation_settings"]["seed"] == check, (raw, body["generation_settings"])
        elif check == "full":  # clamped to the free context
            assert body["stopped_limit"] and body["tokens_evaluated"] + body["tokens_predicted"] == N_CTX + 1
        elif isinstance(check, tuple):  # the greedy limit
            assert body["content"] == reference(*check), raw
        elif isinstance(check, str):
            assert body["content"] == check, raw
    _healthy(live)
    assert elapsed < 30
    assert _greedy(live, PROMPTS[0]) == (200, want[PROMPTS[0]])


# ---------------------------------------------------------------------- (b) half-open connections
PARTIAL = [
    b"",  # connects and sends nothing
    b"GET /hea",  # part of the request line
    b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Le",  # part of the headers
    b'POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 90\r\n\r\n{"pro',
]


def _raise_fd_limit(n: int) -> None:
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            pytest.skip(f"the open-file limit ({hard}) is below the {n} this test needs")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


def _stream(live, prompt: str, n: int, **extra) -> tuple[int, str, list]:
    conn = http.client.HTTPConnection(live.host, live.port, timeout=30)
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "stream": True, **extra}
    conn.request("POST", "/completion", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    events = sse_events(resp.read().decode())
    conn.close()
    text = "".join(e.get("content", "") for e in events if isinstance(e, dict))
    return resp.status, text, events


def _wait_closed(socks: list[tuple[socket.socket, float]], limit: float) -> dict[socket.socket, float]:
    """Seconds from each socket's opening to the server closing it (EOF or reset), for those closed before
    `limit` seconds after the last one opened."""
    closed: dict[socket.socket, float] = {}
    sel = selectors.DefaultSelector()
    for s, t in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, t)
    deadline = max(t for _, t in socks) + limit
    while len(closed) < len(socks) and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.1):
            s = key.fileobj
            try:
                data = s.recv(4096)  # type: ignore[union-attr]
            except (ConnectionResetError, BlockingIOError):
                data = b""
            if not data:
                closed[s] = time.monotonic() - key.data  # type: ignore[index]
                sel.unregister(s)
    sel.close()
    return closed


def test_half_open_connections_do_not_lock_out_real_clients(live, reference):
    _raise_fd_limit(2048)
    socks: list[tuple[socket.socket, float]] = []
    health: list[tuple[int, float]] = []
    stop = threading.Event()

    def poll_health() -> None:
        while not stop.is_set():
            t = time.monotonic()
            try:
                status = request(live, "GET", "/health", timeout=5)[0]
            except OSError:
                status = -1
            health.append((status, time.monotonic() - t))
            time.sleep(0.05)

    try:
        for i in range(300):
            s = socket.create_connection((live.host, live.port), timeout=5)
            if PARTIAL[i % 4]:
                s.sendall(PARTIAL[i % 4])
            socks.append((s, time.monotonic()))
        poller = threading.Thread(target=poll_health, daemon=True)
        poller.start()
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
        with ThreadPoolExecutor(32) as pool:
            streams = list(pool.map(lambda p: _stream(live, p, 6), prompts))
        for p, (status, text, events) in zip(prompts, streams, strict=True):
            assert status == 200 and text == reference(p, 6) and events[-1]["stop"] is True
        closed = _wait_closed(socks, READ_TIMEOUT + 3.0)
        stop.set()
        poller.join(10)
    finally:
        stop.set()
        for s, _ in socks:
            s.close()
    assert len(closed) == 300  # every half-open connection was closed by the server ...
    assert max(closed.values()) < READ_TIMEOUT + 2.0  # ... within the read timeout
    assert min(closed.values()) > READ_TIMEOUT - 0.5  # and not before it
    assert health and all(status == 200 for status, _ in health), health
    assert max(latency for _, latency in health) < 2.0
    _healthy(live)


# ---------------------------------------------------------------------- the connection cap, n_predict cap
MAX_CONNECTIONS = 10


@pytest.fixture(scope="module")
def slow(tiny_model: Path):
    opts = ServerOptions(
        model=tiny_model,
        engine=EngineOptions(act_precision="f32", n_ctx=N_CTX, n_seq=MAX_CONNECTIONS, n_threads=1),
        max_queue=8,
        read_timeout_s=30.0,
        max_connections=MAX_CONNECTIONS,
        n_predict_max=40,
    )
    with live_server(opts, step_delay_s=0.05) as srv:
        yield srv


def _open_stream(srv, prompt: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    body = {"prompt": prompt, "n_predict": -1, "ignore_eos": True, "temperature": 0, "stream": True}
    conn.request("POST", "/completion", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    return conn, resp


def _settle(srv, timeout: float = 10.0) -> None:
    """Wait until the server holds no connection and no slot."""
    state = srv.server.uvicorn.server_state
    deadline = time.monotonic() + timeout
    while (state.connections or srv.server.worker.slots_busy()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not state.connections and not srv.server.worker.slots_busy()


def test_connection_cap_closes_the_oldest_waiting_then_refuses(slow, reference):
    socks: list[tuple[socket.socket, float]] = []
    streams = []
    try:
        for _ in range(MAX_CONNECTIONS + 4):  # 4 more half-open ones than the cap: the 4 oldest make room
            socks.append((socket.create_connection((slow.host, slow.port), timeout=5), time.monotonic()))
            time.sleep(0.01)
        closed = _wait_closed(socks, 1.5)
        assert set(closed) == {s for s, _ in socks[:4]}
        # a real client still gets in (the oldest half-open one goes), and --n-predict-max caps its request
        body = {"prompt": "a", "n_predict": 500, "temperature": 0, "ignore_eos": True}
        status, out, _ = request(slow, "POST", "/completion", body)
        assert status == 200 and out["tokens_predicted"] == 40
        assert out["content"] == reference("a", 40, ignore_eos=True)
        for s, _ in socks:
            s.close()
        _settle(slow)
        # every connection serving a request: a new one gets a 503 and is closed
        streams = [_open_stream(slow, f"s{i}") for i in range(MAX_CONNECTIONS)]
        with socket.create_connection((slow.host, slow.port), timeout=5) as extra:
            answer = b""
            while chunk := extra.recv(4096):
                answer += chunk
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ")
        assert json.loads(payload)["error"]["message"] == "too many open connections"
    finally:
        for s, _ in socks:
            s.close()
        for conn, _ in streams:
            conn.close()
    _settle(slow)
    _healthy(slow)


# ---------------------------------------------------------------------- (c) clients gone mid-stream
def test_clients_that_disconnect_mid_stream_leave_the_server_serving(slow, reference):
    worker = slow.server.worker
    cancelled = worker.metrics.requests_cancelled

    def vanish(i: int) -> None:
        conn, resp = _open_stream(slow, f"gone {i}")
        resp.readline()
        if i % 2:  # an abortive close (RST) for half of them
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()

    with ThreadPoolExecutor(7) as pool:
        gone = [pool.submit(vanish, i) for i in range(5)]
        normal = [pool.submit(_greedy, slow, p, 8) for p in PROMPTS[:2]]
        for f in gone:
            f.result()
        results = [f.result() for f in normal]
    assert results == [(200, reference(p, 8)) for p in PROMPTS[:2]]
    _settle(slow)
    assert worker.metrics.requests_cancelled == cancelled + 5
    _healthy(slow)
    assert _greedy(slow, PROMPTS[3]) == (200, reference(PROMPTS[3], 6))


# ---------------------------------------------------------------------- (d) invalid Unicode
@pytest.mark.parametrize(
    "path, raw",
    [
        ("/completion", b'{"prompt": "\\ud800"}'),
        ("/completion", b'{"prompt": "ok", "stop": ["\\udfff"]}'),
        ("/completion", b'{"prompt": "ok", "model": "x\\udc00"}'),
        ("/completion", b'{"prompt": "\xff\xfe"}'),
        ("/completion", b'{"prompt": "\xed\xa0\x80"}'),  # a surrogate encoded as UTF-8 (CESU)
        ("/completion", b'{"prompt": "\xc3"}'),  # a truncated sequence
        ("/tokenize", b'{"content": "a\\udbff"}'),
        ("/v1/completions", b'{"prompt": "\\udc00"}'),
        ("/v1/completions", b'{"prompt": "a", "user": "\\ud800"}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\x80"}]}'),
        ("/v1/completions", '{"prompt": "x"}'.encode("utf-16")),  # not UTF-8 at all
    ],
)
def test_lone_surrogates_and_invalid_utf8_get_400(live, reference, path, raw):
    status, body = _post_raw(live, path, raw)
    assert status == 400, body
    assert body["error"]["message"].startswith("malformed JSON body: ")
    assert "UTF-8" in body["error"]["message"] or "surrogate" in body["error"]["message"]
    # a valid surrogate pair is one astral character, and fine
    status, body = _post_raw(live, "/tokenize", b'{"content": "\\ud83d\\ude00"}')
    assert status == 200 and body["tokens"]


# ---------------------------------------------------------------------- worker isolation
class _Faulty(Sampler):
    """Raises on its third token for two chosen seeds: RuntimeError (a bug: 500) or SamplingError (400)."""

    def __init__(self, params: SamplingParams) -> None:
        super().__init__(params)
        self.calls = 0

    def __call__(self, logits, history=()):
        self.calls += 1
        if self.calls == 3 and self.params.seed == 777:
            raise RuntimeError("injected fault")
        if self.calls == 3 and self.params.seed == 778:
            raise SamplingError("no token can be sampled: injected")
        return super().__call__(logits, history)


def test_a_failure_while_sampling_ends_only_that_request(live, reference, monkeypatch):
    monkeypatch.setattr(generate_module, "Sampler", _Faulty)
    with ThreadPoolExecutor(8) as pool:
        victim = pool.submit(_stream, live, "victim", 10, seed=777)
        victim_400 = pool.submit(
            request, live, "POST", "/completion", {"prompt": "v", "n_predict": 9, "seed": 778}
        )
        normal = [pool.submit(_greedy, live, p, 10) for p in PROMPTS[:6]]
        status, text, events = victim.result()
        results = [f.result() for f in normal]
        status_400, body_400, _ = victim_400.result()
    assert results == [(200, reference(p, 10)) for p in PROMPTS[:6]]
    # streamed: the text of two tokens at most went out, then an error event
    assert status == 200 and reference("victim", 10).startswith(text)
    assert events[-1]["error"]["message"] == "internal error during decoding: RuntimeError"
    assert status_400 == 400 and body_400["error"]["message"] == "no token can be sampled: injected"
    _healthy(live)


def test_a_failed_decode_step_fails_its_batch_and_the_worker_goes_on(live, reference, monkeypatch):
    engine = live.server.worker.engine
    decode = engine.decode
    failures = []

    def flaky(slots, tokens):
        if not failures:
            failures.append(list(slots))
            raise RuntimeError("device lost")
        return decode(slots, tokens)

    monkeypatch.setattr(engine, "decode", flaky)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: _greedy(live, p, 8), PROMPTS[:4]))
    failed = [body for status, body in results if status != 200]
    assert failures and len(failed) == len(failures[0])  # exactly the sequences of the failed step
    assert all(body["error"]["message"] == "internal error during decoding: RuntimeError" for body in failed)
    for prompt, (status, text) in zip(PROMPTS[:4], results, strict=True):
        assert status == 500 or text == reference(prompt, 8)
    _healthy(live)
    assert _greedy(live, PROMPTS[5], 8) == (200, reference(PROMPTS[5], 8))


def test_an_unexpected_failure_in_a_scheduling_round_is_recovered(live, reference, monkeypatch):
    worker = live.server.worker
    active = worker._active
    calls = []

    def broken():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("bookkeeping bug")
        return active()

    monkeypatch.setattr(worker, "_active", broken)
    status, body = _greedy(live, "victim", 8)
    assert status == 500 and body["error"]["message"] == "internal error in the generation worker"
    monkeypatch.setattr(worker, "_active", active)
    _healthy(live)
    assert worker.slots_busy() == 0
    assert _greedy(live, PROMPTS[1], 8) == (200, reference(PROMPTS[1], 8))


# ---------------------------------------------------------------------- protocol timers (no server)
def test_write_stall_aborts_and_read_deadline_closes():
    uvicorn = pytest.importorskip("uvicorn")
    from uvicorn.server import ServerState as UvicornState

    class Transport(asyncio.Transport):
        def __init__(self) -> None:
            super().__init__()
            self.closed = self.aborted = False

        def get_extra_info(self, name, default=None):
            return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

        def is_closing(self) -> bool:
            return self.closed or self.aborted

        def close(self) -> None:
            self.closed = True

        def abort(self) -> None:
            self.aborted = True

        def write(self, data) -> None:
            pass

        def pause_reading(self) -> None:
            pass

        def resume_reading(self) -> None:
            pass

    async def app(scope, receive, send):  # pragma: no cover - never called
        raise AssertionError

    async def scenario() -> tuple[Transport, Transport, Transport]:
        config = uvicorn.Config(app, log_config=None)
        config.load()
        cls = protocol_class(read_timeout_s=0.2, write_timeout_s=0.1, max_connections=8)
        state = UvicornState()
        idle, stalled, complete = Transport(), Transport(), Transport()
        for t in (idle, stalled, complete):
            cls(config=config, server_state=state, app_state={}).connection_made(t)
        protocols = {p.transport: p for p in state.connections}
        protocols[stalled].data_received(b"GET /hea")
        protocols[stalled].pause_writing()  # the client stopped reading
        protocols[complete].waiting_since = None  # as when a complete request arrived
        protocols[complete]._cancel_read()
        await asyncio.sleep(0.15)
        assert stalled.aborted and not idle.closed
        await asyncio.sleep(0.15)
        return idle, stalled, complete

    idle, stalled, complete = asyncio.run(scenario())
    assert idle.closed and not complete.closed and not complete.aborted


# ---------------------------------------------------------------------- --port / --host
def test_bad_ports_and_hosts_give_one_error_line(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from powerinfer.cli import app

    runner = CliRunner()
    base = ["server", "-m", str(tiny_model), "-t", "1"]
    assert_one_error_line(runner.invoke(app, [*base, "--port", "70000"]), "--port", "70000")
    assert_one_error_line(runner.invoke(app, [*base, "--port", "-1"]), "--port")
    assert_one_error_line(runner.invoke(app, [*base, "--host", "no.such.host.invalid"]), "cannot listen on")
    assert_one_error_line(runner.invoke(app, [*base, "--host", "bad\x1bhost"]), "cannot listen on", "\\x1b")
    assert_one_error_line(runner.invoke(app, [*base, "--read-timeout", "0"]), "--read-timeout")
    assert_one_error_line(runner.invoke(app, [*base, "--max-connections", "0"]), "--max-connections")
    assert_one_error_line(runner.invoke(app, [*base, "--temp", "nan"]), "--temp")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t = time.monotonic()
        result = runner.invoke(app, [*base, "--port", str(port)])
        assert_one_error_line(result, f"cannot listen on 127.0.0.1:{port}", "in use")
        assert time.monotonic() - t < 5  # refused before the model loads


# ---------------------------------------------------------------------- property-based request fuzzing
FIELDS = (
    "prompt n_predict temperature top_k top_p min_p repeat_penalty repeat_last_n frequency_penalty presence_penalty "
    "seed logit_bias stop stream ignore_eos max_tokens messages model grammar content tokens n echo stream_options "
    "add_special cache_prompt n_probs json_schema response_format logprobs top_logprobs tools tool_choice input"
).split()


def _fuzz_strategies():
    text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=12)
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**80), 2**80),
        st.integers(-3, 300),
        st.floats(allow_nan=True, allow_infinity=True),
        text,
    )
    values = st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "role",
                        "content",
                        "type",
                        "text",
                        "5",
                        "include_usage",
                        "json_schema",
                        "schema",
                        "properties",
                    ]
                )
                | text,
                inner,
                max_size=4,
            )
        ),
        max_leaves=12,
    )
    messages = st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "x"]), "content": values}
        ),
        max_size=3,
    )
    body = st.dictionaries(st.sampled_from(FIELDS), values, max_size=8)
    plausible = st.fixed_dictionaries(
        {"prompt": st.one_of(text, st.lists(st.integers(-5, 300) | text, max_size=5)), "messages": messages},
        optional={f: values for f in FIELDS if f not in ("prompt", "messages")},
    )
    path = st.sampled_from(
        [
            "/completion",
            "/v1/completions",
            "/v1/chat/completions",
            "/tokenize",
            "/detokenize",
            "/v1/embeddings",
            "/embedding",
        ]
    )
    return path, st.one_of(body, plausible)


def test_fuzzed_requests_never_get_500(live):
    paths, bodies = _fuzz_strategies()

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(path=paths, body=bodies)
    def check(path, body):
        if isinstance(body.get("n_predict"), int) and body["n_predict"] > 16:
            body["n_predict"] = 16  # keep generation short; the cap itself is tested above
        raw = json.dumps(body, allow_nan=True).encode()
        status, answer = _post_raw(live, path, raw)
        assert status < 500, (path, raw, answer)
        if status >= 400:
            assert set(answer["error"]) == {"message", "type", "param", "code"}

    check()
    _healthy(live)


def test_embeddings_are_capped_per_request(live):
    """10,000 inputs took over 120 s: a request holds at most 256 (each one prompt of at most -c tokens);
    the refusal is immediate and one error, and 256 still work."""
    for path, key in (("/v1/embeddings", "input"), ("/embedding", "content")):
        t = time.perf_counter()
        status, body, _ = request(live, "POST", path, {key: ["a"] * 10_000})
        assert status == 400 and "at most 256" in body["error"]["message"], body
        assert body["error"]["param"] == key and time.perf_counter() - t < 5
    status, body, _ = request(live, "POST", "/v1/embeddings", {"input": [[1, 2]] * 256}, timeout=300)
    assert status == 200 and len(body["data"]) == 256


def test_grammars_and_schemas_are_bounded_before_compiling(live):
    """A GBNF grammar of 20,000 chained rules (~500 KB under --max-body) compiled for over 120 s in 2.5 GB: rules,
    bytes and schema nesting are bounded first, each a 400 at once."""
    chained = (
        "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(20_000)) + 'r20000 ::= "a"\n'
    )
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    for body, needle in (
        ({"prompt": "x", "n_predict": 2, "grammar": chained}, "larger than 65536 bytes"),
        (
            {"prompt": "x", "n_predict": 2, "grammar": "root ::= r0\n" + 'r0 ::= "a"\n' * 600},
            "more than 512 rules",
        ),
        ({"prompt": "x", "n_predict": 2, "json_schema": deep}, "nests deeper than 32"),
    ):
        t = time.perf_counter()
        status, answer, _ = request(live, "POST", "/completion", body)
        assert status == 400 and needle in answer["error"]["message"], answer
        assert time.perf_counter() - t < 5


def test_a_compile_stops_when_its_client_leaves(tiny_model: Path):
    """A POST /completion whose grammar is still compiling when the client goes: the compile process is killed
    at once (nothing runs on for the departed client) and the request never reaches the worker; other requests
    are answered meanwhile, and the next grammar compiles in a new process. The first compile of a server
    starts its process (importing xgrammar: measured 1.5-3.5 s here), so a client that leaves after 0.3 s leaves
    during that compile."""
    opts = ServerOptions(
        model=tiny_model, engine=EngineOptions(act_precision="f32", n_ctx=N_CTX, n_seq=2, n_threads=1)
    )
    with live_server(opts) as live:
        grammars = live.server.state.grammars
        body = json.dumps({"prompt": "x", "n_predict": 4, "grammar": 'root ::= "ab" [0-9]'}).encode()
        sock = socket.create_connection((live.host, live.port))
        head = f"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        time.sleep(0.3)
        t = time.perf_counter()
        status, plain = _greedy(live, "hello", 3)  # answered while the compile runs: the loop is free
        assert status == 200 and time.perf_counter() - t < 2.5, plain
        sock.close()
        deadline = time.monotonic() + 5
        while grammars.n_killed == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert grammars.n_killed == 1 and grammars.n_processes == 0
        time.sleep(0.5)
        assert live.server.worker.metrics.requests_total == 1  # the plain request only
        payload = {"prompt": "x", "grammar": 'root ::= "ab" [0-9]', "n_predict": 8, "temperature": 0}
        status, answer, _ = request(live, "POST", "/completion", payload)
        assert status == 200 and answer["content"][:2] == "ab", answer
        assert grammars.n_processes == 1 and grammars.n_killed == 1
    assert grammars.n_processes == 0  # shutdown ends the compile processes


def test_a_compile_past_its_time_or_memory_is_one_400_and_its_process_is_killed(tiny_model: Path):
    """The time bound: a compile that runs past it (here 0.2 s, shorter than the process's start) is a 400
    naming the field, its process killed; with the default bound the same grammar compiles. The memory bound
    likewise (here 4 MiB)."""
    from powerinfer.server.errors import ApiError
    from powerinfer.server.grammar import Grammars

    tokenizer = Engine(tiny_model, EngineOptions(act_precision="f32", n_ctx=N_CTX, n_threads=1)).tokenizer
    short = Grammars(tokenizer, timeout_s=0.2)
    t = time.perf_counter()
    with pytest.raises(ApiError) as e:
        asyncio.run(short.compile("gbnf", 'root ::= "a"', "grammar"))
    assert e.value.status == 400 and "grammar took more than 0.2 s to compile" in e.value.message
    assert time.perf_counter() - t < 2 and short.n_killed == 1 and short.n_processes == 0
    g = Grammars(tokenizer)
    matcher = asyncio.run(g.compile("gbnf", 'root ::= "a"', "grammar"))
    assert matcher.n_vocab == tokenizer.n_vocab and g.n_processes == 1
    g.close()
    assert g.n_processes == 0
    # the memory bound: 400 chained rules of bounded repetitions (14 KB; on SmolLM2 they took 0.5 s and ~150 MB)
    chain = "root ::= r0\n" + "".join(f"r{i} ::= ([a-z] [0-9]?){{0,60}} r{i + 1}\n" for i in range(400))
    chain += 'r400 ::= "a"\n'
    small = Grammars(tokenizer, memory_bytes=4 << 20)
    with pytest.raises(ApiError) as e:
        asyncio.run(small.compile("gbnf", chain, "grammar"))
    assert e.value.status == 400 and "grammar needs more than 4 MiB to compile" in e.value.message
    assert small.n_killed == 1 and small.n_processes == 0


def test_concurrent_compiles_share_two_processes(tiny_model: Path):
    """Six constrained requests at once (distinct grammars): every one answered by its grammar, by at most
    GRAMMAR_PROCESSES compile processes, which stay for later requests."""
    from powerinfer.server.grammar import GRAMMAR_PROCESSES

    opts = ServerOptions(
        model=tiny_model, engine=EngineOptions(act_precision="f32", n_ctx=N_CTX, n_seq=4, n_threads=1)
    )
    with live_server(opts) as live:
        grammars = live.server.state.grammars

        def one(i: int) -> tuple[int, dict]:
            body = {"prompt": "x", "grammar": f'root ::= "a{i}" [0-9]', "n_predict": 8, "temperature": 0}
            status, answer, _ = request(live, "POST", "/completion", body, timeout=120)
            return status, answer

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(one, range(6)))
        for i, (status, answer) in enumerate(results):
            assert status == 200 and answer["content"].startswith(f"a{i}"), answer
        assert 1 <= grammars.n_processes <= GRAMMAR_PROCESSES and grammars.n_killed == 0
