"""Llama (and the models that share its GGUF layout, Mistral among them): config from metadata, the model composed
of blocks.

Weights are used as stored in the GGUF file; q/k rows carry llama.cpp's RoPE permutation, so RoPE rotates
adjacent pairs (2i, 2i+1). PowerInfer files (PWRI) add per-layer predictors and ffn_down_t: with a predictor
selector the FFNs are built sparse, with the activation the file declares (ReLU for PowerInfer's models).
A `llama.attention.sliding_window` key (Mistral, as our converter writes it) makes attention local.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from powerinfer.arch.base import (
    DecoderVariant,
    MetadataView,
    build_decoder,
    check_decoder,
    decoder_config,
    decoder_tensor_table,
)
from powerinfer.arch.moe import MoEConfig, MoEVariant, build_moe, check_moe, moe_config
from powerinfer.gguf.constants import Keys
from powerinfer.gguf.reader import GGUFFile
from powerinfer.model.config import ModelConfig
from powerinfer.model.source import WeightSource
from powerinfer.model.transformer import Transformer


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], sparse: bool, relu_up: bool = False) -> LlamaConfig:
        """Build the config from GGUF metadata; `sparse` is True for PWRI files, relu_up for bamboo."""
        arch = metadata.get(Keys.ARCHITECTURE)
        if arch == "llama" and MetadataView(metadata, arch).optional(Keys.EXPERT_COUNT, 0):
            return moe_config(metadata, sparse, MIXTRAL, MoEConfig)  # type: ignore[return-value]
        return decoder_config(cls, metadata, sparse, DecoderVariant("adjacent", relu_up=relu_up))


MIXTRAL = MoEVariant(DecoderVariant("adjacent"), norm_weights=True)
tensor_table = decoder_tensor_table


def check(config: ModelConfig, gguf: GGUFFile) -> None:
    """The file holds every tensor a Llama model of `config` reads, each of the expected type and shape."""
    if isinstance(config, MoEConfig):
        return check_moe(config, gguf)
    check_decoder(config, gguf)


def build(config: ModelConfig, src: WeightSource) -> Transformer:
    """The Llama transformer from placed weights."""
    if isinstance(config, MoEConfig):
        return build_moe(config, src)
    return build_decoder(config, src)
