"""Hostile model files: every malformed file ends in one `error:` line on stderr and exit code 1, within bounded
memory, never a crash, a traceback or raw control characters.

Each test builds a valid tiny file with the conftest writers, corrupts it (shapes that disagree with the config,
smashed header fields, metadata of the wrong type), and runs the real CLI in a subprocess
(`python -m powerinfer main -m FILE -p hi -n 2`); variants of a class are also checked in-process through
`read_gguf` / `Engine`. The subprocesses of all tests start together on first use (two at a time), so the
module's wall time is about half the sum of their start-up times.
"""

from __future__ import annotations

import math
import os
import signal
import struct
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_llama_state, random_predictors, write_llama_gguf

from powerinfer.errors import ConfigError, FormatError, InputError, PowerInferError
from powerinfer.gguf import GGMLType, ValueType, read_gguf
from powerinfer.ops import library
from powerinfer.runtime.engine import Engine, EngineOptions

MiB = 2**20
TIMEOUT = 180.0
MAX_LINE_BYTES = 500

# ------------------------------------------------------------------------------------------ building the files


def dense_file(path: Path) -> Path:
    """A valid dense GGUF: n_embd 64, n_ff 128, 2 layers, 4 heads, 2 KV heads, vocab 259."""
    return write_llama_gguf(path, random_llama_state(n_head_kv=2), n_head=4, n_head_kv=2)


def sparse_file(path: Path, edit: Callable[[dict, dict], None] | None = None, **kw: object) -> Path:
    """A valid PowerInfer file (predictors of rank 32); `edit(state, predictors)` reshapes tensors first."""
    sd = random_llama_state()
    pred = random_predictors(sd)
    if edit is not None:
        edit(sd, pred)
    return write_llama_gguf(path, sd, n_head=4, n_head_kv=4, act="relu", predictors=pred, **kw)


def patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def kv_offsets(path: Path, key: str) -> tuple[int, int]:
    """Byte offsets of the value type and the value of metadata `key`."""
    raw = path.read_bytes()
    encoded = key.encode()
    at = raw.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    return at, at + 4


def tensor_info_offset(path: Path, name: str) -> int:
    """Byte offset of the n_dims field of tensor `name`'s info record (dims, type and offset follow)."""
    raw = path.read_bytes()
    encoded = name.encode()
    return raw.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


def set_dims_and_type(path: Path, name: str, dims: list[int], type_id: int | None = None) -> None:
    """Rewrite tensor `name`'s dimensions (GGUF order: fastest first, same count) and optionally its type id."""
    at = tensor_info_offset(path, name)
    (n_dims,) = struct.unpack_from("<I", path.read_bytes(), at)
    assert n_dims == len(dims)
    patch(path, at + 4, b"".join(struct.pack("<Q", d) for d in dims))
    if type_id is not None:
        patch(path, at + 4 + 8 * n_dims, struct.pack("<I", type_id))


def kv_record(key: str, vtype: int, payload: bytes) -> bytes:
    encoded = key.encode()
    return struct.pack("<Q", len(encoded)) + encoded + struct.pack("<I", vtype) + payload


def insert_kvs(path: Path, *records: bytes, removed: int = 0, alignment: int = 32) -> None:
    """Insert metadata records after the header (n_kv grows): a filler record keeps the header's length change
    (`removed` bytes taken out before) a multiple of the alignment, so the tensor data stays where the tensor
    infos say it is."""
    size = sum(len(r) for r in records) - removed + 8 + 4 + 1  # + the filler's key length, type and u8 value
    pad_key = "x" * ((-size) % alignment or alignment)
    records = (*records, kv_record(pad_key, ValueType.UINT8, b"\x01"))
    raw = bytearray(path.read_bytes())
    (n_kv,) = struct.unpack_from("<Q", raw, 16)
    raw[16:24] = struct.pack("<Q", n_kv + len(records))
    raw[24:24] = b"".join(records)
    path.write_bytes(bytes(raw))


def replace_kv(path: Path, key: str, vtype: int, payload: bytes) -> None:
    """Give metadata `key` (a scalar) another type and value: its record is dropped and a new one inserted."""
    raw = bytearray(path.read_bytes())
    type_at, value_at = kv_offsets(path, key)
    (old_type,) = struct.unpack_from("<I", raw, type_at)
    start, end = type_at - 8 - len(key.encode()), value_at + struct.calcsize(VALUE_FORMATS[old_type])
    del raw[start:end]
    (n_kv,) = struct.unpack_from("<Q", raw, 16)
    raw[16:24] = struct.pack("<Q", n_kv - 1)
    path.write_bytes(bytes(raw))
    insert_kvs(path, kv_record(key, vtype, payload), removed=end - start)


# struct formats of the scalar value types
VALUE_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q",
                 12: "<d"}  # fmt: skip


# ------------------------------------------------------------------------------------------- running the CLI


@dataclass(frozen=True)
class CliRun:
    returncode: int
    stdout: bytes
    stderr: bytes
    max_rss: int  # bytes, the child's peak resident set


# Runs argv[2:] as a child and writes the child's peak RSS (KiB) to the file argv[1]. The launcher is a small
# process: a child forked straight from pytest would report pytest's own peak (Linux carries the peak RSS of the
# address space a process replaces at exec into ru_maxrss), this one's child reports its own.
LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status) % 256)
"""


def run_cli(model: Path, *extra: str) -> CliRun:
    """`python -m powerinfer main -m model -p hi -n 2 [extra]` in a subprocess: its exit status, output and peak
    RSS; the process group is killed after TIMEOUT seconds."""
    cmd = [sys.executable, "-m", "powerinfer", "main", "-m", str(model), "-p", "hi", "-n", "2", *extra]
    rss_file = model.with_name(model.name + ".maxrss")
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(rss_file), *cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=model.parent,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    max_rss = int(rss_file.read_text()) * 1024 if rss_file.exists() else 0
    return CliRun(proc.returncode, out, err, max_rss)


def assert_refused(run: CliRun, model: Path, *needles: str) -> str:
    """Exit code 1, stdout empty, stderr exactly one printable `error:` line under 500 bytes holding every needle,
    no traceback, and a peak RSS within 2x the file size + 500 MB. Returns the line."""
    assert run.returncode == 1, (run.returncode, run.stderr[-2000:])
    assert run.stdout == b"", run.stdout[:500]
    assert b"Traceback" not in run.stderr
    lines = run.stderr.split(b"\n")
    assert lines[-1] == b"" and len(lines) == 2, run.stderr[:2000]
    line = lines[0]
    assert line.startswith(b"error: ")
    assert len(line) < MAX_LINE_BYTES, len(line)
    assert not any(b < 0x20 or b == 0x7F for b in line), line
    text = line.decode("utf-8")
    assert not any(0x80 <= ord(c) < 0xA0 for c in text), text
    for needle in needles:
        assert needle in text, (needle, text)
    limit = 2 * model.stat().st_size + 500 * MiB
    assert 0 < run.max_rss <= limit, (run.max_rss / MiB, limit / MiB)
    return text


def refused_in_process(model: Path, error: type[PowerInferError], *needles: str, **options: object) -> str:
    """read_gguf + Engine + one decode step raises `error` whose one line holds every needle."""
    with pytest.raises(error) as info:
        read_gguf(model)
        Engine(model, EngineOptions(n_threads=1, **{"act_precision": "f32", **options})).eval([1])  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message and len(message.encode()) < MAX_LINE_BYTES, message
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in message), message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


class CliPool:
    """CLI runs of the module's files, started together on first use (two at a time: the CI machine's cores)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.executor = ThreadPoolExecutor(max_workers=2)
        self.runs: dict[str, tuple[Path, Future[CliRun]]] = {}
        for name, (build, extra) in CLI_CASES.items():
            path = build(folder / name)
            self.runs[name] = (path, self.executor.submit(run_cli, path, *extra))

    def result(self, name: str) -> tuple[Path, CliRun]:
        path, future = self.runs[name]
        return path, future.result()


# --------------------------------------------------------------------------------------------- the CLI cases


def _ffn_wider_than_embd(path: Path) -> Path:
    """The probe's segfault: FFN and predictor tensors agree with each other (K = 96) but n_embd is 64."""

    def edit(sd: dict, pred: dict) -> None:
        rng = np.random.default_rng(5)
        for i in range(2):
            p = f"model.layers.{i}.mlp."
            sd[p + "gate_proj.weight"] = rng.normal(0, 0.08, (128, 96)).astype(np.float32)
            sd[p + "up_proj.weight"] = rng.normal(0, 0.08, (128, 96)).astype(np.float32)
            sd[p + "down_proj.weight"] = rng.normal(0, 0.08, (96, 128)).astype(np.float32)
            pred[f"blk.{i}.fc1.weight"] = rng.normal(0, 0.3, (32, 96)).astype(np.float32)

    return sparse_file(path.with_suffix(".powerinfer.gguf"), edit)


def _output_rows(path: Path) -> Path:
    sd = random_llama_state(n_head_kv=2)
    sd["lm_head.weight"] = np.zeros((len(sd["lm_head.weight"]) + 5, 64), dtype=np.float32)
    return write_llama_gguf(path, sd, n_head=4, n_head_kv=2)


def _rank_chain(path: Path) -> Path:
    def edit(sd: dict, pred: dict) -> None:
        pred["blk.1.fc2.weight"] = np.zeros((128, 16), dtype=np.float32)

    return sparse_file(path.with_suffix(".powerinfer.gguf"), edit)


def _huge_n_ff(path: Path, sparse: bool = False) -> Path:
    """feed_forward_length = 2^31 (u32) in a tiny file."""
    if sparse:
        sparse_file(path)
    else:
        dense_file(path)
    _, value_at = kv_offsets(path, "llama.feed_forward_length")
    patch(path, value_at, struct.pack("<I", 2**31))
    return path


def _huge_context(path: Path) -> Path:
    dense_file(path)
    _, value_at = kv_offsets(path, "llama.context_length")
    patch(path, value_at, struct.pack("<I", 2**32 - 1))
    return path


def _overflow_dims(path: Path) -> Path:
    dense_file(path)
    set_dims_and_type(path, "token_embd.weight", [2**32, 2**32])  # 2^64 elements
    return path


def _max_dim(path: Path) -> Path:
    dense_file(path)
    set_dims_and_type(path, "blk.0.attn_q.weight", [64, 2**64 - 1])
    return path


def _zero_dim(path: Path) -> Path:
    dense_file(path)
    set_dims_and_type(path, "token_embd.weight", [64, 0])
    return path


def _q8_1_weight(path: Path) -> Path:
    dense_file(path)
    set_dims_and_type(path, "blk.0.attn_q.weight", [256, 1], 9)  # Q8_1: an activation format
    return path


def _deep_array(path: Path) -> Path:
    dense_file(path)
    depth = 5000
    nested = struct.pack("<IQ", ValueType.ARRAY, 1) * (depth - 1) + struct.pack("<IQ", ValueType.UINT32, 0)
    insert_kvs(path, kv_record("x.deep", ValueType.ARRAY, nested))
    return path


def _alignment_nan(path: Path) -> Path:
    dense_file(path)
    insert_kvs(path, kv_record("general.alignment", ValueType.FLOAT32, struct.pack("<f", math.nan)))
    return path


def _bad_byte_token(path: Path) -> Path:
    dense_file(path)
    raw = path.read_bytes()
    patch(path, raw.index(b"<0x41>"), b"<0xZZ>")
    return path


def _escape_architecture(path: Path) -> Path:
    evil = "\x1b]0;pwned\x07\x1b[2J" + "A" * 100_000
    return write_llama_gguf(path, random_llama_state(), n_head=4, n_head_kv=4, arch=evil)


def _escape_tensor_name(path: Path) -> Path:
    dense_file(path)
    raw = path.read_bytes()
    name = b"output_norm.weight"
    at = raw.index(struct.pack("<Q", len(name)) + name) + 8
    patch(path, at, b"\x1b[31m\r_norm.weight")  # same length: only the name changes
    set_dims_and_type(path, "\x1b[31m\r_norm.weight", [64], 99)
    return path


def _transposed_down(path: Path) -> Path:
    sd = random_llama_state(n_head_kv=2)
    for i in range(2):
        key = f"model.layers.{i}.mlp.down_proj.weight"
        sd[key] = np.ascontiguousarray(sd[key].T)  # (n_ff, n_embd): never checked before the seams work
    return write_llama_gguf(path, sd, n_head=4, n_head_kv=2)


CLI_CASES: dict[str, tuple[Callable[[Path], Path], tuple[str, ...]]] = {
    "ffn_wider_than_embd": (_ffn_wider_than_embd, ()),
    "output_rows": (_output_rows, ()),
    "rank_chain": (_rank_chain, ()),
    "huge_n_ff": (_huge_n_ff, ()),
    "huge_n_ff_pool": (
        lambda p: _huge_n_ff(p, sparse=True),
        ("--pool-device", "cpu", "--vram-budget", "0.01"),
    ),
    "huge_context": (_huge_context, ("-c", "0")),
    "overflow_dims": (_overflow_dims, ()),
    "max_dim": (_max_dim, ()),
    "zero_dim": (_zero_dim, ()),
    "q8_1_weight": (_q8_1_weight, ()),
    "deep_array": (_deep_array, ()),
    "alignment_nan": (_alignment_nan, ()),
    "bad_byte_token": (_bad_byte_token, ()),
    "escape_architecture": (_escape_architecture, ()),
    "escape_tensor_name": (_escape_tensor_name, ()),
    "transposed_down": (_transposed_down, ()),
}


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory):
    pool = CliPool(tmp_path_factory.mktemp("hostile"))
    yield pool
    pool.executor.shutdown(wait=True)


def refused(cli: CliPool, name: str, *needles: str) -> str:
    path, run = cli.result(name)
    return assert_refused(run, path, *needles)


# ------------------------------------------------------------------------------------------------- the tests


def test_tensor_shapes_checked_against_config(cli: CliPool, tmp_path: Path):
    """Every tensor's shape is checked against the config before a kernel sees it: the FFN/predictor set that
    disagrees with n_embd (the probe's segfault), output rows != n_vocab, the predictor's rank chain."""
    refused(cli, "ffn_wider_than_embd", "blk.0.ffn_gate.weight", "(128, 96)", "expected (128, 64)")
    refused(cli, "output_rows", "output.weight", "(264, 64)", "expected (259, 64)")
    refused(cli, "rank_chain", "blk.1.fc2.weight", "(128, 16)", "expected (128, 32)")


def _reshape(key: str, shape: tuple[int, ...]) -> Callable[[dict, dict], None]:
    def edit(sd: dict, pred: dict) -> None:
        target = pred if key.startswith("blk.") else sd
        target[key] = np.zeros(shape, dtype=np.float32)

    return edit


@pytest.mark.parametrize(
    ("key", "shape", "needle"),
    [
        ("model.embed_tokens.weight", (258, 64), "token_embd.weight"),
        ("model.layers.0.self_attn.q_proj.weight", (32, 64), "blk.0.attn_q.weight"),
        ("model.layers.1.self_attn.k_proj.weight", (32, 64), "blk.1.attn_k.weight"),
        ("model.layers.0.self_attn.v_proj.weight", (64, 32), "blk.0.attn_v.weight"),
        ("model.layers.0.self_attn.o_proj.weight", (64, 32), "blk.0.attn_output.weight"),
        ("model.layers.1.mlp.gate_proj.weight", (96, 64), "blk.1.ffn_gate.weight"),
        ("model.layers.0.mlp.up_proj.weight", (128, 32), "blk.0.ffn_up.weight"),
        ("model.layers.0.mlp.down_proj.weight", (32, 128), "blk.0.ffn_down_t.weight"),
        ("model.layers.0.input_layernorm.weight", (32,), "blk.0.attn_norm.weight"),
        ("model.layers.1.post_attention_layernorm.weight", (65,), "blk.1.ffn_norm.weight"),
        ("model.norm.weight", (63,), "output_norm.weight"),
        ("blk.0.fc1.weight", (32, 32), "blk.0.fc1.weight"),
        ("blk.1.fc2.weight", (96, 32), "blk.1.fc2.weight"),
    ],
)
def test_every_tensor_shape_is_checked(tmp_path: Path, key: str, shape: tuple[int, ...], needle: str):
    path = sparse_file(tmp_path / "m.powerinfer.gguf", _reshape(key, shape))
    refused_in_process(path, FormatError, needle, "expected")
    refused_in_process(path, FormatError, needle, dense_ffn=True)  # the dense run of a PowerInfer file too


def test_transposed_down_projection_is_refused(cli: CliPool):
    """ffn_down must be (n_embd, n_ff); a transposed one used to reach the matmul unchecked."""
    refused(cli, "transposed_down", "blk.0.ffn_down.weight", "(128, 64)", "expected (64, 128)")


def test_metadata_sizes_are_bounded_by_the_tensors(cli: CliPool, tmp_path: Path):
    """feed_forward_length = 2^31 in a tiny file: refused against the FFN tensors before anything sized by it
    is allocated (KV cache, statistics, the planner's tables), in bounded memory."""
    refused(cli, "huge_n_ff", "blk.0.ffn_gate.weight", "expected (2147483648, 64)")
    refused(cli, "huge_n_ff_pool", "blk.0.ffn_gate.weight", "expected (2147483648, 64)")
    path = dense_file(tmp_path / "m.gguf")
    _, value_at = kv_offsets(path, "llama.block_count")
    patch(path, value_at, struct.pack("<I", 2**31))
    refused_in_process(path, FormatError, "block_count 2147483648", "tensors")


def test_huge_context_is_refused_before_allocation(cli: CliPool, tmp_path: Path):
    """context_length 2^32 - 1 with -c 0: the KV cache would take terabytes; refused with the numbers."""
    line = refused(
        cli, "huge_context", "context of 4294967295 tokens", "KV cache 2 layers", "use a smaller context"
    )
    assert "available" in line
    path = _huge_context(tmp_path / "m.gguf")
    refused_in_process(path, InputError, "4294967295", n_ctx=0)
    Engine(path, EngineOptions(act_precision="f32", n_threads=1, n_ctx=64)).eval(
        [1]
    )  # an explicit -c is capped by it: runs


def test_shape_product_overflowing_int64(cli: CliPool):
    refused(cli, "overflow_dims", "token_embd.weight", "more than int64 holds")


def test_zero_and_maximal_dimensions(cli: CliPool, tmp_path: Path):
    refused(cli, "zero_dim", "token_embd.weight", "(0, 64)", "expected (259, 64)")
    refused(cli, "max_dim", "blk.0.attn_q.weight", "dimension out of range")
    path = dense_file(tmp_path / "m.gguf")
    set_dims_and_type(path, "output_norm.weight", [0])
    refused_in_process(path, FormatError, "output_norm.weight", "(0,)")


# ggml type ids (GGUF files) of types without a kernel or a dequantizer
NO_KERNEL_TYPES = {"Q8_1": 9, "Q8_K": 15, "I8": 24, "I16": 25, "I32": 26, "I64": 27, "F64": 28}


def test_tensor_types_without_a_kernel(cli: CliPool, tmp_path: Path):
    refused(cli, "q8_1_weight", "blk.0.attn_q.weight", "Q8_1", "no kernel or dequantizer")
    for type_name, type_id in NO_KERNEL_TYPES.items():
        for name in ("blk.0.attn_q.weight", "token_embd.weight", "blk.1.ffn_down.weight"):
            path = dense_file(tmp_path / f"{type_name}.gguf")
            set_dims_and_type(path, name, [256, 1], type_id)
            refused_in_process(path, FormatError, name, type_name, "no kernel or dequantizer")
        if type_name != "Q8_K":  # a norm vector: as many elements as fit its 256 bytes (Q8_K blocks do not)
            path = dense_file(tmp_path / f"{type_name}_norm.gguf")
            n = 32 if type_name in ("I64", "F64") else 64
            set_dims_and_type(path, "blk.0.attn_norm.weight", [n], type_id)
            refused_in_process(path, FormatError, "blk.0.attn_norm.weight", type_name)


def test_deeply_nested_metadata_arrays(cli: CliPool, tmp_path: Path):
    """Arrays nested 5000 deep: refused at a fixed depth, no RecursionError."""
    refused(cli, "deep_array", "x.deep", "nests arrays deeper than")
    path = dense_file(tmp_path / "m.gguf")
    insert_kvs(path, kv_record("x.wide", ValueType.ARRAY, struct.pack("<IQ", ValueType.STRING, 2**62)))
    refused_in_process(path, FormatError, "x.wide", "4611686018427387904 STRING elements")


NAN = struct.pack("<f", math.nan)


@pytest.mark.parametrize(
    ("key", "vtype", "payload", "error", "needles"),
    [
        (
            "general.alignment",
            ValueType.STRING,
            struct.pack("<Q", 2) + b"32",
            FormatError,
            ("integer", "STRING"),
        ),
        ("general.alignment", ValueType.UINT32, struct.pack("<I", 0), FormatError, ("power of two",)),
        ("general.alignment", ValueType.UINT32, struct.pack("<I", 48), FormatError, ("power of two",)),
        ("tokenizer.ggml.bos_token_id", ValueType.FLOAT32, NAN, ConfigError, ("bos_token_id", "nan")),
        (
            "tokenizer.ggml.bos_token_id",
            ValueType.STRING,
            struct.pack("<Q", 1) + b"1",
            ConfigError,
            ("integer",),
        ),
        (
            "llama.attention.head_count",
            ValueType.FLOAT32,
            struct.pack("<f", 4.0),
            ConfigError,
            ("integer", "4.0"),
        ),
        ("llama.attention.head_count", ValueType.FLOAT32, NAN, ConfigError, ("head_count", "integer")),
        (
            "llama.attention.head_count_kv",
            ValueType.STRING,
            struct.pack("<Q", 1) + b"2",
            ConfigError,
            ("number",),
        ),
        ("llama.attention.head_count", ValueType.UINT32, struct.pack("<I", 0), ConfigError, ("head_count",)),
        ("llama.attention.layer_norm_rms_epsilon", ValueType.FLOAT32, NAN, ConfigError, ("epsilon", "NaN")),
        ("llama.rope.freq_base", ValueType.FLOAT32, struct.pack("<f", math.inf), ConfigError, ("finite",)),
        ("llama.rope.freq_base", ValueType.FLOAT32, struct.pack("<f", -1.0), ConfigError, ("positive",)),
        ("llama.context_length", ValueType.UINT32, struct.pack("<I", 0), ConfigError, ("context_length",)),
        ("llama.block_count", ValueType.BOOL, b"\x01", ConfigError, ("block_count", "number")),
    ],
)
def test_metadata_of_the_wrong_type_or_nan(tmp_path: Path, key, vtype, payload, error, needles):
    path = dense_file(tmp_path / "m.gguf")
    if key == "general.alignment":
        insert_kvs(path, kv_record(key, vtype, payload))
    else:
        replace_kv(path, key, vtype, payload)
    refused_in_process(path, error, *needles)


def test_nan_alignment_and_threshold(cli: CliPool, tmp_path: Path):
    refused(cli, "alignment_nan", "general.alignment", "FLOAT32")
    path = sparse_file(tmp_path / "m.powerinfer.gguf", threshold=0.5)
    replace_kv(path, "powerinfer.sparse_threshold", ValueType.FLOAT32, NAN)
    refused_in_process(path, ConfigError, "powerinfer.sparse_threshold", "NaN")


def test_malformed_byte_token(cli: CliPool):
    refused(cli, "bad_byte_token", "byte token", "<0xZZ>")


def test_file_strings_are_escaped_and_capped(cli: CliPool, tmp_path: Path):
    """Names from the file reach the terminal escaped (no control characters) and cut, whatever their length."""
    line = refused(cli, "escape_architecture", "unknown architecture", "\\x1b]0;pwned\\x07", "...")
    assert "A" * 150 in line and "A" * 400 not in line
    refused(cli, "escape_tensor_name", "\\x1b[31m\\r_norm.weight", "unknown ggml type 99")
    path = dense_file(tmp_path / "m.gguf")
    raw = path.read_bytes()
    name = b"llama.rope.freq_base"
    at = raw.index(name)
    patch(path, at, b"\x1b[2J\x9b" + name[5:])  # a key with control characters and invalid UTF-8 ...
    patch(path, at + len(name), struct.pack("<I", 99))  # ... then its value type smashed
    refused_in_process(path, FormatError, "unknown metadata value type 99", "\\x1b[2J\ufffd.rope.freq_base")


def test_kernels_refuse_inconsistent_arguments():
    """The C entry points compare the lengths they are given and refuse (PI_ERR_SHAPE) rather than read past a
    buffer: rows that overlap (stride < row bytes), activation / output strides shorter than a row, missing
    buffers, row ids past N."""
    lib = library.load()
    if lib is None:
        pytest.skip("powerinfer._kernels is not built")
    shape_error, index_error = library.PI_ERR_SHAPE, library.PI_ERR_INDEX
    N, K, T = 8, 64, 2
    w = torch.zeros(N, K * 4, dtype=torch.uint8)  # F32 rows
    x, y = torch.zeros(T, K), torch.zeros(T, N)
    idx = torch.arange(N, dtype=torch.int64)
    wp, xp, yp, ip = w.data_ptr(), x.data_ptr(), y.data_ptr(), idx.data_ptr()

    matmul = lib.matmul[GGMLType.F32]
    assert matmul(wp, K * 4, N, K, xp, K, T, yp, N, 1, 0) == 0
    assert matmul(wp, K * 4 - 4, N, K, xp, K, T, yp, N, 1, 0) == shape_error  # rows overlap
    assert matmul(wp, K * 4, N, K, xp, K - 1, T, yp, N, 1, 0) == shape_error  # x rows overlap
    assert matmul(wp, K * 4, N, K, xp, K, T, yp, N - 1, 1, 0) == shape_error  # y rows overlap
    assert matmul(None, K * 4, N, K, xp, K, T, yp, N, 1, 0) == shape_error
    assert lib.matmul[GGMLType.Q4_0](wp, 18, N, K, xp, K, T, yp, N, 1, 0) == shape_error  # 2 blocks need 36

    rows_matmul = lib.rows_matmul[GGMLType.F32]
    assert rows_matmul(wp, K * 4, N, K, ip, N, xp, K, T, yp, N, 1, 0) == 0
    assert rows_matmul(wp, K * 2, N, K, ip, N, xp, K, T, yp, N, 1, 0) == shape_error
    assert rows_matmul(wp, K * 4, N - 1, K, ip, N, xp, K, T, yp, N, 1, 0) == index_error  # id 7 of 7 rows

    h, out = torch.zeros(T, N), torch.zeros(T, K)
    axpy = lib.rows_axpy[GGMLType.F32]
    assert axpy(wp, K * 4, N, K, ip, N, h.data_ptr(), N, T, out.data_ptr(), K, 0, 0.0, 1, 0) == 0
    assert (
        axpy(wp, K * 4 - 1, N, K, ip, N, h.data_ptr(), N, T, out.data_ptr(), K, 0, 0.0, 1, 0) == shape_error
    )
    assert (
        axpy(wp, K * 4, N, K, ip, N, h.data_ptr(), N - 1, T, out.data_ptr(), K, 0, 0.0, 1, 0) == shape_error
    )
    assert (
        axpy(wp, K * 4, N, K, ip, N, h.data_ptr(), N, T, out.data_ptr(), K - 32, 0, 0.0, 1, 0) == shape_error
    )
    # TEAL's input threshold must be >= 0 (NaN or negative would skip nothing or everything)
    for h_min in (-1.0, float("nan")):
        assert (
            axpy(wp, K * 4, N, K, ip, N, h.data_ptr(), N, T, out.data_ptr(), K, 0, h_min, 1, 0) == shape_error
        )

    ids, rows = torch.tensor([0, 7], dtype=torch.int64), torch.zeros(2, K)
    get_rows = lib.get_rows[GGMLType.F32]
    assert get_rows(wp, K * 4, N, K, ids.data_ptr(), 2, rows.data_ptr(), K, 1, 0) == 0
    assert get_rows(wp, K * 4 - 4, N, K, ids.data_ptr(), 2, rows.data_ptr(), K, 1, 0) == shape_error
    assert get_rows(wp, K * 4, N, K, ids.data_ptr(), 2, rows.data_ptr(), K - 1, 1, 0) == shape_error
    assert get_rows(wp, K * 4, 7, K, ids.data_ptr(), 2, rows.data_ptr(), K, 1, 0) == index_error

    # the fused decode FFN: gate, up (N, K), down_t (N, D) with D = K; F32 weights (kinds are ggml type ids)
    u, y1 = torch.zeros(K), torch.zeros(K)
    F32 = int(GGMLType.F32)
    scratch = torch.zeros(lib.ffn_rows_scratch_bytes(N, K, 0), dtype=torch.uint8)

    def ffn_rows(down_stride: int, down_ptr: int | None = wp) -> int:
        return lib.ffn_rows(
            u.data_ptr(), K, K, N, wp, K * 4, F32, wp, K * 4, F32, down_ptr, down_stride, F32, ip, N, 0, 0, 0,
            y1.data_ptr(), scratch.data_ptr(), scratch.numel(), 1, 0,
        )  # fmt: skip

    assert ffn_rows(K * 4) == 0
    assert ffn_rows(K * 4 - 4) == shape_error  # the down rows would overlap
    assert ffn_rows(K * 4, None) == shape_error

    # predictor + FFN: fc1 (rank, K), fc2 (N, rank)
    rank = 32
    fc1 = torch.zeros(rank, K * 4, dtype=torch.uint8)
    fc2 = torch.zeros(N, rank * 4, dtype=torch.uint8)
    pscratch = torch.zeros(lib.predict_ffn_scratch_bytes(N, K, rank, 0), dtype=torch.uint8)
    out_idx = torch.zeros(N, dtype=torch.int64)
    n_active = torch.zeros(1, dtype=torch.int64)

    def predict(fc2_stride: int) -> int:
        return lib.predict_ffn(
            u.data_ptr(), u.data_ptr(), K, K, N, fc1.data_ptr(), K * 4, F32, rank, fc2.data_ptr(), fc2_stride, F32,
            0.0, wp, K * 4, F32, wp, K * 4, F32, wp, K * 4, F32, 0, 0, 0, out_idx.data_ptr(), n_active.data_ptr(), None,
            y1.data_ptr(), pscratch.data_ptr(), pscratch.numel(), 1, 0,
        )  # fmt: skip

    assert predict(rank * 4) == 0
    assert predict(rank * 4 - 4) == shape_error  # fc2 rows shorter than the rank

    H, D, n_ctx = 2, 8, 4
    q, k = torch.zeros(H * D), torch.zeros(H * D)
    rope, cache = torch.zeros(D), torch.zeros(n_ctx, H, D)
    ascratch = torch.zeros(lib.attn_decode_scratch_bytes(n_ctx, H), dtype=torch.uint8)

    def attend(pos: int, q_ptr: int | None) -> int:
        return lib.attn_decode(
            q_ptr, k.data_ptr(), k.data_ptr(), rope.data_ptr(), cache.data_ptr(), cache.data_ptr(), 0, 0, n_ctx, pos,
            H, H, D, 1.0, y1.data_ptr(), ascratch.data_ptr(), ascratch.numel(), 0, 1, 0,
        )  # fmt: skip

    assert attend(0, q.data_ptr()) == 0
    assert attend(n_ctx, q.data_ptr()) == shape_error  # the cache has no row n_ctx
    assert attend(0, None) == shape_error
