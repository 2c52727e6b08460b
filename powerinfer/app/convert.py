"""`convert`: the conversion with a progress bar over tensors on stderr and one result line on stdout."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from powerinfer.app.console import err_console
from powerinfer.convert import ConversionResult, convert_checkpoint


def run_convert(
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


def print_converted(result: ConversionResult) -> None:
    """The result line on stdout."""
    kind = "PowerInfer (PWRI)" if result.sparse else "dense GGUF"
    sys.stdout.write(
        f"wrote {result.path}: {kind}, {result.outtype}, {result.n_tensors} tensors, {result.n_kv} KVs, "
        f"{result.n_bytes} bytes\n"
    )
    sys.stdout.flush()
