"""Speculative decoding on SmolLM2-135M: greedy output token-identical to plain decoding, in `main` and in the
server, for an F32, F16 and Q8_0 target with a Q4_0 draft, all four made from the wheel's Q4_1 file by our
`quantize --allow-requantize`. Plain decoding (the reference) is the engine's one-token loop."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import smollm2_path
from typer.testing import CliRunner

from powerinfer.cli import app
from powerinfer.ops import kernels_available
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.generate import Generator, GenParams
from powerinfer.runtime.speculative import SpecOptions
from powerinfer.sampling import SamplingParams
from powerinfer.tokenizer import StreamDecoder

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernels_available(), reason="powerinfer._kernels is not built"),
]

N_PREDICT = 128
# the F32 target carries the full length; F16 and Q8_0 (the same speculative loop over other row types) the first
# 64 tokens: greedy tokens are a prefix of the longer run's (plain decoding runs each target for its own length)
N_OF = {"F32": N_PREDICT, "F16": 64, "Q8_0": 64}
PROMPTS = [
    "The history of the printing press",
    "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n",
    "Ten facts about the planet Mars:\n1.",
    "<|im_start|>user\nRepeat this code exactly:\nfor i in range(10):\n    print(i * i)\n<|im_end|>\n"
    "<|im_start|>assistant\n",
]
runner = CliRunner()


@pytest.fixture(scope="session")
def smol_quants(tmp_path_factory) -> dict[str, Path]:
    """SmolLM2 requantized by `powerinfer quantize --allow-requantize` to F32, F16, Q8_0 and Q4_0."""
    root = tmp_path_factory.mktemp("smol-quants")
    out = {}
    for name in ("F32", "F16", "Q8_0", "Q4_0"):
        path = root / f"smollm2-{name}.gguf"
        result = runner.invoke(app, ["quantize", "--allow-requantize", str(smollm2_path()), str(path), name])
        assert result.exit_code == 0, result.stderr
        out[name] = path
    return out


@pytest.fixture(scope="module")
def plain(smol_quants) -> dict[str, list[list[int]]]:
    """Each target's plain greedy tokens (main's default penalties) for every prompt: the one-token step loop
    without drafts, the prompts decoded side by side (batch invariance: as if one at a time)."""
    refs = {}
    for name in ("F32", "F16", "Q8_0"):
        engine = Engine(smol_quants[name], EngineOptions(n_ctx=512, n_threads=2, n_seq=len(PROMPTS)))
        tok = engine.tokenizer
        gen = Generator(engine)
        out: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
        params = GenParams(sampling=SamplingParams(temp=0.0), n_predict=N_OF[name], ignore_eos=True)
        events = [
            ev
            for i, p in enumerate(PROMPTS)
            for ev in gen.start(i, tok.encode(p, parse_special=True), params)
        ]
        while events:
            for ev in events:
                out[ev.slot].append(ev.token)
            events = gen.step()
        refs[name] = [out[i] for i in range(len(PROMPTS))]
        refs["tokenizer"] = tok  # type: ignore[assignment]
    return refs


def _text(tok, tokens: list[int]) -> str:
    d = StreamDecoder(tok)
    return "".join(d.feed(t) for t in tokens) + d.flush()


@pytest.mark.parametrize("target", ["F32", "F16", "Q8_0"])
def test_main_greedy_is_plain_decoding(smol_quants, plain, target):
    tok = plain["tokenizer"]
    drafted = accepted = 0
    # F32 runs every prompt; F16 and Q8_0 the first three here (the server test runs all five for every target)
    n = len(PROMPTS) if target == "F32" else 3
    for prompt, want in zip(PROMPTS[:n], plain[target][:n], strict=True):
        result = runner.invoke(
            app,
            [
                "main", "-m", str(smol_quants[target]), "-md", str(smol_quants["Q4_0"]), "-p", prompt,
                "-n", str(N_OF[target]), "--temp", "0", "--ignore-eos", "-t", "2", "-c", "512",
            ],
        )  # fmt: skip
        assert result.exit_code == 0, result.stderr
        assert result.stdout == prompt + _text(tok, want) + "\n"
        (line,) = [ln for ln in result.stderr.splitlines() if "speculative =" in ln]
        d, a = [int(w) for w in line.replace(",", " ").split() if w.isdigit()][:2]
        drafted, accepted = drafted + d, accepted + a
    # measured (F32 / F16 / Q8_0 target): about 75% of the drafted tokens accepted
    assert accepted >= 0.4 * drafted > 0


@pytest.mark.parametrize("target", ["F32", "F16", "Q8_0"])
def test_server_greedy_is_plain_decoding(smol_quants, plain, target):
    """The 5 prompts at once on 5 slots (drafted and verified in shared steps), each equal to plain decoding;
    the timings object carries draft_n and draft_n_accepted."""
    pytest.importorskip("fastapi")
    from server_helpers import live_server, request

    from powerinfer.server import ServerOptions

    tok = plain["tokenizer"]
    opts = ServerOptions(
        model=smol_quants[target],
        engine=EngineOptions(n_ctx=512, n_seq=len(PROMPTS), n_threads=2),
        speculative=SpecOptions(draft_model=smol_quants["Q4_0"]),
    )
    ids = [tok.encode(p, add_bos=None, parse_special=True) for p in PROMPTS]
    with live_server(opts) as srv:

        def ask(prompt: list[int]):
            body = {"prompt": prompt, "n_predict": N_OF[target], "temperature": 0, "ignore_eos": True}
            return request(srv, "POST", "/completion", body, timeout=600)

        with ThreadPoolExecutor(len(ids)) as pool:
            answers = list(pool.map(ask, ids))
    for (status, out, _), want in zip(answers, plain[target], strict=True):
        assert status == 200, out
        assert out["content"] == _text(tok, want)
        t = out["timings"]
        assert t["predicted_n"] == N_OF[target]
        assert 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert sum(a[1]["timings"]["draft_n_accepted"] for a in answers) > 0
