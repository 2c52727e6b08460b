"""Memory-mapped GGUF / PWRI reader (numpy only, no copy of tensor data).

Dimensions are stored fastest-first in GGUF; they are reversed here once, so `TensorInfo.shape` is the
row-major (numpy/torch) shape and no other code reverses them.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from itertools import pairwise
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
from powerinfer.printable import printable

_MAX_DIMS = 4
_MAX_ARRAY_DEPTH = 4  # arrays of arrays nested deeper than this are refused (GGUF models use none)
_INT64_MAX = 2**63 - 1
# the fewest bytes one metadata pair and one tensor-info record can take: every count in the header is bounded
# by the bytes left to hold its items
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dimension, type, offset
_INTEGER_TYPES = frozenset(
    {
        ValueType.UINT8,
        ValueType.INT8,
        ValueType.UINT16,
        ValueType.INT16,
        ValueType.UINT32,
        ValueType.INT32,
        ValueType.UINT64,
        ValueType.INT64,
    }
)


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
        return math.prod(self.shape)

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)


def tensor_nbytes(shape: tuple[int, ...], ggml_type: GGMLType) -> int:
    """Byte size of a tensor of `shape` (row-major) and `ggml_type` (exact: Python integers, no overflow)."""
    block_elems, block_bytes = QUANT_SIZES[ggml_type]
    return math.prod(shape) // block_elems * block_bytes


def _min_value_bytes(vtype: ValueType) -> int:
    """The fewest bytes one value of `vtype` takes in the file."""
    if vtype == ValueType.STRING:
        return 8
    if vtype == ValueType.ARRAY:
        return 4 + 8
    return np.dtype(VALUE_DTYPES[vtype]).itemsize


class _Cursor:
    """Bounds-checked little-endian reader over the mapped header."""

    def __init__(self, buf: np.ndarray, path: str) -> None:
        self.buf = buf
        self.mv = memoryview(buf)
        self.pos = 0
        self.path = path

    @property
    def left(self) -> int:
        """Bytes after the cursor."""
        return len(self.buf) - self.pos

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or n > self.left:
            raise FormatError(
                f"{self.path}: file is truncated while reading {printable(what)} at byte {self.pos}"
            )
        out = self.mv[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.take(size, what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        raw = self.take(n, what)
        # invalid UTF-8 is kept visible (U+FFFD) rather than refused: a name is compared, never executed
        return bytes(raw).decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        try:
            vt = ValueType(vtype)
        except ValueError:
            raise FormatError(
                f"{self.path}: unknown metadata value type {vtype} for '{printable(what)}'"
            ) from None
        if vt == ValueType.STRING:
            return self.string(what)
        if vt == ValueType.ARRAY:
            if depth >= _MAX_ARRAY_DEPTH:
                raise FormatError(
                    f"{self.path}: metadata '{printable(what)}' nests arrays deeper than {_MAX_ARRAY_DEPTH} levels"
                )
            etype = self.unpack("<I", what)
            count = self.unpack("<Q", what)
            try:
                et = ValueType(etype)
            except ValueError:
                raise FormatError(
                    f"{self.path}: unknown array element type {etype} for '{printable(what)}'"
                ) from None
            if count > self.left // _min_value_bytes(et):
                raise FormatError(
                    f"{self.path}: metadata '{printable(what)}' claims {count} {et.name} elements but only "
                    f"{self.left} bytes follow"
                )
            if et == ValueType.STRING:
                return [self.string(what) for _ in range(count)]
            if et == ValueType.ARRAY:
                return [self.value(ValueType.ARRAY, what, depth + 1) for _ in range(count)]
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
            what = "not a regular file" if os.path.exists(self.path) else "no such file"
            raise FormatError(f"{printable(self.path)}: {what}")
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
        """Parse and validate the header, in the order of llama.cpp's gguf loader: counts, metadata (types,
        nesting, lengths within the file), then every tensor's type, dimensions, byte size and offset, before
        any tensor is touched."""
        cur = _Cursor(self.mmap, self.path)
        magic = bytes(cur.take(4, "magic"))
        if magic not in (GGUF_MAGIC, PWRI_MAGIC):
            raise FormatError(f"{self.path}: bad magic {magic!r}: expected b'GGUF' or b'PWRI'")
        self.magic = magic.decode()
        self.version = cur.unpack("<I", "version")
        if self.version == 1:
            raise FormatError(f"{self.path}: GGUF version 1 is not supported")
        if self.version == 0 or self.version > 3:
            raise FormatError(f"{self.path}: unsupported GGUF version {self.version}")
        n_tensors = cur.unpack("<Q", "tensor count")
        n_kv = cur.unpack("<Q", "metadata count")
        if n_kv > cur.left // _MIN_KV_BYTES or n_tensors > cur.left // _MIN_TENSOR_INFO_BYTES:
            raise FormatError(
                f"{self.path}: corrupt header: {n_tensors} tensors and {n_kv} metadata pairs cannot fit in "
                f"{len(self.mmap)} bytes"
            )

        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, ValueType] = {}
        self.array_types: dict[str, ValueType] = {}  # element type of array values
        for i in range(n_kv):
            key = cur.string(f"metadata key {i}")
            if key in self.metadata:
                raise FormatError(f"{self.path}: duplicate metadata key '{printable(key)}'")
            vtype = cur.unpack("<I", f"type of {key}")
            if vtype == ValueType.ARRAY and cur.left >= 4:
                elem = struct.unpack_from("<I", cur.mv, cur.pos)[0]
                if elem in ValueType._value2member_map_:
                    self.array_types[key] = ValueType(elem)
            self.metadata[key] = cur.value(vtype, key)
            self.value_types[key] = ValueType(vtype)

        self.alignment = self._alignment()
        infos = [self._tensor_info(cur, i) for i in range(n_tensors)]

        pad = (-cur.pos) % self.alignment
        self.data_offset = cur.pos + pad
        self.tensors: dict[str, TensorInfo] = {}
        file_size = len(self.mmap)
        data_size = max(0, file_size - self.data_offset)
        ranges: list[tuple[int, int, str]] = []
        for name, shape, ggml_type, offset in infos:
            if name in self.tensors:
                raise FormatError(f"{self.path}: duplicate tensor name '{printable(name)}'")
            n_bytes = tensor_nbytes(shape, ggml_type)
            if offset % self.alignment:
                raise FormatError(
                    f"{self.path}: tensor '{printable(name)}' offset {offset} is not a multiple of the "
                    f"alignment {self.alignment}"
                )
            if offset > data_size or n_bytes > data_size - offset:
                start = self.data_offset + offset
                raise FormatError(
                    f"{self.path}: data of tensor '{printable(name)}' runs past the end of the file "
                    f"(needs bytes {start}..{start + n_bytes}, file has {file_size})"
                )
            start = self.data_offset + offset
            ranges.append((start, start + n_bytes, name))
            self.tensors[name] = TensorInfo(name, shape, ggml_type, start, self.mmap[start : start + n_bytes])
        ranges.sort()
        for (_, end, first), (start, _, second) in pairwise(ranges):
            if start < end:
                raise FormatError(
                    f"{self.path}: data of tensors '{printable(first)}' and '{printable(second)}' overlap"
                )

    def _alignment(self) -> int:
        """general.alignment: an integer power of two (32 when absent)."""
        if Keys.ALIGNMENT not in self.metadata:
            return GGUF_DEFAULT_ALIGNMENT
        vtype = self.value_types[Keys.ALIGNMENT]
        value = self.metadata[Keys.ALIGNMENT]
        if vtype not in _INTEGER_TYPES:
            raise FormatError(f"{self.path}: {Keys.ALIGNMENT} must be an integer, found a {vtype.name} value")
        if value <= 0 or value & (value - 1):
            raise FormatError(f"{self.path}: invalid {Keys.ALIGNMENT} {value}: must be a power of two")
        return int(value)

    def _tensor_info(self, cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], GGMLType, int]:
        """One tensor-info record: name, row-major shape, type and offset in the data section, validated."""
        name = cur.string(f"tensor {i} name")
        where = f"{self.path}: tensor '{printable(name)}'"
        n_dims = cur.unpack("<I", f"dims of tensor {i}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise FormatError(f"{where} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
        ne = [cur.unpack("<Q", f"shape of tensor {i}") for _ in range(n_dims)]
        raw_type = cur.unpack("<I", f"type of tensor {i}")
        offset = cur.unpack("<Q", f"offset of tensor {i}")
        try:
            ggml_type = (
                PWRI_LEGACY_TYPES[raw_type]
                if self.is_sparse and raw_type in PWRI_LEGACY_TYPES
                else GGMLType(raw_type)
            )
        except ValueError:
            raise FormatError(f"{where} has unknown ggml type {raw_type}") from None
        if ggml_type not in QUANT_SIZES:
            raise FormatError(f"{where} has unsupported ggml type {ggml_type.name}")
        if any(d > _INT64_MAX for d in ne):
            raise FormatError(f"{where} has a dimension out of range: {ne}")
        # exact products (Python integers): a shape whose element count overflows int64 is refused, never wrapped
        if math.prod(ne) > _INT64_MAX:
            raise FormatError(f"{where} has {' x '.join(map(str, ne))} elements, more than int64 holds")
        block_elems, _ = QUANT_SIZES[ggml_type]
        if ne[0] % block_elems:
            raise FormatError(
                f"{where} row length {ne[0]} is not a multiple of the {ggml_type.name} block size {block_elems}"
            )
        return name, tuple(reversed(ne)), ggml_type, offset

    def copy_metadata(self, writer: Any, skip: frozenset[str] = frozenset()) -> None:
        """Add every metadata key (with its stored value type) to a GGUFWriter, except `skip`."""
        for key, value in self.metadata.items():
            if key not in skip:
                writer.add(key, value, self.value_types[key], self.array_types.get(key))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open and parse a GGUF or PWRI file; raises FormatError on any malformed input."""
    return GGUFFile(path)


TENSOR_COPY_ALIGN = 64  # each tensor's copy starts on a cache line


def tensor_bytes_total(gguf: GGUFFile) -> int:
    """Bytes `in_memory` allocates for the tensors of `gguf` (each rounded up to TENSOR_COPY_ALIGN)."""
    return sum(-(-info.n_bytes // TENSOR_COPY_ALIGN) * TENSOR_COPY_ALIGN for info in gguf.tensors.values())


def in_memory(gguf: GGUFFile) -> GGUFFile:
    """The same file with the bytes of its tensors read into one anonymous buffer (llama.cpp's --no-mmap), which asks
    for transparent huge pages; the metadata stays on the memory map.

    The kernels then stream the weights through 2 MiB pages instead of the file mapping's 4 KiB ones (fewer TLB
    misses) and never take a page fault during decode. Measured on a 2-core AVX-512 Xeon VM, one-token products
    over the FFN matrices of a 1.1B file of a 4-bit block type (docs/kernels.md): 10.0 GB/s from the file mapping,
    12.4 from such a copy at 1 thread (16.0 and 17.2 at 2). Only the tensors listed in `gguf.tensors` are read (a
    pipeline stage's view holds its own layers). Raises FormatError when the file no longer holds the bytes its
    header promised."""
    total = tensor_bytes_total(gguf)
    buf = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    memory = np.frombuffer(buf, dtype=np.uint8)
    # fault every page in before reading: read() into untouched huge pages measured 5x slower (1.25 s against
    # 0.15 s to fault them + 0.11 s to read, 650 MB)
    memory[:: mmap.PAGESIZE] = 0
    tensors: dict[str, TensorInfo] = {}
    pos = 0
    with open(gguf.path, "rb", buffering=0) as f:
        for name, info in sorted(gguf.tensors.items(), key=lambda item: item[1].offset):
            n = info.n_bytes
            dest = memory[pos : pos + n]
            f.seek(info.offset)
            got = 0
            view = memoryview(dest)
            while got < n:
                k = f.readinto(view[got:])
                if not k:
                    raise FormatError(
                        f"{gguf.path}: tensor '{printable(name)}' ends past the end of the file"
                    )
                got += k
            tensors[name] = TensorInfo(info.name, info.shape, info.ggml_type, info.offset, dest)
            pos += -(-n // TENSOR_COPY_ALIGN) * TENSOR_COPY_ALIGN
    view_ = object.__new__(GGUFFile)  # the same parsed file (metadata, mapping), the tensors in memory
    view_.__dict__.update(gguf.__dict__)
    view_.tensors = {name: tensors[name] for name in gguf.tensors}
    return view_
