"""One escaping helper for every string that comes from a file or a client before it is printed."""

from __future__ import annotations

MAX_CHARS = 200  # an error line stays well under 500 bytes


def printable(value: object, limit: int = MAX_CHARS) -> str:
    """`value` as text with control characters (C0, DEL, C1) and lone surrogates escaped, cut to `limit`
    characters (the cut marked with "...")."""
    text = value if isinstance(value, str) else repr(value)
    out: list[str] = []
    n = 0
    for ch in text:
        code = ord(ch)
        if code < 0x20 or code == 0x7F or 0x80 <= code < 0xA0 or 0xD800 <= code < 0xE000:
            piece = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(ch) or (
                f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
            )
        elif ch == "\\":
            piece = "\\\\"
        else:
            piece = ch
        if n + len(piece) > limit:
            out.append("...")
            break
        out.append(piece)
        n += len(piece)
    return "".join(out)
