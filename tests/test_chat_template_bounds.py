"""Hostile chat templates (a user's --chat-template, or a model file's own, rendered on every chat request): each
is one InputError within bounded time and memory, never a hang, a traceback or an abort."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest
from conftest import random_llama_state, write_llama_gguf

from powerinfer.errors import InputError
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.server import chat
from powerinfer.server.chat import ChatFormatter

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    sd = random_llama_state(n_head=4, n_head_kv=2, seed=2)
    path = write_llama_gguf(tmp_path_factory.mktemp("tok") / "m.gguf", sd, n_head=4, n_head_kv=2)
    return Engine(path, EngineOptions(act_precision="f32", n_ctx=32))


@pytest.fixture(scope="module")
def tokenizer(engine):
    return engine.tokenizer


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "range()"),
        ("{{ 'x' * 4000000000 }}", "repetition"),
        ("{{ 'x' * 200000000 }}", "repetition"),
        ("{{ [1] * 200000000 }}", "repetition"),
        ("{% for i in range(10**12) %}{% endfor %}", "range()"),
        ("{{ 2 ** 100000000 }}", "power"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
        ("{% for i in range(1000000) %}{{ 'abcdefgh' }}{% endfor %}", "characters"),
        ("{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", "longer than"),
        ("{{ raise_exception('no system role') }}", "no system role"),
    ],
)
def test_hostile_templates_are_one_error(tokenizer, template, needle, monkeypatch):
    monkeypatch.setattr(chat, "RENDER_SECONDS", 1.0)
    fmt = ChatFormatter(tokenizer, template)
    t = time.perf_counter()
    with pytest.raises(InputError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        fmt.render(MESSAGES)
    assert time.perf_counter() - t < 10


def test_a_normal_template_still_renders_and_the_timeout_does_not_leak(tokenizer):
    fmt = ChatFormatter(tokenizer, "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    for _ in range(3):
        assert fmt.render(MESSAGES) == "<user>hi"
    time.sleep(0.05)  # a render that ended before its watchdog: nothing is raised later
    assert sum(range(1000)) == 499500


def profiled(fn, limit_s: float = 15.0) -> int:
    """Python calls made by fn() under sys.setprofile. Should the profiled call spin (CPython 3.11 with its
    eval breaker left set), a helper thread stops it after limit_s with an AssertionError (an exception that
    lands clears the breaker), so the test fails instead of hanging the suite."""
    n = 0
    finished = threading.Event()
    main = threading.get_ident()

    def count(frame, event, arg):
        nonlocal n
        n += event in ("call", "c_call")

    def rescue():
        if not finished.wait(limit_s):
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(AssertionError))

    helper = threading.Thread(target=rescue, daemon=True)
    helper.start()
    try:
        sys.setprofile(count)
        try:
            fn()
        finally:
            sys.setprofile(None)
    finally:
        finished.set()
    helper.join()
    return n


@pytest.mark.parametrize("race", [False, True])
def test_a_timed_out_render_leaves_a_profiled_engine_step_working(engine, monkeypatch, race):
    """The regression of the hang: after a render stopped by the time limit, an engine step under
    sys.setprofile in the same thread finishes (it spun without end when the watchdog's exception was taken
    back with PyThreadState_SetAsyncExc(id, NULL): on CPython 3.11 that leaves the eval breaker set, and a
    traced function entry then re-runs its RESUME for ever). With `race`, the watchdog fires while the render
    is ending (after its last piece, inside the finally's cancel): still one error, and nothing pending after."""
    fmt = ChatFormatter(engine.tokenizer, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    if race:
        real_timer = threading.Timer

        class LateTimer(real_timer):
            def cancel(self) -> None:  # too late: the limit passed just now, the watchdog's call runs
                super().cancel()
                other = threading.Thread(target=self.function, args=self.args)
                other.start()
                other.join()

        monkeypatch.setattr(chat.threading, "Timer", LateTimer)
    else:
        monkeypatch.setattr(chat, "RENDER_SECONDS", 0.3)
        fmt = ChatFormatter(
            engine.tokenizer,
            "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        )
    with pytest.raises(InputError, match="longer than"):
        fmt.render(MESSAGES)
    monkeypatch.undo()
    for t in threading.enumerate():  # no watchdog outlives its render (one could fire into later code)
        if isinstance(t, threading.Timer):
            t.join(2)
            assert not t.is_alive()
    assert sum(range(1000)) == 499500  # nothing lands later
    engine.free(0)
    logits = []
    n = profiled(lambda: logits.append(engine.prefill(0, [1, 2, 3])))
    assert n > 0 and logits[0].shape == (engine.config.n_vocab,)
