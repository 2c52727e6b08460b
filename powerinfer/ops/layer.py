"""Fused decode blocks of one token (kernels/cpu/layer.c) and RMSNorm.

`attn_block` and `ffn_block` describe a layer's attention block (norm, q/k/v, RoPE, KV write, attention, output
projection, residual add) and its gated dense FFN block (norm, gate, up, activation, down, residual add) once, as
a C struct of weight pointers; each call then runs the whole block on one token in one kernel call and one
parallel region, updating the residual in place. They return None where the kernels do not apply (no kernels, a
weight on a device or of a type without a kernel kind), and the caller runs the blocks op by op: that path is the
reference, and the fused one gives its bits except the FFN activation (libm's instead of torch's).

`sparse_ffn_block` describes a layer's predictor-selected sparse FFN block the same way (norm, PowerInfer's
predictor on the residual, the predicted gate/up/down rows, residual add, the layer's counters): `predict_ffn`
behind `rms_norm`, in one call.

`cats_ffn_block` does the same for a CATS FFN block (norm, every gate row, the per-neuron thresholds, the active
up and down rows, residual add, the layer's counters): `cats_ffn` behind `rms_norm`, in one call, dense for a
sequence's first token.

`teal_layer` runs a whole layer of a TEAL file (sparsify --method teal) the same way: RMSNorm, q/k/v as one
input-sparse product, attention, o, residual add, RMSNorm, gate/up as one product, gating, down, residual add.

`decode_stack` chains the fused blocks of every layer of one sequence (attention with that sequence's cache rows,
then a dense, sparse or CATS FFN block) into one kernel call a token, with the bits of the blocks called one by one.

`rms_norm` is RMSNorm over the last dimension (the mean of squares accumulated in double).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from powerinfer.ops import library
from powerinfer.ops.activation import activation_code
from powerinfer.ops.context import KernelContext, default_context
from powerinfer.ops.kv_types import kv_dims, kv_type_of
from powerinfer.ops.library import check_status
from powerinfer.quant import K_QUANT_TYPES

if TYPE_CHECKING:
    from powerinfer.gguf.constants import GGMLType
    from powerinfer.ops.weights import DeviceWeight, InputSparseWeight, QWeight

__all__ = [
    "AttnBlock",
    "CATSFFNBlock",
    "DecodeStack",
    "FFNBlock",
    "SparseFFNBlock",
    "TealLayer",
    "attn_block",
    "cats_ffn_block",
    "decode_stack",
    "ffn_block",
    "rms_norm",
    "sparse_ffn_block",
    "teal_layer",
]

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


class _Mat(ctypes.Structure):  # pi_mat
    _fields_ = [
        ("w", _ptr),
        ("stride", _i64),
        ("n_rows", _i64),
        ("n_cols", _i64),
        ("kind", _i32),
        ("reserved", _i32),
    ]


class _AttnDesc(ctypes.Structure):  # pi_attn_block_desc
    _fields_ = [
        ("n_embd", _i64), ("n_head", _i64), ("n_head_kv", _i64), ("head_dim", _i64), ("eps", _f32), ("scale", _f32),
        ("norm", _ptr), ("wq", _Mat), ("wk", _Mat), ("wv", _Mat), ("wo", _Mat), ("q_norm", _ptr), ("k_norm", _ptr),
        ("qk_eps", _f32), ("rope_neox", _i32),
    ]  # fmt: skip


class _FFNDesc(ctypes.Structure):  # pi_ffn_block_desc
    _fields_ = [
        ("n_embd", _i64), ("n_ff", _i64), ("eps", _f32), ("act", _i32), ("relu_up", _i32), ("reserved", _i32),
        ("norm", _ptr), ("gate", _Mat), ("up", _Mat), ("down", _Mat),
    ]  # fmt: skip


class _SparseFFNDesc(ctypes.Structure):  # pi_sparse_ffn_block_desc
    _fields_ = [
        ("n_embd", _i64), ("n_ff", _i64), ("rank", _i64), ("eps", _f32), ("threshold", _f32), ("act", _i32),
        ("relu_up", _i32), ("norm", _ptr), ("fc1", _Mat), ("fc2", _Mat), ("gate", _Mat), ("up", _Mat),
        ("down_t", _Mat), ("tokens", _ptr), ("active", _ptr), ("predictor_seconds", _ptr),
    ]  # fmt: skip


class _CATSFFNDesc(ctypes.Structure):  # pi_cats_ffn_block_desc
    _fields_ = [
        ("n_embd", _i64), ("n_ff", _i64), ("eps", _f32), ("act", _i32), ("relu_up", _i32), ("reserved", _i32),
        ("norm", _ptr), ("thresholds", _ptr), ("out_thresholds", _ptr), ("gate", _Mat), ("up", _Mat),
        ("down_t", _Mat), ("tokens", _ptr), ("active", _ptr), ("up_read", _ptr),
    ]  # fmt: skip


class _TealDesc(ctypes.Structure):  # pi_teal_layer_desc
    _fields_ = [
        ("n_embd", _i64), ("n_head", _i64), ("n_head_kv", _i64), ("head_dim", _i64), ("n_ff", _i64),
        ("attn_eps", _f32), ("ffn_eps", _f32), ("scale", _f32), ("act", _i32), ("relu_up", _i32), ("rope_neox", _i32),
        ("attn_norm", _ptr), ("ffn_norm", _ptr), ("qkv_t", _Mat), ("o_t", _Mat), ("gate_up_t", _Mat),
        ("down_t", _Mat), ("t_qkv", _f32), ("t_o", _f32), ("t_gate_up", _f32), ("t_down", _f32),
        ("tokens", _ptr), ("bytes_read", _ptr),
    ]  # fmt: skip


def _mat(w: QWeight | DeviceWeight | None, kc: KernelContext) -> _Mat | None:
    """The kernel's description of a weight; None when the fused kernels cannot read it."""
    if w is None or w.on_device:
        return None
    kind = kc.kernels.ffn_kinds.get(w.ggml_type)
    if kind is None:
        return None
    n_rows, n_cols = w.shape
    return _Mat(w._raw_ptr, w._raw_stride, n_rows, n_cols, kind, 0)


def _norm_weight(weight: torch.Tensor, n: int) -> torch.Tensor | None:
    if weight.shape != (n,) or not weight.is_cpu:
        return None
    return weight.to(torch.float32).contiguous()


def _cache_fits(k: torch.Tensor, v: torch.Tensor, row: int) -> bool:
    """k and v: one sequence's cache rows of a block whose rows hold `row` = H_kv * D elements."""
    n_ctx, n_head_kv, head_dim = kv_dims(k)
    return kv_dims(v) == (n_ctx, n_head_kv, head_dim) and n_head_kv * head_dim == row


class AttnBlock:
    """A layer's attention block for one token: x += wo . attention(rope(wq n), rope(wk n), wv n), n = norm(x)."""

    def __init__(self, desc: _AttnDesc, keep: tuple[object, ...], kc: KernelContext) -> None:
        self.desc, self._keep = desc, keep  # keep: the tensors the struct points into
        self._desc_ref = ctypes.byref(desc)
        self.kc = kc
        self.n_embd, self.head_dim = desc.n_embd, desc.head_dim
        self.row = desc.n_head_kv * desc.head_dim

    def scratch_bytes(self, n_ctx: int) -> int:
        """Scratch one call needs at positions below n_ctx."""
        d = self.desc
        return int(
            library.load().attn_block_scratch_bytes(d.n_embd, d.n_head, d.n_head_kv, d.head_dim, n_ctx)
        )

    def __call__(
        self,
        x: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pos: int,
        rope_pairs: torch.Tensor,
        scratch: torch.Tensor,
    ) -> None:
        """x (1, n_embd) float32 contiguous CPU, updated in place; k_cache, v_cache (n_ctx, H_kv, D) contiguous, of
        any cache type (ops.kv_types), row pos written; rope_pairs (n_positions, D / 2, 2) the (cos, sin) table;
        scratch of scratch_bytes(n_ctx)."""
        type_k, type_v = kv_type_of(k_cache), kv_type_of(v_cache)
        n_ctx = k_cache.shape[0]
        if (
            x.numel() != self.n_embd
            or x.dtype is not torch.float32
            or type_k is None
            or type_v is None
            or not _cache_fits(k_cache, v_cache, self.row)
            or not (x.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous())
            or not 0 <= pos < rope_pairs.shape[0]
            or rope_pairs[0].numel() != self.head_dim
        ):
            raise ValueError("attn_block: x, the caches or the RoPE table do not match the block")
        kc = self.kc
        status = self._kernel()(  # type: ignore[operator]
            self._desc_ref, x.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), type_k.ggml_type,
            type_v.ggml_type, n_ctx, pos, rope_pairs.data_ptr() + pos * self.head_dim * 4, scratch.data_ptr(), scratch.numel(),
            kc.act_precision == "q8", kc.threads_now, kc.level,
        )  # fmt: skip
        if status:
            name = type(self).__name__
            check_status(status, name, scratch.numel(), self.scratch_bytes(n_ctx), f"{name}.scratch_bytes")

    def _kernel(self) -> object:
        return self.kc.kernels.attn_block


class TealLayer(AttnBlock):
    """A TEAL layer for one token (pi_teal_layer): x += attention, then x += FFN, every matrix an input-sparse
    transposed product; the bits of the layer op by op. Called as AttnBlock is."""

    def scratch_bytes(self, n_ctx: int) -> int:
        d = self.desc
        return int(
            library.load().teal_layer_scratch_bytes(
                d.n_embd, d.n_head, d.n_head_kv, d.head_dim, d.n_ff, n_ctx
            )
        )

    def _kernel(self) -> object:
        return self.kc.kernels.teal_layer


class _FFNBlockBase:
    """What the one-token FFN blocks share: their C descriptor (kept alive with the tensors it points into), the
    kernel context, and the check of the residual row they update in place."""

    def __init__(self, desc: ctypes.Structure, keep: tuple[object, ...], kc: KernelContext) -> None:
        self.desc, self._keep = desc, keep
        self._desc_ref = ctypes.byref(desc)
        self.kc = kc
        self.n_embd = int(desc.n_embd)

    def _check_x(self, x: torch.Tensor, op: str) -> None:
        if x.numel() != self.n_embd or x.dtype is not torch.float32 or not x.is_contiguous():
            raise ValueError(f"{op}: x does not match the block")


class FFNBlock(_FFNBlockBase):
    """A layer's gated dense FFN block for one token: x += down . (act(gate n) * up n), n = norm(x)."""

    def scratch_bytes(self) -> int:
        return int(library.load().ffn_block_scratch_bytes(self.desc.n_embd, self.desc.n_ff))

    def __call__(self, x: torch.Tensor, scratch: torch.Tensor, first: bool = False) -> None:
        """x (1, n_embd) float32 contiguous CPU, updated in place; scratch of scratch_bytes(); `first` (the token
        opens its sequence) changes nothing: every neuron is computed anyway."""
        self._check_x(x, "ffn_block")
        kc = self.kc
        status = kc.kernels.ffn_block(
            self._desc_ref, x.data_ptr(), scratch.data_ptr(), scratch.numel(), kc.act_precision == "q8",
            kc.threads_now, kc.level,
        )  # fmt: skip
        if status:
            check_status(status, "ffn_block", scratch.numel(), self.scratch_bytes(), "FFNBlock.scratch_bytes")


def attn_block(
    norm: torch.Tensor,
    eps: float,
    wq: QWeight | DeviceWeight,
    wk: QWeight | DeviceWeight,
    wv: QWeight | DeviceWeight,
    wo: QWeight | DeviceWeight,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    kc: KernelContext | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    neox: bool = False,
) -> AttnBlock | None:
    """The fused attention block of these weights (RMSNorm weight `norm`, no biases, full RoPE on adjacent pairs or
    with `neox` on the pairs (i, i + head_dim / 2), scale 1 / sqrt(head_dim)); qk_norm: the RMSNorm weights (head_dim,)
    of every q and k head before RoPE and their eps. None where the kernels cannot run it."""
    kc = kc or default_context()
    if kc.kernels.attn_block is None:
        return None
    mats = [_mat(w, kc) for w in (wq, wk, wv, wo)]
    n_embd = wo.shape[0]
    weight = _norm_weight(norm, n_embd)
    n_q, n_kv = n_head * head_dim, n_head_kv * head_dim
    if any(m is None for m in mats) or weight is None:
        return None
    shapes = [(m.n_rows, m.n_cols) for m in mats if m is not None]
    if shapes != [(n_q, n_embd), (n_kv, n_embd), (n_kv, n_embd), (n_embd, n_q)] or head_dim % 2:
        return None
    qn = kn = None
    qk_eps = 0.0
    if qk_norm is not None:
        qn, kn = _norm_weight(qk_norm[0], head_dim), _norm_weight(qk_norm[1], head_dim)
        qk_eps = qk_norm[2]
        if qn is None or kn is None:
            return None
    desc = _AttnDesc(
        n_embd, n_head, n_head_kv, head_dim, eps, head_dim**-0.5, weight.data_ptr(), *mats,
        None if qn is None else qn.data_ptr(), None if kn is None else kn.data_ptr(), qk_eps, int(neox),
    )  # fmt: skip
    return AttnBlock(desc, (weight, wq, wk, wv, wo, qn, kn), kc)


def teal_layer(
    attn_norm: tuple[torch.Tensor, float],
    ffn_norm: tuple[torch.Tensor, float],
    qkv: InputSparseWeight,
    wo: InputSparseWeight,
    gate_up: InputSparseWeight,
    down: InputSparseWeight,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    act: str,
    relu_up: bool,
    kc: KernelContext | None = None,
    neox: bool = False,
) -> TealLayer | None:
    """A TEAL layer as one kernel call a token: RMSNorms (weight, eps) before attention and the FFN, q/k/v and gate/up
    as grouped input-sparse products (ops.InputSparseWeight.concat), o and down input-sparse, full RoPE (adjacent
    pairs, or NEOX), scale 1 / sqrt(head_dim), no biases or QK-norm. None where the kernels cannot run it."""
    kc = kc or default_context()
    if kc.kernels.teal_layer is None:
        return None
    mats = [_mat(w.w_t, kc) for w in (qkv, wo, gate_up, down)]
    n_embd, n_ff = wo.shape[0], down.shape[1]
    norms = [_norm_weight(attn_norm[0], n_embd), _norm_weight(ffn_norm[0], n_embd)]
    n_q, n_kv = n_head * head_dim, n_head_kv * head_dim
    if any(m is None for m in mats) or any(n is None for n in norms) or head_dim % 2:
        return None
    shapes = [(m.n_rows, m.n_cols) for m in mats if m is not None]
    if shapes != [(n_embd, n_q + 2 * n_kv), (n_q, n_embd), (n_embd, 2 * n_ff), (n_ff, n_embd)]:
        return None
    an, fn = norms
    assert an is not None and fn is not None
    # the layer's counters (qkv's meter: the layer's tokens and the bytes of every product's rows), else none
    meter = qkv.meter
    tokens = None if meter is None else meter.tokens.ctypes.data
    bytes_read = None if meter is None else meter.bytes_read.ctypes.data
    desc = _TealDesc(
        n_embd, n_head, n_head_kv, head_dim, n_ff, attn_norm[1], ffn_norm[1], head_dim**-0.5, activation_code(act),
        int(relu_up), int(neox), an.data_ptr(), fn.data_ptr(), *mats, qkv.threshold, wo.threshold,
        gate_up.threshold, down.threshold, tokens, bytes_read,
    )  # fmt: skip
    return TealLayer(desc, (an, fn, qkv, wo, gate_up, down, meter), kc)


def ffn_block(
    norm: torch.Tensor,
    eps: float,
    gate: QWeight | DeviceWeight,
    up: QWeight | DeviceWeight,
    down: QWeight | DeviceWeight,
    act: str,
    relu_up: bool,
    kc: KernelContext | None = None,
) -> FFNBlock | None:
    """The fused gated FFN block of these weights (RMSNorm weight `norm`, no biases, down (n_embd, n_ff)); None where
    the kernels cannot run it."""
    kc = kc or default_context()
    if kc.kernels.ffn_block is None:
        return None
    mats = [_mat(w, kc) for w in (gate, up, down)]
    n_ff, n_embd = gate.shape
    weight = _norm_weight(norm, n_embd)
    if any(m is None for m in mats) or weight is None:
        return None
    shapes = [(m.n_rows, m.n_cols) for m in mats if m is not None]
    if shapes != [(n_ff, n_embd), (n_ff, n_embd), (n_embd, n_ff)]:
        return None
    desc = _FFNDesc(n_embd, n_ff, eps, activation_code(act), int(relu_up), 0, weight.data_ptr(), *mats)
    return FFNBlock(desc, (weight, gate, up, down), kc)


class SparseFFNBlock(_FFNBlockBase):
    """A layer's predictor-selected sparse FFN block for one token: x += predict_ffn(x, norm(x)), the layer's
    counters (tokens, active neurons, predictor seconds) updated by the kernel."""

    def scratch_bytes(self) -> int:
        d = self.desc
        return int(library.load().sparse_ffn_block_scratch_bytes(d.n_embd, d.n_ff, d.rank))

    def __call__(self, x: torch.Tensor, scratch: torch.Tensor) -> None:
        """x (1, n_embd) float32 contiguous CPU, updated in place; scratch of scratch_bytes()."""
        self._check_x(x, "sparse_ffn_block")
        kc = self.kc
        status = kc.kernels.sparse_ffn_block(
            self._desc_ref, x.data_ptr(), scratch.data_ptr(), scratch.numel(), kc.act_precision == "q8",
            kc.threads_now, kc.level,
        )  # fmt: skip
        if status:
            check_status(
                status,
                "sparse_ffn_block",
                scratch.numel(),
                self.scratch_bytes(),
                "SparseFFNBlock.scratch_bytes",
            )


def sparse_ffn_block(
    norm: torch.Tensor,
    eps: float,
    fc1: QWeight,
    fc2: QWeight,
    threshold: float,
    gate: QWeight,
    up: QWeight,
    down_t: QWeight,
    act: str,
    relu_up: bool,
    counters: tuple[np.ndarray, np.ndarray, np.ndarray],
    kc: KernelContext | None = None,
) -> SparseFFNBlock | None:
    """The fused sparse FFN block of these weights (RMSNorm weight `norm`, predictor fc1 (rank, n_embd) and fc2
    (n_ff, rank) with its threshold, gate / up / down_t (n_ff, n_embd), no biases); `counters`: one-element views
    (int64 tokens, int64 active neurons, float64 predictor seconds) the kernel adds each call's figures to. None
    where the kernels cannot run it (as `predict_ffn`: no kernel kind, a weight on a device, a K-quant fc1 in q8)."""
    kc = kc or default_context()
    if kc.kernels.sparse_ffn_block is None:
        return None
    if kc.act_precision == "q8" and fc1.ggml_type in K_QUANT_TYPES:
        return None
    mats = [_mat(w, kc) for w in (fc1, fc2, gate, up, down_t)]
    n_ff, n_embd = gate.shape
    rank = fc1.shape[0]
    weight = _norm_weight(norm, n_embd)
    if any(m is None for m in mats) or weight is None:
        return None
    shapes = [(m.n_rows, m.n_cols) for m in mats if m is not None]
    if shapes != [(rank, n_embd), (n_ff, rank), (n_ff, n_embd), (n_ff, n_embd), (n_ff, n_embd)]:
        return None
    tokens, active, seconds = counters
    if (tokens.dtype, active.dtype, seconds.dtype) != (np.int64, np.int64, np.float64):
        raise ValueError("sparse_ffn_block: counters must be int64, int64, float64")
    desc = _SparseFFNDesc(
        n_embd, n_ff, rank, eps, threshold, activation_code(act), int(relu_up), weight.data_ptr(), *mats,
        tokens.ctypes.data, active.ctypes.data, seconds.ctypes.data,
    )  # fmt: skip
    return SparseFFNBlock(desc, (weight, fc1, fc2, gate, up, down_t, counters), kc)


class CATSFFNBlock(_FFNBlockBase):
    """A layer's CATS FFN block for one token: x += cats_ffn(norm(x)), every neuron active when `dense`, the
    layer's counters (tokens, active neurons, up rows read) updated by the kernel."""

    def scratch_bytes(self) -> int:
        return int(library.load().cats_ffn_block_scratch_bytes(self.desc.n_embd, self.desc.n_ff))

    def __call__(self, x: torch.Tensor, scratch: torch.Tensor, dense: bool = False) -> None:
        """x (1, n_embd) float32 contiguous CPU, updated in place; scratch of scratch_bytes(); dense: the token
        opens its sequence (every neuron active)."""
        self._check_x(x, "cats_ffn_block")
        kc = self.kc
        status = kc.kernels.cats_ffn_block(
            self._desc_ref, x.data_ptr(), dense, scratch.data_ptr(), scratch.numel(), kc.act_precision == "q8",
            kc.threads_now, kc.level,
        )  # fmt: skip
        if status:
            check_status(
                status, "cats_ffn_block", scratch.numel(), self.scratch_bytes(), "CATSFFNBlock.scratch_bytes"
            )


def cats_ffn_block(
    norm: torch.Tensor,
    eps: float,
    thresholds: torch.Tensor,
    out_thresholds: torch.Tensor | None,
    gate: QWeight,
    up: QWeight,
    down_t: QWeight,
    act: str,
    relu_up: bool,
    counters: tuple[np.ndarray, np.ndarray, np.ndarray],
    kc: KernelContext | None = None,
) -> CATSFFNBlock | None:
    """The fused CATS FFN block of these weights (RMSNorm weight `norm`, per-neuron thresholds (n_ff,) float32 on
    |act(gate)| and optionally on |h| (the second stage), gate / up / down_t (n_ff, n_embd), no biases, every
    neuron on the CPU); `counters`: one-element int64 views (tokens, active neurons, up rows read) the kernel
    adds each call's figures to. None where the kernels cannot run it (no kernel kind, a weight on a device)."""
    kc = kc or default_context()
    if kc.kernels.cats_ffn_block is None:
        return None
    mats = [_mat(w, kc) for w in (gate, up, down_t)]
    n_ff, n_embd = gate.shape
    weight = _norm_weight(norm, n_embd)
    if any(m is None for m in mats) or weight is None:
        return None
    if [(m.n_rows, m.n_cols) for m in mats if m is not None] != [(n_ff, n_embd)] * 3:
        return None
    limits = [t for t in (thresholds, out_thresholds) if t is not None]
    if any(
        t.dtype is not torch.float32 or not t.is_cpu or t.shape != (n_ff,) or not t.is_contiguous()
        for t in limits
    ):
        raise ValueError("cats_ffn_block: thresholds must be (n_ff,) float32 contiguous CPU tensors")
    if any(c.dtype != np.int64 for c in counters):
        raise ValueError("cats_ffn_block: counters must be int64")
    tokens, active, up_read = counters
    desc = _CATSFFNDesc(
        n_embd, n_ff, eps, activation_code(act), int(relu_up), 0, weight.data_ptr(), thresholds.data_ptr(),
        None if out_thresholds is None else out_thresholds.data_ptr(), *mats, tokens.ctypes.data,
        active.ctypes.data, up_read.ctypes.data,
    )  # fmt: skip
    keep = (weight, thresholds, out_thresholds, gate, up, down_t, counters)
    return CATSFFNBlock(desc, keep, kc)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension (a new tensor); the C kernel for float32 CPU
    tensors, torch's rms_norm otherwise."""
    D = x.shape[-1]
    lib = library.load()
    if (
        lib is None
        or not x.is_cpu
        or x.dtype is not torch.float32
        or (
            weight is not None
            and (weight.dtype is not torch.float32 or not weight.is_cpu or weight.shape != (D,))
        )
        or D == 0
    ):
        return F.rms_norm(x, (D,), weight, eps)
    x2 = x.reshape(-1, D).contiguous()
    out = torch.empty(x2.shape, dtype=torch.float32)
    w_ptr = None
    if weight is not None:
        weight = weight.contiguous()
        w_ptr = weight.data_ptr()
    status = lib.rms_norm(x2.data_ptr(), x2.shape[0], D, x2.stride(0), w_ptr, eps, out.data_ptr(), D)
    if status:
        check_status(status, "rms_norm")
    return out.view(x.shape)


class _StackLayer(ctypes.Structure):  # pi_stack_layer
    _fields_ = [
        ("attn", _ptr), ("k_cache", _ptr), ("v_cache", _ptr), ("type_k", _i32), ("type_v", _i32), ("n_ctx", _i64),
        ("rope", _ptr), ("n_positions", _i64), ("ffn_kind", _i32), ("reserved", _i32), ("ffn", _ptr),
    ]  # fmt: skip


class _StackMatmuls(ctypes.Structure):  # pi_stack_matmuls: a dense layer's pi_matmul_<type> functions
    _fields_ = [(name, _ptr) for name in ("q", "k", "v", "o", "gate", "up", "down")]


# the FFN blocks pi_decode_stack chains (its STACK_FFN_* codes); a whole TEAL layer is its STACK_TEAL
_STACK_FFN_KINDS: dict[type, int] = {FFNBlock: 0, SparseFFNBlock: 1, CATSFFNBlock: 2}
_STACK_TEAL = 3


class DecodeStack:
    """Every layer of one sequence for one token in one kernel call: per layer the attention block (this
    sequence's cache rows) then the FFN block, x updated in place; decode_stack builds it."""

    def __init__(
        self,
        layers: ctypes.Array[_StackLayer],
        keep: tuple[object, ...],
        kc: KernelContext,
        matmuls: ctypes.Array[_StackMatmuls] | None = None,
    ) -> None:
        lib = library.load()
        assert lib is not None
        self.layers, self.kc = layers, kc
        self._keep = keep  # the blocks and tensors the array points into
        self.n_layers = len(layers)
        self._call = lib.decode_stack
        self._matmuls = matmuls  # every layer dense: their products, for a few tokens at once (tokens())
        self._tokens_call = lib.decode_stack_tokens
        self._tokens_bytes = lib.decode_stack_tokens_scratch_bytes

    @property
    def takes_tokens(self) -> bool:
        """Whether tokens() runs: every layer an attention block and a dense FFN block."""
        return self._matmuls is not None

    def tokens(self, x: torch.Tensor, pos: int) -> None:
        """x (T, n_embd) float32 contiguous CPU, T tokens of this sequence at positions pos.., updated in place:
        each token the bits of __call__ at its position (pi_decode_stack_tokens), the products over all T."""
        assert self._matmuls is not None
        kc = self.kc
        n = x.shape[0]
        need = int(self._tokens_bytes(self.layers, self._matmuls, self.n_layers, n))
        scratch = torch.empty(max(need, 1), dtype=torch.uint8)
        status = self._tokens_call(
            self.layers, self._matmuls, self.n_layers, x.data_ptr(), n, pos, scratch.data_ptr(), scratch.numel(),
            kc.threads_now, kc.level,
        )  # fmt: skip
        if status:
            check_status(status, "decode_stack_tokens")

    def __call__(
        self, x: torch.Tensor, pos: int, attn_scratch: torch.Tensor, ffn_scratch: torch.Tensor | None
    ) -> None:
        """x (1, n_embd) float32 contiguous CPU at position pos, updated in place; the scratch buffers of the blocks
        (their largest scratch_bytes: the attention one also a TEAL layer's; None for FFN blocks where every layer
        is a TEAL layer)."""
        kc = self.kc
        ffn_ptr, ffn_bytes = (
            (None, 0) if ffn_scratch is None else (ffn_scratch.data_ptr(), ffn_scratch.numel())
        )
        status = self._call(
            self.layers, self.n_layers, x.data_ptr(), pos, attn_scratch.data_ptr(), attn_scratch.numel(),
            ffn_ptr, ffn_bytes, kc.act_precision == "q8", kc.threads_now, kc.level,
        )  # fmt: skip
        if status:
            check_status(status, "decode_stack")


def decode_stack(
    layers: list[tuple[AttnBlock, torch.Tensor, torch.Tensor, torch.Tensor, _FFNBlockBase | None]],
    kc: KernelContext,
) -> DecodeStack | None:
    """The stack of these layers, each (attention block, its k and v cache rows (n_ctx, H_kv, D) of any cache type,
    contiguous, for the sequence, its RoPE pairs table (n_positions, D / 2, 2), FFN block), or (TEAL layer, k, v,
    pairs, None): the whole layer as TealLayer computes it; all of context kc. None where the kernels cannot chain
    them (an FFN block of another kind, a block of another context, a cache or table that does not fit its block)."""
    lib = library.load()
    if lib is None or not layers:
        return None
    array = (_StackLayer * len(layers))()
    matmuls: ctypes.Array[_StackMatmuls] | None = (_StackMatmuls * len(layers))()
    by_kind = {kind: t for t, kind in kc.kernels.ffn_kinds.items()}
    for i, (attn, k, v, pairs, ffn) in enumerate(layers):
        if isinstance(attn, TealLayer):
            kind = _STACK_TEAL if ffn is None and attn.kc is kc else None
        else:
            kind = _STACK_FFN_KINDS.get(type(ffn))
        if kind is None or attn.kc is not kc:
            return None
        if ffn is not None and (ffn.kc is not kc or ffn.n_embd != attn.n_embd):
            return None
        type_k, type_v = kv_type_of(k), kv_type_of(v)
        if (
            type_k is None
            or type_v is None
            or not (
                k.is_cpu and v.is_cpu and k.is_contiguous() and v.is_contiguous() and pairs.is_contiguous()
            )
            or not _cache_fits(k, v, attn.row)
            or pairs.dtype is not torch.float32
            or pairs.numel() != pairs.shape[0] * attn.head_dim
        ):
            return None
        block = attn if ffn is None else ffn
        if matmuls is not None:
            matmuls = _dense_matmuls(matmuls, i, attn, ffn, by_kind, kc)
        array[i] = _StackLayer(
            ctypes.addressof(attn.desc), k.data_ptr(), v.data_ptr(), type_k.ggml_type, type_v.ggml_type, k.shape[0],
            pairs.data_ptr(), pairs.shape[0], kind, 0, ctypes.addressof(block.desc),
        )  # fmt: skip
    return DecodeStack(array, tuple(layers), kc, matmuls)


def _dense_matmuls(
    matmuls: ctypes.Array[_StackMatmuls],
    i: int,
    attn: AttnBlock,
    ffn: _FFNBlockBase | None,
    by_kind: dict[int, GGMLType],
    kc: KernelContext,
) -> ctypes.Array[_StackMatmuls] | None:
    """matmuls with entry i set to the products of a dense layer (attention block, FFN block), or None where the
    layer is another kind (then no stack of these layers takes several tokens)."""
    if type(attn) is not AttnBlock or type(ffn) is not FFNBlock:
        return None
    a, f = attn.desc, ffn.desc
    fns = []
    for m in (a.wq, a.wk, a.wv, a.wo, f.gate, f.up, f.down):
        gt = by_kind.get(m.kind)
        fn = kc.kernels.matmul.get(gt) if gt is not None else None
        if fn is None:
            return None
        fns.append(ctypes.cast(fn, _ptr).value)
    matmuls[i] = _StackMatmuls(*fns)
    return matmuls
