"""Activation profiling and predictor training on tiny random ReLU models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_llama_state, random_predictors, write_llama_gguf
from typer.testing import CliRunner

from powerinfer.cli import app
from powerinfer.placement import load_activation_stats
from powerinfer.profile import load_predictor_folder, make_windows
from powerinfer.profile.predictor import calibrate_threshold, fold_thresholds
from powerinfer.runtime.engine import Engine, EngineOptions

runner = CliRunner()
N_HEAD = 4
WORDS = (
    "the of and to in is that for it as with was on be by this are from or an which function "
    "returns value list object module class method string file name type data"
).split()


def corpus(n_words: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    sentences = [" ".join(rng.choice(WORDS, 12)).capitalize() + "." for _ in range(n_words // 12)]
    return "\n\n".join(" ".join(sentences[i : i + 4]) for i in range(0, len(sentences), 4))


@pytest.fixture
def relu_model(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """A 2-layer random ReLU PowerInfer GGUF (F32, random predictors) and its HF-named weights."""
    sd = random_llama_state(seed=3)
    (tmp_path / "m").mkdir()
    path = write_llama_gguf(
        tmp_path / "m" / "tiny.powerinfer.gguf",
        sd,
        n_head=N_HEAD,
        n_head_kv=N_HEAD,
        act="relu",
        predictors=random_predictors(sd),
    )
    return path, sd


def reference_counts(sd: dict[str, np.ndarray], windows: list[list[int]], eps: float = 1e-5) -> np.ndarray:
    """Counts of ReLU(gate) > 0 from an independent float64 forward (HF layout, rotate-half RoPE)."""
    w = {k: torch.from_numpy(v).double() for k, v in sd.items()}
    n_layer = sum(1 for k in sd if k.endswith("input_layernorm.weight"))
    D = w["model.embed_tokens.weight"].shape[1]
    hd = D // N_HEAD
    counts = np.zeros((n_layer, w["model.layers.0.mlp.gate_proj.weight"].shape[0]), dtype=np.int64)

    def norm(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g

    def rope(x: torch.Tensor) -> torch.Tensor:  # (T, H, hd)
        T = x.shape[0]
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
        cos, sin = (
            torch.cat([ang.cos(), ang.cos()], -1)[:, None],
            torch.cat([ang.sin(), ang.sin()], -1)[:, None],
        )
        rot = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return x * cos + rot * sin

    for ids in windows:
        x = w["model.embed_tokens.weight"][ids]
        T = len(ids)
        for i in range(n_layer):
            p = f"model.layers.{i}."
            h = norm(x, w[p + "input_layernorm.weight"])
            q = rope((h @ w[p + "self_attn.q_proj.weight"].T).view(T, N_HEAD, hd)).transpose(0, 1)
            k = rope((h @ w[p + "self_attn.k_proj.weight"].T).view(T, N_HEAD, hd)).transpose(0, 1)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(T, N_HEAD, hd).transpose(0, 1)
            att = (q @ k.transpose(1, 2)) / hd**0.5
            att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
            x = x + (att @ v).transpose(0, 1).reshape(T, D) @ w[p + "self_attn.o_proj.weight"].T
            u = norm(x, w[p + "post_attention_layernorm.weight"])
            g = u @ w[p + "mlp.gate_proj.weight"].T
            counts[i] += (g > 0).sum(0).numpy()
            x = x + (torch.relu(g) * (u @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return counts


def test_profile_counts_match_dense_forward(relu_model, tmp_path: Path):
    model, sd = relu_model
    text = corpus(300)
    (tmp_path / "c.txt").write_text(text)
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "profile",
            "-m",
            str(model),
            "-f",
            str(tmp_path / "c.txt"),
            "-c",
            "64",
            "-o",
            str(out),
            "-t",
            "1",
            "--no-plot",
        ],
    )
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    stats = load_activation_stats(out / "activation", 2, 128)  # what the planner reads
    raw = torch.load(out / "activation" / "activation_0.pt", weights_only=True)
    assert raw.dtype == torch.float32 and raw.shape == (128,)
    engine = Engine(model, EngineOptions(act_precision="f32", n_ctx=64, dense_ffn=True))
    windows = make_windows(engine.tokenizer.encode(text, add_bos=False, parse_special=False), 64, 1)
    assert summary["n_tokens"] == sum(len(w) for w in windows)
    expected = reference_counts(sd, windows)
    got = np.stack(stats)
    # float32 engine vs float64 reference: only gate values within rounding of 0 may flip
    assert np.abs(got - expected).sum() <= 1e-4 * expected.sum(), np.abs(got - expected).max()
    assert got.sum() > 0
    sparsity = 1 - expected.sum(1) / (summary["n_tokens"] * 128)
    np.testing.assert_allclose(summary["sparsity"], sparsity, atol=1e-4)
    # hot-neuron share: the fewest neurons covering 80% of the firings
    for layer in range(2):
        c = np.sort(got[layer])[::-1]
        k = int(np.argmax(np.cumsum(c) >= 0.8 * c.sum())) + 1
        assert summary["hot_share_80"][layer] == pytest.approx(k / 128, abs=1e-6)
    assert "neurons for 80% of firings" in result.stderr


def test_profile_leaves_engine_dense_path_unchanged(relu_model):
    """Recording wraps the FFNs for the run only: logits are identical and the FFNs are restored."""
    from powerinfer.profile import recording

    model, _ = relu_model
    engine = Engine(model, EngineOptions(act_precision="f32", n_ctx=32, dense_ffn=True))
    ids = [1, 70, 71, 72, 73, 74]
    before = engine.eval(ids).clone()
    ffns = list(engine.model.ffns)
    with recording(engine) as recorders:
        assert len(engine.model.observers) == 1
        engine.reset()
        during = engine.eval(ids).clone()
    assert engine.model.ffns == ffns and not engine.model.observers
    assert torch.equal(before, during)
    assert int(recorders[0].counts.sum()) > 0


def test_train_predictor_cli(relu_model, tmp_path: Path):
    model, _ = relu_model
    (tmp_path / "c.txt").write_text(corpus(900, seed=1))
    out = tmp_path / "pred"
    result = runner.invoke(
        app,
        [
            "train-predictor",
            "-m",
            str(model),
            "-f",
            str(tmp_path / "c.txt"),
            "-o",
            str(out),
            "-c",
            "64",
            "--steps",
            "150",
            "--target-recall",
            "0.9",
            "-t",
            "1",
        ],
    )
    assert result.exit_code == 0, result.stderr
    summary = json.loads((out / "report.json").read_text())
    pred = load_predictor_folder(out)
    assert len(pred.fc1) == 2 and pred.fc1[0].shape == (32, 64) and pred.fc2[0].shape == (128, 32)
    assert pred.fc1[0].dtype == torch.float16 and pred.fc2[0].dtype == torch.float16
    state = torch.load(out / "model_1.pt", weights_only=True)
    assert sorted(state) == ["fc1.weight", "fc2.weight"]
    assert json.loads((out / "config.json").read_text())["sparse_threshold"] == pytest.approx(pred.threshold)
    # thresholds were calibrated per layer on the calibration windows: recall there reaches the target
    for m in summary["calibration"]:
        assert m["recall"] >= 0.9 - 2e-3
    for m in summary["test"]:
        assert m["recall"] > 0.7 and m["predicted_sparsity"] >= 0.0
    assert "recall" in result.stderr and json.loads(result.stdout)["rank"] == 32

    # the written folder is usable by the runtime: the engine's sparse FFN predicts what our scores say
    sd = random_llama_state(seed=3)
    preds = {
        f"blk.{i}.fc{j}.weight": getattr(pred, f"fc{j}")[i].float().numpy() for i in range(2) for j in (1, 2)
    }
    sparse_path = write_llama_gguf(
        tmp_path / "s.gguf",
        sd,
        n_head=N_HEAD,
        n_head_kv=N_HEAD,
        act="relu",
        predictors=preds,
        threshold=pred.threshold,
    )
    engine = Engine(sparse_path, EngineOptions(act_precision="f32", n_ctx=32))
    x = torch.randn(5, 64)
    active = engine.model.ffns[1].selector.select(x)
    assert torch.equal(active, pred.scores(1, x) >= pred.threshold)


def test_fold_thresholds_keeps_per_layer_decisions():
    rng = np.random.default_rng(0)
    fc2 = [torch.from_numpy(rng.normal(size=(16, 8))).float() for _ in range(4)]
    h = torch.from_numpy(np.abs(rng.normal(size=(50, 8)))).float()
    taus = [-0.7, -0.2, 0.3, -1.5]  # one layer of the other sign
    folded, t = fold_thresholds(fc2, taus)
    assert t < 0
    for layer, tau in enumerate(taus):
        want = h @ fc2[layer].T >= tau
        got = h @ folded[layer].T >= t
        if tau < 0:
            assert torch.equal(want, got)
        else:  # moved to the recall side: a superset of the wanted neurons
            assert bool((got | ~want).all())


def test_calibrate_threshold_reaches_target():
    scores = torch.linspace(-3, 3, 1000).reshape(100, 10)
    fired = scores > -1 + 0.3 * torch.randn(100, 10, generator=torch.Generator().manual_seed(0))
    tau = calibrate_threshold(scores, fired, 0.95)
    recall = float((fired & (scores >= tau)).sum() / fired.sum())
    assert 0.95 <= recall < 0.96


def assert_one_error_line(result, needle: str) -> None:
    assert result.exit_code == 1, (result.exit_code, result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_bad_input(relu_model, tmp_path: Path):
    model, _ = relu_model
    small = tmp_path / "small.txt"
    small.write_text("Hello world. " * 20)
    out = tmp_path / "pred"
    r = runner.invoke(app, ["train-predictor", "-m", str(model), "-f", str(small), "-o", str(out)])
    assert_one_error_line(r, "corpus too small")
    assert not out.exists()
    r = runner.invoke(
        app, ["train-predictor", "-m", str(model), "-f", str(tmp_path / "nope.txt"), "-o", str(out)]
    )
    assert_one_error_line(r, "no such file")
    r = runner.invoke(app, ["profile", "-m", str(model), "-f", str(tmp_path / "nope.txt"), "-o", str(out)])
    assert_one_error_line(r, "no such file")
    r = runner.invoke(
        app, ["profile", "-m", str(tmp_path / "missing.gguf"), "-f", str(small), "-o", str(out)]
    )
    assert r.exit_code == 1 and "error:" in r.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    r = runner.invoke(app, ["profile", "-m", str(model), "-f", str(empty), "-o", str(out)])
    assert_one_error_line(r, "is empty")
    assert not out.exists()
    # a SiLU model has no exactly-zero activations to count
    silu = write_llama_gguf(tmp_path / "silu.gguf", random_llama_state(), n_head=N_HEAD, n_head_kv=N_HEAD)
    r = runner.invoke(app, ["profile", "-m", str(silu), "-f", str(small), "-o", str(out)])
    assert_one_error_line(r, "ReLU")
    assert not out.exists()


def test_plot_curves(tmp_path: Path):
    pytest.importorskip("matplotlib")
    from powerinfer.profile import ActivationProfile, plot_curves

    counts = [np.arange(256, dtype=np.int64)[::-1] * (layer + 1) for layer in range(3)]
    profile = ActivationProfile(counts, n_tokens=1000)
    png = plot_curves(tmp_path / "curve.png", profile)
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # counts 255..0: the hottest k neurons cover sum of the top k; 80% needs k with cumulative share >= 0.8
    c = np.arange(256)[::-1]
    k = int(np.argmax(np.cumsum(c) >= 0.8 * c.sum())) + 1
    assert profile.hot_share(0.8)[0] == pytest.approx(k / 256)
    assert profile.sparsity()[0] == pytest.approx(1 - c.sum() / (1000 * 256))
