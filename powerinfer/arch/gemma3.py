"""Gemma 3 (text, dense): interleaved sliding-window and global attention, QK-norm, pre- and post-norms around
attention and FFN, GELU-tanh gated FFN, embedding scaled by sqrt(n_embd).

As llama.cpp reads these files: every 6th layer (il % 6 == 5) is global, the others see the last
`attention.sliding_window` positions with RoPE base 10000 and no scaling; global layers use rope.freq_base and
its linear scaling. RoPE rotates halves (NEOX), so q/k rows are stored unpermuted. The converter stored each
RMSNorm weight as (1 + w), so every norm here is a plain RMSNorm. q is scaled by 1/sqrt(key_length) (the 27B,
62 layers: 1/sqrt(n_embd / n_head)) unless the file gives `attention.scale`. The output matrix is the embedding.
"""

from __future__ import annotations

import dataclasses
import math
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
from powerinfer.errors import ConfigError
from powerinfer.gguf.constants import Keys, TensorNames
from powerinfer.gguf.reader import GGUFFile
from powerinfer.model.blocks import Attention, Embedding, Head, Norm, Rope
from powerinfer.model.config import ModelConfig
from powerinfer.model.source import WeightSource
from powerinfer.model.specs import AttentionSpec, FFNSpec, NormSpec, RopeSpec
from powerinfer.model.transformer import Layer, Transformer

SWA_PATTERN = 6  # llama.cpp: layers il % 6 < 5 slide, the 6th is global
SWA_ROPE_BASE = 10000.0
N_LAYER_27B = 62  # llama.cpp scales q of the 27B by 1/sqrt(n_embd / n_head)


@dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    # attention: the global layers' spec (no window); local layers use local_rope and the window
    sliding_window: int | None = None
    local_rope: RopeSpec | None = None

    def is_local(self, bid: int) -> bool:
        return self.sliding_window is not None and bid % SWA_PATTERN < SWA_PATTERN - 1

    def layer_attention(self, bid: int) -> AttentionSpec:
        """Layer bid's attention spec: the window and local RoPE on sliding layers."""
        if not self.is_local(bid):
            return self.attention
        return dataclasses.replace(self.attention, rope=self.local_rope, sliding_window=self.sliding_window)

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], sparse: bool) -> Gemma3Config:
        """Build the config from GGUF metadata; `sparse` is True for PWRI files (`powerinfer sparsify`)."""
        arch = metadata[Keys.ARCHITECTURE]
        m = MetadataView(metadata, arch)
        n_embd = m.require(Keys.EMBEDDING_LENGTH, minimum=1)
        n_head = m.require(Keys.HEAD_COUNT, minimum=1)
        n_head_kv = m.optional(Keys.HEAD_COUNT_KV, n_head, minimum=1)
        n_layer = m.require(Keys.BLOCK_COUNT, minimum=1)
        head_dim = m.optional(Keys.KEY_LENGTH, n_embd // n_head if n_embd % n_head == 0 else 0, minimum=1)
        if m.optional(Keys.VALUE_LENGTH, head_dim) != head_dim:
            raise ConfigError(
                f"value length {m.optional(Keys.VALUE_LENGTH, head_dim)} != key length {head_dim}"
            )
        if m.optional(Keys.FINAL_LOGIT_SOFTCAPPING, 0.0, float) != 0.0:
            key = Keys.FINAL_LOGIT_SOFTCAPPING.format(arch=arch)
            raise ConfigError(f"metadata key '{key}' is set: logit soft-capping is unsupported")
        window = m.optional(Keys.SLIDING_WINDOW, 0) or None  # 0 or absent: every layer global
        default_scale = (n_embd // n_head if n_layer == N_LAYER_27B else head_dim) ** -0.5
        scale = m.optional(Keys.ATTENTION_SCALE, default_scale, float)
        eps = m.require(Keys.LAYERNORM_RMS_EPS, float, minimum=0.0)
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
                n_head_kv,
                head_dim,
                rope_spec(m, "neox", head_dim, default_base=1_000_000.0),
                qk_norm=NormSpec("rms", eps),
                scale=scale,
            ),
            ffn=FFNSpec(act=ffn_activation(metadata, "gelu_tanh"), gated=True),
            norm=NormSpec("rms", eps),
            sparse=sparse,
            sparse_threshold=sparse_threshold(metadata),
            sparse_method=method,
            sparse_thresholds=thresholds,
            sliding_window=window,
            local_rope=RopeSpec("neox", head_dim, SWA_ROPE_BASE, 1.0),
        )


def tensor_table(config: ModelConfig) -> TensorTable:
    """Llama's tensors plus the QK-norms and the post-attention and post-FFN norms of every layer."""
    base = llama.tensor_table(config)
    c = config
    extra = {
        TensorNames.ATTN_Q_NORM: (c.head_dim,),
        TensorNames.ATTN_K_NORM: (c.head_dim,),
        TensorNames.ATTN_POST_NORM: (c.n_embd,),
        TensorNames.FFN_POST_NORM: (c.n_embd,),
    }
    shapes = {t.format(bid=bid): s for bid in range(c.n_layer) for t, s in extra.items()}
    return TensorTable(base.shapes | shapes, base.required | frozenset(shapes), base.one_of)


def check(config: ModelConfig, gguf: GGUFFile) -> None:
    """The file holds every tensor a Gemma 3 model of `config` reads, each of the expected type and shape."""
    check_layer_count(gguf, config, 12)
    check_tensors(gguf, config, tensor_table(config))


def build(config: ModelConfig, src: WeightSource) -> Transformer:
    """The Gemma 3 transformer from placed weights."""
    assert isinstance(config, Gemma3Config)
    c, kc = config, src.kc
    embd = src.host_matrix(TensorNames.TOKEN_EMBD, (c.n_vocab, c.n_embd))
    layers = []
    for bid in range(c.n_layer):

        def name(template: str) -> str:
            return template.format(bid=bid)  # noqa: B023 - used within this iteration

        a = c.layer_attention(bid)
        attn = Attention(
            a,
            src.matrix(name(TensorNames.ATTN_Q), (a.n_embd_q, c.n_embd)),
            src.matrix(name(TensorNames.ATTN_K), (a.n_embd_kv, c.n_embd)),
            src.matrix(name(TensorNames.ATTN_V), (a.n_embd_kv, c.n_embd)),
            src.matrix(name(TensorNames.ATTN_OUT), (c.n_embd, a.n_embd_q)),
            kc,
            q_norm=Norm(c.norm, src.vector(name(TensorNames.ATTN_Q_NORM), a.head_dim)),
            k_norm=Norm(c.norm, src.vector(name(TensorNames.ATTN_K_NORM), a.head_dim)),
            workspace=src.workspace,
        )
        layers.append(
            Layer(
                attn_norm=Norm(c.norm, src.vector(name(TensorNames.ATTN_NORM), c.n_embd)),
                attn=attn,
                ffn_norm=Norm(c.norm, src.vector(name(TensorNames.FFN_NORM), c.n_embd)),
                ffn=gated_ffn(c, bid, src),
                device=src.layer_device(bid),
                post_attn_norm=Norm(c.norm, src.vector(name(TensorNames.ATTN_POST_NORM), c.n_embd)),
                post_ffn_norm=Norm(c.norm, src.vector(name(TensorNames.FFN_POST_NORM), c.n_embd)),
            )
        )
    output = src.matrix(TensorNames.OUTPUT, (c.n_vocab, c.n_embd)) if src.has(TensorNames.OUTPUT) else embd
    head = Head(Norm(c.norm, src.vector(TensorNames.OUTPUT_NORM, c.n_embd)), output, kc)
    return Transformer(
        Embedding(embd, kc, scale=math.sqrt(c.n_embd)),
        layers,
        head,
        src.head_device(),
        rope_factory=lambda bid, n_ctx: Rope(c.layer_attention(bid).rope, n_ctx),  # type: ignore[arg-type]
    )
