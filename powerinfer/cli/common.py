"""Options shared by several commands, defined once, and the error edge of the CLI."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console

from powerinfer.errors import PowerInferError

if TYPE_CHECKING:
    from powerinfer.runtime.engine import EngineOptions

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


class ActPrecision(str, Enum):
    """Activations of the quant matmuls (KernelContext.act_precision)."""

    f32 = "f32"
    q8 = "q8"


ActPrecisionOpt = Annotated[
    ActPrecision,
    typer.Option(
        "--act-precision",
        help="Activations of the Q4_0/Q4_1/Q8_0 matmuls: f32 (exact) or q8 (int8 blocks like llama.cpp: "
        "faster, not bit-comparable with float references).",
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
    """The -m path, or the bundled default model when -m is not given."""
    if path is not None:
        return path
    candidates = sorted(DEFAULT_MODEL_DIR.glob("*.gguf")) if DEFAULT_MODEL_DIR.is_dir() else []
    if not candidates:
        raise PowerInferError("no model given: pass -m MODEL.gguf")
    return candidates[0]


def resolve_vram_budget(gib: float) -> float | None:
    """--vram-budget: -1 (the default) means all free device memory; other negative values are errors."""
    if gib == -1:
        return None
    if gib < 0 or gib != gib:
        raise PowerInferError(f"--vram-budget must be -1 (all free memory) or >= 0 GiB, got {gib}")
    return gib


def threads(n: int) -> int:
    import os

    return n if n > 0 else (os.cpu_count() or 1)


def engine_options(
    *,
    threads_: int,
    act_precision: ActPrecision,
    vram_budget: float,
    pool_device: str | None,
    reset_gpu_index: bool = False,
    disable_gpu_index: bool = False,
    **fields: Any,
) -> EngineOptions:
    """EngineOptions from the options every engine command shares (threads, precision, pool), plus `fields`."""
    from powerinfer.runtime.engine import EngineOptions

    return EngineOptions(
        n_threads=threads(threads_),
        act_precision=act_precision.value,
        vram_budget_gib=resolve_vram_budget(vram_budget),
        reset_gpu_index=reset_gpu_index,
        disable_gpu_index=disable_gpu_index,
        pool_device=pool_device,
        **fields,
    )


def setup_logging(disabled: bool) -> None:
    level = logging.CRITICAL + 1 if disabled else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname).1s %(name)s: %(message)s"))
    logging.basicConfig(level=level, force=True, handlers=[handler])


def run_guarded(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a command body; project errors become one line on stderr and exit code 1."""
    try:
        return fn(*args, **kwargs)
    except PowerInferError as e:
        # plain stderr, never silenced by --log-disable
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()
        raise typer.Exit(code=1) from None
    except KeyboardInterrupt:
        err_console.print("interrupted")
        raise typer.Exit(code=130) from None
    except BrokenPipeError:
        sys.stderr.close()
        raise typer.Exit(code=0) from None
    except MemoryError:
        sys.stderr.write("error: out of memory\n")
        raise typer.Exit(code=1) from None
