"""Token log-probabilities in the shapes of the three APIs: OpenAI chat, OpenAI completions, llama.cpp."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from powerinfer.server.worker import TokenProb
from powerinfer.tokenizer import Tokenizer


def _piece(tok: Tokenizer, token: int) -> tuple[str, list[int]]:
    """A token's text (invalid UTF-8 replaced) and its exact bytes."""
    raw = tok.token_bytes(token, special=True)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat(tok: Tokenizer, probs: Sequence[TokenProb]) -> dict[str, Any]:
    """choices[].logprobs of /v1/chat/completions: content[] with token, logprob, bytes, top_logprobs."""
    content = []
    for p in probs:
        text, raw = _piece(tok, p.token)
        top = []
        for tid, lp in p.top:
            t, b = _piece(tok, tid)
            top.append({"token": t, "logprob": lp, "bytes": b})
        content.append({"token": text, "logprob": p.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion(tok: Tokenizer, probs: Sequence[TokenProb], offset: int = 0) -> dict[str, Any]:
    """choices[].logprobs of /v1/completions: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, offsets, tops = [], [], []
    for p in probs:
        text, _ = _piece(tok, p.token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top: dict[str, float] = {}
        for tid, lp in p.top:
            top.setdefault(_piece(tok, tid)[0], lp)
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [p.logprob for p in probs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def llama(tok: Tokenizer, probs: Sequence[TokenProb]) -> list[dict[str, Any]]:
    """llama.cpp's completion_probabilities: id, token, logprob, bytes, top_logprobs[] of the same."""
    out = []
    for p in probs:
        text, raw = _piece(tok, p.token)
        top = []
        for tid, lp in p.top:
            t, b = _piece(tok, tid)
            top.append({"id": tid, "token": t, "logprob": lp, "bytes": b})
        out.append({"id": p.token, "token": text, "logprob": p.logprob, "bytes": raw, "top_logprobs": top})
    return out
