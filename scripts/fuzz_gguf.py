#!/usr/bin/env python3
"""Mutation fuzzing of model files: a hostile GGUF or PowerInfer (PWRI) file must end in a PowerInferError, never
in a crash, a hang, another exception, unbounded memory or an unprintable error line.

The parent writes three tiny valid files (a dense F32 Llama GGUF with grouped-query attention, a PowerInfer F16
file and a PowerInfer Q4_0/Q8_0 file; n_embd 64, 2 layers), then runs a worker subprocess with an address-space
cap (RLIMIT_AS: its size after start-up plus --mem-mib). The worker draws cases with hypothesis (seeded): one to
three mutations of one base file (bit flips, truncation, byte-range fills and shifts of the header, field
smashing of header counts, metadata types, values and string lengths, tensor dims, types and offsets with
boundary values such as 0, 2^31, 2^32 - 1, 2^63, 2^64 - 1, NaN and infinities, garbage in tensor data) and runs
each through read_gguf, Engine construction and one decode step (Engine.eval([1])) in-process, under a per-case
timer. Each case is announced on stdout before it runs, so a crash (signal) or a hang (no result within the
time limit) of the worker is attributed to its case; the worker is then restarted for the remaining cases.

Outcomes: ok (the mutation was harmless), clean (a PowerInferError with one printable line under 500 bytes,
counted by message class), and the failures: unexpected (any other exception), bad_message, timeout (the
per-case timer fired in Python), hang (the worker stopped answering), crash (the worker died).

Usage: python scripts/fuzz_gguf.py [--cases 20000] [--seed 0] [--case-timeout 10] [--mem-mib 1024] [--json]
       python scripts/fuzz_gguf.py --replay CASES_JSON     (a case, or a list of cases, as in a failure report)
Exit code 0 when no case failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

MAX_MESSAGE_BYTES = 500
STARTUP_TIMEOUT = 180.0  # seconds for the worker's imports and warm-up
HANG_GRACE = 10.0  # seconds past the per-case timer before the worker counts as hung
FAILURE_KINDS = ("unexpected", "bad_message", "timeout", "hang", "crash", "stdout")

# ---------------------------------------------------------------------------------------------------- base files

TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
TOKEN_TYPES = [2, 3, 3] + [6] * 256


def write_base(path: Path, *, sparse: bool, dtype: Any, ffn_dtype: Any, output_dtype: Any, seed: int) -> Path:
    """A valid tiny Llama file (n_embd 64, n_ff 128, 2 layers, 4 heads, KV heads 2 for dense / 4 for sparse)."""
    from powerinfer.gguf import GGMLType, GGUFWriter

    n_embd, n_ff, n_layer, n_head = 64, 128, 2, 4
    n_head_kv = 4 if sparse else 2
    head_dim, rank = n_embd // n_head, 32
    pred_dtype = dtype if dtype == GGMLType.F32 else GGMLType.F16
    rng = np.random.default_rng(seed)

    def m(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.08, shape).astype(np.float32)

    def norm() -> np.ndarray:
        return rng.uniform(0.8, 1.2, n_embd).astype(np.float32)

    w = GGUFWriter(path, sparse=sparse)
    for key, value in {
        "general.architecture": "llama",
        "general.name": "fuzz-base",
        "llama.context_length": 128,
        "llama.embedding_length": n_embd,
        "llama.block_count": n_layer,
        "llama.feed_forward_length": n_ff,
        "llama.rope.dimension_count": head_dim,
        "llama.attention.head_count": n_head,
        "llama.attention.head_count_kv": n_head_kv,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.scores": np.zeros(len(TOKENS), dtype=np.float32),
        "tokenizer.ggml.token_type": np.array(TOKEN_TYPES, dtype=np.int32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        **({"powerinfer.ffn_activation": "relu", "powerinfer.sparse_threshold": 0.0} if sparse else {}),
    }.items():
        w.add(key, value)
    w.add_tensor("token_embd.weight", m(len(TOKENS), n_embd), dtype)
    w.add_tensor("output_norm.weight", norm())
    w.add_tensor("output.weight", m(len(TOKENS), n_embd), output_dtype)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.attn_q.weight", m(n_embd, n_embd), dtype)
        w.add_tensor(f"blk.{i}.attn_k.weight", m(n_head_kv * head_dim, n_embd), dtype)
        w.add_tensor(f"blk.{i}.attn_v.weight", m(n_head_kv * head_dim, n_embd), dtype)
        w.add_tensor(f"blk.{i}.attn_output.weight", m(n_embd, n_embd), dtype)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        w.add_tensor(f"blk.{i}.ffn_gate.weight", m(n_ff, n_embd), ffn_dtype)
        w.add_tensor(f"blk.{i}.ffn_up.weight", m(n_ff, n_embd), ffn_dtype)
        if sparse:  # predictors stay F16 in quantized files, as PowerInfer's converter leaves them
            w.add_tensor(f"blk.{i}.ffn_down_t.weight", m(n_ff, n_embd), ffn_dtype)
            w.add_tensor(f"blk.{i}.fc1.weight", m(rank, n_embd), pred_dtype)
            w.add_tensor(f"blk.{i}.fc2.weight", m(n_ff, rank), pred_dtype)
        else:
            w.add_tensor(f"blk.{i}.ffn_down.weight", m(n_embd, n_ff), ffn_dtype)
    w.write()
    return path


def make_bases(folder: Path) -> dict[str, Path]:
    """The three base files, deterministic (same bytes on every run, so a reported case replays anywhere)."""
    from powerinfer.gguf import GGMLType

    T = GGMLType
    # name: (PowerInfer file, type of the matrices, of the FFN, of the output head)
    kinds = {"dense": (False, T.F32, T.F32, T.F32), "sparse": (True, T.F16, T.F16, T.F16),
             "sparse_q4": (True, T.Q4_0, T.Q4_0, T.Q8_0)}  # fmt: skip
    return {
        name: write_base(folder / f"{name}.gguf", sparse=sp, dtype=d, ffn_dtype=f, output_dtype=o, seed=seed)
        for seed, (name, (sp, d, f, o)) in enumerate(kinds.items(), start=1)
    }


# ------------------------------------------------------------------------------------------------------ layout

_SCALAR_FMT = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<B",
    10: "<Q",
    11: "<q",
    12: "<d",
}


def layout(data: bytes) -> dict[str, list[tuple[int, str]]]:
    """Fields of a valid GGUF file by category: (byte offset, struct format) of every header field a mutation
    can smash; "kv" holds whole metadata records (offset, "key length:record length"), "matrix" the dims of
    2-D tensors, "header_end" the end of the tensor infos. Trusts its input (only run on the base files)."""
    fields: dict[str, list[tuple[int, str]]] = {}

    def add(category: str, offset: int, fmt: str) -> None:
        fields.setdefault(category, []).append((offset, fmt))

    pos = 4
    add("count", pos, "<I")  # version
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    add("count", 8, "<Q")
    add("count", 16, "<Q")
    pos = 24

    def string(category: str) -> int:
        nonlocal pos
        add(category, pos, "<Q")
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        return n

    for _ in range(n_kv):
        start = pos
        key_len = string("key_len")
        add("vtype", pos, "<I")
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if vtype == 8:
            string("str_len")
        elif vtype == 9:
            add("arr_type", pos, "<I")
            (etype,) = struct.unpack_from("<I", data, pos)
            add("arr_count", pos + 4, "<Q")
            (count,) = struct.unpack_from("<Q", data, pos + 4)
            pos += 12
            if etype == 8:
                for _ in range(count):
                    string("arr_str_len")
            else:
                size = struct.calcsize(_SCALAR_FMT[etype])
                for i in range(min(count, 8)):
                    add("arr_value", pos + i * size, _SCALAR_FMT[etype])
                pos += count * size
        else:
            fmt = _SCALAR_FMT[vtype]
            add("float_value" if fmt in ("<f", "<d") else "int_value", pos, fmt)
            pos += struct.calcsize(fmt)
        add("kv", start, f"{key_len}:{pos - start}")  # whole records, for the value replacements
    for _ in range(n_tensors):
        string("name_len")
        add("n_dims", pos, "<I")
        (n_dims,) = struct.unpack_from("<I", data, pos)
        pos += 4
        for d in range(n_dims):
            add("dim", pos + 8 * d, "<Q")
        if n_dims == 2:  # whole matrices, for the shape-preserving mutations
            add("matrix", pos, "<QQ")
        pos += 8 * n_dims
        add("ttype", pos, "<I")
        add("toffset", pos + 4, "<Q")
        pos += 12
    fields["header_end"] = [(pos, "")]
    return fields


# -------------------------------------------------------------------------------------------------- mutations

INTERESTING = [
    0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 33, 63, 64, 65, 127, 128, 255, 256, 259, 1023, 1024, 4096, 65535, 65536,
    2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**40, 2**48, 2**62, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1,
]  # fmt: skip
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1.0, 1e-45, 3.4e38, -3.4e38, 1e-30]


def _string(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def _array(etype: int, fmt: str, values: list[Any]) -> bytes:
    return struct.pack("<IQ", etype, len(values)) + b"".join(struct.pack(fmt, v) for v in values)


# (value type, encoded value) a metadata record's value is replaced with: every type, wrong kinds for the keys
# that are read (strings for numbers, arrays for strings ...), NaN, infinities, extremes, escapes, nesting
NEW_VALUES: list[tuple[int, bytes]] = [
    (4, struct.pack("<I", 0)), (4, struct.pack("<I", 1)), (4, struct.pack("<I", 2**31)),
    (4, struct.pack("<I", 2**32 - 1)), (5, struct.pack("<i", -1)), (10, struct.pack("<Q", 2**64 - 1)),
    (11, struct.pack("<q", -(2**63))), (6, struct.pack("<f", math.nan)), (6, struct.pack("<f", math.inf)),
    (6, struct.pack("<f", 4.0)), (6, struct.pack("<f", -1.0)), (12, struct.pack("<d", math.nan)), (7, b"\x01"),
    (0, b"\x07"), (8, _string(b"")), (8, _string(b"llama")), (8, _string(b"gpt2")), (8, _string(b"relu")),
    (8, _string(b"linear")), (8, _string(b"\x1b[2J" + b"A" * 300)), (8, _string(b"\xff\xfe")),
    (9, _array(4, "<I", [1, 2])), (9, _array(6, "<f", [math.nan])), (9, _array(4, "<I", [])),
    (9, struct.pack("<IQ", 8, 2) + _string(b"a") + _string(b"b")), (9, _array(7, "<B", [1])),
    (9, struct.pack("<IQ", 9, 1) * 3 + struct.pack("<IQ", 4, 0)),
]  # fmt: skip

CATEGORY_WEIGHTS = {
    "count": 2, "key_len": 2, "vtype": 3, "int_value": 5, "float_value": 3, "str_len": 2, "arr_type": 2,
    "arr_count": 3, "arr_str_len": 2, "arr_value": 2, "name_len": 2, "n_dims": 2, "dim": 6, "ttype": 4,
    "toffset": 3,
}  # fmt: skip


def case_strategy(bases: dict[str, bytes], layouts: dict[str, dict[str, list[tuple[int, str]]]]) -> Any:
    """A hypothesis strategy of cases: {"base", "ops", "n_ctx", "dense_ffn"}, every op concrete (replayable)."""
    from hypothesis import strategies as st

    categories = [c for c, w in CATEGORY_WEIGHTS.items() for _ in range(w)]

    @st.composite
    def case(draw: Any) -> dict[str, Any]:
        base = draw(st.sampled_from(sorted(bases)))
        data, fields = bases[base], layouts[base]
        header_end = fields["header_end"][0][0]
        size = len(data)

        def smash() -> list[Any]:
            category = draw(st.sampled_from([c for c in categories if c in fields]))
            offset, fmt = draw(st.sampled_from(fields[category]))
            n = struct.calcsize(fmt)
            if fmt in ("<f", "<d"):
                value = draw(st.sampled_from(SPECIAL_FLOATS) | st.floats(width=32 if fmt == "<f" else 64))
                return ["set", offset, n, int.from_bytes(struct.pack(fmt, value), "little")]
            (orig,) = struct.unpack_from("<" + fmt[1].upper(), data, offset)
            top = 2 ** (8 * n) - 1
            value = draw(
                st.sampled_from([v for v in INTERESTING if v <= top])
                | st.integers(-4, 4).map(lambda d: (orig + d) % (top + 1))
                | st.sampled_from([orig * 2 % (top + 1), orig // 2, orig * 4 % (top + 1)])
                | st.integers(0, 45 if category in ("vtype", "arr_type", "ttype") else top)
            )
            return ["set", offset, n, value]

        def reshape() -> list[Any]:
            """A matrix's dims refactored with the same element count (the file still parses): shape checks."""
            offset, _ = draw(st.sampled_from(fields["matrix"]))
            ne0, ne1 = struct.unpack_from("<QQ", data, offset)
            factor = draw(st.sampled_from([2, 4, 8, 32]))
            if draw(st.booleans()) and ne1 % factor == 0:
                ne0, ne1 = ne0 * factor, ne1 // factor
            elif ne0 % (32 * factor) == 0:
                ne0, ne1 = ne0 // factor, ne1 * factor
            else:
                ne0, ne1 = ne1, ne0
            return ["set", offset, 16, ne0 | ne1 << 64]

        def retype() -> list[Any]:
            """A tensor's type swapped for one of the same byte size (F32 -> I32, F16 -> BF16 or I16, Q4_0 ->
            IQ4_NL): types without kernels and types only decoded in Python reach the loader."""
            offset, _ = draw(st.sampled_from(fields["ttype"]))
            (old,) = struct.unpack_from("<I", data, offset)
            legacy = data[:4] == b"PWRI"  # PowerInfer's ids 16-18 are I8, I16, I32
            same_size = {0: [18 if legacy else 26], 1: [30, 17 if legacy else 25], 2: [20]}
            return ["set", offset, 4, draw(st.sampled_from(same_size.get(old, [old])))]

        def revalue() -> list[Any]:
            """A metadata record's value replaced by one of another type (NEW_VALUES); a filler record keeps the
            header length a multiple of the alignment, so the tensor data stays in place."""
            start, spec = draw(st.sampled_from(fields["kv"]))
            key_len, old_len = map(int, spec.split(":"))
            vtype, payload = draw(st.sampled_from(NEW_VALUES))
            record = data[start : start + 8 + key_len] + struct.pack("<I", vtype) + payload
            pad = (-(len(record) - old_len + 13)) % 32 or 32
            filler = _string(f"fill{start}".encode().ljust(pad, b"_")[:pad]) + struct.pack("<I", 0) + b"\x01"
            return ["kv", start, old_len, (record + filler).hex()]

        def op() -> list[Any]:
            kinds = ["smash"] * 10 + ["flip"] * 4 + ["flip_any", "trunc", "trunc", "fill", "shift", "data"]
            kind = draw(st.sampled_from(kinds + ["reshape"] * 3 + ["retype"] * 2 + ["revalue"] * 4))
            if kind == "smash":
                return smash()
            if kind == "revalue":
                return revalue()
            if kind == "reshape":
                return reshape()
            if kind == "retype":
                return retype()
            if kind == "flip":  # a bit of a header field, or anywhere in the header after the magic
                if draw(st.booleans()):
                    offset, fmt = draw(
                        st.sampled_from(fields[draw(st.sampled_from(sorted(CATEGORY_WEIGHTS)))])
                    )
                    return ["flip", offset * 8 + draw(st.integers(0, 8 * struct.calcsize(fmt) - 1))]
                return ["flip", draw(st.integers(32, header_end * 8 - 1))]
            if kind == "flip_any":
                return ["flip", draw(st.integers(0, size * 8 - 1))]
            if kind == "trunc":
                return ["trunc", draw(st.integers(0, header_end + 64) | st.integers(0, size - 1))]
            if kind == "fill":
                start = draw(st.integers(0, header_end - 1))
                return ["fill", start, draw(st.integers(1, 64)), draw(st.sampled_from([0, 0xFF, 0x7F, 0x80]))]
            if kind == "shift":
                at = draw(st.integers(24, header_end - 1))
                if draw(st.booleans()):
                    return ["delete", at, draw(st.integers(1, 16))]
                return ["insert", at, draw(st.binary(min_size=1, max_size=16)).hex()]
            # garbage in tensor data (NaN, infinity and zero patterns), somewhere after the header
            start, n = draw(st.integers(header_end, size - 1)), draw(st.integers(1, 4096))
            return ["fill", start, n, draw(st.sampled_from([0xFF, 0x7F, 0x7C, 0x00]))]

        ops = [op() for _ in range(draw(st.integers(1, 3)))]
        n_ctx = draw(st.sampled_from([64, 64, 0]))  # 0: the file's context_length
        return {"base": base, "ops": ops, "n_ctx": n_ctx, "dense_ffn": draw(st.booleans())}

    return case()


def apply_ops(data: bytes, ops: list[list[Any]]) -> bytes:
    """The base bytes with a case's mutations applied in order (ops past the current end are skipped)."""
    out = bytearray(data)
    for op in ops:
        kind = op[0]
        if kind == "set":
            _, offset, n, value = op
            if offset + n <= len(out):
                out[offset : offset + n] = int(value).to_bytes(n, "little")
        elif kind == "flip":
            if op[1] // 8 < len(out):
                out[op[1] // 8] ^= 1 << (op[1] % 8)
        elif kind == "trunc":
            del out[op[1] :]
        elif kind == "fill":
            _, start, n, byte = op
            out[start : start + n] = bytes([byte]) * len(out[start : start + n])
        elif kind == "delete":
            del out[op[1] : op[1] + op[2]]
        elif kind == "insert":
            out[op[1] : op[1]] = bytes.fromhex(op[2])
        elif kind == "kv":  # a record replaced, plus one filler record
            _, start, old_len, new = op
            if start + old_len <= len(out) and len(out) >= 24:
                out[start : start + old_len] = bytes.fromhex(new)
                n_kv = int.from_bytes(out[16:24], "little")
                out[16:24] = ((n_kv + 1) % 2**64).to_bytes(8, "little")
        elif kind in ("selftest_crash", "selftest_hang"):
            pass
        else:
            raise ValueError(f"unknown op {kind!r}")
    return bytes(out)


# ----------------------------------------------------------------------------------------------------- worker


def replay_cases(text: str) -> list[dict[str, Any]]:
    """The cases of --replay: one case object or a list of them."""
    cases = json.loads(text)
    return cases if isinstance(cases, list) else [cases]


class CaseTimeout(Exception):
    """The per-case timer fired."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise CaseTimeout()


def message_class(message: str, path: str) -> str:
    """An error message without its file path, quoted file strings and numbers: the class it is counted in."""
    text = message.replace(path, "FILE")
    text = re.sub(r"'[^']*'", "'_'", text)
    text = re.sub(r"\(.*?\)", "(..)", text)
    text = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", text)
    return text[:90]


def run_case(
    case: dict[str, Any], base_bytes: dict[str, bytes], path: Path, timeout: float
) -> dict[str, Any]:
    """One case in-process: mutate, write, read_gguf + Engine + eval([1]); the outcome as a dict."""
    from powerinfer.errors import PowerInferError
    from powerinfer.gguf import read_gguf
    from powerinfer.runtime.engine import Engine, EngineOptions

    ops = case["ops"]
    if ops and ops[0][0] == "selftest_crash":  # the harness's own check: a segfault must be detected
        os.kill(os.getpid(), signal.SIGSEGV)
    path.unlink(missing_ok=True)  # a new file each case: a mapping of the last one never sees it change
    path.write_bytes(apply_ops(base_bytes[case["base"]], ops))
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        if ops and ops[0][0] == "selftest_hang":  # a hang the timer cannot interrupt, as in C code
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(timeout + 3600)
        read_gguf(path)
        engine = Engine(
            path,
            EngineOptions(act_precision="f32", n_ctx=case["n_ctx"], n_threads=1, dense_ffn=case["dense_ffn"]),
        )
        engine.eval([1])
        return {"outcome": "ok"}
    except PowerInferError as e:
        message = str(e)
        if (
            "\n" in message
            or len(message.encode("utf-8", "replace")) >= MAX_MESSAGE_BYTES
            or any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in message)
        ):
            return {"outcome": "bad_message", "type": type(e).__name__, "message": ascii(message[:400])}
        return {"outcome": "clean", "class": f"{type(e).__name__}: {message_class(message, str(path))}"}
    except CaseTimeout:
        return {"outcome": "timeout"}
    except Exception as e:  # every other exception is a finding, reported with where it was raised
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"
        return {
            "outcome": "unexpected",
            "type": type(e).__name__,
            "message": ascii(str(e)[:300]),
            "where": where,
        }
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _vm_size() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def worker(args: argparse.Namespace) -> int:
    """Run cases, one JSON line on stdout before ("start") and after ("end") each."""
    import resource
    import warnings

    import torch
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # NaN weights make numpy warn; warnings are not findings
    folder = Path(args.worker)
    base_bytes = {p.stem: p.read_bytes() for p in sorted(folder.glob("*.gguf"))}
    layouts = {name: layout(data) for name, data in base_bytes.items()}
    path = folder / "case" / "case.gguf"
    path.parent.mkdir(exist_ok=True)
    signal.signal(signal.SIGALRM, _on_alarm)
    run_case({"base": "dense", "ops": [], "n_ctx": 64, "dense_ffn": False}, base_bytes, path, 60.0)  # warm-up
    cap = _vm_size() + args.mem_mib * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    def emit(record: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()

    index = args.start

    def one(case: dict[str, Any]) -> None:
        nonlocal index
        emit({"start": index, "case": case})
        result = run_case(case, base_bytes, path, args.case_timeout)
        emit({"end": index, **result})
        index += 1
        if index % 500 == 0:
            gc.collect()  # engines of earlier cases held by reference cycles count against the cap

    if args.replay is not None:
        for case in replay_cases(args.replay)[index:]:
            one(case)
        return 0
    seed = args.seed
    cases = case_strategy(base_bytes, layouts)
    while index < args.cases:

        @settings(
            max_examples=args.cases - index,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
            verbosity=Verbosity.quiet,
        )
        @hypothesis_seed(seed)
        @given(st.data())
        def draw_and_run(data: Any) -> None:
            if index < args.cases:
                one(data.draw(cases))

        draw_and_run()
        seed += 1  # hypothesis stopped early (rare): continue with a fresh stream
    return 0


# ----------------------------------------------------------------------------------------------------- parent


def campaign(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Run args.cases cases through worker subprocesses; restart after a crash or hang."""
    make_bases(folder)
    t0 = time.perf_counter()
    outcomes: Counter[str] = Counter()
    classes: Counter[str] = Counter()
    failures: list[dict[str, Any]] = []
    done, restarts = 0, 0
    total = len(replay_cases(args.replay)) if args.replay is not None else args.cases
    stderr_path = folder / "worker.stderr"
    while done < total:
        cmd = [sys.executable, "-X", "faulthandler", os.path.abspath(__file__), "--worker", str(folder)]
        cmd += ["--cases", str(args.cases), "--start", str(done), "--seed", str(args.seed + 7919 * restarts)]
        cmd += ["--case-timeout", str(args.case_timeout), "--mem-mib", str(args.mem_mib)]
        if args.replay is not None:
            cmd += ["--replay", args.replay]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
        with open(stderr_path, "wb") as err:
            # cwd: the folder, which also takes hypothesis's own cache (.hypothesis)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, cwd=folder)
        assert proc.stdout is not None
        current: dict[str, Any] | None = None
        buffer = b""
        limit = STARTUP_TIMEOUT
        failed_case = None
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], limit)
            if not ready:  # no word within the limit: hung
                proc.kill()
                proc.wait()
                failed_case = ("hang", current)
                break
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                proc.wait()
                if current is not None or proc.returncode != 0:
                    failed_case = ("crash", current)
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:  # not ours: something in the worker wrote to stdout
                    outcomes["stdout"] += 1
                    failures.append({"outcome": "stdout", "line": ascii(line[:200])})
                    continue
                if "start" in record:
                    current = record
                    limit = args.case_timeout + args.hang_grace
                    continue
                case = current["case"] if current is not None else None
                current = None
                done += 1
                outcomes[record["outcome"]] += 1
                if record["outcome"] == "clean":
                    classes[record["class"]] += 1
                elif record["outcome"] != "ok":
                    failures.append({**record, "case": case})
        proc.stdout.close()
        if failed_case is not None:
            kind, record = failed_case
            tail = stderr_path.read_text(errors="replace").strip().splitlines()[-12:]
            outcomes[kind] += 1
            failures.append(
                {
                    "outcome": kind,
                    "index": None if record is None else record["start"],
                    "case": None if record is None else record["case"],
                    "returncode": proc.returncode,
                    "stderr": tail,
                }
            )
            if record is None:  # died outside a case (start-up): nothing to resume
                break
            done += 1
            restarts += 1
    elapsed = time.perf_counter() - t0
    return {
        "cases": done,
        "seed": args.seed,
        "seconds": round(elapsed, 1),
        "outcomes": dict(outcomes),
        "clean_classes": dict(classes.most_common()),
        "failures": failures,
        "restarts": restarts,
    }


def _print_report(summary: dict[str, Any]) -> None:
    out = summary["outcomes"]
    print(f"cases {summary['cases']} (seed {summary['seed']}) in {summary['seconds']} s, ", end="")
    print(f"{summary['restarts']} restarts")
    for kind in ("ok", "clean", *FAILURE_KINDS):
        print(f"  {kind:12s} {out.get(kind, 0)}")
    print("clean errors by message class:")
    for cls, n in summary["clean_classes"].items():
        print(f"  {n:6d}  {cls}")
    for f in summary["failures"]:
        print("FAILURE", json.dumps(f))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case-timeout", type=float, default=10.0, help="seconds per case")
    parser.add_argument("--mem-mib", type=int, default=1024, help="address space a worker may add (MiB)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    parser.add_argument("--replay", help="run these cases: one case or a list (JSON as in a failure report)")
    parser.add_argument(
        "--hang-grace",
        type=float,
        default=HANG_GRACE,
        help="seconds past --case-timeout before a worker is hung",
    )
    parser.add_argument("--workdir", help="folder for the base files (default: a temporary one)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="fuzz-gguf-", dir=args.workdir) as tmp:
        summary = campaign(args, Path(tmp))
    if args.json:
        print(json.dumps(summary))
    else:
        _print_report(summary)
    bad = sum(summary["outcomes"].get(k, 0) for k in FAILURE_KINDS)
    total = len(replay_cases(args.replay)) if args.replay is not None else args.cases
    return 1 if bad or summary["cases"] < total else 0


if __name__ == "__main__":
    sys.exit(main())
