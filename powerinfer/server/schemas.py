"""Request bodies of the HTTP API (pydantic models: FastAPI validates them and lists them in the OpenAPI
schema).

Sampling fields left out take the server's defaults (those of `powerinfer main`, or the server's flags).
Every number must be finite (NaN and infinities are refused with 400); the sampling semantics and the seed's
reduction to uint32 are llama.cpp's (see powerinfer.sampling).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)


class _Sampling(_Strict):
    temperature: float | None = Field(None, description="<= 0: greedy")
    top_k: int | None = Field(None, description="<= 0: off")
    top_p: float | None = Field(None, ge=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0, description="1: off")
    repeat_last_n: int | None = Field(None, ge=-1, description="-1: the whole context, 0: off")
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, description="reduced modulo 2**32; -1 (0xFFFFFFFF) or absent: random")


class _Constrained(_Sampling):
    """Fields every generating endpoint shares: prompt reuse and structured output (llama.cpp's names)."""

    cache_prompt: bool = Field(
        True, description="reuse the slot's KV cache for the prompt's common prefix with its previous request"
    )
    grammar: str | None = Field(None, description="GBNF grammar (llama.cpp's format) the output must follow")
    json_schema: dict[str, Any] | None = Field(None, description="JSON schema the output must follow")
    n_keep: int | None = Field(
        None,
        ge=-1,
        description="with --context-shift: prompt tokens kept when the context shifts or the prompt is cut "
        "(-1: all; default --keep)",
    )


class CompletionRequest(_Constrained):
    """llama.cpp `POST /completion`. Unknown llama.cpp fields (tfs_z, typical_p, mirostat*,
    penalize_nl, slot_id, image_data ...) are accepted and ignored."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    prompt: str | list[int | str] = Field(description="text, token ids, or a mix of both")
    stream: bool = False
    n_predict: int | None = Field(
        None,
        description="-1: until end of sequence or a full context; larger "
        "values are clamped to the free context",
    )
    ignore_eos: bool = False
    stop: list[str] = Field(default_factory=list, max_length=16)
    logit_bias: list[tuple[int, float | bool]] = Field(
        default_factory=list, description="[token, bias]; bias false bans the token"
    )
    n_probs: int = Field(
        0,
        ge=0,
        le=20,
        description="completion_probabilities: each token's logprob and this many alternatives",
    )


class TokenizeRequest(_Strict):
    content: str
    add_special: bool = Field(False, description="prepend BOS as the vocabulary says")


class DetokenizeRequest(_Strict):
    tokens: list[int]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str = "{}"


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    """OpenAI's response_format: text, any JSON object, or JSON following `json_schema.schema`."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="llama.cpp: the schema here")


class _OpenAIBase(_Constrained):
    """Fields shared by /v1/completions and /v1/chat/completions (top_k, min_p, repeat_penalty and
    repeat_last_n are llama.cpp extensions)."""

    model: str | None = Field(None, description="any name: the loaded model serves every request")
    temperature: float | None = Field(None, ge=0, le=2)
    max_tokens: int | None = Field(None, description=">= 1; clamped to the free context")
    n: int = Field(1, ge=1, le=1, description="only 1 choice is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class FunctionSpec(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, description="alias of max_tokens")
    response_format: ResponseFormat | None = None
    logprobs: bool = Field(False, description="each generated token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="alternatives per token (needs logprobs)")
    tools: list[Tool] | None = Field(None, max_length=64)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class OpenAICompletionRequest(_OpenAIBase):
    prompt: str | list[str] | list[int] = Field(
        description="one prompt: a string, a list of one string, or token ids"
    )
    echo: bool = False
    logprobs: int | None = Field(
        None, ge=0, le=20, description="log-probabilities of the tokens and this many alternatives"
    )
    response_format: ResponseFormat | None = None


class EmbeddingRequest(_Strict):
    """OpenAI `POST /v1/embeddings`: one text, several, token ids, or lists of token ids."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = Field("float", description="base64: float32 little-endian")
    user: str | None = None


class LlamaEmbeddingRequest(_Strict):
    """llama.cpp `POST /embedding`: `content` is a text or a list of texts."""

    content: str | list[str]
