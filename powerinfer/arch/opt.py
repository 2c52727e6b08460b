"""OPT (PowerInfer's sparse OPT files and our dense ones): pre-LayerNorm blocks with biases everywhere.

Token embedding plus a learned position table looked up at position + 2 (OPT's offset: the table has
max_position_embeddings + 2 rows), no RoPE; q/k/v/output projections with biases; an ungated ReLU FFN with biases
(`ffn_up.bias`, and `ffn_down_t.bias` in PowerInfer files); final LayerNorm, output tied to the token embedding.
PowerInfer's predictors read the attention output plus residual, before the FFN norm.

LayerNorm epsilon: PowerInfer's converter writes none and its loader runs OPT with 0; we use
`opt.attention.layer_norm_epsilon` when a file has it, else transformers' 1e-5 (OPT's trained value).
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
from powerinfer.errors import ConfigError, FormatError
from powerinfer.gguf.constants import Keys, TensorNames, bias_of
from powerinfer.gguf.reader import GGUFFile
from powerinfer.model.blocks import Attention, Embedding, Head
from powerinfer.model.config import ModelConfig
from powerinfer.model.source import WeightSource
from powerinfer.model.specs import AttentionSpec, FFNSpec, NormSpec
from powerinfer.model.transformer import Layer, Transformer

POSITION_OFFSET = 2  # OPT's learned positions start at row 2
DEFAULT_EPS = 1e-5


@dataclass(frozen=True)
class OPTConfig(ModelConfig):
    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], sparse: bool) -> OPTConfig:
        m = MetadataView(metadata, "opt")
        n_embd = m.require(Keys.EMBEDDING_LENGTH, minimum=1)
        n_head = m.require(Keys.HEAD_COUNT, minimum=1)
        if n_embd % n_head:
            raise ConfigError(f"embedding length {n_embd} is not divisible by head count {n_head}")
        n_head_kv = m.optional(Keys.HEAD_COUNT_KV, n_head, minimum=1)
        n_layer = m.require(Keys.BLOCK_COUNT, minimum=1)
        method, thresholds = sparse_method(metadata, sparse, n_layer)
        if sparse and method != "predictor":
            raise ConfigError(
                "opt files are sparse through PowerInfer's predictors only (no gate to threshold)"
            )
        n_ctx = m.require(Keys.CONTEXT_LENGTH, minimum=POSITION_OFFSET + 1)
        return cls(
            arch="opt",
            n_vocab=n_vocab_of(metadata),
            # the position table's rows (context_length, 2050 in PowerInfer's files) less OPT's offset
            n_ctx_train=n_ctx - POSITION_OFFSET,
            n_embd=n_embd,
            n_layer=n_layer,
            n_ff=m.require(Keys.FEED_FORWARD_LENGTH, minimum=1),
            attention=AttentionSpec(n_head, n_head_kv, n_embd // n_head, None, bias=True, out_bias=True),
            ffn=FFNSpec(act="relu" if sparse else ffn_activation(metadata, "relu"), gated=False, bias=True),
            norm=NormSpec("layer", m.optional(Keys.LAYERNORM_EPS, DEFAULT_EPS, float, minimum=0.0)),
            sparse=sparse,
            sparse_threshold=sparse_threshold(metadata),
            sparse_method=method,
            sparse_thresholds=thresholds,
        )


_LAYER_TENSORS = 16  # norms, attention and ffn_up with their biases


def tensor_table(config: ModelConfig) -> TensorTable:
    c, a = config, config.attention
    shapes: dict[str, tuple[int | str, ...]] = {
        TensorNames.TOKEN_EMBD: (c.n_vocab, c.n_embd),
        TensorNames.POS_EMBD: ("positions", c.n_embd),
        TensorNames.OUTPUT: (c.n_vocab, c.n_embd),  # absent: tied to the embedding (PowerInfer's files)
        TensorNames.OUTPUT_NORM: (c.n_embd,),
        bias_of(TensorNames.OUTPUT_NORM): (c.n_embd,),
    }
    required = set(shapes) - {TensorNames.OUTPUT}
    one_of = []
    for bid in range(c.n_layer):
        layer: dict[str, tuple[int | str, ...]] = {}
        for name, rows, cols in (
            (TensorNames.ATTN_Q, a.n_embd_q, c.n_embd),
            (TensorNames.ATTN_K, a.n_embd_kv, c.n_embd),
            (TensorNames.ATTN_V, a.n_embd_kv, c.n_embd),
            (TensorNames.ATTN_OUT, c.n_embd, a.n_embd_q),
            (TensorNames.FFN_UP, c.n_ff, c.n_embd),
        ):
            layer |= {name: (rows, cols), bias_of(name): (rows,)}
        for name in (TensorNames.ATTN_NORM, TensorNames.FFN_NORM):
            layer |= {name: (c.n_embd,), bias_of(name): (c.n_embd,)}
        required |= {t.format(bid=bid) for t in layer}
        layer |= {
            TensorNames.FFN_DOWN: (c.n_embd, c.n_ff),
            bias_of(TensorNames.FFN_DOWN): (c.n_embd,),
            TensorNames.FFN_DOWN_T: (c.n_ff, c.n_embd),
            bias_of(TensorNames.FFN_DOWN_T): (c.n_embd,),
            TensorNames.PRED_FC1: (f"rank.{bid}", c.n_embd),
            TensorNames.PRED_FC2: (c.n_ff, f"rank.{bid}"),
        }
        shapes |= {t.format(bid=bid): shape for t, shape in layer.items()}
        if c.sparse:
            needs = (
                TensorNames.FFN_DOWN_T,
                bias_of(TensorNames.FFN_DOWN_T),
                TensorNames.PRED_FC1,
                TensorNames.PRED_FC2,
            )
            required |= {t.format(bid=bid) for t in needs}
        else:
            one_of.append((TensorNames.FFN_DOWN.format(bid=bid), TensorNames.FFN_DOWN_T.format(bid=bid)))
            one_of.append(
                (
                    bias_of(TensorNames.FFN_DOWN).format(bid=bid),
                    bias_of(TensorNames.FFN_DOWN_T).format(bid=bid),
                )
            )
    return TensorTable(shapes, frozenset(required), tuple(one_of))


def check(config: ModelConfig, gguf: GGUFFile) -> None:
    """The file holds every tensor an OPT model of `config` reads, each of the expected type and shape, and a
    position table covering the context."""
    check_layer_count(gguf, config, _LAYER_TENSORS)
    check_tensors(gguf, config, tensor_table(config))
    rows = gguf.tensors[TensorNames.POS_EMBD].shape[0]
    if rows < config.n_ctx_train + POSITION_OFFSET:
        raise FormatError(
            f"{gguf.path}: {TensorNames.POS_EMBD} has {rows} rows, the context length needs "
            f"{config.n_ctx_train + POSITION_OFFSET}"
        )


def build(config: ModelConfig, src: WeightSource) -> Transformer:
    c, kc, a = config, src.kc, config.attention
    embd = src.host_matrix(TensorNames.TOKEN_EMBD, (c.n_vocab, c.n_embd))
    positions = src.host_matrix(TensorNames.POS_EMBD)
    layers = []
    for bid in range(c.n_layer):

        def proj(template: str, rows: int, cols: int) -> tuple[Any, Any]:
            name = template.format(bid=bid)  # noqa: B023 - used within this iteration
            return src.matrix(name, (rows, cols)), src.vector(bias_of(name), rows)

        (wq, bq), (wk, bk) = (
            proj(TensorNames.ATTN_Q, a.n_embd_q, c.n_embd),
            proj(TensorNames.ATTN_K, a.n_embd_kv, c.n_embd),
        )
        (wv, bv), (wo, bo) = (
            proj(TensorNames.ATTN_V, a.n_embd_kv, c.n_embd),
            proj(TensorNames.ATTN_OUT, c.n_embd, a.n_embd_q),
        )
        attn = Attention(a, wq, wk, wv, wo, kc, biases=(bq, bk, bv, bo), workspace=src.workspace)
        layers.append(
            Layer(
                attn_norm=norm_with_bias(c, src, TensorNames.ATTN_NORM, bid),
                attn=attn,
                ffn_norm=norm_with_bias(c, src, TensorNames.FFN_NORM, bid),
                ffn=gated_ffn(c, bid, src),
                device=src.layer_device(bid),
            )
        )
    output = src.matrix(TensorNames.OUTPUT, (c.n_vocab, c.n_embd)) if src.has(TensorNames.OUTPUT) else embd
    head = Head(norm_with_bias(c, src, TensorNames.OUTPUT_NORM), output, kc)
    embedding = Embedding(embd, kc, positions=positions, position_offset=POSITION_OFFSET)
    return Transformer(embedding, layers, head, src.head_device())
