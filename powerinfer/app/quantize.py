"""`quantize`: the run with a progress bar and llama.cpp's per-tensor log and totals on stderr."""

from __future__ import annotations

import time

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

from powerinfer.app.console import err_console
from powerinfer.quantize import QuantizeOptions, QuantizeReport, TensorDone, quantize_model


def format_shape(shape: tuple[int, ...]) -> str:
    """ggml's tensor shape string: ne0 first, padded to 4 dims."""
    ne = list(reversed(shape)) + [1] * (4 - len(shape))
    return ", ".join(f"{d:5d}" for d in ne)


def format_tensor_line(ev: TensorDone) -> str:
    """The original's per-tensor log line."""
    p = ev.plan
    head = (
        f"[{ev.index + 1:4d}/{ev.n_tensors:4d}] {p.name:>36s} - [{format_shape(p.shape)}], "
        f"type = {p.src_type.name.lower():>6s}, "
    )
    if not p.converted:
        return head + f"size = {ev.src_bytes / 2**20:8.3f} MB"
    return (
        head + f"quantizing to {p.dst_type.name.lower()} .. "
        f"size = {ev.src_bytes / 2**20:8.2f} MB -> {ev.dst_bytes / 2**20:8.2f} MB"
    )


def run_quantize(opts: QuantizeOptions) -> QuantizeReport:
    """Quantize with a progress bar and the per-tensor log on stderr."""
    t_start = time.perf_counter()
    err = err_console
    err.print(
        f"main: quantizing '{opts.input}' to '{opts.output}' as {opts.file_type.name} "
        f"using {opts.n_threads} threads",
        markup=False,
    )
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task("quantize", total=None)

        def on_tensor(ev: TensorDone) -> None:
            if ev.index == 0:
                progress.update(task, total=ev.n_tensors)
            progress.console.print(format_tensor_line(ev), markup=False, highlight=False)
            if ev.plan.note:
                progress.console.print(
                    f"llama_model_quantize_internal: {ev.plan.name}: {ev.plan.note}",
                    markup=False,
                    highlight=False,
                )
            progress.update(task, advance=1, description=ev.plan.name)

        report = quantize_model(opts, on_tensor)
    for label, n_bytes in (("model size ", report.src_bytes), ("quant size ", report.dst_bytes)):
        err.print(f"llama_model_quantize_internal: {label} = {n_bytes / 2**20:8.2f} MB", markup=False)
    err.print("")
    err.print(f"main: quantize time = {report.quantize_ms:8.2f} ms", markup=False)
    err.print(f"main:    total time = {(time.perf_counter() - t_start) * 1e3:8.2f} ms", markup=False)
    return report
