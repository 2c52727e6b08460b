"""CATS's thresholded FFN (ops.cats_ffn, kernels/cpu/ffn.c pi_cats_ffn) against the masked dense reference.

The kernel computes the gate rows of the candidate neurons, keeps those with |act(g)| > threshold, then their up
rows, and (two stages) keeps those whose |h| = |act(g) * up| passes a second per-neuron threshold, then their down
rows. Checked, for one and two stages:
- bit for bit against the same computation from the separate row ops (rows_matmul of the gate, the activation
  and mask in torch, rows_matmul of the active up rows, rows_axpy of the down rows) for ReLU, in every SIMD
  variant and both activation precisions; the libm activations (silu, gelu) within ACT_TOL of torch's, with the
  same active set except neurons within that tolerance of the threshold;
- against cats_ffn_ref, the masked dense torch reference on float64-decoded weights, for every kernel weight
  type, all rows or a candidate subset, T = 1 (the kernel) and T > 1 (row ops with per-token masks, both the
  sparse-union and the dense-union branch), within the float32 bounds of tests/test_sparse_ops.py;
- thread-count independence, validation, and the pool's threshold mode on the CPU stand-in.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from conftest import down_rel
from test_sparse_ops import (
    ACT_TOL,
    KERNEL_TYPES,
    KQ_TYPES,
    QUANT_TYPES,
    fake_quant_act,
    ffn_cases,
    ffn_shapes,
    ffn_weights,
    make_x,
    needs_kernels,
)

from powerinfer import ops
from powerinfer.gguf.constants import GGMLType
from powerinfer.ops import sparse


def candidates(n_rows: int, seed: int = 3) -> dict[str, torch.Tensor | None]:
    rng = np.random.default_rng(seed)
    return {
        "all": None,
        "empty": torch.zeros(0, dtype=torch.int64),
        "sorted": torch.from_numpy(np.sort(rng.permutation(n_rows)[: max(1, n_rows // 2)]).astype(np.int64)),
    }


def median_threshold(u: torch.Tensor, gate: ops.QWeight, act: str) -> float:
    """A threshold that leaves about half of the neurons active for u."""
    a = ops.act(act, sparse.decode_rows(gate, None) @ u.reshape(-1))
    return float(a.abs().median())


def unfused(u, gate, up, down_t, cand, threshold, act, relu_up, kc, out_t=None):
    """The row ops the kernel fuses: (y (1, D), active ids, up rows read)."""
    # all rows: rows_matmul's arithmetic (K-quant rows are exact in both precisions; their dense q8 matmul is not)
    all_kc = kc.exact if gate.ggml_type in KQ_TYPES else kc
    g = sparse.rows_matmul(u, gate, cand, kc) if cand is not None else ops.linear(u, gate, all_kc)
    a = ops.act(act, g)
    if isinstance(threshold, torch.Tensor):  # one per row of the weights
        threshold = threshold if cand is None else threshold[cand]
    keep = (a.abs() > threshold).view(-1)
    pos = keep.nonzero().view(-1)
    rows = pos if cand is None else cand[pos]
    v = sparse.rows_matmul(u, up, rows, kc)
    h = a[:, pos] * (torch.relu(v) if relu_up else v)
    if out_t is None:
        return sparse.rows_axpy(h, down_t, rows, kc), rows, rows.numel()
    second = (h.abs() > out_t[rows]).view(-1)
    return sparse.rows_axpy(h[:, second].contiguous(), down_t, rows[second], kc), rows[second], rows.numel()


def out_thresholds(u, gate, up, act, seed=11):
    """Per-neuron thresholds on |h| that drop about a third of the neurons passing the median gate threshold."""
    h = ops.act(act, sparse.decode_rows(gate, None) @ u.reshape(-1)) * (
        sparse.decode_rows(up, None) @ u.reshape(-1)
    )
    n = h.numel()
    return (
        float(h.abs().quantile(0.65))
        * torch.from_numpy(np.random.default_rng(seed).uniform(0.5, 1.5, n)).float()
    )


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_cats_kernel_equals_row_ops_bitwise(ggml_type, isa, act):
    kc = ops.KernelContext(act_precision=act, isa=isa)
    for types in ffn_cases(ggml_type):
        for (n_in, n_out), n_rows in itertools.product(ffn_shapes(types), [7, 70]):
            gate, up, down_t = ffn_weights(types, n_rows, n_in, n_out)
            u = make_x(1, n_in)
            t_one = median_threshold(u, gate, "relu")
            # one value for every row, and one per row around it
            t_rows = t_one * torch.from_numpy(np.random.default_rng(n_rows).uniform(0.3, 1.7, n_rows)).float()
            scratch = torch.empty(ops.cats_scratch_bytes(n_rows, n_in), dtype=torch.uint8)
            t_out = out_thresholds(u, gate, up, "relu")
            for (name, cand), relu_up, t, out_t in itertools.product(
                candidates(n_rows).items(), [False, True], [t_one, t_rows], [None, t_out]
            ):
                where = (
                    f"{[t.name for t in types]} {isa} {act} N={n_rows} K={n_in} D={n_out} {name} {relu_up} "
                    f"two={out_t is not None}"
                )
                y, n_active, n_up = ops.cats_ffn(
                    u, gate, up, down_t, cand, t, "relu", relu_up, kc, out_thresholds=out_t, scratch=scratch
                )
                y_ref, rows, up_ref = unfused(u, gate, up, down_t, cand, t, "relu", relu_up, kc, out_t)
                assert n_active == rows.numel() and n_up == up_ref, where
                assert torch.equal(y, y_ref), where


@needs_kernels
@pytest.mark.parametrize("act_name", ["silu", "gelu", "gelu_tanh"])
def test_cats_kernel_libm_activations(act_name):
    # the kernel's activations are libm in torch's formulas: within ACT_TOL * |g| of torch's (measured in
    # tests/test_sparse_ops.py); the active set is the same except neurons that close to the threshold
    kc = ops.KernelContext()
    gate, up, down_t = ffn_weights((GGMLType.Q8_0,) * 3, 300, 576, 544)
    for seed in range(4):
        u = make_x(1, 576, seed=seed)
        t = median_threshold(u, gate, act_name)
        y, n_active, _ = ops.cats_ffn(u, gate, up, down_t, None, t, act_name, False, kc)
        g = ops.linear(u, gate, kc)
        a = ops.act(act_name, g)
        v = ops.linear(u, up, kc)
        borderline = ((a.abs() - t).abs() <= ACT_TOL * g.abs()).view(-1)
        keep = (a.abs() > t).view(-1)
        assert abs(n_active - int(keep.sum())) <= int(borderline.sum()), seed
        h = (a * v * keep).double()
        wd = sparse.decode_rows(down_t, None).double()
        err_h = (ACT_TOL * g.abs() * v.abs() + 1e-6 * h.abs()).double()
        if borderline.any():  # a borderline neuron may be in or out: its whole h is allowed
            err_h += (a * v).abs().double() * borderline
        bound = err_h @ wd.abs() + 1e-6 * (h.abs() @ wd.abs()) + 1e-30
        assert ((y.double() - h @ wd).abs() <= bound).all(), seed


@needs_kernels
@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tokens", [1, 3])
def test_cats_matches_masked_dense_reference(ggml_type, n_tokens, act):
    # float bounds as tests/test_sparse_ops.py's ffn_rows test (1e-5 of |u| @ |W|^T on g and v, propagated);
    # the mask is the one the reference derives from its float64 gate, so neurons whose |act| is within the
    # gate's error bound of the threshold are excluded from the comparison (they may fall either way)
    kc = ops.KernelContext(act_precision=act)
    for types in ffn_cases(ggml_type):
        for (n_in, n_out), n_rows in itertools.product(ffn_shapes(types), [70]):
            gate, up, down_t = ffn_weights(types, n_rows, n_in, n_out)
            x = make_x(n_tokens, n_in)
            t = median_threshold(x[0], gate, "relu")
            for (name, cand), relu_up in itertools.product(candidates(n_rows).items(), [False, True]):
                where = f"{[t.name for t in types]} {act} T={n_tokens} N={n_rows} K={n_in} {name} {relu_up}"
                y, n_active, _ = ops.cats_ffn(x, gate, up, down_t, cand, t, "relu", relu_up, kc)
                assert y.shape == (n_tokens, n_out) and y.dtype == torch.float32, where
                wg, wu, wd = (sparse.decode_rows(w, cand).double() for w in (gate, up, down_t))
                xg = fake_quant_act(x) if act == "q8" and types[0] in QUANT_TYPES else x
                xu = fake_quant_act(x) if act == "q8" and types[1] in QUANT_TYPES else x
                g, v = xg.double() @ wg.T, xu.double() @ wu.T
                sg, sv = xg.double().abs() @ wg.abs().T, xu.double().abs() @ wu.abs().T
                a = torch.relu(g)
                keep = a > t
                unsure = (a - t).abs() <= 1e-5 * sg
                gv = torch.relu(v) if relu_up else v
                h = a * gv * keep
                err_h = 1e-5 * (sg * gv.abs() + a.abs() * sv + 1e-5 * sg * sv) + 1e-6 * h.abs()
                err_h = err_h + (a * gv).abs() * unsure
                bound = (err_h + down_rel(act, types[2]) * h.abs()) @ wd.abs() + 1e-30
                assert ((y.double() - h @ wd).abs() <= bound).all(), where
                assert abs(n_active - int(keep.sum())) <= int(unsure.sum()), where
                if act == "f32":
                    y_ref, mask = sparse.cats_ffn_ref(x, gate, up, down_t, cand, t, "relu", relu_up)
                    assert ((y_ref.double() - h @ wd).abs() <= bound).all(), where


@needs_kernels
@pytest.mark.parametrize(
    "ggml_type", [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.F16, GGMLType.Q4_K], ids=lambda t: t.name
)
@pytest.mark.parametrize("n_tokens", [1, 3])
def test_cats_per_neuron_thresholds_and_dense_rows(ggml_type, n_tokens):
    # one threshold per neuron (sparsify's files), one or two stages, and tokens forced dense (a sequence's
    # first position): the kernel (T = 1) and the row ops (T > 1) against the masked dense reference; errors
    # measured <= 8e-7 of the output scale, bound 5e-6 (a wrong mask moves whole neurons' h, far above it)
    kc = ops.KernelContext()
    n_rows = 90
    gate, up, down_t = ffn_weights((ggml_type,) * 3, n_rows, 256, 256 if ggml_type in KQ_TYPES else 128)
    x = make_x(n_tokens, 256)
    t_rows = (
        median_threshold(x[0], gate, "relu")
        * torch.from_numpy(np.random.default_rng(7).uniform(0.3, 1.7, n_rows)).float()
    )
    t_out = out_thresholds(x[0], gate, up, "relu")
    dense_first = torch.zeros(n_tokens, dtype=torch.bool)
    dense_first[0] = True
    for (name, cand), dense_rows, out_t in itertools.product(
        candidates(n_rows).items(), [None, dense_first], [None, t_out]
    ):
        where = f"{ggml_type.name} T={n_tokens} {name} dense={dense_rows is not None} two={out_t is not None}"
        y, n_active, n_up = ops.cats_ffn(
            x, gate, up, down_t, cand, t_rows, "relu", False, kc, dense_rows=dense_rows, out_thresholds=out_t
        )
        y_ref, mask = sparse.cats_ffn_ref(x, gate, up, down_t, cand, t_rows, "relu", False, dense_rows, out_t)
        _, passed = sparse.cats_ffn_ref(x, gate, up, down_t, cand, t_rows, "relu", False, dense_rows)
        scale = float(y_ref.abs().max()) + 1e-30
        assert n_active == int(mask.sum()) and n_up == int(passed.sum()), where
        if out_t is not None and name != "empty" and dense_rows is None:  # the second stage drops some
            assert 0 < n_active < n_up, where
        assert torch.allclose(y, y_ref, rtol=0, atol=5e-6 * scale), where
        if dense_rows is not None and name == "all":  # the dense token is the dense FFN for that token
            y_dense, n_dense, _ = ops.cats_ffn(x[:1], gate, up, down_t, None, -1.0, "relu", False, kc)
            assert torch.allclose(y[:1], y_dense, rtol=0, atol=5e-6 * scale), where
            assert bool(mask[0].all()), where


@needs_kernels
@pytest.mark.parametrize(
    "ggml_type", [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.F16, GGMLType.Q4_K], ids=lambda t: t.name
)
def test_cats_prefill_branches_match_decode(ggml_type, act):
    # T > 1 runs the row ops with per-token masks: each token's y bit for bit as the kernel gives it for that token
    # alone (the kernel's activation, the same dot products, the down rows summed in index order skipping
    # h == 0), in the dense-union branch (low threshold) and the sparse-union one (high), one and two stages,
    # all rows or a candidate list, with a dense first token
    kc = ops.KernelContext(act_precision=act)
    n_in = 256
    gate, up, down_t = ffn_weights((ggml_type,) * 3, 200, n_in, 128 if ggml_type not in KQ_TYPES else 256)
    x = make_x(5, n_in)
    t_out = out_thresholds(x[0], gate, up, "silu") * 0.05
    dense = torch.tensor([True, False, False, False, False])
    a = ops.act("silu", x @ sparse.decode_rows(gate, None).T).abs()  # (5, 200)
    t_sparse = float(a.quantile(0.9))  # about 10% of the neurons per token: a union below the dense share
    assert float((a > t_sparse).any(0).float().mean()) < sparse.CATS_DENSE_UNION_SHARE
    for t, out_t, (name, cand), dense_rows in itertools.product(
        (1e-3, t_sparse), (None, t_out), candidates(200).items(), (None, dense)
    ):
        where = (t, out_t is not None, name, dense_rows is not None)
        y, n_active, n_up = ops.cats_ffn(
            x, gate, up, down_t, cand, t, "silu", False, kc, out_thresholds=out_t, dense_rows=dense_rows
        )
        rows = [
            ops.cats_ffn(
                x[i : i + 1],
                gate,
                up,
                down_t,
                cand,
                t,
                "silu",
                False,
                kc,
                out_thresholds=out_t,
                dense_rows=None if dense_rows is None else dense_rows[i : i + 1],
            )  # fmt: skip
            for i in range(5)
        ]
        assert (n_active, n_up) == (sum(r[1] for r in rows), sum(r[2] for r in rows)), where
        assert torch.equal(y, torch.cat([r[0] for r in rows])), where


@needs_kernels
@pytest.mark.parametrize(
    "ggml_type", [GGMLType.Q4_0, GGMLType.F16, GGMLType.Q5_1, GGMLType.Q4_K], ids=lambda t: t.name
)
def test_cats_independent_of_threads(ggml_type, act):
    n_in, n_out = (768, 1280) if ggml_type in KQ_TYPES else (576, 544)
    gate, up, down_t = ffn_weights((ggml_type,) * 3, 600, n_in, n_out)
    u = make_x(1, n_in)
    t = median_threshold(u, gate, "silu")
    t_out = out_thresholds(u, gate, up, "silu")
    for (name, cand), out_t in itertools.product(candidates(600).items(), [None, t_out]):
        results = [
            ops.cats_ffn(
                u,
                gate,
                up,
                down_t,
                cand,
                t,
                "silu",
                False,
                ops.KernelContext(n_threads=n, act_precision=act),
                out_thresholds=out_t,
            )
            for n in (1, 2, 3)
        ]
        same = all(torch.equal(r[0], results[0][0]) and r[1:] == results[0][1:] for r in results[1:])
        assert same, (name, out_t is not None)


@needs_kernels
def test_cats_threshold_extremes():
    kc = ops.KernelContext()
    gate, up, down_t = ffn_weights((GGMLType.Q8_0,) * 3, 64, 64, 32)
    u = make_x(1, 64)
    # a negative threshold keeps every neuron: the dense FFN over down_t
    y, n_active, _ = ops.cats_ffn(u, gate, up, down_t, None, -1.0, "silu", False, kc)
    dense = sparse.rows_axpy(
        ops.gated(ops.linear(u, gate, kc), ops.linear(u, up, kc), "silu", False), down_t, None, kc
    )
    assert n_active == 64
    assert torch.allclose(y, dense, rtol=1e-5, atol=1e-5 * float(dense.abs().max()))
    # an infinite threshold keeps none
    y, n_active, _ = ops.cats_ffn(u, gate, up, down_t, None, float("inf"), "silu", False, kc)
    assert n_active == 0 and torch.equal(y, torch.zeros(1, 32))


@needs_kernels
def test_cats_validation():
    gate, up, down_t = ffn_weights((GGMLType.Q8_0,) * 3, 20, 64, 32)
    u = make_x(1, 64)
    for bad in ([20], [-1], [0, 25]):
        with pytest.raises(IndexError):
            ops.cats_ffn(u, gate, up, down_t, torch.tensor(bad), 0.1, "silu", False)
    with pytest.raises(ValueError, match="NaN"):
        ops.cats_ffn(u, gate, up, down_t, None, float("nan"), "silu", False)
    with pytest.raises(ValueError, match="thresholds for 20 rows"):
        ops.cats_ffn(u, gate, up, down_t, None, 0.1, "silu", False, out_thresholds=torch.zeros(19))
    with pytest.raises(ValueError, match="features"):
        ops.cats_ffn(make_x(1, 32), gate, up, down_t, None, 0.1, "silu", False)
    with pytest.raises(ValueError, match="activation"):
        ops.cats_ffn(u, gate, up, down_t, None, 0.1, "tanh", False)
    tiny = torch.empty(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scratch"):
        ops.cats_ffn(u, gate, up, down_t, None, 0.1, "silu", False, scratch=tiny)


@needs_kernels
@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_1, GGMLType.F16, GGMLType.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n_tokens", [1, 4])
@pytest.mark.parametrize("two", [False, True], ids=["one-stage", "two-stage"])
def test_cats_split_between_pool_and_cpu(ggml_type, n_tokens, two):
    # the hot part (pool rows on the CPU stand-in, thresholds decided there) plus the CPU part over the other
    # neurons equals the whole layer computed on the CPU, with the same counts
    from powerinfer.device.pool import HotRows

    kc = ops.KernelContext()
    n_rows = 128
    gate, up, down_t = ffn_weights((ggml_type,) * 3, n_rows, 256, 256)
    x = make_x(n_tokens, 256)
    t = (
        median_threshold(x[0], gate, "silu")
        * torch.from_numpy(np.random.default_rng(6).uniform(0.5, 1.5, n_rows)).float()
    )  # one per neuron
    hot_ids = np.sort(np.random.default_rng(5).permutation(n_rows)[:40])
    hot = HotRows(gate, up, down_t, hot_ids, torch.device("cpu"), kc)
    assert all(w.ggml_type == ggml_type for w in (hot.gate, hot.up, hot.down_t))  # the file's blocks, not F16
    cold = torch.ones(n_rows, dtype=torch.bool)
    cold[torch.from_numpy(hot_ids)] = False
    dense_rows = torch.zeros(n_tokens, dtype=torch.bool)
    dense_rows[-1] = True  # the last token computed densely on both sides
    t_out = out_thresholds(x[0], gate, up, "silu") if two else None
    hot_ids_t = torch.from_numpy(hot_ids)
    y_hot, counts = hot.launch_threshold(
        x, t[hot_ids_t], None if t_out is None else t_out[hot_ids_t], dense_rows, "silu", False
    ).result()
    y_cpu, n_cpu, up_cpu = ops.cats_ffn(
        x,
        gate,
        up,
        down_t,
        cold.nonzero().view(-1),
        t,
        "silu",
        False,
        kc,
        dense_rows=dense_rows,
        out_thresholds=t_out,
    )
    y_all, n_all, up_all = ops.cats_ffn(
        x, gate, up, down_t, None, t, "silu", False, kc, dense_rows=dense_rows, out_thresholds=t_out
    )
    scale = float(y_all.abs().max())
    n_hot, up_hot = counts.tolist()
    # a neuron at a threshold may fall either way between the pool's float path and the kernel's (none seen)
    assert abs(n_hot + n_cpu - n_all) <= 1 and abs(up_hot + up_cpu - up_all) <= 1
    assert (n_all < up_all) == (two and n_tokens > 1)  # one token: the dense one
    assert torch.allclose(y_hot + y_cpu, y_all, rtol=1e-4, atol=1e-5 * scale)
