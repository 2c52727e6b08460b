"""`powerinfer bench`: prompt and decode speed in the shape of llama.cpp's llama-bench.

Every numeric flag takes several values as llama-bench's do: comma lists (`-p 0,64,512`), repeated flags
(`-t 1 -t 2`) and ranges FIRST-LAST, FIRST-LAST+STEP or FIRST-LAST*MULT (`-t 1-4`, `-p 64-512*2`). The run is
the cartesian product of the values (powerinfer.bench). Results go to stdout as each test completes (md, json,
jsonl or csv); --progress lines go to stderr.
"""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TextIO

import typer

import powerinfer
from powerinfer.bench import (
    BenchParams,
    BenchResult,
    bench_plan,
    check_context,
    cpu_info,
    model_info,
    run_bench,
)
from powerinfer.cli.common import (
    DEFAULT_ACT_PRECISION,
    ActPrecision,
    FixedThreadsOpt,
    MmapOpt,
    NglOpt,
    PoolDeviceOpt,
    SparseHeadOpt,
    VramOpt,
    engine_options,
    err_console,
    resolve_model,
    run_guarded,
    setup_logging,
    threads,
)
from powerinfer.errors import InputError
from powerinfer.printable import printable

if TYPE_CHECKING:
    from powerinfer.runtime.engine import EngineOptions

DEFAULT_N_PROMPT = 512
DEFAULT_N_GEN = 128
DEFAULT_N_BATCH = 512
DEFAULT_REPETITIONS = 5
MAX_VALUES = 1024  # values one flag may expand to (a range like 1-1000000 is a typo, not a plan)
# one item of a value list: N, FIRST-LAST, FIRST-LAST+STEP or FIRST-LAST*MULT (llama-bench's parse_int_range)
ITEM = re.compile(r"(\d+)(?:-(\d+)(?:([+*])(\d+))?)?")
LIST_HELP = "; comma lists, ranges FIRST-LAST[+STEP|*MULT] and repeated flags give several values"
OUTPUTS = ("md", "json", "jsonl", "csv")


def _expand(flag: str, item: str, text: str) -> list[int]:
    m = ITEM.fullmatch(item)
    if m is None:
        raise InputError(
            f"{flag} {printable(text, 60)}: expected non-negative integers, comma lists or ranges "
            "FIRST-LAST[+STEP|*MULT]"
        )
    first = int(m[1])
    if m[2] is None:
        return [first]
    last, op, step = int(m[2]), m[3] or "+", int(m[4] or 1)
    if last < first:
        raise InputError(f"{flag} {printable(item, 60)}: the range ends before it starts")
    if (op == "+" and step < 1) or (op == "*" and (step < 2 or first < 1)):
        raise InputError(f"{flag} {printable(item, 60)}: the range does not advance")
    values = []
    value = first
    while value <= last:
        values.append(value)
        if len(values) > MAX_VALUES:
            break
        value = value + step if op == "+" else value * step
    return values


def parse_values(flag: str, given: list[str] | None, default: tuple[int, ...]) -> tuple[int, ...]:
    """The integers of a list flag in the order given (repeated flags appended); `default` when not given."""
    if not given:
        return default
    values: list[int] = []
    for text in given:
        for item in text.split(","):
            values += _expand(flag, item.strip(), text)
            if len(values) > MAX_VALUES:
                raise InputError(f"{flag}: more than {MAX_VALUES} values")
    return tuple(values)


def parse_act_precisions(given: list[str] | None) -> tuple[str, ...]:
    """--act-precision values (comma lists, repeated flags): f32 and q8."""
    if not given:
        return (DEFAULT_ACT_PRECISION.value,)
    names = [item.strip() for text in given for item in text.split(",")]
    for name in names:
        if name not in ActPrecision.__members__:
            raise InputError(
                f"--act-precision {printable(name, 40)}: expected {' or '.join(ActPrecision.__members__)}"
            )
    return tuple(names)


def parse_repetitions(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise InputError(f"-r {printable(text, 40)}: expected a whole number of repetitions >= 1")
    return int(text)


# --------------------------------------------------------------------------------------------------- output


def bench_record(r: BenchResult, options: EngineOptions, cpu: str) -> dict[str, Any]:
    """One test as llama-bench's json names its fields, plus ours: act_precision, sparse, powerinfer_version,
    vram_budget_gib (-1: all free memory)."""
    t = r.test
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


class MarkdownPrinter(Printer):
    """llama-bench's table; n_batch and ngl columns appear only when they differ from the defaults."""

    def __init__(self, out: TextIO, params: BenchParams, options: EngineOptions) -> None:
        super().__init__(out, params, options)
        longest = max(len(m.description) for m in params.models)
        # (header, width; negative = left-aligned text)
        self.columns = [("model", -max(30, longest)), ("size", 10), ("params", 10), ("backend", -7)]
        self.columns.append(("threads", 7))
        if params.n_batch != (DEFAULT_N_BATCH,):
            self.columns.append(("n_batch", 7))
        if options.n_gpu_layers:
            self.columns.append(("ngl", 3))
        self.columns += [("act", -3), ("test", 13), ("t/s", 20)]

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


# ------------------------------------------------------------------------------------------------------ CLI

ListOpt = list[str] | None
LIST = "LIST"


def bench(
    model: Annotated[
        list[Path] | None,
        typer.Option(
            "-m",
            "--model",
            help="Model file (GGUF or PowerInfer GGUF); repeat for several, e.g. a sparse file and its dense twin.",
            envvar="POWERINFER_MODEL",
            metavar="FILE",
            show_default=False,
        ),
    ] = None,
    n_prompt: Annotated[
        ListOpt,
        typer.Option(
            "-p",
            "--n-prompt",
            help=f"Prompt tokens of a pp test (default {DEFAULT_N_PROMPT}; 0: no pp test){LIST_HELP}.",
            metavar=LIST,
            show_default=False,
        ),
    ] = None,
    n_gen: Annotated[
        ListOpt,
        typer.Option(
            "-n",
            "--n-gen",
            help=f"Generated tokens of a tg test (default {DEFAULT_N_GEN}; 0: no tg test){LIST_HELP}.",
            metavar=LIST,
            show_default=False,
        ),
    ] = None,
    threads_: Annotated[
        ListOpt,
        typer.Option(
            "-t",
            "--threads",
            help=f"CPU threads (default and 0: all cores){LIST_HELP}.",
            metavar=LIST,
            show_default=False,
        ),
    ] = None,
    batch_size: Annotated[
        ListOpt,
        typer.Option(
            "-b",
            "--batch-size",
            help=f"Prompt tokens per forward pass (default {DEFAULT_N_BATCH}){LIST_HELP}.",
            metavar=LIST,
            show_default=False,
        ),
    ] = None,
    act_precision: Annotated[
        ListOpt,
        typer.Option(
            "--act-precision",
            help="Activations of the quant matmuls: q8 (int8 blocks as llama.cpp, the default) or f32 (exact); "
            "comma lists and repeated flags give several.",
            metavar=LIST,
            show_default=False,
        ),
    ] = None,
    repetitions: Annotated[
        str,
        typer.Option(
            "-r", "--repetitions", help="Timed runs of each test, after one warm-up run.", metavar="N"
        ),
    ] = str(DEFAULT_REPETITIONS),
    output: Annotated[
        str,
        typer.Option("-o", "--output", help="Output format: md, json, jsonl or csv.", metavar="FORMAT"),
    ] = "md",
    vram_budget: VramOpt = -1.0,
    n_gpu_layers: NglOpt = 0,
    pool_device: PoolDeviceOpt = None,
    progress: Annotated[bool, typer.Option("--progress", help="Print a line per test on stderr.")] = False,
    fixed_threads: FixedThreadsOpt = False,
    mmap: MmapOpt = None,
    sparse_head: SparseHeadOpt = None,
) -> None:
    """Measure prompt (ppN) and decode (tgN) speed as llama-bench does: tokens/s, mean ± stddev."""
    setup_logging(False)

    def body() -> None:
        if output not in OUTPUTS:
            raise InputError(f"-o {printable(output, 40)}: expected one of {', '.join(OUTPUTS)}")
        n_threads = tuple(threads(n) for n in parse_values("-t", threads_, (0,)))
        prompts = parse_values("-p", n_prompt, (DEFAULT_N_PROMPT,))
        gens = parse_values("-n", n_gen, (DEFAULT_N_GEN,))
        batches = parse_values("-b", batch_size, (DEFAULT_N_BATCH,))
        if 0 in batches:
            raise InputError("-b: the batch size must be >= 1")
        acts = parse_act_precisions(act_precision)
        reps = parse_repetitions(repetitions)
        options = engine_options(
            threads_=n_threads[0],
            act_precision=ActPrecision(acts[0]),
            vram_budget=vram_budget,
            pool_device=pool_device,
            n_gpu_layers=n_gpu_layers,
            fixed_threads=fixed_threads,
            mmap=mmap,
            sparse_head=sparse_head,
        )
        paths = list(model) if model else [resolve_model(None)]
        params = BenchParams(
            models=tuple(model_info(path) for path in paths),
            n_prompt=prompts,
            n_gen=gens,
            n_threads=n_threads,
            act_precision=acts,
            n_batch=batches,
            repetitions=reps,
        )
        if not bench_plan(params):
            raise InputError("nothing to run: every -p and -n value is 0")
        check_context(params)
        printer = PRINTERS[output](sys.stdout, params, options)
        printer.header()
        on_progress = (lambda line: err_console.print(line, markup=False)) if progress else None
        for result in run_bench(params, options, on_progress):
            printer.row(result)
        printer.footer()
        sys.stdout.flush()

    run_guarded(body)
