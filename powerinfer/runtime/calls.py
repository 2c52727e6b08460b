"""Python work per step, counted: the calls a function makes (the measure behind "Python work per token grows with
layers, never with neurons, rows or experts"), for tests and benchmarks."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["count_calls"]


def count_calls(fn: Callable[[], object]) -> int:
    """Python and builtin calls made while fn() runs (sys.setprofile; the caller's profile hook is put back)."""
    n = 0
    before = sys.getprofile()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal n
        if event in ("call", "c_call"):
            n += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(before)
    return n
