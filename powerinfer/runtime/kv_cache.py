"""Preallocated KV cache: per layer, (n_seq, n_ctx, n_head_kv, head_dim) keys and values on that layer's device,
each stored in its cache type (-ctk / -ctv: quant.types.KV_CACHE_TYPES; ops.kv_types gives the layouts).

The cache also keeps each sequence's length (`n_past`): the one place positions live. Every write and read of rows
outside the attention kernels goes through `KVLayerView.store` / `KVLayerView.rows` (encode / decode), so a new
operation on the cache (a context shift re-rotating kept keys) reads and writes rows the same way for every type.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Sequence

import torch

from powerinfer.ops.kv_types import KVType, kv_decode, kv_dims, kv_encode, kv_rotation, kv_type

# re-rotates keys (T, H_kv, D) already rotated for positions p to positions p + delta (model.blocks.Rope.shift)
Rotation = Callable[[torch.Tensor, int], torch.Tensor]

DEFAULT_KV_TYPE = "f32"  # -ctk / -ctv default (docs/generation.md: why not llama.cpp's f16)


def kv_cache_bytes(
    n_layer: int,
    n_ctx: int,
    n_embd_gqa: int,
    n_seq: int = 1,
    type_k: str = DEFAULT_KV_TYPE,
    type_v: str = DEFAULT_KV_TYPE,
) -> int:
    """Bytes of the keys and values of n_layer layers, n_ctx positions and n_seq sequences (exact integers): per
    element 4 (f32), 2 (f16, bf16), 34 / 32 and 18 / 32 (the 8-bit and 4-bit blocks)."""
    row = kv_type(type_k).row_bytes(n_embd_gqa) + kv_type(type_v).row_bytes(n_embd_gqa)
    return n_layer * n_ctx * row * n_seq


def kv_bytes_terms(type_k: str, type_v: str) -> str:
    """The per-element bytes of a cache's keys and values as a formula's text ("2 x 4", "(34 + 18) / 32")."""
    tk, tv = kv_type(type_k), kv_type(type_v)
    if tk == tv and tk.block_elems == 1:
        return f"2 x {tk.block_bytes}"
    return f"({tk.block_bytes}/{tk.block_elems} + {tv.block_bytes}/{tv.block_elems})"


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
    """One layer's keys and values of every sequence, stored as their cache types say."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, type_k: KVType, type_v: KVType) -> None:
        self.k, self.v = (
            k,
            v,
        )  # (n_seq, n_ctx, H_kv, D), or (n_seq, n_ctx, H_kv, D / 32, block bytes): ops.kv_types
        self.type_k, self.type_v = type_k, type_v
        head_dim = kv_dims(k[0])[2]
        self.rot_k, self.rot_v = kv_rotation(type_k, head_dim, False), kv_rotation(type_v, head_dim, True)
        self.positions = torch.arange(k.shape[1], device=k.device)
        # each sequence's views, made once: a decode step asks for one per layer (indexing costs ~10 us)
        self._slots = [(k[i], v[i]) for i in range(k.shape[0])]

    def slot(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._slots[seq]

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k, self.v

    def store(
        self, seqs: int | torch.Tensor, positions: slice | torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write float keys and values (..., H_kv, D) at [seqs, positions], encoded in the cache's types."""
        self.k[seqs, positions] = (
            k if self.type_k.dtype is torch.float32 else kv_encode(k, self.type_k, self.rot_k)
        )
        self.v[seqs, positions] = (
            v if self.type_v.dtype is torch.float32 else kv_encode(v, self.type_v, self.rot_v)
        )

    def rows(self, seqs: int | torch.Tensor, positions: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at [seqs, positions] as float32 (..., H_kv, D): views of an f32 cache, else decoded
        (only the rows asked for)."""
        k, v = self.k[seqs, positions], self.v[seqs, positions]
        return (
            k if self.type_k.dtype is torch.float32 else kv_decode(k, self.rot_k),
            v if self.type_v.dtype is torch.float32 else kv_decode(v, self.rot_v),
        )

    def update(
        self, seq: int, pos: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = pos + k.shape[0]
        self.store(seq, slice(pos, end), k, v)
        return self.rows(seq, slice(0, end))

    def read_rows(self, seq: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions start..end-1 of sequence seq as float32 copies (end - start, H_kv, D),
        decoded from the cache's types."""
        k, v = self.rows(seq, slice(start, end))
        return k.float().clone(), v.float().clone()

    def write_rows(self, seq: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store float keys and values (T, H_kv, D) at positions pos..pos+T-1 of sequence seq, encoded in the
        cache's types (a shifted typed cache re-encodes its moved rows, as llama.cpp's K-shift does)."""
        self.store(seq, slice(pos, pos + k.shape[0]), k, v)

    def update_batch(
        self, seqs: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seqs, positions = seqs.to(self.k.device), positions.to(self.k.device)
        self.store(seqs, positions, k, v)
        length = int(positions.max()) + 1
        mask = self.positions[:length][None, :] <= positions[:, None]  # (B, L)
        # positions past a sequence's end may never have been written (empty memory): zero them so that a
        # masked-out NaN cannot leak through 0 * NaN in the weighted sum
        hidden = ~mask[:, :, None, None]
        keys, values = self.rows(seqs, slice(0, length))
        return keys.masked_fill(hidden, 0.0), values.masked_fill(hidden, 0.0), mask


def kv_report(kv: KVCache, n_layer: int, n_embd_gqa: int) -> str:
    """The load report's line on the cache (llama.cpp's llama_kv_cache line): its bytes, those of keys and values."""
    tk, tv = kv.type_k, kv.type_v
    k_bytes = sum(view.k.nbytes for view in kv.layers)
    v_bytes = sum(view.v.nbytes for view in kv.layers)
    return (
        f"KV cache: {(k_bytes + v_bytes) / 2**20:.2f} MiB ({kv.n_ctx} cells, {n_layer} layers, {kv.n_seq} seqs, "
        f"{n_embd_gqa} K/V features), K ({tk.name}): {k_bytes / 2**20:.2f} MiB, V ({tv.name}): "
        f"{v_bytes / 2**20:.2f} MiB"
    )


class KVCache:
    """KV cache of n_seq independent sequences (slots), sized once from the config and the context length."""

    def __init__(
        self,
        n_layer: int,
        n_ctx: int,
        n_head_kv: int,
        head_dim: int,
        n_seq: int = 1,
        type_k: str = DEFAULT_KV_TYPE,
        type_v: str = DEFAULT_KV_TYPE,
        devices: Sequence[torch.device] | None = None,
        zeroed: Sequence[bool] | None = None,
    ) -> None:
        """type_k, type_v: the cache types of keys and values (ops.kv_types.KV_TYPES; ValueError for another name or
        a head size the type cannot store); devices: each layer's (default the CPU); zeroed: the layers whose rows
        start at 0 (a device span's attention reads every row, masking the unwritten ones: they must be finite)."""
        self.n_ctx = n_ctx
        self.n_seq = n_seq
        self.n_past = [0] * n_seq
        self.type_k, self.type_v = kv_type(type_k), kv_type(type_v)
        for t in (self.type_k, self.type_v):
            why = t.fits(head_dim)
            if why is not None:
                raise ValueError(why)
        devices = devices or [torch.device("cpu")] * n_layer
        zeroed = zeroed or [False] * len(devices)

        def rows(t: KVType, device: torch.device, zero: bool) -> torch.Tensor:
            # empty where attention reads written positions only: pages are committed as positions fill
            make = torch.zeros if zero else torch.empty
            shape = (n_seq, *t.shape(n_ctx, n_head_kv, head_dim))
            return make(shape, dtype=t.dtype or torch.uint8, device=device)

        self.layers = [
            KVLayerView(rows(self.type_k, d, z), rows(self.type_v, d, z), self.type_k, self.type_v)
            for d, z in zip(devices, zeroed, strict=True)
        ]

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
        """The first n positions of sequence seq: keys and values (n_layer, n, H_kv, D) float32 on the CPU (decoded:
        written back by write_slot, a typed cache gets the same bytes)."""
        rows = [view.rows(seq, slice(0, n)) for view in self.layers]
        keys = torch.stack([k.cpu() for k, _ in rows])
        values = torch.stack([v.cpu() for _, v in rows])
        return keys, values

    def write_slot(self, seq: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make sequence seq hold keys and values (n_layer, n, H_kv, D), as read_slot returns them."""
        n = keys.shape[1]
        for view, k, v in zip(self.layers, keys, values, strict=True):
            view.store(
                seq, slice(0, n), k.to(view.k.device, torch.float32), v.to(view.v.device, torch.float32)
            )
        self.n_past[seq] = n
