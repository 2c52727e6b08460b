"""The server's generator: the shared generation loop plus what only the server needs per slot.

- prompt reuse: each slot remembers the tokens its KV cache holds; a new prompt on that slot evaluates only
  the tokens after the common prefix (llama.cpp's `cache_prompt`);
- token log-probabilities: log-softmax of the model's raw logits, before any bias, penalty or constraint;
- constrained decoding: a per-slot token mask (powerinfer.server.grammar) applied before sampling and
  advanced with each sampled token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from powerinfer.runtime.context_shift import held_tokens
from powerinfer.runtime.engine import Engine
from powerinfer.runtime.generate import Chooser, Event, Generator, GenParams, Sequence
from powerinfer.runtime.speculative import Speculator

MAX_TOP_LOGPROBS = 20


class Constraint(Protocol):
    """A grammar state of one sequence: which tokens may come next, advanced token by token."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor: ...

    def accept(self, token: int) -> None: ...


@dataclass(frozen=True)
class TokenProb:
    """A generated token, its log-probability and the most likely alternatives (id, logprob), best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class SlotRequest:
    """What the server adds to a generation: reuse of the cached prefix, log-probabilities, a constraint."""

    cache_prompt: bool = True
    logprobs: bool = False  # record each generated token's log-probability
    n_top: int = 0  # and this many alternatives
    constraint: Constraint | None = None
    embed: bool = False  # no generation: the prompt's pooled hidden state (an Embedded event)
    probs: list[TokenProb] = field(default_factory=list)
    n_evaluated: int = 0  # prompt tokens actually evaluated (the rest came from the cache)
    truncated: bool = False  # the prompt was cut to fit the slot (--context-shift)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SlotGenerator(Generator):
    """A Generator whose slots keep their KV cache between requests and that applies SlotRequest options."""

    def __init__(self, engine: Engine, spec: Speculator | None = None) -> None:
        super().__init__(engine, spec=spec)
        self.cached: list[list[int]] = [[] for _ in range(engine.kv.n_seq)]  # tokens held by each slot
        self.requests: dict[int, SlotRequest] = {}

    def reusable(self, slot: int, prompt: list[int]) -> int:
        """Prompt tokens that slot `slot` could take from its cache (at least one token is always evaluated)."""
        return min(common_prefix(self.cached[slot], prompt), len(prompt) - 1)

    def start_request(self, slot: int, prompt: list[int], params: GenParams, req: SlotRequest) -> list[Event]:
        """Evaluate `prompt` into `slot` (only past the cached prefix when req.cache_prompt), then sample
        its first token."""
        e = self.engine
        if slot in self.live:
            return super().start(slot, prompt, params)  # refused there: the slot is busy
        n_keep = self.reusable(slot, prompt) if req.cache_prompt and prompt else 0
        self.cached[slot] = []
        self.requests[slot] = req
        t = time.perf_counter()
        try:
            if not prompt or len(prompt) > e.n_ctx:
                return super().start(slot, prompt, params)  # refused there with its message
            e.keep(slot, n_keep)
            logits = e.prefill(slot, prompt[n_keep:], n_keep)
        except BaseException:
            self.requests.pop(slot, None)
            e.free(slot)
            raise
        ms = (time.perf_counter() - t) * 1e3
        req.n_evaluated = len(prompt) - n_keep
        self.timings.prompt_ms += ms
        self.timings.n_prompt += req.n_evaluated
        events = super().start(slot, prompt, params, logits=logits)
        for ev in events:
            if ev.seq is not None:
                ev.seq.prompt_ms = ms
        return events

    def _accept(self, seq: Sequence, logits: torch.Tensor, choose: Chooser | None = None) -> Event:
        req = self.requests.get(seq.slot)
        if req is None or (req.constraint is None and not req.logprobs):
            return super()._accept(seq, logits, choose)
        logprobs = torch.log_softmax(logits.float(), dim=-1) if req.logprobs else None
        if req.constraint is not None:
            logits = req.constraint.mask(logits)
            if seq.params.ignore_eos and self.eog:  # the grammar is complete: nothing but an end is left
                allowed = torch.isfinite(logits)
                allowed[list(self.eog)] = False
                if not bool(allowed.any()):
                    return self._finish(seq, "eos")
        ev = super()._accept(seq, logits, choose)
        if ev.token is not None:
            if req.constraint is not None and ev.end is None:
                req.constraint.accept(ev.token)
            if logprobs is not None:
                top: tuple[tuple[int, float], ...] = ()
                if req.n_top > 0:
                    values, ids = torch.topk(logprobs, min(req.n_top, logprobs.numel()))
                    top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
                req.probs.append(TokenProb(ev.token, float(logprobs[ev.token]), top))
        return ev

    def _finish(self, seq: Sequence, reason: str, stopping_word: str = "", token: int | None = None) -> Event:
        # what the slot's KV cache holds: the prompt and every generated token evaluated so far
        self.cached[seq.slot] = held_tokens(seq)[: self.engine.kv.n_past[seq.slot]]
        self.requests.pop(seq.slot, None)
        return super()._finish(seq, reason, stopping_word, token)

    def drop(self, slot: int) -> None:
        self.cached[slot] = []  # after a failure the cache rows are not trusted
        self.requests.pop(slot, None)
        super().drop(slot)
