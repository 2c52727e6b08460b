"""`powerinfer perplexity`: llama.cpp's chunking, the original's numbers on its fixture, transformers on
SmolLM2, KL divergence and predictor recall against the dense FFN, and bad input."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import assert_one_error_line as assert_cli_error
from conftest import fixture_dir, smollm2_path
from typer.testing import CliRunner

from powerinfer.cli import app
from powerinfer.errors import InputError
from powerinfer.eval import (
    KLDivergence,
    PerplexityOptions,
    PerplexityResult,
    compare_logits,
    perplexity,
    plan_chunks,
    predictor_recall,
    tokenize_text,
)
from powerinfer.runtime.engine import Engine, EngineOptions

runner = CliRunner()
DATA = Path(__file__).resolve().parent / "data"
TEXT = DATA / "python-reference-prose.txt"
STDOUT_RE = re.compile(r"^(\[\d+\]\d+\.\d{4},)+\nFinal estimate: PPL = (\d+\.\d{4}) \+/- (\d+\.\d{5})\n")


def run_ppl(*args: str):
    return runner.invoke(app, ["perplexity", *args])


def parse_stdout(stdout: str) -> tuple[list[float], float, float]:
    m = STDOUT_RE.match(stdout)
    assert m, stdout
    running = [float(v) for v in re.findall(r"\[\d+\](\d+\.\d{4}),", stdout.splitlines()[0])]
    return running, float(m.group(2)), float(m.group(3))


def assert_one_error_line(result, *needles: str) -> None:
    assert_cli_error(result, *needles)
    assert result.stdout == ""


# ---------------------------------------------------------------- chunking and statistics (pure)
def test_plan_chunks_replaces_first_token_and_scores_second_half():
    tokens = list(range(100, 135))  # 35 tokens, n_ctx 8 -> 4 chunks
    chunks = plan_chunks(tokens, PerplexityOptions(n_ctx=8), bos_id=1)
    assert len(chunks) == 4
    c = chunks[2]
    assert c.start == 16 and c.tokens == [1, *range(117, 124)]
    assert c.first == 4 and c.targets == [121, 122, 123]  # rows 4..6 predict tokens 5..7 of the window
    assert plan_chunks(tokens, PerplexityOptions(n_ctx=8), bos_id=None)[0].tokens == list(range(100, 108))
    assert len(plan_chunks(tokens, PerplexityOptions(n_ctx=8, n_chunks=2), bos_id=1)) == 2


def test_plan_chunks_strided():
    tokens = list(range(40))
    # -c 8 --ppl-stride 4: context 10, windows 4 apart, each scores its last 4 predictions
    chunks = plan_chunks(tokens, PerplexityOptions(n_ctx=8, stride=4), bos_id=1)
    assert len(chunks) == (40 - 10 + 3) // 4
    assert (
        chunks[1].tokens == list(range(4, 14))
        and chunks[1].first == 5
        and chunks[1].targets == [10, 11, 12, 13]
    )


def test_plan_chunks_too_short_names_both_counts():
    with pytest.raises(InputError, match=r"at least 16 tokens .* the text has 15"):
        plan_chunks(list(range(15)), PerplexityOptions(n_ctx=8), bos_id=1)


def test_error_formula():
    nll = [1.0, 2.0, 4.0, 0.5]
    r = PerplexityResult(nll_sum=sum(nll), nll2_sum=sum(x * x for x in nll), count=len(nll))
    mean = sum(nll) / 4
    var = sum(x * x for x in nll) / 4 - mean**2
    assert r.ppl == pytest.approx(math.exp(mean))
    assert r.ppl_error == pytest.approx(math.exp(mean) * math.sqrt(var / 3))
    assert PerplexityResult(nll_sum=2.0, nll2_sum=2.0, count=2).ppl_error is None  # zero variance


def test_kl_divergence_of_known_distributions():
    p = torch.tensor([[0.5, 0.25, 0.25], [0.9, 0.05, 0.05]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.5, 0.25], [0.9, 0.05, 0.05]], dtype=torch.float64)
    acc = KLDivergence()
    compare_logits(acc, p.log(), q.log(), torch.tensor([0, 1]))
    expected = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    assert acc.kld == pytest.approx([expected, 0.0])
    assert acc.top1 == 0.5
    assert acc.ref_ppl == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.05)) / 2))


# ---------------------------------------------------------------- the original's fixture
@pytest.fixture(scope="module")
def expected():
    return json.loads((fixture_dir() / "expected.json").read_text())


@pytest.fixture(scope="module")
def reference():
    """The fixture's independent checks (transformers, a torch re-statement of the sparse semantics)."""
    return json.loads((fixture_dir() / "reference.json").read_text())


# `perplexity -c 64 -f text.txt` vs PowerInfer -t 1 (expected.json perplexity_t1). All bounds are RELATIVE: the
# original prints 4 decimals (rounding <= 2.8e-6 relative at PPL ~18), and fixture README 7 suggests ~1e-3 relative.
# An absolute 1e-3 would not hold: PowerInfer rounds the F16 file's activations to fp16 and we do not, which moves
# the final value by 4.1e-3 (our 18.0916 is reference.json's sparse_ref_f16_no_rounding, README 7).
# Relative errors measured now (--act-precision f32, the exact mode; -t 1):
#   f16:  final 2.27e-4, worst running value 2.88e-4 (chunk 9), +/- 1.49e-4
#   q4_0: final 4.47e-4, worst running value 3.17e-3 (chunk 1: 31 scored tokens), +/- 9.8e-5
# (final, each running value, +/-); f16's final is the acceptance item: within 1e-3 relative, 4.4x measured.
# The files tell each other apart: f16 vs the q4_0 truth is -1.46e-2, and the dense FFN (17.9359) -8.8e-3.
FIXTURE_PPL_REL = {"f16": (1e-3, 1e-3, 5e-4), "q4_0": (1.5e-3, 1e-2, 5e-4)}


@pytest.mark.parametrize("name,key", [("tiny.powerinfer.gguf", "f16"), ("tiny.q4.powerinfer.gguf", "q4_0")])
def test_fixture_perplexity_matches_original(expected, reference, name, key):
    """-c 64 on text.txt in sparse mode: final value, every running value and the +/- against PowerInfer -t 1."""
    fx = fixture_dir()
    ref = expected["perplexity_t1"][key]
    rel_final, rel_running, rel_err = FIXTURE_PPL_REL[key]
    # the exact mode (the CLI default q8 measured on q4_0: final +2.3e-4, +/- +8.9e-4 relative)
    result = run_ppl(
        "-m", str(fx / name), "-f", str(fx / "text.txt"), "-c", "64", "-t", "1", "--act-precision", "f32"
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    running, final, err = parse_stdout(result.stdout)
    assert len(running) == ref["n_chunks"] == 33
    assert final == pytest.approx(ref["final_ppl"], rel=rel_final)
    assert err == pytest.approx(ref["final_err"], rel=rel_err)
    for ours, theirs in zip(running, ref["running_ppl"], strict=True):
        assert ours == pytest.approx(theirs, rel=rel_running)
    if key == "f16":
        # the independent torch re-statement of the sparse semantics without fp16 rounding (reference.json):
        # measured identical in all 33 printed values; 1e-4 = one unit in the last printed place
        no_rounding = reference["perplexity"]["sparse_ref_f16_no_rounding"]["running"]
        assert running == pytest.approx(no_rounding, abs=1e-4)
        # predicted-active share per layer on these 33 x 64 tokens, README 2: 0.5578 0.5114 0.4363 0.383 (mean
        # 47.2 %), here at the 2 decimals the sparse report prints (4 decimals: test_fixture_kl_divergence_report)
        shares = "predicted active 47.2% of FFN neurons, per layer: 0.56 0.51 0.44 0.38"
        assert f"sparse: {shares}\n" in result.stderr
    assert "calculating perplexity over 33 chunks, batch_size=64" in result.stderr
    assert "seconds per pass - ETA" in result.stderr


def test_fixture_tokens_match_original(expected):
    engine = Engine(fixture_dir() / "tiny.powerinfer.gguf", EngineOptions(act_precision="f32", n_ctx=64))
    text = (fixture_dir() / "text.txt").read_text().removesuffix("\n")
    assert tokenize_text(engine, text) == [1] + expected["perplexity_tokens"]


def test_fixture_kl_divergence_report(reference):
    """--kl-divergence: KLD and top-1 vs the dense FFN, and the fixture's documented per-layer miss rates."""
    fx = fixture_dir()
    result = run_ppl(
        "-m",
        str(fx / "tiny.powerinfer.gguf"),
        "-f",
        str(fx / "text.txt"),
        "-c",
        "64",
        "-t",
        "1",
        "--kl-divergence",
    )
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    parse_stdout(out)
    dense = float(re.search(r"reference: (\d+\.\d+)", out).group(1))
    # transformers' dense ReLU model, fixture README 7: measured identical at the 4 printed decimals
    assert dense == pytest.approx(17.9359, abs=1e-4)
    kld = float(re.search(r"Mean    KLD: +(\d+\.\d+)", out).group(1))
    top1 = float(re.search(r"Same top-1: (\d+\.\d+)", out).group(1))
    # no outside reference for these two: measured mean KLD 0.003332 and 3.91 % of tokens changing their top-1;
    # bounds 3x either way (0 would mean the predictor skipped nothing, i.e. a dense run)
    assert 0.001 < kld < 0.01
    assert 1.3 < 100 - top1 < 12.0
    # per layer on these 33 x 64 tokens, against the fixture (all printed to 4 significant decimals):
    #   skipped share of truly active neurons, README 2: 0.0775 0.0553 0.0579 0.0622 (measured |diff| <= 1e-4)
    #   predicted-active share, README 2: 0.5578 0.5114 0.4363 0.383 (measured |diff| <= 1e-4 printed, 7.4e-5 exact)
    #   precision and truly-active share from reference.json's counts (measured |diff| <= 1e-4)
    # bound 2e-4: README's and our rounding (5e-5 each) plus the measured count differences (<= 2.8e-5); the Q4_0
    # file's shares differ by up to 9.2e-3 and its skipped shares by 3.2e-2, so a wrong file fails
    truth = reference["predictor_on_text_txt_f16"]
    pattern = r"^ +(\d)  +(\d\.\d{4}) +(\d\.\d{4}) +(\d+\.\d\d)% +(\d+\.\d\d)% +\d+ \("
    rows = re.findall(pattern, out, re.M)
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    readme_skipped = [0.0775, 0.0553, 0.0579, 0.0622]
    readme_predicted = [0.5578, 0.5114, 0.4363, 0.383]
    for (layer, recall, precision, predicted, true_share), skipped, share in zip(
        rows, readme_skipped, readme_predicted, strict=True
    ):
        t = truth[f"layer_{layer}"]
        assert 1 - float(recall) == pytest.approx(skipped, abs=2e-4), layer
        assert float(predicted) / 100 == pytest.approx(share, abs=2e-4), layer
        hits = t["nonzero_neurons"] - t["nonzero_neurons_skipped"]
        assert float(precision) == pytest.approx(hits / t["predicted_active"], abs=2e-4), layer
        assert float(true_share) / 100 == pytest.approx(t["nonzero_neurons"] / t["total"], abs=2e-4), layer


def test_every_neuron_active_gives_dense_logits(monkeypatch):
    """With threshold -inf the predictor marks every neuron: recall 1, KLD 0, top-1 100%."""
    monkeypatch.setenv("LLAMA_SPARSE_PRED_THRESHOLD", "-inf")
    path = fixture_dir() / "tiny.powerinfer.gguf"
    opts = EngineOptions(act_precision="f32", n_ctx=64, n_threads=1)
    sparse, dense = (
        Engine(path, opts),
        Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1, dense_ffn=True)),
    )
    assert sparse.sparse_stats is not None and dense.sparse_stats is None
    sparse.sparse_stats.track_recall()
    tokens = tokenize_text(sparse, (fixture_dir() / "text.txt").read_text().removesuffix("\n"))
    result = perplexity(sparse, tokens, PerplexityOptions(n_ctx=64, n_chunks=6), reference=dense)
    assert result.kld is not None and result.kld.count == 6 * 31
    assert result.kld.max < 1e-6 and result.kld.mean < 1e-6
    assert result.kld.top1 == 1.0
    assert result.ppl == pytest.approx(result.kld.ref_ppl, rel=1e-6)
    layers = predictor_recall(sparse.sparse_stats, sparse.config.n_ff)
    assert len(layers) == 4
    for r in layers:
        assert r.recall == 1.0 and r.missed == 0 and r.predicted_share == 1.0
        assert r.tokens == 6 * 64 and 0.2 < r.true_share < 0.6


def test_kl_divergence_base_file(tmp_path: Path, monkeypatch):
    """--kl-divergence-base: a base written from the all-active run gives the dense comparison's top-1 and,
    from top-64 of 512 tokens, nearly its KLD (a lower bound); a mismatched base is one clear error."""
    fx = fixture_dir()
    args = ["-m", str(fx / "tiny.powerinfer.gguf"), "-f", str(fx / "text.txt"), "-c", "64", "-t", "1"]
    base = tmp_path / "base.pt"
    monkeypatch.setenv("LLAMA_SPARSE_PRED_THRESHOLD", "-inf")
    wrote = run_ppl(*args, "--kl-divergence-base", str(base))
    assert wrote.exit_code == 0, wrote.stderr
    monkeypatch.delenv("LLAMA_SPARSE_PRED_THRESHOLD")
    dense = run_ppl(*args, "--kl-divergence")
    from_file = run_ppl(*args, "--kl-divergence", "--kl-divergence-base", str(base))
    assert dense.exit_code == 0 and from_file.exit_code == 0, from_file.stderr

    def stat(out: str, pattern: str) -> float:
        return float(re.search(pattern, out).group(1))

    for pattern in [r"Same top-1: (\d+\.\d+)", r"reference: (\d+\.\d+)"]:
        assert stat(from_file.stdout, pattern) == pytest.approx(stat(dense.stdout, pattern), rel=1e-4)
    kld_dense, kld_file = (stat(r.stdout, r"Mean    KLD: +(\d+\.\d+)") for r in (dense, from_file))
    assert kld_dense * 0.9 <= kld_file <= kld_dense + 1e-6
    other = run_ppl(*args[:-4], "-c", "32", "-t", "1", "--kl-divergence", "--kl-divergence-base", str(base))
    assert_one_error_line(other, "-c 64", "-c 32")


def test_strided_perplexity_first_window(expected):
    """--ppl-stride 16 -c 32: context 40, chunk i scores the last 16 predictions of tokens[16i : 16i+40]."""
    fx = fixture_dir()
    result = run_ppl(
        "-m",
        str(fx / "tiny.powerinfer.gguf"),
        "-f",
        str(fx / "text.txt"),
        "-c",
        "32",
        "--ppl-stride",
        "16",
        "--chunks",
        "3",
        "-t",
        "1",
    )
    assert result.exit_code == 0, result.stderr
    running, final, _ = parse_stdout(result.stdout)
    assert len(running) == 3
    engine = Engine(fx / "tiny.powerinfer.gguf", EngineOptions(act_precision="f32", n_ctx=40, n_threads=1))
    tokens = [1] + expected["perplexity_tokens"]
    logp = torch.log_softmax(engine.logits_all(tokens[:40]).double(), dim=-1)
    nll = -sum(float(logp[j, tokens[j + 1]]) for j in range(23, 39))
    assert running[0] == pytest.approx(math.exp(nll / 16), abs=1e-4)


# ---------------------------------------------------------------- SmolLM2 against transformers
N_CHUNKS_CI = 2
# -c 256, 2 chunks of python-reference-prose.txt vs transformers' float32 model on the same dequantized GGUF and the
# same token chunks (tests/data/smollm2-reference.json, written by tests/data/compare_smollm2.py, 8 significant
# digits; the live test recomputes it). Relative errors measured now:
#   f32 activations: 7.4e-8 (AVX-512 kernels), 1.0e-7 (AVX2), 2.5e-7 (scalar); live transformers 8.7e-8
#   q8 activations: -4.2e-3 (AVX-512, AVX2), -3.8e-3 (scalar)
SMOLLM2_PPL_REL_F32 = 5e-7  # 2x the worst kernel variant; q8 misses it by 8000x
SMOLLM2_PPL_REL_Q8 = (1e-3, 1.2e-2)  # |rel| within; the lower end fails an f32 run labelled q8


def smollm2_transformers_running() -> list[float]:
    return json.loads((DATA / "smollm2-reference.json").read_text())["transformers"]["running"][:N_CHUNKS_CI]


@pytest.mark.parametrize("act", ["f32", "q8"])
def test_smollm2_matches_transformers(act):
    """The CLI's printed values against transformers' (recorded: loading the GGUF into transformers alone takes
    longer than this file's time budget; test_smollm2_transformers_live recomputes it under the slow marker)."""
    path = smollm2_path()
    theirs = smollm2_transformers_running()
    result = run_ppl(
        "-m", str(path), "-f", str(TEXT), "-c", "256", "--chunks", str(N_CHUNKS_CI), "-t", "2",
        "--act-precision", act,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    running, final, _ = parse_stdout(result.stdout)
    assert len(running) == N_CHUNKS_CI and final == running[-1]
    if act == "f32":
        # 4 printed decimals hide anything below ~2.7e-6 relative, so the printed final value must be
        # transformers' rounded the same way (measured: equal). Transformers' 18.665172 lies 2.2e-5 (1.2e-6
        # relative) from a rounding boundary: 16x our AVX-512 error, 5x the scalar kernels'. Its first running
        # value 29.338148 lies 2e-6 from one, so there either rounding is right: one unit in the last place.
        # test_smollm2_perplexity_unrounded checks the unrounded values.
        assert f"{final:.4f}" == f"{theirs[-1]:.4f}"
        assert running[0] == pytest.approx(theirs[0], abs=1e-4)
    else:
        lo, hi = SMOLLM2_PPL_REL_Q8
        assert lo < abs(final / theirs[-1] - 1) < hi


def test_smollm2_perplexity_unrounded():
    """f32 activations: the library's perplexity (not rounded for printing) within 5e-7 of transformers'."""
    engine = Engine(smollm2_path(), EngineOptions(n_ctx=256, n_batch=256, n_threads=2, act_precision="f32"))
    tokens = tokenize_text(engine, TEXT.read_text(encoding="utf-8").removesuffix("\n"))
    ours = perplexity(engine, tokens, PerplexityOptions(n_ctx=256, n_chunks=N_CHUNKS_CI))
    theirs = smollm2_transformers_running()
    assert len(ours.running) == N_CHUNKS_CI
    for a, b in zip(ours.running, theirs, strict=True):
        assert abs(a / b - 1) < SMOLLM2_PPL_REL_F32, (a, b)


@pytest.mark.slow
def test_smollm2_transformers_live(hf_model):
    path = smollm2_path()
    engine = Engine(path, EngineOptions(n_ctx=256, n_batch=256, act_precision="f32"))
    tokens = tokenize_text(engine, TEXT.read_text(encoding="utf-8").removesuffix("\n"))
    opts = PerplexityOptions(n_ctx=256, n_chunks=2)
    ours = perplexity(engine, tokens, opts)
    _, model = hf_model
    nll, count = 0.0, 0
    with torch.inference_mode():
        for ch in plan_chunks(tokens, opts, None):
            logits = model(torch.tensor([ch.tokens])).logits[0, ch.first : ch.first + len(ch.targets)]
            logp = torch.log_softmax(logits.double(), dim=-1)
            nll -= float(logp.gather(1, torch.tensor(ch.targets)[:, None]).sum())
            count += len(ch.targets)
    # measured 8.7e-8 relative (AVX-512 kernels)
    assert ours.ppl == pytest.approx(math.exp(nll / count), rel=SMOLLM2_PPL_REL_F32)


# ---------------------------------------------------------------- bad input
def test_missing_text_file(tiny_gguf: Path, tmp_path: Path):
    assert_one_error_line(
        run_ppl("-m", str(tiny_gguf), "-f", str(tmp_path / "nope.txt"), "-c", "16"),
        "nope.txt",
        "no such file",
    )


def test_no_text_file_given(tiny_gguf: Path):
    assert_one_error_line(run_ppl("-m", str(tiny_gguf), "-c", "16"), "-f FILE")


def test_empty_text(tiny_gguf: Path, tmp_path: Path):
    text = tmp_path / "empty.txt"
    text.write_text("\n")
    assert_one_error_line(run_ppl("-m", str(tiny_gguf), "-f", str(text), "-c", "16"), "is empty")


def test_text_too_short(tiny_gguf: Path, tmp_path: Path):
    text = tmp_path / "short.txt"
    text.write_text("hello world\n")
    n = len(tokenize_text(Engine(tiny_gguf, EngineOptions(act_precision="f32", n_ctx=16)), "hello world"))
    assert n == 17  # BOS + byte-level pieces; the trailing newline is dropped as llama.cpp's -f does
    assert_one_error_line(
        run_ppl("-m", str(tiny_gguf), "-f", str(text), "-c", "16"),
        "at least 32 tokens",
        "context of 16",
        "the text has 17",
    )


def test_kl_divergence_needs_a_powerinfer_file(tiny_gguf: Path, tmp_path: Path):
    text = tmp_path / "t.txt"
    text.write_text("x" * 100)
    assert_one_error_line(
        run_ppl("-m", str(tiny_gguf), "-f", str(text), "-c", "16", "--kl-divergence"),
        "--kl-divergence",
        "dense GGUF",
    )


def test_dense_tiny_model_runs(tiny_gguf: Path, tmp_path: Path):
    """A dense GGUF: the CLI's numbers equal the library's, batch split (-b 8 < -c 16) included."""
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 3)
    result = run_ppl("-m", str(tiny_gguf), "-f", str(text), "-c", "16", "-b", "8", "-t", "1")
    assert result.exit_code == 0, result.stderr
    running, final, _ = parse_stdout(result.stdout)
    engine = Engine(tiny_gguf, EngineOptions(act_precision="f32", n_ctx=16, n_batch=16, n_threads=1))
    lib = perplexity(
        engine, tokenize_text(engine, text.read_text().removesuffix("\n")), PerplexityOptions(n_ctx=16)
    )
    assert len(running) == len(lib.running) == lib.n_tokens // 16 == 12
    assert running == pytest.approx(lib.running, abs=1e-4)


def test_kl_divergence_base_never_replaces_a_model(tmp_path: Path):
    """Without --kl-divergence the base file is written: a model file at that path (the -m of a mistyped command)
    is refused with one line, before any work, and left byte for byte."""
    import shutil

    fx = fixture_dir()
    model = tmp_path / "copy.powerinfer.gguf"
    shutil.copyfile(fx / "tiny.powerinfer.gguf", model)
    before = model.read_bytes()
    args = ["-m", str(fx / "tiny.powerinfer.gguf"), "-f", str(fx / "text.txt"), "-c", "64", "-t", "1"]
    r = run_ppl(*args, "--kl-divergence-base", str(model))
    assert_one_error_line(r, "is a model file: refusing to replace it")
    assert model.read_bytes() == before
