"""Phi-3 (and Phi-4, which llama.cpp files as phi3): fused q/k/v, fused gate_up, NEOX RoPE, optional window.

llama.cpp's layout: blk.N.attn_qkv (n_embd_q + 2 n_embd_kv, n_embd) with q rows first, unpermuted (RoPE rotates
halves over the first rope.dimension_count dimensions of each head: partial in Phi-4-mini); blk.N.ffn_up holds
2 n_ff rows, the gate first, the up second, and there is no ffn_gate. `attention.sliding_window` > 0 limits every
layer to that many positions, as transformers does (llama.cpp currently ignores the window). Long-context files
(LongRoPE, with rope_factors_long/short tensors) are refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from powerinfer.arch import llama
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
from powerinfer.arch.rope_scaling import rope_spec
from powerinfer.errors import ConfigError, FormatError
from powerinfer.gguf.constants import Keys, TensorNames
from powerinfer.gguf.reader import GGUFFile
from powerinfer.model.blocks import Attention, Embedding, Head, Norm, Rope
from powerinfer.model.config import ModelConfig
from powerinfer.model.source import WeightSource
from powerinfer.model.specs import AttentionSpec, FFNSpec, NormSpec
from powerinfer.model.transformer import Layer, Transformer
from powerinfer.printable import printable

ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class Phi3Config(ModelConfig):
    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], sparse: bool) -> Phi3Config:
        """Build the config from GGUF metadata; `sparse` is True for PWRI files (`powerinfer sparsify`)."""
        arch = metadata[Keys.ARCHITECTURE]
        m = MetadataView(metadata, arch)
        n_embd = m.require(Keys.EMBEDDING_LENGTH, minimum=1)
        n_head = m.require(Keys.HEAD_COUNT, minimum=1)
        if n_embd % n_head:
            raise ConfigError(f"embedding length {n_embd} is not divisible by head count {n_head}")
        head_dim = n_embd // n_head
        n_rot = m.optional(Keys.ROPE_DIMENSION_COUNT, head_dim)
        scaling = m.optional(Keys.ROPE_SCALING_TYPE, "none", str)
        if scaling in ("su", "longrope"):
            raise ConfigError(
                f"unsupported rope scaling type '{printable(scaling)}' (LongRoPE/su: not supported)"
            )
        n_layer = m.require(Keys.BLOCK_COUNT, minimum=1)
        method, thresholds = sparse_method(metadata, sparse, n_layer)
        return cls(
            arch=arch,
            n_vocab=n_vocab_of(metadata),
            n_ctx_train=m.require(Keys.CONTEXT_LENGTH, minimum=1),
            n_embd=n_embd,
            n_layer=n_layer,
            n_ff=m.require(Keys.FEED_FORWARD_LENGTH, minimum=1),
            attention=AttentionSpec(
                n_head,
                m.optional(Keys.HEAD_COUNT_KV, n_head, minimum=1),
                head_dim,
                rope_spec(m, "neox", head_dim, n_rot),
                sliding_window=m.optional(Keys.SLIDING_WINDOW, 0) or None,
            ),
            ffn=FFNSpec(act=ffn_activation(metadata, "silu"), gated=True),
            norm=NormSpec("rms", m.require(Keys.LAYERNORM_RMS_EPS, float, minimum=0.0)),
            sparse=sparse,
            sparse_threshold=sparse_threshold(metadata),
            sparse_method=method,
            sparse_thresholds=thresholds,
        )


def tensor_table(config: ModelConfig, gguf: GGUFFile) -> TensorTable:
    """Llama's tensors with, where the file has them (llama.cpp's converter always writes them), attn_qkv for
    attn_q/k/v and ffn_up of 2 n_ff rows for ffn_gate and ffn_up."""
    base = llama.tensor_table(config)
    c, a = config, config.attention
    shapes, required = dict(base.shapes), set(base.required)
    for bid in range(c.n_layer):
        if TensorNames.ATTN_QKV.format(bid=bid) in gguf.tensors:
            names = (TensorNames.ATTN_Q, TensorNames.ATTN_K, TensorNames.ATTN_V)
            required -= {t.format(bid=bid) for t in names}
            shapes[TensorNames.ATTN_QKV.format(bid=bid)] = (a.n_embd_q + 2 * a.n_embd_kv, c.n_embd)
            required.add(TensorNames.ATTN_QKV.format(bid=bid))
        if TensorNames.FFN_GATE.format(bid=bid) not in gguf.tensors:
            required.discard(TensorNames.FFN_GATE.format(bid=bid))
            shapes[TensorNames.FFN_UP.format(bid=bid)] = (2 * c.n_ff, c.n_embd)
    return TensorTable(shapes, frozenset(required), base.one_of)


def check(config: ModelConfig, gguf: GGUFFile) -> None:
    """The file holds every tensor a Phi-3 model of `config` reads, each of the expected type and shape."""
    for name in ROPE_FACTORS:
        if name in gguf.tensors:
            raise FormatError(f"{gguf.path}: '{name}': LongRoPE (long-context Phi-3) is not supported")
    check_layer_count(gguf, config, 5)
    check_tensors(gguf, config, tensor_table(config, gguf))


def build(config: ModelConfig, src: WeightSource) -> Transformer:
    """The Phi-3 transformer from placed weights."""
    c, kc = config, src.kc
    a = c.attention
    embd = src.host_matrix(TensorNames.TOKEN_EMBD, (c.n_vocab, c.n_embd))
    layers = []
    for bid in range(c.n_layer):

        def name(template: str) -> str:
            return template.format(bid=bid)  # noqa: B023 - used within this iteration

        wo = src.matrix(name(TensorNames.ATTN_OUT), (c.n_embd, a.n_embd_q))
        if src.has(name(TensorNames.ATTN_QKV)):
            qkv = src.matrix(name(TensorNames.ATTN_QKV), (a.n_embd_q + 2 * a.n_embd_kv, c.n_embd))
            attn = Attention(
                dataclasses.replace(a, fused_qkv=True),
                None,
                None,
                None,
                wo,
                kc,
                wqkv=qkv,
                workspace=src.workspace,
            )
        else:
            q = src.matrix(name(TensorNames.ATTN_Q), (a.n_embd_q, c.n_embd))
            k = src.matrix(name(TensorNames.ATTN_K), (a.n_embd_kv, c.n_embd))
            v = src.matrix(name(TensorNames.ATTN_V), (a.n_embd_kv, c.n_embd))
            attn = Attention(a, q, k, v, wo, kc, workspace=src.workspace)
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
    assert rope is not None
    return Transformer(
        Embedding(embd, kc),
        layers,
        head,
        src.head_device(),
        rope_factory=lambda bid, n_ctx: Rope(rope, n_ctx),
    )
