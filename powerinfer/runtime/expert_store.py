"""The experts of a MoE file that does not fit in memory (--memory-limit): pinned ones, a bounded cache, the file.

`ExpertStore` carries out a `placement.memory.MemoryPlan`: the pinned experts are read into one anonymous buffer
at load; the others pass through `n_slots` cache slots, read from the model file when a step selects them (or
ahead, when a predictor names them) by background threads, with direct I/O (O_DIRECT: no page cache, so the
process's memory is what it allocated) where the file system allows it, else with buffered reads whose pages are
dropped after each read. Each layer has a table of where its experts' gate, up and down rows are (3, n_expert)
that the MoE kernels read (ops.moe_experts): 0 for an expert not resident, which the kernel refuses.

The cache policy: pinned experts never leave (the profile's frequencies); among the slots, the least recently
used one is taken, never one the current step uses or one being read. A step's Python work is one lookup per
distinct expert it selects that is not resident (a read each: I/O bound), and array operations otherwise.

Prefetch: a layer whose router reads the layer input (SmallThinker) routes before attention, and its experts are
read while attention runs; for the others the next layer's router applied to this layer's FFN input (rescaled by
the ratio of the two layers' FFN norm weights) predicts the next layer's experts, read while this layer's experts
compute (a training-free predictor; its accuracy is reported).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from powerinfer import ops
from powerinfer.errors import InputError
from powerinfer.gguf.constants import GGMLType
from powerinfer.model.moe import MoEFFN, route
from powerinfer.placement.memory import PAGE, MemoryPlan, slot_bytes

log = logging.getLogger(__name__)

IO_THREADS = 4
PINNED = -2
ABSENT = -1


@dataclass
class StoreStats:
    """Expert calls ((token, expert) pairs) by where they were served, and the reads behind them."""

    calls: int = 0
    pinned: int = 0
    cached: int = 0  # from a cache slot, already there
    prefetched: int = 0  # from a slot a prefetch filled (or was filling)
    disk: int = 0  # read on demand
    bytes_read: int = 0
    prefetch_issued: int = 0  # experts read ahead
    prefetch_used: int = 0  # of them, selected by the step they were read for

    @property
    def hit_rate(self) -> float:
        """Share of the non-pinned calls served without waiting for an on-demand read."""
        n = self.cached + self.prefetched + self.disk
        return (self.cached + self.prefetched) / n if n else 1.0

    @property
    def prefetch_accuracy(self) -> float | None:
        return self.prefetch_used / self.prefetch_issued if self.prefetch_issued else None


def _page_down(n: int) -> int:
    return n // PAGE * PAGE


def _page_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


@dataclass(frozen=True)
class LayerFiles:
    """Where a layer's stacked experts are in the file: per matrix (gate, up, down) the tensor's byte offset and
    one expert's bytes (expert e at offset + e * bytes)."""

    offsets: tuple[int, int, int]
    sizes: tuple[int, int, int]


@dataclass
class _Slot:
    owner: np.ndarray  # (n_slots,) key bid * n_expert + e, or -1
    tick: np.ndarray  # (n_slots,) last step that used it
    busy: np.ndarray  # (n_slots,) bool: a read in flight


class ExpertStore:
    """Pinned experts, cache slots and reads from the file for every MoE layer of one model."""

    def __init__(
        self, path: Path, layers: list[LayerFiles], n_expert: int, plan: MemoryPlan, direct: bool = True
    ) -> None:
        self.path, self.layers, self.n_expert, self.plan = path, layers, n_expert, plan
        self.stats = StoreStats()
        self.tables = [np.zeros((3, n_expert), dtype=np.int64) for _ in layers]
        self.where = np.full((len(layers), n_expert), ABSENT, dtype=np.int64)  # slot, PINNED or ABSENT
        self._tick = 0
        self._pending: dict[int, tuple[int, Future[int]]] = {}  # key -> (slot, read)
        self._prefetched = np.zeros((len(layers), n_expert), dtype=bool)  # read ahead, not yet selected
        self._fd, self.direct = self._open(path, direct)
        self._switch = threading.Lock()
        self._io = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="expert-io")
        self._slot_size = plan.slot_bytes
        n_slots = plan.n_slots
        self._slots = _Slot(
            np.full(n_slots, -1, dtype=np.int64),
            np.zeros(n_slots, dtype=np.int64),
            np.zeros(n_slots, dtype=bool),
        )
        pinned_size = sum(len(p) * slot_bytes(f.sizes) for p, f in zip(plan.pinned, layers, strict=True))
        self._pinned_buf = mmap.mmap(-1, max(PAGE, pinned_size))
        self._cache_buf = mmap.mmap(-1, max(PAGE, n_slots * self._slot_size))
        self._pinned_base = ctypes.addressof(ctypes.c_char.from_buffer(self._pinned_buf))
        self._cache_base = ctypes.addressof(ctypes.c_char.from_buffer(self._cache_buf))
        self._addrs: dict[int, list[int]] = {}  # slot -> its expert's row addresses (written by the read)
        self.predictors: list[Callable[[torch.Tensor], torch.Tensor | None] | None] = [None] * len(layers)
        self._load_pinned()

    @staticmethod
    def _open(path: Path, want_direct: bool) -> tuple[int, bool]:
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        direct = getattr(os, "O_DIRECT", 0) if want_direct else 0
        if direct:
            try:
                return os.open(path, flags | direct), True
            except OSError:
                pass  # a file system without direct I/O: buffered reads, pages dropped after each
        try:
            return os.open(path, flags), False
        except OSError as e:
            raise InputError(f"cannot open {path} for the experts: {e.strerror or e}") from None

    # -- reading -----------------------------------------------------------------------------------------------
    def _read_into(self, buf: mmap.mmap, base: int, at: int, bid: int, e: int) -> tuple[list[int], int]:
        """Expert e of layer bid into buf[at:] (page aligned): the addresses of its gate, up and down rows and the
        bytes read. A file system that refuses a direct read (EINVAL) gets buffered reads from then on."""
        fd = self._fd
        try:
            return self._read_fd(fd, buf, base, at, bid, e)
        except OSError as err:
            if err.errno != errno.EINVAL or not self.direct:
                raise
        with self._switch:
            if self._fd == fd:
                self._fd, self.direct = self._open(self.path, False)
                os.close(fd)
        return self._read_fd(self._fd, buf, base, at, bid, e)

    def _read_fd(
        self, fd: int, buf: mmap.mmap, base: int, at: int, bid: int, e: int
    ) -> tuple[list[int], int]:
        view = memoryview(buf)
        files = self.layers[bid]
        addrs, total = [], 0
        for off0, size in zip(files.offsets, files.sizes, strict=True):
            off = off0 + e * size
            first, end = _page_down(off), _page_up(off + size)
            n = end - first
            got = 0
            while got < n:
                r = os.preadv(fd, [view[at + got : at + n]], first + got)
                if r <= 0:
                    break
                got += r
            if got < off + size - first:
                raise OSError(f"short read of expert {e} of layer {bid} from {self.path}")
            if not self.direct:
                os.posix_fadvise(fd, first, n, os.POSIX_FADV_DONTNEED)
            addrs.append(base + at + (off - first))
            total += got
            at += _page_up(size + PAGE) + PAGE
        view.release()
        return addrs, total

    def _load_pinned(self) -> None:
        at = 0
        jobs = []
        for bid, ids in enumerate(self.plan.pinned):
            step = slot_bytes(self.layers[bid].sizes)
            for e in ids.tolist():
                jobs.append((bid, e, at))
                at += step

        def read(job: tuple[int, int, int]) -> tuple[int, int, list[int], int]:
            bid, e, at = job
            addrs, n = self._read_into(self._pinned_buf, self._pinned_base, at, bid, e)
            return bid, e, addrs, n

        for bid, e, addrs, _ in self._io.map(read, jobs):
            self.tables[bid][:, e] = addrs
            self.where[bid, e] = PINNED

    def _slot_read(self, slot: int, bid: int, e: int) -> int:
        addrs, n = self._read_into(self._cache_buf, self._cache_base, slot * self._slot_size, bid, e)
        self._addrs[slot] = addrs
        return n

    # -- slots -------------------------------------------------------------------------------------------------
    def _take_slot(self) -> int | None:
        """The least recently used slot no step is using now and no read is filling (its expert dropped)."""
        s = self._slots
        free = np.flatnonzero(s.owner < 0)
        if free.size:
            return int(free[0])
        ticks = np.where(s.busy | (s.tick >= self._tick), np.iinfo(np.int64).max, s.tick)
        slot = int(ticks.argmin())
        if ticks[slot] == np.iinfo(np.int64).max:
            return None
        key = int(s.owner[slot])
        bid, e = divmod(key, self.n_expert)
        self.where[bid, e] = ABSENT
        self.tables[bid][:, e] = 0
        self._prefetched[bid, e] = False
        s.owner[slot] = -1
        return slot

    def _start(self, bid: int, e: int) -> bool:
        """Begin reading expert e of layer bid into a slot; False when every slot is in use."""
        slot = self._take_slot()
        if slot is None:
            return False
        s = self._slots
        s.owner[slot], s.busy[slot], s.tick[slot] = bid * self.n_expert + e, True, self._tick
        self.where[bid, e] = slot
        self._pending[bid * self.n_expert + e] = (slot, self._io.submit(self._slot_read, slot, bid, e))
        return True

    def _finish(self, bid: int, e: int) -> None:
        slot, fut = self._pending.pop(bid * self.n_expert + e)
        try:
            self.stats.bytes_read += fut.result()
        finally:
            self._slots.busy[slot] = False
        self.tables[bid][:, e] = self._addrs[slot]

    # -- steps -------------------------------------------------------------------------------------------------
    def ensure(self, bid: int, ids: torch.Tensor) -> None:
        """Every expert `ids` selects in layer bid (-1: none) resident before the kernel reads them."""
        self._tick += 1
        flat = ids.reshape(-1).numpy()
        used, counts = np.unique(flat[flat >= 0], return_counts=True)
        where = self.where[bid, used]
        st = self.stats
        st.calls += int(counts.sum())
        st.pinned += int(counts[where == PINNED].sum())
        cached = where >= 0
        self._slots.tick[where[cached]] = self._tick
        was_prefetched = self._prefetched[bid, used]
        st.prefetch_used += int(was_prefetched.sum())
        self._prefetched[bid, used] = False
        busy = self._slots.busy
        pending = cached & busy[np.where(cached, where, 0)] if busy.size else cached  # a read in flight
        st.prefetched += int(counts[cached & (pending | was_prefetched)].sum())
        st.cached += int(counts[cached & ~pending & ~was_prefetched].sum())
        missing = used[where == ABSENT]
        st.disk += int(counts[where == ABSENT].sum())
        for e in missing.tolist():
            if not self._start(bid, e):
                raise RuntimeError("expert cache: no free slot (fewer slots than one layer's experts)")
        for e in used[pending].tolist() + missing.tolist():
            self._finish(bid, e)

    def prefetch(self, bid: int, ids: torch.Tensor) -> None:
        """Start reading the experts `ids` names in layer bid that are not resident (a prediction)."""
        if bid >= len(self.layers):
            return
        flat = ids.reshape(-1).numpy()
        want = np.unique(flat[flat >= 0])
        for e in want[self.where[bid, want] == ABSENT].tolist():
            if not self._start(bid, e):
                return
            self._prefetched[bid, e] = True
            self.stats.prefetch_issued += 1

    def predict_next(self, bid: int, x: torch.Tensor) -> None:
        """After layer bid's routing: predict layer bid + 1's experts from x and read them ahead."""
        predictor = self.predictors[bid]
        if predictor is not None:
            ids = predictor(x)
            if ids is not None:
                self.prefetch(bid + 1, ids)

    def close(self) -> None:
        for key in list(self._pending):
            bid, e = divmod(key, self.n_expert)
            try:
                self._finish(bid, e)
            except OSError:
                pass
        self._io.shutdown(wait=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def layer(self, bid: int) -> StoredExperts:
        return StoredExperts(self, bid)


def resident_bytes() -> int:
    """This process's resident memory now (/proc/self/statm), 0 where it cannot be read."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class NextRouter:
    """The predictor of the next layer's experts: its router on this layer's FFN input x (one token), rescaled by
    the ratio of the next layer's FFN norm weight to this one's, routed as the next layer routes."""

    def __init__(self, nxt: MoEFFN, ratio: torch.Tensor, kc: ops.KernelContext) -> None:
        self.ffn, self.ratio, self.kc = nxt, ratio, kc

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        if x.shape[0] != 1:
            return None  # a prompt step reads the experts it selects anyway
        logits = ops.linear(x * self.ratio, self.ffn.router, self.kc)
        return route(logits.to("cpu"), self.ffn.spec, self.kc)[0]


class TrainedRouter:
    """The predictor train-predictor fitted (profile.router_predictor): the next layer's router logits ~ x w^T + b,
    routed as the next layer routes (its top-k)."""

    def __init__(self, nxt: MoEFFN, w: np.ndarray, b: np.ndarray, kc: ops.KernelContext) -> None:
        # w as an F32 weight of the engine's own kernels (torch's matmul would map its BLAS libraries: pages a
        # memory limit counts)
        w = np.ascontiguousarray(w, dtype=np.float32)
        self.ffn, self.kc, self.b = nxt, kc, torch.from_numpy(np.ascontiguousarray(b, dtype=np.float32))
        self.w = ops.QWeight.from_numpy(w.view(np.uint8), GGMLType.F32, w.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        if x.shape[0] != 1:
            return None
        return route(ops.linear(x, self.w, self.kc).add_(self.b), self.ffn.spec, self.kc)[0]


@dataclass
class StoredExperts:
    """One layer's view of the store (model.moe.ExpertSource)."""

    store: ExpertStore
    bid: int
    table: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.table = self.store.tables[self.bid]

    def ensure(self, ids: torch.Tensor) -> None:
        self.store.ensure(self.bid, ids)

    def prefetch(self, ids: torch.Tensor) -> None:
        self.store.prefetch(self.bid, ids)

    def routed(self, x: torch.Tensor) -> None:
        self.store.predict_next(self.bid, x)
