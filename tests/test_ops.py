"""C kernels against the torch reference (powerinfer.ops.reference), per type and shape.

Tolerances:
- F32, F16: max|y - ref| <= 1e-5 * (|x| @ |W|.T), the float32 rounding scale of each output.
- Q4_0, Q4_1, Q8_0, activation precision "f32" (default, exact mode): x stays float32, so the same bound as
  F32/F16 against x @ dequant(W).T.
- Q4_0, Q4_1, Q8_0, activation precision "q8": the kernels quantise x to int8 blocks of 32 (scale amax/127), as
  ggml does. Against the plain reference: |y - ref| <= 1e-2 * ||x_t|| * ||W_n|| per output and NMSE <= 1e-3.
  Against the reference fed the same int8-rounded x: max|y - ref| <= 1e-5 * (|x_q| @ |W|.T), i.e. the
  integer block arithmetic is exact and only float summation order differs.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import random_q4_k

from powerinfer import ops, quant
from powerinfer.gguf.constants import GGMLType
from powerinfer.ops import reference
from powerinfer.quant import dequantize, quantize

KERNEL_TYPES = sorted(quant.KERNEL_TYPES)  # every type the C kernels compute on
QUANT_TYPES = {GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0}  # exact and int8 (q8) kernels
BLOCK_TYPES = QUANT_TYPES | {GGMLType.Q5_0, GGMLType.Q5_1}  # rows of 32-element blocks
SHAPES_K = [32, 64, 576, 1536]
SHAPES_N = [1, 7, 64, 300]
SHAPES_T = [1, 3, 17]

needs_kernels = pytest.mark.skipif(not ops.kernels_available(), reason="powerinfer._kernels is not built")
pytestmark = pytest.mark.usefixtures("restore_kernel_settings")


def make_weight(ggml_type: GGMLType, n_rows: int, n_cols: int, seed: int = 0) -> ops.QWeight:
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
    data[:, :3] = 0.0  # an all-zero-ish start exercises zero scales in the first block
    return ops.QWeight.from_numpy(quantize(data, ggml_type), ggml_type, (n_rows, n_cols))


def make_x(n_tokens: int, n_cols: int, seed: int = 1) -> torch.Tensor:
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((n_tokens, n_cols)).astype(np.float32))
    if n_cols >= 64:
        x[0, 32:64] = 0.0  # an all-zero block: activation scale 0
    return x


def fake_quant_act(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernels round activations: per 32-block, round(x * 127 / amax) * amax / 127."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(x.shape)


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_linear_matches_reference(ggml_type, isa, act):
    for n_cols, n_rows in itertools.product(SHAPES_K, SHAPES_N):
        w = make_weight(ggml_type, n_rows, n_cols)
        dense = reference.dense(w).double()
        for n_tokens in SHAPES_T:
            x = make_x(n_tokens, n_cols)
            y = ops.linear(x, w)
            assert y.shape == (n_tokens, n_rows) and y.dtype == torch.float32
            where = f"{ggml_type.name} {isa} {act} N={n_rows} K={n_cols} T={n_tokens}"
            if ggml_type in QUANT_TYPES and act == "q8":
                ref = reference.linear(x, w).double()
                diff = (y.double() - ref).abs()
                norms = x.double().norm(dim=1, keepdim=True) * dense.norm(dim=1)  # (T, N)
                assert (diff <= 1e-2 * norms).all(), where
                assert (diff.square().sum() / ref.square().sum()) <= 1e-3, where
                x = fake_quant_act(x)
            exact = x.double() @ dense.T
            scale = x.double().abs() @ dense.abs().T
            assert ((y.double() - exact).abs() <= 1e-5 * scale + 1e-30).all(), where


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_linear_independent_of_threads_and_batch(ggml_type, isa, act):
    w = make_weight(ggml_type, 300, 576)
    x = make_x(17, 576)
    ops.set_num_threads(1)
    one = ops.linear(x, w)
    ops.set_num_threads(2)
    two = ops.linear(x, w)
    assert torch.equal(one, two)
    # a token's result does not depend on the batch it is computed in (decode == prefill row)
    single = torch.stack([ops.linear(x[t], w) for t in range(x.shape[0])])
    assert torch.equal(single, two)


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_linear_short_rows_decode_equals_batch(ggml_type, isa, act):
    # one token with short rows runs the grouped rows_dot path (several rows per call), and in exact mode with long
    # rows (K = 1536) one row per rows_dot call: same bits as the tiles
    cols = [32, 96, 128, 1536] if ggml_type in BLOCK_TYPES else [1, 7, 33, 100]
    for n_cols, n_rows in itertools.product(cols, [1, 3, 301]):
        w = make_weight(ggml_type, n_rows, n_cols)
        x = make_x(5, n_cols)
        batch = ops.linear(x, w)
        for threads in (1, 2):
            ops.set_num_threads(threads)
            single = torch.stack([ops.linear(x[t], w) for t in range(x.shape[0])])
            assert torch.equal(single, batch), (n_cols, n_rows, threads)


@needs_kernels
def test_simd_variants_agree_on_quant_types():
    # q8: AVX2 and AVX-512 use the same integer dot products and float accumulation order (AVX-512 takes Q4
    # blocks two per 512-bit vector: an odd block count leaves a 256-bit tail block; one token or a batch)
    ops.set_activation_precision("q8")
    for ggml_type, n_cols, n_tokens in itertools.product(
        sorted(QUANT_TYPES), [32, 64, 96, 576, 1568], [1, 5]
    ):
        w = make_weight(ggml_type, 64, n_cols)
        x = make_x(n_tokens, n_cols)
        ops._set_isa("avx2")
        avx2 = ops.linear(x, w)
        ops._set_isa("avx512")
        best = ops.linear(x, w)
        assert torch.equal(avx2, best), (ggml_type.name, n_cols, n_tokens)


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_get_rows_exact(ggml_type):
    w = make_weight(ggml_type, 300, 576)
    ids = torch.tensor([0, 299, 17, 17, 150], dtype=torch.int64)
    rows = ops.get_rows(w, ids)
    expected = dequantize(w.raw.numpy(), ggml_type, w.shape)[ids.numpy()]
    assert rows.dtype == torch.float32 and rows.shape == (5, 576)
    assert np.array_equal(rows.numpy(), expected)
    with pytest.raises(IndexError):
        ops.get_rows(w, torch.tensor([300]))


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_fallback_matches_kernels(ggml_type, act):
    w = make_weight(ggml_type, 64, 576)
    x = make_x(3, 576)
    ids = torch.tensor([5, 1, 63])
    assert ggml_type in ops.supported_types()
    kernel_y, kernel_rows = ops.linear(x, w), ops.get_rows(w, ids)
    ops.use_kernels(False)
    assert ops.supported_types() == frozenset()
    fallback_y, fallback_rows = ops.linear(x, w), ops.get_rows(w, ids)
    assert torch.equal(kernel_rows, fallback_rows)
    tol = 2e-2 if ggml_type in QUANT_TYPES and act == "q8" else 1e-5
    assert (kernel_y - fallback_y).abs().max() <= tol * fallback_y.abs().max()


def test_non_kernel_types_use_cached_dense_copy():
    w = ops.QWeight.from_numpy(random_q4_k(7, 256), GGMLType.Q4_K, (7, 256))
    x = make_x(3, 256)
    y = ops.linear(x, w)
    torch.testing.assert_close(y, reference.linear(x, w), rtol=1e-5, atol=1e-5)
    assert "f32" in w._dense  # decoded once, reused by the next call
    ids = torch.tensor([6, 0])
    assert torch.equal(ops.get_rows(w, ids), reference.get_rows(w, ids))


def test_linear_shapes_and_validation():
    w = make_weight(GGMLType.Q4_1, 7, 64)
    assert ops.linear(make_x(1, 64)[0], w).shape == (7,)
    assert ops.linear(make_x(6, 64).reshape(2, 3, 64), w).shape == (2, 3, 7)
    with pytest.raises(ValueError):
        ops.linear(make_x(1, 32), w)
    with pytest.raises(ValueError):
        ops.QWeight(w.raw[:, :-1], GGMLType.Q4_1, (7, 64))
    ops.set_num_threads(3)
    assert ops.get_num_threads() == 3 and torch.get_num_threads() == 3


def test_activation_precision_setting():
    assert ops.get_activation_precision() == "f32"  # the default: exact mode
    assert ops.set_activation_precision("q8") == "f32"
    assert ops.get_activation_precision() == "q8"
    assert ops.set_activation_precision("f32") == "q8"
    with pytest.raises(ValueError):
        ops.set_activation_precision("int8")
    assert ops.get_activation_precision() == "f32"
    # switching the kernels off and on keeps the precision
    ops.set_activation_precision("q8")
    ops.use_kernels(False)
    ops.use_kernels(True)
    assert ops.get_activation_precision() == "q8"


@needs_kernels
@pytest.mark.parametrize("ggml_type", sorted(QUANT_TYPES), ids=lambda t: t.name)
def test_precisions_select_different_kernels(ggml_type):
    # f32 computes on float x (tight bound); q8 rounds x to int8 blocks, visibly further from the reference
    w = make_weight(ggml_type, 64, 576)
    x = make_x(4, 576)
    exact = x.double() @ reference.dense(w).double().T
    scale = x.double().abs() @ reference.dense(w).double().abs().T
    ops.set_activation_precision("f32")
    err_f32 = ((ops.linear(x, w).double() - exact).abs() / scale).max()
    ops.set_activation_precision("q8")
    err_q8 = ((ops.linear(x, w).double() - exact).abs() / scale).max()
    assert err_f32 <= 1e-5 < err_q8


@needs_kernels
@pytest.mark.parametrize("ggml_type", sorted(BLOCK_TYPES), ids=lambda t: t.name)
def test_exact_mode_long_batches_and_shapes(ggml_type, isa):
    # token counts around the tile sizes (4 and 8) and a K that is one block: tiles never change a token's result
    ops.set_activation_precision("f32")
    w = make_weight(ggml_type, 33, 32 * 37)
    dense = reference.dense(w).double()
    x = make_x(29, 32 * 37, seed=3)
    y = ops.linear(x, w)
    exact, scale = x.double() @ dense.T, x.double().abs() @ dense.abs().T
    assert ((y.double() - exact).abs() <= 1e-5 * scale + 1e-30).all()
    for n_tokens in (1, 5, 8, 9, 16):
        assert torch.equal(ops.linear(x[:n_tokens], w), y[:n_tokens]), n_tokens


@needs_kernels
@pytest.mark.parametrize(("n_head", "n_head_kv"), [(4, 4), (8, 2), (9, 3), (6, 1)])
def test_attn_decode_equals_the_tensor_ops(n_head, n_head_kv):
    """pi_attn_decode (RoPE, KV write, grouped-query softmax attention of one token) == torch's ops."""
    from powerinfer.arch.llama import apply_rope

    head_dim, n_ctx = 16, 40
    gen = torch.Generator().manual_seed(0)
    angles = torch.rand(n_ctx, head_dim // 2, generator=gen, dtype=torch.float64) * 6.0
    rot = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)  # (n_ctx, D/2)
    pairs = torch.view_as_real(rot).contiguous()
    k_cache = torch.randn(n_ctx, n_head_kv, head_dim, generator=gen)
    v_cache = torch.randn(n_ctx, n_head_kv, head_dim, generator=gen)
    for pos in (0, 1, 17, n_ctx - 1):
        q = torch.randn(1, n_head * head_dim, generator=gen) * 3
        k = torch.randn(1, n_head_kv * head_dim, generator=gen)
        v = torch.randn(1, n_head_kv * head_dim, generator=gen)
        kc, vc = k_cache.clone(), v_cache.clone()
        for threads in (1, 2):
            ops.set_num_threads(threads)
            got = ops.attn_decode(q, k, v, pairs[pos], kc, vc, pos)
            qr = apply_rope(q.view(1, n_head, head_dim), rot[pos : pos + 1])
            kr = apply_rope(k.view(1, n_head_kv, head_dim), rot[pos : pos + 1])
            # the complex product in float, possibly not torch's rounding order: within an ulp or two
            torch.testing.assert_close(kc[pos], kr[0], rtol=1e-6, atol=1e-6)
            assert torch.equal(vc[pos], v.view(n_head_kv, head_dim))
            keys, values = kc[: pos + 1].transpose(0, 1), vc[: pos + 1].transpose(0, 1)  # (H_kv, L, D)
            want = F.scaled_dot_product_attention(qr.transpose(0, 1), keys, values, enable_gqa=True)
            torch.testing.assert_close(got, want.transpose(0, 1).reshape(1, -1), rtol=2e-6, atol=2e-6)
        assert torch.equal(kc[pos + 1 :], k_cache[pos + 1 :])  # only row pos written
    assert ops.attn_decode(q, k, v, pairs[0], kc, vc, n_ctx) is None  # a position past the cache: no kernel
