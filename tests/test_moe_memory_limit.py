"""--memory-limit on MoE files (placement.memory, runtime.expert_store): the dense weights and pinned experts
resident, the other experts read from the file through a bounded cache of slots.

The oracle is the same engine without a limit (every expert on the file mapping): a limit changes where an
expert's bytes are read from, never the arithmetic, so logits must be bit-identical, whole prompts and token by
token, with experts read on demand, read ahead (SmallThinker's router before attention, the next layer's router
elsewhere), pinned from a profile, and through buffered reads where the file system has no direct I/O.

Files: the tiny synthetic MoE files of scripts/make_synthetic_moe.py (2 layers, 8 experts of 32, top 2)."""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from powerinfer.errors import PlacementError
from powerinfer.gguf.reader import tensor_bytes_total
from powerinfer.ops.moe import moe_experts
from powerinfer.placement.memory import MemoryPlan, plan_memory, runtime_bytes, slot_bytes
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.expert_store import ExpertStore, LayerFiles
from tests.conftest import load_script

PROMPT = list(range(3, 40))
N_CTX = 64
N_EXPERT = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("moe-memory-limit")
    paths = load_script("make_synthetic_moe").generate(
        out, ["qwen3moe", "smallthinker"], "tiny", ["q4_0", "f32"]
    )
    return {p.name: p for p in paths}


def expert_sizes(engine: Engine) -> list[tuple[int, int, int]]:
    g = engine.assembled.gguf
    names = ("gate", "up", "down")
    return [
        tuple(g.tensors[f"blk.{b}.ffn_{m}_exps.weight"].n_bytes // N_EXPERT for m in names)  # type: ignore[misc]
        for b in range(engine.config.n_layer)
    ]


def limit_for(engine: Engine, n_slots: int, pinned: int = 0) -> float:
    """A --memory-limit (GiB) that leaves room for `n_slots` cache slots and `pinned` pinned experts when the
    runtime is taken as 0 bytes (EngineOptions.memory_runtime_bytes), solved for the plan's margin."""
    sizes = expert_sizes(engine)
    slot = max(slot_bytes(s) for s in sizes)
    dense = tensor_bytes_total(engine.assembled.gguf) - sum(sum(s) * N_EXPERT for s in sizes)
    kv = 2 * N_CTX * engine.config.n_embd_gqa * 2 * 4
    want = dense + (n_slots + pinned) * slot + slot // 2
    limit = want + runtime_bytes(0, 0, kv)
    while limit - runtime_bytes(limit, 0, kv) < want:  # the margin's share of the limit
        limit += 4096
    return limit / 2**30


def run(engine: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's logits in one step, and decode token by token over its first 12 tokens."""
    engine.reset()
    whole = engine.logits_all(PROMPT)
    engine.reset()
    steps = torch.stack([engine.eval([t]).clone() for t in PROMPT[:12]])
    return whole, steps


def options(act: str, **kw) -> EngineOptions:
    return EngineOptions(act_precision=act, n_ctx=N_CTX, n_threads=1, **kw)


@pytest.mark.parametrize("arch", ["qwen3moe", "smallthinker"])
@pytest.mark.parametrize("kind,act", [("q4_0", "q8"), ("f32", "f32")])
def test_cache_gives_the_unlimited_logits(files, arch: str, kind: str, act: str):
    path = files[f"moe-{arch}-tiny-{kind}.gguf"]
    free = Engine(path, options(act))
    want = run(free)
    limited = Engine(path, options(act, memory_limit_gib=limit_for(free, 10), memory_runtime_bytes=0))
    store = limited.assembled.loader.store
    assert store is not None and store.plan.n_slots == 10 and store.plan.n_pinned == 0
    got = run(limited)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    st = store.stats
    # 10 slots for 16 experts: some calls must have been read from the file, some served from the cache
    assert st.disk > 0 and st.cached + st.prefetched > 0 and st.bytes_read > 0
    assert st.calls == st.pinned + st.cached + st.prefetched + st.disk
    assert st.prefetch_issued > 0  # SmallThinker: its router before attention; qwen3moe: the next router
    if arch == "smallthinker":  # the pre-attention router names this layer's experts exactly
        assert st.prefetch_used == st.prefetch_issued
    resident = (store.where >= 0).sum() + (store.where == -2).sum()
    assert resident <= 10  # never more experts than slots


def test_profile_pins_the_hottest_experts(files, tmp_path):
    src = files["moe-qwen3moe-tiny-q4_0.gguf"]
    path = tmp_path / src.name
    shutil.copy(src, path)
    counts = np.arange(2 * N_EXPERT, dtype=np.int64).reshape(2, N_EXPERT)[::-1] + 1  # layer 0 hotter
    (tmp_path / "profile.json").write_text(json.dumps({"expert_counts": counts.tolist()}))
    free = Engine(path, options("q8"))
    want = run(free)
    limited = Engine(path, options("q8", memory_limit_gib=limit_for(free, 8, 3), memory_runtime_bytes=0))
    store = limited.assembled.loader.store
    assert store is not None
    plan = store.plan
    assert plan.n_slots == 8 and plan.n_pinned == 3 and plan.source == "profile"
    # the three with the most selections: layer 0's experts 5, 6, 7 (counts 14..16)
    assert [p.tolist() for p in plan.pinned] == [[5, 6, 7], []]
    got = run(limited)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert store.stats.pinned > 0


@pytest.mark.parametrize("direct", [True, False])
def test_store_reads_each_experts_bytes(files, direct: bool):
    """The rows at a resident expert's table addresses are the file's bytes of that expert, with direct I/O and
    with buffered reads (whose pages are dropped after each read); an evicted expert's entries are 0."""
    path = files["moe-qwen3moe-tiny-q4_0.gguf"]
    engine = Engine(path, options("q8"))
    sizes = expert_sizes(engine)
    g = engine.assembled.gguf
    infos = [[g.tensors[f"blk.{b}.ffn_{m}_exps.weight"] for m in ("gate", "up", "down")] for b in range(2)]
    layers = [LayerFiles(tuple(i.offset for i in inf), s) for inf, s in zip(infos, sizes, strict=True)]  # type: ignore[arg-type]
    slot = max(slot_bytes(s) for s in sizes)
    none = np.zeros(0, dtype=np.int64)
    plan = MemoryPlan(
        7 * slot, 0, 0, (none, none), 0, 7, slot, 0.0, "none"
    )  # fewer slots than plan_memory allows
    store = ExpertStore(path, layers, N_EXPERT, plan, direct=direct)
    data = path.read_bytes()
    try:
        assert store.direct == direct or not direct
        for step, ids in enumerate(([1, 5], [0, 7], [2, 3], [4, 6], [1, 2], [5, 0])):
            bid = step % 2
            store.ensure(bid, torch.tensor([ids]))
            for e in ids:
                for m in range(3):
                    off = layers[bid].offsets[m] + e * sizes[bid][m]
                    got = ctypes.string_at(int(store.tables[bid][m, e]), sizes[bid][m])
                    assert got == data[off : off + sizes[bid][m]]
        resident = store.tables[0].any(axis=0).sum() + store.tables[1].any(axis=0).sum()
        # 7 slots, least recently used out (never one of the step's own): step 4 drops layer 0's expert 1, step 5
        # reads it again and drops layer 0's 5, step 6 keeps layer 1's 0 (its own) and drops layer 1's 7
        assert resident == 7
        assert not store.tables[0][:, 5].any() and not store.tables[1][:, 7].any()
        assert store.tables[0][:, [1, 2, 3]].all() and store.tables[1][:, [0, 4, 5, 6]].all()
        assert store.stats.disk == 10 and store.stats.cached == 2
    finally:
        store.close()


def test_kernel_refuses_an_expert_not_resident(files):
    engine = Engine(files["moe-qwen3moe-tiny-q4_0.gguf"], options("q8"))
    experts = engine.assembled.model.layers[0].ffn.experts
    table = np.zeros((3, N_EXPERT), dtype=np.int64)
    k = moe_experts(
        experts.gate, experts.up, experts.down, N_EXPERT, 2, "silu", False, engine.assembled.kc, table=table
    )
    assert k is not None
    x, y = torch.randn(1, experts.n_embd), torch.zeros(1, experts.n_embd)
    with pytest.raises(Exception, match="index|range|expert"):
        k(x, torch.tensor([[1, 3]]), torch.tensor([[0.5, 0.5]]), y)
    with pytest.raises(Exception, match="index|range|expert"):
        k.grouped(x.repeat(2, 1), torch.tensor([[1, 3], [0, -1]]), torch.ones(2, 2))


def test_plan_rules():
    sizes = [(1000, 1000, 1000)] * 2
    slot = slot_bytes(sizes[0])
    gib = 2**30
    with pytest.raises(PlacementError, match="too small"):
        plan_memory(gib, gib // 2, gib // 2, sizes, 4)
    everything = plan_memory(100 * slot, 0, 0, sizes, 4)
    assert everything.n_pinned == 8 and everything.n_slots == 0
    counts = np.array([[1.0, 9, 0, 3], [5, 0, 0, 0]])
    plan = plan_memory(7 * slot, 0, 0, sizes, 4, counts)
    # 7 slots' bytes: a cache of max(4 slots, a fifth of the experts) = 4 slots, 3 pinned by count
    assert plan.n_slots == 4 and [p.tolist() for p in plan.pinned] == [[1, 3], [0]]
    assert plan.share == pytest.approx((9 + 3 + 5) / 18)
    plain = plan_memory(7 * slot, 0, 0, sizes, 4)
    assert plain.n_pinned == 0 and plain.n_slots == 7


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "powerinfer", *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_cli_reports_and_refuses(files, tiny_llama_path=None):
    path = str(files["moe-smallthinker-tiny-q4_0.gguf"])
    ok = cli("main", "-m", path, "-p", "abc", "-n", "4", "--temp", "0", "-c", "64", "--memory-limit", "4")
    assert ok.returncode == 0, ok.stderr
    out = ok.stdout + ok.stderr
    assert "placement: memory limit 4 GiB" in out and "16/16 experts pinned" in out  # the tiny file fits
    assert "expert calls" in out and "read from the file per token" in out
    for value, message in (("0", "--memory-limit must be"), ("0.05", "too small")):
        bad = cli("main", "-m", path, "-p", "abc", "-n", "2", "-c", "64", "--memory-limit", value)
        assert bad.returncode == 1
        lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
        assert message in bad.stderr and "Traceback" not in bad.stderr and len(lines) <= 3, bad.stderr
