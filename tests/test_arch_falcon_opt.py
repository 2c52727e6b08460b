"""Dense Falcon (40B-style grouped q/k/v with GQA, and 7B-style multi-query) and OPT: tiny random transformers
checkpoints converted by `powerinfer convert` run by our engine against transformers; the fixtures' byte-level BPE
tokenizers against transformers' tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import fixture_dir
from test_tokenizer import STRINGS, _random_strings

from powerinfer.convert import convert_checkpoint
from powerinfer.gguf import read_gguf
from powerinfer.quantize import QuantizeOptions, quantize_model, require_file_type
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
N_TOKENS = 24


def _config(kind: str):
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, bos_token_id=0, eos_token_id=0)
    if kind == "falcon-40b":  # grouped q/k/v, two LayerNorms per layer, GQA 4:2
        return transformers.FalconConfig(
            vocab_size=512, new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True, alibi=False,
            bias=False, activation="gelu", tie_word_embeddings=False, **common,
        )  # fmt: skip
    if kind == "falcon-7b":  # multi-query, one LayerNorm, tied output
        return transformers.FalconConfig(
            vocab_size=512, new_decoder_architecture=False, multi_query=True, parallel_attn=True, alibi=False,
            bias=False, activation="gelu", tie_word_embeddings=True, **common,
        )  # fmt: skip
    return transformers.OPTConfig(
        vocab_size=384, ffn_dim=160, word_embed_proj_dim=64, max_position_embeddings=64, do_layer_norm_before=True,
        activation_function="relu", enable_bias=True, tie_word_embeddings=True, bos_token_id=2, eos_token_id=2,
        pad_token_id=1, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    )  # fmt: skip


@pytest.fixture(scope="module", params=["falcon-40b", "falcon-7b", "opt"])
def checkpoint(request, tmp_path_factory) -> tuple[Path, object]:
    kind = request.param
    torch.manual_seed(7)
    config = _config(kind)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.uniform_(0.8, 1.2) if name.endswith("weight") else p.normal_(0, 0.05)
            else:
                p.normal_(0, 0.2 if name.endswith("bias") else 0.08)
            p.copy_(p.half().float())  # F16 files hold the weights exactly
    folder = tmp_path_factory.mktemp(kind)
    model.save_pretrained(folder)
    tok = fixture_dir("tiny-relu-falcon" if kind.startswith("falcon") else "tiny-relu-opt") / "hf"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, folder / name)
    return folder, model


# max abs logit difference against transformers, measured: F32 and F16 1.1e-6 to 1.3e-6 (falcon-40b, falcon-7b,
# opt) in all three modes; bound 1e-5. Q8_0 (our quantize of the F16 file) against the float model: measured
# 0.028 (opt) to 0.036 (falcon-40b); bound 0.1.
@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_logits_match_transformers(tmp_path, checkpoint, outtype):
    folder, model = checkpoint
    tokens = torch.randint(
        0, model.config.vocab_size, (N_TOKENS,), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        ref = model(tokens[None]).logits[0]
    path = convert_checkpoint(folder, tmp_path / "m.gguf", outtype="f32" if outtype == "f32" else "f16").path
    assert not read_gguf(path).is_sparse
    if outtype == "q8_0":
        q = tmp_path / "q8.gguf"
        quantize_model(QuantizeOptions(path, q, require_file_type("Q8_0"), n_threads=2))
        path = q
    bound = 0.1 if outtype == "q8_0" else 1e-5
    for n_batch in (512, 5):  # the prompt in one pass, then in chunks of 5
        engine = Engine(path, EngineOptions(n_ctx=64, n_batch=n_batch, n_threads=2, act_precision="f32"))
        diff = (engine.logits_all(tokens.tolist()) - ref).abs().max().item()
        assert diff <= bound, (n_batch, diff)
    engine = Engine(path, EngineOptions(n_ctx=64, n_threads=1, act_precision="f32"))
    step = torch.stack([engine.eval([t]) for t in tokens.tolist()])
    assert (step - ref).abs().max().item() <= bound


@pytest.mark.parametrize("fixture", ["tiny-relu-falcon", "tiny-relu-opt"])
def test_tokenizer_matches_transformers(fixture):
    """The PowerInfer file's vocabulary (GPT-2 regex, as PowerInfer splits) against transformers' tokenizer of
    the same tokenizer.json, on the fixed and 300 random strings; special-token text parsed in both."""
    f = fixture_dir(fixture)
    ours = Tokenizer.from_metadata(read_gguf(f / "tiny.powerinfer.gguf").metadata, powerinfer_file=True)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(f / "hf" / "tokenizer.json"))
    for s in STRINGS + _random_strings(300, seed=3):
        assert ours.encode(s, add_bos=False, parse_special=True) == theirs.encode(
            s, add_special_tokens=False
        ), s
