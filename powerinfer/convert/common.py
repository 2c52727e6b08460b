"""What every checkpoint converter shares: reading numbers from config.json, writing the tensors."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from powerinfer.errors import ConfigError
from powerinfer.gguf.constants import GGMLType, TensorNames
from powerinfer.gguf.writer import GGUFWriter
from powerinfer.printable import printable

# the largest size any config.json number may state (a context of 2^63 or 2^40 layers is a hostile file, not a
# model; the checkpoint's tensors must match the numbers anyway)
# Hugging Face tensor names of the Llama layout, shared by its families' converters
LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
GLOBAL_TENSORS = {
    "model.embed_tokens.weight": TensorNames.TOKEN_EMBD,
    "model.norm.weight": TensorNames.OUTPUT_NORM,
    "lm_head.weight": TensorNames.OUTPUT,
}
ATTENTION_TENSORS = {  # name after the layer prefix -> GGUF template
    "input_layernorm.weight": TensorNames.ATTN_NORM,
    "self_attn.q_proj.weight": TensorNames.ATTN_Q,
    "self_attn.k_proj.weight": TensorNames.ATTN_K,
    "self_attn.v_proj.weight": TensorNames.ATTN_V,
    "self_attn.o_proj.weight": TensorNames.ATTN_OUT,
    "post_attention_layernorm.weight": TensorNames.FFN_NORM,
}
CONFIG_INT_MAX = 1 << 24


def config_number(
    cfg: dict[str, Any],
    path: Path,
    key: str,
    kind: type = int,
    default: Any = None,
    *,
    positive: bool = True,
) -> Any:
    """config.json's number `key` as `kind` (an int must be integral and in 1..CONFIG_INT_MAX; a float finite and,
    with `positive`, above 0; a bool is no number); `default` when the key is absent or null, ConfigError when it is
    required (default None) or not such a number."""
    value = cfg.get(key)
    if value is None:
        value = default
    if value is None:
        raise ConfigError(f"{printable(str(path))}: missing required key '{key}'")
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or (kind is int and value != int(value))
    ):
        raise ConfigError(f"{printable(str(path))}: '{key}' must be a number, got {printable(value)}")
    if kind is int and not 1 <= value <= CONFIG_INT_MAX:
        raise ConfigError(f"{printable(str(path))}: '{key}' = {value} is out of range (1..{CONFIG_INT_MAX})")
    if kind is float and positive and not value > 0:
        raise ConfigError(f"{printable(str(path))}: '{key}' must be above 0, got {value}")
    return kind(value)


def write_tensors(
    writer: GGUFWriter,
    tensors: Iterable[tuple[str, np.ndarray]],
    total: int,
    matrix_type: GGMLType,
    on_tensor: Callable[[str, int, int], None] | None,
) -> None:
    """Add (GGUF name, row-major array) pairs, matrices as `matrix_type` and vectors as F32, then write the file
    (atomically: a temp file renamed into place); `on_tensor(name, index, total)` reports progress."""
    for i, (name, data) in enumerate(tensors):
        if on_tensor is not None:
            on_tensor(name, i, total)
        ggml_type = matrix_type if data.ndim >= 2 else GGMLType.F32
        src = data if ggml_type == GGMLType.F16 else data.astype(np.float32)
        writer.add_tensor(name, np.ascontiguousarray(src), ggml_type)
    writer.write()
