"""Gemma 3 and Phi-3: tiny random transformers checkpoints through `powerinfer convert`, then logits against
transformers (prefill, chunked prefill, decode past the sliding window; F32, F16, Q8_0), the Gemma-style
SentencePiece tokenizer against transformers' GemmaTokenizer, sparsify at zero sparsity, the CPU pool, bad input."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_one_error_line
from test_sparsify import calibration_text, sparsify
from test_tokenizer import STRINGS, _random_strings
from typer.testing import CliRunner

from powerinfer.cli import app
from powerinfer.gguf import GGUFWriter, read_gguf
from powerinfer.quantize import QuantizeOptions, quantize_model, require_file_type
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")
runner = CliRunner()

N_VOCAB, WINDOW, N_TOKENS = 400, 8, 24
# Gemma's special ids: pad 0, eos 1, bos 2, unk 3
SPECIALS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}


def train_tokenizer(folder: Path) -> Path:
    """A Gemma-style SentencePiece BPE model (byte fallback, no dummy prefix, digits split, whitespace kept)."""
    prose = (Path(__file__).parent / "data" / "python-reference-prose.txt").read_text(encoding="utf-8")
    lines = [ln for ln in prose[:60000].splitlines() if ln.strip()] + STRINGS
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        vocab_size=N_VOCAB,
        model_type="bpe",
        byte_fallback=True,
        add_dummy_prefix=False,
        split_digits=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        allow_whitespace_only_pieces=True,
        character_coverage=0.995,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        minloglevel=2,
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.model"
    path.write_bytes(buf.getvalue())
    return path


@pytest.fixture(scope="module")
def tokenizer_model(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("spm"))


def randomize(model, fp16: bool, norm_low: float, norm_high: float, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(norm_low, norm_high)
            else:
                p.normal_(0, 0.08)
            if fp16:
                p.copy_(p.half().float())


def tiny_gemma3(fp16: bool = False, seed: int = 0, query_pre_attn_scalar: int = 32):
    cfg = transformers.Gemma3TextConfig(
        vocab_size=N_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,  # layers 0-4 slide, layer 5 is global
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # not hidden_size / heads
        query_pre_attn_scalar=query_pre_attn_scalar,
        sliding_window=WINDOW,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        tie_word_embeddings=True,
        **SPECIALS,
    )
    model = transformers.Gemma3ForCausalLM(cfg).float().eval()
    randomize(model, fp16, -0.2, 0.2, seed)  # Gemma's norms scale by 1 + w
    return model


def tiny_phi3(fp16: bool = False, seed: int = 0):
    cfg = transformers.Phi3Config(
        vocab_size=N_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        partial_rotary_factor=0.5,  # RoPE on 8 of 16 dimensions
        sliding_window=WINDOW,
        max_position_embeddings=128,
        original_max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **SPECIALS,
    )
    model = transformers.Phi3ForCausalLM(cfg).float().eval()
    randomize(model, fp16, 0.8, 1.2, seed)
    return model


def hf_folder(model, folder: Path, tokenizer_model: Path) -> Path:
    model.save_pretrained(folder)
    (folder / "tokenizer.model").write_bytes(tokenizer_model.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return folder


def convert(folder: Path, out: Path, outtype: str = "f32") -> Path:
    r = runner.invoke(app, ["convert", str(folder), "--outfile", str(out), "--outtype", outtype])
    assert r.exit_code == 0, r.stderr
    return out


def copy_gguf(
    src: Path, dst: Path, skip_keys: tuple[str, ...] = (), skip_tensors: tuple[str, ...] = ()
) -> Path:
    """A copy of a GGUF file without some metadata keys or tensors."""
    model = read_gguf(src)
    w = GGUFWriter(dst)
    model.copy_metadata(w, frozenset(skip_keys))
    for t in model.tensors.values():
        if t.name not in skip_tensors:
            w.add_tensor(t.name, t.data, t.ggml_type, t.shape)
    w.write()
    return dst


MAKERS = {"gemma3": tiny_gemma3, "phi3": tiny_phi3}


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_model) -> dict[tuple[str, str], tuple[object, Path]]:
    """(arch, type) -> (transformers model, its GGUF): F32 and Q8_0 (our quantize of the F32 file) of one random
    model, F16 of another whose weights are float16 values."""
    root = tmp_path_factory.mktemp("models")
    out: dict[tuple[str, str], tuple[object, Path]] = {}
    for arch, make in MAKERS.items():
        hf = make(seed=1)
        f32 = convert(hf_folder(hf, root / arch, tokenizer_model), root / f"{arch}.f32.gguf")
        out[arch, "f32"] = hf, f32
        q8 = root / f"{arch}.q8_0.gguf"
        quantize_model(QuantizeOptions(f32, q8, require_file_type("Q8_0"), n_threads=2))
        out[arch, "q8_0"] = hf, q8
        hf16 = make(fp16=True, seed=2)
        out[arch, "f16"] = (
            hf16,
            convert(hf_folder(hf16, root / f"{arch}16", tokenizer_model), root / f"{arch}.f16.gguf", "f16"),
        )
    return out


def reference(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


TOKENS = torch.randint(0, N_VOCAB, (N_TOKENS,), generator=torch.Generator().manual_seed(7)).tolist()
# max abs logit difference to transformers per type (logits up to ~8 in magnitude): F32 and F16 (float16-valued
# weights) measured 1.3e-6 .. 3.7e-6 in all three modes; Q8_0 (weights and, in the kernels, activations in int8
# blocks) measured 0.084 (gemma3) and 0.077 (phi3), the same in all three modes
BOUNDS = {"f32": 1e-4, "f16": 1e-4, "q8_0": 0.25}


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_logits_match_transformers(models, arch, dtype):
    hf, path = models[arch, dtype]
    assert read_gguf(path).metadata["general.architecture"] == arch
    ref = reference(hf, TOKENS)
    diffs = {}
    for n_batch in (512, 5):  # one prefill pass, then chunks of 5 (chunks start past the window)
        engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_batch=n_batch, n_threads=2))
        diffs[n_batch] = (engine.logits_all(TOKENS) - ref).abs().max().item()
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1))
    step = torch.stack([engine.eval([t]) for t in TOKENS])
    diffs["decode"] = (step - ref).abs().max().item()
    assert max(diffs.values()) <= BOUNDS[dtype], diffs


@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_sliding_window_matters(models, arch, tmp_path):
    # without the window key every layer sees every position: past the window the logits move away from
    # transformers' (by ~1), so the test above holds the window to account (gemma3 also turns its local layers
    # global, with the global RoPE, so it differs from the second position on)
    hf, path = models[arch, "f32"]
    key = f"{arch}.attention.sliding_window"
    wide = copy_gguf(path, tmp_path / "wide.gguf", skip_keys=(key,))
    ref = reference(hf, TOKENS)
    ours = Engine(wide, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2)).logits_all(TOKENS)
    if arch == "phi3":
        assert (ours[:WINDOW] - ref[:WINDOW]).abs().max() <= 1e-4
    assert (ours[WINDOW:] - ref[WINDOW:]).abs().max() > 1e-2


def test_converted_layout(models):
    g = read_gguf(models["gemma3", "f32"][1])
    md, tensors = g.metadata, g.tensors
    assert md["gemma3.attention.key_length"] == md["gemma3.attention.value_length"] == 32
    assert md["gemma3.attention.sliding_window"] == WINDOW and md["gemma3.rope.freq_base"] == 1e6
    assert (md["gemma3.rope.scaling.type"], md["gemma3.rope.scaling.factor"]) == ("linear", 2.0)
    assert "gemma3.attention.scale" not in md  # query_pre_attn_scalar == head_dim: llama.cpp's own scale
    assert (
        md["tokenizer.ggml.add_space_prefix"] is False and md["tokenizer.chat_template"] == "{{ messages }}"
    )
    assert "output.weight" not in tensors  # tied
    hf = models["gemma3", "f32"][0]
    norm = hf.model.layers[0].post_feedforward_layernorm.weight.detach().numpy()
    assert np.array_equal(tensors["blk.0.post_ffw_norm.weight"].data.view(np.float32), norm + 1)  # (1 + w)
    p = read_gguf(models["phi3", "f32"][1])
    assert (
        p.metadata["phi3.rope.dimension_count"] == 8 and p.metadata["phi3.attention.sliding_window"] == WINDOW
    )
    assert p.tensors["blk.0.attn_qkv.weight"].shape == (64 + 2 * 32, 64)  # (rows, n_embd)
    assert (
        p.tensors["blk.0.ffn_up.weight"].shape == (2 * 128, 64) and "blk.0.ffn_gate.weight" not in p.tensors
    )


def gemma_tokenizer(model_path: Path):
    """transformers' GemmaTokenizer over the SentencePiece model's pieces, with the merges its BPE implies (each
    piece from its two-piece splits, ranked by the piece's id, as transformers' SentencePieceExtractor does;
    protobuf, which that extractor needs, is not a dependency here)."""
    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    vocab = {sp.id_to_piece(i): i for i in range(sp.vocab_size())}
    merges = []
    for piece, pid in vocab.items():
        if sp.is_control(pid) or sp.is_byte(pid) or sp.is_unknown(pid):
            continue
        merges += [(pid, vocab[piece[:k]], piece[:k], piece[k:]) for k in range(1, len(piece))
                   if piece[:k] in vocab and piece[k:] in vocab]  # fmt: skip
    merges.sort()
    return transformers.GemmaTokenizer(vocab=vocab, merges=[(a, b) for *_, a, b in merges])


def test_tokenizer_matches_transformers(models, tokenizer_model):
    tok = Tokenizer.from_metadata(read_gguf(models["gemma3", "f32"][1]).metadata)
    assert (tok.add_space_prefix, tok.add_bos, tok.bos_id, tok.eos_id) == (False, True, 2, 1)
    oracle = gemma_tokenizer(tokenizer_model)
    for s in STRINGS + _random_strings(300, seed=3):
        assert tok.encode(s, add_bos=False) == oracle(s, add_special_tokens=False)["input_ids"], repr(s)
    assert tok.encode("Hello")[0] == 2


@pytest.mark.parametrize(
    ("arch", "budget"), [("gemma3", 0.001), ("phi3", 0.0004)]
)  # GiB: some neurons in the pool
def test_sparsify_dense_and_cpu_pool(models, arch, budget, tmp_path):
    # sparsity 0: every threshold 0, so every neuron with a nonzero activation runs: the dense logits
    dense = models[arch, "f32"][1]
    out = tmp_path / f"{arch}.cats.gguf"
    text = calibration_text(tmp_path, 1500)
    r = sparsify("-m", str(dense), "-f", str(text), "--sparsity", "0", "-o", str(out), "-c", "128")
    assert r.exit_code == 0, r.stderr
    assert "blk.0.ffn_down_t.weight" in read_gguf(out).tensors
    want = Engine(dense, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2)).logits_all(TOKENS)
    # the dense file with every layer on the CPU stand-in (phi3: halves of ffn_up as DeviceWeight rows)
    offload = Engine(
        dense, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2, pool_device="cpu", n_gpu_layers=99)
    )
    assert (offload.logits_all(TOKENS) - want).abs().max() <= 1e-4  # measured 0.0
    cpu = Engine(out, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2))
    assert cpu.sparse_stats is not None
    got = cpu.logits_all(TOKENS)
    assert (got - want).abs().max() <= 1e-4  # measured 1.3e-6 (gemma3), 8.9e-7 (phi3)
    # the CPU standing in for the pool device, with some neurons there: the all-CPU logits
    pool = Engine(
        out,
        EngineOptions(act_precision="f32", n_ctx=64, n_threads=2, pool_device="cpu", vram_budget_gib=budget),
    )
    n_pool = sum(hot.ids.numel() for hot in pool.loader.hot)
    assert 0 < n_pool < pool.config.n_layer * pool.config.n_ff, n_pool  # a split
    pooled = pool.logits_all(TOKENS)
    assert (pooled - got).abs().max() <= 1e-4  # measured 8.3e-7 (gemma3), 3.6e-7 (phi3)


def test_missing_post_ffw_norm(models, tmp_path):
    bad = copy_gguf(
        models["gemma3", "f32"][1], tmp_path / "bad.gguf", skip_tensors=("blk.0.post_ffw_norm.weight",)
    )
    r = runner.invoke(app, ["main", "-m", str(bad), "-p", "hi", "-n", "1"])
    assert_one_error_line(r, "blk.0.post_ffw_norm.weight", "missing")


def test_convert_refuses(tmp_path, models, tokenizer_model):
    folder = hf_folder(tiny_phi3(), tmp_path / "phi3", tokenizer_model)
    (tmp_path / "pred").mkdir()
    r = runner.invoke(
        app, ["convert", str(folder), str(tmp_path / "pred"), "--outfile", str(tmp_path / "x.gguf")]
    )
    assert_one_error_line(r, "phi3", "sparse format")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
                              "long_factor": [1.0] * 4}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    r = runner.invoke(app, ["convert", str(folder), "--outfile", str(tmp_path / "x.gguf")])
    assert_one_error_line(r, "longrope")
    assert not (tmp_path / "x.gguf").exists()


def test_gemma3_query_scale(tmp_path, tokenizer_model):
    # query_pre_attn_scalar other than key_length (llama.cpp assumes it from the model size): our
    # attention.scale key carries it
    hf = tiny_gemma3(seed=3, query_pre_attn_scalar=20)
    path = convert(hf_folder(hf, tmp_path / "g", tokenizer_model), tmp_path / "g.gguf")
    assert read_gguf(path).metadata["gemma3.attention.scale"] == pytest.approx(20**-0.5)
    ours = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2)).logits_all(TOKENS)
    assert (ours - reference(hf, TOKENS)).abs().max() <= 1e-4


def test_gemma3_270m_shape_matches_transformers(tmp_path, tokenizer_model):
    """The layout of the real Gemma 3 270M at small width: head size 256 (four times n_embd / n_head), one KV
    head, query_pre_attn_scalar = head size, RoPE bases 10000 (local) and 1e6 (global) without scaling, the
    6-layer pattern twice, and norm weights around Gemma's trained scale (1 + w up to 5). The real file's f32
    perplexity equals transformers' to 3.5e-8 (docs/kernels.md; test_gemma3_real runs it where the file is).
    Norms this large amplify rounding: transformers in float32 is 2.0e-3 from itself in float64 (logits up to
    7.5), so float64 is the reference; ours measured 7.4e-4 from it (prefill; 3.9e-4 with a window past the prompt);
    bound 3e-3 (a wrong RoPE base, scale or window moves logits by ~1)."""
    cfg = transformers.Gemma3TextConfig(
        vocab_size=N_VOCAB,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=WINDOW,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        tie_word_embeddings=True,
        **SPECIALS,
    )
    hf = transformers.Gemma3ForCausalLM(cfg).float().eval()
    randomize(hf, False, -0.5, 4.0, seed=5)
    path = convert(hf_folder(hf, tmp_path / "hf", tokenizer_model), tmp_path / "m.gguf")
    meta = read_gguf(path).metadata
    assert meta["gemma3.attention.key_length"] == 256 and meta["gemma3.attention.head_count_kv"] == 1
    ref = reference(hf.double(), TOKENS)
    for n_batch in (512, 5):
        ours = Engine(path, EngineOptions(n_ctx=64, n_batch=n_batch, n_threads=2, act_precision="f32"))
        assert (ours.logits_all(TOKENS).double() - ref).abs().max().item() <= 3e-3
