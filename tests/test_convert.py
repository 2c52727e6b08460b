"""`powerinfer convert`: fixture conversions equal the original converter's files; synthetic checkpoints check
the q/k permutation, ffn_down_t, GQA, sharding, bf16, the BPE vocabulary, and bad input."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    TINY_TOKENS,
    TINY_TYPES,
    assert_one_error_line,
    fixture_dir,
    permute_qk,
    random_llama_state,
)
from typer.testing import CliRunner

from powerinfer.arch.base import ACTIVATION_KEY
from powerinfer.cli import app
from powerinfer.convert import convert_hf_to_gguf
from powerinfer.errors import ConfigError, FormatError
from powerinfer.gguf import GGMLType, read_gguf
from powerinfer.quant import dequantize
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.tokenizer.spm_proto import spm_model_proto

runner = CliRunner()


def fixture() -> Path:
    return fixture_dir()  # skips, or fails when CI=true, without ../shared


def assert_same_gguf(ours: Path, reference: Path, ignore: tuple[str, ...] = (ACTIVATION_KEY,)) -> None:
    """Every KV (order, type, value) and tensor (type, shape, bytes) equal; `ignore`: keys extra in ours."""
    a, b = read_gguf(ours), read_gguf(reference)
    assert a.magic == b.magic and a.version == b.version
    keys = [k for k in a.metadata if k not in ignore]
    assert keys == list(b.metadata)
    for key in keys:
        assert a.value_types[key] == b.value_types[key], key
        assert a.array_types.get(key) == b.array_types.get(key), key
        va, vb = a.metadata[key], b.metadata[key]
        if isinstance(vb, np.ndarray):
            assert va.dtype == vb.dtype and np.array_equal(va, vb), key
        else:
            assert va == vb, key
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, t in b.tensors.items():
        u = a.tensors[name]
        assert (u.shape, u.ggml_type) == (t.shape, t.ggml_type), name
        assert np.array_equal(u.data, t.data), name


def test_fixture_powerinfer_matches_original(tmp_path: Path):
    f = fixture()
    out = convert_hf_to_gguf(f / "hf", tmp_path / "tiny.powerinfer.gguf", predictor_dir=f / "predictor")
    assert_same_gguf(out, f / "tiny.powerinfer.gguf")
    g = read_gguf(out)
    assert g.metadata[ACTIVATION_KEY] == "relu"  # config.json hidden_act; the original has no such key
    assert "blk.0.ffn_down.weight" not in g.tensors
    assert g.tensors["blk.0.ffn_down_t.weight"].shape == (512, 128)


def test_fixture_dense_matches_original(tmp_path: Path):
    f = fixture()
    out = tmp_path / "tiny.dense.gguf"
    result = runner.invoke(
        app, ["convert", str(f / "hf"), "--dense", "--outtype", "f16", "--outfile", str(out)]
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith(f"wrote {out}: dense GGUF, f16, 39 tensors, 19 KVs")
    assert_same_gguf(out, f / "tiny.dense.gguf")


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_fixture_outtypes_generate(tmp_path: Path, outtype: str):
    f = fixture()
    out = convert_hf_to_gguf(f / "hf", tmp_path / "m.gguf", predictor_dir=f / "predictor", outtype=outtype)
    g = read_gguf(out)
    matrix = GGMLType.F32 if outtype == "f32" else GGMLType.Q8_0
    assert (
        g.tensors["blk.1.fc2.weight"].ggml_type == matrix and g.tensors["output.weight"].ggml_type == matrix
    )
    assert g.tensors["blk.1.ffn_norm.weight"].ggml_type == GGMLType.F32
    assert g.metadata["general.file_type"] == {"f32": 0, "q8_0": 7}[outtype]
    # greedy ids of PowerInfer's own F16 run (-t 1, no repeat penalty): sparse mode on our file agrees
    case = json.loads((f / "expected.json").read_text())["generate_no_repeat_penalty_t1"]["f16"][0]
    engine = Engine(out, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2))
    assert engine.sparse_stats is not None
    logits, ids = engine.eval(case["prompt_ids"]), []
    for _ in range(12):
        ids.append(int(logits.argmax()))
        logits = engine.eval([ids[-1]])
    assert ids == case["generated_ids"][:12]


# ---- synthetic checkpoints (no fixture needed) ----


def write_hf_dir(
    folder: Path,
    sd: dict[str, np.ndarray],
    *,
    n_head: int,
    n_head_kv: int,
    act: str = "silu",
    **config: object,
) -> Path:
    """A HF Llama folder: model.safetensors (float16), config.json and a byte-level SentencePiece model."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    n_vocab, n_embd = sd["model.embed_tokens.weight"].shape
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": act,
        "hidden_size": n_embd,
        "intermediate_size": sd["model.layers.0.mlp.up_proj.weight"].shape[0],
        "vocab_size": n_vocab,
        "num_hidden_layers": sum(k.endswith("input_layernorm.weight") for k in sd),
        "rms_norm_eps": 1e-5,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        **config,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.astype(np.float16) for k, v in sd.items()}, str(folder / "model.safetensors"))
    pieces = [(t, 0.0, ty) for t, ty in zip(TINY_TOKENS, TINY_TYPES, strict=True)]
    (folder / "tokenizer.model").write_bytes(
        spm_model_proto(pieces, byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    )
    return folder


def write_predictors(
    folder: Path,
    n_layer: int,
    n_embd: int,
    n_ff: int,
    rank: int = 32,
    skip: int | None = None,
    threshold: float | None = 0.25,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(n_layer):
        if i != skip:
            torch.save(
                {
                    "fc1.weight": torch.randn(rank, n_embd, generator=gen).half(),
                    "fc2.weight": torch.randn(n_ff, rank, generator=gen).half(),
                },
                folder / f"model_{i}.pt",
            )
    if threshold is not None:
        (folder / "config.json").write_text(json.dumps({"sparse_threshold": threshold}))
    return folder


@pytest.fixture
def gqa(tmp_path: Path):
    sd = random_llama_state(n_head=4, n_head_kv=2)
    return sd, write_hf_dir(tmp_path / "hf", sd, n_head=4, n_head_kv=2, act="relu")


def test_synthetic_tensors_and_keys(gqa, tmp_path: Path):
    sd, hf = gqa
    pred = write_predictors(tmp_path / "pred", 2, 64, 128)
    g = read_gguf(convert_hf_to_gguf(hf, tmp_path / "m.gguf", predictor_dir=pred, outtype="f32"))
    assert g.magic == "PWRI"
    md = g.metadata
    assert md["general.name"] == "hf"
    assert (md["llama.attention.head_count_kv"], md["llama.rope.dimension_count"]) == (2, 16)
    assert md["powerinfer.sparse_threshold"] == 0.25 and md[ACTIVATION_KEY] == "relu"
    assert md["tokenizer.ggml.tokens"] == TINY_TOKENS and list(md["tokenizer.ggml.token_type"]) == TINY_TYPES

    def tensor(name: str) -> np.ndarray:
        t = g.tensors[name]
        return dequantize(t.data, t.ggml_type, t.shape)

    def hf_value(name: str) -> np.ndarray:
        return sd[name].astype(np.float16).astype(np.float32)

    p = "model.layers.1."
    assert np.array_equal(
        tensor("blk.1.attn_q.weight"), permute_qk(hf_value(p + "self_attn.q_proj.weight"), 4)
    )
    assert np.array_equal(
        tensor("blk.1.attn_k.weight"), permute_qk(hf_value(p + "self_attn.k_proj.weight"), 2)
    )
    assert np.array_equal(tensor("blk.1.attn_v.weight"), hf_value(p + "self_attn.v_proj.weight"))
    assert np.array_equal(tensor("blk.1.ffn_down_t.weight"), hf_value(p + "mlp.down_proj.weight").T)
    fc2 = torch.load(pred / "model_1.pt", weights_only=True)["fc2.weight"].float().numpy()
    assert np.array_equal(tensor("blk.1.fc2.weight"), fc2)


def test_synthetic_dense_matches_transformers(gqa, tmp_path: Path):
    """The converted GQA ReLU model run by our engine gives transformers' logits (permutation, activation)."""
    transformers = pytest.importorskip("transformers")
    _, hf = gqa
    out = convert_hf_to_gguf(hf, tmp_path / "m.gguf", outtype="f32")
    assert read_gguf(out).magic == "GGUF"
    model = transformers.LlamaForCausalLM.from_pretrained(hf, torch_dtype=torch.float32).eval()
    tokens = [1, 70, 80, 90, 100, 110, 120, 130]
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0, -1]
    got = Engine(out, EngineOptions(act_precision="f32", n_ctx=32, n_threads=2)).eval(tokens)
    assert torch.allclose(got.float(), want, atol=1e-3), (got - want).abs().max()


def test_sharded_bf16_checkpoint(tmp_path: Path):
    from safetensors.torch import save_file

    sd = random_llama_state(n_head=4, n_head_kv=4)
    ref = write_hf_dir(tmp_path / "ref", sd, n_head=4, n_head_kv=4)
    hf = tmp_path / "sharded"
    shutil.copytree(ref, hf)
    (hf / "model.safetensors").unlink()
    names = sorted(sd)
    weight_map = {}
    for shard, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file = f"model-{shard + 1:05d}-of-00002.safetensors"
        save_file({k: torch.from_numpy(sd[k]).to(torch.bfloat16) for k in part}, str(hf / file))
        weight_map.update(dict.fromkeys(part, file))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    g = read_gguf(convert_hf_to_gguf(hf, tmp_path / "m.gguf", outtype="f32"))
    t = g.tensors["blk.0.ffn_gate.weight"]
    want = torch.from_numpy(sd["model.layers.0.mlp.gate_proj.weight"]).to(torch.bfloat16).float().numpy()
    assert np.array_equal(dequantize(t.data, t.ggml_type, t.shape), want)
    assert len(g.tensors) == 3 + 2 * 9 and ACTIVATION_KEY not in g.metadata  # SiLU: no extra key


def test_bpe_tokenizer_json(gqa, tmp_path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    _, hf = gqa
    (hf / "tokenizer.model").unlink()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=len(TINY_TOKENS),
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "add_bos_token": False})
    )
    g = read_gguf(convert_hf_to_gguf(hf, tmp_path / "m.gguf", outtype="f16"))
    md = g.metadata
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "gpt2"
    assert md["tokenizer.ggml.eos_token_id"] == 0 and md["tokenizer.ggml.add_bos_token"] is False
    assert len(md["tokenizer.ggml.tokens"]) == len(TINY_TOKENS) and md["tokenizer.ggml.merges"]
    engine = Engine(tmp_path / "m.gguf", EngineOptions(act_precision="f32", n_ctx=32, n_threads=1))
    text = "the lazy fox"
    assert engine.tokenizer.encode(text, add_bos=False) == tok.encode(text).ids


# ---- bad input: one error line, exit code 1, no output file ----


def assert_fails(args: list[str], out: Path, *needles: str) -> None:
    result = runner.invoke(app, ["convert", *args, "--outfile", str(out)])
    assert_one_error_line(result, *needles)
    assert not out.exists() and list(out.parent.glob(".tmp-*")) == []


def test_bad_hf_folders(gqa, tmp_path: Path):
    _, hf = gqa
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    (hf / "model.safetensors").rename(tmp_path / "weights.safetensors")
    assert_fails([str(hf)], out, "no *.safetensors weights")
    (tmp_path / "weights.safetensors").rename(hf / "model.safetensors")
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    assert_fails([str(hf)], out, "unsupported architecture 'gpt_neox'")
    with pytest.raises(ConfigError, match="unsupported architecture"):
        convert_hf_to_gguf(hf, out)
    (hf / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    assert_fails([str(hf)], out, "mlp.gate_proj.weight", "expected (96, 64)")
    (hf / "config.json").unlink()
    assert_fails([str(hf)], out, "no config.json")
    assert_fails([str(tmp_path / "nowhere")], out, "does not exist")


def test_bad_predictor_folders(gqa, tmp_path: Path):
    _, hf = gqa
    out = tmp_path / "m.gguf"
    missing = write_predictors(tmp_path / "missing", 2, 64, 128, skip=1)
    assert_fails([str(hf), str(missing)], out, "model_1.pt")
    with pytest.raises(FormatError, match="model_1.pt"):
        convert_hf_to_gguf(hf, out, predictor_dir=missing)
    wrong = write_predictors(tmp_path / "wrong", 2, 64, 96)  # fc2 rows != n_ff
    assert_fails([str(hf), str(wrong)], out, "fc2.weight", "expected (128, 32)")
    transposed = write_predictors(tmp_path / "transposed", 2, 128, 64)  # fc1 (r, n_ff) instead of (r, n_embd)
    assert_fails([str(hf), str(transposed)], out, "fc1.weight", "expected (r, 64)")
    (tmp_path / "garbage").mkdir()
    for i in range(2):
        (tmp_path / "garbage" / f"model_{i}.pt").write_bytes(b"not a torch file")
    assert_fails([str(hf), str(tmp_path / "garbage")], out, "model_0.pt", "cannot read")
    assert_fails([str(hf), str(tmp_path / "wrong"), "--outtype", "q4_0"], out, "unsupported output type")


def test_index_shards_stay_inside_the_checkpoint_folder(gqa, tmp_path: Path):
    """A weight_map naming a file outside the folder (`..`, an absolute path, a subfolder, a link out of it) is
    refused before anything is opened; one error line, no output."""
    _, hf = gqa
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    outside = tmp_path / "outside.safetensors"
    shutil.copy(hf / "model.safetensors", outside)
    (hf / "link.safetensors").symlink_to(outside)
    index = hf / "model.safetensors.index.json"
    for name, needle in (
        ("../../../../etc/passwd", "is not a file of the folder"),
        (str(outside), "is not a file of the folder"),
        ("sub/model.safetensors", "is not a file of the folder"),
        ("link.safetensors", "leads out of the folder"),
        ("..", "is not a file of the folder"),
    ):
        index.write_text(json.dumps({"metadata": {}, "weight_map": {"model.embed_tokens.weight": name}}))
        assert_fails([str(hf)], out, needle)
    index.write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": 7}}))
    assert_fails([str(hf)], out, "must be file names")


def test_hostile_config_numbers_are_one_error(gqa, tmp_path: Path):
    """config.json numbers a hostile or broken file may hold: each one error line at once (a 2^40-layer config
    hung, string/list head counts and a non-object rope_scaling gave tracebacks, NaN eps and a 2^63 context were
    accepted)."""
    _, hf = gqa
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    cfg = json.loads((hf / "config.json").read_text())
    cases = [
        ({"num_hidden_layers": 1099511627776}, "'num_hidden_layers' = 1099511627776 is out of range"),
        ({"num_key_value_heads": "4"}, "'num_key_value_heads' must be a number"),
        ({"num_key_value_heads": [4]}, "'num_key_value_heads' must be a number"),
        ({"rope_scaling": "linear"}, "rope_scaling / rope_parameters must be objects"),
        ({"rope_scaling": {"type": "linear", "factor": "x"}}, "'factor' must be a number"),
        ({"rms_norm_eps": float("nan")}, "'rms_norm_eps' must be a number"),
        ({"rms_norm_eps": -1e-5}, "'rms_norm_eps' must be above 0"),
        (
            {"max_position_embeddings": 2**63},
            "'max_position_embeddings' = 9223372036854775808 is out of range",
        ),
        ({"rope_theta": float("inf")}, "'rope_theta' must be a number"),
        ({"hidden_act": ["silu"]}, "unsupported hidden_act"),
        ({"model_type": None, "architectures": [{"x": 1}]}, "unsupported architecture"),
    ]
    for change, needle in cases:
        (hf / "config.json").write_text(json.dumps({**cfg, **change}))
        t = time.perf_counter()
        assert_fails([str(hf)], out, needle)
        assert time.perf_counter() - t < 30, change
    (hf / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    assert_fails([str(hf)], out, "nested too deep")


def test_integer_tensors_are_refused(gqa, tmp_path: Path):
    from safetensors.numpy import load_file, save_file

    _, hf = gqa
    tensors = load_file(str(hf / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].astype(np.int16)
    save_file(tensors, str(hf / "model.safetensors"))
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    assert_fails([str(hf)], out, name, "I16, not a float type")
