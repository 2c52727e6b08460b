"""Qwen2-MoE: Qwen2's attention (q/k/v biases, NEOX RoPE) with a MoE FFN and a shared expert in every layer.

Softmax router, top-k weights not renormalised (llama.cpp's qwen2moe never does; a `qwen2moe.expert_weights_norm`
key written by our converter for a checkpoint with norm_topk_prob says otherwise). The shared expert
(`ffn_{gate,up,down}_shexp`, width `expert_shared_feed_forward_length`) is added to the experts' sum, scaled per
token by the sigmoid of its gate `ffn_gate_inp_shexp` . x.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from powerinfer.arch.base import DecoderVariant
from powerinfer.arch.moe import MoEConfig, MoEVariant, build_moe, check_moe, moe_config

__all__ = ["Qwen2MoEConfig", "build", "check"]

build, check = build_moe, check_moe
VARIANT = MoEVariant(
    DecoderVariant("neox", bias=True), norm_weights=False, expert_width="n_ff/k", shared=True
)


@dataclass(frozen=True)
class Qwen2MoEConfig(MoEConfig):
    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], sparse: bool) -> MoEConfig:
        """The config from `qwen2moe.*` keys."""
        return moe_config(metadata, sparse, VARIANT, cls)
