"""Placement: activation stats, GPU index file, solver and byte-budget planner. Pure data, no device."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import fixture_dir

from powerinfer.errors import FormatError, PlacementError
from powerinfer.gguf import GGMLType, GGUFWriter, read_gguf
from powerinfer.placement import (
    DenseTensor,
    GPUIndex,
    ModelFootprint,
    choose_groups,
    expected_gpu_hit_rate,
    footprint_from_gguf,
    gpu_index_path,
    group_sums,
    kv_cache_bytes,
    load_activation_stats,
    load_cached_gpu_index,
    plan,
    read_gpu_index,
    select_gpu_neurons,
    solve_neuron_counts,
    write_gpu_index,
)

ORIGINAL_INDEX = "tiny.powerinfer.gguf.generated.gpuidx"


def fixture() -> Path:
    return fixture_dir()  # skips, or fails when CI=true, without ../shared


# ---------------------------------------------------------------- random models


def random_stats(rng: np.random.Generator, n_layer: int, n_ff: int, integer: bool = True) -> list[np.ndarray]:
    if integer:
        return [rng.integers(0, 1000, n_ff).astype(np.float64) for _ in range(n_layer)]
    return [rng.random(n_ff) * 100 for _ in range(n_layer)]


def random_footprint(rng: np.random.Generator, n_layer: int, n_ff: int, mixed: bool) -> ModelFootprint:
    base = int(rng.integers(1, 20))
    neuron_bytes = tuple(int(rng.integers(1, 20)) if mixed else base for _ in range(n_layer))

    def tensors(kind: str) -> tuple[DenseTensor, ...]:
        return tuple(DenseTensor(f"blk.{i}.{kind}.weight", int(rng.integers(0, 200))) for i in range(n_layer))

    return ModelFootprint(
        n_ff=n_ff,
        neuron_bytes=neuron_bytes,
        attn=tensors("attn_q"),
        pred=tensors("fc1"),
        ffn_io=tensors("ffn_norm"),
        output=(DenseTensor("output.weight", int(rng.integers(0, 300))),),
    )


def gpu_frequency(stats: list[np.ndarray], neurons) -> float:
    return float(sum(s[ids].sum() for s, ids in zip(stats, neurons, strict=True)))


def brute_force(sums: np.ndarray, group_bytes: list[int], budget: int) -> float:
    """Best total over every subset of groups (not only prefixes) whose cost fits the budget."""
    items = [(sums[l, g], group_bytes[l]) for l in range(sums.shape[0]) for g in range(sums.shape[1])]
    best = 0.0
    for mask in itertools.product((0, 1), repeat=len(items)):
        cost = sum(c for (_, c), m in zip(items, mask, strict=True) if m)
        if cost <= budget:
            best = max(best, sum(v for (v, _), m in zip(items, mask, strict=True) if m))
    return best


# ---------------------------------------------------------------- solver


def test_solve_neuron_counts_takes_hottest_groups_globally():
    stats = [np.array([9.0, 1, 8, 2]), np.array([7.0, 7, 0, 0]), np.array([3.0, 3, 3, 3])]
    # group sums (group 2): L0 [17, 3], L1 [14, 0], L2 [6, 6]
    assert solve_neuron_counts(stats, 6, 2) == [2, 2, 2]
    assert solve_neuron_counts(stats, 7, 2) == [2, 2, 2]  # floor(7/2) = 3 groups
    assert solve_neuron_counts(stats, 8, 2) == [2, 2, 4]  # L2 ties 6 = 6: both before L0's 3
    assert solve_neuron_counts(stats, 0, 2) == [0, 0, 0]
    assert solve_neuron_counts(stats, 100, 2) == [4, 4, 4]


def test_solve_neuron_counts_tie_break_is_layer_then_group():
    stats = [np.ones(4), np.ones(4)]
    assert solve_neuron_counts(stats, 2, 2) == [2, 0]
    assert solve_neuron_counts(stats, 6, 2) == [4, 2]


def test_solve_neuron_counts_errors():
    with pytest.raises(PlacementError, match="multiple of the neuron group"):
        solve_neuron_counts([np.ones(10)], 4, 4)
    with pytest.raises(PlacementError, match="capacity"):
        solve_neuron_counts([np.ones(8)], -1, 4)


def test_solve_neuron_counts_matches_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(30):
        n_layer, n_groups, group = int(rng.integers(2, 4)), int(rng.integers(3, 5)), 2
        stats = random_stats(rng, n_layer, n_groups * group)
        capacity = int(rng.integers(0, n_layer * n_groups * group + 3))
        counts = solve_neuron_counts(stats, capacity, group)
        assert sum(counts) <= capacity and all(c % group == 0 for c in counts)
        sums = group_sums(stats, group)
        best = brute_force(sums, [1] * n_layer, capacity // group)
        assert gpu_frequency(stats, select_gpu_neurons(stats, counts)) == pytest.approx(best)


def test_select_gpu_neurons_order_and_ties():
    stats = [np.array([5.0, 1, 5, 3, 5]), np.array([0.0, 0, 0, 0, 0])]
    ids = select_gpu_neurons(stats, [2, 3])
    assert ids[0].tolist() == [0, 2] and ids[0].dtype == np.int32  # three 5s: lower ids win
    assert ids[1].tolist() == [0, 1, 2]
    assert expected_gpu_hit_rate(stats, ids) == pytest.approx(10 / 19)
    assert expected_gpu_hit_rate([np.zeros(3)], [np.array([0])]) == 0.0


# ---------------------------------------------------------------- group choice with byte costs


def test_choose_groups_exact_matches_brute_force_mixed_costs():
    rng = np.random.default_rng(2)
    for case in range(120):
        n_layer, n_groups = int(rng.integers(2, 4)), int(rng.integers(3, 5))
        sums = -np.sort(-rng.integers(0, 50, (n_layer, n_groups)).astype(np.float64), axis=1)
        costs = [int(rng.integers(1, 9)) for _ in range(n_layer)] if case % 3 else [3] * n_layer
        budget = int(rng.integers(0, sum(costs) * n_groups + 2))
        counts = choose_groups(sums, costs, budget)
        assert sum(k * c for k, c in zip(counts, costs, strict=True)) <= budget
        value = sum(sums[l, :k].sum() for l, k in enumerate(counts))
        assert value == pytest.approx(brute_force(sums, costs, budget)), (sums, costs, budget)


def test_choose_groups_greedy_fallback_bound_and_monotone():
    rng = np.random.default_rng(3)
    for _ in range(30):
        n_layer, n_groups = int(rng.integers(2, 4)), int(rng.integers(3, 5))
        sums = -np.sort(-rng.random((n_layer, n_groups)) * 50, axis=1)
        costs = [int(rng.integers(1, 9)) for _ in range(n_layer)]
        previous = -1.0
        for budget in range(sum(costs) * n_groups + 2):
            counts = choose_groups(sums, costs, budget, exact_max_cells=0)  # force the greedy path
            assert sum(k * c for k, c in zip(counts, costs, strict=True)) <= budget
            value = sum(sums[l, :k].sum() for l, k in enumerate(counts))
            assert value >= brute_force(sums, costs, budget) - sums.max() - 1e-9
            assert value >= previous - 1e-9
            previous = value


# ---------------------------------------------------------------- planner


def test_plan_properties_over_random_models():
    rng = np.random.default_rng(4)
    for case in range(40):
        n_layer, group = int(rng.integers(1, 4)), int(rng.choice([1, 2, 4]))
        n_ff = group * int(rng.integers(2, 6))
        fp = random_footprint(rng, n_layer, n_ff, mixed=bool(case % 2))
        stats = random_stats(rng, n_layer, n_ff, integer=bool(case % 3))
        kv = int(rng.integers(0, 100))
        reserve = int(rng.integers(0, 50))
        top = reserve + fp.dense_bytes + kv + fp.ffn_bytes + 10
        previous_share, previous_dense = -1.0, 0
        for budget in sorted(set(rng.integers(0, top, 25).tolist()) | {0, top}):
            p = plan(fp, budget_bytes=budget, kv_bytes=kv, stats=stats, reserve_bytes=reserve, group=group)
            assert p.total_bytes == sum(p.bytes_by_category.values()) <= budget
            assert p.bytes_by_category["ffn"] == sum(
                ids.size * c for ids, c in zip(p.gpu_neurons, fp.neuron_bytes, strict=True)
            )
            assert all(ids.size % group == 0 and np.all(np.diff(ids) > 0) for ids in p.gpu_neurons)
            assert p.gpu_frequency_share == pytest.approx(expected_gpu_hit_rate(stats, p.gpu_neurons))
            assert p.gpu_frequency_share >= previous_share - 1e-12
            assert len(p.gpu_tensors) >= previous_dense  # dense offload is a growing prefix
            previous_share, previous_dense = p.gpu_frequency_share, len(p.gpu_tensors)
            again = plan(
                fp, budget_bytes=budget, kv_bytes=kv, stats=stats, reserve_bytes=reserve, group=group
            )
            assert again.gpu_tensors == p.gpu_tensors and again.reason == p.reason
            assert all(np.array_equal(a, b) for a, b in zip(again.gpu_neurons, p.gpu_neurons, strict=True))
        assert p.n_gpu_neurons == n_layer * n_ff and p.kv_on_gpu and "all" in p.reason


def test_plan_ffn_choice_equals_brute_force():
    rng = np.random.default_rng(5)
    for case in range(60):
        n_layer, n_groups, group = int(rng.integers(2, 4)), int(rng.integers(3, 5)), 2
        n_ff = n_groups * group
        fp = random_footprint(rng, n_layer, n_ff, mixed=case % 4 != 0)
        stats = random_stats(rng, n_layer, n_ff)
        budget = fp.dense_bytes + int(rng.integers(0, fp.ffn_bytes + 5))
        p = plan(fp, budget_bytes=budget, kv_bytes=0, stats=stats, reserve_bytes=0, group=group)
        assert p.ffn_source == "solved" and p.ffn_budget_bytes == budget - fp.dense_bytes
        best = brute_force(group_sums(stats, group), [group * c for c in fp.neuron_bytes], p.ffn_budget_bytes)
        assert gpu_frequency(stats, p.gpu_neurons) == pytest.approx(best)


def test_plan_order_and_degradation():
    fp = ModelFootprint(
        n_ff=4,
        neuron_bytes=(10, 10),
        attn=(DenseTensor("blk.0.attn_q.weight", 100), DenseTensor("blk.1.attn_q.weight", 100)),
        pred=(DenseTensor("blk.0.fc1.weight", 50), DenseTensor("blk.1.fc1.weight", 50)),
        ffn_io=(DenseTensor("blk.0.ffn_norm.weight", 5), DenseTensor("blk.1.ffn_norm.weight", 5)),
        output=(DenseTensor("output_norm.weight", 5), DenseTensor("output.weight", 200)),
    )
    stats = [np.array([4.0, 3, 2, 1]), np.array([8.0, 7, 6, 5])]
    common = dict(kv_bytes=40, stats=stats, reserve_bytes=20, group=2)

    p = plan(fp, budget_bytes=10, **common)
    assert p.total_bytes == 0 and p.gpu_tensors == () and "compute reserve" in p.reason

    p = plan(fp, budget_bytes=20 + 250, **common)  # attn (200) fits, then blk.1.fc1 does not
    assert p.gpu_tensors == ("blk.0.attn_q.weight", "blk.1.attn_q.weight", "blk.0.fc1.weight")
    assert not p.kv_on_gpu and p.n_gpu_neurons == 0 and p.ffn_source == "none"
    assert "blk.1.fc1.weight" in p.reason and "CPU" in p.reason
    assert dict(p.bytes_by_category) == {
        "reserve": 20,
        "attn": 200,
        "pred": 50,
        "ffn_io": 0,
        "output": 0,
        "kv": 0,
        "ffn": 0,
    }

    dense = 20 + fp.dense_bytes
    p = plan(fp, budget_bytes=dense + 39, **common)
    assert len(p.gpu_tensors) == 8 and not p.kv_on_gpu and "KV cache" in p.reason

    p = plan(fp, budget_bytes=dense + 40 + 39, **common)  # one group costs 20 bytes: 1 group fits
    assert p.kv_on_gpu and p.ffn_budget_bytes == 39
    assert [ids.tolist() for ids in p.gpu_neurons] == [[], [0, 1]]
    assert p.total_bytes == dense + 40 + 20

    p = plan(fp, budget_bytes=dense + 40 + 80, ffn_offload=False, **common)
    assert p.kv_on_gpu and p.n_gpu_neurons == 0 and "disabled" in p.reason

    p = plan(fp, budget_bytes=dense + 40 + 80, **{**common, "stats": None})
    assert p.n_gpu_neurons == 0 and "no activation statistics" in p.reason


def test_plan_budget_errors():
    fp = ModelFootprint(n_ff=4, neuron_bytes=(1,))
    stats = [np.ones(4)]
    with pytest.raises(PlacementError, match=">= 0"):
        plan(fp, budget_bytes=-1, kv_bytes=0, stats=stats)
    with pytest.raises(PlacementError, match="exceeds the device"):
        plan(fp, budget_bytes=2000, kv_bytes=0, stats=stats, device_total_bytes=1000)
    with pytest.raises(PlacementError, match="multiple of the neuron group"):
        plan(fp, budget_bytes=100, kv_bytes=0, stats=stats, group=3)
    with pytest.raises(PlacementError, match="layers"):
        plan(fp, budget_bytes=100, kv_bytes=0, stats=stats * 2, group=2)
    p = plan(
        fp, budget_bytes=1000, kv_bytes=0, stats=stats, device_total_bytes=1000, group=2, reserve_bytes=0
    )
    assert p.n_gpu_neurons == 4 and p.total_bytes == 4


def test_plan_uses_cache_only_for_the_same_budget():
    fp = ModelFootprint(n_ff=4, neuron_bytes=(10, 10))
    stats = [np.array([4.0, 3, 2, 1]), np.array([8.0, 7, 6, 5])]
    cached = GPUIndex.from_neurons([np.array([2, 3]), np.array([], dtype=np.int32)], 4, 50)
    p = plan(fp, budget_bytes=50, kv_bytes=0, stats=stats, reserve_bytes=0, group=2, cached_index=cached)
    assert p.ffn_source == "cache" and [i.tolist() for i in p.gpu_neurons] == [[2, 3], []]
    p = plan(fp, budget_bytes=60, kv_bytes=0, stats=stats, reserve_bytes=0, group=2, cached_index=cached)
    assert p.ffn_source == "solved" and [i.tolist() for i in p.gpu_neurons] == [[0, 1], [0, 1, 2, 3]]
    assert p.to_gpu_index().vram_capacity == 60


def test_kv_cache_bytes():
    assert kv_cache_bytes(4, 256, 128) == 2 * 4 * 256 * 128 * 2
    assert kv_cache_bytes(2, 10, 8, bytes_per_element=4) == 2 * 2 * 10 * 8 * 4


# ---------------------------------------------------------------- activation statistics


def test_load_activation_stats_numeric_order(tmp_path):
    n_layer = 12  # activation_10.pt sorts before activation_2.pt by name (spec 8.9)
    for layer in range(n_layer):
        torch.save(torch.full((8,), float(layer)), tmp_path / f"activation_{layer}.pt")
    stats = load_activation_stats(tmp_path, n_layer, 8)
    assert [float(s[0]) for s in stats] == [float(i) for i in range(n_layer)]
    assert all(s.dtype == np.float64 and s.shape == (8,) for s in stats)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (torch.ones(7), FormatError, "expected 8 counts"),
        (torch.ones(2, 4), FormatError, "1-D"),
        (torch.tensor([1.0, -1, 0, 0, 0, 0, 0, 0]), FormatError, "negative"),
        (torch.tensor([1.0, float("nan"), 0, 0, 0, 0, 0, 0]), FormatError, "NaN"),
        ({"a": torch.ones(8)}, FormatError, "expected a tensor"),
    ],
)
def test_load_activation_stats_bad_files(tmp_path, value, error, match):
    torch.save(value, tmp_path / "activation_0.pt")
    with pytest.raises(error, match=match):
        load_activation_stats(tmp_path, 1, 8)


def test_load_activation_stats_missing(tmp_path):
    with pytest.raises(PlacementError, match="does not exist"):
        load_activation_stats(tmp_path / "nope", 1, 8)
    torch.save(torch.ones(8), tmp_path / "activation_0.pt")
    with pytest.raises(PlacementError, match="layer 1"):
        load_activation_stats(tmp_path, 2, 8)


# ---------------------------------------------------------------- GPU index file


def test_gpu_index_round_trip(tmp_path):
    index = GPUIndex.from_neurons([np.array([5, 1, 3]), np.array([], dtype=np.int32), np.arange(8)], 8, 12345)
    path = tmp_path / "m.gguf.generated.gpuidx"
    write_gpu_index(path, index)
    back = read_gpu_index(path, n_layer=3, n_ff=8)
    assert back.vram_capacity == 12345 and back.n_layer == 3 and back.n_ff == 8
    assert [b.tolist() for b in back.gpu_bucket] == [[1, 3, 5], [], list(range(8))]
    assert all(np.array_equal(a, b) for a, b in zip(back.gpu_idx, index.gpu_idx, strict=True))
    f = read_gguf(path)
    assert (
        f.magic == "PWRI"
        and list(f.metadata)
        == [
            "general.architecture",
            "generic.gpu_index.block_count",
            "split.vram_capacity",
            "powerinfer.stamp.format",  # our version stamp (powerinfer.stamps; PowerInfer's loader ignores extra keys)
            "powerinfer.stamp.code",
        ]
    )
    assert gpu_index_path("/x/model.gguf") == Path("/x/model.gguf.generated.gpuidx")


def _write_raw_index(
    path: Path, arch: str, tensors: list[tuple[str, np.ndarray]], sparse: bool = True
) -> None:
    w = GGUFWriter(path, sparse=sparse)
    w.add("general.architecture", arch)
    w.add("generic.gpu_index.block_count", len(tensors) // 2)
    w.add("split.vram_capacity", 100)
    for name, data in tensors:
        w.add_tensor(name, data.astype(np.int32), GGMLType.I32)
    w.write()


def _good_tensors() -> list[tuple[str, np.ndarray]]:
    return [
        ("blk.0.gpu_idx", np.array([1, 0, 1, 0])),
        ("blk.0.gpu_bucket", np.array([0, 2])),
        ("blk.1.gpu_idx", np.array([0, 0, 0, 1])),
        ("blk.1.gpu_bucket", np.array([3])),
    ]


def test_gpu_index_corrupt_files(tmp_path):
    path = tmp_path / "x.gpuidx"
    _write_raw_index(path, "generic.gpu_index", _good_tensors())
    assert [b.tolist() for b in read_gpu_index(path, 2, 4).gpu_bucket] == [[0, 2], [3]]
    with pytest.raises(FormatError, match="expected 2 x 3"):
        read_gpu_index(path, n_layer=3)
    with pytest.raises(FormatError, match="n_ff = 8"):
        read_gpu_index(path, n_ff=8)

    cases = {
        "architecture is 'llama'": ("llama", _good_tensors()),
        "expected 2 per layer": ("generic.gpu_index", _good_tensors()[:3]),
        "bucket inconsistent": (
            "generic.gpu_index",
            _good_tensors()[:3] + [("blk.1.gpu_bucket", np.array([2]))],
        ),
        "values other than 0 and 1": (
            "generic.gpu_index",
            [("blk.0.gpu_idx", np.array([2, 0, 1, 0]))] + _good_tensors()[1:],
        ),
        "expected 'blk.0.gpu_idx'": ("generic.gpu_index", _good_tensors()[1::-1] + _good_tensors()[2:]),
    }
    for match, (arch, tensors) in cases.items():
        _write_raw_index(path, arch, tensors)
        with pytest.raises(FormatError, match=match):
            read_gpu_index(path)
    _write_raw_index(path, "generic.gpu_index", _good_tensors(), sparse=False)
    with pytest.raises(FormatError, match="magic GGUF"):
        read_gpu_index(path)


def test_load_cached_gpu_index(tmp_path):
    path = tmp_path / "m.gguf.generated.gpuidx"
    assert load_cached_gpu_index(path, n_layer=2, n_ff=4) is None
    _write_raw_index(path, "generic.gpu_index", _good_tensors())
    assert load_cached_gpu_index(path, n_layer=2, n_ff=4).vram_capacity == 100
    assert load_cached_gpu_index(path, n_layer=2, n_ff=4, reset=True) is None
    assert load_cached_gpu_index(path, n_layer=3, n_ff=4) is None  # invalid for this model: regenerate


# ---------------------------------------------------------------- fixture (original PowerInfer outputs)


def test_fixture_solver_and_index_byte_identical(tmp_path):
    root = fixture()
    stats = load_activation_stats(root / "activation", 4, 512)
    counts = solve_neuron_counts(stats, 820, 64)
    assert counts == [320, 256, 128, 64]
    index = GPUIndex.from_neurons(select_gpu_neurons(stats, counts), 512, 944640)
    ours = tmp_path / ORIGINAL_INDEX
    write_gpu_index(ours, index, stamp=False)  # the stamp's two keys are all the pool's cached files add
    original = read_gpu_index(root / ORIGINAL_INDEX, n_layer=4, n_ff=512)
    back = read_gpu_index(ours, n_layer=4, n_ff=512)
    assert back.vram_capacity == original.vram_capacity == 944640
    for a, b in zip(back.gpu_bucket, original.gpu_bucket, strict=True):
        assert np.array_equal(a, b)
    ref, mine = read_gguf(root / ORIGINAL_INDEX), read_gguf(ours)
    assert list(ref.tensors) == list(mine.tensors) and ref.metadata == mine.metadata
    assert ref.value_types == mine.value_types
    for name, t in ref.tensors.items():
        assert t.shape == mine.tensors[name].shape and bytes(t.data) == bytes(mine.tensors[name].data)
    assert ours.read_bytes() == (root / ORIGINAL_INDEX).read_bytes()


def test_fixture_original_index_buckets():
    root = fixture()
    expected = json.loads((root / "expected.json").read_text())["files"][ORIGINAL_INDEX]["layers"]
    index = read_gpu_index(root / ORIGINAL_INDEX, n_layer=4, n_ff=512)
    assert [b.tolist() for b in index.gpu_bucket] == [layer["gpu_bucket"] for layer in expected]
    assert [int(m.sum()) for m in index.gpu_idx] == [layer["k"] for layer in expected]


def test_fixture_footprint_and_plan():
    root = fixture()
    f16 = footprint_from_gguf(read_gguf(root / "tiny.powerinfer.gguf"), 4, 512)
    q4 = footprint_from_gguf(read_gguf(root / "tiny.q4.powerinfer.gguf"), 4, 512)
    assert f16.neuron_bytes == (3 * 128 * 2,) * 4  # gate + up + down_t rows, F16
    assert q4.neuron_bytes == (3 * 128 * 18 // 32,) * 4  # Q4_0
    assert f16.attn[:5] == tuple(
        DenseTensor(f"blk.0.{s}.weight", n)
        for s, n in (
            ("attn_norm", 512),
            ("attn_q", 32768),
            ("attn_k", 32768),
            ("attn_v", 32768),
            ("attn_output", 32768),
        )
    )
    assert [t.name for t in f16.output] == ["output_norm.weight", "output.weight"]
    stats = load_activation_stats(root / "activation", 4, 512)
    kv = kv_cache_bytes(4, 256, 128)
    budget = f16.dense_bytes + kv + 944640
    p = plan(f16, budget_bytes=budget, kv_bytes=kv, stats=stats, reserve_bytes=0, group=64)
    # real cost 768 B/neuron vs PowerInfer's 1152 B proxy: 1229 neurons' worth, 19 groups of 64
    assert p.ffn_budget_bytes == 944640 and p.n_gpu_neurons == 944640 // (768 * 64) * 64
    assert p.total_bytes <= budget
