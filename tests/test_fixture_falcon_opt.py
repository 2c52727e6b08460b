"""PowerInfer's Falcon and OPT fixtures (../shared/fixtures/tiny-relu-{falcon,opt}, made by the original tools):
our converter's files, greedy text of main and the server, perplexity, the GPU index, and sparse against dense.

Greedy ids are compared exactly up to the first step where the fixture's torch re-statement of PowerInfer's sparse
graph (reference.json) has a top-2 logit margin below 0.05 (its README, section 7: ties that small flip with the
order of additions; F16 never reaches one on these prompts, Q4_0 does on one prompt per model).
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_one_error_line, fixture_dir
from test_cli_main import MAIN_FLAGS, accepted_continuations
from test_convert import assert_same_gguf
from typer.testing import CliRunner

from powerinfer.arch.base import ACTIVATION_KEY
from powerinfer.cli import app
from powerinfer.convert import convert_hf_to_gguf
from powerinfer.eval.perplexity import PerplexityOptions, perplexity
from powerinfer.gguf import read_gguf
from powerinfer.gguf.writer import GGUFWriter
from powerinfer.placement.gpu_index import GPUIndex, write_gpu_index
from powerinfer.placement.planner import select_gpu_neurons, solve_neuron_counts
from powerinfer.placement.stats import load_activation_stats
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sampling import Sampler, SamplingParams

FIXTURES = ("tiny-relu-falcon", "tiny-relu-opt")
MODELS = {"f16": "tiny.powerinfer.gguf", "q4_0": "tiny.q4.powerinfer.gguf"}
GPU_INDEX = "tiny.powerinfer.gguf.generated.gpuidx"
# the original solver's arguments (fixture READMEs, section 3): capacity in neurons, VRAM bytes, n_ff
SOLVER = {"tiny-relu-falcon": (820, 419840, 512), "tiny-relu-opt": (716, 320768, 448)}
NEAR_TIE = 0.05
runner = CliRunner()


@cache
def _json(fixture: str, name: str) -> dict:
    return json.loads((fixture_dir(fixture) / name).read_text())


def _engine(fixture: str, model: str, **kw) -> Engine:
    kw.setdefault("act_precision", "f32")
    return Engine(fixture_dir(fixture) / MODELS[model], EngineOptions(n_ctx=256, n_threads=1, **kw))


def _greedy(engine: Engine, ids: list[int], n: int) -> list[int]:
    engine.reset()
    return list(engine.generate(ids, Sampler(SamplingParams(temp=0, repeat_penalty=1.0)), n_predict=n))


def _trusted_prefix(fixture: str, model: str, prompt_index: int) -> int:
    """Steps before the reference's first top-2 margin below NEAR_TIE (all 24 when there is none)."""
    ref = _json(fixture, "reference.json")["generation"][prompt_index][f"sparse_ref_{model}"]
    margins = ref["top2_logit_margin_no_penalty"]
    return next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))


@pytest.mark.parametrize("fixture", FIXTURES)
def test_converter_equals_the_original(tmp_path, fixture):
    """Every key (order, type, value) and tensor (type, shape, bytes) of the original converter's F16 file; ours
    has no extra key (PowerInfer files carry no tokenizer.ggml.pre: our reader then splits with the GPT-2 regex)."""
    f = fixture_dir(fixture)
    out = convert_hf_to_gguf(f / "hf", tmp_path / "m.gguf", predictor_dir=f / "predictor")
    assert_same_gguf(out, f / MODELS["f16"], ignore=())


@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("fixture", FIXTURES)
def test_main_greedy_equals_the_original(fixture, model, act):
    """`main -t 1 --repeat-penalty 1.0` of the original: our prompt ids (no BOS for these BPE vocabularies, as
    PowerInfer's main) and 24 greedy ids, on the CPU and with the original GPU index's neurons in a CPU pool, with
    float activations and in the default precision q8 (int8 activation blocks, as the original's Q4_0 matmuls)."""
    f = fixture_dir(fixture)
    cases = _json(fixture, "expected.json")["generate_no_repeat_penalty_t1"][model]
    for split in (False, True):
        extra = {"pool_device": "cpu", "gpu_index_path": str(f / GPU_INDEX)} if split else {}
        engine = _engine(fixture, model, act_precision=act, **extra)
        for i, case in enumerate(cases):
            ids = engine.tokenizer.encode(case["prompt"], add_bos=None)
            assert ids == case["prompt_ids"]
            # F16: all 24 ids on every prompt (measured; the reference's margins dip to 0.0087 there, yet no flip)
            n = 24 if model == "f16" else _trusted_prefix(fixture, model, i)
            assert _greedy(engine, ids, 24)[:n] == case["generated_ids"][:n], (fixture, model, split, i)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_main_cli_text(fixture):
    """The CLI end to end on the F16 file: the original's generated text for its first prompt (pure greedy)."""
    f = fixture_dir(fixture)
    case = _json(fixture, "expected.json")["generate_no_repeat_penalty_t1"]["f16"][0]
    args = ["main", "-m", str(f / MODELS["f16"]), "-p", case["prompt"], "-n", "24", "--temp", "0"]
    r = runner.invoke(app, [*args, "--repeat-penalty", "1.0", "-t", "1", "--seed", "42"])
    assert r.exit_code == 0, r.output
    assert case["prompt"] + case["generated"]["text"] in r.stdout


@pytest.mark.parametrize("flags", list(MAIN_FLAGS))
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("fixture", FIXTURES)
def test_main_cli_default_precision_equals_the_original(fixture, model, flags):
    """`powerinfer main` with the original's flags and no --act-precision (the default, q8): the original -t 1
    stdout for every prompt, with the default repeat penalty 1.1 and with 1.0, up to the README's near-tie rule
    (a continuation that leaves the original's only where the torch re-statement's top-2 margin is below 0.05).
    Measured: 23 of 24 cases print the original's own stdout; Falcon Q4_0 'Hello world' (penalty 1.1) leaves it at
    step 17, a near-tie (margin 0.015), in f32 too. (f32: 22 of 24, OPT Q4_0 also leaving at a 0.011 margin.)"""
    f = fixture_dir(fixture)
    expected, reference = _json(fixture, "expected.json"), _json(fixture, "reference.json")
    extra, t1_key, _, _ = MAIN_FLAGS[flags]
    tok = _engine(fixture, model).tokenizer
    for i, case in enumerate(expected[t1_key][model]):
        prompt = case["prompt"]
        branches = accepted_continuations(expected, reference, model, flags, i)
        texts = [prompt + tok.decode(ids, strip_leading_space=False) for ids in branches]
        assert texts[0] == case["stdout"]["text"]
        args = ["main", "-m", str(f / MODELS[model]), "-p", prompt, "-n", "24", "--temp", "0", "--top-k", "1"]
        r = runner.invoke(app, [*args, "--seed", "42", "--ignore-eos", "-t", "1", *extra])
        assert r.exit_code == 0, r.output
        assert r.stdout.removesuffix("\n") in texts, (fixture, model, flags, prompt, r.stdout, texts)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("fixture", FIXTURES)
@pytest.mark.parametrize("act", ["f32", "q8"])
def test_server_greedy_equals_the_original(fixture, model, act):
    """The original -t 1 server's pure-greedy /completion texts (BOS + prompt, 9 tokens emitted), in both
    activation precisions."""
    engine = _engine(fixture, model, act_precision=act)
    tok = engine.tokenizer
    refs = [
        r
        for r in _json(fixture, "reference.json")["server_completion_vs_t1"]
        if r["model"] == model and r["kind"] == "completion_stream_no_penalty"
    ]
    for case, ref in zip(
        _json(fixture, "expected.json")["server_t1"][model]["completion_stream_no_penalty"], refs, strict=True
    ):
        assert ref["prompt"] == case["request"]["prompt"]
        ids = [tok.bos_id] + tok.encode(case["request"]["prompt"], add_bos=False)
        pieces = [tok.decode([t], strip_leading_space=False) for t in _greedy(engine, ids, 9)]
        theirs = [step["content"] for step in case["completion_probabilities"]]
        assert "".join(theirs) == case["content"]
        # F16: all 9 (measured on every prompt); Q4_0: up to the first near-tie of the reference (falcon's
        # 'The quick brown fox' step 1: 'k' 0.2397 against 'es' 0.2324 in the original's own probabilities)
        margins = [step["top2_logit_margin"] for step in ref["steps"]]
        n = 9 if model == "f16" else next((i for i, m in enumerate(margins) if m < NEAR_TIE), 9)
        assert pieces[:n] == theirs[:n], (fixture, model, case["request"]["prompt"])


# original -t 1 finals: falcon f16 20.999, q4_0 21.4194; opt f16 25.0086, q4_0 25.7127. Ours, measured: falcon
# 20.9989 / 21.4263 (3.2e-4 relative), opt 25.0089 / 25.7152 (1.0e-4; OPT's LayerNorm epsilon is 1e-5 here, 0 in
# PowerInfer: its README, 8.6b); in q8 the F16 files give the same and the Q4_0 files 21.4296 (4.8e-4) and 25.7255
# (5.0e-4). Bound: the 1e-3 relative.
@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("fixture", FIXTURES)
def test_perplexity_within_1e3_of_the_original(fixture, model, act):
    e = _json(fixture, "expected.json")
    engine = _engine(fixture, model, act_precision=act)
    result = perplexity(engine, e["perplexity_tokens"], PerplexityOptions(n_ctx=64))
    theirs = e["perplexity_t1"][model]["final_ppl"]
    assert abs(result.ppl / theirs - 1) < 1e-3


@pytest.mark.parametrize("fixture", FIXTURES)
def test_gpu_index_byte_identical(tmp_path, fixture):
    """The original solver's index from the same activation statistics and capacity, byte for byte."""
    capacity, vram, n_ff = SOLVER[fixture]
    f = fixture_dir(fixture)
    stats = load_activation_stats(f / "activation", 4, n_ff)
    counts = solve_neuron_counts(stats, capacity, 64)
    index = GPUIndex.from_neurons(select_gpu_neurons(stats, counts), n_ff, vram)
    write_gpu_index(tmp_path / GPU_INDEX, index, stamp=False)  # the stamp's two keys: ours, not PowerInfer's
    assert (tmp_path / GPU_INDEX).read_bytes() == (f / GPU_INDEX).read_bytes()


@pytest.mark.parametrize("fixture", FIXTURES)
def test_sparse_all_active_equals_dense(monkeypatch, fixture):
    """Threshold -inf (every neuron active) through the sparse FFN equals the dense FFN of the same file, and the
    split placement equals the all-CPU logits (max abs difference measured 0; bound 1e-4)."""
    tokens = _json(fixture, "expected.json")["perplexity_tokens"][:40]
    dense = _engine(fixture, "f16", act_precision="f32", dense_ffn=True).logits_all(tokens)
    monkeypatch.setenv("LLAMA_SPARSE_PRED_THRESHOLD", "-inf")
    sparse = _engine(fixture, "f16", act_precision="f32").logits_all(tokens)
    assert (sparse - dense).abs().max().item() <= 1e-4
    monkeypatch.delenv("LLAMA_SPARSE_PRED_THRESHOLD")
    cpu = _engine(fixture, "f16", act_precision="f32")
    split = _engine(
        fixture,
        "f16",
        act_precision="f32",
        pool_device="cpu",
        gpu_index_path=str(fixture_dir(fixture) / GPU_INDEX),
    )
    a, b = cpu.logits_all(tokens), split.logits_all(tokens)
    assert (a - b).abs().max().item() <= 1e-4
    assert not torch.equal(a, dense)  # the predictor skips neurons: sparse is not the dense run


@pytest.mark.parametrize("fixture", FIXTURES)
def test_tokenizer_equals_the_original_server(fixture):
    engine = _engine(fixture, "f16")
    for case in _json(fixture, "expected.json")["tokenize"]["cases"]:
        assert engine.tokenizer.encode(case["content"], add_bos=False, parse_special=False) == case["tokens"]


@pytest.mark.parametrize("fixture", FIXTURES)
def test_profile_train_predictor_and_convert(tmp_path, fixture):
    """profile and train-predictor on the original's F16 file, then our converter with the new predictors: a
    sparse file that runs. The trained predictors' held-out recall: measured 0.95 (falcon, opt; 30 steps); the
    calibrated threshold targets 0.95 by default, bound 0.9."""
    f = fixture_dir(fixture)
    text = tmp_path / "text.txt"
    text.write_text(2 * (f / "text.txt").read_text())  # train-predictor wants >= 2048 tokens
    model = str(f / MODELS["f16"])
    common = ["-m", model, "-f", str(text), "-c", "64", "-t", "2"]
    r = runner.invoke(app, ["profile", *common, "-o", str(tmp_path / "prof"), "--no-plot"])
    assert r.exit_code == 0, r.output
    counts = torch.load(tmp_path / "prof" / "activation" / "activation_0.pt")
    assert (
        counts.shape == (SOLVER[fixture][2],) and counts[:32].sum() == 0
    )  # neurons 0..31 are dead (README 2)
    r = runner.invoke(app, ["train-predictor", *common, "-o", str(tmp_path / "pred"), "--steps", "30"])
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "pred" / "report.json").read_text())
    assert report["mean_recall"] > 0.9, report
    out = convert_hf_to_gguf(f / "hf", tmp_path / "m.gguf", predictor_dir=tmp_path / "pred")
    engine = Engine(out, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2))
    assert engine.sparse_stats is not None
    assert torch.isfinite(engine.logits_all(_json(fixture, "expected.json")["perplexity_tokens"][:32])).all()


def _without(src: Path, dst: Path, drop: str) -> Path:
    """A copy of a GGUF file without one tensor."""
    g = read_gguf(src)
    w = GGUFWriter(dst, sparse=g.is_sparse)
    for key, value in g.metadata.items():
        w.add(key, value, g.value_types[key], g.array_types.get(key))
    for name, t in g.tensors.items():
        if name != drop:
            w.add_tensor(name, np.asarray(t.data).view(np.uint8).reshape(-1), t.ggml_type, t.shape)
    w.write()
    return dst


@pytest.mark.parametrize(
    ("fixture", "drop"),
    [("tiny-relu-falcon", "blk.2.attn_qkv.weight"), ("tiny-relu-opt", "blk.1.ffn_down_t.bias")],
)
def test_missing_tensor_is_one_error_line(tmp_path, fixture, drop):
    bad = _without(fixture_dir(fixture) / MODELS["f16"], tmp_path / "bad.gguf", drop)
    r = runner.invoke(app, ["main", "-m", str(bad), "-p", "x", "-n", "1"])
    assert_one_error_line(r, f"missing required tensor '{drop}'")


def test_refinedweb_config_converts_alike(tmp_path):
    """The same Falcon checkpoint described by an original RWForCausalLM config.json (model_type RefinedWeb, its
    own key names): the same file as the original converter's (which fails on it, README 8.6b)."""
    f = fixture_dir("tiny-relu-falcon")
    hf = tmp_path / "hf"
    shutil.copytree(f / "hf", hf)
    config = json.loads((hf / "config.json").read_text())
    config = {
        "architectures": ["RWForCausalLM"], "model_type": "RefinedWeb", "n_embed": config["hidden_size"],
        "n_head": config["num_attention_heads"], "n_head_kv": config["num_kv_heads"],
        "n_layer": config["num_hidden_layers"], "vocab_size": config["vocab_size"], "alibi": False, "bias": False,
        "parallel_attn": True, "layer_norm_epsilon": 1e-5, "bos_token_id": 0, "eos_token_id": 0, "activation": "relu",
    }  # fmt: skip
    (hf / "config.json").write_text(json.dumps(config))
    out = convert_hf_to_gguf(hf, tmp_path / "m.gguf", predictor_dir=f / "predictor")
    assert_same_gguf(out, f / MODELS["f16"], ignore=(ACTIVATION_KEY,))
