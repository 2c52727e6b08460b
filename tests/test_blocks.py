"""The variants of the model blocks against independent oracles.

RoPE (neox, partial, adjacent, linear scale) against transformers' rotary code; norms against transformers' and
torch's; attention with QK-norm and with q/k/v biases against transformers' Qwen3 and Qwen2 attention; the sliding
window against a softmax reference with transformers' mask convention; FFN variants against transformers' MLPs
and written references. Every attention variant also keeps the invariant that one "run" step over a prompt equals
the tokens fed one by one, a "decode" batch of several sequences and a "mixed" batch (all against a float64
reference written here).

Errors are max |got - want| / max |want| (float32 blocks against float64 oracles); each bound is a few times the
error measured here, and each variant is shown to change the output by far more than its bound.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from powerinfer import ops
from powerinfer.gguf import GGMLType
from powerinfer.model.batch import StepBatch
from powerinfer.model.blocks import Attention, DenseFFN, Norm, Rope
from powerinfer.model.specs import AttentionSpec, FFNSpec, NormSpec, RopeSpec
from powerinfer.runtime.kv_cache import KVCache

F64 = torch.float64
N_EMBD, HEAD_DIM = 32, 8
LENS = (11, 7, 9, 5, 13)  # five sequences' prompt lengths: a decode batch of 5
N_CTX = 16

# ------------------------------------------------------------------------------------------ helpers


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float64."""
    got, want = got.to(F64), want.to(F64)
    return ((got - want).abs().max() / want.abs().max()).item()


def qweight(w: torch.Tensor) -> ops.QWeight:
    """A float32 QWeight of the (rows, cols) matrix w."""
    a = np.ascontiguousarray(w.detach().to(torch.float32).numpy())
    return ops.QWeight.from_numpy(a, GGMLType.F32, a.shape)


def f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float32).contiguous()


def kernel_context() -> ops.KernelContext:
    return ops.KernelContext(n_threads=1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """NeoX layout (transformers' rotate_half): element i pairs with i + n/2."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """Adjacent layout (transformers' GPT-J rotate_every_two): element 2i pairs with 2i + 1."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def ref_rope(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """x (T, H, D) rotated over its first n_rot dims for positions (T,), in float64."""
    n_rot = spec.n_rot
    inv_freq = spec.base ** (-torch.arange(0, n_rot, 2, dtype=F64) / n_rot)
    angles = (positions.to(F64) / spec.scale)[:, None] * inv_freq  # (T, n_rot/2)
    if spec.kind == "neox":
        angles, rot = torch.cat((angles, angles), -1), rotate_half  # transformers' emb = cat(freqs, freqs)
    else:
        angles, rot = angles.repeat_interleave(2, -1), rotate_every_two
    cos, sin = angles.cos(), angles.sin()
    x = x.to(F64)
    part = x[..., :n_rot]
    out = part * cos[:, None, :] + rot(part) * sin[:, None, :]
    return torch.cat((out, x[..., n_rot:]), dim=-1)


def ref_norm(spec: NormSpec, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The three norms written out in float64 (w as stored: rms_1p applies 1 + w)."""
    x, w = x.to(F64), w.to(F64)
    if spec.kind == "layer":
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + spec.eps) * w + (0.0 if b is None else b.to(F64))
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + spec.eps)
    return y * (1.0 + w) if spec.kind == "rms_1p" else y * w


def random_attention_weights(spec: AttentionSpec, seed: int) -> dict[str, torch.Tensor]:
    """float64 weights (scaled so that q and k entries are about unit size), biases and QK-norm weights."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=F64) * scale

    s = spec
    return {
        "wq": randn(s.n_embd_q, N_EMBD, scale=N_EMBD**-0.5),
        "wk": randn(s.n_embd_kv, N_EMBD, scale=N_EMBD**-0.5),
        "wv": randn(s.n_embd_kv, N_EMBD, scale=N_EMBD**-0.5),
        "wo": randn(N_EMBD, s.n_embd_q, scale=s.n_embd_q**-0.5),
        "bq": randn(s.n_embd_q, scale=0.5),
        "bk": randn(s.n_embd_kv, scale=0.5),
        "bv": randn(s.n_embd_kv, scale=0.5),
        "bo": randn(N_EMBD, scale=0.5),
        "qn": 1.0 + randn(s.head_dim, scale=0.3),
        "kn": 1.0 + randn(s.head_dim, scale=0.3),
    }


def build_attention(spec: AttentionSpec, w: dict[str, torch.Tensor], kc: ops.KernelContext) -> Attention:
    """The block for spec with weights w (fused: one wqkv made of the wq, wk, wv rows), set up for N_CTX."""
    biases = (
        f32(w["bq"]) if spec.bias else None,
        f32(w["bk"]) if spec.bias else None,
        f32(w["bv"]) if spec.bias else None,
        f32(w["bo"]) if spec.out_bias else None,
    )
    q_norm = k_norm = None
    if spec.qk_norm is not None:
        q_norm, k_norm = Norm(spec.qk_norm, f32(w["qn"])), Norm(spec.qk_norm, f32(w["kn"]))
    if spec.fused_qkv:
        wqkv = qweight(torch.cat((w["wq"], w["wk"], w["wv"])))
        attn = Attention(spec, None, None, None, qweight(w["wo"]), kc, wqkv=wqkv, biases=biases,
                         q_norm=q_norm, k_norm=k_norm)  # fmt: skip
    else:
        attn = Attention(spec, qweight(w["wq"]), qweight(w["wk"]), qweight(w["wv"]), qweight(w["wo"]), kc,
                         biases=biases, q_norm=q_norm, k_norm=k_norm)  # fmt: skip
    attn.setup(None if spec.rope is None else Rope(spec.rope, N_CTX), N_CTX)
    return attn


def window_mask(T: int, window: int | None) -> torch.Tensor:
    """(T, T) bool: query p sees key j when j <= p and, with a window, p - window < j (transformers' Mistral and
    Gemma convention: kv_idx > q_idx - sliding_window, so a query sees `window` keys counting itself)."""
    q, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    mask = j <= q
    return mask if window is None else mask & (j > q - window)


def ref_attention(
    spec: AttentionSpec, w: dict[str, torch.Tensor], x: torch.Tensor, window: int | None = -1
) -> torch.Tensor:
    """Plain causal softmax attention of a prompt x (T, n_embd) at positions 0..T-1 in float64: projections (+
    biases), per-head QK-norm, RoPE, query head h reading KV head h // (H / H_kv), the window mask, output
    projection (+ bias). window -1: the spec's."""
    s = spec
    T = x.shape[0]
    x = x.to(F64)
    q, k, v = x @ w["wq"].T, x @ w["wk"].T, x @ w["wv"].T
    if s.bias:
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    q, k = q.view(T, s.n_head, s.head_dim), k.view(T, s.n_head_kv, s.head_dim)
    v = v.view(T, s.n_head_kv, s.head_dim)
    if s.qk_norm is not None:
        q, k = ref_norm(s.qk_norm, q, w["qn"]), ref_norm(s.qk_norm, k, w["kn"])
    if s.rope is not None:
        pos = torch.arange(T)
        q, k = ref_rope(q, pos, s.rope), ref_rope(k, pos, s.rope)
    group = s.n_head // s.n_head_kv
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (T, H, D)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(s.head_dim)
    mask = window_mask(T, s.sliding_window if window == -1 else window)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v).reshape(T, s.n_embd_q) @ w["wo"].T
    return out + w["bo"] if s.out_bias else out


def drive(
    attn: Attention, spec: AttentionSpec, xs: list[torch.Tensor], schedule: list[list[tuple[int, int]]]
) -> tuple[list[torch.Tensor], set[str]]:
    """Feed the prompts xs (one per sequence) through the block in the steps of schedule (each step: (sequence,
    token count) chunks taken in order from each prompt) on a fresh cache; the output rows of each sequence and
    the batch kinds seen."""
    kv = KVCache(1, N_CTX, spec.n_head_kv, spec.head_dim, n_seq=len(xs))
    view = kv.layer_view(0)
    cursor = [0] * len(xs)
    outs: list[list[torch.Tensor]] = [[] for _ in xs]
    kinds = set()
    for step in schedule:
        seq_ids, positions, rows = [], [], []
        for s, n in step:
            p = cursor[s]
            seq_ids += [s] * n
            positions += list(range(p, p + n))
            rows.append(xs[s][p : p + n])
            cursor[s] += n
        batch = StepBatch.build(seq_ids, [0] * len(seq_ids), positions)
        kinds.add(batch.kind)
        y = attn(torch.cat(rows).contiguous(), batch, view)
        assert y.shape == (len(seq_ids), N_EMBD) and y.dtype == torch.float32
        start = 0
        for s, n in step:
            outs[s].append(y[start : start + n])
            start += n
    assert cursor == [x.shape[0] for x in xs]
    return [torch.cat(o) for o in outs], kinds


def prompts(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, N_EMBD, generator=g) for n in LENS]


# the schedules feed every token of the five prompts (LENS) once
SCHEDULES: dict[str, tuple[list[list[tuple[int, int]]], set[str]]] = {
    "run": ([[(s, n)] for s, n in enumerate(LENS)], {"run"}),
    "one_by_one": ([[(s, 1)] for s, n in enumerate(LENS) for _ in range(n)], {"run"}),
    # prefill all but 3 tokens, then decode batches of 5 (padded SDPA), 2 and 3 (per-sequence kernel where it
    # applies) and 5 sequences
    "decode": (
        [[(s, n - 3)] for s, n in enumerate(LENS)]
        + [
            [(s, 1) for s in range(5)],
            [(0, 1), (2, 1)],
            [(1, 1), (3, 1), (4, 1)],
            [(s, 1) for s in range(5)],
        ],
        {"run", "decode"},
    ),
    # chunks of several sequences in one step, chunks that continue a sequence, one-token chunks at pos > 0
    "mixed": (
        [[(0, 5), (1, 3)], [(0, 2), (1, 1), (2, 6)], [(3, 5), (4, 1)], [(0, 4), (1, 3), (2, 3), (4, 12)]],
        {"mixed"},
    ),
}

# ------------------------------------------------------------------------------------------ 1. RoPE


def _hf_neox_cos_sin(head_dim: int, n_rot: int, base: float, scale: float, positions: torch.Tensor):
    """cos, sin (1, T, n_rot) as transformers' GPT-NeoX rotary embedding builds them (float32 angles)."""
    tf = pytest.importorskip("transformers")
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

    params = {"rope_type": "default", "rope_theta": base, "partial_rotary_factor": n_rot / head_dim}
    if scale != 1.0:
        params.update(rope_type="linear", factor=scale)
    cfg = tf.GPTNeoXConfig(hidden_size=head_dim * 2, num_attention_heads=2, rope_parameters=params)
    emb = GPTNeoXRotaryEmbedding(cfg)
    assert emb.inv_freq.shape == (n_rot // 2,)
    return emb(torch.zeros(1, dtype=F64), positions[None])


@pytest.mark.parametrize(
    "head_dim, n_rot, base, scale",
    [
        (16, 16, 10000.0, 1.0),  # GPT-NeoX / Qwen / transformers' Llama layout, full
        (32, 8, 10000.0, 1.0),  # GPT-NeoX rotary_pct = 0.25
        (20, 8, 10000.0, 1.0),  # Phi partial_rotary_factor = 0.4
        (16, 16, 500000.0, 4.0),  # linear scaling: positions / 4
    ],
)
def test_rope_neox_matches_transformers(head_dim, n_rot, base, scale):
    """NeoX RoPE (element i pairs with i + n_rot/2, the dims past n_rot passed through) equals transformers'
    GPT-NeoX apply_rotary_pos_emb with cos/sin from its rotary embedding, for full and partial rotation and linear
    scaling, at positions given as a slice (prefill) and as a tensor (decode batch)."""
    pytest.importorskip("transformers")
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(1)
    T, H = 40, 3
    x = torch.randn(T, H, head_dim, generator=g)
    spec = RopeSpec("neox", n_rot, base, scale)
    rope = Rope(spec, 64)
    pos = torch.arange(T)
    cos, sin = _hf_neox_cos_sin(head_dim, n_rot, base, scale, pos)
    want, _ = apply_rotary_pos_emb(x[None].to(F64), x[None].to(F64), cos, sin, unsqueeze_dim=2)
    got = rope.apply(x, slice(0, T))
    # measured 9.7e-8 .. 3.4e-7 (transformers builds its angles in float32; our table is float64 rounded to
    # complex64), and at most 7.2e-8 against the float64 written reference that the attention tests use
    assert rel_err(got, want[0]) < 1.5e-6
    assert rel_err(got, ref_rope(x, pos, spec)) < 3e-7
    if n_rot < head_dim:
        assert torch.equal(got[..., n_rot:], x[..., n_rot:])  # the unrotated dims pass through untouched
    # a tensor of positions (the decode batch) gives the rows of those positions
    idx = torch.tensor([3, 39, 0, 17])
    assert torch.equal(rope.apply(x[idx], idx), got[idx])
    # the layout matters: the adjacent-pair rotation of the same x differs by far more than the bound
    other = Rope(dataclasses.replace(spec, kind="adjacent"), 64).apply(x, slice(0, T))
    assert rel_err(other, want[0]) > 0.1
    if scale != 1.0:  # and so does the scale
        unscaled = Rope(dataclasses.replace(spec, scale=1.0), 64).apply(x, slice(0, T))
        assert rel_err(unscaled, want[0]) > 0.1


@pytest.mark.parametrize("head_dim, n_rot", [(16, 16), (32, 8)])
def test_rope_adjacent_matches_gptj(head_dim, n_rot):
    """Adjacent-pair RoPE (GGUF llama layout; GPT-J, which rotates the first rotary_dim dims) equals transformers'
    GPT-J rotate_every_two with its sinusoidal table, and the explicit formula
    out[2i] = x[2i] cos(p t_i) - x[2i+1] sin(p t_i), out[2i+1] = x[2i] sin(p t_i) + x[2i+1] cos(p t_i)."""
    pytest.importorskip("transformers")
    from transformers.models.gptj import modeling_gptj as gptj

    g = torch.Generator().manual_seed(2)
    T, H = 40, 3
    x = torch.randn(T, H, head_dim, generator=g)
    got = Rope(RopeSpec("adjacent", n_rot), 64).apply(x, slice(0, T))
    table = gptj.create_sinusoidal_positions(T, n_rot).to(F64)  # (T, n_rot): sin | cos
    sin, cos = table[None, :, : n_rot // 2], table[None, :, n_rot // 2 :]
    rot = gptj.apply_rotary_pos_emb(x[None, ..., :n_rot].to(F64), sin, cos)[0]
    want = torch.cat((rot, x[..., n_rot:].to(F64)), dim=-1)
    assert rel_err(got, want) < 2e-6  # measured 5.3e-7 (full), 8.6e-8 (partial): GPT-J's table is float32
    if n_rot < head_dim:
        assert torch.equal(got[..., n_rot:], x[..., n_rot:])
    # the explicit formula, with another base and a linear scale
    spec = RopeSpec("adjacent", n_rot, base=500.0, scale=2.5)
    got = Rope(spec, 64).apply(x, slice(0, T)).to(F64)
    p = torch.arange(T, dtype=F64)[:, None, None] / 2.5
    theta = 500.0 ** (-2 * torch.arange(n_rot // 2, dtype=F64) / n_rot)
    c, s = torch.cos(p * theta), torch.sin(p * theta)
    x64 = x.to(F64)
    even, odd = x64[..., 0:n_rot:2], x64[..., 1:n_rot:2]
    assert rel_err(got[..., 0:n_rot:2], even * c - odd * s) < 3e-7  # measured 8.0e-8 (full), 5.2e-8 (partial)
    assert rel_err(got[..., 1:n_rot:2], even * s + odd * c) < 3e-7  # measured 5.8e-8, 5.2e-8
    unscaled = Rope(dataclasses.replace(spec, scale=1.0), 64).apply(x, slice(0, T))
    assert rel_err(unscaled[..., 0:n_rot:2], even * c - odd * s) > 0.1


# ------------------------------------------------------------------------------------------ 2. attention invariants

ADJ = RopeSpec("adjacent", HEAD_DIM)
NEOX = RopeSpec("neox", HEAD_DIM)
VARIANTS = {
    "llama": AttentionSpec(4, 2, HEAD_DIM, ADJ),  # the fused decode-attention kernel path
    "mha_1to1": AttentionSpec(4, 4, HEAD_DIM, ADJ),
    "gqa_4to1": AttentionSpec(8, 2, HEAD_DIM, NEOX),
    "neox": AttentionSpec(4, 2, HEAD_DIM, NEOX),
    "partial_neox": AttentionSpec(4, 2, HEAD_DIM, RopeSpec("neox", 4)),
    "partial_adjacent": AttentionSpec(4, 2, HEAD_DIM, RopeSpec("adjacent", 4)),
    "bias": AttentionSpec(4, 2, HEAD_DIM, NEOX, bias=True, out_bias=True),
    "fused_qkv": AttentionSpec(4, 2, HEAD_DIM, ADJ, fused_qkv=True),
    "qk_norm": AttentionSpec(4, 2, HEAD_DIM, NEOX, qk_norm=NormSpec("rms", 1e-6)),
    "qk_norm_1p": AttentionSpec(4, 2, HEAD_DIM, ADJ, qk_norm=NormSpec("rms_1p", 1e-6)),
    "window": AttentionSpec(4, 2, HEAD_DIM, ADJ, sliding_window=4),
    "window_gqa_4to1": AttentionSpec(8, 2, HEAD_DIM, NEOX, sliding_window=3),
    "no_rope": AttentionSpec(4, 2, HEAD_DIM, None),
}
# each variant without what makes it one: the block's output must be far from this twin's reference
TWINS = {
    "neox": dataclasses.replace(VARIANTS["neox"], rope=ADJ),
    "gqa_4to1": dataclasses.replace(VARIANTS["gqa_4to1"], rope=ADJ),
    "partial_neox": dataclasses.replace(VARIANTS["partial_neox"], rope=NEOX),
    "partial_adjacent": dataclasses.replace(VARIANTS["partial_adjacent"], rope=ADJ),
    "bias": dataclasses.replace(VARIANTS["bias"], bias=False, out_bias=False),
    "qk_norm": dataclasses.replace(VARIANTS["qk_norm"], qk_norm=None),
    "qk_norm_1p": dataclasses.replace(VARIANTS["qk_norm_1p"], qk_norm=NormSpec("rms", 1e-6)),
    "window": dataclasses.replace(VARIANTS["window"], sliding_window=None),
    "window_gqa_4to1": dataclasses.replace(VARIANTS["window_gqa_4to1"], sliding_window=None),
    "no_rope": dataclasses.replace(VARIANTS["no_rope"], rope=ADJ),
}
# measured 6e-8 .. 5.5e-7 over every variant, schedule and sequence (float32 block, float64 reference); the
# twins are 1.8e-2 .. 1.4 off (at least 0.2 for the worst-off sequence of each variant)
ATTN_BOUND = 2e-6


@pytest.mark.parametrize("name", list(VARIANTS))
def test_attention_steps_agree_with_reference(name):
    """For each attention variant: five prompts evaluated as one "run" step each, token by token, as prefill then
    "decode" batches of 5, 2 and 3 sequences, and as "mixed" steps, all equal the float64 reference of each
    prompt, and the run step equals the token-by-token outputs; the variant's twin (the same weights without the
    variant) is far off."""
    spec = VARIANTS[name]
    w = random_attention_weights(spec, seed=10)
    attn = build_attention(spec, w, kernel_context())
    xs = prompts(seed=11)
    refs = [ref_attention(spec, w, x) for x in xs]
    results = {}
    for sched_name, (schedule, kinds) in SCHEDULES.items():
        outs, seen = drive(attn, spec, xs, schedule)
        assert seen == kinds, sched_name
        for s, (out, ref) in enumerate(zip(outs, refs, strict=True)):
            err = rel_err(out, ref)
            assert err < ATTN_BOUND, f"{sched_name}, sequence {s}: {err:.2e}"
        results[sched_name] = outs
    for a, b in zip(results["run"], results["one_by_one"], strict=True):
        assert rel_err(b, a) < ATTN_BOUND
    if name in TWINS:
        twin = [ref_attention(TWINS[name], w, x) for x in xs]
        # the decode schedule's last rows are the positions past every window
        assert max(rel_err(o, t) for o, t in zip(results["decode"], twin, strict=True)) > 100 * ATTN_BOUND


@pytest.mark.parametrize("base", ["llama", "partial_neox", "bias", "qk_norm", "window"])
def test_fused_qkv_equals_separate_projections(base):
    """One wqkv made of the wq, wk and wv rows gives the separate block's outputs, for every step kind."""
    sep_spec = VARIANTS[base]
    fused_spec = dataclasses.replace(sep_spec, fused_qkv=True)
    w = random_attention_weights(sep_spec, seed=20)
    kc = kernel_context()
    sep, fused = build_attention(sep_spec, w, kc), build_attention(fused_spec, w, kc)
    assert fused.wqkv is not None and fused.wq is None
    xs = prompts(seed=21)
    for schedule, _ in SCHEDULES.values():
        outs_sep, outs_fused = (
            drive(sep, sep_spec, xs, schedule)[0],
            drive(fused, fused_spec, xs, schedule)[0],
        )
        for a, b in zip(outs_sep, outs_fused, strict=True):
            # measured 0 for the non-kernel variants; up to 1.05e-7 for "llama" (the separate block runs one
            # token through the fused decode-attention kernel, the fused-qkv block through the tensor ops)
            assert rel_err(b, a) < 5e-7


# ------------------------------------------------------------------------------------------ 3. sliding window


def test_sliding_window_matches_transformers_mask_convention():
    """A query at p sees keys p - window < j <= p (transformers' Mistral, Gemma 2/3 and Qwen2 masks:
    sliding_window_overlay is kv_idx > q_idx - sliding_window, so `window` keys counting the query's own): the
    block equals softmax attention under that mask for a 12-token prefill (window 4) and for decode steps past
    the window, and differs from windows 3 and 5 and from no window by far more than the bound."""
    window, T = 4, 12
    pytest.importorskip("transformers")
    from transformers.masking_utils import sliding_window_causal_mask_function

    hf_mask = sliding_window_causal_mask_function(window)(
        torch.tensor(0), torch.tensor(0), torch.arange(T)[:, None], torch.arange(T)[None, :]
    )
    assert torch.equal(hf_mask, window_mask(T, window))  # the reference's mask is transformers' own
    spec = AttentionSpec(4, 2, HEAD_DIM, NEOX, sliding_window=window)
    w = random_attention_weights(spec, seed=30)
    attn = build_attention(spec, w, kernel_context())
    x = torch.randn(T, N_EMBD, generator=torch.Generator().manual_seed(31))
    want = ref_attention(spec, w, x)
    prefill = drive(attn, spec, [x], [[(0, T)]])[0][0]
    stepped = drive(attn, spec, [x], [[(0, 6)]] + [[(0, 1)]] * (T - 6))[0][0]  # decode from pos 6 > window
    assert rel_err(prefill, want) < 1e-6  # measured 1.8e-7
    assert rel_err(stepped[6:], want[6:]) < 1e-6  # measured 1.9e-7
    for other in (window - 1, window + 1, None):
        assert rel_err(prefill, ref_attention(spec, w, x, window=other)) > 1e-2
        assert rel_err(stepped[6:], ref_attention(spec, w, x, window=other)[6:]) > 1e-2
    # inside the window the rows are plain causal attention
    assert (
        rel_err(prefill[:window], ref_attention(spec, w, x, window=None)[:window]) < 1e-6
    )  # measured 1.4e-7


# ------------------------------------------------------------------------------------------ 4. Qwen2 / Qwen3 attention


def _hf_attention(
    kind: str, spec: AttentionSpec, w: dict[str, torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    """transformers' Qwen3Attention (per-head q/k RMSNorm before RoPE) or Qwen2Attention (q, k, v biases) in
    float64 with the weights w, over the prompt x at positions 0..T-1 (eager attention, causal mask)."""
    tf = pytest.importorskip("transformers")
    if kind == "qwen3":
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention as Attn
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding as Emb

        Config = tf.Qwen3Config
    else:
        from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention as Attn
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding as Emb

        Config = tf.Qwen2Config
    assert spec.rope is not None
    cfg = Config(
        hidden_size=N_EMBD, intermediate_size=64, num_attention_heads=spec.n_head,
        num_key_value_heads=spec.n_head_kv, head_dim=spec.head_dim, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope.base}, attention_bias=False,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    mod = Attn(cfg, layer_idx=0).to(F64).eval()
    with torch.no_grad():
        for proj, key in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "o")):
            getattr(mod, proj).weight.copy_(w["w" + key])
            if getattr(mod, proj).bias is not None:
                getattr(mod, proj).bias.copy_(w["b" + key])
        if kind == "qwen3":
            mod.q_norm.weight.copy_(w["qn"])
            mod.k_norm.weight.copy_(w["kn"])
        T = x.shape[0]
        h = x.to(F64)[None]
        cos_sin = Emb(cfg)(h, torch.arange(T)[None])
        mask = torch.zeros(T, T, dtype=F64).masked_fill(~window_mask(T, None), float("-inf"))[None, None]
        return mod(h, cos_sin, mask)[0][0]


def test_qk_norm_matches_transformers_qwen3():
    """QK-norm (RMSNorm over each head's q and k before NeoX RoPE), GQA 2:1, equals transformers' Qwen3Attention
    with the same weights, prefilled and token by token; without the norm the output is far off."""
    spec = AttentionSpec(4, 2, HEAD_DIM, RopeSpec("neox", HEAD_DIM, 1e6), qk_norm=NormSpec("rms", 1e-6))
    w = random_attention_weights(spec, seed=40)
    x = torch.randn(12, N_EMBD, generator=torch.Generator().manual_seed(41))
    want = _hf_attention("qwen3", spec, w, x)
    attn = build_attention(spec, w, kernel_context())
    prefill = drive(attn, spec, [x], [[(0, 12)]])[0][0]
    stepped = drive(attn, spec, [x], [[(0, 1)]] * 12)[0][0]
    assert rel_err(prefill, want) < 1e-6  # measured 1.2e-7
    assert rel_err(stepped, want) < 1e-6  # measured 1.7e-7
    plain = dataclasses.replace(spec, qk_norm=None)
    assert (
        rel_err(drive(build_attention(plain, w, kernel_context()), plain, [x], [[(0, 12)]])[0][0], want)
        > 1e-2
    )


def test_qkv_biases_match_transformers_qwen2():
    """Biases on q, k and v (no output bias), GQA 2:1, NeoX RoPE, equal transformers' Qwen2Attention with the
    same weights; without the biases the output is far off."""
    spec = AttentionSpec(4, 2, HEAD_DIM, RopeSpec("neox", HEAD_DIM, 1e6), bias=True)
    w = random_attention_weights(spec, seed=50)
    x = torch.randn(12, N_EMBD, generator=torch.Generator().manual_seed(51))
    want = _hf_attention("qwen2", spec, w, x)
    attn = build_attention(spec, w, kernel_context())
    prefill = drive(attn, spec, [x], [[(0, 12)]])[0][0]
    stepped = drive(attn, spec, [x], [[(0, 1)]] * 12)[0][0]
    assert rel_err(prefill, want) < 1e-6  # measured 1.3e-7
    assert rel_err(stepped, want) < 1e-6  # measured 1.0e-7
    plain = dataclasses.replace(spec, bias=False)
    assert (
        rel_err(drive(build_attention(plain, w, kernel_context()), plain, [x], [[(0, 12)]])[0][0], want)
        > 1e-2
    )


# ------------------------------------------------------------------------------------------ 5. norms


def _norm_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 5, 48, generator=g) * 3 + 0.5  # a mean to remove for LayerNorm
    return x, torch.randn(48, generator=g) * 0.5, torch.randn(48, generator=g)


def test_rms_norm_matches_llama():
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, w, _ = _norm_inputs(60)
    hf = LlamaRMSNorm(48, eps=1e-5).to(F64)
    with torch.no_grad():
        hf.weight.copy_(w)
        want = hf(x.to(F64))
    got = Norm(NormSpec("rms", 1e-5), w)(x)
    assert rel_err(got, want) < 2e-7  # measured 2.6e-8


def test_rms_1p_norm_matches_gemma():
    """rms_1p stores w and applies (1 + w), as transformers' GemmaRMSNorm; plain rms with the same w is far off."""
    pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    x, w, _ = _norm_inputs(61)
    hf = GemmaRMSNorm(48, eps=1e-6).to(F64)
    with torch.no_grad():
        hf.weight.copy_(w)
        want = hf(x.to(F64))
    got = Norm(NormSpec("rms_1p", 1e-6), w)(x)
    assert rel_err(got, want) < 4e-7  # measured 0: GemmaRMSNorm computes in float32 whatever its input
    assert rel_err(got, ref_norm(NormSpec("rms_1p", 1e-6), x, w)) < 4e-7  # measured 8.0e-8 (float64 formula)
    assert rel_err(Norm(NormSpec("rms", 1e-6), w)(x), want) > 0.1


def test_layer_norm_matches_torch():
    """LayerNorm with weight and bias equals torch.nn.LayerNorm (and the written formula); the rms norm of the
    same input and weight is far off (the input has a mean)."""
    x, w, b = _norm_inputs(62)
    ln = torch.nn.LayerNorm(48, eps=1e-5).to(F64)
    with torch.no_grad():
        ln.weight.copy_(w)
        ln.bias.copy_(b)
        want = ln(x.to(F64))
    got = Norm(NormSpec("layer", 1e-5), w, b)(x)
    assert rel_err(got, want) < 3e-7  # measured 6.5e-8
    assert rel_err(got, ref_norm(NormSpec("layer", 1e-5), x, w, b)) < 3e-7  # measured 6.5e-8
    assert rel_err(Norm(NormSpec("rms", 1e-5), w)(x) + b, want) > 0.05


# ------------------------------------------------------------------------------------------ 6. dense FFN

N_FF = 64
FFN_BOUND = 1e-6  # measured at most 2.6e-7 (float32 block, float64 oracle)


def _ffn_weights(seed: int) -> dict[str, torch.Tensor]:
    """float64 FFN weights; the gate and up pre-activations are about N(0, 2) so the activations' tails matter."""
    g = torch.Generator().manual_seed(seed)
    return {
        "gate": torch.randn(N_FF, N_EMBD, generator=g, dtype=F64) * (2 / N_EMBD**0.5),
        "up": torch.randn(N_FF, N_EMBD, generator=g, dtype=F64) * (2 / N_EMBD**0.5),
        "down": torch.randn(N_EMBD, N_FF, generator=g, dtype=F64) * N_FF**-0.5,
        "b_up": torch.randn(N_FF, generator=g, dtype=F64),
        "b_down": torch.randn(N_EMBD, generator=g, dtype=F64),
        "x": torch.randn(9, N_EMBD, generator=g),
    }


def _dense_ffns(spec: FFNSpec, w: dict[str, torch.Tensor]) -> list[DenseFFN]:
    """The block reading ffn_down, and the block reading the transposed ffn_down_t (PowerInfer files)."""
    kc = kernel_context()
    gate = qweight(w["gate"]) if spec.gated else None
    biases = (f32(w["b_up"]), f32(w["b_down"])) if spec.bias else (None, None)
    up = qweight(w["up"])
    return [
        DenseFFN(spec, up, gate, qweight(w["down"]), None, kc, biases),
        DenseFFN(spec, up, gate, None, qweight(w["down"].T), kc, biases),
    ]


def _erf_gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.special.erf(x / math.sqrt(2)))


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def test_gated_gelu_tanh_matches_gemma_mlp():
    """Gemma's GeGLU: down(gelu_tanh(gate x) * up x) equals transformers' GemmaMLP (hidden_activation
    gelu_pytorch_tanh); the erf GELU is far off by comparison."""
    tf = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    w = _ffn_weights(70)
    cfg = tf.GemmaConfig(hidden_size=N_EMBD, intermediate_size=N_FF, hidden_activation="gelu_pytorch_tanh")
    mlp = GemmaMLP(cfg).to(F64)
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(w["gate"])
        mlp.up_proj.weight.copy_(w["up"])
        mlp.down_proj.weight.copy_(w["down"])
        want = mlp(w["x"].to(F64))
    x64 = w["x"].to(F64)
    written = (_tanh_gelu(x64 @ w["gate"].T) * (x64 @ w["up"].T)) @ w["down"].T
    assert rel_err(written, want) < 1e-12
    for ffn in _dense_ffns(FFNSpec("gelu_tanh"), w):
        got = ffn(w["x"], w["x"])
        assert rel_err(got, want) < FFN_BOUND  # measured 1.1e-7 (down), 1.9e-7 (down_t)
    erf = _dense_ffns(FFNSpec("gelu"), w)[0](w["x"], w["x"])
    assert rel_err(erf, want) > 50 * FFN_BOUND  # measured 1.15e-4


def test_gated_gelu_erf_matches_reference():
    """down(gelu(gate x) * up x) with the erf GELU equals the written formula; tanh GELU is far off."""
    w = _ffn_weights(71)
    x64 = w["x"].to(F64)
    want = (_erf_gelu(x64 @ w["gate"].T) * (x64 @ w["up"].T)) @ w["down"].T
    for ffn in _dense_ffns(FFNSpec("gelu"), w):
        assert rel_err(ffn(w["x"], w["x"]), want) < FFN_BOUND  # measured 1.6e-7, 1.8e-7
    assert rel_err(_dense_ffns(FFNSpec("gelu_tanh"), w)[0](w["x"], w["x"]), want) > 50 * FFN_BOUND  # 1.45e-4


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_ungated_ffn_with_biases(act):
    """OPT (relu) and Falcon (gelu) FFNs: down(act(up x + b_up)) + b_down, against a written reference and, for
    gelu, transformers' FalconMLP; dropping either bias is far off."""
    w = _ffn_weights(72)
    x64 = w["x"].to(F64)
    fn = torch.relu if act == "relu" else _erf_gelu
    want = fn(x64 @ w["up"].T + w["b_up"]) @ w["down"].T + w["b_down"]
    spec = FFNSpec(act, gated=False, bias=True)
    for ffn in _dense_ffns(spec, w):
        got = ffn(w["x"], w["x"])
        assert rel_err(got, want) < FFN_BOUND  # measured 8.2e-8, 1.4e-7 (relu); 1.3e-7, 2.6e-7 (gelu)
    no_bias = _dense_ffns(FFNSpec(act, gated=False), w)[0](w["x"], w["x"])
    assert rel_err(no_bias, want) > 0.1
    if act == "gelu":
        tf = pytest.importorskip("transformers")
        from transformers.models.falcon.modeling_falcon import FalconMLP

        cfg = tf.FalconConfig(hidden_size=N_EMBD, ffn_hidden_size=N_FF, bias=True, activation="gelu")
        mlp = FalconMLP(cfg).to(F64)
        with torch.no_grad():
            mlp.dense_h_to_4h.weight.copy_(w["up"])
            mlp.dense_h_to_4h.bias.copy_(w["b_up"])
            mlp.dense_4h_to_h.weight.copy_(w["down"])
            mlp.dense_4h_to_h.bias.copy_(w["b_down"])
            assert rel_err(mlp(x64), want) < 1e-12


def test_relu_up_ffn_matches_bamboo():
    """Bamboo's FFN: down(relu(gate x) * relu(up x)); the plain ReGLU (up not rectified) is far off."""
    w = _ffn_weights(73)
    x64 = w["x"].to(F64)
    want = (torch.relu(x64 @ w["gate"].T) * torch.relu(x64 @ w["up"].T)) @ w["down"].T
    for ffn in _dense_ffns(FFNSpec("relu", relu_up=True), w):
        assert rel_err(ffn(w["x"], w["x"]), want) < FFN_BOUND  # measured 1.4e-7, 1.5e-7
    assert rel_err(_dense_ffns(FFNSpec("relu"), w)[0](w["x"], w["x"]), want) > 0.1


def test_attention_refuses_parts_its_spec_does_not_declare():
    """A q-norm without a k-norm, biases or a fused matrix the spec does not declare: a build error, never
    silently ignored."""
    from powerinfer.errors import ConfigError

    spec = AttentionSpec(4, 2, 8, RopeSpec("neox", 8), qk_norm=NormSpec())
    w = qweight(torch.zeros(32, 32))
    wkv = qweight(torch.zeros(16, 32))
    norm = Norm(NormSpec(), torch.ones(8))
    kc = ops.KernelContext()
    with pytest.raises(ConfigError, match="QK-norm"):
        Attention(spec, w, wkv, wkv, w, kc, q_norm=norm)
    plain = AttentionSpec(4, 2, 8, RopeSpec("neox", 8))
    with pytest.raises(ConfigError, match="bias"):
        Attention(plain, w, wkv, wkv, w, kc, biases=(torch.zeros(32), None, None, None))
    with pytest.raises(ConfigError, match="wqkv"):
        Attention(plain, None, None, None, w, kc)
