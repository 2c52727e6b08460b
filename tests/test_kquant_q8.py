"""K-quant and IQ4 kernels in "q8" precision, and the IQ4 row decoders and exact kernels.

Oracles, all independent of the kernels:
- Q8_K activations: `quantize_q8_k` below, llama.cpp's quantize_row_q8_K_ref in numpy (the C quantiser must match
  it bit for bit); IQ4_NL takes the int8 blocks of 32 of the other q8 kernels (`quantize_q8_0_blocks`).
- weights: the gguf package's decoder (`powerinfer.quant.dequantize`) on random super-blocks, which are valid
  blocks of every K-quant / IQ4 type whatever their bytes (finite fp16 scales set by the generators).
- products in float64: x_q @ dequant(W).T for "q8" (the kernel computes the same sum with exact integer block
  dot products and a few float32 roundings per super-block), x @ dequant(W).T for the exact kernels.
"""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
import torch
from test_kquant_kernels import random_k_blocks
from test_ops import needs_isa
from test_sparse_ops import needs_kernels

from powerinfer import ops
from powerinfer.gguf.constants import GGMLType
from powerinfer.ops import library
from powerinfer.quant import dequantize

K_QUANTS = [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
Q8K_TYPES = [*K_QUANTS, GGMLType.IQ4_XS]  # "q8" with Q8_K activations
Q8_TYPES = [*Q8K_TYPES, GGMLType.IQ4_NL]  # every type of this file's "q8" kernels
IQ4_TYPES = [GGMLType.IQ4_NL, GGMLType.IQ4_XS]
IQ4_LAYOUT = {
    GGMLType.IQ4_NL: (32, 18),
    GGMLType.IQ4_XS: (256, 136),
}  # elements, bytes per block; fp16 d first
NAME = lambda t: t.name  # noqa: E731


def random_iq4(ggml_type: GGMLType, n_rows: int, n_cols: int, seed: int = 0) -> np.ndarray:
    """Raw IQ4 blocks (n_rows, row bytes): random indices and sub-block scales, finite random fp16 d of either
    sign."""
    elems, size = IQ4_LAYOUT[ggml_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_rows, n_cols // elems, size), dtype=np.uint8)
    d = (rng.standard_normal((n_rows, n_cols // elems)) * 0.01).astype(np.float16)
    blocks[:, :, :2] = d.view(np.uint8).reshape(n_rows, n_cols // elems, 2)
    return blocks.reshape(n_rows, -1)


def random_weight(
    ggml_type: GGMLType, n_rows: int, n_cols: int, seed: int = 0
) -> tuple[np.ndarray, ops.QWeight]:
    make = random_iq4 if ggml_type in IQ4_LAYOUT else random_k_blocks
    raw = make(ggml_type, n_rows, n_cols, seed=seed)
    return raw, ops.QWeight.from_numpy(raw, ggml_type, (n_rows, n_cols))


def make_x(n_tokens: int, n_cols: int, seed: int = 1) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n_tokens, n_cols)).astype(np.float32)
    if n_cols >= 512:
        x[0, 256:512] = 0.0  # an all-zero super-block: activation scale 0
    return x


def quantize_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's Q8_K (quantize_row_q8_K_ref) of x (T, K): per 256, max = the first element of largest magnitude,
    iscale = -127 / max (float32), q = min(127, round half even(iscale * x)), d = 1 / iscale, bsums per 16."""
    T, K = x.shape
    blocks = x.reshape(T, K // 256, 256)
    first = np.abs(blocks).argmax(axis=-1)[..., None]  # argmax: the first of equal magnitudes
    max_ = np.take_along_axis(blocks, first, axis=-1)
    zero = max_ == 0
    with np.errstate(divide="ignore"):
        iscale = np.float32(-127.0) / np.where(zero, np.float32(1.0), max_)
    q = np.minimum(np.rint(iscale * blocks), 127).astype(np.int8)
    q[np.broadcast_to(zero, q.shape)] = 0
    d = np.where(zero, np.float32(0.0), np.float32(1.0) / iscale)[..., 0]
    bsums = q.reshape(T, K // 16, 16).sum(axis=-1, dtype=np.int32).astype(np.int16)
    return q.reshape(T, K), d.astype(np.float32), bsums


def quantize_q8_0_blocks(x: np.ndarray) -> np.ndarray:
    """x as the int8 blocks of 32 of the Q4_0 / Q8_0 / IQ4_NL "q8" kernels, decoded to float64: per block
    q = round half even(x * (127 / amax)), d = amax / 127 (float32 operations)."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0))
    q = np.rint(blocks * inv)
    return (q.astype(np.float64) * (amax / np.float32(127.0)).astype(np.float64)).reshape(x.shape)


def dequantized_activations(ggml_type: GGMLType, x: np.ndarray) -> np.ndarray:
    """The activations the "q8" kernel of ggml_type computes with, decoded to float64."""
    if ggml_type == GGMLType.IQ4_NL:
        return quantize_q8_0_blocks(x)
    q, d, _ = quantize_q8_k(x)
    return q.astype(np.float64) * np.repeat(d.astype(np.float64), 256, axis=1)


def c_quantize_q8_k(x: np.ndarray, isa: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernels' own Q8_K quantiser (pi_quantize_q8_k, exported for this test)."""
    fn = ctypes.CDLL(library.load().path).pi_quantize_q8_k
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes, fn.restype = (ptr, i64, i64, ptr, ptr, ptr, ctypes.c_int32), ctypes.c_int32
    T, K = x.shape
    qs, d = np.empty((T, K), np.int8), np.empty((T, K // 256), np.float32)
    bsums = np.empty((T, K // 16), np.int16)
    x = np.ascontiguousarray(x, dtype=np.float32)
    level = ops.ISA_NAMES.index(isa)
    assert fn(x.ctypes.data, K, T, qs.ctypes.data, d.ctypes.data, bsums.ctypes.data, level) == 0
    return qs, d, bsums


def linear(x: np.ndarray, w: ops.QWeight, kc: ops.KernelContext) -> np.ndarray:
    return ops.linear(torch.from_numpy(np.ascontiguousarray(x)), w, kc).double().numpy()


@needs_kernels
def test_quantize_q8_k_bit_equal_to_reference(isa):
    x = make_x(6, 1024, seed=2)
    x[1, 0:256] *= 1e6  # large values
    x[2, 10], x[2, 20] = -30.0, 30.0  # equal largest magnitudes: the first one's sign wins (d > 0 here)
    x[2, 600], x[2, 700] = 50.0, -50.0  # (d < 0 here)
    x[3, 512:768] = np.float32(1e-30)  # tiny, and all equal
    x[4, 768:] = np.round(x[4, 768:] * 4) / 4  # values on rounding ties
    x[5, :256] = -0.0
    got, want = c_quantize_q8_k(x, isa), quantize_q8_k(x)
    for name, g, w in zip(("qs", "d", "bsums"), got, want, strict=True):
        assert g.dtype == w.dtype and np.array_equal(g.view(np.uint8), w.view(np.uint8)), name
    qs, d, bsums = got
    assert d[2, 0] > 0 > d[2, 2] and d[0, 1] == d[5, 0] == 0 and not qs[0, 256:512].any()
    assert qs.min() >= -127 and qs.max() == 127


@needs_kernels
@pytest.mark.parametrize("ggml_type", Q8_TYPES, ids=NAME)
def test_q8_against_float64_reference(ggml_type, isa):
    # y vs x_q @ dequant(W).T in float64, x_q the activations as the kernel quantises them (numpy oracle):
    # the integer block sums are exact, the rest float32 rounding (measured max 4.7e-8 of |x_q| @ |W|.T over
    # the seven types and eight seeds; bound 2e-7; one activation rounded the other way moves y by ~1e-5 of it)
    raw, w = random_weight(ggml_type, 70, 1024, seed=3 + int(ggml_type))
    dense = dequantize(raw, ggml_type, w.shape).astype(np.float64)
    x = make_x(11, 1024)
    xq = dequantized_activations(ggml_type, x)
    ref, scale = xq @ dense.T, np.abs(xq) @ np.abs(dense).T
    kc = ops.KernelContext(act_precision="q8", isa=isa)
    assert ggml_type in kc.supported_types()
    y = linear(x, w, kc)
    assert (np.abs(y - ref) <= 2e-7 * scale).all()
    # decode (T = 1) equals the batch tiles bit for bit
    assert np.array_equal(np.stack([linear(x[t], w, kc) for t in range(11)]), y)
    assert not w._dense  # no float copy of W


@needs_kernels
@pytest.mark.parametrize("ggml_type", Q8_TYPES, ids=NAME)
def test_q8_within_activation_rounding_of_exact(ggml_type):
    # q8 vs the exact f32 kernel: only the rounding of the activations separates them. Per output
    # |y_q8 - y_f32| <= 4e-3 ||x|| ||W_n|| (measured max 1.0e-3) and NMSE <= 3e-4 (measured max 6.2e-5), and the
    # rigorous |y_q8 - x @ W.T| <= sum |W| |x - x_q| (+ float32 rounding; measured at most 0.27 of it)
    raw, w = random_weight(ggml_type, 70, 1024, seed=5)
    dense = dequantize(raw, ggml_type, w.shape).astype(np.float64)
    x = make_x(11, 1024, seed=6)
    q8 = linear(x, w, ops.KernelContext(act_precision="q8"))
    f32 = linear(x, w, ops.KernelContext(act_precision="f32"))
    assert not np.array_equal(q8, f32)
    norms = np.linalg.norm(x, axis=1)[:, None] * np.linalg.norm(dense, axis=1)[None, :]
    assert (np.abs(q8 - f32) <= 4e-3 * norms).all()
    assert ((q8 - f32) ** 2).sum() <= 3e-4 * (f32**2).sum()
    exact, scale = x.astype(np.float64) @ dense.T, np.abs(x.astype(np.float64)) @ np.abs(dense).T
    rounding = np.abs(x.astype(np.float64) - dequantized_activations(ggml_type, x)) @ np.abs(dense).T
    assert (np.abs(q8 - exact) <= rounding + 2e-7 * scale).all()


@needs_kernels
@pytest.mark.parametrize("ggml_type", Q8_TYPES, ids=NAME)
def test_q8_independent_of_threads_batch_and_row_grouping(ggml_type):
    # a token's result depends neither on the thread count nor on the batch (T = 1 rows go several per call
    # when short, one per call when long; T > 1 goes through tiles of 8 tokens, here 8 + 3)
    for n_rows, n_cols in itertools.product([1, 5, 301], [256, 2304]):
        _, w = random_weight(ggml_type, n_rows, n_cols, seed=n_rows + n_cols)
        x = make_x(11, n_cols, seed=7)
        kc = ops.KernelContext(n_threads=1, act_precision="q8")
        batch = linear(x, w, kc)
        for n_threads in (1, 2, 3):
            kt = kc.replace(n_threads=n_threads)
            assert np.array_equal(linear(x, w, kt), batch), (n_rows, n_cols, n_threads)
            single = np.stack([linear(x[t], w, kt) for t in range(11)])
            assert np.array_equal(single, batch), (n_rows, n_cols, n_threads)


@needs_kernels
@pytest.mark.parametrize("ggml_type", Q8K_TYPES, ids=NAME)
def test_q8_simd_variants_bit_equal(ggml_type):
    # Q8_K types: the scalar fallback follows the SIMD lanes and float order, so every variant this CPU runs gives
    # the same bits (one token and a batch)
    _, w = random_weight(ggml_type, 37, 768, seed=8)
    x = make_x(5, 768, seed=9)
    isas = ops.ISA_NAMES[: ops.ISA_NAMES.index(ops.isa_best()) + 1]
    results = {isa: linear(x, w, ops.KernelContext(act_precision="q8", isa=isa)) for isa in isas}
    ones = {isa: linear(x[2], w, ops.KernelContext(act_precision="q8", isa=isa)) for isa in isas}
    for isa in isas:
        assert np.array_equal(results[isa], results["scalar"]), isa
        assert np.array_equal(ones[isa], results["scalar"][2]), isa


@needs_kernels
@needs_isa("avx512")
@pytest.mark.parametrize("ggml_type", Q8_TYPES, ids=NAME)
def test_q8_avx2_equals_avx512(ggml_type):
    # same integer sums (VNNI or maddubs/madd), same float operations: the same bits, alternating per call
    avx2 = ops.KernelContext(act_precision="q8", isa="avx2")
    avx512 = avx2.replace(isa="avx512")
    for n_cols, n_tokens in itertools.product([256, 1280], [1, 5]):
        _, w = random_weight(ggml_type, 64, n_cols, seed=n_cols)
        x = make_x(n_tokens, n_cols)
        y2 = linear(x, w, avx2)
        assert np.array_equal(linear(x, w, avx512), y2), (n_cols, n_tokens)
        assert np.array_equal(linear(x, w, avx2), y2)


@needs_kernels
@pytest.mark.parametrize("ggml_type", IQ4_TYPES, ids=NAME)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_iq4_get_rows_bit_equal_to_reference(ggml_type, n_threads):
    raw, w = random_weight(ggml_type, 40, 768, seed=10)
    ids = torch.tensor([0, 39, 7, 7, 20, 1], dtype=torch.int64)
    rows = ops.get_rows(w, ids, ops.KernelContext(n_threads=n_threads))
    expected = dequantize(raw, ggml_type, w.shape)[ids.numpy()]
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0
    assert np.array_equal(rows.numpy().view(np.uint32), expected.astype(np.float32).view(np.uint32))
    assert not w._dense
    with pytest.raises(IndexError):
        ops.get_rows(w, torch.tensor([40]))


@needs_kernels
@pytest.mark.parametrize("ggml_type", IQ4_TYPES, ids=NAME)
def test_iq4_exact_against_float64_reference(ggml_type, isa):
    # x @ dequant(W).T in float64: the kernel decodes the gguf decoder's float32 weights and sums in float32
    # (measured max 3.6e-8 of |x| @ |W|.T; bound 2e-7); decode equals batch bit for bit, any thread count
    raw, w = random_weight(ggml_type, 70, 768, seed=11)
    dense = dequantize(raw, ggml_type, w.shape).astype(np.float64)
    x = make_x(11, 768, seed=12)
    exact, scale = x.astype(np.float64) @ dense.T, np.abs(x.astype(np.float64)) @ np.abs(dense).T
    kc = ops.KernelContext(act_precision="f32", isa=isa)
    y = linear(x, w, kc)
    assert (np.abs(y - exact) <= 2e-7 * scale).all()
    for n_threads in (1, 2, 3):
        kt = kc.replace(n_threads=n_threads)
        assert np.array_equal(linear(x, w, kt), y)
        assert np.array_equal(np.stack([linear(x[t], w, kt) for t in range(11)]), y)
    assert not w._dense


@needs_kernels
@pytest.mark.parametrize("ggml_type", Q8_TYPES, ids=NAME)
def test_bad_width_refused(ggml_type, act):
    # K must hold whole blocks (super-blocks of 256, IQ4_NL blocks of 32): refused before any row is read
    n_cols = 32 if ggml_type == GGMLType.IQ4_NL else 256
    _, w = random_weight(ggml_type, 3, n_cols)
    kernel = library.load().matmul if act == "q8" else library.load().matmul_f
    fn = kernel[ggml_type]
    x, y = torch.zeros(2, 1024), torch.zeros(2, 3)
    # not whole blocks; longer rows than the row stride holds (IQ4_NL 160); negative
    for bad_k in (n_cols + 16, n_cols + 128, -n_cols):
        status = fn(w._raw_ptr, w._raw_stride, 3, bad_k, x.data_ptr(), 1024, 1, y.data_ptr(), 3, 1, 1)
        assert status == library.PI_ERR_SHAPE, bad_k
    with pytest.raises(ValueError):
        ops.linear(torch.zeros(1, n_cols + 32), w, ops.KernelContext(act_precision=act))


def test_engine_on_an_iq4_and_k_quant_file(tmp_path):
    # a tiny random Llama with IQ4_NL / IQ4_XS / K-quant matrices, loaded by transformers (gguf package decoder)
    # and by the engine (kernels, no float copy): exact precision within 1e-5 of the logits' scale (measured
    # 1.1e-6), "q8" within 0.15 (measured 0.028 here, 0.061 with other random weights: random matrices amplify
    # the activation rounding layer by layer)
    import os

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from conftest import tiny_hf_llama, write_hf_llama_gguf

    from powerinfer.gguf import GGUFWriter, read_gguf
    from powerinfer.runtime.engine import Engine, EngineOptions

    src = read_gguf(
        write_hf_llama_gguf(tiny_hf_llama(n_embd=256, n_ff=512, n_head=4, seed=7), tmp_path / "f.gguf")
    )
    mix = {
        "attn_q": GGMLType.IQ4_XS, "attn_k": GGMLType.Q4_K, "attn_v": GGMLType.IQ4_NL, "attn_output": GGMLType.Q5_K,
        "ffn_gate": GGMLType.IQ4_NL, "ffn_up": GGMLType.Q3_K, "ffn_down": GGMLType.IQ4_XS, "output": GGMLType.Q6_K,
        "token_embd": GGMLType.IQ4_XS,
    }  # fmt: skip
    path = tmp_path / "model" / "iq4.gguf"
    path.parent.mkdir()
    writer = GGUFWriter(path)
    src.copy_metadata(writer)
    for seed, t in enumerate(src.tensors.values()):
        kind = t.name.split(".")[-2]
        if len(t.shape) == 2 and kind in mix:
            writer.add_tensor(t.name, random_weight(mix[kind], *t.shape, seed=seed)[0], mix[kind], t.shape)
        else:
            writer.add_tensor(t.name, t.data, t.ggml_type, t.shape)
    writer.write()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    ids = [1, 17, 42, 5, 99, 3, 64, 8, 23, 77]
    with torch.no_grad():
        ref = hf.eval()(torch.tensor([ids])).logits[0]
    scale = float(ref.abs().max())
    assert scale > 0
    results = {}
    for precision, bound in (("f32", 1e-5), ("q8", 0.15)):
        e = Engine(path, EngineOptions(n_ctx=64, act_precision=precision))
        prefill = e.logits_all(ids)
        e.reset()
        decode = torch.stack([e.eval([i]) for i in ids])
        for got in (prefill, decode):
            assert (got - ref).abs().max() <= bound * scale, precision
        results[precision] = prefill
        layer = e.model.layers[0]
        weights = [layer.attn.wq, layer.attn.wv, layer.ffn.gate, layer.ffn.down, e.model.embedding.weight]
        assert all(m is not None and m.ggml_type in IQ4_TYPES and not m._dense for m in weights)
    assert not torch.equal(results["f32"], results["q8"])
