"""The kernels off x86-64: the scalar variant alone must build and pass its C tests, and Python must never ask
for an x86 variant on another CPU.

The full check (a cross-compiled aarch64 build run under qemu, its results compared bit for bit with x86-64's) is
scripts/check_aarch64.sh; here, on any machine with a C compiler, the build other CPUs get (-DPI_SCALAR_ONLY, the
same preprocessor branch as aarch64) is compiled and kernels/tests/scalar_kernels_test.c run against it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from powerinfer.ops import library

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "kernels" / "cpu"
FLAGS = ["-std=c11", "-fopenmp", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror", f"-I{KERNELS}"]


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    return cc


def test_isa_ceiling_is_scalar_off_x86_64():
    assert library.isa_ceiling("x86_64") == library.isa_ceiling("AMD64") == len(library.ISA_NAMES) - 1
    for machine in ("aarch64", "arm64", "armv7l", "ppc64le", "riscv64", "s390x", "i686", ""):
        assert library.isa_ceiling(machine) == 0, machine


def test_loaded_library_within_the_ceiling():
    lib = library.load()
    if lib is None:
        pytest.skip("kernels not built")
    import platform

    assert 0 <= lib.isa_best <= library.isa_ceiling(platform.machine())


def test_immintrin_only_behind_the_isa_guard():
    """<immintrin.h> is included in one place, inside `#if PI_X86` (simd_variants.h); the x86 bodies (*_x86.h,
    attention_body.h's SIMD part) are reached only through it."""
    includes = {
        p.name
        for p in KERNELS.iterdir()
        if re.search(r"#\s*include\s*<(imm|x86|[a-z]mm)intrin\.h>", p.read_text())
    }
    assert includes == {"simd_variants.h"}
    text = (KERNELS / "simd_variants.h").read_text()
    assert text.index("#if PI_X86") < text.index("#include <immintrin.h>") < text.index("#endif")
    for p in KERNELS.glob("*.c"):
        assert not re.search(r'#\s*include\s*"\w+_x86\.h"', p.read_text()), p.name


@pytest.mark.slow
def test_scalar_only_build_passes_the_c_tests(tmp_path):
    """The kernels as a CPU other than x86-64 gets them (no AVX variant, nothing from <immintrin.h>), with
    warnings as errors, and the scalar kernel tests (llama.cpp's K-quant blocks included) passing on that build."""
    cc = compiler()
    exe = tmp_path / "scalar_kernels_test"
    sources = [str(p) for p in sorted(KERNELS.glob("*.c"))]
    cmd = [cc, *FLAGS, "-O1", "-DPI_SCALAR_ONLY", *sources, str(REPO / "kernels/tests/scalar_kernels_test.c")]
    build = subprocess.run([*cmd, "-lm", "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    golden = tmp_path / "golden"
    zipfile.ZipFile(REPO / "tests/data/kquant_golden.npz").extractall(golden)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    run = subprocess.run([str(exe), str(golden)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:]
    assert "best SIMD level of this build and CPU: 0" in run.stdout
    assert run.stdout.count("digest ") == 85
    assert "0 of 145 rows differ" in run.stdout and run.stdout.rstrip().endswith(
        "all scalar kernel checks passed"
    )


# ------------------------------------------------------------------------------------------ a clone elsewhere


@pytest.mark.parametrize(
    ("env", "outcome"),
    [
        ({}, pytest.skip.Exception),  # a clone without ../shared: skip
        ({"CI": "true"}, pytest.fail.Exception),  # the project's CI must have it
        ({"CI": "true", "POWERINFER_NO_SHARED": "1"}, pytest.skip.Exception),  # a GitHub runner (ci.yml)
    ],
)
def test_missing_shared_fixtures_skip_on_a_clone_and_fail_in_ci(monkeypatch, tmp_path, env, outcome):
    import conftest

    monkeypatch.setattr(conftest, "FIXTURE", tmp_path / "fixtures" / "tiny-relu-llama")
    for name in ("CI", "POWERINFER_NO_SHARED"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(outcome):
        conftest.fixture_dir()
    (tmp_path / "fixtures" / "tiny-relu-opt").mkdir(parents=True)
    assert conftest.fixture_dir("tiny-relu-opt") == tmp_path / "fixtures" / "tiny-relu-opt"


def test_the_github_workflow_declares_its_missing_shared_data():
    """A GitHub runner has no ../shared and sets CI=true: the workflow says so, or every fixture test fails."""
    workflow = REPO / ".github" / "workflows" / "ci.yml"
    if not workflow.is_file():
        pytest.skip("no GitHub workflow")
    assert re.search(r"POWERINFER_NO_SHARED:\s*\"?1\"?", workflow.read_text())
