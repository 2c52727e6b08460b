"""`powerinfer main`: option plumbing, prompt handling and output shape."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import powerinfer.cli.main as cli_main
from powerinfer.cli import app
from powerinfer.cli.main import process_escapes
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sampling import Sampler, SamplingParams

runner = CliRunner()


def test_process_escapes():
    assert process_escapes(r"a\nb\tc\\d\x41\"") == 'a\nb\tc\\dA"'
    assert process_escapes(r"keep \q") == "keep \\q"


def test_options_reach_the_library(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(cli_main, "run_main", lambda opts: seen.setdefault("opts", opts))
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text("line1\\nline2\n")
    result = runner.invoke(
        app,
        [
            "main",
            "-m",
            "m.gguf",
            "-f",
            str(prompt_file),
            "-e",
            "-n",
            "7",
            "-c",
            "128",
            "-b",
            "16",
            "-t",
            "3",
            "-s",
            "5",
            "--temp",
            "0.5",
            "--top-k",
            "9",
            "--top-p",
            "0.8",
            "--min-p",
            "0.1",
            "--repeat-penalty",
            "1.2",
            "--repeat-last-n",
            "32",
            "--ignore-eos",
            "--vram-budget",
            "2.5",
            "-ngl",
            "4",
            "--reset-gpu-index",
            "--disable-gpu-index",
            "--verbose-prompt",
            "--act-precision",
            "q8",
        ],
    )
    assert result.exit_code == 0, result.stderr
    o = seen["opts"]
    assert o.model == Path("m.gguf")
    assert o.prompt == "line1\nline2"  # trailing newline of -f dropped, then escapes processed
    assert (o.n_predict, o.ignore_eos, o.verbose_prompt) == (7, True, True)
    assert o.engine == EngineOptions(
        n_ctx=128,
        n_batch=16,
        n_threads=3,
        act_precision="q8",
        vram_budget_gib=2.5,
        n_gpu_layers=4,
        reset_gpu_index=True,
        disable_gpu_index=True,
    )
    assert o.sampling == SamplingParams(
        temp=0.5, top_k=9, top_p=0.8, min_p=0.1, repeat_penalty=1.2, repeat_last_n=32, seed=5
    )


def test_generates_like_the_engine(tiny_gguf: Path):
    """stdout is the echoed prompt then the greedy continuation; timings go to stderr."""
    engine = Engine(tiny_gguf, EngineOptions(n_ctx=64, n_threads=1))
    ids = engine.tokenizer.encode("hello")
    expected = list(engine.generate(ids, Sampler(SamplingParams(temp=0)), n_predict=12, ignore_eos=True))
    result = runner.invoke(
        app,
        [
            "main",
            "-m",
            str(tiny_gguf),
            "-p",
            "hello",
            "-n",
            "12",
            "--temp",
            "0",
            "--ignore-eos",
            "-c",
            "64",
            "-t",
            "1",
            "--verbose-prompt",
        ],
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "hello" + engine.tokenizer.decode(expected, strip_leading_space=False) + "\n"
    assert f"number of tokens in prompt = {len(ids)}" in result.stderr
    assert "llama_print_timings: prompt eval time" in result.stderr
    assert "llama_print_timings:        eval time" in result.stderr
    assert " 11 runs " in result.stderr  # 12 sampled, 11 evaluated


def test_log_disable_prints_only_text(tiny_gguf: Path):
    result = runner.invoke(
        app,
        [
            "main",
            "-m",
            str(tiny_gguf),
            "-p",
            "hi",
            "-n",
            "3",
            "--temp",
            "0",
            "--ignore-eos",
            "--log-disable",
            "--no-display-prompt",
        ],
    )
    assert result.exit_code == 0
    assert result.stderr == ""
    assert len(result.stdout) > 1 and result.stdout.endswith("\n")


def test_python_dash_m_entry_point():
    env = dict(os.environ, COLUMNS="200")
    proc = subprocess.run(
        [sys.executable, "-m", "powerinfer", "main", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0
    for flag in (
        "--vram-budget",
        "-ngl",
        "--reset-gpu-index",
        "--disable-gpu-index",
        "--min-p",
        "--ignore-eos",
    ):
        assert flag in proc.stdout


@pytest.mark.parametrize("n_batch", [1, 3])
def test_small_batches_give_the_same_tokens(tiny_gguf: Path, n_batch: int):
    ref = Engine(tiny_gguf, EngineOptions(n_ctx=64, n_threads=1))
    ids = ref.tokenizer.encode("a longer prompt")
    want = list(ref.generate(ids, Sampler(SamplingParams(temp=0)), n_predict=8, ignore_eos=True))
    eng = Engine(tiny_gguf, EngineOptions(n_ctx=64, n_batch=n_batch, n_threads=1))
    assert list(eng.generate(ids, Sampler(SamplingParams(temp=0)), n_predict=8, ignore_eos=True)) == want


def test_engine_sets_the_activation_precision(tiny_gguf: Path):
    from powerinfer import ops

    previous = ops.set_activation_precision("f32")
    try:
        Engine(tiny_gguf, EngineOptions(n_ctx=16, act_precision="q8"))
        assert ops.set_activation_precision("f32") == "q8"
        Engine(tiny_gguf, EngineOptions(n_ctx=16))  # None: left as it is
        assert ops.set_activation_precision("f32") == "f32"
    finally:
        ops.set_activation_precision(previous)
