"""`sparsify`: the run with a progress bar per stage, the per-layer table on stderr and one JSON line on stdout."""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack

from rich.progress import Progress, TaskID
from rich.table import Table

from powerinfer.app.console import err_console, progress_bar
from powerinfer.sparsify import SparsifyOptions, SparsifyResult, run_sparsify
from powerinfer.sparsify.quality import spread_warning


def teal_table(result: SparsifyResult) -> Table:
    """Per layer (TEAL): sparsity, and for each input the share of calibration inputs above its threshold."""
    assert result.input_kept is not None
    table = Table(
        title=f"TEAL sparsity {result.target} ({result.allocation}) over {result.n_tokens} tokens: the share of each "
        "input kept"
    )
    for name in ("layer", "sparsity", "q/k/v", "o", "gate/up", "down"):
        table.add_column(name, justify="right")
    for layer, (s, kept) in enumerate(zip(result.layer_sparsity, result.input_kept, strict=True)):
        table.add_row(str(layer), f"{s:.3f}", *(f"{k:.1%}" for k in kept))
    return table


def sparsity_table(result: SparsifyResult) -> Table:
    """Per layer: calibrated sparsity, threshold, active share on the calibration text, estimated error."""
    if result.input_kept is not None:
        return teal_table(result)
    table = Table(
        title=f"CATS sparsity {result.target} ({result.allocation}, "
        f"{'one stage' if result.up_ratio >= 1 else f'two stages, up ratio {result.up_ratio:g}'}) over "
        f"{result.n_tokens} tokens ({result.n_ff} neurons per layer)"
    )
    for name in ("layer", "sparsity", "threshold", "active", "up read", "est. error"):
        table.add_column(name, justify="right")
    errors = [None] * len(result.thresholds) if result.est_error is None else list(result.est_error)
    rows = zip(
        result.layer_sparsity, result.thresholds, result.active_share, result.up_share, errors, strict=True
    )
    for layer, (s, t, a, up, e) in enumerate(rows):
        table.add_row(
            str(layer), f"{s:.3f}", f"{t:.4g}", f"{a:.1%}", f"{up:.1%}", "-" if e is None else f"{e:.2e}"
        )
    return table


def quality_table(result: SparsifyResult) -> Table:
    """Per scored text: perplexity of the output and of the dense input, the increase, the KL divergence."""
    table = Table(title="Quality against the dense input (held-out text, q8 activations)")
    for name in ("text", "tokens", "PPL", "dense PPL", "increase", "KLD"):
        table.add_column(name, justify="right")
    for q in result.quality:
        table.add_row(
            q.name,
            str(q.n_tokens),
            f"{q.ppl:.3f}",
            f"{q.dense_ppl:.3f}",
            f"{q.increase:+.2f}%",
            f"{q.kld:.4f}",
        )
    return table


STAGES = {
    "calibrate": ("calibrating", "tokens"),
    "allocate": ("error curves", "layers"),
    "threshold": ("thresholds", "layers"),
    "write": ("writing transposed matrices", "matrices"),
}


def sparsify_with_progress(opts: SparsifyOptions) -> SparsifyResult:
    """run_sparsify with a progress bar per stage on stderr (ETA included)."""
    with ExitStack() as stack:  # the bars start with the first progress event: a refusal prints one line
        bars: list[Progress] = []
        tasks: dict[str, TaskID] = {}

        def on_progress(stage: str, done: int, total: int) -> None:
            if not bars:
                bars.append(stack.enter_context(progress_bar()))
            if stage not in tasks:
                description, unit = STAGES.get(stage, (stage, ""))
                tasks[stage] = bars[0].add_task(description, total=total, unit=unit)
            bars[0].update(tasks[stage], completed=done, total=total)

        return run_sparsify(opts, on_progress)


def run_sparsify_report(opts: SparsifyOptions) -> None:
    """Sparsify with progress; the table and the files written on stderr, the summary on stdout."""
    result = sparsify_with_progress(opts)
    err_console.print(sparsity_table(result))
    if result.quality:
        err_console.print(quality_table(result))
        warning = spread_warning(result.quality)
        if warning is not None:
            err_console.print(warning, markup=False)
    err_console.print(f"sparsify: wrote {result.output}", markup=False)
    if result.activation is not None:
        err_console.print(f"sparsify: wrote activation {result.activation}", markup=False)
    sys.stdout.write(json.dumps(result.summary()) + "\n")
