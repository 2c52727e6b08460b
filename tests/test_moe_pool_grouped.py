"""The pool's experts of a MoE layer (device.pool.PoolExperts, ops.StackedExperts): whole experts stacked slot by
slot with an expert -> slot table, and one grouped step over a step's (token, expert) pairs, with no per-expert
Python and no host sync.

On the CPU standing in for the pool (the C kernels: the CPU's own grouped MoE kernel over the slots' row table)
against the all-CPU experts (the dense MoE layer: model.moe.Experts without a pool) and against the torch path of
the stand-in without the C kernels; a token's sum alone and in a batch; the Python calls of a step for 8 and 32
experts, k = 2 and 4. The CUDA pool's Triton pair kernel runs on the CPU through the Triton interpreter (a
subprocess: TRITON_INTERPRET must be set before triton is imported) against the float64 product of the reference
dequantisation, every pool type, and on a GPU (marked cuda) with host syncs turned into errors.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import BackgroundCheck, run_background

from powerinfer import ops
from powerinfer.device.pool import PoolExperts
from powerinfer.gguf import GGMLType
from powerinfer.model.moe import Experts, MoESpec
from powerinfer.ops.encode import quantize
from powerinfer.runtime.calls import count_calls

TESTS = Path(__file__).resolve().parent


def stacks(E: int, D: int, F: int, t: GGMLType, seed: int = 0) -> tuple[ops.QWeight, ...]:
    """Random stacked experts gate, up (E F, D) and down (E D, F) of type t."""
    rng = np.random.default_rng(seed)
    out = []
    for shape in ((E * F, D), (E * F, D), (E * D, F)):
        data = rng.normal(0, 0.2, shape).astype(np.float32)
        raw = data.astype(np.float16).view(np.uint8) if t == GGMLType.F16 else quantize(data, t)
        out.append(ops.QWeight.from_numpy(np.asarray(raw), t, shape))
    return tuple(out)


def routed(T: int, E: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token in increasing order (as the router gives them) and their weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k].sort().values for _ in range(T)])
    return ids, torch.rand(T, k, generator=g)


def layer(
    E: int, k: int, pooled: list[int], partial: dict[int, np.ndarray] | None, act: str = "silu", seed: int = 0
) -> tuple[Experts, Experts]:
    """(experts with a pool on the CPU stand-in, the same experts all on the CPU)."""
    D, F = 64, 64
    gate, up, down = stacks(E, D, F, GGMLType.Q4_0, seed)
    spec = MoESpec(n_expert=E, n_expert_used=k, n_ff_exp=F, act=act)
    kc = ops.default_context()
    pool = PoolExperts(
        gate, up, down, np.array(pooled, dtype=np.int64), E, act, torch.device("cpu"), kc, partial=partial
    )
    return Experts(spec, gate, up, down, kc, pool=pool), Experts(spec, gate, up, down, kc)


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("T", [1, 7])
def test_stand_in_gives_the_all_cpu_experts(T: int):
    """Whole experts in the pool: the pool's pairs in one grouped kernel call, the CPU's in another, added:
    the all-CPU layer's sum (measured 0 at T = 1, 7 and 33: the same products per pair). The stand-in's torch path
    (no C kernels) gives the kernel's sum (measured at most 5e-7 relative: torch's float32 products in another
    order than the kernels')."""
    pooled_experts, plain = layer(8, 2, [1, 3, 4, 6], None)
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(3))
    ids, w = routed(T, 8, 2)
    ref = plain(x, ids, w)
    got = pooled_experts(x, ids, w)
    assert pooled_experts.pool_calls > 0 and pooled_experts.pool_calls < ids.numel() or T == 1
    assert rel(got, ref) <= 1e-6
    stack = pooled_experts.pool.whole
    mask = torch.ones_like(ids, dtype=torch.bool)
    kernel = stack(x, ids, w, mask)
    slots = stack.slot[ids]
    assert rel(stack._torch(x, slots, w), kernel) <= 2e-6
    # the pairs whose expert is not in the pool add nothing
    only_cpu = ~pooled_experts.pool.member[ids]
    assert torch.equal(stack(x, ids, w, mask & only_cpu), torch.zeros(T, 64))


def test_stand_in_with_partial_experts_gives_the_all_cpu_experts():
    """Some neurons of ReLU experts 2 and 5 in the pool (one HotRows for both, each token's neurons weighted by
    its router weight of their expert), the CPU computes their other neurons (its gate copy with those rows
    zeroed): the all-CPU sum (measured 9.3e-8 relative at T = 9, 7.3e-8 at T = 1: the pooled neurons' sum added
    apart, the router weight applied before the down product)."""
    partial = {2: np.array([0, 5, 9, 33, 60]), 5: np.array([1, 2, 3])}
    pooled_experts, plain = layer(8, 3, [4], partial, act="relu")
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(4))
    ids, w = routed(9, 8, 3, seed=1)
    assert bool(pooled_experts.pool.partial_member[ids].any())
    assert rel(pooled_experts(x, ids, w), plain(x, ids, w)) <= 5e-7


def test_a_tokens_pool_sum_does_not_depend_on_the_batch():
    """Row t of the pool's sum over 6 tokens is, bit for bit, its sum for token t alone (whole and partial
    experts)."""
    pooled_experts, _ = layer(8, 2, [0, 3, 5], {6: np.array([4, 7, 8])}, act="relu")
    pool = pooled_experts.pool
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(5))
    ids, w = routed(6, 8, 2, seed=2)
    mask = pool.member[ids] | pool.partial_member[ids]
    together = pool.compute(x, ids, w, mask)
    assert together.abs().max() > 0
    for t in range(6):
        alone = pool.compute(x[t : t + 1], ids[t : t + 1], w[t : t + 1], mask[t : t + 1])
        assert torch.equal(alone[0], together[t]), t


def step_call_counts() -> dict[str, list[int]]:
    """Python-level calls of a decode step and of a 4-token step of the pooled experts, per (E, k, pooled,
    partial experts)."""
    counts: dict[str, list[int]] = {}
    for E, k, n_pooled in ((8, 2, 2), (32, 4, 6), (32, 2, 6)):
        for with_partial in (False, True):
            partial = {E - 1: np.array([0, 3]), E - 2: np.array([1])} if with_partial else None
            experts, _ = layer(E, k, list(range(n_pooled)), partial, act="relu")
            got = []
            for T in (1, 4):
                x = torch.randn(T, 64, generator=torch.Generator().manual_seed(T))
                ids, w = routed(T, E, k, seed=T)
                ids[:, 0] = 0  # every step has a pooled pair
                ids = ids.sort(dim=-1).values
                experts(x, ids, w)  # once: the kernel's description for this k is made on first use
                got.append(count_calls(lambda: experts(x, ids, w)))  # noqa: B023
            counts[f"{E} {k} {n_pooled} {int(with_partial)}"] = got
    return counts


def test_python_calls_of_a_step_do_not_grow_with_experts_or_k():
    """A decode step and a 4-token step of the pooled experts make the same number of Python-level calls with
    8 or 32 experts, k = 2 or 4, and 2 or 6 of them in the pool (whole), or partial experts besides: no
    per-expert work, no `.tolist()` of the routing."""
    counts = step_call_counts()
    for with_partial in ("0", "1"):
        seen = {tuple(v) for key, v in counts.items() if key.endswith(with_partial)}
        assert len(seen) == 1, counts


CHECK = r"""
import json, sys, time
import numpy as np, torch
sys.path.insert(0, sys.argv[1])
from test_kquant_kernels import random_k_blocks
from powerinfer.gguf import GGMLType
from powerinfer.ops import triton_quant as tq
from powerinfer.ops.triton_experts import pairs_matmul
from powerinfer.quant import K_QUANT_TYPES, dequantize, quantize

def weight(t, n, k, seed):
    if t in K_QUANT_TYPES:
        return torch.from_numpy(random_k_blocks(t, n, k, seed=seed))
    w = np.random.default_rng(seed).normal(0, 1, (n, k)).astype(np.float32)
    if t == GGMLType.F16:
        return torch.from_numpy(w.astype(np.float16).view(np.uint8))
    if t == GGMLType.BF16:
        return torch.from_numpy(w).view(torch.int32).__rshift__(16).to(torch.int16).view(torch.uint8).reshape(n, -1)
    return torch.from_numpy(quantize(w, t))

torch.manual_seed(0)
start = time.time()
out = {"errors": [], "zero": {}, "alone": {}, "order": {}}
for t in sorted(tq.SUPPORTED_TYPES, key=int):
    S = 3
    N, K = (40, 256) if t in K_QUANT_TYPES else (40, 96)  # two row blocks, the second partial
    raw = weight(t, S * N, K, seed=int(t))
    w = tq.pack(raw, t, K)
    dense = torch.from_numpy(dequantize(raw.numpy(), t, (S * N, K)).copy()).double().view(S, N, K)
    x = torch.randn(3, K, dtype=torch.float64)
    slots = torch.tensor([2, -1, 0, 2, 1, -1])  # pairs of 3 tokens, k = 2
    y = pairs_matmul(x.float(), slots, w, N, 2)
    out["order"][t.name] = bool(torch.equal(pairs_matmul(x.float(), slots, w, N, 2, slots.argsort()), y))
    for p, s in enumerate(slots.tolist()):
        if s >= 0:
            ref = dense[s] @ x[p // 2]
            out["errors"].append([t.name, p, float((y[p].double() - ref).abs().max() / ref.abs().max())])
    out["zero"][t.name] = bool(torch.equal(y[slots < 0], torch.zeros(2, N)))
    out["alone"][t.name] = all(
        torch.equal(pairs_matmul(x[p // 2 : p // 2 + 1].float(), slots[p : p + 1], w, N, 1)[0], y[p])
        for p in range(6)
    )
# the pool's experts, whole and partial, through the Triton kernels against the C kernels' stand-in
from powerinfer import ops
from powerinfer.device.pool import PoolExperts
from test_moe_pool_grouped import routed, stacks
gate, up, down = stacks(8, 64, 64, GGMLType.Q4_0, seed=3)
args = (gate, up, down, np.array([0, 3, 5]), 8, "relu", torch.device("cpu"), ops.default_context())
partial = {6: np.array([4, 7, 8]), 2: np.array([0])}
tri, ker = PoolExperts(*args, "triton", partial=partial), PoolExperts(*args, "kernels", partial=partial)
x = torch.randn(6, 64)
ids, w = routed(6, 8, 2, seed=2)
mask = ker.member[ids] | ker.partial_member[ids]
a, b = tri.compute(x, ids, w, mask), ker.compute(x, ids, w, mask)
out["pool_rel"] = float((a - b).abs().max() / b.abs().max())
part = ker.partial_member[ids]  # the pairs of partial experts alone
mp = mask & part
ap, bp = tri.compute(x, ids, w, mp), ker.compute(x, ids, w, mp)
out["partial_pairs"] = int(part.sum())
out["partial_rel"] = float((ap - bp).abs().max() / bp.abs().max())
out["pool_alone"] = all(
    torch.equal(tri.compute(x[t : t + 1], ids[t : t + 1], w[t : t + 1], mask[t : t + 1])[0], a[t]) for t in range(6)
)
out["seconds"] = time.time() - start
print(json.dumps(out))
"""
TRITON_CHECK = BackgroundCheck(
    (sys.executable, "-c", CHECK, str(TESTS)), (("TRITON_INTERPRET", "1"), ("OMP_NUM_THREADS", "1"))
)

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)
# max |y - ref| / max |ref| against float64 of each pair's row: float32 fma per column, then a sum of 32 (measured
# at most 1.6e-7 over every type, Q2_K)
PAIR_TOL = 1e-6


@needs_triton
@pytest.mark.slow  # about 11 s on a busy 2-core machine (the interpreter runs every program in numpy)
@pytest.mark.background(TRITON_CHECK)
def test_triton_pair_kernel_every_type(request):
    """The CUDA pool's pair kernel in the Triton interpreter: every pool type, rows of a pair's slot times its
    token's input against float64, pairs outside the pool exactly 0, and each pair's row alone the same bits as
    in the batch. Then a layer's pooled experts (whole and partial, ReLU) through the Triton kernels against the
    C kernels' stand-in (measured 1.1e-7 relative, the partial experts' pairs alone 1.1e-7; bound 1e-6), each token's sum alone the same bits as in the
    step."""
    proc = run_background(request, TRITON_CHECK)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    from powerinfer.ops import triton_quant

    assert {e[0] for e in report["errors"]} == {t.name for t in triton_quant.SUPPORTED_TYPES}
    bad = [e for e in report["errors"] if not e[-1] < PAIR_TOL]
    assert not bad, bad
    assert all(report["zero"].values()), report["zero"]
    assert all(report["alone"].values()), report["alone"]
    assert all(report["order"].values()), report["order"]  # the programs' order of the pairs changes no bit
    assert report["pool_rel"] <= 1e-6 and report["pool_alone"], report
    assert report["partial_pairs"] > 0 and report["partial_rel"] <= 1e-6, report


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_pool_experts_without_host_sync():
    """On a GPU: the pooled experts' step (whole and partial) queued with host syncs turned into errors, its sum
    against the CPU stand-in's (float32 sums in another order: bound 1e-5 relative, as the other pool tests; not
    measured on a GPU yet), each token's sum alone the same bits."""
    E, k, D, F = 16, 4, 64, 64
    gate, up, down = stacks(E, D, F, GGMLType.Q4_0, seed=7)
    kc = ops.default_context()
    args = (gate, up, down, np.array([0, 2, 5, 9, 11], dtype=np.int64), E, "relu")
    partial = {3: np.array([1, 8, 40]), 12: np.array([0, 63])}
    cpu = PoolExperts(*args, torch.device("cpu"), kc, partial=partial)
    gpu = PoolExperts(*args, torch.device("cuda"), kc, partial=partial)
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(8))
    ids, w = routed(5, E, k, seed=9)
    mask = cpu.member[ids] | cpu.partial_member[ids]
    ref = cpu.compute(x, ids, w, mask)
    d = torch.device("cuda")
    xd, idsd, wd, maskd = x.to(d), ids.to(d), w.to(d), mask.to(d)
    gpu.compute(xd, idsd, wd, maskd)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = gpu.compute(xd, idsd, wd, maskd)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel(got.cpu(), ref) <= 1e-5
    for t in range(5):  # a token's sum alone is the same bits as in the step
        alone = gpu.compute(xd[t : t + 1], idsd[t : t + 1], wd[t : t + 1], maskd[t : t + 1])
        assert torch.equal(alone[0], got[t]), t
