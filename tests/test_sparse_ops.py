"""Sparse FFN kernels (kernels/cpu/sparse.c) against their torch references (powerinfer.ops.sparse.*_ref).

Tolerance as in tests/test_ops.py: exact mode (float activations) max|y - ref| <= 1e-5 * (|x| @ |W|^T) per
output; rows_matmul in the "q8" activation precision is checked against the reference fed the int8-rounded x.
rows_axpy is exact mode whatever the activation precision and is the same chain of FMAs per output element in
every SIMD variant, thread count and batch, so those are compared bit for bit.

FFN activations of the fused kernels (ffn_rows, predict_ffn) against torch's (gated with rows_matmul, torch's
activation and rows_axpy): ReLU bit for bit; silu, gelu and gelu_tanh use libm (expf, erff, tanhf) in torch's
formulas. Measured over g in [-12, 12] and |g| in [1e-6, 100] (h extracted exactly through an identity F32 down
projection; torch 2.13 on an AVX-512 CPU), |act_kernel(g) - act_torch(g)| <= c |g| with c = 1.0e-7 (silu),
2.9e-7 (gelu: torch's vectorised erf is a 1.5e-7 polynomial; near g = -5.5 the float32 1 + erf cancels to 0 in
torch, 6e-8 here) and 1.1e-7 (gelu_tanh); the tests bound |dh| by ACT_TOL = 1e-6 * |g| * |up|.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import torch
from conftest import down_rel, random_tq2_0

from powerinfer import ops, quant
from powerinfer.gguf.constants import GGMLType
from powerinfer.ops import sparse
from powerinfer.quant import quantize

# K-quants: rows of 256-element super-blocks, exact (float activation) kernels in both precisions; test weights are
# random valid super-blocks (nothing here quantizes to them yet), the reference decodes them with the gguf package
KQ_TYPES = [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
# the types the property tests run over: every 32-element/float type, and three of the five K-quants (Q5_K is
# Q4_K's scales plus a high bit; Q2_K is left to the decoder tests): every K decoder's rows are checked bit for bit
# against the gguf package in tests/test_kquant_sparse.py (CI time: these tests' float64 references are slow)
KERNEL_TYPES = sorted(quant.KERNEL_TYPES) + [GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q6_K]
# rows of 32-element blocks: exact (f32) and int8 (q8) kernels
QUANT_TYPES = {GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q5_1}
BLOCK_TYPES = QUANT_TYPES
SHAPES_T = [1, 3, 9]

ACT_TOL = 1e-6  # |act_kernel(g) - act_torch(g)| <= ACT_TOL * |g|: a few times the measured 1e-7 .. 2.9e-7
OTHER_ACTS = [a for a in ops.ACTIVATIONS if a != "relu"]

needs_kernels = pytest.mark.skipif(not ops.kernels_available(), reason="powerinfer._kernels is not built")


def needs_isa(name: str):
    """Skip unless this CPU runs the SIMD variant `name` (a variant is never compared with itself)."""
    has = name in available_isas()
    return pytest.mark.skipif(not has, reason=f"this CPU has no {name} (best SIMD variant: {ops.isa_best()})")


def available_isas() -> list[str]:
    """The SIMD variants this CPU runs."""
    best = ops.isa_best()
    return [] if best is None else list(ops.ISA_NAMES[: ops.ISA_NAMES.index(best) + 1])


def cols_for(ggml_type: GGMLType) -> list[int]:
    """Row lengths: any for F32/F16 (tails of every size), multiples of 32 for the quant types, of 256 for the
    K-quants."""
    if ggml_type in KQ_TYPES:
        return [256, 512]
    return [32, 576] if ggml_type in BLOCK_TYPES else [1, 7, 33, 100, 576]


def long_cols(ggml_type: GGMLType) -> int:
    """A row length of several blocks (super-blocks) for the type."""
    return 768 if ggml_type in KQ_TYPES else 576


def make_weight(ggml_type: GGMLType, n_rows: int, n_cols: int, seed: int = 0) -> ops.QWeight:
    if ggml_type in KQ_TYPES:
        # imported here: test_kquant_kernels imports this module
        from test_kquant_kernels import random_k_blocks

        raw = random_k_blocks(ggml_type, n_rows, n_cols, seed)
        return ops.QWeight.from_numpy(raw, ggml_type, (n_rows, n_cols))
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
    kc = ops.KernelContext(act_precision=act, isa=isa)
    for n_cols, n_rows in itertools.product(cols_for(ggml_type), [1, 7, 70]):
        w = make_weight(ggml_type, n_rows, n_cols)
        for (name, idx), n_tokens in itertools.product(subsets(n_rows).items(), SHAPES_T):
            x = make_x(n_tokens, n_cols)
            y = sparse.rows_matmul(x, w, idx, kc)
            where = f"{ggml_type.name} {isa} {act} N={n_rows} K={n_cols} T={n_tokens} idx={name}"
            assert y.shape == (n_tokens, idx.numel()), where
            if ggml_type in QUANT_TYPES and act == "q8":
                x = fake_quant_act(x)
            assert_close_exact(y, x, sparse.decode_rows(w, idx).double().T, where)


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_rows_matmul_all_rows_is_linear(ggml_type, isa, act):
    kc = ops.KernelContext(act_precision=act, isa=isa)
    n_cols = long_cols(ggml_type)
    w = make_weight(ggml_type, 300, n_cols)
    x = make_x(9, n_cols)
    # K-quant sparse rows run the exact kernels in both precisions (as the fused FFN kernels do); the dense "q8"
    # matmul of a K-quant has its own int8 kernels
    dense = ops.linear(x, w, ops.KernelContext(act_precision="f32", isa=isa) if ggml_type in KQ_TYPES else kc)
    assert torch.equal(sparse.rows_matmul(x, w, torch.arange(300), kc), dense)
    # any subset is the matching columns of the dense result, bit for bit
    idx = subsets(300)["random"]
    assert torch.equal(sparse.rows_matmul(x, w, idx, kc), dense[:, idx])
    assert torch.equal(sparse.rows_matmul(x[2], w, idx, kc), dense[2, idx])


# ---- rows_axpy -----------------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_rows_axpy_matches_reference(ggml_type, isa):
    kc = ops.KernelContext(isa=isa)
    for n_out, n_rows in itertools.product(cols_for(ggml_type), [1, 7, 70, 600]):
        w = make_weight(ggml_type, n_rows, n_out)
        cases = dict(subsets(n_rows).items())
        cases["None"] = None
        for (name, idx), n_tokens in itertools.product(cases.items(), SHAPES_T):
            n_sel = n_rows if idx is None else idx.numel()
            h = make_h(n_tokens, n_sel)
            y = sparse.rows_axpy(h, w, idx, kc)
            where = f"{ggml_type.name} {isa} N={n_rows} D={n_out} T={n_tokens} idx={name}"
            assert_close_exact(y, h, sparse.decode_rows(w, idx).double(), where)
            if n_sel == 0:
                assert torch.equal(y, torch.zeros(n_tokens, n_out)), where
            if n_tokens > 1:
                assert torch.equal(y[1], torch.zeros(n_out)), where  # every h zero


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_rows_axpy_bitwise_invariants(ggml_type, act):
    # same bits for: every SIMD variant this CPU has, 1 or 2 threads, a token alone or in a batch, idx None or
    # arange, and whatever the activation precision (rows_axpy is always exact mode). 600 rows: the one-token
    # path lists the rows with h != 0 in chunks, which must not change a bit either.
    # (K-quants: 5 super-blocks, split 2 + 3 over two threads)
    n_rows, n_out = 600, 1280 if ggml_type in KQ_TYPES else 544 if ggml_type in BLOCK_TYPES else 547
    w = make_weight(ggml_type, n_rows, n_out)
    idx = subsets(n_rows)["random"]
    h = make_h(9, idx.numel())
    h_all = make_h(9, n_rows, seed=5)
    results = []
    for isa_name, threads in itertools.product(available_isas(), [1, 2]):
        kc = ops.KernelContext(n_threads=threads, act_precision=act, isa=isa_name)
        y, y_all = sparse.rows_axpy(h, w, idx, kc), sparse.rows_axpy(h_all, w, None, kc)
        single = torch.stack([sparse.rows_axpy(h[t], w, idx, kc) for t in range(h.shape[0])])
        assert torch.equal(single, y), (isa_name, threads)
        assert torch.equal(sparse.rows_axpy(h_all, w, torch.arange(n_rows), kc), y_all), (isa_name, threads)
        single_all = torch.stack([sparse.rows_axpy(h_all[t], w, None, kc) for t in range(h.shape[0])])
        assert torch.equal(single_all, y_all), (isa_name, threads)
        results.append((y, y_all))
    for y, y_all in results[1:]:
        assert torch.equal(y, results[0][0]) and torch.equal(y_all, results[0][1])


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_rows_matmul_independent_of_threads(ggml_type, isa, act):
    w = make_weight(ggml_type, 300, long_cols(ggml_type))
    x = make_x(9, long_cols(ggml_type))
    idx = subsets(300)["random"]
    one = sparse.rows_matmul(x, w, idx, ops.KernelContext(n_threads=1, act_precision=act, isa=isa))
    two = sparse.rows_matmul(x, w, idx, ops.KernelContext(n_threads=2, act_precision=act, isa=isa))
    assert torch.equal(two, one)


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
    w = make_weight(ggml_type, 70, long_cols(ggml_type))
    x, idx = make_x(3, long_cols(ggml_type)), subsets(70)["random"]
    h = make_h(3, idx.numel())
    kernel_mm, kernel_axpy = sparse.rows_matmul(x, w, idx), sparse.rows_axpy(h, w, idx)
    off = ops.KernelContext(enabled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # switched off on purpose: no warning
        ref_mm, ref_axpy = sparse.rows_matmul(x, w, idx, off), sparse.rows_axpy(h, w, idx, off)
    assert torch.equal(ref_mm, sparse.rows_matmul_ref(x, w, idx))
    assert torch.equal(ref_axpy, sparse.rows_axpy_ref(h, w, idx))
    rows = sparse.decode_rows(w, idx).double()
    assert_close_exact(kernel_mm, x, rows.T, "rows_matmul")
    assert_close_exact(ref_mm, x, rows.T, "rows_matmul ref")
    assert_close_exact(kernel_axpy, h, rows, "rows_axpy")
    assert_close_exact(ref_axpy, h, rows, "rows_axpy ref")


def test_missing_extension_runs_the_references(monkeypatch):
    from powerinfer.ops import library

    w = make_weight(GGMLType.Q4_0, 20, 64)
    x, idx = make_x(2, 64), torch.tensor([3, 0, 19])
    h = make_h(2, 3)
    monkeypatch.setattr(library, "load", lambda: None)  # as if powerinfer._kernels were not built
    kc = ops.KernelContext()
    assert kc.supported_types() == frozenset() and not kc.uses_kernels
    assert torch.equal(sparse.rows_matmul(x, w, idx, kc), sparse.rows_matmul_ref(x, w, idx))
    assert torch.equal(sparse.rows_axpy(h, w, idx, kc), sparse.rows_axpy_ref(h, w, idx))
    gate, up, down_t = ffn_weights((GGMLType.Q4_0,) * 3, 20, 64, 32)
    for act in ops.ACTIVATIONS:
        want = sparse.ffn_rows_ref(x[0], gate, up, down_t, idx, act, True)
        assert torch.equal(sparse.ffn_rows(x[0], gate, up, down_t, idx, act, True, kc), want), act
    assert sparse.predict_ffn(x[:1], x[:1], gate, up, 0.0, gate, up, down_t, "relu", False, kc) is None
    assert ops.ffn_scratch_bytes(20, 64) == 0 and ops.attn_scratch_bytes(8, 4) == 0


def test_non_kernel_types_use_reference_without_warning():
    w = ops.QWeight.from_numpy(random_tq2_0(9, 256), GGMLType.TQ2_0, (9, 256))
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
    n_cols = 256 if ggml_type in KQ_TYPES else 64
    w = make_weight(ggml_type, 20, n_cols)
    x = make_x(2, n_cols)
    for bad in ([20], [-1], [0, 25]):
        with pytest.raises(IndexError):
            sparse.rows_matmul(x, w, torch.tensor(bad))
        with pytest.raises(IndexError):
            sparse.rows_axpy(make_h(2, len(bad)), w, torch.tensor(bad))
    with pytest.raises(ValueError):
        sparse.rows_matmul(make_x(2, n_cols // 2), w, torch.tensor([1]))
    with pytest.raises(ValueError):
        sparse.rows_axpy(make_h(2, 3), w, torch.tensor([1, 2]))
    with pytest.raises(ValueError):
        sparse.rows_axpy(make_h(2, 19), w, None)
    # empty selections and other index dtypes / layouts
    assert sparse.rows_matmul(x, w, torch.zeros(0, dtype=torch.int64)).shape == (2, 0)
    assert torch.equal(
        sparse.rows_axpy(torch.zeros(2, 0), w, torch.zeros(0, dtype=torch.int64)), torch.zeros(2, n_cols)
    )
    idx32 = torch.tensor([5, 1, 7, 3], dtype=torch.int32)
    idx_strided = torch.tensor([5, 0, 1, 0, 7, 0, 3, 0])[::2]
    expected = sparse.rows_matmul(x, w, idx32.long())
    assert torch.equal(sparse.rows_matmul(x, w, idx32), expected)
    assert torch.equal(sparse.rows_matmul(x, w, idx_strided), expected)
    h = make_h(2, 4)
    assert torch.equal(sparse.rows_axpy(h.T.contiguous().T, w, idx32), sparse.rows_axpy(h, w, idx32.long()))


# ---- ffn_rows: fused decode FFN ------------------------------------------------------------------------------


def unfused(
    u: torch.Tensor, gate, up, down_t, idx, relu_up: bool, kc=None, act: str = "relu"
) -> torch.Tensor:
    """The decode path before fusion: rows_matmul, rows_matmul, the gating in torch, rows_axpy."""
    g, v = sparse.rows_matmul(u, gate, idx, kc), sparse.rows_matmul(u, up, idx, kc)
    return sparse.rows_axpy(ops.gated_ref(g, v, act, relu_up), down_t, idx, kc)


def ffn_weights(types, n_rows: int, n_in: int, n_out: int, seed: int = 0):
    gate_type, up_type, down_type = types
    return (
        make_weight(gate_type, n_rows, n_in, seed),
        make_weight(up_type, n_rows, n_in, seed + 1),
        make_weight(down_type, n_rows, n_out, seed + 2),
    )


def ffn_cases(ggml_type: GGMLType):
    """(gate, up, down) types: all of one type, and one mixed triple with it as the gate (a K-quant gate with a
    Q8_0 up and another K-quant down, as the mixes of K-quant files have them)."""
    if ggml_type in KQ_TYPES:
        other_k = GGMLType.Q6_K if ggml_type != GGMLType.Q6_K else GGMLType.Q4_K
        return [(ggml_type,) * 3, (ggml_type, GGMLType.Q8_0, other_k)]
    other = GGMLType.F16 if ggml_type in BLOCK_TYPES else GGMLType.Q8_0
    return [(ggml_type,) * 3, (ggml_type, other, GGMLType.Q4_0)]


def ffn_shapes(types):
    """(K, D) pairs valid for the types: odd lengths where every weight is F32/F16, multiples of 256 for the
    K-quants."""
    if all(t not in BLOCK_TYPES and t not in KQ_TYPES for t in types):
        return [(1, 7), (33, 100), (576, 576)]
    if any(t in KQ_TYPES for t in types[:2]):
        k = [256, 768]
    else:
        k = [32, 576] if any(t in BLOCK_TYPES for t in types[:2]) else [7, 100]
    if types[2] in KQ_TYPES:
        d = [256, 768]
    else:
        d = [64, 544] if types[2] in BLOCK_TYPES else [33, 547]
    return list(zip(k, d, strict=False))


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_ffn_rows_equals_unfused_bitwise(ggml_type, isa, act):
    kc = ops.KernelContext(act_precision=act, isa=isa)
    for types in ffn_cases(ggml_type):
        for (n_in, n_out), n_rows in itertools.product(ffn_shapes(types), [1, 7, 70]):
            gate, up, down_t = ffn_weights(types, n_rows, n_in, n_out)
            x = make_x(3, n_in)
            scratch = torch.empty(ops.ffn_scratch_bytes(n_rows, n_in), dtype=torch.uint8)
            for (name, idx), relu_up in itertools.product(subsets(n_rows).items(), [False, True]):
                where = f"{[t.name for t in types]} {isa} {act} N={n_rows} K={n_in} D={n_out} idx={name} {relu_up}"
                y = sparse.ffn_rows(x[0], gate, up, down_t, idx, "relu", relu_up, kc, scratch=scratch)
                assert y.shape == (n_out,) and y.dtype == torch.float32, where
                assert torch.equal(y, unfused(x[0], gate, up, down_t, idx, relu_up, kc)), where
                # a (1, K) token gives (1, D); the same token inside an unfused batch has the same bits
                assert torch.equal(
                    sparse.ffn_rows(x[:1], gate, up, down_t, idx, "relu", relu_up, kc), y[None]
                ), where
                assert torch.equal(unfused(x, gate, up, down_t, idx, relu_up, kc)[0], y), where
                if idx.numel() == 0:
                    assert torch.equal(y, torch.zeros(n_out)), where


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_ffn_rows_matches_reference(ggml_type, act):
    # tolerance propagated from tests/test_ops.py: 1e-5 of |x| @ |W|^T on g and v, then through relu * mul and
    # the down projection; "q8" compares the quant gate/up against the reference fed the int8-rounded u. (Every
    # SIMD variant is bit-identical to the unfused ops, which test_rows_*_matches_reference check per variant.)
    kc = ops.KernelContext(act_precision=act)
    for types in ffn_cases(ggml_type):
        for (n_in, n_out), n_rows in itertools.product(ffn_shapes(types), [7, 70]):
            gate, up, down_t = ffn_weights(types, n_rows, n_in, n_out)
            u = make_x(1, n_in)[0]
            for (name, idx), relu_up in itertools.product(subsets(n_rows).items(), [False, True]):
                where = (
                    f"{[t.name for t in types]} {kc.isa_name} {act} N={n_rows} K={n_in} D={n_out} idx={name}"
                )
                y = sparse.ffn_rows(u, gate, up, down_t, idx, "relu", relu_up, kc)
                wg, wu, wd = (sparse.decode_rows(w, idx).double() for w in (gate, up, down_t))
                ug = fake_quant_act(u) if act == "q8" and types[0] in QUANT_TYPES else u
                uu = fake_quant_act(u) if act == "q8" and types[1] in QUANT_TYPES else u
                g, v = wg @ ug.double(), wu @ uu.double()
                sg, sv = wg.abs() @ ug.double().abs(), wu.abs() @ uu.double().abs()
                gv = torch.relu(v) if relu_up else v
                h = torch.relu(g) * gv
                err_h = 1e-5 * (sg * gv.abs() + g.abs() * sv + 1e-5 * sg * sv) + 1e-6 * h.abs()
                bound = (err_h + down_rel(act, types[2]) * h.abs()) @ wd.abs() + 1e-30
                assert ((y.double() - h @ wd).abs() <= bound).all(), f"{where} {relu_up}"
                ref = sparse.ffn_rows_ref(u, gate, up, down_t, idx, "relu", relu_up)
                if act == "f32":
                    assert ((ref.double() - h @ wd).abs() <= bound).all(), f"{where} {relu_up}"


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_ffn_rows_independent_of_threads(ggml_type, isa, act):
    n_rows, n_in, n_out = 600, 576, 544 if ggml_type in BLOCK_TYPES else 547
    if ggml_type in KQ_TYPES:
        n_in, n_out = 768, 1280
    types = (ggml_type,) * 3
    gate, up, down_t = ffn_weights(types, n_rows, n_in, n_out)
    u = make_x(1, n_in)[0]
    for name in ("random", "sorted", "all"):
        idx = subsets(n_rows)[name]
        results = []
        for threads in (1, 2, 3):
            kc = ops.KernelContext(n_threads=threads, act_precision=act, isa=isa)
            results.append(sparse.ffn_rows(u, gate, up, down_t, idx, "relu", False, kc))
        assert all(torch.equal(r, results[0]) for r in results[1:]), name
        assert torch.equal(results[0], unfused(u, gate, up, down_t, idx, False, kc)), name


@needs_kernels
def test_ffn_rows_fallbacks():
    gate, up, down_t = ffn_weights((GGMLType.Q4_0,) * 3, 70, 64, 96)
    x, idx = make_x(3, 64), subsets(70)["random"]
    # several tokens: the unfused ops, same bits
    assert torch.equal(
        sparse.ffn_rows(x, gate, up, down_t, idx, "relu", True), unfused(x, gate, up, down_t, idx, True)
    )
    # kernels switched off: the torch reference, exactly
    off = ops.KernelContext(enabled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = sparse.ffn_rows(x[0], gate, up, down_t, idx, "relu", False, off)
    assert torch.equal(y, sparse.ffn_rows_ref(x[0], gate, up, down_t, idx, "relu", False))
    # a non-kernel type anywhere: the unfused ops (reference for that weight)
    tq2 = ops.QWeight.from_numpy(random_tq2_0(70, 256, seed=2), GGMLType.TQ2_0, (70, 256))
    y = sparse.ffn_rows(x[0], gate, up, tq2, idx, "relu", False)
    assert torch.equal(y, unfused(x[0], gate, up, tq2, idx, False))


@needs_kernels
def test_ffn_rows_validation():
    gate, up, down_t = ffn_weights((GGMLType.Q8_0,) * 3, 20, 64, 32)
    u = make_x(1, 64)[0]
    for bad in ([20], [-1], [0, 25]):
        with pytest.raises(IndexError):
            sparse.ffn_rows(u, gate, up, down_t, torch.tensor(bad), "relu", False)
    with pytest.raises(ValueError):
        sparse.ffn_rows(make_x(1, 32)[0], gate, up, down_t, torch.tensor([1]), "relu", False)
    with pytest.raises(ValueError):
        sparse.ffn_rows(u, gate, make_weight(GGMLType.Q8_0, 21, 64), down_t, torch.tensor([1]), "relu", False)
    with pytest.raises(ValueError):
        sparse.ffn_rows(u, gate, up, make_weight(GGMLType.Q8_0, 19, 32), torch.tensor([1]), "relu", False)
    with pytest.raises(ValueError, match="FFN activation must be one of"):
        sparse.ffn_rows(u, gate, up, down_t, torch.tensor([1]), "tanh", False)
    # index dtypes and layouts
    idx32 = torch.tensor([5, 1, 7, 3], dtype=torch.int32)
    expected = sparse.ffn_rows(u, gate, up, down_t, idx32.long(), "relu", True)
    assert torch.equal(sparse.ffn_rows(u, gate, up, down_t, idx32, "relu", True), expected)
    assert torch.equal(
        sparse.ffn_rows(u, gate, up, down_t, torch.tensor([5, 0, 1, 0, 7, 0, 3, 0])[::2], "relu", True),
        expected,
    )


# ---- FFN activations of the fused kernels --------------------------------------------------------------------


def identity_down(n_rows: int) -> ops.QWeight:
    """An F32 identity (N, N) as down_t: y[idx_m] = fma(h_m, 1, 0) = h_m exactly, so y shows the kernel's h."""
    return ops.QWeight.from_numpy(np.eye(n_rows, dtype=np.float32), GGMLType.F32, (n_rows, n_rows))


@needs_kernels
@pytest.mark.parametrize("act_name", OTHER_ACTS)
def test_ffn_rows_activation_values(act_name, isa):
    """The kernel's h = act(g) * up element by element (through an identity down projection) against torch's
    activation on the same g and up, which rows_matmul computes bit-identically to the kernel."""
    n_rows, n_in = 4096, 64
    rng = np.random.default_rng(7)
    scales = np.concatenate(
        [
            np.linspace(-12, 12, n_rows // 2),
            rng.choice([-1, 1], n_rows // 2) * 10 ** rng.uniform(-6, 2, n_rows // 2),
        ]
    )  # g from tiny to 100, both signs, dense around the activation's bend
    rows = rng.standard_normal((n_rows, n_in)).astype(np.float32)
    rows *= (scales / np.linalg.norm(rows, axis=1))[:, None]
    gate = ops.QWeight.from_numpy(rows.astype(np.float32), GGMLType.F32, (n_rows, n_in))
    up = make_weight(GGMLType.F32, n_rows, n_in, seed=8)
    eye = identity_down(n_rows)
    kc = ops.KernelContext(isa=isa)
    for seed, relu_up in itertools.product([1, 2], [False, True]):
        u = make_x(1, n_in, seed)[0]
        u /= u.norm()
        idx = torch.arange(n_rows)
        h = sparse.ffn_rows(u, gate, up, eye, idx, act_name, relu_up, kc)
        g, v = sparse.rows_matmul(u, gate, idx, kc), sparse.rows_matmul(u, up, idx, kc)
        want = ops.gated_ref(g, v, act_name, relu_up)
        vv = torch.relu(v) if relu_up else v
        err = (h.double() - want.double()).abs()
        assert (err <= ACT_TOL * g.double().abs() * vv.double().abs() + 1e-38).all(), (act_name, relu_up)
        # how many bits agree depends on torch's vectorised activation for the CPU (most of them on AVX-512
        # machines; 27% for gelu on a 2-core AVX2 EPYC), so only the bound above is the contract


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("act_name", ops.ACTIVATIONS)
def test_ffn_rows_activations_vs_torch(ggml_type, act_name, act):
    """ffn_rows with each activation against the unfused ops with torch's activation: ReLU bit for bit, the others
    within ACT_TOL * |g| * |up| per neuron, carried through the down rows."""
    kc = ops.KernelContext(act_precision=act)
    for types in ffn_cases(ggml_type):
        n_in, n_out = ffn_shapes(types)[-1]
        gate, up, down_t = ffn_weights(types, 70, n_in, n_out)
        u = make_x(1, n_in)[0]
        for (name, idx), relu_up in itertools.product(subsets(70).items(), [False, True]):
            where = f"{[t.name for t in types]} {act} {act_name} idx={name} {relu_up}"
            y = sparse.ffn_rows(u, gate, up, down_t, idx, act_name, relu_up, kc)
            want = unfused(u, gate, up, down_t, idx, relu_up, kc, act_name)
            if act_name == "relu":
                assert torch.equal(y, want), where
                continue
            g, v = sparse.rows_matmul(u, gate, idx, kc).double(), sparse.rows_matmul(u, up, idx, kc).double()
            vv = torch.relu(v) if relu_up else v
            h = ops.gated_ref(g, v, act_name, relu_up).double()
            wd = sparse.decode_rows(down_t, idx).double().abs()
            # the activation's difference per neuron, plus the two FMA chains rounding differently
            bound = (ACT_TOL * g.abs() * vv.abs()) @ wd + 2 * down_rel(act, types[2]) * (h.abs() @ wd) + 1e-30
            assert ((y.double() - want.double()).abs() <= bound).all(), where
            # kernel and reference against float64 math: matmul bounds of test_ffn_rows_matches_reference carried
            # through the activation (|act'| <= 1.2 for these three) plus ACT_TOL for the float32 activation
            wg, wu = sparse.decode_rows(gate, idx).double(), sparse.decode_rows(up, idx).double()
            ug = fake_quant_act(u) if act == "q8" and types[0] in QUANT_TYPES else u
            uu = fake_quant_act(u) if act == "q8" and types[1] in QUANT_TYPES else u
            g64, v64 = wg @ ug.double(), wu @ uu.double()
            sg, sv = wg.abs() @ ug.double().abs(), wu.abs() @ uu.double().abs()
            vv64 = torch.relu(v64) if relu_up else v64
            a64 = ops.act(act_name, g64)
            h64 = a64 * vv64
            err_h = 1e-5 * (1.2 * sg * vv64.abs() + a64.abs() * sv + 1.2e-5 * sg * sv)
            err_h += ACT_TOL * g64.abs() * vv64.abs() + 1e-6 * h64.abs()
            bound64 = (err_h + down_rel(act, types[2]) * h64.abs()) @ wd + 1e-30
            assert ((y.double() - h64 @ sparse.decode_rows(down_t, idx).double()).abs() <= bound64).all(), (
                where
            )
            if act == "f32":
                ref = sparse.ffn_rows_ref(u, gate, up, down_t, idx, act_name, relu_up)
                assert (
                    (ref.double() - h64 @ sparse.decode_rows(down_t, idx).double()).abs() <= bound64
                ).all(), where


@needs_kernels
@pytest.mark.parametrize("act_name", ops.ACTIVATIONS)
@pytest.mark.parametrize("precision", ["f32", "q8"])
def test_predict_ffn_equals_the_separate_steps(act_name, isa, precision):
    """pi_predict_ffn == linear(fc1), relu, linear(fc2) (exact), >= threshold, nonzero, then ffn_rows: bit for bit,
    for every activation, both precisions (q8: fc1, gate and up on int8 blocks), 1 or 2 threads; fc1 F16 or Q4_0
    (K = 288: one 8-block group of the one-token Q4_0 rows and a ragged tail)."""
    n_rows, n_in, n_out, rank = 300, 288, 96, 32
    gate, up, down_t = ffn_weights((GGMLType.Q4_0, GGMLType.Q4_0, GGMLType.Q8_0), n_rows, n_in, n_out)
    fc2 = make_weight(GGMLType.F16, n_rows, rank, seed=12)
    scratch = torch.empty(ops.ffn_scratch_bytes(n_rows, n_in, rank), dtype=torch.uint8)
    for fc1_type, threads, relu_up, seed in itertools.product(
        [GGMLType.F16, GGMLType.Q4_0], [1, 2], [False, True], [3, 4]
    ):
        fc1 = make_weight(fc1_type, rank, n_in, seed=11)
        kc = ops.KernelContext(n_threads=threads, isa=isa, act_precision=precision)
        x, u = make_x(1, n_in, seed), make_x(1, n_in, seed + 10)
        got = sparse.predict_ffn(
            x, u, fc1, fc2, 0.5, gate, up, down_t, act_name, relu_up, kc, scratch=scratch
        )
        assert got is not None
        y, n_active, seconds = got
        score = ops.linear(torch.relu(ops.linear(x, fc1, kc)), fc2, kc.exact)
        idx = (score[0] >= 0.5).nonzero().view(-1)
        assert 0 < n_active == idx.numel() < n_rows and seconds >= 0.0, (fc1_type, n_active)
        assert torch.equal(y, sparse.ffn_rows(u, gate, up, down_t, idx, act_name, relu_up, kc))
    # q8 precision with a K-quant fc1 (its q8 matmul is the Q8_K one): no fused kernel
    fc1 = make_weight(GGMLType.Q4_K, rank, 256, seed=11)
    gate, up, down_t = ffn_weights((GGMLType.Q4_0, GGMLType.Q4_0, GGMLType.Q8_0), n_rows, 256, n_out)
    q8 = ops.KernelContext(act_precision="q8")
    x, u = make_x(1, 256, 5), make_x(1, 256, 6)
    assert sparse.predict_ffn(x, u, fc1, fc2, 0.5, gate, up, down_t, act_name, False, q8) is None


@needs_kernels
@needs_isa("avx512")
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_ffn_rows_avx2_and_avx512_per_call(ggml_type):
    """Both variants on the same data, alternating per call: each reproduces its own bits (the variant is an
    argument of the call, nothing global), and both are within float32 rounding of the reference (their row dot
    products sum in different vector widths, so they differ from each other in the last bits)."""
    avx2, avx512 = ops.KernelContext(isa="avx2"), ops.KernelContext(isa="avx512")
    types = (ggml_type,) * 3
    n_in, n_out = ffn_shapes(types)[-1]
    gate, up, down_t = ffn_weights(types, 300, n_in, n_out)
    u, idx = make_x(1, n_in)[0], subsets(300)["random"]
    first = {kc.isa: sparse.ffn_rows(u, gate, up, down_t, idx, "silu", False, kc) for kc in (avx2, avx512)}
    for kc in (avx512, avx2, avx512, avx2):
        assert torch.equal(sparse.ffn_rows(u, gate, up, down_t, idx, "silu", False, kc), first[kc.isa])
    ref = sparse.ffn_rows_ref(u, gate, up, down_t, idx, "silu", False).double()
    for y in first.values():
        torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


# ---- caller-owned scratch --------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("act_precision", ["f32", "q8"])
def test_scratch_too_small_is_a_clear_error(act_precision):
    n_rows, n_in, n_out, rank = 70, 64, 96, 16
    gate, up, down_t = ffn_weights((GGMLType.Q4_0,) * 3, n_rows, n_in, n_out)
    fc1, fc2 = make_weight(GGMLType.F32, rank, n_in, 5), make_weight(GGMLType.F32, n_rows, rank, 6)
    kc = ops.KernelContext(act_precision=act_precision)
    u, idx = make_x(1, n_in)[0], subsets(n_rows)["all"]
    need = ops.ffn_scratch_bytes(n_rows, n_in, rank)
    assert need > n_rows * 4
    # the size the helper gives serves every selection, in both precisions, and a buffer reused across calls
    scratch = torch.zeros(need, dtype=torch.uint8)
    for name, sel in subsets(n_rows).items():
        got = sparse.ffn_rows(u, gate, up, down_t, sel, "silu", True, kc, scratch=scratch)
        assert torch.equal(got, sparse.ffn_rows(u, gate, up, down_t, sel, "silu", True, kc)), name
    for small in (torch.empty(0, dtype=torch.uint8), torch.empty(n_rows * 2, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="ffn_rows: scratch buffer of .* bytes is too small") as info:
            sparse.ffn_rows(u, gate, up, down_t, idx, "relu", False, kc, scratch=small)
        assert "ffn_scratch_bytes" in str(info.value) and "\n" not in str(info.value)
        if act_precision == "f32":
            with pytest.raises(ValueError, match="predict_ffn: scratch buffer of .* bytes is too small"):
                sparse.predict_ffn(
                    u[None], u[None], fc1, fc2, 0.0, gate, up, down_t, "relu", False, kc, scratch=small
                )
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        sparse.ffn_rows(u, gate, up, down_t, idx, "relu", False, kc, scratch=scratch.view(2, -1).T)
    # an empty selection needs no scratch at all
    empty = torch.zeros(0, dtype=torch.int64)
    assert torch.equal(
        sparse.ffn_rows(
            u, gate, up, down_t, empty, "relu", False, kc, scratch=torch.empty(0, dtype=torch.uint8)
        ),
        torch.zeros(n_out),
    )
