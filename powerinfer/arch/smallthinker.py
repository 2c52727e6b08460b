"""SmallThinker (PowerInfer's MoE models for local devices), as llama.cpp reads `smallthinker` files.

Every layer: the router reads the layer input (before the attention norm, so experts are known before attention
runs), attention (NEOX RoPE), then ReGLU experts relu(gate x) * up x on the normed FFN input. Gating softmax or
sigmoid per `smallthinker.expert_gating_func` (1 / 2), top-k weights always renormalised. With a non-zero
`smallthinker.attention.sliding_window` llama.cpp uses a window of 4096 (whatever the key's value) on the layers
il % 4 != 0 and no RoPE on the others (il % 4 == 0: full attention, no positions); without it every layer has
RoPE and full attention. The head reads token_embd when the file has no output.weight.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from powerinfer.arch.base import DecoderVariant, MetadataView
from powerinfer.arch.moe import MoEConfig, MoEVariant, build_moe, check_moe, moe_config
from powerinfer.gguf.constants import Keys

__all__ = ["SmallThinkerConfig", "build", "check"]

build, check = build_moe, check_moe
VARIANT = MoEVariant(DecoderVariant("neox"), norm_weights=True, act="relu", route_input="layer")
WINDOW = 4096  # llama.cpp's n_swa for smallthinker files with a window
PATTERN = 4  # layers il % 4 == 0 attend to the whole context without RoPE


@dataclass(frozen=True)
class SmallThinkerConfig(MoEConfig):
    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], sparse: bool) -> MoEConfig:
        """The config from `smallthinker.*` keys."""
        window = MetadataView(metadata, "smallthinker").optional(Keys.SLIDING_WINDOW, 0)
        config = moe_config(
            {**metadata, Keys.SLIDING_WINDOW.format(arch="smallthinker"): 0}, sparse, VARIANT, cls
        )
        if not window:
            return config
        local = dataclasses.replace(config.attention, sliding_window=WINDOW)
        full = dataclasses.replace(config.attention, rope=None)
        layers = tuple(local if bid % PATTERN else full for bid in range(config.n_layer))
        return dataclasses.replace(config, layer_attention=layers)
