"""Mutation fuzzing of the small files we read besides models: PowerInfer activation statistics
(`activation/activation_<l>.pt`, PowerInfer's format: no checksum, so a mutation may load as other valid counts),
GPU index files (`<model>.generated.gpuidx`, PowerInfer's format, also without checksum) and --prompt-cache
session files (a SHA-256 trailer: every mutation is refused). Seeded hypothesis mutations
(bytes flipped, cut, inserted, appended); only our one-line errors may come out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_llama_state, write_llama_gguf, write_relu_sparse_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from powerinfer import stamps
from powerinfer.cli import app
from powerinfer.errors import FormatError, PlacementError
from powerinfer.gguf import read_gguf
from powerinfer.placement.gpu_index import (
    GPU_INDEX_SUFFIX,
    GPUIndex,
    load_cached_gpu_index,
    read_gpu_index,
    write_gpu_index,
)
from powerinfer.placement.gpu_index import (
    KIND as GPU_INDEX_KIND,
)
from powerinfer.placement.stats import load_activation_stats
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.session import load_session, save_session

mutation = st.lists(
    st.tuples(
        st.sampled_from(["flip", "cut", "insert", "append"]),
        st.integers(0, 1 << 20),
        st.binary(min_size=1, max_size=64),
    ),
    min_size=1,
    max_size=4,
)


def mutate(data: bytes, steps: list[tuple[str, int, bytes]]) -> bytes:
    out = bytearray(data)
    for op, at, chunk in steps:
        i = at % max(1, len(out))
        if op == "flip":
            for j, b in enumerate(chunk):
                if i + j < len(out):
                    out[i + j] ^= b or 0xFF
        elif op == "cut":
            del out[i:]
        elif op == "insert":
            out[i:i] = chunk
        else:
            out += chunk
    return bytes(out)


@pytest.fixture(scope="module")
def stats_file(tmp_path_factory) -> tuple[Path, bytes]:
    folder = tmp_path_factory.mktemp("act")
    torch.save(torch.arange(64, dtype=torch.float32), folder / "activation_0.pt")
    return folder, (folder / "activation_0.pt").read_bytes()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(steps=mutation)
def test_mutated_activation_statistics_load_or_fail_cleanly(stats_file, steps):
    folder, good = stats_file
    (folder / "activation_0.pt").write_bytes(mutate(good, steps))
    try:
        (counts,) = load_activation_stats(folder, 1, 64)
    except (FormatError, PlacementError) as e:
        assert str(e) and "\n" not in str(e)
    else:
        assert counts.shape == (64,) and np.isfinite(counts).all() and (counts >= 0).all()


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> tuple[Engine, Path, bytes]:
    root = tmp_path_factory.mktemp("sess")
    sd = random_llama_state(n_head=4, n_head_kv=2, seed=4)
    engine = Engine(
        write_llama_gguf(root / "m.gguf", sd, n_head=4, n_head_kv=2),
        EngineOptions(act_precision="f32", n_ctx=32),
    )
    engine.prefill(0, [1, 5, 9, 13])
    path = root / "s.bin"
    save_session(path, engine, [1, 5, 9, 13])
    return engine, path, path.read_bytes()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(steps=mutation)
def test_every_mutated_session_file_is_refused(session, steps):
    engine, path, good = session
    bad = mutate(good, steps)
    if bad == good:
        return
    path.write_bytes(bad)
    engine.free(0)
    with pytest.raises(FormatError):
        load_session(path, engine)
    assert engine.n_past == 0


@pytest.fixture(scope="module")
def gpu_index_file(tmp_path_factory) -> tuple[Path, bytes]:
    """A GPU index of 3 layers x 96 neurons as write_gpu_index (and PowerInfer's solver) lays it out."""
    rng = np.random.default_rng(7)
    neurons = [np.sort(rng.choice(96, size=k, replace=False)) for k in (40, 0, 96)]
    path = tmp_path_factory.mktemp("gpuidx") / ("m.gguf" + GPU_INDEX_SUFFIX)
    write_gpu_index(path, GPUIndex.from_neurons(neurons, 96, 123456))
    return path, path.read_bytes()


def _valid_index(index: GPUIndex) -> None:
    """What a loaded index promises its users (the pool, the planner): one bool mask and its sorted ids per
    layer, every id a neuron of the layer."""
    assert index.n_layer == 3 and index.n_ff == 96 and index.vram_capacity >= 0
    for mask, bucket in zip(index.gpu_idx, index.gpu_bucket, strict=True):
        assert mask.shape == (96,) and mask.dtype == np.bool_
        assert np.array_equal(bucket, np.flatnonzero(mask))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(steps=mutation)
def test_mutated_gpu_index_loads_or_fails_cleanly(gpu_index_file, steps):
    """An explicit --gpu-index file: a mutation gives a valid index or one FormatError line (the file has no
    checksum: PowerInfer's format; a flipped capacity or a 0/1 swap kept consistent with its bucket is another
    valid index). The cached `<model>.generated.gpuidx` is the same reader behind load_cached_gpu_index, which
    turns the error into a warning and None: the index is solved again and rewritten (documented rebuild)."""
    path, good = gpu_index_file
    path.write_bytes(mutate(good, steps))
    try:
        index = read_gpu_index(path, n_layer=3, n_ff=96)
    except FormatError as e:
        assert str(e) and "\n" not in str(e)
        assert load_cached_gpu_index(path, n_layer=3, n_ff=96) is None
    else:
        _valid_index(index)
        cached = load_cached_gpu_index(path, n_layer=3, n_ff=96)
        stamp = stamps.check_gguf(GPU_INDEX_KIND, read_gguf(path).metadata)
        if stamp.state in (
            "stale",
            "changed",
        ):  # a mutated stamp: the cache is made again (documented rebuild)
            assert cached is None
        else:
            assert cached is not None
            _valid_index(cached)


@pytest.mark.parametrize("size", [0, 1, 4, 8, 23, 24, 100, 500, 1000, -4, -1])
def test_truncated_gpu_index_is_one_error_line(gpu_index_file, size):
    """Every cut of the file (empty, inside the header, the KVs, the tensor table, the data) is refused."""
    path, good = gpu_index_file
    path.write_bytes(good[:size])
    with pytest.raises(FormatError) as e:
        read_gpu_index(path, n_layer=3, n_ff=96)
    assert str(e.value) and "\n" not in str(e.value)
    assert load_cached_gpu_index(path, n_layer=3, n_ff=96) is None


@pytest.fixture(scope="module")
def pooled_model(tmp_path_factory) -> tuple[Path, Path, bytes]:
    """A sparse model with activation statistics, run once with a (CPU stand-in) pool so that it caches its
    solved GPU index beside it: (model, cache, the cache's bytes)."""
    model = write_relu_sparse_model(
        tmp_path_factory.mktemp("pool") / "m.powerinfer.gguf", n_ff=128, seed=0, stats=True
    )
    cache = Path(str(model) + GPU_INDEX_SUFFIX)
    r = CliRunner().invoke(app, ["main", "-m", str(model), *POOL_ARGS])
    assert r.exit_code == 0, r.stderr
    return model, cache, cache.read_bytes()


def _flip(data: bytes, at: int, bits: int) -> bytes:
    return data[:at] + bytes([data[at] ^ bits]) + data[at + 1 :]


POOL_ARGS = [
    "-p",
    "hi",
    "-n",
    "2",
    "--temp",
    "0",
    "--pool-device",
    "cpu",
    "--vram-budget",
    "0.001",
    "-t",
    "1",
]


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b"",
        lambda b: b[:40],
        lambda b: b[:-9],
        lambda b: _flip(b, b.index(b"generic.gpu_index") + 2, 0x40),  # the architecture string
        lambda b: _flip(b, b.index(b"blk.1.gpu_bucket") + 4, 0x01),  # a tensor name in the table
        lambda b: _flip(b, len(b) - 40, 0x01),  # a gpu_bucket id
        lambda b: b[:-300] + b"\xff\xff\xff\x7f" + b[-296:],  # in the data
    ],
    ids=["empty", "header-cut", "data-cut", "arch-flip", "name-flip", "bucket-flip", "data-flip"],
)
def test_damaged_gpu_index_cache_is_rebuilt(pooled_model, damage):
    """A damaged cached index: one warning line naming it, the index solved again and rewritten as before, the
    run unaffected. The same file given explicitly (EngineOptions.gpu_index_path) is one FormatError line."""
    model, cache, good = pooled_model
    bad = damage(good)
    assert bad != good
    cache.write_bytes(bad)
    with pytest.raises(FormatError) as e:
        Engine(
            model,
            EngineOptions(
                act_precision="f32", n_ctx=32, n_threads=1, pool_device="cpu", gpu_index_path=str(cache)
            ),
        )
    assert str(cache) in str(e.value) and "\n" not in str(e.value)
    r = CliRunner().invoke(app, ["main", "-m", str(model), *POOL_ARGS])
    assert r.exit_code == 0, r.stderr
    assert "Traceback" not in r.stderr
    warnings = [ln for ln in r.stderr.splitlines() if "invalid GPU index cache" in ln]
    assert len(warnings) == 1, r.stderr
    assert cache.read_bytes() == good
