"""Logits to token ids with llama.cpp's semantics and order.

Chain: penalties (repeat, frequency, presence over the last `repeat_last_n` tokens) -> greedy if temp <= 0,
else top-k -> top-p -> min-p -> temperature -> draw from a seeded generator. Each step is a small pure function
over a candidate set (logits and token ids sorted by logit, descending).

Parameters follow llama.cpp: temp <= 0 is greedy, top_k <= 0 keeps every token, top_p >= 1 and min_p <= 0 are
off, repeat_penalty 1 and repeat_last_n 0 turn the repeat penalty off, repeat_last_n -1 looks back over the
whole context. The seed is a uint32 as in llama.cpp: any integer is reduced modulo 2**32, and 0xFFFFFFFF
(LLAMA_DEFAULT_SEED, what -1 becomes) draws a random one. Values that would make the distribution NaN (a
non-finite number anywhere, a repeat penalty <= 0 or denormal) are refused by `SamplingParams`. Whatever the
logits hold, the sampler returns a token id in range: NaN logits are never drawn, +inf ones win over every
finite one, and when no token is left to draw it raises `SamplingError` instead of drawing garbage.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from powerinfer import ops
from powerinfer.errors import InputError

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # smallest normal float32
SEED_MASK = 0xFFFFFFFF
DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: draw a random seed


class SamplingParamError(InputError):
    """A sampling parameter that cannot be used; `field` names it (a SamplingParams field)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field} {reason}")
        self.field = field
        self.reason = reason


class SamplingError(InputError):
    """No token can be drawn: every candidate logit is -inf or NaN."""


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

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise SamplingParamError(f.name, f"must be an integer, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SamplingParamError(f.name, f"must be a number, got {value!r}")
            if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
                raise SamplingParamError(f.name, f"must be a finite number, got {value}")
        if self.repeat_penalty < FLOAT32_TINY:
            # 0 or a denormal divides positive logits into +inf, a negative one flips their order
            raise SamplingParamError(
                "repeat_penalty",
                f"must be a positive, non-denormal number (1 = off), got {self.repeat_penalty}",
            )
        if self.repeat_last_n < -1:
            raise SamplingParamError(
                "repeat_last_n", f"must be >= -1 (-1: the whole context, 0: off), got {self.repeat_last_n}"
            )

    @property
    def greedy(self) -> bool:
        return _as_float32(self.temp) <= 0


def _as_float32(x: float) -> float:
    """`x` rounded to float32, as the sampler uses it (1e-46 becomes 0)."""
    return float(torch.tensor(x, dtype=torch.float32))


def resolve_seed(seed: int) -> int:
    """llama.cpp's seed: reduced to uint32; LLAMA_DEFAULT_SEED (what -1 becomes) draws a random one."""
    seed = int(seed) & SEED_MASK
    return random.randrange(DEFAULT_SEED) if seed == DEFAULT_SEED else seed


def apply_penalties(logits: torch.Tensor, history: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """Repeat penalty (divide positive, multiply negative logits) then frequency/presence penalties."""
    n = params.repeat_last_n
    if n < 0:
        n = len(history)  # -1: the whole context
    recent = list(history[-n:]) if n > 0 else []
    if not recent or (
        params.repeat_penalty == 1.0 and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0
    ):
        return logits
    # in numpy: the same float32 steps as torch's (a float32 array and a Python float scalar compute in float32),
    # without torch's ~8 us a call on these few values
    ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
    inside = (ids >= 0) & (ids < logits.numel())
    ids, counts = ids[inside], counts[inside]
    out = logits.clone()
    values = out.numpy()
    sel = values[ids]
    with np.errstate(
        over="ignore", invalid="ignore"
    ):  # IEEE as torch: a huge logit over a tiny penalty is inf
        sel = np.where(sel <= 0, sel * params.repeat_penalty, sel / params.repeat_penalty)
        values[ids] = sel - counts.astype(np.float32) * params.frequency_penalty - params.presence_penalty
    return out


def top_k(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the k best candidates; k <= 0 keeps all. Inputs are sorted descending."""
    if k <= 0 or k >= values.numel():
        return values, ids
    return values[:k], ids[:k]


def top_k_sorted(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best finite logits of (n,) float32 without NaN (k <= 0: every finite one) and their ids, best first,
    ties by the lower id; -inf (banned) tokens are never candidates. A small k takes the candidates over a threshold
    sampled from every 16th logit (ops.top_about_k, ~40 us on 49152 logits where torch.topk takes ~120), which hold
    the k best whenever they are at least k; else every logit at least the k-th best (numpy's partition)."""
    values = logits.numpy()
    n = values.size
    cand: np.ndarray | None = None
    if 0 < k and 8 * k <= n:
        found, _ = ops.top_about_k(logits, 2 * k)
        if found.numel() >= k:
            cand = found.numpy()
    if cand is None:  # every logit, or the rare sampled threshold above the k-th best
        cand = np.flatnonzero(values >= np.partition(values, n - k)[n - k]) if 0 < k < n else np.arange(n)
    values = values[cand]
    order = np.argsort(-values, kind="stable")  # ids ascending: ties keep the lower id first
    if 0 < k < order.size:
        order = order[:k]
    values, cand = values[order], cand[order]
    keep = int(np.isfinite(values).sum())  # best first: the finite ones lead
    return torch.from_numpy(values[:keep]), torch.from_numpy(cand[:keep])


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
        self.seed = resolve_seed(params.seed)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.temp = _as_float32(params.temp)

    def __call__(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        """Pick the next token from logits (n_vocab,) given the tokens seen so far; a token id in
        [0, n_vocab), or SamplingError when every logit is -inf or NaN."""
        logits, arg = self._prepare(logits, history)
        if self.temp <= 0:
            return arg
        probs, ids = self._candidates(logits)
        choice = torch.multinomial(probs, 1, generator=self.generator)
        return int(ids[choice].item())

    def distribution(
        self, logits: torch.Tensor, history: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The distribution `__call__` draws from: probabilities (n,) over candidate token ids (n,); greedy
        (temp <= 0) puts all of it on the chosen token. Draws nothing (speculative decoding weighs drafts with
        it)."""
        logits, arg = self._prepare(logits, history)
        if self.temp <= 0:
            return torch.ones(1), torch.tensor([arg])
        return self._candidates(logits)

    def _prepare(self, logits: torch.Tensor, history: Sequence[int]) -> tuple[torch.Tensor, int]:
        """Penalised logits with NaN out and +inf ties kept, and the greedy choice (the first best id).
        Whole-vocabulary passes go through numpy views: torch's one-row reductions cost ~10x more (max, isfinite,
        topk on 49152 logits: 37, 140 and 122 us a token at one thread)."""
        inf = float("inf")
        if logits.numel() == 0:
            raise SamplingError("no token can be sampled: the logits are empty")
        logits = apply_penalties(logits.detach().float().contiguous(), history, self.params)
        if np.isnan(logits.numpy()).any():  # NaN is never drawn
            logits = torch.nan_to_num(logits, nan=-inf, posinf=inf, neginf=-inf)
        values = logits.numpy()
        arg = int(values.argmax())
        top = float(values[arg])
        if top == -inf:
            raise SamplingError("no token can be sampled: every logit is -inf or NaN")
        if top == inf:  # +inf outranks every finite logit: the +inf tokens tie, the rest are out
            logits = torch.where(torch.isposinf(logits), 0.0, -inf)
        return logits, arg

    def _candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """top-k -> top-p -> min-p -> temperature: probabilities over the candidate ids, best first (ties: the
        lower id first)."""
        p = self.params
        values, ids = top_k_sorted(logits, p.top_k)
        values, ids = top_p(values, ids, p.top_p)
        values, ids = min_p(values, ids, p.min_p)
        # shifted by the best logit before dividing: a tiny temperature gives 0 and -inf, never inf - inf
        return torch.softmax((values - values[0]) / self.temp, dim=0), ids
