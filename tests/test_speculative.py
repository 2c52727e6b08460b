"""Speculative decoding on tiny models (runtime.speculative).

Greedy: the tokens are those of plain decoding whatever the prompt, the drafter (the same weights in Q4_0, a
model of other weights, n-gram lookup), draft-max/min, p-min, penalties and limits; a property (hypothesis), for
one sequence and for several sharing steps. Sampling: the rejection scheme keeps the target's distribution,
checked against the exact distribution computed from the target's logits. Bad input: one error line, exit 1.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest
import torch
from conftest import assert_one_error_line, random_llama_state, write_llama_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from powerinfer.cli import app
from powerinfer.errors import InputError
from powerinfer.gguf.constants import GGMLType
from powerinfer.ops import kernels_available
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.generate import Generator, GenParams, generate
from powerinfer.runtime.speculative import (
    LookupDrafter,
    SpecOptions,
    Speculator,
    _judge,
    load_speculator,
)
from powerinfer.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.skipif(not kernels_available(), reason="powerinfer._kernels is not built")

N_CTX = 128
runner = CliRunner()
GREEDY = SamplingParams(temp=0.0, repeat_penalty=1.0)
GREEDY_PENALISED = SamplingParams(temp=0.0, repeat_penalty=1.3, repeat_last_n=16, presence_penalty=0.2)


def _write(path: Path, seed: int, dtype: GGMLType) -> Path:
    sd = random_llama_state(n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=seed)
    return write_llama_gguf(path, sd, n_head=4, n_head_kv=2, n_ctx=N_CTX, dtype=dtype)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    return {
        "target": _write(root / "target-q8_0.gguf", 5, GGMLType.Q8_0),
        "same": _write(root / "draft-q8_0.gguf", 5, GGMLType.Q8_0),  # the target's bytes: agrees always
        "same_q4": _write(root / "draft-q4_0.gguf", 5, GGMLType.Q4_0),  # the target's weights in Q4_0
        "other": _write(root / "other-f32.gguf", 9, GGMLType.F32),  # other weights, the same vocabulary
    }


@pytest.fixture(scope="module")
def engines(files):
    """The target (2 threads, 3 slots) and one speculator per drafter kind and p_min, loaded once."""
    target = Engine(files["target"], EngineOptions(n_ctx=N_CTX, n_threads=2, n_seq=3, act_precision="q8"))
    specs = {}
    for kind in ("same", "same_q4", "other"):
        for p_min in (0.0, 0.3, 0.8):
            specs[kind, p_min] = load_speculator(SpecOptions(draft_model=files[kind], p_min=p_min), target)
    specs["lookup", 0.0] = load_speculator(SpecOptions(lookup=True), target)
    return target, specs


def _with(spec: Speculator, n_max: int, n_min: int, ngram: tuple[int, int] = (1, 4)) -> Speculator:
    """The same drafter (and its draft slots) under other draft lengths."""
    opts = SpecOptions(
        draft_model=spec.options.draft_model,
        lookup=spec.options.lookup,
        n_max=n_max,
        n_min=min(n_min, n_max),
        p_min=spec.options.p_min,
        ngram_min=ngram[0],
        ngram_max=ngram[1],
    )
    drafter = spec.drafter
    if isinstance(drafter, LookupDrafter):
        drafter = LookupDrafter(*ngram)
    return Speculator(drafter, opts)


def _tokens(engine: Engine, prompt, params, n_predict, ignore_eos=False, spec=None) -> list[int]:
    engine.timings.__init__()
    return list(generate(engine, prompt, Sampler(params), n_predict, ignore_eos, spec=spec))


# repetitive prompts give the lookup drafter something to find
prompts = st.one_of(
    st.lists(st.integers(3, 258), min_size=1, max_size=30),
    st.lists(st.integers(3, 12), min_size=1, max_size=8).map(lambda p: p * 4),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(
    prompt=prompts,
    n_predict=st.integers(1, 48),
    drafter=st.sampled_from(
        [("same_q4", 0.0), ("same_q4", 0.3), ("other", 0.0), ("other", 0.8), ("lookup", 0.0)]
    ),
    n_max=st.integers(1, 12),
    n_min=st.integers(0, 3),
    ngram=st.sampled_from([(1, 1), (1, 4), (2, 3)]),
    penalised=st.booleans(),
    ignore_eos=st.booleans(),
)
def test_greedy_is_plain_decoding(
    engines, prompt, n_predict, drafter, n_max, n_min, ngram, penalised, ignore_eos
):
    target, specs = engines
    params = GREEDY_PENALISED if penalised else GREEDY
    want = _tokens(target, prompt, params, n_predict, ignore_eos)
    spec = _with(specs[drafter], n_max, n_min, ngram)
    got = _tokens(target, prompt, params, n_predict, ignore_eos, spec)
    assert got == want
    tm = target.timings
    assert 0 <= tm.n_draft_accepted <= tm.n_draft
    assert tm.n_eval <= len(got)  # never more target steps than plain decoding


def test_a_draft_of_the_same_bytes_is_always_accepted(engines):
    """A draft model that is the target's file agrees on every token (its one-token decode steps give the
    bits of the target's 9-token verification steps): 63 tokens after the first in ceil(63 / 9) steps."""
    target, specs = engines
    prompt = list(range(40, 60))
    want = _tokens(target, prompt, GREEDY, 64, ignore_eos=True)
    got = _tokens(target, prompt, GREEDY, 64, ignore_eos=True, spec=_with(specs["same", 0.0], 8, 0))
    tm = target.timings
    assert got == want
    assert tm.n_draft == tm.n_draft_accepted == 56 and tm.n_eval == 7


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.lists(st.integers(3, 258), min_size=1, max_size=20), min_size=2, max_size=3),
    n_predict=st.lists(st.integers(1, 30), min_size=3, max_size=3),
    drafter=st.sampled_from([("same", 0.0), ("same_q4", 0.0), ("other", 0.3), ("lookup", 0.0)]),
    n_max=st.integers(1, 8),
)
def test_sequences_sharing_steps_are_plain_decoding(engines, prompts, n_predict, drafter, n_max):
    """Several sequences drafted and verified in the same steps each get their plain greedy tokens."""
    target, specs = engines
    want = [_tokens(target, p, GREEDY, n, True) for p, n in zip(prompts, n_predict, strict=False)]
    gen = Generator(target, spec=_with(specs[drafter], n_max, 0))
    got: dict[int, list[int]] = {}
    for slot, (p, n) in enumerate(zip(prompts, n_predict, strict=False)):
        for ev in gen.start(slot, p, GenParams(sampling=GREEDY, n_predict=n, ignore_eos=True)):
            got.setdefault(ev.slot, []).append(ev.token)
    while gen.live:
        for ev in gen.step():
            got.setdefault(ev.slot, []).append(ev.token)
    assert [got[i] for i in range(len(prompts))] == want


def _exact_joint(target: Engine, prompt: list[int], sampler: Sampler, n: int) -> dict[tuple[int, ...], float]:
    """The target's exact probability of every n-token continuation its sampler chain allows."""
    out: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == n:
            out[tuple(prefix)] = prob
            return
        target.free(0)
        logits = target.prefill(0, prompt + prefix)
        probs, ids = sampler.distribution(logits, prompt + prefix)
        for p, t in zip(probs.tolist(), ids.tolist(), strict=True):
            walk(prefix + [t], prob * p)

    walk([], 1.0)
    return out


def test_sampling_keeps_the_target_distribution(engines):
    """Tokens 2 and 3 come from a verification step (the target's weights in Q4_0 draft: some rejections): the
    empirical joint of the 3 tokens matches the target's exact one."""
    target, specs = engines
    params = SamplingParams(temp=1.5, top_k=3, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    prompt = [40, 41, 42, 43]
    exact = _exact_joint(target, prompt, Sampler(params), 3)
    spec = _with(specs["same_q4", 0.0], 2, 0)
    n = 1500
    counts: dict[tuple[int, ...], int] = {}
    target.timings.__init__()
    for seed in range(n):
        sampler = Sampler(SamplingParams(**{**params.__dict__, "seed": seed}))
        got = tuple(generate(target, prompt, sampler, 3, True, spec=spec))
        counts[got] = counts.get(got, 0) + 1
    tm = target.timings
    assert 0 < tm.n_draft_accepted < tm.n_draft  # both paths taken
    assert set(counts) <= set(exact)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
    # measured 0.050 (1155 of 1500 drafts accepted); sampling noise alone: mean 0.053, 99th percentile 0.072
    # at n = 1500; taking every draft token as it is (no rejection step) gives 0.224
    assert tv < 0.1, tv


def test_judge_keeps_the_target_distribution():
    """The acceptance rule alone: x ~ q, then the chooser; its tokens are distributed as p (20k draws)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, generator=gen) * 2
    sampler = Sampler(SamplingParams(temp=0.9, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, seed=3))
    probs, ids = sampler.distribution(logits)
    p = torch.zeros(12)
    p[ids] = probs
    q = torch.softmax(torch.randn(12, generator=gen) * 2, dim=0)
    seq = SimpleNamespace(sampler=sampler)
    n = 20000
    counts = torch.zeros(12)
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=gen))
        counts[_judge(seq, x, q)(logits, [])] += 1  # type: ignore[arg-type]
    tv = 0.5 * float((counts / n - p).abs().sum())
    naive = 0.5 * float((q - p).abs().sum())
    # measured 0.0085; taking the draft as it is would give `naive` (0.90 here)
    assert tv < 0.02 and naive > 0.2, (tv, naive)
    point = torch.zeros(12)
    for _ in range(n // 4):  # a lookup draft: q = 1 on one token
        point[_judge(seq, 7, None)(logits, [])] += 1  # type: ignore[arg-type]
    assert 0.5 * float((point / (n // 4) - p).abs().sum()) < 0.03


def test_lookup_proposes_the_continuation_of_the_latest_match():
    d = LookupDrafter(1, 3)
    seq = SimpleNamespace(slot=0, history=[5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6, 7])
    (draft,) = d.draft([seq], [4])  # type: ignore[list-item]
    assert draft.tokens == [1, 5, 6, 7]  # after the latest earlier "5 6 7"
    seq.history += [1, 2]
    (draft,) = d.draft([seq], [3])  # type: ignore[list-item]
    assert draft.tokens == []  # "7 1 2", "1 2" and "2" never came before
    seq.history += [9]
    (draft,) = d.draft([seq], [3])  # type: ignore[list-item]
    assert draft.tokens == [5, 6, 7]  # "9" came before "5 6 7" (unigram)


@pytest.mark.parametrize(
    "opts, needle",
    [
        (dict(n_max=0), "--draft-max must be >= 1"),
        (dict(n_max=4, n_min=5), "--draft-min must be in 0..--draft-max (4)"),
        (dict(p_min=1.5), "--draft-p-min must be in [0, 1]"),
        (dict(p_min=float("nan")), "--draft-p-min must be in [0, 1]"),
        (dict(lookup=True, ngram_min=3, ngram_max=2), "--lookup-ngram-min"),
        (dict(lookup=True, draft_model=Path("x.gguf")), "use one"),
    ],
)
def test_bad_options_are_refused(opts, needle):
    with pytest.raises(InputError, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        SpecOptions(**opts)


@pytest.fixture(scope="module")
def other_vocab(files, tmp_path_factory) -> Path:
    """The draft's weights with one token renamed: the same size, another vocabulary."""
    tokens = list(conftest.TINY_TOKENS)
    tokens[100] = "<renamed>"
    old = conftest.TINY_TOKENS
    conftest.TINY_TOKENS = tokens
    try:
        return _write(tmp_path_factory.mktemp("vocab") / "renamed.gguf", 9, GGMLType.F32)
    finally:
        conftest.TINY_TOKENS = old


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--draft-max", "0"], ["--draft-max must be >= 1, got 0"]),
        (["--draft-min", "9", "--draft-max", "8"], ["--draft-min must be in 0..--draft-max (8), got 9"]),
        (["--draft-p-min", "-0.1"], ["--draft-p-min must be in [0, 1], got -0.1"]),
        (["--lookup"], ["-md/--model-draft and --lookup are two ways to draft"]),
    ],
)
def test_main_refuses_bad_draft_options(files, args, needles):
    result = runner.invoke(
        app, ["main", "-m", str(files["target"]), "-md", str(files["other"]), "-p", "hi", "-n", "2", *args]
    )
    assert_one_error_line(result, *needles)


def test_main_refuses_a_draft_of_another_vocabulary(files, other_vocab, tmp_path):
    result = runner.invoke(
        app, ["main", "-m", str(files["target"]), "-md", str(other_vocab), "-p", "hi", "-n", "2"]
    )
    assert_one_error_line(result, "vocabulary differs from the target's at token 100", "<renamed>")
    result = runner.invoke(
        app, ["main", "-m", str(files["target"]), "-md", str(tmp_path / "none.gguf"), "-p", "hi", "-n", "2"]
    )
    assert_one_error_line(result, "-md/--model-draft: no such file")


def test_server_refuses_bad_draft_options(files):
    result = runner.invoke(
        app, ["server", "-m", str(files["target"]), "--lookup", "--draft-min", "20", "--port", "0"]
    )
    assert_one_error_line(result, "--draft-min must be in 0..--draft-max (16), got 20")


def test_main_prints_the_speculative_timings(files):
    """main -md: the continuation of plain main, the draft counts on stderr."""
    args = [
        "main",
        "-m",
        str(files["target"]),
        "-p",
        "hello world",
        "-n",
        "24",
        "--temp",
        "0",
        "--ignore-eos",
    ]
    plain = runner.invoke(app, args)
    spec = runner.invoke(app, [*args, "-md", str(files["same"]), "--draft-p-min", "0"])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.stderr
    assert spec.stdout == plain.stdout
    (line,) = [ln for ln in spec.stderr.splitlines() if "speculative =" in ln]
    drafted, accepted = [int(w) for w in line.replace(",", " ").split() if w.isdigit()][:2]
    assert 0 < accepted <= drafted
    assert "speculative decoding: draft model" in spec.stderr


def test_draft_slot_reuses_its_prefix(engines):
    """The draft slots follow the target's: a second prompt in the same slot reuses the common prefix."""
    target, specs = engines
    spec = _with(specs["same", 0.0], 4, 0)
    drafter = spec.drafter
    for prompt in ([50, 51, 52, 53, 54], [50, 51, 52, 99]):
        assert _tokens(target, prompt, GREEDY, 10, True, spec) == _tokens(target, prompt, GREEDY, 10, True)
    assert drafter.cached[0][:3] == [50, 51, 52]  # type: ignore[attr-defined]
    assert list(itertools.islice(drafter.cached[0], 4))[3] == 99  # type: ignore[attr-defined]


@pytest.mark.parametrize("drafter", [("same", 0.0), ("same_q4", 0.0), ("lookup", 0.0)])
def test_a_full_context_ends_as_in_plain_decoding(engines, drafter):
    """Drafts stop short of the context's end; the run ends at a full context with plain decoding's tokens."""
    target, specs = engines
    prompt = [(7 * i) % 50 + 3 for i in range(N_CTX - 30)]
    want = _tokens(target, prompt, GREEDY, -1, ignore_eos=True)
    assert len(prompt) + len(want) == N_CTX + 1  # the last token sampled, not evaluated
    assert _tokens(target, prompt, GREEDY, -1, True, _with(specs[drafter], 16, 0)) == want


def test_server_grammar_and_logprobs_with_drafts(files):
    """The server's per-slot extras go through the same rows: a grammar-constrained greedy answer and the
    log-probabilities of each token are those of a server without drafts."""
    pytest.importorskip("fastapi")
    pytest.importorskip("xgrammar")
    from server_helpers import live_server, request

    from powerinfer.server import ServerOptions

    bodies = [
        {"prompt": "x", "grammar": 'root ::= "ab" [0-9]+ "c"', "n_predict": 12, "temperature": 0},
        {"prompt": "hello", "n_predict": 12, "temperature": 0, "n_probs": 3},
    ]
    answers = []
    for spec in (None, SpecOptions(draft_model=files["same"], p_min=0.0)):
        engine = EngineOptions(n_ctx=N_CTX, n_seq=2, n_threads=1, act_precision="q8")
        with live_server(ServerOptions(model=files["target"], engine=engine, speculative=spec)) as srv:
            answers.append([request(srv, "POST", "/completion", b)[1] for b in bodies])
    plain, drafted = answers
    for a, b in zip(plain, drafted, strict=True):
        assert b["content"] == a["content"]
        assert b.get("completion_probabilities") == a.get("completion_probabilities")
        assert "draft_n" not in a["timings"]
    assert plain[0]["content"].startswith("ab") and len(plain[1]["completion_probabilities"]) == 12
    assert drafted[1]["timings"]["draft_n_accepted"] > 0


@pytest.mark.parametrize("drafter", [("same", 0.0), ("same_q4", 0.3), ("lookup", 0.0)])
def test_context_shifts_keep_plain_decoding_and_drafting(engines, drafter):
    """Generation through several context shifts (n_keep 4): greedy tokens of plain decoding with drafts, and the
    draft model goes on drafting after each shift, its slot shifted as the target's (before, drafting stopped once
    the history outgrew the draft's context; recomputing the kept tokens instead left a draft of the target's own
    bytes agreeing on 0 of 13 tokens after a shift of this random model). With the shifted slot a draft of the
    target's own bytes is accepted but for the tokens evaluated across a shift (measured: 50 target steps for 384
    tokens, 333 of 366 drafted accepted; without drafts after the first shift it was 221 steps)."""
    target, specs = engines
    prompt = [(5 * i) % 40 + 3 for i in range(20)]
    n = 3 * N_CTX
    target.timings.__init__()
    want = list(generate(target, prompt, Sampler(GREEDY), n, True, n_keep=4))
    assert len(want) == n
    spec = _with(specs[drafter], 8, 0)
    target.timings.__init__()
    got = list(generate(target, prompt, Sampler(GREEDY), n, True, n_keep=4, spec=spec))
    assert got == want
    if drafter[0] == "same":
        assert target.timings.n_eval < n // 3
