"""scripts/make_synthetic_model.py: the tiny shape is a valid PowerInfer model, sparse at the asked share."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from powerinfer.gguf import GGMLType
from powerinfer.gguf.reader import read_gguf
from powerinfer.runtime.engine import Engine, EngineOptions
from tests.conftest import load_script

REPO = Path(__file__).resolve().parents[1]
ACTIVE = 0.10
N_SAMPLE = 128


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    mod = load_script("make_synthetic_model")
    out = tmp_path_factory.mktemp("synthetic")
    summary = mod.generate(out, mod.SHAPES["tiny"], ["f16", "q4_0"], ACTIVE, seed=0, n_sample=N_SAMPLE)
    return mod, out, summary


def _paths(synthetic) -> dict[str, Path]:
    mod, out, _ = synthetic
    shape = mod.SHAPES["tiny"]
    return {kind: out / mod.model_filename(shape, kind) for kind in ("f16", "q4_0")}


@pytest.mark.parametrize("kind", ["f16", "q4_0"])
def test_file_is_pwri_with_sparse_tensors(synthetic, kind):
    mod, _, summary = synthetic
    s = mod.SHAPES["tiny"]
    path = _paths(synthetic)[kind]
    names = {"f16": "synthetic-tiny.powerinfer.gguf", "q4_0": "synthetic-tiny.q4.powerinfer.gguf"}
    assert path.name == names[kind]
    assert path.read_bytes()[:4] == b"PWRI"
    g = read_gguf(path)
    assert g.is_sparse
    md = g.metadata
    assert md["general.architecture"] == "llama"
    assert md["llama.embedding_length"] == s.n_embd and md["llama.feed_forward_length"] == s.n_ff
    assert md["llama.block_count"] == s.n_layer and md["llama.attention.head_count_kv"] == s.n_head_kv
    assert md["powerinfer.sparse_threshold"] == pytest.approx(summary["threshold"])
    assert md["general.file_type"] == (1 if kind == "f16" else 2)
    tokens = md["tokenizer.ggml.tokens"]
    assert md["tokenizer.ggml.model"] == "llama" and len(tokens) == s.n_vocab
    assert list(tokens[:3]) == ["<unk>", "<s>", "</s>"] and tokens[3] == "<0x00>" and tokens[258] == "<0xFF>"
    assert len(set(tokens)) == len(tokens)

    t = g.tensors
    assert 3 + 11 * s.n_layer == len(t)
    matrix_type = GGMLType.F16 if kind == "f16" else GGMLType.Q4_0
    assert t["token_embd.weight"].ggml_type == matrix_type
    assert t["output.weight"].ggml_type == (GGMLType.F16 if kind == "f16" else GGMLType.Q8_0)
    assert t["output_norm.weight"].ggml_type == GGMLType.F32
    for bid in range(s.n_layer):
        p = f"blk.{bid}."
        assert p + "ffn_down.weight" not in t
        assert t[p + "ffn_down_t.weight"].shape == (s.n_ff, s.n_embd)
        assert t[p + "ffn_gate.weight"].shape == (s.n_ff, s.n_embd)
        assert t[p + "fc1.weight"].shape == (s.rank, s.n_embd)
        assert t[p + "fc2.weight"].shape == (s.n_ff, s.rank)
        for name in ("fc1", "fc2", "ffn_down_t", "ffn_up", "attn_q", "attn_k"):
            assert t[p + name + ".weight"].ggml_type == matrix_type
        assert t[p + "attn_k.weight"].shape == (s.n_embd_gqa, s.n_embd)
        assert t[p + "ffn_norm.weight"].ggml_type == GGMLType.F32


@pytest.mark.parametrize("kind", ["f16", "q4_0"])
def test_engine_runs_sparse_at_requested_share(synthetic, kind):
    path = _paths(synthetic)[kind]
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=128, n_threads=2))
    assert engine.sparse_stats is not None  # sparse mode
    c = engine.config
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_bos=True)
    token = int(engine.eval(prompt).argmax())
    stats = engine.sparse_stats
    active0, tokens0 = stats.active.copy(), stats.tokens.copy()
    generated = []
    for _ in range(48):  # greedy generation
        logits = engine.eval([token])
        assert torch.isfinite(logits).all()
        token = int(logits.argmax())
        generated.append(token)
    share = (stats.active - active0).sum().item() / ((stats.tokens - tokens0).sum().item() * c.n_ff)
    assert share == pytest.approx(ACTIVE, abs=0.03)
    assert len(set(generated)) > 4  # a plausible model, not a constant output

    dense = Engine(path, EngineOptions(act_precision="f32", n_ctx=128, n_threads=2, dense_ffn=True))
    assert dense.sparse_stats is None
    assert torch.isfinite(dense.eval(prompt)).all()


def test_calibration_summary(synthetic):
    _, _, summary = synthetic
    assert summary["active"] == pytest.approx(ACTIVE, abs=0.005)  # the quantile is taken on this very sample
    assert summary["active_q4"] == pytest.approx(ACTIVE, abs=0.02)
    assert summary["threshold"] > 0


def test_activation_files(synthetic):
    mod, out, summary = synthetic
    s = mod.SHAPES["tiny"]
    for bid in range(s.n_layer):
        counts = torch.load(out / "activation" / f"activation_{bid}.pt", weights_only=True)
        assert counts.dim() == 1 and counts.numel() == s.n_ff and counts.dtype == torch.float32
        assert counts.min() >= 0 and counts.max() <= N_SAMPLE
        assert counts.sum().item() == pytest.approx(summary["layers"][bid]["active"] * N_SAMPLE * s.n_ff)
        top = torch.sort(counts, descending=True).values[: s.n_ff // 5].sum() / counts.sum()
        assert top > 0.4  # hot neurons exist: the top 20% fire far more than 20% of the time


def test_cli_is_deterministic_and_types_are_independent(synthetic, tmp_path):
    mod, _, _ = synthetic
    assert (
        mod.main(
            [
                "--out",
                str(tmp_path),
                "--shape",
                "tiny",
                "--types",
                "q4_0",
                "--seed",
                "0",
                "--active",
                str(ACTIVE),
                "-q",
            ]
        )
        == 0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["activation", "synthetic-tiny.q4.powerinfer.gguf"]

    def digest(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest()

    ref = _paths(synthetic)["q4_0"]
    assert digest(tmp_path / ref.name) == digest(ref)
    a = torch.load(tmp_path / "activation" / "activation_0.pt", weights_only=True)
    b = torch.load(ref.parent / "activation" / "activation_0.pt", weights_only=True)
    assert torch.equal(a, b)


def test_vocabulary_pieces_are_unique():
    mod = load_script("make_synthetic_model")
    tokens, scores, types = mod.vocabulary(32000)
    assert len(tokens) == len(set(tokens)) == 32000
    assert types[0] == 2 and list(types[1:3]) == [3, 3]
    assert (types[3:259] == 6).all() and (types[259:] == 1).all()
    assert np.all(np.diff(scores[259:]) < 0)
