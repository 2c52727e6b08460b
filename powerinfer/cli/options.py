"""The option table: every option that several commands share, declared once, as llama.cpp's common/arg.cpp does.

`EngineArgs` and `SamplingArgs` are dataclasses whose fields are the options themselves (an Annotated type with
its flags and help, and a default). `@takes(EngineArgs, SamplingArgs, ...)` adds their fields to a command's
options and hands the command one object per group, which checks the values (one InputError line per mistake)
and builds the library's EngineOptions / SamplingParams. A command says which fields it leaves out and which
defaults differ, the way arg.cpp tags each option with the examples that take it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import math
import os
import time
from collections.abc import Callable
from copy import copy
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, TypeVar, get_args, get_type_hints

import typer

from powerinfer.app.console import resolve_model
from powerinfer.errors import InputError
from powerinfer.placement.requests import n_cpu_moe, resolve_device, resolve_vram_budget
from powerinfer.printable import printable
from powerinfer.quant.types import KV_CACHE_TYPES
from powerinfer.runtime.defaults import DEFAULT_ACT_PRECISION as ENGINE_DEFAULT_ACT_PRECISION
from powerinfer.runtime.speculative import SpecOptions
from powerinfer.sampling import SamplingParams

if TYPE_CHECKING:
    from powerinfer.arch.rope_scaling import RopeOverrides
    from powerinfer.runtime.engine import EngineOptions

log = logging.getLogger(__name__)

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


# the default of every command and of the library's EngineOptions (runtime.defaults)
DEFAULT_ACT_PRECISION = ActPrecision(ENGINE_DEFAULT_ACT_PRECISION)

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
CpuMoeOpt = Annotated[
    bool, typer.Option("--cpu-moe", help="MoE files: keep every expert tensor on the CPU (llama.cpp's flag).")
]
NCpuMoeOpt = Annotated[
    int,
    typer.Option("--n-cpu-moe", help="MoE files: keep the experts of the first N layers on the CPU."),
]
MemoryLimitOpt = Annotated[
    float | None,
    typer.Option(
        "--memory-limit",
        help="MoE files larger than memory: stay within GIB (page cache included): the dense weights and the "
        "hottest experts (profile.json beside the model) resident, the others read from the file through a "
        "bounded cache.",
        metavar="GIB",
    ),
]
OverrideTensorOpt = Annotated[
    list[str] | None,
    typer.Option(
        "-ot",
        "--override-tensor",
        help="MoE files: REGEX=DEV[,...] puts the expert tensors whose name matches REGEX on DEV: CPU, or "
        "the pool device (pool; cuda, CUDA0 on a GPU); the first match wins, repeatable.",
        show_default=False,
    ),
]
PipelineSplitOpt = Annotated[
    str | None,
    typer.Option(
        "--pipeline-split",
        envvar="POWERINFER_PIPELINE_SPLIT",
        help="Under torchrun: layers per pipeline stage in rank order, e.g. 10,12 (default: balanced by bytes).",
        show_default=False,
    ),
]
DistTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--dist-timeout",
        envvar="POWERINFER_DIST_TIMEOUT",
        help="Under torchrun: seconds a rank waits for the others to join and for a peer within a step.",
    ),
]
LogDisableOpt = Annotated[bool, typer.Option("--log-disable", help="Print no log lines, only results.")]

# -- RoPE scaling (llama.cpp's names and meanings; unset: the model file's, see arch.rope_scaling) ---------------
RopeScalingOpt = Annotated[
    str | None,
    typer.Option(
        "--rope-scaling",
        help="RoPE frequency scaling: none, linear or yarn (default: the model's).",
        metavar="{none,linear,yarn}",
        show_default=False,
    ),
]
RopeScaleOpt = Annotated[
    float | None,
    typer.Option(
        "--rope-scale",
        help="RoPE context scaling factor: the context grows N times (= 1 / --rope-freq-scale).",
        metavar="N",
        show_default=False,
    ),
]
RopeFreqBaseOpt = Annotated[
    float | None,
    typer.Option(
        "--rope-freq-base",
        help="RoPE base frequency (default: the model's).",
        metavar="N",
        show_default=False,
    ),
]
RopeFreqScaleOpt = Annotated[
    float | None,
    typer.Option(
        "--rope-freq-scale",
        help="RoPE frequency scaling factor: the context grows 1/N times.",
        metavar="N",
        show_default=False,
    ),
]
YarnOrigCtxOpt = Annotated[
    int,
    typer.Option(
        "--yarn-orig-ctx", help="YaRN: the model's original context size (0 = the model's).", metavar="N"
    ),
]
YarnExtFactorOpt = Annotated[
    float,
    typer.Option(
        "--yarn-ext-factor",
        help="YaRN: extrapolation mix factor (< 0: the model's; 1 for yarn, 0 else).",
        metavar="N",
    ),
]
YarnAttnFactorOpt = Annotated[
    float,
    typer.Option(
        "--yarn-attn-factor",
        help="YaRN: scale of the attention magnitude (< 0: the model's, 1).",
        metavar="N",
    ),
]
YarnBetaFastOpt = Annotated[
    float,
    typer.Option(
        "--yarn-beta-fast", help="YaRN: low correction dimension (< 0: the model's, 32).", metavar="N"
    ),
]
YarnBetaSlowOpt = Annotated[
    float,
    typer.Option(
        "--yarn-beta-slow", help="YaRN: high correction dimension (< 0: the model's, 1).", metavar="N"
    ),
]

# ---- KV cache types (-ctk / -ctv, llama.cpp's names; ops.kv_types) --------------------------------------------------
# plain strings checked in EngineArgs.options, so a bad value is one error line (exit 1) like every other option
KV_TYPE_NAMES = KV_CACHE_TYPES  # ops.kv_types.KV_TYPES (no torch import here)
DEFAULT_CACHE_TYPE = (
    "f32"  # runtime.kv_cache.DEFAULT_KV_TYPE; docs/generation.md says why not llama.cpp's f16
)
CacheTypeKOpt = Annotated[
    str,
    typer.Option(
        "-ctk",
        "--cache-type-k",
        help=f"KV cache type of the keys: {', '.join(KV_TYPE_NAMES)} (the last two: ggml's blocks of 32).",
    ),
]
CacheTypeVOpt = Annotated[
    str,
    typer.Option("-ctv", "--cache-type-v", help=f"KV cache type of the values: {', '.join(KV_TYPE_NAMES)}."),
]


def cache_type(flag: str, name: str) -> str:
    """A -ctk / -ctv value, checked (case as llama.cpp takes it: lower)."""
    if name not in KV_TYPE_NAMES:
        raise InputError(f"{flag} {name!r} is not a KV cache type: choose one of {', '.join(KV_TYPE_NAMES)}")
    return name


TempOpt = Annotated[float, typer.Option("--temp", help="Temperature (0 = greedy).")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Top-k sampling (<= 0: off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Top-p (nucleus) sampling.")]
MinPOpt = Annotated[float, typer.Option("--min-p", help="Min-p sampling.")]
RepeatPenaltyOpt = Annotated[float, typer.Option("--repeat-penalty", help="Repetition penalty.")]
RepeatLastNOpt = Annotated[int, typer.Option("--repeat-last-n", help="Tokens the penalty looks back.")]
FrequencyPenaltyOpt = Annotated[float, typer.Option("--frequency-penalty")]
PresencePenaltyOpt = Annotated[float, typer.Option("--presence-penalty")]

# -t past this many threads per core is clamped (oversubscription only slows the OpenMP regions down)
THREADS_PER_CORE = 4
ENGINE_MAX_THREADS = 1024  # runtime.engine.MAX_THREADS: what KernelContext accepts at all
UINT32 = 1 << 32
FLOAT32_TINY = 2.0**-126  # smallest normal float32: the sampler divides float32 logits by these values


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


def seed(value: int) -> int:
    """-s as llama.cpp reads it: any integer reduced to uint32 (stoul, then a uint32 store), where 0xFFFFFFFF
    (-1, LLAMA_DEFAULT_SEED) means a random seed, returned as -1."""
    s = value % UINT32
    return -1 if s == UINT32 - 1 else s


def random_seed(value: int) -> int:
    """A normalised seed (see `seed`), with -1 replaced by a time-based one as llama.cpp does."""
    s = seed(value)
    return int(time.time()) % (UINT32 - 1) if s == -1 else s


@dataclass(frozen=True)
class EngineArgs:
    """The model and engine options of main, server, perplexity, batched and bench, as typed."""

    PANEL: ClassVar[str] = "Model and engine"
    model: ModelOpt = None
    ctx_size: CtxOpt = 512
    batch_size: BatchOpt = 512
    threads: ThreadsOpt = 0
    fixed_threads: FixedThreadsOpt = False
    mmap: MmapOpt = None
    sparse_head: SparseHeadOpt = None
    act_precision: ActPrecisionOpt = DEFAULT_ACT_PRECISION
    vram_budget: VramOpt = -1.0
    n_gpu_layers: NglOpt = 0
    reset_gpu_index: ResetIdxOpt = False
    disable_gpu_index: DisableIdxOpt = False
    pool_device: PoolDeviceOpt = None
    cpu_moe: CpuMoeOpt = False
    n_cpu_moe: NCpuMoeOpt = 0
    override_tensor: OverrideTensorOpt = None
    memory_limit: MemoryLimitOpt = None
    cache_type_k: CacheTypeKOpt = DEFAULT_CACHE_TYPE
    cache_type_v: CacheTypeVOpt = DEFAULT_CACHE_TYPE
    pipeline_split: PipelineSplitOpt = None
    dist_timeout: DistTimeoutOpt = 60.0
    # RoPE scaling
    rope_scaling: RopeScalingOpt = None
    rope_scale: RopeScaleOpt = None
    rope_freq_base: RopeFreqBaseOpt = None
    rope_freq_scale: RopeFreqScaleOpt = None
    yarn_orig_ctx: YarnOrigCtxOpt = 0
    yarn_ext_factor: YarnExtFactorOpt = -1.0
    yarn_attn_factor: YarnAttnFactorOpt = -1.0
    yarn_beta_fast: YarnBetaFastOpt = -1.0
    yarn_beta_slow: YarnBetaSlowOpt = -1.0

    def model_path(self) -> Path:
        """-m, or the default model (see `app.console.resolve_model`)."""
        return resolve_model(self.model)

    def rope_overrides(self) -> RopeOverrides | None:
        """The RoPE options as overrides of the model's keys, checked (InputError); None when none is given."""
        from powerinfer.arch.rope_scaling import RopeOverrides

        for option, value in (("--rope-scale", self.rope_scale), ("--rope-freq-scale", self.rope_freq_scale)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise InputError(f"{option} must be a positive number, got {value}")
        if self.rope_scale is not None and self.rope_freq_scale is not None:
            raise InputError("give --rope-scale or --rope-freq-scale, not both (one is 1 / the other)")
        overrides = RopeOverrides(
            scaling=self.rope_scaling,
            freq_base=self.rope_freq_base,
            freq_scale=self.rope_freq_scale if self.rope_scale is None else 1.0 / self.rope_scale,
            yarn_orig_ctx=self.yarn_orig_ctx,
            yarn_ext_factor=self.yarn_ext_factor,
            yarn_attn_factor=self.yarn_attn_factor,
            yarn_beta_fast=self.yarn_beta_fast,
            yarn_beta_slow=self.yarn_beta_slow,
        )
        return overrides if overrides != RopeOverrides() else None

    def options(self, **fields: Any) -> EngineOptions:
        """EngineOptions from these options, checked (threads clamped, budget and device parsed, the pipeline
        stage of this process read from its environment); `fields` set or override EngineOptions fields."""
        from powerinfer.runtime.engine import EngineOptions
        from powerinfer.runtime.pipeline import pipeline_options

        values: dict[str, Any] = dict(
            n_ctx=self.ctx_size,
            n_batch=self.batch_size,
            n_threads=threads(self.threads),
            fixed_threads=self.fixed_threads,
            mmap=self.mmap,
            sparse_head=self.sparse_head,
            act_precision=self.act_precision.value,
            vram_budget_gib=resolve_vram_budget(self.vram_budget),
            n_gpu_layers=self.n_gpu_layers,
            reset_gpu_index=self.reset_gpu_index,
            disable_gpu_index=self.disable_gpu_index,
            pool_device=resolve_device(self.pool_device),
            cpu_moe=self.cpu_moe,
            n_cpu_moe=n_cpu_moe(self.n_cpu_moe),
            override_tensor=tuple(self.override_tensor or ()),
            memory_limit_gib=self.memory_limit,
            rope=self.rope_overrides(),
            cache_type_k=cache_type("--cache-type-k", self.cache_type_k),
            cache_type_v=cache_type("--cache-type-v", self.cache_type_v),
        )
        values.update(fields)
        if "pipeline" not in values:
            values["pipeline"] = pipeline_options(self.pipeline_split, self.dist_timeout, os.environ)
        return EngineOptions(**values)


_D = SamplingParams()  # llama.cpp's sampling defaults


@dataclass(frozen=True)
class SamplingArgs:
    """The sampling options of main and server, as typed (llama.cpp's defaults)."""

    PANEL: ClassVar[str] = "Sampling"
    seed: SeedOpt = _D.seed
    temp: TempOpt = _D.temp
    top_k: TopKOpt = _D.top_k
    top_p: TopPOpt = _D.top_p
    min_p: MinPOpt = _D.min_p
    repeat_penalty: RepeatPenaltyOpt = _D.repeat_penalty
    repeat_last_n: RepeatLastNOpt = _D.repeat_last_n
    frequency_penalty: FrequencyPenaltyOpt = _D.frequency_penalty
    presence_penalty: PresencePenaltyOpt = _D.presence_penalty

    def params(self) -> SamplingParams:
        """SamplingParams, checked: every float finite, --temp 0 (greedy) or at least a normal float32,
        --repeat-penalty > 0 (the sampler divides by it), the seed reduced to uint32."""
        for option, value in (
            ("--temp", self.temp),
            ("--repeat-penalty", self.repeat_penalty),
            ("--top-p", self.top_p),
            ("--min-p", self.min_p),
            ("--frequency-penalty", self.frequency_penalty),
            ("--presence-penalty", self.presence_penalty),
        ):
            if not math.isfinite(value):
                raise InputError(f"{option} must be a finite number, got {value}")
        if 0 < self.temp < FLOAT32_TINY:
            raise InputError(
                f"--temp {self.temp} is too small to divide by: use 0 for greedy sampling or >= {FLOAT32_TINY:.3g}"
            )
        if self.repeat_penalty < FLOAT32_TINY:
            raise InputError(f"--repeat-penalty must be > 0 (1.0 = off), got {self.repeat_penalty}")
        return SamplingParams(**{**dataclasses.asdict(self), "seed": seed(self.seed)})


# ---------------------------------------------------------------- context shift (runtime.context_shift)
@dataclass(frozen=True)
class ContextShiftArgs:
    """What main and server do when a sequence fills its context (llama.cpp's --keep, --context-shift)."""

    PANEL: ClassVar[str] = "Context shift"
    keep: Annotated[
        int,
        typer.Option(
            "--keep",
            help="Tokens of the prompt kept when the context shifts, counted after the BOS (-1: the whole "
            "prompt); the server's default n_keep.",
        ),
    ] = 0
    context_shift: Annotated[
        bool,
        typer.Option(
            "--context-shift/--no-context-shift",
            help="A full context keeps --keep tokens, drops half of the rest and goes on (off: stop there).",
        ),
    ] = True

    def checked(self) -> ContextShiftArgs:
        """These options, --keep checked (the context size is checked once the model is loaded)."""
        if self.keep < -1:
            raise InputError(f"--keep must be -1 (the whole prompt) or >= 0, got {self.keep}")
        return self


# ---------------------------------------------------------------- speculative decoding (main, server)
# llama.cpp's -md/--model-draft, --draft-max/--draft-min/--draft-p-min and -cd; --lookup is its `lookup`
# example (prompt lookup decoding) as a flag. Checked by runtime.speculative.SpecOptions.
_S = SpecOptions()


@dataclass(frozen=True)
class SpeculativeArgs:
    """The speculative decoding options of main and server."""

    PANEL: ClassVar[str] = "Speculative decoding"
    model_draft: Annotated[
        Path | None,
        typer.Option(
            "-md",
            "--model-draft",
            help="Draft model (GGUF, the target's vocabulary): it proposes tokens, the model checks them in one "
            "step; greedy output is unchanged, sampling keeps the model's distribution.",
            show_default=False,
        ),
    ] = None
    draft_max: Annotated[
        int, typer.Option("--draft-max", "--draft", "--draft-n", help="Tokens drafted per step at most.")
    ] = _S.n_max
    draft_min: Annotated[
        int, typer.Option("--draft-min", "--draft-n-min", help="Drafts shorter than this are not checked.")
    ] = _S.n_min
    draft_p_min: Annotated[
        float,
        typer.Option(
            "--draft-p-min", help="The draft model stops after a token whose probability is below this."
        ),
    ] = _S.p_min
    ctx_size_draft: Annotated[
        int, typer.Option("-cd", "--ctx-size-draft", help="Draft model context (0: the model's -c).")
    ] = _S.n_ctx_draft
    lookup: Annotated[
        bool,
        typer.Option(
            "--lookup",
            help="Prompt lookup decoding (no draft model): draft what followed the last n-gram's latest "
            "earlier occurrence in the prompt and the output.",
        ),
    ] = False
    lookup_ngram_min: Annotated[
        int, typer.Option("--lookup-ngram-min", help="--lookup: shortest n-gram matched.")
    ] = _S.ngram_min
    lookup_ngram_max: Annotated[
        int, typer.Option("--lookup-ngram-max", help="--lookup: longest n-gram matched (tried first).")
    ] = _S.ngram_max

    def options(self) -> SpecOptions | None:
        """SpecOptions (checked: one InputError line per mistake), None when neither -md nor --lookup."""
        opts = SpecOptions(
            draft_model=resolve_draft(self.model_draft),
            lookup=self.lookup,
            n_max=self.draft_max,
            n_min=self.draft_min,
            p_min=self.draft_p_min,
            n_ctx_draft=self.ctx_size_draft,
            ngram_min=self.lookup_ngram_min,
            ngram_max=self.lookup_ngram_max,
        )
        return opts if opts.enabled else None


def resolve_draft(path: Path | None) -> Path | None:
    """-md FILE, which must be a readable file."""
    if path is not None and not path.is_file():
        raise InputError(f"-md/--model-draft: no such file: {printable(str(path))}")
    return path


# ---------------------------------------------------------------- end of speculative decoding


F = TypeVar("F", bound=Callable[..., Any])


def takes(*groups: type, skip: tuple[str, ...] = (), **defaults: Any) -> Callable[[F], F]:
    """Give a command the options of `groups` (dataclasses of options such as EngineArgs): their fields, less
    `skip`, become the command's options under the group's help panel (its PANEL), `defaults` replacing a
    field's default; the command receives one object per group, in its parameter annotated with that group's
    class (a field left out keeps the dataclass's default)."""

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn, eval_str=True)
        own = [p for p in signature.parameters.values() if p.annotation not in groups]
        slots = {p.name: p.annotation for p in signature.parameters.values() if p.annotation in groups}
        added: list[inspect.Parameter] = []
        taken: dict[type, list[str]] = {group: [] for group in groups}
        for group in groups:
            hints = get_type_hints(group, include_extras=True)
            for field in dataclasses.fields(group):
                if field.name in skip:
                    continue
                kind, info = get_args(hints[field.name])
                info = copy(info)
                info.rich_help_panel = getattr(group, "PANEL", None)
                default = defaults.pop(field.name, field.default)
                annotation = Annotated[kind, info]  # type: ignore[valid-type]
                added.append(
                    inspect.Parameter(
                        field.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
                    )
                )
                taken[group].append(field.name)
        assert not defaults, f"no such options: {sorted(defaults)}"
        assert not {p.name for p in own} & {p.name for p in added}, "an option declared twice"
        assert not set(slots) & {p.name for p in added}, "a group's parameter named like an option"

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            for slot, group in slots.items():
                kwargs[slot] = group(**{name: kwargs.pop(name) for name in taken[group]})
            return fn(**kwargs)

        command.__signature__ = signature.replace(parameters=own + added)  # type: ignore[attr-defined]
        return command  # type: ignore[return-value]

    return decorate
