"""The shapes a transformer block can take, as data: norms, attention variants, FFN variants.

An architecture file fills these in from its config; the blocks in `powerinfer.model.blocks` read them. A variant
the blocks cannot compute is refused when the spec is built, with one clear error.
"""

from __future__ import annotations

from dataclasses import dataclass

from powerinfer.errors import ConfigError
from powerinfer.printable import printable

NORM_KINDS = ("rms", "rms_1p", "layer")  # RMSNorm, RMSNorm with (1 + w) (Gemma), LayerNorm with bias
ROPE_KINDS = ("adjacent", "neox")  # rotate pairs (2i, 2i+1) (GGUF llama layout) or halves (i, i + n_rot/2)
ACTIVATIONS = ("relu", "silu", "gelu", "gelu_tanh")


@dataclass(frozen=True)
class NormSpec:
    kind: str = "rms"
    eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.kind not in NORM_KINDS:
            raise ConfigError(f"unknown norm kind '{self.kind}' (known: {', '.join(NORM_KINDS)})")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary positions over the first n_rot dimensions of each head (n_rot < head_dim: partial RoPE)."""

    kind: str = "adjacent"
    n_rot: int = 0
    base: float = 10000.0
    scale: float = 1.0  # linear scaling (1 / llama.cpp's freq_scale): positions are divided by it
    # YaRN (llama.cpp's ggml rope): the share of each pair's unscaled frequency, ramped between the correction
    # dimensions that beta_fast / beta_slow rotations over n_ctx_orig positions give (0: linear scaling only)
    ext_factor: float = 0.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0
    magnitude: float = 1.0  # cos and sin are multiplied by it (YaRN's mscale times the attention factors)
    freq_factors: tuple[float, ...] | None = None  # per-pair frequency divisors (rope_freqs.weight: llama3)

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ConfigError(f"unknown RoPE kind '{self.kind}' (known: {', '.join(ROPE_KINDS)})")
        if self.n_rot <= 0 or self.n_rot % 2:
            raise ConfigError(f"RoPE dimension count must be positive and even (got {self.n_rot})")
        if not self.base > 0 or not self.scale > 0:
            raise ConfigError(f"RoPE base {self.base} and scaling factor {self.scale} must be positive")
        if self.ext_factor and self.n_ctx_orig <= 0:
            raise ConfigError(f"YaRN needs the original context length (got {self.n_ctx_orig})")
        if self.freq_factors is not None and len(self.freq_factors) != self.n_rot // 2:
            raise ConfigError(
                f"rope_freqs has {len(self.freq_factors)} frequency factors, RoPE rotates {self.n_rot // 2} pairs"
            )


@dataclass(frozen=True)
class AttentionSpec:
    n_head: int
    n_head_kv: int
    head_dim: int
    rope: RopeSpec | None = None  # None: no rotary positions (learned or none)
    fused_qkv: bool = False  # one wqkv matrix instead of wq, wk, wv
    bias: bool = False  # biases on q, k, v (and on the output when out_bias)
    out_bias: bool = False
    qk_norm: NormSpec | None = None  # per-head norm of q and k before RoPE
    qk_norm_whole: bool = False  # the q/k norms span the whole projection, not one head (OLMoE)
    sliding_window: int | None = None  # a query at p sees keys p - window < j <= p
    scale: float | None = None  # softmax scale of q.k (None: 1 / sqrt(head_dim))

    def __post_init__(self) -> None:
        if self.n_head <= 0 or self.n_head_kv <= 0 or self.n_head % self.n_head_kv:
            raise ConfigError(f"head count {self.n_head} is not a multiple of KV head count {self.n_head_kv}")
        if self.head_dim <= 0:
            raise ConfigError(f"head size must be positive (got {self.head_dim})")
        if self.rope is not None and self.rope.n_rot > self.head_dim:
            raise ConfigError(f"RoPE dimension {self.rope.n_rot} exceeds the head size {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding window must be positive (got {self.sliding_window})")
        if self.scale is not None and not self.scale > 0:
            raise ConfigError(f"attention scale must be positive (got {self.scale})")

    @property
    def n_embd_q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim


@dataclass(frozen=True)
class FFNSpec:
    """down(act(gate x) * up x) when gated, down(act(up x)) otherwise; relu_up: bamboo's ReLU(up x)."""

    act: str = "silu"
    gated: bool = True
    relu_up: bool = False
    bias: bool = False

    def __post_init__(self) -> None:
        if self.act not in ACTIVATIONS:
            raise ConfigError(
                f"unsupported FFN activation '{printable(self.act)}' (supported: {', '.join(ACTIVATIONS)})"
            )
        if self.relu_up and not self.gated:
            raise ConfigError("ReLU(up) needs a gated FFN")
