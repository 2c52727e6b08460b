"""RoPE scaling (linear, YaRN, Llama 3's rope_freqs) against transformers on tiny random Llama checkpoints that
our converter turned into GGUF files, the command line's overrides against the file's keys, and bad values."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_TOKENS, TINY_TYPES, assert_one_error_line, smollm2_path
from typer.testing import CliRunner

import powerinfer.cli.main as cli_main
from powerinfer.arch import load_config
from powerinfer.arch.rope_scaling import RopeOverrides
from powerinfer.cli import app
from powerinfer.cli.options import EngineArgs
from powerinfer.convert.hf import convert_hf_to_gguf
from powerinfer.errors import ConfigError, InputError
from powerinfer.gguf.reader import read_gguf
from powerinfer.model.blocks import rope_frequencies
from powerinfer.model.specs import RopeSpec
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.tokenizer.spm_proto import spm_model_proto

runner = CliRunner()
N_CTX_ORIG = 32  # the checkpoints' original context: the prompt runs to 4x past it
N_TOKENS = 120
SCALINGS = {
    "default": {},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": N_CTX_ORIG},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": N_CTX_ORIG,
    },
}


def hf_llama(kind: str):
    """A random 2-layer transformers Llama (GQA 4/2, head size 16) with the RoPE scaling `kind`; the same
    weights for every kind."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=len(TINY_TOKENS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0} | SCALINGS[kind],
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08)
            if "norm" in name:
                p.uniform_(0.8, 1.2)
    return model


def converted(model, folder: Path) -> Path:
    """The checkpoint saved as transformers saves it (config.json, f32 safetensors) plus a SentencePiece vocab,
    converted by our converter to an F32 GGUF."""
    model.save_pretrained(folder)
    pieces = [(t, 0.0, ty) for t, ty in zip(TINY_TOKENS, TINY_TYPES, strict=True)]
    (folder / "tokenizer.model").write_bytes(
        spm_model_proto(pieces, byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    )
    return convert_hf_to_gguf(folder, folder / "model.gguf", outtype="f32")


def prompt() -> list[int]:
    return torch.randint(
        0, len(TINY_TOKENS), (N_TOKENS,), generator=torch.Generator().manual_seed(1)
    ).tolist()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("kind", ["linear", "yarn", "llama3"])
def test_converted_checkpoint_matches_transformers(kind: str, tmp_path: Path):
    """Prompt in one pass, in chunks of 7 and token by token (the C decode-attention kernel's (cos, sin) pairs),
    in f32, against transformers at positions up to 4x the original context. Measured: at most 6.6e-7 relative
    (max |diff| / max |logit|) for every kind and path; scaling itself moves the logits by 0.35 to 0.48 relative."""
    model = hf_llama(kind)
    path = converted(model, tmp_path / kind)
    tokens = prompt()
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0]
        plain = hf_llama("default")(torch.tensor([tokens])).logits[0]
    assert rel(plain, ref) > 0.05  # the scaling matters on this prompt
    for n_batch in (512, 7):
        engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=128, n_batch=n_batch, n_threads=2))
        assert rel(engine.logits_all(tokens), ref) < 5e-6, n_batch
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=128, n_threads=1))
    step = torch.stack([engine.eval([t]) for t in tokens])
    assert rel(step, ref) < 5e-6


def test_converter_writes_what_llama_cpp_writes(tmp_path: Path):
    """linear: type and factor; yarn: also the original context; llama3: no scaling keys, rope_freqs.weight holds
    the divisors of transformers' Llama 3 frequencies (inv_freq = base^(-2i/d) / rope_freqs[i])."""
    md = {
        kind: read_gguf(converted(hf_llama(kind), tmp_path / kind)) for kind in ("linear", "yarn", "llama3")
    }
    lin, yarn, llama3 = md["linear"].metadata, md["yarn"].metadata, md["llama3"].metadata
    assert (lin["llama.rope.scaling.type"], lin["llama.rope.scaling.factor"]) == ("linear", 4.0)
    assert (yarn["llama.rope.scaling.type"], yarn["llama.rope.scaling.factor"]) == ("yarn", 4.0)
    assert yarn["llama.rope.scaling.original_context_length"] == N_CTX_ORIG
    assert not any(k.startswith("llama.rope.scaling") for k in llama3)
    assert "rope_freqs.weight" not in md["yarn"].tensors
    info = md["llama3"].tensors["rope_freqs.weight"]
    factors = info.data.view(np.float32)
    hf = hf_llama("llama3")
    base = 10000.0 ** (-np.arange(0, 16, 2) / 16)
    inv_freq = hf.model.rotary_emb.inv_freq.double().numpy()
    assert np.allclose(base / factors, inv_freq, rtol=1e-6)
    assert factors[0] == 1.0 and factors[-1] == 8.0 and 1.0 < factors[1] < 8.0  # high, low and blended pairs


def test_yarn_frequencies_follow_llama_cpp():
    """The ramp and magnitude as ggml's rope_yarn computes them, written out here for n_rot 16, base 1e4, original
    context 32: corr dims floor(-1.60) -> 0 and ceil(1.41) = 2, so pair 0 keeps its frequency, pair 1 is half
    scaled, pairs >= 2 are divided by the factor; cos and sin carry 0.1 ln 4 + 1."""
    spec = RopeSpec("adjacent", 16, 1e4, 4.0, ext_factor=1.0, n_ctx_orig=N_CTX_ORIG)
    theta = 1e4 ** (-np.arange(8) * 2 / 16)
    expected = theta / 4
    expected[0] = theta[0]
    expected[1] = theta[1] / 4 * 0.5 + theta[1] * 0.5
    assert np.allclose(rope_frequencies(spec).numpy(), expected, rtol=1e-12)
    path_spec = load_spec({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    assert path_spec.magnitude == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert path_spec.ext_factor == 1.0 and path_spec.n_ctx_orig == 128  # no original length: context_length


def load_spec(keys: dict, overrides: RopeOverrides | None = None) -> RopeSpec:
    """The RoPE spec of the tiny Llama file with `keys` added to its metadata."""
    from powerinfer.arch.llama import LlamaConfig

    md = {
        "general.architecture": "llama",
        "llama.context_length": 128,
        "llama.embedding_length": 64,
        "llama.block_count": 2,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": 4,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.tokens": TINY_TOKENS,
    } | keys
    if overrides is not None:
        md |= {k.format(arch="llama"): v for k, v in overrides.keys().items()}
    rope = LlamaConfig.from_gguf(md, False).attention.rope
    assert rope is not None
    return rope


def engine_logits(path: Path, rope: RopeOverrides | None, tokens: list[int]) -> torch.Tensor:
    return Engine(path, EngineOptions(act_precision="f32", n_ctx=128, n_threads=2, rope=rope)).logits_all(
        tokens
    )


def test_overrides_equal_the_file_keys(tmp_path: Path):
    """The unscaled file with --rope-scaling/--rope-scale/--yarn-orig-ctx (and linear) gives the scaled file's
    logits bit for bit; --rope-freq-base and the YaRN knobs change the spec as llama.cpp's context does."""
    plain = converted(hf_llama("default"), tmp_path / "default")
    tokens = prompt()[:60]
    for kind, args in (
        ("yarn", EngineArgs(rope_scaling="yarn", rope_scale=4.0, yarn_orig_ctx=N_CTX_ORIG)),
        ("linear", EngineArgs(rope_freq_scale=0.25)),  # the file has no type: linear, as llama.cpp reads it
    ):
        scaled = converted(hf_llama(kind), tmp_path / kind)
        assert torch.equal(
            engine_logits(plain, args.rope_overrides(), tokens), engine_logits(scaled, None, tokens)
        )
    # --rope-scaling none switches a file's scaling off
    yarn = tmp_path / "yarn" / "model.gguf"
    none = EngineArgs(rope_scaling="none").rope_overrides()
    assert torch.equal(engine_logits(yarn, none, tokens), engine_logits(plain, None, tokens))
    config = load_config(
        read_gguf(yarn), EngineArgs(rope_freq_base=5e5, yarn_beta_fast=16.0).rope_overrides()
    )
    rope = config.attention.rope
    assert rope is not None and (rope.base, rope.beta_fast, rope.beta_slow, rope.scale) == (
        5e5,
        16.0,
        1.0,
        4.0,
    )
    attn = load_spec(
        {}, RopeOverrides(scaling="yarn", freq_scale=0.5, yarn_attn_factor=2.0, yarn_ext_factor=0.5)
    )
    assert (attn.ext_factor, attn.magnitude) == (0.5, pytest.approx(2.0 * (0.1 * math.log(2.0) + 1.0)))


def test_options_reach_the_engine_options(monkeypatch):
    """The flags of every command land in EngineOptions.rope through EngineArgs (main shown, patched at run_main)."""
    seen = {}
    monkeypatch.setattr(cli_main, "run_main", lambda opts: seen.update(opts=opts))
    flags = [
        "--rope-scaling",
        "yarn",
        "--rope-scale",
        "8",
        "--rope-freq-base",
        "20000",
        "--yarn-orig-ctx",
        "4096",
    ]
    flags += [
        "--yarn-ext-factor",
        "0.5",
        "--yarn-attn-factor",
        "1.5",
        "--yarn-beta-fast",
        "24",
        "--yarn-beta-slow",
        "2",
    ]
    result = runner.invoke(app, ["main", "-m", "m.gguf", "-p", "hi", *flags])
    assert result.exit_code == 0, result.output
    assert seen["opts"].engine.rope == RopeOverrides("yarn", 20000.0, 0.125, 4096, 0.5, 1.5, 24.0, 2.0)
    assert EngineArgs().options().rope is None


@pytest.mark.parametrize("command", ["main", "perplexity", "batched", "bench", "server"])
@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--rope-scale", "0"], "--rope-scale must be a positive number"),
        (["--rope-freq-scale", "-2"], "--rope-freq-scale must be a positive number"),
        (["--rope-freq-base", "0"], "--rope-freq-base must be a positive number"),
        (["--rope-scaling", "dynamic"], "--rope-scaling must be one of none, linear, yarn"),
        (["--yarn-orig-ctx", "-1"], "--yarn-orig-ctx must be >= 0"),
        (["--yarn-beta-fast", "inf"], "--yarn-beta-fast must be a finite number"),
    ],
)
def test_bad_values_are_one_error_line(command: str, flags: list[str], needle: str):
    args = [command, "-m", str(smollm2_path()), *flags]
    if command == "perplexity":
        args += ["-f", __file__]
    assert_one_error_line(runner.invoke(app, args), needle)


def test_scale_without_a_scaling_type_is_refused(tmp_path: Path):
    """llama.cpp would ignore --rope-scale under type none; we say so."""
    plain = converted(hf_llama("default"), tmp_path / "default")
    with pytest.raises(InputError, match="do nothing with RoPE scaling type none"):
        Engine(plain, EngineOptions(rope=RopeOverrides(scaling="none", freq_scale=0.5)))
    with pytest.raises(ConfigError, match="unsupported rope scaling type"):
        load_spec({"llama.rope.scaling.type": "longrope"})


def span_engine(path: Path, device: str) -> Engine:
    """Every layer and the head on the pool device (`device`; "cpu" stands in): one-token steps run as a
    device span over the layers' device copies of the scaled (cos, sin) tables."""
    options = EngineOptions(act_precision="f32", n_ctx=128, n_threads=2, pool_device=device, n_gpu_layers=3)
    return Engine(path, options)


@pytest.mark.parametrize("kind", ["yarn", "llama3"])
def test_device_span_uses_the_scaled_tables(kind: str, tmp_path: Path):
    """Prompt, then decode through the span (CPU standing in for the device). Measured: 6.6e-7 relative, as the
    CPU's own path (the stand-in runs the same kernels)."""
    model = hf_llama(kind)
    path = converted(model, tmp_path / kind)
    tokens = prompt()
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0]
    engine = span_engine(path, "cpu")
    n_prompt = N_TOKENS - 8
    first = engine.logits_all(tokens[:n_prompt])
    rest = torch.stack([engine.eval([t]) for t in tokens[n_prompt:]])
    assert rel(torch.cat([first, rest]), ref) < 5e-6


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("kind", ["yarn", "llama3"])
def test_cuda_span_uses_the_scaled_tables(kind: str, tmp_path: Path):
    """The same on CUDA (masked_attention over the device table, captured graphs), f32 weights."""
    model = hf_llama(kind)
    path = converted(model, tmp_path / kind)
    tokens = prompt()
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0]
    engine = span_engine(path, "cuda")
    n_prompt = N_TOKENS - 8
    first = engine.logits_all(tokens[:n_prompt]).cpu()
    rest = torch.stack([engine.eval([t]).cpu() for t in tokens[n_prompt:]])
    assert rel(torch.cat([first, rest]), ref) < 1e-4


def test_gemma3_local_layers_keep_their_rope():
    """Gemma 3's sliding layers rotate with base 10000 and no scaling whatever the file and the command line say
    (llama.cpp's freq_base_swa); its global layers take both."""
    from powerinfer.arch.gemma3 import SWA_ROPE_BASE, Gemma3Config

    keys = {
        "general.architecture": "gemma3",
        "gemma3.context_length": 128,
        "gemma3.embedding_length": 64,
        "gemma3.block_count": 6,
        "gemma3.feed_forward_length": 128,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.attention.sliding_window": 8,
        "gemma3.rope.scaling.type": "linear",
        "gemma3.rope.scaling.factor": 8.0,
        "tokenizer.ggml.tokens": TINY_TOKENS,
    }
    overrides = RopeOverrides(scaling="yarn", freq_base=2e6, yarn_orig_ctx=64)
    c = Gemma3Config.from_gguf(
        keys | {k.format(arch="gemma3"): v for k, v in overrides.keys().items()}, False
    )
    assert c.local_rope == RopeSpec("neox", 16, SWA_ROPE_BASE)
    g = c.attention.rope
    assert g is not None and (g.base, g.scale, g.ext_factor, g.n_ctx_orig) == (2e6, 8.0, 1.0, 64)


def test_moe_checkpoint_with_yarn_matches_transformers(tmp_path: Path):
    """A Qwen2-MoE checkpoint with YaRN (arch/moe.py builds its own per-layer RoPE from the same spec), converted
    by the MoE converter. Measured: 7.1e-7 to 8.6e-7 relative over prompt, chunks of 7 and decode."""
    transformers = pytest.importorskip("transformers")
    from test_arch_moe import hf_model
    from test_arch_qwen import write_qwen_tokenizer

    config = transformers.Qwen2MoeConfig(
        vocab_size=300, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2,
        tie_word_embeddings=False, intermediate_size=512, moe_intermediate_size=256,
        shared_expert_intermediate_size=96, num_experts=8, norm_topk_prob=False,
        rope_parameters={"rope_theta": 1e6} | SCALINGS["yarn"],
    )  # fmt: skip
    model = hf_model(config, 3)
    model.save_pretrained(tmp_path)
    write_qwen_tokenizer(tmp_path)
    path = convert_hf_to_gguf(tmp_path, tmp_path / "model.gguf", outtype="f32")
    assert read_gguf(path).metadata["qwen2moe.rope.scaling.type"] == "yarn"
    tokens = torch.randint(3, 300, (100,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0]
    for n_batch in (512, 7):
        engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=128, n_batch=n_batch, n_threads=2))
        assert rel(engine.logits_all(tokens), ref) < 5e-6, n_batch
    engine = Engine(path, EngineOptions(act_precision="f32", n_ctx=128, n_threads=1))
    assert rel(torch.stack([engine.eval([t]) for t in tokens]), ref) < 5e-6
