"""Llama (and the models that share its GGUF layout): config from metadata, the model composed of blocks.

Weights are used as stored in the GGUF file; q/k rows carry llama.cpp's RoPE permutation, so RoPE rotates
adjacent pairs (2i, 2i+1). PowerInfer files (PWRI) add per-layer predictors and ffn_down_t: with a predictor
selector the FFNs are built sparse, with the activation the file declares (ReLU for PowerInfer's models).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from powerinfer.arch.base import (
    MetadataView,
    TensorTable,
    check_layer_count,
    check_tensors,
    ffn_activation,
    gated_ffn,
    n_vocab_of,
    sparse_method,
    sparse_threshold,
)
from powerinfer.errors import ConfigError
from powerinfer.gguf.constants import Keys, TensorNames
from powerinfer.gguf.reader import GGUFFile
from powerinfer.model.blocks import Attention, Embedding, Head, Norm, Rope
from powerinfer.model.config import ModelConfig
from powerinfer.model.source import WeightSource
from powerinfer.model.specs import AttentionSpec, FFNSpec, NormSpec, RopeSpec
from powerinfer.model.transformer import Layer, Transformer
from powerinfer.printable import printable


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], sparse: bool, relu_up: bool = False) -> LlamaConfig:
        """Build the config from GGUF metadata; `sparse` is True for PWRI files, relu_up for bamboo."""
        arch = metadata[Keys.ARCHITECTURE]
        m = MetadataView(metadata, arch)
        n_embd = m.require(Keys.EMBEDDING_LENGTH, minimum=1)
        n_head = m.require(Keys.HEAD_COUNT, minimum=1)
        if n_embd % n_head:
            raise ConfigError(f"embedding length {n_embd} is not divisible by head count {n_head}")
        head_dim = n_embd // n_head
        rope_dim = m.optional(Keys.ROPE_DIMENSION_COUNT, head_dim)
        if rope_dim != head_dim:
            raise ConfigError(f"rope dimension {rope_dim} != head size {head_dim} (partial RoPE unsupported)")
        scaling = m.optional(Keys.ROPE_SCALING_TYPE, "none", str)
        if scaling not in ("none", "linear"):
            raise ConfigError(f"unsupported rope scaling type '{printable(scaling)}'")
        rope_scale = m.optional(Keys.ROPE_SCALING_FACTOR, 1.0, float) if scaling == "linear" else 1.0
        if rope_scale <= 0:
            raise ConfigError(f"rope scaling factor must be positive (got {rope_scale})")
        rope_base = m.optional(Keys.ROPE_FREQ_BASE, 10000.0, float)
        if rope_base <= 0:
            raise ConfigError(f"rope frequency base must be positive (got {rope_base})")
        rope = RopeSpec("adjacent", head_dim, rope_base, rope_scale)
        n_head_kv = m.optional(Keys.HEAD_COUNT_KV, n_head)
        if n_head_kv <= 0 or n_head % n_head_kv:
            raise ConfigError(f"head count {n_head} is not a multiple of KV head count {n_head_kv}")
        n_layer = m.require(Keys.BLOCK_COUNT, minimum=1)
        method, thresholds = sparse_method(metadata, sparse, n_layer)
        # PowerInfer's own sparse files are ReLU models; sparsify records the activation it calibrated
        act = ffn_activation(metadata, "relu" if (sparse and method == "predictor") or relu_up else "silu")
        return cls(
            arch=arch,
            n_vocab=n_vocab_of(metadata),
            n_ctx_train=m.require(Keys.CONTEXT_LENGTH, minimum=1),
            n_embd=n_embd,
            n_layer=n_layer,
            n_ff=m.require(Keys.FEED_FORWARD_LENGTH, minimum=1),
            attention=AttentionSpec(n_head, n_head_kv, head_dim, rope),
            ffn=FFNSpec(act=act, gated=True, relu_up=relu_up),
            norm=NormSpec("rms", m.require(Keys.LAYERNORM_RMS_EPS, float, minimum=0.0)),
            sparse=sparse,
            sparse_threshold=sparse_threshold(metadata),
            sparse_method=method,
            sparse_thresholds=thresholds,
        )


# tensors of one layer every Llama file holds (norms, attention, gate and up)
_LAYER_TENSORS = 9


def tensor_table(config: ModelConfig) -> TensorTable:
    """Every tensor a Llama or PowerInfer file may hold, with the shape the config gives it; PowerInfer files
    hold ffn_down_t (n_ff, n_embd) instead of ffn_down and per-layer predictors fc1 (r, n_embd) -> fc2 (n_ff, r)."""
    c, a = config, config.attention
    shapes: dict[str, tuple[int | str, ...]] = {
        TensorNames.TOKEN_EMBD: (c.n_vocab, c.n_embd),
        TensorNames.OUTPUT: (c.n_vocab, c.n_embd),  # absent: tied to the embedding
        TensorNames.OUTPUT_NORM: (c.n_embd,),
    }
    required = {TensorNames.TOKEN_EMBD, TensorNames.OUTPUT_NORM}
    one_of = []
    for bid in range(c.n_layer):
        layer = {
            TensorNames.ATTN_NORM: (c.n_embd,),
            TensorNames.ATTN_Q: (a.n_embd_q, c.n_embd),
            TensorNames.ATTN_K: (a.n_embd_kv, c.n_embd),
            TensorNames.ATTN_V: (a.n_embd_kv, c.n_embd),
            TensorNames.ATTN_OUT: (c.n_embd, a.n_embd_q),
            TensorNames.FFN_NORM: (c.n_embd,),
            TensorNames.FFN_GATE: (c.n_ff, c.n_embd),
            TensorNames.FFN_UP: (c.n_ff, c.n_embd),
        }
        required |= {t.format(bid=bid) for t in layer}
        layer |= {
            TensorNames.FFN_DOWN: (c.n_embd, c.n_ff),
            TensorNames.FFN_DOWN_T: (c.n_ff, c.n_embd),
            TensorNames.FFN_ACT_THRESHOLD: (c.n_ff,),
            TensorNames.FFN_OUT_THRESHOLD: (c.n_ff,),
            TensorNames.PRED_FC1: (f"rank.{bid}", c.n_embd),
            TensorNames.PRED_FC2: (c.n_ff, f"rank.{bid}"),
        }
        shapes |= {t.format(bid=bid): shape for t, shape in layer.items()}
        if c.sparse:
            needs = (TensorNames.FFN_DOWN_T, TensorNames.PRED_FC1, TensorNames.PRED_FC2)
            required |= {t.format(bid=bid) for t in needs[: 3 if c.sparse_method == "predictor" else 1]}
        else:
            one_of.append((TensorNames.FFN_DOWN.format(bid=bid), TensorNames.FFN_DOWN_T.format(bid=bid)))
    return TensorTable(shapes, frozenset(required), tuple(one_of))


def check(config: ModelConfig, gguf: GGUFFile) -> None:
    """The file holds every tensor a Llama model of `config` reads, each of the expected type and shape."""
    check_layer_count(gguf, config, _LAYER_TENSORS)
    check_tensors(gguf, config, tensor_table(config))


def build(config: ModelConfig, src: WeightSource) -> Transformer:
    """The Llama transformer from placed weights."""
    c, kc = config, src.kc
    a = c.attention
    embd = src.host_matrix(TensorNames.TOKEN_EMBD, (c.n_vocab, c.n_embd))
    layers = []
    for bid in range(c.n_layer):

        def name(template: str) -> str:
            return template.format(bid=bid)  # noqa: B023 - used within this iteration

        attn = Attention(
            a,
            src.matrix(name(TensorNames.ATTN_Q), (a.n_embd_q, c.n_embd)),
            src.matrix(name(TensorNames.ATTN_K), (a.n_embd_kv, c.n_embd)),
            src.matrix(name(TensorNames.ATTN_V), (a.n_embd_kv, c.n_embd)),
            src.matrix(name(TensorNames.ATTN_OUT), (c.n_embd, a.n_embd_q)),
            kc,
            workspace=src.workspace,
        )
        layers.append(
            Layer(
                attn_norm=Norm(c.norm, src.vector(name(TensorNames.ATTN_NORM), c.n_embd)),
                attn=attn,
                ffn_norm=Norm(c.norm, src.vector(name(TensorNames.FFN_NORM), c.n_embd)),
                ffn=gated_ffn(c, bid, src),
                device=src.layer_device(bid),
            )
        )
    output = src.matrix(TensorNames.OUTPUT, (c.n_vocab, c.n_embd)) if src.has(TensorNames.OUTPUT) else embd
    head = Head(Norm(c.norm, src.vector(TensorNames.OUTPUT_NORM, c.n_embd)), output, kc)
    rope = a.rope
    return Transformer(
        Embedding(embd, kc),
        layers,
        head,
        src.head_device(),
        rope_factory=None if rope is None else (lambda bid, n_ctx: Rope(rope, n_ctx)),
    )
