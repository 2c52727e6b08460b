"""`powerinfer sparsify`: make a sparse PowerInfer GGUF from a dense SiLU/GELU model, without training (CATS)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from powerinfer.app.sparsify import run_sparsify_report
from powerinfer.cli.common import (
    err_console,
    resolve_model,
    run_guarded,
    setup_logging,
)
from powerinfer.cli.options import LogDisableOpt, ModelOpt, ThreadsOpt, threads
from powerinfer.cli.profile import CorpusOpt
from powerinfer.quant.types import DOWN_T_DEFAULT, DOWN_T_TYPES

if TYPE_CHECKING:
    pass


class Method(str, Enum):
    cats = "cats"
    teal = "teal"
    predictor = "predictor"


class Allocation(str, Enum):
    greedy = "greedy"
    uniform = "uniform"


def sparsify(
    model: ModelOpt = None,
    file: CorpusOpt = ...,  # type: ignore[assignment]
    sparsity: Annotated[
        float,
        typer.Option(
            "--sparsity",
            help="Target mean share of FFN neurons skipped per token, in [0, 0.95] (each layer at most 0.95).",
            show_default=False,
        ),
    ] = ...,  # type: ignore[assignment]
    method: Annotated[
        Method,
        typer.Option(
            "--method",
            help="cats (FFN neurons by gate thresholds) or teal (every matrix's inputs by magnitude; "
            "Llama-layout models, uniform allocation); predictor: not built yet.",
        ),
    ] = Method.cats,
    allocation: Annotated[
        Allocation,
        typer.Option(
            "--allocation",
            help="Per-layer sparsity: uniform (every layer at the target) or greedy (on per-layer output-error "
            "curves, mean = target; helps one-stage files from S = 0.4 up; teal: within each layer, per input).",
        ),
    ] = Allocation.uniform,
    up_ratio: Annotated[
        float,
        typer.Option(
            "--up-ratio",
            help="Share of a layer's skipped neurons whose up rows are skipped too, in [0, 1]. Below 1, two "
            "stages: a looser gate threshold picks the up rows to read, then |act(gate x) * up x| * ||down col|| "
            "picks the active neurons; 1 = one stage (CATS as published).",
        ),
    ] = 0.5,
    output: Annotated[
        Path | None,
        typer.Option(
            "-o",
            "--output",
            help="Output PowerInfer GGUF (default: IN with .gguf replaced by .sparse.powerinfer.gguf). "
            "activation/ is written beside it, replacing one already there.",
            show_default=False,
        ),
    ] = None,
    ctx_size: Annotated[int, typer.Option("-c", "--ctx-size", help="Calibration window in tokens.")] = 512,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Calibration tokens used (0 = the whole file).")
    ] = 4096,
    down_type: Annotated[
        str | None,
        typer.Option(
            "--down-type",
            help=f"Type of the transposed down projection ffn_down_t: {', '.join(t.name for t in DOWN_T_TYPES)} "
            f"(default: the input's float or {DOWN_T_DEFAULT.name} type as it is, {DOWN_T_DEFAULT.name} for "
            "lower-bit inputs: a second rounding to 5 bits cost the bundled SmolLM2 +1.7% perplexity at S = 0.4, "
            "to 4 bits +8%).",
            show_default=False,
        ),
    ] = None,
    sparse_head: Annotated[
        bool,
        typer.Option(
            "--sparse-head/--no-sparse-head",
            help="Also write a screen of the output head (exact logits only for the rows it ranks first), "
            "where the head is large enough for it to pay.",
        ),
    ] = True,
    mix: Annotated[
        bool,
        typer.Option(
            "--mix/--no-mix",
            help="Calibrate the thresholds on the text of -f (at most half of --max-tokens) and as many tokens of "
            "the packaged prose, code documentation, dialogue and docstrings (--no-mix: -f alone). The head's "
            "screen always uses both.",
        ),
    ] = False,
    quality: Annotated[
        bool,
        typer.Option(
            "--quality/--no-quality",
            help="Score the output against the input (perplexity, KL divergence) on a held-out slice of the "
            "calibration text and on packaged prose, code documentation and dialogue; warn when they differ.",
        ),
    ] = True,
    threads_: ThreadsOpt = 0,
    log_disable: LogDisableOpt = False,
) -> None:
    """Sparsify a dense SiLU/GELU gated model without training (CATS): per-neuron thresholds on |act(gate x)|
    and, in two stages (the default), on |act(gate x) * up x|.

    Calibrates on the text of -f, writes a PowerInfer GGUF (ffn_down stored transposed as ffn_down_t, the
    thresholds as per-layer tensors) and activation/activation_<N>.pt beside it; MoE files: one-stage thresholds
    per expert, as a key of a GGUF copy. Prints a per-layer table on stderr and one JSON line on stdout.
    """
    setup_logging(log_disable)
    err_console.quiet = log_disable

    def body() -> None:
        from powerinfer.sparsify import SparsifyOptions, default_output

        path = resolve_model(model)
        opts = SparsifyOptions(
            model=path,
            corpus=file,
            output=output if output is not None else default_output(path),
            sparsity=sparsity,
            method=method.value,
            allocation=allocation.value,
            up_ratio=up_ratio,
            n_ctx=ctx_size,
            n_threads=threads(threads_),
            max_tokens=max_tokens,
            sparse_head=sparse_head,
            down_type=down_type,
            quality=quality,
            mix=mix,
        )
        run_sparsify_report(opts)

    run_guarded(body)
