"""GGUF/PWRI reader and writer: the original tools' files, round trips, gguf-py interoperability."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import fixture_dir

from powerinfer import quant
from powerinfer.errors import FormatError
from powerinfer.gguf import GGMLType, GGUFWriter, read_gguf

FILES = [
    "tiny.powerinfer.gguf",
    "tiny.q4.powerinfer.gguf",
    "tiny.dense.gguf",
    "tiny.powerinfer.gguf.generated.gpuidx",
]


@pytest.fixture(scope="module")
def expected_files():
    return json.loads((fixture_dir() / "expected.json").read_text())["files"]


@pytest.mark.parametrize("name", FILES)
def test_reads_original_files(name, expected_files):
    """Header, metadata and tensor table equal what the original tools recorded."""
    exp = expected_files[name]
    f = read_gguf(fixture_dir() / name)
    assert f.magic == exp["magic"] and f.version == exp["version"]
    assert f.is_sparse == (exp["magic"] == "PWRI")
    assert len(f.tensors) == exp["n_tensors"] and len(f.metadata) == exp["n_kv"]
    assert f.data_offset == exp["data_start"]
    for key, value in exp["kv"].items():
        ours = f.metadata[key]
        if isinstance(value, str) and value.startswith("array["):
            assert len(ours) == int(value[6:-1])
        elif isinstance(value, float):
            assert ours == pytest.approx(value, rel=1e-7)
        else:
            assert ours == value, key
    for t, info in zip(exp["tensors"], f.tensors.values(), strict=False):
        assert info.name == t["name"]
        assert info.shape == tuple(reversed(t["ne"]))
        assert info.ggml_type.name == t["type"]
        assert info.offset == exp["data_start"] + t["offset"]


def test_gpu_index_contents(expected_files):
    exp = expected_files["tiny.powerinfer.gguf.generated.gpuidx"]
    f = read_gguf(fixture_dir() / "tiny.powerinfer.gguf.generated.gpuidx")
    for layer in exp["layers"]:
        i = layer["layer"]
        gpu_idx = f.tensors[f"blk.{i}.gpu_idx"].data.view("<i4")
        bucket = f.tensors[f"blk.{i}.gpu_bucket"].data.view("<i4")
        assert int(gpu_idx.sum()) == layer["gpu_idx_sum"]
        assert bucket.tolist() == layer["gpu_bucket"]
        assert np.flatnonzero(gpu_idx).tolist() == layer["gpu_bucket"]


@pytest.mark.parametrize("name", FILES)
def test_rewrite_is_identical(tmp_path, name):
    """Re-writing a file with our writer (same keys, types, tensors, order) reproduces it byte for byte."""
    src = read_gguf(fixture_dir() / name)
    out = tmp_path / name
    w = GGUFWriter(out, sparse=src.is_sparse)
    src.copy_metadata(w)
    for info in src.tensors.values():
        w.add_tensor(info.name, info.data, info.ggml_type, info.shape)
    w.write()
    assert out.read_bytes() == (fixture_dir() / name).read_bytes()


def test_dense_output_opens_in_gguf_py(tmp_path):
    """gguf-py's reader opens a dense file we wrote and sees the same metadata and data."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((8, 64)).astype(np.float32)
    w = GGUFWriter(tmp_path / "x.gguf")
    w.add("general.architecture", "llama")
    w.add("test.strings", ["a", "bé", "日本"])
    w.add("test.f32", 1.5)
    w.add("test.flag", True)
    w.add_tensor("f32", a)
    w.add_tensor("f16", a, GGMLType.F16)
    w.add_tensor("q8_0", a, GGMLType.Q8_0)
    w.add_tensor("q4_1", a, GGMLType.Q4_1)
    w.write()
    ref = gguf.GGUFReader(tmp_path / "x.gguf")
    assert ref.fields["general.architecture"].contents() == "llama"
    assert ref.fields["test.strings"].contents() == ["a", "bé", "日本"]
    assert ref.fields["test.f32"].contents() == 1.5
    assert ref.fields["test.flag"].contents() is True
    ours = read_gguf(tmp_path / "x.gguf")
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == t.tensor_type
        assert bytes(info.data) == bytes(np.asarray(t.data).view(np.uint8).reshape(-1))
    np.testing.assert_array_equal(quant.dequantize(ours.tensors["f32"].data, GGMLType.F32, (8, 64)), a)


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "out.gguf"
    w = GGUFWriter(target)
    w.add("general.architecture", "llama")
    w.add_tensor("t", np.ones((4, 32), np.float32))

    def boom(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        w.write()
    assert os.listdir(tmp_path) == []


def test_write_to_missing_folder(tmp_path):
    w = GGUFWriter(tmp_path / "missing" / "out.gguf")
    with pytest.raises(FormatError, match="does not exist"):
        w.write()
