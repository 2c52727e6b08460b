"""OLMoE: Llama-layout attention whose q and k RMSNorms span the whole projection (attn_q_norm (n_head * head_dim),
attn_k_norm (n_head_kv * head_dim)), before NEOX RoPE; a MoE FFN in every layer, softmax router, top-k weights not
renormalised (llama.cpp's olmoe; an `olmoe.expert_weights_norm` key says otherwise), experts of width n_ff.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from powerinfer.arch.base import DecoderVariant
from powerinfer.arch.moe import MoEConfig, MoEVariant, build_moe, check_moe, moe_config

__all__ = ["OLMoEConfig", "build", "check"]

build, check = build_moe, check_moe
VARIANT = MoEVariant(DecoderVariant("neox", qk_norm=True), norm_weights=False, qk_norm_whole=True)


@dataclass(frozen=True)
class OLMoEConfig(MoEConfig):
    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], sparse: bool) -> MoEConfig:
        """The config from `olmoe.*` keys."""
        return moe_config(metadata, sparse, VARIANT, cls)
