"""`powerinfer convert`: a Hugging Face checkpoint (+ predictor folder) into a PowerInfer or dense GGUF."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from powerinfer.app.convert import print_converted, run_convert
from powerinfer.cli.common import run_guarded
from powerinfer.quant.types import CONVERT_FILE_TYPES

_OUTTYPES = (
    ", ".join(name.lower() for name in CONVERT_FILE_TYPES[:-1]) + f" or {CONVERT_FILE_TYPES[-1].lower()}"
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
    outtype: Annotated[str, typer.Option("--outtype", help=f"Type of 2-D tensors: {_OUTTYPES}.")] = "f16",
    dense: Annotated[
        bool, typer.Option("--dense", help="Write a plain llama.cpp GGUF (ffn_down, no predictors).")
    ] = False,
) -> None:
    """Convert a Hugging Face Llama/Bamboo/Falcon/OPT (PowerInfer GGUF or dense) or Mistral/Qwen2/Qwen3/Gemma 3/Phi-3 (dense) checkpoint."""
    print_converted(run_guarded(run_convert, hf_dir, predictor_dir, outfile, outtype, dense))
