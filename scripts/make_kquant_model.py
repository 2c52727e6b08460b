#!/usr/bin/env python3
"""Write a K-quant copy of a GGUF/PWRI file (the F16 synthetic model of make_synthetic_model.py), for benches.

`powerinfer quantize` cannot write K-quants yet, so this script encodes them itself with plain round-to-nearest
(per 32- or 16-element sub-block: the range of the values sets its scale (and min), the sub-scales are rounded
to 6 or 8 bits against the super-block's fp16 scales, then each value to the nearest level). That is not
llama.cpp's search for the best scales, so the error is somewhat larger than a real Q4_K_M file's, but the bytes
are valid blocks of the same sizes, which is all a speed measurement needs. The gguf package decodes them (the
script reports each type's relative RMS error on the first matrix it writes in that type).

The mix follows llama.cpp's Q4_K_M rules (src/llama-quant.cpp): Q4_K everywhere, Q6_K for output.weight and
for attn_v and ffn_down (here ffn_down_t, the same matrix transposed) in the layers where `use_more_bits` holds
(the first and last eighth and every third layer between); rows whose length is not a multiple of 256 fall back
to Q5_0 (Q4_K) or Q8_0 (Q6_K) as llama.cpp does; 1-D tensors stay as they are. `--type q4_k` writes Q4_K for
every matrix instead.

Usage: python scripts/make_kquant_model.py SRC DST [--type q4_k_m|q4_k]
       (activation/ statistics are copied beside DST when SRC has them)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from powerinfer.gguf import GGMLType, GGUFWriter, read_gguf
from powerinfer.quant import dequantize, quantize

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K blocks of x (rows, n) float32, n a multiple of 256: uint8 (rows, n / 256 * 144).

    x ~= d * sc_j * q - dmin * m_j per sub-block j of 32, q in 0..15, sc_j and m_j in 0..63."""
    rows = x.shape[0]
    v = x.reshape(rows, -1, 8, 32).astype(np.float32)  # (rows, super-blocks, sub-blocks, 32)
    lo = np.minimum(v.min(axis=-1), 0.0)
    hi = v.max(axis=-1)
    scale, mins = (hi - lo) / 15.0, -lo
    d = _f16(scale.max(axis=-1) / 63.0)
    dmin = _f16(mins.max(axis=-1) / 63.0)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dminf > 0, np.rint(mins / dminf), 0).clip(0, 63).astype(np.uint8)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.rint((v + (dminf * m)[..., None]) / step), 0).clip(0, 15).astype(np.uint8)
    out = np.zeros((rows, v.shape[1], 144), dtype=np.uint8)
    out[..., 0:2] = d[..., None].view(np.uint8)
    out[..., 2:4] = dmin[..., None].view(np.uint8)
    # scales[12]: bytes 0..3 sc_j (j < 4) with the top 2 bits of sc_j+4, 4..7 m_j with the top 2 bits of m_j+4,
    # 8..11 the low nibbles of sc_j+4 and m_j+4
    out[..., 4:8] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    out[..., 8:12] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    out[..., 12:16] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    # qs[128]: sub-blocks 2i (low nibbles) and 2i + 1 (high nibbles) share 32 bytes
    out[..., 16:] = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(rows, v.shape[1], 128)
    return out.reshape(rows, -1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of x (rows, n) float32, n a multiple of 256: uint8 (rows, n / 256 * 210).

    x ~= d * sc_g * (q - 32) per group g of 16, q in 0..63, sc_g an int8."""
    rows = x.shape[0]
    v = x.reshape(rows, -1, 16, 16).astype(np.float32)  # (rows, super-blocks, groups, 16)
    scale = np.abs(v).max(axis=-1) / 31.0
    d = _f16(scale.max(axis=-1) / 127.0)
    df = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(-128, 127).astype(np.int8)
        step = (df * sc)[..., None]
        q = (np.where(step != 0, np.rint(v / step), 0).clip(-32, 31) + 32).astype(np.uint8)
    q = q.reshape(rows, v.shape[1], 2, 4, 32)  # (rows, super-blocks, half, quarter, 32)
    out = np.zeros((rows, v.shape[1], 210), dtype=np.uint8)
    # ql[128]: per half, 64 bytes; quarters 0/1 in the low nibbles of bytes 0..31 / 32..63, quarters 2/3 high
    ql = np.concatenate(
        [q[:, :, :, 0] & 15 | (q[:, :, :, 2] & 15) << 4, q[:, :, :, 1] & 15 | (q[:, :, :, 3] & 15) << 4],
        axis=-1,
    )
    out[..., :128] = ql.reshape(rows, v.shape[1], 128)
    # qh[64]: per half, 32 bytes holding the top 2 bits of the four quarters at shifts 0, 2, 4, 6
    qh = sum((q[:, :, :, k] >> 4) << (2 * k) for k in range(4)).astype(np.uint8)
    out[..., 128:192] = qh.reshape(rows, v.shape[1], 64)
    out[..., 192:208] = sc.view(np.uint8)
    out[..., 208:210] = d[..., None].view(np.uint8)
    return out.reshape(rows, -1)


ENCODERS = {GGMLType.Q4_K: encode_q4_k, GGMLType.Q6_K: encode_q6_k}
FALLBACK = {GGMLType.Q4_K: GGMLType.Q5_0, GGMLType.Q6_K: GGMLType.Q8_0}  # rows not of whole super-blocks


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in the _M mixes."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def target_type(name: str, n_layer: int, mix: str) -> GGMLType:
    if mix == "q4_k" or "." not in name:
        return GGMLType.Q4_K
    if name == "output.weight":
        return GGMLType.Q6_K
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down", "ffn_down_t"):
        return GGMLType.Q6_K if use_more_bits(int(parts[1]), n_layer) else GGMLType.Q4_K
    return GGMLType.Q4_K


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--type", choices=("q4_k_m", "q4_k"), default="q4_k_m")
    args = ap.parse_args()
    src = read_gguf(args.src)
    n_layer = int(src.get("llama.block_count", 0))
    writer = GGUFWriter(args.dst, sparse=src.is_sparse)
    src.copy_metadata(writer)
    counts: dict[str, int] = {}
    reported: set[GGMLType] = set()
    t0 = time.perf_counter()
    for t in src.tensors.values():
        if len(t.shape) != 2:
            writer.add_tensor(t.name, t.data, t.ggml_type, t.shape)
            continue
        x = dequantize(t.data, t.ggml_type, t.shape)
        ggml_type = target_type(t.name, n_layer, args.type)
        if t.shape[1] % QK_K:
            ggml_type = FALLBACK[ggml_type]
            writer.add_tensor(t.name, quantize(x, ggml_type), ggml_type, t.shape)
        else:
            raw = ENCODERS[ggml_type](x)
            if ggml_type not in reported:  # the encoder against the gguf package's decoder
                back = dequantize(raw, ggml_type, t.shape)
                rel = float(np.sqrt(np.mean((back - x) ** 2) / np.mean(x**2)))
                print(f"{ggml_type.name}: relative RMS error {rel:.4f} on {t.name}", file=sys.stderr)
                reported.add(ggml_type)
            writer.add_tensor(t.name, raw, ggml_type, t.shape)
        counts[ggml_type.name] = counts.get(ggml_type.name, 0) + 1
    writer.write()
    stats = args.src.parent / "activation"
    if stats.is_dir() and args.dst.parent.resolve() != args.src.parent.resolve():
        shutil.copytree(stats, args.dst.parent / "activation", dirs_exist_ok=True)
    print(f"wrote {args.dst} in {time.perf_counter() - t0:.0f} s: {counts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
