"""Float rows into blocks of every type `powerinfer quantize` produces (quant.PRODUCIBLE).

The gguf package's reference quantizers for the QUANTIZABLE types (powerinfer.quant.quantize), the C quantizers
(kernels/cpu/quantize_k.c, pi_quantize_rows: bit-exact with llama.cpp's without an importance matrix) for the
C_QUANTIZABLE types (the K-quants and IQ4). Here rather than in powerinfer.quant, which the ops import.
"""

from __future__ import annotations

import numpy as np

from powerinfer.errors import FormatError
from powerinfer.gguf.constants import GGMLType
from powerinfer.ops import library as _library
from powerinfer.quant import C_QUANTIZABLE, QUANTIZABLE, row_bytes
from powerinfer.quant import quantize as _reference_quantize


def quantize(data: np.ndarray, ggml_type: GGMLType, n_threads: int = 1) -> np.ndarray:
    """Encode a float array into raw blocks (uint8, shape (rows, row_bytes)), bit-exact with ggml; C_QUANTIZABLE
    types on `n_threads` threads (FormatError when the kernels are not built)."""
    if ggml_type not in QUANTIZABLE and ggml_type not in C_QUANTIZABLE:
        raise FormatError(f"quantizing to {ggml_type.name} is not supported")
    if ggml_type in QUANTIZABLE:
        return _reference_quantize(data, ggml_type)
    data = np.ascontiguousarray(data, dtype=np.float32)
    flat = data.reshape(-1, data.shape[-1]) if data.ndim else data.reshape(1, 1)
    rb = row_bytes(ggml_type, flat.shape[-1])
    library = _library.load()
    if library is None:
        raise FormatError(
            f"quantizing to {ggml_type.name} needs the C kernels, which are not built (build them with "
            "`pip install -e .`)"
        )
    out = np.empty((flat.shape[0], rb), dtype=np.uint8)
    status = library.quantize_rows(
        int(ggml_type),
        flat.ctypes.data,
        flat.shape[0],
        flat.shape[1],
        out.ctypes.data,
        max(1, int(n_threads)),
    )
    if status:
        _library.check_status(status, "quantize")
    return out
