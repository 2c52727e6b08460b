#!/usr/bin/env python3
"""The acceptance table of the GPU check (issue 47) from the result folder scripts/gpu_check.sh fills.

Reads, where present: meta.env (KEY=value lines), steps.tsv (step, exit code, seconds, note), cuda_tests.txt
(pytest -v output), bench_<run>.jsonl (`powerinfer bench -o jsonl`; runs in BENCH_RUNS), main_<run>.txt
(`main` stdout; runs in GREEDY), bench_pool_kernels.txt (rows starting with "| "). A missing input gives "-"
in its cells, never an error: the table prints whatever the check got to. Markdown on stdout.

Usage: python scripts/gpu_table.py RESULTS_DIR
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# bench runs: name -> what it runs (the check's flags, for the details table)
BENCH_RUNS = {
    "cpu": "sparse, CPU only",
    "vb0": "sparse --vram-budget 0",
    "vb2": "sparse --vram-budget 2",
    "vb025": "sparse --vram-budget 0.25",
    "dense_cpu": "dense, CPU only",
    "ngl99": "dense -ngl 99",
    "ngl9": "dense -ngl 9",
}
# greedy comparisons: (label, reference run, run)
GREEDY = (
    ("sparse --vram-budget 2", "sparse_cpu", "sparse_vb2"),
    ("sparse --vram-budget 0.25", "sparse_cpu", "sparse_vb025"),
    ("dense -ngl 99", "dense_cpu", "dense_ngl99"),
    ("dense -ngl 9", "dense_cpu", "dense_ngl9"),
)
PYTEST_SUMMARY = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")
PYTEST_OUTCOME = re.compile(r"::\S+ (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def read_meta(folder: Path) -> dict[str, str]:
    path = folder / "meta.env"
    if not path.is_file():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text(errors="replace").splitlines() if "=" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def read_bench(folder: Path) -> dict[str, dict[str, dict]]:
    """run -> test name (pp64, tg64, ...) -> its bench record."""
    runs: dict[str, dict[str, dict]] = {}
    for run in BENCH_RUNS:
        path = folder / f"bench_{run}.jsonl"
        if not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            name = f"pp{record['n_prompt']}" if record.get("n_prompt") else f"tg{record.get('n_gen')}"
            runs.setdefault(run, {})[name] = record
    return runs


@dataclass(frozen=True)
class PytestCounts:
    passed: int
    failed: int
    errors: int
    skipped: int
    complete: bool  # pytest printed its summary line (it was not stopped by the timeout)


def read_pytest(folder: Path) -> PytestCounts | None:
    """The counts of pytest's closing line, else (a run cut short) those of its per-test lines."""
    path = folder / "cuda_tests.txt"
    if not path.is_file():
        return None
    text = path.read_text(errors="replace")
    for line in reversed(text.splitlines()):
        if " in " in line and PYTEST_SUMMARY.search(line):
            counts = {word.rstrip("s"): int(n) for n, word in PYTEST_SUMMARY.findall(line)}
            return PytestCounts(
                counts.get("passed", 0),
                counts.get("failed", 0),
                counts.get("error", 0),
                counts.get("skipped", 0),
                True,
            )
    outcomes = PYTEST_OUTCOME.findall(text)
    if not outcomes:
        return None
    return PytestCounts(
        outcomes.count("PASSED"),
        outcomes.count("FAILED"),
        outcomes.count("ERROR"),
        outcomes.count("SKIPPED"),
        False,
    )


def speed(runs: dict[str, dict[str, dict]], run: str, test: str) -> float | None:
    record = runs.get(run, {}).get(test)
    if record is None:
        return None
    value = record.get("avg_ts")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def tps(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} tok/s"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def versus(a: float | None, b: float | None, unit: str = "") -> str:
    """ "A / B = R" of two speeds, as much of it as was measured."""
    if a is None and b is None:
        return "-"
    r = ratio(a, b)
    return f"{tps(a)} / {tps(b)}" + ("" if r is None else f" = {r:.2f}{unit}")


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else "pass" if ok else "FAIL"


def at_least(value: float | None, bound: float) -> bool | None:
    return None if value is None else value >= bound


def same_output(folder: Path, reference: str, run: str) -> bool | None:
    """Whether two `main` runs printed the same bytes (None when one is missing or printed nothing)."""
    a, b = folder / f"main_{reference}.txt", folder / f"main_{run}.txt"
    if not a.is_file() or not b.is_file() or a.stat().st_size == 0 or b.stat().st_size == 0:
        return None
    return a.read_bytes() == b.read_bytes()


def kernel_rows(folder: Path) -> list[str] | None:
    path = folder / "bench_pool_kernels.txt"
    if not path.is_file():
        return None
    return [line.rstrip() for line in path.read_text(errors="replace").splitlines() if line.startswith("| ")]


def acceptance(folder: Path, runs: dict[str, dict[str, dict]], long: str) -> list[str]:
    """The rows of issue 47's table: check, measured, bound, result."""
    rows = []
    tests = read_pytest(folder)
    if tests is None:
        rows.append(("1", "`pytest -m cuda`", "-", "0 failed, 0 errors", "-"))
    else:
        cut = "" if tests.complete else " (cut short by its timeout)"
        measured = f"{tests.passed} passed, {tests.failed} failed, {tests.errors} errors, {tests.skipped} skipped{cut}"
        ok = tests.complete and tests.failed == 0 and tests.errors == 0 and tests.passed > 0
        rows.append(("1", "`pytest -m cuda`", measured, "0 failed, 0 errors", verdict(ok)))
    cpu, vb0 = speed(runs, "cpu", "tg64"), speed(runs, "vb0", "tg64")
    measured, r = versus(vb0, cpu), ratio(vb0, cpu)
    rows.append(
        (
            "2",
            "sparse decode: `--vram-budget 0` (nothing pooled) / CPU only",
            measured,
            ">= 0.95",
            verdict(at_least(r, 0.95)),
        )
    )
    tg99, pp99 = speed(runs, "ngl99", "tg64"), speed(runs, "ngl99", long)
    rows.append(
        ("3a", "dense twin `-ngl 99` decode", tps(tg99), ">= 600 tok/s", verdict(at_least(tg99, 600)))
    )
    rows.append(
        (
            "3b",
            f"dense twin `-ngl 99` prompt ({long})",
            tps(pp99),
            ">= 10000 tok/s",
            verdict(at_least(pp99, 10000)),
        )
    )
    tg2, pp2 = speed(runs, "vb2", "tg64"), speed(runs, "vb2", long)
    rows.append(("3c", "sparse `--vram-budget 2` (all pooled) decode", tps(tg2), "reported", "-"))
    rows.append(("3d", f"sparse `--vram-budget 2` prompt ({long})", tps(pp2), "reported", "-"))
    hybrid, ngl9 = speed(runs, "vb025", "tg64"), speed(runs, "ngl9", "tg64")
    measured, r = versus(hybrid, cpu, "x"), ratio(hybrid, cpu)
    rows.append(
        (
            "4a",
            "hybrid decode: sparse `--vram-budget 0.25` / CPU only",
            measured,
            ">= 1.5x",
            verdict(at_least(r, 1.5)),
        )
    )
    measured, r = versus(hybrid, ngl9, "x"), ratio(hybrid, ngl9)
    rows.append(
        (
            "4b",
            "hybrid decode: sparse `--vram-budget 0.25` / dense `-ngl 9`",
            measured,
            ">= 2x",
            verdict(at_least(r, 2.0)),
        )
    )
    kernels = kernel_rows(folder)
    measured = (
        "scripts/bench_pool_kernels.py absent or not run"
        if kernels is None
        else f"{len(kernels)} table lines (below)"
    )
    rows.append(("5", "pool kernels (`scripts/bench_pool_kernels.py`)", measured, "its own", "-"))
    for label, reference, run in GREEDY:
        same = same_output(folder, reference, run)
        measured = "-" if same is None else "same text" if same else "differs"
        rows.append(
            (
                "6",
                f"greedy `main --temp 0 --act-precision f32 -n 32`: {label} = CPU",
                measured,
                "equal",
                verdict(same),
            )
        )
    out = ["| # | check | measured | bound | result |", "|---|---|---|---|---|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def details(runs: dict[str, dict[str, dict]], long: str) -> list[str]:
    """Every bench run: backend, the pool's bytes and FFN share, speeds."""
    out = [
        f"| run | backend | dev MiB | alloc MiB | plan MiB | FFN on device | pp64 | {long} | tg64 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run, label in BENCH_RUNS.items():
        tests = runs.get(run)
        if not tests:
            out.append(f"| {label} | - | - | - | - | - | - | - | - |")
            continue
        record = tests.get("tg64") or next(iter(tests.values()))

        def mib(key: str, record: dict = record) -> str:
            value = record.get(key)
            return "-" if not isinstance(value, (int, float)) else f"{value / 2**20:.1f}"

        share = record.get("ffn_device_share")
        cells = [
            label,
            str(record.get("backends", "-")),
            mib("device_bytes"),
            mib("device_allocated_bytes"),
            mib("plan_bytes"),
            "-" if not isinstance(share, (int, float)) else f"{share:.1%}",
            *(f"{v:.1f}" if (v := speed(runs, run, t)) is not None else "-" for t in ("pp64", long, "tg64")),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return out


def steps(folder: Path) -> list[str]:
    path = folder / "steps.tsv"
    if not path.is_file():
        return []
    out = ["| step | exit | seconds | note |", "|---|---:|---:|---|"]
    for line in path.read_text(errors="replace").splitlines():
        cells = (line.split("\t") + ["", "", "", ""])[:4]
        out.append("| " + " | ".join(cells) + " |")
    return out


def table(folder: Path) -> str:
    """The whole report: header, acceptance rows, bench details, kernel rows, steps."""
    meta = read_meta(folder)
    runs = read_bench(folder)
    long = f"pp{meta.get('long_prompt', '512')}"
    pool = meta.get("pool", "-")
    head = (
        f"GPU check {meta.get('date', '-')}, tree {meta.get('tree', '-')}: {meta.get('gpu', '-')}, "
        f"{meta.get('cpu', '-')} ({meta.get('cores', '-')} cores), Python {meta.get('python', '-')}, "
        f"torch {meta.get('torch', '-')}, Triton {meta.get('triton', '-')}; model {meta.get('shape', '-')} Q4_0, "
        f"bench -p 64 -n 64 -r 3 -t {meta.get('threads', '-')}; pool device: {pool}"
    )
    lines = [head, ""]
    if pool == "cpu":
        lines += ["The pool is the CPU standing in for a GPU: the bounds are for CUDA.", ""]
    elif pool == "none":
        lines += ["No CUDA device: the rows that need one are `-`.", ""]
    lines += acceptance(folder, runs, long)
    lines += ["", *details(runs, long)]
    kernels = kernel_rows(folder)
    if kernels:
        lines += ["", "Pool kernels (scripts/bench_pool_kernels.py):", "", *kernels]
    step_lines = steps(folder)
    if step_lines:
        lines += ["", *step_lines]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.exit(__doc__)
    sys.stdout.write(table(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
