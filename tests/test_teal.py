"""`sparsify --method teal`: the file contract, the engine against a masked transformers model, the kernel's input
threshold, the quantized file end to end, refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_one_error_line, tiny_hf_llama, write_hf_llama_gguf
from typer.testing import CliRunner

from powerinfer import ops
from powerinfer.cli import app
from powerinfer.gguf import GGMLType, read_gguf
from powerinfer.gguf.constants import TensorNames
from powerinfer.ops import kernels_available
from powerinfer.ops.context import KernelContext
from powerinfer.ops.qweight import QWeight
from powerinfer.ops.sparse import rows_axpy
from powerinfer.quant import quantize
from powerinfer.quantize import QuantizeOptions, parse_file_type, quantize_model
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sparsify import SparsifyOptions, run_sparsify

pytestmark = pytest.mark.skipif(not kernels_available(), reason="powerinfer._kernels is not built")

runner = CliRunner()
PROSE = Path(__file__).parent / "data" / "python-reference-prose.txt"
# transformers' module of each TEAL matrix (TensorNames.TEAL_MATRICES order)
HF_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
HF_MODULES += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def teal(tmp_path_factory):
    """A tiny random Llama (transformers), its F32 GGUF, and its TEAL file at S = 0.5."""
    root = tmp_path_factory.mktemp("teal")
    hf = tiny_hf_llama(n_embd=64, n_ff=256, n_layer=2, n_head_kv=2, seed=7)
    f32 = write_hf_llama_gguf(hf, root / "tiny.gguf", GGMLType.F32)
    text = root / "calib.txt"
    text.write_text(PROSE.read_text()[:20000])
    opts = SparsifyOptions(
        f32, text, root / "teal.powerinfer.gguf", 0.5, method="teal", n_ctx=128, max_tokens=1024
    )
    return hf, f32, run_sparsify(opts), text


def file_thresholds(path: Path, n_layer: int) -> dict[str, float]:
    gguf = read_gguf(path)
    out = {}
    for bid in range(n_layer):
        for template in TensorNames.TEAL_MATRICES:
            name = template.format(bid=bid)
            out[name] = float(gguf.tensors[TensorNames.input_threshold(name)].data.view("<f4")[0])
    return out


def test_file_contract(teal):
    """PWRI, method teal; each TEAL matrix replaced by its exact transpose (F32 in, F32 out) with its threshold;
    q/k/v share one threshold and gate/up another; every other tensor copied as stored; on the calibration
    sample each input keeps ~half of its values."""
    _, f32, result, _ = teal
    src, dst = read_gguf(f32), read_gguf(result.output)
    assert dst.is_sparse and dst.metadata["powerinfer.sparsity.method"] == "teal"
    assert math.isclose(dst.metadata["powerinfer.sparsity.target"], 0.5, rel_tol=1e-6)
    thresholds = file_thresholds(result.output, 2)
    teal_names = set(thresholds)
    for name in teal_names:
        t_name = TensorNames.transposed(name)
        assert name not in dst.tensors and t_name in dst.tensors
        s, d = src.tensors[name], dst.tensors[t_name]
        assert d.ggml_type == GGMLType.F32 and d.shape == (s.shape[1], s.shape[0])
        want = s.data.view("<f4").reshape(s.shape).T
        assert np.array_equal(d.data.view("<f4").reshape(d.shape), want)
        assert thresholds[name] > 0
    for name, info in src.tensors.items():
        if name not in teal_names:
            assert bytes(dst.tensors[name].data) == bytes(info.data)
    for bid in range(2):
        t = [thresholds[m.format(bid=bid)] for m in TensorNames.TEAL_MATRICES]
        assert t[0] == t[1] == t[2] and t[4] == t[5]
    assert result.input_kept is not None
    assert np.abs(result.input_kept - 0.5).max() < 0.01, result.input_kept  # quantiles of that very sample
    assert result.summary()["method"] == "teal"


def masked_hf_logits(hf, thresholds: dict[str, float] | None, tokens: list[int]) -> torch.Tensor:
    """transformers' logits with each TEAL matrix's input masked, x * (|x| > t) (None: unmasked)."""
    hooks = []
    if thresholds is not None:
        for bid, layer in enumerate(hf.model.layers):
            for template, module in zip(TensorNames.TEAL_MATRICES, HF_MODULES, strict=True):
                t = thresholds[template.format(bid=bid)]

                def mask(_, args, t=t):
                    return (args[0].masked_fill(args[0].abs() <= t, 0.0),)

                hooks.append(layer.get_submodule(module).register_forward_pre_hook(mask))
    try:
        with torch.no_grad():
            return hf(torch.tensor([tokens])).logits[0]
    finally:
        for h in hooks:
            h.remove()


def test_engine_is_the_masked_model(teal):
    """The engine on the TEAL file (f32) equals transformers with every matrix's input masked at the file's
    thresholds, token by token and as one prompt. Measured over three prompts: 0.8-1.5e-6 max abs difference
    (bound 1e-5); the unmasked model is 1.8-2.1 away from the masked one, so the bound cannot pass a dense run."""
    hf, _, result, _ = teal
    thresholds = file_thresholds(result.output, 2)
    tokens = torch.randint(
        0, hf.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3)
    ).tolist()
    want = masked_hf_logits(hf, thresholds, tokens)
    dense = masked_hf_logits(hf, None, tokens)
    engine = Engine(result.output, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2))
    whole = engine.logits_all(tokens)
    assert (whole - want).abs().max().item() <= 1e-5
    assert (dense - want).abs().max().item() > 0.5
    engine.free(0)
    step = torch.stack([engine.eval([t]) for t in tokens])
    assert (step - want).abs().max().item() <= 1e-5


def test_zero_sparsity_reads_every_input(teal, tmp_path: Path):
    """At S = 0 every threshold is 0 and the TEAL file's logits are the dense file's (measured 1.4e-6: the
    transposed product sums in another order; bound 1e-5)."""
    _, f32, _, text = teal
    opts = SparsifyOptions(
        f32, text, tmp_path / "t0.powerinfer.gguf", 0.0, method="teal", n_ctx=128, max_tokens=512
    )
    out = run_sparsify(opts).output
    assert set(file_thresholds(out, 2).values()) == {0.0}
    tokens = list(range(3, 23))
    got = Engine(out, EngineOptions(act_precision="f32", n_ctx=64)).logits_all(tokens)
    want = Engine(f32, EngineOptions(act_precision="f32", n_ctx=64)).logits_all(tokens)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("ggml_type", [GGMLType.F32, GGMLType.Q8_0, GGMLType.Q4_0])
@pytest.mark.parametrize("precision", ["f32", "q8"])
def test_rows_axpy_input_threshold(ggml_type: GGMLType, precision: str):
    """rows_axpy with h_min skips |h| <= h_min (ties included, NaN kept): the bits of the same call on h with those
    entries zeroed; a token's row in a batch of 5 has the bits of the token alone."""
    rng = np.random.default_rng(0)
    n, d = 96, 64
    w = QWeight.from_numpy(quantize(rng.normal(size=(n, d)).astype(np.float32), ggml_type), ggml_type, (n, d))
    kc = KernelContext(n_threads=2, act_precision=precision)
    h = torch.from_numpy(rng.normal(size=(5, n)).astype(np.float32))
    h[:, :8] = 0.5  # ties at the threshold: skipped
    h[:, 8:12] = -0.5
    masked = h.masked_fill(h.abs() <= 0.5, 0.0)
    got = rows_axpy(h, w, None, kc, h_min=0.5)
    assert torch.equal(got, rows_axpy(masked, w, None, kc))
    for t in range(5):
        assert torch.equal(rows_axpy(h[t], w, None, kc, h_min=0.5), got[t])
    assert not torch.equal(got, rows_axpy(h, w, None, kc))
    h[2, 20] = float("nan")
    assert torch.isnan(rows_axpy(h, w, None, kc, h_min=0.5)[2]).all()
    with pytest.raises(ValueError, match="h_min"):
        rows_axpy(h, w, None, kc, h_min=-1.0)


def test_input_sparse_weight_matches_the_mask():
    """ops.InputSparseWeight: ops.linear on it is the masked product with W (shape (N, K) from its (K, N)
    transpose); measured 1.6e-6 against float64 (bound 1e-5)."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=(48, 64)).astype(np.float32)  # W (N, K)
    w_t = QWeight.from_numpy(np.ascontiguousarray(w.T), GGMLType.F32, (64, 48))
    weight = ops.InputSparseWeight(w_t, 0.7)
    assert weight.shape == (48, 64)
    x = torch.from_numpy(rng.normal(size=(3, 64)).astype(np.float32))
    got = ops.linear(x, weight, KernelContext(act_precision="f32"))
    xm = x.double().masked_fill(x.abs() <= 0.7, 0.0)
    assert (got.double() - xm @ torch.from_numpy(w).double().T).abs().max().item() <= 1e-5
    with pytest.raises(ValueError):
        ops.InputSparseWeight(w_t, float("nan"))


def test_quantized_file_runs(teal, tmp_path: Path):
    """`quantize` Q4_0 keeps the layout (transposes quantized, thresholds F32); `main` runs it and names TEAL."""
    _, _, result, _ = teal
    file_type = parse_file_type("q4_0")
    assert file_type is not None
    q4 = tmp_path / "teal-q4_0.powerinfer.gguf"
    quantize_model(QuantizeOptions(result.output, q4, file_type))
    g = read_gguf(q4)
    assert g.tensors["blk.0.attn_q_t.weight"].ggml_type == GGMLType.Q4_0
    assert g.tensors["blk.0.attn_q.input_threshold"].ggml_type == GGMLType.F32
    r = runner.invoke(app, ["main", "-m", str(q4), "-p", "hello", "-n", "4", "--temp", "0", "-t", "1"])
    assert r.exit_code == 0, r.output
    assert "mode = sparse (PWRI, TEAL)" in r.output
    assert "TEAL input thresholds" in r.output


def test_kl_divergence_is_against_the_dense_model(teal):
    """`perplexity --kl-divergence` on a TEAL file compares with every input read (the whole dense model, not
    only its FFN) and says so."""
    _, _, result, text = teal
    args = ["perplexity", "-m", str(result.output), "-f", str(text), "-c", "64", "--chunks", "2", "-t", "1"]
    r = runner.invoke(app, [*args, "--kl-divergence"])
    assert r.exit_code == 0, r.output
    assert "this model vs the dense model," in r.output
    assert "dense FFN" not in r.output


def test_refusals(teal, tmp_path: Path):
    """One error line: a TEAL file on a pool device."""
    _, _, result, _ = teal
    r = runner.invoke(app, ["main", "-m", str(result.output), "-p", "hi", "-n", "2", "--pool-device", "cpu"])
    assert_one_error_line(r, "TEAL files")


def test_greedy_allocation(teal, tmp_path: Path):
    """--allocation greedy (TEAL's block-wise): within each layer, per input from its measured error curve,
    weighted by the bytes it reads; each layer skips S of its matrix bytes; the inputs' shares differ."""
    _, f32, _, text = teal
    out = tmp_path / "g.powerinfer.gguf"
    r = runner.invoke(
        app,
        ["sparsify", "-m", str(f32), "-f", str(text), "--sparsity", "0.5", "--method", "teal", "--allocation", "greedy",
         "-c", "128", "--max-tokens", "1024", "-t", "1", "-o", str(out)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["method"] == "teal" and summary["allocation"] == "greedy"
    kept = np.array([summary["input_kept"][name] for name in ("attn", "attn_out", "ffn", "ffn_hidden")]).T
    # elements read per input in this model (n_embd 64, n_q 64, n_kv 32, n_ff 256): q/k/v, o, gate/up, down
    weights = np.array([64 * 128, 64 * 64, 2 * 256 * 64, 256 * 64], dtype=np.float64)
    skipped = ((1 - kept) * weights).sum(axis=1) / weights.sum()  # per layer
    assert np.abs(skipped - 0.5).max() < 0.01, skipped
    assert kept.max() - kept.min() > 0.05  # not uniform
    layer = np.asarray(read_gguf(out).metadata["powerinfer.sparsity.layer_sparsity"])
    assert np.abs(layer - 0.5).max() < 1e-3


def test_allocate_greedy_weighted():
    """The weighted greedy: cheap units first per unit of weight, the weighted mean exactly the target; without
    weights, the plain mean."""
    from powerinfer.sparsify import allocate_greedy

    grid = np.array([0.0, 0.5, 0.95])
    curves = np.array([[0.0, 1.0, 4.0], [0.0, 1.0, 4.0], [0.0, 0.1, 0.4]])
    weights = np.array([1.0, 3.0, 1.0])
    s = allocate_greedy(curves, grid, 0.3, weights)
    assert abs(float((s * weights).sum() / weights.sum()) - 0.3) < 1e-9
    # the cheap unit first; per unit of weight, unit 1 costs a third of unit 0
    assert s[2] > s[1] > s[0] == 0.0
    assert abs(float(allocate_greedy(curves, grid, 0.3).mean()) - 0.3) < 1e-9
    with pytest.raises(ValueError):
        allocate_greedy(curves, grid, 0.3, np.array([1.0, 0.0, 1.0]))


@pytest.mark.parametrize("precision", ["f32", "q8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_products_have_the_parts_bits(precision: str, threads: int):
    """ops.InputSparseWeight.concat (q/k/v, gate/up as one product): every output element has the bits of its
    part computed alone, for one token and a batch; parts of different thresholds or types are not grouped."""
    rng = np.random.default_rng(2)
    parts = []
    for n in (64, 32, 32):  # (N, K = 96) matrices, kept as (96, N) transposes
        w = rng.normal(size=(96, n)).astype(np.float32)
        parts.append(
            ops.InputSparseWeight(QWeight.from_numpy(quantize(w, GGMLType.Q4_0), GGMLType.Q4_0, (96, n)), 0.4)
        )
    group = ops.InputSparseWeight.concat(parts)
    assert group is not None and group.shape == (128, 96)
    kc = KernelContext(n_threads=threads, act_precision=precision)
    for x in (torch.from_numpy(rng.normal(size=(96,)).astype(np.float32)), torch.randn(4, 96)):
        got = ops.linear(x, group, kc)
        assert torch.equal(got, torch.cat([ops.linear(x, p, kc) for p in parts], dim=-1))
    assert ops.InputSparseWeight.concat([parts[0], ops.InputSparseWeight(parts[1].w_t, 0.5)]) is None


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_layer_has_the_op_by_op_bits(teal, tmp_path: Path, threads: int):
    """A decoded token through the decode stack (every TEAL layer in one kernel call a token), through
    pi_teal_layer one call a layer, and op by op: the same bits, in the q8 precision the CLI runs, on the file
    quantized Q4_0. The bytes of the rows read, counted by the C kernel (stack, per layer) and by the op-by-op
    products (torch's mask of the same test), are the same; fewer than the whole matrices (S = 0.5)."""
    _, _, result, _ = teal
    file_type = parse_file_type("q4_0")
    assert file_type is not None
    q4 = tmp_path / "teal-q4_0.powerinfer.gguf"
    quantize_model(QuantizeOptions(result.output, q4, file_type))
    tokens = [5, 9, 14, 3, 27, 8, 11]
    rows, counted = [], []
    for mode in ("stack", "layer", "op"):
        e = Engine(q4, EngineOptions(n_ctx=64, n_threads=threads, act_precision="q8"))
        layers = e.model.layers
        assert all(layer.fused_layer is not None for layer in layers)
        spans = e.model.spans_for(e.kv, 0)
        assert [(a, b, type(s).__name__) for a, b, s in spans] == [(0, len(layers), "DecodeStack")]
        if mode != "stack":
            e.model.stack_decode = False
        if mode == "op":
            for layer in layers:
                layer.fused_layer = None
        rows.append(torch.stack([e.eval([t]) for t in tokens]))
        stats = e.sparse_stats
        assert stats is not None and stats.input_tokens is not None and stats.input_bytes is not None
        assert stats.input_tokens.tolist() == [len(tokens)] * len(layers)
        counted.append(stats.input_bytes.copy())
        whole = sum(
            e.gguf.tensors[TensorNames.transposed(t.format(bid=bid))].n_bytes
            for bid in range(len(layers))
            for t in TensorNames.TEAL_MATRICES
        )
        per_token = float(stats.input_bytes.sum()) / len(tokens)
        assert 0 < per_token < 0.8 * whole
        assert e.read_bytes_per_token() == pytest.approx(e.weight_bytes - whole + per_token)
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])
    assert np.array_equal(counted[0], counted[1]) and np.array_equal(counted[0], counted[2])


def with_tensor(src: Path, dst: Path, name: str, data: np.ndarray | None) -> Path:
    """A copy of a PWRI file with tensor `name` replaced by F32 `data` (None: left out)."""
    from powerinfer.gguf import GGUFWriter

    model = read_gguf(src)
    w = GGUFWriter(dst, sparse=True)
    model.copy_metadata(w)
    for t in model.tensors.values():
        if t.name != name:
            w.add_tensor(t.name, t.data, t.ggml_type, t.shape)
        elif data is not None:
            w.add_tensor(t.name, data, GGMLType.F32, data.shape)
    w.write()
    return dst


@pytest.mark.parametrize(
    ("name", "data", "needle"),
    [
        ("blk.1.attn_o.input_threshold", None, ""),  # not a tensor of the file: a plain copy loads
        ("blk.0.ffn_down.input_threshold", np.array([np.nan], np.float32), "expected a finite value >= 0"),
        ("blk.0.attn_q.input_threshold", np.array([-1.0], np.float32), "expected a finite value >= 0"),
        ("blk.1.ffn_up.input_threshold", None, "blk.1.ffn_up.input_threshold"),
        ("blk.0.attn_k_t.weight", None, "blk.0.attn_k_t.weight"),
        ("blk.0.attn_v_t.weight", np.zeros((64, 31), np.float32), "blk.0.attn_v_t.weight"),
    ],
)
def test_bad_teal_files(teal, tmp_path: Path, name: str, data, needle: str):
    """A TEAL file with a bad or missing threshold or transposed matrix: one error line, exit code 1."""
    _, _, result, _ = teal
    bad = with_tensor(result.output, tmp_path / "bad.powerinfer.gguf", name, data)
    r = runner.invoke(app, ["main", "-m", str(bad), "-p", "hi", "-n", "2", "-t", "1"])
    if not needle:
        assert r.exit_code == 0, r.output
        return
    assert_one_error_line(r, needle)
