"""The CUDA pool's Triton kernels (powerinfer.ops.triton_quant) on the CPU, through the Triton interpreter.

The interpreter must be switched on before triton is imported, so the kernels run in one subprocess (CHECK below)
that prints a JSON report; the tests read it. Every supported type, odd N, K not a multiple of the tiles, token
counts in each tile bucket (1, 3, 17), split-K and several column tiles; each result against the float64 product
of the reference dequantisation of the same blocks. The repacking itself (pack / unpack) runs in this process.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import BackgroundCheck, run_background

from powerinfer import quant
from powerinfer.gguf import GGMLType

TESTS = Path(__file__).resolve().parent
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)
# max |y - ref| / max |ref| against float64: measured at most 2.4e-7 over the cases below (float32 sums; the
# activation's hi + lo pieces are exact to 2^-22), bound a few times that
REL_TOL = 2e-6

CHECK = r"""
import json, sys
import numpy as np, torch
sys.path.insert(0, sys.argv[1])
from test_kquant_kernels import random_k_blocks
from powerinfer.gguf import GGMLType
from powerinfer.ops import triton_quant as tq
from powerinfer.quant import K_QUANT_TYPES, dequantize, quantize

def weight(t, n, k, seed):
    if t in K_QUANT_TYPES:
        return torch.from_numpy(random_k_blocks(t, n, k, seed=seed))
    w = np.random.default_rng(seed).normal(0, 1, (n, k)).astype(np.float32)
    w[0, :5] = 0.0
    return torch.from_numpy(quantize(w, t))

def rel(y, ref):
    return float((y.double() - ref).abs().max() / ref.abs().max())

torch.manual_seed(0)
out = {"errors": [], "invariant": {}, "zero_rows": {}, "meta": {}}
for t in sorted(tq.SUPPORTED_TYPES, key=int):
    # N = 37: two row tiles, the second partial (K-quants: 20); K: a tail of blocks past the loop step (and past a 32-column
    # block for the float types); Q4_0 / Q8_0 at K = 96 read their words byte by byte (rows of 54 and 102 bytes)
    kq = t in K_QUANT_TYPES
    shapes = [(20, 512)] if kq else [(37, 40 if t in (GGMLType.F16, GGMLType.F32, GGMLType.BF16) else 96)]
    if t in (GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.F16):
        shapes.append((5, 1088))  # rows read as words; two column tiles in axpy; two splits in matmul
    for n, k in shapes:
        raw = weight(t, n, k, seed=n + k)
        w = tq.pack(raw, t, k)
        dense = torch.from_numpy(dequantize(raw.numpy(), t, (n, k)).copy()).double()
        x = torch.randn(17, k, dtype=torch.float64)
        h = torch.randn(17, n, dtype=torch.float64) * (torch.rand(17, n) < 0.5)
        if n > 16:
            h[:, :8] = 0.0  # a chunk of rows zero for every token: skipped
        h[2] = 0.0  # a token whose activations are all zero
        ys = {T: tq.matmul(x[:T].float(), w) for T in (1, 3, 17)}
        zs = {T: tq.axpy(h[:T].float(), w) for T in (1, 3, 17)}
        for T in (1, 3, 17):
            out["errors"].append([t.name, "matmul", n, k, T, rel(ys[T], x[:T] @ dense.T)])
            out["errors"].append([t.name, "axpy", n, k, T, rel(zs[T], h[:T] @ dense)])
        y_half = tq.matmul(x[:3].half(), w)
        out["errors"].append([t.name, "matmul-f16x", n, k, 3, rel(y_half, x[:3].half().double() @ dense.T)])
        key = f"{t.name} {n}x{k}"
        # a token's row is the same bits whatever the other tokens and T (tile buckets 8 / 32 and 1 / 4 / 8)
        y1 = [tq.matmul(x[i : i + 1].float(), w)[0] for i in (0, 1)]
        z1 = [tq.axpy(h[i : i + 1].float(), w)[0] for i in (0, 1)]
        out["invariant"][key] = [
            bool(torch.equal(ys[17][:3], ys[3]) and all(torch.equal(ys[3][i], y1[i]) for i in (0, 1))),
            bool(torch.equal(zs[17][:3], zs[3]) and all(torch.equal(zs[3][i], z1[i]) for i in (0, 1))),
        ]
        out["zero_rows"][key] = bool(torch.equal(zs[17][2], torch.zeros(k)))
        out["meta"][key] = {"words": w.weight_arg()[2], "T": [1, 3, 17]}
print(json.dumps(out))
"""


INTERPRETER_CHECK = BackgroundCheck(
    (sys.executable, "-c", CHECK, str(TESTS)), (("TRITON_INTERPRET", "1"), ("OMP_NUM_THREADS", "1"))
)


@pytest.fixture(scope="module")
def report(request) -> dict:
    proc = run_background(request, INTERPRETER_CHECK)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_triton
@pytest.mark.slow
@pytest.mark.background(INTERPRETER_CHECK)
def test_every_type_equals_the_float64_product(report):
    errors = report["errors"]
    assert {e[0] for e in errors} == {t.name for t in quant.POOL_TYPES}
    bad = [e for e in errors if not e[-1] < REL_TOL]
    assert not bad, bad
    # the words of Q4_0 / Q8_0 rows read both ways (aligned rows as int32, odd rows byte by byte)
    words = {key: m["words"] for key, m in report["meta"].items()}
    assert words["Q4_0 37x96"] is False and words["Q4_0 5x1088"] is True
    assert words["Q8_0 37x96"] is False and words["Q8_0 5x1088"] is True


@needs_triton
@pytest.mark.slow
@pytest.mark.background(INTERPRETER_CHECK)
def test_a_tokens_bits_do_not_depend_on_the_batch(report):
    """Row t of a 17-token (or 3-token) call is bit for bit the 1-token call on that row: matmul and axpy."""
    bad = {key: v for key, v in report["invariant"].items() if v != [True, True]}
    assert not bad, bad


@needs_triton
@pytest.mark.slow
@pytest.mark.background(INTERPRETER_CHECK)
def test_axpy_of_an_all_zero_token_is_exactly_zero(report):
    bad = [key for key, ok in report["zero_rows"].items() if not ok]
    assert not bad, bad


@pytest.mark.parametrize("ggml_type", sorted(quant.POOL_TYPES), ids=lambda t: t.name)
def test_pack_keeps_the_bytes_and_unpack_inverts_it(ggml_type):
    pytest.importorskip("triton")
    from test_kquant_kernels import random_k_blocks

    from powerinfer.ops import triton_quant as tq

    n_cols = 512 if ggml_type in quant.K_QUANT_TYPES else 96
    if ggml_type in quant.K_QUANT_TYPES:
        raw = torch.from_numpy(random_k_blocks(ggml_type, 7, n_cols, seed=1))
    else:
        w = np.random.default_rng(1).normal(0, 1, (7, n_cols)).astype(np.float32)
        raw = torch.from_numpy(quant.quantize(w, ggml_type))
    packed = tq.pack(raw, ggml_type, n_cols)
    assert (
        packed.data.dtype == torch.uint8 and packed.data.shape == raw.shape
    )  # the planner's bytes, row by row
    assert torch.equal(tq.unpack(packed), raw)
    # rows stay rows: a slice of the packed rows is the packing of the slice
    assert torch.equal(tq.pack(raw[2:5], ggml_type, n_cols).data, packed.data[2:5])


def test_q4_0_words_hold_neighbouring_elements_in_their_two_halves():
    """The repacked Q4_0 block: nibbles n and n + 4 of a word are elements 8w + 2n and 8w + 2n + 1."""
    pytest.importorskip("triton")
    from powerinfer.ops import triton_quant as tq

    q = np.arange(32) % 16  # element e has quant e % 16
    block = np.zeros(18, dtype=np.uint8)
    block[2:] = (q[:16] | (q[16:] << 4)).astype(np.uint8)
    packed = tq.pack(torch.from_numpy(block[None]), GGMLType.Q4_0, 32).data[0, :16].numpy()
    words = packed.view("<u4")
    for w in range(4):
        for n in range(4):
            assert (words[w] >> (4 * n)) & 15 == q[8 * w + 2 * n]
            assert (words[w] >> (16 + 4 * n)) & 15 == q[8 * w + 2 * n + 1]
