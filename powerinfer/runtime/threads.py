"""ThreadGovernor: fewer kernel threads while the CPU cores are shared with other busy processes.

The kernels' OpenMP regions end in barriers, and their threads spin there. When another CPU-bound process
shares the cores, the scheduler takes a core from one of our threads for a whole time slice and every region
waits for it: on a 2-core machine with one competing process, -t 2 decoded at 29 tok/s against 62 at -t 1
(docs/benchmarks.md, "Shared cores"). Such a stall shows in the thread that runs the steps: it gets less CPU time than
wall time (our threads never sleep inside a step). So after each step the governor adds up both, and once a
window of WINDOW_S seconds is full:
- if the calling thread had less than LOW_SHARE of the wall time in LOW_WINDOWS windows in a row, the kernels run
  fewer threads from the next step on (about the share of the cores they got, at least one less);
- at fewer threads than the context's n_threads it tries all of them again after PROBE_S seconds; a probe
  that finds the cores still shared (one low window) doubles the wait (up to PROBE_MAX_S), one that finds them
  free restores the first wait.
A quiet machine sees shares of 0.97-1.0 and never leaves n_threads. One low window alone is not a busy process:
on the quiet 2-core VM a single window of 0.74 now and then (the host's) dropped a benchmark's engine to one
thread, and since its runs came less than FRESH_S apart it stayed there until the probe, 2 s then: its -t 2 runs
fell to the -t 1 rate for seconds at a time, the "bimodal -t 2 series" of docs/sparsity.md. Front ends that wait inside a step (a
CUDA pool, pipeline stages receiving from other ranks) do not use it.

A window is judged only after steps ran, so a prompt (one step) and the first decode steps would be unprotected
(measured on the 2-core VM with two busy loops beside it: the first 5-token prompt of a fresh engine 0.09-1.3 s at
-t 2 against 35-79 ms at -t 1). So a step that starts fresh (the first one, or FRESH_S after the last ended) looks
at the load first: with k other runnable tasks (Linux /proc/loadavg; the fewest of LOAD_SAMPLES samples a
millisecond apart) on c usable cores it starts at max(1, c - k) threads (at most n_threads); a quiet machine starts
at n_threads again.

torch's own thread pool (its ops inside a step: prompt attention, norms) is process-global, so an engine never
sets it for good: `torch_threads` sets it to the engine's current count for the length of one step (or of a
pipeline rank's serving loop) and puts the caller's back afterwards. Two engines of one process with different
-t each run their steps at their own count, and a program that embeds one keeps its own torch setting.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from powerinfer.ops import KernelContext

log = logging.getLogger(__name__)

WINDOW_S = 0.05  # steps are judged over at least this much wall time
LOW_SHARE = 0.8  # CPU time / wall time of the stepping thread below this: the cores are shared
LOW_WINDOWS = 2  # low windows in a row that lower the count (a probe's one low window lowers it again)
PROBE_S = 2.0  # first wait before trying all threads again
PROBE_MAX_S = 32.0
FRESH_S = 0.5  # a step starting this long after the last one ended looks at the load first
# that look takes the fewest other runnable tasks of a few samples this far apart: a kernel thread or a short task
# runnable at one instant is not a busy process (on the quiet 2-core VM single samples saw "1 other" often enough to
# run benchmark steps at -t 2 on one thread; a busy process is runnable in every sample)
LOAD_SAMPLES = 3
LOAD_SAMPLE_GAP_S = 0.001


def runnable_others() -> int | None:
    """Tasks of other processes runnable now (Linux: /proc/loadavg's running count less this process's running
    threads); None elsewhere. This process's own threads are left out: for a few ms after a region the kernels'
    OpenMP threads spin, runnable, and a step starting then (an engine stepped right after another engine of the
    same process, as the benchmarks alternate them) counted them as another process and ran at one thread."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0, running - own_running_threads())


def own_running_threads() -> int:
    """This process's threads in state R (the calling thread included; at least 1): /proc/self/task/*/stat."""
    n = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        end = stat.rfind(")")
        if end >= 0 and stat[end + 2 : end + 3] == "R":
            n += 1
    return max(1, n)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's thread count set to n inside the block, the caller's restored after it (no call when equal)."""
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class ThreadGovernor:
    kc: KernelContext
    wall: float = 0.0
    cpu: float = 0.0
    probe_wait: float = PROBE_S
    changed_at: float = 0.0
    probing: bool = False
    low: int = 0  # low windows in a row so far
    # the step being timed: (perf_counter, thread_time) at its start
    _start: tuple[float, float] | None = None
    _last_end: float | None = None  # perf_counter when the last step ended
    load: Callable[[], int | None] = field(default=runnable_others, repr=False)  # other runnable tasks
    cores: Callable[[], int] = field(default=usable_cores, repr=False)

    @property
    def n_max(self) -> int:
        return self.kc.n_threads

    def begin(self) -> None:
        now = time.perf_counter()
        if self._last_end is None or now - self._last_end >= FRESH_S:
            self.check_load(now)
        self._start = (now, time.thread_time())

    def check_load(self, now: float) -> None:
        """Before a fresh step: as many threads as the cores the other runnable tasks leave (at least one)."""
        others = self.load()
        for _ in range(LOAD_SAMPLES - 1):
            if not others:  # None (no /proc) or 0: nothing to confirm
                break
            time.sleep(LOAD_SAMPLE_GAP_S)
            again = self.load()
            others = None if again is None else min(others, again)
        if others is None:
            return
        n = max(1, min(self.n_max, self.cores() - others))
        if n != self.kc.threads.n:
            self._set(n, now, f"{others} other runnable tasks")
        self.probing = False
        self.probe_wait = PROBE_S
        self.low = 0
        self.wall = self.cpu = 0.0

    def end(self) -> None:
        if self._start is None:
            return
        now, cpu = time.perf_counter(), time.thread_time()
        self._last_end = now
        self.wall += now - self._start[0]
        self.cpu += cpu - self._start[1]
        self._start = None
        if self.wall >= WINDOW_S:
            self.judge(self.cpu / self.wall, now)
            self.wall = self.cpu = 0.0

    def judge(self, share: float, now: float) -> None:
        """One full window: `share` = CPU time / wall time of the stepping thread over it."""
        cell = self.kc.threads
        n = cell.n
        low = share < LOW_SHARE
        self.low = self.low + 1 if low else 0
        if low:  # one low window alone may be a transient: a busy process shows in the next one too
            if n > 1 and (self.probing or self.low >= LOW_WINDOWS):
                if self.probing:  # all threads were tried again and the cores are still shared
                    self.probe_wait = min(self.probe_wait * 2, PROBE_MAX_S)
                self._set(max(1, min(n - 1, int(share * n))), now, f"CPU share {share:.2f}")
                self.probing = False
                self.low = 0
        elif self.probing:
            self.probing = False
            self.probe_wait = PROBE_S
            log.info("threads: %d (the cores are free again)", n)
        elif n < self.n_max and now - self.changed_at >= self.probe_wait:
            self._set(self.n_max, now, "probe")
            self.probing = True

    def _set(self, n: int, now: float, why: str) -> None:
        self.kc.threads.n = n  # torch's ops follow it: the engine's steps run under torch_threads(threads.n)
        self.changed_at = now
        log.debug("threads: %d (%s)", n, why)
