"""Model assembly: read a model file once, plan where its weights go and build the model over them.

`assemble(path, options)` returns an `AssembledModel`: the file (copied into memory or mapped), its config and
tokenizer, the kernel context, the device plan, the loader that carried the plan out and the built model. It runs
no step and holds no KV cache; `runtime.engine.Engine` takes an assembled model and steps it. A pipeline rank
assembles its stage only (a view of the file with its own layers, runtime.pipeline.stage_view).
"""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from powerinfer import ops, stamps
from powerinfer.arch import RopeOverrides, build_model, load_config
from powerinfer.device.span import SpanMaker
from powerinfer.errors import ConfigError, FormatError, InputError, PlacementError
from powerinfer.gguf.constants import Keys
from powerinfer.gguf.reader import GGUFFile, in_memory, read_gguf, tensor_bytes_total
from powerinfer.model.config import ModelConfig
from powerinfer.model.moe import MoEFFN
from powerinfer.model.source import Sparsity
from powerinfer.model.sparse import SparseStats
from powerinfer.model.transformer import Transformer
from powerinfer.ops.kv_types import KV_TYPES
from powerinfer.placement import Placement
from powerinfer.placement.device_plan import DevicePlan, layers_plan
from powerinfer.placement.experts import (
    EXPERT_TENSORS,
    ExpertRequest,
    load_expert_counts,
    load_router_predictor,
    parse_overrides,
    pool_names,
)
from powerinfer.placement.memory import plan_memory, runtime_bytes
from powerinfer.runtime.defaults import DEFAULT_ACT_PRECISION
from powerinfer.runtime.expert_store import ExpertStore, LayerFiles, NextRouter, TrainedRouter, resident_bytes
from powerinfer.runtime.kv_cache import (
    DEFAULT_KV_TYPE,
    available_memory_bytes,
    kv_bytes_terms,
    kv_cache_bytes,
)
from powerinfer.runtime.loader import Loader
from powerinfer.runtime.pool import PoolRequest, budget_bytes, plan_moe_pool, plan_pool, pool_device
from powerinfer.runtime.threads import torch_threads
from powerinfer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from powerinfer.runtime.pipeline import PipelineOptions, Stage

log = logging.getLogger(__name__)

MAX_THREADS = 1024
MAX_MEMORY_LIMIT_GIB = 1 << 20
# host bytes per position and rotary pair while the RoPE tables are built (float64 angles, complex128 and
# complex64 rotations, float pairs: model.blocks.Rope), an upper bound
ROPE_BYTES_PER_PAIR = 64


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.3g} GiB"


@dataclass(frozen=True)
class EngineOptions:
    n_ctx: int = 512  # 0: the model's training context
    n_batch: int = 512
    n_seq: int = 1  # KV cache slots: independent sequences decoded together (batched, server)
    n_threads: int | None = None
    # activations of the quant matmuls: "q8" (int8 blocks, llama.cpp's arithmetic) or "f32" (exact); the CLI's
    # default too (runtime.defaults)
    act_precision: str = DEFAULT_ACT_PRECISION
    vram_budget_gib: float | None = None
    n_gpu_layers: int = 0
    reset_gpu_index: bool = False
    disable_gpu_index: bool = False
    dense_ffn: bool = False  # PWRI files: compute every FFN neuron (no predictor)
    pool_device: str | None = None  # device of the pool: "cuda", "cuda:1", or "cpu" (stand-in)
    gpu_index_path: str | None = None  # use this GPU index instead of planning one
    pipeline: PipelineOptions | None = None  # one stage of several ranks (runtime.pipeline)
    # the weights: None copies them into memory (huge pages) when they take at most half of the available memory,
    # else maps the file; True always maps the file (--mmap), False always copies (--no-mmap)
    mmap: bool | None = None
    fixed_threads: bool = False  # False: fewer kernel threads while the cores are shared (runtime.threads)
    # the output head (model.head): None screens it where the file carries a screen (sparsify writes one), True
    # also builds a screen for a file without one (from the packaged calibration text), False computes it whole
    sparse_head: bool | None = None
    # MoE files (placement.experts): every expert on the CPU (--cpu-moe), the experts of the first N layers
    # (--n-cpu-moe), and -ot/--override-tensor values (REGEX=DEV[,REGEX=DEV...]) in order
    cpu_moe: bool = False
    n_cpu_moe: int = 0
    override_tensor: tuple[str, ...] = ()
    # MoE files larger than memory (--memory-limit GiB): the dense weights and the hottest experts resident, the
    # rest read from the file through a bounded cache (placement.memory, runtime.expert_store); None: no limit.
    # memory_runtime_bytes: the interpreter's and libraries' bytes the plan assumes (None: this process's
    # resident size when the model is assembled)
    memory_limit_gib: float | None = None
    memory_runtime_bytes: int | None = None
    rope: RopeOverrides | None = None  # the command line's RoPE scaling options (arch.rope_scaling)
    # KV cache types (-ctk / -ctv): ops.kv_types.KV_TYPES names
    cache_type_k: str = DEFAULT_KV_TYPE
    cache_type_v: str = DEFAULT_KV_TYPE


def kernel_context(options: EngineOptions) -> ops.KernelContext:
    """The kernel settings an engine owns (threads, activation precision)."""
    n = options.n_threads
    if n is not None and n > MAX_THREADS:
        raise InputError(f"-t {n} is more threads than this engine supports ({MAX_THREADS})")
    kwargs: dict[str, object] = {"act_precision": options.act_precision}
    if n is not None and n > 0:
        kwargs["n_threads"] = n
    try:
        return ops.KernelContext(**kwargs)  # type: ignore[arg-type]
    except ValueError as e:
        raise InputError(str(e)) from None


def weights_in_memory(gguf: GGUFFile, mmap: bool | None) -> GGUFFile:
    """The file whose tensors the engine reads: copied into memory (gguf.reader.in_memory: huge pages, no page
    faults during decode) unless `mmap` is True, or None and the copy would take more than half of the available
    memory (then the file mapping, as llama.cpp's default)."""
    if mmap is True:
        return gguf
    need, available = tensor_bytes_total(gguf), available_memory_bytes()
    if mmap is None and available is not None and need > available // 2:
        log.info(
            "weights (%s) stay on the file mapping: more than half of the available %s",
            _gib(need),
            _gib(available),
        )
        return gguf
    if available is not None and need > available:
        raise InputError(
            f"--no-mmap: the weights need {_gib(need)}, only {_gib(available)} is available (use --mmap)"
        )
    try:
        return in_memory(gguf)
    except OSError as e:
        raise InputError(f"cannot read the weights of {gguf.path} into memory: {e.strerror or e}") from None


@dataclass(eq=False)
class AssembledModel:
    """A model file read, placed and built for the kernels of `kc`: what an Engine steps.

    stage: this rank's layers under a pipeline (gguf and config are then the stage's view), else None.
    sparse_stats: the sparse FFN's counters (None for a dense run); the model's sparse FFNs add to them.
    """

    model_path: Path
    options: EngineOptions
    kc: ops.KernelContext
    gguf: GGUFFile
    config: ModelConfig
    tokenizer: Tokenizer
    n_ctx: int
    stage: Stage | None
    plan: DevicePlan
    loader: Loader
    model: Transformer
    sparse_stats: SparseStats | None

    @property
    def placement(self) -> Placement | None:
        return self.plan.placement

    @property
    def pool_device(self) -> torch.device | None:
        return torch.device(self.plan.device) if self.plan.device is not None else None


def check_stamp(gguf: GGUFFile) -> None:
    """A file our sparsify made (it has Keys.SPARSITY_METHOD): FormatError where its version stamp says another
    format, one warning where other code made it (powerinfer.stamps); other files are not ours to judge."""
    if Keys.SPARSITY_METHOD not in gguf.metadata:
        return
    verdict = stamps.check_gguf("sparse", gguf.metadata)
    if verdict.changed:
        raise FormatError(
            f"{gguf.path}: a sparse file of another format ({verdict.found}): sparsify it again"
        )
    stamps.warn_user_file(f"the sparse file {gguf.path}", verdict)


def assemble(model_path: str | os.PathLike[str], options: EngineOptions | None = None) -> AssembledModel:
    """Read, plan and build the model of `model_path` as `options` say (the KV cache and steps: Engine)."""
    o = options or EngineOptions()
    kc = kernel_context(o)
    if o.n_batch <= 0:
        raise InputError(f"batch size must be positive (got {o.n_batch})")
    if o.n_seq < 1:
        raise InputError(f"the number of sequences must be >= 1 (got {o.n_seq})")
    for flag, name in (("--cache-type-k", o.cache_type_k), ("--cache-type-v", o.cache_type_v)):
        if name not in KV_TYPES:
            raise InputError(f"{flag} {name!r} is not a KV cache type: choose one of {', '.join(KV_TYPES)}")
    gguf = read_gguf(model_path)
    check_stamp(gguf)
    c = load_config(gguf, o.rope)
    stage: Stage | None = None
    if o.pipeline is not None:  # this rank's layers only: a view of the file with n_layer of them
        from powerinfer.runtime.pipeline import plan_stage, stage_view

        stage = plan_stage(o.pipeline, gguf, c)
        gguf, c = stage_view(gguf, c, stage.layers)
    if o.memory_limit_gib is None:
        gguf = weights_in_memory(gguf, o.mmap)
    tokenizer = Tokenizer.from_metadata(gguf.metadata, powerinfer_file=gguf.is_sparse)
    if tokenizer.n_vocab != c.n_vocab:
        raise InputError(f"tokenizer has {tokenizer.n_vocab} tokens, model {c.n_vocab}")
    n_ctx = context_size(o.n_ctx, c.n_ctx_train)
    sparse = gguf.is_sparse and not o.dense_ffn
    sparse_stats = SparseStats.zeros(c.n_layer) if sparse else None
    plan = device_plan(o, gguf, c, n_ctx, sparse, stage.layers if stage is not None else None)
    sparsity = Sparsity(c.sparse_method, c.sparse_threshold) if sparse else Sparsity()
    loader = Loader(gguf, plan, kc, sparsity, sparse_stats)
    check_cache_types(o, c, plan)
    check_context_memory(c, loader, n_ctx, o.n_seq, o.cache_type_k, o.cache_type_v)
    predictor = None
    if o.memory_limit_gib is not None:
        moe = getattr(c, "moe", None)
        if moe is not None and moe.route_input == "ffn":
            predictor = load_router_predictor(Path(model_path), c.n_layer, moe.n_expert, c.n_embd)
        # the predictor's arrays, and as much again while they were read, are the runtime's too
        extra = 0 if predictor is None else 2 * (predictor[0].nbytes + predictor[1].nbytes)
        loader.store = expert_store(o, Path(model_path), gguf, c, plan, stage, n_ctx, extra)
    with torch_threads(kc.n_threads):  # torch's ops while building (RoPE tables) at this engine's count
        model = build_model(gguf, c, loader)
        model.setup(n_ctx, placed=plan.device is not None)
        if plan.device is not None:  # one token through the resident layers: device spans (graphs on CUDA)
            model.span_maker = SpanMaker(torch.device(plan.device), n_ctx)
    if loader.store is not None:
        connect_predictors(model, loader.store, kc, predictor)
    return AssembledModel(
        Path(model_path), o, kc, gguf, c, tokenizer, n_ctx, stage, plan, loader, model, sparse_stats
    )


def expert_store(
    o: EngineOptions,
    path: Path,
    gguf: GGUFFile,
    c: ModelConfig,
    plan: DevicePlan,
    stage: Stage | None,
    n_ctx: int,
    extra: int = 0,
) -> ExpertStore:
    """The experts under --memory-limit: planned from the limit, this process's size, the dense weights and the
    profile's expert counts, then the pinned ones read (placement.memory, runtime.expert_store); `extra` bytes more
    for the runtime (the router predictor)."""
    assert o.memory_limit_gib is not None
    moe = getattr(c, "moe", None)
    if moe is None:
        raise InputError(
            "--memory-limit applies to mixture-of-experts files only (this model has no experts)"
        )
    if not 0 < o.memory_limit_gib <= MAX_MEMORY_LIMIT_GIB:
        raise InputError(
            f"--memory-limit must be in (0, {MAX_MEMORY_LIMIT_GIB}] GiB (got {o.memory_limit_gib})"
        )
    if plan.device is not None or stage is not None:
        raise InputError(
            "--memory-limit runs the experts on the CPU of one process (no pool device, no pipeline)"
        )
    if o.mmap is False:
        raise InputError("--memory-limit reads the dense weights from the file mapping (not with --no-mmap)")
    limit = int(o.memory_limit_gib * 2**30)
    base = (o.memory_runtime_bytes if o.memory_runtime_bytes is not None else resident_bytes()) + extra
    kv = kv_cache_bytes(c.n_layer, n_ctx, c.n_embd_gqa, o.n_seq, o.cache_type_k, o.cache_type_v)
    layers, expert_sizes, expert_total = [], [], 0
    for bid in range(c.n_layer):
        infos = [gguf.tensors[t.format(bid=bid)] for t in EXPERT_TENSORS]
        sizes = tuple(info.n_bytes // moe.n_expert for info in infos)
        layers.append(LayerFiles(tuple(info.offset for info in infos), sizes))  # type: ignore[arg-type]
        expert_sizes.append(sizes)
        expert_total += sum(info.n_bytes for info in infos)
    dense = tensor_bytes_total(gguf) - expert_total
    no_readahead_into_experts(gguf, c.n_layer)
    counts = load_expert_counts(path, c.n_layer, moe.n_expert)
    mplan = plan_memory(limit, runtime_bytes(limit, base, kv), dense, expert_sizes, moe.n_expert, counts)
    log.info("%s", mplan.describe(moe.n_expert))
    return ExpertStore(path, layers, moe.n_expert, mplan)


def no_readahead_into_experts(gguf: GGUFFile, n_layer: int) -> None:
    """The file mapping read page by page as touched (MADV_RANDOM), the dense tensors read ahead explicitly
    (MADV_WILLNEED): the kernel's read-around of a fault in a dense tensor would otherwise bring megabytes of the
    stacked experts next to it into the page cache (measured on the 5.5 GB synthetic file under 2.5 GiB: 300 MB of
    expert pages, which a memory limit counts)."""
    mm = getattr(gguf.mmap, "_mmap", None)
    if mm is None or not hasattr(mmap, "MADV_RANDOM"):
        return
    experts = {t.format(bid=bid) for bid in range(n_layer) for t in EXPERT_TENSORS}
    try:
        mm.madvise(mmap.MADV_RANDOM)
        page = mmap.PAGESIZE
        for name, info in gguf.tensors.items():
            if name in experts or info.n_bytes == 0:
                continue
            start = info.offset // page * page
            end = -(-(info.offset + info.n_bytes) // page) * page
            mm.madvise(mmap.MADV_WILLNEED, start, min(end, len(mm)) - start)
    except (OSError, ValueError) as e:  # advice only
        log.debug("madvise on %s: %s", gguf.path, e)


def connect_predictors(
    model: Transformer,
    store: ExpertStore,
    kc: ops.KernelContext,
    trained: tuple[np.ndarray, np.ndarray] | None,
) -> None:
    """Each MoE layer routed on its FFN input predicts the next layer's experts (runtime.expert_store): with the
    predictor train-predictor wrote beside the model (`trained`: w, b) where there is one, else the next layer's
    router."""
    ffns = [layer.ffn for layer in model.layers]
    for bid in range(len(ffns) - 1):
        here, nxt = ffns[bid], ffns[bid + 1]
        if not isinstance(here, MoEFFN) or not isinstance(nxt, MoEFFN) or nxt.spec.route_input != "ffn":
            continue
        if trained is not None:
            store.predictors[bid] = TrainedRouter(nxt, trained[0][bid], trained[1][bid], kc)
            continue
        ratio = model.layers[bid + 1].ffn_norm.weight.to("cpu") / model.layers[bid].ffn_norm.weight.to("cpu")
        store.predictors[bid] = NextRouter(nxt, ratio.float(), kc)


def context_size(n_ctx: int, n_ctx_train: int) -> int:
    """The context an engine runs: -c, 0 for the model's training context, at most that."""
    n = n_ctx if n_ctx > 0 else n_ctx_train
    if n > n_ctx_train:
        # positions past the training context degrade the text; take the model's own limit
        log.warning(
            "context %d exceeds the model's training context %d; using %d", n, n_ctx_train, n_ctx_train
        )
        return n_ctx_train
    return n


def check_cache_types(o: EngineOptions, c: ModelConfig, plan: DevicePlan) -> None:
    """Refuse -ctk / -ctv types the model's heads or the placement cannot take: the block types store each head
    as whole blocks of 32, and the pool device's attention (device spans, padded decode) reads f32 caches only."""
    for flag, name in (("--cache-type-k", o.cache_type_k), ("--cache-type-v", o.cache_type_v)):
        why = KV_TYPES[name].fits(c.head_dim)
        if why is not None:
            raise InputError(f"{flag} {name}: {why}; use f32, f16 or bf16")
    typed = [n for n in (o.cache_type_k, o.cache_type_v) if n != "f32"]
    if typed and plan.device is not None and plan.kv_layers:
        raise InputError(
            f"--cache-type-k/--cache-type-v {typed[0]}: the KV cache of {len(plan.kv_layers)} layers is on the "
            f"pool device ({plan.device}), whose attention reads f32 caches only; use f32 there"
        )


def check_context_memory(
    c: ModelConfig,
    loader: Loader,
    n_ctx: int,
    n_seq: int,
    type_k: str = DEFAULT_KV_TYPE,
    type_v: str = DEFAULT_KV_TYPE,
) -> None:
    """Refuse a context whose host buffers (KV cache, RoPE tables, attention scores) need more memory than
    this process can get, before any of them is allocated: the context comes from -c or, with -c 0, from
    the file's context_length."""
    n_layer = sum(1 for bid in range(c.n_layer) if loader.kv_device(bid).type == "cpu")
    kv = kv_cache_bytes(n_layer, n_ctx, c.n_embd_gqa, n_seq, type_k, type_v)
    tables = n_ctx * (c.head_dim // 2 * ROPE_BYTES_PER_PAIR + c.n_head * 4)
    available = available_memory_bytes()
    if available is not None and kv + tables > available:
        kv_terms = f"{n_layer} layers x {n_ctx} x {c.n_embd_gqa} x {kv_bytes_terms(type_k, type_v)} bytes"
        raise InputError(
            f"context of {n_ctx} tokens needs {_gib(kv + tables)} of host memory (KV cache {kv_terms} "
            f"x {n_seq} sequences = {_gib(kv)}), only {_gib(available)} is available; "
            "use a smaller context (-c)"
        )


def device_plan(
    o: EngineOptions, gguf: GGUFFile, c: ModelConfig, n_ctx: int, sparse: bool, layers: range | None
) -> DevicePlan:
    """Where weights, KV caches and residuals live: -ngl for dense files, the VRAM budget for sparse ones
    (`layers`: a pipeline stage's, else every layer)."""
    if o.n_gpu_layers < 0:
        raise PlacementError(f"-ngl must be >= 0 (got {o.n_gpu_layers})")
    request = PoolRequest(
        o.pool_device, o.vram_budget_gib, o.gpu_index_path, o.reset_gpu_index, o.disable_gpu_index
    )
    if sparse:
        if o.n_gpu_layers > 0:
            log.warning("sparse models ignore -ngl/--n-gpu-layers; use --vram-budget instead")
        if (
            o.vram_budget_gib is not None
            and o.vram_budget_gib >= 0
            and not torch.cuda.is_available()
            and o.pool_device is None
        ):
            log.warning("no CUDA device: --vram-budget ignored, running on the CPU")
        device = pool_device(request)
        if device is None:
            return DevicePlan()
        if c.sparse_method == "teal":
            raise ConfigError(
                "TEAL files (sparsify --method teal) run on the CPU: --vram-budget and --pool-device are not "
                "built for them yet"
            )
        return plan_pool(gguf, c, request, device, n_ctx, layers, o.n_seq)
    moe = getattr(c, "moe", None)
    if moe is not None:
        return moe_device_plan(o, gguf, c, moe.n_expert, n_ctx)
    if o.cpu_moe or o.n_cpu_moe or o.override_tensor:
        log.warning("%s is not a MoE model: --cpu-moe, --n-cpu-moe and -ot ignored", gguf.path)
    if o.n_gpu_layers > 0:
        if o.pool_device is None and not torch.cuda.is_available():
            log.warning("no CUDA device: -ngl %d ignored, running on the CPU", o.n_gpu_layers)
            return DevicePlan()
        device = pool_device(PoolRequest(o.pool_device or "cuda", None))
        if device is None:  # pragma: no cover - pool_device returns a device when one is asked for
            raise PlacementError("no device for -ngl")
        return layers_plan(gguf.tensors, c.n_layer, o.n_gpu_layers, str(device))
    return DevicePlan()


def moe_device_plan(
    o: EngineOptions, gguf: GGUFFile, c: ModelConfig, n_expert: int, n_ctx: int
) -> DevicePlan:
    """A MoE file's plan: -ngl layers (or, with --vram-budget, the dense parts that fit) and the experts the
    static flags and the budget put in the pool (placement.experts); everything on the CPU without a pool."""
    cuda = torch.cuda.is_available()
    has_pool = o.pool_device is not None or cuda
    device = None
    if has_pool:
        device = pool_device(PoolRequest(o.pool_device or "cuda", o.vram_budget_gib))
    overrides = parse_overrides(o.override_tensor, pool_names(None if device is None else str(device)))
    request = ExpertRequest(o.cpu_moe, o.n_cpu_moe, overrides)
    budget = o.vram_budget_gib is not None and has_pool
    if device is None or not (o.n_gpu_layers > 0 or budget or any(d == "pool" for _, d in overrides)):
        if o.n_gpu_layers > 0 and not has_pool:
            log.warning("no CUDA device: -ngl %d ignored, running on the CPU", o.n_gpu_layers)
        return DevicePlan()
    if o.n_gpu_layers < 0:
        raise PlacementError(f"-ngl must be >= 0 (got {o.n_gpu_layers})")
    limit = budget_bytes(PoolRequest(str(device), o.vram_budget_gib), device) if budget else None
    return plan_moe_pool(gguf, c, n_expert, device, n_ctx, o.n_gpu_layers, limit, request, o.n_seq)
