"""What a sparsified file costs, where: perplexity and KL divergence against the dense input on a held-out slice of
the calibration text and on the packaged held-out texts of other kinds (powerinfer.texts: prose, code
documentation, dialogue).

Thresholds and the head's screen calibrated on one narrow kind of text can cost more on other kinds than on the
calibration text itself; `sparsify` prints both and warns when the increases differ by more than SPREAD_POINTS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from powerinfer.eval.perplexity import PerplexityOptions, perplexity
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.texts import HELD_OUT_KINDS, held_out_text

EVAL_CTX = 256  # tokens per scored window (second halves scored, as `perplexity` does)
EVAL_CHUNKS = 4  # windows per text at most
SPREAD_POINTS = 2.0  # percentage points of perplexity increase between texts that draw a warning
CALIBRATION = "calibration (held out)"


@dataclass(frozen=True)
class TextQuality:
    name: str
    n_tokens: int  # tokens scored
    ppl: float
    dense_ppl: float
    kld: float

    @property
    def increase(self) -> float:
        """Perplexity increase over the dense input, in percent."""
        return (self.ppl / self.dense_ppl - 1.0) * 100.0

    def summary(self) -> dict[str, object]:
        return {
            "n_tokens": self.n_tokens,
            "ppl": round(self.ppl, 4),
            "dense_ppl": round(self.dense_ppl, 4),
            "increase_pct": round(self.increase, 3),
            "kld": round(self.kld, 6),
        }


def eval_context(n_ctx: int) -> int:
    return min(EVAL_CTX, n_ctx)


def split_held_out(
    ids: list[int], max_tokens: int, n_ctx: int, min_tokens: int
) -> tuple[list[int], list[int]]:
    """(calibration tokens, held-out tokens) of the calibration text: the held-out slice is the text after the
    calibration tokens (at most EVAL_CHUNKS windows), else a tail carved out of them where MIN_TOKENS stay; empty
    when the text is too short for two windows of eval_context(n_ctx)."""
    ctx = eval_context(n_ctx)
    want = EVAL_CHUNKS * ctx
    calib = ids[:max_tokens] if max_tokens > 0 else list(ids)
    rest = ids[len(calib) :]
    if len(rest) >= 2 * ctx:
        return calib, rest[:want]
    n = min(want, len(calib) // 4)
    if n >= 2 * ctx and len(calib) - n >= min_tokens:
        return calib[:-n], calib[-n:]
    return calib, []


def score(sparse: Engine, dense: Engine, name: str, tokens: list[int]) -> TextQuality | None:
    """Perplexity of both engines and KL divergence over `tokens` (BOS per the vocabulary first); None when the
    text is shorter than two windows."""
    ctx = eval_context(sparse.n_ctx)
    bos = sparse.tokenizer.bos_id if sparse.tokenizer.add_bos else None
    stream = ([bos] if bos is not None else []) + tokens
    if len(stream) < 2 * ctx:
        return None
    r = perplexity(sparse, stream, PerplexityOptions(n_ctx=ctx, n_chunks=EVAL_CHUNKS), reference=dense)
    assert r.kld is not None
    return TextQuality(name, r.count, r.ppl, r.kld.ref_ppl, r.kld.mean)


def measure(
    output: Path, model: Path, held_out: list[int], n_ctx: int, n_threads: int | None
) -> list[TextQuality]:
    """The sparse file `output` against the dense `model` (whole head) on the calibration text's held-out tokens
    and the packaged held-out texts, q8 activations (the engine's default)."""
    ctx = eval_context(n_ctx)
    sparse = Engine(output, EngineOptions(n_ctx=ctx, n_threads=n_threads))
    dense = Engine(model, EngineOptions(n_ctx=ctx, n_threads=n_threads, sparse_head=False))
    texts = [(CALIBRATION, held_out)] + [
        (kind, sparse.tokenizer.encode(held_out_text(kind), add_bos=False, parse_special=False))
        for kind in HELD_OUT_KINDS
    ]
    results = [score(sparse, dense, name, tokens) for name, tokens in texts if tokens]
    return [r for r in results if r is not None]


def spread_warning(results: list[TextQuality]) -> str | None:
    """One line when the perplexity increases differ by more than SPREAD_POINTS between texts, else None."""
    if len(results) < 2:
        return None
    low = min(results, key=lambda r: r.increase)
    high = max(results, key=lambda r: r.increase)
    if high.increase - low.increase <= SPREAD_POINTS:
        return None
    return (
        f"warning: the sparse file's perplexity increase differs by {high.increase - low.increase:.1f} points "
        f"between texts ({high.name} {high.increase:+.1f}%, {low.name} {low.increase:+.1f}%): its thresholds may "
        "not transfer to text unlike the calibration text"
    )
