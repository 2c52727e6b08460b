"""The blocks every architecture composes: norm, attention, dense FFN, embedding and head.

Blocks hold weights that the placement already put on their devices (`ops.QWeight` in the memory-mapped file,
`ops.DeviceWeight` on the pool device) and call `ops.*` only: no device or weight-format decisions here. A block's
output is on the device of its last weight; the transformer moves the residual where the plan says.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F

from powerinfer import ops
from powerinfer.errors import ConfigError
from powerinfer.model.batch import StepBatch
from powerinfer.model.specs import AttentionSpec, FFNSpec, NormSpec, RopeSpec
from powerinfer.model.workspace import Workspace

Weight = ops.QWeight | ops.DeviceWeight | ops.InputSparseWeight

# A batched decode step on the CPU runs each sequence's token as a lone decode token runs: the decode-attention
# kernel once per sequence (or, where it does not apply, the one-token path), never a padded SDPA call over the
# batch, whose sums round differently: a token's logits must not depend on the other sequences of its step. What it
# costs at many sequences (SmolLM2, positions ~10-35, ms per step kernel / padded SDPA: -t 1: 27.9/27.3 at 8
# sequences; -t 2: 17.2/16.3 at 8, 31.5/27.1 at 16) is the price of that. On a GPU pool the padded call stays.


class KVLayer(Protocol):
    """One layer's KV cache (runtime.kv_cache.KVCache.layer_view implements it)."""

    def slot(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of sequence seq: (n_ctx, H_kv, D) contiguous buffers."""
        ...

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every sequence: (n_seq, n_ctx, H_kv, D) contiguous buffers."""
        ...

    def update(
        self, seq: int, pos: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (T, H_kv, D) at pos..pos+T-1; return keys and values 0..pos+T."""
        ...

    def update_batch(
        self, seqs: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store one token per sequence; return keys, values (B, L, H_kv, D) and the visibility mask (B, L)."""
        ...


class Norm:
    """RMSNorm, RMSNorm with (1 + w), or LayerNorm with bias, over the last dimension."""

    def __init__(self, spec: NormSpec, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.spec = spec
        self.weight = weight + 1.0 if spec.kind == "rms_1p" else weight
        self.bias = bias
        self.shape = (int(weight.shape[0]),)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.kind == "layer":
            return F.layer_norm(x, self.shape, self.weight, self.bias, self.spec.eps)
        return ops.rms_norm(x, self.weight, self.spec.eps)


class Rope:
    """Rotation tables of one RoPE spec for a context of n_ctx positions, kept per device."""

    def __init__(self, spec: RopeSpec, n_ctx: int) -> None:
        self.spec = spec
        angles = torch.outer(torch.arange(n_ctx, dtype=torch.float64), rope_frequencies(spec))
        magnitude = torch.full_like(angles, spec.magnitude)
        table = torch.polar(magnitude, angles).to(torch.complex64)  # (n_ctx, n_rot/2)
        self.tables = {torch.device("cpu"): table}
        # the same rotations as (cos, sin) float pairs (n_ctx, n_rot/2, 2), for the decode-attention kernel
        self.pairs = torch.view_as_real(table).contiguous()

    def table(self, device: torch.device) -> torch.Tensor:
        if device not in self.tables:
            self.tables[device] = self.tables[torch.device("cpu")].to(device)
        return self.tables[device]

    def apply(self, x: torch.Tensor, positions: torch.Tensor | slice) -> torch.Tensor:
        """Rotate x (T, H, D) for its positions."""
        return self._rotate(x, self.table(x.device)[positions])

    def shift(self, x: torch.Tensor, delta: int) -> torch.Tensor:
        """Rotate x (T, H, D), already rotated for positions p, to positions p + delta (|delta| < n_ctx): a
        context shift re-rotates cached keys so, as llama.cpp does, without recomputing them."""
        rot = self.table(x.device)[abs(delta)][None]  # (1, n_rot/2)
        return self._rotate(x, rot.conj().resolve_conj() if delta < 0 else rot)

    def _rotate(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """x (T, H, D) rotated by rot (T or 1, n_rot/2) complex."""
        T, H, D = x.shape
        n_rot = self.spec.n_rot
        if self.spec.kind == "adjacent":
            part = x if n_rot == D else x[..., :n_rot]
            xc = torch.view_as_complex(part.reshape(T, H, n_rot // 2, 2))
            out = torch.view_as_real(xc * rot[:, None, :]).reshape(T, H, n_rot)
        else:  # neox: element i pairs with i + n_rot/2
            half = n_rot // 2
            cos, sin = rot.real[:, None, :], rot.imag[:, None, :]
            x1, x2 = x[..., :half], x[..., half:n_rot]
            out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return out if n_rot == D else torch.cat((out, x[..., n_rot:]), dim=-1)


def yarn_correction_dims(spec: RopeSpec) -> tuple[float, float]:
    """The pair range YaRN ramps over (llama.cpp's ggml_rope_yarn_corr_dims): pair i of n_rot turns
    n_ctx_orig / (2 pi base^(2i/n_rot)) times over the original context; the ramp runs from the pair turning
    beta_fast times (floored) to the one turning beta_slow times (ceiled), within [0, n_rot - 1]."""

    def dim(n_turns: float) -> float:
        return spec.n_rot * math.log(spec.n_ctx_orig / (n_turns * 2 * math.pi)) / (2 * math.log(spec.base))

    return max(0.0, math.floor(dim(spec.beta_fast))), min(spec.n_rot - 1.0, math.ceil(dim(spec.beta_slow)))


def rope_frequencies(spec: RopeSpec) -> torch.Tensor:
    """Angle per position of each rotated pair (n_rot/2,) float64, as llama.cpp's rope computes it: base^(-2i/n_rot)
    divided by the pair's frequency factor (llama3), scaled by 1/scale, and with YaRN mixed with the unscaled
    frequency by ext_factor times a ramp that is 1 for the fast pairs and 0 for the slow ones."""
    half = spec.n_rot // 2
    pair = torch.arange(half, dtype=torch.float64)
    extrapolated = spec.base ** (-2.0 * pair / spec.n_rot)
    if spec.freq_factors is not None:
        extrapolated = extrapolated / torch.tensor(spec.freq_factors, dtype=torch.float64)
    interpolated = extrapolated / spec.scale
    if not spec.ext_factor:
        return interpolated
    low, high = yarn_correction_dims(spec)
    ramp = (1.0 - ((pair - low) / max(0.001, high - low)).clamp(0.0, 1.0)) * spec.ext_factor
    return interpolated * (1.0 - ramp) + extrapolated * ramp


def identity_pairs(n_ctx: int, half: int) -> torch.Tensor:
    """(cos, sin) = (1, 0) pairs (n_ctx, half, 2): the rotation of a layer without RoPE, for the attention kernels."""
    pairs = torch.zeros(n_ctx, half, 2)
    pairs[..., 0] = 1.0
    return pairs


class Attention:
    """Causal self-attention with a KV cache: GQA, optional biases, QK-norm, RoPE variants, sliding window."""

    def __init__(
        self,
        spec: AttentionSpec,
        wq: Weight | None,
        wk: Weight | None,
        wv: Weight | None,
        wo: Weight,
        kc: ops.KernelContext,
        wqkv: Weight | None = None,
        biases: tuple[torch.Tensor | None, ...] = (None, None, None, None),  # q, k, v, out
        q_norm: Norm | None = None,
        k_norm: Norm | None = None,
        workspace: Workspace | None = None,
        qkv_group: Weight | None = None,
    ) -> None:
        self.spec = spec
        self.wq, self.wk, self.wv, self.wo, self.wqkv = wq, wk, wv, wo, wqkv
        # q, k and v by one product, outputs side by side (TEAL files: arch.base.input_group); None: three
        self.qkv_group = qkv_group
        self.bq, self.bk, self.bv, self.bo = biases
        self.q_norm, self.k_norm = q_norm, k_norm
        # the spec says which parts exist: a block given other parts than it declares is a build error
        if (spec.qk_norm is not None) != (q_norm is not None and k_norm is not None) or (q_norm is None) != (
            k_norm is None
        ):
            raise ConfigError(
                "attention: QK-norm needs both q and k norms, exactly when the spec declares it"
            )
        if (wqkv is not None) != spec.fused_qkv or (wqkv is None and None in (wq, wk, wv)):
            raise ConfigError(
                "attention: give wqkv exactly when the spec declares fused q/k/v, else wq, wk, wv"
            )
        if any(b is not None for b in biases[:3]) != spec.bias or (self.bo is not None) != spec.out_bias:
            raise ConfigError("attention: biases given do not match the spec's bias / out_bias")
        self.kc = kc
        self.workspace = workspace or Workspace()
        self.rope: Rope | None = None
        self._one_kernel = False
        self._neox = False
        self.rope_pairs: torch.Tensor | None = None
        # the decode-attention kernels apply (per-head QK-norm is applied before them, by the same RMSNorm)
        self.plain = (
            wqkv is None
            and all(b is None for b in biases)
            and (q_norm is None or (not spec.qk_norm_whole and q_norm.spec.kind != "layer"))
            and spec.scale is None
        )

    def setup(self, rope: Rope | None, n_ctx: int, no_rope: torch.Tensor | None = None) -> None:
        """RoPE tables for positions below n_ctx; no_rope: identity_pairs(n_ctx, head_dim) to share between the
        layers without RoPE (None: made here when needed)."""
        self.rope = rope
        # (cos, sin) pairs the kernels rotate by: the RoPE table's, or for a layer without RoPE (SmallThinker's
        # every fourth) the identity (1, 0): a * 1 - b * 0 and a * 0 + b * 1 give a and b back exactly
        self.rope_pairs = None
        if rope is not None:
            self.rope_pairs = rope.pairs
        elif self.spec.rope is None and self.plain:
            shape = (n_ctx, self.spec.head_dim // 2, 2)
            self.rope_pairs = (
                no_rope if no_rope is not None and no_rope.shape == shape else identity_pairs(*shape[:2])
            )
        # one token with full RoPE (adjacent pairs or NEOX) and nothing else: the fused decode-attention op applies
        # a sliding window at least as long as the context hides no key (keys at or below pos - window are out of
        # reach; SmallThinker's 4096): the kernels, which see every key, apply
        window = self.spec.sliding_window
        self._one_kernel = (
            self.plain
            and (window is None or n_ctx <= window)
            and self.rope_pairs is not None
            and (
                rope is None
                or (rope.spec.kind in ("adjacent", "neox") and rope.spec.n_rot == self.spec.head_dim)
            )
        )
        self._neox = rope is not None and rope.spec.kind == "neox"
        self.workspace.reserve("attn", ops.attn_scratch_bytes(n_ctx, self.spec.n_head))

    @property
    def one_token_kernel(self) -> bool:
        """One token's RoPE, KV write and attention are one op (after setup): a plain block with full RoPE or none
        and no sliding window within the context (the fused CPU op and a device span both compute it)."""
        return self._one_kernel

    @property
    def neox(self) -> bool:
        """RoPE rotates the pairs (i, i + D/2) (else (2i, 2i + 1))."""
        return self._neox

    def fuse(self, norm: Norm, n_ctx: int) -> ops.AttnBlock | None:
        """This block behind `norm` as one fused op for one token at positions below n_ctx (after setup); None
        where it has parts the fused op lacks or the kernels cannot run it."""
        s = self.spec
        if not self._one_kernel or norm.spec.kind == "layer" or self.wqkv is not None:
            return None
        assert self.wq is not None and self.wk is not None and self.wv is not None
        block = ops.attn_block(
            norm.weight,
            norm.spec.eps,
            self.wq,
            self.wk,
            self.wv,
            self.wo,
            s.n_head,
            s.n_head_kv,
            s.head_dim,
            self.kc,
            None if self.q_norm is None or self.k_norm is None else self._qk_norm_weights(),
            self._neox,
        )
        if block is not None:
            self.workspace.reserve("attn_block", block.scratch_bytes(n_ctx))
        return block

    def _qk_norm_weights(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        assert self.q_norm is not None and self.k_norm is not None
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.spec.eps

    def _qk_normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (T, H * D) and k (T, H_kv * D) with each head RMS-normed (QK-norm; unchanged without it)."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        s, T = self.spec, q.shape[0]
        q = self.q_norm(q.reshape(T, s.n_head, s.head_dim)).reshape(T, s.n_embd_q)
        return q, self.k_norm(k.reshape(T, s.n_head_kv, s.head_dim)).reshape(T, s.n_embd_kv)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (T, H * D), k and v (T, H_kv * D) of x (T, n_embd)."""
        kc = self.kc
        fused = self.wqkv if self.wqkv is not None else self.qkv_group
        if fused is not None:
            qkv = ops.linear(x, fused, kc)
            s = self.spec
            q, k, v = qkv.split((s.n_embd_q, s.n_embd_kv, s.n_embd_kv), dim=-1)
        else:
            assert self.wq is not None and self.wk is not None and self.wv is not None
            q, k, v = ops.linear(x, self.wq, kc), ops.linear(x, self.wk, kc), ops.linear(x, self.wv, kc)
        if self.bq is not None:
            q = q + self.bq
        if self.bk is not None:
            k = k + self.bk
        if self.bv is not None:
            v = v + self.bv
        return q, k, v

    def _heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | slice
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (T, H, D) and k (T, H_kv, D) normed and rotated for their positions, v (T, H_kv, D)."""
        s = self.spec
        T = q.shape[0]
        if s.qk_norm_whole and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over (T, H * D) before the split into heads
        q, k = q.reshape(T, s.n_head, s.head_dim), k.reshape(T, s.n_head_kv, s.head_dim)
        if not s.qk_norm_whole and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope.apply(q, positions), self.rope.apply(k, positions)
        return q, k, v.reshape(T, s.n_head_kv, s.head_dim)

    def _out(self, out: torch.Tensor) -> torch.Tensor:
        y = ops.linear(out, self.wo, self.kc)
        return y if self.bo is None else y + self.bo

    def __call__(self, x: torch.Tensor, batch: StepBatch, kv: KVLayer) -> torch.Tensor:
        """Attention output (N, n_embd) of the batch's tokens, on the device of wo."""
        q, k, v = self._project(x)
        if batch.kind == "run":
            seg = batch.segments[0]
            return self._out(self._run(q, k, v, seg.seq, seg.pos, kv))
        if batch.kind == "decode" and not q.is_cpu:  # on the CPU each token as a lone one (see the top)
            return self._out(self._decode(q, k, v, batch, kv))
        parts = [
            self._run(
                q[s.start : s.start + s.n],
                k[s.start : s.start + s.n],
                v[s.start : s.start + s.n],
                s.seq,
                s.pos,
                kv,
            )
            for s in batch.segments
        ]
        return self._out(torch.cat(parts))

    def _run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: int, pos: int, kv: KVLayer
    ) -> torch.Tensor:
        """T consecutive tokens of one sequence at pos..pos+T-1: (T, H * D)."""
        T = q.shape[0]
        s = self.spec
        pairs = self.rope_pairs
        if T == 1 and self._one_kernel:
            assert pairs is not None
            # one token: RoPE, the KV write and attention in one kernel call where the op has one
            scratch = self.workspace.get("attn")
            qn, kn = self._qk_normed(q, k)
            return ops.attend_one(
                qn, kn, v, pairs[pos], *kv.slot(seq), pos, self.kc, scratch=scratch, neox=self._neox
            )
        if self._one_kernel and pos + T <= ops.ATTN_KERNEL_MAX_POS:
            assert pairs is not None
            # several tokens: each as the one-token kernel computes it, so a token's output does not depend on
            # how its prompt was split into batches (the prompt cache, interactive turns and the server rely on it)
            qn, kn = self._qk_normed(q, k)
            out = ops.attn_prefill(
                qn, kn, v, pairs[pos : pos + T], *kv.slot(seq), pos, self.kc, neox=self._neox
            )
            if out is not None:
                return out
        q, k, v = self._heads(q, k, v, slice(pos, pos + T))
        keys, values = kv.update(seq, pos, k, v)  # (pos+T, H_kv, D)
        window = s.sliding_window
        if T == 1 and (window is None or pos < window):
            return ops.decode_attention(q, keys, values, s.scale)
        qh, kh, vh = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)  # (H, T, D)
        # query i sits at absolute position pos+i and sees keys 0..pos+i (and, with a window, > pos+i-window)
        mask = torch.ones(T, pos + T, dtype=torch.bool, device=q.device).tril(diagonal=pos)
        if window is not None:
            mask &= ~torch.ones_like(mask).tril(diagonal=pos - window)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True, scale=s.scale)
        return out.transpose(0, 1).reshape(T, s.n_embd_q)

    def _decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch, kv: KVLayer
    ) -> torch.Tensor:
        """One new token for each of B distinct sequences off the CPU, in one padded SDPA call: (B, H * D)."""
        s = self.spec
        B = q.shape[0]
        positions = batch.positions.to(q.device)
        q, k, v = self._heads(q, k, v, positions)
        keys, values, mask = kv.update_batch(batch.seq_ids, positions, k, v)  # (B, L, H_kv, D), (B, L)
        if s.sliding_window is not None:
            lo = positions[:, None] - s.sliding_window  # keys at or below p - window are out of reach
            mask = mask & (torch.arange(mask.shape[1], device=mask.device)[None, :] > lo)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # (B, H, 1, D)
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            enable_gqa=True,
            scale=s.scale,
        )  # (B, H, 1, D)
        return out.reshape(B, s.n_embd_q)


def fuse_teal_layer(
    attn_norm: Norm, attn: Attention, ffn_norm: Norm, ffn: object, n_ctx: int
) -> ops.TealLayer | None:
    """A TEAL layer (every matrix input-sparse, q/k/v and gate/up grouped: arch.base.input_group) behind RMSNorms
    as one fused op for one token at positions below n_ctx (after attn.setup); None where the layer has other parts
    (biases, QK-norm, a RoPE the kernels lack) or the kernels cannot run it."""
    isw = ops.InputSparseWeight
    s = attn.spec
    if (
        not attn._one_kernel
        or attn.q_norm is not None
        or attn_norm.spec.kind != "rms"
        or ffn_norm.spec.kind != "rms"
        or not isinstance(ffn, DenseFFN)
        or ffn.b_up is not None
        or ffn.b_down is not None
        or not isinstance(attn.qkv_group, isw)
        or not isinstance(attn.wo, isw)
        or not isinstance(ffn.gate_up, isw)
        or not isinstance(ffn.down, isw)
    ):
        return None
    layer = ops.teal_layer(
        (attn_norm.weight, attn_norm.spec.eps),
        (ffn_norm.weight, ffn_norm.spec.eps),
        attn.qkv_group,
        attn.wo,
        ffn.gate_up,
        ffn.down,
        s.n_head,
        s.n_head_kv,
        s.head_dim,
        ffn.spec.act,
        ffn.spec.relu_up,
        attn.kc,
        attn._neox,
    )
    if layer is not None:
        attn.workspace.reserve("teal_layer", layer.scratch_bytes(n_ctx))
        # in a decode stack (ops.decode_stack) the layer runs on the attention blocks' scratch
        attn.workspace.reserve("attn_block", layer.scratch_bytes(n_ctx))
    return layer


class FFN(Protocol):
    """A layer's FFN: x_norm (T, D) the normed input, x_residual the residual it is added to, batch the step's
    tokens and positions (None outside a model step)."""

    def __call__(
        self, x_norm: torch.Tensor, x_residual: torch.Tensor, batch: StepBatch | None = None
    ) -> torch.Tensor: ...


class DenseFFN:
    """Every neuron computed: down(act(gate x) * up x) (or down(act(up x)) ungated).

    Reads `ffn_down` or, in PowerInfer files, the transposed `ffn_down_t` (row j = output column of neuron j).
    """

    def __init__(
        self,
        spec: FFNSpec,
        up: Weight,
        gate: Weight | None,
        down: Weight | None,
        down_t: Weight | None,
        kc: ops.KernelContext,
        biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),  # up, down
        gate_up: Weight | None = None,
    ) -> None:
        self.spec = spec
        self.up, self.gate, self.down, self.down_t = up, gate, down, down_t
        # gate and up by one product, gate's outputs first (TEAL files: arch.base.input_group); None: two
        self.gate_up = gate_up if gate is not None else None
        self.b_up, self.b_down = biases
        self.kc = kc

    def fuse(self, norm: Norm) -> ops.FFNBlock | None:
        """This block behind `norm` as one fused op for one token; None where it has parts the fused op lacks
        (no gate, biases, ffn_down_t) or the kernels cannot run it."""
        if self.gate is None or self.down is None or self.b_up is not None or self.b_down is not None:
            return None
        if norm.spec.kind == "layer":
            return None
        spec = self.spec
        return ops.ffn_block(
            norm.weight, norm.spec.eps, self.gate, self.up, self.down, spec.act, spec.relu_up, self.kc
        )

    def hidden(self, x_norm: torch.Tensor) -> torch.Tensor:
        """The neurons' activations h (T, n_ff)."""
        kc, spec = self.kc, self.spec
        if self.gate_up is not None:
            g, u = ops.linear(x_norm, self.gate_up, kc).split(self.up.shape[0], dim=-1)
            if self.b_up is not None:
                u = u + self.b_up
            return ops.gated(g, u, spec.act, spec.relu_up)
        u = ops.linear(x_norm, self.up, kc)
        if self.b_up is not None:
            u = u + self.b_up
        if self.gate is None:
            return ops.act(spec.act, u)
        return ops.gated(ops.linear(x_norm, self.gate, kc), u, spec.act, spec.relu_up)

    def __call__(
        self, x_norm: torch.Tensor, x_residual: torch.Tensor, batch: StepBatch | None = None
    ) -> torch.Tensor:
        h = self.hidden(x_norm)
        if self.down is not None:
            y = ops.linear(h, self.down, self.kc)
        else:
            assert self.down_t is not None
            y = ops.rows_axpy(h, self.down_t, None, self.kc)
        return y if self.b_down is None else y + self.b_down


class Embedding:
    """Token rows of the embedding matrix, optionally scaled (Gemma: sqrt(n_embd)) and with learned positions
    (row position + position_offset of `positions`: OPT's table starts 2 rows in)."""

    def __init__(
        self,
        weight: ops.QWeight,
        kc: ops.KernelContext,
        scale: float | None = None,
        positions: ops.QWeight | None = None,
        position_offset: int = 0,
    ) -> None:
        self.weight, self.kc, self.scale, self.positions = weight, kc, scale, positions
        self.position_offset = position_offset

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        x = ops.get_rows(self.weight, batch.tokens, self.kc)  # (N, D)
        if self.scale is not None:
            x = x * self.scale
        if self.positions is not None:
            rows = batch.positions + self.position_offset if self.position_offset else batch.positions
            x = x + ops.get_rows(self.positions, rows, self.kc)
        return x


class Head:
    """Final norm and output projection."""

    def __init__(self, norm: Norm, output: Weight, kc: ops.KernelContext) -> None:
        self.norm, self.output, self.kc = norm, output, kc

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(self.norm(x).contiguous(), self.output, self.kc)
