"""Hugging Face Gemma 3 (text) and Phi-3 checkpoints into dense GGUF files laid out as llama.cpp's converter
writes them.

Gemma3ForCausalLM (model_type gemma3_text): RMSNorm weights stored as (1 + w) (the runtime then uses plain
RMSNorm), lm_head dropped when tied, q/k unpermuted (NEOX RoPE), add_space_prefix false. Phi3ForCausalLM: qkv_proj
and gate_up_proj kept fused as attn_qkv and ffn_up. Both: SentencePiece vocabulary with tokenizer_config.json's
added tokens, and its chat template. Only dense files: PowerInfer's sparse format covers llama/bamboo.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from powerinfer.arch import gemma3
from powerinfer.convert.common import GLOBAL_TENSORS, LAYER_RE, config_number, write_tensors
from powerinfer.convert.vocab import (
    ADDED_TOKEN_SCORE,
    TOKEN_CONTROL,
    TOKEN_USER_DEFINED,
    Vocab,
    load_vocab,
    read_json,
)
from powerinfer.errors import ConfigError, FormatError
from powerinfer.gguf.constants import GGMLType, Keys, TensorNames, ValueType
from powerinfer.gguf.writer import GGUFWriter
from powerinfer.printable import printable

U32, F32, STR = ValueType.UINT32, ValueType.FLOAT32, ValueType.STRING
_COMMON_LAYER = {
    "input_layernorm.weight": TensorNames.ATTN_NORM,
    "self_attn.o_proj.weight": TensorNames.ATTN_OUT,
    "mlp.down_proj.weight": TensorNames.FFN_DOWN,
}
_GEMMA3_LAYER = _COMMON_LAYER | {
    "self_attn.q_proj.weight": TensorNames.ATTN_Q,
    "self_attn.k_proj.weight": TensorNames.ATTN_K,
    "self_attn.v_proj.weight": TensorNames.ATTN_V,
    "self_attn.q_norm.weight": TensorNames.ATTN_Q_NORM,
    "self_attn.k_norm.weight": TensorNames.ATTN_K_NORM,
    "post_attention_layernorm.weight": TensorNames.ATTN_POST_NORM,
    "pre_feedforward_layernorm.weight": TensorNames.FFN_NORM,
    "post_feedforward_layernorm.weight": TensorNames.FFN_POST_NORM,
    "mlp.gate_proj.weight": TensorNames.FFN_GATE,
    "mlp.up_proj.weight": TensorNames.FFN_UP,
}
_PHI3_LAYER = _COMMON_LAYER | {
    "self_attn.qkv_proj.weight": TensorNames.ATTN_QKV,
    "post_attention_layernorm.weight": TensorNames.FFN_NORM,
    "mlp.gate_up_proj.weight": TensorNames.FFN_UP,
}


@dataclass(frozen=True)
class Family:
    """One HF family: GGUF architecture, HF layer tensor names -> GGUF templates, metadata writer, and the
    transform of a tensor's data by its GGUF name."""

    arch: str
    layer_tensors: dict[str, str]
    metadata: Callable[[GGUFWriter, dict[str, Any], Path], None]
    transform: Callable[[str, np.ndarray], np.ndarray]
    add_space_prefix: bool | None  # written when not None


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings of config.json: transformers 5's rope_parameters, or the older rope_theta / rope_scaling
    keys."""
    params = cfg.get("rope_parameters") or {}
    out = dict(cfg.get("rope_scaling") or {}) | {k: v for k, v in params.items() if v is not None}
    if "rope_theta" in cfg and "rope_theta" not in out:
        out["rope_theta"] = cfg["rope_theta"]
    return out


def _common_metadata(w: GGUFWriter, cfg: dict[str, Any], path: Path, arch: str) -> tuple[int, int]:
    def k(template: str) -> str:
        return template.format(arch=arch)

    n_embd, n_head = config_number(cfg, path, "hidden_size"), config_number(cfg, path, "num_attention_heads")
    w.add(k(Keys.CONTEXT_LENGTH), config_number(cfg, path, "max_position_embeddings"), U32)
    w.add(k(Keys.EMBEDDING_LENGTH), n_embd, U32)
    w.add(k(Keys.BLOCK_COUNT), config_number(cfg, path, "num_hidden_layers"), U32)
    w.add(k(Keys.FEED_FORWARD_LENGTH), config_number(cfg, path, "intermediate_size"), U32)
    w.add(k(Keys.HEAD_COUNT), n_head, U32)
    w.add(k(Keys.HEAD_COUNT_KV), int(cfg.get("num_key_value_heads") or n_head), U32)
    w.add(k(Keys.LAYERNORM_RMS_EPS), config_number(cfg, path, "rms_norm_eps", float), F32)
    return n_embd, n_head


def _gemma3_metadata(w: GGUFWriter, cfg: dict[str, Any], path: Path) -> None:
    def k(template: str) -> str:
        return template.format(arch="gemma3")

    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ConfigError(f"{printable(str(path))}: '{key}' is set: logit soft-capping is unsupported")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError(
            f"{printable(str(path))}: bidirectional attention (embedding models) is unsupported"
        )
    n_embd, n_head = _common_metadata(w, cfg, path, "gemma3")
    n_layer = config_number(cfg, path, "num_hidden_layers")
    head_dim = int(cfg.get("head_dim") or 256)
    pattern = gemma3.SWA_PATTERN
    want = ["sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(n_layer)]
    if cfg.get("layer_types") not in (None, want):
        raise ConfigError(
            f"{printable(str(path))}: layer_types must repeat 5 sliding layers and 1 global layer (llama.cpp's "
            f"Gemma 3 layout)"
        )
    params = cfg.get("rope_parameters") or {}
    if "sliding_attention" in params or "full_attention" in params:  # transformers 5: per layer type
        local, full = params.get("sliding_attention") or {}, params.get("full_attention") or {}
    else:
        local = {"rope_theta": cfg.get("rope_local_base_freq", gemma3.SWA_ROPE_BASE)}
        full = dict(cfg.get("rope_scaling") or {}) | {"rope_theta": cfg.get("rope_theta", 1_000_000.0)}
    local_type = local.get("rope_type", local.get("type", "default"))
    if (
        float(local.get("rope_theta", gemma3.SWA_ROPE_BASE)) != gemma3.SWA_ROPE_BASE
        or local_type != "default"
    ):
        raise ConfigError(f"{printable(str(path))}: sliding layers must use plain RoPE with base 10000")
    w.add(k(Keys.KEY_LENGTH), head_dim, U32)
    w.add(k(Keys.VALUE_LENGTH), head_dim, U32)
    w.add(k(Keys.ROPE_FREQ_BASE), float(full.get("rope_theta", 1_000_000.0)), F32)
    w.add(k(Keys.SLIDING_WINDOW), int(cfg.get("sliding_window") or 0), U32)
    rope_type = full.get("rope_type", full.get("type", "default"))
    if rope_type == "linear":
        w.add(k(Keys.ROPE_SCALING_TYPE), "linear", STR)
        w.add(k(Keys.ROPE_SCALING_FACTOR), float(full["factor"]), F32)
    elif rope_type != "default":
        raise ConfigError(f"{printable(str(path))}: unsupported RoPE scaling '{printable(rope_type)}'")
    # llama.cpp derives q's scale from the model size; a checkpoint that differs gets our explicit key
    scalar = float(cfg.get("query_pre_attn_scalar") or head_dim)
    default = (n_embd // n_head if n_layer == gemma3.N_LAYER_27B else head_dim) ** -0.5
    if not math.isclose(scalar**-0.5, default, rel_tol=1e-6):
        w.add(k(Keys.ATTENTION_SCALE), scalar**-0.5, F32)


def _phi3_metadata(w: GGUFWriter, cfg: dict[str, Any], path: Path) -> None:
    def k(template: str) -> str:
        return template.format(arch="phi3")

    rope = _rope_parameters(cfg)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(
            f"{printable(str(path))}: unsupported RoPE scaling '{printable(rope_type)}' (LongRoPE)"
        )
    n_embd, n_head = _common_metadata(w, cfg, path, "phi3")
    orig = cfg.get("original_max_position_embeddings") or config_number(cfg, path, "max_position_embeddings")
    w.add(k("{arch}.rope.scaling.original_context_length"), int(orig), U32)
    factor = float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    w.add(k(Keys.ROPE_DIMENSION_COUNT), int(factor * n_embd) // n_head, U32)
    w.add(k(Keys.ROPE_FREQ_BASE), float(rope.get("rope_theta", 10000.0)), F32)
    w.add(k(Keys.SLIDING_WINDOW), int(cfg.get("sliding_window") or 0), U32)


def _gemma3_transform(name: str, data: np.ndarray) -> np.ndarray:
    # Gemma's RMSNorm multiplies by (1 + w): llama.cpp stores the sum
    return data.astype(np.float32) + 1.0 if name.endswith("norm.weight") else data


FAMILIES: dict[str, Family] = {
    "gemma3_text": Family("gemma3", _GEMMA3_LAYER, _gemma3_metadata, _gemma3_transform, False),
    "phi3": Family("phi3", _PHI3_LAYER, _phi3_metadata, lambda name, data: data, None),
}


def _added_tokens(vocab: Vocab, tok_config: dict[str, Any]) -> None:
    """tokenizer_config.json's added_tokens_decoder over the SentencePiece pieces, as llama.cpp applies it:
    special tokens become control tokens, others user-defined, each with the added-token score."""
    decoder = tok_config.get("added_tokens_decoder") or {}
    for key, data in decoder.items():
        token_id, text = int(key), data.get("content") if isinstance(data, dict) else None
        if not isinstance(text, str) or not 0 <= token_id < len(vocab.tokens):
            continue
        special = bool(data.get("special"))
        vocab.tokens[token_id] = text if special else text.replace("\u2581", " ")
        vocab.types[token_id] = TOKEN_CONTROL if special else TOKEN_USER_DEFINED
        if vocab.scores is not None:
            vocab.scores[token_id] = ADDED_TOKEN_SCORE


def convert_family(
    hf_dir: Path,
    outfile: Path,
    config: dict[str, Any],
    ckpt: Any,
    matrix_type: GGMLType,
    file_type: int,
    on_tensor: Callable[[str, int, int], None] | None,
) -> GGUFWriter:
    """Write the dense GGUF of a Gemma 3 or Phi-3 checkpoint (`ckpt`: hf.Checkpoint); returns the writer."""
    path = hf_dir / "config.json"
    family = FAMILIES[config["model_type"]]
    n_layer = config_number(config, path, "num_hidden_layers")
    tied = bool(config.get("tie_word_embeddings", family.arch == "gemma3"))
    mapping: dict[str, str] = {}  # GGUF name -> HF name, in checkpoint order
    for hf_name in ckpt.names():
        gguf_name = GLOBAL_TENSORS.get(hf_name)
        m = LAYER_RE.fullmatch(hf_name)
        if m and m.group(2) in family.layer_tensors and int(m.group(1)) < n_layer:
            gguf_name = family.layer_tensors[m.group(2)].format(bid=int(m.group(1)))
        if gguf_name == TensorNames.OUTPUT and tied:
            continue  # the embedding serves as the output matrix
        if gguf_name is None:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            raise FormatError(f"unexpected tensor '{printable(hf_name)}' in the checkpoint")
        mapping[gguf_name] = hf_name
    for template in (TensorNames.TOKEN_EMBD, TensorNames.OUTPUT_NORM, *family.layer_tensors.values()):
        for bid in range(n_layer if "{bid}" in template else 1):
            if template.format(bid=bid) not in mapping:
                raise FormatError(f"the checkpoint has no tensor for {printable(template.format(bid=bid))}")
    n_vocab = ckpt.shape(mapping[TensorNames.TOKEN_EMBD])[0]
    vocab = load_vocab(hf_dir, config)
    vocab.pad_to(n_vocab)
    tok_config_path = hf_dir / "tokenizer_config.json"
    tok_config = read_json(tok_config_path) if tok_config_path.is_file() else {}
    _added_tokens(vocab, tok_config)

    writer = GGUFWriter(outfile)
    writer.add(Keys.ARCHITECTURE, family.arch, STR)
    writer.add(Keys.NAME, hf_dir.resolve().name, STR)
    family.metadata(writer, config, path)
    writer.add(Keys.FILE_TYPE, file_type, U32)
    vocab.add_to(writer)
    if family.add_space_prefix is not None:
        writer.add(Keys.TOKENIZER_ADD_SPACE_PREFIX, family.add_space_prefix, ValueType.BOOL)
    tensors = ((name, family.transform(name, ckpt.get(hf_name))) for name, hf_name in mapping.items())
    write_tensors(writer, tensors, len(mapping), matrix_type, on_tensor)
    return writer
