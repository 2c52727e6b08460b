"""The error edge of the CLI and what its commands share besides options (see options.py): logging setup,
one-line errors, progress bars.

Everything a user types is checked at the edge, with one InputError line per mistake. This module stays light to
import (no torch): the entry point imports it before the commands.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from powerinfer.app.console import err_console, resolve_model  # noqa: F401 - for the commands
from powerinfer.app.signals import exit_code_of_interrupt, raise_pending_signal
from powerinfer.errors import InputError, PowerInferError
from powerinfer.printable import printable

if TYPE_CHECKING:
    pass

T = TypeVar("T")


def utf8_argument(text: str, what: str) -> str:
    """`text` from the command line, refused with InputError when its bytes were not UTF-8 (Python hands them
    over as lone surrogates, which the tokenizer cannot take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raw = text.encode("utf-8", errors="surrogateescape")
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{what} is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
        raise InputError(f"{what} is not UTF-8") from None  # surrogates typed as such
    return text


def setup_logging(disabled: bool) -> None:
    level = logging.CRITICAL + 1 if disabled else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname).1s %(name)s: %(message)s"))
    logging.basicConfig(level=level, force=True, handlers=[handler])


MAX_ERROR_BYTES = 480  # an error line (with "error: ") stays under 500 bytes


def one_line(message: str, limit: int = MAX_ERROR_BYTES) -> str:
    """`message` safe to print as one line: control characters and lone surrogates escaped (the messages
    already pass file-derived strings through printable(); this is the net for any that do not), cut to
    `limit` UTF-8 bytes."""
    out = []
    for ch in message:
        code = ord(ch)
        if code < 0x20 or code == 0x7F or 0x80 <= code < 0xA0 or 0xD800 <= code < 0xE000:
            out.append(
                {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(ch)
                or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
            )
        else:
            out.append(ch)
    text = "".join(out)
    raw = text.encode("utf-8")
    if len(raw) > limit:
        text = raw[: limit - 3].decode("utf-8", errors="ignore") + "..."
    return text


def print_error(message: str) -> None:
    """One `error: ...` line on plain stderr, never silenced by --log-disable."""
    sys.stderr.write(f"error: {one_line(message)}\n")
    sys.stderr.flush()


def run_guarded(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a command body; project errors become one line on stderr and exit code 1, Ctrl-C one line and 130,
    SIGTERM (see app.signals) one line and 143."""
    try:
        raise_pending_signal()
        return fn(*args, **kwargs)
    except PowerInferError as e:
        print_error(str(e))
        raise typer.Exit(code=1) from None
    except KeyboardInterrupt as e:
        raise typer.Exit(code=exit_code_of_interrupt(e)) from None
    except BrokenPipeError:
        sys.stderr.close()
        raise typer.Exit(code=0) from None
    except MemoryError:
        print_error("out of memory")
        raise typer.Exit(code=1) from None
    except OSError as e:  # the environment (disk full, permissions) rather than a bug: one line, no traceback
        where = f": {printable(str(e.filename))}" if e.filename else ""
        print_error(f"{e.strerror or e}{where}")
        raise typer.Exit(code=1) from None
