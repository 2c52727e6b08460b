"""Llama-family architecture (llama, bamboo): config, attention, FFN and the model forward.

Weights are used as stored in the GGUF file: matrices stay quantized in the memory map and are multiplied by
`ops.linear`; q/k rows carry llama.cpp's RoPE permutation, so RoPE rotates adjacent pairs (2i, 2i+1).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from powerinfer import ops, quant
from powerinfer.arch.base import MetadataView
from powerinfer.errors import ConfigError, FormatError
from powerinfer.gguf.constants import GGMLType, Keys, TensorNames
from powerinfer.gguf.reader import GGUFFile, TensorInfo
from powerinfer.ops import sparse as sparse_ops

# Our converter records the FFN activation; GGUF itself has no key for it (spec 8.6).
ACTIVATION_KEY = "powerinfer.ffn_activation"
THRESHOLD_ENV = "LLAMA_SPARSE_PRED_THRESHOLD"


@dataclass(frozen=True)
class LlamaConfig:
    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    rms_eps: float
    rope_base: float = 10000.0
    rope_scale: float = 1.0
    activation: str = "silu"  # "silu" or "relu"
    relu_up: bool = False  # bamboo: ReLU(gate) * ReLU(up)
    sparse: bool = False
    sparse_threshold: float = 0.0
    head_dim: int = field(init=False)
    n_embd_gqa: int = field(init=False)

    def __post_init__(self) -> None:
        if self.n_head <= 0 or self.n_embd % self.n_head:
            raise ConfigError(f"embedding length {self.n_embd} is not divisible by head count {self.n_head}")
        if self.n_head_kv <= 0 or self.n_head % self.n_head_kv:
            raise ConfigError(f"head count {self.n_head} is not a multiple of KV head count {self.n_head_kv}")
        if self.activation not in ("silu", "relu"):
            raise ConfigError(f"unsupported FFN activation '{self.activation}'")
        object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        object.__setattr__(self, "n_embd_gqa", self.head_dim * self.n_head_kv)

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], sparse: bool) -> LlamaConfig:
        """Build the config from GGUF metadata; `sparse` is True for PWRI files."""
        arch = metadata[Keys.ARCHITECTURE]
        m = MetadataView(metadata, arch)
        tokens = metadata.get(Keys.TOKENIZER_TOKENS)
        if tokens is None:
            raise ConfigError(f"missing required metadata key '{Keys.TOKENIZER_TOKENS}'")
        n_embd = m.require(Keys.EMBEDDING_LENGTH)
        n_head = m.require(Keys.HEAD_COUNT)
        rope_dim = m.optional(Keys.ROPE_DIMENSION_COUNT, n_embd // max(n_head, 1))
        if n_head and rope_dim != n_embd // n_head:
            raise ConfigError(
                f"rope dimension {rope_dim} != head size {n_embd // n_head} (partial RoPE unsupported)"
            )
        scaling = m.optional(Keys.ROPE_SCALING_TYPE, "none", str)
        rope_scale = m.optional(Keys.ROPE_SCALING_FACTOR, 1.0, float) if scaling == "linear" else 1.0
        if scaling not in ("none", "linear"):
            raise ConfigError(f"unsupported rope scaling type '{scaling}'")
        default_act = "relu" if sparse or arch == "bamboo" else "silu"
        activation = metadata.get(ACTIVATION_KEY, default_act)
        threshold = float(metadata.get(Keys.SPARSE_THRESHOLD, 0.0))
        if os.environ.get(THRESHOLD_ENV):
            try:
                threshold = float(os.environ[THRESHOLD_ENV])
            except ValueError:
                raise ConfigError(f"{THRESHOLD_ENV}={os.environ[THRESHOLD_ENV]!r} is not a number") from None
        return cls(
            arch=arch,
            n_vocab=len(tokens),
            n_ctx_train=m.require(Keys.CONTEXT_LENGTH),
            n_embd=n_embd,
            n_layer=m.require(Keys.BLOCK_COUNT),
            n_ff=m.require(Keys.FEED_FORWARD_LENGTH),
            n_head=n_head,
            n_head_kv=m.optional(Keys.HEAD_COUNT_KV, n_head),
            rms_eps=m.require(Keys.LAYERNORM_RMS_EPS, float),
            rope_base=m.optional(Keys.ROPE_FREQ_BASE, 10000.0, float),
            rope_scale=rope_scale,
            activation=activation,
            relu_up=arch == "bamboo",
            sparse=sparse,
            sparse_threshold=threshold,
        )


class KVStore(Protocol):
    """What attention needs from a KV cache (runtime.kv_cache.KVCache implements it)."""

    def update(
        self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor, seq: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def update_batch(
        self, layer: int, seqs: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class FFN(Protocol):
    def __call__(self, x_norm: torch.Tensor, x_residual: torch.Tensor) -> torch.Tensor: ...


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wq: ops.QWeight | ops.DeviceWeight
    wk: ops.QWeight | ops.DeviceWeight
    wv: ops.QWeight | ops.DeviceWeight
    wo: ops.QWeight | ops.DeviceWeight
    ffn_norm: torch.Tensor
    tensors: dict[str, TensorInfo]  # FFN and predictor tensors, handed to the FFN builder


class DenseFFN:
    """Every neuron computed: down(act(gate(x)) * up(x)); reads `ffn_down` or the transposed `ffn_down_t`."""

    def __init__(self, config: LlamaConfig, tensors: dict[str, TensorInfo], bid: int) -> None:
        self.gate = _qweight(tensors, TensorNames.FFN_GATE.format(bid=bid))
        self.up = _qweight(tensors, TensorNames.FFN_UP.format(bid=bid))
        down = TensorNames.FFN_DOWN.format(bid=bid)
        if down in tensors:
            self.down: ops.QWeight | None = _qweight(tensors, down)
            self.down_t: ops.QWeight | None = None
        else:
            # PWRI files store down transposed: (n_ff, n_embd), row j = output column of neuron j
            self.down = None
            self.down_t = _qweight(tensors, TensorNames.FFN_DOWN_T.format(bid=bid))
        self.relu = config.activation == "relu"
        self.relu_up = config.relu_up

    def __call__(self, x_norm: torch.Tensor, x_residual: torch.Tensor) -> torch.Tensor:
        g = ops.linear(x_norm, self.gate)
        u = ops.linear(x_norm, self.up)
        h = (F.relu(g) if self.relu else F.silu(g)) * (F.relu(u) if self.relu_up else u)
        if self.down is not None:
            return ops.linear(h, self.down)
        return sparse_ops.rows_axpy(h, self.down_t, None)


def _require(tensors: dict[str, TensorInfo], name: str) -> TensorInfo:
    if name not in tensors:
        raise FormatError(f"missing required tensor '{name}'")
    return tensors[name]


def _qweight(tensors: dict[str, TensorInfo], name: str) -> ops.QWeight:
    info = _require(tensors, name)
    if len(info.shape) != 2:
        raise FormatError(f"tensor '{name}' should be 2-D, has shape {info.shape}")
    return ops.QWeight.from_numpy(info.data, info.ggml_type, info.shape)


def _vector(tensors: dict[str, TensorInfo], name: str, n: int) -> torch.Tensor:
    info = _require(tensors, name)
    if info.shape != (n,):
        raise FormatError(f"tensor '{name}' has shape {info.shape}, expected ({n},)")
    return _dequantized(info).reshape(n)


def _dequantized(info: TensorInfo) -> torch.Tensor:
    """A float32 tensor of `info`: a zero-copy view for F32 data, a decoded copy otherwise."""
    if info.ggml_type == GGMLType.F32:
        return torch.from_numpy(info.data.view("<f4").reshape(info.shape))
    return torch.from_numpy(quant.dequantize(info.data, info.ggml_type, info.shape))


def rope_table(config: LlamaConfig, n_ctx: int) -> torch.Tensor:
    """Complex rotations e^{i*pos*theta_j}, shape (n_ctx, head_dim/2)."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, half, dtype=torch.float64) * 2 / config.head_dim))
    pos = torch.arange(n_ctx, dtype=torch.float64) / config.rope_scale
    angles = torch.outer(pos, inv_freq)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def apply_rope(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x (T, H, D) by rot (T, D/2)."""
    T, H, D = x.shape
    xc = torch.view_as_complex(x.reshape(T, H, D // 2, 2))
    return torch.view_as_real(xc * rot[:, None, :]).reshape(T, H, D)


# up to this position the decode-attention kernel beats the tensor ops (measured on 32 heads x 64, GQA 8:1, 2 threads:
# 40 vs 63 us at 128 positions, 67 vs 70 us at 256, 95 vs 81 us at 384: its per-row dot products end in a horizontal
# sum each, where torch runs a matrix product)
ATTN_KERNEL_MAX_POS = 256


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Attention of one query q (1, H, D) over keys/values (L, H_kv, D); returns (1, H * D).

    The H / H_kv query heads that share a KV head are one matrix product against it, on the cache's own layout:
    no copy of the keys per query head (SDPA's enable_gqa path costs 2.2 ms a layer at L = 512 here, this 74 us).
    """
    _, H, D = q.shape
    L, H_kv, _ = keys.shape
    qg = q.view(H_kv, H // H_kv, D)  # query heads grouped by their KV head
    scores = torch.matmul(qg, keys.permute(1, 2, 0)).mul_(D**-0.5)  # (H_kv, G, L)
    return torch.matmul(torch.softmax(scores, dim=-1), values.transpose(0, 1)).view(1, H * D)


class LlamaModel:
    """The Llama forward over memory-mapped weights. FFNs are pluggable per layer (dense or sparse)."""

    def __init__(self, config: LlamaConfig, gguf: GGUFFile) -> None:
        self.config = config
        t = gguf.tensors
        c = config
        self.tok_embd = _qweight(t, TensorNames.TOKEN_EMBD)
        if self.tok_embd.shape != (c.n_vocab, c.n_embd):
            raise FormatError(
                f"token_embd.weight has shape {self.tok_embd.shape}, expected {(c.n_vocab, c.n_embd)}"
            )
        self.output_norm = _vector(t, TensorNames.OUTPUT_NORM, c.n_embd)
        self.output = _qweight(t, TensorNames.OUTPUT) if TensorNames.OUTPUT in t else self.tok_embd
        self.layers: list[LayerWeights] = []
        for bid in range(c.n_layer):
            layer = LayerWeights(
                attn_norm=_vector(t, TensorNames.ATTN_NORM.format(bid=bid), c.n_embd),
                wq=_qweight(t, TensorNames.ATTN_Q.format(bid=bid)),
                wk=_qweight(t, TensorNames.ATTN_K.format(bid=bid)),
                wv=_qweight(t, TensorNames.ATTN_V.format(bid=bid)),
                wo=_qweight(t, TensorNames.ATTN_OUT.format(bid=bid)),
                ffn_norm=_vector(t, TensorNames.FFN_NORM.format(bid=bid), c.n_embd),
                tensors={k: v for k, v in t.items() if k.startswith(f"blk.{bid}.")},
            )
            expect = {
                "wq": (c.n_embd, c.n_embd),
                "wk": (c.n_embd_gqa, c.n_embd),
                "wv": (c.n_embd_gqa, c.n_embd),
                "wo": (c.n_embd, c.n_embd),
            }
            for attr, shape in expect.items():
                if getattr(layer, attr).shape != shape:
                    raise FormatError(
                        f"blk.{bid} {attr} has shape {getattr(layer, attr).shape}, expected {shape}"
                    )
            self.layers.append(layer)
        self.ffns: list[FFN] = [DenseFFN(c, layer.tensors, bid) for bid, layer in enumerate(self.layers)]
        self.rope: dict[torch.device, torch.Tensor] = {}
        self.rope_pairs = torch.zeros(0, config.head_dim // 2, 2)
        self.n_ctx = 0

    def setup(self, n_ctx: int) -> None:
        """Precompute position tables for a context of n_ctx tokens."""
        self.n_ctx = n_ctx
        self.rope = {torch.device("cpu"): rope_table(self.config, n_ctx)}
        # the same rotations as (cos, sin) float pairs, (n_ctx, head_dim/2, 2), for the decode-attention kernel
        self.rope_pairs = torch.view_as_real(self.rope[torch.device("cpu")]).contiguous()

    def _rope(self, device: torch.device) -> torch.Tensor:
        if device not in self.rope:
            self.rope[device] = self.rope[torch.device("cpu")].to(device)
        return self.rope[device]

    def _qkv(
        self, layer: LayerWeights, x: torch.Tensor, positions: torch.Tensor | slice, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projected and rotated q (T, H, D), k and v (T, H_kv, D) for tokens at `positions`."""
        return self._rotate(*self._project(layer, x), positions, device)

    @staticmethod
    def _project(layer: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (T, H * D), k and v (T, H_kv * D) of x (T, n_embd)."""
        return ops.linear(x, layer.wq), ops.linear(x, layer.wk), ops.linear(x, layer.wv)

    def _rotate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor | slice,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (T, H, D) and k (T, H_kv, D) rotated for their positions, v (T, H_kv, D)."""
        c = self.config
        T = q.shape[0]
        rot = self._rope(device)[positions]
        q = apply_rope(q.view(T, c.n_head, c.head_dim), rot)
        return q, apply_rope(k.view(T, c.n_head_kv, c.head_dim), rot), v.view(T, c.n_head_kv, c.head_dim)

    @staticmethod
    def _device(layer: LayerWeights, home: torch.device) -> torch.device:
        return layer.wq.device if isinstance(layer.wq, ops.DeviceWeight) else home

    def attention(
        self, layer: LayerWeights, bid: int, x: torch.Tensor, pos: int, kv: KVStore, seq: int = 0
    ) -> torch.Tensor:
        """Causal self-attention of T consecutive tokens of one sequence at positions pos..pos+T-1."""
        c = self.config
        T, home = x.shape[0], x.device
        device = self._device(layer, home)
        q, k, v = self._project(layer, x.to(device))
        if T == 1 and device.type == "cpu" and pos < ATTN_KERNEL_MAX_POS and hasattr(kv, "layer"):
            # one token: RoPE, the KV write and attention in one kernel call (None: the tensor ops below)
            out = ops.attn_decode(q, k, v, self.rope_pairs[pos], *kv.layer(bid, seq), pos)
            if out is not None:
                return ops.linear(out, layer.wo)
        q, k, v = self._rotate(q, k, v, slice(pos, pos + T), device)
        keys, values = kv.update(bid, pos, k, v, seq)  # (pos+T, H_kv, D)
        if T == 1:
            return ops.linear(decode_attention(q, keys, values), layer.wo).to(home)
        qh, kh, vh = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)  # (H, T, D)
        # query i sits at absolute position pos+i and sees keys 0..pos+i
        mask = torch.ones(T, pos + T, dtype=torch.bool, device=device).tril(diagonal=pos)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
        return ops.linear(out.transpose(0, 1).reshape(T, c.n_embd), layer.wo).to(home)

    def attention_batch(
        self,
        layer: LayerWeights,
        bid: int,
        x: torch.Tensor,
        positions: torch.Tensor,
        seqs: torch.Tensor,
        kv: KVStore,
    ) -> torch.Tensor:
        """One new token for each of B different sequences: token b at positions[b] of sequence seqs[b]."""
        c = self.config
        B, home = x.shape[0], x.device
        device = self._device(layer, home)
        q, k, v = self._qkv(layer, x.to(device), positions, device)
        keys, values, mask = kv.update_batch(bid, seqs, positions, k, v)  # (B, L, H_kv, D), mask (B, L)
        qh = q.unsqueeze(2)  # (B, H, 1, D)
        out = F.scaled_dot_product_attention(
            qh,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            enable_gqa=True,
        )  # (B, H, 1, D)
        return ops.linear(out.reshape(B, c.n_embd), layer.wo).to(home)

    def _layers(
        self, x: torch.Tensor, attend: Callable[[LayerWeights, int, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        c = self.config
        for bid, layer in enumerate(self.layers):
            h = F.rms_norm(x, (c.n_embd,), layer.attn_norm, c.rms_eps)
            x = x + attend(layer, bid, h)
            h = F.rms_norm(x, (c.n_embd,), layer.ffn_norm, c.rms_eps)
            x = x + self.ffns[bid](h, x)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = F.rms_norm(x, (self.config.n_embd,), self.output_norm, self.config.rms_eps)
        return ops.linear(x.contiguous(), self.output).to(x.device)

    def forward(
        self, tokens: torch.Tensor, pos: int, kv: KVStore, last_only: bool = False, seq: int = 0
    ) -> torch.Tensor:
        """Logits for `tokens` (T,) of sequence `seq` at positions pos..pos+T-1; (T, n_vocab) or (1, n_vocab)."""
        x = ops.get_rows(self.tok_embd, tokens)  # (T, D)
        x = self._layers(x, lambda layer, bid, h: self.attention(layer, bid, h, pos, kv, seq))
        return self._logits(x[-1:] if last_only else x)

    def forward_batch(
        self, tokens: torch.Tensor, positions: torch.Tensor, seqs: torch.Tensor, kv: KVStore
    ) -> torch.Tensor:
        """Logits (B, n_vocab) for one token of each of B distinct sequences (batched decode)."""
        x = ops.get_rows(self.tok_embd, tokens)  # (B, D)
        x = self._layers(x, lambda layer, bid, h: self.attention_batch(layer, bid, h, positions, seqs, kv))
        return self._logits(x)
