"""Chat messages to prompt tokens through the model's Jinja2 chat template, rendered in Jinja2's sandbox."""

from __future__ import annotations

import datetime
import functools
from collections.abc import Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from powerinfer.errors import InputError
from powerinfer.tokenizer import Tokenizer

# Used when the GGUF has no `tokenizer.chat_template` (llama.cpp falls back to ChatML as well).
# On a vocabulary without the ChatML tokens the markers are plain text, so "<|im_end|>" is also a stop string.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
FALLBACK_STOP = ("<|im_end|>",)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    # the settings of transformers' apply_chat_template
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatFormatter:
    """Renders OpenAI-style messages with a chat template and tokenizes the result."""

    def __init__(self, tokenizer: Tokenizer, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        source = template if template is not None else tokenizer.chat_template
        self.fallback = not source
        self.template = source or FALLBACK_TEMPLATE
        self.stop: tuple[str, ...] = FALLBACK_STOP if self.fallback else ()
        try:
            _compile(self.template)
        except jinja2.exceptions.TemplateError as e:
            raise InputError(f"the chat template does not compile: {e}") from None

    def _special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.tokenizer.token_text(token_id)

    @property
    def renders_tools(self) -> bool:
        """Whether the template reads the `tools` variable (else the tools go into a system message)."""
        return "tools" in self.template

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text of a conversation; template errors (e.g. roles out of order) raise InputError."""
        try:
            return _compile(self.template).render(
                messages=list(messages),
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._special_text(self.tokenizer.bos_id),
                eos_token=self._special_text(self.tokenizer.eos_id),
            )
        except jinja2.exceptions.SecurityError as e:
            raise InputError(f"chat template refused by the sandbox: {e}") from None
        except jinja2.exceptions.TemplateError as e:
            raise InputError(f"chat template error: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise InputError(f"chat template failed on these messages: {e}") from None

    def tokens(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Prompt token ids: the rendered text with special tokens parsed; BOS added as the vocabulary says,
        unless the template already wrote it."""
        text = self.render(messages, tools=tools)
        tok = self.tokenizer
        bos = self._special_text(tok.bos_id)
        add_bos = tok.add_bos and not (bos and text.startswith(bos))
        return tok.encode(text, add_bos=add_bos, parse_special=True)
