"""Context shift, as llama.cpp's main and server do it: when a sequence fills its context, keep its first n_keep
tokens, drop half of the rest and go on generating.

The dropped positions' rows leave the KV cache; the later rows move down by n_discard and their keys are
re-rotated by -n_discard in place (`KVCache.shift`, with each layer's `Rope.shift`): nothing is recomputed, so the
kept tokens' keys and values still carry what they attended to before (llama.cpp's K-shift). A layer without RoPE
just moves its rows; a model with learned absolute positions (OPT) cannot shift and stops instead.

`make_room` is the generation loop's hook (runtime.generate), `held_tokens` the tokens a shifted sequence's slot
still holds (prompt reuse, session files), `truncate_prompt` llama-server's cut of a prompt longer than its slot.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from powerinfer.errors import InputError

if TYPE_CHECKING:
    from powerinfer.model.transformer import Transformer
    from powerinfer.runtime.kv_cache import KVCache, Rotation

log = logging.getLogger(__name__)

STOP_DISABLED = "context full and context shift is disabled => stopping"  # llama.cpp main's words


class ShiftParams(Protocol):
    """What a context shift reads of a sequence's parameters (runtime.generate.GenParams)."""

    context_shift: bool
    n_keep: int


class ShiftSequence(Protocol):
    """What a context shift uses of a sequence (runtime.generate.Sequence; a protocol, so that this module does
    not import the loop that imports it)."""

    slot: int
    params: ShiftParams
    history: list[int]
    shifts: list[tuple[int, int]]


class ShiftEngine(Protocol):
    """What a context shift uses of an engine (runtime.engine.Engine)."""

    n_ctx: int
    kv: KVCache

    def shift(self, seq: int, n_keep: int, n_discard: int) -> None: ...


def shift_blocker(model: Transformer) -> str | None:
    """Why this model's cache cannot be shifted (None: it can)."""
    if model.embedding.positions is not None:
        return "its learned absolute positions are part of the cached keys and values"
    if any(layer.attn.spec.rope is not None and layer.attn.rope is None for layer in model.layers):
        return "a layer's RoPE tables are missing"
    return None


def shift_cache(model: Transformer, kv: KVCache, seq: int, n_keep: int, n_discard: int) -> None:
    """Drop positions n_keep..n_keep+n_discard-1 of sequence seq from the layers of `model` held in `kv`, the
    later keys re-rotated by each layer's RoPE (runtime.kv_cache.KVCache.shift)."""
    reason = shift_blocker(model)
    if reason is not None:
        raise InputError(f"cannot shift the context: {reason}")
    ropes: list[Rotation | None] = [
        None if layer.attn.rope is None else layer.attn.rope.shift for layer in model.layers
    ]
    kv.shift(seq, n_keep, n_discard, ropes)


def resolve_keep(n_keep: int, n_prompt: int, add_bos: bool) -> int:
    """--keep / n_keep as llama.cpp's main reads it: -1 (any negative) or more than the prompt keeps the whole
    prompt; else n_keep tokens after the BOS the tokenizer adds (the count then includes it)."""
    if n_keep < 0 or n_keep > n_prompt:
        return n_prompt
    return min(n_keep + int(add_bos), n_prompt)


def check_keep(n_keep: int, n_ctx: int) -> None:
    """--keep must leave room in the context: one error line otherwise."""
    if n_keep >= n_ctx:
        raise InputError(
            f"--keep {n_keep} is not below the context size {n_ctx} (-c): nothing could be shifted out"
        )


def make_room(engine: ShiftEngine, seq: ShiftSequence) -> bool:
    """The loop's hook after a token is sampled: whether `seq` may go on. A sequence whose next token has no free
    position (llama.cpp: n_past + 1 >= n_ctx) is shifted when its params allow it (GenParams.context_shift):
    n_keep tokens kept, n_discard = (n_past - n_keep) / 2 dropped, recorded in seq.shifts."""
    n_past, n_ctx = engine.kv.n_past[seq.slot], engine.n_ctx
    p = seq.params
    if not p.context_shift:
        if n_past >= n_ctx:
            log.info(STOP_DISABLED)
        return n_past < n_ctx
    if n_past + 1 < n_ctx:
        return True
    n_keep = min(p.n_keep, n_past)
    n_discard = (n_past - n_keep) // 2
    try:
        if n_discard <= 0:
            raise InputError(f"n_keep {n_keep} leaves nothing to drop")
        engine.shift(seq.slot, n_keep, n_discard)
    except InputError as e:
        log.warning("context full and %s => stopping", e)
        return False
    log.debug("context shifted: n_past = %d, n_keep = %d, n_discard = %d", n_past, n_keep, n_discard)
    seq.shifts.append((n_keep, n_discard))
    return True


def held_tokens(seq: ShiftSequence) -> list[int]:
    """The tokens of seq.history (prompt and generated) that its slot still holds after its shifts (the last of
    them perhaps not evaluated yet)."""
    tokens = seq.history
    for n_keep, n_discard in seq.shifts:
        tokens = tokens[:n_keep] + tokens[n_keep + n_discard :]
    return tokens


def truncate_prompt(prompt: list[int], n_ctx: int, n_keep: int) -> list[int]:
    """llama-server's cut of a prompt that does not fit its slot (n_prompt >= n_ctx): the first n_keep tokens,
    then the end, with whole blocks of (n_ctx - n_keep) / 2 tokens dropped after the kept ones. A prompt that
    fits comes back as it is."""
    if len(prompt) < n_ctx:
        return prompt
    block = (n_ctx - n_keep) // 2
    if block <= 0:
        raise InputError(
            f"the prompt has {len(prompt)} tokens and n_keep {n_keep} leaves no room to truncate it in a context "
            f"of {n_ctx}"
        )
    erased = (len(prompt) - n_keep - block) // block
    return prompt[:n_keep] + prompt[n_keep + erased * block :]
