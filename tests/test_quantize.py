"""`powerinfer quantize`: type parsing, per-tensor rules, blocks bit-exact with the gguf reference, the
original's output on the fixture, sparse FFN on every quantized type, and bad input."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    assert_one_error_line,
    fixture_dir,
    random_llama_state,
    random_predictors,
    smollm2_path,
    write_llama_gguf,
)
from gguf import GGUFReader
from gguf import quants as gguf_quants
from test_sparse import N_FF, N_HEAD, N_HEAD_KV, _Fixed, _masked_reference, _placements
from typer.testing import CliRunner

from powerinfer.cli import app
from powerinfer.errors import InputError
from powerinfer.gguf import GGMLType, read_gguf
from powerinfer.quant import dequantize
from powerinfer.quant.mix import MixState, llama_order, model_facts, use_more_bits
from powerinfer.quantize import (
    QuantizeOptions,
    parse_file_type,
    quantize_model,
    require_file_type,
    tensor_type,
)
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sampling import Sampler, SamplingParams

runner = CliRunner()


def run_quantize(*args: str):
    return runner.invoke(app, ["quantize", *args])


def assert_reference_blocks(src_path: Path, out_path: Path, every: int = 1) -> int:
    """Converted tensors of `out_path` (every `every`-th one checked) equal the gguf package's quantizer on
    the decoded source, unconverted ones their source bytes; returns the number of converted tensors."""
    src, out = read_gguf(src_path), read_gguf(out_path)
    assert list(src.tensors) == list(out.tensors)
    n = 0
    for name, t in out.tensors.items():
        s = src.tensors[name]
        if t.ggml_type == s.ggml_type:
            assert bytes(t.data) == bytes(s.data), name
            continue
        n += 1
        if (n - 1) % every:
            continue
        rows = dequantize(s.data, s.ggml_type, s.shape)
        want = gguf_quants.quantize(rows, t.ggml_type)
        assert bytes(t.data) == np.ascontiguousarray(want).tobytes(), name
    return n


def _opts(target: str, **kw) -> QuantizeOptions:
    return QuantizeOptions(Path("in.gguf"), Path("out.gguf"), require_file_type(target), **kw)


def test_type_names_and_numbers():
    assert parse_file_type("q4_0").ggml_type == GGMLType.Q4_0
    assert parse_file_type("Q8_0").ftype == 7
    assert parse_file_type("7").name == "Q8_0"
    assert parse_file_type("2").name == "Q4_0"
    assert parse_file_type("32").ggml_type == GGMLType.BF16
    assert parse_file_type("copy").ggml_type is None
    assert parse_file_type("model.gguf") is None
    # llama.cpp's K-quant mixes, their numbers and quantize.cpp's aliases
    assert parse_file_type("q4_k_m").ftype == 15 and parse_file_type("Q4_K").name == "Q4_K_M"
    assert parse_file_type("18").name == "Q6_K" and parse_file_type("Q3_K").name == "Q3_K_M"
    assert parse_file_type("25").name == "IQ4_NL" and parse_file_type("30").ggml_type == GGMLType.IQ4_XS
    assert parse_file_type("Q2_K").ggml_type == GGMLType.Q2_K
    for q2_k_s in ("q2_k_s", "21"):  # llama.cpp refuses it without an importance matrix, and so do we
        with pytest.raises(InputError, match="Q2_K_S needs an importance matrix"):
            parse_file_type(q2_k_s)
    assert parse_file_type("IQ2_XXS") is None and parse_file_type("19") is None  # types we cannot produce
    with pytest.raises(InputError, match="unknown quantization type 'Q9_9'"):
        require_file_type("Q9_9")


def _types(opts: QuantizeOptions, tensors: dict[str, tuple[tuple[int, ...], GGMLType]], **meta) -> dict:
    """tensor name -> (destination type, note) of a plan over `tensors` (name -> (shape, source type))."""
    names = list(tensors)
    facts = model_facts({"general.architecture": "llama", **meta}, names)
    state = MixState()
    out = {}
    for name in llama_order(names):
        shape, src = tensors[name]
        out[name] = tensor_type(name, shape, src, opts, facts, state)
    return out


def test_per_tensor_rules():
    q4, q8, q41 = _opts("Q4_0"), _opts("Q8_0"), _opts("Q4_1")
    f16 = GGMLType.F16
    tensors = {
        "token_embd.weight": ((512, 256), f16),
        "blk.0.attn_norm.weight": ((256,), GGMLType.F32),
        "blk.0.gpu_idx": ((512,), GGMLType.I32),
        "blk.0.ffn_down_t.weight": ((512, 256), f16),
        "blk.0.fc1.weight": ((64, 256), f16),
        "blk.0.fc2.weight": ((512, 64), f16),
        "blk.0.attn_q.weight": ((256, 48), f16),
    }
    with_output = {**tensors, "output.weight": ((512, 256), f16)}

    def dst(opts, name, tied=False, **kw):
        return _types(opts, tensors if tied else with_output, **kw)[name][0]

    assert _types(q4, tensors)["blk.0.attn_norm.weight"] == (GGMLType.F32, "")
    assert _types(q4, tensors)["blk.0.gpu_idx"] == (GGMLType.I32, "")
    assert dst(q41, "blk.0.ffn_down_t.weight") == GGMLType.Q4_1
    assert dst(q4, "token_embd.weight") == GGMLType.Q4_0
    # tied embeddings: token_embd.weight is the output head too and takes the output rule (Q6_K: 256 | n_embd)
    assert dst(q4, "token_embd.weight", tied=True) == GGMLType.Q6_K
    assert dst(_opts("Q4_0", pure=True), "token_embd.weight", tied=True) == GGMLType.Q4_0
    assert dst(q4, "output.weight") == GGMLType.Q6_K and dst(q8, "output.weight") == GGMLType.Q8_0
    assert dst(_opts("Q4_0", leave_output_tensor=True), "output.weight") == f16
    assert dst(_opts("Q4_0", pure=True), "output.weight") == GGMLType.Q4_0
    assert dst(_opts("Q4_0", output_tensor_type=GGMLType.Q4_1), "output.weight") == GGMLType.Q4_1
    assert dst(_opts("Q4_0", token_embedding_type=GGMLType.Q8_0), "token_embd.weight") == GGMLType.Q8_0
    assert dst(q4, "blk.0.fc1.weight") == GGMLType.Q4_0
    assert dst(q41, "blk.0.fc2.weight") == GGMLType.Q5_0
    assert dst(_opts("Q4_1", pure=True), "blk.0.fc2.weight") == GGMLType.Q4_1
    assert dst(q8, "blk.0.fc2.weight") == GGMLType.Q5_0
    assert dst(_opts("F16"), "output.weight") == f16
    # a row length no block divides: F16 (llama.cpp's last resort), with a note
    got, note = _types(q4, with_output)["blk.0.attn_q.weight"]
    assert got == f16 and "row length 48 is not a multiple of the Q4_0 block size 32" in note
    # 256-element types fall back to a 32-element one when 256 does not divide the row (n_embd 576 here)
    odd = {"blk.0.attn_k.weight": ((192, 576), f16), "output.weight": ((512, 576), f16)}
    assert _types(_opts("Q4_K_S"), odd)["blk.0.attn_k.weight"][0] == GGMLType.Q5_0
    assert _types(_opts("Q5_K_S"), odd)["blk.0.attn_k.weight"][0] == GGMLType.Q5_1
    assert _types(_opts("Q6_K"), odd)["blk.0.attn_k.weight"][0] == GGMLType.Q8_0
    assert _types(_opts("Q3_K_S"), odd)["blk.0.attn_k.weight"][0] == GGMLType.Q4_0
    assert _types(_opts("IQ4_XS"), odd)["blk.0.attn_k.weight"][0] == GGMLType.IQ4_NL
    assert _types(_opts("Q4_K_M"), odd)["output.weight"][0] == GGMLType.Q8_0


def test_k_quant_mixes():
    """llama.cpp's mixes on a 16-layer LLaMA (GQA 4): which layers' attn_v / ffn_down get more bits."""
    f16 = GGMLType.F16
    tensors = {"output.weight": ((512, 256), f16), "token_embd.weight": ((512, 256), f16)}
    for i in range(16):
        for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            tensors[f"blk.{i}.{kind}.weight"] = ((256, 256), f16)
    meta = {"llama.block_count": 16, "llama.attention.head_count": 8, "llama.attention.head_count_kv": 2}

    def layers(ftype: str, kind: str) -> list[str]:
        got = _types(_opts(ftype), tensors, **meta)
        return [got[f"blk.{i}.{kind}.weight"][0].name for i in range(16)]

    # use_more_bits(i, 16): i < 2, i >= 14, (i - 2) % 3 == 2 -> layers 0, 1, 4, 7, 10, 13, 14, 15
    more = [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(16) if use_more_bits(i, 16)] == more
    assert layers("Q4_K_M", "ffn_down") == ["Q6_K" if i in more else "Q4_K" for i in range(16)]
    assert layers("Q4_K_M", "attn_v") == ["Q6_K" if i in more else "Q4_K" for i in range(16)]
    assert layers("Q4_K_M", "attn_q") == ["Q4_K"] * 16
    assert layers("Q5_K_M", "ffn_down") == ["Q6_K" if i in more else "Q5_K" for i in range(16)]
    assert layers("Q4_K_S", "attn_v") == ["Q5_K"] * 4 + ["Q4_K"] * 12
    assert layers("Q4_K_S", "ffn_down") == ["Q5_K"] * 2 + ["Q4_K"] * 14
    assert layers("Q3_K_M", "attn_v") == ["Q5_K"] * 2 + ["Q4_K"] * 14
    assert layers("Q3_K_M", "ffn_down") == ["Q5_K"] + ["Q4_K"] * 15
    assert layers("Q3_K_M", "attn_output") == ["Q4_K"] * 16
    assert layers("Q3_K_L", "ffn_down") == ["Q5_K"] * 16
    assert layers("Q3_K_S", "ffn_down") == ["Q3_K"] * 16
    assert layers("Q2_K", "attn_v") == ["Q4_K"] * 16  # GQA >= 4
    assert layers("Q2_K", "ffn_down") == ["Q3_K"] * 16 and layers("Q2_K", "ffn_up") == ["Q2_K"] * 16
    assert layers("IQ4_XS", "attn_v") == ["Q5_K"] * 16 and layers("IQ4_NL", "ffn_down")[:3] == [
        "Q5_K", "Q5_K", "IQ4_NL",
    ]  # fmt: skip
    assert layers("Q6_K", "ffn_down") == ["Q6_K"] * 16
    got = _types(_opts("Q4_K_M"), tensors, **meta)
    assert got["output.weight"][0] == GGMLType.Q6_K and got["token_embd.weight"][0] == GGMLType.Q4_K


@pytest.mark.parametrize("target", ["Q4_0", "Q8_0", "Q4_1"])
def test_fixture_round_trip(tmp_path, target):
    src = fixture_dir() / "tiny.powerinfer.gguf"
    out = tmp_path / f"tiny.{target}.gguf"
    result = run_quantize(str(src), str(out), target.lower(), "2")
    assert result.exit_code == 0, result.stderr
    assert "quantizing to q8_0 .. size =     0.12 MB ->     0.07 MB" in result.stderr  # output.weight
    assert "main: quantize time =" in result.stderr and "main:    total time =" in result.stderr
    model, original = read_gguf(out), read_gguf(src)
    assert model.is_sparse
    assert model.metadata["general.file_type"] == require_file_type(target).ftype
    assert model.metadata["general.quantization_version"] == 2
    assert list(model.metadata) == list(original.metadata) + ["general.quantization_version"]
    types = {n: t.ggml_type for n, t in model.tensors.items()}
    assert types["output.weight"] == GGMLType.Q8_0 and types["blk.0.attn_norm.weight"] == GGMLType.F32
    fc = GGMLType.Q4_0 if target == "Q4_0" else GGMLType.Q5_0  # as the original
    assert types["blk.2.fc1.weight"] == fc and types["blk.2.fc2.weight"] == fc
    assert types["blk.2.ffn_down_t.weight"] == GGMLType[target]
    assert assert_reference_blocks(src, out) == 4 * 9 + 2
    engine = Engine(out, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1))
    assert engine.sparse_stats is not None
    assert torch.isfinite(engine.logits_all([1, 414, 481])).all()


# tensors of the original's Q4_0 file that ours has byte-identical (measured: llama 36 of 47 with 14 differing
# blocks of 16896, falcon 36 of 44 with 11 of 12800, opt 73 of 76 with 4 of 11784)
Q4_FIXTURES = {"tiny-relu-llama": 36, "tiny-relu-falcon": 36, "tiny-relu-opt": 73}


@pytest.mark.parametrize("fixture", list(Q4_FIXTURES))
def test_fixture_q4_0_equals_the_original(tmp_path, fixture):
    """Against the original quantize's tiny.q4.powerinfer.gguf: same header and tensor table; blocks
    identical except a handful where the original binary's fused multiply-add rounds x*id + 8.5 differently
    (one nibble)."""
    src = fixture_dir(fixture) / "tiny.powerinfer.gguf"
    out = tmp_path / "q4.gguf"
    quantize_model(QuantizeOptions(src, out, require_file_type("Q4_0"), n_threads=2))
    ours, theirs = read_gguf(out), read_gguf(fixture_dir(fixture) / "tiny.q4.powerinfer.gguf")
    assert ours.data_offset == theirs.data_offset
    assert {k: v for k, v in ours.metadata.items() if not isinstance(v, (list, np.ndarray))} == {
        k: v for k, v in theirs.metadata.items() if not isinstance(v, (list, np.ndarray))
    }
    n_blocks = n_diff = 0
    identical = []
    for name, t in theirs.tensors.items():
        o = ours.tensors[name]
        assert (o.shape, o.ggml_type, o.offset) == (t.shape, t.ggml_type, t.offset), name
        if bytes(o.data) == bytes(t.data):
            identical.append(name)
            continue
        assert t.ggml_type == GGMLType.Q4_0, name
        a, b = o.data.reshape(-1, 18), t.data.reshape(-1, 18)
        bad = np.nonzero((a != b).any(1))[0]
        n_blocks += len(a)
        n_diff += len(bad)
        assert (a[bad, :2] == b[bad, :2]).all()  # same scale
        nib = lambda x: np.concatenate([x[:, 2:] & 15, x[:, 2:] >> 4], 1).astype(int)  # noqa: E731
        assert np.abs(nib(a[bad]) - nib(b[bad])).sum() == len(bad)  # exactly one nibble off by one per block
    assert len(identical) >= Q4_FIXTURES[fixture]
    assert n_diff <= 20


def test_q8_0_fixture_generates_its_dense_text(tmp_path, monkeypatch):
    """The fixture quantized to Q8_0: sparse mode, every neuron active, gives the dense FFN's greedy text."""
    out = tmp_path / "q8.gguf"
    quantize_model(QuantizeOptions(fixture_dir() / "tiny.powerinfer.gguf", out, require_file_type("Q8_0")))
    monkeypatch.setenv("LLAMA_SPARSE_PRED_THRESHOLD", "-inf")
    sparse = Engine(out, EngineOptions(act_precision="f32", n_ctx=128, n_threads=2))
    dense = Engine(out, EngineOptions(act_precision="f32", n_ctx=128, n_threads=2, dense_ffn=True))
    tok = sparse.tokenizer
    for prompt in ("Hello world", "The quick brown fox", "def main():"):
        ids = [tok.bos_id] + tok.encode(prompt, add_bos=False)
        got = [
            list(e.generate(ids, Sampler(SamplingParams(temp=0, repeat_penalty=1.0)), n_predict=16))
            for e in (sparse, dense)
        ]
        assert got[0] == got[1], prompt
        assert len(tok.decode(got[0]).strip()) > 0


@pytest.mark.parametrize("target", ["Q8_0", "Q4_1", "Q4_0", "BF16", "Q5_0", "Q5_1"])
def test_sparse_ffn_on_quantized_weights(tmp_path, target):
    """Sparse FFN of a file quantized by us equals the masked dense reference on the dequantized weights."""
    sd = random_llama_state(n_ff=N_FF, n_head=N_HEAD, n_head_kv=N_HEAD_KV, seed=4)
    src = write_llama_gguf(
        tmp_path / "m.powerinfer.gguf",
        sd,
        n_head=N_HEAD,
        n_head_kv=N_HEAD_KV,
        act="relu",
        predictors=random_predictors(sd, seed=4),
        threshold=0.0,
    )
    out = tmp_path / f"m.{target}.powerinfer.gguf"
    quantize_model(QuantizeOptions(src, out, require_file_type(target), n_threads=2))
    assert {read_gguf(out).tensors["blk.1.ffn_up.weight"].ggml_type} == {GGMLType[target]}
    gen = torch.Generator().manual_seed(1)
    for name, opts in _placements(tmp_path).items():
        engine = Engine(out, opts)
        for ffn in engine.model.ffns:
            ffn.fused_decode = False  # the fused decode kernel runs its own predictor
            for T in (1, 4):
                u, x = torch.randn(T, 64, generator=gen), torch.randn(T, 64, generator=gen)
                for p in (0.1, 0.6, 1.0):
                    mask = torch.rand(T, N_FF, generator=gen) < p
                    ffn.selector = _Fixed(mask)
                    want = _masked_reference(ffn, u, mask)
                    err = (ffn(u, x) - want).abs().max().item()
                    assert err <= 1e-4 * (want.abs().max().item() + 1), (name, target, T, p, err)


def test_threads_and_chunks_give_the_same_bytes(tmp_path, monkeypatch):
    sd = random_llama_state(n_ff=N_FF, seed=5)
    src = write_llama_gguf(tmp_path / "m.gguf", sd, n_head=4, n_head_kv=4, dtype=GGMLType.F16)
    quantize_model(QuantizeOptions(src, tmp_path / "a.gguf", require_file_type("Q4_1"), n_threads=1))
    monkeypatch.setattr("powerinfer.quantize._CHUNK_ELEMENTS", 200)  # many small row chunks
    quantize_model(QuantizeOptions(src, tmp_path / "b.gguf", require_file_type("Q4_1"), n_threads=4))
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    types = {t.name: t.tensor_type for t in GGUFReader(tmp_path / "a.gguf").tensors}  # gguf's reader opens it
    assert types["blk.1.ffn_up.weight"] == GGMLType.Q4_1 and types["output.weight"] == GGMLType.Q8_0


def test_default_output_name_and_float_targets(tmp_path):
    sd = random_llama_state(seed=6)
    src = write_llama_gguf(tmp_path / "m.gguf", sd, n_head=4, n_head_kv=4)
    result = run_quantize(str(src), "f16")
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "ggml-model-F16.gguf"
    model = read_gguf(out)
    assert model.magic == "GGUF" and model.metadata["general.file_type"] == 1
    assert model.tensors["output.weight"].ggml_type == GGMLType.F16
    assert model.tensors["output_norm.weight"].ggml_type == GGMLType.F32
    assert assert_reference_blocks(src, out) == 2 + 2 * 7
    assert (out.stat().st_mode & 0o777) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("target", ["Q8_0", "Q4_0"])
def test_smollm2_requantize(tmp_path, target):
    """The real SmolLM2 Q4_1 file requantized (its token_embd is Q8_0); every 30th tensor's blocks checked.

    SmolLM2 ties its output head to token_embd, which therefore keeps Q8_0 (the output rule) at Q4_0."""
    src = smollm2_path()
    out = tmp_path / f"smollm2.{target}.gguf"
    result = run_quantize("--allow-requantize", str(src), str(out), target, "2")
    assert result.exit_code == 0, result.stderr
    assert "type =   q4_1, quantizing to " + target.lower() in result.stderr
    assert assert_reference_blocks(src, out, every=30) == 210
    reader = GGUFReader(out)
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {GGMLType[target], GGMLType.Q8_0}
    if target != "Q8_0":
        return
    engine = Engine(out, EngineOptions(act_precision="f32", n_ctx=32, n_threads=2))
    ids = engine.tokenizer.encode("The capital of France is", add_bos=None)
    assert torch.isfinite(engine.logits_all(ids)).all()


# -- bad input: one error line, exit code 1, no output file -----------------------------------------------


def _no_files_left(folder: Path, before: set[str]) -> None:
    assert {p.name for p in folder.iterdir()} == before


def test_unknown_type(tiny_gguf):
    before = {p.name for p in tiny_gguf.parent.iterdir()}
    assert_one_error_line(run_quantize(str(tiny_gguf), "Q9_9"), "unknown quantization type 'Q9_9'")
    assert_one_error_line(
        run_quantize(str(tiny_gguf), str(tiny_gguf.parent / "o.gguf"), "iq2_xxs"), "unknown quantization type"
    )
    assert_one_error_line(
        run_quantize("--output-tensor-type", "q9", str(tiny_gguf), str(tiny_gguf.parent / "o.gguf"), "q8_0"),
        "--output-tensor-type: unknown or unsupported ggml type 'q9'",
    )
    assert_one_error_line(run_quantize(str(tiny_gguf), "q8_0", "two"), "invalid nthreads 'two'")
    _no_files_left(tiny_gguf.parent, before)


def test_requantize_needs_the_flag(tmp_path):
    src = write_llama_gguf(
        tmp_path / "m.gguf", random_llama_state(), n_head=4, n_head_kv=4, dtype=GGMLType.Q4_0
    )
    before = {p.name for p in tmp_path.iterdir()}
    assert_one_error_line(
        run_quantize(str(src), str(tmp_path / "o.gguf"), "Q8_0"),
        "requantizing from type Q4_0 is disabled",
        "--allow-requantize",
    )
    _no_files_left(tmp_path, before)
    assert run_quantize("--allow-requantize", str(src), str(tmp_path / "o.gguf"), "Q8_0").exit_code == 0


def test_missing_folder_and_non_gguf_input(tiny_gguf, tmp_path):
    assert_one_error_line(
        run_quantize(str(tiny_gguf), str(tmp_path / "nope" / "o.gguf"), "q4_0"), "does not exist"
    )
    assert not (tmp_path / "nope").exists()
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a model\n" * 10)
    before = {p.name for p in tmp_path.iterdir()}
    assert_one_error_line(run_quantize(str(text), str(tmp_path / "o.gguf"), "q4_0"), "bad magic")
    assert_one_error_line(run_quantize(str(tmp_path / "missing.gguf"), "q4_0"), "no such file")
    _no_files_left(tmp_path, before)


def test_read_only_output_location(tiny_gguf, tmp_path):
    if os.geteuid() == 0:  # root writes into chmod 0555 folders; /sys refuses even root
        if not os.path.isdir("/sys") or os.access("/sys", os.W_OK) and _writable("/sys"):
            pytest.skip("no read-only folder available to root")
        out = Path("/sys/o.gguf")
    else:
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o555)
        out = folder / "o.gguf"
    assert_one_error_line(run_quantize(str(tiny_gguf), str(out), "q4_0"), "cannot write")
    assert not out.exists()


def _writable(folder: str) -> bool:
    try:
        Path(folder, ".probe").touch()
    except OSError:
        return False
    Path(folder, ".probe").unlink()
    return True


def test_interrupted_run_leaves_no_output(tiny_gguf, monkeypatch):
    calls = []

    def boom(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    import powerinfer.quantize as q

    real = q.quantize
    monkeypatch.setattr(q, "quantize", boom)
    before = {p.name for p in tiny_gguf.parent.iterdir()}
    result = run_quantize(str(tiny_gguf), str(tiny_gguf.parent / "o.gguf"), "q8_0", "1")
    assert result.exit_code == 130
    _no_files_left(tiny_gguf.parent, before)
