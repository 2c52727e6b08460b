"""The chat page at / loads in headless Chromium: it shows the model name, streams an answer, stops one,
keeps the conversation for the next turn and renders code blocks (driven through chromedriver's WebDriver
HTTP API; skipped when Debian's chromium / chromium-driver are not installed)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import random_llama_state, write_llama_gguf
from server_helpers import live_server, request

from powerinfer.runtime.engine import EngineOptions
from powerinfer.server import ServerOptions

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER), reason="chromium and chromium-driver are not installed"
)


def _call(method: str, url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["value"]


@pytest.fixture
def webdriver(tmp_path: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([DRIVER, f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if _call("GET", base + "/status")["ready"]:
                    break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.skip("chromedriver did not start")
            time.sleep(0.1)
        options = {
            "binary": CHROMIUM,
            "args": [
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                f"--user-data-dir={tmp_path / 'profile'}",
            ],
        }
        session = _call(
            "POST",
            base + "/session",
            {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}},
        )
        url = f"{base}/session/{session['sessionId']}"

        def run(script: str, *args: Any) -> Any:
            return _call("POST", url + "/execute/sync", {"script": script, "args": list(args)})

        run.goto = lambda page: _call("POST", url + "/url", {"url": page})  # type: ignore[attr-defined]
        yield run
        _call("DELETE", url)
    finally:
        proc.terminate()
        proc.wait(10)


def _wait_state(webdriver: Any, want: tuple[str, ...], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while (state := webdriver("return document.body.dataset.state")) not in want:
        assert time.monotonic() < deadline, f"state {state}, waiting for {want}"
        time.sleep(0.02)
    return state


def _send(webdriver: Any, text: str, max_tokens: int) -> None:
    webdriver(
        """
        document.getElementById('max_tokens').value = String(arguments[1]);
        document.getElementById('input').value = arguments[0];
        document.getElementById('send').click();""",
        text,
        max_tokens,
    )


def test_chat_page_streams_an_answer(tmp_path, webdriver):
    model = write_llama_gguf(
        tmp_path / "m.gguf", random_llama_state(n_head_kv=2), n_head=4, n_head_kv=2, n_ctx=512
    )
    opts = ServerOptions(
        model=model, engine=EngineOptions(act_precision="f32", n_ctx=512, n_seq=2, n_threads=1), alias="tiny"
    )
    with live_server(opts, step_delay_s=0.03) as srv:
        webdriver.goto(srv.url + "/")
        deadline = time.monotonic() + 20
        while webdriver("return document.getElementById('model').textContent") != "tiny":
            assert time.monotonic() < deadline, "the page did not load the model name"
            time.sleep(0.1)
        webdriver("""
            document.getElementById('temperature').value = '0';
            document.getElementById('max_tokens').value = '24';
            document.getElementById('input').value = 'Hello!';
            document.getElementById('send').click();""")
        partial, states = set(), []
        deadline = time.monotonic() + 60
        while True:
            state, text = webdriver(
                "const a = document.querySelector('.msg.assistant, .msg.error');"
                "return [document.body.dataset.state, a ? a.textContent : null];"
            )
            states.append(state)
            if state == "streaming" and text:
                partial.add(text)
            if state in ("done", "error"):
                break
            assert time.monotonic() < deadline, "no answer in time"
            time.sleep(0.02)
        assert state == "done", text
        status, body, _ = request(
            srv,
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 24, "temperature": 0},
        )
        assert status == 200 and text == body["choices"][0]["message"]["content"] and text
        # the answer grew in place while streaming: partial texts were prefixes of the final one
        assert partial and all(text.startswith(p) and p != text for p in partial)
        assert webdriver("return document.querySelector('.msg.user').textContent") == "Hello!"

        # Stop: the answer ends where it was, the slot is freed, the partial answer stays in the conversation
        _send(webdriver, "Tell me more.", 100)
        deadline = time.monotonic() + 30
        while not webdriver(
            "const a = document.querySelectorAll('.msg.assistant'); return a[1] ? a[1].textContent : ''"
        ):
            assert time.monotonic() < deadline, webdriver(
                "return [document.body.dataset.state, document.getElementById('messages').innerHTML]"
            )
            time.sleep(0.02)
        webdriver("document.getElementById('stop').click()")
        assert _wait_state(webdriver, ("stopped", "done", "error")) == "stopped"
        partial_answer = webdriver("return history[3].content")
        assert partial_answer and webdriver("return history.length") == 4
        deadline = time.monotonic() + 10
        while request(srv, "GET", "/health")[1]["slots_processing"]:
            assert time.monotonic() < deadline, "the stopped request still holds its slot"
            time.sleep(0.05)
        # a third turn sends the whole conversation
        _send(webdriver, "Thanks.", 6)
        assert _wait_state(webdriver, ("done", "error")) == "done"
        third = webdriver("const a = document.querySelectorAll('.msg.assistant'); return a[2].textContent")
        history = webdriver("return history")
        assert [m["role"] for m in history] == ["user", "assistant"] * 3
        status, body, _ = request(
            srv,
            "POST",
            "/v1/chat/completions",
            {"messages": history[:5], "max_tokens": 6, "temperature": 0},
        )
        assert status == 200 and body["choices"][0]["message"]["content"] == third
        # fenced code blocks render as <pre><code>, the rest stays text (never HTML)
        code = webdriver(
            """
            const div = document.createElement('div');
            render(div, 'Run <b>this</b>:\\n```python\\nprint(1)\\n```\\nDone.');
            const c = div.querySelector('pre code');
            return [c.className, c.textContent, div.querySelectorAll('b').length, div.textContent];"""
        )
        assert code == ["language-python", "print(1)\n", 0, "Run <b>this</b>:\nprint(1)\nDone."]
