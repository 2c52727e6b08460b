"""Quantize a GGUF or PowerInfer GGUF file, as llama.cpp's `quantize` does.

Per-tensor types follow llama.cpp's `llama_tensor_get_type` (powerinfer.quant.mix): the K-quant mixes (more
bits on some attn_v and ffn_down matrices), the output.weight rule, and the fallback to a 32-element type when a
row length is not a multiple of 256. A model without `output.weight` (tied embeddings: `token_embd.weight` is also
the output head) gets the output rule on `token_embd.weight`, as later llama.cpp does; the original PowerInfer
quantized it like any matrix, which costs SmolLM2-135M 8% perplexity at 4 bits (docs/kernels.md). PowerInfer's own
rule (spec 1.7) is kept for its predictor matrices fc1/fc2 (mix.predictor_type). Blocks come from
`powerinfer.quant`: the `gguf` package's reference quantizers for the legacy types, our C quantizers (bit-exact with
ggml-quants.c) for K-quants and IQ4.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from powerinfer.errors import FormatError, InputError
from powerinfer.gguf import GGMLType, GGUFWriter, read_gguf
from powerinfer.gguf.constants import GGUF_DEFAULT_ALIGNMENT, QUANT_SIZES, Keys, TensorNames, ValueType
from powerinfer.gguf.reader import GGUFFile, TensorInfo
from powerinfer.gguf.writer import output_problem
from powerinfer.ops.encode import quantize
from powerinfer.printable import printable
from powerinfer.quant import FLOAT_TYPES, PRODUCIBLE, WEIGHT_TYPES, dequantize, row_bytes
from powerinfer.quant.mix import (
    Category,
    MixState,
    ModelFacts,
    allows_quantization,
    category,
    fallback,
    llama_order,
    mix_type,
    model_facts,
    predictor_type,
)
from powerinfer.quant.types import (
    FILE_TYPE_ALIASES,
    FILE_TYPES,
    FILE_TYPES_NEED_IMATRIX,
    FileType,
    guess_ftype,
)

QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION
_CHUNK_ELEMENTS = 1 << 20  # elements per work item of the thread pool


_BY_NAME = {ft.name: ft for ft in FILE_TYPES}
_BY_NUMBER = {ft.ftype: ft for ft in FILE_TYPES if ft.ggml_type is not None}
# ggml type -> llama_ftype, for a file without general.file_type (llama.cpp guesses from the commonest type)


def parse_file_type(text: str) -> FileType | None:
    """TYPE by name (case-insensitive, quantize.cpp's aliases included) or llama_ftype number; None when `text`
    is not a type at all. Raises InputError for a mix that needs an importance matrix."""
    name = text.strip().upper()
    name = FILE_TYPE_ALIASES.get(name, name)
    imatrix_name = next((k for k, v in FILE_TYPES_NEED_IMATRIX.items() if name in (k, str(v))), None)
    if imatrix_name is not None:
        raise InputError(
            f"type {imatrix_name} needs an importance matrix (--imatrix), which is not supported"
        )
    if name in _BY_NAME:
        return _BY_NAME[name]
    number = int(name) if name.lstrip("-").isdigit() else None
    if number is not None and number in _BY_NUMBER:
        return _BY_NUMBER[number]
    return None


def require_file_type(text: str) -> FileType:
    """parse_file_type, with an error naming the valid types when `text` is not one."""
    ft = parse_file_type(text)
    if ft is None:
        raise InputError(
            f"unknown quantization type '{printable(text, 40)}' (expected one of {', '.join(_BY_NAME)} "
            f"or a llama.cpp ftype number)"
        )
    return ft


def require_tensor_type(text: str | None, flag: str) -> GGMLType | None:
    """A ggml type name given to --output-tensor-type / --token-embedding-type (None stays None)."""
    if text is None:
        return None
    name = text.strip().upper()
    if name in GGMLType.__members__ and GGMLType[name] in PRODUCIBLE:
        return GGMLType[name]
    choices = ", ".join(t.name for t in sorted(PRODUCIBLE, key=lambda t: t.value))
    raise InputError(
        f"{flag}: unknown or unsupported ggml type '{printable(text, 40)}' (expected one of {choices})"
    )


@dataclass(frozen=True)
class QuantizeOptions:
    input: Path
    output: Path
    file_type: FileType
    n_threads: int = 1
    allow_requantize: bool = False
    leave_output_tensor: bool = False
    pure: bool = False
    output_tensor_type: GGMLType | None = None  # --output-tensor-type: output.weight's type, no rule applied
    token_embedding_type: GGMLType | None = None  # --token-embedding-type: token_embd.weight's type


@dataclass(frozen=True)
class TensorPlan:
    """What happens to one tensor: its source and destination type, and why it kept its type if it did."""

    name: str
    shape: tuple[int, ...]  # row-major
    src_type: GGMLType
    dst_type: GGMLType
    note: str = ""

    @property
    def converted(self) -> bool:
        return self.src_type != self.dst_type


@dataclass(frozen=True)
class TensorDone:
    """Progress event: tensor `index` (0-based) of `n_tensors` has been encoded."""

    index: int
    n_tensors: int
    plan: TensorPlan
    src_bytes: int
    dst_bytes: int


@dataclass
class QuantizeReport:
    output: Path
    file_type: FileType
    plans: list[TensorPlan] = field(default_factory=list)
    src_bytes: int = 0
    dst_bytes: int = 0
    quantize_ms: float = 0.0


def default_output(input_path: Path, file_type: FileType) -> Path:
    """The original's default OUT: `<input dir>/ggml-model-<TYPE>.gguf`."""
    return input_path.parent / f"ggml-model-{file_type.name}.gguf"


def tensor_type(
    name: str,
    shape: tuple[int, ...],
    src_type: GGMLType,
    opts: QuantizeOptions,
    facts: ModelFacts,
    state: MixState,
) -> tuple[GGMLType, str]:
    """The destination ggml type of one tensor, and a note when a rule kept or changed its type.

    llama.cpp's llama_tensor_get_type: tensors llama.cpp never quantizes keep their type; --token-embedding-type
    and --output-tensor-type apply as given; else, for a quantized target, the predictor rule (fc1/fc2) or the
    mix rules (powerinfer.quant.mix; not with --pure), then the fallback for row lengths the type's block does
    not divide. Called in llama.cpp's tensor order (mix.llama_order), which advances `state`.
    """
    target = opts.file_type.ggml_type
    if name in (TensorNames.OUTPUT_SCREEN, TensorNames.OUTPUT_SCREEN_PROJ):
        return src_type, ""  # the sparse head's screen (model.head): its types are part of its design
    # 2-D weights, and 3-D stacks of them (a MoE layer's experts), as llama.cpp quantizes them
    if (
        target is None
        or len(shape) not in (2, 3)
        or not allows_quantization(name, len(shape), facts.powerinfer_file)
    ):
        return src_type, ""
    if name == "output.weight" and opts.leave_output_tensor:
        return src_type, ""
    cat = category(name)
    note = ""
    if opts.token_embedding_type is not None and cat == Category.TOKEN_EMBD:
        new_type = opts.token_embedding_type
    elif opts.output_tensor_type is not None and cat == Category.OUTPUT:
        new_type = opts.output_tensor_type
    elif target in FLOAT_TYPES:
        new_type = target
    else:
        new_type = target
        if not opts.pure:
            if name.endswith((".fc1.weight", ".fc2.weight")):
                new_type = predictor_type(target)
            else:
                new_type = mix_type(opts.file_type.ftype, target, name, shape[-1], facts, state)
        chosen = new_type
        new_type = fallback(chosen, shape[-1])
        if new_type != chosen:
            note = (
                f"row length {shape[-1]} is not a multiple of the {chosen.name} block size "
                f"{QUANT_SIZES[chosen][0]}: {new_type.name}"
            )
    if new_type == src_type:
        return src_type, note
    if src_type not in WEIGHT_TYPES:
        return src_type, f"{src_type.name} tensors cannot be converted: kept as {src_type.name}"
    if shape[-1] % QUANT_SIZES[new_type][0]:  # an explicit --*-type the row length does not fit
        return src_type, (
            f"row length {shape[-1]} is not a multiple of the {new_type.name} block size "
            f"{QUANT_SIZES[new_type][0]}: kept as {src_type.name}"
        )
    return new_type, note


def plan_tensors(model: GGUFFile, opts: QuantizeOptions) -> list[TensorPlan]:
    """The per-tensor plan in file order; raises InputError when it would requantize without permission."""
    names = list(model.tensors)
    facts = model_facts(dict(model.metadata), names)
    if model.is_sparse:  # PowerInfer's quantize: no tied-output rule (OPT's token_embd takes the target type)
        facts = dataclasses.replace(facts, powerinfer_file=True, tied_embeddings=False)
    state = MixState()
    by_name = {}
    for name in llama_order(names):  # the order the mix counters advance in
        t = model.tensors[name]
        dst, note = tensor_type(t.name, t.shape, t.ggml_type, opts, facts, state)
        by_name[name] = TensorPlan(t.name, t.shape, t.ggml_type, dst, note)
    plans = [by_name[name] for name in names]
    for plan in plans:
        if plan.converted and plan.src_type not in FLOAT_TYPES and not opts.allow_requantize:
            raise InputError(
                f"requantizing from type {plan.src_type.name} is disabled ({plan.name} is already "
                f"quantized): pass --allow-requantize"
            )
    return plans


def file_type_number(model: GGUFFile, opts: QuantizeOptions) -> int:
    """general.file_type of the output: the target's ftype; COPY keeps (or guesses) the input's."""
    if opts.file_type.ggml_type is not None:
        return opts.file_type.ftype
    if Keys.FILE_TYPE in model.metadata:
        return int(model.metadata[Keys.FILE_TYPE])
    return guess_ftype(t.ggml_type for t in model.tensors.values())


def _encode_rows(t: TensorInfo, plan: TensorPlan, out: np.ndarray, r0: int, r1: int) -> None:
    src = t.data.reshape(-1, row_bytes(plan.src_type, plan.shape[-1]))[r0:r1]
    rows = dequantize(src, plan.src_type, (r1 - r0, plan.shape[-1]))
    out[r0:r1] = quantize(rows, plan.dst_type)


def _check_output(path: Path) -> None:
    """Refuse, before any work, an output that cannot be written: a missing folder, a folder, a FIFO or a
    device at OUT (never replaced), or a folder we cannot create files in."""
    problem = output_problem(path)
    if problem is not None:
        raise InputError(f"cannot write {printable(str(path))}: {problem}")
    folder = path.absolute().parent
    try:  # a probe file: os.access says yes to root on read-only mounts and folders
        fd, probe = tempfile.mkstemp(prefix=".tmp-probe-", dir=folder)
    except OSError as e:
        raise InputError(f"cannot write {printable(str(path))}: {e.strerror}") from None
    try:
        os.close(fd)
    finally:
        os.unlink(probe)


def quantize_model(
    opts: QuantizeOptions, on_tensor: Callable[[TensorDone], None] | None = None
) -> QuantizeReport:
    """Quantize `opts.input` into `opts.output` (written to a temp file and renamed into place).

    Tensors are encoded in row chunks on `opts.n_threads` threads; `on_tensor` is called in file order as each
    tensor is ready. Raises InputError / FormatError on bad input before anything is written.
    """
    t_start = time.perf_counter()
    model = read_gguf(opts.input)
    plans = plan_tensors(model, opts)
    _check_output(opts.output)
    report = QuantizeReport(opts.output, opts.file_type, plans)

    writer = GGUFWriter(opts.output, sparse=model.is_sparse, alignment=model.alignment)
    skip = {Keys.ALIGNMENT} if model.alignment != GGUF_DEFAULT_ALIGNMENT else set()
    settings = {
        Keys.QUANTIZATION_VERSION: QUANTIZATION_VERSION,
        Keys.FILE_TYPE: file_type_number(model, opts),
    }
    for key, value in model.metadata.items():
        if key in skip:
            continue
        if key in settings:
            writer.add(key, settings.pop(key), ValueType.UINT32)
        else:
            writer.add(key, value, model.value_types[key], model.array_types.get(key))
    for key, value in settings.items():  # the original sets quantization_version first, then file_type
        writer.add(key, value, ValueType.UINT32)

    n = len(plans)
    pool = ThreadPoolExecutor(max(1, opts.n_threads))
    try:
        jobs = list(_submit(pool, model, plans))
        for i, (plan, out, futures) in enumerate(jobs):
            t = model.tensors[plan.name]
            for fut in futures:
                fut.result()
            writer.add_tensor(plan.name, out if out is not None else t.data, plan.dst_type, plan.shape)
            dst_bytes = out.nbytes if out is not None else t.n_bytes
            report.src_bytes += t.n_bytes
            report.dst_bytes += dst_bytes
            if on_tensor is not None:
                on_tensor(TensorDone(i, n, plan, t.n_bytes, dst_bytes))
    finally:  # on an error or Ctrl-C, drop the queued chunks instead of finishing them
        pool.shutdown(wait=True, cancel_futures=True)
    try:
        writer.write()
    except OSError as e:
        raise FormatError(f"cannot write {printable(str(opts.output))}: {e.strerror or e}") from None
    report.quantize_ms = (time.perf_counter() - t_start) * 1e3
    return report


def _submit(
    pool: ThreadPoolExecutor, model: GGUFFile, plans: list[TensorPlan]
) -> Iterator[tuple[TensorPlan, np.ndarray | None, list[Future[None]]]]:
    """Queue every chunk of every converted tensor at once, so that no thread idles between tensors."""
    for plan in plans:
        if not plan.converted:
            yield plan, None, []
            continue
        t = model.tensors[plan.name]
        n_rows, n_cols = math.prod(plan.shape[:-1]), plan.shape[-1]
        out = np.empty((n_rows, row_bytes(plan.dst_type, n_cols)), dtype=np.uint8)
        step = max(1, _CHUNK_ELEMENTS // n_cols)
        futures = [
            pool.submit(_encode_rows, t, plan, out, r0, min(r0 + step, n_rows))
            for r0 in range(0, n_rows, step)
        ]
        yield plan, out, futures
