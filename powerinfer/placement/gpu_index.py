"""GPU index file (`<model>.generated.gpuidx`): which FFN neurons of each layer live on the GPU (spec 3.6).

Layout, identical to PowerInfer's export_split.py: a PWRI v3 file with the KVs `general.architecture` =
"generic.gpu_index", `generic.gpu_index.block_count` (u32) and `split.vram_capacity` (u64, the FFN byte
budget the index was made for), our version stamp (powerinfer.stamps, kind "gpu_index": an index of another
format or code is regenerated, with one log line; PowerInfer's own files have none and are used), then per layer l the I32 tensors `blk.l.gpu_idx` [n_ff] (1 = on GPU) at
position 2l and `blk.l.gpu_bucket` [k_l] (sorted GPU neuron ids) at position 2l+1.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerinfer import stamps
from powerinfer.errors import FormatError, PowerInferError
from powerinfer.gguf import GGMLType, GGUFWriter, Keys, TensorNames, ValueType, read_gguf
from powerinfer.printable import printable

log = logging.getLogger(__name__)

GPU_INDEX_SUFFIX = ".generated.gpuidx"
KIND = "gpu_index"


@dataclass(frozen=True, eq=False)
class GPUIndex:
    """Per-layer GPU membership: gpu_idx[l] bool (n_ff,), gpu_bucket[l] sorted int32 ids; budget in bytes."""

    vram_capacity: int
    gpu_idx: list[np.ndarray]
    gpu_bucket: list[np.ndarray]

    def __post_init__(self) -> None:
        if int(self.vram_capacity) < 0:
            raise FormatError(f"GPU index: vram_capacity must be >= 0, got {self.vram_capacity}")
        if len(self.gpu_idx) != len(self.gpu_bucket):
            raise FormatError(
                f"GPU index: {len(self.gpu_idx)} gpu_idx arrays but {len(self.gpu_bucket)} gpu_bucket arrays"
            )
        widths = {int(m.shape[0]) for m in self.gpu_idx if m.ndim == 1}
        if len(widths) > 1:
            raise FormatError(f"GPU index: layers have different FFN sizes {sorted(widths)}")
        for layer, (mask, bucket) in enumerate(zip(self.gpu_idx, self.gpu_bucket, strict=True)):
            _check_layer(layer, mask, bucket, "GPU index")

    @property
    def n_layer(self) -> int:
        return len(self.gpu_idx)

    @property
    def n_ff(self) -> int:
        return int(self.gpu_idx[0].shape[0]) if self.gpu_idx else 0

    @classmethod
    def from_neurons(cls, gpu_neurons: Sequence[np.ndarray], n_ff: int, vram_capacity: int) -> GPUIndex:
        """Build an index from per-layer GPU neuron ids (any order, no duplicates)."""
        masks, buckets = [], []
        for layer, ids in enumerate(gpu_neurons):
            ids = np.asarray(ids, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= n_ff):
                raise FormatError(f"GPU index: layer {layer} has neuron ids outside 0..{n_ff - 1}")
            mask = np.zeros(n_ff, dtype=bool)
            mask[ids] = True
            if int(mask.sum()) != ids.size:
                raise FormatError(f"GPU index: layer {layer} lists a neuron id twice")
            masks.append(mask)
            buckets.append(np.flatnonzero(mask).astype(np.int32))
        return cls(int(vram_capacity), masks, buckets)

    def gpu_neurons(self) -> list[np.ndarray]:
        """Per-layer sorted GPU neuron ids (int32), i.e. the buckets."""
        return [b.copy() for b in self.gpu_bucket]


def _check_layer(layer: int, mask: np.ndarray, bucket: np.ndarray, where: str) -> None:
    if mask.ndim != 1 or mask.dtype != np.bool_:
        raise FormatError(f"{where}: gpu_idx of layer {layer} must be a 1-D bool array")
    if bucket.ndim != 1 or bucket.dtype != np.int32:
        raise FormatError(f"{where}: gpu_bucket of layer {layer} must be a 1-D int32 array")
    if not np.array_equal(bucket, np.flatnonzero(mask)):
        raise FormatError(
            f"{where}: layer {layer}: gpu_bucket ({bucket.size} ids) is not the sorted list of neurons "
            f"marked in gpu_idx ({int(mask.sum())} marked)"
        )


def gpu_index_path(model_path: str | os.PathLike[str]) -> Path:
    """Cache path of the GPU index beside the model: `<model file>.generated.gpuidx`."""
    return Path(os.fspath(model_path) + GPU_INDEX_SUFFIX)


def read_gpu_index(
    path: str | os.PathLike[str], n_layer: int | None = None, n_ff: int | None = None
) -> GPUIndex:
    """Read and validate a GPU index file; raises FormatError naming what is wrong.

    Tensors are taken by position (2l, 2l+1) as PowerInfer's loader does, and their names, types and
    shapes must also be the expected ones. `n_layer` / `n_ff`, when given, must match the file.
    """
    f = read_gguf(path)
    where = os.fspath(path)
    if f.magic != "PWRI":
        raise FormatError(f"{where}: not a GPU index file (magic {f.magic}, expected PWRI)")
    arch = f.get(Keys.ARCHITECTURE)
    if arch != Keys.GPU_INDEX_ARCH:
        raise FormatError(f"{where}: architecture is '{printable(arch)}', expected {Keys.GPU_INDEX_ARCH!r}")
    capacity = f.get(Keys.VRAM_CAPACITY)
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
        raise FormatError(f"{where}: missing or invalid {Keys.VRAM_CAPACITY} ({printable(capacity)})")
    tensors = list(f.tensors.values())
    if len(tensors) % 2:
        raise FormatError(f"{where}: {len(tensors)} tensors, expected 2 per layer")
    file_layers = len(tensors) // 2
    block_count = f.get(Keys.GPU_INDEX_BLOCK_COUNT)
    if block_count is not None and block_count != file_layers:
        raise FormatError(
            f"{where}: {Keys.GPU_INDEX_BLOCK_COUNT} is {printable(block_count)} but the file has "
            f"{len(tensors)} tensors ({file_layers} layers)"
        )
    if n_layer is not None and len(tensors) != 2 * n_layer:
        raise FormatError(f"{where}: {len(tensors)} tensors, expected 2 x {n_layer} layers = {2 * n_layer}")
    if file_layers == 0:
        raise FormatError(f"{where}: GPU index has no layers")

    masks, buckets = [], []
    width = n_ff
    for layer in range(file_layers):
        idx_t, bucket_t = tensors[2 * layer], tensors[2 * layer + 1]
        for pos, t, template in (
            (2 * layer, idx_t, TensorNames.GPU_IDX),
            (2 * layer + 1, bucket_t, TensorNames.GPU_BUCKET),
        ):
            expected = template.format(bid=layer)
            if t.name != expected:
                raise FormatError(
                    f"{where}: tensor at position {pos} is '{printable(t.name)}', expected {expected!r}"
                )
            if t.ggml_type != GGMLType.I32 or len(t.shape) != 1:
                raise FormatError(
                    f"{where}: {t.name} must be a 1-D I32 tensor, found {t.ggml_type.name} shape {t.shape}"
                )
        if width is None:
            width = idx_t.shape[0]
        if idx_t.shape[0] != width:
            raise FormatError(f"{where}: {idx_t.name} has {idx_t.shape[0]} entries, expected n_ff = {width}")
        raw_idx = idx_t.data.view("<i4")
        if np.any((raw_idx != 0) & (raw_idx != 1)):
            raise FormatError(f"{where}: {idx_t.name} holds values other than 0 and 1")
        bucket = bucket_t.data.view("<i4").astype(np.int32)
        if bucket.size and (bucket.min() < 0 or bucket.max() >= width):
            raise FormatError(f"{where}: {bucket_t.name} holds neuron ids outside 0..{width - 1}")
        mask = raw_idx.astype(bool)
        try:
            _check_layer(layer, mask, bucket, where)
        except FormatError as e:
            raise FormatError(f"{e} (bucket inconsistent with gpu_idx)") from None
        masks.append(mask)
        buckets.append(bucket)
    return GPUIndex(int(capacity), masks, buckets)


def write_gpu_index(path: str | os.PathLike[str], index: GPUIndex, stamp: bool = True) -> None:
    """Write `index` in PowerInfer's format (atomically: temp file, then rename), with our version stamp unless
    `stamp` is False (then byte for byte what PowerInfer writes). A FIFO, device or folder at `path` is never
    replaced: FormatError (GGUFWriter.write), which the pool logs as an uncached index."""
    writer = GGUFWriter(path, sparse=True)
    writer.add(Keys.ARCHITECTURE, Keys.GPU_INDEX_ARCH, ValueType.STRING)
    writer.add(Keys.GPU_INDEX_BLOCK_COUNT, index.n_layer, ValueType.UINT32)
    writer.add(Keys.VRAM_CAPACITY, int(index.vram_capacity), ValueType.UINT64)
    if stamp:
        (fkey, fmt), (ckey, code) = stamps.gguf_items(KIND)
        writer.add(fkey, fmt, ValueType.UINT32)
        writer.add(ckey, code, ValueType.STRING)
    for layer, (mask, bucket) in enumerate(zip(index.gpu_idx, index.gpu_bucket, strict=True)):
        writer.add_tensor(TensorNames.GPU_IDX.format(bid=layer), mask.astype(np.int32), GGMLType.I32)
        writer.add_tensor(TensorNames.GPU_BUCKET.format(bid=layer), bucket.astype(np.int32), GGMLType.I32)
    writer.write()


def load_cached_gpu_index(
    path: str | os.PathLike[str], *, n_layer: int, n_ff: int, reset: bool = False
) -> GPUIndex | None:
    """Return the cached index at `path` if it exists, is valid and matches the model; else None.

    `reset` (--reset-gpu-index) always returns None. An invalid file is logged and ignored, so the caller
    regenerates it. Whether its budget still applies is decided by `gpu_index_matches_budget`.
    """
    if reset:
        log.info("--reset-gpu-index: regenerating %s", path)
        return None
    if not Path(path).is_file():
        return None
    try:
        index = read_gpu_index(path, n_layer=n_layer, n_ff=n_ff)
        metadata = read_gguf(path).metadata
    except PowerInferError as e:
        log.warning("ignoring invalid GPU index cache: %s", e)
        return None
    verdict = stamps.check_gguf(KIND, metadata)
    if verdict.state in ("stale", "changed"):  # no stamp: PowerInfer's own file, used
        log.warning(
            "the GPU index cache %s was made by other code (%s); regenerating it", path, verdict.found
        )
        return None
    return index


def gpu_index_matches_budget(index: GPUIndex, vram_capacity: int) -> bool:
    """Our cache rule: reuse only an index made for exactly this FFN budget.

    PowerInfer also reuses an index made for a smaller budget and so never enlarges it (spec 8.11); we
    regenerate whenever the recorded `split.vram_capacity` differs from the current budget.
    """
    return int(index.vram_capacity) == int(vram_capacity)
