"""Timings: the wall-clock accounting of an engine and its generation loop, in the shape of llama_print_timings.

A leaf module: the engine (which makes it) and the generation loop (which adds to it) both import it from here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["Timings"]


@dataclass
class Timings:
    """Wall-clock accounting in the shape of llama_print_timings."""

    load_ms: float = 0.0
    sample_ms: float = 0.0
    n_sample: int = 0
    prompt_ms: float = 0.0
    n_prompt: int = 0
    eval_ms: float = 0.0
    n_eval: int = 0
    start: float = field(default_factory=time.perf_counter)
