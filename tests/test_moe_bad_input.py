"""Bad MoE files: an expert count of 0 or above 1024, top-k above the expert count, expert tensors whose shapes
disagree with the keys, a missing router: one error line each (exit code 1, no traceback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import assert_one_error_line
from typer.testing import CliRunner

from powerinfer.cli import app
from powerinfer.gguf import GGMLType, GGUFWriter, read_gguf
from powerinfer.gguf.constants import ValueType
from tests.conftest import load_script

runner = CliRunner()


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A tiny qwen3moe F32 file (scripts/make_synthetic_moe.py)."""
    mod = load_script("make_synthetic_moe")
    return mod.generate(tmp_path_factory.mktemp("moe"), ["qwen3moe"], "tiny", ["f32"])[0]


def rewrite(
    src: Path,
    dst: Path,
    keys: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """A copy of src with metadata `keys` set (uint32), tensors `drop` left out and `tensors` replaced (F32)."""
    g = read_gguf(src)
    keys, tensors = keys or {}, tensors or {}
    w = GGUFWriter(dst)
    for key, value in g.metadata.items():
        if key in keys:
            w.add(key, keys.pop(key), ValueType.UINT32)
        else:
            w.add(key, value, g.value_types[key], g.array_types.get(key))
    for key, value in keys.items():
        w.add(key, value, ValueType.UINT32)
    for name, t in g.tensors.items():
        if name in drop:
            continue
        if name in tensors:
            w.add_tensor(name, tensors[name], GGMLType.F32)
        else:
            w.add_tensor(name, t.data, t.ggml_type, t.shape)
    w.write()
    return dst


def run_main(model: Path):
    return runner.invoke(app, ["main", "-m", str(model), "-n", "2", "--temp", "0", "-p", "hi"])


@pytest.mark.parametrize(
    ("keys", "needles"),
    [
        ({"qwen3moe.expert_count": 0}, ("expert count must be 1..1024", "got 0")),
        ({"qwen3moe.expert_count": 1025}, ("expert count must be 1..1024", "got 1025")),
        ({"qwen3moe.expert_count": 1 << 31}, ("expert count must be 1..1024",)),
        ({"qwen3moe.expert_used_count": 9}, ("experts used per token must be 1..8", "got 9")),
        ({"qwen3moe.expert_used_count": 0}, ("experts used per token must be 1..8", "got 0")),
        ({"qwen3moe.expert_feed_forward_length": 64}, ("blk.0.ffn_", "(8, 64, 64)")),
        ({"qwen3moe.expert_count": 16}, ("blk.0.ffn_gate_inp.weight", "(16, 64)")),
        ({"qwen3moe.expert_gating_func": 3}, ("expert_gating_func", "unsupported")),
    ],
)
def test_bad_expert_keys(good: Path, tmp_path: Path, keys, needles):
    path = rewrite(good, tmp_path / "bad.gguf", keys=keys)
    assert_one_error_line(run_main(path), *needles)


def test_missing_router(good: Path, tmp_path: Path):
    path = rewrite(good, tmp_path / "bad.gguf", drop=("blk.1.ffn_gate_inp.weight",))
    assert_one_error_line(run_main(path), "missing required tensor", "blk.1.ffn_gate_inp.weight")


def test_missing_expert_count(good: Path, tmp_path: Path):
    g = read_gguf(good)
    path = tmp_path / "bad.gguf"
    w = GGUFWriter(path)
    for key, value in g.metadata.items():
        if key != "qwen3moe.expert_count":
            w.add(key, value, g.value_types[key], g.array_types.get(key))
    for name, t in g.tensors.items():
        w.add_tensor(name, t.data, t.ggml_type, t.shape)
    w.write()
    assert_one_error_line(run_main(path), "missing required metadata key", "qwen3moe.expert_count")


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("blk.0.ffn_down_exps.weight", (8, 32, 64)),  # down stored like gate: (n_expert, n_ff, n_embd)
        ("blk.1.ffn_up_exps.weight", (7, 32, 64)),  # one expert short
        ("blk.0.ffn_gate_exps.weight", (8 * 32, 64)),  # 2-D instead of the stack
    ],
)
def test_expert_tensor_shapes(good: Path, tmp_path: Path, name: str, shape):
    path = rewrite(good, tmp_path / "bad.gguf", tensors={name: np.zeros(shape, np.float32)})
    assert_one_error_line(run_main(path), name, "shape")


def test_mixtral_expert_count_zero_is_dense(tmp_path: Path):
    """A llama file with expert_count 0 is a dense Llama (as llama.cpp reads it): it then needs ffn_gate."""
    mod = load_script("make_synthetic_moe")
    path = mod.generate(tmp_path, ["mixtral"], "tiny", ["f32"])[0]
    bad = rewrite(path, tmp_path / "bad.gguf", keys={"llama.expert_count": 0})
    assert_one_error_line(run_main(bad), "missing required tensor", "ffn_gate.weight")
