"""The C quantizers (kernels/cpu/quantize_k.c) behind `powerinfer.quant.quantize` for Q2_K..Q6_K, IQ4_NL, IQ4_XS.

Bit-exact with llama.cpp's quantizers as its `quantize` tool runs them without an importance matrix: against
tests/data/kquant_golden.npz (llama.cpp's blocks of seeded rows of every kind, written by
scripts/make_kquant_golden.py), and, where llama-cpp-python is installed, against its ggml_quantize_chunk called
directly on more inputs (multi-block rows and whole weight matrices of the bundled model). Also: the round trip
through the gguf package's decoder has the error each type is known to have, the blocks do not depend on the
thread count, bad shapes are refused, and without the kernels quantize() says so in one line.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from test_sparse_ops import needs_kernels

from powerinfer.errors import FormatError
from powerinfer.gguf import GGMLType, read_gguf
from powerinfer.ops import library
from powerinfer.ops.encode import quantize
from powerinfer.quant import C_QUANTIZABLE, KERNEL_TYPES, QUANTIZABLE, dequantize, row_bytes
from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "kquant_golden.npz"
MODEL = ROOT / "models" / "pydoc-relu-llama-8m.powerinfer.gguf"
TYPES = sorted(C_QUANTIZABLE)
type_ids = pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)


def llama_cpp_quantizer():
    """ggml_quantize_chunk of the installed llama-cpp-python (skip without it)."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    return load_script("make_kquant_golden").ggml_quantizer()


def first_difference(got: np.ndarray, want: np.ndarray) -> str:
    rows = np.nonzero((got != want).any(axis=1))[0]
    if not len(rows):
        return "equal"
    cols = np.nonzero(got[rows[0]] != want[rows[0]])[0]
    return f"{len(rows)} of {len(got)} rows differ; row {rows[0]} first at byte {cols[0]}"


def varied_inputs(n_cols: int, seed: int) -> np.ndarray:
    """Rows of n_cols of many kinds (several super-blocks each), for the direct comparison with llama.cpp."""
    rng = np.random.default_rng(seed)
    n = 8

    def normal(scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n, n_cols)) * scale).astype(np.float32)

    kinds = [normal(), normal(0.02), (rng.standard_t(2, (n, n_cols)) * 0.02).astype(np.float32)]
    kinds.append(rng.standard_cauchy((n, n_cols)).astype(np.float32))
    z = normal()
    z[:, : n_cols // 4] = 0  # whole zero super-blocks
    z[np.arange(n), rng.integers(0, n_cols // 16, n) * 16] = 0
    z[:, 256 + 32 : 256 + 48] = 0  # zero groups of 16
    z[:, 512 + 64 : 512 + 96] = 0  # and 32
    kinds.append(z)
    kinds.append(np.repeat(rng.standard_normal((n, n_cols // 16)).astype(np.float32), 16, axis=1))
    kinds.append(np.repeat(rng.standard_normal((n, n_cols // 32)).astype(np.float32), 32, axis=1))
    kinds += [normal(s) for s in (1e-5, 1e-9, 1e-30, 1e-42, 1e3, 3e4, 1e6)]
    o = normal(0.01)
    o[np.arange(n), rng.integers(0, n_cols, n)] = rng.choice([-1.0, 1.0], n) * rng.uniform(0.5, 50, n)
    kinds.append(o)
    kinds += [-np.abs(normal()), np.abs(normal()), np.abs(normal()) + 3.0]
    kinds.append(rng.integers(-16, 16, (n, n_cols)).astype(np.float32))
    kinds.append((rng.integers(-64, 64, (n, n_cols)) + 0.5).astype(np.float32))
    kinds.append(normal() * (rng.random((n, n_cols)) < 0.03))
    kinds.append(rng.uniform(-1, 1, (n, n_cols)).astype(np.float32))
    return np.ascontiguousarray(np.concatenate(kinds).astype(np.float32))


# ------------------------------------------------------------------------------------------ bit-exactness


@needs_kernels
@type_ids
def test_golden_blocks_bit_exact(ggml_type):
    # llama.cpp's blocks, stored: every row must come out byte for byte
    golden = np.load(GOLDEN)
    x = golden["x"]
    assert x.dtype == np.float32 and x.shape[1] == 256 and len(x) >= 100
    want = golden[ggml_type.name]
    assert want.shape == (len(x), row_bytes(ggml_type, 256))
    got = quantize(x, ggml_type)
    assert np.array_equal(got, want), first_difference(got, want)


@needs_kernels
@type_ids
def test_bit_exact_with_llama_cpp(ggml_type):
    # ggml_quantize_chunk (imatrix NULL) on rows of 4 super-blocks of every kind
    oracle = llama_cpp_quantizer()
    x = varied_inputs(1024, seed=int(ggml_type))
    got, want = quantize(x, ggml_type), oracle(ggml_type, x)
    assert np.array_equal(got, want), first_difference(got, want)


@needs_kernels
@type_ids
def test_bit_exact_with_llama_cpp_on_model_weights(ggml_type):
    # trained weights: a few whole matrices of the bundled model, as `quantize` would meet them
    oracle = llama_cpp_quantizer()
    model = read_gguf(MODEL)
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.1.ffn_down_t.weight"):
        t = model.tensors[name]
        w = dequantize(t.data, t.ggml_type, t.shape)
        got, want = quantize(w, ggml_type), oracle(ggml_type, w)
        assert np.array_equal(got, want), (name, first_difference(got, want))


# ------------------------------------------------------------------------------------------ round trip

# rms(dequantize(quantize(x)) - x) / rms(x) for x ~ N(0, 1) (64 x 4096, seed 5), measured: Q2_K 0.2956,
# Q3_K 0.1504, Q4_K 0.0712, Q5_K 0.0360, Q6_K 0.0177, IQ4_NL 0.0759, IQ4_XS 0.0765 (llama.cpp's blocks, so
# llama.cpp's error); and the largest |error| in a super-block over its largest |x|: 0.370, 0.209, 0.079, 0.045,
# 0.016, 0.094, 0.102. Bounds: 1.5 times those; the types must also keep their order of precision.
ROUND_TRIP = {
    GGMLType.Q2_K: (0.2956, 0.370),
    GGMLType.Q3_K: (0.1504, 0.209),
    GGMLType.Q4_K: (0.0712, 0.079),
    GGMLType.Q5_K: (0.0360, 0.045),
    GGMLType.Q6_K: (0.0177, 0.016),
    GGMLType.IQ4_NL: (0.0759, 0.094),
    GGMLType.IQ4_XS: (0.0765, 0.102),
}


def round_trip_errors(ggml_type: GGMLType, x: np.ndarray) -> tuple[float, float]:
    y = dequantize(quantize(x, ggml_type), ggml_type, x.shape)
    err = (y - x).astype(np.float64)
    rel_rms = float(np.sqrt(np.mean(err**2) / np.mean(x.astype(np.float64) ** 2)))
    rel_max = float((np.abs(err).reshape(-1, 256).max(1) / np.abs(x).reshape(-1, 256).max(1)).max())
    return rel_rms, rel_max


@needs_kernels
@type_ids
def test_round_trip_error(ggml_type):
    x = np.random.default_rng(5).standard_normal((64, 4096)).astype(np.float32)
    rel_rms, rel_max = round_trip_errors(ggml_type, x)
    rms_measured, max_measured = ROUND_TRIP[ggml_type]
    assert rel_rms <= 1.5 * rms_measured, rel_rms
    assert rel_max <= 1.5 * max_measured, rel_max
    # scaling the input scales the blocks' factors, not the relative error (fp16 scales, far from their limits)
    rel_rms_small, _ = round_trip_errors(ggml_type, x * np.float32(1e-3))
    assert rel_rms_small <= 1.5 * rms_measured, rel_rms_small


@needs_kernels
def test_round_trip_precision_order():
    x = np.random.default_rng(5).standard_normal((16, 4096)).astype(np.float32)
    rms = {t: round_trip_errors(t, x)[0] for t in TYPES}
    chain = [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.IQ4_XS, GGMLType.Q5_K, GGMLType.Q6_K]
    assert all(rms[a] > 1.5 * rms[b] for a, b in zip(chain[:-1], chain[1:], strict=True)), rms
    assert rms[GGMLType.Q3_K] > 1.5 * rms[GGMLType.Q4_K] > 1.5 * rms[GGMLType.Q5_K], rms
    assert rms[GGMLType.Q3_K] > 1.5 * rms[GGMLType.IQ4_NL] > 1.5 * rms[GGMLType.Q5_K], rms


@needs_kernels
@type_ids
def test_zero_and_constant_rows(ggml_type):
    # all-zero rows decode to zeros; a constant row decodes to within the type's step of the constant
    x = np.zeros((3, 512), np.float32)
    x[1] = 0.75
    x[2] = -2.5
    y = dequantize(quantize(x, ggml_type), ggml_type, x.shape)
    assert np.all(y[0] == 0)
    assert np.allclose(y[1:], x[1:], rtol=0.05, atol=0), np.abs(y - x).max()


# ------------------------------------------------------------------------------------------ threads, shapes


@needs_kernels
@type_ids
def test_thread_count_independent(ggml_type):
    x = (np.random.default_rng(7).standard_t(3, (96, 2048)) * 0.05).astype(np.float32)
    one = quantize(x, ggml_type, n_threads=1)
    for n_threads in (2, 3, 5):
        assert np.array_equal(quantize(x, ggml_type, n_threads=n_threads), one), n_threads


@needs_kernels
def test_shapes():
    x = np.random.default_rng(8).standard_normal((2, 3, 512)).astype(np.float32)
    q = quantize(x, GGMLType.Q4_K)
    assert q.shape == (6, 2 * 144) and q.dtype == np.uint8
    assert np.array_equal(q, quantize(x.reshape(6, 512), GGMLType.Q4_K))
    assert np.array_equal(quantize(x[0, 0], GGMLType.Q6_K), quantize(x[0, :1], GGMLType.Q6_K))  # 1-D: one row
    # IQ4_NL blocks are 32 wide: any multiple of 32 is a row length
    assert quantize(x.reshape(-1, 32)[:5], GGMLType.IQ4_NL).shape == (5, 18)
    assert quantize(np.zeros((0, 256), np.float32), GGMLType.Q2_K).shape == (0, 84)
    # a strided view is quantized as its values
    wide = np.random.default_rng(9).standard_normal((4, 1024)).astype(np.float32)
    assert np.array_equal(quantize(wide[:, ::2], GGMLType.Q3_K), quantize(wide[:, ::2].copy(), GGMLType.Q3_K))


@needs_kernels
@pytest.mark.parametrize(
    ("ggml_type", "n_cols"),
    [(GGMLType.Q4_K, 128), (GGMLType.Q6_K, 300), (GGMLType.IQ4_XS, 32), (GGMLType.IQ4_NL, 48)],
)
def test_bad_row_length_refused(ggml_type, n_cols):
    with pytest.raises(FormatError, match="not a multiple"):
        quantize(np.ones((2, n_cols), np.float32), ggml_type)


@needs_kernels
def test_kernel_refuses_bad_arguments():
    # the C entry validates on its own (PI_ERR_SHAPE = 1): row length, counts, type, buffers
    fn = library.load().quantize_rows
    x = np.ones((2, 512), np.float32)
    out = np.zeros(2 * 512, np.uint8)
    assert fn(int(GGMLType.Q4_K), x.ctypes.data, 2, 512, out.ctypes.data, 1) == 0
    assert fn(int(GGMLType.Q4_K), x.ctypes.data, 2, 500, out.ctypes.data, 1) == library.PI_ERR_SHAPE
    assert fn(int(GGMLType.IQ4_NL), x.ctypes.data, 2, 48, out.ctypes.data, 1) == library.PI_ERR_SHAPE
    assert fn(int(GGMLType.Q4_K), x.ctypes.data, -1, 512, out.ctypes.data, 1) == library.PI_ERR_SHAPE
    assert fn(int(GGMLType.Q4_K), x.ctypes.data, 1, -256, out.ctypes.data, 1) == library.PI_ERR_SHAPE
    assert fn(int(GGMLType.Q4_K), x.ctypes.data, 2**62, 2**10, out.ctypes.data, 1) == library.PI_ERR_SHAPE
    assert fn(int(GGMLType.Q4_0), x.ctypes.data, 2, 512, out.ctypes.data, 1) == library.PI_ERR_SHAPE
    assert fn(int(GGMLType.Q4_K), None, 2, 512, out.ctypes.data, 1) == library.PI_ERR_SHAPE
    assert fn(int(GGMLType.Q4_K), x.ctypes.data, 2, 512, None, 1) == library.PI_ERR_SHAPE
    assert fn(int(GGMLType.Q4_K), None, 0, 512, None, 1) == 0  # nothing to do


def test_without_kernels_one_line_error(monkeypatch):
    monkeypatch.setattr(library, "load", lambda: None)
    for ggml_type in TYPES:
        with pytest.raises(FormatError) as info:
            quantize(np.ones((1, 256), np.float32), ggml_type)
        message = str(info.value)
        assert "\n" not in message and ggml_type.name in message and "not built" in message
    # the gguf package's types do not need them
    assert quantize(np.ones((1, 32), np.float32), GGMLType.Q4_0).shape == (1, 18)


def test_type_sets():
    # the C quantizers add types to `quantize` without claiming kernels or pool formats for them
    assert not C_QUANTIZABLE & QUANTIZABLE and not C_QUANTIZABLE & KERNEL_TYPES
    with pytest.raises(FormatError, match="not supported"):
        quantize(np.ones((1, 256), np.float32), GGMLType.IQ2_XXS)
