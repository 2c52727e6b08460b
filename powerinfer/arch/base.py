"""Shared parts of architecture modules: typed metadata access, the FFN builder and the Llama-layout decoder
(config, tensor table, build) that llama, qwen2 and qwen3 compose with their own variant."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from powerinfer import ops
from powerinfer.arch.metadata import MetadataView
from powerinfer.arch.rope_scaling import rope_spec
from powerinfer.errors import ConfigError, FormatError
from powerinfer.gguf.constants import Keys, TensorNames, bias_of
from powerinfer.gguf.reader import GGUFFile
from powerinfer.model.blocks import FFN, Attention, DenseFFN, Embedding, Head, Norm, Rope
from powerinfer.model.config import ModelConfig
from powerinfer.model.source import WeightSource
from powerinfer.model.sparse import PredictorSelector, SparseFFN, ThresholdFFN
from powerinfer.model.specs import AttentionSpec, FFNSpec, NormSpec
from powerinfer.model.transformer import Layer, Transformer
from powerinfer.printable import printable
from powerinfer.quant import check_weight_type

# Our converter records the FFN activation; GGUF itself has no key for it (spec 8.6).
ACTIVATION_KEY = "powerinfer.ffn_activation"
THRESHOLD_ENV = "LLAMA_SPARSE_PRED_THRESHOLD"


def n_vocab_of(metadata: dict[str, Any]) -> int:
    tokens = metadata.get(Keys.TOKENIZER_TOKENS)
    if tokens is None:
        raise ConfigError(f"missing required metadata key '{Keys.TOKENIZER_TOKENS}'")
    if not isinstance(tokens, list) or not tokens:
        raise ConfigError(f"metadata key '{Keys.TOKENIZER_TOKENS}' should be a non-empty array of strings")
    return len(tokens)


def ffn_activation(metadata: dict[str, Any], default: str) -> str:
    """The FFN activation our converter recorded, else the architecture's default."""
    act = metadata.get(ACTIVATION_KEY, default)
    if not isinstance(act, str):
        raise ConfigError(f"metadata key '{ACTIVATION_KEY}' should be a string")
    return act


def sparse_threshold(metadata: dict[str, Any]) -> float:
    """The predictor threshold: the file's, overridden by LLAMA_SPARSE_PRED_THRESHOLD as in the original
    (-inf: every neuron active, inf: none; NaN is refused)."""
    value = metadata.get(Keys.SPARSE_THRESHOLD, 0.0)
    threshold = MetadataView._cast(Keys.SPARSE_THRESHOLD, value, float, infinite=True)
    if os.environ.get(THRESHOLD_ENV):
        text = os.environ[THRESHOLD_ENV]
        try:
            threshold = float(text)
        except ValueError:
            raise ConfigError(f"{THRESHOLD_ENV}={printable(text)!r} is not a number") from None
        if math.isnan(threshold):
            raise ConfigError(f"{THRESHOLD_ENV}={printable(text)!r} is NaN")
    return threshold


SPARSE_METHODS = ("predictor", "cats", "teal")


def sparse_method(
    metadata: dict[str, Any], sparse: bool, n_layer: int, teal: bool = False
) -> tuple[str, tuple[float, ...]]:
    """How a sparse file selects neurons, and the per-layer thresholds of "cats" (`powerinfer sparsify`).

    PowerInfer's own files have no method key: "predictor". A "cats" file needs one finite threshold per layer; a
    "teal" file keeps its thresholds beside its transposed matrices (TensorNames.TEAL_MATRICES)."""
    if not sparse:
        return "predictor", ()
    method = metadata.get(Keys.SPARSITY_METHOD, "predictor")
    if not isinstance(method, str) or method not in SPARSE_METHODS:
        raise ConfigError(
            f"metadata key '{Keys.SPARSITY_METHOD}' should be one of {', '.join(SPARSE_METHODS)}, "
            f"got {printable(method)}"
        )
    if method == "teal" and not teal:
        raise ConfigError("TEAL files (sparsify --method teal) are built for Llama-layout models only")
    if method != "cats":
        return method, ()
    values = metadata.get(Keys.SPARSITY_THRESHOLDS)
    if isinstance(values, np.ndarray) and values.ndim == 1:  # numeric arrays are read as numpy arrays
        values = values.tolist()
    if not isinstance(values, list) or len(values) != n_layer:
        got = f"{len(values)} values" if isinstance(values, list) else type(values).__name__
        raise ConfigError(
            f"metadata key '{Keys.SPARSITY_THRESHOLDS}' should hold {n_layer} numbers, got {got}"
        )
    thresholds = tuple(MetadataView._cast(Keys.SPARSITY_THRESHOLDS, v, float) for v in values)
    return method, thresholds


@dataclass(frozen=True)
class TensorTable:
    """The tensors an architecture reads, with the shapes its config gives them.

    shapes: name -> shape; a str dimension is a size the config does not fix (a predictor's rank), bound by
    the first tensor that has it and checked against every other. required: names that must be present;
    one_of: groups of names of which at least one must be present (ffn_down or the transposed ffn_down_t).
    """

    shapes: dict[str, tuple[int | str, ...]]
    required: frozenset[str]
    one_of: tuple[tuple[str, ...], ...] = ()


def check_tensors(gguf: GGUFFile, config: ModelConfig, table: TensorTable) -> None:
    """Every tensor the model reads is present with the type and shape the config expects: one pass over the
    tensor table before anything sized by metadata is allocated (FormatError naming the first mismatch)."""
    tensors = gguf.tensors
    for name in sorted(table.required):
        if name not in tensors:
            raise FormatError(f"{gguf.path}: missing required tensor '{name}'")
    for group in table.one_of:
        if not any(name in tensors for name in group):
            raise FormatError(f"{gguf.path}: missing required tensor '{group[0]}' (or '{group[-1]}')")
    bound: dict[str, int] = {}
    for name, expected in table.shapes.items():
        info = tensors.get(name)
        if info is None:
            continue
        check_weight_type(info.ggml_type, name, f"{gguf.path}: ")
        actual = info.shape
        ok = len(actual) == len(expected)
        for have, want in zip(actual, expected, strict=False):
            if isinstance(want, str):
                want = bound.setdefault(want, have)
            ok = ok and have == want
        if not ok:
            shown = tuple(bound.get(d, d) if isinstance(d, str) else d for d in expected)
            raise FormatError(
                f"{gguf.path}: tensor '{name}' has shape {actual}, expected {shown} "
                f"(n_embd {config.n_embd}, n_ff {config.n_ff}, n_vocab {config.n_vocab})"
            )


def check_layer_count(gguf: GGUFFile, config: ModelConfig, per_layer: int) -> None:
    """block_count against the tensors that exist: a layer needs `per_layer` tensors, so a count the file cannot
    hold is refused before a per-layer table is built."""
    if config.n_layer > len(gguf.tensors) // per_layer:
        raise FormatError(
            f"{gguf.path}: block_count {config.n_layer} needs {per_layer} tensors per layer, the file has "
            f"{len(gguf.tensors)} tensors"
        )


def vector(src: WeightSource, template: str, n: int, bid: int | None = None) -> torch.Tensor:
    return src.vector(template.format(bid=bid), n)


def norm_with_bias(config: ModelConfig, src: WeightSource, template: str, bid: int | None = None) -> Norm:
    """The norm named by `template` (of layer bid) with its bias beside it (Falcon's and OPT's LayerNorms)."""
    name = template.format(bid=bid)
    return Norm(config.norm, src.vector(name, config.n_embd), src.vector(bias_of(name), config.n_embd))


def input_group(weights: list[Any]) -> ops.InputSparseWeight | None:
    """Matrices that read one input (q/k/v; gate/up) as one product, their outputs side by side, where they are
    input-sparse (a TEAL file's) with one threshold and type (ops.InputSparseWeight.concat); else None."""
    if not all(isinstance(w, ops.InputSparseWeight) for w in weights):
        return None
    return ops.InputSparseWeight.concat(weights)


def gate_up(src: WeightSource, bid: int, shape: tuple[int, int], host: bool) -> tuple[Any, Any]:
    """A layer's gate and up matrices, each (n_ff, n_embd): ffn_gate and ffn_up, or, in files without ffn_gate
    (Phi-3), the two halves of ffn_up (2 n_ff, n_embd), gate first; `host`: both from the memory-mapped file."""
    read = src.host_matrix if host else src.matrix
    gate_name, up_name = TensorNames.FFN_GATE.format(bid=bid), TensorNames.FFN_UP.format(bid=bid)
    if src.has(gate_name):
        return read(gate_name, shape), read(up_name, shape)
    n_ff, n_embd = shape
    fused = read(up_name, (2 * n_ff, n_embd))
    return ops.weight_rows(fused, 0, n_ff), ops.weight_rows(fused, n_ff, 2 * n_ff)


def gated_ffn(config: ModelConfig, bid: int, src: WeightSource) -> FFN:
    """A layer's FFN from the standard tensor names: sparse when the source asks for a selector.

    Gated down(act(gate u) * up u) or, when the spec is ungated (Falcon, OPT), down(act(up u + b_up)) + b_down
    with OPT's biases (`ffn_up.bias`, `ffn_down.bias` / `ffn_down_t.bias`) when the spec has them.
    PowerInfer files hold ffn_down_t (n_ff, n_embd) instead of ffn_down; predictors fc1 (r, n_embd), fc2 (n_ff, r)
    ("predictor"); "cats" files (`powerinfer sparsify`) thresholds on |act(gate)| instead: one per neuron
    (blk.N.ffn_act_threshold) or, in files without that tensor, the layer's one value for every neuron; with
    blk.N.ffn_out_threshold, a second stage on |act(gate) * up| per neuron.
    """
    c, kc = config, src.kc
    up_name = TensorNames.FFN_UP.format(bid=bid)
    down_name, down_t_name = TensorNames.FFN_DOWN.format(bid=bid), TensorNames.FFN_DOWN_T.format(bid=bid)
    shape = (c.n_ff, c.n_embd)
    gated, with_bias = c.ffn.gated, c.ffn.bias
    if src.sparsity.selector == "predictor":
        if src.stats is None:
            raise ConfigError("sparse FFNs need a statistics owner")
        fc1 = src.matrix(TensorNames.PRED_FC1.format(bid=bid))
        if fc1.shape[1] != c.n_embd:
            raise FormatError(
                f"predictor {TensorNames.PRED_FC1.format(bid=bid)} has shape {fc1.shape}, expected (r, {c.n_embd})"
            )
        fc2 = src.matrix(TensorNames.PRED_FC2.format(bid=bid), (c.n_ff, fc1.shape[0]))
        if gated:
            gate, up = gate_up(src, bid, shape, host=True)
        else:
            gate, up = None, src.host_matrix(up_name, shape)
        down_t = src.host_matrix(down_t_name, shape)
        biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if with_bias:
            biases = (
                src.vector(bias_of(up_name), c.n_ff).to("cpu"),
                src.vector(bias_of(down_t_name), c.n_embd).to("cpu"),
            )
        selector = PredictorSelector(fc1, fc2, c.sparse_threshold, kc)
        hot = src.hot_rows(bid, gate, up, down_t, biases[0])
        return SparseFFN(c.ffn, bid, selector, gate, up, down_t, hot, src.stats, kc, src.workspace, biases)
    if src.sparsity.selector == "cats":
        if src.stats is None:
            raise ConfigError("sparse FFNs need a statistics owner")
        gate, up = gate_up(src, bid, shape, host=True)
        down_t = src.host_matrix(down_t_name, shape)
        hot = src.hot_rows(bid, gate, up, down_t)
        thr_name = TensorNames.FFN_ACT_THRESHOLD.format(bid=bid)
        if src.has(thr_name):
            thresholds = src.vector(thr_name, c.n_ff).to("cpu")
        else:
            thresholds = torch.full((c.n_ff,), c.sparse_thresholds[bid], dtype=torch.float32)
        out_name = TensorNames.FFN_OUT_THRESHOLD.format(bid=bid)
        out = src.vector(out_name, c.n_ff).to("cpu") if src.has(out_name) else None
        return ThresholdFFN(c.ffn, bid, thresholds, gate, up, down_t, hot, src.stats, kc, src.workspace, out)
    if src.sparsity.selector not in ("none", "teal"):  # teal: the source gives input-sparse matrices
        raise ConfigError(f"unknown sparsity selector '{src.sparsity.selector}'")
    gate, up = gate_up(src, bid, shape, host=False) if gated else (None, src.matrix(up_name, shape))
    down_used = down_name if src.has(down_name) else down_t_name
    dense_biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if with_bias:
        dense_biases = (src.vector(bias_of(up_name), c.n_ff), src.vector(bias_of(down_used), c.n_embd))
    if down_used == down_name:
        down = src.matrix(down_name, (c.n_embd, c.n_ff))
        group = None if gate is None else input_group([gate, up])
        return DenseFFN(c.ffn, up, gate, down, None, kc, dense_biases, gate_up=group)
    return DenseFFN(c.ffn, up, gate, None, src.matrix(down_t_name, shape), kc, dense_biases)


# ---- the Llama-layout decoder (pre-norm blocks, attention, gated FFN) that llama, qwen2 and qwen3 share


def head_size(m: MetadataView, n_embd: int, n_head: int) -> int:
    """The head size: {arch}.attention.key_length when the file has it (Qwen3), else n_embd / n_head."""
    head_dim = m.optional(Keys.KEY_LENGTH, None, minimum=1)
    if head_dim is None:
        if n_embd % n_head:
            raise ConfigError(f"embedding length {n_embd} is not divisible by head count {n_head}")
        return n_embd // n_head
    value_dim = m.optional(Keys.VALUE_LENGTH, head_dim)
    if value_dim != head_dim:
        raise ConfigError(f"value length {value_dim} != key length {head_dim} (unsupported)")
    return int(head_dim)


@dataclass(frozen=True)
class DecoderVariant:
    """What sets a Llama-layout family apart: RoPE pairing, q/k/v biases, per-head QK-norm, ReLU(up)."""

    rope: str = "adjacent"  # "adjacent": q/k rows permuted by the converter (llama); "neox": as in HF
    bias: bool = False
    qk_norm: bool = False
    relu_up: bool = False


C = TypeVar("C", bound=ModelConfig)


def decoder_config(cls: type[C], metadata: dict[str, Any], sparse: bool, variant: DecoderVariant) -> C:
    """The config of a Llama-layout file from its `{arch}.*` keys; `sparse` is True for PWRI files.

    A `{arch}.attention.sliding_window` key makes every layer's attention local (Mistral as our converter writes
    it; 0 or no key: the whole context); a window on some layers only (a pattern) is refused.
    """
    arch = metadata[Keys.ARCHITECTURE]
    m = MetadataView(metadata, arch)
    n_embd = m.require(Keys.EMBEDDING_LENGTH, minimum=1)
    n_head = m.require(Keys.HEAD_COUNT, minimum=1)
    head_dim = head_size(m, n_embd, n_head)
    n_head_kv = m.optional(Keys.HEAD_COUNT_KV, n_head)
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise ConfigError(f"head count {n_head} is not a multiple of KV head count {n_head_kv}")
    eps = m.require(Keys.LAYERNORM_RMS_EPS, float, minimum=0.0)
    window = m.optional(Keys.SLIDING_WINDOW, None)
    pattern = metadata.get(Keys.SLIDING_WINDOW_PATTERN.format(arch=arch))
    if window and pattern is not None and not all(pattern):
        raise ConfigError(
            f"{arch}: a sliding window on some layers only is unsupported for this architecture"
        )
    attention = AttentionSpec(
        n_head,
        n_head_kv,
        head_dim,
        rope_spec(m, variant.rope, head_dim),
        bias=variant.bias,
        qk_norm=NormSpec("rms", eps) if variant.qk_norm else None,
        sliding_window=window or None,  # 0: no window
    )
    n_layer = m.require(Keys.BLOCK_COUNT, minimum=1)
    method, thresholds = sparse_method(metadata, sparse, n_layer, teal=True)
    # PowerInfer's own sparse files are ReLU models; sparsify records the activation it calibrated
    relu = (sparse and method == "predictor") or variant.relu_up
    return cls(
        arch=arch,
        n_vocab=n_vocab_of(metadata),
        n_ctx_train=m.require(Keys.CONTEXT_LENGTH, minimum=1),
        n_embd=n_embd,
        n_layer=n_layer,
        n_ff=m.require(Keys.FEED_FORWARD_LENGTH, minimum=1),
        attention=attention,
        ffn=FFNSpec(
            act=ffn_activation(metadata, "relu" if relu else "silu"), gated=True, relu_up=variant.relu_up
        ),
        norm=NormSpec("rms", eps),
        sparse=sparse,
        sparse_threshold=sparse_threshold(metadata),
        sparse_method=method,
        sparse_thresholds=thresholds,
    )


# tensors of one layer every Llama-layout file holds (norms, attention, gate and up)
DECODER_LAYER_TENSORS = 9


def decoder_tensor_table(config: ModelConfig) -> TensorTable:
    """Every tensor a Llama-layout or PowerInfer file may hold, with the shape the config gives it; PowerInfer
    files hold ffn_down_t (n_ff, n_embd) instead of ffn_down and per-layer predictors fc1 (r, n_embd) -> fc2
    (n_ff, r); q/k/v biases and q/k norms are required exactly when the attention spec has them."""
    c, a = config, config.attention
    shapes: dict[str, tuple[int | str, ...]] = {
        TensorNames.TOKEN_EMBD: (c.n_vocab, c.n_embd),
        TensorNames.OUTPUT: (c.n_vocab, c.n_embd),  # absent: tied to the embedding
        TensorNames.OUTPUT_NORM: (c.n_embd,),
    }
    required = {TensorNames.TOKEN_EMBD, TensorNames.OUTPUT_NORM}
    one_of = []
    for bid in range(c.n_layer):
        layer: dict[str, tuple[int | str, ...]] = {
            TensorNames.ATTN_NORM: (c.n_embd,),
            TensorNames.ATTN_Q: (a.n_embd_q, c.n_embd),
            TensorNames.ATTN_K: (a.n_embd_kv, c.n_embd),
            TensorNames.ATTN_V: (a.n_embd_kv, c.n_embd),
            TensorNames.ATTN_OUT: (c.n_embd, a.n_embd_q),
            TensorNames.FFN_NORM: (c.n_embd,),
            TensorNames.FFN_GATE: (c.n_ff, c.n_embd),
            TensorNames.FFN_UP: (c.n_ff, c.n_embd),
        }
        if a.bias:
            layer |= {
                TensorNames.ATTN_Q_BIAS: (a.n_embd_q,),
                TensorNames.ATTN_K_BIAS: (a.n_embd_kv,),
                TensorNames.ATTN_V_BIAS: (a.n_embd_kv,),
            }
        if a.qk_norm is not None:
            layer |= {TensorNames.ATTN_Q_NORM: (a.head_dim,), TensorNames.ATTN_K_NORM: (a.head_dim,)}
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
        if c.sparse and c.sparse_method == "teal":  # every TEAL matrix transposed, with its input threshold
            for template in TensorNames.TEAL_MATRICES:
                name = template.format(bid=bid)
                n_rows, n_cols = shapes[name]
                required.discard(name)
                t_name, thr_name = TensorNames.transposed(name), TensorNames.input_threshold(name)
                shapes |= {t_name: (n_cols, n_rows), thr_name: (1,)}
                required |= {t_name, thr_name}
            continue
        if c.sparse:
            needs = (TensorNames.FFN_DOWN_T, TensorNames.PRED_FC1, TensorNames.PRED_FC2)
            required |= {t.format(bid=bid) for t in needs[: 3 if c.sparse_method == "predictor" else 1]}
        else:
            one_of.append((TensorNames.FFN_DOWN.format(bid=bid), TensorNames.FFN_DOWN_T.format(bid=bid)))
    return TensorTable(shapes, frozenset(required), tuple(one_of))


def check_decoder(config: ModelConfig, gguf: GGUFFile) -> None:
    """The file holds every tensor a Llama-layout model of `config` reads, each of the expected type and shape."""
    check_layer_count(gguf, config, DECODER_LAYER_TENSORS)
    check_tensors(gguf, config, decoder_tensor_table(config))


def decoder_attention(
    config: ModelConfig, bid: int, src: WeightSource, spec: AttentionSpec | None = None
) -> Attention:
    """A layer's attention block with the parts its spec declares (biases, per-head or whole-projection QK-norm);
    `spec` is the layer's own where layers differ (RoPE, window), else the model's."""
    c, a = config, spec or config.attention

    def name(template: str) -> str:
        return template.format(bid=bid)

    biases: tuple[torch.Tensor | None, ...] = (None, None, None, None)
    if a.bias:
        biases = (
            src.vector(name(TensorNames.ATTN_Q_BIAS), a.n_embd_q),
            src.vector(name(TensorNames.ATTN_K_BIAS), a.n_embd_kv),
            src.vector(name(TensorNames.ATTN_V_BIAS), a.n_embd_kv),
            None,
        )
    q_norm = k_norm = None
    if a.qk_norm is not None:
        nq, nk = (a.n_embd_q, a.n_embd_kv) if a.qk_norm_whole else (a.head_dim, a.head_dim)
        q_norm = Norm(a.qk_norm, src.vector(name(TensorNames.ATTN_Q_NORM), nq))
        k_norm = Norm(a.qk_norm, src.vector(name(TensorNames.ATTN_K_NORM), nk))
    wq = src.matrix(name(TensorNames.ATTN_Q), (a.n_embd_q, c.n_embd))
    wk = src.matrix(name(TensorNames.ATTN_K), (a.n_embd_kv, c.n_embd))
    wv = src.matrix(name(TensorNames.ATTN_V), (a.n_embd_kv, c.n_embd))
    return Attention(
        a,
        wq,
        wk,
        wv,
        src.matrix(name(TensorNames.ATTN_OUT), (c.n_embd, a.n_embd_q)),
        src.kc,
        biases=biases,
        q_norm=q_norm,
        k_norm=k_norm,
        workspace=src.workspace,
        qkv_group=input_group([wq, wk, wv]),
    )


def build_decoder(config: ModelConfig, src: WeightSource) -> Transformer:
    """The Llama-layout transformer from placed weights: pre-norm attention and gated FFN in every layer."""
    c, kc = config, src.kc
    embd = src.host_matrix(TensorNames.TOKEN_EMBD, (c.n_vocab, c.n_embd))
    layers = [
        Layer(
            attn_norm=Norm(c.norm, src.vector(TensorNames.ATTN_NORM.format(bid=bid), c.n_embd)),
            attn=decoder_attention(c, bid, src),
            ffn_norm=Norm(c.norm, src.vector(TensorNames.FFN_NORM.format(bid=bid), c.n_embd)),
            ffn=gated_ffn(c, bid, src),
            device=src.layer_device(bid),
        )
        for bid in range(c.n_layer)
    ]
    output = src.matrix(TensorNames.OUTPUT, (c.n_vocab, c.n_embd)) if src.has(TensorNames.OUTPUT) else embd
    head = Head(Norm(c.norm, src.vector(TensorNames.OUTPUT_NORM, c.n_embd)), output, kc)
    rope = c.attention.rope
    return Transformer(
        Embedding(embd, kc),
        layers,
        head,
        src.head_device(),
        rope_factory=None if rope is None else (lambda bid, n_ctx: Rope(rope, n_ctx)),
    )
