"""GGUF / PWRI writer. Writes to a temporary file in the target folder and renames it into place."""

from __future__ import annotations

import os
import secrets
import stat
import struct
from collections.abc import Callable
from typing import IO, Any

import numpy as np

from powerinfer.errors import FormatError
from powerinfer.gguf.constants import (
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_VERSION,
    PWRI_LEGACY_IDS,
    PWRI_MAGIC,
    QUANT_SIZES,
    VALUE_DTYPES,
    GGMLType,
    Keys,
    ValueType,
)
from powerinfer.printable import printable

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def output_problem(path: str | os.PathLike[str]) -> str | None:
    """Why a new file cannot be put at `path`, or None: its folder must exist and `path` must be missing or a
    regular file (a FIFO, device, socket or folder there is never replaced). Symlinks are followed for the
    check; the link itself is what a rename replaces."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"folder {printable(str(folder))} does not exist"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None  # missing, or a dangling symlink
    except OSError as e:
        return e.strerror or str(e)
    if stat.S_ISDIR(mode):
        return "it is a folder"
    if not stat.S_ISREG(mode):
        return f"it is {_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}, not a regular file"
    return None


def write_file_atomically(
    path: str | os.PathLike[str], write: Callable[[IO[bytes]], None], *, suffix: str = ""
) -> None:
    """Write a file through `write(f)` into a temp file beside `path`, then rename it into place.

    Refuses (FormatError) a target that is not a regular file or a missing one (see `output_problem`). The temp
    file is removed on every way out (errors, KeyboardInterrupt, SystemExit from a signal handler); OSError
    from writing propagates.
    """
    target = os.fspath(path)
    problem = output_problem(target)
    if problem is not None:
        raise FormatError(f"cannot write {printable(str(target))}: {problem}")
    folder = os.path.dirname(os.path.abspath(target))
    # the name is known before the file exists, so a signal at any moment after this line finds it to remove
    tmp = os.path.join(folder, f".tmp-{secrets.token_hex(8)}{suffix}")
    try:
        try:  # 0666 minus the umask, as a plain open() would give
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as e:
            raise FormatError(f"cannot write {printable(str(target))}: {e.strerror}") from None
        with os.fdopen(fd, "wb") as f:
            write(f)
        problem = output_problem(target)  # something may have appeared there meanwhile
        if problem is not None:
            raise FormatError(f"cannot write {printable(str(target))}: {problem}")
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


_NUMPY_TO_VALUE = {np.dtype(v): k for k, v in VALUE_DTYPES.items() if k != ValueType.BOOL}


def _infer_type(value: Any) -> ValueType:
    if isinstance(value, bool):
        return ValueType.BOOL
    if isinstance(value, (int, np.integer)):
        return ValueType.UINT32 if 0 <= int(value) < 2**32 else ValueType.INT64
    if isinstance(value, (float, np.floating)):
        return ValueType.FLOAT32
    if isinstance(value, str):
        return ValueType.STRING
    if isinstance(value, (list, tuple, np.ndarray)):
        return ValueType.ARRAY
    raise FormatError(f"cannot store a {type(value).__name__} in GGUF metadata")


def _array_elem_type(value: Any) -> ValueType:
    if isinstance(value, np.ndarray):
        if value.dtype == np.bool_:
            return ValueType.BOOL
        if value.dtype.newbyteorder("<") in _NUMPY_TO_VALUE:
            return _NUMPY_TO_VALUE[value.dtype.newbyteorder("<")]
        raise FormatError(f"cannot store a numpy array of {value.dtype} in GGUF metadata")
    if len(value) == 0:
        return ValueType.INT32
    first = value[0]
    if isinstance(first, str):
        return ValueType.STRING
    if isinstance(first, bool):
        return ValueType.BOOL
    if isinstance(first, (int, np.integer)):
        return ValueType.INT32
    if isinstance(first, (float, np.floating)):
        return ValueType.FLOAT32
    raise FormatError(f"cannot store an array of {type(first).__name__} in GGUF metadata")


def _encode_string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _encode_value(value: Any, vtype: ValueType, elem_type: ValueType | None = None) -> bytes:
    if vtype == ValueType.STRING:
        return _encode_string(value)
    if vtype == ValueType.ARRAY:
        et = elem_type if elem_type is not None else _array_elem_type(value)
        head = struct.pack("<IQ", int(et), len(value))
        if et == ValueType.STRING:
            return head + b"".join(_encode_string(s) for s in value)
        if et == ValueType.ARRAY:
            return head + b"".join(_encode_value(v, ValueType.ARRAY) for v in value)
        return head + np.asarray(value).astype(VALUE_DTYPES[et]).tobytes()
    return np.asarray(value).astype(VALUE_DTYPES[vtype]).tobytes()


class GGUFWriter:
    """Collects metadata and tensors, then writes a GGUF (or PWRI) v3 file atomically.

    Tensors are given row-major; `data` is either a float array stored as F32/F16/BF16 or the raw bytes
    (uint8) of an already quantized tensor together with its row-major `shape`.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, sparse: bool = False, alignment: int = GGUF_DEFAULT_ALIGNMENT
    ) -> None:
        self.path = os.fspath(path)
        self.magic = PWRI_MAGIC if sparse else GGUF_MAGIC
        self.alignment = alignment
        self.kv: list[tuple[str, bytes]] = []
        self.keys: set[str] = set()
        self.tensors: list[tuple[str, tuple[int, ...], GGMLType, np.ndarray]] = []
        if alignment != GGUF_DEFAULT_ALIGNMENT:
            self.add(Keys.ALIGNMENT, alignment, ValueType.UINT32)

    def add(
        self, key: str, value: Any, vtype: ValueType | None = None, elem_type: ValueType | None = None
    ) -> None:
        """Add one metadata key; the value type is inferred unless given."""
        if key in self.keys:
            raise FormatError(f"duplicate metadata key {key}")
        vt = vtype if vtype is not None else _infer_type(value)
        self.kv.append(
            (key, _encode_string(key) + struct.pack("<I", int(vt)) + _encode_value(value, vt, elem_type))
        )
        self.keys.add(key)

    def add_tensor(
        self,
        name: str,
        data: np.ndarray,
        ggml_type: GGMLType | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        """Add a tensor. Float data is converted to `ggml_type` (F32 by default; F16/BF16 allowed)."""
        if ggml_type is None:
            ggml_type = GGMLType.F32
        if data.dtype == np.uint8 and ggml_type not in (GGMLType.I8,):
            if shape is None:
                raise FormatError(f"tensor {name}: raw bytes need an explicit shape")
            raw = np.ascontiguousarray(data).reshape(-1)
        else:
            shape = tuple(int(s) for s in data.shape)
            raw = _float_to_raw(np.ascontiguousarray(data), ggml_type, name)
        block_elems, block_bytes = QUANT_SIZES[ggml_type]
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if (shape and shape[-1] % block_elems) or raw.nbytes != n // block_elems * block_bytes:
            raise FormatError(
                f"tensor {name}: {raw.nbytes} bytes do not fit shape {shape} of {ggml_type.name}"
            )
        self.tensors.append((name, tuple(shape), ggml_type, raw))

    def write(self) -> None:
        """Write the file to a temp file beside the target, then rename it into place (see
        `write_file_atomically`: a FIFO, device or folder at the target is refused, never replaced)."""
        folder = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(folder):
            raise FormatError(
                f"{printable(str(self.path))}: output folder {printable(str(folder))} does not exist"
            )
        header = bytearray()
        header += self.magic + struct.pack("<IQQ", GGUF_VERSION, len(self.tensors), len(self.kv))
        for _, encoded in self.kv:
            header += encoded
        offset = 0
        offsets = []
        for name, shape, ggml_type, raw in self.tensors:
            header += _encode_string(name) + struct.pack("<I", len(shape))
            header += b"".join(struct.pack("<Q", d) for d in reversed(shape))
            type_id = (
                PWRI_LEGACY_IDS.get(ggml_type, int(ggml_type)) if self.magic == PWRI_MAGIC else int(ggml_type)
            )
            header += struct.pack("<IQ", type_id, offset)
            offsets.append(offset)
            offset += raw.nbytes + (-raw.nbytes) % self.alignment
        header += b"\0" * ((-len(header)) % self.alignment)

        def write(f: IO[bytes]) -> None:
            f.write(header)
            for _, _, _, raw in self.tensors:
                f.write(raw.tobytes())
                f.write(b"\0" * ((-raw.nbytes) % self.alignment))

        write_file_atomically(self.path, write, suffix=".gguf")


def _float_to_raw(data: np.ndarray, ggml_type: GGMLType, name: str) -> np.ndarray:
    if ggml_type == GGMLType.F32:
        return data.astype("<f4").view(np.uint8).reshape(-1)
    if ggml_type == GGMLType.F16:
        return data.astype("<f2").view(np.uint8).reshape(-1)
    if ggml_type == GGMLType.I32:
        return data.astype("<i4").view(np.uint8).reshape(-1)
    from powerinfer.quant import quantize

    return quantize(data.astype(np.float32), ggml_type).reshape(-1)
