"""K-quant kernels (kernels/cpu/kquants.h) against the gguf package's reference dequantisation.

So far the row decoders, through get_rows (the embedding lookup of a K-quant file without a float copy of the
whole table): every element bit-equal to `powerinfer.quant.dequantize` (the gguf package's numpy decoder) for
random super-blocks of Q2_K..Q6_K, any thread count, and out-of-range ids refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sparse_ops import needs_kernels

from powerinfer import ops
from powerinfer.gguf.constants import GGMLType
from powerinfer.quant import dequantize

# bytes per super-block of 256 and the byte offsets of its fp16 super-scales (d, and dmin where it has one)
K_TYPES = {
    GGMLType.Q2_K: (84, (80, 82)),
    GGMLType.Q3_K: (110, (108,)),
    GGMLType.Q4_K: (144, (0, 2)),
    GGMLType.Q5_K: (176, (0, 2)),
    GGMLType.Q6_K: (210, (208,)),
}


def random_k_blocks(ggml_type: GGMLType, n_rows: int, n_cols: int, seed: int = 0) -> np.ndarray:
    """Raw super-blocks (n_rows, n_cols / 256 * block bytes): random quants, sub-scales and mins, and finite
    random fp16 super-scales of either sign (a sign flips every element of the block)."""
    size, scale_offsets = K_TYPES[ggml_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n_rows, n_cols // 256, size), dtype=np.uint8)
    for off in scale_offsets:
        scales = (rng.standard_normal((n_rows, n_cols // 256)) * 0.01).astype(np.float16)
        blocks[:, :, off : off + 2] = scales.view(np.uint8).reshape(n_rows, n_cols // 256, 2)
    return blocks.reshape(n_rows, -1)


@needs_kernels
@pytest.mark.parametrize("ggml_type", list(K_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_get_rows_bit_equal_to_reference(ggml_type, n_threads):
    n_rows, n_cols = 40, 768
    raw = random_k_blocks(ggml_type, n_rows, n_cols, seed=int(ggml_type))
    w = ops.QWeight.from_numpy(raw, ggml_type, (n_rows, n_cols))
    ids = torch.tensor([0, 39, 7, 7, 20, 1], dtype=torch.int64)
    rows = ops.get_rows(w, ids, ops.KernelContext(n_threads=n_threads))
    expected = dequantize(raw, ggml_type, (n_rows, n_cols))[ids.numpy()]
    assert rows.dtype == torch.float32 and rows.shape == (6, n_cols)
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0
    assert np.array_equal(rows.numpy().view(np.uint32), expected.astype(np.float32).view(np.uint32))
    assert not w._dense  # no float copy of the whole table was made
    # 2-D ids keep their shape
    assert torch.equal(ops.get_rows(w, ids.view(2, 3)), rows.view(2, 3, n_cols))
    with pytest.raises(IndexError):
        ops.get_rows(w, torch.tensor([n_rows]))


@needs_kernels
@pytest.mark.parametrize("ggml_type", list(K_TYPES), ids=lambda t: t.name)
def test_linear_exact_against_float64_reference(ggml_type):
    # x @ dequant(W).T in float64 from the gguf package's decoder: the kernel decodes the same float32 weights
    # and sums in float32 (measured max error 3.3e-8 of |x| @ |W|^T over the five types; bound 2e-7; one wrong
    # element of W moves y by ~1e-2 of it); decode (T = 1, the row-dot path) equals
    # the batch tiles bit for bit, whatever the thread count; no float copy of W is made
    n_rows, n_cols = 70, 512
    raw = random_k_blocks(ggml_type, n_rows, n_cols, seed=3 + int(ggml_type))
    w = ops.QWeight.from_numpy(raw, ggml_type, (n_rows, n_cols))
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((11, n_cols)).astype(np.float32))
    dense = torch.from_numpy(dequantize(raw, ggml_type, (n_rows, n_cols))).double()
    exact, scale = x.double() @ dense.T, x.double().abs() @ dense.abs().T
    kc = ops.KernelContext(act_precision="f32")  # "q8" (Q8_K activations): test_kquant_q8.py
    assert ggml_type in kc.supported_types()
    y = ops.linear(x, w, kc)
    assert ((y.double() - exact).abs() <= 2e-7 * scale + 1e-30).all()
    for n_threads in (1, 2, 3):
        kt = kc.replace(n_threads=n_threads)
        assert torch.equal(ops.linear(x, w, kt), y), n_threads
        rows = torch.stack([ops.linear(x[t], w, kt) for t in range(x.shape[0])])  # T = 1 each
        assert torch.equal(rows, y), n_threads
    assert not w._dense


@needs_kernels
def test_linear_short_rows_and_bad_width():
    # rows of one super-block go through the grouped row dot (several rows per call): same bits as the tiles
    raw = random_k_blocks(GGMLType.Q4_K, 9, 256, seed=5)
    w = ops.QWeight.from_numpy(raw, GGMLType.Q4_K, (9, 256))
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((3, 256)).astype(np.float32))
    y = ops.linear(x, w)
    assert torch.equal(torch.stack([ops.linear(x[t], w) for t in range(3)]), y)
    with pytest.raises(ValueError):
        ops.linear(torch.zeros(1, 128), w)


def test_engine_matches_transformers_on_a_k_quant_file(tmp_path):
    # a tiny random Llama whose matrices are random K-quant super-blocks (a mix as K-quant files have it),
    # written as GGUF and loaded by transformers (which decodes K-quants with the gguf package) and by the
    # engine (kernels, no float copy of any matrix): logits of a prefill and of token-by-token decode agree
    # within 1e-5 of the logits' scale (measured 1.3e-6: float32 summation order)
    import os

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from conftest import tiny_hf_llama, write_hf_llama_gguf

    from powerinfer.gguf import GGUFWriter, read_gguf
    from powerinfer.runtime.engine import Engine, EngineOptions

    dense = write_hf_llama_gguf(tiny_hf_llama(n_embd=256, n_ff=512, n_head=4, seed=7), tmp_path / "f32.gguf")
    src = read_gguf(dense)
    mix = {
        "attn_q": GGMLType.Q4_K, "attn_k": GGMLType.Q5_K, "attn_v": GGMLType.Q6_K, "attn_output": GGMLType.Q3_K,
        "ffn_gate": GGMLType.Q4_K, "ffn_up": GGMLType.Q2_K, "ffn_down": GGMLType.Q6_K, "output": GGMLType.Q6_K,
        "token_embd": GGMLType.Q4_K,
    }  # fmt: skip
    path = tmp_path / "model" / "kq.gguf"
    path.parent.mkdir()
    w = GGUFWriter(path)
    src.copy_metadata(w)
    seed = 0
    for t in src.tensors.values():
        kind = t.name.split(".")[-2]
        if len(t.shape) == 2 and kind in mix:
            seed += 1
            w.add_tensor(t.name, random_k_blocks(mix[kind], *t.shape, seed=seed), mix[kind], t.shape)
        else:
            w.add_tensor(t.name, t.data, t.ggml_type, t.shape)
    w.write()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    ids = [1, 17, 42, 5, 99, 3, 64, 8, 23, 77]
    with torch.no_grad():
        ref = hf.eval()(torch.tensor([ids])).logits[0]
    e = Engine(path, EngineOptions(act_precision="f32", n_ctx=64))
    prefill = e.logits_all(ids)
    e.reset()
    decode = torch.stack([e.eval([i]) for i in ids])
    scale = float(ref.abs().max())
    assert scale > 0
    for got in (prefill, decode):
        assert (got - ref).abs().max() <= 1e-5 * scale
    layer = e.model.layers[0]
    weights = [layer.attn.wq, layer.attn.wk, layer.attn.wv, layer.attn.wo, layer.ffn.gate, layer.ffn.up]
    weights += [layer.ffn.down, e.model.embedding.weight, e.model.head.output]
    assert all(m is not None and m.ggml_type in mix.values() and not m._dense for m in weights)
