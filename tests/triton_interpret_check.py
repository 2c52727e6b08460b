"""Checks of the pool's Triton kernels on the CPU, through the Triton interpreter (not a test file itself).

tests/test_device_quant.py runs this script in a subprocess with TRITON_INTERPRET=1 (the variable must be set
before triton is imported, so it cannot run inside the pytest process). It prints one JSON object:
  {"kernels": [[type, op, N, K, T, n_split, rel_err], ...], "engine": {type: max |logit diff|}, "failures": [...]}
and exits 1 when a check fails. rel_err is max |y - ref| / max |ref| against the float64 product of the
reference dequantisation of the same raw blocks; the kernels sum in float32, so it must stay below REL_TOL.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REL_TOL = 1e-5  # float32 accumulation over K <= 1024 terms (observed ~2e-7; K-quants <= 3.4e-7)
LOGIT_TOL = 1e-4  # whole model, Triton pool vs the all-CPU engine (same tolerance as the C stand-in)


def check_kernels(failures: list[str]) -> list[list]:
    from test_kquant_kernels import random_k_blocks

    from powerinfer.gguf.constants import GGMLType
    from powerinfer.ops import triton_quant
    from powerinfer.quant import K_QUANT_TYPES, dequantize, quantize

    rng = np.random.default_rng(0)
    out = []
    # N not a multiple of the row tile (32/64), K from one block up; F16/F32 rows also of odd length; K-quants
    # from one super-block up (random valid super-blocks: nothing quantizes to them here yet)
    shapes = [(37, 32), (5, 64), (70, 96), (33, 1024)]
    k_shapes = [(37, 256), (5, 512), (33, 1024)]
    cases = [
        (t, n, k)
        for t in triton_quant.SUPPORTED_TYPES
        for n, k in (k_shapes if t in K_QUANT_TYPES else shapes)
    ]
    cases += [(GGMLType.F16, 9, 40), (GGMLType.F32, 9, 24)]
    for ggml_type, n_rows, n_cols in sorted(cases, key=lambda c: (c[0].value, c[1], c[2])):
        if ggml_type in K_QUANT_TYPES:
            raw = torch.from_numpy(random_k_blocks(ggml_type, n_rows, n_cols, seed=n_rows))
        else:
            w = rng.normal(0, 1, (n_rows, n_cols)).astype(np.float32)
            w[0, :5] = 0.0  # zeros and a negative-zero scale somewhere
            raw = torch.from_numpy(quantize(w, ggml_type))
        dense = torch.from_numpy(dequantize(raw.numpy(), ggml_type, (n_rows, n_cols)).copy()).double()
        # the interpreter is slow: K = 1024 one token, default split only; T = 17 (the tl.dot path, every
        # type, N not a multiple of the row tile) is tests/test_triton_kernels.py's
        for T in (1,) if n_cols == 1024 else (1, 3):
            x = torch.randn(T, n_cols, dtype=torch.float64)
            h = torch.randn(T, n_rows, dtype=torch.float64)
            h[:, ::3] = 0.0  # inactive neurons
            packed = triton_quant.pack(raw, ggml_type, n_cols)
            results = [("matmul", None, triton_quant.matmul(x.float(), packed), x @ dense.T)]
            results.append(("axpy", None, triton_quant.axpy(h.float(), packed), h @ dense))
            if T == 3:  # fp16 activations are read and widened in the kernel
                y = triton_quant.matmul(x.half(), packed)
                results.append(("matmul-f16x", None, y, x.half().double() @ dense.T))
            for op, n_split, y, ref in results:
                err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                out.append([ggml_type.name, op, n_rows, n_cols, T, n_split, err])
                if y.dtype != torch.float32 or tuple(y.shape) != tuple(ref.shape) or not err < REL_TOL:
                    failures.append(f"{ggml_type.name} {op} N={n_rows} K={n_cols} T={T}: {err:.3g}")
    return out


def check_engine(failures: list[str]) -> dict[str, float]:
    """A whole model with every pool weight (attention, predictors, output, hot rows) on the Triton path."""
    from conftest import write_relu_sparse_model

    from powerinfer import ops
    from powerinfer.device.pool import HotRows
    from powerinfer.gguf import GGMLType, read_gguf
    from powerinfer.ops import triton_quant
    from powerinfer.placement import default_reserve_bytes, footprint_from_gguf, kv_cache_bytes
    from powerinfer.runtime.engine import Engine, EngineOptions

    def to_triton(w):
        if isinstance(w, ops.DeviceWeight):
            packed = triton_quant.pack(w.raw, w.ggml_type, w.shape[1]).data
            return ops.DeviceWeight(packed, w.ggml_type, w.shape, backend="triton")
        return w

    from test_device_quant import _k_quant_models

    tokens = [1, 5, 17, 99, 200, 3]  # the interpreter is slow: a prefill of 5 and a decode step
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = []  # (name, path, n_ff, n_embd)
        # whole models for one block format, one float format and the K-quant mix (the interpreter is slow: the
        # kernel checks above cover every pool type on its own)
        for ggml_type in (GGMLType.Q4_0, GGMLType.F16):
            folder = Path(tmp) / ggml_type.name
            folder.mkdir()
            path = write_relu_sparse_model(
                folder / "m.powerinfer.gguf", n_ff=128, seed=4, dtype=ggml_type, stats=True
            )
            models.append((ggml_type.name, path, 128, 64))
        # K-quant FFN rows (Q4_K gate/up, Q6_K down_t, as Q4_K_M files mix them), dense part F32; n_ff 256 (of
        # which 128 rows hot: two row tiles), the interpreter's K-quant decoding being its slowest part
        (Path(tmp) / "kq").mkdir()
        kq_path = _k_quant_models(Path(tmp) / "kq", GGMLType.Q4_K, GGMLType.Q6_K, n_ff=256)[0]
        models.append(("Q4_K/Q6_K", kq_path, 256, 256))
        for name, path, n_ff, n_embd in models:
            ref = Engine(path, EngineOptions(act_precision="f32", n_ctx=64, n_threads=1)).logits_all(tokens)
            # a budget for the dense part and half of the FFN: hot and cold rows both in use
            fp = footprint_from_gguf(read_gguf(path), 2, n_ff)
            kv_bytes = kv_cache_bytes(2, 64, n_embd, 4)
            budget = default_reserve_bytes(fp) + fp.dense_bytes + kv_bytes + fp.ffn_bytes // 2
            engine = Engine(
                path,
                EngineOptions(
                    act_precision="f32",
                    n_ctx=64,
                    n_threads=1,
                    pool_device="cpu",
                    vram_budget_gib=budget / 2**30,
                ),
            )
            m = engine.model
            # the same placement with Triton weights (the interpreter runs them on the CPU tensors)
            for layer in m.layers:
                for attr in ("wq", "wk", "wv", "wo"):
                    setattr(layer.attn, attr, to_triton(getattr(layer.attn, attr)))
            n_hot = 0
            for f in m.ffns:
                sel = f.selector
                sel.fc1, sel.fc2 = to_triton(sel.fc1), to_triton(sel.fc2)
                if f.hot is not None:
                    ids = f.hot.ids.numpy()
                    f.hot = HotRows(f.gate, f.up, f.down_t, ids, f.hot.device, engine.kc, backend="triton")
                    n_hot += f.hot.ids.numel()
            m.head.output = to_triton(m.head.output)
            if not 0 < n_hot < 2 * n_ff or not isinstance(m.layers[0].attn.wq, ops.DeviceWeight):
                failures.append(f"engine {name}: unexpected placement ({n_hot} hot neurons)")
            # a prefill of 5 tokens and a decode step of 1 (both broadcast-and-sum; test_triton_kernels.py takes
            # the tl.dot path at T = 17)
            got = torch.cat([engine.logits_all(tokens[:5])] + [engine.logits_all([t]) for t in tokens[5:]])
            err = (got - ref).abs().max().item()
            out[name] = err
            if not err < LOGIT_TOL:
                failures.append(f"engine {name}: max |logit diff| {err:.3g}")
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("run with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).parent))  # conftest and the test modules' data helpers
    failures: list[str] = []
    report = {"kernels": check_kernels(failures), "engine": check_engine(failures), "failures": failures}
    print(json.dumps(report))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
