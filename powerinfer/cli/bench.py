"""`powerinfer bench`: prompt and decode speed in the shape of llama.cpp's llama-bench.

Every numeric flag takes several values as llama-bench's do: comma lists (`-p 0,64,512`), repeated flags
(`-t 1 -t 2`) and ranges FIRST-LAST, FIRST-LAST+STEP or FIRST-LAST*MULT (`-t 1-4`, `-p 64-512*2`). The run is
the cartesian product of the values (powerinfer.bench). Results go to stdout as each test completes (md, json,
jsonl or csv); --progress lines go to stderr.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from powerinfer.app.bench import DEFAULT_N_BATCH, PRINTERS, run_bench_report
from powerinfer.bench import BenchParams, bench_plan, check_context, model_info
from powerinfer.cli.common import err_console, run_guarded, setup_logging
from powerinfer.cli.options import DEFAULT_ACT_PRECISION, ActPrecision, EngineArgs, takes, threads
from powerinfer.errors import InputError
from powerinfer.printable import printable

DEFAULT_N_PROMPT = 512
DEFAULT_N_GEN = 128
DEFAULT_REPETITIONS = 5
MAX_VALUES = 1024  # values one flag may expand to (a range like 1-1000000 is a typo, not a plan)
# one item of a value list: N, FIRST-LAST, FIRST-LAST+STEP or FIRST-LAST*MULT (llama-bench's parse_int_range)
ITEM = re.compile(r"(\d+)(?:-(\d+)(?:([+*])(\d+))?)?")
LIST_HELP = "; comma lists, ranges FIRST-LAST[+STEP|*MULT] and repeated flags give several values"
OUTPUTS = tuple(PRINTERS)


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


ListOpt = list[str] | None
LIST = "LIST"


# -m, -t, -b and --act-precision take lists here; the engine options bench shares are the rest
NOT_SHARED = (
    "model",
    "ctx_size",
    "batch_size",
    "threads",
    "act_precision",
    "reset_gpu_index",
    "disable_gpu_index",
)


@takes(EngineArgs, skip=NOT_SHARED + ("pipeline_split", "dist_timeout"))
def bench(
    engine: EngineArgs,
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
    progress: Annotated[bool, typer.Option("--progress", help="Print a line per test on stderr.")] = False,
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
        options = replace(engine, threads=n_threads[0], act_precision=ActPrecision(acts[0])).options(
            pipeline=None
        )
        paths = list(model) if model else [engine.model_path()]
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
        on_progress = (lambda line: err_console.print(line, markup=False)) if progress else None
        run_bench_report(params, options, output, on_progress)

    run_guarded(body)
