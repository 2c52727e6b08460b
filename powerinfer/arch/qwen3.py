"""Qwen3 (dense): Llama's layout with a per-head RMSNorm of q and k before NEOX RoPE and no biases.

The head size comes from `qwen3.attention.key_length` and may differ from n_embd / n_head (Qwen3-0.6B: 1024 wide,
16 heads of 128), so attn_q is (n_head * head_dim, n_embd) and attn_output (n_embd, n_head * head_dim). The norms
blk.N.attn_q_norm / attn_k_norm hold head_dim weights shared by every head; q/k rows are not permuted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from powerinfer.arch.base import DecoderVariant, build_decoder, check_decoder, decoder_config
from powerinfer.model.config import ModelConfig

__all__ = ["Qwen3Config", "build", "check"]

build, check = build_decoder, check_decoder


@dataclass(frozen=True)
class Qwen3Config(ModelConfig):
    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], sparse: bool) -> Qwen3Config:
        """The config from `qwen3.*` keys; `sparse`: a `powerinfer sparsify` (PWRI) file."""
        return decoder_config(cls, metadata, sparse, DecoderVariant("neox", qk_norm=True))
