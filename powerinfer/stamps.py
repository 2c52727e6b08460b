"""Version stamps of derived files: the format version and the version of the code that made them, in one place.

Every file powerinfer derives from a model carries its kind's FORMAT (the layout a reader expects; a change of
meaning bumps it) and the CODE version that made it: the package version plus the revision of the kind's
producing algorithm (REVISIONS; bump it when the algorithm changes, e.g. how a head screen is calibrated, so
that files made by the older algorithm are recognised). GGUF outputs hold both as metadata keys (KEY_FORMAT,
KEY_CODE); other files as a header field or a `stamp.json` beside their content.

On load (`check`): a cached file (the head-screen cache, the default model, `.generated.gpuidx`) that is not
current is rebuilt with one log line; a user's file (sparsify output, profile folders, session files) made by
other code is used with one warning, and refused where its format version differs (its meaning changed).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from powerinfer import __version__

log = logging.getLogger(__name__)

KEY_FORMAT = "powerinfer.stamp.format"  # uint32
KEY_CODE = "powerinfer.stamp.code"  # string: CODE version
STAMP_FILE = "stamp.json"  # folder outputs: {"kind", "format", "code"}

# kind -> (format version, algorithm revision)
REVISIONS: dict[str, tuple[int, int]] = {
    # the sparse head's screen: 2 = the broad calibration mix with the user's text (issue 50)
    "head_screen": (1, 2),
    # the cached default model (a dense copy with the head's screen)
    "default_model": (1, 2),
    # sparsify outputs (CATS, TEAL, MoE thresholds)
    "sparse": (1, 2),
    # profile's activation/ and train-predictor's folder
    "profile": (1, 1),
    # .generated.gpuidx
    "gpu_index": (1, 1),
    # --prompt-cache session files (the format is also runtime.session.SESSION_VERSION)
    "session": (2, 1),
}


def format_version(kind: str) -> int:
    return REVISIONS[kind][0]


def code_version(kind: str) -> str:
    """The package version plus the revision of `kind`'s producing algorithm, e.g. "0.1.0+head_screen.2"."""
    return f"{__version__}+{kind}.{REVISIONS[kind][1]}"


@dataclass(frozen=True)
class Verdict:
    """How a file's stamp compares with this code: current, stale (other code, same format), changed (another
    format: its meaning changed) or missing (no stamp: made before stamps)."""

    state: str
    found: str  # what the file says, for messages

    @property
    def current(self) -> bool:
        return self.state == "current"

    @property
    def changed(self) -> bool:
        return self.state == "changed"


def check(kind: str, found_format: object, found_code: object) -> Verdict:
    """Compare a file's stamp (None where absent) with this code's for `kind`."""
    if found_format is None and found_code is None:
        return Verdict("missing", "no version stamp")
    found = f"format {found_format}, made by {found_code}"
    if found_format != format_version(kind):
        return Verdict("changed", found)
    if found_code != code_version(kind):
        return Verdict("stale", found)
    return Verdict("current", found)


def gguf_items(kind: str) -> list[tuple[str, Any]]:
    """(key, value) of the stamp for a GGUF writer: format (uint32) and code (string)."""
    return [(KEY_FORMAT, format_version(kind)), (KEY_CODE, code_version(kind))]


def check_gguf(kind: str, metadata: dict[str, Any]) -> Verdict:
    return check(kind, metadata.get(KEY_FORMAT), metadata.get(KEY_CODE))


def header(kind: str) -> dict[str, object]:
    """The stamp as a header field of a non-GGUF file: {"kind", "format", "code"}."""
    return {"kind": kind, "format": format_version(kind), "code": code_version(kind)}


def check_header(kind: str, value: object) -> Verdict:
    if not isinstance(value, dict):
        return check(kind, None, None)
    return check(kind, value.get("format"), value.get("code"))


def write_stamp_file(folder: Path, kind: str) -> None:
    (Path(folder) / STAMP_FILE).write_text(json.dumps(header(kind)) + "\n", encoding="utf-8")


def check_stamp_file(folder: Path, kind: str) -> Verdict:
    """The verdict on a folder output's stamp.json (missing where absent or unreadable)."""
    try:
        value = json.loads((Path(folder) / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        value = None
    return check_header(kind, value)


def check_folder(folder: Path, kind: str, what: str) -> None:
    """A user's folder output on load: FormatError where its stamp says another format; one warning where other
    code made it; silent without a stamp (PowerInfer's own folders have none)."""
    from powerinfer.errors import FormatError

    verdict = check_stamp_file(folder, kind)
    if verdict.changed:
        raise FormatError(f"{what} {folder} has another format ({verdict.found}): make it again")
    if verdict.state == "stale":
        warn_user_file(f"{what} {folder}", verdict)


def warn_user_file(what: str, verdict: Verdict) -> None:
    """The one warning for a user's file made by other code (callers refuse `changed` files themselves)."""
    if verdict.current:
        return
    log.warning(
        "%s was made by another version of powerinfer (%s; this is %s): it is used as it is; make it again for "
        "the current algorithm",
        what,
        verdict.found,
        __version__,
    )
