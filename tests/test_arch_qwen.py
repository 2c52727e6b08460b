"""Qwen2, Qwen3 and Mistral (sliding window): tiny random transformers checkpoints converted by `powerinfer convert`
run by our engine against transformers; the Qwen2 tokenizer; `powerinfer sparsify` and the CPU pool on qwen files;
bad input."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, TINY_TOKENS, TINY_TYPES, assert_one_error_line
from test_tokenizer import STRINGS, _random_strings
from typer.testing import CliRunner

from powerinfer.cli import app
from powerinfer.convert import convert_checkpoint
from powerinfer.errors import FormatError
from powerinfer.gguf import GGMLType, GGUFWriter, read_gguf
from powerinfer.quant import dequantize
from powerinfer.quantize import QuantizeOptions, quantize_model, require_file_type
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.tokenizer import Tokenizer
from powerinfer.tokenizer.spm_proto import spm_model_proto

transformers = pytest.importorskip("transformers")

runner = CliRunner()
PROSE = REPO / "tests" / "data" / "python-reference-prose.txt"
N_VOCAB, WINDOW, N_TOKENS = 300, 8, 24
# Qwen2's pre-tokenizer split (tokenizer.json of Qwen2/2.5/3)
QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
# GGUF layer tensor -> transformers parameter (after model.layers.N.), to load a file's weights back
HF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_config(model_type: str):
    common = dict(
        vocab_size=N_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if model_type == "qwen2":  # tied embeddings, as Qwen2.5-0.5B
        return transformers.Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=True)
    if model_type == "qwen3":  # head_dim 32 != 64 / 4
        return transformers.Qwen3Config(**common, head_dim=32, rope_theta=1e6, tie_word_embeddings=False)
    return transformers.MistralConfig(
        **common, sliding_window=WINDOW, rope_theta=1e4, tie_word_embeddings=False
    )


def hf_model(config, seed: int):
    """A random model; weights in float16-representable values (so F16 files hold them exactly)."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.3 if name.endswith("bias") else 0.08)
            p.copy_(p.half().float())
    return model


def write_qwen_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer.json with Qwen2's pre-tokenizer, trained on a little prose."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=N_VOCAB,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([PROSE.read_text(encoding="utf-8")[:20000]], trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
    }  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """model_type -> (HF folder, the transformers model)."""
    out = {}
    for seed, model_type in enumerate(("qwen2", "qwen3", "mistral")):
        folder = tmp_path_factory.mktemp(model_type)
        model = hf_model(hf_config(model_type), seed)
        model.save_pretrained(folder)
        if model_type == "mistral":
            pieces = [(t, 0.0, ty) for t, ty in zip(TINY_TOKENS, TINY_TYPES, strict=True)]
            proto = spm_model_proto(pieces, byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
            (folder / "tokenizer.model").write_bytes(proto)
        else:
            write_qwen_tokenizer(folder)
        out[model_type] = (folder, model)
    return out


def convert(folder: Path, out: Path, outtype: str) -> Path:
    return convert_checkpoint(folder, out, outtype=outtype).path


def quantize_q8_0(src: Path, dst: Path) -> Path:
    quantize_model(QuantizeOptions(src, dst, require_file_type("Q8_0")))
    return dst


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's adjacent-pair q/k rows back into transformers' rotate-half order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def model_of_file(model, path: Path):
    """A copy of `model` holding the file's weights, dequantized (q/k rows unpermuted for arch llama)."""
    g = read_gguf(path)
    permuted = g.metadata["general.architecture"] == "llama"
    cfg = model.config
    state = {}
    for name, t in g.tensors.items():
        w = dequantize(t.data, t.ggml_type, t.shape).reshape(t.shape)
        if name.startswith("blk."):
            _, bid, rest = name.split(".", 2)
            if permuted and rest in ("attn_q.weight", "attn_k.weight"):
                w = unpermute_qk(w, cfg.num_attention_heads if "q" in rest else cfg.num_key_value_heads)
            state[f"model.layers.{bid}.{HF_NAMES[rest]}"] = torch.from_numpy(np.ascontiguousarray(w))
        else:
            state[GLOBAL_NAMES[name]] = torch.from_numpy(np.ascontiguousarray(w))
    copy = type(model)(cfg).float().eval()
    missing, unexpected = copy.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: lm_head is the embedding
    return copy


def tensor(g, name: str) -> np.ndarray:
    t = g.tensors[name]
    return dequantize(t.data, t.ggml_type, t.shape).reshape(t.shape)


def tokens() -> list[int]:
    return torch.randint(3, N_VOCAB, (N_TOKENS,), generator=torch.Generator().manual_seed(7)).tolist()


def logits_hf(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def max_diffs(path: Path, ref: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """Max abs logit difference of full prefill, prefill in chunks of 5 and token-by-token decode."""
    out = {}
    for mode, n_batch in (("prefill", 512), ("chunked", 5)):
        ours = Engine(
            path, EngineOptions(act_precision="f32", n_ctx=64, n_batch=n_batch, n_threads=2)
        ).logits_all(ids)
        assert ours.shape == ref.shape
        out[mode] = (ours - ref).abs().max().item()
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1))
    step = torch.stack([engine.eval([t]) for t in ids])
    out["decode"] = (step - ref).abs().max().item()
    return out


# F32 and F16 (fp16-representable weights) against the checkpoint, Q8_0 (our quantize of the F32 file) against
# the checkpoint with the file's dequantized weights (against the original weights Q8_0 is 3e-2 to 9e-2 off).
# Measured max abs logit differences, prefill / chunked / decode: qwen2 F32 and F16 1.1e-6, Q8_0 1.3e-6; qwen3
# F32 and F16 2.0e-6, Q8_0 2.3e-6; mistral F32 and F16 2.0e-6, Q8_0 1.9e-6 (float32 sums in another order)
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral"])
def test_logits_match_transformers(checkpoints, tmp_path: Path, model_type: str):
    folder, model = checkpoints[model_type]
    ids = tokens()
    ref = logits_hf(model, ids)
    f32 = convert(folder, tmp_path / "f32.gguf", "f32")
    f16 = convert(folder, tmp_path / "f16.gguf", "f16")
    q8 = quantize_q8_0(f32, tmp_path / "q8_0.gguf")
    assert read_gguf(q8).tensors["blk.0.ffn_up.weight"].ggml_type == GGMLType.Q8_0
    for path, want in ((f32, ref), (f16, ref), (q8, logits_hf(model_of_file(model, q8), ids))):
        diffs = max_diffs(path, want, ids)
        assert max(diffs.values()) <= 1e-5, (path.name, diffs)


def test_mistral_window_beyond_its_length(checkpoints, tmp_path: Path):
    """The window is in the file and in effect: transformers without it differs from position WINDOW on, and our
    decode beyond the window matches transformers with it (test_logits_match_transformers)."""
    folder, model = checkpoints["mistral"]
    path = convert(folder, tmp_path / "m.gguf", "f32")
    g = read_gguf(path)
    assert g.metadata["general.architecture"] == "llama"
    assert g.metadata["llama.attention.sliding_window"] == WINDOW
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1))
    assert engine.config.attention.sliding_window == WINDOW
    cfg = hf_config("mistral")
    cfg.sliding_window = None
    full = type(model)(cfg).float().eval()
    full.load_state_dict(model.state_dict())
    ids = tokens()
    windowed, unwindowed = logits_hf(model, ids), logits_hf(full, ids)
    assert (windowed[:WINDOW] - unwindowed[:WINDOW]).abs().max() <= 1e-5
    assert (windowed[WINDOW:] - unwindowed[WINDOW:]).abs().max() > 1e-2
    # token by token beyond the window: the masked SDPA path, not the whole-context decode kernel
    ours = torch.stack([engine.eval([t]) for t in ids])
    assert (ours - windowed).abs().max() <= 1e-5
    # two sequences decoded together (positions 4.. and 9..): the batched path's window mask
    batch = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=2, n_seq=2))
    batch.prefill(0, ids[:4])
    batch.prefill(1, ids[:9])
    for i in range(12):
        logits = batch.decode([0, 1], [ids[4 + i], ids[9 + i]])
        want = torch.stack([windowed[4 + i], windowed[9 + i]])
        assert (logits - want).abs().max() <= 1e-5, i


def test_converted_tensors_and_keys(checkpoints, tmp_path: Path):
    for model_type, (folder, model) in checkpoints.items():
        cfg = json.loads((folder / "config.json").read_text())
        g = read_gguf(convert(folder, tmp_path / f"{model_type}.gguf", "f32"))
        md, arch = g.metadata, g.metadata["general.architecture"]
        assert arch == {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}[model_type]
        theta = (
            cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
        )  # transformers 5: rope_parameters
        assert md[f"{arch}.attention.head_count_kv"] == 2 and md[f"{arch}.rope.freq_base"] == theta
        assert ("head_dim" in cfg) == (f"{arch}.attention.key_length" in md)
        if model_type == "qwen3":
            assert md["qwen3.attention.key_length"] == md["qwen3.attention.value_length"] == 32
        assert (f"{arch}.rope.dimension_count" in md) == (arch == "llama")  # as llama.cpp's converter
        sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}

        q, hf_q = tensor(g, "blk.1.attn_q.weight"), sd["model.layers.1.self_attn.q_proj.weight"]
        if arch == "llama":
            assert np.array_equal(unpermute_qk(q, 4), hf_q) and not np.array_equal(q, hf_q)
        else:
            assert np.array_equal(q, hf_q)  # NEOX RoPE: rows as transformers stores them
        if model_type == "qwen2":
            assert np.array_equal(tensor(g, "blk.0.attn_k.bias"), sd["model.layers.0.self_attn.k_proj.bias"])
            assert "output.weight" not in g.tensors  # tied
            assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "qwen2"
            assert md["tokenizer.chat_template"] == CHAT_TEMPLATE
            assert md["tokenizer.ggml.eos_token_id"] == TOKENS_QWEN.index("<|im_end|>")
        if model_type == "qwen3":
            assert g.tensors["blk.1.attn_k_norm.weight"].shape == (32,)
            assert g.tensors["blk.0.attn_output.weight"].shape == (64, 128)  # (n_embd, n_head * head_dim)
            assert "blk.0.attn_q.bias" not in g.tensors
        if model_type == "mistral":
            assert md["tokenizer.ggml.model"] == "llama" and md["tokenizer.ggml.tokens"][:259] == TINY_TOKENS


TOKENS_QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_qwen2_tokenizer_matches_transformers(checkpoints, tmp_path: Path):
    folder, _ = checkpoints["qwen2"]
    oracle = transformers.AutoTokenizer.from_pretrained(folder)
    g = read_gguf(convert(folder, tmp_path / "q.gguf", "f16"))
    tok = Tokenizer.from_metadata(g.metadata)
    strings = STRINGS + _random_strings(300, seed=5) + ["<|im_start|>user\nhi<|im_end|>"]
    n_nfc = 0
    for s in strings:
        # transformers' Qwen2Tokenizer normalizes to NFC (as Qwen's own tokenizer.json does); llama.cpp, and so
        # we, tokenize the text as given: equal ids on the NFC form
        nfc = unicodedata.normalize("NFC", s)
        n_nfc += nfc != s
        assert tok.encode(nfc, add_bos=False) == oracle.encode(s, add_special_tokens=False), repr(s)
    assert n_nfc < 5
    ids = tok.encode(strings[-1], add_bos=False)
    assert (ids[0], ids[-1]) == (TOKENS_QWEN.index("<|im_start|>"), TOKENS_QWEN.index("<|im_end|>"))


def rewrite(src: Path, dst: Path, drop: str | None = None, tensors: dict | None = None) -> Path:
    """A copy of a GGUF without tensor `drop`, with tensors replaced: name -> float32 array."""
    model = read_gguf(src)
    w = GGUFWriter(dst, sparse=model.is_sparse)
    model.copy_metadata(w)
    for t in model.tensors.values():
        if t.name == drop:
            continue
        if tensors and t.name in tensors:
            w.add_tensor(t.name, tensors[t.name], GGMLType.F32, t.shape)
        else:
            w.add_tensor(t.name, t.data, t.ggml_type, t.shape)
    w.write()
    return dst


def all_logits(path: Path, ids: list[int], **options) -> torch.Tensor:
    options.setdefault("act_precision", "f32")
    return Engine(path, EngineOptions(n_ctx=64, n_threads=2, **options)).logits_all(ids)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_sparsify_and_pool(checkpoints, tmp_path: Path, model_type: str):
    folder, _ = checkpoints[model_type]
    dense = convert(folder, tmp_path / "dense.gguf", "f32")
    text = tmp_path / "calib.txt"
    text.write_text(PROSE.read_text(encoding="utf-8")[:2000], encoding="utf-8")
    out = tmp_path / "cats.gguf"
    r = runner.invoke(
        app, ["sparsify", "-t", "1", "-m", str(dense), "-f", str(text), "--sparsity", "0.5", "-o", str(out),
              "-c", "64", "--max-tokens", "400"],
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    g = read_gguf(out)
    assert g.is_sparse and g.metadata["powerinfer.sparsity.method"] == "cats"
    ids = tokens()
    want = all_logits(dense, ids)
    sparse = all_logits(out, ids)
    assert (sparse - want).abs().max() > 1e-3  # half the neurons skipped
    # thresholds below every |act|: each neuron active, the dense logits (measured 6.0e-7 qwen2, 6.6e-7 qwen3)
    n_ff = g.tensors["blk.0.ffn_down_t.weight"].shape[0]
    active = {n: np.full(n_ff, -1.0, np.float32) for n in g.tensors if n.endswith("_threshold")}
    every = rewrite(out, tmp_path / "every.gguf", tensors=active)
    assert (all_logits(every, ids) - want).abs().max() <= 1e-5
    # the CPU stand-in pool, a split and everything (attention with its biases / q-k norms too) in the pool:
    # the all-CPU logits (measured 0 to 5.7e-7)
    vector = "blk.1.attn_v.bias" if model_type == "qwen2" else "blk.1.attn_k_norm.weight"
    split = {"qwen2": 0.00025, "qwen3": 0.0005}[model_type]  # GiB: some of the 256 neurons in the pool
    for budget in (split, 1.0):
        engine = Engine(
            out,
            EngineOptions(
                act_precision="f32", n_ctx=64, n_threads=2, pool_device="cpu", vram_budget_gib=budget
            ),
        )
        assert engine.loader.hot, "the planner put no neuron in the pool"
        plan = engine.loader.plan
        n_pooled = sum(len(ids) for ids in plan.neurons if ids is not None)
        assert (n_pooled < 2 * n_ff) == (budget == split), n_pooled
        assert plan.on_device(vector) == plan.on_device("blk.1.attn_v.weight")
        assert plan.on_device(vector) or budget < 1
        assert (engine.logits_all(ids) - sparse).abs().max() <= 1e-5


def test_qwen3_missing_q_norm(checkpoints, tmp_path: Path):
    folder, _ = checkpoints["qwen3"]
    path = rewrite(
        convert(folder, tmp_path / "q.gguf", "f16"), tmp_path / "bad.gguf", drop="blk.0.attn_q_norm.weight"
    )
    with pytest.raises(FormatError, match=r"missing required tensor 'blk\.0\.attn_q_norm\.weight'"):
        Engine(path, EngineOptions(act_precision="f32", n_ctx=32))
    r = runner.invoke(app, ["main", "-m", str(path), "-p", "hi", "-n", "1"])
    assert_one_error_line(r, "blk.0.attn_q_norm.weight")


def test_convert_refusals(checkpoints, tmp_path: Path):
    folder, _ = checkpoints["qwen2"]
    pred = tmp_path / "pred"
    pred.mkdir()
    out = tmp_path / "o.gguf"
    r = runner.invoke(app, ["convert", str(folder), str(pred), "--outfile", str(out)])
    assert_one_error_line(r, "predictor folder", "qwen2")
    bad = tmp_path / "partial"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    cfg |= {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
    (bad / "config.json").write_text(json.dumps(cfg))
    r = runner.invoke(app, ["convert", str(bad), "--outfile", str(out)])
    assert_one_error_line(r, "max_window_layers")
    assert not out.exists()


def test_config_from_metadata(checkpoints, tmp_path: Path):
    """Head size, window and their bad values, from the metadata of converted files."""
    from powerinfer.arch import ARCHITECTURES
    from powerinfer.errors import ConfigError

    md = dict(read_gguf(convert(checkpoints["qwen3"][0], tmp_path / "q3.gguf", "f16")).metadata)
    config = ARCHITECTURES["qwen3"].config(md, False)
    a = config.attention
    assert (a.head_dim, a.n_embd_q, a.qk_norm is not None, a.bias, a.rope.kind) == (
        32,
        128,
        True,
        False,
        "neox",
    )
    assert a.sliding_window is None and config.n_embd == 64
    with pytest.raises(ConfigError, match="value length 16 != key length 32"):
        ARCHITECTURES["qwen3"].config(md | {"qwen3.attention.value_length": 16}, False)
    md = dict(read_gguf(convert(checkpoints["mistral"][0], tmp_path / "m.gguf", "f16")).metadata)
    assert ARCHITECTURES["llama"].config(md, False).attention.sliding_window == WINDOW
    assert (
        ARCHITECTURES["llama"]
        .config(md | {"llama.attention.sliding_window": 0}, False)
        .attention.sliding_window
        is None
    )
    with pytest.raises(ConfigError, match="some layers only"):
        ARCHITECTURES["llama"].config(md | {"llama.attention.sliding_window_pattern": [True, False]}, False)
    md = dict(read_gguf(convert(checkpoints["qwen2"][0], tmp_path / "q2.gguf", "f16")).metadata)
    a = ARCHITECTURES["qwen2"].config(md, False).attention
    assert (a.head_dim, a.bias, a.qk_norm, a.rope.kind, a.rope.base) == (16, True, None, "neox", 1e6)
