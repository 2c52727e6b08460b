"""The FastAPI application: shared request handling, the safety layer (API key, body size), error answers."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from powerinfer.runtime.engine import EngineOptions
from powerinfer.sampling import SamplingParams
from powerinfer.server.chat import ChatFormatter
from powerinfer.server.errors import ApiError, validation_message
from powerinfer.server.schemas import _Sampling
from powerinfer.server.worker import Done, Event, Failed, GenParams, GenRequest, QueueFull, Worker

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


class ServerState:
    """What the handlers share: the worker (model owner), options, chat formatter and the served model id."""

    def __init__(self, worker: Worker, options: ServerOptions) -> None:
        self.worker = worker
        self.options = options
        self.tokenizer = worker.tokenizer
        self.formatter = ChatFormatter(self.tokenizer, options.chat_template)
        self.model_id = options.alias or options.model.name
        self.model_names = {self.model_id, options.model.name, options.model.stem}
        self.created = int(time.time())
        self.n_ctx = worker.n_ctx

    # ------------------------------------------------------------------ request -> generation parameters
    def sampling(self, body: _Sampling) -> SamplingParams:
        """The server defaults with the request's sampling fields applied."""
        names = {
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
        changes = {
            ours: getattr(body, theirs) for theirs, ours in names.items() if getattr(body, theirs) is not None
        }
        return dataclasses.replace(self.options.sampling, **changes)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise ApiError(
                404,
                f"The model '{name}' does not exist; this server serves '{self.model_id}'",
                param="model",
                code="model_not_found",
            )

    def encode(self, text: str) -> list[int]:
        """Prompt text to tokens as `powerinfer main` does (BOS per the vocabulary, special tokens parsed)."""
        return self.tokenizer.encode(text, add_bos=None, parse_special=True)

    def check_prompt(self, tokens: list[int]) -> list[int]:
        """An empty prompt becomes BOS; ids must be in the vocabulary; the prompt must leave room."""
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
        if len(tokens) > limit:
            raise ApiError(
                400,
                f"the prompt has {len(tokens)} tokens, more than the {limit} this server accepts "
                f"(context size {self.n_ctx} minus 4)",
                param="prompt",
                code="context_length_exceeded",
            )
        return tokens

    # ------------------------------------------------------------------ running a generation
    def start(self, prompt: list[int], params: GenParams) -> tuple[GenRequest, asyncio.Queue[Event]]:
        """Hand a generation to the worker; 503 when the queue is full."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        req = GenRequest(
            prompt, params, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev), self.options.timeout_s
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

    async def collect(self, http: Request, req: GenRequest, queue: asyncio.Queue[Event]) -> Done:
        """Wait for the end of a non-streamed generation."""
        async for event in self.events(http, req, queue):
            if isinstance(event, Failed):
                raise ApiError(event.status, event.message)
            if isinstance(event, Done):
                return event
        raise ApiError(499, "client closed the request")


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def timings(done: Done) -> dict[str, float]:
    """llama.cpp's per-request timings object."""
    pn, pm, gn, gm = done.n_prompt, done.prompt_ms, done.n_predicted, done.predicted_ms
    return {
        "prompt_n": pn,
        "prompt_ms": pm,
        "prompt_per_token_ms": pm / pn if pn else 0.0,
        "prompt_per_second": 1e3 * pn / pm if pm > 0 else 0.0,
        "predicted_n": gn,
        "predicted_ms": gm,
        "predicted_per_token_ms": gm / gn if gn else 0.0,
        "predicted_per_second": 1e3 * gn / gm if gm > 0 else 0.0,
    }


class Guard:
    """ASGI layer in front of the app: API key (401) and request body size (413)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if scope["method"] == "POST" and "json" not in headers.get("content-type", ""):
            # every POST body is JSON, whatever the client declared (llama.cpp parses it the same way)
            raw = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope = {**scope, "headers": [*raw, (b"content-type", b"application/json")]}
        if self.api_key and scope["method"] != "OPTIONS" and scope["path"] not in PUBLIC_PATHS:
            given = headers.get("authorization", "")
            token = given[7:].strip() if given.lower().startswith("bearer ") else headers.get("x-api-key", "")
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                message = "invalid API key" if token else "missing API key (send 'Authorization: Bearer KEY')"
                err = ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await err.response()(scope, receive, send)
                return
        limit = self.max_body_bytes
        too_large = ApiError(
            413, f"request body larger than the limit of {limit} bytes", code="request_too_large"
        )
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await too_large.response()(scope, receive, send)
            return
        state = {"received": 0, "rejected": False, "started": False}

        async def receive_limited() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > limit and not state["started"]:
                    state["rejected"] = True
                    await too_large.response()(scope, receive, send)
                    state["started"] = True
                    return {"type": "http.disconnect"}
            return message

        async def send_tracked(message: Message) -> None:
            if state["rejected"]:
                return  # the app's answer to the cut-off body is dropped: 413 went out already
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        try:
            await self.app(scope, receive_limited, send_tracked)
        except Exception:
            if not state["rejected"]:
                raise


def create_app(worker: Worker, options: ServerOptions) -> Guard:
    """The ASGI application: FastAPI routes behind the Guard layer; `app.state.server` is the ServerState."""
    from powerinfer.server import routes_llama, routes_openai

    app = FastAPI(
        title="powerinfer server",
        description="llama.cpp-compatible (/completion, /tokenize, ...) and OpenAI-compatible (/v1/...) text "
        "generation with continuous batching. Errors use the OpenAI shape "
        '{"error": {"message", "type", "param", "code"}}. With --api-key every endpoint except '
        "/, /health and the API docs needs 'Authorization: Bearer KEY'.",
        version="0.1.0",
    )
    app.state.server = ServerState(worker, options)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Any:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Any:
        message, param = validation_message(list(exc.errors()))
        return ApiError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Any:
        return ApiError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Any:
        return ApiError(500, f"internal error: {type(exc).__name__}").response()

    app.include_router(routes_llama.router)
    app.include_router(routes_openai.router)
    return Guard(app, options.api_key, options.max_body_bytes)
