"""Samplers: llama.cpp semantics, order and seeding."""

from __future__ import annotations

import math

import torch

from powerinfer.sampling import Sampler, SamplingParams, apply_penalties, min_p, top_k, top_p


def test_repeat_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_penalties(logits, [0, 1, 1], SamplingParams(repeat_penalty=2.0))
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # input untouched


def test_repeat_window_and_frequency_presence():
    logits = torch.zeros(5)
    p = SamplingParams(repeat_penalty=1.0, repeat_last_n=3, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [4, 1, 1, 2], p)  # only the last 3 tokens: 1, 1, 2
    assert out.tolist() == [0.0, -1.25, -0.75, 0.0, 0.0]


def test_truncations():
    values = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    ids = torch.arange(5)
    assert top_k(values, ids, 2)[1].tolist() == [0, 1]
    assert top_k(values, ids, 0)[1].tolist() == [0, 1, 2, 3, 4]
    probs = torch.softmax(values, 0)
    # top-p keeps the smallest prefix whose mass reaches p
    assert top_p(values, ids, float(probs[0]) - 1e-6)[1].tolist() == [0]
    assert top_p(values, ids, float(probs[0] + probs[1]) - 1e-6)[1].tolist() == [0, 1]
    assert top_p(values, ids, 1.0)[1].tolist() == [0, 1, 2, 3, 4]
    # min-p keeps candidates with p >= min_p * p_max: exp(-1) ~ 0.37, exp(-2) ~ 0.14
    assert min_p(values, ids, 0.3)[1].tolist() == [0, 1]
    assert min_p(values, ids, 0.1)[1].tolist() == [0, 1, 2]


def test_greedy_is_argmax_after_penalty():
    logits = torch.tensor([1.0, 5.0, 4.9])
    assert Sampler(SamplingParams(temp=0, repeat_penalty=1.0))(logits, [1]) == 1
    assert Sampler(SamplingParams(temp=0, repeat_penalty=1.1))(logits, [1]) == 2


def test_seeded_sampling_is_reproducible_and_follows_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    params = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=42)
    a = [Sampler(params)(logits) for _ in range(3)]
    s1, s2 = Sampler(params), Sampler(params)
    seq1 = [s1(logits) for _ in range(2000)]
    seq2 = [s2(logits) for _ in range(2000)]
    assert seq1 == seq2 and len(set(a)) == 1
    freq = [seq1.count(i) / len(seq1) for i in range(3)]
    for f, p in zip(freq, [0.5, 0.3, 0.2], strict=False):
        assert math.isclose(f, p, abs_tol=0.04)


def test_top_k_one_is_greedy_and_temperature_sharpens():
    logits = torch.tensor([0.0, 1.0, 0.5])
    s = Sampler(SamplingParams(temp=1.0, top_k=1, repeat_penalty=1.0, seed=1))
    assert {s(logits) for _ in range(50)} == {1}
    cold = Sampler(SamplingParams(temp=0.05, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=3))
    assert sum(cold(logits) == 1 for _ in range(200)) >= 195


def test_top_k_sorted_is_the_exact_top_k_best_first_ties_by_id():
    """The candidates' fast path (a sampled threshold, ops.top_about_k) against a plain stable sort: the same ids
    in the same order on rows with ties (few distinct values), banned (-inf) tokens, k at and above the finite
    count, k <= 0, and vocabularies small enough for the whole-row path."""
    from powerinfer.sampling import top_k_sorted

    g = torch.Generator().manual_seed(7)
    for trial in range(60):
        n = [49152, 4096, 300, 17][trial % 4]
        levels = [n, 50, 3][trial % 3]  # ties: few distinct values
        x = torch.randint(0, levels, (n,), generator=g).float() * 0.37 - 5.0
        if trial % 5 == 0:
            x[torch.randperm(n, generator=g)[: n // 2]] = float("-inf")
        for k in (1, 40, 64, n // 3, n, n + 5, 0):
            values, ids = top_k_sorted(x.contiguous(), k)
            order = torch.sort(x, descending=True, stable=True).indices
            order = order[torch.isfinite(x[order])]
            ref = order if k <= 0 else order[:k]
            assert torch.equal(ids, ref), (trial, n, k)
            assert torch.equal(values, x[ref])
