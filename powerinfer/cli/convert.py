"""`powerinfer convert`: a Hugging Face checkpoint (+ predictor folder) into a PowerInfer or dense GGUF."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from powerinfer.cli.common import err_console, run_guarded
from powerinfer.convert import ConversionResult, convert_checkpoint


def _convert(
    hf_dir: Path, predictor_dir: Path | None, outfile: Path, outtype: str, dense: bool
) -> ConversionResult:
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=err_console,
        transient=True,
    ) as progress:
        task = progress.add_task("converting", total=None)

        def on_tensor(name: str, index: int, total: int) -> None:
            progress.update(task, description=name, completed=index, total=total)

        return convert_checkpoint(
            hf_dir, outfile, predictor_dir=predictor_dir, outtype=outtype, dense=dense, on_tensor=on_tensor
        )


def convert(
    hf_dir: Annotated[
        Path,
        typer.Argument(
            help="Hugging Face model folder (config.json, *.safetensors, tokenizer).", show_default=False
        ),
    ],
    predictor_dir: Annotated[
        Path | None,
        typer.Argument(
            help="PowerInfer predictor folder (model_<N>.pt, config.json); omit for a dense GGUF.",
            show_default=False,
        ),
    ] = None,
    *,
    outfile: Annotated[Path, typer.Option("--outfile", "-o", help="Output GGUF file.", show_default=False)],
    outtype: Annotated[str, typer.Option("--outtype", help="Type of 2-D tensors: f32, f16 or q8_0.")] = "f16",
    dense: Annotated[
        bool, typer.Option("--dense", help="Write a plain llama.cpp GGUF (ffn_down, no predictors).")
    ] = False,
) -> None:
    """Convert a Hugging Face Llama/Bamboo/Falcon/OPT (PowerInfer GGUF or dense) or Mistral/Qwen2/Qwen3/Gemma 3/Phi-3 (dense) checkpoint."""
    result = run_guarded(_convert, hf_dir, predictor_dir, outfile, outtype, dense)
    kind = "PowerInfer (PWRI)" if result.sparse else "dense GGUF"
    typer.echo(
        f"wrote {result.path}: {kind}, {result.outtype}, {result.n_tensors} tensors, {result.n_kv} KVs, "
        f"{result.n_bytes} bytes"
    )
