"""Pipeline stages over torch.distributed (runtime.pipeline): pure planning, and local multi-process runs.

The multi-process tests start each rank as `python tests/pipeline_program.py` (or the CLI) with the variables
torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); one test goes through torchrun itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from powerinfer.arch import load_config
from powerinfer.cli import app
from powerinfer.errors import InputError
from powerinfer.gguf.reader import read_gguf
from powerinfer.model.batch import StepBatch
from powerinfer.runtime.engine import Engine
from powerinfer.runtime.pipeline import (
    DistEnv,
    PipelineOptions,
    balance,
    parse_split,
    plan_stages,
    stage_view,
)
from tests.conftest import REPO, fixture_dir, smollm2_path
from tests.pipeline_program import compute, engine_options

PROGRAM = REPO / "tests" / "pipeline_program.py"
TIMEOUT = 120  # seconds any multi-process test may take before it counts as a hang


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
    )
    return env


def start_ranks(world: int, argv: list[str]) -> list[subprocess.Popen[str]]:
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, *argv],
            env=rank_env(r, world, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]


def finish(procs: list[subprocess.Popen[str]], timeout: float = TIMEOUT) -> list[tuple[int, str, str]]:
    out = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a rank hung") from None
        out.append((p.returncode, stdout, stderr))
    return out


def run_program(tmp_path: Path, world: int, spec: dict) -> dict[str, torch.Tensor]:
    spec = {**spec, "out": str(tmp_path / "rank0.pt")}
    results = finish(start_ranks(world, [str(PROGRAM), json.dumps(spec)]))
    for rank, (rc, _, stderr) in enumerate(results):
        assert rc == 0, f"rank {rank} failed:\n{stderr[-3000:]}"
    return torch.load(spec["out"])


def single(spec: dict) -> dict[str, torch.Tensor]:
    engine = Engine(spec["model"], engine_options(spec, pipeline=False))
    return compute(engine, spec)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got["ids"].tolist() == want["ids"].tolist()
    torch.testing.assert_close(got["logits"], want["logits"], rtol=0, atol=1e-5)
    assert abs(float(got["ppl"]) - float(want["ppl"])) <= 1e-5 * float(want["ppl"])
    if "batched" in want:
        torch.testing.assert_close(got["batched"], want["batched"], rtol=0, atol=1e-5)
        assert got["batched"].argmax(-1).tolist() == want["batched"].argmax(-1).tolist()


def options(world: int, split: tuple[int, ...] | None = None) -> PipelineOptions:
    return PipelineOptions(DistEnv(0, world, "127.0.0.1", 29500), split)


# ---------------------------------------------------------------------------------------------------- planning
def test_balance_minimises_the_largest_stage() -> None:
    assert balance([1, 1, 1, 1], 2) == (2, 2)
    assert balance([4, 1, 1, 1, 1], 2) == (1, 4)
    assert balance([1, 1, 1, 1], 2, first_extra=2) == (1, 3)  # rank 0 also computes the head
    assert balance([5, 5, 5], 3) == (1, 1, 1)
    assert sum(balance([3, 1, 4, 1, 5, 9, 2, 6], 3)) == 8


def test_bad_splits_are_refused_with_one_line() -> None:
    gguf = read_gguf(fixture_dir() / "tiny.dense.gguf")
    config = load_config(gguf)  # 4 layers
    assert [r for r in plan_stages(options(2, (1, 3)), gguf, config)] == [range(0, 1), range(1, 4)]
    with pytest.raises(InputError, match="5 pipeline stages .* only 4 layers"):
        plan_stages(options(5), gguf, config)
    with pytest.raises(InputError, match="covers 3 layers, the model has 4"):
        plan_stages(options(2, (1, 2)), gguf, config)
    with pytest.raises(InputError, match="gives 3 stages, but WORLD_SIZE is 2"):
        plan_stages(options(2, (1, 1, 2)), gguf, config)
    with pytest.raises(InputError, match="at least one layer"):
        parse_split("4,0")


def test_stage_view_holds_only_its_layers() -> None:
    gguf = read_gguf(fixture_dir() / "tiny.powerinfer.gguf")
    config = load_config(gguf)
    view, stage_config = stage_view(gguf, config, range(1, 3))
    assert stage_config.n_layer == 2
    layers = {name.split(".")[1] for name in view.tensors if name.startswith("blk.")}
    assert layers == {"0", "1"}
    assert view.tensors["blk.0.ffn_up.weight"] is gguf.tensors["blk.1.ffn_up.weight"]
    assert "output.weight" in view.tensors and view.is_sparse


def test_micro_batches_cut_whole_sequences() -> None:
    from powerinfer.runtime.pipeline import Pipeline

    pipe = object.__new__(Pipeline)
    pipe.n_micro = 2
    batch = StepBatch.build([0, 1, 2, 3, 3, 3], [5, 6, 7, 8, 9, 10], [4, 9, 2, 0, 1, 2])
    parts = pipe._parts(batch)
    assert [p.seq_ids.tolist() for p in parts] == [[0, 1, 2], [3, 3, 3]]
    assert [p.positions.tolist() for p in parts] == [[4, 9, 2], [0, 1, 2]]
    one = StepBatch.build([0, 0], [1, 2], [0, 1])
    assert pipe._parts(one) == [one]


# ---------------------------------------------------------------------------------------------------- errors
def test_cli_wrong_split_is_one_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    model = fixture_dir() / "tiny.dense.gguf"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for split, message in (("1,2", "covers 3 layers"), ("1,1,2", "gives 3 stages")):
        result = CliRunner().invoke(
            app, ["main", "-m", str(model), "-p", "a", "-n", "1", "--pipeline-split", split]
        )
        assert result.exit_code == 1
        lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and message in lines[0]


def test_cli_unreachable_master_ends_within_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    model = fixture_dir() / "tiny.dense.gguf"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody listens there
    t0 = time.monotonic()
    result = CliRunner().invoke(app, ["main", "-m", str(model), "-p", "a", "--dist-timeout", "2"])
    assert time.monotonic() - t0 < 30
    assert result.exit_code == 1
    lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "rank 1: cannot reach the master 127.0.0.1" in lines[0], result.output


@pytest.mark.slow
def test_killed_rank_ends_every_other_rank_with_one_error_line() -> None:
    """3 stages decoding; the middle rank is killed mid-generation; ranks 0 and 2 exit 1 with one error line
    naming rank 1, well within --dist-timeout."""
    model = fixture_dir() / "tiny.dense.gguf"
    argv = ["-m", "powerinfer", "main", "-m", str(model), "-p", "Once", "-n", "100000", "--ignore-eos"]
    argv += ["-c", "256", "-t", "1", "--temp", "0", "--dist-timeout", "30", "--log-disable"]
    procs = start_ranks(3, argv)
    assert procs[0].stdout is not None
    os.set_blocking(procs[0].stdout.fileno(), False)
    deadline, seen = time.monotonic() + TIMEOUT, b""
    while len(seen) < 20 and time.monotonic() < deadline and procs[0].poll() is None:
        try:
            seen += os.read(procs[0].stdout.fileno(), 4096)
        except BlockingIOError:
            time.sleep(0.05)
    assert len(seen) >= 20, "no generation before the kill"
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    results = finish(procs, timeout=60)
    assert time.monotonic() - t0 < 30
    for rank in (0, 2):
        rc, _, stderr = results[rank]
        lines = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
        assert rc == 1 and len(lines) == 1, (rank, stderr[-2000:])
        assert "pipeline rank 1 " in lines[0] and "connection closed" in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------------- equality
@pytest.mark.slow
def test_smollm2_two_stages_equal_single_process(tmp_path: Path) -> None:
    spec = {"model": str(smollm2_path()), "n_ctx": 64, "n_seq": 3, "n_predict": 4}
    want = single(spec)
    got = run_program(tmp_path, 2, spec)
    assert_same(got, want)
    assert int(got["ring_bytes"]) > 0


@pytest.mark.slow
def test_sparse_fixture_three_stages_with_a_pool_equal_single_process(tmp_path: Path) -> None:
    """The PWRI file (predictors) over 3 ranks, rank 1 with a CPU stand-in pool under its own budget."""
    spec = {"model": str(fixture_dir() / "tiny.powerinfer.gguf"), "n_seq": 4, "pool": {"1": 0.001}}
    want = single(spec)
    got = run_program(tmp_path, 3, {**spec, "split": "1,2,1"})
    assert_same(got, want)
    pools = [torch.load(tmp_path / f"rank0.pt.rank{r}")["pool_bytes"] for r in (1, 2)]
    assert pools[0] > 0 and pools[1] == 0  # only rank 1 planned a pool, for its own 2 layers


@pytest.mark.slow
def test_torchrun_perplexity_and_greedy_text_equal_single_process(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    model = fixture_dir() / "tiny.powerinfer.gguf"
    text = fixture_dir() / "text.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    common = [
        "-m",
        "powerinfer",
        "perplexity",
        "-m",
        str(model),
        "-f",
        str(text),
        "-c",
        "64",
        "--chunks",
        "3",
    ]
    common += ["-t", "1", "--act-precision", "f32", "--log-disable"]
    single_run = subprocess.run(
        [sys.executable, *common], env=env, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert single_run.returncode == 0, single_run.stderr
    port = free_port()
    launch = [torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    launch += ["--master-port", str(port), "--no-python", sys.executable]
    piped = subprocess.run([*launch, *common], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert piped.returncode == 0, piped.stderr[-3000:]
    want = [ln for ln in single_run.stdout.splitlines() if ln.startswith("Final estimate")]
    got = [ln for ln in piped.stdout.splitlines() if ln.startswith("Final estimate")]
    assert want and got == want
