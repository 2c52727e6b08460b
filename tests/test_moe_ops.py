"""ops.moe.experts_down against its reference (`linear` on each expert's row slice), bit for bit, per type."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from powerinfer import ops
from powerinfer.gguf import GGMLType
from powerinfer.ops.encode import quantize
from powerinfer.ops.moe import experts_down, experts_down_ref
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
def test_experts_down_matches_linear(name: str):
    E, D, F = 6, 48, 256
    t = GGMLType[name]
    data = np.random.default_rng(1).normal(0, 0.1, (E * D, F)).astype(np.float32)
    raw = data.astype(np.float16).view(np.uint8) if t == GGMLType.F16 else quantize(data, t)
    w = ops.QWeight.from_numpy(np.asarray(raw), t, (E * D, F))
    h = torch.randn(3, F, generator=torch.Generator().manual_seed(2))
    experts = [5, 0, 2]
    want = experts_down_ref(h, w, D, experts)
    assert torch.equal(experts_down(h, w, D, experts), want)
    # against the stored blocks decoded (float sums in another order): measured up to 3e-7 relative
    dense = torch.from_numpy(dequantize(np.asarray(raw), t, (E * D, F)).reshape(E, D, F).astype(np.float32))
    ref = torch.stack([dense[e] @ h[j] for j, e in enumerate(experts)])
    assert (want - ref).abs().max() <= 1e-5 * ref.abs().max()
    with pytest.raises(ValueError):
        experts_down(h, w, D, [5, 0, 6])  # an expert past the stack
