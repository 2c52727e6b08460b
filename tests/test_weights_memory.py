"""Where the engine's weights live: read into memory (the default when they fit, `--no-mmap`) or on the file mapping
(`--mmap`); the same bits either way, and an impossible copy refused with one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from powerinfer.cli import app
from powerinfer.cli import main as cli_main
from powerinfer.errors import InputError
from powerinfer.gguf.reader import in_memory, read_gguf, tensor_bytes_total
from powerinfer.runtime import assembly as assembly_module
from powerinfer.runtime.engine import Engine, EngineOptions

PROMPT = [5, 9, 14, 3, 7]


def _on_mapping(engine: Engine) -> list[bool]:
    return [np.shares_memory(t.data, engine.gguf.mmap) for t in engine.gguf.tensors.values()]


def test_in_memory_copies_every_tensor_byte_for_byte(tiny_gguf: Path):
    mapped = read_gguf(tiny_gguf)
    copied = in_memory(mapped)
    assert list(copied.tensors) == list(mapped.tensors)
    for name, info in mapped.tensors.items():
        twin = copied.tensors[name]
        assert (twin.shape, twin.ggml_type, twin.offset) == (info.shape, info.ggml_type, info.offset)
        assert np.array_equal(twin.data, info.data) and not np.shares_memory(twin.data, mapped.mmap)
        assert twin.data.ctypes.data % 64 == 0  # each tensor starts on a cache line
    assert copied.metadata is mapped.metadata
    assert tensor_bytes_total(mapped) >= sum(t.n_bytes for t in mapped.tensors.values())


def test_mmap_option_places_the_weights_and_keeps_the_bits(tiny_gguf: Path):
    engines = {
        m: Engine(tiny_gguf, EngineOptions(act_precision="f32", n_ctx=32, n_threads=1, mmap=m))
        for m in (True, False, None)
    }
    assert all(_on_mapping(engines[True]))
    assert not any(_on_mapping(engines[False]))
    assert not any(_on_mapping(engines[None]))  # a tiny model fits: into memory by default
    logits = [e.eval(PROMPT)[-1].clone() for e in engines.values()]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])


def test_default_maps_weights_that_do_not_fit_and_no_mmap_refuses(tiny_gguf: Path, monkeypatch):
    need = tensor_bytes_total(read_gguf(tiny_gguf))
    monkeypatch.setattr(
        assembly_module, "available_memory_bytes", lambda: need + 1
    )  # under twice the weights
    assert all(_on_mapping(Engine(tiny_gguf, EngineOptions(act_precision="f32", n_ctx=32, n_threads=1))))
    monkeypatch.setattr(assembly_module, "available_memory_bytes", lambda: need - 1)
    with pytest.raises(InputError, match=r"--no-mmap: the weights need .* is available \(use --mmap\)"):
        Engine(tiny_gguf, EngineOptions(act_precision="f32", n_ctx=32, n_threads=1, mmap=False))


@pytest.mark.parametrize(("flag", "value"), [([], None), (["--mmap"], True), (["--no-mmap"], False)])
def test_cli_flag_reaches_the_engine(monkeypatch, flag, value):
    seen = {}
    monkeypatch.setattr(cli_main, "run_main", lambda opts: seen.update(opts=opts))
    result = CliRunner().invoke(app, ["main", "-m", "m.gguf", "-p", "hi", *flag])
    assert result.exit_code == 0, result.stderr
    assert seen["opts"].engine.mmap is value
