"""Mutation fuzzing of model files (scripts/fuzz_gguf.py): seeded hypothesis mutations of valid GGUF and PowerInfer
files run through read_gguf, Engine construction and one decode step in a worker subprocess under an address-space
cap; only PowerInferError may come out, and a crash or hang of the worker is detected and attributed to its case.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("hypothesis")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_gguf.py"
FAILURES = ("unexpected", "bad_message", "timeout", "hang", "crash")


def run_fuzz(tmp_path: Path, *args: str, timeout: float = 600) -> dict[str, Any]:
    """The script's JSON summary (its last stdout line)."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", "--workdir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_fuzz_2000_cases(tmp_path: Path):
    """2,000 cases of seed 0 (about 20 s on two cores): every one ends normally or in a clean one-line error."""
    summary = run_fuzz(tmp_path, "--cases", "2000", "--seed", "0")
    failures = summary["failures"]
    report = "\n".join(json.dumps(f) for f in failures[:10])
    assert failures == [], f"{len(failures)} failing cases (replay one with --replay CASE):\n{report}"
    outcomes = summary["outcomes"]
    assert summary["cases"] == 2000 and outcomes.get("ok", 0) + outcomes.get("clean", 0) == 2000
    assert not any(outcomes.get(kind) for kind in FAILURES)
    # the mutations get past the reader: into the config and shape checks, and through the decode step
    assert outcomes["ok"] >= 100, outcomes
    classes = summary["clean_classes"]
    assert sum(n for c, n in classes.items() if "has shape" in c) >= 50, classes
    assert any(c.startswith("ConfigError") for c in classes), classes
    assert any("unknown ggml type" in c for c in classes), classes


def test_harness_reports_crashes_and_hangs_with_their_case(tmp_path: Path):
    """A worker that dies by a signal or stops answering is reported with the case it was running, and the
    remaining cases still run in a fresh worker."""
    n_kv_smashed = {"base": "dense", "ops": [["set", 16, 8, 2**64 - 1]], "n_ctx": 64, "dense_ffn": False}
    crash = {"base": "dense", "ops": [["selftest_crash"]], "n_ctx": 64, "dense_ffn": False}
    hang = {"base": "sparse", "ops": [["selftest_hang"]], "n_ctx": 64, "dense_ffn": False}
    harmless = {"base": "sparse_q4", "ops": [], "n_ctx": 0, "dense_ffn": True}
    cases = [n_kv_smashed, crash, hang, harmless]
    summary = run_fuzz(
        tmp_path, "--replay", json.dumps(cases), "--case-timeout", "1", "--hang-grace", "2", timeout=300
    )
    assert summary["cases"] == 4
    assert summary["outcomes"] == {"clean": 1, "crash": 1, "hang": 1, "ok": 1}
    assert list(summary["clean_classes"]) == [
        "FormatError: FILE: corrupt header: N tensors and N metadata pairs cannot fit in N bytes"
    ]
    by_kind = {f["outcome"]: f for f in summary["failures"]}
    assert by_kind["crash"]["case"] == crash and by_kind["crash"]["index"] == 1
    assert by_kind["crash"]["returncode"] == -11  # SIGSEGV
    assert any("Segmentation fault" in line for line in by_kind["crash"]["stderr"])  # faulthandler's report
    assert by_kind["hang"]["case"] == hang and by_kind["hang"]["index"] == 2
    assert summary["restarts"] == 2
