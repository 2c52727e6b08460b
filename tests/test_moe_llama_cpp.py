"""MoE files made by scripts/make_synthetic_moe.py (gguf package, llama.cpp's names and keys) against llama.cpp's
greedy ids recorded by that script with llama-cpp-python 0.3.16 (tests/data/moe-llama-cpp-greedy.json): Qwen3-MoE,
Qwen2-MoE, OLMoE, Mixtral and SmallThinker, F32, F16 and Q4_0; and SmallThinker's own parts (router on the layer input,
RoPE-less layers)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

import powerinfer.arch.moe as arch_moe
from powerinfer import ops
from powerinfer.runtime.engine import Engine, EngineOptions
from tests.conftest import load_script

REPO = Path(__file__).resolve().parents[1]
RECORDED = json.loads((REPO / "tests" / "data" / "moe-llama-cpp-greedy.json").read_text())
# README's rule: greedy ids exact except at a near-tie, a step whose top-2 logit margin is below ~0.05
NEAR_TIE = 0.05


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The tiny files of every architecture, F32, F16 and Q4_0, regenerated: byte for byte those llama.cpp ran."""
    mod = load_script("make_synthetic_moe")
    out = tmp_path_factory.mktemp("moe")
    paths = mod.generate(out, list(mod.ARCHS), "tiny", ["f32", "f16", "q4_0"], seed=0)
    for p in paths:
        assert hashlib.sha256(p.read_bytes()).hexdigest() == RECORDED["sha256"][p.name], p.name
    return {p.name: p for p in paths}


def forced_steps(path: Path) -> tuple[int, int, int]:
    """Our next-token choice along llama.cpp's greedy continuations (teacher forcing: each step sees llama.cpp's
    ids before it): (steps compared, mismatches, near-ties skipped). A step is compared unless our top-2 margin or
    llama.cpp's is below NEAR_TIE, where either choice is right."""
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=128, n_threads=1))
    compared = wrong = skipped = 0
    for run in RECORDED["runs"][path.name]:
        prompt, ids, margins = run["prompt"], run["ids"], run["margins"]
        engine.reset()
        logits = engine.logits_all(prompt + ids[:-1])[len(prompt) - 1 :]  # (32, n_vocab): the step's logits
        top = logits.topk(2, dim=-1)
        ours = top.values[:, 0] - top.values[:, 1]
        for step, want in enumerate(ids):
            if ours[step] < NEAR_TIE or margins[step] < NEAR_TIE:
                skipped += 1
                continue
            compared += 1
            wrong += int(top.indices[step, 0]) != want
    return compared, wrong, skipped


ARCHS = ("qwen3moe", "qwen2moe", "olmoe", "mixtral", "smallthinker")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["f32", "f16", "q4_0"])
def test_greedy_ids_match_llama_cpp(files, arch: str, kind: str):
    # measured: every compared step equal; of the 96 steps 3 to 7 are near-ties (llama.cpp's margin or ours) in the
    # F32 and F16 files, 20 to 39 in the Q4_0 ones (random blocks and a random Q4_0 head: smaller logit margins)
    compared, wrong, skipped = forced_steps(files[f"moe-{arch}-tiny-{kind}.gguf"])
    assert wrong == 0 and skipped <= (48 if kind == "q4_0" else 12), (compared, wrong, skipped)


@pytest.mark.parametrize("change", ["top_k", "norm"])
def test_wrong_router_disagrees_with_llama_cpp(files, monkeypatch, change: str):
    """Negative control: one more expert per token, or the renormalisation flipped, leaves llama.cpp's ids."""
    real = arch_moe.moe_spec

    def spec(*args, **kwargs):
        s = real(*args, **kwargs)
        if change == "top_k":
            return dataclasses.replace(s, n_expert_used=s.n_expert_used + 1)
        return dataclasses.replace(s, norm_weights=not s.norm_weights)

    monkeypatch.setattr(arch_moe, "moe_spec", spec)
    # measured mismatches (of ~90 steps per file): one more expert 5, 0, 2, 1, 27 (qwen3moe, qwen2moe, olmoe,
    # mixtral, smallthinker), renormalisation flipped 2, 3, 2, 1, 12; greedy ids of a 2-layer model are a coarse
    # oracle, test_arch_moe compares the logits themselves
    wrong = [forced_steps(files[f"moe-{arch}-tiny-f32.gguf"])[1] for arch in ARCHS]
    assert sum(wrong) >= 15, wrong


def test_smallthinker_layers(files):
    """llama.cpp's smallthinker with a window key: layer 0 full attention without RoPE, layer 1 windowed (4096)
    with RoPE; ReGLU experts, sigmoid gating, renormalised, the router on the layer input."""
    engine = Engine(
        files["moe-smallthinker-tiny-f32.gguf"], EngineOptions(act_precision="f32", n_ctx=64, n_threads=1)
    )
    c = engine.config
    assert c.attention_of(0).rope is None and c.attention_of(0).sliding_window is None
    assert c.attention_of(1).rope is not None and c.attention_of(1).sliding_window == 4096
    s = c.experts
    assert (s.act, s.gating, s.norm_weights, s.route_input) == ("relu", "sigmoid", True, "layer")


def test_smallthinker_routes_on_the_layer_input(files, monkeypatch):
    """Routing on the normed FFN input instead (as the other families do) changes the logits far beyond the
    differences between prefill, chunks and token by token."""
    path = files["moe-smallthinker-tiny-f32.gguf"]
    ids = RECORDED["runs"][path.name][1]["prompt"] + RECORDED["runs"][path.name][1]["ids"]
    ref = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1)).logits_all(ids)
    chunked = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_batch=5, n_threads=1)).logits_all(
        ids
    )
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1))
    step = torch.stack([engine.eval([t]) for t in ids])
    # measured 4.8e-7 (chunks) and 4.8e-7 (token by token)
    assert (chunked - ref).abs().max() <= 1e-5 and (step - ref).abs().max() <= 1e-5
    real = arch_moe.moe_spec
    monkeypatch.setattr(
        arch_moe, "moe_spec", lambda *a, **k: dataclasses.replace(real(*a, **k), route_input="ffn")
    )
    other = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1)).logits_all(ids)
    assert (other - ref).abs().max() > 0.5


def test_profile_cli_on_moe(files, tmp_path: Path):
    """`powerinfer profile` on a MoE file: the expert table on stderr, the summary on stdout, profile.json."""
    from typer.testing import CliRunner

    from powerinfer.cli import app

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "prof"
    path = files["moe-smallthinker-tiny-f32.gguf"]
    result = CliRunner().invoke(
        app, ["profile", "-m", str(path), "-f", str(corpus), "-o", str(out), "-c", "64"]
    )
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["n_expert"] == 8 and summary["n_expert_used"] == 2
    n = summary["n_tokens"]
    assert [sum(c) for c in summary["expert_counts"]] == [2 * n, 2 * n]
    assert "top 10% of experts serve" in result.stderr
    assert json.loads((out / "profile.json").read_text())["expert_counts"] == summary["expert_counts"]


@pytest.mark.parametrize("kind", ["f32", "q4_0"])
def test_sparse_reglu_experts_equal_dense(files, kind: str):
    """SmallThinker's ReGLU experts for one token read only the up rows of neurons whose gate is positive; the
    result equals the dense expert computation (every up row; and each expert's own three matmuls) within 1e-5
    relative. Measured: bit for bit; about half of the up rows skipped."""
    from powerinfer.model.moe import Experts, route

    engine = Engine(
        files[f"moe-smallthinker-tiny-{kind}.gguf"], EngineOptions(act_precision="f32", n_ctx=64, n_threads=1)
    )
    ffn = engine.model.layers[1].ffn
    sparse = ffn.experts
    assert sparse.sparse and sparse.rows_path and sparse.one_path
    dense = Experts(sparse.spec, sparse.gate, sparse.up, sparse.down, engine.kc, sparse=False)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    skipped = 0
    for t in range(16):
        xt = x[t : t + 1]
        ids, weights = route(xt @ torch.randn(64, 8, generator=torch.Generator().manual_seed(t)), sparse.spec)
        a = sparse(xt, ids, weights)
        b = dense(xt, ids, weights)
        c = sum(sparse.expert(int(e), xt) * weights[0, j] for j, e in enumerate(ids[0]))
        scale = b.abs().max()
        assert (a - b).abs().max() <= 1e-5 * scale and (a - c).abs().max() <= 1e-5 * scale
        rows = (ids[0, :, None] * sparse.spec.n_ff_exp + sparse.neurons).reshape(-1)
        skipped += int((ops_rows(sparse, xt, rows) <= 0).sum())
    share = skipped / (16 * 2 * sparse.spec.n_ff_exp)
    assert 0.3 < share < 0.7, share


def ops_rows(experts, x, rows):
    from powerinfer import ops

    return ops.rows_matmul(x, experts.gate, rows, experts.kc)[0]


def test_bytes_read_per_token(files):
    """A token reads its k experts' rows of the stacked tensors and every other tensor whole (the file's convention
    for dense tensors); `main` prints it beside the file's size."""
    from powerinfer.gguf import read_gguf

    path = files["moe-qwen2moe-tiny-q4_0.gguf"]
    g = read_gguf(path)
    experts = sum(t.n_bytes for name, t in g.tensors.items() if "_exps." in name)
    others = sum(t.n_bytes for name, t in g.tensors.items() if "_exps." not in name)
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1))
    assert engine.read_bytes_per_token() == pytest.approx(others + experts * 2 / 8)
    assert any(line.startswith("moe: 2 of 8 experts per token") for line in engine.sparse_report())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["f32", "q4_0"])
def test_moe_block_batch_invariant(files, arch: str, kind: str):
    """A token's MoE output does not depend on the tokens it is computed with: a prompt grouped by expert equals
    each token alone (the one-token rows path) bit for bit, so prompts split into any batches, the prompt cache and
    the server's batches give the same logits."""
    engine = Engine(
        files[f"moe-{arch}-tiny-{kind}.gguf"], EngineOptions(act_precision="f32", n_ctx=64, n_threads=2)
    )
    ffn = engine.model.layers[1].ffn
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(5))

    def run(rows: slice) -> torch.Tensor:
        if ffn.spec.route_input == "layer":
            ffn.route_early(x[rows] * 2)
        return ffn(x[rows], x[rows])

    whole = run(slice(0, 12))
    alone = torch.cat([run(slice(t, t + 1)) for t in range(12)])
    halves = torch.cat([run(slice(0, 5)), run(slice(5, 12))])
    assert torch.equal(whole, alone) and torch.equal(whole, halves)


@pytest.mark.parametrize("arch", ["qwen2moe", "smallthinker"])
def test_offloaded_layers_on_the_cpu_pool(files, arch: str):
    """-ngl on MoE files (the CPU standing in for the pool device): attention, norms, routers and the shared expert
    are placed, and the offloaded layers' experts whole (llama.cpp's rule; tests/test_moe_placement.py covers the
    expert plans); logits as without placement."""
    path = files[f"moe-{arch}-tiny-q4_0.gguf"]
    ids = RECORDED["runs"][path.name][2]["prompt"]
    plain = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2)).logits_all(ids)
    for n_gpu_layers in (1, 3):
        engine = Engine(
            path,
            EngineOptions(
                act_precision="f32", n_ctx=64, n_threads=2, pool_device="cpu", n_gpu_layers=n_gpu_layers
            ),
        )
        layers = engine.model.layers
        assert sum(isinstance(layer.attn.wq, ops.DeviceWeight) for layer in layers) == min(n_gpu_layers, 2)
        assert isinstance(layers[-1].ffn.router, ops.DeviceWeight)
        assert [la.ffn.experts.pool is not None for la in layers] == [n_gpu_layers > 1, True]
        placed = engine.logits_all(ids)
        engine.reset()
        step = torch.stack([engine.eval([t]) for t in ids])
        # measured 0 (the prompt) and up to 4.2e-7 (token by token: the one-token attention path)
        assert (placed - plain).abs().max() <= 1e-5 and (step - plain).abs().max() <= 1e-5, n_gpu_layers


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["f32", "q4_0"])
@pytest.mark.parametrize("act", ["q8", "f32"])
def test_fused_decode_equals_op_by_op(files, arch: str, kind: str, act: str):
    """Decode through the fused blocks (the one-token attention block, with Qwen3's per-head QK-norm and NEOX RoPE,
    and the MoE FFN block: norm, router, one experts kernel call into the residual) gives the bits of every layer
    run op by op, at 1 and 2 threads; and a prompt's last logits do not depend on how it is split (the prompt
    attention computes each token as the one-token kernel does, the experts grouped by expert as one token alone)."""
    from powerinfer.model.moe import FusedMoEFFN

    path = files[f"moe-{arch}-tiny-{kind}.gguf"]
    prompt, ids = RECORDED["runs"][path.name][2]["prompt"], RECORDED["runs"][path.name][2]["ids"][:6]
    for threads in (1, 2):
        engine = Engine(path, EngineOptions(n_ctx=64, n_threads=threads, act_precision=act))
        layers = engine.model.layers
        # every layer's FFN fuses but Qwen2-MoE's (a shared expert); the attention block where the kernel has
        # every part (not OLMoE's whole-projection QK-norm, nor Qwen2-MoE's q/k/v biases; SmallThinker's window of
        # 4096 is past the context, its RoPE-less layers rotate by the identity)
        assert all(isinstance(la.fused_ffn, FusedMoEFFN) for la in layers) == (arch != "qwen2moe")
        whole_kernels = arch in ("qwen3moe", "mixtral", "smallthinker")
        assert all(la.fused_attn is not None for la in layers) == whole_kernels

        def decode(engine: Engine = engine) -> torch.Tensor:
            engine.reset()
            engine.eval(prompt)
            return torch.stack([engine.eval([t]).clone() for t in ids])

        fused = decode()
        saved = [(la.fused_attn, la.fused_ffn) for la in layers]
        for la in layers:
            la.fused_attn = la.fused_ffn = None
        assert torch.equal(fused, decode()), (threads, "op by op")
        for la, (a, f) in zip(layers, saved, strict=True):
            la.fused_attn, la.fused_ffn = a, f
        if not whole_kernels:  # some prompt attention runs SDPA, not the one-token kernel's sums
            continue
        engine.reset()
        whole = engine.eval(prompt + ids).clone()
        engine.reset()
        engine.eval(prompt[:3])
        engine.eval(prompt[3:] + ids[:2])
        for t in ids[2:]:
            last = engine.eval([t]).clone()
        assert torch.equal(whole, last), (threads, "split")


def test_bench_moe_script_runs(files):
    """scripts/bench_moe.py on a tiny file, our side only (llama.cpp lives in its own venv): one table row."""
    import os
    import subprocess

    path = files["moe-qwen3moe-tiny-q4_0.gguf"]
    cmd = [sys.executable, str(REPO / "scripts" / "bench_moe.py"), "-m", str(path), "--no-llama-cpp"]
    cmd += ["-r", "1", "--n-prompt", "8", "--n-gen", "2", "-t", "1"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=True)
    rows = [line for line in result.stdout.splitlines() if line.startswith(path.name)]
    assert len(rows) == 1 and "nan" in rows[0]  # no llama.cpp column
