"""The `powerinfer` command line: one Typer app, one module per command.

Importing this package is light (typer, rich): the command modules, and with them torch, are imported when the
app first builds its commands, that is inside `app()`, after the signal handlers are in place. So Ctrl-C during
the second or two of imports prints one line like any other interrupt instead of a traceback.
"""

from __future__ import annotations

import sys
from typing import Any

import typer
from typer.models import CommandInfo

from powerinfer.app.signals import (
    deferred_signals,
    exit_code_of_interrupt,
    install_signal_handlers,
    raise_pending_signal,
)


def _register(app: typer.Typer) -> None:
    from powerinfer.cli.batched import batched
    from powerinfer.cli.bench import bench
    from powerinfer.cli.convert import convert
    from powerinfer.cli.main import main
    from powerinfer.cli.perplexity import perplexity_command
    from powerinfer.cli.profile import profile
    from powerinfer.cli.quantize import quantize
    from powerinfer.cli.server import server
    from powerinfer.cli.sparsify import sparsify
    from powerinfer.cli.train_predictor import train_predictor

    app.command("main", help="Generate text from a prompt (llama.cpp main).")(main)
    app.command("profile")(profile)
    app.command("train-predictor")(train_predictor)
    app.command("sparsify")(sparsify)
    app.command("quantize")(quantize)
    app.command("perplexity", help="Perplexity of a text file (llama.cpp perplexity).")(perplexity_command)
    app.command("batched", help="Decode several sequences in parallel (llama.cpp batched).")(batched)
    app.command("bench", help="Measure prompt and decode speed (llama.cpp llama-bench).")(bench)
    app.command("server", help="Serve a model over HTTP (llama.cpp endpoints and the OpenAI API).")(server)
    app.command("convert", help="Convert a Hugging Face checkpoint into a PowerInfer or dense GGUF.")(convert)


class PowerInferApp(typer.Typer):
    """The Typer app, with its commands registered on first use and interrupts handled around the whole run."""

    def __init__(self, **kwargs: Any) -> None:
        self._loaded = False
        super().__init__(**kwargs)

    @property  # type: ignore[override]
    def registered_commands(self) -> list[CommandInfo]:
        if not self._loaded:
            self._loaded = True
            with deferred_signals():  # the imports of torch and numpy are not interrupted half-way
                _register(self)
        return self._commands

    @registered_commands.setter
    def registered_commands(self, value: list[CommandInfo]) -> None:
        self._commands = value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        install_signal_handlers()
        try:
            result = super().__call__(*args, **kwargs)
            raise_pending_signal()
            return result
        except KeyboardInterrupt as e:  # outside a command body: while importing or parsing
            sys.exit(exit_code_of_interrupt(e))
        except SystemExit:
            try:  # a signal whose exception something swallowed, with no command body to report it
                raise_pending_signal()
            except KeyboardInterrupt as e:
                sys.exit(exit_code_of_interrupt(e))
            raise


app = PowerInferApp(
    name="powerinfer",
    help="CPU/GPU hybrid LLM inference with activation sparsity (llama.cpp / PowerInfer compatible).",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """powerinfer: run llama.cpp and PowerInfer GGUF models."""
