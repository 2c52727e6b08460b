"""One step's tokens: which sequence and position each token has, grouped once per step (not per layer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from powerinfer.errors import InputError


@dataclass(frozen=True)
class Segment:
    """A run of tokens of one sequence at consecutive positions: rows start..start+n of the batch."""

    seq: int
    pos: int
    start: int
    n: int


@dataclass(frozen=True)
class StepBatch:
    """tokens (N,), positions (N,) and seq_ids (N,) as int64 CPU tensors, with their segments.

    kind: "run" (one segment: a prompt chunk or one decode token), "decode" (one token of each of several
    distinct sequences) or "mixed" (anything else; attention then runs segment by segment).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    seq_ids: torch.Tensor
    segments: tuple[Segment, ...]
    kind: str
    max_pos: int

    @classmethod
    def build(cls, seq_ids: list[int], tokens: list[int], positions: list[int]) -> StepBatch:
        """Group a flat token list into segments; positions of one sequence must be consecutive per run."""
        if not (len(seq_ids) == len(tokens) == len(positions)) or not tokens:
            raise InputError(
                "a step needs as many sequence ids and positions as tokens, and at least one token"
            )
        segments: list[Segment] = []
        start = 0
        for i in range(1, len(tokens) + 1):
            if i == len(tokens) or seq_ids[i] != seq_ids[start] or positions[i] != positions[i - 1] + 1:
                segments.append(Segment(seq_ids[start], positions[start], start, i - start))
                start = i
        if len(segments) == 1:
            kind = "run"
        elif all(s.n == 1 for s in segments) and len({s.seq for s in segments}) == len(segments):
            kind = "decode"
        else:
            kind = "mixed"
        return cls(
            torch.tensor(tokens, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            torch.tensor(seq_ids, dtype=torch.int64),
            tuple(segments),
            kind,
            max(positions),
        )

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])
