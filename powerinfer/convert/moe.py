"""Hugging Face mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) into dense GGUF files laid
out as llama.cpp's converter writes them.

Checkpoints store each expert's matrices apart (`mlp.experts.N.gate_proj` / `block_sparse_moe.experts.N.w1`);
the file stacks them per layer into `blk.L.ffn_{gate,up,down}_exps` (n_expert, ...), the router `mlp.gate` becomes
`ffn_gate_inp`, Qwen2-MoE's shared expert `ffn_{gate,up,down}_shexp` and its gate `ffn_gate_inp_shexp` (written
(n_embd,)). Mixtral is written as arch `llama` with q/k rows permuted for adjacent-pair RoPE; the others keep
Hugging Face's order (NEOX RoPE). Keys: `{arch}.expert_count`, `expert_used_count`, and for the Qwen families
`expert_feed_forward_length` (and `expert_shared_feed_forward_length`). llama.cpp hard-codes whether a family
renormalises its top-k weights (Mixtral and Qwen3-MoE do, Qwen2-MoE and OLMoE do not); where the checkpoint's
norm_topk_prob says otherwise we write `{arch}.expert_weights_norm`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from powerinfer.convert.common import (
    ATTENTION_TENSORS,
    GLOBAL_TENSORS,
    LAYER_RE,
    config_number,
    write_tensors,
)
from powerinfer.convert.rope import RopeScaling
from powerinfer.convert.vocab import load_vocab
from powerinfer.errors import ConfigError, FormatError
from powerinfer.gguf.constants import GGMLType, Keys, TensorNames, ValueType
from powerinfer.gguf.writer import GGUFWriter
from powerinfer.printable import printable

U32, F32, STR = ValueType.UINT32, ValueType.FLOAT32, ValueType.STRING
_EXPERT_RE = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_QK_NORMS = {
    "self_attn.q_norm.weight": TensorNames.ATTN_Q_NORM,
    "self_attn.k_norm.weight": TensorNames.ATTN_K_NORM,
}
_QKV_BIASES = {
    "self_attn.q_proj.bias": TensorNames.ATTN_Q_BIAS,
    "self_attn.k_proj.bias": TensorNames.ATTN_K_BIAS,
    "self_attn.v_proj.bias": TensorNames.ATTN_V_BIAS,
}
_SHARED = {
    "mlp.shared_expert.gate_proj.weight": TensorNames.FFN_GATE_SHEXP,
    "mlp.shared_expert.up_proj.weight": TensorNames.FFN_UP_SHEXP,
    "mlp.shared_expert.down_proj.weight": TensorNames.FFN_DOWN_SHEXP,
    "mlp.shared_expert_gate.weight": TensorNames.FFN_GATE_INP_SHEXP,
}
# expert matrix name in the checkpoint -> which of the stacked tensors ("gate", "up", "down")
_EXPERT_PARTS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}
_STACKED = {
    "gate": TensorNames.FFN_GATE_EXPS,
    "up": TensorNames.FFN_UP_EXPS,
    "down": TensorNames.FFN_DOWN_EXPS,
}


@dataclass(frozen=True)
class Family:
    """One HF MoE model_type: GGUF arch, its layer tensors besides the experts, the router's name, whether q/k are
    permuted (arch llama), the key of the expert count, llama.cpp's renormalisation for the arch, and whether the
    Qwen expert-width keys are written."""

    arch: str
    layer_tensors: dict[str, str]
    router: str
    permute_qk: bool = False
    expert_count_keys: tuple[str, ...] = (
        "num_experts",
        "num_local_experts",
    )  # transformers 5 writes the latter
    norm_default: bool = False
    norm_key: str | None = "norm_topk_prob"  # None: the family always renormalises (Mixtral)
    expert_width_keys: bool = False
    shared: bool = False
    extra_checks: Callable[[dict[str, Any], Path], None] = field(default=lambda cfg, path: None)


def _qwen_checks(cfg: dict[str, Any], path: Path) -> None:
    step = cfg.get("decoder_sparse_step", 1)
    if step not in (None, 1) or cfg.get("mlp_only_layers"):
        raise ConfigError(
            f"{printable(str(path))}: dense layers between MoE layers (decoder_sparse_step, mlp_only_layers) are "
            f"unsupported"
        )
    if cfg.get("use_sliding_window"):
        raise ConfigError(f"{printable(str(path))}: use_sliding_window is unsupported for MoE checkpoints")


def _olmoe_checks(cfg: dict[str, Any], path: Path) -> None:
    if cfg.get("clip_qkv") is not None:
        raise ConfigError(f"{printable(str(path))}: clip_qkv is unsupported")


FAMILIES: dict[str, Family] = {
    "mixtral": Family(
        "llama", ATTENTION_TENSORS, "block_sparse_moe.gate.weight", permute_qk=True,
        expert_count_keys=("num_local_experts",), norm_default=True, norm_key=None,
    ),
    "qwen2_moe": Family(
        "qwen2moe", ATTENTION_TENSORS | _QKV_BIASES | _SHARED, "mlp.gate.weight", expert_width_keys=True, shared=True,
        extra_checks=_qwen_checks,
    ),
    "qwen3_moe": Family(
        "qwen3moe", ATTENTION_TENSORS | _QK_NORMS, "mlp.gate.weight", norm_default=True, expert_width_keys=True,
        extra_checks=_qwen_checks,
    ),
    "olmoe": Family("olmoe", ATTENTION_TENSORS | _QK_NORMS, "mlp.gate.weight", extra_checks=_olmoe_checks),
}  # fmt: skip
MODEL_TYPES = tuple(FAMILIES)


@dataclass(frozen=True)
class MoEShape:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_used: int
    n_ff_exp: int
    n_ff_shexp: int


def _rope_theta(cfg: dict[str, Any], path: Path) -> float | None:
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta") if isinstance(params, dict) else None)
    return None if theta is None else config_number({"rope_theta": theta}, path, "rope_theta", float)


def _metadata(w: GGUFWriter, cfg: dict[str, Any], path: Path, family: Family) -> MoEShape:
    arch = family.arch

    def k(template: str) -> str:
        return template.format(arch=arch)

    def need(key: str, kind: type = int) -> Any:
        return config_number(cfg, path, key, kind)

    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"{printable(str(path))}: unsupported hidden_act '{printable(cfg.get('hidden_act'))}'"
        )
    family.extra_checks(cfg, path)
    n_embd, n_head, n_layer = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
    n_head_kv = config_number(cfg, path, "num_key_value_heads", int, default=n_head)
    head_dim = cfg.get("head_dim") or n_embd // n_head
    if not isinstance(head_dim, int) or head_dim % 2 or n_head % n_head_kv:
        raise ConfigError(f"{printable(str(path))}: head_dim / head counts do not fit")
    if family.arch != "qwen3moe" and head_dim * n_head != n_embd:
        raise ConfigError(f"{printable(str(path))}: head_dim {head_dim} != hidden_size / num_attention_heads")
    count_key = next((key for key in family.expert_count_keys if cfg.get(key) is not None), "num_experts")
    n_expert, n_used = need(count_key), need("num_experts_per_tok")
    if n_used > n_expert:
        raise ConfigError(
            f"{printable(str(path))}: num_experts_per_tok {n_used} exceeds the {n_expert} experts"
        )
    n_ff = need("intermediate_size")
    n_ff_exp = need("moe_intermediate_size") if family.expert_width_keys else n_ff
    n_ff_shexp = need("shared_expert_intermediate_size") if family.shared else 0

    w.add(k(Keys.CONTEXT_LENGTH), need("max_position_embeddings"), U32)
    w.add(k(Keys.EMBEDDING_LENGTH), n_embd, U32)
    w.add(k(Keys.BLOCK_COUNT), n_layer, U32)
    w.add(k(Keys.FEED_FORWARD_LENGTH), n_ff, U32)
    if family.permute_qk:
        w.add(k(Keys.ROPE_DIMENSION_COUNT), head_dim, U32)
    w.add(k(Keys.HEAD_COUNT), n_head, U32)
    w.add(k(Keys.HEAD_COUNT_KV), n_head_kv, U32)
    scaling = RopeScaling.from_config(cfg, path)
    if scaling.kind == "llama3":
        raise ConfigError(f"{printable(str(path))}: unsupported RoPE scaling 'llama3' for MoE checkpoints")
    theta = _rope_theta(cfg, path)
    if theta is not None:
        w.add(k(Keys.ROPE_FREQ_BASE), theta, F32)
    for key, value, kind in scaling.keys(arch):
        w.add(key, value, kind)
    w.add(k(Keys.LAYERNORM_RMS_EPS), need("rms_norm_eps", float), F32)
    if cfg.get("head_dim") is not None and family.arch != "llama":
        w.add(k(Keys.KEY_LENGTH), head_dim, U32)
        w.add(k(Keys.VALUE_LENGTH), head_dim, U32)
    window = cfg.get("sliding_window") if family.arch == "llama" else None
    if window:
        w.add(k(Keys.SLIDING_WINDOW), config_number(cfg, path, "sliding_window"), U32)
    w.add(k(Keys.EXPERT_COUNT), n_expert, U32)
    w.add(k(Keys.EXPERT_USED_COUNT), n_used, U32)
    if family.expert_width_keys:
        w.add(k(Keys.EXPERT_FEED_FORWARD_LENGTH), n_ff_exp, U32)
    if family.shared:
        w.add(k(Keys.EXPERT_SHARED_FEED_FORWARD_LENGTH), n_ff_shexp, U32)
    if family.norm_key is not None:
        norm = cfg.get(family.norm_key, family.norm_default)
        if not isinstance(norm, bool):
            raise ConfigError(f"{printable(str(path))}: '{family.norm_key}' must be true or false")
        if norm != family.norm_default:  # llama.cpp's hard-coded choice is wrong for this checkpoint
            w.add(k(Keys.EXPERT_WEIGHTS_NORM), norm, ValueType.BOOL)
    return MoEShape(n_layer, n_embd, n_head, n_head_kv, head_dim, n_expert, n_used, n_ff_exp, n_ff_shexp)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF q/k rows (rotate-half per head) into llama.cpp's adjacent-pair order."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _plan(
    ckpt: Any, s: MoEShape, family: Family, tied: bool
) -> tuple[dict[str, str], dict[int, dict[str, list]]]:
    """GGUF name -> HF name of the plain tensors (checkpoint order), and per layer each stacked part's HF names by
    expert; checks every tensor is present with its shape."""
    mapping: dict[str, str] = {}
    experts: dict[int, dict[str, list]] = {
        b: {part: [None] * s.n_expert for part in _STACKED} for b in range(s.n_layer)
    }
    for hf_name in ckpt.names():
        gguf_name = GLOBAL_TENSORS.get(hf_name)
        m = LAYER_RE.fullmatch(hf_name)
        if m and int(m.group(1)) < s.n_layer:
            bid, rest = int(m.group(1)), m.group(2)
            e = _EXPERT_RE.fullmatch(rest)
            if e and e.group(2) in _EXPERT_PARTS and int(e.group(1)) < s.n_expert:
                experts[bid][_EXPERT_PARTS[e.group(2)]][int(e.group(1))] = hf_name
                continue
            template = TensorNames.FFN_GATE_INP if rest == family.router else family.layer_tensors.get(rest)
            gguf_name = None if template is None else template.format(bid=bid)
        if gguf_name == TensorNames.OUTPUT and tied:
            continue
        if gguf_name is None:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue
            raise FormatError(f"unexpected tensor '{printable(hf_name)}' in the checkpoint")
        mapping[gguf_name] = hf_name
    D, F, E = s.n_embd, s.n_ff_exp, s.n_expert
    q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    whole = family.arch == "olmoe"
    shapes = {
        TensorNames.ATTN_NORM: (D,), TensorNames.FFN_NORM: (D,), TensorNames.ATTN_Q: (q, D),
        TensorNames.ATTN_K: (kv, D), TensorNames.ATTN_V: (kv, D), TensorNames.ATTN_OUT: (D, q),
        TensorNames.FFN_GATE_INP: (E, D), TensorNames.ATTN_Q_BIAS: (q,), TensorNames.ATTN_K_BIAS: (kv,),
        TensorNames.ATTN_V_BIAS: (kv,), TensorNames.ATTN_Q_NORM: (q if whole else s.head_dim,),
        TensorNames.ATTN_K_NORM: (kv if whole else s.head_dim,), TensorNames.FFN_GATE_SHEXP: (s.n_ff_shexp, D),
        TensorNames.FFN_UP_SHEXP: (s.n_ff_shexp, D), TensorNames.FFN_DOWN_SHEXP: (D, s.n_ff_shexp),
        TensorNames.FFN_GATE_INP_SHEXP: (1, D),
    }  # fmt: skip
    wanted = {TensorNames.TOKEN_EMBD: (None, D), TensorNames.OUTPUT_NORM: (D,)}
    if not tied:
        wanted[TensorNames.OUTPUT] = (None, D)
    for bid in range(s.n_layer):
        for template in (*family.layer_tensors.values(), TensorNames.FFN_GATE_INP):
            wanted[template.format(bid=bid)] = shapes[template]
    for gguf_name, shape in wanted.items():
        if gguf_name not in mapping:
            raise FormatError(f"the checkpoint has no tensor for {printable(gguf_name)}")
        got = ckpt.shape(mapping[gguf_name])
        if len(got) != len(shape) or any(
            want is not None and g != want for g, want in zip(got, shape, strict=True)
        ):
            raise FormatError(
                f"tensor '{mapping[gguf_name]}' has shape {got}, expected {shape} from config.json"
            )
    expert_shapes = {"gate": (F, D), "up": (F, D), "down": (D, F)}
    for bid, parts in experts.items():
        for part, names in parts.items():
            for e, hf_name in enumerate(names):
                if hf_name is None:
                    raise FormatError(f"the checkpoint has no {part} matrix for expert {e} of layer {bid}")
                if ckpt.shape(hf_name) != expert_shapes[part]:
                    raise FormatError(
                        f"tensor '{hf_name}' has shape {ckpt.shape(hf_name)}, expected {expert_shapes[part]}"
                    )
    return mapping, experts


def _tensors(
    ckpt: Any, s: MoEShape, family: Family, mapping: dict[str, str], experts: dict[int, dict[str, list]]
) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, array) pairs: the plain tensors in checkpoint order, each layer's stacked experts after the
    layer's first tensor."""
    done: set[int] = set()
    for gguf_name, hf_name in mapping.items():
        data = ckpt.get(hf_name)
        if family.permute_qk and gguf_name.endswith(".attn_q.weight"):
            data = _permute(data, s.n_head)
        elif family.permute_qk and gguf_name.endswith(".attn_k.weight"):
            data = _permute(data, s.n_head_kv)
        elif gguf_name.endswith("ffn_gate_inp_shexp.weight"):
            data = data.reshape(-1)  # (1, n_embd) -> (n_embd,): a vector, never quantized
        yield gguf_name, data
        m = LAYER_RE.fullmatch(hf_name)
        bid = int(m.group(1)) if m else -1
        if bid >= 0 and bid not in done:
            done.add(bid)
            for part in ("down", "gate", "up"):
                stack = np.stack([ckpt.get(n) for n in experts[bid][part]])  # (n_expert, rows, cols)
                yield _STACKED[part].format(bid=bid), stack


def convert_moe(
    hf_dir: Path,
    outfile: Path,
    config: dict[str, Any],
    ckpt: Any,
    matrix_type: GGMLType,
    file_type: int,
    on_tensor: Callable[[str, int, int], None] | None,
) -> GGUFWriter:
    """Write the dense GGUF of a Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE checkpoint (`ckpt`: hf.Checkpoint)."""
    path = hf_dir / "config.json"
    family = FAMILIES[config["model_type"]]
    tied = bool(config.get("tie_word_embeddings", False))
    writer = GGUFWriter(outfile)
    writer.add(Keys.ARCHITECTURE, family.arch, STR)
    writer.add(Keys.NAME, hf_dir.resolve().name, STR)
    s = _metadata(writer, config, path, family)
    writer.add(Keys.FILE_TYPE, file_type, U32)
    mapping, experts = _plan(ckpt, s, family, tied)
    n_vocab = ckpt.shape(mapping[TensorNames.TOKEN_EMBD])[0]
    vocab = load_vocab(hf_dir, config)
    vocab.pad_to(n_vocab)
    vocab.add_to(writer)
    total = len(mapping) + 3 * s.n_layer
    write_tensors(writer, _tensors(ckpt, s, family, mapping, experts), total, matrix_type, on_tensor)
    return writer
