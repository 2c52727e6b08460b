"""`powerinfer bench`: llama-bench's value lists, run order and output formats (never the timings themselves)."""

from __future__ import annotations

import csv
import io
import json
import statistics
from pathlib import Path

import pytest
from conftest import REPO, random_llama_state, write_llama_gguf
from test_bad_input import assert_one_error_line
from typer.testing import CliRunner

import powerinfer.app.bench as app_bench
from powerinfer.bench import (
    BenchParams,
    BenchResult,
    BenchTest,
    ModelInfo,
    bench_plan,
    model_info,
    size_class,
)
from powerinfer.cli import app
from powerinfer.cli.bench import parse_values
from powerinfer.cli.options import threads
from powerinfer.errors import InputError
from powerinfer.gguf import read_gguf
from powerinfer.runtime.engine import Engine, EngineOptions

runner = CliRunner()
BUNDLED = REPO / "models" / "pydoc-relu-llama-8m.powerinfer.gguf"
# what the fake run_bench times: a test of n tokens takes n/2 s, then n/4 s (2 and 4 tokens/s)
FAKE_SAMPLES = (0.5, 0.25)
RECORD_FIELDS = {
    "powerinfer_version",
    "cpu_info",
    "gpu_info",
    "backends",
    "model_filename",
    "model_type",
    "model_size",
    "model_n_params",
    "sparse",
    "n_batch",
    "n_threads",
    "act_precision",
    "n_gpu_layers",
    "vram_budget_gib",
    "device_bytes",
    "device_allocated_bytes",
    "plan_bytes",
    "plan_budget_bytes",
    "ffn_device_share",
    "n_prompt",
    "n_gen",
    "test_time",
    "avg_ns",
    "stddev_ns",
    "avg_ts",
    "stddev_ts",
    "samples_ns",
    "samples_ts",
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    """A tiny dense F32 GGUF (no general.file_type) with a 1024-token context."""
    path = tmp_path_factory.mktemp("bench") / "tiny-dense.gguf"
    return write_llama_gguf(path, random_llama_state(), n_head=4, n_head_kv=4, n_ctx=1024)


@pytest.fixture
def fake_run(monkeypatch):
    """Replace the timed runs with fixed samples; returns what the command passed down."""
    seen: dict = {}

    def run_bench(params, options, on_progress=None):
        seen["params"], seen["options"] = params, options
        for test in bench_plan(params):
            samples = tuple(round(test.n_tokens * s * 1e9) for s in FAKE_SAMPLES)
            model = params.models[test.model]
            yield BenchResult(test, model, "CPU", "", "2024-01-02T03:04:05Z", samples)

    monkeypatch.setattr(app_bench, "run_bench", run_bench)
    return seen


def bench(*args: str):
    return runner.invoke(app, ["bench", *args])


def table_rows(stdout: str) -> list[list[str]]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("|")]
    return [[cell.strip() for cell in ln.strip("|").split("|")] for ln in lines]


# ------------------------------------------------------------------------------------------ argument handling


def test_value_lists_ranges_and_repeats():
    assert parse_values("-p", None, (512,)) == (512,)
    assert parse_values("-p", ["0,64, 512"], (512,)) == (0, 64, 512)
    assert parse_values("-t", ["1", "2,3"], (0,)) == (1, 2, 3)  # repeated flags append
    assert parse_values("-t", ["1-4"], (0,)) == (1, 2, 3, 4)
    assert parse_values("-t", ["1-8+3"], (0,)) == (1, 4, 7)
    assert parse_values("-p", ["16-128*2,7"], (0,)) == (16, 32, 64, 128, 7)
    assert parse_values("-n", ["5-5"], (0,)) == (5,)
    for text, needle in (
        ("-1", "non-negative integers"),
        ("1.5", "non-negative integers"),
        ("1,,2", "non-negative integers"),
        ("", "non-negative integers"),
        ("4-2", "ends before it starts"),
        ("1-4+0", "does not advance"),
        ("1-8*1", "does not advance"),
        ("0-8*2", "does not advance"),
        ("1-100000", "more than 1024 values"),
    ):
        with pytest.raises(InputError, match=needle):
            parse_values("-p", [text], (0,))


def test_size_class_and_model_info(dense: Path):
    assert [size_class(n) for n in (8_389_632, 134_515_008, 1_100_048_384, 70_553_706_496)] == [
        "8.4M",
        "135M",
        "1.1B",
        "71B",
    ]
    info = model_info(BUNDLED)
    gguf = read_gguf(BUNDLED)
    assert info.sparse and info.description == "llama 8.4M F16 sparse"  # predictors left out of the class
    assert info.size_bytes == sum(t.n_bytes for t in gguf.tensors.values())
    assert info.n_params == sum(t.n_elements for t in gguf.tensors.values())  # predictors counted
    assert model_info(dense).description.endswith(" all F32 (guessed)")
    assert not model_info(dense).sparse


def test_plan_is_the_cartesian_product_in_llama_bench_order():
    info = ModelInfo(Path("a.gguf"), "llama", "1B", "Q4_0", False, 1, 1, 4096, 32000)
    params = BenchParams(
        models=(info, info),
        n_prompt=(0, 16, 32),
        n_gen=(8, 0),
        n_threads=(1, 2),
        act_precision=("f32", "q8"),
        n_batch=(64,),
    )
    plan = bench_plan(params)
    assert len(plan) == 2 * 2 * 2 * 3  # models x acts x threads x (pp16, pp32, tg8)
    assert [t.name for t in plan[:6]] == ["pp16", "pp32", "tg8"] * 2
    assert [(t.model, t.act_precision, t.n_threads) for t in plan[::3]] == [
        (m, a, n) for m in (0, 1) for a in ("f32", "q8") for n in (1, 2)
    ]
    assert plan[2] == BenchTest(0, 64, "f32", 1, 0, 8)


def test_options_reach_the_library(fake_run, dense: Path):
    result = bench(
        "-m",
        str(dense),
        "-m",
        str(BUNDLED),
        "-p",
        "0,16",
        "-p",
        "32",
        "-n",
        "8",
        "-t",
        "1-2",
        "-b",
        "8",
        "-r",
        "3",
        "--act-precision",
        "f32,q8",
    )
    assert result.exit_code == 0, result.stderr
    params, options = fake_run["params"], fake_run["options"]
    assert [m.path for m in params.models] == [dense, BUNDLED]
    assert params.n_prompt == (0, 16, 32) and params.n_gen == (8,)
    assert params.n_threads == (1, 2) and params.n_batch == (8,)
    assert params.act_precision == ("f32", "q8") and params.repetitions == 3
    assert options.n_gpu_layers == 0 and options.vram_budget_gib is None


def test_defaults(fake_run, dense: Path):
    result = bench("-m", str(dense))
    assert result.exit_code == 0, result.stderr
    params = fake_run["params"]
    assert (params.n_prompt, params.n_gen, params.n_batch) == ((512,), (128,), (512,))
    assert params.n_threads == (threads(0),) and params.act_precision == ("q8",)
    assert params.repetitions == 5
    assert [row[-2] for row in table_rows(result.stdout)[2:]] == ["pp512", "tg128"]


# ------------------------------------------------------------------------------------------------ output


def test_markdown_table(fake_run, dense: Path):
    result = bench("-m", str(BUNDLED), "-m", str(dense), "-p", "4,8", "-n", "4", "-t", "1", "-r", "2")
    assert result.exit_code == 0, result.stderr
    rows = table_rows(result.stdout)
    assert rows[0] == ["model", "size", "params", "backend", "threads", "act", "test", "t/s"]
    assert all(set(cell) <= {"-", ":"} for cell in rows[1])
    assert rows[1][1].endswith(":") and not rows[1][0].endswith(":")  # numbers right, text left
    assert len(rows) == 2 + 2 * 3
    assert [row[6] for row in rows[2:]] == ["pp4", "pp8", "tg4"] * 2
    assert rows[2][:5] == ["llama 8.4M F16 sparse", "17.89 MiB", "9.37 M", "CPU", "1"]
    assert rows[5][0].startswith("llama ") and not rows[5][0].endswith("sparse")
    # samples of 2 and 4 tokens/s: mean 3, sample stddev sqrt(2)
    assert {row[7] for row in rows[2:]} == {"3.00 ± 1.41"}
    assert result.stdout.rstrip().endswith("build: powerinfer 0.1.0")
    assert len({len(ln) for ln in result.stdout.splitlines() if ln.startswith("|")}) == 1  # aligned


def test_markdown_extra_columns(fake_run):
    result = bench("-m", str(BUNDLED), "-p", "4", "-n", "0", "-t", "1", "-b", "2,4", "-r", "1")
    assert result.exit_code == 0, result.stderr
    rows = table_rows(result.stdout)
    assert rows[0][4:7] == ["threads", "n_batch", "act"]
    assert [row[5] for row in rows[2:]] == ["2", "4"]
    assert [row[-2] for row in rows[2:]] == ["pp4", "pp4"]  # -n 0: no tg rows


def test_jsonl_and_csv_from_fixed_samples(fake_run, dense: Path):
    args = ("-m", str(dense), "-p", "4", "-n", "2", "-t", "1", "-r", "2", "--act-precision", "q8")
    records = [json.loads(ln) for ln in bench(*args, "-o", "jsonl").stdout.splitlines()]
    assert [(r["n_prompt"], r["n_gen"]) for r in records] == [(4, 0), (0, 2)]
    assert records[0]["samples_ns"] == [2_000_000_000, 1_000_000_000]
    assert records[0]["samples_ts"] == [2.0, 4.0]
    assert (records[0]["avg_ns"], records[0]["avg_ts"]) == (1_500_000_000, 3.0)
    assert records[0]["stddev_ts"] == pytest.approx(2**0.5)
    assert records[0]["act_precision"] == "q8" and records[0]["test_time"] == "2024-01-02T03:04:05Z"
    rows = list(csv.DictReader(io.StringIO(bench(*args, "-o", "csv").stdout)))
    assert len(rows) == 2 and set(rows[0]) == RECORD_FIELDS
    assert rows[0]["samples_ns"] == "2000000000 1000000000"  # lists space-separated
    assert rows[0]["sparse"] == "0" and rows[1]["n_gen"] == "2"
    assert float(rows[1]["avg_ts"]) == records[1]["avg_ts"]


def test_json_records_of_a_real_run(dense: Path):
    result = bench(
        "-m", str(BUNDLED), "-m", str(dense), "-p", "4", "-n", "4", "-t", "1", "-r", "2", "-o", "json"
    )
    assert result.exit_code == 0, result.stderr
    records = json.loads(result.stdout)  # stdout holds nothing but the JSON
    assert isinstance(records, list) and len(records) == 4
    assert [(r["n_prompt"], r["n_gen"]) for r in records] == [(4, 0), (0, 4)] * 2
    assert [r["sparse"] for r in records] == [True, True, False, False]
    gguf = read_gguf(BUNDLED)
    for r in records:
        assert set(r) == RECORD_FIELDS
        assert r["n_threads"] == 1 and r["n_batch"] == 512 and r["act_precision"] == "q8"
        assert r["backends"] == "CPU" and r["gpu_info"] == ""
        assert len(r["samples_ns"]) == len(r["samples_ts"]) == 2
        n_tokens = r["n_prompt"] + r["n_gen"]
        assert r["samples_ts"] == pytest.approx([n_tokens * 1e9 / ns for ns in r["samples_ns"]])
        assert r["avg_ts"] == pytest.approx(statistics.mean(r["samples_ts"]))
        assert r["stddev_ts"] == pytest.approx(statistics.stdev(r["samples_ts"]))
        assert r["avg_ns"] == round(statistics.mean(r["samples_ns"]))
    assert records[0]["model_size"] == sum(t.n_bytes for t in gguf.tensors.values())
    assert records[0]["model_filename"] == str(BUNDLED)
    assert records[0]["model_type"] == "llama 8.4M F16 sparse"


def test_progress_goes_to_stderr(dense: Path):
    result = bench("-m", str(dense), "-p", "0", "-n", "2", "-t", "1", "-r", "1", "-o", "csv", "--progress")
    assert result.exit_code == 0, result.stderr
    assert "bench: 1/1: " in result.stderr and "tg2" in result.stderr
    assert "bench:" not in result.stdout
    (row,) = csv.DictReader(io.StringIO(result.stdout))
    assert row["n_gen"] == "2" and len(row["samples_ns"].split()) == 1 and row["stddev_ts"] == "0.0"


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("-p", "-1"), "-p -1: expected non-negative integers"),
        (("-n", "two"), "-n two"),
        (("-t", "4-2"), "ends before it starts"),
        (("-p", "1-8*1"), "does not advance"),
        (("-r", "0"), "-r 0"),
        (("-r", "1.5"), "-r 1.5"),
        (("-o", "xml"), "-o xml: expected one of md, json, jsonl, csv"),
        (("-b", "0"), "batch size"),
        (("-p", "0", "-n", "0"), "nothing to run"),
        (("--act-precision", "f32,f16"), "--act-precision f16"),
        (("-p", "4", "-n", "300"), "-n 300 is longer than the training context"),
    ],
)
def test_bad_values(args: tuple[str, ...], needle: str):
    assert_one_error_line(bench("-m", str(BUNDLED), *args), needle)


def test_bad_model_files(tmp_path: Path):
    text = tmp_path / "notes.txt"
    text.write_text("not a model\n" * 4)
    assert_one_error_line(bench("-m", str(tmp_path / "missing.gguf"), "-p", "4", "-n", "4"), "no such file")
    assert_one_error_line(bench("-m", str(BUNDLED), "-m", str(text), "-p", "4", "-n", "4"), "bad magic")
    assert_one_error_line(bench("-m", str(tmp_path), "-p", "4", "-n", "4"), "not a regular file")


# ------------------------------------------------------------------------------------------------ the pool


@pytest.fixture
def bundled(tmp_path: Path) -> Path:
    """The bundled model linked into tmp_path with its activation counts, so the GPU index the pool caches
    beside the model is written there and not into models/."""
    link = tmp_path / BUNDLED.name
    link.symlink_to(BUNDLED)
    (tmp_path / "activation").symlink_to(BUNDLED.parent / "activation")
    return link


def records_of(*args: str) -> list[dict]:
    result = bench(*args, "-o", "jsonl")
    assert result.exit_code == 0, result.stderr
    return [json.loads(ln) for ln in result.stdout.splitlines()]


@pytest.mark.parametrize("budget", ["0.01", "1"])
def test_stand_in_pool_columns_and_records(bundled: Path, budget: str):
    """--pool-device cpu: the backend says so, the bytes are the loader's, the FFN share is measured."""
    args = ("-m", str(bundled), "-p", "8", "-n", "4", "-t", "1", "-r", "1")
    pool = ("--pool-device", "cpu", "--vram-budget", budget)
    result = bench(*args, *pool)
    assert result.exit_code == 0, result.stderr
    rows = table_rows(result.stdout)
    assert rows[0][5:10] == ["act", "dev MiB", "alloc MiB", "plan MiB", "ffn dev"]
    assert [row[3] for row in rows[2:]] == ["CPU (stand-in pool)"] * 2
    assert len({len(ln) for ln in result.stdout.splitlines() if ln.startswith("|")}) == 1  # aligned
    records = records_of(*args, *pool)
    engine = Engine(
        bundled,
        EngineOptions(n_ctx=8, n_threads=1, pool_device="cpu", vram_budget_gib=float(budget)),
    )
    device_bytes = engine.loader.device_bytes
    planned = engine.placement
    assert device_bytes > 0 and planned is not None
    for r, row in zip(records, rows[2:], strict=True):
        assert r["backends"] == "CPU (stand-in pool)" and r["device_allocated_bytes"] is None
        assert r["device_bytes"] == device_bytes and r["plan_budget_bytes"] == int(float(budget) * 2**30)
        weights = planned.total_bytes - planned.bytes_by_category["reserve"] - planned.bytes_by_category["kv"]
        assert r["plan_bytes"] == weights
        assert 0.0 <= r["ffn_device_share"] <= 1.0
        assert row[6] == f"{device_bytes / 2**20:.1f}" and row[7] == "-"
        assert row[9] == f"{r['ffn_device_share']:.1%}"
    if budget == "1":  # every neuron in the pool: all the FFN work there
        assert [r["ffn_device_share"] for r in records] == [1.0, 1.0]
    else:  # some neurons: the hot ones do more than their share of the work
        n_pooled = sum(len(ids) for ids in planned.gpu_neurons)
        c = engine.config
        assert 0 < n_pooled < c.n_layer * c.n_ff
        assert all(0.0 < r["ffn_device_share"] < 1.0 for r in records)


def test_stand_in_pool_budget_zero_is_the_cpu(bundled: Path):
    records = records_of(
        "-m",
        str(bundled),
        "-p",
        "0",
        "-n",
        "2",
        "-t",
        "1",
        "-r",
        "1",
        "--pool-device",
        "cpu",
        "--vram-budget",
        "0",
    )
    (r,) = records
    assert r["backends"] == "CPU" and r["device_bytes"] == 0 and r["ffn_device_share"] == 0.0


@pytest.mark.parametrize(("ngl", "backend", "share"), [("0", "CPU", 0.0), ("1", "CPU (stand-in pool)", 0.5)])
def test_ngl_on_the_stand_in(dense: Path, ngl: str, backend: str, share: float):
    """-ngl on a dense file: the FFN share is the share of FFN weight bytes on the device (1 of 2 layers)."""
    args = ("-m", str(dense), "-p", "0", "-n", "2", "-t", "1", "-r", "1", "--pool-device", "cpu", "-ngl", ngl)
    (r,) = records_of(*args)
    gguf = read_gguf(dense)
    last = sum(t.n_bytes for name, t in gguf.tensors.items() if name.startswith("blk.1."))
    assert r["backends"] == backend and r["ffn_device_share"] == pytest.approx(share)
    assert r["plan_bytes"] == (last if ngl == "1" else 0) and r["plan_budget_bytes"] is None
    engine = Engine(dense, EngineOptions(n_ctx=2, n_threads=1, pool_device="cpu", n_gpu_layers=int(ngl)))
    assert r["device_bytes"] == engine.loader.device_bytes


def test_pool_columns_only_when_a_pool_is_asked(fake_run, dense: Path):
    plain = table_rows(bench("-m", str(dense), "-p", "4", "-n", "0", "-t", "1", "-r", "1").stdout)
    assert "dev MiB" not in plain[0]
    result = bench("-m", str(dense), "-p", "4", "-n", "0", "-t", "1", "-r", "1", "--vram-budget", "0.5")
    rows = table_rows(result.stdout)
    assert rows[0][3:] == [
        "backend",
        "threads",
        "act",
        "dev MiB",
        "alloc MiB",
        "plan MiB",
        "ffn dev",
        "test",
        "t/s",
    ]
    assert rows[2][6:10] == ["-", "-", "-", "-"]  # the fake run reports no pool
