"""Bad input gets one clear error line on stderr and exit code 1, never a traceback."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_one_error_line as assert_cli_error
from conftest import random_llama_state, write_llama_gguf
from typer.testing import CliRunner

from powerinfer.cli import app
from powerinfer.errors import ConfigError, FormatError
from powerinfer.gguf import read_gguf

runner = CliRunner()


def run_main(model: Path, *args: str):
    return runner.invoke(app, ["main", "-m", str(model), "-n", "4", "--temp", "0", *args])


def assert_one_error_line(result, *needles: str) -> None:
    assert_cli_error(result, *needles)
    assert result.exception is None or isinstance(result.exception, SystemExit)


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def test_truncated_header(tiny_gguf: Path):
    tiny_gguf.write_bytes(tiny_gguf.read_bytes()[:200])
    with pytest.raises(FormatError, match="truncated"):
        read_gguf(tiny_gguf)
    assert_one_error_line(run_main(tiny_gguf, "-p", "hi"), "truncated")


def test_tensor_data_past_end(tiny_gguf: Path):
    tiny_gguf.write_bytes(tiny_gguf.read_bytes()[:-4096])
    assert_one_error_line(run_main(tiny_gguf, "-p", "hi"), "runs past the end of the file")


def test_wrong_magic(tiny_gguf: Path):
    _patch(tiny_gguf, 0, b"GGML")
    assert_one_error_line(run_main(tiny_gguf, "-p", "hi"), "bad magic", "GGML")


def test_missing_required_key(tmp_path: Path):
    path = write_llama_gguf(
        tmp_path / "m.gguf", random_llama_state(), n_head=4, n_head_kv=4, skip_keys=("llama.block_count",)
    )
    with pytest.raises(ConfigError, match="llama.block_count"):
        from powerinfer.arch import load_config

        load_config(read_gguf(path))
    assert_one_error_line(run_main(path, "-p", "hi"), "missing required metadata key", "llama.block_count")


def test_unknown_architecture(tmp_path: Path):
    path = write_llama_gguf(tmp_path / "m.gguf", random_llama_state(), n_head=4, n_head_kv=4, arch="gpt9")
    assert_one_error_line(run_main(path, "-p", "hi"), "unknown architecture", "gpt9")


def test_unknown_tensor_type(tiny_gguf: Path):
    raw = tiny_gguf.read_bytes()
    name = b"output_norm.weight"
    at = raw.index(name) + len(name)
    (n_dims,) = struct.unpack_from("<I", raw, at)
    _patch(tiny_gguf, at + 4 + 8 * n_dims, struct.pack("<I", 99))
    assert_one_error_line(run_main(tiny_gguf, "-p", "hi"), "output_norm.weight", "unknown ggml type 99")


def test_prompt_longer_than_context(tiny_gguf: Path):
    result = run_main(tiny_gguf, "-c", "16", "-p", "x" * 40)
    assert_one_error_line(result, "prompt is too long", "-c 16")


def test_missing_file(tmp_path: Path):
    assert_one_error_line(run_main(tmp_path / "nope.gguf", "-p", "hi"), "no such file")


def test_real_process_prints_no_traceback(tiny_gguf: Path, tmp_path: Path):
    bad = tmp_path / "bad.gguf"
    shutil.copy(tiny_gguf, bad)
    _patch(bad, 0, b"XXXX")
    proc = subprocess.run(
        [sys.executable, "-m", "powerinfer", "main", "-m", str(bad), "-p", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: {bad}: bad magic b'XXXX': expected b'GGUF' or b'PWRI'"
    ]
    assert proc.stdout == ""


def test_negative_vram_budget(tiny_gguf: Path):
    assert_one_error_line(run_main(tiny_gguf, "-p", "hi", "--vram-budget", "-5"), "--vram-budget", "-5")


def test_pool_device_cuda_without_cuda(tmp_path: Path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    from conftest import random_predictors

    sd = random_llama_state()
    path = write_llama_gguf(
        tmp_path / "m.powerinfer.gguf",
        sd,
        n_head=4,
        n_head_kv=4,
        act="relu",
        predictors=random_predictors(sd),
    )
    assert_one_error_line(run_main(path, "-p", "hi", "--pool-device", "cuda"), "no CUDA device")
