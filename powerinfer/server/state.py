"""The server's shared state: options, the worker handle, request helpers (the strict JSON body every route
parses); every route module imports it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from powerinfer.errors import InputError
from powerinfer.runtime.context_shift import resolve_keep, truncate_prompt
from powerinfer.runtime.engine import EngineOptions
from powerinfer.runtime.speculative import SpecOptions
from powerinfer.sampling import SamplingParamError, SamplingParams
from powerinfer.server.chat import ChatFormatter
from powerinfer.server.errors import ApiError
from powerinfer.server.grammar import Grammars
from powerinfer.server.schemas import ResponseFormat, _Constrained, _Sampling
from powerinfer.server.slots import Constraint
from powerinfer.server.worker import (
    Done,
    Embedded,
    Event,
    Failed,
    GenParams,
    GenRequest,
    QueueFull,
    SlotRequest,
    Worker,
)

PUBLIC_PATHS = frozenset({"/", "/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


@dataclass(frozen=True)
class ServerOptions:
    model: Path
    engine: EngineOptions = field(default_factory=EngineOptions)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    n_predict: int = -1  # default for requests that give no limit
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    timeout_s: float = 600.0  # longest a request may wait plus generate
    alias: str | None = None
    max_queue: int = 32  # requests waiting beyond the slots; more get 503
    max_body_bytes: int = 1 << 20
    chat_template: str | None = None  # overrides the GGUF's tokenizer.chat_template
    n_predict_max: int = -1  # cap on any request's token limit; -1: only the context limits it
    read_timeout_s: float = 20.0  # to receive a whole request: line, headers and body
    write_timeout_s: float = 60.0  # a response may stall this long because the client does not read
    max_connections: int = 512  # open connections; past it the oldest one still sending a request is closed
    embedding: bool = False  # serve /v1/embeddings and /embedding
    context_shift: bool = (
        False  # --context-shift: truncate long prompts, shift full contexts (llama-server's)
    )
    n_keep: int = 0  # --keep: the n_keep of requests that give none
    speculative: SpecOptions | None = None  # draft model or n-gram lookup (runtime.speculative)


# API field names of the sampling parameters (the SamplingParams field in the value)
SAMPLING_FIELDS = {
    "temperature": "temp",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "seed": "seed",
}
_API_NAMES = {ours: theirs for theirs, ours in SAMPLING_FIELDS.items()}

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogate(obj: Any) -> bool:
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def parse_json(body: bytes) -> Any:
    """A request body as JSON, strictly: UTF-8 only (RFC 8259), no NaN/Infinity literals, no lone surrogate
    escapes (they are not Unicode text); each refusal is a JSONDecodeError, i.e. a 400."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise json.JSONDecodeError(f"the body is not valid UTF-8 (byte {e.start})", "", 0) from None

    def constant(name: str) -> Any:
        raise json.JSONDecodeError(f"{name} is not a JSON number", text, max(0, text.find(name)))

    obj = json.loads(text, parse_constant=constant)
    escape = _SURROGATE_ESCAPE.search(text)
    if escape is not None and _has_surrogate(obj):
        raise json.JSONDecodeError(
            "a string holds a lone UTF-16 surrogate escape, which is not valid Unicode", text, escape.start()
        )
    return obj


class _JSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class JSONRoute(APIRoute):
    """An APIRoute whose request bodies go through `parse_json`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_JSONRequest(request.scope, request.receive, request._send))

        return strict


class ServerState:
    """What the handlers share: the worker (model owner), options, chat formatter and the served model id."""

    def __init__(self, worker: Worker, options: ServerOptions) -> None:
        self.worker = worker
        self.options = options
        self.tokenizer = worker.tokenizer
        self.formatter = ChatFormatter(self.tokenizer, options.chat_template)
        self.grammars = Grammars(self.tokenizer)
        # the id /v1/models lists and every response's `model` field (llama-server reports its --alias too,
        # whatever name the request gave); a request's `model` never selects: the loaded model serves all
        self.model_id = options.alias or options.model.name
        self.created = int(time.time())
        self.n_ctx = worker.n_ctx

    # ------------------------------------------------------------------ request -> generation parameters
    def sampling(self, body: _Sampling) -> SamplingParams:
        """The server defaults with the request's sampling fields applied; 400 for values that cannot be
        sampled with (SamplingParams' checks)."""
        changes = {
            ours: getattr(body, theirs)
            for theirs, ours in SAMPLING_FIELDS.items()
            if getattr(body, theirs) is not None
        }
        try:
            return dataclasses.replace(self.options.sampling, **changes)
        except SamplingParamError as e:
            name = _API_NAMES.get(e.field, e.field)
            raise ApiError(400, f"{name} {e.reason}", param=name) from None

    def n_predict(self, n: int | None) -> int:
        """A request's token limit: absent -> the server default; -1 (or -2, llama.cpp's "until the context
        is full") -> until end of sequence; capped by --n-predict-max; past the free context generation
        stops when the context is full."""
        if n is None:
            n = self.options.n_predict
        n = -1 if n < 0 else n
        cap = self.options.n_predict_max
        if cap >= 0 and (n < 0 or n > cap):
            n = cap
        return n

    async def slot_request(
        self,
        body: _Constrained,
        response_format: ResponseFormat | None = None,
        n_top: int | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        http: Request | None = None,
    ) -> SlotRequest:
        """The request's prompt reuse, log-probabilities (n_top: None for none, else the alternatives per
        token) and output constraint (grammar, json_schema, response_format or `tool_calls`, the schemas of
        a required tool call; 400 for a bad one). A constraint is compiled while `http`'s client stays: when it
        leaves, the compile is stopped (powerinfer.server.grammar) and the request ends with 499."""
        given = [name for name in ("grammar", "json_schema") if getattr(body, name) not in (None, "")]
        if response_format is not None and response_format.type != "text":
            given.append("response_format")
        if tool_calls:
            given.append("tool_choice")
        if len(given) > 1:
            raise ApiError(400, f"give one of {' and '.join(given)}, not both", param=given[1])
        constraint: Constraint | None = None
        gone = None if http is None else http.is_disconnected
        if tool_calls:
            constraint = await self.grammars.compile("tool_call", tool_calls, "tools", gone)
        elif body.grammar:
            constraint = await self.grammars.compile("gbnf", body.grammar, "grammar", gone)
        elif body.json_schema is not None:
            constraint = await self.grammars.compile("json_schema", body.json_schema, "json_schema", gone)
        elif response_format is not None and response_format.type != "text":
            schema = response_format.schema_
            if response_format.type == "json_schema":
                inner = response_format.json_schema or {}
                schema = inner.get("schema", schema)
                if not isinstance(schema, dict):
                    raise ApiError(
                        400,
                        "response_format.json_schema.schema must be a JSON schema object",
                        param="response_format",
                    )
            kind, source = ("json_schema", schema) if schema is not None else ("json", None)
            constraint = await self.grammars.compile(kind, source, "response_format", gone)
        return SlotRequest(
            cache_prompt=body.cache_prompt,
            logprobs=n_top is not None,
            n_top=n_top or 0,
            constraint=constraint,
        )

    def encode(self, text: str) -> list[int]:
        """Prompt text to tokens as `powerinfer main` does (BOS per the vocabulary, special tokens parsed)."""
        return self.tokenizer.encode(text, add_bos=None, parse_special=True)

    def check_prompt(self, tokens: list[int], shifts: bool = False) -> list[int]:
        """An empty prompt becomes BOS; ids must be in the vocabulary; the prompt must leave room (unless it
        `shifts`, a generation's prompt under --context-shift: `fit_context` cuts it)."""
        if not tokens:
            if self.tokenizer.bos_id is None:
                raise ApiError(400, "empty prompt", param="prompt")
            tokens = [self.tokenizer.bos_id]
        n_vocab = self.tokenizer.n_vocab
        bad = [t for t in tokens if not 0 <= t < n_vocab]
        if bad:
            raise ApiError(
                400, f"token id {bad[0]} is out of range for a vocabulary of {n_vocab}", param="prompt"
            )
        limit = self.n_ctx - 4
        if len(tokens) > limit and not (shifts and self.options.context_shift):
            raise ApiError(
                400,
                f"the prompt has {len(tokens)} tokens, more than the {limit} this server accepts "
                f"(context size {self.n_ctx} minus 4)",
                param="prompt",
                code="context_length_exceeded",
            )
        return tokens

    def fit_context(
        self, prompt: list[int], params: GenParams, n_keep: int | None
    ) -> tuple[list[int], GenParams, bool]:
        """Under --context-shift (llama-server's): the request's n_keep (default --keep; -1: the whole prompt;
        counted after the BOS the vocabulary adds), the prompt cut as llama-server cuts one that does not fit the
        slot (runtime.context_shift.truncate_prompt), and a generation of a given length allowed to shift its
        context (an unlimited one stops at a full context, as llama-server's does). Returns the prompt, the
        parameters and whether the prompt was cut."""
        if not self.options.context_shift:
            return prompt, params, False
        add_bos = self.tokenizer.add_bos and prompt[0] == self.tokenizer.bos_id
        keep = resolve_keep(self.options.n_keep if n_keep is None else n_keep, len(prompt), add_bos)
        try:
            cut = truncate_prompt(prompt, self.n_ctx, keep)
        except InputError as e:
            raise ApiError(400, str(e), param="n_keep", code="context_length_exceeded") from None
        params = dataclasses.replace(params, context_shift=params.n_predict >= 0, n_keep=min(keep, len(cut)))
        return cut, params, len(cut) < len(prompt)

    # ------------------------------------------------------------------ running a generation
    def start(
        self, prompt: list[int], params: GenParams, options: SlotRequest | None = None
    ) -> tuple[GenRequest, asyncio.Queue[Event]]:
        """Hand a generation to the worker; 503 when the queue is full."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        req = GenRequest(
            prompt,
            params,
            lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev),
            self.options.timeout_s,
            options,
        )
        try:
            self.worker.submit(req)
        except QueueFull as e:
            raise ApiError(503, f"server busy: {e}", headers={"Retry-After": "1"}) from None
        return req, queue

    async def events(
        self, http: Request, req: GenRequest, queue: asyncio.Queue[Event], first: Event | None = None
    ) -> AsyncIterator[Event]:
        """The events of one generation until Done or Failed; a client that goes away cancels it."""
        finished = False
        try:
            if first is not None:
                finished = isinstance(first, Done | Failed)
                yield first
            while not finished:
                event = await self.next_event(http, req, queue)
                if event is None:
                    return
                finished = isinstance(event, Done | Failed)
                yield event
        finally:
            if not finished:
                self.worker.cancel(req)

    async def next_event(self, http: Request, req: GenRequest, queue: asyncio.Queue[Event]) -> Event | None:
        """The next event, or None (and the request cancelled) once the client has disconnected."""
        while True:
            try:
                return await asyncio.wait_for(queue.get(), 0.5)
            except TimeoutError:
                if await http.is_disconnected():
                    self.worker.cancel(req)
                    return None

    async def embed(self, http: Request, tokens: list[int]) -> Embedded:
        """The pooled embedding of `tokens` (501 unless the server runs with --embedding)."""
        if not self.options.embedding:
            raise ApiError(
                501, "embeddings are off: start the server with --embedding", type="not_supported_error"
            )
        req, queue = self.start(self.check_prompt(tokens), GenParams(), SlotRequest(embed=True))
        event = await self.next_event(http, req, queue)
        if isinstance(event, Failed):
            raise ApiError(event.status, event.message)
        if not isinstance(event, Embedded):
            raise ApiError(499, "client closed the request")
        return event

    async def collect(self, http: Request, req: GenRequest, queue: asyncio.Queue[Event]) -> Done:
        """Wait for the end of a non-streamed generation."""
        async for event in self.events(http, req, queue):
            if isinstance(event, Failed):
                raise ApiError(event.status, event.message)
            if isinstance(event, Done):
                return event
        raise ApiError(499, "client closed the request")


EMBEDDING_MAX_INPUTS = 256  # texts (or token lists) one embeddings request may hold; each is bounded by -c


def check_embedding_inputs(n: int, param: str) -> None:
    """400 for an embeddings request of more than EMBEDDING_MAX_INPUTS inputs: one request's work stays bounded
    (each input is one prompt of at most the context size)."""
    if n > EMBEDDING_MAX_INPUTS:
        raise ApiError(400, f"{n} inputs in one request; at most {EMBEDDING_MAX_INPUTS}", param=param)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def timings(done: Done) -> dict[str, float]:
    """llama.cpp's per-request timings object; prompt_n counts the prompt tokens evaluated, without those
    reused from the slot's cache (cache_n)."""
    pn, pm, gn, gm = done.n_evaluated, done.prompt_ms, done.n_predicted, done.predicted_ms
    out = {
        "cache_n": done.n_prompt - pn,
        "prompt_n": pn,
        "prompt_ms": pm,
        "prompt_per_token_ms": pm / pn if pn else 0.0,
        "prompt_per_second": 1e3 * pn / pm if pm > 0 else 0.0,
        "predicted_n": gn,
        "predicted_ms": gm,
        "predicted_per_token_ms": gm / gn if gn else 0.0,
        "predicted_per_second": 1e3 * gn / gm if gm > 0 else 0.0,
    }
    if done.n_draft > 0:  # as llama-server: only when the request drafted
        out["draft_n"] = done.n_draft
        out["draft_n_accepted"] = done.n_draft_accepted
    return out
