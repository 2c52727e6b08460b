"""Mixture-of-experts models: tiny random transformers checkpoints of Qwen3-MoE, Qwen2-MoE (shared expert), Mixtral
and OLMoE converted by `powerinfer convert`, run by our engine against transformers (full prefill, chunks, token by
token), F32, F16, Q8_0 and Q4_K_M; negative controls on the router (top-k, renormalisation)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_TOKENS, TINY_TYPES
from test_arch_qwen import CHAT_TEMPLATE, logits_hf, max_diffs, write_qwen_tokenizer

import powerinfer.arch.moe as arch_moe
import powerinfer.convert.moe as moe_convert
from powerinfer.convert import convert_checkpoint
from powerinfer.gguf import GGMLType, read_gguf
from powerinfer.quant import dequantize
from powerinfer.quantize import QuantizeOptions, quantize_model, require_file_type
from powerinfer.tokenizer.spm_proto import spm_model_proto

transformers = pytest.importorskip("transformers")

N_VOCAB, N_TOKENS = 300, 24
MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe"}


def hf_config(model_type: str):
    common = dict(
        vocab_size=N_VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    # rows of 256 (n_embd, expert width): the experts are K-quant blocks in Q4_K_M files
    if model_type == "qwen3_moe":  # head_dim 32 != 256 / 4; 8 experts of 256
        return transformers.Qwen3MoeConfig(
            **common, head_dim=32, intermediate_size=512, moe_intermediate_size=256, num_experts=8,
            norm_topk_prob=True, rope_theta=1e6,
        )  # fmt: skip
    if model_type == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **common, intermediate_size=512, moe_intermediate_size=256, shared_expert_intermediate_size=96,
            num_experts=8, norm_topk_prob=False, rope_theta=1e6,
        )  # fmt: skip
    if model_type == "mixtral":
        return transformers.MixtralConfig(
            **common, intermediate_size=256, num_local_experts=8, rope_theta=1e4
        )
    common["num_key_value_heads"] = 4  # llama.cpp's olmoe: attn_k_norm spans n_embd
    return transformers.OlmoeConfig(**common, intermediate_size=256, num_experts=8, rope_theta=1e4)


def hf_model(config, seed: int):
    """A random model; weights in float16-representable values (so F16 files hold them exactly); the router's
    weights large, so that the top-k choice is far from ties (random logits of a tiny model sit close)."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                p.normal_(0, 0.25)
            else:
                p.normal_(0, 0.3 if name.endswith("bias") else 0.04)
            p.copy_(p.half().float())
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """model_type -> (HF folder, the transformers model)."""
    out = {}
    for seed, model_type in enumerate(MODEL_TYPES):
        folder = tmp_path_factory.mktemp(model_type)
        model = hf_model(hf_config(model_type), 10 + seed)
        model.save_pretrained(folder)
        if model_type == "mixtral":
            pieces = [(t, 0.0, ty) for t, ty in zip(TINY_TOKENS, TINY_TYPES, strict=True)]
            proto = spm_model_proto(pieces, byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
            (folder / "tokenizer.model").write_bytes(proto)
        else:
            write_qwen_tokenizer(folder)
        out[model_type] = (folder, model)
    return out


def tokens() -> list[int]:
    return torch.randint(3, N_VOCAB, (N_TOKENS,), generator=torch.Generator().manual_seed(7)).tolist()


def convert(folder: Path, out: Path, outtype: str) -> Path:
    return convert_checkpoint(folder, out, outtype=outtype).path


def quantize(src: Path, dst: Path, ftype: str) -> Path:
    quantize_model(QuantizeOptions(src, dst, require_file_type(ftype)))
    return dst


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's adjacent-pair q/k rows back into transformers' rotate-half order."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def model_of_file(model_type: str, model, path: Path, folder: Path):
    """The transformers model of the file's weights, dequantized: a checkpoint in Hugging Face's per-expert names
    written beside config.json and loaded (transformers fuses the experts on load)."""
    from safetensors.numpy import save_file

    family = moe_convert.FAMILIES[model_type]
    back = {t.split(".", 2)[2]: hf for hf, t in family.layer_tensors.items()} | {
        "ffn_gate_inp.weight": family.router
    }
    globals_back = {t: hf for hf, t in moe_convert.GLOBAL_TENSORS.items()}
    cfg = model.config
    prefix = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    names = (
        {"gate": "w1", "up": "w3", "down": "w2"}
        if model_type == "mixtral"
        else {p: f"{p}_proj" for p in ("gate", "up", "down")}
    )
    state = {}
    for name, t in read_gguf(path).tensors.items():
        w = dequantize(t.data, t.ggml_type, t.shape).reshape(t.shape).astype(np.float32)
        if not name.startswith("blk."):
            state[globals_back[name]] = w
            continue
        _, bid, rest = name.split(".", 2)
        layer = f"model.layers.{bid}."
        if rest.endswith("_exps.weight"):
            part = rest.split("_")[1]
            for e in range(w.shape[0]):
                state[f"{layer}{prefix}.experts.{e}.{names[part]}.weight"] = w[e]
            continue
        if model_type == "mixtral" and rest in ("attn_q.weight", "attn_k.weight"):
            w = unpermute_qk(w, cfg.num_attention_heads if "q" in rest else cfg.num_key_value_heads)
        if rest == "ffn_gate_inp_shexp.weight":
            w = w.reshape(1, -1)
        state[layer + back[rest]] = w
    out = folder.parent / (folder.name + "-" + path.stem)
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text((folder / "config.json").read_text())
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, str(out / "model.safetensors"))
    copy = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    return copy


def max_rel(path: Path, ref: torch.Tensor, ids: list[int]) -> float:
    """The largest of max_diffs (prefill, chunks of 5, token by token) relative to max |ref|."""
    return max(max_diffs(path, ref, ids).values()) / ref.abs().max().item()


# Relative max logit differences (max |ours - ref| / max |ref|) over prefill, chunks of 5 and token by token,
# measured: F32 and F16 against the checkpoint up to 7e-7; Q8_0 and Q4_K_M (our quantize of the F32 file) against
# transformers running the file's dequantized weights 5.7e-7 to 1.5e-6 (against the original weights those files
# are 0.03 to 1.3 off in absolute logits, so the dequantized oracle is what tells a wrong kernel from rounding).
# The negative controls (one more expert, renormalisation flipped) measured 0.045 to 0.29.
BOUND = 1e-5
QUANT_BOUND = 1e-5


def wrong_router(monkeypatch, change: str) -> None:
    """Make every MoE config the engine reads route with one more expert, or flip the renormalisation."""
    real = arch_moe.moe_spec

    def spec(*args, **kwargs):
        s = real(*args, **kwargs)
        if change == "top_k":
            return dataclasses.replace(s, n_expert_used=s.n_expert_used + 1)
        return dataclasses.replace(s, norm_weights=not s.norm_weights)

    monkeypatch.setattr(arch_moe, "moe_spec", spec)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_logits_match_transformers(checkpoints, tmp_path: Path, model_type: str, monkeypatch):
    folder, model = checkpoints[model_type]
    ids = tokens()
    ref = logits_hf(model, ids)
    f32 = convert(folder, tmp_path / "f32.gguf", "f32")
    f16 = convert(folder, tmp_path / "f16.gguf", "f16")
    for path in (f32, f16):
        assert max_rel(path, ref, ids) <= BOUND, path.name
    for ftype in ("Q8_0", "Q4_K_M"):
        q = quantize(f32, tmp_path / f"{ftype}.gguf", ftype)
        g = read_gguf(q)
        want = GGMLType.Q8_0 if ftype == "Q8_0" else GGMLType.Q4_K
        assert g.tensors["blk.0.ffn_gate_exps.weight"].ggml_type == want
        assert g.tensors["blk.0.ffn_gate_inp.weight"].ggml_type == GGMLType.F32  # routers stay float
        oracle = logits_hf(model_of_file(model_type, model, q, folder), ids)
        assert max_rel(q, oracle, ids) <= QUANT_BOUND, ftype
    # negative controls: the same comparison fails with a router that picks one more expert, or (de)normalises
    for change in ("top_k", "norm"):
        with monkeypatch.context() as m:
            wrong_router(m, change)
            assert max_rel(f32, ref, ids) > 100 * BOUND, change


def test_converted_tensors_and_keys(checkpoints, tmp_path: Path):
    """Names, shapes and keys as llama.cpp's converter writes them; the experts stacked in expert order."""
    for model_type, (folder, _) in checkpoints.items():
        g = read_gguf(convert(folder, tmp_path / f"{model_type}.gguf", "f32"))
        md, arch = g.metadata, g.metadata["general.architecture"]
        assert arch == ARCH[model_type]
        assert md[f"{arch}.expert_count"] == 8 and md[f"{arch}.expert_used_count"] == 2
        assert g.tensors["blk.1.ffn_gate_inp.weight"].shape == (8, 256)
        assert g.tensors["blk.1.ffn_gate_exps.weight"].shape == (8, 256, 256)
        assert g.tensors["blk.1.ffn_down_exps.weight"].shape == (8, 256, 256)
        # no key where llama.cpp's hard-coded choice fits the checkpoint (all four tiny checkpoints)
        assert f"{arch}.expert_weights_norm" not in md
        saved = dict(safe_open_numpy(folder))
        layer = "model.layers.1.block_sparse_moe.experts.5.w2" if model_type == "mixtral" else (
            "model.layers.1.mlp.experts.5.down_proj"
        )  # fmt: skip
        down = g.tensors["blk.1.ffn_down_exps.weight"]
        assert np.array_equal(dequantize(down.data, down.ggml_type, down.shape)[5], saved[layer + ".weight"])
        if model_type != "mixtral":  # the tokenizer and chat template as for the dense families
            assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.chat_template"] == CHAT_TEMPLATE
        if model_type in ("qwen3_moe", "qwen2_moe"):
            assert md[f"{arch}.expert_feed_forward_length"] == 256
        if model_type == "qwen2_moe":
            assert md["qwen2moe.expert_shared_feed_forward_length"] == 96
            assert g.tensors["blk.0.ffn_gate_inp_shexp.weight"].shape == (256,)
            assert g.tensors["blk.0.ffn_down_shexp.weight"].shape == (256, 96)
        if model_type == "olmoe":
            assert g.tensors["blk.0.attn_q_norm.weight"].shape == (256,)  # the whole projection


def safe_open_numpy(folder: Path):
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="np") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def test_qwen3moe_without_renormalisation(tmp_path: Path):
    """A Qwen3-MoE checkpoint with norm_topk_prob false: the converter writes expert_weights_norm false (llama.cpp
    renormalises every qwen3moe file without the key) and we follow the key, matching transformers."""
    config = hf_config("qwen3_moe")
    config.norm_topk_prob = False
    model = hf_model(config, 21)
    model.save_pretrained(tmp_path / "hf")
    write_qwen_tokenizer(tmp_path / "hf")
    path = convert(tmp_path / "hf", tmp_path / "q.gguf", "f32")
    assert read_gguf(path).metadata["qwen3moe.expert_weights_norm"] is False
    ids = tokens()
    assert max_rel(path, logits_hf(model, ids), ids) <= BOUND


def test_profile_counts_expert_selections(checkpoints, tmp_path: Path):
    """`profile` on a MoE file counts each layer's expert selections: the top-k of transformers' router logits over
    the same windows, expert for expert; the skew is the top 10% of experts' share."""
    from powerinfer.profile.experts import profile_experts
    from powerinfer.runtime.engine import Engine, EngineOptions

    folder, model = checkpoints["qwen3_moe"]
    path = convert(folder, tmp_path / "f32.gguf", "f32")
    ids = tokens()
    windows = [ids[:10], ids[10:]]
    prof = profile_experts(
        Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1, dense_ffn=True)), windows
    )
    want = [np.zeros(8, dtype=np.int64) for _ in range(2)]
    for w in windows:
        with torch.no_grad():
            out = model(torch.tensor([w]), output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            want[layer] += np.bincount(
                logits.reshape(len(w), 8).topk(2).indices.reshape(-1).numpy(), minlength=8
            )
    assert prof.n_tokens == N_TOKENS and prof.n_used == 2
    for layer in range(2):
        assert np.array_equal(prof.counts[layer], want[layer])
        assert prof.counts[layer].sum() == 2 * N_TOKENS
    assert np.allclose(prof.skew(), [c.max() / c.sum() for c in want])  # 8 experts: the top 10% is one


@pytest.fixture(scope="module")
def converted(checkpoints, tmp_path_factory) -> dict[str, Path]:
    """Every checkpoint converted (F32, F16) and quantized (Q4_K_M): "<model_type>-<kind>.gguf" -> path; written
    into POWERINFER_MOE_CONVERTED_OUT when set (to record llama.cpp on them: scripts/make_synthetic_moe.py)."""
    out_env = os.environ.get("POWERINFER_MOE_CONVERTED_OUT")
    out = Path(out_env) if out_env else tmp_path_factory.mktemp("converted")
    paths = {}
    for model_type, (folder, _) in checkpoints.items():
        for kind in ("f32", "f16"):
            paths[f"{model_type}-{kind}.gguf"] = convert(folder, out / f"{model_type}-{kind}.gguf", kind)
        q = quantize(paths[f"{model_type}-f32.gguf"], out / f"{model_type}-q4_k_m.gguf", "Q4_K_M")
        paths[q.name] = q
    return paths


def tensor_digest(path: Path) -> str:
    """sha256 over the tensors' names and bytes, as scripts/make_synthetic_moe.py computes it."""
    import hashlib

    import gguf

    h = hashlib.sha256()
    for t in gguf.GGUFReader(str(path)).tensors:
        h.update(t.name.encode())
        h.update(np.ascontiguousarray(t.data).tobytes())
    return h.hexdigest()


CONVERTED = Path(__file__).parent / "data" / "moe-llama-cpp-converted.json"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("kind", ["f32", "f16", "q4_k_m"])
def test_converted_files_match_llama_cpp(converted, model_type: str, kind: str):
    """Our converted (and quantized) files run by llama.cpp 0.3.16 (recorded): our next-token choice along its
    greedy continuations equals its own at every step that is no near-tie (top-2 margin below 0.05, llama.cpp's
    or ours). Measured: 0 mismatches; 11 to 41 of the 96 steps near-ties (the tiny head's logits sit close)."""
    import json

    from powerinfer.runtime.engine import Engine, EngineOptions

    recorded = json.loads(CONVERTED.read_text())
    name = f"{model_type}-{kind}.gguf"
    path = converted[name]
    assert tensor_digest(path) == recorded["tensor_sha256"][name], (
        "the tiny checkpoint or the converter changed: re-record tests/data/moe-llama-cpp-converted.json "
        "(scripts/make_synthetic_moe.py --files ... --record)"
    )
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=128, n_threads=1))
    compared = wrong = 0
    for run in recorded["runs"][name]:
        engine.reset()
        prompt, ids, margins = run["prompt"], run["ids"], run["margins"]
        logits = engine.logits_all(prompt + ids[:-1])[len(prompt) - 1 :]
        top = logits.topk(2, dim=-1)
        ours = top.values[:, 0] - top.values[:, 1]
        for step, want in enumerate(ids):
            if ours[step] >= 0.05 and margins[step] >= 0.05:
                compared += 1
                wrong += int(top.indices[step, 0]) != want
    assert wrong == 0 and compared >= 48, (compared, wrong)
