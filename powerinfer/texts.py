"""The packaged texts (powerinfer/data/): a broad calibration mix and held-out slices of other kinds of text.

Four kinds: `docstrings` (calibration.txt, Python standard-library docstrings; calibration only), and three
texts written for this project, `prose` (narrative prose), `code` (code documentation of made-up tools) and
`dialogue` (conversations and chat turns). Each of the three is split once at a line boundary: the first
CALIBRATION_SHARE of its bytes joins the calibration mix, the rest is held out for scoring and never calibrated
on (long enough that a perplexity change of ~0.2% shows: SmolLM2 scores 3175-3556 tokens of each in windows of
256). The head's screen (model.head) and the sparsify thresholds calibrate on the mix together with the user's text;
sparsify scores its output on the held-out slices (sparsify.quality).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
CALIBRATION_SHARE = (
    0.2  # of each held-out kind's bytes, the first part: calibration (1600-1800 tokens); the rest held out
)


@dataclass(frozen=True)
class PackagedText:
    kind: str
    file: str
    held_out: bool  # False: the whole file is calibration text

    def text(self) -> str:
        return (DATA / self.file).read_text(encoding="utf-8")


TEXTS = (
    PackagedText("docstrings", "calibration.txt", held_out=False),
    PackagedText("prose", "prose.txt", held_out=True),
    PackagedText("code", "codedoc.txt", held_out=True),
    PackagedText("dialogue", "dialogue.txt", held_out=True),
)
HELD_OUT_KINDS = tuple(t.kind for t in TEXTS if t.held_out)


def split_text(text: str, share: float) -> tuple[str, str]:
    """(head, tail) of `text` cut at the first line break at or after `share` of its characters."""
    cut = text.find("\n", int(len(text) * share))
    if cut < 0:
        return text, ""
    return text[: cut + 1], text[cut + 1 :]


def packaged(kind: str) -> PackagedText:
    for t in TEXTS:
        if t.kind == kind:
            return t
    raise KeyError(kind)


def calibration_text(kind: str) -> str:
    """The calibration part of a packaged text (the whole of `docstrings`)."""
    t = packaged(kind)
    return split_text(t.text(), CALIBRATION_SHARE)[0] if t.held_out else t.text()


def held_out_text(kind: str) -> str:
    """The held-out part of a packaged text of kind HELD_OUT_KINDS."""
    t = packaged(kind)
    if not t.held_out:
        raise KeyError(f"{kind} has no held-out part")
    return split_text(t.text(), CALIBRATION_SHARE)[1]


def calibration_mix() -> list[tuple[str, str]]:
    """(kind, calibration text) of every packaged kind: the broad mix."""
    return [(t.kind, calibration_text(t.kind)) for t in TEXTS]
