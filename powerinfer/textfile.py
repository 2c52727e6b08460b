"""Reading text files given by users (prompts, texts to score, corpora): bounded, UTF-8 or one clear error."""

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
