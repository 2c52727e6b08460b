"""Batched decoding: many sequences, one KV slot each, one forward pass per step for all of them."""

from __future__ import annotations

import torch

from powerinfer.errors import InputError
from powerinfer.runtime.engine import Engine


class BatchDecoder:
    """Drives an Engine whose KV cache has n_seq slots.

    `prefill(slot, tokens)` runs a prompt into one slot (from position 0); `step(slots, tokens)` appends one
    token to each of several distinct slots in a single forward pass and returns their next-token logits.
    Sparse models apply per-token predictor masks inside the batch.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.n_seq = engine.kv.n_seq
        self.n_past = [0] * self.n_seq

    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx

    def free(self, slot: int) -> None:
        """Forget a slot's sequence; the slot can take a new prompt."""
        self.n_past[slot] = 0

    @torch.inference_mode()
    def prefill(self, slot: int, tokens: list[int]) -> torch.Tensor:
        """Evaluate a prompt into `slot` from position 0; returns the last token's logits (n_vocab,)."""
        self._check_slot(slot)
        if not tokens:
            raise InputError("empty prompt")
        if len(tokens) > self.n_ctx:
            raise InputError(f"prompt of {len(tokens)} tokens exceeds the context size {self.n_ctx}")
        e = self.engine
        logits = None
        for i in range(0, len(tokens), e.options.n_batch):
            chunk = torch.tensor(tokens[i : i + e.options.n_batch], dtype=torch.int64)
            logits = e.model.forward(chunk, i, e.kv, last_only=True, seq=slot)
        self.n_past[slot] = len(tokens)
        assert logits is not None
        return logits[-1]

    def fork(self, src: int, dst: int) -> None:
        """Start slot dst as a copy of slot src (same prompt, evaluated once)."""
        self._check_slot(src)
        self._check_slot(dst)
        self.engine.kv.copy_slot(src, dst, self.n_past[src])
        self.n_past[dst] = self.n_past[src]

    @torch.inference_mode()
    def step(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """Append tokens[i] to slots[i] (distinct slots); returns logits (len(slots), n_vocab)."""
        if len(set(slots)) != len(slots):
            raise InputError("a batch step takes one token per slot")
        for slot in slots:
            self._check_slot(slot)
            if self.n_past[slot] >= self.n_ctx:
                raise InputError(f"slot {slot} is full ({self.n_ctx} tokens)")
        positions = torch.tensor([self.n_past[s] for s in slots], dtype=torch.int64)
        seqs = torch.tensor(slots, dtype=torch.int64)
        logits = self.engine.model.forward_batch(
            torch.tensor(tokens, dtype=torch.int64), positions, seqs, self.engine.kv
        )
        for slot in slots:
            self.n_past[slot] += 1
        return logits

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_seq:
            raise InputError(f"slot {slot} out of range (0..{self.n_seq - 1})")
