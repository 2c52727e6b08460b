#!/usr/bin/env python3
"""Write tests/data/kquant_golden.npz: llama.cpp's own Q2_K..Q6_K, IQ4_NL and IQ4_XS blocks of seeded rows.

The oracle is ggml_quantize_chunk in the ggml-base library that llama-cpp-python ships (called through ctypes
with no importance matrix, as llama.cpp's `quantize` tool does without --imatrix). The file lets a machine
without llama-cpp-python still check that `powerinfer.quant.quantize` is bit-exact with it
(tests/test_kquant_quantize.py).

Contents: `x` (rows of 256 float32, see `golden_rows`: gaussian, heavy-tailed, zero and constant groups, tiny,
subnormal and huge magnitudes, single outliers, one-signed, ties, sparse, and rows of the bundled model's
weights), one uint8 array per type name with llama.cpp's blocks of every row, and `llama_cpp_version`.

Usage: python scripts/make_kquant_golden.py [--out tests/data/kquant_golden.npz] [--seed 0]
(needs `pip install llama-cpp-python`)
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import importlib.util
from pathlib import Path

import numpy as np

from powerinfer.gguf import GGMLType, read_gguf
from powerinfer.quant import C_QUANTIZABLE, dequantize, row_bytes

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "pydoc-relu-llama-8m.powerinfer.gguf"
N_COLS = 256


def llama_cpp_version() -> str | None:
    """The installed llama-cpp-python's version, None when it is not installed."""
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return None


def ggml_quantizer():
    """ggml_quantize_chunk of llama-cpp-python's ggml-base as f(ggml_type, x (rows, cols) float32) -> blocks.

    The library is found in the package's directory without importing the package (its __init__ needs more
    than this does)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("llama-cpp-python is not installed")
    lib_dir = Path(list(spec.submodule_search_locations)[0]) / "lib"
    paths = sorted(lib_dir.glob("libggml-base.*"))
    if not paths:
        raise FileNotFoundError(f"no libggml-base in {lib_dir}")
    lib = ctypes.CDLL(str(paths[0]))
    fn = lib.ggml_quantize_chunk
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes, fn.restype = (ctypes.c_int, ptr, ptr, i64, i64, i64, ptr), ctypes.c_size_t

    def quantize(ggml_type: GGMLType, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.zeros((x.shape[0], row_bytes(ggml_type, x.shape[1])), dtype=np.uint8)
        written = fn(int(ggml_type), x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None)
        assert written == out.size, (written, out.size)
        return out

    return quantize


def model_rows(n: int, seed: int) -> np.ndarray:
    """n rows of the bundled model's F16 weight matrices (256 columns), picked at random."""
    rng = np.random.default_rng(seed)
    model = read_gguf(MODEL)
    names = sorted(t.name for t in model.tensors.values() if len(t.shape) == 2 and t.shape[1] == N_COLS)
    rows = []
    for name in rng.choice(names, size=n):
        t = model.tensors[name]
        w = dequantize(t.data, t.ggml_type, t.shape)
        rows.append(w[rng.integers(0, w.shape[0])])
    return np.stack(rows).astype(np.float32)


def golden_rows(seed: int) -> np.ndarray:
    """The golden inputs: (rows, 256) float32, a few rows of each kind (one super-block per row)."""
    rng = np.random.default_rng(seed)

    def normal(n: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n, N_COLS)) * scale).astype(np.float32)

    kinds = [
        normal(12),
        normal(12, 0.02),
        (rng.standard_t(2, (8, N_COLS)) * 0.02).astype(np.float32),  # heavy tails
        rng.standard_cauchy((6, N_COLS)).astype(np.float32),
        np.zeros((2, N_COLS), np.float32),
    ]
    # zero groups of 16 and 32 inside otherwise gaussian rows
    z = normal(8)
    for r in range(8):
        for g in rng.choice(16, size=1 + r % 4, replace=False):
            z[r, 16 * g : 16 * g + 16 if r % 2 else 16 * g + 32] = 0
    kinds.append(z)
    # constant rows, and rows constant per group of 16 / 32
    kinds.append(np.repeat(rng.standard_normal((4, 1)).astype(np.float32), N_COLS, axis=1))
    kinds.append(np.repeat(rng.standard_normal((4, 16)).astype(np.float32), 16, axis=1))
    kinds.append(np.repeat(rng.standard_normal((4, 8)).astype(np.float32), 32, axis=1))
    # magnitudes: tiny, subnormal, near the fp16 range of the scales, huge
    for scale in (1e-5, 1e-8, 1e-12, 1e-40, 3e3, 1e5, 1e7):
        kinds.append(normal(3, scale))
    # one outlier in small noise
    o = normal(8, 0.01)
    o[np.arange(8), rng.integers(0, N_COLS, 8)] = rng.choice([-1.0, 1.0], 8) * rng.uniform(0.5, 20, 8)
    kinds.append(o)
    # one-signed rows
    kinds.append(-np.abs(normal(6)))
    kinds.append(np.abs(normal(6)))
    # ties: integers and half-integers (rounding ties everywhere), and a coarse grid
    kinds.append(rng.integers(-8, 8, (4, N_COLS)).astype(np.float32))
    kinds.append((rng.integers(-64, 64, (4, N_COLS)) + 0.5).astype(np.float32))
    kinds.append((rng.integers(-4, 5, (4, N_COLS)) * 0.25).astype(np.float32))
    # sparse rows, uniform rows
    kinds.append(normal(4) * (rng.random((4, N_COLS)) < 0.05))
    kinds.append(rng.uniform(-1, 1, (4, N_COLS)).astype(np.float32))
    kinds.append(model_rows(24, seed + 1))
    return np.ascontiguousarray(np.concatenate(kinds).astype(np.float32))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "kquant_golden.npz")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    quantize = ggml_quantizer()
    version = llama_cpp_version()
    x = golden_rows(args.seed)
    arrays = {"x": x, "llama_cpp_version": np.array(version)}
    for ggml_type in sorted(C_QUANTIZABLE):
        arrays[ggml_type.name] = quantize(ggml_type, x)
    np.savez_compressed(args.out, **arrays)
    print(f"{args.out}: {x.shape[0]} rows, {args.out.stat().st_size} bytes (llama-cpp-python {version})")


if __name__ == "__main__":
    main()
