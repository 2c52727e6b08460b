"""Hostile chat templates (a user's --chat-template, or a model file's own, rendered on every chat request): each
is one InputError within bounded time and memory, never a hang, a traceback or an abort."""

from __future__ import annotations

import time

import pytest
from conftest import random_llama_state, write_llama_gguf

from powerinfer.errors import InputError
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.server import chat
from powerinfer.server.chat import ChatFormatter

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    sd = random_llama_state(n_head=4, n_head_kv=2, seed=2)
    path = write_llama_gguf(tmp_path_factory.mktemp("tok") / "m.gguf", sd, n_head=4, n_head_kv=2)
    return Engine(path, EngineOptions(act_precision="f32", n_ctx=32)).tokenizer


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
