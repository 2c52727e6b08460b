"""Timings: the wall-clock accounting of an engine and its generation loop, in the shape of llama_print_timings.

A leaf module: the engine (which makes it) and the generation loop (which adds to it) both import it from here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["Timings", "format_timings"]


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
    # speculative decoding (runtime.speculative): time spent drafting, tokens drafted and kept
    draft_ms: float = 0.0
    n_draft: int = 0
    n_draft_accepted: int = 0
    start: float = field(default_factory=time.perf_counter)


def format_timings(tm: Timings) -> list[str]:
    """The llama_print_timings block."""

    def rate(ms: float, n: int, unit: str) -> str:
        per = ms / n if n else float("nan")
        tps = 1e3 * n / ms if ms > 0 else float("nan")
        return f"{ms:10.2f} ms / {n:5d} {unit} ({per:8.2f} ms per token, {tps:8.2f} tokens per second)"

    total = (time.perf_counter() - tm.start) * 1e3
    spec = []
    if tm.draft_ms > 0:
        rate_pct = 100.0 * tm.n_draft_accepted / tm.n_draft if tm.n_draft else 0.0
        spec = [
            f"llama_print_timings:  speculative = {tm.n_draft:5d} drafted, {tm.n_draft_accepted:5d} accepted "
            f"({rate_pct:6.2f}%), draft time = {tm.draft_ms:10.2f} ms"
        ]
    return [
        f"llama_print_timings:        load time = {tm.load_ms:10.2f} ms",
        f"llama_print_timings:      sample time = {rate(tm.sample_ms, tm.n_sample, 'runs  ')}",
        f"llama_print_timings: prompt eval time = {rate(tm.prompt_ms, tm.n_prompt, 'tokens')}",
        f"llama_print_timings:        eval time = {rate(tm.eval_ms, tm.n_eval, 'runs  ')}",
        *spec,
        f"llama_print_timings:       total time = {total:10.2f} ms",
    ]
