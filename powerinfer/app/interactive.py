"""Interactive `main` (-i, --interactive-first, -cnv) and --prompt-cache, as llama.cpp's main does them.

One sequence lives in KV slot 0 for the whole run (`runtime.session.Session`): each turn evaluates only the
tokens the cache does not hold yet, then one `Generator` (the loop every front end uses) samples the reply.
In conversation mode the chat template is rendered for the whole conversation every turn and the common
prefix with the cache is kept. Ctrl-C during a reply ends the reply and returns to the prompt; Ctrl-C at the
prompt ends the run (exit code 130), as does end of input (exit code 0); both print the timings.
Input comes from stdin, a terminal or a pipe alike (a pipe is not echoed).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from powerinfer.app.console import err_console
from powerinfer.app.signals import interrupt_handled
from powerinfer.errors import FormatError, InputError
from powerinfer.runtime.context_shift import held_tokens
from powerinfer.runtime.generate import Event, Generator, GenParams
from powerinfer.runtime.session import Session, common_prefix, load_session, save_session

if TYPE_CHECKING:
    from powerinfer.runtime.engine import Engine
    from powerinfer.runtime.speculative import Speculator
    from powerinfer.sampling import Sampler, SamplingParams
    from powerinfer.server.chat import ChatFormatter


@dataclass(frozen=True)
class InteractiveOptions:
    """The interactive and prompt-cache options of `main`."""

    interactive: bool = False
    interactive_first: bool = False
    conversation: bool = False
    chat_template: str | None = None  # Jinja2 source; None: the model's own
    chat_stop: tuple[str, ...] = ()  # stop strings that come with a built-in template
    system_prompt: str = ""
    reverse_prompts: tuple[str, ...] = ()
    in_prefix: str = ""
    in_suffix: str = ""
    multiline_input: bool = False
    prompt_cache: Path | None = None
    prompt_cache_all: bool = False
    prompt_cache_ro: bool = False

    @property
    def waits_for_input(self) -> bool:
        return self.interactive or self.interactive_first or self.conversation

    @property
    def needs_session(self) -> bool:
        """Whether `main` runs through `run_session` rather than its one-shot path."""
        return self.waits_for_input or bool(self.reverse_prompts) or self.prompt_cache is not None


def read_input(stream: TextIO, multiline: bool) -> str | None:
    """One user input, llama.cpp's way: a line ending in \\ goes on to the next line (with --multiline-input
    lines go on by default and \\ ends the input); a line ending in / ends the input without its newline.
    None at end of input."""
    buffer = ""
    more = True
    while more:
        line = stream.readline()
        if not line:
            return buffer or None
        line = line.rstrip("\r\n")
        more = multiline
        if line.endswith("/"):
            return buffer + line[:-1]
        if line.endswith("\\"):
            line = line[:-1]
            more = not more
        buffer += line + "\n"
    return buffer


def chat_tokens(fmt: ChatFormatter, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
    """The conversation's prompt tokens; without the assistant's opening when add_generation_prompt is False."""
    if add_generation_prompt:
        return fmt.tokens(messages)
    tok = fmt.tokenizer
    text = fmt.render(messages, add_generation_prompt=False)
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
    return tok.encode(text, add_bos=tok.add_bos and not (bos and text.startswith(bos)), parse_special=True)


def chat_formatter(engine: Engine, template: str | None) -> ChatFormatter:
    """The server's chat formatter (Jinja2, from the `server` extra) for -cnv."""
    try:
        from powerinfer.server.chat import ChatFormatter
    except ImportError:
        raise InputError("-cnv needs jinja2: pip install 'powerinfer[server]'") from None
    return ChatFormatter(engine.tokenizer, template)


class PromptCache:
    """--prompt-cache FILE: the session file loaded at start and saved after the first evaluation (all of the
    run with --prompt-cache-all, at the end; never with --prompt-cache-ro)."""

    def __init__(self, path: Path, save_all: bool, read_only: bool) -> None:
        self.path = path
        self.save_all = save_all
        self.read_only = read_only
        self.loaded: list[int] = []
        self.pending = True  # the first evaluation is still to be reported and saved

    def load(self, engine: Engine) -> list[int]:
        err = err_console
        if not self.path.exists():
            err.print("main: session file does not exist, will create.", markup=False)
            return []
        err.print(f"main: attempting to load saved session from '{self.path}'", markup=False)
        try:
            self.loaded = load_session(self.path, engine)
        except FormatError as e:
            err.print(
                f"main: warning: cannot use session file '{self.path}': {e}; starting fresh", markup=False
            )
            return []
        err.print(f"main: loaded a session with prompt size of {len(self.loaded)} tokens", markup=False)
        return self.loaded

    def first_evaluation(self, engine: Engine, tokens: list[int]) -> None:
        """Report how much of `tokens` (just evaluated) the file held; save them if the file held less."""
        if not self.pending:
            return
        self.pending = False
        n_match = common_prefix(self.loaded, tokens)
        err = err_console
        if self.loaded:
            if n_match == len(tokens):
                err.print("main: using full prompt from session file", markup=False)
            elif n_match >= len(tokens) / 2:
                err.print(
                    f"main: session file matches {n_match} / {len(tokens)} tokens of prompt", markup=False
                )
            else:
                err.print(
                    f"main: warning: session file has low similarity to prompt ({n_match} / {len(tokens)} "
                    "tokens); will mostly be reevaluated",
                    markup=False,
                )
        if n_match < len(tokens) and not self.read_only:
            save_session(self.path, engine, tokens)

    def finish(self, engine: Engine, tokens: list[int]) -> None:
        if self.save_all and not self.read_only and tokens:
            err_console.print(f"\nmain: saving final output to session file '{self.path}'", markup=False)
            save_session(self.path, engine, tokens)


def _banner(io: InteractiveOptions) -> None:
    err = err_console
    err.print("main: interactive mode on.", markup=False)
    for r in io.reverse_prompts:
        err.print(f"Reverse prompt: '{r}'", markup=False)
    if io.in_prefix and not io.conversation:
        err.print(f"Input prefix: '{io.in_prefix}'", markup=False)
    if io.in_suffix and not io.conversation:
        err.print(f"Input suffix: '{io.in_suffix}'", markup=False)
    lines = [
        "== Running in interactive mode. ==",
        " - Press Ctrl+C to interject at any time.",
        " - Press Ctrl+C at the prompt, or Ctrl+D (end of input), to quit.",
        " - Press Return to return control to the AI." if not io.conversation else "",
        " - To return control without starting a new line, end your input with '/'.",
        " - If you want to submit another line, end your input with '\\'."
        if not io.multiline_input
        else " - Input goes on over lines; end it with '\\' (or '/' to leave out the last newline).",
    ]
    for line in lines:
        if line:
            err.print(line, markup=False)


class InteractiveRun:
    """The state of one interactive (or prompt-cached) `main` run over KV slot 0."""

    def __init__(
        self,
        engine: Engine,
        sampler: Sampler,
        io: InteractiveOptions,
        sampling: SamplingParams,
        n_predict: int,
        ignore_eos: bool,
        out: TextIO,
        stdin: TextIO,
        n_keep: int | None = None,
    ) -> None:
        """n_keep: shift a full context keeping that many tokens (runtime.context_shift); None: stop there."""
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.sampler = sampler
        self.io = io
        self.out = out
        self.stdin = stdin
        self.session = Session(engine)
        self.gen = Generator(engine, keep=True)
        self.fmt = chat_formatter(engine, io.chat_template) if io.conversation else None
        stops = io.reverse_prompts + io.chat_stop + (self.fmt.stop if self.fmt is not None else ())
        self.n_keep = n_keep
        self.params = GenParams(
            sampling=sampling,
            n_predict=n_predict,
            ignore_eos=ignore_eos,
            stop=stops,
            context_shift=n_keep is not None,
            n_keep=n_keep or 0,
        )
        self.cache = (
            PromptCache(io.prompt_cache, io.prompt_cache_all, io.prompt_cache_ro)
            if io.prompt_cache is not None
            else None
        )

    def write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()

    def evaluate(self, tokens: list[int], logits: bool = True) -> Any:
        """Bring the cache to `tokens`; their last logits (None without `logits` when the cache held them)."""
        tokens = self.fit(tokens)
        logits, _ = self.session.sync(tokens, logits)
        if self.cache is not None:
            self.cache.first_evaluation(self.engine, tokens)
        return logits

    def fit(self, tokens: list[int]) -> list[int]:
        """`tokens` as the cache will hold them: shifted to leave room when context shift is on."""
        return tokens if self.n_keep is None else self.session.make_room(tokens, self.n_keep)

    def _show(self, ev: Event) -> None:
        self.write(ev.text)
        if ev.end == "stop" and ev.stopping_word in self.io.reverse_prompts:
            self.write(ev.stopping_word)

    def reply(self, context: list[int]) -> tuple[list[int], str, str]:
        """Generate after `context`: (the tokens of the sequence now, the reply's text, how it ended:
        eos | stop | length | interrupted). Ctrl-C ends the reply only when the run is interactive.

        The reply's last text is shown once generation is over, so that a Ctrl-C sent on seeing it (a reverse
        prompt) reaches the prompt and ends the run, as the user means it to."""
        seq = None
        final: Event | None = None
        end = "length"
        try:
            context = self.fit(context)
            logits = self.evaluate(context)
            events = self.gen.start(0, context, self.params, self.sampler, logits)
            seq = events[0].seq
            while True:
                for ev in events:
                    if ev.end is None:
                        self._show(ev)
                    else:
                        final = ev
                if not self.gen.live:
                    break
                events = self.gen.step()
        except KeyboardInterrupt:
            if not self.io.waits_for_input:
                raise
            interrupt_handled()
            end = "interrupted"
            final = self.gen.end(0) or final
        if final is not None:
            seq = final.seq
            self._show(final)
            end = end if end == "interrupted" else final.end or end
        history = held_tokens(seq) if seq is not None else context
        self.session.settle(history)
        return list(history), seq.text if seq is not None else "", end

    def run(self, prompt: str, prompt_ids: list[int], display_prompt: bool) -> int:
        """The whole run; the exit code (0, or 130 for Ctrl-C at the prompt)."""
        io = self.io
        if self.cache is not None:
            self.session.cached = self.cache.load(self.engine)
        if io.waits_for_input:
            _banner(io)
        try:
            if self.fmt is not None:
                self._conversation(prompt)
            else:
                self._completion(prompt, prompt_ids, display_prompt)
            code = 0
        except KeyboardInterrupt:  # at the prompt: the end of the run
            if not io.waits_for_input:
                raise
            interrupt_handled()
            code = 130
        self.write("\n")
        if self.cache is not None:
            self.cache.finish(self.engine, self.session.cached)
        return code

    def _completion(self, prompt: str, prompt_ids: list[int], display_prompt: bool) -> None:
        """-i / --interactive-first (or only -r / --prompt-cache): the prompt, then user input appended as text."""
        io, tok = self.io, self.tokenizer
        if len(prompt_ids) > self.engine.n_ctx - 4:
            raise InputError(
                f"prompt is too long ({len(prompt_ids)} tokens, max {self.engine.n_ctx - 4} for -c "
                f"{self.engine.n_ctx})"
            )
        if display_prompt:
            self.write(prompt)
        context = prompt_ids
        if io.interactive_first:
            self.evaluate(context, logits=False)
        else:
            context, _, end = self.reply(context)
            if not io.waits_for_input:
                return
            context = context + self._after_reply(end)
        while True:
            if io.in_prefix:
                self.write(io.in_prefix)
            text = read_input(self.stdin, io.multiline_input)
            if text is None:
                return
            if text.strip("\n"):
                if io.in_suffix:
                    self.write(io.in_suffix)
                context = (
                    context
                    + tok.encode(io.in_prefix, add_bos=False, parse_special=True)
                    + tok.encode(text, add_bos=False, parse_special=False)
                    + tok.encode(io.in_suffix, add_bos=False, parse_special=True)
                )
            context, _, end = self.reply(context)
            context = context + self._after_reply(end)

    def _after_reply(self, end: str) -> list[int]:
        """After an end-of-generation token the first reverse prompt is shown and goes into the context, so the
        user answers in turn (llama.cpp injects it the same way)."""
        if end != "eos" or not self.io.reverse_prompts:
            return []
        first = self.io.reverse_prompts[0]
        self.write("\n" + first)
        return self.tokenizer.encode(first, add_bos=False, parse_special=True)

    def _conversation(self, prompt: str) -> None:
        """-cnv: messages rendered with the chat template; the system prompt is -sys, else -p."""
        assert self.fmt is not None
        system = self.io.system_prompt or prompt
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if messages:
            self.evaluate(chat_tokens(self.fmt, messages, add_generation_prompt=False), logits=False)
        while True:
            self.write("\n> ")
            text = read_input(self.stdin, self.io.multiline_input)
            if text is None:
                return
            content = text[:-1] if text.endswith("\n") else text
            if not content.strip():
                continue
            messages.append({"role": "user", "content": content})
            _, answer, _ = self.reply(chat_tokens(self.fmt, messages, add_generation_prompt=True))
            messages.append({"role": "assistant", "content": answer})
            self.write("\n")


def run_session(
    engine: Engine,
    sampler: Sampler,
    io: InteractiveOptions,
    sampling: SamplingParams,
    prompt: str,
    prompt_ids: list[int],
    n_predict: int,
    ignore_eos: bool,
    display_prompt: bool,
    n_keep: int | None = None,
    spec: Speculator | None = None,
) -> int:
    """Run interactive `main` on stdin and stdout (with `spec`, speculative decoding); the exit code."""
    stdin = sys.stdin
    if hasattr(
        stdin, "reconfigure"
    ):  # bytes typed or piped that are not UTF-8 become U+FFFD, not a traceback
        stdin.reconfigure(errors="replace")
    run = InteractiveRun(engine, sampler, io, sampling, n_predict, ignore_eos, sys.stdout, stdin, n_keep)
    run.gen.spec = spec
    return run.run(prompt, prompt_ids, display_prompt)
