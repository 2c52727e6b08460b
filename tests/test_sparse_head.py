"""The sparse output head (model.head): a low-rank screen, exact logits for its candidates, the exact fallback.

The oracle is the whole head (ops.linear over every row, itself tested against transformers in test_smollm2.py)
on the real SmolLM2 weights; held-out text is tests/data/python-reference-prose.txt, the screen is calibrated on
the packaged calibration text (another domain).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from powerinfer import ops
from powerinfer.cli import app
from powerinfer.gguf import read_gguf
from powerinfer.model.blocks import Head
from powerinfer.model.head import (
    SCREEN,
    SCREEN_PROJ,
    HeadStats,
    SparseHead,
    build_head_screen,
    screen_pays,
    screen_rank,
)
from powerinfer.runtime import head_cache
from powerinfer.runtime.engine import CALIBRATION_TEXT, Engine, EngineOptions
from tests.conftest import smollm2_path

HELD_OUT = Path(__file__).parent / "data" / "python-reference-prose.txt"


def hidden(engine: Engine, path: Path, n_tokens: int) -> torch.Tensor:
    ids = engine.tokenizer.encode(path.read_text(encoding="utf-8"))[:n_tokens]
    return torch.cat([engine.hidden_states(0, ids[i : i + 256]) for i in range(0, len(ids), 256)])


@pytest.fixture(scope="module", params=["q8", "f32"])
def smollm2(request):
    """(engine with the whole head, its SparseHead on a screen calibrated on 1024 tokens, held-out states)."""
    engine = Engine(
        smollm2_path(), EngineOptions(n_ctx=256, n_threads=2, act_precision=request.param, sparse_head=False)
    )
    # the states below are final-normed already: the head under test takes them as they are
    head = Head(lambda x: x, engine.model.head.output, engine.kc)  # type: ignore[arg-type]
    calib = hidden(engine, CALIBRATION_TEXT, 1024)
    proj, screen = build_head_screen(head.output, calib).weights(*head.output.shape)
    sparse = SparseHead(head, proj, screen, engine.kc)
    x = hidden(engine, HELD_OUT, 512)
    return engine, sparse, x


@pytest.fixture(scope="module")
def screen_cache(tmp_path_factory):
    """One cache folder for this module's engines: the screen is calibrated once (~5 s) and loaded after."""
    folder = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("XDG_CACHE_HOME", str(folder))
        yield folder


def test_screen_shape_and_pays():
    assert screen_rank(576) == 256 and screen_rank(2048) == 896 and screen_rank(64) == 32
    engine = Engine(
        smollm2_path(), EngineOptions(act_precision="f32", n_ctx=64, n_threads=1, sparse_head=False)
    )
    assert screen_pays(engine.model.head.output)  # 7.9 MB of screen against the 30.1 MB Q8_0 head


def test_greedy_and_candidates_match_the_whole_head(smollm2):
    engine, sparse, x = smollm2
    full = ops.linear(x, sparse.output, engine.kc)
    got = sparse(x)
    # measured: the dense argmax on all 512 held-out tokens (and 4096 in the study), in q8 and f32; the target
    # is 99.5%, a screen that missed the argmax without noticing would fall below it at once
    agree = (got.argmax(1) == full.argmax(1)).float().mean().item()
    assert agree >= 0.995, agree
    # the candidates' logits are the whole head's bits (rows_matmul and linear share the row kernels)
    top = got.topk(64, dim=1).indices
    assert torch.equal(got.gather(1, top), full.gather(1, top))
    # the rest are the screen's estimates: measured error std 1.07 logits on SmolLM2; a screen of the wrong
    # basis (the head's own SVD) errs by ~4
    assert (got - full).std().item() < 1.6
    assert sparse.stats.tokens == 512 and sparse.stats.fallbacks <= 2


def test_each_token_on_its_own(smollm2):
    """A token's logits do not depend on the other rows of the step."""
    _, sparse, x = smollm2
    batch = sparse(x[:6])
    for t in range(6):
        assert torch.equal(batch[t], sparse(x[t : t + 1])[0]), t


def test_a_weak_screen_widens_and_falls_back(smollm2):
    """A screen of rank 32 errs ~4x more and misses the argmax often; the margin check widens those tokens or
    computes the whole head. The margin is an estimate from the candidates' errors, not a bound (the rows left
    out with a high logit are those the screen underrated most), so it recovers part of the misses only: the
    rank-256 default is what makes greedy agree (measured 2047 of 2048 held-out tokens in the study)."""
    engine, sparse, x = smollm2
    calib = hidden(engine, CALIBRATION_TEXT, 1024)
    proj, screen = build_head_screen(sparse.output, calib, rank=32).weights(*sparse.output.shape)
    head = Head(lambda x: x, sparse.output, engine.kc)  # type: ignore[arg-type]
    weak = SparseHead(head, proj, screen, engine.kc, n_candidates=64, widen_mass=1.0)  # the margin alone
    x = x[:256].contiguous()
    full = ops.linear(x, weak.output, engine.kc)
    got = weak(x)
    assert weak.stats.fallbacks + weak.stats.widened > 10
    # one token at a time the head runs its chain in one kernel call (ops.head_chain), then the same check: the
    # same bits as the batch's op-by-op path, on tokens the check widened or computed whole too
    assert weak.chain is not None
    settled = weak.stats.fallbacks + weak.stats.widened
    for t in range(0, 256, 5):
        assert torch.equal(weak(x[t : t + 1])[0], got[t]), t
    assert weak.stats.fallbacks + weak.stats.widened > settled
    # the candidates alone (no check): the exact argmax among the screen's 64 best rows
    screened = ops.linear(ops.linear(x, proj, engine.kc).contiguous(), screen, engine.kc)
    cand = screened.topk(64, dim=1).indices
    alone = cand.gather(1, full.gather(1, cand).argmax(1, keepdim=True)).squeeze(1)
    truth = full.argmax(1)
    # measured 211 against 209 of 256: the check recovers few misses of a weak screen
    assert int((got.argmax(1) == truth).sum()) >= int((alone == truth).sum())
    # with no room to widen, the unsafe tokens are computed whole: the whole head's bits
    weak.max_extra, weak.stats = 0, HeadStats()
    again = weak(x)
    whole = [t for t in range(x.shape[0]) if torch.equal(again[t], full[t])]
    assert len(whole) == weak.stats.fallbacks >= 10 and weak.stats.widened == 0


def test_spread_widens_to_more_exact_rows(smollm2):
    """A token whose screen leaves more than widen_mass of its probability outside the candidates gets about
    WIDEN_FACTORS[-1] times as many exact rows: every token at widen_mass -1, none at 1; the same bits one token at a time
    (the chain) as in the batch."""
    engine, sparse, x = smollm2
    x = x[:24].contiguous()
    full = ops.linear(x, sparse.output, engine.kc)
    head = Head(lambda x: x, sparse.output, engine.kc)  # type: ignore[arg-type]
    wide = SparseHead(head, sparse.proj, sparse.screen, engine.kc, widen_mass=-1.0)
    plain = SparseHead(head, sparse.proj, sparse.screen, engine.kc, widen_mass=1.0)
    got_wide, got_plain = wide(x), plain(x)
    assert wide.stats.spread == 24 and plain.stats.spread == 0
    # exact rows: within 1e-3 of the whole head's logits (the screen errs by ~0.1-1 elsewhere)
    n_wide = ((got_wide - full).abs() < 1e-3).sum(1).float()
    n_plain = ((got_plain - full).abs() < 1e-3).sum(1).float()
    assert (n_wide > 3 * n_plain).all(), (n_wide, n_plain)  # two steps: ~4x
    for t in range(0, 24, 5):
        assert torch.equal(wide(x[t : t + 1])[0], got_wide[t]), t


def test_a_screen_of_ties_computes_the_whole_head(smollm2):
    """A screen whose values all tie (a zero screen) selects no sound set: the chain's sampled threshold takes every
    row, more than the room for the candidates, so it falls back to the exact k, and the widening's set overflows
    too; the token is computed whole. The whole head's bits on every token, in a batch and one at a time."""
    engine, sparse, x = smollm2
    x = x[:4].contiguous()
    full = ops.linear(x, sparse.output, engine.kc)
    zero = ops.QWeight(torch.zeros_like(sparse.screen.raw), sparse.screen.ggml_type, sparse.screen.shape)
    head = Head(lambda x: x, sparse.output, engine.kc)  # type: ignore[arg-type]
    flat = SparseHead(head, sparse.proj, zero, engine.kc, widen_mass=-1.0)
    assert flat.chain is not None
    assert torch.equal(flat(x), full)
    assert flat.stats.fallbacks == 4
    for t in range(4):
        assert torch.equal(flat(x[t : t + 1])[0], full[t]), t
    assert flat.stats.fallbacks == 8


def test_engine_builds_and_reports_it(screen_cache: Path):
    """--sparse-head on a dense file calibrates a screen at load (kept in the cache folder); greedy decode
    equals the whole head's."""
    options = EngineOptions(act_precision="f32", n_ctx=128, n_threads=2, sparse_head=True)
    engine = Engine(smollm2_path(), options)
    assert isinstance(engine.model.head, SparseHead)
    dense = Engine(
        smollm2_path(), EngineOptions(act_precision="f32", n_ctx=128, n_threads=2, sparse_head=False)
    )
    ids = engine.tokenizer.encode("The capital of France is")
    a, b = engine.eval(ids), dense.eval(ids)
    for _ in range(16):
        ta, tb = int(a.argmax()), int(b.argmax())
        assert ta == tb
        a, b = engine.eval([ta]), dense.eval([tb])
    lines = engine.sparse_report()
    assert lines[0].startswith("head: sparse (screen of rank 256, 2048 exact candidates)")
    # bytes per token: the file's 92.1 MiB less the 28.7 MiB head plus ~7.6 MiB of screen and candidates and the
    # widened tokens' rows (measured 8.2 MiB over these 17 tokens)
    per_token = engine.read_bytes_per_token() / 2**20
    assert 68 < per_token < 74, per_token


def test_same_bits_however_the_token_arrives(screen_cache: Path):
    """A token's logits through the sparse head are the same bits in a whole prompt, a prompt split in three, a
    decode step shared with another sequence, and at 1 or 2 threads."""
    outs = []
    for threads in (2, 1):
        e = Engine(
            smollm2_path(),
            EngineOptions(act_precision="f32", n_ctx=128, n_threads=threads, n_seq=3, sparse_head=True),
        )
        assert isinstance(e.model.head, SparseHead)
        ids = e.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
        whole = e.prefill(0, ids)
        e.free(0)
        e.prefill(0, ids[:5])
        e.prefill(0, ids[5:-1], 5)
        split = e.prefill(0, ids[-1:], len(ids) - 1)
        e.prefill(1, ids[:-1])
        e.prefill(2, [1, 2, 3, 4])
        mixed = e.decode([2, 1], [9, ids[-1]])[1]
        assert torch.equal(whole, split) and torch.equal(whole, mixed)
        outs.append(whole)
    assert torch.equal(outs[0], outs[1])


def test_sparse_head_refused_with_a_pool_device():
    """The screen runs on the CPU head: with the layers on a pool device --sparse-head is one error line."""
    from typer.testing import CliRunner

    args = [
        "main",
        "-m",
        str(smollm2_path()),
        "--sparse-head",
        "--pool-device",
        "cpu",
        "-ngl",
        "99",
        "-p",
        "hi",
    ]
    r = CliRunner().invoke(app, [*args, "-n", "2"])
    assert r.exit_code == 1
    assert "--sparse-head runs on the CPU head only" in r.output
    assert r.output.strip().count("\n") == 0


def test_sparsify_writes_the_screen(smollm2_sparsified, tmp_path: Path):
    """Written by sparsify into the PWRI file (the session's greedy run, conftest.py); the engine loads it by
    default and --no-sparse-head skips it."""
    _, out, result = smollm2_sparsified
    assert result.exit_code == 0, result.stderr
    tensors = read_gguf(out).tensors
    assert tensors[SCREEN_PROJ].shape == (256, 576) and tensors[SCREEN].shape == (49152, 256)
    assert isinstance(
        Engine(out, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1)).model.head, SparseHead
    )
    plain = Engine(out, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1, sparse_head=False))
    assert not isinstance(plain.model.head, SparseHead)
    # quantize keeps the screen as written (its types are part of its design), whatever the target
    from typer.testing import CliRunner

    q8 = tmp_path / "s.q8_0.powerinfer.gguf"
    r = CliRunner().invoke(app, ["quantize", "--allow-requantize", str(out), str(q8), "q8_0", "2"])
    assert r.exit_code == 0, r.output
    after = read_gguf(q8).tensors
    for name in (SCREEN, SCREEN_PROJ):
        assert after[name].ggml_type == tensors[name].ggml_type
        assert bytes(after[name].data) == bytes(tensors[name].data)
    assert isinstance(
        Engine(q8, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1)).model.head, SparseHead
    )


def test_cached_screen_is_checked(screen_cache: Path, monkeypatch, caplog):
    """A later load takes the cached screen; a flipped byte anywhere in it is caught and the screen rebuilt."""
    options = EngineOptions(act_precision="f32", n_ctx=128, n_threads=2, sparse_head=True)
    first = Engine(smollm2_path(), options).model.head
    path = head_cache.cache_path(smollm2_path())
    assert path.is_file() and not list(path.parent.glob(".tmp-*"))

    def no_calibration(self, output):
        raise AssertionError("calibrated again")

    with monkeypatch.context() as m:
        m.setattr(Engine, "calibrated_screen", no_calibration)
        again = Engine(smollm2_path(), options).model.head
    assert isinstance(first, SparseHead) and isinstance(again, SparseHead)
    assert torch.equal(first.screen.raw, again.screen.raw) and torch.equal(first.proj.raw, again.proj.raw)
    data = bytearray(path.read_bytes())
    for offset in (len(data) // 3, len(data) - 100):  # inside the screen's blocks, then the digest
        bad = bytearray(data)
        bad[offset] ^= 0x40
        path.write_bytes(bytes(bad))
        assert (
            head_cache.load(smollm2_path(), (tuple(first.proj.raw.shape), tuple(first.screen.raw.shape)))
            is None
        )
    path.write_bytes(data[:1000])  # truncated
    with caplog.at_level("WARNING"):
        rebuilt = Engine(smollm2_path(), options).model.head
    assert "ignoring the cached head screen" in caplog.text
    assert isinstance(rebuilt, SparseHead) and torch.equal(rebuilt.screen.raw, first.screen.raw)
