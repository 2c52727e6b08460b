"""A device's result handed to the CPU: a handle whose `result()` waits for the queued work that produces it.

A pool part queues its kernels and its copy to the host on its own stream and returns at once, so the CPU's part
of the layer runs meanwhile; the value is ready only when the stream reaches the event recorded after the copy.
Returning the tensor itself would let a caller read it before the copy lands. On the CPU stand-in the work ran
synchronously and the handle holds no event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


@dataclass(eq=False)
class Pending(Generic[T]):
    """`value` once `event` (recorded on the producing stream after its last copy) has completed."""

    value: T
    event: torch.cuda.Event | None = None

    @classmethod
    def queued(cls, value: T, stream: torch.cuda.Stream | None) -> Pending[T]:
        """value, ready when the work queued on `stream` so far is done (None: ready now)."""
        if stream is None:
            return cls(value)
        event = torch.cuda.Event()
        event.record(stream)
        return cls(value, event)

    def result(self) -> T:
        """The value, after waiting for the work that produces it."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.value
