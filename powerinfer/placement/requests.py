"""What the user asked of placement, checked: a pool device, a VRAM budget, a count of CPU-only MoE layers.

Each check raises one InputError / PlacementError line; the CLI's option table and any other front end call them.
"""

from __future__ import annotations

import math

from powerinfer.errors import InputError, PlacementError
from powerinfer.printable import printable


def resolve_vram_budget(gib: float) -> float | None:
    """--vram-budget: -1 (the default) means all free device memory; other negative values, NaN and inf are
    errors."""
    if gib == -1:
        return None
    if not math.isfinite(gib) or gib < 0:
        raise InputError(f"--vram-budget must be -1 (all free memory) or >= 0 GiB, got {gib}")
    return gib


def n_cpu_moe(n: int) -> int:
    """--n-cpu-moe: a layer count, >= 0."""
    if n < 0:
        raise InputError(f"--n-cpu-moe must be >= 0 (got {n})")
    return n


def resolve_device(text: str | None, option: str = "--pool-device") -> str | None:
    """A device option: cpu, cuda or cuda:N (N an existing device); InputError / PlacementError otherwise."""
    if text is None:
        return None
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise InputError(f"{option} {printable(text)}: expected cpu, cuda or cuda:N") from None
    if device.type == "cpu" and device.index in (None, 0):
        return "cpu"
    if device.type != "cuda":
        raise InputError(f"{option} {printable(text)}: expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise PlacementError(f"{option} {printable(text)}: no CUDA device is available")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise PlacementError(
            f"{option} {printable(text)}: no such CUDA device ({count} present: cuda:0..{count - 1})"
        )
    return str(device)
