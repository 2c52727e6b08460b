"""`powerinfer main`: generate text from a prompt, as llama.cpp's `main` does."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar

import typer

from powerinfer.app.interactive import InteractiveOptions
from powerinfer.app.main import MainOptions, run_main
from powerinfer.app.pipeline import serve_if_worker
from powerinfer.cli.common import err_console, run_guarded, setup_logging, utf8_argument
from powerinfer.cli.options import (
    ContextShiftArgs,
    EngineArgs,
    LogDisableOpt,
    SamplingArgs,
    SpeculativeArgs,
    takes,
)
from powerinfer.errors import InputError
from powerinfer.textfile import MAX_PROMPT_BYTES, check_output_file, process_escapes, read_text_file


@dataclass(frozen=True)
class InteractiveArgs:
    """The interactive and prompt-cache options of main."""

    PANEL: ClassVar[str] = "Interactive and prompt cache"

    interactive: Annotated[
        bool,
        typer.Option(
            "-i",
            "--interactive",
            help="Interactive: after the reply (a reverse prompt, -n tokens or end of text) read more input "
            "from stdin; Ctrl-C interjects, Ctrl-C at the prompt or end of input quits.",
        ),
    ] = False
    interactive_first: Annotated[
        bool, typer.Option("--interactive-first", help="Interactive, and wait for input before generating.")
    ] = False
    conversation: Annotated[
        bool,
        typer.Option(
            "-cnv",
            "--conversation",
            help="Chat: each input is a user message, formatted with the chat template; the '> ' marker asks.",
        ),
    ] = False
    chat_template: Annotated[
        str | None,
        typer.Option(
            "--chat-template",
            help="-cnv template: a Jinja2 file or a built-in name (chatml, llama3, zephyr, gemma); default: the "
            "model's tokenizer.chat_template, else chatml.",
            show_default=False,
        ),
    ] = None
    system_prompt: Annotated[
        str, typer.Option("-sys", "--system-prompt", help="-cnv system message (default: -p).")
    ] = ""
    reverse_prompt: Annotated[
        list[str] | None,
        typer.Option(
            "-r",
            "--reverse-prompt",
            help="Stop generating when the output ends with this text and (with -i) hand over to the user; "
            "repeatable.",
            show_default=False,
        ),
    ] = None
    in_prefix: Annotated[
        str, typer.Option("--in-prefix", help="-i: text put (and shown) before each input.")
    ] = ""
    in_suffix: Annotated[
        str, typer.Option("--in-suffix", help="-i: text put (and shown) after each input.")
    ] = ""
    multiline_input: Annotated[
        bool,
        typer.Option(
            "--multiline-input",
            help="Input goes on over lines until one ends in \\ (without it, a line ending in \\ goes on); "
            "a line ending in / ends the input without its newline.",
        ),
    ] = False
    prompt_cache: Annotated[
        Path | None,
        typer.Option(
            "--prompt-cache",
            help="Session file: load the evaluated prompt (tokens and KV cache) from it, evaluate only what "
            "is new, save the prompt to it.",
            show_default=False,
        ),
    ] = None
    prompt_cache_all: Annotated[
        bool,
        typer.Option("--prompt-cache-all", help="Save the generated tokens too, at the end of the run."),
    ] = False
    prompt_cache_ro: Annotated[
        bool, typer.Option("--prompt-cache-ro", help="Read the session file, never write it.")
    ] = False

    def options(self, escape: bool) -> InteractiveOptions:
        """InteractiveOptions: texts checked as UTF-8 (and unescaped with -e), the template resolved, the session
        file's folder checked before any work."""

        def text(value: str, option: str) -> str:
            value = utf8_argument(value, option)
            return process_escapes(value) if escape else value

        reverse = tuple(text(r, "-r") for r in self.reverse_prompt or [])
        if any(not r for r in reverse):
            raise InputError("-r: a reverse prompt cannot be empty")
        source, stops = None, ()
        if self.chat_template is not None:
            from powerinfer.chat_templates import chat_template_source

            source, stops = chat_template_source(utf8_argument(self.chat_template, "--chat-template"))
        if self.prompt_cache is not None and not self.prompt_cache_ro:
            check_output_file(self.prompt_cache, "session file")
        if (self.prompt_cache_all or self.prompt_cache_ro) and self.prompt_cache is None:
            raise InputError("--prompt-cache-all and --prompt-cache-ro need --prompt-cache FILE")
        return InteractiveOptions(
            interactive=self.interactive or self.interactive_first or self.conversation,
            interactive_first=self.interactive_first or self.conversation,
            conversation=self.conversation,
            chat_template=source,
            chat_stop=stops,
            system_prompt=text(self.system_prompt, "-sys"),
            reverse_prompts=reverse,
            in_prefix=text(self.in_prefix, "--in-prefix"),
            in_suffix=text(self.in_suffix, "--in-suffix"),
            multiline_input=self.multiline_input,
            prompt_cache=self.prompt_cache,
            prompt_cache_all=self.prompt_cache_all,
            prompt_cache_ro=self.prompt_cache_ro,
        )


@takes(EngineArgs, SamplingArgs, InteractiveArgs, ContextShiftArgs, SpeculativeArgs)
def main(
    engine: EngineArgs,
    sampling: SamplingArgs,
    io: InteractiveArgs,
    shift: ContextShiftArgs,
    speculative: SpeculativeArgs,
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="Prompt text.")] = "",
    file: Annotated[Path | None, typer.Option("-f", "--file", help="Read the prompt from a file.")] = None,
    n_predict: Annotated[
        int, typer.Option("-n", "--n-predict", help="Tokens to generate (-1 = until EOS).")
    ] = -1,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Keep generating past end-of-sequence.")
    ] = False,
    escape: Annotated[
        bool, typer.Option("-e", "--escape", help="Process \\n, \\t ... in the prompt.")
    ] = False,
    verbose_prompt: Annotated[
        bool, typer.Option("--verbose-prompt", help="Print the prompt tokens.")
    ] = False,
    no_display_prompt: Annotated[
        bool, typer.Option("--no-display-prompt", help="Do not echo the prompt.")
    ] = False,
    log_disable: LogDisableOpt = False,
) -> None:
    """Generate text from a prompt (llama.cpp `main`)."""
    setup_logging(log_disable)
    err_console.quiet = log_disable

    def body() -> int:
        text = prompt
        if file is not None:
            text = read_text_file(file, "prompt file", limit=MAX_PROMPT_BYTES)
            text = text[:-1] if text.endswith("\n") else text
        if escape:
            text = process_escapes(text)
        text = utf8_argument(text, "the prompt (-p)")
        if len(text) > MAX_PROMPT_BYTES:
            raise InputError(f"the prompt is longer than {MAX_PROMPT_BYTES >> 20} MiB")
        opts = MainOptions(
            model=engine.model_path(),
            prompt=text,
            n_predict=n_predict,
            ignore_eos=ignore_eos,
            verbose_prompt=verbose_prompt,
            display_prompt=not no_display_prompt,
            engine=engine.options(),
            sampling=sampling.params(),
            interactive=io.options(escape),
            n_keep=shift.checked().keep,
            context_shift=shift.context_shift,
            speculative=speculative.options(),
        )
        if serve_if_worker(opts.model, opts.engine):  # ranks > 0 of a pipeline serve rank 0, then exit
            return 0
        return run_main(opts)

    code = run_guarded(body)
    if code:
        raise typer.Exit(code=code)
