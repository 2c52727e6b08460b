"""Structured output through xgrammar: JSON schemas, any JSON, and GBNF grammars to per-slot token masks.

The compiler (the vocabulary's bytes, the end-of-generation tokens) is built on the first request that asks
for a constraint; compiled grammars are cached by xgrammar. Each request gets its own matcher, used only by
the worker thread: `mask` bans the tokens the grammar cannot take next (end-of-generation tokens are allowed
only where the grammar may end), `accept` advances it with the sampled token.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import torch

from powerinfer.printable import printable
from powerinfer.server.errors import ApiError
from powerinfer.tokenizer import Tokenizer

# Bounds on what a request may ask to compile (xgrammar's compile runs in C++, off the event loop, and cannot be
# interrupted): a GBNF grammar of 20,000 chained rules (~500 KB) ran past 120 s and 2.5 GB. Real grammars and
# schemas (llama.cpp's examples: json.gbnf 0.6 KB, c.gbnf 0.5 KB; OpenAI's structured output caps schemas at 100
# properties and 5 levels) are far below these.
GRAMMAR_MAX_BYTES = 1 << 16  # a GBNF grammar's or a JSON schema's text
GRAMMAR_MAX_RULES = 512  # GBNF rules (`::=`)
SCHEMA_MAX_DEPTH = 32  # nesting of a JSON schema's objects and arrays

# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: "
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


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


class Grammars:
    """Compiles a request's constraint; errors are 400s naming the request field."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        xgr = _xgrammar()
        with self._lock:
            if self._compiler is None:
                tok = self.tokenizer
                vocab = [tok.token_bytes(i) for i in range(tok.n_vocab)]
                info = xgr.TokenizerInfo(
                    vocab, xgr.VocabType.RAW, vocab_size=tok.n_vocab, stop_token_ids=sorted(tok.eog_ids)
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

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

    def compile(self, kind: str, source: Any, field: str) -> GrammarMatcher:
        """A matcher for `kind`: "json" (any JSON object), "json_schema" (a schema, dict or JSON text) or
        "gbnf" (llama.cpp's grammar format, root rule `root`) or "tool_call" (one `<tool_call>` whose JSON
        follows one of the schemas in `source`). Blocking: call it off the event loop."""
        self.check_size(kind, source, field)
        compiler = self._get_compiler()
        xgr = _xgrammar()
        try:
            if kind == "json":
                compiled = compiler.compile_builtin_json_grammar()
            elif kind == "json_schema":
                schema = json.loads(source) if isinstance(source, str) else source
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema must be an object")
                compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            elif kind == "tool_call":  # source: one JSON schema per allowed call
                calls = [xgr.Grammar.from_json_schema(json.dumps(c), any_whitespace=False) for c in source]
                compiled = compiler.compile_grammar(
                    xgr.Grammar.concat(
                        xgr.Grammar.from_ebnf('root ::= "<tool_call>"'),
                        xgr.Grammar.union(*calls),
                        xgr.Grammar.from_ebnf('root ::= "</tool_call>"'),
                    )
                )
            else:
                compiled = compiler.compile_grammar(source)
        except ApiError:
            raise
        except Exception as e:
            message = _LOCATION.sub("", " ".join(str(e).split()))[:300] or type(e).__name__
            message = printable(message)
            raise ApiError(400, f"invalid {field}: {message}", param=field) from None
        return GrammarMatcher(xgr, compiled, self.tokenizer.n_vocab)
