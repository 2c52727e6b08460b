"""Preallocated KV cache: (n_seq, n_ctx, n_head_kv, head_dim) buffers per layer for keys and values."""

from __future__ import annotations

import torch


class KVCache:
    """KV cache of n_seq independent sequences (slots), sized once from the config and the context length."""

    def __init__(
        self,
        n_layer: int,
        n_ctx: int,
        n_head_kv: int,
        head_dim: int,
        n_seq: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.n_ctx = n_ctx
        self.n_seq = n_seq
        shape = (n_layer, n_seq, n_ctx, n_head_kv, head_dim)
        # empty, not zeros: pages are committed as positions fill; attention only reads written positions
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.positions = torch.arange(n_ctx, device=device)

    @property
    def n_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update(
        self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor, seq: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (T, H_kv, D) of sequence seq at positions pos..pos+T-1; return its keys and values 0..end."""
        end = pos + k.shape[0]
        self.k[layer, seq, pos:end] = k
        self.v[layer, seq, pos:end] = v
        return self.k[layer, seq, :end], self.v[layer, seq, :end]

    def layer(self, layer: int, seq: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one sequence in one layer: contiguous (n_ctx, H_kv, D) views of the buffers."""
        return self.k[layer, seq], self.v[layer, seq]

    def update_batch(
        self, layer: int, seqs: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store one token per sequence (k, v: (B, H_kv, D)); return keys, values (B, L, H_kv, D) and the
        visibility mask (B, L), L = the longest sequence so far."""
        seqs, positions = seqs.to(self.k.device), positions.to(self.k.device)
        self.k[layer, seqs, positions] = k
        self.v[layer, seqs, positions] = v
        length = int(positions.max()) + 1
        mask = self.positions[:length][None, :] <= positions[:, None]  # (B, L)
        # positions past a sequence's end may never have been written (empty memory): zero them so that a
        # masked-out NaN cannot leak through 0 * NaN in the weighted sum
        hidden = ~mask[:, :, None, None]
        keys = self.k[layer, seqs, :length].masked_fill(hidden, 0.0)
        values = self.v[layer, seqs, :length].masked_fill(hidden, 0.0)
        return keys, values, mask

    def copy_slot(self, src: int, dst: int, n: int) -> None:
        """Copy the first n positions of sequence src into sequence dst (a shared prompt evaluated once)."""
        self.k[:, dst, :n] = self.k[:, src, :n]
        self.v[:, dst, :n] = self.v[:, src, :n]
