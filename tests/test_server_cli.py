"""`powerinfer server` command line: options passed down, bad flags, and a clean shutdown on SIGTERM with a
request in flight."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import random_llama_state, write_llama_gguf
from server_helpers import sse_events
from typer.testing import CliRunner

from powerinfer.cli import app


def test_cli_builds_server_options(tmp_path, monkeypatch):
    import powerinfer.server as server_pkg

    seen = {}

    class FakeServer:
        def __init__(self, options):
            seen["options"] = options

        def run(self):
            seen["ran"] = True

    monkeypatch.setattr(server_pkg, "Server", FakeServer)
    model = tmp_path / "m.gguf"
    result = CliRunner().invoke(
        app,
        [
            "server",
            "-m",
            str(model),
            "--port",
            "9123",
            "-np",
            "3",
            "-c",
            "256",
            "--api-key",
            "k1",
            "--timeout",
            "30",
            "--alias",
            "mine",
            "--temp",
            "0.5",
            "--max-queue",
            "7",
            "--max-body",
            "4096",
            "-t",
            "1",
            "--embedding",
        ],
    )
    assert result.exit_code == 0, result.output
    o = seen["options"]
    assert seen["ran"] and o.model == model and o.host == "127.0.0.1" and o.port == 9123
    assert o.engine.n_seq == 3 and o.engine.n_ctx == 256 and o.engine.n_threads == 1
    assert o.api_key == "k1" and o.timeout_s == 30 and o.alias == "mine" and o.max_queue == 7
    assert o.max_body_bytes == 4096 and o.sampling.temp == 0.5 and o.sampling.top_k == 40
    assert o.sampling.repeat_penalty == 1.1 and o.n_predict == -1 and o.embedding
    help_text = CliRunner().invoke(app, ["server", "--help"], env={"COLUMNS": "200"}).output
    assert "--embedding" in help_text and "--alias" in help_text


def test_cli_rejects_zero_slots(tmp_path):
    result = CliRunner().invoke(app, ["server", "-m", str(tmp_path / "m.gguf"), "-np", "0"])
    assert result.exit_code == 1 and "error:" in result.output and "-np" in result.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_with_a_request_in_flight_shuts_down_cleanly(tmp_path):
    pytest.importorskip("uvicorn")
    model = write_llama_gguf(tmp_path / "m.gguf", random_llama_state(n_head_kv=2), n_head=4, n_head_kv=2)
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "powerinfer",
            "server",
            "-m",
            str(model),
            "--port",
            str(port),
            "-c",
            "8192",
            "-np",
            "1",
            "-t",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stderr.read() if proc.stderr else ""
            )
            time.sleep(0.2)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request(
            "POST",
            "/completion",
            body=json.dumps({"prompt": "a", "n_predict": -1, "ignore_eos": True, "stream": True}),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        events = sse_events(resp.read().decode())
        # the stream ends with the final object or an error event, not a cut connection
        assert events and ("error" in events[-1] or events[-1].get("stop") is True)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "Traceback" not in err, err
    assert proc.returncode in (0, 130), err
    assert out == ""  # logs go to stderr
