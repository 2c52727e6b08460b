"""CATS thresholds per expert (`powerinfer sparsify` on MoE files, issue 34): the engine with every neuron active is
the dense engine bit for bit; at S = 0.5 it equals experts computed in float64 by torch with the same active masks;
its prompt and one-token paths agree bit for bit; the file keeps every tensor of the input (llama.cpp loads it);
bad thresholds give one error line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_one_error_line
from typer.testing import CliRunner

from powerinfer.cli import app
from powerinfer.gguf import GGUFWriter, read_gguf
from powerinfer.gguf.constants import Keys, ValueType
from powerinfer.model.moe import FusedMoEFFN
from powerinfer.quant import dequantize
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sparsify import SparsifyOptions, run_sparsify
from powerinfer.sparsify.write import write_moe_gguf
from tests.conftest import load_script

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "powerinfer" / "data" / "calibration.txt"
PROMPT = [1, 72, 105, 300, 260, 84, 104, 101, 280, 299, 77, 270, 108]
runner = CliRunner()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Tiny MoE files (scripts/make_synthetic_moe.py) and their CATS copies: threshold -inf (every neuron active)
    and sparsified at S = 0.5 on the bundled calibration text."""
    mod = load_script("make_synthetic_moe")
    out = tmp_path_factory.mktemp("moe-cats")
    paths = mod.generate(
        out, ["qwen3moe", "mixtral", "olmoe", "qwen2moe", "smallthinker"], "tiny", ["f32", "q4_0"]
    )
    files = {p.name: p for p in paths}
    for kind in ("f32", "q4_0"):
        dense = files[f"moe-qwen3moe-tiny-{kind}.gguf"]
        g = read_gguf(dense)
        every = np.full((2, 8, 32), -np.inf, dtype=np.float32)
        path = out / f"every-{kind}.gguf"
        write_moe_gguf(
            g, path, target=0.0, thresholds=np.zeros(2), expert_thresholds=every, layer_sparsity=np.zeros(2)
        )
        files[f"every-{kind}"] = path
        files[f"s05-{kind}"] = sparsify(dense, out / f"s05-{kind}.gguf", 0.5)
    return files


def sparsify(model: Path, output: Path, s: float) -> Path:
    opts = SparsifyOptions(
        model=model, corpus=CORPUS, output=output, sparsity=s, n_threads=1, max_tokens=2048
    )
    run_sparsify(opts)
    return output


def decode(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits of each token fed one at a time (the fused one-token MoE block)."""
    engine.reset()
    return torch.stack([engine.eval([t]).clone() for t in ids])


@pytest.mark.parametrize("kind", ["f32", "q4_0"])
@pytest.mark.parametrize("act", ["q8", "f32"])
def test_every_neuron_active_equals_dense(files, kind: str, act: str):
    """Thresholds of -inf: the CATS paths (the one-token kernel's chunk scan, the grouped kernel's mask) give the
    dense experts' bits, prompt and decode, at 1 and 2 threads."""
    for threads in (1, 2):
        opts = EngineOptions(n_ctx=64, n_threads=threads, act_precision=act)
        dense = Engine(files[f"moe-qwen3moe-tiny-{kind}.gguf"], opts)
        cats = Engine(files[f"every-{kind}"], opts)
        assert all(la.ffn.experts.thresholds is not None for la in cats.model.layers)
        assert torch.equal(dense.logits_all(PROMPT), cats.logits_all(PROMPT)), threads
        assert torch.equal(decode(dense, PROMPT), decode(cats, PROMPT)), threads


def expert_weights(path: Path, bid: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, up (E, F, D) and down (E, D, F) of layer bid in float64, decoded from the file."""
    g = read_gguf(path)
    out = []
    for name in ("gate", "up", "down"):
        t = g.tensors[f"blk.{bid}.ffn_{name}_exps.weight"]
        out.append(torch.from_numpy(dequantize(t.data, t.ggml_type, t.shape)).double())
    return out[0], out[1], out[2]


def reference(x, ids, weights, gate, up, down, thresholds) -> tuple[torch.Tensor, int]:
    """sum_j w_j down_e(h) in float64, h = silu(gate_e x) * up_e x where |silu(gate_e x)| > thresholds[e] (None:
    every neuron), and the count of pairs within 1e-4 (relative) of their threshold (a mask float32 could flip)."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    near = 0
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            a = torch.nn.functional.silu(gate[e] @ x[t].double())
            h = a * (up[e] @ x[t].double())
            if thresholds is not None:
                thr = thresholds[e].double()
                near += int(((a.abs() - thr).abs() <= 1e-4 * thr.abs()).sum())
                h = torch.where(a.abs() > thr, h, torch.zeros_like(h))
            out[t] += float(weights[t, j]) * (down[e] @ h)
    return out, near


def test_sparse_experts_equal_masked_reference(files):
    """At S = 0.5 the engine's experts (prompt path, grouped kernel; decode path, one-token kernel) equal the
    float64 masked reference; the dense reference and thresholds shifted by one expert are far from it.
    Measured (layer 1, 24 tokens): max |engine - reference| 7.0e-8 (prompt and one-token alike; layer 0: 5.1e-8)
    against outputs of max 0.37; the dense reference differs from the masked one by 0.10, the shifted thresholds
    by 0.077."""
    from powerinfer.model.moe import route

    path = files["s05-f32"]
    engine = Engine(path, EngineOptions(n_ctx=64, n_threads=1, act_precision="f32"))
    bid = 1
    ffn = engine.model.layers[bid].ffn
    thresholds = ffn.experts.thresholds
    assert thresholds is not None and thresholds.shape == (8, 32) and torch.isfinite(thresholds).all()
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(7))
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()  # RMS-normed like the FFN input
    ids, weights = route(ffn.logits(x), ffn.spec, engine.kc)
    gate, up, down = expert_weights(path, bid)
    want, near = reference(x, ids, weights, gate, up, down, thresholds)
    assert near == 0  # no mask decided by a float32 rounding
    prompt = ffn.experts(x, ids, weights).double()
    alone = torch.cat(
        [ffn.experts(x[t : t + 1], ids[t : t + 1], weights[t : t + 1]) for t in range(24)]
    ).double()
    err = max((prompt - want).abs().max().item(), (alone - want).abs().max().item())
    bound = 3e-7  # a few times the measured 7.0e-8
    assert err <= bound, err
    ffn.experts.kernel = None  # the op-by-op torch paths (no experts kernel) apply the same masks
    prompt = ffn.experts(x, ids, weights).double()
    alone = torch.cat(
        [ffn.experts(x[t : t + 1], ids[t : t + 1], weights[t : t + 1]) for t in range(24)]
    ).double()
    assert max((prompt - want).abs().max().item(), (alone - want).abs().max().item()) <= bound
    dense, _ = reference(x, ids, weights, gate, up, down, None)
    shifted, _ = reference(x, ids, weights, gate, up, down, thresholds.roll(1, dims=0))
    assert (dense - want).abs().max() > 100 * bound and (shifted - want).abs().max() > 100 * bound
    # the mask's share: about half of the selected experts' neurons
    active = 0
    for t in range(24):
        for e in ids[t].tolist():
            active += int((torch.nn.functional.silu(gate[e] @ x[t].double()).abs() > thresholds[e]).sum())
    assert 0.3 < active / (24 * 2 * 32) < 0.7


@pytest.mark.parametrize("kind", ["f32", "q4_0"])
def test_sparse_path_batch_invariant(files, kind: str):
    """S = 0.5: a prompt at once, split, or token by token (the fused one-token block), gives the same logits bit
    for bit, at 1 and 2 threads; the one-token kernel reads only the active neurons' up rows."""
    for threads in (1, 2):
        engine = Engine(files[f"s05-{kind}"], EngineOptions(n_ctx=64, n_threads=threads))
        assert all(isinstance(la.fused_ffn, FusedMoEFFN) for la in engine.model.layers)
        whole = engine.logits_all(PROMPT)
        engine.reset()
        split = torch.cat([engine.logits_all(PROMPT[:5]), engine.logits_all(PROMPT[5:9])])
        split = torch.cat([split, decode_from(engine, PROMPT[9:])])
        assert torch.equal(whole, split), threads
        assert torch.equal(whole, decode(engine, PROMPT)), threads
        counts = sum(la.ffn.experts.kernel.counts for la in engine.model.layers)
        active, read, total = (int(v) for v in counts)
        assert total > 0 and read == active and 0.3 < active / total < 0.75, (active, read, total)


def decode_from(engine: Engine, ids: list[int]) -> torch.Tensor:
    return torch.stack([engine.eval([t]).clone() for t in ids])


def test_file_keeps_the_input_tensors(files):
    """The sparsified MoE file holds the input's tensors unchanged and only adds keys (llama.cpp refuses a file
    with tensors it does not load, it ignores unknown keys)."""
    dense, cats = read_gguf(files["moe-qwen3moe-tiny-f32.gguf"]), read_gguf(files["s05-f32"])
    assert list(dense.tensors) == list(cats.tensors)
    for name, t in dense.tensors.items():
        assert np.array_equal(t.data, cats.tensors[name].data), name
    added = set(cats.metadata) - set(dense.metadata)
    assert Keys.SPARSITY_EXPERT_THRESHOLDS in added and all(
        k.startswith(("powerinfer.sparsity.", "powerinfer.stamp."))
        for k in added  # and our version stamp
    )
    assert cats.metadata[Keys.SPARSITY_EXPERT_THRESHOLDS].shape == (2 * 8 * 32,)


@pytest.mark.parametrize("arch", ["mixtral", "olmoe", "qwen2moe"])
def test_sparsify_other_moe_archs(files, tmp_path: Path, arch: str):
    """Mixtral, OLMoE and Qwen2-MoE (its routed experts; the shared expert stays dense) sparsify and load."""
    out = sparsify(files[f"moe-{arch}-tiny-f32.gguf"], tmp_path / "s.gguf", 0.5)
    engine = Engine(out, EngineOptions(n_ctx=64, n_threads=1))
    assert all(la.ffn.experts.thresholds is not None for la in engine.model.layers)
    assert torch.isfinite(engine.logits_all(PROMPT)).all()


def invoke_sparsify(model: Path, out: Path):
    """`powerinfer sparsify` at S = 0.5 on the calibration corpus, through the CLI"""
    return runner.invoke(
        app, ["sparsify", "-m", str(model), "-f", str(CORPUS), "--sparsity", "0.5", "-o", str(out)]
    )


def test_sparsify_refuses_reglu_experts(files, tmp_path: Path):
    model = files["moe-smallthinker-tiny-f32.gguf"]
    result = invoke_sparsify(model, tmp_path / "o.gguf")
    assert_one_error_line(result, "ReGLU")
    assert not (tmp_path / "o.gguf").exists()


def with_key(src: Path, dst: Path, value: np.ndarray) -> Path:
    """A copy of src whose expert thresholds key holds `value`."""
    g = read_gguf(src)
    w = GGUFWriter(dst)
    for key, v in g.metadata.items():
        if key != Keys.SPARSITY_EXPERT_THRESHOLDS:
            w.add(key, v, g.value_types[key], g.array_types.get(key))
    w.add(Keys.SPARSITY_EXPERT_THRESHOLDS, value, ValueType.ARRAY)
    for name, t in g.tensors.items():
        w.add_tensor(name, t.data, t.ggml_type, t.shape)
    w.write()
    return dst


@pytest.mark.parametrize(
    ("value", "needles"),
    [
        (
            np.zeros(2 * 8 * 31, dtype=np.float32),
            ("expert_act_thresholds", "512 float32", "2 x 8 x 32", "496"),
        ),
        (
            np.zeros(2 * 8 * 32 + 1, dtype=np.float32),
            (
                "expert_act_thresholds",
                "513 float32 values",
            ),
        ),
        (
            np.zeros(2 * 8 * 32, dtype=np.int32),
            (
                "expert_act_thresholds",
                "int32",
            ),
        ),
    ],
)
def test_bad_thresholds_one_error_line(files, tmp_path: Path, value, needles):
    path = with_key(files["s05-f32"], tmp_path / "bad.gguf", value)
    result = runner.invoke(app, ["main", "-m", str(path), "-n", "2", "--temp", "0", "-p", "hi"])
    assert_one_error_line(result, *needles)


def test_offload_keeps_cats_experts_on_the_cpu(files):
    """-ngl on a file with expert thresholds: attention and routers placed (the CPU standing in for the pool
    device), every expert on the CPU with its thresholds (the pool would run them dense); the same logits."""
    path = files["s05-f32"]
    plain = Engine(path, EngineOptions(n_ctx=64, n_threads=1)).logits_all(PROMPT)
    engine = Engine(path, EngineOptions(n_ctx=64, n_threads=1, pool_device="cpu", n_gpu_layers=3))
    assert all(
        la.ffn.experts.pool is None and la.ffn.experts.thresholds is not None for la in engine.model.layers
    )
    assert any("experts on the CPU (CATS thresholds)" in line for line in engine.placement_report())
    assert (engine.logits_all(PROMPT) - plain).abs().max() <= 1e-5  # measured 0 (the placed attention's sums)


@pytest.mark.parametrize("kind", ["f32", "q4_0"])
def test_first_token_runs_dense(files, kind: str):
    """A sequence's first token (position 0, the attention sink) runs the experts without thresholds, as the dense
    CATS files do: its logits are the dense file's bits, in a prompt and decoded alone (the fused block), and the
    later tokens' are not."""
    for threads in (1, 2):
        opts = EngineOptions(n_ctx=64, n_threads=threads)
        dense = Engine(files[f"moe-qwen3moe-tiny-{kind}.gguf"], opts).logits_all(PROMPT)
        engine = Engine(files[f"s05-{kind}"], opts)
        prompt = engine.logits_all(PROMPT)
        assert torch.equal(prompt[0], dense[0]) and not torch.equal(prompt[1:], dense[1:])
        assert torch.equal(decode(engine, PROMPT)[0], dense[0])


def test_sparsify_refuses_a_sparsified_moe_file(files, tmp_path: Path):
    result = invoke_sparsify(files["s05-f32"], tmp_path / "o.gguf")
    assert_one_error_line(result, "already sparse")
