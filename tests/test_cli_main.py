"""`powerinfer main`: option plumbing, prompt handling and output shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fixture_dir
from typer.testing import CliRunner

import powerinfer.cli.main as cli_main
from powerinfer.cli import app
from powerinfer.gguf import GGUFWriter, read_gguf
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sampling import Sampler, SamplingParams
from powerinfer.textfile import process_escapes

runner = CliRunner()


def test_process_escapes():
    assert process_escapes(r"a\nb\tc\\d\x41\"") == 'a\nb\tc\\dA"'
    assert process_escapes(r"keep \q") == "keep \\q"


def test_options_reach_the_library(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(cli_main, "run_main", lambda opts: seen.update(opts=opts))
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
    engine = Engine(tiny_gguf, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1))
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
    ref = Engine(tiny_gguf, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1))
    ids = ref.tokenizer.encode("a longer prompt")
    want = list(ref.generate(ids, Sampler(SamplingParams(temp=0)), n_predict=8, ignore_eos=True))
    eng = Engine(tiny_gguf, EngineOptions(act_precision="f32", n_ctx=64, n_batch=n_batch, n_threads=1))
    assert list(eng.generate(ids, Sampler(SamplingParams(temp=0)), n_predict=8, ignore_eos=True)) == want


def test_engine_owns_its_activation_precision(tiny_gguf: Path):
    """The setting lives in the engine's kernel context: a later engine is not affected."""
    q8 = Engine(tiny_gguf, EngineOptions(n_ctx=16, act_precision="q8"))
    plain = Engine(tiny_gguf, EngineOptions(act_precision="f32", n_ctx=16))
    assert q8.kc.act_precision == "q8" and plain.kc.act_precision == "f32"
    assert q8.kc.n_threads >= 1


# ---------------------------------------------------------------- the original's 24-token outputs on its fixture
# Fixture README 4/5: `main -m FILE -p PROMPT -n 24 --temp 0 --top-k 1 --seed 42 --ignore-eos -t 1`, with the
# default repeat penalty 1.1 and with --repeat-penalty 1.0. key in expected.json (-t 1), the -t 2 record (its
# `all_generated_ids` keep every outcome of 3 runs), and the suffix of reference.json's sparse_ref_* entries
MAIN_FLAGS = {
    "penalty-1.1": ([], "generate_t1", "generate", "penalty_1.1"),
    "penalty-1.0": (["--repeat-penalty", "1.0"], "generate_no_repeat_penalty_t1", "generate_no_repeat_penalty",
                    "no_penalty"),
}  # fmt: skip
# README 7: "greedy ids exact up to the first step whose top-2 logit margin (reference.json) is below ~0.05"
NEAR_TIE = 0.05


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def accepted_continuations(
    expected: dict, reference: dict, model: str, flags: str, i: int
) -> list[list[int]]:
    """Every 24-token continuation of prompt i that README 7's rule for near-ties accepts.

    The original's -t 1 ids; the torch re-statement of the sparse semantics (reference.json), which leaves them
    only at a step whose top-2 logit margin is below 0.05; and each -t 2 outcome of the original that leaves them
    at such a step. At a near-tie either candidate is right, and the rest must then follow the recorded run that
    took it. A -t 2 outcome that leaves elsewhere is one of the original's thread races (README 8.1: lost updates
    in its down-projection), not an accepted branch.
    """
    _, t1_key, t2_key, ref_key = MAIN_FLAGS[flags]
    case, t2 = expected[t1_key][model][i], expected[t2_key][model][i]
    gen = reference["generation"][i]
    assert gen["prompt"] == case["prompt"] == t2["prompt"]
    original = case["generated_ids"]
    restated = gen[f"sparse_ref_{model}"][f"ids_{ref_key}"]
    margins = gen[f"sparse_ref_{model}"][f"top2_logit_margin_{ref_key}"]  # along `restated`
    branches = [original]
    step = _first_difference(restated, original)
    if step is not None:
        assert margins[step] < NEAR_TIE, (model, flags, case["prompt"], step, margins[step])
        branches.append(restated)
    for ids in t2.get("all_generated_ids", [t2["generated_ids"]]):
        step = _first_difference(ids, original)
        if step is None or ids in branches:
            continue
        shared = _first_difference(restated, ids)  # the margin is known where `restated` has the same prefix
        if (shared is None or shared >= step) and margins[step] < NEAR_TIE:
            branches.append(ids)
    return branches


@pytest.fixture(scope="module")
def original_prompt_files(tmp_path_factory) -> dict[str, Path]:
    """The fixture's sparse files with tokenizer.ggml.add_space_prefix = false: the original main tokenized -p
    without SentencePiece's leading space (README 8.2, a quirk we do not copy; test_tokenizer checks that this
    key gives its prompt ids), so with it our main continues the original's prompt ids."""
    out = {}
    folder = tmp_path_factory.mktemp("no-space-prefix")
    for model, name in (("f16", "tiny.powerinfer.gguf"), ("q4_0", "tiny.q4.powerinfer.gguf")):
        src = read_gguf(fixture_dir() / name)
        w = GGUFWriter(folder / name, sparse=src.is_sparse)
        src.copy_metadata(w)
        w.add("tokenizer.ggml.add_space_prefix", False)
        for info in src.tensors.values():
            w.add_tensor(info.name, info.data, info.ggml_type, info.shape)
        w.write()
        out[model] = folder / name
    return out


@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("flags", list(MAIN_FLAGS))
@pytest.mark.parametrize("model", ["f16", "q4_0"])
def test_fixture_outputs_match_original_main(original_prompt_files, model, flags, act):
    """The full 24-token output of `powerinfer main` (sparse, greedy) for the fixture's three prompts equals the
    original main's, except at README 7's near-ties. Measured: 10 of 12 cases equal the original -t 1 output in
    both activation precisions; the other two leave it at the Q4_0 file's near-ties (top-2 margins 0.007 and
    0.010) and then follow the torch re-statement in f32, and in q8 one takes the original's branch and the
    other leaves at an earlier near-tie (margin 0.028) into a recorded -t 2 outcome of the original."""
    fx = fixture_dir()
    expected = json.loads((fx / "expected.json").read_text())
    reference = json.loads((fx / "reference.json").read_text())
    path = original_prompt_files[model]
    tok = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1)).tokenizer
    extra, t1_key, _, _ = MAIN_FLAGS[flags]
    cases = expected[t1_key][model]
    assert len(cases) == 3
    for i, case in enumerate(cases):
        prompt = case["prompt"]
        assert tok.encode(prompt) == case["prompt_ids"]
        branches = accepted_continuations(expected, reference, model, flags, i)
        texts = [prompt + tok.decode(ids, strip_leading_space=False) for ids in branches]
        assert texts[0] == case["stdout"]["text"]  # the original's own stdout, as recorded
        result = runner.invoke(
            app,
            ["main", "-m", str(path), "-p", prompt, "-n", "24", "--temp", "0", "--top-k", "1", "--seed", "42",
             "--ignore-eos", "-t", "1", "--act-precision", act, *extra],
        )  # fmt: skip
        assert result.exit_code == 0, result.stderr
        assert result.stdout.removesuffix("\n") in texts, (prompt, result.stdout, texts)
