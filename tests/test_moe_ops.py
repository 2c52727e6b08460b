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


@pytest.mark.parametrize("name", ["Q4_0", "Q6_K", "IQ4_NL"])
@pytest.mark.parametrize("act", ["silu", "relu"])
def test_one_token_paths_equal_per_expert_matmuls(name: str, act: str):
    """A token alone (rows_matmul where the type has it, IQ4_NL through experts_matmul; ReGLU skipping up rows)
    equals the per-expert linear path bit for bit."""
    from powerinfer.model.moe import Experts, MoESpec, route

    E, F, D = 8, 256, 256
    t = GGMLType[name]
    rng = np.random.default_rng(4)

    def stack(rows: int, cols: int) -> ops.QWeight:
        data = rng.normal(0, 0.1, (E * rows, cols)).astype(np.float32)
        return ops.QWeight.from_numpy(np.asarray(quantize(data, t)), t, (E * rows, cols))

    spec = MoESpec(n_expert=E, n_expert_used=3, n_ff_exp=F, act=act, norm_weights=True)
    experts = Experts(spec, stack(F, D), stack(F, D), stack(D, F), ops.default_context())
    assert experts.rows_path == (name != "IQ4_NL") and experts.sparse == (act == "relu" and name != "IQ4_NL")
    for seed in range(4):
        x = torch.randn(1, D, generator=torch.Generator().manual_seed(seed))
        ids, weights = route(torch.randn(1, E, generator=torch.Generator().manual_seed(10 + seed)), spec)
        want = torch.zeros(1, D)
        for j, e in enumerate(ids[0].tolist()):
            want += experts.expert(e, x) * weights[0, j]
        assert torch.equal(experts(x, ids, weights), want)


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
