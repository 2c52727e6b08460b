#!/usr/bin/env python3
"""Write synthetic PowerInfer GGUF files (magic PWRI, arch llama) with random weights, for benches and tests.

Shapes: `tinyllama-1.1b` (TinyLlama-1.1B: n_embd 2048, 22 layers, n_ff 5632, 32 heads, 4 KV heads,
vocab 32000, context 2048, rms eps 1e-5, rope base 10000) or `tiny` (n_embd 256, 2 layers, n_ff 1024, 4/2
heads, vocab 512) for tests.

Contents: seeded random weights (one numpy stream per tensor name, see the scales below), norm gains 1, a
byte-level SentencePiece vocabulary (`<unk> <s> </s>`, the 256 `<0xNN>` byte tokens, then letter pieces).
Every layer has a predictor fc1 (r, n_embd) / fc2 (n_ff, r) and the transposed `ffn_down_t` (n_ff, n_embd)
instead of `ffn_down`. fc2 rows carry a random per-neuron offset, so some neurons fire far more often than
others (hot neurons are real, as in ReLU LLMs).

Calibration (spec section 2): `--sample-tokens` random tokens are run through the model layer by layer
(embedding, attention, predictor-masked ReLU FFN; float32 on the F16-rounded weights, as our engine computes).
Each layer's predictor scores fc2 . ReLU(fc1 . ffn_inp) are taken over that sample and fc2 of layer l is
rescaled so that the (1 - active) quantile of its scores equals layer 0's, which becomes
`powerinfer.sparse_threshold`: about `--active` of the (token, neuron) pairs are predicted active in every
layer. `activation/activation_<N>.pt` holds, per layer, how often the predictor marked each neuron active over
that sample (float32 tensor of length n_ff).

Files, both holding the same weights (the Q4_0 one quantizes the F16 values, as llama.cpp's quantize does;
`powerinfer.quant.quantize` takes ~0.05 s for a 5632x2048 matrix, so no shortcut is needed):
  DIR/synthetic-<shape>.powerinfer.gguf      2-D tensors F16, 1-D F32
  DIR/synthetic-<shape>.q4.powerinfer.gguf   2-D tensors Q4_0 (token_embd and fc1/fc2 included, as quantize
                                             does for a Q4_0 target), output.weight Q8_0 (quantize would pick
                                             Q6_K, which we cannot write), 1-D F32
  DIR/activation/activation_<N>.pt
The Q4_0 model runs its own calibration stream (its quantized weights) only to report its active share; the
threshold and the activation counts come from the F16 weights.

Usage: python scripts/make_synthetic_model.py --out DIR [--shape tinyllama-1.1b|tiny] [--types f16,q4_0]
                                              [--active 0.10] [--seed 0] [--rank R] [--sample-tokens N]
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from powerinfer.gguf import GGMLType, GGUFWriter
from powerinfer.quant import dequantize, quantize

WEIGHT_STD = 0.02  # every matrix except those below
# The predictor reads the un-normalised residual, so its scores scale with the residual's norm, and one
# threshold gives a steady active share only if that norm is steady across tokens and positions. Random
# attention is nearly uniform: its output shrinks like 1/sqrt(position) and would dominate a 0.02-scale
# embedding. So the embedding has unit scale (like Gemma's sqrt(n_embd)-scaled embeddings), the residual
# projections (attn_output, ffn_down_t) use GPT-2's 0.02/sqrt(2 n_layer), and q/k are larger so that attention
# logits have a std of about ATTN_LOGIT_STD (= std_q * std_k * n_embd): each query attends to a few keys, as
# in trained models.
EMBD_STD = 1.0
ATTN_LOGIT_STD = 3.0
# fc1 ~ N(0, 1/n_embd), fc2 ~ N(0, 1/r) plus a per-neuron offset ~ N(0, (HOT_SPREAD/r)^2): the offset sets
# how skewed the neurons' firing rates are
HOT_SPREAD = 0.6


@dataclass(frozen=True)
class Shape:
    name: str  # used in the file names
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    n_ctx: int
    rank: int  # predictor rank (multiple of 32 so that fc2 rows fit Q4_0 blocks)
    rms_eps: float = 1e-5
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_embd_gqa(self) -> int:
        return self.head_dim * self.n_head_kv


SHAPES = {
    "tinyllama-1.1b": Shape(
        "1.1b",
        n_embd=2048,
        n_layer=22,
        n_ff=5632,
        n_head=32,
        n_head_kv=4,
        n_vocab=32000,
        n_ctx=2048,
        rank=128,
    ),
    "tiny": Shape(
        "tiny", n_embd=256, n_layer=2, n_ff=1024, n_head=4, n_head_kv=2, n_vocab=512, n_ctx=256, rank=128
    ),
}
TYPES = {"f16": GGMLType.F16, "q4_0": GGMLType.Q4_0}
FILE_TYPE = {"f16": 1, "q4_0": 2}  # llama_ftype MOSTLY_F16 / MOSTLY_Q4_0


def model_filename(shape: Shape, kind: str) -> str:
    infix = "" if kind == "f16" else ".q4"
    return f"synthetic-{shape.name}{infix}.powerinfer.gguf"


# ------------------------------------------------------------------------------------------------------------
# vocabulary
# ------------------------------------------------------------------------------------------------------------
def vocabulary(n_vocab: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Byte-level SentencePiece vocabulary: specials, 256 byte tokens, then letter pieces (shortest first)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [2, 3, 3] + [6] * 256
    if n_vocab < len(tokens) + 1:
        raise SystemExit(f"vocabulary of {n_vocab} is too small for the byte tokens")
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    pieces: list[str] = []
    frontier = [""]
    while len(pieces) < n_vocab - len(tokens):
        frontier = [p + c for p in frontier for c in letters]
        for p in frontier:
            pieces.extend(("\u2581" + p, p))
    pieces = pieces[: n_vocab - len(tokens)]
    scores = np.zeros(n_vocab, dtype=np.float32)
    scores[len(tokens) :] = -np.arange(len(pieces), dtype=np.float32)  # shorter pieces merge first
    return tokens + pieces, scores, np.array(types + [1] * len(pieces), dtype=np.int32)


# ------------------------------------------------------------------------------------------------------------
# weights
# ------------------------------------------------------------------------------------------------------------
def rng_for(seed: int, name: str) -> np.random.Generator:
    """One independent stream per tensor name: weights do not depend on generation order or options."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    w = rng_for(seed, name).standard_normal(shape, dtype=np.float32)
    w *= np.float32(std)
    return w


def f16_round(w: np.ndarray) -> np.ndarray:
    return w.astype(np.float16).astype(np.float32)


class Outputs:
    """One GGUFWriter per requested file type; 2-D tensors are stored in each file's type."""

    def __init__(self, out: Path, shape: Shape, kinds: list[str], metadata: dict) -> None:
        self.kinds = kinds
        self.paths = {k: out / model_filename(shape, k) for k in kinds}
        self.writers = {k: GGUFWriter(self.paths[k], sparse=True) for k in kinds}
        for kind, w in self.writers.items():
            for key, value in metadata.items():
                w.add(key, value)
            w.add("general.file_type", FILE_TYPE[kind])
            if kind != "f16":
                w.add("general.quantization_version", 2)
        self.q4_dense: dict[str, np.ndarray] = {}  # float32 decode of the latest Q4_0 matrices (calibration)

    def vector(self, name: str, v: np.ndarray) -> None:
        for w in self.writers.values():
            w.add_tensor(name, v, GGMLType.F32)

    def matrix(
        self, name: str, w16: np.ndarray, q4_type: GGMLType = GGMLType.Q4_0, keep_q4: bool = False
    ) -> None:
        """w16: F16-rounded float32 weights; the Q4 file quantizes those (as quantize does from F16)."""
        for kind, w in self.writers.items():
            if kind == "f16":
                w.add_tensor(name, w16, GGMLType.F16)
            else:
                raw = quantize(w16, q4_type)
                w.add_tensor(name, raw, q4_type, shape=w16.shape)
                if keep_q4:
                    self.q4_dense[name] = dequantize(raw, q4_type, w16.shape)

    def write(self) -> None:
        for w in self.writers.values():
            w.write()


# ------------------------------------------------------------------------------------------------------------
# the calibration forward (float32, llama.cpp's adjacent-pair RoPE, ReLU FFN masked by the predictor)
# ------------------------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, base: float) -> torch.Tensor:
    T, H, D = x.shape
    inv = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    rot = torch.polar(torch.ones_like(ang), ang).to(torch.complex64)
    xc = torch.view_as_complex(x.reshape(T, H, D // 2, 2).contiguous())
    return torch.view_as_real(xc * rot[:, None, :]).reshape(T, H, D)


def attention(s: Shape, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    T = x.shape[0]
    h = rms_norm(x, s.rms_eps)  # gain 1
    q = rope((h @ w["attn_q"].T).view(T, s.n_head, s.head_dim), s.rope_base)
    k = rope((h @ w["attn_k"].T).view(T, s.n_head_kv, s.head_dim), s.rope_base)
    v = (h @ w["attn_v"].T).view(T, s.n_head_kv, s.head_dim)
    rep = s.n_head // s.n_head_kv
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return o.transpose(0, 1).reshape(T, s.n_embd) @ w["attn_output"].T


def scores(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    return F.relu(x @ fc1.T) @ fc2.T  # (T, n_ff)


def sparse_ffn(s: Shape, x: torch.Tensor, active: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    u = rms_norm(x, s.rms_eps)
    h = F.relu(u @ w["ffn_gate"].T) * (u @ w["ffn_up"].T) * active
    return h @ w["ffn_down_t"]


def quantile(values: torch.Tensor, q: float) -> float:
    v = values.reshape(-1).double().numpy()
    return float(np.quantile(v, q))


# ------------------------------------------------------------------------------------------------------------
def generate(
    out: Path,
    shape: Shape,
    kinds: list[str],
    active: float,
    seed: int,
    n_sample: int,
    rank: int | None = None,
    log=None,
) -> dict:
    """Write the model files and activation statistics; returns a summary dict."""
    t0 = time.perf_counter()
    s = shape if rank is None else Shape(**{**shape.__dict__, "rank": rank})
    if s.rank % 32:
        raise SystemExit(f"predictor rank {s.rank} must be a multiple of 32 (Q4_0 rows of fc2)")
    if not 0.0 < active < 1.0:
        raise SystemExit(f"--active must be in (0, 1), got {active}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "activation").mkdir(exist_ok=True)
    tokens, tok_scores, tok_types = vocabulary(s.n_vocab)
    metadata = {
        "general.architecture": "llama",
        "general.name": f"synthetic-{s.name}",
        "llama.context_length": s.n_ctx,
        "llama.embedding_length": s.n_embd,
        "llama.block_count": s.n_layer,
        "llama.feed_forward_length": s.n_ff,
        "llama.rope.dimension_count": s.head_dim,
        "llama.attention.head_count": s.n_head,
        "llama.attention.head_count_kv": s.n_head_kv,
        "llama.attention.layer_norm_rms_epsilon": s.rms_eps,
        "llama.rope.freq_base": s.rope_base,
    }
    # the threshold is only known after calibrating layer 0; the key is added before writing (order is free)
    outs = Outputs(out, s, kinds, metadata)
    tok_meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": tok_scores,
        "tokenizer.ggml.token_type": tok_types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }
    q4 = "q4_0" in kinds
    sample = np.random.default_rng([seed, 1]).integers(3, s.n_vocab, n_sample)

    embd = f16_round(normal(seed, "token_embd.weight", (s.n_vocab, s.n_embd), EMBD_STD))
    outs.matrix("token_embd.weight", embd, keep_q4=q4)
    x = torch.from_numpy(embd[sample])  # (T, D) residual stream of the F16 weights
    xq = torch.from_numpy(outs.q4_dense.pop("token_embd.weight")[sample]) if q4 else None
    del embd
    outs.vector("output_norm.weight", np.ones(s.n_embd, dtype=np.float32))
    outs.matrix(
        "output.weight",
        f16_round(normal(seed, "output.weight", (s.n_vocab, s.n_embd), WEIGHT_STD)),
        q4_type=GGMLType.Q8_0,
    )

    threshold = None
    per_layer = []
    shapes = {
        "attn_q": (s.n_embd, s.n_embd),
        "attn_k": (s.n_embd_gqa, s.n_embd),
        "attn_v": (s.n_embd_gqa, s.n_embd),
        "attn_output": (s.n_embd, s.n_embd),
        "ffn_gate": (s.n_ff, s.n_embd),
        "ffn_up": (s.n_ff, s.n_embd),
        "ffn_down_t": (s.n_ff, s.n_embd),
    }
    for bid in range(s.n_layer):
        p = f"blk.{bid}."
        w: dict[str, torch.Tensor] = {}
        outs.vector(p + "attn_norm.weight", np.ones(s.n_embd, dtype=np.float32))
        outs.vector(p + "ffn_norm.weight", np.ones(s.n_embd, dtype=np.float32))
        qk_std, residual_std = float(np.sqrt(ATTN_LOGIT_STD / s.n_embd)), WEIGHT_STD / np.sqrt(2 * s.n_layer)
        stds = {"attn_q": qk_std, "attn_k": qk_std, "attn_output": residual_std, "ffn_down_t": residual_std}
        for short, shp in shapes.items():
            std = stds.get(short, WEIGHT_STD)
            m = f16_round(normal(seed, p + short + ".weight", shp, std))
            outs.matrix(p + short + ".weight", m, keep_q4=q4)
            w[short] = torch.from_numpy(m)
        wq = {k: torch.from_numpy(outs.q4_dense.pop(p + k + ".weight")) for k in shapes} if q4 else {}

        # residual entering the FFN (the predictor input, spec section 2)
        x = x + attention(s, x, w)
        if q4:
            xq = xq + attention(s, xq, wq)

        # predictor: fc1 (r, D) gaussian; fc2 (n_ff, r) gaussian plus a per-neuron offset. ReLU(fc1 x) is
        # non-negative, so the offset shifts neuron j's score by offset_j * sum(h): a per-neuron firing rate.
        fc1 = f16_round(normal(seed, p + "fc1.weight", (s.rank, s.n_embd), 1.0 / np.sqrt(s.n_embd)))
        fc2 = normal(seed, p + "fc2.weight", (s.n_ff, s.rank), 1.0 / np.sqrt(s.rank))
        fc2 += normal(seed, p + "fc2.offset", (s.n_ff, 1), HOT_SPREAD / s.rank)
        fc1_t = torch.from_numpy(fc1)
        q_l = quantile(scores(x, fc1_t, torch.from_numpy(fc2)), 1.0 - active)
        if threshold is None:
            if q_l == 0.0:
                raise SystemExit("degenerate predictor scores (quantile 0)")
            threshold = q_l
        elif q_l * threshold <= 0:
            raise SystemExit(f"layer {bid}: quantile {q_l:g} and threshold {threshold:g} differ in sign")
        fc2 = f16_round(fc2 * np.float32(threshold / q_l))
        outs.matrix(p + "fc1.weight", fc1, keep_q4=q4)
        outs.matrix(p + "fc2.weight", fc2, keep_q4=q4)
        mask = scores(x, fc1_t, torch.from_numpy(fc2)) >= threshold
        counts = mask.sum(0).to(torch.float32)
        torch.save(counts, out / "activation" / f"activation_{bid}.pt")
        layer = {"active": float(mask.float().mean())}
        x = x + sparse_ffn(s, x, mask, w)
        if q4:
            fq1 = torch.from_numpy(outs.q4_dense.pop(p + "fc1.weight"))
            fq2 = torch.from_numpy(outs.q4_dense.pop(p + "fc2.weight"))
            mq = scores(xq, fq1, fq2) >= threshold
            layer["active_q4"] = float(mq.float().mean())
            xq = xq + sparse_ffn(s, xq, mq, wq)
        srt = torch.sort(counts, descending=True).values
        layer["top20"] = float(srt[: s.n_ff // 5].sum() / max(float(srt.sum()), 1.0))
        layer["never"] = float((counts == 0).float().mean())
        layer["rms"] = float(x.pow(2).mean().sqrt())
        per_layer.append(layer)
        if log:
            log(
                f"  layer {bid:2d}: active {layer['active']:.3f}"
                + (f" (q4 {layer['active_q4']:.3f})" if q4 else "")
                + f", top 20% neurons carry {layer['top20']:.0%} of activations"
                + f", residual rms {layer['rms']:.2f}"
                + f"  [{time.perf_counter() - t0:.1f}s]"
            )
        del w, wq
    if not torch.isfinite(x).all():
        raise SystemExit("residual stream is not finite; lower the weight scale")

    for wr in outs.writers.values():
        wr.add("powerinfer.sparse_threshold", float(threshold))
        for key, value in tok_meta.items():
            wr.add(key, value)
    outs.write()
    summary = {
        "paths": {k: str(v) for k, v in outs.paths.items()},
        "sizes": {k: v.stat().st_size for k, v in outs.paths.items()},
        "threshold": float(threshold),
        "active": float(np.mean([lay["active"] for lay in per_layer])),
        "layers": per_layer,
        "seconds": time.perf_counter() - t0,
    }
    if q4:
        summary["active_q4"] = float(np.mean([lay["active_q4"] for lay in per_layer]))
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output folder (models + activation/)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    ap.add_argument("--types", default="f16,q4_0", help="comma-separated subset of f16,q4_0")
    ap.add_argument(
        "--active", type=float, default=0.10, help="share of neurons predicted active (default 0.10)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rank", type=int, default=None, help="predictor rank (default 128)")
    ap.add_argument("--sample-tokens", type=int, default=128, help="calibration sample length (default 128)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no per-layer lines")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.types.split(",") if k.strip()]
    bad = [k for k in kinds if k not in TYPES]
    if bad or not kinds:
        ap.error(f"--types: unknown type(s) {bad}; choose from {sorted(TYPES)}")
    shape = SHAPES[args.shape]
    if args.sample_tokens < 2 or args.sample_tokens > shape.n_ctx:
        ap.error(f"--sample-tokens must be in [2, {shape.n_ctx}]")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    log(
        f"shape {args.shape}: n_embd {shape.n_embd}, {shape.n_layer} layers, n_ff {shape.n_ff}, "
        f"heads {shape.n_head}/{shape.n_head_kv}, vocab {shape.n_vocab}; "
        f"target active share {args.active:.3f}, "
        f"seed {args.seed}, calibration sample {args.sample_tokens} tokens"
    )
    r = generate(
        args.out,
        shape,
        kinds,
        args.active,
        args.seed,
        args.sample_tokens,
        args.rank,
        None if args.quiet else log,
    )
    for kind in kinds:
        log(f"wrote {r['paths'][kind]} ({r['sizes'][kind] / 2**20:.1f} MiB)")
    log(f"wrote {args.out / 'activation'}/activation_{{0..{shape.n_layer - 1}}}.pt")
    log(f"powerinfer.sparse_threshold = {r['threshold']:.6g}")
    msg = f"measured predicted-active share over the sample: {r['active']:.4f} (F16 weights)"
    if "active_q4" in r:
        msg += f", {r['active_q4']:.4f} (Q4_0 weights)"
    log(msg)
    top = np.mean([lay["top20"] for lay in r["layers"]])
    log(
        f"hot neurons: the top 20% carry {top:.0%} of activations (mean over layers); "
        f"took {r['seconds']:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
