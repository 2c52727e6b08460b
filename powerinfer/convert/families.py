"""What `powerinfer convert` does per Hugging Face model_type: the GGUF architecture, q/k permutation, the
tensors beyond Llama's, and the config checks of each family.

The facts follow llama.cpp's convert_hf_to_gguf.py: Llama and Mistral (written as arch "llama") have q/k rows
permuted for adjacent-pair RoPE; Qwen2 and Qwen3 keep Hugging Face's order (NEOX RoPE), write
`{arch}.attention.key_length`/`value_length` when config.json has head_dim, no rope.dimension_count, and no
output.weight when the embeddings are tied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from powerinfer.errors import ConfigError
from powerinfer.gguf.constants import TensorNames
from powerinfer.printable import printable


def no_window(cfg: dict[str, Any], path: Path) -> int | None:
    return None


def mistral_window(cfg: dict[str, Any], path: Path) -> int | None:
    """Mistral's sliding_window (null in v0.2 and later: full attention)."""
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ConfigError(f"{printable(str(path))}: sliding_window must be a positive integer or null")
    return window


def qwen_window(cfg: dict[str, Any], path: Path) -> int | None:
    """Qwen2/Qwen3 slide only with use_sliding_window, and then only from layer max_window_layers on (as
    transformers does); a window on some layers but not others is refused."""
    if not cfg.get("use_sliding_window"):
        return None
    n_layer = cfg.get("num_hidden_layers")
    first = cfg.get("max_window_layers", 0)
    if isinstance(first, int) and isinstance(n_layer, int) and first >= n_layer:
        return None  # no layer reaches max_window_layers
    if first:
        raise ConfigError(
            f"{printable(str(path))}: sliding windows on layers {first}.. only (max_window_layers) are unsupported"
        )
    return mistral_window(cfg, path)


# HF layer tensor (after model.layers.N.) -> (GGUF template, size: "q" n_head * head_dim, "kv" n_head_kv *
# head_dim, "head" head_dim)
QKV_BIASES = {
    "self_attn.q_proj.bias": (TensorNames.ATTN_Q_BIAS, "q"),
    "self_attn.k_proj.bias": (TensorNames.ATTN_K_BIAS, "kv"),
    "self_attn.v_proj.bias": (TensorNames.ATTN_V_BIAS, "kv"),
}
QK_NORMS = {
    "self_attn.q_norm.weight": (TensorNames.ATTN_Q_NORM, "head"),
    "self_attn.k_norm.weight": (TensorNames.ATTN_K_NORM, "head"),
}


@dataclass(frozen=True)
class Family:
    """One HF model_type as the converter writes it.

    arch: general.architecture. permute_qk: q/k rows into llama.cpp's adjacent-pair order. extra: 1-D layer
    tensors beyond Llama's. sparse: a PowerInfer (PWRI) file may be written (predictor folder).
    free_head_dim: config.json's head_dim may differ from hidden_size / num_attention_heads. key_length: write
    {arch}.attention.key_length/value_length when config.json has head_dim. rope_dim_key: write
    {arch}.rope.dimension_count. tied_output: write output.weight as a copy of the embedding when tied
    (PowerInfer's loader requires it; llama.cpp's qwen files have none). window: the sliding window written
    as {arch}.attention.sliding_window (None: none).
    """

    arch: str
    permute_qk: bool = True
    extra: dict[str, tuple[str, str]] = field(default_factory=dict)
    sparse: bool = False
    free_head_dim: bool = False
    key_length: bool = False
    rope_dim_key: bool = True
    tied_output: bool = True
    window: Callable[[dict[str, Any], Path], int | None] = no_window


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", sparse=True),
    "bamboo": Family("bamboo", sparse=True),
    "mistral": Family("llama", free_head_dim=True, key_length=True, window=mistral_window),
    "qwen2": Family(
        "qwen2", permute_qk=False, extra=QKV_BIASES, key_length=True, rope_dim_key=False, tied_output=False,
        window=qwen_window,
    ),
    "qwen3": Family(
        "qwen3", permute_qk=False, extra=QK_NORMS, free_head_dim=True, key_length=True, rope_dim_key=False,
        tied_output=False, window=qwen_window,
    ),
}  # fmt: skip
# the class name in config.json's "architectures" when model_type is missing
CLASS_NAMES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def extra_shape(size: str, n_head: int, n_head_kv: int, head_dim: int) -> tuple[int]:
    """The shape of an `extra` tensor of the given size kind."""
    return ({"q": n_head * head_dim, "kv": n_head_kv * head_dim, "head": head_dim}[size],)
