"""The `powerinfer` command line: one Typer app, one module per command."""

from __future__ import annotations

import typer

from powerinfer.cli.batched import batched as batched_command
from powerinfer.cli.convert import convert as convert_command
from powerinfer.cli.main import main as main_command
from powerinfer.cli.perplexity import perplexity_command
from powerinfer.cli.quantize import quantize as quantize_command
from powerinfer.cli.server import server as server_command

app = typer.Typer(
    name="powerinfer",
    help="CPU/GPU hybrid LLM inference with activation sparsity (llama.cpp / PowerInfer compatible).",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)
app.command("main", help="Generate text from a prompt (llama.cpp main).")(main_command)
app.command("profile")(__import__("powerinfer.cli.profile", fromlist=["profile"]).profile)
app.command("train-predictor")(__import__("powerinfer.cli.train_predictor", fromlist=["_"]).train_predictor)
app.command("quantize")(quantize_command)
app.command("perplexity", help="Perplexity of a text file (llama.cpp perplexity).")(perplexity_command)
app.command("batched", help="Decode several sequences in parallel (llama.cpp batched).")(batched_command)
app.command("server", help="Serve a model over HTTP (llama.cpp endpoints and the OpenAI API).")(
    server_command
)
app.command("convert", help="Convert a Hugging Face checkpoint into a PowerInfer or dense GGUF.")(
    convert_command
)


@app.callback()
def _root() -> None:
    """powerinfer: run llama.cpp and PowerInfer GGUF models."""
