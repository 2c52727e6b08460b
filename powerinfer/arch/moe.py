"""Shared parts of the mixture-of-experts architectures (Mixtral as `llama` with experts, qwen2moe, qwen3moe, olmoe,
smallthinker): the MoE config read from llama.cpp's `{arch}.expert_*` keys, the tensor table and the model built
of attention blocks and MoE FFNs (powerinfer.model.moe).

Routing as llama.cpp's build_moe_ffn computes it: softmax (or sigmoid) of the router logits, the top
`expert_used_count`, renormalised where the family does it (Mixtral, Qwen3-MoE and SmallThinker always in
llama.cpp, Qwen2-MoE and OLMoE never; our converter writes `expert_weights_norm` when a checkpoint says otherwise,
and the key wins where present), times `expert_weights_scale` (1 without the key).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from powerinfer import ops
from powerinfer.arch.base import (
    DecoderVariant,
    MetadataView,
    TensorTable,
    check_layer_count,
    check_tensors,
    decoder_attention,
    decoder_config,
)
from powerinfer.errors import ConfigError, FormatError
from powerinfer.gguf.constants import Keys, TensorNames
from powerinfer.gguf.reader import GGUFFile
from powerinfer.model.blocks import DenseFFN, Embedding, Head, Norm, Rope
from powerinfer.model.config import ModelConfig
from powerinfer.model.moe import Experts, MoEFFN, MoESpec, SharedExpert
from powerinfer.model.source import WeightSource
from powerinfer.model.specs import AttentionSpec, FFNSpec
from powerinfer.model.transformer import Layer, Transformer
from powerinfer.printable import printable

# llama.cpp's llama_expert_gating_func_type: 0 none (the family's default), 1 softmax, 2 sigmoid
GATING_CODES = {1: "softmax", 2: "sigmoid"}


@dataclass(frozen=True)
class MoEVariant:
    """What sets a MoE family apart: its attention (DecoderVariant), the defaults llama.cpp hard-codes for its
    router, the width of an expert without `expert_feed_forward_length` ("n_ff" or "n_ff/k", llama.cpp's
    n_ff / n_expert_used), a shared expert, and q/k norms over the whole projection (OLMoE)."""

    decoder: DecoderVariant
    norm_weights: bool
    gating: str = "softmax"
    act: str = "silu"
    expert_width: str = "n_ff"
    shared: bool = False
    qk_norm_whole: bool = False
    route_input: str = "ffn"


@dataclass(frozen=True)
class MoEConfig(ModelConfig):
    """A MoE model's config: the dense fields (n_ff: feed_forward_length), the MoE spec and, where layers differ
    (SmallThinker: RoPE and window per layer), one attention spec per layer."""

    moe: MoESpec | None = None
    layer_attention: tuple[AttentionSpec, ...] = ()
    # CATS (`powerinfer sparsify`): (n_layer, n_expert, n_ff) float32 thresholds on |act(gate)|, or None
    expert_thresholds: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    def attention_of(self, bid: int) -> AttentionSpec:
        return self.layer_attention[bid] if self.layer_attention else self.attention

    @property
    def experts(self) -> MoESpec:
        if self.moe is None:
            raise ConfigError(f"{self.arch}: no expert settings")
        return self.moe


def _flag(metadata: dict[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(key, default)
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ConfigError(f"metadata key '{key}' should be a boolean, got {printable(value)}")


def moe_spec(metadata: dict[str, Any], arch: str, n_ff: int, variant: MoEVariant) -> MoESpec:
    """The MoE spec from `{arch}.expert_*` keys and the family's defaults."""
    m = MetadataView(metadata, arch)
    n_expert = m.require(Keys.EXPERT_COUNT)
    n_used = m.require(Keys.EXPERT_USED_COUNT)
    width = n_ff if variant.expert_width == "n_ff" or not n_used else n_ff // n_used
    n_ff_exp = m.optional(Keys.EXPERT_FEED_FORWARD_LENGTH, 0) or width
    code = m.optional(Keys.EXPERT_GATING_FUNC, 0)
    if code and code not in GATING_CODES:
        raise ConfigError(
            f"metadata key '{Keys.EXPERT_GATING_FUNC.format(arch=arch)}' = {code} is unsupported"
        )
    n_ff_shexp = 0
    if variant.shared:
        n_ff_shexp = m.optional(Keys.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0) or n_ff
    return MoESpec(
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=n_ff_exp,
        gating=GATING_CODES.get(code, variant.gating),
        norm_weights=_flag(metadata, Keys.EXPERT_WEIGHTS_NORM.format(arch=arch), variant.norm_weights),
        weights_scale=m.optional(Keys.EXPERT_WEIGHTS_SCALE, 1.0, float) or 1.0,
        act=variant.act,
        n_ff_shexp=n_ff_shexp,
        route_input=variant.route_input,
    )


def moe_config(
    metadata: dict[str, Any], sparse: bool, variant: MoEVariant, cls: type[MoEConfig] = MoEConfig
) -> MoEConfig:
    """The config of a MoE file: the Llama-layout decoder's fields plus the MoE spec."""
    arch = metadata[Keys.ARCHITECTURE]
    if sparse:
        raise ConfigError(f"{arch}: PowerInfer's sparse (PWRI) format has no mixture-of-experts layout")
    ff_key, exp_key = (
        Keys.FEED_FORWARD_LENGTH.format(arch=arch),
        Keys.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch),
    )
    if ff_key not in metadata and exp_key in metadata:  # feed_forward_length is optional next to the experts'
        metadata = {**metadata, ff_key: metadata[exp_key]}
    config = decoder_config(cls, metadata, False, variant.decoder)
    attention = config.attention
    if variant.qk_norm_whole:
        attention = dataclasses.replace(attention, qk_norm_whole=True)
    spec = moe_spec(metadata, arch, config.n_ff, variant)
    return dataclasses.replace(
        config,
        attention=attention,
        moe=spec,
        ffn=FFNSpec(act=variant.act, gated=True),
        expert_thresholds=expert_thresholds(metadata, config.n_layer, spec),
    )


def expert_thresholds(metadata: dict[str, Any], n_layer: int, spec: MoESpec) -> np.ndarray | None:
    """The file's CATS thresholds of every expert's neurons (n_layer, n_expert, n_ff) float32, or None without
    the key; ConfigError for a value that is not n_layer * n_expert * n_ff float32 numbers."""
    key = Keys.SPARSITY_EXPERT_THRESHOLDS
    if key not in metadata:
        return None
    value = metadata[key]
    shape = (n_layer, spec.n_expert, spec.n_ff_exp)
    n = n_layer * spec.n_expert * spec.n_ff_exp
    if not isinstance(value, np.ndarray) or value.dtype != np.float32 or value.ndim != 1 or value.size != n:
        got = (
            f"{value.size} {value.dtype} values"
            if isinstance(value, np.ndarray)
            else printable(type(value).__name__)
        )
        raise ConfigError(
            f"metadata key '{key}' should hold {n} float32 thresholds (n_layer x n_expert x n_ff = "
            f"{' x '.join(map(str, shape))}), got {got}"
        )
    return value.reshape(shape)


# tensors of one layer every MoE file holds (norms, attention, router and the three stacked experts)
MOE_LAYER_TENSORS = 10


def moe_tensor_table(config: MoEConfig, gguf: GGUFFile | None = None) -> TensorTable:
    """Every tensor a MoE model reads, with the shape the config gives it (a shared expert's gate may be stored
    as (n_embd,) or, as llama.cpp's converter writes it, (1, n_embd))."""
    c, s = config, config.experts
    E, F, D = s.n_expert, s.n_ff_exp, c.n_embd
    shapes: dict[str, tuple[int | str, ...]] = {
        TensorNames.TOKEN_EMBD: (c.n_vocab, D),
        TensorNames.OUTPUT: (c.n_vocab, D),
        TensorNames.OUTPUT_NORM: (D,),
    }
    required = {TensorNames.TOKEN_EMBD, TensorNames.OUTPUT_NORM}
    for bid in range(c.n_layer):
        a = c.attention_of(bid)
        layer: dict[str, tuple[int | str, ...]] = {
            TensorNames.ATTN_NORM: (D,),
            TensorNames.ATTN_Q: (a.n_embd_q, D),
            TensorNames.ATTN_K: (a.n_embd_kv, D),
            TensorNames.ATTN_V: (a.n_embd_kv, D),
            TensorNames.ATTN_OUT: (D, a.n_embd_q),
            TensorNames.FFN_NORM: (D,),
            TensorNames.FFN_GATE_INP: (E, D),
            TensorNames.FFN_GATE_EXPS: (E, F, D),
            TensorNames.FFN_UP_EXPS: (E, F, D),
            TensorNames.FFN_DOWN_EXPS: (E, D, F),
        }
        if a.bias:
            layer |= {
                TensorNames.ATTN_Q_BIAS: (a.n_embd_q,),
                TensorNames.ATTN_K_BIAS: (a.n_embd_kv,),
                TensorNames.ATTN_V_BIAS: (a.n_embd_kv,),
            }
        if a.qk_norm is not None:
            q, k = (a.n_embd_q, a.n_embd_kv) if a.qk_norm_whole else (a.head_dim, a.head_dim)
            layer |= {TensorNames.ATTN_Q_NORM: (q,), TensorNames.ATTN_K_NORM: (k,)}
        if s.n_ff_shexp:
            gate_inp = TensorNames.FFN_GATE_INP_SHEXP.format(bid=bid)
            two_d = gguf is not None and gate_inp in gguf.tensors and len(gguf.tensors[gate_inp].shape) == 2
            layer |= {
                TensorNames.FFN_GATE_INP_SHEXP: (1, D) if two_d else (D,),
                TensorNames.FFN_GATE_SHEXP: (s.n_ff_shexp, D),
                TensorNames.FFN_UP_SHEXP: (s.n_ff_shexp, D),
                TensorNames.FFN_DOWN_SHEXP: (D, s.n_ff_shexp),
            }
        required |= {t.format(bid=bid) for t in layer}
        shapes |= {t.format(bid=bid): shape for t, shape in layer.items()}
    return TensorTable(shapes, frozenset(required))


def check_moe(config: ModelConfig, gguf: GGUFFile) -> None:
    """The file holds every tensor a MoE model of `config` reads, each of the expected type and shape."""
    assert isinstance(config, MoEConfig)
    check_layer_count(gguf, config, MOE_LAYER_TENSORS)
    check_tensors(gguf, config, moe_tensor_table(config, gguf))


def _shared_gate(src: WeightSource, name: str, n: int) -> torch.Tensor:
    """The shared expert's gate (n,) float32, stored (n,) or (1, n)."""
    try:
        return src.vector(name, n).to("cpu")
    except FormatError:
        w = src.host_matrix(name, (1, n))
        return ops.get_rows(w, torch.zeros(1, dtype=torch.int64), src.kc)[0]


def moe_ffn(c: MoEConfig, bid: int, src: WeightSource) -> MoEFFN:
    """A layer's MoE FFN: router, the stacked experts in their stored blocks, the shared expert if any."""
    s, D, kc = c.experts, c.n_embd, src.kc

    def name(template: str) -> str:
        return template.format(bid=bid)

    E, F = s.n_expert, s.n_ff_exp
    gate = src.host_stack(name(TensorNames.FFN_GATE_EXPS), (E, F, D))
    up = src.host_stack(name(TensorNames.FFN_UP_EXPS), (E, F, D))
    down = src.host_stack(name(TensorNames.FFN_DOWN_EXPS), (E, D, F))
    store = src.stored_experts(bid)
    if (
        c.expert_thresholds is not None
    ):  # CATS experts: every expert on the CPU (the pool computes dense ones)
        thresholds = torch.from_numpy(np.ascontiguousarray(c.expert_thresholds[bid]))
        experts = Experts(s, gate, up, down, kc, thresholds=thresholds, store=store)
    else:
        pool = src.pool_experts(bid, gate, up, down, E, s.act)
        experts = Experts(s, gate, up, down, kc, pool=pool, store=store)
    shared = None
    if s.n_ff_shexp:
        Fs = s.n_ff_shexp
        ffn = DenseFFN(
            FFNSpec(act="silu", gated=True),
            src.matrix(name(TensorNames.FFN_UP_SHEXP), (Fs, D)),
            src.matrix(name(TensorNames.FFN_GATE_SHEXP), (Fs, D)),
            src.matrix(name(TensorNames.FFN_DOWN_SHEXP), (D, Fs)),
            None,
            kc,
        )
        shared = SharedExpert(ffn, _shared_gate(src, name(TensorNames.FFN_GATE_INP_SHEXP), D))
    router = src.matrix(name(TensorNames.FFN_GATE_INP), (E, D))
    return MoEFFN(s, bid, router, experts, kc, shared)


def build_moe(config: ModelConfig, src: WeightSource) -> Transformer:
    """The MoE transformer from placed weights: pre-norm attention and a MoE FFN in every layer."""
    assert isinstance(config, MoEConfig)
    c, kc = config, src.kc
    embd = src.host_matrix(TensorNames.TOKEN_EMBD, (c.n_vocab, c.n_embd))
    layers = []
    for bid in range(c.n_layer):
        ffn = moe_ffn(c, bid, src)
        layers.append(
            Layer(
                attn_norm=Norm(c.norm, src.vector(TensorNames.ATTN_NORM.format(bid=bid), c.n_embd)),
                attn=decoder_attention(c, bid, src, c.attention_of(bid)),
                ffn_norm=Norm(c.norm, src.vector(TensorNames.FFN_NORM.format(bid=bid), c.n_embd)),
                ffn=ffn,
                device=src.layer_device(bid),
                pre_attn=ffn.route_early if c.experts.route_input == "layer" else None,
            )
        )
    output = src.matrix(TensorNames.OUTPUT, (c.n_vocab, c.n_embd)) if src.has(TensorNames.OUTPUT) else embd
    head = Head(Norm(c.norm, src.vector(TensorNames.OUTPUT_NORM, c.n_embd)), output, kc)

    def rope(bid: int, n_ctx: int) -> Rope | None:
        spec = c.attention_of(bid).rope
        return None if spec is None else Rope(spec, n_ctx)

    return Transformer(Embedding(embd, kc), layers, head, src.head_device(), rope_factory=rope)


__all__ = ["MoEConfig", "MoEVariant", "build_moe", "check_moe", "moe_config", "moe_tensor_table"]
