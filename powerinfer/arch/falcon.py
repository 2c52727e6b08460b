"""Falcon (PowerInfer's ReluFalcon and llama.cpp's falcon files): parallel attention and FFN on one residual.

Per layer: x + attention(ln_attn(x)) + FFN(ln_mlp(x)), LayerNorms with bias; one fused q/k/v matrix (rows: all
query heads, then the K heads, then the V heads, as both converters re-order them), NEOX RoPE over the whole head,
an ungated FFN. GGUF `attn_norm` is HF `ln_mlp` (the only norm of Falcon-7B-style files, where attention reads it
too) and `attn_norm_2` HF `ln_attn`. A PowerInfer (PWRI) file holds ffn_down_t and per-layer predictors that read
the layer input; its FFN is ReLU (PowerInfer's sparse graph asserts it). Dense files run the activation our
converter recorded, else GELU as llama.cpp's falcon graph does.
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
    norm_with_bias,
    sparse_method,
    sparse_threshold,
)
from powerinfer.arch.rope_scaling import rope_spec
from powerinfer.errors import ConfigError
from powerinfer.gguf.constants import Keys, TensorNames, bias_of
from powerinfer.gguf.reader import GGUFFile
from powerinfer.model.blocks import Attention, Embedding, Head, Rope
from powerinfer.model.config import ModelConfig
from powerinfer.model.source import WeightSource
from powerinfer.model.specs import AttentionSpec, FFNSpec, NormSpec
from powerinfer.model.transformer import Layer, Transformer


@dataclass(frozen=True)
class FalconConfig(ModelConfig):
    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], sparse: bool) -> FalconConfig:
        m = MetadataView(metadata, "falcon")
        n_embd = m.require(Keys.EMBEDDING_LENGTH, minimum=1)
        n_head = m.require(Keys.HEAD_COUNT, minimum=1)
        if n_embd % n_head:
            raise ConfigError(f"embedding length {n_embd} is not divisible by head count {n_head}")
        head_dim = n_embd // n_head
        n_head_kv = m.optional(Keys.HEAD_COUNT_KV, n_head, minimum=1)
        n_layer = m.require(Keys.BLOCK_COUNT, minimum=1)
        method, thresholds = sparse_method(metadata, sparse, n_layer)
        if sparse and method != "predictor":
            raise ConfigError(
                "falcon files are sparse through PowerInfer's predictors only (no gate to threshold)"
            )
        return cls(
            arch="falcon",
            n_vocab=n_vocab_of(metadata),
            n_ctx_train=m.require(Keys.CONTEXT_LENGTH, minimum=1),
            n_embd=n_embd,
            n_layer=n_layer,
            n_ff=m.require(Keys.FEED_FORWARD_LENGTH, minimum=1),
            attention=AttentionSpec(
                n_head, n_head_kv, head_dim, rope_spec(m, "neox", head_dim), fused_qkv=True
            ),
            ffn=FFNSpec(act="relu" if sparse else ffn_activation(metadata, "gelu"), gated=False),
            norm=NormSpec("layer", m.require(Keys.LAYERNORM_EPS, float, minimum=0.0)),
            sparse=sparse,
            sparse_threshold=sparse_threshold(metadata),
            sparse_method=method,
            sparse_thresholds=thresholds,
        )


_LAYER_TENSORS = 4  # attn_norm, attn_qkv, attn_output, ffn_up: what every layer holds at least


def tensor_table(config: ModelConfig) -> TensorTable:
    c, a = config, config.attention
    shapes: dict[str, tuple[int | str, ...]] = {
        TensorNames.TOKEN_EMBD: (c.n_vocab, c.n_embd),
        TensorNames.OUTPUT: (c.n_vocab, c.n_embd),  # absent: tied to the embedding
        TensorNames.OUTPUT_NORM: (c.n_embd,),
        bias_of(TensorNames.OUTPUT_NORM): (c.n_embd,),
    }
    required = set(shapes) - {TensorNames.OUTPUT}
    one_of = []
    for bid in range(c.n_layer):
        layer: dict[str, tuple[int | str, ...]] = {
            TensorNames.ATTN_NORM: (c.n_embd,),
            bias_of(TensorNames.ATTN_NORM): (c.n_embd,),
            TensorNames.ATTN_QKV: (a.n_embd_q + 2 * a.n_embd_kv, c.n_embd),
            TensorNames.ATTN_OUT: (c.n_embd, a.n_embd_q),
            TensorNames.FFN_UP: (c.n_ff, c.n_embd),
        }
        required |= {t.format(bid=bid) for t in layer}
        layer |= {
            TensorNames.ATTN_NORM_2: (c.n_embd,),
            bias_of(TensorNames.ATTN_NORM_2): (c.n_embd,),
            TensorNames.FFN_DOWN: (c.n_embd, c.n_ff),
            TensorNames.FFN_DOWN_T: (c.n_ff, c.n_embd),
            TensorNames.PRED_FC1: (f"rank.{bid}", c.n_embd),
            TensorNames.PRED_FC2: (c.n_ff, f"rank.{bid}"),
        }
        shapes |= {t.format(bid=bid): shape for t, shape in layer.items()}
        if c.sparse:
            needs = (TensorNames.FFN_DOWN_T, TensorNames.PRED_FC1, TensorNames.PRED_FC2)
            required |= {t.format(bid=bid) for t in needs}
        else:
            one_of.append((TensorNames.FFN_DOWN.format(bid=bid), TensorNames.FFN_DOWN_T.format(bid=bid)))
    return TensorTable(shapes, frozenset(required), tuple(one_of))


def check(config: ModelConfig, gguf: GGUFFile) -> None:
    """The file holds every tensor a Falcon model of `config` reads, each of the expected type and shape; a
    layer's second norm comes with its bias."""
    check_layer_count(gguf, config, _LAYER_TENSORS)
    check_tensors(gguf, config, tensor_table(config))


def build(config: ModelConfig, src: WeightSource) -> Transformer:
    c, kc, a = config, src.kc, config.attention
    embd = src.host_matrix(TensorNames.TOKEN_EMBD, (c.n_vocab, c.n_embd))
    layers = []
    for bid in range(c.n_layer):
        qkv = src.matrix(TensorNames.ATTN_QKV.format(bid=bid), (a.n_embd_q + 2 * a.n_embd_kv, c.n_embd))
        wo = src.matrix(TensorNames.ATTN_OUT.format(bid=bid), (c.n_embd, a.n_embd_q))
        attn = Attention(a, None, None, None, wo, kc, wqkv=qkv, workspace=src.workspace)
        mlp_norm = norm_with_bias(c, src, TensorNames.ATTN_NORM, bid)
        two_norms = src.has(TensorNames.ATTN_NORM_2.format(bid=bid))
        layers.append(
            Layer(
                attn_norm=norm_with_bias(c, src, TensorNames.ATTN_NORM_2, bid) if two_norms else mlp_norm,
                attn=attn,
                ffn_norm=mlp_norm if two_norms else None,
                ffn=gated_ffn(c, bid, src),
                device=src.layer_device(bid),
                parallel=True,
            )
        )
    output = src.matrix(TensorNames.OUTPUT, (c.n_vocab, c.n_embd)) if src.has(TensorNames.OUTPUT) else embd
    head = Head(norm_with_bias(c, src, TensorNames.OUTPUT_NORM), output, kc)
    rope = a.rope
    assert rope is not None
    return Transformer(
        Embedding(embd, kc), layers, head, src.head_device(), lambda bid, n_ctx: Rope(rope, n_ctx)
    )
