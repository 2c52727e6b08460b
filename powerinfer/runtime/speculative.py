"""Speculative decoding: a draft proposes tokens, the target checks them all in one step.

A `Speculator` advances a Generator's live sequences in place of its one-token step. For each sequence a
drafter proposes up to n_max tokens after the pending one: `ModelDrafter`, a smaller model with the same
vocabulary (its own engine and KV slots), stopping where its top probability falls below p_min;
`LookupDrafter`, the tokens that followed the latest earlier occurrence of the sequence's last n-gram (prompt
lookup decoding). One target step evaluates every sequence's pending token and drafts with the logits of every
position. The rows then go through the Generator's own sampling (`_accept`: bias, penalties, grammar, stops,
limits) in order, and a sequence keeps its draft up to the first token the target did not choose, plus the
target's token there; the rejected positions are rolled back (`keep`).

Greedy decoding chooses exactly the tokens of plain decoding: a token's logits do not depend on how many
tokens its step holds. With a temperature, a draft token x drawn with probability q(x) is accepted with
probability min(1, p(x) / q(x)) and a rejected one is replaced by a draw from max(0, p - q) normalised, which
keeps the target's distribution p (Leviathan et al. 2023, Chen et al. 2023); a lookup draft has q(x) = 1.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

import torch

from powerinfer.errors import InputError
from powerinfer.printable import printable
from powerinfer.runtime.context_shift import held_tokens
from powerinfer.runtime.session import common_prefix
from powerinfer.sampling import apply_penalties

if TYPE_CHECKING:
    from powerinfer.runtime.engine import Engine
    from powerinfer.runtime.generate import Chooser, Event, Generator, Sequence

log = logging.getLogger(__name__)

DRAFT_TOP_K = 10  # a greedy draft's confidence: its top probability among this many best tokens (llama.cpp's)


@dataclass(frozen=True)
class SpecOptions:
    """How to draft: a draft model file or n-gram lookup, draft lengths and the draft's confidence floor."""

    draft_model: Path | None = None
    lookup: bool = False
    n_max: int = 16  # tokens drafted per step at most
    n_min: int = 0  # a shorter draft is not verified
    p_min: float = 0.8  # the draft model stops where its top probability is lower
    n_ctx_draft: int = 0  # the draft model's context (0: the target's)
    ngram_min: int = 1
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if self.n_max < 1:
            raise InputError(f"--draft-max must be >= 1, got {self.n_max}")
        if not 0 <= self.n_min <= self.n_max:
            raise InputError(f"--draft-min must be in 0..--draft-max ({self.n_max}), got {self.n_min}")
        if not (math.isfinite(self.p_min) and 0.0 <= self.p_min <= 1.0):
            raise InputError(f"--draft-p-min must be in [0, 1], got {self.p_min}")
        if self.n_ctx_draft < 0:
            raise InputError(f"-cd/--ctx-size-draft must be >= 0 (0: the target's), got {self.n_ctx_draft}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InputError(
                f"--lookup-ngram-min and --lookup-ngram-max must satisfy 1 <= min <= max, got "
                f"{self.ngram_min} and {self.ngram_max}"
            )
        if self.draft_model is not None and self.lookup:
            raise InputError("-md/--model-draft and --lookup are two ways to draft: use one")

    @property
    def enabled(self) -> bool:
        return self.draft_model is not None or self.lookup


@dataclass
class Draft:
    """Tokens proposed after a sequence's pending token, with the distribution each was drawn from (n_vocab,);
    None: a proposal made with certainty (greedy drafting, lookup), q(x) = 1."""

    tokens: list[int] = field(default_factory=list)
    q: list[torch.Tensor | None] = field(default_factory=list)
    # the first token was drafted with the drafter's confidence (p >= p_min; lookup: always)
    confident: bool = True


class Drafter(Protocol):
    """Proposes drafts for sequences; `limits[i]`: at most that many tokens for seqs[i]."""

    def draft(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]: ...


class ModelDrafter:
    """Drafts with a smaller model: catches each sequence's history up in its own KV slot (only past the
    prefix it already holds), then decodes every drafting sequence one token per step, in one batch."""

    def __init__(self, engine: Engine, p_min: float) -> None:
        self.engine = engine
        self.p_min = p_min
        self.eog = sorted(engine.tokenizer.eog_ids)
        self.cached: list[list[int]] = [[] for _ in range(engine.kv.n_seq)]  # tokens each draft slot holds
        # per slot: the sequence last caught up, the length of its held tokens then and its shifts then (the
        # tokens then are a prefix of those now while it has not shifted since)
        self.synced: list[tuple[Sequence | None, int, int]] = [(None, 0, 0)] * engine.kv.n_seq

    def draft(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        e = self.engine
        drafts = [Draft() for _ in seqs]
        # the draft reads what the target's slot holds (after a context shift, the kept tokens and the rest); the
        # last draft token is not evaluated: L + n - 1 positions of the draft's context
        held = [held_tokens(s) for s in seqs]
        limits = [min(n, e.n_ctx - len(h) + 1) for h, n in zip(held, limits, strict=True)]
        todo = [i for i, n in enumerate(limits) if n > 0]
        if not todo:
            return drafts
        try:
            rows = self._catch_up([seqs[i] for i in todo], [held[i] for i in todo])
            while todo:
                going = []
                for i, row in zip(todo, rows, strict=True):
                    s, d = seqs[i], drafts[i]
                    token, q, sure = self._pick(s, d, row)
                    if not d.tokens:
                        d.confident = sure
                    # an unsure token is still proposed (its logits are paid for; checking it costs the target
                    # one more position of its step, a few percent of a step), and ends the draft
                    d.tokens.append(token)
                    d.q.append(q)
                    if sure and len(d.tokens) < limits[i]:
                        going.append(i)
                todo = going
                if todo:
                    slots = [seqs[i].slot for i in todo]
                    rows = list(e.decode(slots, [drafts[i].tokens[-1] for i in todo]))
                    for i in todo:
                        self.cached[seqs[i].slot].append(drafts[i].tokens[-1])
        except BaseException:
            for s in seqs:  # what the draft's slots hold is not known any more
                self.cached[s.slot] = []
                self.synced[s.slot] = (None, 0, 0)
                e.free(s.slot)
            raise
        return drafts

    def _catch_up(self, seqs: list[Sequence], held: list[list[int]]) -> list[torch.Tensor]:
        """Evaluate what each sequence's held tokens (`held`: context_shift.held_tokens of each) add to its draft
        slot; the last token's logits of each."""
        e = self.engine
        rows: dict[int, torch.Tensor] = {}
        ids: list[int] = []
        tokens: list[int] = []
        positions: list[int] = []
        for s, history in zip(seqs, held, strict=True):
            cached = self.cached[s.slot]
            seq, n_synced, n_shifts = self.synced[s.slot]
            if seq is s and n_shifts < len(s.shifts):  # the target shifted its context since: the same here
                n_synced = self._shift(s.slot, s.shifts[n_shifts:])
                n_shifts = len(s.shifts)
            if seq is s and n_shifts == len(s.shifts) and n_synced <= len(history):  # it only grew since
                same = n_synced + common_prefix(cached[n_synced:], history[n_synced:])
            else:  # another request in this slot: the prompt it shares
                same = common_prefix(cached, history)
            keep = min(same, len(history) - 1, e.kv.n_past[s.slot])
            e.keep(s.slot, keep)
            rest = history[keep:]
            del cached[keep:]
            cached.extend(rest)
            self.synced[s.slot] = (s, len(history), len(s.shifts))
            if len(rest) > e.options.n_batch:  # a new prompt: in chunks, on its own
                rows[s.slot] = e.prefill(s.slot, rest, keep)
            else:
                ids += [s.slot] * len(rest)
                tokens += rest
                positions += range(keep, keep + len(rest))
        if ids:
            slots = list(dict.fromkeys(ids))
            for slot, row in zip(slots, e.step(ids, tokens, positions), strict=True):
                rows[slot] = row
        return [rows[s.slot] for s in seqs]

    def _shift(self, slot: int, shifts: list[tuple[int, int]]) -> int:
        """The target's context shifts (n_keep, n_discard) applied to the draft slot as to the target's (its keys
        re-rotated, nothing recomputed), so the draft reads the state the target reads: recomputing the kept tokens
        without the dropped ones would not give it (the kept keys and values of later layers saw the dropped
        tokens). Where the slot holds too little for a shift, it keeps its first n_keep tokens. Returns how many
        tokens the slot holds that are the sequence's."""
        e, cached = self.engine, self.cached[slot]
        for n_keep, n_discard in shifts:
            n_past = min(e.kv.n_past[slot], len(cached))
            if n_keep + n_discard < n_past:
                e.shift(slot, n_keep, n_discard)
                del cached[n_keep : n_keep + n_discard]
            else:
                e.keep(slot, min(n_keep, n_past))
                del cached[min(n_keep, n_past) :]
        return min(e.kv.n_past[slot], len(cached))

    def _pick(self, s: Sequence, d: Draft, logits: torch.Tensor) -> tuple[int, torch.Tensor | None, bool]:
        """The next draft token, the distribution it was drawn from (None: greedy) and whether the draft goes
        on after it: its top probability is at least p_min (over its 10 best tokens when greedy). The first unsure
        token ends the draft; it is proposed too, even as the whole draft (llama.cpp drops it: there a step over
        one more token costs more than here, where a few tokens' step reads the weights once)."""
        n = s.sampler.params.repeat_last_n  # the penalties' window of the history, and the draft so far
        history = (s.history if n < 0 else s.history[len(s.history) - n :] if n > 0 else []) + d.tokens
        logits = logits.float()
        if s.bias is not None:  # what the target's sampling sees too (Generator._accept)
            logits = logits + s.bias
        if s.params.ignore_eos and self.eog:
            logits = logits.clone()
            logits[self.eog] = float("-inf")
        if s.sampler.temp <= 0:
            logits = apply_penalties(logits, history, s.sampler.params)
            values, ids = torch.topk(logits, min(DRAFT_TOP_K, logits.numel()))
            top = float(torch.softmax(values, dim=0)[0])
            return int(ids[0]), None, top >= self.p_min  # NaN: not sure either
        probs, ids = s.sampler.distribution(logits, history)
        token = int(ids[torch.multinomial(probs, 1, generator=s.sampler.generator)])
        q = torch.zeros(logits.numel())
        q[ids] = probs
        return token, q, float(probs[0]) >= self.p_min


class _NgramIndex:
    """Every n-gram (ngram_min..ngram_max tokens) of one sequence's history that has a next token, mapped to
    the position after its latest occurrence; extended as the history grows."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.done = 0  # n-grams ending before positions 1..done are in
        self.table: dict[tuple[int, ...], int] = {}

    def extend(self, history: list[int], ngram_min: int, ngram_max: int) -> None:
        table = self.table
        for end in range(self.done + 1, len(history)):
            for n in range(ngram_min, min(ngram_max, end) + 1):
                table[tuple(history[end - n : end])] = end
        self.done = max(self.done, len(history) - 1)


class LookupDrafter:
    """Prompt lookup decoding: the continuation of the latest earlier occurrence of the history's last n-gram
    (n from ngram_max down to ngram_min), from the prompt and the generated tokens."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.index: dict[int, _NgramIndex] = {}  # by slot

    def draft(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        drafts = []
        for s, limit in zip(seqs, limits, strict=True):
            history = s.history
            index = self.index.get(s.slot)
            if index is None or index.seq is not s or index.done >= len(history):
                index = self.index[s.slot] = _NgramIndex(s)
            index.extend(history, self.ngram_min, self.ngram_max)
            tokens: list[int] = []
            if limit > 0:
                for n in range(min(self.ngram_max, len(history)), self.ngram_min - 1, -1):
                    end = index.table.get(tuple(history[-n:]))
                    if end is not None:
                        tokens = history[end : end + limit]
                        break
            drafts.append(Draft(tokens, [None] * len(tokens)))
        return drafts


class Speculator:
    """Drafts and verifies: one Generator step, several tokens per sequence."""

    def __init__(self, drafter: Drafter, options: SpecOptions) -> None:
        self.drafter = drafter
        self.options = options
        self.backoff: dict[int, _Backoff] = {}  # by slot

    def describe(self) -> str:
        """One line for the logs: how this speculator drafts."""
        o = self.options
        if isinstance(self.drafter, ModelDrafter):
            d = self.drafter.engine
            how = (
                f"draft model {printable(str(o.draft_model))} ({d.config.arch}, "
                f"{d.weight_bytes / 2**20:.2f} MiB, n_ctx {d.n_ctx}), p_min {o.p_min:.2f}"
            )
        else:
            how = f"n-gram lookup, n {o.ngram_min}..{o.ngram_max}"
        return f"{how}, n_max {o.n_max}, n_min {o.n_min}"

    def step(self, gen: Generator, isolate: bool) -> list[Event]:
        """Generator.step with drafts: one draft round, one target step, each sequence's rows accepted in
        order (see the module's docstring)."""
        e = cast("Engine", gen.engine)
        seqs = [s for s in gen.live.values() if s.pending is not None]
        if not seqs:
            return []
        t = time.perf_counter()
        try:
            drafts = self.drafter.draft(seqs, [self._limit(gen, s) for s in seqs])
        except Exception:
            if not isolate:
                raise
            log.exception("speculative decoding: drafting failed; this step goes on without drafts")
            drafts = [Draft() for _ in seqs]
        gen.timings.draft_ms += (time.perf_counter() - t) * 1e3
        drafts = [d if len(d.tokens) >= self.options.n_min else Draft() for d in drafts]
        starts = [e.kv.n_past[s.slot] for s in seqs]
        ids: list[int] = []
        tokens: list[int] = []
        positions: list[int] = []
        for s, d, n in zip(seqs, drafts, starts, strict=True):
            run = [s.pending, *d.tokens]
            ids += [s.slot] * len(run)
            tokens += run  # type: ignore[arg-type]
            positions += range(n, n + len(run))
        t = time.perf_counter()
        try:
            logits = e.step(ids, tokens, positions, all_logits=True)
        except Exception as err:
            if not isolate:
                raise
            return [gen._fail(s, err) for s in seqs]
        gen.timings.eval_ms += (time.perf_counter() - t) * 1e3
        gen.timings.n_eval += 1
        events: list[Event] = []
        row = 0
        for s, d, n in zip(seqs, drafts, starts, strict=True):
            rows = logits[row : row + 1 + len(d.tokens)]
            row += 1 + len(d.tokens)
            try:
                events += self._verify(gen, s, d, rows, n)
            except Exception as err:
                if not isolate:
                    raise
                events.append(gen._fail(s, err))
        return events

    def _limit(self, gen: Generator, s: Sequence) -> int:
        """Draft tokens worth verifying for `s`: within the context, not past its token limit, none while it
        backs off after rejected drafts."""
        b = self.backoff.get(s.slot)
        if b is None or b.seq is not s:
            b = self.backoff[s.slot] = _Backoff(s)
        if b.wait > 0:
            b.wait -= 1
            return 0
        # the last row may fill the context, none before it (a context shift there would move rows still to come)
        n = min(self.options.n_max, gen.engine.n_ctx - gen.engine.kv.n_past[s.slot] - 2)
        if s.params.n_predict >= 0:
            n = min(n, s.params.n_predict - s.n_gen - 1)
        return max(0, n)

    def _verify(self, gen: Generator, s: Sequence, d: Draft, rows: torch.Tensor, start: int) -> list[Event]:
        """Accept rows (1 + len(d.tokens), n_vocab) of `s` in order while the chosen token is the draft's;
        the slot keeps the evaluated tokens the sequence holds, its first `start` + 1 + accepted."""
        engine = cast("Engine", gen.engine)
        events = []
        k = len(d.tokens)
        s.n_draft += k
        gen.timings.n_draft += k
        accepted = 0
        for j in range(k + 1):
            engine.keep(s.slot, start + 1 + j)  # the tokens row j was computed after
            choose = None
            if j < k and s.sampler.temp > 0:
                choose = _judge(s, d.tokens[j], d.q[j])
            ev = gen._accept(s, rows[j], choose)
            events.append(ev)
            if j == k or ev.token != d.tokens[j]:
                break
            accepted += 1
            s.n_draft_accepted += 1
            gen.timings.n_draft_accepted += 1
            if ev.end is not None:
                break
        b = self.backoff.get(s.slot)
        if k and b is not None and b.seq is s and (accepted or d.confident):
            b.update(accepted)  # an unsure first token rejected is no sign the drafts stopped agreeing
        return events


MAX_BACKOFF = 16  # steps without drafts after repeated wholly rejected drafts, at most


class _Backoff:
    """A sequence's pause in drafting: a draft rejected at its first token costs a step over 1 + k tokens for
    one token (on the CPU 2-3x a one-token step), so after n such drafts in a row the next 2**(n-1) steps (at
    most MAX_BACKOFF) draft nothing; an accepted token ends the pause."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.misses = 0
        self.wait = 0

    def update(self, accepted: int) -> None:
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        self.wait = min(MAX_BACKOFF, 1 << (self.misses - 1))


def _judge(s: Sequence, x: int, q: torch.Tensor | None) -> Chooser:
    """A chooser (runtime.generate.Chooser) that accepts draft token x with probability min(1, p(x) / q(x)),
    else draws from max(0, p - q) normalised; p: the sequence's sampler on the target's logits."""

    def choose(logits: torch.Tensor, history: list[int]) -> int:
        probs, ids = s.sampler.distribution(logits, history)
        p = torch.zeros(logits.numel())
        p[ids] = probs
        qx = 1.0 if q is None else float(q[x])
        u = float(torch.rand(1, generator=s.sampler.generator))
        if u * qx < float(p[x]):
            return x
        if q is None:
            rest = p
            rest[x] = 0.0
        else:
            rest = (p - q).clamp_min(0.0)
        if not float(rest.sum()) > 0:  # p == q up to rounding: a rejection cannot happen, draw from p
            rest = torch.zeros_like(p)
            rest[ids] = probs
        return int(torch.multinomial(rest, 1, generator=s.sampler.generator))

    return choose


def check_vocab(target: Engine, draft: Engine) -> None:
    """InputError unless the draft's vocabulary is the target's: the same size and the same token texts."""
    nt, nd = target.config.n_vocab, draft.config.n_vocab
    tt, td = target.tokenizer, draft.tokenizer
    if nt != nd or tt.n_vocab != td.n_vocab:
        raise InputError(
            f"the draft model's vocabulary ({nd} tokens) is not the target's ({nt}): speculative decoding needs "
            "the same vocabulary"
        )
    for i in range(min(tt.n_vocab, nt)):
        a, b = tt.token_text(i), td.token_text(i)
        if a != b:
            raise InputError(
                f"the draft model's vocabulary differs from the target's at token {i} ('{printable(b)}', the "
                f"target has '{printable(a)}'): speculative decoding needs the same vocabulary"
            )


def load_speculator(options: SpecOptions, target: Engine) -> Speculator | None:
    """The speculator `options` ask for (None when they ask for none): with a draft model, that model loaded
    once with as many KV slots as the target and the target's threads."""
    if options.lookup:
        return Speculator(LookupDrafter(options.ngram_min, options.ngram_max), options)
    if options.draft_model is None:
        return None
    import dataclasses

    from powerinfer.runtime.engine import Engine, EngineOptions

    o = target.options
    draft_options = dataclasses.replace(
        EngineOptions(),
        n_ctx=options.n_ctx_draft or target.n_ctx,
        n_batch=o.n_batch,
        n_seq=o.n_seq,
        n_threads=o.n_threads,
        act_precision=o.act_precision,
        mmap=o.mmap,
        fixed_threads=o.fixed_threads,
    )
    draft = Engine(options.draft_model, draft_options)
    check_vocab(target, draft)
    return Speculator(ModelDrafter(draft, options.p_min), options)
