"""Logits to token ids with llama.cpp's semantics and order.

Chain: penalties (repeat, frequency, presence over the last `repeat_last_n` tokens) -> greedy if temp <= 0,
else top-k -> top-p -> min-p -> temperature -> draw from a seeded generator. Each step is a small pure function
over a candidate set (logits and token ids sorted by logit, descending).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.1
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int = -1

    @property
    def greedy(self) -> bool:
        return self.temp <= 0


def apply_penalties(logits: torch.Tensor, history: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """Repeat penalty (divide positive, multiply negative logits) then frequency/presence penalties."""
    n = params.repeat_last_n
    if n < 0:
        n = 64
    recent = list(history[-n:]) if n > 0 else []
    if not recent or (
        params.repeat_penalty == 1.0 and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0
    ):
        return logits
    ids, counts = torch.tensor(recent, dtype=torch.int64).unique(return_counts=True)
    out = logits.clone()
    sel = out[ids]
    sel = torch.where(sel <= 0, sel * params.repeat_penalty, sel / params.repeat_penalty)
    sel = sel - counts.to(sel.dtype) * params.frequency_penalty - params.presence_penalty
    out[ids] = sel
    return out


def top_k(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the k best candidates; k <= 0 keeps all. Inputs are sorted descending."""
    if k <= 0 or k >= values.numel():
        return values, ids
    return values[:k], ids[:k]


def top_p(values: torch.Tensor, ids: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the smallest prefix whose probability mass reaches p (at least one candidate)."""
    if p >= 1.0:
        return values, ids
    cum = torch.softmax(values, dim=0).cumsum(0)
    keep = int(torch.searchsorted(cum, torch.tensor([p], dtype=cum.dtype)).item()) + 1
    keep = max(1, min(keep, values.numel()))
    return values[:keep], ids[:keep]


def min_p(values: torch.Tensor, ids: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep candidates whose probability is at least p times the best one's."""
    if p <= 0.0:
        return values, ids
    probs = torch.softmax(values, dim=0)
    keep = max(1, int((probs >= p * probs[0]).sum().item()))
    return values[:keep], ids[:keep]


class Sampler:
    """Stateful sampler for one sequence: owns the seeded RNG."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed if params.seed >= 0 else random.randrange(2**31)
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        """Pick the next token from logits (n_vocab,) given the tokens seen so far."""
        p = self.params
        logits = apply_penalties(logits.float(), history, p)
        if p.greedy:
            return int(torch.argmax(logits).item())
        k = p.top_k if p.top_k > 0 else logits.numel()
        values, ids = torch.topk(logits, min(k, logits.numel()))
        values, ids = top_p(values, ids, p.top_p)
        values, ids = min_p(values, ids, p.min_p)
        probs = torch.softmax(values / p.temp, dim=0)
        choice = torch.multinomial(probs, 1, generator=self.generator)
        return int(ids[choice].item())
