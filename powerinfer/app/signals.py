"""Signals as exceptions: SIGTERM and SIGHUP end a run like Ctrl-C (every cleanup runs, one line, exit code
128 + signum), and no signal is lost to code that swallows its exception. The CLI installs the handlers; the
interactive loop takes part (a Ctrl-C it acts on is forgotten)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM / SIGHUP, so that every `finally` and `except BaseException`
    cleanup (temp files, temp folders, thread pools) runs as for Ctrl-C; the CLI exits with 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_pending: list[int] = []  # signals received and not yet reported (see raise_pending_signal)


_deferring: list[bool] = []  # non-empty while deferred_signals() holds the signals back


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _pending.append(signum)
    if _deferring:  # recorded only: raised when deferred_signals() ends
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
    raise Terminated(signum)


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP raise Terminated instead of killing the process without cleanup; SIGINT raises
    KeyboardInterrupt as usual. Each is also recorded, because code that swallows the exception (seen now and
    then while numpy and torch import) must not swallow the signal: `raise_pending_signal` raises it again.
    Only default dispositions are replaced (nohup's ignored SIGHUP stays ignored)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_signal)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _on_signal)


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP back (recorded, not raised) while the block runs, then raise the first one.
    For the imports of numpy and torch: an exception raised inside a C extension's initialisation leaves the module
    half made ("cannot load module more than once per process" at the next import, a traceback instead of one
    line); the imports take a second or two, after which the signal is reported as usual."""
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()
    raise_pending_signal()


def raise_pending_signal() -> None:
    """Raise the interrupt of a signal that arrived but whose exception something swallowed."""
    if _pending:
        signum = _pending[0]
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)


def interrupt_handled() -> None:
    """A Ctrl-C was caught and acted on (interactive `main` interjects): forget it, so that it is not raised
    again at exit; other signals stay recorded."""
    _pending[:] = [s for s in _pending if s != signal.SIGINT]


def exit_code_of_interrupt(e: KeyboardInterrupt) -> int:
    """Print the one line of an interrupt ("interrupted" / "terminated") and return its exit code."""
    _pending.clear()
    if isinstance(e, Terminated):
        sys.stderr.write("terminated\n")
        code = 128 + e.signum
    else:
        sys.stderr.write("interrupted\n")
        code = 130
    sys.stderr.flush()
    return code
