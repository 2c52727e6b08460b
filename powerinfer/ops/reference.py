"""Pure-torch reference of every op: the spec, the fallback when the kernels are missing, the oracle in tests.

Signatures match `powerinfer.ops` (less the kernel context). Weights are decoded with `powerinfer.quant.dequantize`, the one Python
decoder per format.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from powerinfer.quant import dequantize

if TYPE_CHECKING:
    from powerinfer.ops.qweight import QWeight


def dense(w: QWeight) -> torch.Tensor:
    """The whole weight decoded to float32, shape (N, K)."""
    return torch.from_numpy(dequantize(w.raw.numpy(), w.ggml_type, w.shape).copy())


def linear(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """y = x @ W.T; x is (..., K) float32, the result (..., N) float32."""
    return x.to(torch.float32) @ dense(w).T


def get_rows(w: QWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of W decoded to float32, shape (len(ids), K)."""
    rows = w.raw[ids.to(torch.int64)].numpy()  # (n_ids, row_bytes)
    return torch.from_numpy(dequantize(rows, w.ggml_type, (rows.shape[0], w.shape[1])).copy())
