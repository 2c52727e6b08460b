"""ops.top_k and ops.top_about_k (kernels/cpu/select.c) against torch.topk, the oracle."""

from __future__ import annotations

import pytest
import torch

from powerinfer import ops
from powerinfer.ops.library import kernels_available


def vectors():
    g = torch.Generator().manual_seed(0)
    for trial in range(24):
        n = (49152, 3000, 10, 100000)[trial % 4]
        v = torch.randn(n, generator=g) * 10.0 ** (trial % 5 - 2)
        if trial % 3 == 0:
            v[::7] = v[3]  # many ties
        if trial % 5 == 1:
            v = v.round()  # ties everywhere
        if n > 20 and trial % 2:
            v[5], v[6], v[7] = float("nan"), -0.0, 0.0
        yield v


def keys(v: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(v, nan=float("-inf"))


@pytest.mark.parametrize("k", [1, 3, 64, 1024])
def test_top_k_is_torch_topk(k):
    for v in vectors():
        if k > v.numel():
            continue
        ids, left = ops.top_k(v, k)
        assert ids.numel() == k and torch.equal(ids, ids.sort().values)
        assert torch.equal(keys(v)[ids].sort().values, keys(v).topk(k).values.sort().values)
        out = torch.ones(v.numel(), dtype=torch.bool)
        out[ids] = False
        if out.any():
            below = float(keys(v)[out].max())
            assert left == below or (below == float("-inf") and left != left)  # only NaNs left out: NaN
        # ties: the lowest indices holding the k-th value
        kth = keys(v)[ids].min()
        tied = (keys(v) == kth).nonzero().view(-1)
        assert torch.equal(tied[: int((keys(v)[ids] == kth).sum())], ids[keys(v)[ids] == kth])


@pytest.mark.parametrize("k", [16, 64, 1024])
def test_top_about_k_takes_a_threshold(k):
    for v in vectors():
        if k > v.numel():
            continue
        ids, left = ops.top_about_k(v, k)
        m = ids.numel()
        assert 0 < m <= 4 * k and torch.equal(ids, ids.sort().values)
        out = torch.ones(v.numel(), dtype=torch.bool)
        out[ids] = False
        if out.any():  # every value kept is at least every value left out, the largest of which is `left`
            assert float(keys(v)[ids].min()) >= float(keys(v)[out].max())
            assert left == float(keys(v)[out].max()) or left != left
        if (
            k >= 64
            and v.numel() >= 32 * k
            and float(v.std()) > 0
            and not torch.isnan(v).any()
            and (v.round() != v).any()
        ):
            assert k // 4 < m < 2 * k  # a sampled threshold lands near k on continuous values (~k +- k / 2)


def test_bad_k():
    with pytest.raises(ValueError):
        ops.top_k(torch.zeros(4), 5)
    with pytest.raises(ValueError):
        ops.top_about_k(torch.zeros(4), 0)


@pytest.mark.skipif(not kernels_available(), reason="needs the C kernels")
@pytest.mark.parametrize("k", [16, 1024])
def test_top_about_k_same_at_every_simd_level(k):
    """The AVX-512 pass (16 keys at a time) lists the same indices and the same largest value left out as the
    scalar one: NaN, -0 and +0, infinities, ties and a tail that is not a multiple of 16 included."""
    for v in vectors():
        if k > v.numel():
            continue
        for n in (v.numel(), v.numel() - 7):
            if k > n:
                continue
            w = v[:n].clone()
            w[1::997] = float("inf")
            w[2::1999] = float("-inf")
            w[3::2999] = -float("nan")
            ids0, left0 = ops.top_about_k(w, k, isa=0)
            ids2, left2 = ops.top_about_k(w, k, isa=2)
            assert torch.equal(ids0, ids2)
            assert left0 == left2 or (left0 != left0 and left2 != left2)
