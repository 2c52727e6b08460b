"""MoE placement on the CPU standing in for the pool device (powerinfer.placement.experts, device.pool.PoolExperts):
experts whole in the pool under -ngl and --vram-budget (hottest per byte from the profile), llama.cpp's static flags
--cpu-moe, --n-cpu-moe and -ot; logits against everything on the CPU, pool bytes against the plan, the plan's
expected share of expert calls against the share measured on a held-out text, and bad flag values through the CLI.

Files: the tiny synthetic MoE files of scripts/make_synthetic_moe.py (2 layers, 8 experts of 32, top 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from powerinfer.placement.experts import load_expert_counts, load_neuron_counts
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.report import expert_calls
from tests.conftest import load_script

REPO = Path(__file__).resolve().parents[1]
TEXT = (REPO / "powerinfer" / "data" / "calibration.txt").read_text()
PROFILE_TEXT, HELD_OUT = (
    TEXT[:12000],
    TEXT[30000:36000],
)  # disjoint parts: profile on one, measure on the other


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("moe-placement")
    paths = load_script("make_synthetic_moe").generate(
        out, ["qwen3moe", "qwen2moe", "smallthinker"], "tiny", ["q4_0"], seed=0
    )
    return {p.name: p for p in paths}


PROMPT = list(range(3, 40))
# plans: EngineOptions fields beside pool_device="cpu", and the experts each layer of the 2 then holds
PLANS = {
    "ngl-experts-whole": (dict(n_gpu_layers=3), [8, 8]),
    "n-cpu-moe-1": (dict(n_gpu_layers=3, n_cpu_moe=1), [0, 8]),
    "cpu-moe": (dict(n_gpu_layers=3, cpu_moe=True), [0, 0]),
    "ot-layer0-pool": (dict(override_tensor=(r"blk\.0\.ffn_(gate|up|down)_exps=pool",)), [8, 0]),
    "ot-cpu-first": (dict(n_gpu_layers=3, override_tensor=("blk.1.=CPU,exps=pool",)), [8, 0]),
    "budget": (
        {},
        None,
    ),  # the dense parts and 10 experts' bytes (no profile: the last layer first): budget()
}


def budget(path: Path, n_experts: int) -> float:
    """A --vram-budget (GiB) for both layers' dense parts and KV caches (n_ctx 64) and n_experts experts, plus
    half of one."""
    opts = EngineOptions(act_precision="f32", n_ctx=64, n_threads=1, pool_device="cpu", n_gpu_layers=2)
    probe = Engine(path, opts)
    loader, plan = probe.assembled.loader, probe.assembled.plan.experts
    assert plan is not None
    dense = loader.device_bytes - loader.expert_bytes
    per_expert = plan.bytes // 16
    kv = 2 * 2 * 64 * probe.config.n_embd_gqa * 4
    return (dense + kv + n_experts * per_expert + per_expert // 2) / 2**30


def run(engine: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's logits in one step, and decode token by token over its first 10 tokens."""
    engine.reset()
    whole = engine.logits_all(PROMPT)
    engine.reset()
    steps = torch.stack([engine.eval([t]).clone() for t in PROMPT[:10]])
    return whole, steps


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "smallthinker"])
@pytest.mark.parametrize("act", ["f32", "q8"])
def test_plans_give_the_all_cpu_logits(files, arch: str, act: str):
    path = files[f"moe-{arch}-tiny-q4_0.gguf"]
    base = EngineOptions(act_precision=act, n_ctx=64, n_threads=1)
    plain_whole, plain_steps = run(Engine(path, base))
    for name, (fields, per_layer) in PLANS.items():
        if name == "budget":
            fields = dict(vram_budget_gib=budget(path, 10))
        engine = Engine(path, EngineOptions(**{**base.__dict__, "pool_device": "cpu", **fields}))
        plan = engine.assembled.plan.experts
        assert plan is not None, name
        held = [len(e) for e in plan.experts]
        if per_layer is not None:
            assert held == per_layer, name
        else:  # the budget: the last layer's experts first
            assert held == [2, 8], held
        # the pool holds exactly the planned bytes of experts
        assert engine.assembled.loader.expert_bytes == plan.bytes, name
        whole, steps = run(engine)
        # measured 0 for every plan, architecture and activation precision (the stand-in computes its experts
        # with the C kernels on the same blocks, the CPU part grouped per expert: the bits of the all-CPU paths);
        # the acceptance bound is 1e-4 relative, on a GPU the pool's own kernels differ in the last bits
        for got, ref in ((whole, plain_whole), (steps, plain_steps)):
            rel = float((got - ref).abs().max() / ref.abs().max())
            assert rel <= 1e-5, (name, rel)
        calls, pool = expert_calls(engine.assembled)
        # (the prompt + 10 steps) x 2 layers x top 2
        assert calls == (len(PROMPT) + 10) * 2 * 2, name
        if per_layer is not None:  # whole layers: the pool serves exactly their share
            assert pool / calls == pytest.approx(sum(per_layer) / 16), name
        report = "\n".join(engine.placement_report() + engine.sparse_report())
        assert f"experts: {sum(held)}/16 in the pool (cpu)" in report and "served by the pool" in report


def test_budget_takes_the_hottest_experts_and_predicts_the_share(files, tmp_path):
    """profile (the CLI) writes the expert counts of one text; a budget then holds the hottest experts per byte;
    the share of expert calls the pool serves on a held-out text is what the plan expected, within 5 points."""
    path = tmp_path / "model.gguf"  # its own folder: profile.json goes beside it
    path.write_bytes(files["moe-qwen3moe-tiny-q4_0.gguf"].read_bytes())
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(PROFILE_TEXT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "powerinfer", "profile", "-m", str(path), "-f", str(corpus), "-c", "64"]
    done = subprocess.run(
        [*cmd, "-t", "1", "--no-plot"], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr
    counts = load_expert_counts(path, 2, 8)
    assert counts is not None
    plain = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1))
    # room for the dense parts of both layers and 6 of the 16 experts
    opts = EngineOptions(act_precision="f32", n_ctx=64, n_threads=1, pool_device="cpu")
    engine = Engine(path, EngineOptions(**{**opts.__dict__, "vram_budget_gib": budget(path, 6)}))
    plan = engine.assembled.plan.experts
    assert plan.source == "profile" and plan.n_pooled == 6
    assert engine.assembled.loader.expert_bytes == plan.bytes
    # the 6 with the most selections (one byte size for every expert here)
    top = set(np.argsort(-counts.reshape(-1), kind="stable")[:6].tolist())
    assert {bid * 8 + int(e) for bid, ids in enumerate(plan.experts) for e in ids} == top
    ids = engine.tokenizer.encode(HELD_OUT)
    held_out = [ids[i : i + 60] for i in range(0, len(ids) - 60, 60)][:8]
    for window in held_out:
        engine.reset()
        got = engine.logits_all(window)
        plain.reset()
        ref = plain.logits_all(window)
        assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5
    calls, pool = expert_calls(engine.assembled)
    measured = pool / calls
    # measured: expected 67.4%, served 64.5% of 1920 calls (2.9 points; SmallThinker's tiny file: 56.5% and 58.6%)
    assert abs(measured - plan.expected_share) <= 0.05, (measured, plan.expected_share)
    assert plan.expected_share > 6 / 16  # hotter than uniform


@pytest.mark.parametrize("act", ["f32", "q8"])
def test_budget_takes_hot_neurons_of_warm_relu_experts(files, tmp_path, act: str):
    """SmallThinker (ReLU experts): profile writes per-neuron counts (expert_neurons.npy); a budget with room for 3
    whole experts and part of a fourth puts the hottest neurons of the next expert(s) in the pool: the pool
    computes those neurons, the CPU the others (its copy of the expert's gate has their rows zeroed)."""
    path = tmp_path / "model.gguf"
    path.write_bytes(files["moe-smallthinker-tiny-q4_0.gguf"].read_bytes())
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(PROFILE_TEXT[:6000])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "powerinfer", "profile", "-m", str(path), "-f", str(corpus), "-c", "64"]
    done = subprocess.run(
        [*cmd, "-t", "1", "--no-plot"], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr
    neurons = load_neuron_counts(path, 2, 8, 32)
    assert neurons is not None and neurons.sum() > 0
    plain = Engine(path, EngineOptions(act_precision=act, n_ctx=64, n_threads=1))
    plain_whole, plain_steps = run(plain)
    engine = Engine(
        path,
        EngineOptions(
            act_precision=act, n_ctx=64, n_threads=1, pool_device="cpu", vram_budget_gib=budget(path, 3.2)
        ),
    )
    plan = engine.assembled.plan.experts
    assert plan.n_pooled == 3 and plan.n_neurons > 0
    assert engine.assembled.loader.expert_bytes == plan.bytes  # the pool holds the planned bytes
    # the pooled neurons of an expert are its most active ones
    for bid, layer in enumerate(plan.neurons):
        for e, ids in layer.items():
            assert e not in set(plan.experts[bid].tolist())
            rest = np.setdiff1d(np.arange(32), ids)
            if len(rest):
                assert neurons[bid, e, ids].min() >= neurons[bid, e, rest].max() or len(layer) > 1
    whole, steps = run(engine)
    # measured: f32 1.4e-7 relative (the pooled neurons' sum is added apart); q8 0.8% (the CPU's down product
    # quantises h to int8 per 32 neurons, and a block with its pooled neurons zeroed gets another scale: the size
    # of q8's own error, whose logits differ from f32's by 1.3% here)
    bound = 1e-5 if act == "f32" else 0.03
    for got, ref in ((whole, plain_whole), (steps, plain_steps)):
        rel = float((got - ref).abs().max() / ref.abs().max())
        assert rel <= bound, rel
    report = "\n".join(engine.placement_report())
    assert "neurons of" in report


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "powerinfer", "main", "-n", "4", "-t", "1", "-p", "hi", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_flags_in_the_placement_line(files):
    path = str(files["moe-qwen3moe-tiny-q4_0.gguf"])
    done = cli("-m", path, "--pool-device", "cpu", "-ngl", "3", "--n-cpu-moe", "1", "-ot", "blk.0.=CPU")
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stderr.splitlines() if x.startswith("placement:"))
    assert "experts: 8/16 in the pool (cpu)" in line and "--n-cpu-moe 1; -ot blk.0.=cpu" in line, line
    assert "moe: 50.0% of " in done.stderr
    done = cli("-m", path, "--pool-device", "cpu", "-ngl", "3", "--cpu-moe")
    assert "experts: 0/16 in the pool (cpu)" in done.stderr and "--cpu-moe" in done.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (("--n-cpu-moe", "-1"), "--n-cpu-moe must be >= 0"),
        (("-ot", "exps"), "expected REGEX=DEVICE"),
        (("-ot", "(exps=CPU"), "bad regular expression"),
        (("-ot", "exps=CUDA7"), "unknown device CUDA7"),
        (("-ot", "exps=CPU,=pool"), "expected REGEX=DEVICE"),
        (("-ot", r"blk\.1\.ffn_down_exps=pool"), "a layer's expert tensors move together"),
    ],
)
def test_bad_flag_values_one_error_line(files, args: tuple[str, ...], message: str):
    done = cli("-m", str(files["moe-qwen3moe-tiny-q4_0.gguf"]), "--pool-device", "cpu", *args)
    assert done.returncode == 1
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in done.stderr, done.stderr


TRITON_CHECK = """
import sys, numpy as np, torch
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.device.pool import PoolExperts
engine = Engine(sys.argv[1], EngineOptions(act_precision="f32", n_ctx=64, n_threads=1))
experts = engine.model.layers[1].ffn.experts
x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
ids, w = torch.tensor([[0, 3], [1, 3], [2, 5], [3, 7], [0, 6]]), torch.rand(5, 2)
ref = experts(x, ids, w)
experts.pool = PoolExperts(
    experts.gate, experts.up, experts.down, np.array([3, 5, 6]), 8, "silu", torch.device("cpu"), experts.kc, "triton"
)
got = experts(x, ids, w)
print(float((got - ref).abs().max() / ref.abs().max()), experts.pool_calls)
"""


def test_pool_experts_on_the_triton_kernels(files):
    """The pooled experts through the CUDA pool's kernels (Triton, run on the CPU by its interpreter): a prompt's
    pairs split between the pool and the CPU give the all-CPU sum (measured 1.1e-7 relative: float32 sums in
    another order)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    path = str(files["moe-qwen3moe-tiny-q4_0.gguf"])
    done = subprocess.run(
        [sys.executable, "-c", TRITON_CHECK, path], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr
    rel, pooled = done.stdout.split()
    assert float(rel) <= 1e-5 and int(pooled) == 5
