"""One sequence kept across turns (interactive `main`), and its evaluated state in a file (--prompt-cache).

`Session.sync(tokens)` makes KV slot 0 hold `tokens`: it keeps the longest prefix the cache already holds and
evaluates only the rest, so a conversation never re-prefills its history. `save_session` / `load_session` write
and read the tokens and their keys and values with `torch.save` / `torch.load(weights_only=True)` (plain tensors
and strings, no pickled code), followed by a trailer (magic and the SHA-256 of every byte before it), checked on
load before anything is parsed, then against the model and the context: a damaged file is refused, never used.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from powerinfer import stamps
from powerinfer.errors import FormatError, InputError

if TYPE_CHECKING:
    from powerinfer.runtime.engine import Engine

SESSION_FORMAT = "powerinfer-session"
SESSION_VERSION = 2  # 2: the SHA-256 trailer
TRAILER_MAGIC = b"PISESS2\0"  # then 32 bytes of SHA-256 over everything before the magic
FINGERPRINT_BYTES = 1 << 22  # the header (metadata, tokenizer, tensor table) and the first weights


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Session:
    """The tokens held by KV slot 0 of an engine, kept in step with `engine.kv.n_past[0]`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cached: list[int] = []

    def sync(self, tokens: list[int], logits: bool = True) -> tuple[torch.Tensor | None, int]:
        """Evaluate what `tokens` adds to the cache (with `logits`, at least its last token, for its logits).

        Returns the last token's logits (n_vocab,), None when nothing was evaluated, and how many tokens were
        evaluated. The prompt timings count only those. An interrupt leaves `cached` as far as the evaluation
        got."""
        e = self.engine
        if not tokens:
            raise InputError("nothing to evaluate (empty token list)")
        if not logits and self.cached[: len(tokens)] == tokens:
            e.kv.n_past[0] = len(tokens)
            self.cached = list(tokens)
            return None, 0
        if len(tokens) > e.n_ctx:
            raise InputError(
                f"context is full: {len(tokens)} tokens exceed the context size {e.n_ctx} (-c); "
                "start again with a larger -c"
            )
        keep = min(common_prefix(self.cached, tokens), len(tokens) - 1, e.kv.n_past[0])
        e.kv.n_past[0] = keep
        self.cached = self.cached[:keep]
        t = time.perf_counter()
        try:
            logits = e.prefill(0, tokens[keep:], keep)
        finally:
            self.cached = tokens[: e.kv.n_past[0]]
        e.timings.prompt_ms += (time.perf_counter() - t) * 1e3
        e.timings.n_prompt += len(tokens) - keep
        return logits, len(tokens) - keep

    def make_room(self, tokens: list[int], n_keep: int) -> list[int]:
        """`tokens` made to fit the context before they are evaluated, as llama.cpp's main shifts it: while they
        leave no free position, keep the first n_keep, drop half of the rest; the cache drops the same positions
        (engine.shift, keys re-rotated) where it holds them, so that only the new tokens are evaluated."""
        e = self.engine
        while len(tokens) + 1 >= e.n_ctx:
            n_discard = (len(tokens) - n_keep) // 2
            if n_discard <= 0:
                break  # sync refuses them with one line
            n_past = min(common_prefix(self.cached, tokens), e.kv.n_past[0])
            if n_past >= n_keep + n_discard:
                e.kv.n_past[0] = n_past
                e.shift(0, n_keep, n_discard)
                self.cached = self.cached[:n_keep] + self.cached[n_keep + n_discard : n_past]
            else:
                self.cached = self.cached[: min(n_past, n_keep)]
                e.kv.n_past[0] = len(self.cached)
            tokens = tokens[:n_keep] + tokens[n_keep + n_discard :]
        return tokens

    def settle(self, history: list[int]) -> None:
        """After a generation: the cache holds the evaluated head of `history` (prompt + generated tokens)."""
        self.cached = history[: self.engine.kv.n_past[0]]


@dataclass(frozen=True)
class SessionIdentity:
    """What a session file must match: the model file's bytes (a hash of its head and its size), the compute
    mode and the KV shape."""

    model: str
    mode: str
    n_layer: int
    n_head_kv: int
    head_dim: int


def session_identity(engine: Engine) -> SessionIdentity:
    data = engine.gguf.mmap
    digest = hashlib.sha256(memoryview(data[:FINGERPRINT_BYTES])).hexdigest()
    c = engine.config
    mode = f"{'sparse' if engine.sparse_stats is not None else 'dense'}/{engine.kc.act_precision}"
    return SessionIdentity(f"{digest}:{data.shape[0]}", mode, c.n_layer, c.n_head_kv, c.head_dim)


def save_session(path: Path, engine: Engine, tokens: list[int]) -> None:
    """Write tokens and the keys and values slot 0 holds for them; through a temp file and a rename, so a
    reader never sees half a file."""
    if len(tokens) > engine.kv.n_past[0]:
        raise InputError(f"session of {len(tokens)} tokens, the cache holds {engine.kv.n_past[0]}")
    keys, values = engine.kv.read_slot(0, len(tokens))
    ident = session_identity(engine)
    state = {
        "format": SESSION_FORMAT,
        "version": SESSION_VERSION,
        "model": ident.model,
        "mode": ident.mode,
        "stamp": stamps.header("session"),
        "tokens": torch.tensor(tokens, dtype=torch.int64),
        "keys": keys,
        "values": values,
    }
    folder = path.parent if str(path.parent) else Path(".")
    try:
        mode = path.stat().st_mode & 0o777  # a rewrite keeps the file's permissions
    except OSError:
        mode = 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        body = io.BytesIO()
        torch.save(state, body)
        data = body.getvalue()
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.write(TRAILER_MAGIC + hashlib.sha256(data).digest())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_session(path: Path, engine: Engine) -> list[int]:
    """Read a session file into slot 0 and return its tokens; FormatError (nothing changed) when the file is
    not a session of this model, mode and shape or does not fit the context."""
    ident = session_identity(engine)
    c = engine.config
    max_bytes = c.n_layer * engine.n_ctx * c.n_head_kv * c.head_dim * 2 * 8 + engine.n_ctx * 8 + (1 << 16)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise FormatError(f"cannot read it ({e.strerror})") from None
    if size > max_bytes:
        raise FormatError(
            f"{size} bytes is more than a session of this model and context holds ({max_bytes})"
        )
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise FormatError(f"cannot read it ({e.strerror})") from None
    n_trailer = len(TRAILER_MAGIC) + 32
    if len(raw) < n_trailer or raw[-n_trailer:-32] != TRAILER_MAGIC:
        raise FormatError("not a powerinfer session file of this version (no checksum trailer)")
    if hashlib.sha256(memoryview(raw)[:-n_trailer]).digest() != raw[-32:]:
        raise FormatError("its checksum does not match its bytes (a damaged file)")
    try:
        with warnings.catch_warnings():  # torch's notes on odd pickles: the refusal below says it in one line
            warnings.simplefilter("ignore")
            state = torch.load(io.BytesIO(raw[:-n_trailer]), map_location="cpu", weights_only=True)
    except (RuntimeError, ValueError, EOFError, OSError, AttributeError, KeyError, TypeError, IndexError,
            pickle.UnpicklingError, UnicodeDecodeError, MemoryError) as e:  # fmt: skip
        raise FormatError(f"not a readable session file ({type(e).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != SESSION_FORMAT:
        raise FormatError("not a powerinfer session file")
    if state.get("version") != SESSION_VERSION:
        raise FormatError(f"session format version {state.get('version')!r}, expected {SESSION_VERSION}")
    verdict = stamps.check_header("session", state.get("stamp"))
    if verdict.changed:
        raise FormatError(f"it was saved in another session format ({verdict.found})")
    stamps.warn_user_file(f"session file {path}", verdict)
    if state.get("model") != ident.model:
        raise FormatError("it was saved with another model file")
    if state.get("mode") != ident.mode:
        raise FormatError(f"it was saved in mode {state.get('mode')!r}, this run is {ident.mode}")
    tokens, keys, values = state.get("tokens"), state.get("keys"), state.get("values")
    if not all(isinstance(t, torch.Tensor) for t in (tokens, keys, values)):
        raise FormatError("tokens, keys or values missing")
    assert (
        isinstance(tokens, torch.Tensor)
        and isinstance(keys, torch.Tensor)
        and isinstance(values, torch.Tensor)
    )
    n = tokens.numel()
    shape = (ident.n_layer, n, ident.n_head_kv, ident.head_dim)
    if tokens.dim() != 1 or tuple(keys.shape) != shape or tuple(values.shape) != shape:
        raise FormatError(f"sizes do not match the model: keys {tuple(keys.shape)}, expected {shape}")
    if not keys.is_floating_point() or not values.is_floating_point():
        raise FormatError("keys and values are not floating point")
    if n > engine.n_ctx:
        raise FormatError(f"{n} tokens do not fit the context size {engine.n_ctx} (-c)")
    ids = tokens.tolist()
    if n and not 0 <= min(ids) <= max(ids) < engine.config.n_vocab:
        raise FormatError("a token id is out of the vocabulary")
    if not (torch.isfinite(keys).all() and torch.isfinite(values).all()):
        raise FormatError("keys or values are not finite")
    engine.kv.write_slot(0, keys, values)
    return ids
