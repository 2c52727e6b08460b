"""The FastAPI application: shared request handling, the safety layer (API key, body size), error answers."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from powerinfer.errors import PowerInferError
from powerinfer.printable import printable
from powerinfer.server.errors import ApiError, validation_message
from powerinfer.server.routes_llama import router as llama_router
from powerinfer.server.routes_openai import router as openai_router
from powerinfer.server.state import PUBLIC_PATHS, ServerOptions, ServerState
from powerinfer.server.worker import Worker


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

    @app.exception_handler(PowerInferError)
    async def _input_error(request: Request, exc: PowerInferError) -> Any:
        return ApiError(400, printable(str(exc))).response()  # e.g. a chat template refusing the messages

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Any:
        return ApiError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Any:
        return ApiError(500, f"internal error: {type(exc).__name__}").response()

    app.include_router(llama_router)
    app.include_router(openai_router)
    return Guard(app, options.api_key, options.max_body_bytes)
