"""The device pool keeps weights in the file's block format: bytes as budgeted, same logits, ~3.5x the neurons
of F16 per budget for Q4_0; and the Triton kernels of the CUDA pool, run here by the Triton interpreter."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    BackgroundCheck,
    random_llama_state,
    random_predictors,
    random_tq2_0,
    run_background,
    write_activation_stats,
    write_llama_gguf,
    write_relu_sparse_model,
)

from powerinfer import ops, quant
from powerinfer.device.pool import HotRows
from powerinfer.errors import PlacementError
from powerinfer.gguf import GGMLType, read_gguf
from powerinfer.ops import sparse as sparse_ops
from powerinfer.placement import default_reserve_bytes, footprint_from_gguf, kv_cache_bytes, planner
from powerinfer.quant import pool_bytes, quantize, row_bytes
from powerinfer.runtime.engine import Engine, EngineOptions

TESTS = Path(__file__).resolve().parent
N_FF = 128
TOKENS = [1, 5, 17, 99, 200, 3, 41, 250, 8, 77]
POOL_TYPES = sorted(quant.POOL_TYPES)  # the types the pool keeps as blocks
# the pool types our writer can quantize the tiny models to (K-quants: random super-blocks, below)
WRITABLE_POOL_TYPES = sorted(quant.POOL_TYPES & quant.QUANTIZABLE)
# exact-mode C kernels decode blocks to the reference floats: pool and CPU differ in summation order only
LOGIT_TOL = 1e-4
KV_BYTES = kv_cache_bytes(2, 64, 64, 4)  # the engines below: 2 layers, n_ctx 64, 64 KV features, float32


def _model(folder: Path, dtype: GGMLType, n_ff: int = N_FF, ffn_dtype: GGMLType | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "m.powerinfer.gguf"
    return write_relu_sparse_model(path, n_ff=n_ff, seed=4, dtype=dtype, ffn_dtype=ffn_dtype, stats=True)


def _weight(ggml_type: GGMLType, n_rows: int, n_cols: int, seed: int = 0) -> ops.QWeight:
    if ggml_type in quant.K_QUANT_TYPES:  # random valid super-blocks (nothing quantizes to K-quants here yet)
        from test_sparse_ops import make_weight

        return make_weight(ggml_type, n_rows, n_cols, seed)
    w = np.random.default_rng(seed).normal(0, 1, (n_rows, n_cols)).astype(np.float32)
    return ops.QWeight.from_numpy(quantize(w, ggml_type), ggml_type, (n_rows, n_cols))


@pytest.mark.parametrize("ggml_type", POOL_TYPES, ids=lambda t: t.name)
def test_device_weight_keeps_the_raw_blocks(ggml_type):
    n_cols = 512 if ggml_type in quant.K_QUANT_TYPES else 96
    w = _weight(ggml_type, 70, n_cols)
    ids = torch.tensor([3, 0, 69, 17, 18], dtype=torch.int64)
    dw = ops.DeviceWeight.from_qweight(w, torch.device("cpu"), ids)
    assert dw.ggml_type == ggml_type and dw.shape == (5, n_cols) and dw.raw.dtype == torch.uint8
    assert torch.equal(dw.raw, w.raw[ids])  # the file's bytes of those rows
    assert dw.n_bytes == 5 * row_bytes(ggml_type, n_cols) == pool_bytes(ggml_type, (5, n_cols))
    x = torch.randn(3, n_cols)
    assert torch.equal(ops.linear(x, dw), sparse_ops.rows_matmul(x, w, ids))
    h = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    want = sparse_ops.rows_axpy(h, w, ids)
    # the selected rows summed in another chain order: measured <= 1.5e-7 of the largest output over 50 seeds and
    # every type (an absolute 1e-6 failed on Q6_K's outputs of ~40 for some draws)
    assert (dw.axpy(h) - want).abs().max().item() <= 1e-6 * want.abs().max().item()
    whole = ops.DeviceWeight.from_qweight(w, "cpu")
    assert torch.equal(whole.raw, w.raw) and whole.raw.data_ptr() != w.raw.data_ptr()  # a copy
    assert torch.equal(ops.linear(x, whole), ops.linear(x, w))


def test_other_types_are_stored_as_f16_and_budgeted_so():
    w = ops.QWeight.from_numpy(random_tq2_0(9, 256), GGMLType.TQ2_0, (9, 256))  # a type without pool kernels
    dw = ops.DeviceWeight.from_qweight(w, "cpu", torch.tensor([2, 4]))
    assert dw.ggml_type == GGMLType.F16 and dw.n_bytes == 2 * 256 * 2 == pool_bytes(GGMLType.TQ2_0, (2, 256))
    assert torch.equal(
        dw.raw.view(torch.float16).float(), ops.get_rows(w, torch.tensor([2, 4])).half().float()
    )


def test_cuda_pool_without_triton_is_a_placement_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "powerinfer.ops.triton_quant", None)  # makes the import fail
    with pytest.raises(PlacementError, match="triton"):
        ops.DeviceWeight.from_qweight(_weight(GGMLType.Q4_0, 4, 32), torch.device("cuda"))


def test_the_cpu_package_does_not_import_triton():
    code = (
        "import sys; import powerinfer.cli, powerinfer.runtime.engine; "
        "assert 'triton' not in sys.modules and 'powerinfer.ops.triton_quant' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _device_weights(engine: Engine) -> dict[str, ops.DeviceWeight]:
    out = {}
    for bid, layer in enumerate(engine.model.layers):
        for attr, name in (("wq", "attn_q"), ("wk", "attn_k"), ("wv", "attn_v"), ("wo", "attn_output")):
            out[f"blk.{bid}.{name}.weight"] = getattr(layer.attn, attr)
        sel = layer.ffn.selector
        out[f"blk.{bid}.fc1.weight"], out[f"blk.{bid}.fc2.weight"] = sel.fc1, sel.fc2
    out["output.weight"] = engine.model.head.output
    return out


@pytest.mark.parametrize("ggml_type", WRITABLE_POOL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("share", [1.0, 0.5])
def test_stand_in_pool_bytes_are_the_budgeted_bytes_and_logits_match(tmp_path, ggml_type, share):
    """The whole dense part and all (or half) of the FFN in the CPU stand-in pool, planned from a budget."""
    path = _model(tmp_path, ggml_type)
    ref = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2)).logits_all(TOKENS)
    fp = footprint_from_gguf(read_gguf(path), 2, N_FF)
    budget = default_reserve_bytes(fp) + fp.dense_bytes + KV_BYTES + int(share * fp.ffn_bytes) + 1
    engine = Engine(
        path,
        EngineOptions(
            act_precision="f32", n_ctx=64, n_threads=2, pool_device="cpu", vram_budget_gib=budget / 2**30
        ),
    )
    p = engine.placement
    assert p is not None and p.kv_on_gpu and p.total_bytes <= p.budget_bytes
    # every planned matrix sits in the pool as the file's bytes, nothing decoded
    dense = _device_weights(engine)
    for name, w in dense.items():
        assert isinstance(w, ops.DeviceWeight) and name in p.gpu_tensors, name
        assert w.raw.dtype == torch.uint8 and w.ggml_type == ggml_type
        assert w.n_bytes == engine.gguf.tensors[name].n_bytes == pool_bytes(ggml_type, w.shape), name
    # the hot rows take exactly what the planner budgeted for them
    hot = [f.hot for f in engine.model.ffns]
    assert all(h is not None for h in hot)
    for h, neuron_bytes in zip(hot, fp.neuron_bytes, strict=True):
        assert h.n_bytes == h.ids.numel() * neuron_bytes
        assert h.gate.raw.dtype == torch.uint8 and h.gate.ggml_type == ggml_type
    assert sum(h.n_bytes for h in hot) == p.bytes_by_category["ffn"]
    assert sum(h.ids.numel() for h in hot) == int(share * 2 * N_FF)
    diff = (engine.logits_all(TOKENS) - ref).abs().max().item()
    assert diff <= LOGIT_TOL, diff


def _k_quant_models(folder: Path, gate_up: GGMLType, down: GGMLType, n_ff: int = 512) -> tuple[Path, Path]:
    """A ReLU PowerInfer model (n_embd 256, n_ff 512 by default, 2 layers; dense part F32) whose gate/up rows are random
    `gate_up` super-blocks and ffn_down_t rows random `down` ones, super-scales shrunk so that the weights have
    about the scale of random_llama_state's; and the same model with those matrices decoded to F32 (the gguf
    package's decoder). Returns (K-quant path, F32 path); activation stats beside both."""
    from test_kquant_kernels import K_TYPES, random_k_blocks

    from powerinfer.gguf import GGUFWriter
    from powerinfer.quant import dequantize

    n_embd = 256
    src_path = folder / "src" / "m.powerinfer.gguf"
    src_path.parent.mkdir(parents=True)
    sd = random_llama_state(n_embd=n_embd, n_ff=n_ff, seed=4)
    write_llama_gguf(src_path, sd, n_head=4, n_head_kv=4, act="relu", predictors=random_predictors(sd))
    src = read_gguf(src_path)
    paths = []
    for variant in ("kq", "f32"):
        path = folder / variant / "m.powerinfer.gguf"
        path.parent.mkdir()
        write_activation_stats(path.parent / "activation", 2, n_ff)
        w = GGUFWriter(path, sparse=True)
        src.copy_metadata(w)
        for seed, t in enumerate(src.tensors.values()):
            kind = t.name.split(".")[-2]
            if kind not in ("ffn_gate", "ffn_up", "ffn_down_t"):
                w.add_tensor(t.name, t.data, t.ggml_type, t.shape)
                continue
            ggml_type = down if kind == "ffn_down_t" else gate_up
            raw = random_k_blocks(ggml_type, *t.shape, seed=seed)
            blocks = raw.reshape(t.shape[0], -1, K_TYPES[ggml_type][0])
            for off in K_TYPES[ggml_type][1]:  # super-scales / 50: weights of about 0.1 at most, not 10
                scales = np.ascontiguousarray(blocks[:, :, off : off + 2]).view(np.float16) / np.float16(50)
                blocks[:, :, off : off + 2] = scales.view(np.uint8)
            if variant == "kq":
                w.add_tensor(t.name, raw, ggml_type, t.shape)
            else:
                w.add_tensor(t.name, dequantize(raw, ggml_type, t.shape), GGMLType.F32)
        w.write()
        paths.append(path)
    return paths[0], paths[1]


@pytest.mark.parametrize(
    "gate_up, down",
    [(GGMLType.Q4_K, GGMLType.Q6_K), (GGMLType.Q2_K, GGMLType.Q5_K), (GGMLType.Q3_K, GGMLType.Q4_K)],
)
def test_k_quant_sparse_ffn_on_the_cpu_and_in_the_pool(tmp_path, gate_up, down):
    """A K-quant PowerInfer file runs its sparse FFN on its blocks: all on the CPU (the fused predictor + FFN
    kernel) and split with the CPU stand-in pool (half of the FFN, kept as the file's super-blocks), both against
    the same model with the FFN decoded to F32, prefill and token-by-token decode. Measured over the three mixes:
    max |logit diff| <= 8.4e-7 of the logits' scale (float32 summation order; about half the neurons active);
    bound 1e-5."""
    kq_path, f32_path = _k_quant_models(tmp_path, gate_up, down)
    ref = Engine(f32_path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2)).logits_all(TOKENS)
    scale = float(ref.abs().max())
    cpu = Engine(kq_path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2))
    ffn = cpu.model.ffns[0]
    assert ffn.gate.ggml_type == gate_up and ffn.down_t.ggml_type == down and ffn.fused_decode
    prefill = cpu.logits_all(TOKENS)
    cpu.reset()
    decode = torch.stack([cpu.eval([t]) for t in TOKENS])  # T = 1 steps: the fused kernel
    for got in (prefill, decode):
        assert (got - ref).abs().max() <= 1e-5 * scale
    for f in cpu.model.ffns:  # no float copy of any FFN matrix was made
        assert not (f.gate._dense or f.up._dense or f.down_t._dense)
    fp = footprint_from_gguf(read_gguf(kq_path), 2, 512)
    kv = kv_cache_bytes(2, 64, 256, 4)
    budget = default_reserve_bytes(fp) + fp.dense_bytes + kv + fp.ffn_bytes // 2 + 1
    pooled = Engine(
        kq_path,
        EngineOptions(
            act_precision="f32", n_ctx=64, n_threads=2, pool_device="cpu", vram_budget_gib=budget / 2**30
        ),
    )
    hot = [f.hot for f in pooled.model.ffns]
    assert all(h is not None for h in hot)
    for h, neuron_bytes in zip(hot, fp.neuron_bytes, strict=True):
        assert h.gate.ggml_type == gate_up and h.down_t.ggml_type == down  # the file's blocks, not F16
        assert h.n_bytes == h.ids.numel() * neuron_bytes
    assert 0 < sum(h.ids.numel() for h in hot) < 2 * 512
    prefill = pooled.logits_all(TOKENS)
    pooled.reset()
    decode = torch.stack([pooled.eval([t]) for t in TOKENS])
    for got in (prefill, decode):
        assert (got - ref).abs().max() <= 1e-5 * scale
    assert int(pooled.sparse_stats.active_gpu.sum()) > 0  # the pool computed some of the active neurons


def test_a_budget_holds_3_5x_more_q4_0_neurons_than_f16(tmp_path, monkeypatch):
    """Same budget, same dense part (F16), FFN in Q4_0 or F16: the pool holds ~3.56x the neurons (108 vs
    384 bytes each at n_embd 64). The compute reserve, which the planner scales with the model's size, is fixed
    so that both files leave exactly the same bytes to the FFN; the budget binds (well below n_layer x n_ff)."""
    monkeypatch.setattr(planner, "default_reserve_bytes", lambda footprint: 64 * 1024)
    n_ff, ffn_budget = 4096, 256 * 1024
    held = {}
    for ffn_type in (GGMLType.F16, GGMLType.Q4_0):
        path = _model(tmp_path / ffn_type.name, GGMLType.F16, n_ff=n_ff, ffn_dtype=ffn_type)
        fp = footprint_from_gguf(read_gguf(path), 2, n_ff)
        budget = 64 * 1024 + fp.dense_bytes + KV_BYTES + ffn_budget + 1
        engine = Engine(
            path,
            EngineOptions(
                act_precision="f32", n_ctx=64, n_threads=2, pool_device="cpu", vram_budget_gib=budget / 2**30
            ),
        )
        p = engine.placement
        assert p is not None and ffn_budget <= p.ffn_budget_bytes <= ffn_budget + 1
        n_hot = sum(f.hot.ids.numel() for f in engine.model.ffns if f.hot is not None)
        pool = sum(f.hot.n_bytes for f in engine.model.ffns if f.hot is not None)
        assert n_hot == p.n_gpu_neurons and pool == p.bytes_by_category["ffn"] <= ffn_budget
        assert n_hot < 2 * n_ff  # the budget binds, not the model's size
        held[ffn_type] = n_hot
    ratio = held[GGMLType.Q4_0] / held[GGMLType.F16]
    assert 3.3 <= ratio <= 384 / 108 + 0.1, held


def test_pool_bytes_for_the_same_neurons(tmp_path):
    """The same hot neurons take 3.56x fewer pool bytes at Q4_0 than at F16 (7.1x fewer than the float32 rows
    the stand-in used to decode)."""
    ids = np.arange(0, N_FF, 2)
    n_bytes = {}
    for ggml_type in (GGMLType.F16, GGMLType.Q4_0):
        engine = Engine(
            _model(tmp_path / ggml_type.name, ggml_type),
            EngineOptions(act_precision="f32", n_ctx=64, n_threads=2),
        )
        ffn = engine.model.ffns[0]
        n_bytes[ggml_type] = HotRows(
            ffn.gate, ffn.up, ffn.down_t, ids, torch.device("cpu"), engine.kc
        ).n_bytes
    assert n_bytes[GGMLType.F16] == len(ids) * 3 * 64 * 2
    assert n_bytes[GGMLType.Q4_0] == len(ids) * 3 * 2 * 18
    assert n_bytes[GGMLType.F16] / n_bytes[GGMLType.Q4_0] == pytest.approx(384 / 108)


INTERPRETER_CHECK = BackgroundCheck(
    (sys.executable, str(TESTS / "triton_interpret_check.py")), (("TRITON_INTERPRET", "1"),)
)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.background(INTERPRETER_CHECK)
def test_triton_kernels_in_the_interpreter(request):
    """The CUDA pool's kernels (every pool type, K-quants included; odd N, K 32..1024, T 1/3, split sums; T = 17
    is test_triton_kernels.py's) and whole models with every pool weight on the Triton path, run on the CPU by
    TRITON_INTERPRET=1 (see the script)."""
    proc = run_background(request, INTERPRETER_CHECK)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["failures"], report["failures"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernels = report["kernels"]
    assert {k[0] for k in kernels} == {t.name for t in POOL_TYPES}
    assert {k[4] for k in kernels} == {1, 3} and {k[3] for k in kernels} >= {32, 64, 96, 1024}
    assert max(k[-1] for k in kernels) < 1e-5
    assert set(report["engine"]) == {"Q4_0", "F16", "Q4_K/Q6_K"}
    assert max(report["engine"].values()) < 1e-4
