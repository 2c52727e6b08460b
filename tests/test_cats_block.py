"""The fused CATS FFN block of one token (ops.cats_ffn_block, kernels/cpu/layer.c pi_cats_ffn_block) and the
engine paths a CATS file's tokens take.

- The block gives the bits of rms_norm, cats_ffn and the float residual add called one by one, for every
  thread count, both activation precisions, one and two stages, and the dense first token (every neuron).
- A CATS file's logits are the same bits whether a token is decoded alone through the fused blocks, run op by
  op (an FFN observer forces that path), or evaluated inside a multi-token prompt (the row ops with masks).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_hf_llama, write_hf_llama_gguf
from test_cats_ops import median_threshold, out_thresholds
from test_sparse_ops import ffn_weights, make_x, needs_kernels

from powerinfer import ops
from powerinfer.gguf.constants import GGMLType
from powerinfer.model.sparse import FusedThresholdFFN
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sparsify import SparsifyOptions, run_sparsify

PROSE = Path(__file__).parent / "data" / "python-reference-prose.txt"
EPS = 1e-5
# the int8-tile types, a float type and a K-quant (float activations in both precisions); 1024 columns make the
# block rows longer than FFN_DOT_MAX_ROW (one row per dot call), 576 shorter
BLOCK_CASES = [
    (GGMLType.Q4_0, 576),
    (GGMLType.Q4_1, 1024),
    (GGMLType.Q8_0, 576),
    (GGMLType.Q5_1, 576),
    (GGMLType.F16, 576),
    (GGMLType.Q4_K, 768),
]


def counters() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.zeros(1, dtype=np.int64) for _ in range(3))  # type: ignore[return-value]


@needs_kernels
@pytest.mark.parametrize("ggml_type,n_embd", BLOCK_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_cats_block_equals_ops_bitwise(ggml_type, n_embd, act):
    n_ff = 600
    gate, up, down_t = ffn_weights((ggml_type,) * 3, n_ff, n_embd, n_embd)
    norm = torch.from_numpy(np.random.default_rng(5).uniform(0.5, 1.5, n_embd).astype(np.float32))
    x = make_x(1, n_embd, seed=4)
    u = ops.rms_norm(x, norm, EPS)
    t = median_threshold(u, gate, "silu")
    t_rows = t * torch.from_numpy(np.random.default_rng(7).uniform(0.3, 1.7, n_ff)).float()
    t_out = out_thresholds(u, gate, up, "silu").contiguous()
    for n_threads, out_t, dense in itertools.product((1, 2, 3), (None, t_out), (False, True)):
        kc = ops.KernelContext(n_threads=n_threads, act_precision=act)
        count = counters()
        block = ops.cats_ffn_block(norm, EPS, t_rows, out_t, gate, up, down_t, "silu", False, count, kc)
        assert block is not None
        scratch = torch.empty(block.scratch_bytes(), dtype=torch.uint8)
        got = x.clone()
        block(got, scratch, dense)
        y, n_active, n_up = ops.cats_ffn(
            ops.rms_norm(x, norm, EPS), gate, up, down_t, None, t_rows, "silu", False, kc,
            dense_rows=torch.tensor([dense]), out_thresholds=out_t,
        )  # fmt: skip
        where = (ggml_type.name, act, n_threads, out_t is not None, dense)
        assert torch.equal(got, x + y), where
        assert [int(c[0]) for c in count] == [1, n_active, n_up], where
        if dense:
            assert n_active == n_up == n_ff, where
        else:
            assert 0 < n_active < n_up if out_t is not None else 0 < n_active == n_up < n_ff, where


@needs_kernels
def test_cats_block_validation():
    gate, up, down_t = ffn_weights((GGMLType.Q4_0,) * 3, 64, 64, 64)
    norm = torch.ones(64)
    t = torch.zeros(64)
    block = ops.cats_ffn_block(norm, EPS, t, None, gate, up, down_t, "silu", False, counters())
    assert block is not None
    x = make_x(1, 64)
    with pytest.raises(ValueError, match="scratch"):
        block(x, torch.empty(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="does not match"):
        block(make_x(1, 32), torch.empty(block.scratch_bytes(), dtype=torch.uint8))
    with pytest.raises(ValueError, match="thresholds"):
        ops.cats_ffn_block(norm, EPS, torch.zeros(63), None, gate, up, down_t, "silu", False, counters())
    # down_t of another width: not a block of this shape
    _, _, down_wide = ffn_weights((GGMLType.Q4_0,) * 3, 64, 64, 96)
    assert ops.cats_ffn_block(norm, EPS, t, None, gate, up, down_wide, "silu", False, counters()) is None


@pytest.fixture(scope="module")
def cats_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cats_block")
    text = root / "calib.txt"
    text.write_text(PROSE.read_text()[:8000])
    out = {}
    for dtype in (GGMLType.F32, GGMLType.Q4_1):
        dense = write_hf_llama_gguf(
            tiny_hf_llama(n_embd=64, n_ff=256, n_layer=2), root / f"tiny-{dtype.name}.gguf", dtype
        )
        opts = SparsifyOptions(
            dense, text, root / f"tiny-{dtype.name}.powerinfer.gguf", 0.5, n_ctx=64, max_tokens=256
        )
        out[dtype.name] = run_sparsify(opts).output
    return out


def prose_ids(engine: Engine, n: int) -> list[int]:
    return engine.tokenizer.encode(PROSE.read_text()[30000:34000], add_bos=True)[:n]


@needs_kernels
@pytest.mark.parametrize("dtype", ["F32", "Q4_1"])
@pytest.mark.parametrize("act", ["q8", "f32"])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_cats_file_tokens_same_bits_every_path(cats_files, dtype, act, n_threads):
    e = Engine(cats_files[dtype], EngineOptions(n_ctx=64, n_threads=n_threads, act_precision=act))
    assert e.config.sparse_method == "cats"
    assert all(isinstance(layer.fused_ffn, FusedThresholdFFN) for layer in e.model.layers)
    assert e.model.stack_for(e.kv, 0) is not None  # decode chains the layers in one call (ops.decode_stack)
    ids = prose_ids(e, 12)
    fused = torch.stack([e.eval([t]) for t in ids])  # one token at a time: the fused blocks
    stats = e.sparse_stats
    assert stats is not None and int(stats.tokens.sum()) == 2 * len(ids)
    assert int(stats.active.sum()) < int(stats.up_read.sum()) < 2 * len(ids) * e.config.n_ff
    e.reset()
    e.model.observers.append(lambda bid, h, x: None)  # forces the op-by-op path
    op_by_op = torch.stack([e.eval([t]) for t in ids])
    e.model.observers.clear()
    assert torch.equal(fused, op_by_op)
    # in a prompt: the row ops over several tokens with per-token masks (first token dense)
    for n in (1, 6, 12):
        e.reset()
        assert torch.equal(e.logits_all(ids[:n]), fused[:n]), n
    e.reset()
    e.eval(ids[:5])
    assert torch.equal(e.eval([ids[5]]), fused[5])
