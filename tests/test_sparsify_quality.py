"""sparsify's quality report (sparsify.quality) and its calibration mix (--mix): what it prints is what
`powerinfer perplexity` measures on the same held-out texts; the warning line when texts disagree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import REPO, tiny_hf_llama, write_hf_llama_gguf
from typer.testing import CliRunner

from powerinfer.cli import app
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sparsify.pipeline import calibration_windows
from powerinfer.sparsify.quality import EVAL_CHUNKS, TextQuality, split_held_out, spread_warning
from powerinfer.texts import HELD_OUT_KINDS, calibration_mix, held_out_text, split_text

runner = CliRunner()
PROSE = REPO / "tests" / "data" / "python-reference-prose.txt"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_hf_llama_gguf(tiny_hf_llama(seed=3), tmp_path_factory.mktemp("q") / "tiny.gguf")


def test_packaged_texts_split_once():
    """Each held-out kind's two parts are its whole text, cut at a line break; the calibration mix never holds
    a held-out part; the held-out part is long enough to resolve a small perplexity change (SmolLM2 scores
    3175-3556 tokens of each in windows of 256: >= 24 windows, ~6000 tokens, ~24000 characters)."""
    for kind in HELD_OUT_KINDS:
        calib = dict(calibration_mix())[kind]
        held = held_out_text(kind)
        assert calib.endswith("\n") and len(held) > 24000 and len(calib) > 6000
        assert held not in calib and calib[-200:] not in held
    assert split_text("ab\ncd\nef", 0.5) == ("ab\ncd\n", "ef")


def test_split_held_out():
    ids = list(range(5000))
    calib, held = split_held_out(ids, 4096, 512, 256)
    assert calib == ids[:4096] and held == ids[4096:5000]  # the text after the calibration tokens
    calib, held = split_held_out(ids[:3000], 4096, 512, 256)
    assert calib == ids[: 3000 - 750] and held == ids[3000 - 750 : 3000]  # a tail carved out of them
    assert split_held_out(ids[:600], 4096, 512, 256) == (ids[:600], [])  # too short for two windows


def test_spread_warning():
    def q(name: str, ppl: float) -> TextQuality:
        return TextQuality(name, 100, ppl, 10.0, 0.01)

    assert spread_warning([q("a", 10.1), q("b", 10.25)]) is None  # 1.5 points apart
    line = spread_warning([q("a", 10.1), q("b", 10.35), q("c", 10.2)])
    assert line is not None and "\n" not in line
    assert "differs by 2.5 points" in line and "b +3.5%" in line and "a +1.0%" in line


def test_report_matches_perplexity(tiny: Path, tmp_path: Path):
    """The JSON's quality per text: the dense PPL is `powerinfer perplexity`'s on the input, the sparse PPL its on
    the output, over the same held-out text (-c 128, EVAL_CHUNKS chunks)."""
    text = tmp_path / "calib.txt"
    text.write_text(PROSE.read_text(encoding="utf-8")[:3000], encoding="utf-8")
    out = tmp_path / "tiny.cats.gguf"
    args = ["sparsify", "-t", "1", "-m", str(tiny), "-f", str(text), "--sparsity", "0.5", "-o", str(out)]
    r = runner.invoke(app, [*args, "-c", "128", "--max-tokens", "1000"])
    assert r.exit_code == 0, r.stderr
    quality = json.loads(r.stdout.strip().splitlines()[-1])["quality"]
    assert list(quality) == ["calibration (held out)", *HELD_OUT_KINDS]
    assert "Quality against the dense input" in r.stderr
    held = tmp_path / "held.txt"
    held.write_text(held_out_text("dialogue"), encoding="utf-8")
    for model, key in ((tiny, "dense_ppl"), (out, "ppl")):
        p = runner.invoke(
            app,
            [
                "perplexity",
                "-m",
                str(model),
                "-f",
                str(held),
                "-c",
                "128",
                "--chunks",
                str(EVAL_CHUNKS),
                "-t",
                "1",
            ],
        )
        assert p.exit_code == 0, p.stderr
        ppl = float(re.search(r"PPL = ([0-9.]+)", p.stdout + p.stderr).group(1))  # type: ignore[union-attr]
        assert abs(ppl - quality["dialogue"][key]) < 1e-3 * ppl, (key, ppl, quality["dialogue"])
    assert quality["dialogue"]["kld"] > 0


def test_mix_windows(tiny: Path):
    """--mix: the text gives half of --max-tokens, the packaged kinds as many tokens again in equal shares."""
    engine = Engine(tiny, EngineOptions(act_precision="f32", n_ctx=128, n_threads=1))
    text = PROSE.read_text(encoding="utf-8")[:6000]
    alone, held = calibration_windows(engine, text, 2000, mix=False)
    mixed, held_mix = calibration_windows(engine, text, 2000, mix=True)
    n_alone = sum(len(w) - 1 for w in alone)
    n_text = 1000
    assert n_alone == 2000 and len(held) == EVAL_CHUNKS * 128 and len(held_mix) == EVAL_CHUNKS * 128
    assert sum(len(w) - 1 for w in mixed) == n_text + len(calibration_mix()) * (
        n_text // len(calibration_mix())
    )
    assert mixed[: len(alone) // 2][0] == alone[0]
