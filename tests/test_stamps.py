"""Version stamps of derived files (powerinfer.stamps): every derived file carries its format and the version of
the code that made it; on load a stale cached file is made again with one line, a stale user file is used with
one warning, and a file of another format is refused. Tiny models throughout."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_llama_state, write_llama_gguf

from powerinfer import stamps
from powerinfer.errors import FormatError
from powerinfer.gguf import GGUFWriter, read_gguf
from powerinfer.gguf.constants import Keys, ValueType
from powerinfer.model.head import HeadScreen
from powerinfer.placement.gpu_index import GPUIndex, load_cached_gpu_index, write_gpu_index
from powerinfer.placement.stats import load_activation_stats
from powerinfer.runtime import head_cache
from powerinfer.runtime.assembly import check_stamp
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.session import load_session, save_session
from powerinfer.sparsify import default
from powerinfer.sparsify.write import write_activation_folder

OLD_CODE = "0.0.9+old.1"


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_llama_gguf(tmp_path / "tiny.gguf", random_llama_state(n_head_kv=2), n_head=4, n_head_kv=2)


def restamp(path: Path, code: str, fmt: int | None = None) -> None:
    """Rewrite a GGUF in place with its stamp's code version (and format) replaced: an older code's file."""
    f = read_gguf(path)
    tmp = path.with_name(path.name + ".re")
    w = GGUFWriter(tmp, sparse=f.is_sparse, alignment=f.alignment)
    f.copy_metadata(w, frozenset({stamps.KEY_CODE, stamps.KEY_FORMAT, Keys.ALIGNMENT}))
    w.add(stamps.KEY_FORMAT, int(f.metadata[stamps.KEY_FORMAT]) if fmt is None else fmt, ValueType.UINT32)
    w.add(stamps.KEY_CODE, code, ValueType.STRING)
    for t in f.tensors.values():
        w.add_tensor(t.name, t.data, t.ggml_type, t.shape)
    w.write()
    del f
    tmp.replace(path)


def test_verdicts():
    kind = "sparse"
    here = (stamps.format_version(kind), stamps.code_version(kind))
    assert stamps.check(kind, *here).current
    assert stamps.check(kind, here[0], OLD_CODE).state == "stale"
    assert stamps.check(kind, here[0] + 1, here[1]).changed
    assert stamps.check(kind, None, None).state == "missing"
    # the code version is the package version plus the kind's algorithm revision
    from powerinfer import __version__

    assert stamps.code_version("head_screen").startswith(__version__ + "+head_screen.")


def test_cached_default_model_made_by_older_code_is_made_again(
    tiny: Path, tmp_path: Path, monkeypatch, capsys
):
    """The default model's cache (made here from a tiny stand-in for the wheel's file): made once, reused, and
    made again on the next run when its stamp says older code (one line says so)."""
    from powerinfer.app.console import resolve_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(default, "smollm2_gguf", lambda: tiny)
    d = default.default_model(tiny)
    assert resolve_model(None) == d.output
    assert "first run" in capsys.readouterr().err
    meta = read_gguf(d.output).metadata
    assert meta[stamps.KEY_CODE] == stamps.code_version("default_model")
    assert "output_screen.weight" in read_gguf(d.output).tensors
    assert resolve_model(None) == d.output and "first run" not in capsys.readouterr().err
    restamp(d.output, OLD_CODE)  # a file an older version made and sealed
    default.seal(d)
    assert (
        default.not_ready(d)
        == f"the cached default model {d.output} was made by other code (format 1, made by {OLD_CODE})"
    )
    assert resolve_model(None) == d.output
    err = capsys.readouterr().err
    assert f"made by {OLD_CODE}): making it again" in err and "first run" not in err
    assert read_gguf(d.output).metadata[stamps.KEY_CODE] == stamps.code_version("default_model")
    assert default.is_ready(d)


def test_head_cache_stamp(tmp_path: Path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 100)
    rng = np.random.default_rng(0)
    screen = HeadScreen(
        rng.integers(0, 255, (32, 68), dtype=np.uint8), rng.integers(0, 255, (256, 18), dtype=np.uint8), 32
    )
    shapes = ((32, 68), (256, 18))
    head_cache.save(model, screen)
    got = head_cache.load(model, shapes)
    assert got is not None and np.array_equal(got.screen, screen.screen)
    monkeypatch.setitem(stamps.REVISIONS, "head_screen", (1, 999))  # the screen's construction changed since
    with caplog.at_level(logging.WARNING):
        assert head_cache.load(model, shapes) is None
    assert "built by other code" in caplog.text and "building it again" in caplog.text
    head_cache.save(model, screen)  # rebuilt: the new stamp
    assert head_cache.load(model, shapes) is not None


def test_gpu_index_cache_stamp(tmp_path: Path, monkeypatch, caplog):
    path = tmp_path / "m.gguf.generated.gpuidx"
    index = GPUIndex.from_neurons([np.array([0, 3]), np.array([1])], 8, 1000)
    write_gpu_index(path, index)
    assert load_cached_gpu_index(path, n_layer=2, n_ff=8) is not None
    monkeypatch.setitem(stamps.REVISIONS, "gpu_index", (1, 999))
    with caplog.at_level(logging.WARNING):
        assert load_cached_gpu_index(path, n_layer=2, n_ff=8) is None
    assert "made by other code" in caplog.text
    # PowerInfer's own index files carry no stamp: used as they are
    f = read_gguf(path)
    bare = tmp_path / "bare.gpuidx"
    w = GGUFWriter(bare, sparse=True)
    f.copy_metadata(w, frozenset({stamps.KEY_CODE, stamps.KEY_FORMAT}))
    for t in f.tensors.values():
        w.add_tensor(t.name, t.data, t.ggml_type, t.shape)
    w.write()
    got = load_cached_gpu_index(bare, n_layer=2, n_ff=8)
    assert got is not None and np.array_equal(got.gpu_bucket[0], [0, 3])


def test_sparse_file_stamp(tiny: Path, tmp_path: Path, monkeypatch, caplog):
    """A file our sparsify made: current -> silent; older code -> one warning; another format -> refused."""
    f = read_gguf(tiny)
    path = tmp_path / "s.gguf"
    w = GGUFWriter(path)
    f.copy_metadata(w)
    w.add(Keys.SPARSITY_METHOD, "cats", ValueType.STRING)
    for key, value in stamps.gguf_items("sparse"):
        w.add(key, value, ValueType.UINT32 if isinstance(value, int) else ValueType.STRING)
    for t in f.tensors.values():
        w.add_tensor(t.name, t.data, t.ggml_type, t.shape)
    w.write()
    with caplog.at_level(logging.WARNING):
        check_stamp(read_gguf(path))
    assert caplog.text == ""
    restamp(path, OLD_CODE)
    with caplog.at_level(logging.WARNING):
        check_stamp(read_gguf(path))
    assert caplog.text.count("made by another version of powerinfer") == 1 and OLD_CODE in caplog.text
    restamp(path, OLD_CODE, fmt=stamps.format_version("sparse") + 1)
    with pytest.raises(FormatError, match="another format"):
        check_stamp(read_gguf(path))
    check_stamp(read_gguf(tiny))  # not ours (no sparsity keys): nothing to judge


def test_activation_folder_stamp(tmp_path: Path, monkeypatch, caplog):
    counts = [np.arange(8, dtype=np.float32), np.ones(8, dtype=np.float32)]
    folder = write_activation_folder(tmp_path / "activation", counts)
    assert stamps.check_stamp_file(folder, "profile").current
    with caplog.at_level(logging.WARNING):
        got = load_activation_stats(folder, 2, 8)
    assert caplog.text == "" and np.array_equal(got[0], counts[0])
    monkeypatch.setitem(stamps.REVISIONS, "profile", (1, 999))
    with caplog.at_level(logging.WARNING):
        load_activation_stats(folder, 2, 8)
    assert caplog.text.count("made by another version") == 1
    monkeypatch.setitem(stamps.REVISIONS, "profile", (2, 1))
    with pytest.raises(FormatError, match="another format"):
        load_activation_stats(folder, 2, 8)
    (folder / stamps.STAMP_FILE).unlink()  # PowerInfer's folders carry none: used, silently
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_activation_stats(folder, 2, 8)
    assert caplog.text == ""


def test_session_stamp(tiny: Path, tmp_path: Path, monkeypatch, caplog):
    engine = Engine(tiny, EngineOptions(n_ctx=32, n_threads=1))
    tokens = [1, 5, 9, 12]
    engine.prefill(0, tokens)
    path = tmp_path / "s.session"
    save_session(path, engine, tokens)
    caplog.clear()  # the engine's load lines, where an earlier test left the package's loggers at INFO
    with caplog.at_level(logging.WARNING):
        assert load_session(path, engine) == tokens
    assert caplog.text == ""
    monkeypatch.setitem(stamps.REVISIONS, "session", (2, 999))
    with caplog.at_level(logging.WARNING):
        assert load_session(path, engine) == tokens
    assert caplog.text.count("made by another version") == 1
    monkeypatch.setitem(stamps.REVISIONS, "session", (3, 1))
    with pytest.raises(FormatError, match="another session format"):
        load_session(path, engine)
    assert torch.isfinite(engine.kv.read_slot(0, 4)[0]).all()


def test_moe_profile_outputs_stamp(tmp_path: Path, monkeypatch, caplog):
    """profile.json's expert counts and router_predictor.npz: other code -> used with a warning; another format ->
    ignored with a warning (the loaders' way with a file that does not fit)."""
    import json

    from powerinfer.placement.experts import load_expert_counts, load_router_predictor
    from powerinfer.profile.experts import write_expert_report
    from powerinfer.profile.router_predictor import RouterPredictors, write_router_predictors

    model = tmp_path / "m.gguf"
    counts = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    write_expert_report(tmp_path / "profile.json", {"expert_counts": counts})
    assert json.loads((tmp_path / "profile.json").read_text())["stamp"] == stamps.header("profile")
    w, b = np.ones((1, 3, 8), dtype=np.float32), np.zeros((1, 3), dtype=np.float32)
    write_router_predictors(tmp_path, RouterPredictors(w, b, [0.5], [0.4], 10, 5))
    with caplog.at_level(logging.WARNING):
        assert np.array_equal(load_expert_counts(model, 2, 3), counts)  # type: ignore[arg-type]
        assert load_router_predictor(model, 2, 3, 8) is not None
    assert caplog.text == ""
    monkeypatch.setitem(stamps.REVISIONS, "profile", (1, 999))
    with caplog.at_level(logging.WARNING):
        assert load_expert_counts(model, 2, 3) is not None
        assert load_router_predictor(model, 2, 3, 8) is not None
    assert caplog.text.count("made by another version") == 2
    monkeypatch.setitem(stamps.REVISIONS, "profile", (2, 1))
    assert load_expert_counts(model, 2, 3) is None and load_router_predictor(model, 2, 3, 8) is None
