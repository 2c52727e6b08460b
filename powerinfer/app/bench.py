"""`bench` results in llama-bench's output formats (md, json, jsonl, csv), written as each test completes."""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

import powerinfer
from powerinfer.bench import BenchParams, BenchResult, cpu_info, run_bench
from powerinfer.runtime.engine import EngineOptions
from powerinfer.runtime.report import STAND_IN

DEFAULT_N_BATCH = 512


def uses_pool(options: EngineOptions) -> bool:
    """Whether the run asked for a pool device (a VRAM budget, -ngl or --pool-device)."""
    return options.pool_device is not None or options.vram_budget_gib is not None or options.n_gpu_layers > 0


def bench_record(r: BenchResult, options: EngineOptions, cpu: str) -> dict[str, Any]:
    """One test as llama-bench's json names its fields, plus ours: act_precision, sparse, powerinfer_version,
    vram_budget_gib (-1: all free memory), and the pool's (runtime.report.PoolSummary): device_bytes,
    device_allocated_bytes (CUDA only, else null), plan_bytes, plan_budget_bytes (null for -ngl),
    ffn_device_share (0 to 1)."""
    t = r.test
    pool = r.pool
    return {
        "powerinfer_version": powerinfer.__version__,
        "cpu_info": cpu,
        "gpu_info": r.gpu_info,
        "backends": r.backend,
        "model_filename": str(r.model.path),
        "model_type": r.model.description,
        "model_size": r.model.size_bytes,
        "model_n_params": r.model.n_params,
        "sparse": r.model.sparse,
        "n_batch": t.n_batch,
        "n_threads": t.n_threads,
        "act_precision": t.act_precision,
        "n_gpu_layers": options.n_gpu_layers,
        "vram_budget_gib": -1 if options.vram_budget_gib is None else options.vram_budget_gib,
        "device_bytes": 0 if pool is None else pool.device_bytes,
        "device_allocated_bytes": None if pool is None else pool.allocated_bytes,
        "plan_bytes": 0 if pool is None else pool.plan_bytes,
        "plan_budget_bytes": None if pool is None else pool.budget_bytes,
        "ffn_device_share": 0.0 if pool is None else pool.ffn_device_share,
        "n_prompt": t.n_prompt,
        "n_gen": t.n_gen,
        "test_time": r.test_time,
        "avg_ns": r.avg_ns,
        "stddev_ns": r.stddev_ns,
        "avg_ts": r.avg_ts,
        "stddev_ts": r.stddev_ts,
        "samples_ns": list(r.samples_ns),
        "samples_ts": r.samples_ts,
    }


def size_text(n_bytes: int) -> str:
    """llama-bench's size column: MiB below 1 GiB, else GiB."""
    return f"{n_bytes / 2**20:.2f} MiB" if n_bytes < 2**30 else f"{n_bytes / 2**30:.2f} GiB"


def params_text(n_params: int) -> str:
    """llama-bench's params column: M below 10^9, else B."""
    return f"{n_params / 1e6:.2f} M" if n_params < 1e9 else f"{n_params / 1e9:.2f} B"


class Printer:
    """Writes the results of a run as they come: header(), row() per test, footer()."""

    def __init__(self, out: TextIO, params: BenchParams, options: EngineOptions) -> None:
        self.out, self.params, self.options = out, params, options
        self.cpu = cpu_info()

    def header(self) -> None:
        pass

    def row(self, r: BenchResult) -> None:
        raise NotImplementedError

    def footer(self) -> None:
        pass


def mib_text(n_bytes: int | None) -> str:
    return "-" if n_bytes is None else f"{n_bytes / 2**20:.1f}"


class MarkdownPrinter(Printer):
    """llama-bench's table; n_batch and ngl columns appear only when they differ from the defaults, and the pool
    columns only when the run asks for a pool device: MiB the loader put on it (dev MiB), torch's allocated
    MiB there (alloc MiB, CUDA only), the weight MiB the plan put there (plan MiB) and the share of FFN work
    done there (ffn dev)."""

    def __init__(self, out: TextIO, params: BenchParams, options: EngineOptions) -> None:
        super().__init__(out, params, options)
        longest = max(len(m.description) for m in params.models)
        pool = uses_pool(options)
        # the longest backend name this run can print: rows are written as they come
        backend = len(STAND_IN) if options.pool_device == "cpu" else len("CUDA+CPU") if pool else 7
        # (header, width; negative = left-aligned text)
        self.columns = [("model", -max(30, longest)), ("size", 10), ("params", 10), ("backend", -backend)]
        self.columns.append(("threads", 7))
        if params.n_batch != (DEFAULT_N_BATCH,):
            self.columns.append(("n_batch", 7))
        if options.n_gpu_layers:
            self.columns.append(("ngl", 3))
        self.columns.append(("act", -3))
        if pool:
            self.columns += [("dev MiB", 8), ("alloc MiB", 9), ("plan MiB", 8), ("ffn dev", 7)]
        self.columns += [("test", 13), ("t/s", 20)]

    def _line(self, cells: list[str]) -> None:
        parts = [
            f"{cell:<{-w}}" if w < 0 else f"{cell:>{w}}"
            for cell, (_, w) in zip(cells, self.columns, strict=True)
        ]
        self.out.write("| " + " | ".join(parts) + " |\n")
        self.out.flush()

    def header(self) -> None:
        self._line([name for name, _ in self.columns])
        self._line(["-" * -w if w < 0 else "-" * (w - 1) + ":" for _, w in self.columns])

    def row(self, r: BenchResult) -> None:
        t = r.test
        cells = {
            "model": r.model.description,
            "size": size_text(r.model.size_bytes),
            "params": params_text(r.model.n_params),
            "backend": r.backend,
            "threads": str(t.n_threads),
            "n_batch": str(t.n_batch),
            "ngl": str(self.options.n_gpu_layers),
            "act": t.act_precision,
            "dev MiB": mib_text(None if r.pool is None else r.pool.device_bytes),
            "alloc MiB": mib_text(None if r.pool is None else r.pool.allocated_bytes),
            "plan MiB": mib_text(None if r.pool is None else r.pool.plan_bytes),
            "ffn dev": "-" if r.pool is None else f"{r.pool.ffn_device_share:.1%}",
            "test": t.name,
            "t/s": f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f}",
        }
        self._line([cells[name] for name, _ in self.columns])

    def footer(self) -> None:
        self.out.write(f"\nbuild: powerinfer {powerinfer.__version__}\n")


class JsonPrinter(Printer):
    """A JSON array of records (llama-bench -o json), one record written per completed test."""

    first = True

    def header(self) -> None:
        self.out.write("[\n")

    def row(self, r: BenchResult) -> None:
        text = json.dumps(bench_record(r, self.options, self.cpu), indent=2, ensure_ascii=False)
        self.out.write(("" if self.first else ",\n") + "\n".join("  " + ln for ln in text.splitlines()))
        self.out.flush()
        self.first = False

    def footer(self) -> None:
        self.out.write("\n]\n")


class JsonlPrinter(Printer):
    """One JSON record per line (llama-bench -o jsonl)."""

    def row(self, r: BenchResult) -> None:
        self.out.write(json.dumps(bench_record(r, self.options, self.cpu), ensure_ascii=False) + "\n")
        self.out.flush()


def csv_value(value: Any) -> str:
    """A record value in a CSV cell as llama-bench writes it: lists space-separated, booleans 0/1."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


class CsvPrinter(Printer):
    """A header line of field names, then one row per test, every cell quoted (llama-bench -o csv)."""

    def __init__(self, out: TextIO, params: BenchParams, options: EngineOptions) -> None:
        super().__init__(out, params, options)
        self.writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
        self.first = True

    def row(self, r: BenchResult) -> None:
        record = bench_record(r, self.options, self.cpu)
        if self.first:
            self.writer.writerow(list(record))
            self.first = False
        self.writer.writerow([csv_value(v) for v in record.values()])
        self.out.flush()


PRINTERS: dict[str, type[Printer]] = {
    "md": MarkdownPrinter,
    "json": JsonPrinter,
    "jsonl": JsonlPrinter,
    "csv": CsvPrinter,
}


def run_bench_report(
    params: BenchParams, options: EngineOptions, output: str, on_progress: Callable[[str], None] | None
) -> None:
    """Run the tests and write each result to stdout in the format `output` (one of PRINTERS) as it completes."""
    printer = PRINTERS[output](sys.stdout, params, options)
    printer.header()
    for result in run_bench(params, options, on_progress):
        printer.row(result)
    printer.footer()
    sys.stdout.flush()
