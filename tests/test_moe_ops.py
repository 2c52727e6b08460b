"""ops.moe.experts_matmul against its reference (`linear` on each expert's row slice), bit for bit, per type."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from powerinfer import ops
from powerinfer.gguf import GGMLType
from powerinfer.ops.encode import quantize
from powerinfer.ops.moe import experts_matmul, experts_matmul_ref
from powerinfer.quant import dequantize

TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
)


@pytest.mark.parametrize("name", TYPES)
def test_experts_matmul_matches_linear(name: str):
    E, D, F = 6, 48, 256
    t = GGMLType[name]
    data = np.random.default_rng(1).normal(0, 0.1, (E * D, F)).astype(np.float32)
    raw = data.astype(np.float16).view(np.uint8) if t == GGMLType.F16 else quantize(data, t)
    w = ops.QWeight.from_numpy(np.asarray(raw), t, (E * D, F))
    h = torch.randn(3, F, generator=torch.Generator().manual_seed(2))
    experts = [5, 0, 2]
    want = experts_matmul_ref(h, w, D, experts)
    assert torch.equal(experts_matmul(h, w, D, experts), want)
    shared = experts_matmul(h[1:2], w, D, experts)  # one input for every expert (gate and up)
    assert torch.equal(shared, experts_matmul_ref(h[1:2], w, D, experts))
    # against the stored blocks decoded (float sums in another order): measured up to 3e-7 relative
    dense = torch.from_numpy(dequantize(np.asarray(raw), t, (E * D, F)).reshape(E, D, F).astype(np.float32))
    ref = torch.stack([dense[e] @ h[j] for j, e in enumerate(experts)])
    assert (want - ref).abs().max() <= 1e-5 * ref.abs().max()
    with pytest.raises(ValueError):
        experts_matmul(h, w, D, [5, 0, 6])  # an expert past the stack


@pytest.mark.parametrize("name", ["F16", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_NL"])
@pytest.mark.parametrize("act", ["silu", "relu"])
@pytest.mark.parametrize("precision", ["f32", "q8"])
def test_one_token_paths_equal_per_expert_matmuls(name: str, act: str, precision: str):
    """A token alone (the experts kernel where it reads the type, kernels/cpu/moe.c; IQ4_NL op by op; ReGLU
    skipping up rows) equals the per-expert linear path bit for bit, in both activation precisions."""
    from powerinfer.model.moe import Experts, MoESpec, route

    E, F, D = 8, 256, 256
    t = GGMLType[name]
    rng = np.random.default_rng(4)

    def stack(rows: int, cols: int, loc: float = 0.0) -> ops.QWeight:
        data = rng.normal(loc, 0.1, (E * rows, cols)).astype(np.float32)
        return ops.QWeight.from_numpy(np.asarray(quantize(data, t)), t, (E * rows, cols))

    spec = MoESpec(n_expert=E, n_expert_used=3, n_ff_exp=F, act=act, norm_weights=True)
    kc = ops.default_context().replace(act_precision=precision)
    experts = Experts(spec, stack(F, D, -0.02), stack(F, D), stack(D, F), kc)
    assert (experts.kernel is None) == (name == "IQ4_NL")
    for seed in range(4):
        x = torch.randn(1, D, generator=torch.Generator().manual_seed(seed))
        if seed >= 2:  # positive inputs: most gates negative (ReGLU: the up rows of a list), else about half
            x = x.abs()
        ids, weights = route(torch.randn(1, E, generator=torch.Generator().manual_seed(10 + seed)), spec)
        want = torch.zeros(1, D)
        for j, e in enumerate(ids[0].tolist()):
            want += experts.expert(e, x) * weights[0, j]
        assert torch.equal(experts(x, ids, weights), want)


@pytest.mark.parametrize("n_used", [4, 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_token_q4_0_rows_read_in_pairs_equal_per_expert_matmuls(n_used: int, threads: int):
    """Q4_0 experts of the bench files' widths (n_embd 1024, n_ff 512): one token's gate and up rows read side by side
    and two experts' down rows side by side (the rows kernel with a second matrix, an odd expert alone), at 1 and 2
    threads: bit for bit the per-expert linear path."""
    from powerinfer.model.moe import Experts, MoESpec, route

    E, F, D = 8, 512, 1024
    t = GGMLType.Q4_0
    rng = np.random.default_rng(7)

    def stack(rows: int, cols: int) -> ops.QWeight:
        data = rng.normal(0.0, 0.1, (E * rows, cols)).astype(np.float32)
        return ops.QWeight.from_numpy(np.asarray(quantize(data, t)), t, (E * rows, cols))

    spec = MoESpec(n_expert=E, n_expert_used=n_used, n_ff_exp=F, act="silu", norm_weights=True)
    kc = ops.default_context().replace(act_precision="q8", n_threads=threads)
    experts = Experts(spec, stack(F, D), stack(F, D), stack(D, F), kc)
    assert experts.kernel is not None
    for seed in range(3):
        x = torch.randn(1, D, generator=torch.Generator().manual_seed(seed))
        ids, weights = route(torch.randn(1, E, generator=torch.Generator().manual_seed(20 + seed)), spec)
        want = torch.zeros(1, D)
        for j, e in enumerate(ids[0].tolist()):
            want += experts.expert(e, x) * weights[0, j]
        assert torch.equal(experts(x, ids, weights), want)


@pytest.mark.parametrize("name", ["F16", "Q4_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("act", ["silu", "relu"])
@pytest.mark.parametrize("precision", ["f32", "q8"])
def test_grouped_kernel_equals_each_token_alone(name: str, act: str, precision: str):
    """A prompt's experts in one kernel call (pi_moe_grouped_ffn: tokens grouped by expert, matrices split in row
    ranges between threads) equal each token through the one-token kernel and the op-by-op grouped path (grouped
    matmuls, gated, index_add_) bit for bit, at 1 and 2 threads."""
    from powerinfer.model.moe import Experts, MoESpec, route

    E, F, D, T = 8, 512, 256, 11
    t = GGMLType[name]
    rng = np.random.default_rng(7)

    def stack(rows: int, cols: int) -> ops.QWeight:
        data = rng.normal(0, 0.1, (E * rows, cols)).astype(np.float32)
        return ops.QWeight.from_numpy(np.asarray(quantize(data, t)), t, (E * rows, cols))

    spec = MoESpec(n_expert=E, n_expert_used=3, n_ff_exp=F, act=act, norm_weights=True)
    gate, up, down = stack(F, D), stack(F, D), stack(D, F)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(8))
    ids, weights = route(torch.randn(T, E, generator=torch.Generator().manual_seed(9)), spec)
    for threads in (1, 2):
        kc = ops.KernelContext(n_threads=threads, act_precision=precision)
        experts = Experts(spec, gate, up, down, kc)
        assert experts.kernel is not None
        alone = torch.cat([experts(x[i : i + 1], ids[i : i + 1], weights[i : i + 1]) for i in range(T)])
        for n in (2, T):  # 2 tokens: at most 6 groups, each split in row ranges at 2 threads
            got = experts(x[:n], ids[:n], weights[:n])
            assert torch.equal(got, alone[:n]), (threads, n)
            kernel, experts.kernel = experts.kernel, None  # the op-by-op grouped path
            assert torch.equal(got, experts(x[:n], ids[:n], weights[:n])), (threads, n)
            experts.kernel = kernel
        mask = (
            torch.rand(T, 3, generator=torch.Generator().manual_seed(threads)) < 0.6
        )  # the pairs a pool leaves
        got = experts.pairs(x, ids, weights, mask)
        kernel, experts.kernel = experts.kernel, None
        assert torch.equal(got, experts.pairs(x, ids, weights, mask)), threads
        experts.kernel = kernel
        none = torch.zeros_like(
            mask
        )  # every pair on the pool: no group left (this divided by zero at 2 threads)
        assert torch.equal(experts.pairs(x, ids, weights, none), torch.zeros(T, D)), threads
    with pytest.raises(IndexError, match="moe_grouped_ffn"):  # an expert past the stack
        experts.kernel.grouped(x, torch.full_like(ids, E), weights)


@pytest.mark.parametrize("name", ["F16", "Q4_0", "Q4_K", "IQ4_XS"])
def test_grouped_matmul_matches_linear(name: str):
    from powerinfer.ops.moe import grouped_matmul, grouped_matmul_ref

    E, N, K = 6, 40, 256
    t = GGMLType[name]
    data = np.random.default_rng(5).normal(0, 0.1, (E * N, K)).astype(np.float32)
    raw = data.astype(np.float16).view(np.uint8) if t == GGMLType.F16 else quantize(data, t)
    w = ops.QWeight.from_numpy(np.asarray(raw), t, (E * N, K))
    experts, counts = [0, 2, 3, 5], [3, 1, 0, 7]
    x = torch.randn(sum(counts), K, generator=torch.Generator().manual_seed(6))
    y = grouped_matmul(x, w, N, experts, counts)
    assert torch.equal(y, grouped_matmul_ref(x, w, N, experts, counts))
    assert torch.equal(y[4:], ops.linear(x[4:], ops.weight_rows(w, 5 * N, 6 * N)))  # the last group: expert 5
    with pytest.raises(ValueError):
        grouped_matmul(x, w, N, experts, [3, 1, 0, 6])  # counts that do not add up to x's rows


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
@pytest.mark.parametrize(
    ("n", "k", "norm", "scale"), [(8, 2, True, 1.0), (64, 8, False, 2.5), (128, 1, True, 1.0)]
)
def test_route_kernel_matches_torch(gating: str, n: int, k: int, norm: bool, scale: float):
    """pi_moe_route (the one-token block's routing, also the prompt's) against the torch routing: the same experts,
    weights within 1e-6 relative (measured: at most 5.5e-7, softmax over 64 experts: expf and a sequential sum
    against torch's vectorised exp and sum); each row as if alone, bit for bit."""
    from powerinfer.model.moe import MoESpec, route
    from powerinfer.ops.moe import moe_route

    spec = MoESpec(
        n_expert=n, n_expert_used=k, n_ff_exp=32, gating=gating, norm_weights=norm, weights_scale=scale
    )
    logits = torch.randn(40, n, generator=torch.Generator().manual_seed(n + k)) * 2
    got = moe_route(logits, k, gating, norm, scale)
    assert got is not None
    want = route(logits, spec, ops.KernelContext(enabled=False))  # the torch path
    assert torch.equal(got[0], want[0])
    assert torch.allclose(got[1], want[1], rtol=1e-6, atol=0)
    alone = [moe_route(logits[t : t + 1], k, gating, norm, scale) for t in range(40)]
    assert torch.equal(torch.cat([a[1] for a in alone if a is not None]), got[1])
    assert torch.equal(route(logits, spec)[1], got[1])  # route() takes the kernel where it applies


def test_moe_kernels_reject_bad_arguments():
    """Impossible sizes and mismatched tensors: one clear error, the kernels read nothing."""
    from powerinfer.model.moe import Experts, MoESpec
    from powerinfer.ops import library
    from powerinfer.ops.moe import moe_ffn_block

    lib = library.load()
    logits, ids, w = torch.zeros(1, 8), torch.zeros(1, 9, dtype=torch.int64), torch.zeros(1, 9)
    assert lib.moe_route(logits.data_ptr(), 1, 8, 9, 0, 1, 1.0, ids.data_ptr(), w.data_ptr()) != 0  # k > n
    assert lib.moe_route(logits.data_ptr(), 1, 8, 2, 2, 1, 1.0, ids.data_ptr(), w.data_ptr()) != 0  # gating 2
    assert lib.moe_experts_scratch_bytes(64, 0, 2) == -1
    t = GGMLType.Q4_0
    rng = np.random.default_rng(1)

    def stack(rows: int, cols: int) -> ops.QWeight:
        data = rng.normal(0, 0.1, (8 * rows, cols)).astype(np.float32)
        return ops.QWeight.from_numpy(np.asarray(quantize(data, t)), t, (8 * rows, cols))

    spec = MoESpec(n_expert=8, n_expert_used=2, n_ff_exp=64, norm_weights=True)
    experts = Experts(spec, stack(64, 64), stack(64, 64), stack(64, 64), ops.default_context())
    assert experts.kernel is not None
    with pytest.raises(ValueError, match="moe_experts"):
        experts.kernel(torch.zeros(1, 64), torch.tensor([[0, 1, 2]]), torch.zeros(1, 2), torch.zeros(1, 64))
    with pytest.raises(IndexError, match="moe_experts"):  # an expert past the stack
        experts.kernel(torch.zeros(1, 64), torch.tensor([[0, 8]]), torch.zeros(1, 2), torch.zeros(1, 64))
    router = stack(1, 64)  # (8, 64)
    block = moe_ffn_block(torch.ones(64), 1e-6, router, experts.kernel, "softmax", True, 1.0)
    assert block is not None
    with pytest.raises(ValueError, match="moe_ffn_block"):
        block(torch.zeros(1, 32))
    with pytest.raises(ValueError, match="moe_ffn_block"):
        block(torch.zeros(1, 64), torch.zeros(1, 7))
    assert moe_ffn_block(torch.ones(64), 1e-6, stack(2, 64), experts.kernel, "softmax", True, 1.0) is None
