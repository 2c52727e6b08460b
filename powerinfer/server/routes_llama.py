"""llama.cpp's native endpoints (/completion, /tokenize, /detokenize, /health, /props), /metrics and the chat
page at /."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse

from powerinfer.server import logprobs
from powerinfer.server.errors import ApiError
from powerinfer.server.schemas import (
    CompletionRequest,
    DetokenizeRequest,
    LlamaEmbeddingRequest,
    TokenizeRequest,
)
from powerinfer.server.state import JSONRoute, ServerState, check_embedding_inputs, sse, timings
from powerinfer.server.worker import Chunk, Done, Failed, GenParams

router = APIRouter(route_class=JSONRoute)


def _state(request: Request) -> ServerState:
    return request.app.state.server  # type: ignore[no-any-return]


def _prompt_tokens(st: ServerState, prompt: str | list[int | str]) -> list[int]:
    if isinstance(prompt, str):
        return st.encode(prompt)
    out: list[int] = []
    for i, part in enumerate(prompt):  # llama.cpp: BOS only before a leading text part
        if isinstance(part, str):
            out += st.tokenizer.encode(part, add_bos=None if i == 0 else False, parse_special=True)
        else:
            out.append(part)
    return out


def _n_predict(st: ServerState, n: int | None) -> int:
    if n is not None and n < -2:
        raise ApiError(
            400,
            f"n_predict must be >= -2 (-1: until end of sequence, -2: until the context is full), got {n}",
            param="n_predict",
        )
    return st.n_predict(n)


def _settings(st: ServerState, body: CompletionRequest, params: GenParams, seed: int) -> dict[str, Any]:
    s = params.sampling
    return {
        "n_ctx": st.n_ctx,
        "model": st.model_id,
        "seed": seed,
        "temperature": s.temp,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "repeat_last_n": s.repeat_last_n,
        "repeat_penalty": s.repeat_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "stop": list(params.stop),
        "n_predict": params.n_predict,
        "n_keep": params.n_keep,
        "ignore_eos": params.ignore_eos,
        "stream": body.stream,
        "logit_bias": [list(b) for b in params.logit_bias],
    }


def _final(
    st: ServerState, body: CompletionRequest, params: GenParams, done: Done, content: str
) -> dict[str, Any]:
    return {
        "content": content,
        "slot_id": done.slot,
        "stop": True,
        "model": st.model_id,
        "tokens_predicted": done.n_predicted,
        "tokens_evaluated": done.n_prompt,
        "generation_settings": _settings(st, body, params, done.seed),
        "prompt": body.prompt if isinstance(body.prompt, str) else "",
        "truncated": done.truncated,
        "stopped_eos": done.reason == "eos",
        "stopped_word": done.reason == "stop",
        "stopped_limit": done.reason in ("length", "timeout"),
        "stopping_word": done.stopping_word,
        "tokens_cached": done.n_prompt + done.n_predicted,
        "timings": timings(done),
    }


@router.post("/completion", tags=["llama.cpp"], summary="Complete a prompt (llama.cpp)")
async def completion(body: CompletionRequest, request: Request) -> Any:
    """llama.cpp's completion. With `stream`, server-sent events `data: {"content", "stop": false, ...}` and a
    last event holding the final object (content "", timings). `n_predict` < -2 is an error; a value past the
    free context is clamped (generation stops when the context is full, `stopped_limit`)."""
    st = _state(request)
    prompt = st.check_prompt(_prompt_tokens(st, body.prompt), shifts=True)
    bias = []
    for tid, b in body.logit_bias:
        if not 0 <= tid < st.tokenizer.n_vocab:
            raise ApiError(400, f"logit_bias token {tid} is out of range", param="logit_bias")
        value = float("-inf") if b is False else float(b)
        if math.isnan(value) or value == math.inf:
            raise ApiError(
                400, "logit_bias values must be finite numbers, or false to ban the token", param="logit_bias"
            )
        bias.append((tid, value))
    params = GenParams(
        st.sampling(body),
        _n_predict(st, body.n_predict),
        body.ignore_eos,
        tuple(s for s in body.stop if s),
        tuple(bias),
    )
    prompt, params, truncated = st.fit_context(prompt, params, body.n_keep)
    options = await st.slot_request(body, n_top=body.n_probs if body.n_probs > 0 else None, http=request)
    options.truncated = truncated
    req, queue = st.start(prompt, params, options)
    if not body.stream:
        done = await st.collect(request, req, queue)
        out = _final(st, body, params, done, done.text)
        if options.logprobs:
            out["completion_probabilities"] = logprobs.llama(st.tokenizer, done.probs)
        return out
    first = await st.next_event(request, req, queue)
    if first is None:
        raise ApiError(499, "client closed the request")
    if isinstance(first, Failed):
        raise ApiError(first.status, first.message)

    async def stream() -> AsyncIterator[str]:
        async for event in st.events(request, req, queue, first):
            if isinstance(event, Chunk):
                out = {"content": event.text, "stop": False, "slot_id": event.slot, "multimodal": False}
                if options.logprobs:
                    out["completion_probabilities"] = logprobs.llama(st.tokenizer, event.probs)
                yield sse(out)
            elif isinstance(event, Done):
                out = _final(st, body, params, event, "")
                if options.logprobs:  # tokens whose text was held back (a stop word may have begun)
                    rest = event.probs[event.n_probs_sent :]
                    out["completion_probabilities"] = logprobs.llama(st.tokenizer, rest)
                yield sse(out)
            else:
                yield ApiError(event.status, event.message).sse()

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.post("/embedding", tags=["llama.cpp"], summary="Embedding (llama.cpp; needs --embedding)")
async def embedding(body: LlamaEmbeddingRequest, request: Request) -> Any:
    """`{"embedding": [...]}` for one text; `[{"index", "embedding"}, ...]` for a list of texts. Pooling and
    normalisation as /v1/embeddings."""
    st = _state(request)
    if isinstance(body.content, str):
        return {"embedding": (await st.embed(request, st.encode(body.content))).vector}
    check_embedding_inputs(len(body.content), "content")
    return [
        {"index": i, "embedding": (await st.embed(request, st.encode(text))).vector}
        for i, text in enumerate(body.content)
    ]


@router.post("/tokenize", tags=["llama.cpp"], summary="Text to token ids")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, list[int]]:
    """Token ids of `content` (no BOS unless `add_special`), special-token texts parsed."""
    st = _state(request)
    return {
        "tokens": st.tokenizer.encode(
            body.content, add_bos=None if body.add_special else False, parse_special=True
        )
    }


@router.post("/detokenize", tags=["llama.cpp"], summary="Token ids to text")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    st = _state(request)
    n_vocab = st.tokenizer.n_vocab
    bad = [t for t in body.tokens if not 0 <= t < n_vocab]
    if bad:
        raise ApiError(
            400, f"token id {bad[0]} is out of range for a vocabulary of {n_vocab}", param="tokens"
        )
    return {"content": st.tokenizer.decode(body.tokens)}


@router.get("/health", tags=["llama.cpp"], summary="Liveness and slot usage")
async def health(request: Request) -> Any:
    st = _state(request)
    busy = st.worker.slots_busy()
    body = {
        "status": "ok" if st.worker.alive else "error",
        "slots_idle": st.worker.n_slots - busy,
        "slots_processing": busy,
    }
    return JSONResponse(body, status_code=200 if st.worker.alive else 500)


@router.get("/props", tags=["llama.cpp"], summary="Server properties")
async def props(request: Request) -> dict[str, Any]:
    st = _state(request)
    s = st.options.sampling
    return {
        "user_name": "User",
        "assistant_name": "Assistant",
        "model": st.model_id,
        "n_ctx": st.n_ctx,
        "total_slots": st.worker.n_slots,
        "max_queue": st.worker.max_queue,
        "chat_template": st.formatter.template,
        "chat_template_fallback": st.formatter.fallback,
        "sparse": st.worker.engine.sparse_stats is not None,
        "embedding": st.options.embedding,
        "default_generation_settings": {
            **dataclasses.asdict(s),
            "temperature": s.temp,
            "n_predict": st.options.n_predict,
        },
    }


def _metric(lines: list[str], name: str, kind: str, help_: str, value: float) -> None:
    lines += [
        f"# HELP powerinfer_{name} {help_}",
        f"# TYPE powerinfer_{name} {kind}",
        f"powerinfer_{name} {value}",
    ]


@router.get("/metrics", tags=["llama.cpp"], summary="Prometheus metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    """Prometheus text format: requests, tokens and tokens/s, slots, queue; in sparse mode the predicted share
    of active FFN neurons and the share of active neurons served by the GPU pool."""
    st = _state(request)
    m = st.worker.metrics
    lines: list[str] = []
    _metric(lines, "requests_total", "counter", "Generations finished (any reason).", m.requests_total)
    _metric(lines, "requests_failed_total", "counter", "Generations that failed.", m.requests_failed)
    _metric(
        lines,
        "requests_rejected_total",
        "counter",
        "Requests refused with 503 (queue full).",
        m.requests_rejected,
    )
    _metric(
        lines,
        "requests_cancelled_total",
        "counter",
        "Generations whose client went away.",
        m.requests_cancelled,
    )
    _metric(lines, "requests_processing", "gauge", "Generations holding a slot.", m.processing)
    _metric(lines, "requests_deferred", "gauge", "Requests waiting for a slot.", m.deferred)
    _metric(lines, "slots_total", "gauge", "KV cache slots.", st.worker.n_slots)
    _metric(lines, "kv_cache_tokens", "gauge", "Tokens held in the KV cache.", m.kv_tokens)
    _metric(lines, "prompt_tokens_total", "counter", "Prompt tokens evaluated.", m.prompt_tokens_total)
    _metric(
        lines, "prompt_seconds_total", "counter", "Time spent on prompt evaluation.", m.prompt_seconds_total
    )
    _metric(lines, "tokens_predicted_total", "counter", "Tokens generated.", m.predicted_tokens_total)
    _metric(
        lines,
        "decode_seconds_total",
        "counter",
        "Time spent in batched decode steps.",
        m.decode_seconds_total,
    )
    _metric(
        lines,
        "prompt_tokens_seconds",
        "gauge",
        "Average prompt throughput in tokens/s.",
        m.prompt_tokens_total / m.prompt_seconds_total if m.prompt_seconds_total > 0 else 0.0,
    )
    _metric(
        lines,
        "predicted_tokens_seconds",
        "gauge",
        "Average generation throughput in tokens/s (all slots).",
        m.predicted_tokens_total / m.decode_seconds_total if m.decode_seconds_total > 0 else 0.0,
    )
    stats = st.worker.engine.sparse_stats
    if stats is not None:
        n_ff = st.worker.engine.config.n_ff
        tokens = float(stats.tokens.sum())
        active = float(stats.active.sum())
        _metric(
            lines,
            "sparse_predicted_active_ratio",
            "gauge",
            "Share of FFN neurons the predictor marked active (mean over layers and tokens).",
            active / (tokens * n_ff) if tokens else 0.0,
        )
        _metric(
            lines,
            "sparse_gpu_active_share",
            "gauge",
            "Share of active neurons served by the GPU pool.",
            float(stats.active_gpu.sum()) / active if active else 0.0,
        )
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


@router.get("/", include_in_schema=False)
async def chat_page() -> HTMLResponse:
    page = resources.files("powerinfer.server").joinpath("static/index.html").read_text(encoding="utf-8")
    return HTMLResponse(page)
