"""The GPU side of the engine: what runs on the pool device and how its results reach the CPU.

`Pending`: a result a device queued, handed to its caller as a handle that waits for the work producing it.
"""

from powerinfer.device.pending import Pending

__all__ = ["Pending"]
