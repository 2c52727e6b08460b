"""Preallocated KV cache: per layer, (n_seq, n_ctx, n_head_kv, head_dim) keys and values on that layer's device.

The cache also keeps each sequence's length (`n_past`): the one place positions live.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Sequence

import torch

# re-rotates keys (T, H_kv, D) already rotated for positions p to positions p + delta (model.blocks.Rope.shift)
Rotation = Callable[[torch.Tensor, int], torch.Tensor]

KV_BYTES_PER_ELEMENT = 4  # float32 keys and values


def kv_cache_bytes(n_layer: int, n_ctx: int, n_embd_gqa: int, n_seq: int = 1) -> int:
    """Bytes of the keys and values of n_layer layers, n_ctx positions and n_seq sequences (exact integers)."""
    return n_layer * n_ctx * n_embd_gqa * 2 * KV_BYTES_PER_ELEMENT * n_seq


def _meminfo_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, else free physical pages from sysconf; None when neither exists."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _address_space_left() -> int | None:
    """Address space this process may still map under RLIMIT_AS (None: no limit, or unknown)."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return max(0, soft - int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    return soft


def available_memory_bytes() -> int | None:
    """Host memory this process can still allocate: the machine's available memory, capped by what an
    address-space limit (ulimit -v) leaves; None when neither can be read."""
    limits = [n for n in (_meminfo_available(), _address_space_left()) if n is not None]
    return min(limits) if limits else None


class KVLayerView:
    """One layer's keys and values of every sequence."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v  # (n_seq, n_ctx, H_kv, D)
        self.positions = torch.arange(k.shape[1], device=k.device)
        # each sequence's views, made once: a decode step asks for one per layer (indexing costs ~10 us)
        self._slots = [(k[i], v[i]) for i in range(k.shape[0])]

    def slot(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._slots[seq]

    def update(
        self, seq: int, pos: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = pos + k.shape[0]
        self.k[seq, pos:end] = k
        self.v[seq, pos:end] = v
        return self.k[seq, :end], self.v[seq, :end]

    def read_rows(self, seq: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions start..end-1 of sequence seq as float32 copies (end - start, H_kv, D)."""
        return self.k[seq, start:end].float().clone(), self.v[seq, start:end].float().clone()

    def write_rows(self, seq: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store float keys and values (T, H_kv, D) at positions pos..pos+T-1 of sequence seq."""
        self.k[seq, pos : pos + k.shape[0]] = k
        self.v[seq, pos : pos + v.shape[0]] = v

    def update_batch(
        self, seqs: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seqs, positions = seqs.to(self.k.device), positions.to(self.k.device)
        self.k[seqs, positions] = k
        self.v[seqs, positions] = v
        length = int(positions.max()) + 1
        mask = self.positions[:length][None, :] <= positions[:, None]  # (B, L)
        # positions past a sequence's end may never have been written (empty memory): zero them so that a
        # masked-out NaN cannot leak through 0 * NaN in the weighted sum
        hidden = ~mask[:, :, None, None]
        keys = self.k[seqs, :length].masked_fill(hidden, 0.0)
        values = self.v[seqs, :length].masked_fill(hidden, 0.0)
        return keys, values, mask


class KVCache:
    """KV cache of n_seq independent sequences (slots), sized once from the config and the context length."""

    def __init__(
        self,
        n_layer: int,
        n_ctx: int,
        n_head_kv: int,
        head_dim: int,
        n_seq: int = 1,
        dtype: torch.dtype = torch.float32,
        devices: Sequence[torch.device] | None = None,
        zeroed: Sequence[bool] | None = None,
    ) -> None:
        """devices: each layer's (default the CPU); zeroed: the layers whose rows start at 0 (a device span's
        attention reads every row, masking the unwritten ones: they must be finite)."""
        self.n_ctx = n_ctx
        self.n_seq = n_seq
        self.n_past = [0] * n_seq
        devices = devices or [torch.device("cpu")] * n_layer
        zeroed = zeroed or [False] * len(devices)
        shape = (n_seq, n_ctx, n_head_kv, head_dim)

        def rows(device: torch.device, zero: bool) -> torch.Tensor:
            # empty where attention reads written positions only: pages are committed as positions fill
            make = torch.zeros if zero else torch.empty
            return make(shape, dtype=dtype, device=device)

        self.layers = [KVLayerView(rows(d, z), rows(d, z)) for d, z in zip(devices, zeroed, strict=True)]

    @property
    def n_bytes(self) -> int:
        return sum(view.k.nbytes + view.v.nbytes for view in self.layers)

    def layer_view(self, layer: int) -> KVLayerView:
        return self.layers[layer]

    def copy_slot(self, src: int, dst: int, n: int) -> None:
        """Copy the first n positions of sequence src into sequence dst (a shared prompt evaluated once)."""
        for view in self.layers:
            view.k[dst, :n] = view.k[src, :n]
            view.v[dst, :n] = view.v[src, :n]
        self.n_past[dst] = n

    def shift(self, seq: int, n_keep: int, n_discard: int, ropes: Sequence[Rotation | None]) -> None:
        """Drop positions n_keep..n_keep+n_discard-1 of sequence seq: the later rows move down by n_discard and
        their keys are re-rotated by -n_discard (ropes[layer](k, delta); None: a layer without RoPE), in place
        (a device span's views stay valid); the sequence's length shrinks by n_discard."""
        n_past = self.n_past[seq]
        if n_keep < 0 or n_discard <= 0 or n_keep + n_discard > n_past:
            raise ValueError(f"cannot drop {n_discard} positions after {n_keep} of a sequence of {n_past}")
        for view, rotate in zip(self.layers, ropes, strict=True):
            k, v = view.read_rows(seq, n_keep + n_discard, n_past)
            view.write_rows(seq, n_keep, k if rotate is None else rotate(k, -n_discard), v)
        self.n_past[seq] = n_past - n_discard

    def read_slot(self, seq: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n positions of sequence seq: keys and values (n_layer, n, H_kv, D) on the CPU."""
        keys = torch.stack([view.k[seq, :n].cpu() for view in self.layers])
        values = torch.stack([view.v[seq, :n].cpu() for view in self.layers])
        return keys, values

    def write_slot(self, seq: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make sequence seq hold keys and values (n_layer, n, H_kv, D), as read_slot returns them."""
        n = keys.shape[1]
        for view, k, v in zip(self.layers, keys, values, strict=True):
            view.k[seq, :n] = k.to(view.k.device, view.k.dtype)
            view.v[seq, :n] = v.to(view.v.device, view.v.dtype)
        self.n_past[seq] = n
