"""Chat messages to prompt tokens through the model's Jinja2 chat template, rendered in Jinja2's sandbox with
bounds: a template (the user's --chat-template, or a model file's own, rendered on every chat request) may not
repeat a string or list past RENDER_MAX_CHARS, make more than RENDER_MAX_RANGE items of range() in one render,
raise a huge power, write more than RENDER_MAX_CHARS, or run longer than RENDER_SECONDS; each is one InputError."""

from __future__ import annotations

import ctypes
import datetime
import functools
import threading
from collections.abc import Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

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


RENDER_MAX_CHARS = 1 << 22  # 4 Mi characters of output (and of any repeated string or list)
RENDER_MAX_RANGE = 1 << 20  # range() items per render, all calls together
RENDER_MAX_EXPONENT = 4096  # x ** n with |n| above this is refused (big-integer powers take unbounded time)
RENDER_SECONDS = 5.0  # wall-clock limit of one render


class RenderTimeout(BaseException):
    """Raised inside a render that ran past RENDER_SECONDS (sent to its thread by the watchdog). A BaseException,
    as KeyboardInterrupt is: an interrupt, not the template's error, so no `except Exception` on its way out
    swallows it."""


class _Budget:
    """One render's: its range() items left, and the watchdog's state."""

    def __init__(self) -> None:
        self.range_left = RENDER_MAX_RANGE
        self.lock = threading.Lock()
        self.done = False
        self.fired = False

    def range(self, *args: int) -> range:
        """The template's range() during this render (passed as a render variable, so it shadows the global)."""
        r = range(*args)
        self.range_left -= len(r)
        if self.range_left < 0:
            raise SecurityError(f"range() made more than {RENDER_MAX_RANGE} items in one render")
        return r


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox with repetition and power bounded (the other operators cannot grow a value past its inputs)."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if (
                    isinstance(seq, (str, list, tuple))
                    and isinstance(n, int)
                    and len(seq) * n > RENDER_MAX_CHARS
                ):
                    raise SecurityError(f"repetition past {RENDER_MAX_CHARS} items")
        if operator == "**" and isinstance(right, int) and abs(right) > RENDER_MAX_EXPONENT:
            raise SecurityError(f"power with an exponent above {RENDER_MAX_EXPONENT}")
        return super().call_binop(context, operator, left, right)


def _send_timeout(thread_id: int) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(RenderTimeout))


def _interrupt(thread_id: int, budget: _Budget) -> None:
    """The watchdog: RenderTimeout into the render's thread, once, unless the render is done."""
    with budget.lock:
        if budget.done:
            return
        budget.fired = True
        _send_timeout(thread_id)


def _land_timeout(thread_id: int) -> None:
    """Raises here the RenderTimeout sent to this thread that has not landed yet: sent again from this thread
    (one pending exception per thread: this replaces it) and raised at the loop's first eval-breaker check."""
    _send_timeout(thread_id)
    for _ in range(1 << 24):
        pass


def render_bounded(template: jinja2.Template, **variables: Any) -> str:
    """template.render(**variables) within the bounds of this module (SecurityError or RenderTimeout).

    The time limit interrupts the render's thread with an asynchronous exception (the only way to stop pure
    Python, e.g. an empty loop of 1e10 items, without a hook in it). It is never taken back: clearing it with
    PyThreadState_SetAsyncExc(id, NULL) leaves CPython 3.11's eval breaker set for good (its async flag is
    cleared only when an exception lands), and then every profiled or traced function call spins without end.
    An exception sent lands in this function, whatever the race: in the render, in the `finally`, or in
    _land_timeout when it was still pending once the render ended. Renders of one process run one at a time
    (the server's event loop, the interactive loop): on CPython 3.11 two threads with pending async exceptions
    can lose one's signal."""
    budget = _Budget()
    thread_id = threading.get_ident()
    watchdog = threading.Timer(RENDER_SECONDS, _interrupt, (thread_id, budget))
    watchdog.daemon = True
    watchdog.start()
    landed = False
    try:
        pieces, n = [], 0
        for piece in template.generate(**variables, range=budget.range):
            n += len(piece)
            if n > RENDER_MAX_CHARS:
                raise SecurityError(f"the rendered prompt passed {RENDER_MAX_CHARS} characters")
            pieces.append(piece)
        return "".join(pieces)
    except RenderTimeout:
        landed = True
        raise
    finally:
        watchdog.cancel()
        with budget.lock:
            budget.done = True  # no exception is sent after this
        if budget.fired and not landed:
            _land_timeout(thread_id)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    # the settings of transformers' apply_chat_template
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)
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
            return render_bounded(
                _compile(self.template),
                messages=list(messages),
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._special_text(self.tokenizer.bos_id),
                eos_token=self._special_text(self.tokenizer.eos_id),
            )
        except RenderTimeout:
            raise InputError(f"chat template ran longer than {RENDER_SECONDS:g} s") from None
        except jinja2.exceptions.SecurityError as e:
            raise InputError(f"chat template refused by the sandbox: {e}") from None
        except jinja2.exceptions.TemplateError as e:
            raise InputError(f"chat template error: {e}") from None
        except RecursionError:
            raise InputError("chat template recursed too deep") from None
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError, MemoryError) as e:
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
