"""Hugging Face Falcon and OPT checkpoints into PowerInfer (PWRI) or dense GGUF files.

A PowerInfer file equals what PowerInfer's convert-hf-to-powerinfer-gguf.py writes (spec 1.3-1.5): the same keys
in the same order and types, the predictors first, Falcon's fused q/k/v rows re-ordered into all query heads, then
the K heads, then the V heads, the FFN down matrix transposed into `ffn_down_t` (OPT's fc2 bias renamed with it).
Where the original writes a broken file we write a working one instead: a Falcon or OPT checkpoint with tied
embeddings still gets its output matrix (Falcon) or none (OPT, whose output is always the token embedding), and
prefixed (`model.decoder.*`) OPT names are mapped like the original's prefix-less ones. A dense file adds
`tokenizer.ggml.pre` (modern llama.cpp needs it; PowerInfer's files have none and split with the GPT-2 regex) and
our activation key where the checkpoint's activation is not the architecture's default.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from powerinfer.arch.base import ACTIVATION_KEY
from powerinfer.convert.common import config_number
from powerinfer.convert.predictor import Predictors
from powerinfer.errors import ConfigError, FormatError
from powerinfer.gguf.constants import Keys, TensorNames, ValueType, bias_of
from powerinfer.gguf.writer import GGUFWriter
from powerinfer.printable import printable

U32, F32, STR = ValueType.UINT32, ValueType.FLOAT32, ValueType.STRING
# config.json model_type values this module converts: RefinedWeb / RefinedWebModel are the original Falcon-40B /
# Falcon-7B checkpoints (RWForCausalLM, their own key names)
MODEL_TYPES = ("falcon", "RefinedWeb", "RefinedWebModel", "opt")
_RW_KEYS = {"n_embed": "hidden_size", "n_head": "num_attention_heads", "n_layer": "num_hidden_layers",
            "n_head_kv": "num_kv_heads"}  # fmt: skip


@dataclass(frozen=True)
class FamilyConfig:
    """What the Falcon/OPT writers need from config.json."""

    arch: str  # falcon or opt
    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    eps: float
    activation: str
    new_decoder: bool = False  # Falcon's grouped q/k/v layout (40B/180B); else Falcon-7B's multi-query layout
    rope_theta: float = 10000.0


def _refuse(path: Path, cond: bool, what: str) -> None:
    if cond:
        raise ConfigError(f"{printable(str(path))}: {what}")


def read_config(cfg: dict[str, Any], path: Path) -> FamilyConfig:
    """The Falcon or OPT config of a config.json (model_type falcon / opt), refusing variants we cannot run."""
    arch = cfg.get("model_type")
    if arch in ("RefinedWeb", "RefinedWebModel"):
        cfg = {_RW_KEYS.get(k, k): v for k, v in cfg.items()}
        cfg.setdefault("new_decoder_architecture", arch == "RefinedWeb")
        arch = "falcon"
    n_embd, n_head = config_number(cfg, path, "hidden_size"), config_number(cfg, path, "num_attention_heads")
    _refuse(
        path, n_head <= 0 or n_embd % n_head != 0, f"hidden_size {n_embd} is not a multiple of {n_head} heads"
    )
    if arch == "falcon":
        _refuse(path, bool(cfg.get("alibi")), "ALiBi Falcon models are not supported (RoPE only)")
        _refuse(path, bool(cfg.get("bias")), "Falcon models with linear biases are not supported")
        _refuse(
            path,
            cfg.get("parallel_attn") is False,
            "Falcon models without parallel attention are not supported",
        )
        new_decoder = bool(cfg.get("new_decoder_architecture"))
        if new_decoder:
            n_head_kv = config_number(cfg, path, "num_kv_heads", default=1)
        else:
            _refuse(path, not cfg.get("multi_query", True), "Falcon's per-head q/k/v layout is not supported")
            n_head_kv = 1
        _refuse(path, n_head_kv <= 0 or n_head % n_head_kv != 0, f"{n_head} heads and {n_head_kv} KV heads")
        rope = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
        return FamilyConfig(
            arch="falcon",
            n_vocab=config_number(cfg, path, "vocab_size"),
            n_embd=n_embd,
            n_layer=config_number(cfg, path, "num_hidden_layers"),
            n_ff=config_number(cfg, path, "ffn_hidden_size", default=4 * n_embd),
            n_head=n_head,
            n_head_kv=n_head_kv,
            eps=config_number(cfg, path, "layer_norm_epsilon", float, default=1e-5),
            activation=str(cfg.get("activation", "gelu")),
            new_decoder=new_decoder,
            rope_theta=float(rope),
        )
    _refuse(
        path,
        cfg.get("do_layer_norm_before") is False,
        "post-LayerNorm OPT models (opt-350m) are not supported",
    )
    proj = cfg.get("word_embed_proj_dim", n_embd)
    _refuse(
        path, proj != n_embd, f"word_embed_proj_dim {proj} != hidden_size (project_in/out) is not supported"
    )
    _refuse(path, cfg.get("enable_bias") is False, "OPT models without biases are not supported")
    act = str(cfg.get("activation_function", "relu"))
    _refuse(path, act != "relu", f"OPT activation '{printable(act)}' is not supported (relu only)")
    return FamilyConfig(
        arch="opt",
        n_vocab=config_number(cfg, path, "vocab_size"),
        n_embd=n_embd,
        n_layer=config_number(cfg, path, "num_hidden_layers"),
        n_ff=config_number(cfg, path, "ffn_dim"),
        n_head=n_head,
        n_head_kv=n_head,
        eps=1e-5,
        activation=act,
    )


# HF name after the layer prefix -> GGUF template (Falcon: 40B-style and 7B-style norms)
_FALCON_LAYER = {
    "ln_attn": TensorNames.ATTN_NORM_2,
    "ln_mlp": TensorNames.ATTN_NORM,
    "input_layernorm": TensorNames.ATTN_NORM,
    "self_attention.query_key_value": TensorNames.ATTN_QKV,
    "self_attention.dense": TensorNames.ATTN_OUT,
    "mlp.dense_h_to_4h": TensorNames.FFN_UP,
    "mlp.dense_4h_to_h": TensorNames.FFN_DOWN,
}
_FALCON_GLOBAL = {
    "transformer.word_embeddings": TensorNames.TOKEN_EMBD,
    "transformer.ln_f": TensorNames.OUTPUT_NORM,
    "lm_head": TensorNames.OUTPUT,
}
_OPT_LAYER = {
    "self_attn_layer_norm": TensorNames.ATTN_NORM,
    "self_attn.q_proj": TensorNames.ATTN_Q,
    "self_attn.k_proj": TensorNames.ATTN_K,
    "self_attn.v_proj": TensorNames.ATTN_V,
    "self_attn.out_proj": TensorNames.ATTN_OUT,
    "final_layer_norm": TensorNames.FFN_NORM,
    "fc1": TensorNames.FFN_UP,
    "fc2": TensorNames.FFN_DOWN,
}
_OPT_GLOBAL = {
    "decoder.embed_tokens": TensorNames.TOKEN_EMBD,
    "decoder.embed_positions": TensorNames.POS_EMBD,
    "decoder.final_layer_norm": TensorNames.OUTPUT_NORM,
    "lm_head": TensorNames.OUTPUT,
}
_FALCON_RE = re.compile(r"transformer\.h\.(\d+)\.(.+)\.(weight|bias)")
_OPT_RE = re.compile(r"(?:model\.)?decoder\.layers\.(\d+)\.(.+)\.(weight|bias)")


def map_names(names: list[str], c: FamilyConfig, tied: bool) -> dict[str, str]:
    """GGUF name -> HF name, in checkpoint order; FormatError for a tensor we do not know."""
    layer_map, global_map, pattern = (
        (_FALCON_LAYER, _FALCON_GLOBAL, _FALCON_RE)
        if c.arch == "falcon"
        else (_OPT_LAYER, _OPT_GLOBAL, _OPT_RE)
    )
    out: dict[str, str] = {}
    for hf in names:
        m = pattern.fullmatch(hf)
        if m and m.group(2) in layer_map and int(m.group(1)) < c.n_layer:
            template = layer_map[m.group(2)].format(bid=int(m.group(1)))
            out[template if m.group(3) == "weight" else bias_of(template)] = hf
            continue
        stem, _, kind = hf.removeprefix("model.").rpartition(".")
        if stem in global_map and kind in ("weight", "bias"):
            if global_map[stem] == TensorNames.OUTPUT and c.arch == "opt" and tied:
                continue  # OPT's output is the token embedding
            out[global_map[stem] if kind == "weight" else bias_of(global_map[stem])] = hf
            continue
        if hf.endswith("rotary_emb.inv_freq"):
            continue
        raise FormatError(f"unexpected tensor '{printable(hf)}' in the checkpoint")
    if c.arch == "falcon" and TensorNames.OUTPUT not in out and TensorNames.TOKEN_EMBD in out:
        out[TensorNames.OUTPUT] = out[TensorNames.TOKEN_EMBD]  # tied: PowerInfer's loader needs output.weight
    return out


def expected_shapes(c: FamilyConfig, mapping: dict[str, str], n_positions: int) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture needs, with its HF shape (before re-ordering or transposing)."""
    kv = c.n_head_kv * (c.n_embd // c.n_head)
    out: dict[str, tuple[int, ...]] = {TensorNames.TOKEN_EMBD: (c.n_vocab, c.n_embd)}
    norms = [TensorNames.OUTPUT_NORM]
    if c.arch == "falcon":
        out[TensorNames.OUTPUT] = (c.n_vocab, c.n_embd)
        for bid in range(c.n_layer):
            norms.append(TensorNames.ATTN_NORM.format(bid=bid))
            if TensorNames.ATTN_NORM_2.format(bid=bid) in mapping:
                norms.append(TensorNames.ATTN_NORM_2.format(bid=bid))
            out[TensorNames.ATTN_QKV.format(bid=bid)] = (c.n_embd + 2 * kv, c.n_embd)
            out[TensorNames.ATTN_OUT.format(bid=bid)] = (c.n_embd, c.n_embd)
            out[TensorNames.FFN_UP.format(bid=bid)] = (c.n_ff, c.n_embd)
            out[TensorNames.FFN_DOWN.format(bid=bid)] = (c.n_embd, c.n_ff)
    else:
        out[TensorNames.POS_EMBD] = (n_positions, c.n_embd)
        for bid in range(c.n_layer):
            norms += [TensorNames.ATTN_NORM.format(bid=bid), TensorNames.FFN_NORM.format(bid=bid)]
            for template, shape in (
                (TensorNames.ATTN_Q, (c.n_embd, c.n_embd)),
                (TensorNames.ATTN_K, (c.n_embd, c.n_embd)),
                (TensorNames.ATTN_V, (c.n_embd, c.n_embd)),
                (TensorNames.ATTN_OUT, (c.n_embd, c.n_embd)),
                (TensorNames.FFN_UP, (c.n_ff, c.n_embd)),
                (TensorNames.FFN_DOWN, (c.n_embd, c.n_ff)),
            ):
                name = template.format(bid=bid)
                out[name], out[bias_of(name)] = shape, shape[:1]
    for name in norms:
        out[name] = out[bias_of(name)] = (c.n_embd,)
    return out


def check_shapes(c: FamilyConfig, mapping: dict[str, str], shape_of: Callable[[str], tuple[int, ...]]) -> int:
    """Every needed tensor present with its shape; returns OPT's position-table rows (0 for Falcon)."""
    n_positions = 0
    if c.arch == "opt":
        if TensorNames.POS_EMBD not in mapping:
            raise FormatError(f"the checkpoint has no tensor for {TensorNames.POS_EMBD}")
        n_positions = shape_of(mapping[TensorNames.POS_EMBD])[0]
        if n_positions < 3:
            raise FormatError("the OPT position table has fewer than 3 rows")
    for name, want in expected_shapes(c, mapping, n_positions).items():
        if name not in mapping:
            raise FormatError(f"the checkpoint has no tensor for {printable(name)}")
        got = shape_of(mapping[name])
        if got != want:
            raise FormatError(f"tensor '{mapping[name]}' has shape {got}, expected {want} from config.json")
    return n_positions


def falcon_qkv(w: np.ndarray, c: FamilyConfig) -> np.ndarray:
    """Falcon's fused q/k/v rows into all query heads, then the K heads, then the V heads."""
    if not c.new_decoder:
        return w  # Falcon-7B: already [q heads | k | v]
    head_dim = c.n_embd // c.n_head
    g = w.reshape(c.n_head_kv, c.n_head // c.n_head_kv + 2, head_dim, w.shape[-1])
    q = g[:, :-2].reshape(-1, w.shape[-1])
    return np.concatenate([q, g[:, -2].reshape(-1, w.shape[-1]), g[:, -1].reshape(-1, w.shape[-1])])


def add_metadata(w: GGUFWriter, c: FamilyConfig, file_type: int, sparse: bool, predictors: Predictors | None,
                 n_positions: int) -> None:  # fmt: skip
    """The keys of the original converter, in its order (spec 1.3); dense files add what llama.cpp reads."""
    a = c.arch
    w.add(Keys.ARCHITECTURE, a, STR)
    w.add(Keys.NAME, "Falcon" if a == "falcon" else "opt", STR)
    if a == "falcon":
        w.add(Keys.CONTEXT_LENGTH.format(arch=a), 2048, U32)
        w.add(Keys.TENSOR_DATA_LAYOUT.format(arch=a), "jploski", STR)
        w.add(Keys.EMBEDDING_LENGTH.format(arch=a), c.n_embd, U32)
        w.add(Keys.FEED_FORWARD_LENGTH.format(arch=a), c.n_ff, U32)
        w.add(Keys.BLOCK_COUNT.format(arch=a), c.n_layer, U32)
        w.add(Keys.HEAD_COUNT.format(arch=a), c.n_head, U32)
        w.add(Keys.HEAD_COUNT_KV.format(arch=a), c.n_head_kv, U32)
        w.add(Keys.LAYERNORM_EPS.format(arch=a), c.eps, F32)
        if c.rope_theta != 10000.0:  # PowerInfer assumes 10000 and writes no key
            w.add(Keys.ROPE_FREQ_BASE.format(arch=a), c.rope_theta, F32)
    else:
        w.add(Keys.CONTEXT_LENGTH.format(arch=a), n_positions, U32)
        w.add(Keys.EMBEDDING_LENGTH.format(arch=a), c.n_embd, U32)
        w.add(Keys.BLOCK_COUNT.format(arch=a), c.n_layer, U32)
        w.add(Keys.FEED_FORWARD_LENGTH.format(arch=a), c.n_ff, U32)
        w.add(Keys.HEAD_COUNT.format(arch=a), c.n_head, U32)
    w.add(Keys.FILE_TYPE, file_type, U32)
    if predictors is not None and predictors.threshold is not None:
        w.add(Keys.SPARSE_THRESHOLD, predictors.threshold, F32)
    default_act = "relu" if sparse or a == "opt" else "gelu"
    if c.activation != default_act:
        w.add(ACTIVATION_KEY, c.activation, STR)


def tensors(
    get: Callable[[str], np.ndarray],
    c: FamilyConfig,
    mapping: dict[str, str],
    sparse: bool,
    predictors: Predictors | None,
) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, row-major array): the predictors first (as the original writes them), then the checkpoint's
    tensors in its order."""
    if predictors is not None:
        for layer, (fc1, fc2) in enumerate(zip(predictors.fc1, predictors.fc2, strict=True)):
            yield TensorNames.PRED_FC1.format(bid=layer), fc1
            yield TensorNames.PRED_FC2.format(bid=layer), fc2
    for name, hf in mapping.items():
        data = get(hf)
        if name.endswith(".attn_qkv.weight"):
            data = falcon_qkv(data, c)
        if sparse and ".ffn_down." in name:
            name = name.replace(".ffn_down.", ".ffn_down_t.")
            if data.ndim == 2:
                data = data.T  # (n_ff, n_embd): row j = output column of neuron j
        yield name, data
