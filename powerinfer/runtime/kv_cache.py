"""Preallocated KV cache: per layer, (n_seq, n_ctx, n_head_kv, head_dim) keys and values on that layer's device.

The cache also keeps each sequence's length (`n_past`): the one place positions live.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class KVLayerView:
    """One layer's keys and values of every sequence."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v  # (n_seq, n_ctx, H_kv, D)
        self.positions = torch.arange(k.shape[1], device=k.device)

    def slot(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[seq], self.v[seq]

    def update(
        self, seq: int, pos: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = pos + k.shape[0]
        self.k[seq, pos:end] = k
        self.v[seq, pos:end] = v
        return self.k[seq, :end], self.v[seq, :end]

    def update_batch(
        self, seqs: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seqs, positions = seqs.to(self.k.device), positions.to(self.k.device)
        self.k[seqs, positions] = k
        self.v[seqs, positions] = v
        length = int(positions.max()) + 1
        mask = self.positions[:length][None, :] <= positions[:, None]  # (B, L)
        # positions past a sequence's end may never have been written (empty memory): zero them so that a
        # masked-out NaN cannot leak through 0 * NaN in the weighted sum
        hidden = ~mask[:, :, None, None]
        keys = self.k[seqs, :length].masked_fill(hidden, 0.0)
        values = self.v[seqs, :length].masked_fill(hidden, 0.0)
        return keys, values, mask


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
        devices: Sequence[torch.device] | None = None,
    ) -> None:
        self.n_ctx = n_ctx
        self.n_seq = n_seq
        self.n_past = [0] * n_seq
        devices = devices or [torch.device("cpu")] * n_layer
        shape = (n_seq, n_ctx, n_head_kv, head_dim)
        # empty, not zeros: pages are committed as positions fill; attention only reads written positions
        self.layers = [
            KVLayerView(torch.empty(shape, dtype=dtype, device=d), torch.empty(shape, dtype=dtype, device=d))
            for d in devices
        ]

    @property
    def n_bytes(self) -> int:
        return sum(view.k.nbytes + view.v.nbytes for view in self.layers)

    def layer_view(self, layer: int) -> KVLayerView:
        return self.layers[layer]

    def copy_slot(self, src: int, dst: int, n: int) -> None:
        """Copy the first n positions of sequence src into sequence dst (a shared prompt evaluated once)."""
        for view in self.layers:
            view.k[dst, :n] = view.k[src, :n]
            view.v[dst, :n] = view.v[src, :n]
        self.n_past[dst] = n
