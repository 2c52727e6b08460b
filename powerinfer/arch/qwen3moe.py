"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, NEOX RoPE, free head size) with a MoE FFN in every layer.

Softmax router over `qwen3moe.expert_count` experts, top `expert_used_count`, renormalised: llama.cpp always
renormalises and its converter writes no key for the checkpoint's norm_topk_prob; ours writes
`qwen3moe.expert_weights_norm` false for a checkpoint that does not, and that key is read here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from powerinfer.arch.base import DecoderVariant
from powerinfer.arch.moe import MoEConfig, MoEVariant, build_moe, check_moe, moe_config

__all__ = ["Qwen3MoEConfig", "build", "check"]

build, check = build_moe, check_moe
VARIANT = MoEVariant(DecoderVariant("neox", qk_norm=True), norm_weights=True, expert_width="n_ff/k")


@dataclass(frozen=True)
class Qwen3MoEConfig(MoEConfig):
    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], sparse: bool) -> MoEConfig:
        """The config from `qwen3moe.*` keys."""
        return moe_config(metadata, sparse, VARIANT, cls)
