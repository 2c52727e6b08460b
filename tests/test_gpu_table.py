"""scripts/gpu_table.py: the GPU check's acceptance table from a result folder (no GPU needed)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import load_script

gpu_table = load_script("gpu_table")

# run -> {test: tokens/s}; the 0.25 GiB hybrid decodes 1.6x the CPU and 2.5x dense -ngl 9
SPEEDS = {
    "cpu": {"pp64": 230.0, "tg64": 100.0},
    "vb0": {"pp64": 220.0, "tg64": 96.0},
    "vb2": {"pp64": 900.0, "pp512": 5000.0, "tg64": 400.0},
    "vb025": {"pp64": 180.0, "tg64": 160.0},
    "ngl99": {"pp64": 1400.0, "pp512": 12000.0, "tg64": 550.0},
    "ngl9": {"pp64": 500.0, "tg64": 64.0},
}


def write_results(folder: Path, pytest_text: str) -> Path:
    folder.mkdir()
    (folder / "meta.env").write_text(
        "date=2026-12-04\ntree=abc1234\ngpu=NVIDIA H200, 143771 MiB\npool=cuda\n"
    )
    for run, tests in SPEEDS.items():
        lines = []
        for name, tps in tests.items():
            n = int(name[2:])
            record = {
                "n_prompt": n if name.startswith("pp") else 0,
                "n_gen": n if name.startswith("tg") else 0,
                "avg_ts": tps,
                "backends": "CUDA+CPU" if run == "vb025" else "CPU",
                "device_bytes": 300 * 2**20 if run == "vb025" else 0,
                "device_allocated_bytes": 320 * 2**20 if run == "vb025" else None,
                "plan_bytes": 298 * 2**20 if run == "vb025" else 0,
                "ffn_device_share": 0.61 if run == "vb025" else 0.0,
            }
            lines.append(json.dumps(record))
        (folder / f"bench_{run}.jsonl").write_text("\n".join(lines) + "\n")
    for run in ("sparse_cpu", "sparse_vb2", "sparse_vb025", "dense_cpu", "dense_ngl99"):
        text = "jumps over\n" if run != "sparse_vb025" else "jumps under\n"
        (folder / f"main_{run}.txt").write_text(text)
    (folder / "main_dense_ngl9.txt").write_text("")  # a run that printed nothing: not compared
    (folder / "cuda_tests.txt").write_text(pytest_text)
    (folder / "bench_pool_kernels.txt").write_text("header\n| Q4_0 | 1 | 201 |\n| Q8_0 | 1 | 318 |\nend\n")
    return folder


def rows_by_check(text: str) -> dict[str, list[str]]:
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and ln.count("|") == 6]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in rows]
    return {f"{c[0]} {c[1]}": c[2:] for c in cells[1:]}


def test_acceptance_rows(tmp_path: Path):
    summary = "tests/test_cuda.py::test_a PASSED\n===== 2 failed, 49 passed, 1 error, 3 skipped, 134 deselected in 123.34s ====="
    text = gpu_table.table(write_results(tmp_path / "r", summary))
    assert text.startswith("GPU check 2026-12-04, tree abc1234: NVIDIA H200, 143771 MiB,")
    rows = rows_by_check(text)
    assert rows["1 `pytest -m cuda`"] == [
        "49 passed, 2 failed, 1 errors, 3 skipped",
        "0 failed, 0 errors",
        "FAIL",
    ]
    row2 = next(v for k, v in rows.items() if k.startswith("2 "))
    assert row2 == ["96.0 tok/s / 100.0 tok/s = 0.96", ">= 0.95", "pass"]
    assert rows["3a dense twin `-ngl 99` decode"] == ["550.0 tok/s", ">= 600 tok/s", "FAIL"]
    assert rows["3b dense twin `-ngl 99` prompt (pp512)"] == ["12000.0 tok/s", ">= 10000 tok/s", "pass"]
    assert rows["3d sparse `--vram-budget 2` prompt (pp512)"][0] == "5000.0 tok/s"
    hybrid = [v for k, v in rows.items() if k.startswith("4")]
    assert hybrid == [
        ["160.0 tok/s / 100.0 tok/s = 1.60x", ">= 1.5x", "pass"],
        ["160.0 tok/s / 64.0 tok/s = 2.50x", ">= 2x", "pass"],
    ]
    greedy = [v[0] + " " + v[2] for k, v in rows.items() if k.startswith("6 ")]
    assert greedy == ["same text pass", "differs FAIL", "same text pass", "- -"]
    assert "| Q4_0 | 1 | 201 |" in text and "2 table lines (below)" in text
    assert (
        "| sparse --vram-budget 0.25 | CUDA+CPU | 300.0 | 320.0 | 298.0 | 61.0% | 180.0 | - | 160.0 |" in text
    )


def test_pytest_cut_short_counts_its_lines(tmp_path: Path):
    lines = [f"tests/test_cuda.py::test_{i} {'PASSED' if i % 3 else 'FAILED'} [ {i}%]" for i in range(1, 8)]
    counts = gpu_table.read_pytest(write_results(tmp_path / "r", "\n".join(lines)))
    assert counts == gpu_table.PytestCounts(passed=5, failed=2, errors=0, skipped=0, complete=False)
    text = gpu_table.table(tmp_path / "r")
    assert rows_by_check(text)["1 `pytest -m cuda`"][0].endswith("(cut short by its timeout)")


def test_an_empty_folder_gives_dashes(tmp_path: Path):
    text = gpu_table.table(tmp_path)
    rows = rows_by_check(text)
    assert len(rows) == 13 and {v[2] for v in rows.values()} == {"-"}
    assert rows["1 `pytest -m cuda`"][0] == "-"
