"""The cached default model (sparsify.default): sealed by its SHA-256, made again when the check fails."""

from __future__ import annotations

from pathlib import Path

from powerinfer.sparsify.default import default_mode_line, default_sparse_options, is_ready, seal


def test_seal_catches_flips_and_truncation(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    opts = default_sparse_options(tmp_path / "src.gguf")
    out = Path(opts.output)
    out.parent.mkdir(parents=True)
    (out.parent / "activation").mkdir()
    payload = bytes(range(256)) * 4096  # 1 MiB stands in for the model file
    out.write_bytes(payload)
    assert not is_ready(opts)  # no seal yet: an interrupted first run is made again
    seal(opts)
    assert is_ready(opts)
    for offset in (0, len(payload) // 2, len(payload) - 4096, len(payload) - 1):
        bad = bytearray(payload)
        bad[offset] ^= 1
        out.write_bytes(bytes(bad))
        assert not is_ready(opts), offset
    for cut in (0, len(payload) - 1):
        out.write_bytes(payload[:cut])
        assert not is_ready(opts), cut
    out.write_bytes(payload)
    assert is_ready(opts)
    assert not list(out.parent.glob(".tmp-*"))


def test_mode_line_names_the_mode():
    line = default_mode_line()
    assert (
        line.startswith("default model: SmolLM2-135M-Instruct") and "sparse mode" in line and "\n" not in line
    )
