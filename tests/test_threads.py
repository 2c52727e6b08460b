"""The thread governor's decisions (runtime.threads), fed CPU shares directly: no timing in tests."""

from __future__ import annotations

import pytest
import torch

from powerinfer.ops import KernelContext
from powerinfer.runtime import threads as th
from powerinfer.runtime.threads import ThreadGovernor


@pytest.fixture
def keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_context_shares_its_thread_cell() -> None:
    kc = KernelContext(n_threads=2)
    assert kc.threads_now == 2
    assert kc.exact.threads is kc.threads or kc.act_precision == "f32"
    q8 = kc.replace(act_precision="q8")
    assert q8.threads is kc.threads  # the fused and the exact kernels follow one governor
    assert kc.replace(n_threads=1).threads is not kc.threads
    kc.threads.n = 1
    assert q8.threads_now == 1 and q8.n_threads == 2 and q8 == kc.replace(act_precision="q8")


def test_governor_drops_probes_and_backs_off(keep_torch_threads) -> None:
    kc = KernelContext(n_threads=2)
    before = torch.get_num_threads()
    g = ThreadGovernor(kc)
    g.judge(0.99, 0.0)  # a quiet machine: nothing changes
    assert kc.threads_now == 2
    g.judge(0.66, 0.95)  # 3 busy threads on 2 cores: each gets two thirds; one window could be a transient
    assert kc.threads_now == 2
    g.judge(0.66, 1.0)  # the next one too: a busy process
    assert kc.threads_now == 1 and torch.get_num_threads() == before  # torch's pool: the steps' business
    g.judge(1.0, 1.0 + th.PROBE_S / 2)  # too early to try again
    assert kc.threads_now == 1
    g.judge(1.0, 1.0 + th.PROBE_S)  # the probe
    assert kc.threads_now == 2 and g.probing
    g.judge(0.6, 1.2 + th.PROBE_S)  # still shared: back to one, the next probe waits twice as long
    assert kc.threads_now == 1 and g.probe_wait == 2 * th.PROBE_S
    t = 1.2 + th.PROBE_S
    g.judge(1.0, t + th.PROBE_S)
    assert kc.threads_now == 1
    g.judge(1.0, t + 2 * th.PROBE_S)
    assert kc.threads_now == 2
    g.judge(0.98, t + 2 * th.PROBE_S + 0.1)  # free again: stays, and the wait is reset
    assert kc.threads_now == 2 and g.probe_wait == th.PROBE_S and not g.probing


def test_governor_steps_down_by_the_share(keep_torch_threads) -> None:
    kc = KernelContext(n_threads=8)
    g = ThreadGovernor(kc)
    g.judge(0.5, 0.0)
    g.judge(0.5, 0.05)
    assert kc.threads_now == 4
    g.judge(0.79, 0.1)
    g.judge(0.79, 0.15)  # at least one less each time
    assert kc.threads_now == 3
    for _ in range(5):
        g.judge(0.1, 0.2)
    assert kc.threads_now == 1  # never below one


def test_one_low_window_is_not_a_busy_process(keep_torch_threads) -> None:
    """A single low window between quiet ones (the VM host's: 0.74 once in ~30 runs of a -t 2 benchmark) keeps
    every thread; two in a row lower the count."""
    kc = KernelContext(n_threads=2)
    g = ThreadGovernor(kc)
    for i in range(20):
        g.judge(0.74 if i % 3 == 0 else 0.99, 0.05 * i)
        assert kc.threads_now == 2
    g.judge(0.74, 1.0)
    g.judge(0.7, 1.05)
    assert kc.threads_now == 1


def test_backoff_is_capped(keep_torch_threads) -> None:
    kc = KernelContext(n_threads=2)
    g = ThreadGovernor(kc)
    now = 0.0
    g.judge(0.5, now)
    g.judge(0.5, now)
    for _ in range(10):
        now += g.probe_wait
        g.judge(1.0, now)
        assert g.probing
        g.judge(0.5, now)
    assert g.probe_wait == th.PROBE_MAX_S


def test_engine_governs_unless_fixed(tmp_path, keep_torch_threads) -> None:
    from conftest import random_llama_state, write_llama_gguf
    from typer.testing import CliRunner

    import powerinfer.app.main as app_main
    from powerinfer.cli import app
    from powerinfer.runtime.engine import Engine, EngineOptions

    path = write_llama_gguf(tmp_path / "tiny.gguf", random_llama_state(n_head_kv=2), n_head=4, n_head_kv=2)
    torch.set_num_threads(3)
    caller = torch.get_num_threads()
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=32, n_threads=2))
    assert engine.governor is not None and engine.governor.kc is engine.kc
    before = engine.step([0, 0, 0], [1, 2, 3], [0, 1, 2])
    engine.governor.judge(0.5, 0.0)  # as if the cores were shared: one thread, the same logits
    engine.governor.judge(0.5, 0.05)
    assert engine.kc.threads_now == 1
    engine.reset()
    inside = []
    forward = engine.model.forward

    def recording(*args, **kwargs):
        inside.append(torch.get_num_threads())
        return forward(*args, **kwargs)

    engine.model.forward = recording
    engine.governor.load = lambda: None  # no look at the machine's load that could raise the count again
    assert torch.equal(engine.step([0, 0, 0], [1, 2, 3], [0, 1, 2]), before)
    assert (
        inside == [1] and torch.get_num_threads() == caller
    )  # torch at the engine's count, in its step only
    del engine.model.forward
    assert (
        Engine(path, EngineOptions(act_precision="f32", n_ctx=32, n_threads=2, fixed_threads=True)).governor
        is None
    )
    assert torch.get_num_threads() == caller  # building and stepping engines left the caller's setting
    assert (
        Engine(path, EngineOptions(act_precision="f32", n_ctx=32, n_threads=1)).governor is None
    )  # nothing to lower

    seen = []

    class Stop(Exception):
        pass

    def engine_of(path, options):
        seen.append(options.fixed_threads)
        raise Stop

    mp = pytest.MonkeyPatch()
    mp.setattr(app_main, "Engine", engine_of)
    try:
        runner = CliRunner()
        for extra in ([], ["--fixed-threads"]):
            runner.invoke(app, ["main", "-m", str(path), "-p", "hi", "-n", "1", *extra])
    finally:
        mp.undo()
    assert seen == [False, True]


def test_torch_threads_is_scoped(keep_torch_threads) -> None:
    """torch's process-global count is the engine's only inside its step, whatever the engine's count."""
    torch.set_num_threads(3)
    seen = []
    for n in (1, 3, 2):
        with th.torch_threads(n):
            seen.append(torch.get_num_threads())
        assert torch.get_num_threads() == 3
    with pytest.raises(RuntimeError), th.torch_threads(1):
        raise RuntimeError
    assert seen == [1, 3, 2] and torch.get_num_threads() == 3


def test_a_fresh_step_looks_at_the_load_first(keep_torch_threads) -> None:
    """The first step (and one after FRESH_S idle) starts at the threads the other runnable tasks leave: a prompt
    is one step, judged only after it ran."""
    kc = KernelContext(n_threads=2)
    others = [2]
    gov = ThreadGovernor(kc, load=lambda: others[0], cores=lambda: 2)
    gov.begin()
    assert kc.threads_now == 1  # two busy tasks on two cores: one thread
    gov.end()
    gov.begin()  # right after: no second look
    gov.end()
    assert kc.threads_now == 1
    others[0] = 0
    gov._last_end -= th.FRESH_S  # idle since
    gov.begin()
    assert kc.threads_now == 2  # quiet again: all threads
    gov.end()
    others[0] = 1
    gov._last_end -= th.FRESH_S
    gov.begin()
    assert kc.threads_now == 1
    gov.end()
    assert th.runnable_others() is None or th.runnable_others() >= 0


def test_a_task_runnable_for_an_instant_is_not_a_busy_process(keep_torch_threads) -> None:
    """The fresh step's look takes the fewest other runnable tasks of LOAD_SAMPLES samples: one seen in the first
    sample only (a kernel thread waking) leaves every thread; one seen in every sample takes a core."""
    kc = KernelContext(n_threads=2)
    seen = iter([1, 0, 1])
    gov = ThreadGovernor(kc, load=lambda: next(seen), cores=lambda: 2)
    gov.begin()
    assert kc.threads_now == 2
    gov.end()
    gov._last_end -= th.FRESH_S
    gov.load = lambda: 1
    gov.begin()
    assert kc.threads_now == 1
    gov.end()


@pytest.mark.skipif(th.runnable_others() is None, reason="needs Linux /proc")
def test_own_spinning_threads_are_not_other_tasks() -> None:
    """A thread of this process that is running (here one in a long torch product, which releases the GIL; as the
    kernels' OpenMP threads spin for a few ms after each region) is counted among this process's running threads,
    which runnable_others leaves out of the machine's running count: an engine stepped right after another one
    of the same process saw its spinning threads as a busy process and ran at one thread."""
    import threading

    stop = threading.Event()
    a = torch.randn(600, 600)

    def spin() -> None:
        while not stop.is_set():
            a @ a

    worker = threading.Thread(target=spin)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    worker.start()
    try:
        seen = max(th.own_running_threads() for _ in range(200))
    finally:
        stop.set()
        worker.join()
        torch.set_num_threads(previous)
    assert seen >= 2  # the caller and the worker
