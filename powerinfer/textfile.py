"""Text and files given by users: text files read bounded, UTF-8 or one clear error (prompts, texts to score,
corpora), prompt escapes, output paths checked before any work."""

from __future__ import annotations

from pathlib import Path

from powerinfer.errors import InputError
from powerinfer.printable import printable

# prompt and text files past this are refused (so -f /dev/zero ends instead of eating memory)
MAX_TEXT_BYTES = 1 << 30
# a prompt (main's -f / -p) past this is refused before tokenizing: 16 MiB is millions of tokens, past any context,
# and a 200 MB prompt aborted the process inside the tokenizer library
MAX_PROMPT_BYTES = 1 << 24


def read_text_file(path: Path, what: str, *, limit: int = MAX_TEXT_BYTES) -> str:
    """A UTF-8 text file (prompt, text to score); InputError naming `what` and the path when it is missing, a
    folder, unreadable, larger than `limit` bytes or not UTF-8. Pipes (`-f <(cmd)`) are read like files."""
    name = printable(str(path))
    chunks: list[bytes] = []
    size = 0
    try:
        with open(path, "rb") as f:
            while size <= limit and (chunk := f.read(1 << 20)):
                chunks.append(chunk)
                size += len(chunk)
    except FileNotFoundError:
        raise InputError(f"cannot read {what} {name}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"cannot read {what} {name}: it is a folder") from None
    except OSError as e:
        raise InputError(f"cannot read {what} {name}: {e.strerror or e}") from None
    if size > limit:
        raise InputError(f"{what} {name} is larger than {limit >> 20} MiB")
    data = b"".join(chunks)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"{what} {name} is not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None


def check_output_file(path: Path, what: str = "") -> None:
    """Refuse, before any work, an output file whose folder is missing or whose path holds something other
    than a regular file (a FIFO or device is never replaced)."""
    from powerinfer.gguf.writer import output_problem

    problem = output_problem(path)
    if problem is not None:
        raise InputError(f"cannot write {what + ' ' if what else ''}{printable(str(path))}: {problem}")


_ESCAPES = {
    "n": b"\n",
    "r": b"\r",
    "t": b"\t",
    "'": b"'",
    '"': b'"',
    "\\": b"\\",
    "a": b"\a",
    "b": b"\b",
    "f": b"\f",
    "v": b"\v",
    "?": b"?",
}
_HEX = frozenset(b"0123456789abcdefABCDEF")


def process_escapes(text: str) -> str:
    """Turn \\n, \\t, \\xNN ... into what they name, on bytes as llama.cpp's -e does (so \\xc3\\xa9 is é).

    Other escapes stay as written. Raises InputError for a \\x without two hex digits after it and for
    escapes that leave invalid UTF-8."""
    data = text.encode("utf-8", errors="surrogateescape")
    out = bytearray()
    i, n = 0, len(data)
    while i < n:
        if data[i] != 0x5C or i + 1 == n:  # not a backslash, or a lone one at the end
            out.append(data[i])
            i += 1
            continue
        kind = chr(data[i + 1])
        if kind == "x":
            digits = data[i + 2 : i + 4]
            if len(digits) < 2 or not set(digits) <= _HEX:
                raise InputError(
                    f"-e: \\x at byte {i} of the prompt needs two hex digits after it (\\x41 = 'A')"
                )
            out.append(int(digits, 16))
            i += 4
        elif kind in _ESCAPES:
            out += _ESCAPES[kind]
            i += 2
        else:
            out += data[i : i + 2]
            i += 2
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"-e: the prompt is not valid UTF-8 after escape processing "
            f"(byte 0x{out[e.start]:02x} at offset {e.start})"
        ) from None
