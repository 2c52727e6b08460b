"""Kernel scratch owned by an engine."""

from __future__ import annotations

import torch


class Workspace:
    """Scratch buffers of the kernels, owned by one engine: blocks reserve sizes when built, and get the one
    buffer of each kind (sized for the largest request) when they run; it is allocated once."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.buffers: dict[str, torch.Tensor] = {}

    def reserve(self, kind: str, n_bytes: int) -> None:
        if n_bytes > self.sizes.get(kind, 0):
            self.sizes[kind] = n_bytes
            self.buffers.pop(kind, None)

    def get(self, kind: str) -> torch.Tensor | None:
        """The buffer of `kind` (None when nothing was reserved: the op then allocates its own)."""
        buf = self.buffers.get(kind)
        if buf is None:
            n = self.sizes.get(kind, 0)
            if n <= 0:
                return None
            buf = self.buffers[kind] = torch.empty(n, dtype=torch.uint8)
        return buf
