"""The one generation loop: sequences in KV slots, one batched step per token, sampling, stops and limits.

`main`, `batched` and the server all drive a `Generator`: `start` prefills a prompt into a slot (or forks a slot
that already holds the same prompt) and samples the first token; `step` evaluates the pending token of every
live sequence in one engine step and samples the next ones. Each sampled token gives an `Event`; a sequence
ends on an end-of-generation token (unless ignore_eos), a stop string, n_predict tokens or a full context.

A failure never leaves a sequence half-registered: `start` frees the slot before it re-raises, and
`step(isolate=True)` (the server) ends only the sequence whose sampling failed, or every sequence of a batch
whose engine step failed, each with an "error" event that carries the exception.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from powerinfer.errors import InputError
from powerinfer.runtime.context_shift import make_room
from powerinfer.sampling import Sampler, SamplingParams
from powerinfer.tokenizer import StreamDecoder

if TYPE_CHECKING:
    from powerinfer.model.config import ModelConfig
    from powerinfer.runtime.kv_cache import KVCache
    from powerinfer.runtime.timings import Timings
    from powerinfer.tokenizer import Tokenizer


class GenerationEngine(Protocol):
    """What the generation loop uses of an engine (runtime.engine.Engine, which imports this module): its
    context, tokenizer, timings and KV positions, and its prefill / decode / free steps."""

    n_ctx: int
    config: ModelConfig
    tokenizer: Tokenizer
    timings: Timings
    kv: KVCache

    def prefill(self, seq: int, tokens: list[int], start: int = 0) -> torch.Tensor: ...

    def decode(self, seqs: list[int], tokens: list[int]) -> torch.Tensor: ...

    def free(self, seq: int) -> None: ...

    def shift(self, seq: int, n_keep: int, n_discard: int) -> None: ...


class Speculator(Protocol):
    """A step that drafts tokens and verifies them in one target step (runtime.speculative.Speculator; a protocol,
    so that the loop does not import the module that builds on it)."""

    def step(self, gen: Generator, isolate: bool) -> list[Event]: ...


@dataclass(frozen=True)
class GenParams:
    """What to generate: sampling, a token limit (-1: until end of sequence or a full context) and stops."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    n_predict: int = -1
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); -inf bans the token
    # a full context: shift it (keep the first n_keep tokens, drop half of the rest) instead of ending with "length"
    context_shift: bool = False
    n_keep: int = 0  # tokens counted from the start, BOS included (runtime.context_shift.resolve_keep)


@dataclass(frozen=True)
class Event:
    """What one sampling round gave a sequence: a token (None when it ended without one), new text
    (complete UTF-8 characters; text that may start a stop word is held back) and, at the end, the reason
    (eos | stop | length | cancelled | timeout | error) and the stop string that ended it; an "error" end
    carries the exception."""

    slot: int
    token: int | None
    text: str
    end: str | None = None
    stopping_word: str = ""
    seq: Sequence | None = field(default=None, compare=False, repr=False)
    error: BaseException | None = field(default=None, compare=False)


@dataclass
class Sequence:
    """A generation that holds a KV slot."""

    slot: int
    prompt: list[int]
    params: GenParams
    sampler: Sampler
    decoder: StreamDecoder
    history: list[int]
    bias: torch.Tensor | None = None  # (n_vocab,) additive logit bias
    n_gen: int = 0
    pending: int | None = None  # sampled, not yet evaluated
    text: str = ""
    sent: int = 0  # characters of `text` already given out
    end: str | None = None
    prompt_ms: float = 0.0
    t_first: float = 0.0
    shifts: list[tuple[int, int]] = field(default_factory=list)  # context shifts: (n_keep, n_discard) each
    n_draft: int = 0  # speculative decoding: tokens drafted for this sequence, and those the target kept
    n_draft_accepted: int = 0


Chooser = Callable[[torch.Tensor, list[int]], int]  # (logits, history) -> token, in place of the sampler


def _stop_holdback(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop word."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class Generator:
    """Sequences of one engine, advanced together one token per step."""

    def __init__(self, engine: GenerationEngine, keep: bool = False, spec: Speculator | None = None) -> None:
        """With `keep`, an ended sequence leaves its slot's KV cache as it is (the interactive `main` goes on
        from it next turn); `kv.n_past` then counts its evaluated tokens, the first of `Sequence.history`.
        With `spec`, each step drafts tokens and verifies them (runtime.speculative)."""
        self.engine = engine
        self.keep = keep
        self.spec = spec
        self.tokenizer = engine.tokenizer
        self.eog = engine.tokenizer.eog_ids
        self.timings = engine.timings
        self.live: dict[int, Sequence] = {}

    def start(
        self,
        slot: int,
        prompt: list[int],
        params: GenParams,
        sampler: Sampler | None = None,
        logits: torch.Tensor | None = None,
    ) -> list[Event]:
        """Evaluate a prompt into `slot` and sample the first token; with `logits` (its last token's), the
        prompt is already in the slot (evaluated or forked by the caller)."""
        e = self.engine
        if not prompt:
            raise InputError("empty prompt")
        if len(prompt) > e.n_ctx:
            raise InputError(f"prompt of {len(prompt)} tokens exceeds the context size {e.n_ctx}")
        if slot in self.live:
            raise InputError(f"slot {slot} is busy")
        bias = None
        if params.logit_bias:
            bias = torch.zeros(e.config.n_vocab)
            for tid, b in params.logit_bias:
                if not 0 <= tid < e.config.n_vocab:
                    raise InputError(f"logit_bias token id {tid} is out of range")
                if math.isnan(b) or b == math.inf:
                    raise InputError(
                        f"logit_bias of token {tid} must be a finite number or -inf (ban), got {b}"
                    )
                bias[tid] += b
        seq = Sequence(
            slot,
            prompt,
            params,
            sampler or Sampler(params.sampling),
            StreamDecoder(self.tokenizer),
            list(prompt),
            bias,
        )
        t = time.perf_counter()
        if logits is None:
            e.free(slot)
            logits = e.prefill(slot, prompt)
            self.timings.prompt_ms += (time.perf_counter() - t) * 1e3
            self.timings.n_prompt += len(prompt)
        seq.prompt_ms = (time.perf_counter() - t) * 1e3
        seq.t_first = time.perf_counter()
        self.live[slot] = seq
        if params.n_predict == 0:
            return [self._finish(seq, "length")]
        try:
            return [self._accept(seq, logits)]
        except BaseException:
            self.drop(slot)
            raise

    def step(self, isolate: bool = False) -> list[Event]:
        """Evaluate every live sequence's pending token in one step and sample the next ones.

        Without `isolate` a failure propagates; with it, a sequence whose sampling fails ends with an "error"
        event (the others go on), and a failed engine step ends every sequence of the batch that way."""
        if self.spec is not None:  # several tokens per sequence and step
            return self.spec.step(self, isolate)
        seqs = [s for s in self.live.values() if s.pending is not None]
        if not seqs:
            return []
        t = time.perf_counter()
        try:
            logits = self.engine.decode([s.slot for s in seqs], [s.pending for s in seqs])  # type: ignore[misc]
        except Exception as e:
            if not isolate:
                raise
            return [self._fail(s, e) for s in seqs]
        self.timings.eval_ms += (time.perf_counter() - t) * 1e3
        self.timings.n_eval += 1
        events = []
        for s, row in zip(seqs, logits, strict=True):
            try:
                events.append(self._accept(s, row))
            except Exception as e:
                if not isolate:
                    raise
                events.append(self._fail(s, e))
        return events

    def end(self, slot: int, reason: str = "cancelled") -> Event | None:
        """End a live sequence now (client gone: "cancelled"; "timeout"); its final event, None if not live."""
        seq = self.live.get(slot)
        return None if seq is None else self._finish(seq, reason)

    def drop(self, slot: int) -> None:
        """Forget a sequence without an event (its request failed) and free its slot."""
        self.live.pop(slot, None)
        self.engine.free(slot)

    def _accept(self, seq: Sequence, logits: torch.Tensor, choose: Chooser | None = None) -> Event:
        """Sample the next token of `seq` from its logits (n_vocab,) (or let `choose` pick it from the logits
        as the sampler would see them); end it if a limit is hit."""
        p = seq.params
        t = time.perf_counter()
        if seq.bias is not None:
            logits = logits.float() + seq.bias
        if p.ignore_eos and self.eog:
            logits = logits.clone()
            logits[list(self.eog)] = float("-inf")
        token = (choose or seq.sampler)(logits, seq.history)
        self.timings.sample_ms += (time.perf_counter() - t) * 1e3
        self.timings.n_sample += 1
        if token in self.eog and not p.ignore_eos:
            return self._finish(seq, "eos")
        seq.history.append(token)
        seq.n_gen += 1
        seq.text += seq.decoder.feed(token)
        if p.stop:
            hits = [(i, s) for s in p.stop if (i := seq.text.find(s, max(0, seq.sent - len(s)))) >= 0]
            if hits:
                at, word = min(hits)
                seq.text = seq.text[:at]
                return self._finish(seq, "stop", word, token)
        if (p.n_predict >= 0 and seq.n_gen >= p.n_predict) or not make_room(self.engine, seq):
            return self._finish(seq, "length", token=token)
        end = len(seq.text) - _stop_holdback(seq.text, p.stop)
        text = seq.text[seq.sent : end] if end > seq.sent else ""
        seq.sent = max(seq.sent, end)
        seq.pending = token
        return Event(seq.slot, token, text, seq=seq)

    def _fail(self, seq: Sequence, error: Exception) -> Event:
        """End `seq` because of `error` (its slot freed, its text dropped)."""
        self.drop(seq.slot)
        seq.end = "error"
        seq.pending = None
        return Event(seq.slot, None, "", "error", seq=seq, error=error)

    def _finish(self, seq: Sequence, reason: str, stopping_word: str = "", token: int | None = None) -> Event:
        self.live.pop(seq.slot, None)
        if not self.keep:
            self.engine.free(seq.slot)
        if reason != "stop":
            seq.text += seq.decoder.flush()
        text = seq.text[seq.sent :]
        seq.sent = len(seq.text)
        seq.end = reason
        seq.pending = None
        return Event(seq.slot, token, text, reason, stopping_word, seq)


def generate(
    engine: GenerationEngine,
    prompt: list[int],
    sampler: Sampler,
    n_predict: int = -1,
    ignore_eos: bool = False,
    *,
    n_keep: int | None = None,
    spec: Speculator | None = None,
) -> Iterator[int]:
    """Prefill the prompt into sequence 0, then yield sampled tokens until EOS, n_predict or a full context;
    with n_keep (runtime.context_shift.resolve_keep) a full context shifts instead; with `spec`, tokens are
    drafted and verified several at a time."""
    if len(prompt) > engine.n_ctx - 4:
        raise InputError(
            f"prompt is too long ({len(prompt)} tokens, max {engine.n_ctx - 4} for -c {engine.n_ctx})"
        )
    gen = Generator(engine, spec=spec)
    shift = n_keep is not None
    params = GenParams(n_predict=n_predict, ignore_eos=ignore_eos, context_shift=shift, n_keep=n_keep or 0)
    events = gen.start(0, prompt, params, sampler)
    while True:
        for ev in events:
            if ev.token is not None:
                yield ev.token
        if not gen.live:
            return
        events = gen.step()
