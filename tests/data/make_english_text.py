"""Regenerate python-reference-prose.txt: English prose paragraphs from Python's own documentation.

The source is `pydoc_data.topics` (the Python Language Reference text that `help()` shows; PSF documentation,
licensed under the PSF License Agreement / Zero-Clause BSD for the docs). Paragraphs are taken in sorted topic
order, code samples, headings, tables and lists are dropped, lines are re-flowed to one paragraph per line,
and the text stops before MAX_BYTES. The committed file was made with CPython 3.11.7:

    python tests/data/make_english_text.py > tests/data/python-reference-prose.txt
"""

from __future__ import annotations

import pydoc_data.topics
import re
import sys

MAX_BYTES = 100_000


def prose_paragraphs(text: str) -> list[str]:
    """Paragraphs of running English text: no indentation (code, lists), no headings, mostly letters."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if any(ln.startswith((" ", "\t", "*", "+", "|", ">>>", "...")) for ln in lines):
            continue
        if any(re.fullmatch(r"[=\-*~^\"'+]{3,}", ln.strip()) for ln in lines):
            continue
        para = " ".join(ln.strip() for ln in lines).strip()
        letters = sum(ch.isalpha() or ch == " " for ch in para)
        if len(para) < 160 or letters < 0.85 * len(para) or not para.endswith((".", ":")):
            continue
        out.append(para)
    return out


def main() -> None:
    parts: list[str] = []
    size = 0
    topics = pydoc_data.topics.topics
    for key in sorted(topics):
        for para in prose_paragraphs(topics[key]):
            n = len(para.encode("utf-8")) + 2
            if size + n > MAX_BYTES:
                sys.stdout.write("\n\n".join(parts) + "\n")
                return
            parts.append(para)
            size += n
    sys.stdout.write("\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
