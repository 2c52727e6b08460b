"""Helpers for the server tests: a live server on a random loopback port, raw HTTP calls."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from powerinfer.server import Server, ServerOptions  # noqa: E402


@dataclass
class Live:
    server: Server
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@contextlib.contextmanager
def live_server(options: ServerOptions, step_delay_s: float = 0.0) -> Iterator[Live]:
    """Run a Server in a thread on a free 127.0.0.1 port; step_delay_s slows each decode step."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = Server(options, shutdown_grace_s=0.5, sockets=[sock])
    if step_delay_s:
        engine = server.worker.engine
        decode = engine.decode

        def slow_decode(slots: list[int], tokens: list[int]) -> Any:
            time.sleep(step_delay_s)
            return decode(slots, tokens)

        engine.decode = slow_decode  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.uvicorn.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield Live(server, "127.0.0.1", port)
    finally:
        server.shutdown()
        thread.join(15)
        sock.close()


def request(
    live: Live,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    timeout: float = 60,
) -> tuple[int, Any, dict[str, str]]:
    """One HTTP call; returns (status, parsed JSON or text, headers)."""
    conn = http.client.HTTPConnection(live.host, live.port, timeout=timeout)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    h = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body=data, headers=h)
    resp = conn.getresponse()
    payload = resp.read().decode("utf-8")
    conn.close()
    try:
        parsed: Any = json.loads(payload)
    except ValueError:
        parsed = payload
    return resp.status, parsed, {k.lower(): v for k, v in resp.getheaders()}


def sse_events(text: str) -> list[Any]:
    """The `data:` payloads of a server-sent event stream ([DONE] kept as the string)."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        block = block.strip()
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
