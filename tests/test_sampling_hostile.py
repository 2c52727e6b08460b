"""The sampler under hostile parameters and logits: llama.cpp's clamps and off-values, refusals of what would make
the distribution NaN, seeds reduced to uint32, and (property-based) a token id in range or a SamplingError for
any logits, finite or not."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from powerinfer.errors import InputError
from powerinfer.sampling import (
    FLOAT32_MAX,
    Sampler,
    SamplingError,
    SamplingParamError,
    SamplingParams,
    apply_penalties,
    resolve_seed,
)

INF, NAN = math.inf, math.nan
PLAIN = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}  # every sampler stage off


# ---------------------------------------------------------------------- refused and accepted parameters
@pytest.mark.parametrize(
    "field, value, words",
    [
        ("temp", NAN, "finite"),
        ("temp", INF, "finite"),
        ("temp", -INF, "finite"),
        ("temp", 1e39, "finite"),  # finite in float64, inf as the float32 the sampler divides by
        ("top_p", NAN, "finite"),
        ("min_p", INF, "finite"),
        ("repeat_penalty", 0.0, "positive"),
        ("repeat_penalty", -1.0, "positive"),
        ("repeat_penalty", 1e-45, "non-denormal"),  # 1/x overflows float32: positive logits become inf
        ("repeat_penalty", NAN, "finite"),
        ("frequency_penalty", INF, "finite"),
        ("presence_penalty", NAN, "finite"),
        ("repeat_last_n", -2, ">= -1"),
        ("top_k", 1.5, "integer"),
        ("seed", True, "integer"),
    ],
)
def test_params_that_break_the_math_are_refused(field, value, words):
    with pytest.raises(SamplingParamError) as e:
        SamplingParams(**{field: value})
    assert isinstance(e.value, InputError) and e.value.field == field
    assert words in str(e.value) and str(e.value).startswith(field)


def test_llama_cpp_off_values_and_clamps_are_accepted():
    logits = torch.tensor([0.5, 3.0, 1.0, -2.0])
    # temp <= 0 is greedy (llama.cpp), also negative and float32-underflowing temperatures
    for temp in (0.0, -1.0, 1e-46):
        assert Sampler(SamplingParams(temp=temp, repeat_penalty=1.0)).temp <= 0
        assert Sampler(SamplingParams(temp=temp, repeat_penalty=1.0))(logits) == 1
    # a denormal but float32-representable temperature is the greedy limit, not inf - inf
    s = Sampler(SamplingParams(temp=1e-45, seed=1, **PLAIN))
    assert {s(logits) for _ in range(20)} == {1}
    # top_k <= 0 or past the vocabulary keeps all; top_p >= 1 off, <= 0 keeps one; min_p > 1 keeps one
    for extra in ({"top_k": -5}, {"top_k": 2**70}, {"top_p": 7.0}, {"min_p": -1.0}):
        s = Sampler(SamplingParams(temp=1.0, seed=3, **{**PLAIN, **extra}))
        assert {s(logits) for _ in range(300)} == {0, 1, 2, 3}
    for extra in ({"top_p": 0.0}, {"top_p": -3.0}, {"min_p": 5.0}):
        s = Sampler(SamplingParams(temp=1.0, seed=3, **{**PLAIN, **extra}))
        assert {s(logits) for _ in range(50)} == {1}


def test_seed_is_reduced_to_uint32_as_llama_cpp_does():
    assert resolve_seed(42) == 42
    assert resolve_seed(2**70 + 42) == 42
    assert resolve_seed(-2) == 2**32 - 2
    assert resolve_seed(2**32) == 0
    # -1 and 0xFFFFFFFF (LLAMA_DEFAULT_SEED) draw a random seed that is itself reproducible
    drawn = {resolve_seed(-1) for _ in range(20)} | {resolve_seed(2**32 - 1), resolve_seed(2**64 - 1)}
    assert all(0 <= s < 2**32 - 1 for s in drawn) and len(drawn) > 1
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    a = Sampler(SamplingParams(temp=1.0, seed=2**70 + 7, **PLAIN))
    b = Sampler(SamplingParams(temp=1.0, seed=7, **PLAIN))
    assert a.seed == b.seed == 7 and [a(logits) for _ in range(50)] == [b(logits) for _ in range(50)]


def test_repeat_last_n_minus_one_is_the_whole_context():
    logits = torch.tensor([2.0, 2.0, 2.0, 2.0])
    history = [0, 1, 2, 3] * 40  # 160 tokens, more than the default window of 64
    out = apply_penalties(
        logits, [0] + history[1:] + [3], SamplingParams(repeat_penalty=2.0, repeat_last_n=-1)
    )
    assert out.tolist() == [1.0, 1.0, 1.0, 1.0]
    out = apply_penalties(logits, [0] + [1] * 100, SamplingParams(repeat_penalty=2.0, repeat_last_n=-1))
    assert out.tolist() == [1.0, 1.0, 2.0, 2.0]
    out = apply_penalties(logits, [0] + [1] * 100, SamplingParams(repeat_penalty=2.0, repeat_last_n=0))
    assert out.tolist() == [2.0, 2.0, 2.0, 2.0]


# ---------------------------------------------------------------------- non-finite logits
def test_non_finite_logits_never_produce_nan_or_a_bad_id():
    for temp in (0.0, 1.0):
        p = SamplingParams(temp=temp, seed=5, **PLAIN)
        # NaN is never drawn, +inf is the certain choice, -inf is banned
        assert {Sampler(p)(torch.tensor([NAN, 1.0, NAN])) for _ in range(20)} == {1}
        assert {Sampler(p)(torch.tensor([0.0, INF, 3.0, NAN])) for _ in range(20)} == {1}
        two = {
            Sampler(SamplingParams(temp=temp, seed=s, **PLAIN))(torch.tensor([INF, -INF, INF]))
            for s in range(40)
        }
        assert two <= {0, 2} and (temp == 0 or two == {0, 2})  # two +inf tie
        for bad in ([NAN, NAN], [-INF, NAN, -INF], [-INF], []):
            with pytest.raises(SamplingError, match="no token can be sampled"):
                Sampler(p)(torch.tensor(bad))
    # the largest finite logits and a huge penalty stay finite: no overflow into inf - inf
    p = SamplingParams(temp=0.7, seed=2, top_k=0, top_p=0.9, min_p=0.01, repeat_penalty=1e-30)
    assert Sampler(p)(torch.tensor([FLOAT32_MAX, -FLOAT32_MAX, 5.0]), [2]) in (0, 2)


def test_a_ban_everywhere_but_one_token_always_picks_it():
    logits = torch.full((300,), -INF)
    logits[123] = -1e30
    for temp in (0.0, 0.8, 1e6):
        s = Sampler(SamplingParams(temp=temp, seed=9, top_k=40, top_p=0.5, min_p=0.5, repeat_penalty=1.3))
        assert {s(logits, [123, 5]) for _ in range(10)} == {123}


FLOATS = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, INF, -INF, NAN, FLOAT32_MAX, -FLOAT32_MAX, 1e-45]),
)
FINITE = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    return SamplingParams(
        temp=draw(st.one_of(FINITE, st.sampled_from([0.0, -1.0, 1e-45, 1e-30, 0.8, 1e30]))),
        top_k=draw(st.one_of(st.integers(-3, 70), st.just(2**70))),
        top_p=draw(st.one_of(FINITE, st.floats(0, 1))),
        min_p=draw(st.one_of(FINITE, st.floats(0, 1))),
        repeat_penalty=draw(st.one_of(st.floats(2.0**-126, FLOAT32_MAX, width=32), st.just(1.0))),
        repeat_last_n=draw(st.integers(-1, 80)),
        frequency_penalty=draw(st.one_of(FINITE, st.just(0.0))),
        presence_penalty=draw(st.one_of(FINITE, st.just(0.0))),
        seed=draw(st.one_of(st.integers(-(2**80), 2**80), st.just(-1))),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    logits=st.lists(FLOATS, min_size=1, max_size=64),
    params=sampling_params(),
    history=st.lists(st.integers(-5, 80), max_size=100),
)
def test_any_logits_and_params_give_an_id_in_range_or_sampling_error(logits, params, history):
    x = torch.tensor(logits, dtype=torch.float32)
    try:
        token = Sampler(params)(x, history)
    except SamplingError:
        # only when nothing can be drawn: every logit was NaN or -inf, or a penalty pushed the rest to -inf
        n = len(history) if params.repeat_last_n < 0 else params.repeat_last_n
        penalized = {t for t in (history[-n:] if n > 0 else []) if 0 <= t < len(logits)}
        survivors = {i for i, v in enumerate(logits) if not math.isnan(v) and v != -INF}
        assert survivors <= penalized
        return
    assert isinstance(token, int) and 0 <= token < len(logits)
    assert not math.isnan(logits[token])
    no_penalty = (
        params.repeat_penalty == 1.0 and params.frequency_penalty == 0 and params.presence_penalty == 0
    )
    if no_penalty:
        assert logits[token] != -INF
        if params.greedy:
            best = max(v if not math.isnan(v) else -INF for v in logits)
            assert logits[token] == best


@settings(max_examples=100, deadline=None)
@given(logits=st.lists(FLOATS, min_size=1, max_size=32))
def test_greedy_without_penalties_is_the_nan_free_argmax(logits):
    x = torch.tensor(logits, dtype=torch.float32)
    clean = [v for v in x.tolist() if not math.isnan(v) and v != -INF]
    sampler = Sampler(SamplingParams(temp=0.0, **PLAIN))
    if not clean:
        with pytest.raises(SamplingError):
            sampler(x)
        return
    assert x[sampler(x)].item() == max(clean)
