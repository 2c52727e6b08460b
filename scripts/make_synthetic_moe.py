#!/usr/bin/env python3
"""Write seeded random mixture-of-experts GGUF files with the gguf package, laid out as llama.cpp reads them.

Architectures: `qwen3moe`, `qwen2moe` (shared expert), `olmoe` (whole-projection q/k norms), `mixtral` (arch
`llama` with `llama.expert_count`) and `smallthinker` (router on the layer input, ReGLU experts, a sliding-window
key so that layers il % 4 == 0 have no RoPE). Shapes: `tiny` (2 layers, n_embd 64, 8 experts of 32, top 2, vocab
320: tests and the llama.cpp oracle) and `bench` (Qwen3-MoE-like: 24 layers, n_embd 1024, 16/4 heads of 64,
64 experts of 512, top 8, vocab 32000; about 1.5 GB in Q4_0, for the speed comparison with llama.cpp) and `large`
(the same with 256 experts: about 5.5 GB in Q4_0, for the --memory-limit benchmark, with --router-skew).

Weights: one numpy stream per tensor name (seed + crc32 of the name), normal with std 0.08 (routers 0.5, so that
the top-k choice is far from ties; output.weight 0.5, so that greedy choices are mostly far from ties too; norms
uniform in 0.8..1.2). F32 and F16 files hold the same (F16-rounded)
values. Q4_0 (bench) files hold random blocks (scale 0.08 / 8 times a random factor 0.5..1.5, random nibbles)
written straight, without a float copy of the 2.4 billion expert weights. Vocabulary: SentencePiece-style
`<unk> <s> </s>`, the 256 byte tokens, then letter pieces.

With --record (needs llama_cpp importable, e.g. a separate venv with llama-cpp-python 0.3.16 and gguf), the files
written (the test records --types f32,f16,q4_0 of the tiny shape) are run by llama.cpp: greedy ids over 32 tokens
after each of PROMPTS, with llama.cpp's top-2 logit margin at each step and each file's sha256, stored as JSON
(tests/data/moe-llama-cpp-greedy.json; tests/test_moe_llama_cpp.py regenerates the files and checks both).

With --files F.gguf ... --record JSON it records existing files instead (the prompts of PROMPTS_300), with a
digest of their tensors: tests/test_arch_moe.py writes its converted checkpoints (F32, F16, Q4_K_M) into the folder
named by POWERINFER_MOE_CONVERTED_OUT when that is set, and this records them into
tests/data/moe-llama-cpp-converted.json.

Usage: python scripts/make_synthetic_moe.py --out DIR [--arch qwen3moe,...] [--shape tiny|bench]
                                            [--types f32,f16|q4_0] [--seed 0] [--record JSON]
       python scripts/make_synthetic_moe.py --files F.gguf ... --record JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ARCHS = ("qwen3moe", "qwen2moe", "olmoe", "mixtral", "smallthinker")
STD, ROUTER_STD, OUTPUT_STD = 0.08, 0.5, 0.5
N_PREDICT = 32
# prompt token ids (byte tokens and letter pieces of the tiny vocabulary)
PROMPTS = (
    [1, 72, 105, 300, 260],
    [1, 84, 104, 101, 280, 299, 77, 270, 108],
    [1, 265, 266, 33, 290, 310, 45, 46, 47, 48, 262, 301, 302, 100],
)
# for files of a 300-token vocabulary (tests/test_arch_moe.py's converted checkpoints)
PROMPTS_300 = (
    [1, 72, 105, 200, 260],
    [1, 84, 104, 101, 280, 299, 77, 270, 108],
    [1, 265, 266, 33, 290, 45, 46, 47],
)


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_used: int
    n_ff_exp: int
    n_ff_shexp: int
    n_vocab: int
    n_ctx: int
    # a factor on the blocks that write into the residual stream (attn_output, ffn_down_exps) of Q4_0 files: small
    # keeps the residual stream token-specific (a random model's attention otherwise averages it to one vector
    # for every token, and its routers then pick the same experts for every token, which no trained router does)
    out_scale: float = 1.0
    # Q4_0 nibbles drawn from 1..15 (mean 8: zero-mean weights) instead of 0..15 (mean 7.5: every row then shares
    # a -0.5 d offset, a direction that grows layer by layer until every token routes alike)
    centered: bool = False


SHAPES = {
    "tiny": Shape(2, 64, 4, 2, 16, 8, 2, 32, 48, 320, 256),
    "bench": Shape(24, 1024, 16, 4, 64, 64, 8, 512, 1024, 32000, 4096),
    # --memory-limit benchmark: 256 experts a layer, about 5.5 GB in Q4_0
    "large": Shape(24, 1024, 16, 4, 64, 256, 8, 512, 1024, 32000, 4096, out_scale=0.05, centered=True),
}
U8 = np.uint8


def vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = ["\u2581" + a for a in letters] + [a + b for a in letters for b in letters]
    pieces += [a + b + c for a in letters for b in letters for c in letters]
    pieces += ["\u2581" + a + b + c for a in letters for b in letters for c in letters]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += pieces[: n_vocab - len(tokens)]
    if len(tokens) != n_vocab:
        raise ValueError(f"vocabulary of {n_vocab} is larger than the pieces made here")
    scores = [0.0] * 259 + [-float(i) for i in range(n_vocab - 259)]
    types = [2, 3, 3] + [6] * 256 + [1] * (n_vocab - 259)
    return tokens, scores, types


def rng_for(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def tensor_shapes(arch: str, s: Shape) -> dict[str, tuple[int, ...]]:
    """GGUF name -> row-major shape, in the order llama.cpp's converters write them."""
    q, kv, D, E, F = s.n_head * s.head_dim, s.n_head_kv * s.head_dim, s.n_embd, s.n_expert, s.n_ff_exp
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (s.n_vocab, D)}
    for b in range(s.n_layer):
        p = f"blk.{b}."
        layer = {
            "attn_norm.weight": (D,),
            "attn_q.weight": (q, D),
            "attn_k.weight": (kv, D),
            "attn_v.weight": (kv, D),
            "attn_output.weight": (D, q),
        }
        if arch == "qwen2moe":
            layer |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
        if arch == "qwen3moe":
            layer |= {"attn_q_norm.weight": (s.head_dim,), "attn_k_norm.weight": (s.head_dim,)}
        if arch == "olmoe":
            layer |= {"attn_q_norm.weight": (q,), "attn_k_norm.weight": (kv,)}
        layer |= {
            "ffn_norm.weight": (D,),
            "ffn_gate_inp.weight": (E, D),
            "ffn_down_exps.weight": (E, D, F),
            "ffn_gate_exps.weight": (E, F, D),
            "ffn_up_exps.weight": (E, F, D),
        }
        if arch == "qwen2moe":
            Fs = s.n_ff_shexp
            layer |= {
                "ffn_gate_inp_shexp.weight": (D,),
                "ffn_gate_shexp.weight": (Fs, D),
                "ffn_up_shexp.weight": (Fs, D),
                "ffn_down_shexp.weight": (D, Fs),
            }
        out |= {p + k: v for k, v in layer.items()}
    out["output_norm.weight"] = (D,)
    out["output.weight"] = (s.n_vocab, D)
    return out


def router_scales(seed: int, name: str, n_expert: int, skew: float) -> np.ndarray:
    """Per-expert factors on a router's rows for a skewed selection: the expert of rank r (a random order per
    layer) gets (r + 1) ** -skew, normalised to mean 1. A row's logit then spreads that much wider, so that the
    experts of low rank win the top-k more often (skew 0.3 on 256 experts, top 8, Gaussian inputs: the top 10%
    take ~46% of the selections, the top 37% ~82%)."""
    rank = rng_for(seed, name + ".rank").permutation(n_expert)
    scale = (rank + 1.0) ** -skew
    return scale / scale.mean()


def float_tensor(seed: int, name: str, shape: tuple[int, ...], skew: float = 0.0) -> np.ndarray:
    """The tensor's values, F16-representable float32; `skew` > 0 scales the routers' rows (router_scales)."""
    rng = rng_for(seed, name)
    if "norm" in name:
        data = rng.uniform(0.8, 1.2, shape)
    elif name.endswith("ffn_gate_inp.weight"):
        data = rng.normal(0, ROUTER_STD, shape)
        if skew > 0:
            data *= router_scales(seed, name, shape[0], skew)[:, None]
    elif name == "output.weight":
        data = rng.normal(0, OUTPUT_STD, shape)
    elif name.endswith(".bias"):
        data = rng.normal(0, 0.3, shape)
    else:
        data = rng.normal(0, STD, shape)
    return data.astype(np.float16).astype(np.float32)


def q4_0_blocks(
    seed: int, name: str, shape: tuple[int, ...], scale: float = 1.0, centered: bool = False
) -> np.ndarray:
    """Random Q4_0 blocks of a tensor: (rows, K / 32 * 18) bytes (f16 scale, 16 bytes of nibbles)."""
    rng = rng_for(seed, name)
    rows, K = int(np.prod(shape[:-1])), shape[-1]
    out = np.empty((rows, K // 32, 18), dtype=U8)
    step = max(1, (1 << 24) // K)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        d = (scale * STD / 8 * rng.uniform(0.5, 1.5, (r1 - r0, K // 32))).astype(np.float16)
        out[r0:r1, :, :2] = d.view(U8).reshape(r1 - r0, K // 32, 2)
        if centered:
            lo, hi = rng.integers(1, 16, (2, r1 - r0, K // 32, 16), dtype=U8)
            out[r0:r1, :, 2:] = lo | (hi << 4)
        else:
            out[r0:r1, :, 2:] = rng.integers(0, 256, (r1 - r0, K // 32, 16), dtype=U8)
    return out.reshape(rows, -1)


def stored_as(name: str, shape: tuple[int, ...], kind: str) -> str:
    """How a tensor is stored: vectors and routers F32; matrices as `kind`, in Q4_0 files F16 where a row is no
    whole number of 32-element blocks."""
    if len(shape) == 1 or name.endswith("ffn_gate_inp.weight"):
        return "f32"
    if kind == "q4_0" and shape[-1] % 32:
        return "f16"
    return kind


def gguf_arch(arch: str) -> str:
    return "llama" if arch == "mixtral" else arch


def write(path: Path, arch: str, s: Shape, kind: str, seed: int, skew: float = 0.0) -> Path:
    """One file of `arch` with `kind` ("f32", "f16", "q4_0") matrices (1-D tensors and routers F32)."""
    import gguf

    if arch == "olmoe":  # llama.cpp's olmoe: attn_k_norm spans n_embd, so no grouped-query attention
        s = dataclasses.replace(s, n_head_kv=s.n_head)
    a = gguf_arch(arch)
    w = gguf.GGUFWriter(str(path), a)
    w.add_name(f"synthetic-{arch}")
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff_exp)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch == "mixtral":
        w.add_rope_dimension_count(s.head_dim)
    if s.head_dim * s.n_head != s.n_embd:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_used)
    if arch != "mixtral":
        w.add_expert_feed_forward_length(s.n_ff_exp)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(s.n_ff_shexp)
    if arch == "smallthinker":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_sliding_window(4096)
    w.add_file_type({"f32": 0, "f16": 1, "q4_0": 2}[kind])
    tokens, scores, types = vocab(s.n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    shapes = tensor_shapes(arch, s)
    if arch == "olmoe" or arch == "qwen2moe":  # llama.cpp reads n_embd-sized q for these: no free head size
        assert s.head_dim * s.n_head == s.n_embd
    for name, shape in shapes.items():
        form = stored_as(name, shape, kind)
        if form == "q4_0":
            byte_shape = (*shape[:-1], shape[-1] // 32 * 18)  # gguf reads a uint8 shape as bytes per row
            nbytes = int(np.prod(byte_shape))
            w.add_tensor_info(name, byte_shape, np.dtype(U8), nbytes, gguf.GGMLQuantizationType.Q4_0)
        else:
            dtype = np.float16 if form == "f16" else np.float32
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            w.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape in shapes.items():
        form = stored_as(name, shape, kind)
        if form == "q4_0":
            out = name.endswith(("attn_output.weight", "ffn_down_exps.weight"))
            w.write_tensor_data(q4_0_blocks(seed, name, shape, s.out_scale if out else 1.0, s.centered))
        else:
            data = float_tensor(seed, name, shape, skew)
            w.write_tensor_data(data.astype(np.float16) if form == "f16" else data)
    w.close()
    return path


def filename(arch: str, shape: str, kind: str) -> str:
    return f"moe-{arch}-{shape}-{kind}.gguf"


def generate(
    out: Path, archs: list[str], shape: str, kinds: list[str], seed: int = 0, skew: float = 0.0
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    return [write(out / filename(a, shape, k), a, SHAPES[shape], k, seed, skew) for a in archs for k in kinds]


def tensor_digest(path: Path) -> str:
    """sha256 over the tensors' names and bytes (not the metadata: a converted file names its folder)."""
    import gguf

    h = hashlib.sha256()
    for t in gguf.GGUFReader(str(path)).tensors:
        h.update(t.name.encode())
        h.update(np.ascontiguousarray(t.data).tobytes())
    return h.hexdigest()


def record(paths: list[Path], json_path: Path, prompts: tuple[list[int], ...] = PROMPTS) -> None:
    """llama.cpp's greedy ids (and top-2 margins) after each prompt, per file name."""
    import llama_cpp

    result: dict[str, object] = {
        "llama_cpp_version": llama_cpp.__version__,
        "n_predict": N_PREDICT,
        "runs": {},
        "sha256": {},
        "tensor_sha256": {},
    }
    for path in paths:
        llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=1, n_batch=64, logits_all=True, verbose=False)
        runs = []
        for prompt in prompts:
            llm.reset()
            ids, margins = list(prompt), []
            llm.eval(ids)
            for _ in range(N_PREDICT):
                logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
                top = np.argsort(-logits)[:2]
                margins.append(float(logits[top[0]] - logits[top[1]]))
                ids.append(int(top[0]))
                llm.eval([int(top[0])])
            runs.append({"prompt": list(prompt), "ids": ids[len(prompt) :], "margins": margins})
        result["runs"][path.name] = runs  # type: ignore[index]
        result["sha256"][path.name] = hashlib.sha256(path.read_bytes()).hexdigest()  # type: ignore[index]
        result["tensor_sha256"][path.name] = tensor_digest(path)  # type: ignore[index]
        del llm
    json_path.write_text(json.dumps(result, indent=1) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="folder for the generated files")
    ap.add_argument(
        "--files", type=Path, nargs="*", help="record existing files of a 300-token vocabulary instead"
    )
    ap.add_argument("--arch", default=",".join(ARCHS))
    ap.add_argument("--shape", default="tiny", choices=tuple(SHAPES))
    ap.add_argument("--types", default="f32,f16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--router-skew", type=float, default=0.0, help="skewed expert selection (router_scales), e.g. 0.3"
    )
    ap.add_argument(
        "--record", type=Path, default=None, help="run llama.cpp on the files, write its greedy ids"
    )
    args = ap.parse_args()
    if args.files:
        if args.record is None:
            print("--files needs --record", file=sys.stderr)
            return 1
        record(args.files, args.record, PROMPTS_300)
        return 0
    if args.out is None:
        print("--out is required", file=sys.stderr)
        return 1
    archs = args.arch.split(",")
    if any(a not in ARCHS for a in archs):
        print(f"unknown architecture in {args.arch} (known: {', '.join(ARCHS)})", file=sys.stderr)
        return 1
    paths = generate(args.out, archs, args.shape, args.types.split(","), args.seed, args.router_skew)
    for p in paths:
        print(p, p.stat().st_size, file=sys.stderr)
    if args.record is not None:
        record(paths, args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
