"""Preallocated KV cache: one (n_ctx, n_head_kv, head_dim) buffer per layer for keys and values."""

from __future__ import annotations

import torch


class KVCache:
    """Single-sequence KV cache, sized once from the config and the context length."""

    def __init__(self, n_layer: int, n_ctx: int, n_head_kv: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.n_ctx = n_ctx
        # empty, not zeros: pages are committed as positions fill; attention only reads 0..pos+T-1
        self.k = torch.empty(n_layer, n_ctx, n_head_kv, head_dim, dtype=dtype, device=device)
        self.v = torch.empty(n_layer, n_ctx, n_head_kv, head_dim, dtype=dtype, device=device)

    @property
    def n_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (T, H_kv, D) at positions pos..pos+T-1; return keys and values 0..pos+T-1."""
        end = pos + k.shape[0]
        self.k[layer, pos:end] = k
        self.v[layer, pos:end] = v
        return self.k[layer, :end], self.v[layer, :end]
