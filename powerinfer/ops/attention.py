"""Decode attention: one query token of one sequence against its KV cache, as one kernel call or tensor ops.

`attn_decode` is the kernel (kernels/cpu/attention.c: RoPE, KV write, grouped-query softmax attention);
`decode_attention` and `apply_rope` are the tensor ops; `attend_one` picks between them the way the Llama
forward does for one token: the kernel while the cache is on the CPU and pos < ATTN_KERNEL_MAX_POS, else the
tensor ops. `attend_batch` is one token of each of several sequences, each as `attend_one` computes it.
"""

from __future__ import annotations

import torch

from powerinfer.ops import library
from powerinfer.ops.context import KernelContext, default_context
from powerinfer.ops.kv_types import kv_decode, kv_dims, kv_encode, kv_rotation, kv_type_of
from powerinfer.ops.library import check_status

__all__ = [
    "ATTN_KERNEL_MAX_POS",
    "apply_rope",
    "attend_batch",
    "attend_one",
    "attn_decode",
    "attn_prefill",
    "attn_scratch_bytes",
    "decode_attention",
]

# up to this position the decode-attention kernel runs (its scores scratch grows with the position). Measured, one
# thread, kernel / tensor ops (decode_attention): 9 heads x 64, GQA 3:1: 73 / 147 us at 256 positions, 162 / 373 at
# 1024, 555 / 1486 at 4096; 32 heads x 64, GQA 8:1: 136 / 162, 417 / 392, 1964 / 2100: it wins or ties at every
# length since its scores are computed 8 positions at a time with the key rows shared by the grouped heads.
ATTN_KERNEL_MAX_POS = 1 << 16


def _kernel_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention kernels' float32 contiguous inputs: q and k copies (the kernels rotate them in place)."""
    return (
        q.to(torch.float32).contiguous().clone(),
        k.to(torch.float32).contiguous().clone(),
        v.to(torch.float32).contiguous(),
        rope.to(torch.float32).contiguous(),
    )


def attn_scratch_bytes(n_ctx: int, n_head: int) -> int:
    """Bytes of scratch that serve `attn_decode` at every position below n_ctx with n_head query heads: allocate
    it once per engine. 0 when the kernels are not built."""
    lib = library.load()
    if lib is None:
        return 0
    if n_ctx <= 0 or n_head <= 0:
        raise ValueError(f"attn_scratch_bytes: sizes must be positive, got n_ctx={n_ctx}, n_head={n_head}")
    return int(lib.attn_decode_scratch_bytes(n_ctx, n_head))


def attn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: int,
    kc: KernelContext | None = None,
    *,
    scratch: torch.Tensor | None = None,
    neox: bool = False,
) -> torch.Tensor | None:
    """Attention of one token at position `pos` in one kernel call; None where the kernel does not apply.

    q (1, H * D), k and v (1, H_kv * D): the token's projections (float32, CPU); rope (D / 2, 2): cos and sin of
    each pair's rotation at pos; k_cache, v_cache: the sequence's cache of the layer (n_ctx, H_kv, D) of any
    cache type (ops.kv_types; contiguous, CPU), into which the rotated k and v are written at row pos, encoded in
    that type; the kernel reads the typed rows directly. Returns (1, H * D): per head,
    softmax(q . K[0..pos] / sqrt(D)) . V[0..pos] with the query heads grouped over the KV heads (GQA).
    scratch: a contiguous CPU tensor of at least `attn_scratch_bytes(n_ctx, H)` bytes, reused across calls
    (None: one is allocated for this call). neox: RoPE pairs elements i and i + D / 2 of a head (else 2i and
    2i + 1).
    """
    if kc is None:
        kc = default_context()
    kernel = kc.kernels.attn_decode
    type_k, type_v = kv_type_of(k_cache), kv_type_of(v_cache)
    if type_k is None or type_v is None:
        return None
    n_ctx, n_head_kv, head_dim = kv_dims(k_cache)
    if (
        kernel is None
        or not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu)
        or kv_dims(v_cache) != (n_ctx, n_head_kv, head_dim)
        or not (k_cache.is_contiguous() and v_cache.is_contiguous() and rope.is_contiguous())
        or not 0 <= pos < n_ctx
    ):
        return None
    n_head = q.numel() // head_dim
    if q.numel() != n_head * head_dim or k.numel() != n_head_kv * head_dim or v.numel() != k.numel():
        raise ValueError(
            f"attn_decode: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not match the cache "
            f"{tuple(k_cache.shape)}"
        )
    if rope.numel() != head_dim or rope.dtype is not torch.float32 or not rope.is_cpu:
        raise ValueError(f"attn_decode: rope must hold {head_dim // 2} float32 (cos, sin) pairs on the CPU")
    q = q.to(torch.float32).contiguous().clone()  # rotated in place by the kernel
    k = k.to(torch.float32).contiguous().clone()
    v = v.to(torch.float32).contiguous()
    if scratch is None:
        scratch = torch.empty(library.load().attn_decode_scratch_bytes(pos + 1, n_head), dtype=torch.uint8)
    elif not (scratch.is_cpu and scratch.is_contiguous()):
        raise ValueError("attn_decode: scratch must be a contiguous CPU tensor")
    scratch_bytes = scratch.numel() * scratch.element_size()
    out = torch.empty(1, n_head * head_dim, dtype=torch.float32)
    status = kernel(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), rope.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        type_k.ggml_type, type_v.ggml_type, n_ctx, pos, n_head, n_head_kv, head_dim, head_dim**-0.5, out.data_ptr(), scratch.data_ptr(),
        scratch_bytes, int(neox), kc.threads_now, kc.level,
    )  # fmt: skip
    if status:
        needed = library.load().attn_decode_scratch_bytes(pos + 1, n_head)
        check_status(status, "attn_decode", scratch_bytes, needed, "attn_scratch_bytes")
    return out


def attn_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: int,
    kc: KernelContext | None = None,
    neox: bool = False,
) -> torch.Tensor | None:
    """Attention of T consecutive tokens of one sequence at pos..pos+T-1 in one kernel call, each token exactly as
    `attn_decode` computes it at its position (so a token's output does not depend on how its prompt was split into
    batches); None where the kernel does not apply.

    q (T, H * D), k and v (T, H_kv * D): the projections; rope (T, D / 2, 2): each token's (cos, sin) pairs;
    k_cache, v_cache as `attn_decode` (any cache type), rows pos..pos+T-1 written; neox as `attn_decode`.
    Returns (T, H * D).
    """
    if kc is None:
        kc = default_context()
    kernel = kc.kernels.attn_prefill
    type_k, type_v = kv_type_of(k_cache), kv_type_of(v_cache)
    if type_k is None or type_v is None:
        return None
    n_ctx, n_head_kv, head_dim = kv_dims(k_cache)
    T = q.shape[0]
    if (
        kernel is None
        or not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu and rope.is_cpu)
        or kv_dims(v_cache) != (n_ctx, n_head_kv, head_dim)
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or not (0 <= pos and T >= 1 and pos + T <= n_ctx)
    ):
        return None
    n_head = q.shape[-1] // head_dim
    if (
        q.shape != (T, n_head * head_dim)
        or k.shape != (T, n_head_kv * head_dim)
        or v.shape != k.shape
        or rope.shape != (T, head_dim // 2, 2)
    ):
        raise ValueError(
            f"attn_prefill: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} and rope "
            f"{tuple(rope.shape)} do not match the cache {tuple(k_cache.shape)}"
        )
    q, k, v, rope = _kernel_inputs(q, k, v, rope)
    out = torch.empty(T, n_head * head_dim, dtype=torch.float32)
    status = kernel(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), rope.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        type_k.ggml_type, type_v.ggml_type, n_ctx, pos, T, n_head, n_head_kv, head_dim, head_dim**-0.5, out.data_ptr(), int(neox), kc.threads_now,
        kc.level,
    )  # fmt: skip
    if status:
        check_status(status, "attn_prefill")
    return out


def apply_rope(x: torch.Tensor, rot: torch.Tensor, neox: bool = False) -> torch.Tensor:
    """Rotate adjacent pairs of x (T, H, D) by rot (T, D/2) complex; neox: the pairs (i, i + D/2)."""
    T, H, D = x.shape
    if neox:
        cos, sin = rot.real[:, None, :], rot.imag[:, None, :]
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    xc = torch.view_as_complex(x.reshape(T, H, D // 2, 2))
    return torch.view_as_real(xc * rot[:, None, :]).reshape(T, H, D)


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Attention of one query q (1, H, D) over keys/values (L, H_kv, D); returns (1, H * D). scale: of the
    scores (None: 1 / sqrt(D)).

    The H / H_kv query heads that share a KV head are one matrix product against it, on the cache's own layout:
    no copy of the keys per query head (SDPA's enable_gqa path costs 2.2 ms a layer at L = 512 here, this 74 us).
    """
    _, H, D = q.shape
    L, H_kv, _ = keys.shape
    qg = q.view(H_kv, H // H_kv, D)  # query heads grouped by their KV head
    scores = torch.matmul(qg, keys.permute(1, 2, 0)).mul_(D**-0.5 if scale is None else scale)  # (H_kv, G, L)
    return torch.matmul(torch.softmax(scores, dim=-1), values.transpose(0, 1)).view(1, H * D)


def attend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope_pair: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: int,
    kc: KernelContext | None = None,
    *,
    scratch: torch.Tensor | None = None,
    neox: bool = False,
) -> torch.Tensor:
    """Attention of one token at `pos`, its rotated k and v written to row pos of the cache: (1, H * D) on q's
    device (neox: RoPE on the pairs (i, i + D/2)).

    q (1, H * D), k and v (1, H_kv * D): the token's projections; rope_pair (D / 2, 2): cos and sin of its
    rotation (the rows of the complex RoPE table as float pairs); k_cache, v_cache (n_ctx, H_kv, D) of any cache
    type (ops.kv_types). The kernel
    (`attn_decode`) when q is on the CPU and pos < ATTN_KERNEL_MAX_POS and it applies; else RoPE, the cache
    write and `decode_attention` as tensor ops.
    """
    if q.is_cpu and pos < ATTN_KERNEL_MAX_POS:
        out = attn_decode(q, k, v, rope_pair, k_cache, v_cache, pos, kc, scratch=scratch, neox=neox)
        if out is not None:
            return out
    _, n_head_kv, head_dim = kv_dims(k_cache)
    n_head = q.shape[-1] // head_dim
    rot = torch.view_as_complex(rope_pair).to(q.device)[None]  # (1, D/2)
    q = apply_rope(q.view(1, n_head, head_dim), rot, neox)
    k = apply_rope(k.view(1, n_head_kv, head_dim), rot, neox)
    type_k, type_v = kv_type_of(k_cache), kv_type_of(v_cache)
    if type_k is not None and type_k.dtype is torch.float32 and v_cache.dtype is torch.float32:
        k_cache[pos : pos + 1] = k
        v_cache[pos : pos + 1] = v.view(1, n_head_kv, head_dim)
        return decode_attention(q, k_cache[: pos + 1], v_cache[: pos + 1])
    assert type_k is not None and type_v is not None
    # a typed cache: the row encoded as the kernel encodes it (rotated: ops.kv_types), the rows in use decoded
    rot_k, rot_v = kv_rotation(type_k, head_dim, False), kv_rotation(type_v, head_dim, True)
    k_cache[pos : pos + 1] = kv_encode(k, type_k, rot_k)
    v_cache[pos : pos + 1] = kv_encode(v.view(1, n_head_kv, head_dim), type_v, rot_v)
    keys, values = kv_decode(k_cache[: pos + 1], rot_k), kv_decode(v_cache[: pos + 1], rot_v)
    return decode_attention(q, keys, values)


def attend_batch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqs: torch.Tensor,
    positions: torch.Tensor,
    kc: KernelContext | None = None,
    *,
    neox: bool = False,
) -> torch.Tensor:
    """One token of each of B sequences, row b of sequence seqs[b] at positions[b], each the same bits as
    `attend_one` gives it alone (its rotated k and v written to that sequence's row): (B, H * D) on the CPU.

    q (B, H * D), k and v (B, H_kv * D); rope (B, D / 2, 2): each token's (cos, sin) pairs; k_cache, v_cache
    (n_seq, n_ctx, H_kv, D) of any cache type, contiguous; seqs, positions (B,) int64 on the CPU. A row may repeat an
    earlier row's (sequence, position, q, k, v) (a padded batch): it writes the same row again. One kernel call
    (`attn_decode_batch` in kernels/cpu/attention.c) where it applies, else attend_one row by row.
    """
    if kc is None:
        kc = default_context()
    kernel = kc.kernels.attn_decode_batch
    type_k, type_v = kv_type_of(k_cache[0]), kv_type_of(v_cache[0])
    n_seq = k_cache.shape[0]
    n_ctx, n_head_kv, head_dim = kv_dims(k_cache[0])
    B = q.shape[0]
    n_head = q.shape[-1] // head_dim
    if (
        kernel is not None
        and type_k is not None
        and type_v is not None
        and q.is_cpu
        and k_cache.is_cpu
        and v_cache.is_cpu
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and kv_dims(v_cache[0]) == (n_ctx, n_head_kv, head_dim)
        and positions.dtype is torch.int64
        and seqs.dtype is torch.int64
    ):
        if q.shape != (B, n_head * head_dim) or k.shape != (B, n_head_kv * head_dim) or v.shape != k.shape:
            raise ValueError(
                f"attend_batch: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not match the "
                f"cache {tuple(k_cache.shape)}"
            )
        q, k, v, rope = _kernel_inputs(q, k, v, rope)
        seqs, positions = seqs.contiguous(), positions.contiguous()
        out = torch.empty(B, n_head * head_dim, dtype=torch.float32)
        status = kernel(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), rope.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            type_k.ggml_type, type_v.ggml_type, n_seq, n_ctx, seqs.data_ptr(), positions.data_ptr(), B, n_head,
            n_head_kv, head_dim, head_dim**-0.5, out.data_ptr(), int(neox), kc.threads_now, kc.level,
        )  # fmt: skip
        if status:
            check_status(status, "attn_decode_batch")
        return out
    rows = []
    for b, (seq, pos) in enumerate(zip(seqs.tolist(), positions.tolist(), strict=True)):
        rows.append(
            attend_one(
                q[b : b + 1],
                k[b : b + 1],
                v[b : b + 1],
                rope[b],
                k_cache[seq],
                v_cache[seq],
                pos,
                kc,
                neox=neox,
            )
        )
    return torch.cat(rows)
