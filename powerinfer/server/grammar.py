"""Structured output through xgrammar: JSON schemas, any JSON, and GBNF grammars to per-slot token masks.

Compiling runs in child processes (at most GRAMMAR_PROCESSES at once, each started on first need and kept for the
next request, which then finds xgrammar's cache of its earlier grammars), never on the event loop. xgrammar's
compile runs in C++ and cannot be interrupted, so a process is what can be stopped: the request waits for its
compile while watching its client, and when the client leaves, or the compile runs past GRAMMAR_TIMEOUT_S, the
process is killed at once (its CPU and memory come back; a later compile starts another) and the request ends
there. The same watch kills a compile whose process grows past its size before the compile by GRAMMAR_MEMORY_BYTES
of resident memory (a 400; the server's own memory is never at stake). A constraint that compiles there is
compiled again in the server, known now to finish within the bounds (xgrammar's compiled grammars cannot come
back from the process: serializing one can take far more memory than compiling it). Each request gets its own
matcher, used only by the worker thread: `mask` bans the tokens the grammar cannot take next (end-of-generation
tokens are allowed only where the grammar may end), `accept` advances it with the sampled token.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import logging
import os
import re
import struct
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import IO, Any

import torch

from powerinfer.printable import printable
from powerinfer.server.errors import ApiError
from powerinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Bounds on what a request may ask to compile: a GBNF grammar of 20,000 chained rules (~500 KB) ran past 120 s and
# 2.5 GB. Real grammars and schemas (llama.cpp's examples: json.gbnf 0.6 KB, c.gbnf 0.5 KB; OpenAI's structured
# output caps schemas at 100 properties and 5 levels) are far below these. Measured on SmolLM2's 49k vocabulary:
# 400 chained rules of bounded repetitions (14 KB) compile in 0.5 s, 500 alternatives in 0.15 s.
GRAMMAR_MAX_BYTES = 1 << 16  # a GBNF grammar's or a JSON schema's text
GRAMMAR_MAX_RULES = 512  # GBNF rules (`::=`)
SCHEMA_MAX_DEPTH = 32  # nesting of a JSON schema's objects and arrays
GRAMMAR_TIMEOUT_S = 30.0  # one compile, the process's start-up included
GRAMMAR_MEMORY_BYTES = 1 << 30  # resident memory one compile may add to its process (Linux: /proc)
GRAMMAR_PROCESSES = 2  # compiles at once; more requests wait for one (still watching their client)
_PAGE = 4096 if not hasattr(os, "sysconf") else os.sysconf("SC_PAGE_SIZE")
_POLL_S = 0.05  # how often a waiting request looks at its client, the clock and the process's memory

# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: "
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def compile_constraint(xgr: Any, compiler: Any, kind: str, source: Any) -> Any:
    """xgrammar's compile of one request's constraint (a schema as JSON text, tool calls as a list of them); the
    compile processes run this same function (its source is sent to them)."""
    if kind == "json":
        return compiler.compile_builtin_json_grammar()
    if kind == "json_schema":
        return compiler.compile_json_schema(source, any_whitespace=False)
    if kind == "tool_call":  # one `<tool_call>` whose JSON follows one of the schemas
        calls = [xgr.Grammar.from_json_schema(c, any_whitespace=False) for c in source]
        return compiler.compile_grammar(
            xgr.Grammar.concat(
                xgr.Grammar.from_ebnf('root ::= "<tool_call>"'),
                xgr.Grammar.union(*calls),
                xgr.Grammar.from_ebnf('root ::= "</tool_call>"'),
            )
        )
    return compiler.compile_grammar(source)


# A compile process: reads length-prefixed JSON requests on stdin, answers on stdout. The first request carries the
# tokenizer (xgrammar's serialized TokenizerInfo); it answers {"ready": true}. Then each {"kind", "source"} is
# compiled and answered with {"ok": true} or {"error": message}; EOF ends it. It compiles to try: a compiled grammar
# does not come back (its serialization can take far more memory than the compile), the server compiles it again
# once it is known to finish within the bounds.
_CHILD_MAIN = r"""
import json, struct, sys

def read():
    head = sys.stdin.buffer.read(4)
    if len(head) < 4:
        sys.exit(0)
    return json.loads(sys.stdin.buffer.read(struct.unpack(">I", head)[0]))

def write(obj):
    data = json.dumps(obj).encode()
    sys.stdout.buffer.write(struct.pack(">I", len(data)) + data)
    sys.stdout.buffer.flush()

import xgrammar as xgr  # before the tokenizer arrives: the server makes it meanwhile
hello = read()
compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(hello["tokenizer_info"]), max_threads=1)
write({"ready": True})
while True:
    req = read()
    try:
        compile_constraint(xgr, compiler, req["kind"], req["source"])
        write({"ok": True})
    except Exception as e:
        write({"error": " ".join(str(e).split()) or type(e).__name__})
"""


def _child_source() -> str:
    return "from typing import Any\n" + inspect.getsource(compile_constraint) + _CHILD_MAIN


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:
        raise ApiError(
            501,
            f"structured output needs the xgrammar package, which cannot be imported ({e}); "
            "install it with: pip install xgrammar",
            type="not_supported_error",
        ) from None
    return xgrammar


class GrammarMatcher:
    """The grammar state of one sequence (a powerinfer.server.slots.Constraint)."""

    def __init__(self, xgr: Any, compiled: Any, n_vocab: int) -> None:
        self.xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.n_vocab = n_vocab
        self.bitmask = xgr.allocate_token_bitmask(1, n_vocab)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        out = logits.float().clone()
        self.matcher.fill_next_token_bitmask(self.bitmask)
        self.xgr.apply_token_bitmask_inplace(out[None, :], self.bitmask, vocab_size=self.n_vocab)
        return out

    def accept(self, token: int) -> None:
        self.matcher.accept_token(token)


class _Gone(Exception):
    """The compile process ended (killed, or it died) before it answered."""


def _send(pipe: IO[bytes], obj: Any) -> None:
    data = json.dumps(obj).encode()
    pipe.write(struct.pack(">I", len(data)) + data)
    pipe.flush()


def _receive(pipe: IO[bytes]) -> Any:
    head = pipe.read(4)
    if len(head) < 4:
        raise _Gone
    n = struct.unpack(">I", head)[0]
    data = pipe.read(n)
    if len(data) < n:
        raise _Gone
    return json.loads(data)


class _Process:
    """One compile process. `ask` blocks (call it off the event loop); `kill` may come from any thread, also
    while the process is still starting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self.killed = False
        self.baseline: int | None = None  # resident bytes when the current compile was sent

    def start(self, hello: Callable[[], dict[str, Any]]) -> None:
        """Start the process, then send it hello() (made while the process imports xgrammar)."""
        with self._lock:
            if self.killed:
                raise _Gone
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", _child_source()],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                )
            except OSError:
                raise _Gone from None
        self.ask(hello(), watch=False)

    def ask(self, request: dict[str, Any], watch: bool = True) -> Any:
        """Send one request and wait for the answer; watch: record the resident size first (a compile)."""
        proc = self._proc
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise _Gone
        self.baseline = self.rss() if watch else None
        try:
            _send(proc.stdin, request)
            return _receive(proc.stdout)
        except (OSError, ValueError):
            raise _Gone from None

    def kill(self) -> None:
        with self._lock:
            self.killed = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def rss(self) -> int | None:
        """Resident bytes of the process now; None where it is gone or /proc cannot tell."""
        proc = self._proc
        try:
            with open(f"/proc/{proc.pid}/statm") as f:  # type: ignore[union-attr]
                return int(f.read().split()[1]) * _PAGE
        except (AttributeError, OSError, ValueError, IndexError):
            return None

    @property
    def alive(self) -> bool:
        return not self.killed and self._proc is not None and self._proc.poll() is None


class Grammars:
    """Compiles a request's constraint in a compile process; errors are 400s naming the request field."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        timeout_s: float = GRAMMAR_TIMEOUT_S,
        memory_bytes: int = GRAMMAR_MEMORY_BYTES,
    ) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self._info: Any = None  # xgrammar's TokenizerInfo, made once
        self._local: Any = None  # the compiler of the matchers the worker uses
        self._lock = threading.Lock()
        self._idle: list[_Process] = []
        self._busy: set[_Process] = set()
        self._slots = asyncio.Semaphore(GRAMMAR_PROCESSES)
        self.n_killed = 0  # compiles stopped: the client left, or the time or memory ran out

    def _compile_here(self, xgr: Any, kind: str, source: Any) -> Any:
        """Blocking: the server's own compile of a constraint a process compiled within the bounds."""
        info = self._tokenizer_info()
        with self._lock:
            if self._local is None:
                self._local = xgr.GrammarCompiler(info, max_threads=1)
        return compile_constraint(xgr, self._local, kind, source)

    def _tokenizer_info(self) -> Any:
        xgr = _xgrammar()
        with self._lock:
            if self._info is None:
                tok = self.tokenizer
                vocab = [tok.token_bytes(i) for i in range(tok.n_vocab)]
                self._info = xgr.TokenizerInfo(
                    vocab, xgr.VocabType.RAW, vocab_size=tok.n_vocab, stop_token_ids=sorted(tok.eog_ids)
                )
        return self._info

    @staticmethod
    def check_size(kind: str, source: Any, field: str) -> None:
        """400 for a constraint past the bounds above, before anything is compiled."""
        if kind == "json":
            return
        try:
            text = source if isinstance(source, str) else json.dumps(source)
        except (RecursionError, TypeError, ValueError):
            raise ApiError(400, f"{field} cannot be read back as JSON (too deep?)", param=field) from None
        if len(text.encode("utf-8", "surrogatepass")) > GRAMMAR_MAX_BYTES:
            raise ApiError(400, f"{field} is larger than {GRAMMAR_MAX_BYTES} bytes", param=field)
        if kind == "gbnf" and text.count("::=") > GRAMMAR_MAX_RULES:
            raise ApiError(400, f"{field} has more than {GRAMMAR_MAX_RULES} rules", param=field)
        depth = deepest = 0
        if kind != "gbnf":
            for ch in text:  # brackets inside strings count too: a bound, not a parser
                if ch in "[{":
                    depth += 1
                    deepest = max(deepest, depth)
                elif ch in "]}":
                    depth -= 1
            if deepest > SCHEMA_MAX_DEPTH:
                raise ApiError(400, f"{field} nests deeper than {SCHEMA_MAX_DEPTH} levels", param=field)

    @staticmethod
    def _request(kind: str, source: Any, field: str) -> dict[str, Any]:
        """What the compile process gets: schemas as JSON text (400 for one that is not an object)."""
        if kind == "json_schema":
            try:
                schema = json.loads(source) if isinstance(source, str) else source
            except ValueError as e:
                raise ApiError(400, f"invalid {field}: {printable(str(e))}", param=field) from None
            if not isinstance(schema, dict):
                raise ApiError(400, f"invalid {field}: a JSON schema must be an object", param=field)
            source = json.dumps(schema)
        elif kind == "tool_call":  # source: one JSON schema per allowed call
            source = [json.dumps(c) for c in source]
        return {"kind": kind, "source": source}

    def _run(self, process: _Process, fresh: bool, request: dict[str, Any]) -> Any:
        """Blocking: start the process when it is new, then one compile; _Gone when it was killed or died."""
        if fresh:
            process.start(lambda: {"tokenizer_info": self._tokenizer_info().serialize_json()})
        return process.ask(request)

    async def compile(
        self,
        kind: str,
        source: Any,
        field: str,
        client_gone: Callable[[], Awaitable[bool]] | None = None,
    ) -> GrammarMatcher:
        """A matcher for `kind`: "json" (any JSON object), "json_schema" (a schema, dict or JSON text) or
        "gbnf" (llama.cpp's grammar format, root rule `root`) or "tool_call" (one `<tool_call>` whose JSON
        follows one of the schemas in `source`). client_gone: polled while the compile runs; when it says so
        the compile is killed and the request ends (499)."""
        self.check_size(kind, source, field)
        if importlib.util.find_spec("xgrammar") is None:
            _xgrammar()  # the 501 naming the package
        imported = asyncio.ensure_future(
            asyncio.to_thread(_xgrammar)
        )  # seconds the first time: meanwhile the
        imported.add_done_callback(
            lambda f: f.cancelled() or f.exception()
        )  # process starts (see _Process.start)
        request = self._request(kind, source, field)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        async with self._slots:
            with self._lock:
                process = self._idle.pop() if self._idle else None
                fresh = process is None
                process = process or _Process()
                self._busy.add(process)
            task = asyncio.ensure_future(asyncio.to_thread(self._run, process, fresh, request))
            reason = None
            try:
                while not task.done():
                    await asyncio.wait({task}, timeout=_POLL_S)
                    if task.done():
                        break
                    if client_gone is not None and await client_gone():
                        reason = "gone"
                    elif loop.time() > deadline:
                        reason = "timeout"
                    elif self._grown(process):
                        reason = "memory"
                    if reason is not None:
                        process.kill()
                        self.n_killed += 1
                        break
            finally:
                if not task.done() and reason is None:  # this request was cancelled: stop its compile too
                    process.kill()
                    self.n_killed += 1
                with self._lock:
                    self._busy.discard(process)
            try:
                reply = await task
            except _Gone:
                reply = None
            with self._lock:
                if process.alive:
                    self._idle.append(process)
        if reason == "gone":
            raise ApiError(499, "client closed the request")
        if reason == "timeout":
            raise ApiError(400, f"{field} took more than {self.timeout_s:g} s to compile", param=field)
        if reason == "memory":
            mib = self.memory_bytes / (1 << 20)
            raise ApiError(400, f"{field} needs more than {mib:g} MiB to compile", param=field)
        if reply is None:
            await imported  # an xgrammar that cannot be imported: the 501 naming it
            raise ApiError(400, f"{field} could not be compiled: the compile process ended", param=field)
        if "error" in reply:
            message = _LOCATION.sub("", str(reply["error"]))[:300] or "error"
            raise ApiError(400, f"invalid {field}: {printable(message)}", param=field)
        xgr = await imported
        try:
            compiled = await asyncio.to_thread(self._compile_here, xgr, kind, request["source"])
        except Exception as e:  # it compiled in the process: not expected
            raise ApiError(
                400, f"invalid {field}: {printable(' '.join(str(e).split())[:300])}", param=field
            ) from None
        return GrammarMatcher(xgr, compiled, self.tokenizer.n_vocab)

    def _grown(self, process: _Process) -> bool:
        """True when the compile has grown its process by more than memory_bytes."""
        base, now = process.baseline, process.rss()
        return base is not None and now is not None and now - base > self.memory_bytes

    def close(self) -> None:
        """End every compile process (server shutdown)."""
        with self._lock:
            processes = [*self._idle, *self._busy]
            self._idle.clear()
        for p in processes:
            p.kill()

    @property
    def n_processes(self) -> int:
        """Compile processes alive now (idle or compiling)."""
        with self._lock:
            return sum(p.alive for p in (*self._idle, *self._busy))
