"""Interactive `main` (-cnv, -i -r, Ctrl-C) and --prompt-cache: real processes on a pseudo-terminal, their
replies checked against greedy in-process generation of the same conversation; the session file and the
input conventions on their own."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_llama_state, smollm2_path, write_llama_gguf
from typer.testing import CliRunner

import powerinfer.cli.main as cli_main
from powerinfer.app.interactive import chat_tokens, read_input
from powerinfer.chat_templates import BUILTIN_TEMPLATES, chat_template_source
from powerinfer.cli import app
from powerinfer.errors import FormatError, InputError
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.generate import Generator, GenParams
from powerinfer.runtime.session import TRAILER_MAGIC, Session, load_session, save_session
from powerinfer.sampling import Sampler, SamplingParams

REPO = Path(__file__).resolve().parents[1]
GREEDY = ("--temp", "0", "--repeat-penalty", "1", "-t", "2", "-s", "1")
SYSTEM = "You are a terse assistant."
TIMINGS = re.compile(r"prompt eval time = +[0-9.]+ ms / +(\d+) tokens")


def _tiny(path: Path, seed: int = 0) -> Path:
    return write_llama_gguf(path, random_llama_state(n_head_kv=2, seed=seed), n_head=4, n_head_kv=2)


def test_read_input_conventions():
    assert read_input(io.StringIO("one\ntwo\n"), False) == "one\n"
    assert read_input(io.StringIO("one\\\ntwo\nthree\n"), False) == "one\ntwo\n"
    assert read_input(io.StringIO("no newline/\nrest\n"), False) == "no newline"
    assert read_input(io.StringIO("a\nb\\\nc\n"), True) == "a\nb\n"
    assert read_input(io.StringIO("a\nb/\n"), True) == "a\nb"
    assert read_input(io.StringIO(""), False) is None
    assert read_input(io.StringIO("last"), False) == "last\n"


def test_chat_template_names_and_files(tmp_path):
    source, stops = chat_template_source("chatml")
    assert source == BUILTIN_TEMPLATES["chatml"] and stops == ("<|im_end|>",)
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert chat_template_source(str(path)) == ("{{ messages[0]['content'] }}", ())
    with pytest.raises(InputError, match="chatml"):
        chat_template_source("no-such-template")


def test_builtin_templates_render(tmp_path):
    from powerinfer.server.chat import ChatFormatter

    engine = Engine(_tiny(tmp_path / "m.gguf"), EngineOptions(act_precision="f32", n_ctx=64))
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    texts = {
        name: ChatFormatter(engine.tokenizer, src).render(messages) for name, src in BUILTIN_TEMPLATES.items()
    }
    assert (
        texts["chatml"]
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )
    assert texts["zephyr"] == "<|system|>\nS</s>\n<|user|>\nU</s>\n<|assistant|>\n"
    assert texts["gemma"] == "<s><start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n"
    assert texts["llama3"].endswith(
        "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_session_sync_evaluates_only_the_new_suffix(tmp_path):
    engine = Engine(_tiny(tmp_path / "m.gguf"), EngineOptions(act_precision="f32", n_ctx=64))
    tokens = [1, 40, 41, 42, 43, 44, 45]
    reference = engine.prefill(0, tokens)
    session = Session(engine)
    engine.free(0)
    session.sync(tokens[:4])
    logits, n = session.sync(tokens)
    assert n == 3 and engine.n_past == 7 and session.cached == tokens
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    _, n = session.sync(tokens)  # all held: the last token again, for its logits
    assert n == 1
    assert session.sync(tokens[:5], logits=False) == (None, 0) and engine.n_past == 5
    _, n = session.sync([1, 40, 99, 42])  # diverges at position 2: rewind there
    assert n == 2 and session.cached == [1, 40, 99, 42]


def test_session_file_round_trip_and_refusals(tmp_path):
    engine = Engine(_tiny(tmp_path / "m.gguf"), EngineOptions(act_precision="f32", n_ctx=64))
    tokens = [1, 40, 41, 42, 43]
    reference = engine.prefill(0, tokens + [44])
    engine.free(0)
    engine.prefill(0, tokens)
    path = tmp_path / "s.bin"
    save_session(path, engine, tokens)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".s.bin")] == []  # no temp file left
    engine.free(0)
    assert load_session(path, engine) == tokens and engine.n_past == 5
    torch.testing.assert_close(engine.eval([44]), reference, rtol=1e-4, atol=1e-4)

    other = Engine(_tiny(tmp_path / "o.gguf", seed=3), EngineOptions(act_precision="f32", n_ctx=64))
    with pytest.raises(FormatError, match="another model"):
        load_session(path, other)
    small = Engine(tmp_path / "m.gguf", EngineOptions(act_precision="f32", n_ctx=4))
    with pytest.raises(FormatError, match="context size"):
        load_session(path, small)
    big = tmp_path / "big.bin"
    big.write_bytes(bytes(1 << 20))
    with pytest.raises(FormatError, match="more than a session"):
        load_session(big, engine)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(FormatError, match="no checksum trailer"):
        load_session(path, engine)

    def sealed(data: bytes) -> bytes:  # a body with a valid trailer: the parser's own refusals
        return data + TRAILER_MAGIC + hashlib.sha256(data).digest()

    path.write_bytes(sealed(b"\x80\x04K\x01."))  # a pickle of the integer 1
    with pytest.raises(FormatError, match="not a readable"):
        load_session(path, engine)
    path.write_bytes(sealed(pickle.dumps(os.getcwd)))  # a pickle naming a global that is not ours
    with pytest.raises(FormatError, match="not a readable"):
        load_session(path, engine)


def test_a_flipped_byte_anywhere_in_a_session_file_is_refused(tmp_path):
    """64 bytes inverted at 48 places spread over the file (header, tensor data, zip directory): every copy is
    refused with a FormatError and the cache is left as it was."""
    engine = Engine(_tiny(tmp_path / "m.gguf"), EngineOptions(act_precision="f32", n_ctx=64))
    tokens = [1, 40, 41, 42, 43, 44, 45]
    engine.prefill(0, tokens)
    path = tmp_path / "s.bin"
    save_session(path, engine, tokens)
    good = path.read_bytes()
    engine.free(0)
    assert load_session(path, engine) == tokens
    engine.free(0)
    for start in np.linspace(0, len(good) - 64, 48).astype(int):
        bad = bytearray(good)
        bad[start : start + 64] = bytes(b ^ 0xFF for b in bad[start : start + 64])
        path.write_bytes(bytes(bad))
        with pytest.raises(FormatError):
            load_session(path, engine)
        assert engine.n_past == 0, start


# ---------------------------------------------------------------- real processes on SmolLM2


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}


def _spawn(stderr_path: Path, *args: str):
    """`python -m powerinfer main ARGS` on a pseudo-terminal without echo; stderr goes to a file."""
    pexpect = pytest.importorskip("pexpect")

    def child_setup() -> None:
        # a test run in the background ignores SIGINT, and children inherit that; Ctrl-C is under test here
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)

    return pexpect.spawn(
        sys.executable,
        ["-m", "powerinfer", "main", "-m", str(smollm2_path()), *GREEDY, *args],
        env=_env(),
        encoding="utf-8",
        echo=False,
        timeout=240,
        preexec_fn=child_setup,
        dimensions=(24, 500),
    )


class Reference:
    """Greedy generation computed in-process, each turn prefilled from scratch."""

    def __init__(self) -> None:
        self.engine = Engine(smollm2_path(), EngineOptions(n_threads=2, act_precision="q8"))

    def generate(self, prompt: list[int], n: int, stop: tuple[str, ...] = ()) -> tuple[list[int], str]:
        """(prompt + generated tokens as the interactive run keeps them, the text)."""
        gen = Generator(self.engine)
        params = GenParams(SamplingParams(temp=0, repeat_penalty=1.0, seed=1), n_predict=n, stop=stop)
        events = gen.start(0, prompt, params, Sampler(params.sampling))
        seq = events[0].seq
        while gen.live:
            gen.step()
        assert seq is not None
        return seq.history, seq.text

    def chat(self, messages: list[dict[str, str]], n: int) -> str:
        from powerinfer.server.chat import ChatFormatter

        return self.generate(ChatFormatter(self.engine.tokenizer).tokens(messages), n)[1]


@pytest.fixture(scope="module")
def reference() -> Reference:
    smollm2_path()
    return Reference()


def _crlf(text: str) -> str:
    return text.replace("\r\n", "\n")


@pytest.mark.slow
def test_conversation_three_turns_ctrl_c_and_prompt_cache(tmp_path, reference):
    """-cnv on a terminal: three turns, the second interrupted by Ctrl-C; the replies are greedy generation of
    the same conversation; each turn evaluates only its new tokens; a second run (stdin a pipe) loads the system
    prompt from --prompt-cache and evaluates only the user's turn."""
    from powerinfer.server.chat import ChatFormatter

    pexpect = pytest.importorskip("pexpect")
    cache, err = tmp_path / "session.bin", tmp_path / "err.txt"
    n = 16
    child = _spawn(err, "-cnv", "-sys", SYSTEM, "-n", str(n), "--prompt-cache", str(cache))
    questions = ["What is the capital of France?", "Write a long poem about the sea.", "And of Germany?"]
    replies = []
    try:
        child.expect_exact("> ")
        for i, q in enumerate(questions):
            child.sendline(q)
            if i == 1:  # interject as soon as the reply starts
                child.expect(r"\S")
                start = child.before + child.after
                child.sendintr()
                child.expect_exact("\r\n> ")
                replies.append(_crlf(start + child.before)[:-1])
            else:
                child.expect_exact("\r\n> ")
                replies.append(_crlf(child.before)[:-1])
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    stderr = err.read_text()
    assert child.exitstatus == 0, stderr
    assert "main: session file does not exist, will create." in stderr
    assert "llama_print_timings:       total time" in stderr

    messages = [{"role": "system", "content": SYSTEM}]
    full = []
    for q, got in zip(questions, replies, strict=True):
        messages.append({"role": "user", "content": q})
        full.append(reference.chat(messages, n))
        messages.append({"role": "assistant", "content": got})
    assert replies[0] == full[0]
    assert replies[1] and full[1].startswith(replies[1]) and len(replies[1]) < len(full[1]), replies[1]
    assert replies[2] == full[2]
    # the history is never prefilled again (the replies went in by decoding): fewer prompt tokens than the last
    # turn's conversation alone, where three fresh prefills would be about 2.5 times as many
    last = ChatFormatter(reference.engine.tokenizer).tokens(messages[:-1])
    n_prompt = int(TIMINGS.search(stderr).group(1))
    assert 0 < n_prompt < len(last), (n_prompt, len(last))

    # second run, stdin a pipe: the system prompt comes from the session file
    system = chat_tokens(ChatFormatter(reference.engine.tokenizer), messages[:1], add_generation_prompt=False)
    first = ChatFormatter(reference.engine.tokenizer).tokens(messages[:2])
    proc = subprocess.run(
        [sys.executable, "-m", "powerinfer", "main", "-m", str(smollm2_path()), *GREEDY]
        + ["-cnv", "-sys", SYSTEM, "-n", "4", "--prompt-cache", str(cache)],
        input=questions[0] + "\n",
        capture_output=True,
        text=True,
        env=_env(),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"main: attempting to load saved session from '{cache}'" in proc.stderr
    assert f"main: loaded a session with prompt size of {len(system)} tokens" in proc.stderr
    assert "main: using full prompt from session file" in proc.stderr
    assert int(TIMINGS.search(proc.stderr).group(1)) == len(first) - len(system)
    reply = proc.stdout.split("\n> ")[1][:-1]
    assert reply and full[0].startswith(reply), (reply, full[0])


@pytest.mark.slow
def test_interactive_reverse_prompt_then_ctrl_c_at_the_prompt(tmp_path, reference):
    """-i -r on a terminal: generation stops when the output ends with the reverse prompt and the user's line
    goes on the context; Ctrl-C at the prompt ends the run with the timings and exit code 130."""
    pexpect = pytest.importorskip("pexpect")
    prompt = "User: Hi!\nBot: Hello.\nUser: How are you?\nBot: Fine.\nUser: What is 1+1?\nBot:"
    err = tmp_path / "err.txt"
    n = 24
    child = _spawn(err, "-i", "-r", "User:", "-p", prompt, "-n", str(n))
    try:
        child.expect_exact(prompt.replace("\n", "\r\n"))
        child.expect_exact("User:")
        first = _crlf(child.before) + "User:"
        child.sendline(" What is 2+2?")
        child.expect_exact("User:")
        second = _crlf(child.before) + "User:"
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    stderr = err.read_text()
    assert child.exitstatus == 130, stderr
    assert "Reverse prompt: 'User:'" in stderr
    assert "llama_print_timings:       total time" in stderr

    tok = reference.engine.tokenizer
    history, text = reference.generate(tok.encode(prompt, add_bos=None), n, ("User:",))
    assert first == text + "User:"
    history = history + tok.encode(" What is 2+2?\n", add_bos=False, parse_special=False)
    _, text = reference.generate(history, n, ("User:",))
    assert second == text + "User:"


# ---------------------------------------------------------------- the CLI in-process on a tiny model

runner = CliRunner()


def test_interactive_options_reach_the_library(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(cli_main, "run_main", lambda opts: seen.update(opts=opts))
    args = ["main", "-m", "m.gguf", "-cnv", "-sys", "be brief\\n", "-e", "-r", "A:", "-r", "B:"]
    args += ["--in-prefix", "[", "--in-suffix", "]", "--multiline-input", "--chat-template", "chatml"]
    args += ["--prompt-cache", str(tmp_path / "s.bin"), "--prompt-cache-all"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    o = seen["opts"].interactive
    assert (o.interactive, o.interactive_first, o.conversation) == (True, True, True)
    assert o.system_prompt == "be brief\n" and o.reverse_prompts == ("A:", "B:")
    assert (o.in_prefix, o.in_suffix, o.multiline_input) == ("[", "]", True)
    assert o.chat_template == BUILTIN_TEMPLATES["chatml"] and o.chat_stop == ("<|im_end|>",)
    assert (o.prompt_cache, o.prompt_cache_all, o.prompt_cache_ro) == (tmp_path / "s.bin", True, False)
    seen.clear()
    assert runner.invoke(app, ["main", "-m", "m.gguf", "-p", "x"]).exit_code == 0
    assert not seen["opts"].interactive.needs_session  # plain main keeps its one-shot path
    for bad, needle in (
        (["--prompt-cache-all"], "need --prompt-cache"),
        (["--chat-template", "nope"], "neither a built-in"),
        (["-r", ""], "cannot be empty"),
        (["--prompt-cache", str(tmp_path / "no" / "s.bin")], "session file"),
    ):
        result = runner.invoke(app, ["main", "-m", "m.gguf", *bad])
        assert result.exit_code == 1 and needle in result.stderr, result.stderr


def _greedy(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], str]:
    gen = Generator(engine)
    params = GenParams(SamplingParams(temp=0, seed=1), n_predict=n)
    seq = gen.start(0, prompt, params, Sampler(params.sampling))[0].seq
    while gen.live:
        gen.step()
    assert seq is not None
    return seq.history, seq.text


def test_interactive_from_a_pipe_with_prefix_and_suffix(tmp_path):
    """-i with stdin a pipe: the reply after -n tokens hands over; the input goes in between --in-prefix and
    --in-suffix (both shown); end of input ends the run with exit code 0."""
    model = _tiny(tmp_path / "m.gguf")
    args = ["main", "-m", str(model), "-c", "64", "-t", "1", "--temp", "0", "-s", "1", "-n", "3", "-p", "ab"]
    result = runner.invoke(app, [*args, "-i", "--in-prefix", "[", "--in-suffix", "]"], input="hello\n")
    assert result.exit_code == 0, result.stderr
    assert "main: interactive mode on." in result.stderr and "Input prefix: '['" in result.stderr
    engine = Engine(model, EngineOptions(n_ctx=64, n_threads=1, act_precision="q8"))
    tok = engine.tokenizer
    history, first = _greedy(engine, tok.encode("ab"), 3)
    history += tok.encode("[", add_bos=False) + tok.encode("hello\n", add_bos=False, parse_special=False)
    _, second = _greedy(engine, history + tok.encode("]", add_bos=False), 3)
    assert result.stdout == "ab" + first + "[]" + second + "[\n"  # the prefix shown again, then end of input


def test_prompt_cache_reuses_the_prompt_and_refuses_another_model(tmp_path):
    model, cache = _tiny(tmp_path / "m.gguf"), tmp_path / "cache.bin"
    args = ["main", "-m", str(model), "-c", "64", "-t", "1", "--temp", "0", "-s", "1", "-n", "4"]
    plain = runner.invoke(app, [*args, "-p", "abcdefgh ij"])
    first = runner.invoke(app, [*args, "-p", "abcdefgh", "--prompt-cache", str(cache)])
    assert first.exit_code == 0 and "session file does not exist, will create." in first.stderr
    second = runner.invoke(app, [*args, "-p", "abcdefgh ij", "--prompt-cache", str(cache)])
    assert second.exit_code == 0, second.stderr
    tok = Engine(model, EngineOptions(act_precision="f32", n_ctx=64)).tokenizer
    n_old, n_new = len(tok.encode("abcdefgh")), len(tok.encode("abcdefgh ij"))
    assert f"main: loaded a session with prompt size of {n_old} tokens" in second.stderr
    assert f"main: session file matches {n_old} / {n_new} tokens of prompt" in second.stderr
    assert int(TIMINGS.search(second.stderr).group(1)) == n_new - n_old
    assert second.stdout == plain.stdout  # the same text as without the cache

    other = _tiny(tmp_path / "o.gguf", seed=3)
    before = cache.read_bytes()
    third = runner.invoke(
        app, [*args, "-m", str(other), "-p", "abcdefgh ij", "--prompt-cache", str(cache), "--prompt-cache-ro"]
    )
    assert third.exit_code == 0, third.stderr
    warnings = [line for line in third.stderr.splitlines() if "warning" in line]
    assert warnings == [
        f"main: warning: cannot use session file '{cache}': it was saved with another model file; starting fresh"
    ]
    assert int(TIMINGS.search(third.stderr).group(1)) == n_new
    assert cache.read_bytes() == before  # read-only
