"""Block formats: one registry of ggml types with reference (de)quantisation.

The reference implementations are the `gguf` package's quantizers (the same maths as ggml-quants.c),
so there is a single block decoder per format on the Python side. The gguf package has no quantizer for the
K-quants and IQ4 (C_QUANTIZABLE): those blocks come from our C quantizers (kernels/cpu/quantize_k.c, bit-exact with
llama.cpp's quantizers without an importance matrix) through powerinfer.ops.encode, so producing them needs the
built kernels.
"""

from __future__ import annotations

import numpy as np
from gguf import quants as _gguf_quants

from powerinfer.errors import FormatError
from powerinfer.gguf.constants import QUANT_SIZES, GGMLType
from powerinfer.printable import printable
from powerinfer.quant.types import TYPES, types_where

# the sets the rest of the package asks about, derived from the registry (powerinfer.quant.types)
# types whose blocks the gguf package can produce (and the CPU kernels compute on directly: KERNEL_TYPES)
QUANTIZABLE = types_where(producer="gguf")
# types whose blocks the C kernels produce (pi_quantize_rows), bit-exact with llama.cpp's quantizers run without an
# importance matrix
C_QUANTIZABLE = types_where(producer="c")
# types `powerinfer quantize` produces
PRODUCIBLE = QUANTIZABLE | C_QUANTIZABLE
# types our CPU kernels compute on through the plain or block-of-32 kernels
KERNEL_TYPES = types_where(dense="plain") | types_where(dense="block32")
# weight types the ops compute on: every registry row (the others are decoded to float32 copies)
WEIGHT_TYPES = frozenset(TYPES)
# K-quants: super-block types with the sparse row kernels (dense, sparse rows, fused FFN, the pool's Triton kernels)
K_QUANT_TYPES = types_where(dense="super", sparse_rows=True)
# types the device pool (GPU, or the CPU standing in for it) keeps as the file's own blocks (the types the fused
# kernels and the Triton kernels take); a tensor of any other type is decoded to F16 there
POOL_TYPES = types_where(sparse_rows=True)
FLOAT_TYPES = types_where(dense="plain")


def check_weight_type(ggml_type: GGMLType, name: str, where: str = "") -> None:
    """FormatError unless tensor `name` has a type the ops can compute on (WEIGHT_TYPES); `where` prefixes the
    message (the file's path)."""
    if ggml_type not in WEIGHT_TYPES:
        raise FormatError(
            f"{where}tensor '{printable(name)}' has type {GGMLType(ggml_type).name}, which has no kernel or "
            "dequantizer here"
        )


def block_size(ggml_type: GGMLType) -> tuple[int, int]:
    """(elements per block, bytes per block) of a ggml type."""
    try:
        return QUANT_SIZES[ggml_type]
    except KeyError:
        raise FormatError(f"unsupported ggml type {ggml_type!r}") from None


def row_bytes(ggml_type: GGMLType, n_cols: int) -> int:
    """Bytes of one row of `n_cols` elements."""
    block_elems, block_bytes = block_size(ggml_type)
    if n_cols % block_elems:
        raise FormatError(
            f"row length {n_cols} is not a multiple of the {ggml_type.name} block size {block_elems}"
        )
    return n_cols // block_elems * block_bytes


def pool_type(ggml_type: GGMLType) -> GGMLType:
    """The type a tensor of `ggml_type` has in the device pool: its own for POOL_TYPES, else F16."""
    ggml_type = GGMLType(ggml_type)
    return ggml_type if ggml_type in POOL_TYPES else GGMLType.F16


def pool_bytes(ggml_type: GGMLType, shape: tuple[int, ...]) -> int:
    """Bytes a tensor of `shape` (row-major, rows of shape[-1] elements) and `ggml_type` takes in the pool."""
    n_cols = int(shape[-1]) if shape else 1
    n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return n_rows * row_bytes(pool_type(ggml_type), n_cols)


def dequantize(raw: np.ndarray, ggml_type: GGMLType, shape: tuple[int, ...]) -> np.ndarray:
    """Decode raw tensor bytes (any layout view of them) into a float32 array of row-major `shape`."""
    rb = row_bytes(ggml_type, shape[-1])
    rows = raw.reshape(-1).view(np.uint8).reshape(-1, rb)
    if ggml_type == GGMLType.F32:
        out = rows.view("<f4")
    elif ggml_type == GGMLType.F16:
        out = rows.view("<f2").astype(np.float32)
    elif ggml_type in (GGMLType.I32,):
        out = rows.view("<i4").astype(np.float32)
    else:
        out = _gguf_quants.dequantize(rows, ggml_type).astype(np.float32, copy=False)
    return out.reshape(shape)


def quantize(data: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """Encode a float array into raw blocks (uint8, shape (rows, row_bytes)), bit-exact with ggml: the QUANTIZABLE
    types, through the gguf package. (C_QUANTIZABLE types: powerinfer.ops.encode.quantize, which has both.)"""
    if ggml_type not in QUANTIZABLE:
        raise FormatError(f"quantizing to {ggml_type.name} is not supported here")
    data = np.ascontiguousarray(data, dtype=np.float32)
    flat = data.reshape(-1, data.shape[-1]) if data.ndim else data.reshape(1, 1)
    row_bytes(ggml_type, flat.shape[-1])
    out = _gguf_quants.quantize(flat, ggml_type)
    return np.ascontiguousarray(out).view(np.uint8).reshape(flat.shape[0], -1)
