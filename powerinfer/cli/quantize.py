"""`powerinfer quantize`: llama.cpp's quantize tool (usage, type names, per-tensor log)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from powerinfer.app.quantize import run_quantize
from powerinfer.cli.common import run_guarded, setup_logging
from powerinfer.cli.options import threads
from powerinfer.errors import InputError
from powerinfer.printable import printable
from powerinfer.quant import FLOAT_TYPES
from powerinfer.quant.mix import RULES_HELP
from powerinfer.quant.types import FILE_TYPE_ALIASES, TYPES
from powerinfer.quantize import (
    FILE_TYPES,
    QuantizeOptions,
    default_output,
    parse_file_type,
    require_file_type,
    require_tensor_type,
)
from powerinfer.textfile import check_output_file


def _aliases() -> str:
    names = list(FILE_TYPE_ALIASES)
    return f"{', '.join(names[:-1])} and {names[-1]} mean the _M mixes"


def _fallbacks() -> str:
    """The registry's fallbacks as 'A/B -> C, ...': sources grouped by target, in registry order."""
    by_target: dict[str, list[str]] = {}
    for t, row in TYPES.items():
        if row.fallback is not None:
            by_target.setdefault(row.fallback.name, []).append(t.name)
    return ", ".join(f"{'/'.join(sources)} -> {target}" for target, sources in by_target.items())


HELP = (
    "Quantize a GGUF or PowerInfer GGUF file: IN [OUT] TYPE [NTHREADS] (llama.cpp quantize).\n\n"
    f"TYPE is a name (case-insensitive; {_aliases()}) or llama.cpp ftype number: "
    + ", ".join(f"{ft.name}" + (f" ({ft.ftype})" if ft.ggml_type is not None else "") for ft in FILE_TYPES)
    + ". Without OUT the output is <input dir>/ggml-model-<TYPE>.gguf. NTHREADS <= 0: all cores.\n\n"
    "Only 2-D tensors whose names end in 'weight' are converted (not norms); 1-D tensors keep their type. "
    f"Unless --pure, quantized targets follow llama.cpp's per-tensor rules: {RULES_HELP}, and a 32-element type "
    f"when a row length is not a multiple of 256 ({_fallbacks()}). Float targets "
    f"({', '.join(t.name for t in TYPES if t in FLOAT_TYPES)}) convert every eligible tensor to that type. "
    "PowerInfer (PWRI) files stay PWRI. Logs and timings go to stderr."
)


def parse_positionals(args: list[str]) -> tuple[Path, Path, str, int]:
    """IN [OUT] TYPE [NTHREADS], resolved as quantize.cpp does: a second argument that is a type is TYPE."""
    if len(args) < 2 or len(args) > 4:
        raise InputError(
            "usage: powerinfer quantize [--allow-requantize] [--leave-output-tensor] [--pure] "
            "IN [OUT] TYPE [NTHREADS]"
        )
    inp = Path(args[0])
    rest = args[1:]
    first = parse_file_type(rest[0])
    if first is not None and len(rest) <= 2:
        out, type_text, extra = default_output(inp, first), rest[0], rest[1:]
    elif len(rest) == 1:
        require_file_type(rest[0])
        raise AssertionError("unreachable")
    else:
        out, type_text, extra = Path(rest[0]), rest[1], rest[2:]
    n_threads = 0
    if extra:
        try:
            n_threads = int(extra[0])
        except ValueError:
            raise InputError(f"invalid nthreads '{printable(extra[0], 40)}': expected an integer") from None
    return inp, out, type_text, n_threads


def quantize(
    args: Annotated[
        list[str],
        typer.Argument(
            metavar="IN [OUT] TYPE [NTHREADS]",
            show_default=False,
            help="Input GGUF, optional output, type, optional threads.",
        ),
    ],
    allow_requantize: Annotated[
        bool,
        typer.Option(
            "--allow-requantize", help="Allow requantizing already quantized tensors (loses quality)."
        ),
    ] = False,
    leave_output_tensor: Annotated[
        bool,
        typer.Option(
            "--leave-output-tensor", help="Leave output.weight as it is (bigger file, better quality)."
        ),
    ] = False,
    pure: Annotated[
        bool,
        typer.Option("--pure", help="Every eligible tensor to TYPE: no mix, output.weight or fc1/fc2 rules."),
    ] = False,
    output_tensor_type: Annotated[
        str | None,
        typer.Option(
            "--output-tensor-type", metavar="GGML_TYPE", help="output.weight's type (a ggml type name)."
        ),
    ] = None,
    token_embedding_type: Annotated[
        str | None,
        typer.Option(
            "--token-embedding-type", metavar="GGML_TYPE", help="token_embd.weight's type (a ggml type name)."
        ),
    ] = None,
) -> None:
    setup_logging(False)

    def body() -> None:
        inp, out, type_text, n_threads = parse_positionals(args)
        check_output_file(out)  # before the banner and the work: a FIFO or device at OUT is never replaced
        opts = QuantizeOptions(
            input=inp,
            output=out,
            file_type=require_file_type(type_text),
            n_threads=threads(n_threads),
            allow_requantize=allow_requantize,
            leave_output_tensor=leave_output_tensor,
            pure=pure,
            output_tensor_type=require_tensor_type(output_tensor_type, "--output-tensor-type"),
            token_embedding_type=require_tensor_type(token_embedding_type, "--token-embedding-type"),
        )
        run_quantize(opts)

    run_guarded(body)


quantize.__doc__ = HELP
