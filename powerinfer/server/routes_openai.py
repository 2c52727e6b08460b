"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from powerinfer.printable import printable
from powerinfer.server import logprobs, tools
from powerinfer.server.errors import ApiError
from powerinfer.server.schemas import (
    ChatCompletionRequest,
    EmbeddingRequest,
    OpenAICompletionRequest,
    _OpenAIBase,
)
from powerinfer.server.state import JSONRoute, ServerState, check_embedding_inputs, sse, timings
from powerinfer.server.worker import Chunk, Done, Failed, GenParams, SlotRequest, TokenProb

router = APIRouter(prefix="/v1", tags=["OpenAI"], route_class=JSONRoute)
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "length", "cancelled": "stop"}
FINGERPRINT = "powerinfer-0.1.0"


def _state(request: Request) -> ServerState:
    return request.app.state.server  # type: ignore[no-any-return]


def _params(
    st: ServerState, body: _OpenAIBase, max_tokens: int | None, extra_stop: tuple[str, ...]
) -> GenParams:
    """OpenAI fields to generation parameters. max_tokens < 1 is an error; more than the free context is
    clamped (generation ends with finish_reason "length" when the context is full), as llama.cpp's server
    does."""
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(
            400,
            f"max_tokens must be at least 1, got {max_tokens}",
            param="max_tokens",
            code="integer_below_min_value",
        )
    stop = body.stop_list()
    if len(stop) > 16:
        raise ApiError(400, "at most 16 stop sequences", param="stop")
    bias = []
    for key, value in (body.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) < 12) or not int(key) < st.tokenizer.n_vocab:
            raise ApiError(
                400, f"logit_bias key '{printable(key)}' is not a token id of this model", param="logit_bias"
            )
        if not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
        bias.append((int(key), float("-inf") if value == -100 else value))
    return GenParams(
        st.sampling(body),
        st.n_predict(max_tokens),
        False,
        tuple(s for s in stop if s) + extra_stop,
        tuple(bias),
    )


def _usage(done: Done) -> dict[str, int]:
    return {
        "prompt_tokens": done.n_prompt,
        "completion_tokens": done.n_predicted,
        "total_tokens": done.n_prompt + done.n_predicted,
    }


@router.get("/models", summary="The served model")
async def models(request: Request) -> dict[str, Any]:
    st = _state(request)
    return {
        "object": "list",
        "data": [
            {
                "id": st.model_id,
                "object": "model",
                "created": st.created,
                "owned_by": "powerinfer",
                "meta": {"n_ctx": st.n_ctx, "n_vocab": st.tokenizer.n_vocab, "n_slots": st.worker.n_slots},
            }
        ],
    }


async def _run(
    request: Request,
    st: ServerState,
    body: _OpenAIBase,
    prompt: list[int],
    params: GenParams,
    options: SlotRequest,
    kind: str,
    chunk: Callable[[str | None, str | None, tuple[TokenProb, ...]], dict[str, Any]],
    final: Callable[[Done], dict[str, Any]],
    tail: Callable[[Done, dict[str, Any]], None] | None = None,
) -> Any:
    """Run one generation; answer with the final object, or stream chunks then `data: [DONE]` (`tail` may
    amend the last chunk)."""
    req, queue = st.start(prompt, params, options)
    if not body.stream:
        done = await st.collect(request, req, queue)
        return final(done)
    first = await st.next_event(request, req, queue)
    if first is None:
        raise ApiError(499, "client closed the request")
    if isinstance(first, Failed):
        raise ApiError(first.status, first.message)
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    def event(obj: dict[str, Any]) -> str:
        if include_usage:
            obj["usage"] = None
        return sse(obj)

    async def stream() -> AsyncIterator[str]:
        if kind == "chat":
            yield event(chunk("", None, ()))
        async for ev in st.events(request, req, queue, first):
            if isinstance(ev, Chunk):
                yield event(chunk(ev.text, None, ev.probs))
            elif isinstance(ev, Done):
                last = chunk(None, FINISH[ev.reason], ev.probs[ev.n_probs_sent :])
                last["timings"] = timings(ev)
                if tail is not None:
                    tail(ev, last)
                yield event(last)
                if include_usage:
                    usage = chunk(None, None, ())
                    usage["choices"] = []
                    usage["usage"] = _usage(ev)
                    yield sse(usage)
                yield "data: [DONE]\n\n"
            else:
                yield ApiError(ev.status, ev.message).sse()

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.post("/chat/completions", summary="Chat completion (OpenAI)")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    """Renders `messages` with the model's chat template (GGUF `tokenizer.chat_template`, Jinja2 sandbox;
    ChatML when the model has none) and generates the assistant's answer."""
    st = _state(request)
    mode, offered = tools.tool_choice(
        body.tool_choice, [t.model_dump(exclude_none=True) for t in body.tools or []]
    )
    inline = bool(offered) and not st.formatter.renders_tools  # tools described in a system message
    messages: list[dict[str, Any]] = []
    for m in body.messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = [c.model_dump() for c in m.tool_calls]
            if inline:
                msg["content"] = (msg["content"] + "".join(tools.call_text(c) for c in calls)).strip()
            else:
                msg["tool_calls"] = calls
        messages.append(msg)
    if inline:
        if messages and messages[0]["role"] == "system":
            messages[0] = {
                **messages[0],
                "content": messages[0]["content"] + "\n\n" + tools.system_prompt(offered),
            }
        else:
            messages.insert(0, {"role": "system", "content": tools.system_prompt(offered)})
    prompt = st.check_prompt(st.formatter.tokens(messages, None if inline else offered or None), shifts=True)
    params = _params(
        st,
        body,
        body.max_completion_tokens if body.max_tokens is None else body.max_tokens,
        st.formatter.stop,
    )
    prompt, params, truncated = st.fit_context(prompt, params, body.n_keep)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    options = await st.slot_request(
        body,
        body.response_format,
        (body.top_logprobs or 0) if body.logprobs else None,
        tools.call_schema(offered) if mode == "required" else None,
        http=request,
    )
    options.truncated = truncated
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def answer(done: Done) -> tuple[dict[str, Any], str]:
        """The assistant message and finish_reason; tool calls parsed out of the text when tools were given."""
        content, calls = tools.parse(done.text) if offered else (done.text, [])
        if not calls:
            return {"role": "assistant", "content": done.text}, FINISH[done.reason]
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    content = tools.ContentStream()  # streamed text, tool calls held back

    def tail(done: Done, last: dict[str, Any]) -> None:
        message, finish = answer(done)
        if "tool_calls" in message:
            calls = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
            last["choices"][0]["delta"] = {"tool_calls": calls}
            last["choices"][0]["finish_reason"] = finish
        elif offered and (rest := content.rest()):
            last["choices"][0]["delta"] = {"content": rest}

    def probs_of(probs: tuple[TokenProb, ...]) -> dict[str, Any] | None:
        return logprobs.chat(st.tokenizer, probs) if options.logprobs else None

    def chunk(text: str | None, finish: str | None, probs: tuple[TokenProb, ...]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if text == "":
            delta = {"role": "assistant", "content": ""}
        elif text is not None:
            delta = {"content": content.feed(text) if offered else text}
        return {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": st.model_id,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"index": 0, "delta": delta, "logprobs": probs_of(probs), "finish_reason": finish}],
        }

    def final(done: Done) -> dict[str, Any]:
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": st.model_id,
            "system_fingerprint": FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "message": answer(done)[0],
                    "logprobs": probs_of(done.probs),
                    "finish_reason": answer(done)[1],
                }
            ],
            "usage": _usage(done),
            "timings": timings(done),
        }

    return await _run(request, st, body, prompt, params, options, "chat", chunk, final, tail)


@router.post("/completions", summary="Text completion (OpenAI)")
async def completions(body: OpenAICompletionRequest, request: Request) -> Any:
    """Continues `prompt` (tokenized as `powerinfer main` does). `echo` prepends the prompt to the text."""
    st = _state(request)
    p = body.prompt
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        if len(p) != 1:
            raise ApiError(400, "only one prompt per request is supported", param="prompt")
        p = p[0]
    if isinstance(p, str):
        text, tokens = p, st.encode(p)
    else:
        tokens = [int(x) for x in p]
        text = st.tokenizer.decode(t for t in tokens if 0 <= t < st.tokenizer.n_vocab)
    prompt = st.check_prompt(tokens, shifts=True)
    params = _params(st, body, body.max_tokens, ())
    prompt, params, truncated = st.fit_context(prompt, params, body.n_keep)
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    echo = text if body.echo else ""
    options = await st.slot_request(body, body.response_format, body.logprobs, http=request)
    options.truncated = truncated
    offset = {"text": len(echo)}  # text_offset of the next token

    def chunk(piece: str | None, finish: str | None, probs: tuple[TokenProb, ...]) -> dict[str, Any]:
        lp = None
        if options.logprobs:
            lp = logprobs.completion(st.tokenizer, probs, offset["text"])
            offset["text"] += sum(len(t) for t in lp["tokens"])
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": st.model_id,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"index": 0, "text": piece or "", "logprobs": lp, "finish_reason": finish}],
        }

    def final(done: Done) -> dict[str, Any]:
        out = chunk(echo + done.text, FINISH[done.reason], done.probs)
        out["usage"] = _usage(done)
        out["timings"] = timings(done)
        return out

    if echo and body.stream:
        raise ApiError(400, "echo is not supported with stream", param="echo")
    return await _run(request, st, body, prompt, params, options, "text", chunk, final)


@router.post("/embeddings", summary="Embeddings (OpenAI; needs --embedding)")
async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
    """The mean of the final-normed hidden states over each input's tokens (or the pooling the model's
    GGUF names), L2-normalised."""
    st = _state(request)
    inputs = body.input if isinstance(body.input, list) else [body.input]
    if inputs and all(isinstance(x, int) for x in inputs):
        inputs = [inputs]  # one list of token ids
    if not inputs:
        raise ApiError(400, "input is empty", param="input")
    check_embedding_inputs(len(inputs), "input")
    data, n_tokens = [], 0
    for i, item in enumerate(inputs):
        tokens = st.encode(item) if isinstance(item, str) else [int(t) for t in item]  # type: ignore[union-attr]
        out = await st.embed(request, tokens)
        n_tokens += out.n_prompt
        vector: Any = out.vector
        if body.encoding_format == "base64":
            vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": vector})
    return {
        "object": "list",
        "data": data,
        "model": st.model_id,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }
