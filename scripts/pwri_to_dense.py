#!/usr/bin/env python3
"""Write the dense llama.cpp twin of a PowerInfer GGUF: GGUF magic, ffn_down (the transpose of ffn_down_t) in the
same type, no predictor tensors or sparse keys. Lets llama.cpp run the same weights for a side-by-side benchmark.

Usage: python scripts/pwri_to_dense.py IN.powerinfer.gguf OUT.gguf
"""

from __future__ import annotations

import sys

import numpy as np

from powerinfer.gguf import GGUFWriter, read_gguf
from powerinfer.quant import dequantize, quantize

SPARSE_KEYS = frozenset({"powerinfer.sparse_threshold", "powerinfer.ffn_activation"})


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.exit(__doc__)
    src = read_gguf(argv[0])
    w = GGUFWriter(argv[1])
    src.copy_metadata(w, skip=SPARSE_KEYS)
    for info in src.tensors.values():
        if info.name.endswith((".fc1.weight", ".fc2.weight")):
            continue
        if info.name.endswith(".ffn_down_t.weight"):
            down = np.ascontiguousarray(dequantize(info.data, info.ggml_type, info.shape).T)  # (n_embd, n_ff)
            raw = quantize(down, info.ggml_type)
            w.add_tensor(info.name.replace("ffn_down_t", "ffn_down"), raw, info.ggml_type, down.shape)
        else:
            w.add_tensor(info.name, info.data, info.ggml_type, info.shape)
    w.write()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
