"""The pool's summary (runtime.report.PoolSummary): `main`'s pool line on the CPU stand-in, and its wording."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO
from typer.testing import CliRunner

from powerinfer.cli import app
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.report import STAND_IN, PoolSummary

runner = CliRunner()
BUNDLED = REPO / "models" / "pydoc-relu-llama-8m.powerinfer.gguf"
MAIN = ("main", "-p", "def f", "-n", "4", "--temp", "0", "-t", "1", "-c", "64")
POOL_LINE = re.compile(
    r"pool: (?P<backend>[^,]+), (?P<mib>[\d.]+) MiB on cpu, (?P<plan>[\d.]+) MiB planned under a 1 GiB budget, "
    r"FFN work (?P<share>[\d.]+)% on the device"
)


def test_main_prints_the_pool_line_on_the_stand_in(tmp_path: Path):
    # the model linked into tmp_path with its activation counts: the pool's GPU index is cached beside it
    model = tmp_path / BUNDLED.name
    model.symlink_to(BUNDLED)
    (tmp_path / "activation").symlink_to(BUNDLED.parent / "activation")
    result = runner.invoke(app, [*MAIN, "-m", str(model), "--pool-device", "cpu", "--vram-budget", "1"])
    assert result.exit_code == 0, result.stderr
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("pool: ")]
    m = POOL_LINE.fullmatch(line)
    assert m is not None, line
    engine = Engine(model, EngineOptions(n_ctx=64, n_threads=1, pool_device="cpu", vram_budget_gib=1.0))
    assert m["backend"] == STAND_IN
    assert m["mib"] == f"{engine.loader.device_bytes / 2**20:.1f}"
    assert float(m["share"]) == 100.0  # a 1 GiB budget holds every neuron of the 8M model


def test_main_without_a_pool_prints_no_pool_line():
    result = runner.invoke(app, [*MAIN, "-m", str(BUNDLED)])
    assert result.exit_code == 0, result.stderr
    assert "llama_print_timings:        eval time" in result.stderr
    assert not [ln for ln in result.stderr.splitlines() if ln.startswith("pool: ")]


def test_pool_line_wording():
    hybrid = PoolSummary("CUDA+CPU", "cuda:0", 412 * 2**20, 450 * 2**20, 408 * 2**20, 2**28, 0.61)
    assert hybrid.line() == (
        "pool: CUDA+CPU, 412.0 MiB on cuda:0 (450.0 MiB allocated), 408.0 MiB planned under a 0.25 GiB budget, "
        "FFN work 61.0% on the device"
    )
    layers = PoolSummary("CUDA", "cuda:0", 600 * 2**20, 700 * 2**20, 600 * 2**20, None, 1.0)
    assert layers.line() == (
        "pool: CUDA, 600.0 MiB on cuda:0 (700.0 MiB allocated), 600.0 MiB planned, FFN work 100.0% on the device"
    )
    assert PoolSummary("CPU", None, 0, None, 0, None, 0.0).line() == "pool: CPU, no pool device"
