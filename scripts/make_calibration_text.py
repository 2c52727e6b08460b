"""Regenerate powerinfer/data/calibration.txt: English prose for `powerinfer sparsify`'s default calibration.

The source is the docstrings of Python standard-library modules, their classes and functions (PSF License;
Python's documentation strings). It is a different text from tests/data/python-reference-prose.txt (the
Language Reference topics), which serves as the held-out evaluation text. Paragraphs of running English text
only (no code, tables or lists), one per line, stopping before MAX_BYTES. The committed file was made with
CPython 3.11.7:

    python scripts/make_calibration_text.py > powerinfer/data/calibration.txt
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys

MAX_BYTES = 60_000
MODULES = (
    "argparse", "asyncio", "bisect", "calendar", "collections", "concurrent.futures", "contextlib", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools", "gettext",
    "heapq", "http.client", "imaplib", "inspect", "ipaddress", "itertools", "json", "locale", "logging",
    "mailbox", "multiprocessing", "numbers", "optparse", "os", "pathlib", "pickle", "pprint", "queue",
    "random", "re", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "trace", "typing", "unittest", "urllib.parse", "urllib.request", "uuid", "warnings",
    "weakref", "zipfile",
)  # fmt: skip


def paragraphs(doc: str) -> list[str]:
    """Paragraphs of running text: no indented lines (code, lists), mostly letters, ending a sentence."""
    out = []
    for block in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        lines = block.split("\n")
        if any(ln.startswith((" ", "\t", "*", "-", "+", "|", ">>>", "...")) for ln in lines):
            continue
        para = " ".join(ln.strip() for ln in lines).strip()
        letters = sum(ch.isalpha() or ch == " " for ch in para)
        if len(para) < 120 or letters < 0.85 * len(para) or not para.endswith("."):
            continue
        out.append(para)
    return out


def docstrings(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    docs = [module.__doc__ or ""]
    for name in sorted(vars(module)):
        obj = getattr(module, name)
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            docs.append(obj.__doc__ or "")
    return docs


def main() -> None:
    seen: set[str] = set()
    size = 0
    for module_name in MODULES:
        for doc in docstrings(module_name):
            for para in paragraphs(doc):
                if para in seen:
                    continue
                seen.add(para)
                if size + len(para) + 1 > MAX_BYTES:
                    return
                sys.stdout.write(para + "\n")
                size += len(para) + 1


if __name__ == "__main__":
    main()
