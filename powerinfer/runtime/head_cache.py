"""Screens built for files without one (--sparse-head on a dense file), kept in the user's cache folder.

One .npz per model file, named by a digest of the file's resolved path, size and modification time (a changed
file gets a new screen); it holds the screen's raw blocks, a SHA-256 of them and the version stamp of the code
that built it (powerinfer.stamps, kind "head_screen"), checked on load. A file that fails the check (flipped
bytes, truncated, not ours) is ignored with one warning and built again; one made by another version of the
screen's construction is built again with one log line. Written to a temp file and renamed into place.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from powerinfer import stamps
from powerinfer.model.head import SCREEN_TOKENS, HeadScreen

if TYPE_CHECKING:
    from powerinfer.tokenizer import Tokenizer


class HiddenSource(Protocol):
    """What calibrating a screen uses of an engine (runtime.engine.Engine; a protocol, so that this module does
    not import the engine that imports it)."""

    n_ctx: int
    tokenizer: Tokenizer

    def hidden_states(self, seq: int, tokens: list[int]) -> torch.Tensor: ...

    def free(self, seq: int) -> None: ...


log = logging.getLogger(__name__)

KIND = "head_screen"  # its stamps.REVISIONS entry: bumped when the screen's construction changes


def screen_hidden(engine: HiddenSource, texts: Sequence[str], n_tokens: int = SCREEN_TOKENS) -> torch.Tensor:
    """Final-normed hidden states (N, n_embd) of about n_tokens calibration tokens, an equal share from each of
    `texts` (its first tokens, in windows of up to 512 tokens after BOS; a text shorter than its share gives what
    it has)."""
    share = max(1, n_tokens // max(1, len(texts)))
    window = max(16, min(512, engine.n_ctx))
    bos = engine.tokenizer.bos_id
    prefix = [] if bos is None else [bos]
    step = window - len(prefix)
    hidden = []
    for text in texts:
        ids = engine.tokenizer.encode(text, add_bos=False, parse_special=False)[:share]
        hidden += [engine.hidden_states(0, prefix + ids[i : i + step]) for i in range(0, len(ids), step)]
    engine.free(0)
    return torch.cat(hidden)


def cache_root() -> Path:
    """The user's cache folder of powerinfer: $XDG_CACHE_HOME/powerinfer, else ~/.cache/powerinfer."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "powerinfer"


def cache_folder() -> Path:
    return cache_root() / "head-screens"


def cache_path(model: Path) -> Path:
    st = model.stat()
    key = f"{model.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode("utf-8", "surrogateescape")
    return cache_folder() / f"{hashlib.sha256(key).hexdigest()[:32]}.npz"


def _digest(proj: np.ndarray, screen: np.ndarray, rank: int) -> str:
    h = hashlib.sha256(f"{rank}:{proj.shape}:{screen.shape}".encode())
    h.update(np.ascontiguousarray(proj).data)
    h.update(np.ascontiguousarray(screen).data)
    return h.hexdigest()


def load(model: Path, shapes: tuple[tuple[int, int], tuple[int, int]]) -> HeadScreen | None:
    """The cached screen of `model` whose raw arrays have `shapes` (proj, screen), or None (absent or bad)."""
    path = cache_path(model)
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            proj, screen = z["proj"], z["screen"]
            rank, digest = int(z["rank"]), str(z["digest"])
            stamp = (int(z["format"]), str(z["code"])) if "code" in z.files else (None, None)
        verdict = stamps.check(KIND, *stamp)
        if not verdict.current:
            log.warning(
                "the cached head screen %s was built by other code (%s); building it again",
                path,
                verdict.found,
            )
            return None
        if (proj.dtype, screen.dtype) != (np.uint8, np.uint8) or (proj.shape, screen.shape) != shapes:
            raise ValueError("shapes differ")
        if _digest(proj, screen, rank) != digest:
            raise ValueError("checksum mismatch")
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        log.warning("ignoring the cached head screen %s (%s); building it again", path, e)
        return None
    return HeadScreen(proj=proj, screen=screen, rank=rank)


def save(model: Path, screen: HeadScreen) -> None:
    """Keep `screen` for `model` (best effort: a cache that cannot be written is only logged)."""
    path = cache_path(model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(
                    f,
                    proj=screen.proj,
                    screen=screen.screen,
                    rank=np.int64(screen.rank),
                    digest=np.array(_digest(screen.proj, screen.screen, screen.rank)),
                    format=np.int64(stamps.format_version(KIND)),
                    code=np.array(stamps.code_version(KIND)),
                )
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        log.warning("cannot keep the head screen in %s: %s", path.parent, e)
