"""Sparse FFN kernels (kernels/cpu/sparse.c) against their torch references (powerinfer.ops.sparse.*_ref).

Tolerance as in tests/test_ops.py: exact mode (float activations) max|y - ref| <= 1e-5 * (|x| @ |W|^T) per
output; rows_matmul in the "q8" activation precision is checked against the reference fed the int8-rounded x.
rows_axpy is exact mode whatever the activation precision and is the same chain of FMAs per output element in
every SIMD variant, thread count and batch, so those are compared bit for bit.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
from conftest import random_q4_k

from powerinfer import ops, quant
from powerinfer.gguf.constants import GGMLType
from powerinfer.ops import sparse
from powerinfer.quant import quantize

KERNEL_TYPES = sorted(quant.KERNEL_TYPES)  # every type the C kernels compute on
QUANT_TYPES = {GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0}  # exact and int8 (q8) kernels
BLOCK_TYPES = QUANT_TYPES | {GGMLType.Q5_0, GGMLType.Q5_1}  # rows of 32-element blocks
SHAPES_T = [1, 3, 9]

needs_kernels = pytest.mark.skipif(not ops.kernels_available(), reason="powerinfer._kernels is not built")
pytestmark = pytest.mark.usefixtures("restore_kernel_settings")


def cols_for(ggml_type: GGMLType) -> list[int]:
    """Row lengths: any for F32/F16 (tails of every size), multiples of 32 for the quant types."""
    return [32, 576] if ggml_type in BLOCK_TYPES else [1, 7, 33, 100, 576]


def make_weight(ggml_type: GGMLType, n_rows: int, n_cols: int, seed: int = 0) -> ops.QWeight:
    data = np.random.default_rng(seed).standard_normal((n_rows, n_cols)).astype(np.float32)
    data[:, :3] = 0.0
    return ops.QWeight.from_numpy(quantize(data, ggml_type), ggml_type, (n_rows, n_cols))


def make_x(n_tokens: int, n_cols: int, seed: int = 1) -> torch.Tensor:
    return torch.from_numpy(
        np.random.default_rng(seed).standard_normal((n_tokens, n_cols)).astype(np.float32)
    )


def make_h(n_tokens: int, n_sel: int, seed: int = 2) -> torch.Tensor:
    """ReLU-like activations: about half exactly zero, one token with every row zero when T > 1."""
    h = torch.relu(make_x(n_tokens, n_sel, seed))
    if n_tokens > 1:
        h[1] = 0.0
    return h


def subsets(n_rows: int, seed: int = 3) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return {
        "none": torch.zeros(0, dtype=torch.int64),
        "one": torch.tensor([n_rows - 1], dtype=torch.int64),
        "all": torch.arange(n_rows, dtype=torch.int64),
        "random": torch.from_numpy(rng.permutation(n_rows)[: max(1, n_rows // 3)].astype(np.int64)),
        "sorted": torch.from_numpy(np.sort(rng.permutation(n_rows)[: max(1, n_rows // 2)]).astype(np.int64)),
    }


def fake_quant_act(x: torch.Tensor) -> torch.Tensor:
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(x.shape)


def assert_close_exact(y: torch.Tensor, a: torch.Tensor, w_rows: torch.Tensor, where: str) -> None:
    """y ~= a @ w_rows within 1e-5 of |a| @ |w_rows| (a (T, R), w_rows (R, C) as float64)."""
    exact = a.double() @ w_rows
    scale = a.double().abs() @ w_rows.abs()
    assert y.shape == exact.shape and y.dtype == torch.float32, where
    assert ((y.double() - exact).abs() <= 1e-5 * scale + 1e-30).all(), where


# ---- rows_matmul ---------------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_rows_matmul_matches_reference(ggml_type, isa, act):
    for n_cols, n_rows in itertools.product(cols_for(ggml_type), [1, 7, 70]):
        w = make_weight(ggml_type, n_rows, n_cols)
        for (name, idx), n_tokens in itertools.product(subsets(n_rows).items(), SHAPES_T):
            x = make_x(n_tokens, n_cols)
            y = sparse.rows_matmul(x, w, idx)
            where = f"{ggml_type.name} {isa} {act} N={n_rows} K={n_cols} T={n_tokens} idx={name}"
            assert y.shape == (n_tokens, idx.numel()), where
            if ggml_type in QUANT_TYPES and act == "q8":
                x = fake_quant_act(x)
            assert_close_exact(y, x, sparse.decode_rows(w, idx).double().T, where)


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_rows_matmul_all_rows_is_linear(ggml_type, isa, act):
    w = make_weight(ggml_type, 300, 576)
    x = make_x(9, 576)
    assert torch.equal(sparse.rows_matmul(x, w, torch.arange(300)), ops.linear(x, w))
    # any subset is the matching columns of the dense result, bit for bit
    idx = subsets(300)["random"]
    assert torch.equal(sparse.rows_matmul(x, w, idx), ops.linear(x, w)[:, idx])
    assert torch.equal(sparse.rows_matmul(x[2], w, idx), ops.linear(x, w)[2, idx])


# ---- rows_axpy -----------------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_rows_axpy_matches_reference(ggml_type, isa):
    for n_out, n_rows in itertools.product(cols_for(ggml_type), [1, 7, 70]):
        w = make_weight(ggml_type, n_rows, n_out)
        cases = dict(subsets(n_rows).items())
        cases["None"] = None
        for (name, idx), n_tokens in itertools.product(cases.items(), SHAPES_T):
            n_sel = n_rows if idx is None else idx.numel()
            h = make_h(n_tokens, n_sel)
            y = sparse.rows_axpy(h, w, idx)
            where = f"{ggml_type.name} {isa} N={n_rows} D={n_out} T={n_tokens} idx={name}"
            assert_close_exact(y, h, sparse.decode_rows(w, idx).double(), where)
            if n_sel == 0:
                assert torch.equal(y, torch.zeros(n_tokens, n_out)), where
            if n_tokens > 1:
                assert torch.equal(y[1], torch.zeros(n_out)), where  # every h zero


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_rows_axpy_bitwise_invariants(ggml_type, act):
    # same bits for: every SIMD variant, 1 or 2 threads, a token alone or in a batch, idx None or arange,
    # and whatever the activation precision (rows_axpy is always exact mode)
    n_rows, n_out = 300, 544 if ggml_type in BLOCK_TYPES else 547
    w = make_weight(ggml_type, n_rows, n_out)
    idx = subsets(n_rows)["random"]
    h = make_h(9, idx.numel())
    h_all = make_h(9, n_rows, seed=5)
    results = []
    for isa_name, threads in itertools.product(["scalar", "avx2", "avx512"], [1, 2]):
        ops._set_isa(isa_name)
        ops.set_num_threads(threads)
        y, y_all = sparse.rows_axpy(h, w, idx), sparse.rows_axpy(h_all, w, None)
        single = torch.stack([sparse.rows_axpy(h[t], w, idx) for t in range(h.shape[0])])
        assert torch.equal(single, y), (isa_name, threads)
        assert torch.equal(sparse.rows_axpy(h_all, w, torch.arange(n_rows)), y_all), (isa_name, threads)
        results.append((y, y_all))
    for y, y_all in results[1:]:
        assert torch.equal(y, results[0][0]) and torch.equal(y_all, results[0][1])


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_rows_matmul_independent_of_threads(ggml_type, isa, act):
    w = make_weight(ggml_type, 300, 576)
    x = make_x(9, 576)
    idx = subsets(300)["random"]
    ops.set_num_threads(1)
    one = sparse.rows_matmul(x, w, idx)
    ops.set_num_threads(2)
    assert torch.equal(sparse.rows_matmul(x, w, idx), one)


@needs_kernels
def test_rows_axpy_dense_down_projection():
    # idx None with ReLU activations is the dense down projection of a transposed ffn_down
    w = make_weight(GGMLType.Q4_0, 256, 128)
    h = make_h(3, 256)
    assert_close_exact(sparse.rows_axpy(h, w, None), h, sparse.decode_rows(w, None).double(), "dense")


# ---- fallback, validation ----------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_reference_path_gives_same_values(ggml_type):
    w = make_weight(ggml_type, 70, 576)
    x, idx = make_x(3, 576), subsets(70)["random"]
    h = make_h(3, idx.numel())
    kernel_mm, kernel_axpy = sparse.rows_matmul(x, w, idx), sparse.rows_axpy(h, w, idx)
    ops.use_kernels(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # switched off on purpose: no warning
        ref_mm, ref_axpy = sparse.rows_matmul(x, w, idx), sparse.rows_axpy(h, w, idx)
    assert torch.equal(ref_mm, sparse.rows_matmul_ref(x, w, idx))
    assert torch.equal(ref_axpy, sparse.rows_axpy_ref(h, w, idx))
    rows = sparse.decode_rows(w, idx).double()
    assert_close_exact(kernel_mm, x, rows.T, "rows_matmul")
    assert_close_exact(ref_mm, x, rows.T, "rows_matmul ref")
    assert_close_exact(kernel_axpy, h, rows, "rows_axpy")
    assert_close_exact(ref_axpy, h, rows, "rows_axpy ref")


def test_missing_extension_warns_once(monkeypatch):
    w = make_weight(GGMLType.Q4_0, 20, 64)
    x, idx = make_x(2, 64), torch.tensor([3, 0, 19])
    h = make_h(2, 3)
    monkeypatch.setattr(ops, "_KERNELS", None)
    monkeypatch.setattr(sparse, "_warned_missing", False)
    try:
        ops.use_kernels(True)
        assert ops.supported_types() == frozenset()
        with pytest.warns(RuntimeWarning, match="not built"):
            y = sparse.rows_matmul(x, w, idx)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # only the first fallback warns
            y2 = sparse.rows_axpy(h, w, idx)
            sparse.rows_matmul(x, w, idx)
        assert torch.equal(y, sparse.rows_matmul_ref(x, w, idx))
        assert torch.equal(y2, sparse.rows_axpy_ref(h, w, idx))
    finally:
        monkeypatch.undo()
        ops.use_kernels(True)


def test_non_kernel_types_use_reference_without_warning():
    w = ops.QWeight.from_numpy(random_q4_k(9, 256), GGMLType.Q4_K, (9, 256))
    x, idx = make_x(3, 256), torch.tensor([8, 2])
    h = make_h(3, 2)
    with warnings.catch_warnings():
        if ops.kernels_available():
            warnings.simplefilter("error")
        assert torch.equal(sparse.rows_matmul(x, w, idx), sparse.rows_matmul_ref(x, w, idx))
        assert torch.equal(sparse.rows_axpy(h, w, idx), sparse.rows_axpy_ref(h, w, idx))


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_validation(ggml_type):
    w = make_weight(ggml_type, 20, 64)
    x = make_x(2, 64)
    for bad in ([20], [-1], [0, 25]):
        with pytest.raises(IndexError):
            sparse.rows_matmul(x, w, torch.tensor(bad))
        with pytest.raises(IndexError):
            sparse.rows_axpy(make_h(2, len(bad)), w, torch.tensor(bad))
    with pytest.raises(ValueError):
        sparse.rows_matmul(make_x(2, 32), w, torch.tensor([1]))
    with pytest.raises(ValueError):
        sparse.rows_axpy(make_h(2, 3), w, torch.tensor([1, 2]))
    with pytest.raises(ValueError):
        sparse.rows_axpy(make_h(2, 19), w, None)
    # empty selections and other index dtypes / layouts
    assert sparse.rows_matmul(x, w, torch.zeros(0, dtype=torch.int64)).shape == (2, 0)
    assert torch.equal(
        sparse.rows_axpy(torch.zeros(2, 0), w, torch.zeros(0, dtype=torch.int64)), torch.zeros(2, 64)
    )
    idx32 = torch.tensor([5, 1, 7, 3], dtype=torch.int32)
    idx_strided = torch.tensor([5, 0, 1, 0, 7, 0, 3, 0])[::2]
    expected = sparse.rows_matmul(x, w, idx32.long())
    assert torch.equal(sparse.rows_matmul(x, w, idx32), expected)
    assert torch.equal(sparse.rows_matmul(x, w, idx_strided), expected)
    h = make_h(2, 4)
    assert torch.equal(sparse.rows_axpy(h.T.contiguous().T, w, idx32), sparse.rows_axpy(h, w, idx32.long()))


# ---- ffn_rows: fused decode FFN ------------------------------------------------------------------------------


def unfused(u: torch.Tensor, gate, up, down_t, idx, relu_up: bool) -> torch.Tensor:
    """The decode path before fusion: rows_matmul, rows_matmul, relu * mul in torch, rows_axpy."""
    g, v = sparse.rows_matmul(u, gate, idx), sparse.rows_matmul(u, up, idx)
    return sparse.rows_axpy(torch.relu(g).mul_(torch.relu(v) if relu_up else v), down_t, idx)


def ffn_weights(types, n_rows: int, n_in: int, n_out: int, seed: int = 0):
    gate_type, up_type, down_type = types
    return (
        make_weight(gate_type, n_rows, n_in, seed),
        make_weight(up_type, n_rows, n_in, seed + 1),
        make_weight(down_type, n_rows, n_out, seed + 2),
    )


def ffn_cases(ggml_type: GGMLType):
    """(gate, up, down) types: all of one type, and one mixed triple with it as the gate."""
    other = GGMLType.F16 if ggml_type in BLOCK_TYPES else GGMLType.Q8_0
    return [(ggml_type,) * 3, (ggml_type, other, GGMLType.Q4_0)]


def ffn_shapes(types):
    """(K, D) pairs valid for the types: odd lengths where every weight is F32/F16."""
    if all(t not in BLOCK_TYPES for t in types):
        return [(1, 7), (33, 100), (576, 576)]
    k = [32, 576] if any(t in BLOCK_TYPES for t in types[:2]) else [7, 100]
    d = [64, 544] if types[2] in BLOCK_TYPES else [33, 547]
    return list(zip(k, d, strict=False))


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_ffn_rows_equals_unfused_bitwise(ggml_type, isa, act):
    for types in ffn_cases(ggml_type):
        for (n_in, n_out), n_rows in itertools.product(ffn_shapes(types), [1, 7, 70]):
            gate, up, down_t = ffn_weights(types, n_rows, n_in, n_out)
            x = make_x(3, n_in)
            for (name, idx), relu_up in itertools.product(subsets(n_rows).items(), [False, True]):
                where = f"{[t.name for t in types]} {isa} {act} N={n_rows} K={n_in} D={n_out} idx={name} {relu_up}"
                y = sparse.ffn_rows(x[0], gate, up, down_t, idx, relu_up)
                assert y.shape == (n_out,) and y.dtype == torch.float32, where
                assert torch.equal(y, unfused(x[0], gate, up, down_t, idx, relu_up)), where
                # a (1, K) token gives (1, D); the same token inside an unfused batch has the same bits
                assert torch.equal(sparse.ffn_rows(x[:1], gate, up, down_t, idx, relu_up), y[None]), where
                assert torch.equal(unfused(x, gate, up, down_t, idx, relu_up)[0], y), where
                if idx.numel() == 0:
                    assert torch.equal(y, torch.zeros(n_out)), where


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_ffn_rows_matches_reference(ggml_type, act):
    # tolerance propagated from tests/test_ops.py: 1e-5 of |x| @ |W|^T on g and v, then through relu * mul and
    # the down projection; "q8" compares the quant gate/up against the reference fed the int8-rounded u. (Every
    # SIMD variant is bit-identical to the unfused ops, which test_rows_*_matches_reference check per variant.)
    isa = ops._KERNELS.isa().decode()
    for types in ffn_cases(ggml_type):
        for (n_in, n_out), n_rows in itertools.product(ffn_shapes(types), [7, 70]):
            gate, up, down_t = ffn_weights(types, n_rows, n_in, n_out)
            u = make_x(1, n_in)[0]
            for (name, idx), relu_up in itertools.product(subsets(n_rows).items(), [False, True]):
                where = f"{[t.name for t in types]} {isa} {act} N={n_rows} K={n_in} D={n_out} idx={name} {relu_up}"
                y = sparse.ffn_rows(u, gate, up, down_t, idx, relu_up)
                wg, wu, wd = (sparse.decode_rows(w, idx).double() for w in (gate, up, down_t))
                ug = fake_quant_act(u) if act == "q8" and types[0] in QUANT_TYPES else u
                uu = fake_quant_act(u) if act == "q8" and types[1] in QUANT_TYPES else u
                g, v = wg @ ug.double(), wu @ uu.double()
                sg, sv = wg.abs() @ ug.double().abs(), wu.abs() @ uu.double().abs()
                gv = torch.relu(v) if relu_up else v
                h = torch.relu(g) * gv
                err_h = 1e-5 * (sg * gv.abs() + g.abs() * sv + 1e-5 * sg * sv) + 1e-6 * h.abs()
                bound = (err_h + 1e-5 * h.abs()) @ wd.abs() + 1e-30
                assert ((y.double() - h @ wd).abs() <= bound).all(), where
                ref = sparse.ffn_rows_ref(u, gate, up, down_t, idx, relu_up)
                if act == "f32":
                    assert ((ref.double() - h @ wd).abs() <= bound).all(), where


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_ffn_rows_independent_of_threads(ggml_type, isa, act):
    n_rows, n_in, n_out = 300, 576, 544 if ggml_type in BLOCK_TYPES else 547
    types = (ggml_type,) * 3
    gate, up, down_t = ffn_weights(types, n_rows, n_in, n_out)
    u = make_x(1, n_in)[0]
    for name in ("random", "sorted", "all"):
        idx = subsets(n_rows)[name]
        results = []
        for threads in (1, 2, 3):
            ops.set_num_threads(threads)
            results.append(sparse.ffn_rows(u, gate, up, down_t, idx, False))
        assert all(torch.equal(r, results[0]) for r in results[1:]), name
        assert torch.equal(results[0], unfused(u, gate, up, down_t, idx, False)), name


@needs_kernels
def test_ffn_rows_fallbacks():
    gate, up, down_t = ffn_weights((GGMLType.Q4_0,) * 3, 70, 64, 96)
    x, idx = make_x(3, 64), subsets(70)["random"]
    # several tokens: the unfused ops, same bits
    assert torch.equal(
        sparse.ffn_rows(x, gate, up, down_t, idx, True), unfused(x, gate, up, down_t, idx, True)
    )
    # kernels switched off: the torch reference, exactly
    ops.use_kernels(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = sparse.ffn_rows(x[0], gate, up, down_t, idx, False)
    assert torch.equal(y, sparse.ffn_rows_ref(x[0], gate, up, down_t, idx, False))
    ops.use_kernels(True)
    # a non-kernel type anywhere: the unfused ops (reference for that weight)
    q4_k = ops.QWeight.from_numpy(random_q4_k(70, 256, seed=2), GGMLType.Q4_K, (70, 256))
    y = sparse.ffn_rows(x[0], gate, up, q4_k, idx, False)
    assert torch.equal(y, unfused(x[0], gate, up, q4_k, idx, False))


@needs_kernels
def test_ffn_rows_validation():
    gate, up, down_t = ffn_weights((GGMLType.Q8_0,) * 3, 20, 64, 32)
    u = make_x(1, 64)[0]
    for bad in ([20], [-1], [0, 25]):
        with pytest.raises(IndexError):
            sparse.ffn_rows(u, gate, up, down_t, torch.tensor(bad), False)
    with pytest.raises(ValueError):
        sparse.ffn_rows(make_x(1, 32)[0], gate, up, down_t, torch.tensor([1]), False)
    with pytest.raises(ValueError):
        sparse.ffn_rows(u, gate, make_weight(GGMLType.Q8_0, 21, 64), down_t, torch.tensor([1]), False)
    with pytest.raises(ValueError):
        sparse.ffn_rows(u, gate, up, make_weight(GGMLType.Q8_0, 19, 32), torch.tensor([1]), False)
    # index dtypes and layouts
    idx32 = torch.tensor([5, 1, 7, 3], dtype=torch.int32)
    expected = sparse.ffn_rows(u, gate, up, down_t, idx32.long(), True)
    assert torch.equal(sparse.ffn_rows(u, gate, up, down_t, idx32, True), expected)
    assert torch.equal(
        sparse.ffn_rows(u, gate, up, down_t, torch.tensor([5, 0, 1, 0, 7, 0, 3, 0])[::2], True), expected
    )
