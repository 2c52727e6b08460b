"""Qwen2 / Qwen2.5 (dense): Llama's layout with q/k/v biases and NEOX RoPE.

llama.cpp's converter writes q/k rows as Hugging Face stores them (no permutation), so RoPE rotates the halves
(i, i + head_dim/2) of each head. Tied embeddings: the file has no output.weight and the head reads token_embd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from powerinfer.arch.base import DecoderVariant, build_decoder, check_decoder, decoder_config
from powerinfer.model.config import ModelConfig

__all__ = ["Qwen2Config", "build", "check"]

build, check = build_decoder, check_decoder


@dataclass(frozen=True)
class Qwen2Config(ModelConfig):
    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], sparse: bool) -> Qwen2Config:
        """The config from `qwen2.*` keys; `sparse`: a `powerinfer sparsify` (PWRI) file."""
        return decoder_config(cls, metadata, sparse, DecoderVariant("neox", bias=True))
