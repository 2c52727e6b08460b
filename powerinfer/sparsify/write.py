"""The sparsified model: a PowerInfer (PWRI) GGUF with CATS thresholds and ffn_down_t, and activation/ beside it.

Every tensor of the input is copied as stored, in input order, except `blk.N.ffn_down.weight` (n_embd, n_ff),
which becomes `blk.N.ffn_down_t.weight` (n_ff, n_embd), its transpose, in the same ggml type where that type can
be produced and kept (quant.types.DOWN_T_KEPT; else DOWN_T_DEFAULT, e.g. for K-quants), followed by `blk.N.ffn_act_threshold` (F32 (n_ff,)), the layer's
per-neuron thresholds on |act(gate)|, and, for two-stage selection, `blk.N.ffn_out_threshold` (F32 (n_ff,)), its
thresholds on |act(gate) * up|. MoE files (`write_moe_gguf`): a GGUF copy with the experts' thresholds as a key.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from powerinfer import stamps
from powerinfer.errors import FormatError
from powerinfer.gguf import GGMLType, GGUFWriter
from powerinfer.gguf.constants import GGUF_DEFAULT_ALIGNMENT, QUANT_SIZES, Keys, TensorNames, ValueType
from powerinfer.gguf.reader import GGUFFile, TensorInfo
from powerinfer.placement.stats import activation_file
from powerinfer.printable import printable
from powerinfer.profile.collect import write_folder_atomically
from powerinfer.quant import QUANTIZABLE, dequantize, quantize, row_bytes
from powerinfer.quant.types import DOWN_T_DEFAULT, DOWN_T_KEPT

# metadata of a sparsified file (the engine reads them; Keys.SPARSITY_* name the same keys)
ACTIVATION_KEY = "powerinfer.ffn_activation"  # arch.base.ACTIVATION_KEY
SPARSITY_METHOD_KEY = "powerinfer.sparsity.method"  # "cats"
SPARSITY_TARGET_KEY = "powerinfer.sparsity.target"  # float32: the mean skipped share S asked for
SPARSITY_THRESHOLDS_KEY = "powerinfer.sparsity.thresholds"  # float32[n_layer]: t_l on |act(gate u)|
SPARSITY_LAYER_KEY = "powerinfer.sparsity.layer_sparsity"  # float32[n_layer]: calibrated s_l
SPARSITY_UP_KEY = "powerinfer.sparsity.up_sparsity"  # float32[n_layer]: calibrated share of up rows skipped
# MoE files: float32[n_layer * n_expert * n_ff], every expert's per-neuron thresholds on |act(gate u)|
SPARSITY_EXPERT_KEY = Keys.SPARSITY_EXPERT_THRESHOLDS
SPARSITY_KEYS = (
    SPARSITY_METHOD_KEY,
    SPARSITY_TARGET_KEY,
    SPARSITY_THRESHOLDS_KEY,
    SPARSITY_LAYER_KEY,
    SPARSITY_UP_KEY,
    SPARSITY_EXPERT_KEY,
)

FFN_DOWN = re.compile(r"blk\.(\d+)\.ffn_down\.weight")
CHUNK_ELEMENTS = 1 << 20  # elements per thread-pool work item


def down_t_name(name: str) -> str:
    return name.replace(".ffn_down.weight", ".ffn_down_t.weight")


def transposed_type(src: GGMLType, n_cols: int, want: GGMLType | None = None) -> GGMLType:
    """The type of ffn_down_t: the DOWN_T_KEPT types as they are (exact, or one 8-bit rounding); every lower-bit
    type as DOWN_T_DEFAULT, since rounding the transpose to 4 or 5 bits again along the other axis costs the bundled
    SmolLM2 file +8% perplexity on its own (measured: PPL 18.92 vs 17.68 dense; with DOWN_T_DEFAULT 17.71;
    docs/sparsity.md). For the smallest sparse file, sparsify the F16 model and `quantize` the result (ffn_down_t is
    then rounded once, as PowerInfer does)."""
    if want is not None:
        dst = want
    else:
        dst = src if src in DOWN_T_KEPT and src in QUANTIZABLE else DOWN_T_DEFAULT
    if n_cols % QUANT_SIZES[dst][0]:
        dst = GGMLType.F32 if src == GGMLType.F32 else GGMLType.F16
    return dst


def transpose_tensor(t: TensorInfo, dst: GGMLType, pool: ThreadPoolExecutor) -> np.ndarray:
    """Raw blocks (n_cols, row_bytes) of the transpose of a 2-D tensor (n_rows, n_cols), encoded as dst."""
    n_rows, n_cols = t.shape
    src = t.data.reshape(n_rows, row_bytes(t.ggml_type, n_cols))
    dense = np.empty((n_rows, n_cols), dtype=np.float32)
    step = max(1, CHUNK_ELEMENTS // n_cols)

    def decode(r0: int) -> None:
        r1 = min(r0 + step, n_rows)
        dense[r0:r1] = dequantize(src[r0:r1], t.ggml_type, (r1 - r0, n_cols))

    list(pool.map(decode, range(0, n_rows, step)))
    dense_t = np.ascontiguousarray(dense.T)  # (n_cols, n_rows)
    out = np.empty((n_cols, row_bytes(dst, n_rows)), dtype=np.uint8)
    step_t = max(1, CHUNK_ELEMENTS // n_rows)

    def encode(r0: int) -> None:
        r1 = min(r0 + step_t, n_cols)
        out[r0:r1] = quantize(dense_t[r0:r1], dst)

    list(pool.map(encode, range(0, n_cols, step_t)))
    return out


def write_sparse_gguf(
    model: GGUFFile,
    path: Path,
    *,
    activation: str,
    target: float,
    thresholds: np.ndarray,
    neuron_thresholds: list[np.ndarray],
    layer_sparsity: np.ndarray,
    out_thresholds: list[np.ndarray] | None = None,
    up_sparsity: np.ndarray | None = None,
    n_threads: int = 1,
    progress: Callable[[int, int], None] | None = None,
    extra: list[tuple[str, np.ndarray, GGMLType, tuple[int, int]]] | None = None,
    down_type: GGMLType | None = None,
) -> dict[str, GGMLType]:
    """Write the sparsified copy of `model` to `path` (temp file, renamed into place).

    neuron_thresholds: per layer, the engine's thresholds on |act(gate)| (n_ff,), written as
    blk.N.ffn_act_threshold (F32) after the layer's ffn_down_t; out_thresholds (two-stage selection): per layer,
    the thresholds on |act(gate) * up| (n_ff,), written as blk.N.ffn_out_threshold after it, with up_sparsity
    (the share of up rows skipped per layer). Returns the type each ffn_down_t was written in.
    progress(done, total) counts ffn_down tensors. extra: (name, raw, type, shape) tensors added at the end (the
    output head's screen). down_type: ffn_down_t's type (None: transposed_type's choice).
    """
    writer = GGUFWriter(path, sparse=True, alignment=model.alignment)
    skip = {ACTIVATION_KEY, *SPARSITY_KEYS, stamps.KEY_FORMAT, stamps.KEY_CODE}
    if model.alignment != GGUF_DEFAULT_ALIGNMENT:
        skip.add(Keys.ALIGNMENT)  # the writer adds it
    model.copy_metadata(writer, frozenset(skip))
    add_stamp(writer, "sparse")
    writer.add(ACTIVATION_KEY, activation, ValueType.STRING)
    writer.add(SPARSITY_METHOD_KEY, "cats", ValueType.STRING)
    writer.add(SPARSITY_TARGET_KEY, float(target), ValueType.FLOAT32)
    writer.add(SPARSITY_THRESHOLDS_KEY, np.asarray(thresholds, dtype=np.float32), ValueType.ARRAY)
    writer.add(SPARSITY_LAYER_KEY, np.asarray(layer_sparsity, dtype=np.float32), ValueType.ARRAY)
    if up_sparsity is not None:
        writer.add(SPARSITY_UP_KEY, np.asarray(up_sparsity, dtype=np.float32), ValueType.ARRAY)

    downs = [t for t in model.tensors.values() if FFN_DOWN.fullmatch(t.name)]
    types: dict[str, GGMLType] = {}
    pool = ThreadPoolExecutor(max(1, n_threads))
    try:
        done = 0
        for t in model.tensors.values():
            if not FFN_DOWN.fullmatch(t.name):
                writer.add_tensor(t.name, t.data, t.ggml_type, t.shape)
                continue
            if len(t.shape) != 2:
                raise FormatError(f"{printable(t.name)} should be a matrix, has shape {t.shape}")
            n_embd, n_ff = t.shape
            dst = transposed_type(t.ggml_type, n_embd, down_type)
            name = down_t_name(t.name)
            if name in model.tensors:
                raise FormatError(f"{printable(model.path)} holds both {t.name} and {name}")
            writer.add_tensor(name, transpose_tensor(t, dst, pool), dst, (n_ff, n_embd))
            types[name] = dst
            bid = int(FFN_DOWN.fullmatch(t.name).group(1))  # type: ignore[union-attr]
            if not 0 <= bid < len(neuron_thresholds) or neuron_thresholds[bid].shape != (n_ff,):
                raise FormatError(f"{printable(t.name)}: no thresholds of {n_ff} neurons for layer {bid}")
            thr = np.ascontiguousarray(neuron_thresholds[bid], dtype=np.float32)
            writer.add_tensor(TensorNames.FFN_ACT_THRESHOLD.format(bid=bid), thr, GGMLType.F32, (n_ff,))
            if out_thresholds is not None:
                if out_thresholds[bid].shape != (n_ff,):
                    raise FormatError(f"{printable(t.name)}: no output thresholds of {n_ff} neurons")
                out = np.ascontiguousarray(out_thresholds[bid], dtype=np.float32)
                writer.add_tensor(TensorNames.FFN_OUT_THRESHOLD.format(bid=bid), out, GGMLType.F32, (n_ff,))
            done += 1
            if progress is not None:
                progress(done, len(downs))
    finally:  # on an error or Ctrl-C, drop queued chunks instead of finishing them
        pool.shutdown(wait=True, cancel_futures=True)
    _add_extra(writer, model, extra or [])
    _write(writer, path)
    return types


def write_teal_gguf(
    model: GGUFFile,
    path: Path,
    *,
    activation: str,
    target: float,
    thresholds: dict[str, float],
    layer_sparsity: np.ndarray,
    n_threads: int = 1,
    progress: Callable[[int, int], None] | None = None,
    extra: list[tuple[str, np.ndarray, GGMLType, tuple[int, int]]] | None = None,
    down_type: GGMLType | None = None,
) -> dict[str, GGMLType]:
    """Write the TEAL copy of `model` to `path` (temp file, renamed into place): a PWRI GGUF in which each matrix
    named in `thresholds` (TensorNames.TEAL_MATRICES) is its transpose `X_t.weight`, typed as ffn_down_t is
    (transposed_type), followed by its input threshold `X.input_threshold` (F32 (1,)); every other tensor as
    stored. Returns the type each transpose was written in; progress(done, total) counts the matrices."""
    writer = GGUFWriter(path, sparse=True, alignment=model.alignment)
    skip = {ACTIVATION_KEY, *SPARSITY_KEYS, stamps.KEY_FORMAT, stamps.KEY_CODE}
    if model.alignment != GGUF_DEFAULT_ALIGNMENT:
        skip.add(Keys.ALIGNMENT)
    model.copy_metadata(writer, frozenset(skip))
    add_stamp(writer, "sparse")
    writer.add(ACTIVATION_KEY, activation, ValueType.STRING)
    writer.add(SPARSITY_METHOD_KEY, "teal", ValueType.STRING)
    writer.add(SPARSITY_TARGET_KEY, float(target), ValueType.FLOAT32)
    writer.add(SPARSITY_LAYER_KEY, np.asarray(layer_sparsity, dtype=np.float32), ValueType.ARRAY)
    missing = [name for name in thresholds if name not in model.tensors]
    if missing:
        raise FormatError(f"{printable(model.path)} has no tensor {printable(missing[0])}")
    types: dict[str, GGMLType] = {}
    pool = ThreadPoolExecutor(max(1, n_threads))
    try:
        for t in model.tensors.values():
            if t.name not in thresholds:
                writer.add_tensor(t.name, t.data, t.ggml_type, t.shape)
                continue
            if len(t.shape) != 2:
                raise FormatError(f"{printable(t.name)} should be a matrix, has shape {t.shape}")
            n_rows, n_cols = t.shape
            name = TensorNames.transposed(t.name)
            if name in model.tensors:
                raise FormatError(f"{printable(model.path)} holds both {t.name} and {name}")
            dst = transposed_type(t.ggml_type, n_rows, down_type)
            writer.add_tensor(name, transpose_tensor(t, dst, pool), dst, (n_cols, n_rows))
            thr = np.array([thresholds[t.name]], dtype=np.float32)
            writer.add_tensor(TensorNames.input_threshold(t.name), thr, GGMLType.F32, (1,))
            types[name] = dst
            if progress is not None:
                progress(len(types), len(thresholds))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    _add_extra(writer, model, extra or [])
    _write(writer, path)
    return types


def _add_extra(
    writer: GGUFWriter, model: GGUFFile, extra: list[tuple[str, np.ndarray, GGMLType, tuple[int, int]]]
) -> None:
    for name, raw, ggml_type, shape in extra:
        if name in model.tensors:
            raise FormatError(f"{printable(model.path)} already holds {name}")
        writer.add_tensor(name, raw, ggml_type, shape)


def _write(writer: GGUFWriter, path: Path) -> None:
    try:
        writer.write()
    except OSError as e:
        raise FormatError(f"cannot write {printable(str(path))}: {e.strerror or e}") from None


def write_activation_folder(folder: Path, counts: list[np.ndarray]) -> Path:
    """activation/activation_<l>.pt (float32 counts per neuron, as `profile` writes them), replaced whole."""

    def write(tmp: Path) -> None:
        for layer, c in enumerate(counts):
            torch.save(torch.tensor(np.asarray(c, dtype=np.float32)), activation_file(tmp, layer))
        stamps.write_stamp_file(tmp, "profile")

    return write_folder_atomically(folder, write)


def add_stamp(writer: GGUFWriter, kind: str) -> None:
    """The version stamp of the code writing a `kind` file (powerinfer.stamps)."""
    (fkey, fmt), (ckey, code) = stamps.gguf_items(kind)
    writer.add(fkey, fmt, ValueType.UINT32)
    writer.add(ckey, code, ValueType.STRING)


def write_copy(
    model: GGUFFile,
    path: Path,
    extra: list[tuple[str, np.ndarray, GGMLType, tuple[int, int]]],
    kind: str = "default_model",
) -> None:
    """`model`'s metadata and tensors as stored, then `extra` (name, raw, type, shape) tensors, to `path` (temp
    file, renamed into place): a dense file with its head's screen, stamped as a `kind` file."""
    writer = GGUFWriter(path, sparse=model.is_sparse, alignment=model.alignment)
    skip = {stamps.KEY_FORMAT, stamps.KEY_CODE}
    if model.alignment != GGUF_DEFAULT_ALIGNMENT:
        skip.add(Keys.ALIGNMENT)
    model.copy_metadata(writer, frozenset(skip))
    add_stamp(writer, kind)
    for t in model.tensors.values():
        writer.add_tensor(t.name, t.data, t.ggml_type, t.shape)
    _add_extra(writer, model, extra)
    _write(writer, path)


def write_moe_gguf(
    model: GGUFFile,
    path: Path,
    *,
    target: float,
    thresholds: np.ndarray,
    expert_thresholds: np.ndarray,
    layer_sparsity: np.ndarray,
) -> None:
    """Write `model` (a MoE GGUF) with CATS thresholds for its experts to `path` (temp file, renamed into place).

    Every tensor and key is copied as stored (the file stays a GGUF llama.cpp loads: it ignores unknown keys but
    refuses unknown tensors), plus the sparsity keys: method "cats", the target, thresholds (the layers' t_l, the
    fallback of experts too rarely routed to), layer_sparsity and expert_act_thresholds, float32 (n_layer,
    n_expert, n_ff) flattened layer-major: the engine's per-neuron thresholds on |act(gate u)| of every expert.
    """
    writer = GGUFWriter(path, sparse=False, alignment=model.alignment)
    skip = {ACTIVATION_KEY, *SPARSITY_KEYS, stamps.KEY_FORMAT, stamps.KEY_CODE}
    if model.alignment != GGUF_DEFAULT_ALIGNMENT:
        skip.add(Keys.ALIGNMENT)
    model.copy_metadata(writer, frozenset(skip))
    add_stamp(writer, "sparse")
    writer.add(SPARSITY_METHOD_KEY, "cats", ValueType.STRING)
    writer.add(SPARSITY_TARGET_KEY, float(target), ValueType.FLOAT32)
    writer.add(SPARSITY_THRESHOLDS_KEY, np.asarray(thresholds, dtype=np.float32), ValueType.ARRAY)
    writer.add(SPARSITY_LAYER_KEY, np.asarray(layer_sparsity, dtype=np.float32), ValueType.ARRAY)
    flat = np.ascontiguousarray(expert_thresholds, dtype=np.float32).reshape(-1)
    writer.add(SPARSITY_EXPERT_KEY, flat, ValueType.ARRAY)
    for t in model.tensors.values():
        writer.add_tensor(t.name, t.data, t.ggml_type, t.shape)
    _write(writer, path)
