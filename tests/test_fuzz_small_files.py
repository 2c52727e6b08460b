"""Mutation fuzzing of the small files we read besides models: PowerInfer activation statistics
(`activation/activation_<l>.pt`, PowerInfer's format: no checksum, so a mutation may load as other valid counts)
and --prompt-cache session files (a SHA-256 trailer: every mutation is refused). Seeded hypothesis mutations
(bytes flipped, cut, inserted, appended); only our one-line errors may come out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_llama_state, write_llama_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from powerinfer.errors import FormatError, PlacementError
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
    engine = Engine(write_llama_gguf(root / "m.gguf", sd, n_head=4, n_head_kv=2), EngineOptions(n_ctx=32))
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
