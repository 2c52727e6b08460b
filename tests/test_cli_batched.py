"""`powerinfer batched`: parallel greedy streams equal `main` alone; the original's positional arguments."""

from __future__ import annotations

from pathlib import Path

from conftest import random_llama_state, random_predictors, write_llama_gguf
from test_bad_input import assert_one_error_line
from typer.testing import CliRunner

from powerinfer.app.batched import BatchedOptions, run_batched
from powerinfer.cli import app
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sampling import Sampler, SamplingParams

runner = CliRunner()
PROMPTS = ["hello there", "a b c", "what is", "xyz!"]


def _model(tmp_path: Path) -> Path:
    sd = random_llama_state(n_ff=128, n_head_kv=2, seed=9)
    return write_llama_gguf(
        tmp_path / "m.powerinfer.gguf",
        sd,
        n_head=4,
        n_head_kv=2,
        act="relu",
        predictors=random_predictors(sd),
        threshold=0.0,
    )


def test_parallel_greedy_streams_equal_main(tmp_path: Path):
    path = _model(tmp_path)
    n_len = 24
    opts = BatchedOptions(
        model=path,
        prompts=tuple(PROMPTS),
        n_parallel=4,
        n_len=n_len,
        engine=EngineOptions(act_precision="f32", n_ctx=n_len, n_batch=n_len, n_threads=2, n_seq=4),
        sampling=SamplingParams(temp=0, repeat_penalty=1.0),
    )
    result = run_batched(opts)
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1))
    for i, prompt in enumerate(PROMPTS):
        ids = engine.tokenizer.encode(prompt)
        assert result.prompt_ids[i] == ids
        gen = list(
            engine.generate(
                ids, Sampler(SamplingParams(temp=0, repeat_penalty=1.0)), n_predict=n_len - len(ids)
            )
        )
        assert result.sequences[i] == gen, prompt
    assert result.n_decoded == sum(len(s) for s in result.sequences)
    # the CLI prints the original's shape
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cli = runner.invoke(
        app,
        [
            "batched",
            str(path),
            "-np",
            "4",
            "-n",
            str(n_len),
            "--prompt-file",
            str(prompts),
            "--temp",
            "0",
            "-t",
            "2",
        ],
    )
    assert cli.exit_code == 0, cli.stderr
    assert cli.stdout.startswith("params: model = ")
    assert [f"sequence {i}:" in cli.stdout for i in range(4)] == [True] * 4
    assert "main: generating 4 sequences" in cli.stderr
    assert f"main: decoded {result.n_decoded} tokens in" in cli.stderr and "speed:" in cli.stderr


def test_positional_arguments(tmp_path: Path):
    path = _model(tmp_path)
    result = runner.invoke(app, ["batched", str(path), "hello", "2", "12", "1"])
    assert result.exit_code == 0, result.stderr
    assert "n_parallel = 2, n_len = 12, n_threads = 1" in result.stdout
    assert result.stdout.count("sequence ") == 2


def test_bad_input(tmp_path: Path):
    path = _model(tmp_path)
    assert_one_error_line(runner.invoke(app, ["batched", str(path), "hi", "0"]), "PARALLEL must be >= 1")
    assert_one_error_line(
        runner.invoke(app, ["batched", str(path), "a much longer prompt here", "2", "4"]),
        "LEN 4 must be longer than the prompt",
    )
    assert_one_error_line(runner.invoke(app, ["batched", str(tmp_path / "missing.gguf")]), "no such file")
    assert_one_error_line(
        runner.invoke(app, ["batched", str(path), "--prompt-file", str(tmp_path / "none.txt")]),
        "cannot read prompt file",
    )
