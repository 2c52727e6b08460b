"""Memory-mapped GGUF / PWRI reader (numpy only, no copy of tensor data).

Dimensions are stored fastest-first in GGUF; they are reversed here once, so `TensorInfo.shape` is the
row-major (numpy/torch) shape and no other code reverses them.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from powerinfer.errors import FormatError
from powerinfer.gguf.constants import (
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    PWRI_LEGACY_TYPES,
    PWRI_MAGIC,
    QUANT_SIZES,
    VALUE_DTYPES,
    GGMLType,
    Keys,
    ValueType,
)

_MAX_DIMS = 4


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: row-major shape, ggml type and its raw bytes (a view of the memory map)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLType
    offset: int  # absolute byte offset in the file
    data: np.ndarray  # uint8 view, length n_bytes

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)


def tensor_nbytes(shape: tuple[int, ...], ggml_type: GGMLType) -> int:
    """Byte size of a tensor of `shape` (row-major) and `ggml_type`."""
    block_elems, block_bytes = QUANT_SIZES[ggml_type]
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return n // block_elems * block_bytes


class _Cursor:
    """Bounds-checked little-endian reader over the mapped header."""

    def __init__(self, buf: np.ndarray, path: str) -> None:
        self.buf = buf
        self.mv = memoryview(buf)
        self.pos = 0
        self.path = path

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise FormatError(f"{self.path}: file is truncated while reading {what} at byte {self.pos}")
        out = self.mv[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.take(size, what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        raw = self.take(n, what)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return bytes(raw).decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str) -> Any:
        try:
            vt = ValueType(vtype)
        except ValueError:
            raise FormatError(f"{self.path}: unknown metadata value type {vtype} for {what}") from None
        if vt == ValueType.STRING:
            return self.string(what)
        if vt == ValueType.ARRAY:
            etype = self.unpack("<I", what)
            count = self.unpack("<Q", what)
            try:
                et = ValueType(etype)
            except ValueError:
                raise FormatError(f"{self.path}: unknown array element type {etype} for {what}") from None
            if et == ValueType.STRING:
                return [self.string(what) for _ in range(count)]
            if et == ValueType.ARRAY:
                return [self.value(ValueType.ARRAY, what) for _ in range(count)]
            dtype = np.dtype(VALUE_DTYPES[et])
            raw = self.take(count * dtype.itemsize, what)
            arr = np.frombuffer(raw, dtype=dtype).copy()
            return arr.astype(bool) if et == ValueType.BOOL else arr
        dtype = np.dtype(VALUE_DTYPES[vt])
        v = np.frombuffer(self.take(dtype.itemsize, what), dtype=dtype)[0]
        if vt == ValueType.BOOL:
            return bool(v)
        return float(v) if vt in (ValueType.FLOAT32, ValueType.FLOAT64) else int(v)


class GGUFFile:
    """A parsed GGUF or PWRI file.

    Attributes: `magic` ("GGUF" or "PWRI"), `version`, `metadata` (key -> value; numeric arrays are numpy
    arrays, string arrays lists), `value_types` (key -> ValueType of the stored value), `tensors`
    (name -> TensorInfo, in file order), `data_offset`, `alignment`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FormatError(f"{self.path}: no such file")
        size = os.path.getsize(self.path)
        if size < 24:
            raise FormatError(f"{self.path}: file is truncated ({size} bytes, not a GGUF file)")
        # copy-on-write mapping: writable views for torch without copying pages unless written
        self.mmap = np.memmap(self.path, dtype=np.uint8, mode="c")
        self._parse()

    @property
    def is_sparse(self) -> bool:
        """True for PowerInfer (PWRI) files: sparse inference mode."""
        return self.magic == "PWRI"

    def _parse(self) -> None:
        cur = _Cursor(self.mmap, self.path)
        magic = bytes(cur.take(4, "magic"))
        if magic not in (GGUF_MAGIC, PWRI_MAGIC):
            raise FormatError(f"{self.path}: bad magic {magic!r}: expected b'GGUF' or b'PWRI'")
        self.magic = magic.decode()
        self.version = cur.unpack("<I", "version")
        if self.version == 1:
            raise FormatError(f"{self.path}: GGUF version 1 is not supported")
        if self.version > 3:
            raise FormatError(f"{self.path}: unsupported GGUF version {self.version}")
        n_tensors = cur.unpack("<Q", "tensor count")
        n_kv = cur.unpack("<Q", "metadata count")
        if n_tensors > size_limit(self.mmap) or n_kv > size_limit(self.mmap):
            raise FormatError(f"{self.path}: corrupt header (n_tensors={n_tensors}, n_kv={n_kv})")

        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, ValueType] = {}
        self.array_types: dict[str, ValueType] = {}  # element type of array values
        for i in range(n_kv):
            key = cur.string(f"metadata key {i}")
            vtype = cur.unpack("<I", f"type of {key}")
            if vtype == ValueType.ARRAY and cur.pos + 4 <= len(self.mmap):
                elem = struct.unpack_from("<I", cur.mv, cur.pos)[0]
                if elem in ValueType._value2member_map_:
                    self.array_types[key] = ValueType(elem)
            self.metadata[key] = cur.value(vtype, key)
            self.value_types[key] = ValueType(vtype)

        self.alignment = int(self.metadata.get(Keys.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise FormatError(f"{self.path}: invalid general.alignment {self.alignment}")

        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor {i} name")
            n_dims = cur.unpack("<I", f"dims of {name}")
            if n_dims > _MAX_DIMS:
                raise FormatError(f"{self.path}: tensor {name} has {n_dims} dimensions (max {_MAX_DIMS})")
            ne = [cur.unpack("<Q", f"shape of {name}") for _ in range(n_dims)]
            raw_type = cur.unpack("<I", f"type of {name}")
            offset = cur.unpack("<Q", f"offset of {name}")
            try:
                ggml_type = (
                    PWRI_LEGACY_TYPES[raw_type]
                    if self.is_sparse and raw_type in PWRI_LEGACY_TYPES
                    else GGMLType(raw_type)
                )
            except ValueError:
                raise FormatError(f"{self.path}: tensor {name} has unknown ggml type {raw_type}") from None
            if ggml_type not in QUANT_SIZES:
                raise FormatError(f"{self.path}: tensor {name} has unsupported ggml type {ggml_type.name}")
            infos.append((name, tuple(reversed(ne)), ggml_type, offset))

        pad = (-cur.pos) % self.alignment
        self.data_offset = cur.pos + pad
        self.tensors: dict[str, TensorInfo] = {}
        file_size = len(self.mmap)
        for name, shape, ggml_type, offset in infos:
            block_elems, _ = QUANT_SIZES[ggml_type]
            if shape and shape[-1] % block_elems:
                raise FormatError(
                    f"{self.path}: tensor {name} row length {shape[-1]} is not a multiple of the "
                    f"{ggml_type.name} block size {block_elems}"
                )
            n_bytes = tensor_nbytes(shape, ggml_type)
            start = self.data_offset + offset
            if start + n_bytes > file_size:
                raise FormatError(
                    f"{self.path}: data of tensor {name} runs past the end of the file "
                    f"(needs bytes {start}..{start + n_bytes}, file has {file_size})"
                )
            if name in self.tensors:
                raise FormatError(f"{self.path}: duplicate tensor name {name}")
            self.tensors[name] = TensorInfo(name, shape, ggml_type, start, self.mmap[start : start + n_bytes])

    def copy_metadata(self, writer: Any, skip: frozenset[str] = frozenset()) -> None:
        """Add every metadata key (with its stored value type) to a GGUFWriter, except `skip`."""
        for key, value in self.metadata.items():
            if key not in skip:
                writer.add(key, value, self.value_types[key], self.array_types.get(key))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def size_limit(buf: np.ndarray) -> int:
    """Upper bound on any count in the header: every item takes at least 8 bytes."""
    return len(buf) // 8 + 1


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open and parse a GGUF or PWRI file; raises FormatError on any malformed input."""
    return GGUFFile(path)
