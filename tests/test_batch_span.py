"""A decode step of several sequences through the device spans (powerinfer.device.span.BatchSpan): the resident
layers run once for B rows over every sequence's KV cache, padded to a fixed B per size, on the CPU stand-in pool
(--pool-device cpu, the same step code a CUDA pool runs). A sequence's logits in a batch step are the bits of the
same token decoded alone, and within the span tests' bound of the all-CPU engine's."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import random_llama_state, write_llama_gguf, write_relu_sparse_model

from powerinfer import ops
from powerinfer.device.span import BatchSpan, DeviceSpan, masked_attention
from powerinfer.gguf import GGMLType
from powerinfer.model.batch import StepBatch
from powerinfer.runtime.calls import count_calls
from powerinfer.runtime.engine import Engine, EngineOptions

TESTS = Path(__file__).parent
N_SEQ = 4
PROMPTS = [[1, 17, 42], [5, 6, 7, 8, 9], [250, 3], [64, 65, 66, 67, 68, 69, 70]]
# each step's sequences: 2, 3 (padded to 4) and 4 rows, one alone (B = 1: the one-sequence span), sequences
# joining and leaving between steps, each at its own position
STEPS = [[0, 1], [0, 1, 2], [1, 3], [2], [0, 1, 2, 3], [3, 0], [0, 2, 3], [1, 2]]
# every placement of the stand-in pool with the layers resident: -ngl (dense on the device, and one layer on the
# CPU op by op before the span), hybrid (hot and cold neurons; cold only), every neuron pooled
PLACEMENTS = {
    "ngl-all": ("dense", dict(n_gpu_layers=99)),
    "ngl-1": ("dense", dict(n_gpu_layers=1)),
    "hybrid": ("sparse", dict(vram_budget_gib=5.5e-4)),
    "hybrid-cold": ("sparse", dict(vram_budget_gib=1.0, disable_gpu_index=True)),
    "all-pooled": ("sparse", dict(vram_budget_gib=1.0)),
}


def _opts(act_precision: str = "q8", **kw) -> EngineOptions:
    return EngineOptions(act_precision=act_precision, n_ctx=64, n_threads=2, reset_gpu_index=True, **kw)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batch_span")
    dense = write_llama_gguf(
        root / "dense.gguf", random_llama_state(n_ff=128, seed=5, n_head_kv=2), n_head=4, n_head_kv=2
    )
    sparse = write_relu_sparse_model(
        root / "relu.powerinfer.gguf", n_ff=256, seed=3, ffn_dtype=GGMLType.Q4_0, stats=True
    )
    return {"dense": dense, "sparse": sparse}


def _decode_steps(engine: Engine) -> list[torch.Tensor]:
    """Prefill each sequence's prompt alone, then the STEPS: each step's logits (B, n_vocab)."""
    for seq, prompt in enumerate(PROMPTS):
        engine.free(seq)
        engine.prefill(seq, prompt)
    return [engine.decode(seqs, [(7 * i + 3 * s) % 200 + 1 for s in seqs]) for i, seqs in enumerate(STEPS)]


def _alone(engine: Engine) -> list[torch.Tensor]:
    """The same tokens, each decoded in a step of its own."""
    for seq, prompt in enumerate(PROMPTS):
        engine.free(seq)
        engine.prefill(seq, prompt)
    return [
        torch.cat([engine.decode([s], [(7 * i + 3 * s) % 200 + 1]) for s in seqs])
        for i, seqs in enumerate(STEPS)
    ]


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_a_batch_step_gives_each_sequence_its_logits_alone(files, placement):
    """Batch steps of 2-4 sequences through the batch span: each sequence's logits are the bits it gets decoded
    alone (the one-sequence span), the all-CPU engine's within the span tests' bound, and the sparse counters
    the same as alone."""
    kind, kw = PLACEMENTS[placement]
    engine = Engine(files[kind], _opts(pool_device="cpu", n_seq=N_SEQ, **kw))
    spans = engine.model.step_spans_for(engine.kv)
    n_cpu = 1 if placement == "ngl-1" else 0
    assert [(a, b, type(s).__name__) for a, b, s in spans] == [(0, 1, "NoneType")] * n_cpu + [
        (n_cpu, 2, "BatchSpan")
    ]
    got = _decode_steps(engine)
    batch_span = spans[-1][2]
    assert isinstance(batch_span, BatchSpan) and sorted(batch_span.spans) == [2, 4]  # B = 3 padded to 4
    alone_engine = Engine(files[kind], _opts(pool_device="cpu", n_seq=N_SEQ, **kw))
    alone = _alone(alone_engine)
    for i, (g, a) in enumerate(zip(got, alone, strict=True)):
        assert torch.equal(g, a), (placement, i, (g - a).abs().max().item())
    cpu = _alone(Engine(files[kind], _opts(n_seq=N_SEQ)))
    for g, c in zip(got, cpu, strict=True):
        # measured: equal at q8 on these files (the stand-in runs the CPU's kernels); the bound is the one-token span
        # tests' (tests/test_placed_decode.py: <= 3.8e-7 in f32, hot and cold parts summed apart)
        assert (g - c).abs().max().item() <= 2e-6 * c.abs().max().item()
    if kind == "sparse":
        s, t = engine.sparse_stats, alone_engine.sparse_stats
        assert (s.tokens == t.tokens).all() and (s.active == t.active).all()
        assert (s.active_gpu == t.active_gpu).all()
        if placement == "hybrid":
            assert 0 < s.active_gpu.sum() < s.active.sum()


@pytest.mark.parametrize("placement", ["ngl-all", "ngl-1", "hybrid"])
def test_the_cuda_attention_path_of_a_batch_span_on_cpu_tensors(files, placement):
    """The spans with the attention CUDA runs (masked_attention over the stacked caches from the device tensors of
    sequence ids and positions, padding rows included) on the stand-in: batch steps give the all-CPU engine's
    logits within the span tests' bound."""
    kind, kw = PLACEMENTS[placement]
    engine = Engine(files[kind], _opts("f32", pool_device="cpu", n_seq=N_SEQ, **kw))
    maker = engine.model.span_maker
    assert maker is not None
    maker.masked = True  # read when the spans are made, on first use
    got = _decode_steps(engine)
    assert all(s.masked for s in engine.model.step_spans_for(engine.kv)[-1][2].spans.values())
    cpu = _alone(Engine(files[kind], _opts("f32", n_seq=N_SEQ)))
    for g, c in zip(got, cpu, strict=True):
        # measured: <= 4.1e-7 of the largest logit (the one-token span tests' bound)
        assert (g - c).abs().max().item() <= 2e-6 * c.abs().max().item()


def test_padding_rows_leave_every_cache_as_the_real_rows_write_it(files):
    """A 3-sequence step runs in the 4-row span: the padding row repeats row 0, so it writes row 0's keys and
    values again; every other sequence's rows and every row past a sequence's position are untouched."""
    engine = Engine(files["dense"], _opts(pool_device="cpu", n_seq=N_SEQ, n_gpu_layers=99))
    for seq, prompt in enumerate(PROMPTS):
        engine.prefill(seq, prompt)
    before = [engine.kv.layer_view(b).stacked()[0].clone() for b in range(2)]
    seqs = [1, 2, 3]
    engine.decode(seqs, [9, 10, 11])
    for b in range(2):
        k = engine.kv.layer_view(b).stacked()[0]
        changed = (k != before[b]).flatten(2).any(-1).nonzero().tolist()  # (seq, position) pairs
        assert changed == [[s, len(PROMPTS[s])] for s in seqs], changed


def test_masked_attention_of_a_batch_is_the_one_token_kernel_row_by_row():
    """The CUDA span's batched attention (run here on CPU tensors): each row over its own sequence's stacked cache
    at its own position, later rows masked (they hold junk), against the CPU's one-token kernel row by row; a
    padding row repeating row 0 gives row 0's output and writes the same cache row."""
    from powerinfer.model.blocks import Rope
    from powerinfer.model.specs import AttentionSpec, RopeSpec

    for n_head_kv, neox in ((4, False), (2, True), (1, False)):
        g = torch.Generator().manual_seed(n_head_kv)
        H, D, n_ctx, S = 4, 16, 32, 3
        spec = AttentionSpec(n_head=H, n_head_kv=n_head_kv, head_dim=D)
        pairs = Rope(RopeSpec(kind="neox" if neox else "adjacent", n_rot=D), n_ctx).pairs
        k_cache = torch.randn(S, n_ctx, n_head_kv, D, generator=g)
        v_cache = torch.randn(S, n_ctx, n_head_kv, D, generator=g)
        seqs, pos = torch.tensor([2, 0, 1, 2]), torch.tensor([5, 0, n_ctx - 1, 5])  # row 3 pads with row 0
        q = torch.randn(4, H * D, generator=g)
        k, v = torch.randn(2, 4, n_head_kv * D, generator=g)
        q[3], k[3], v[3] = q[0], k[0], v[0]
        kc, vc = k_cache.clone(), v_cache.clone()
        want = torch.cat(
            [
                ops.attend_one(q[b : b + 1], k[b : b + 1], v[b : b + 1], pairs[p], kc[s], vc[s], p, neox=neox)
                for b, (s, p) in enumerate(zip(seqs.tolist(), pos.tolist(), strict=True))
            ]
        )
        kd, vd = k_cache.clone(), v_cache.clone()
        got = masked_attention(q, k, v, kd, vd, pairs, seqs, pos, torch.arange(n_ctx), spec, neox)
        # measured: <= 5.0e-7 absolute over 20 seeds (outputs of order 1); the key rows written within 2.4e-7
        assert (got - want).abs().max().item() <= 2e-6
        assert torch.equal(got[3], got[0])
        assert torch.allclose(kd, kc, rtol=1e-6, atol=1e-6) and torch.equal(vd, vc)


@pytest.mark.skipif(not ops.kernels_available(), reason="powerinfer._kernels is not built")
@pytest.mark.parametrize("cache_type", ["f32", "q8_0"])
def test_attend_batch_is_attend_one_bit_for_bit(cache_type):
    """ops.attend_batch (one kernel call for one token of each of B sequences) against attend_one row by row: the
    same output and cache bits, at 1 and 2 threads, a padding row repeating row 0, a context long enough for the
    one-token kernel's shared-head path (>= 128 positions)."""
    from powerinfer.ops.kv_types import kv_encode, kv_rotation, kv_type

    g = torch.Generator().manual_seed(7)
    H, H_kv, D, n_ctx, S = 6, 3, 64, 160, 3
    kt = kv_type(cache_type)
    rot = kv_rotation(kt, D, False), kv_rotation(kt, D, True)
    raw = torch.randn(2, S, n_ctx, H_kv, D, generator=g)
    caches = [raw[i] if cache_type == "f32" else kv_encode(raw[i], kt, rot[i]) for i in range(2)]
    pairs = torch.randn(n_ctx, D // 2, 2, generator=g)
    seqs, pos = torch.tensor([1, 0, 2, 1]), torch.tensor([150, 3, 0, 150])
    q = torch.randn(4, H * D, generator=g)
    k, v = torch.randn(2, 4, H_kv * D, generator=g)
    q[3], k[3], v[3] = q[0], k[0], v[0]
    for threads in (1, 2):
        kc = ops.KernelContext(n_threads=threads)
        want_k, want_v = caches[0].clone(), caches[1].clone()
        want = torch.cat(
            [
                ops.attend_one(
                    q[b : b + 1], k[b : b + 1], v[b : b + 1], pairs[p], want_k[s], want_v[s], p, kc
                )
                for b, (s, p) in enumerate(zip(seqs.tolist(), pos.tolist(), strict=True))
            ]
        )
        got_k, got_v = caches[0].clone(), caches[1].clone()
        got = ops.attend_batch(q, k, v, pairs[pos], got_k, got_v, seqs, pos, kc)
        assert torch.equal(got, want) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v), threads
    # the pure-torch reference (no kernels: attend_one's tensor ops row by row) and the scalar variant agree
    for kc in (ops.KernelContext(enabled=False), ops.KernelContext(isa="scalar")):
        ref_k, ref_v = caches[0].clone(), caches[1].clone()
        ref = ops.attend_batch(q, k, v, pairs[pos], ref_k, ref_v, seqs, pos, kc)
        # measured: <= 1.4e-6 absolute over 20 seeds, f32 and q8_0 (outputs of order 1; the random (cos, sin)
        # pairs are not rotations, so q and k grow)
        assert (ref - got).abs().max().item() <= 5e-6 and torch.equal(ref[3], ref[0]), kc


def step_call_counts(root: str) -> dict[str, list[int]]:
    """Python-level calls of the model's forward for a decode step of B = 2, 3 and 4 sequences, per placement
    (every layer resident)."""
    files = {
        "dense": write_llama_gguf(
            Path(root) / "dense.gguf",
            random_llama_state(n_ff=128, seed=5, n_head_kv=2),
            n_head=4,
            n_head_kv=2,
        ),
        "sparse": write_relu_sparse_model(
            Path(root) / "relu.powerinfer.gguf", n_ff=256, seed=3, ffn_dtype=GGMLType.Q4_0, stats=True
        ),
    }
    counts = {}
    for name in ("ngl-all", "hybrid", "hybrid-cold", "all-pooled"):
        kind, kw = PLACEMENTS[name]
        engine = Engine(files[kind], _opts(pool_device="cpu", n_seq=N_SEQ, **kw))
        for seq, prompt in enumerate(PROMPTS):
            engine.prefill(seq, prompt)
        got = []
        for B in (2, 3, 4):
            seqs = list(range(B))
            batch = StepBatch.build(seqs, [5] * B, [len(PROMPTS[s]) for s in seqs])
            engine.model.forward(batch, engine.kv)  # once: the span of this size is made on first use
            got.append(count_calls(lambda: engine.model.forward(batch, engine.kv)))  # noqa: B023
        counts[name] = got
    return counts


def test_python_calls_of_a_batch_step_do_not_grow_with_b(tmp_path):
    """The model's forward for a decode step of 2, 3 (padded) and 4 sequences makes the same number of
    Python-level calls (or fewer, where a hybrid layer's cold part goes dense): no per-row work in the span, its
    attention, its padding or the hybrid layers' cold parts.
    Counted in a fresh interpreter (a profiled step spun without end after tests/test_chat_template_bounds.py in
    the same process; see tests/test_moe_pool_grouped.py)."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import test_batch_span as m; "
        "print(json.dumps(m.step_call_counts(sys.argv[2])))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(TESTS), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    counts = json.loads(r.stdout.strip().splitlines()[-1])
    for name, got in counts.items():
        # the cold part's rows (SparseFFN.cold) go dense once the union of the rows' active cold neurons is most of
        # them, a few calls fewer: measured hybrid 538, 526, 526 (dense from B = 3), ngl-all 397 at every B
        assert max(got) == got[0] and (len(set(got)) == 1 or name.startswith("hybrid")), (name, counts)


def test_server_slots_decoding_together_get_their_answers_alone(files):
    """The real HTTP server with 3 slots and the stand-in pool (-ngl 99): three concurrent greedy requests decode
    in batch steps through the batch span, and each gets the tokens it gets alone (a 1-slot engine)."""
    pytest.importorskip("fastapi")
    from server_helpers import live_server, request

    from powerinfer.sampling import Sampler, SamplingParams
    from powerinfer.server import ServerOptions

    kw = dict(pool_device="cpu", n_gpu_layers=99)
    solo = Engine(files["dense"], _opts(**kw))
    prompts = [[1, 17, 42, 99], [5, 6], [250, 3, 7, 64, 9, 11]]
    n = 12
    want = []
    for p in prompts:
        solo.free(0)
        ids = list(solo.generate(p, Sampler(SamplingParams(temp=0.0)), n_predict=n))
        want.append(solo.tokenizer.decode(ids, strip_leading_space=False))
    opts = ServerOptions(model=files["dense"], engine=_opts(n_seq=3, **kw))
    with live_server(opts, step_delay_s=0.02) as srv:

        def one(p: list[int]) -> str:
            status, out, _ = request(
                srv, "POST", "/completion", {"prompt": p, "n_predict": n, "temperature": 0}
            )
            assert status == 200, out
            return out["content"]

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(one, prompts))
        model, kv = srv.server.worker.engine.model, srv.server.worker.engine.kv
        ((_, _, span),) = model.step_spans_for(kv)
        assert isinstance(span, BatchSpan) and span.spans  # some steps ran as batches
    assert got == want


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("placement", ["ngl-1", "ngl-all", "hybrid"])
def test_batch_span_on_cuda_replays_what_it_runs_eagerly(files, placement):
    """On CUDA each size's span is captured once and replayed per step: batch steps (2, 3 padded to 4, 4 rows)
    give the eager span's logits (graphs off), and each sequence's the CPU's within the CUDA span tests' bound; a
    replayed step of device-only layers syncs with nothing (a hybrid layer waits for its mask by design)."""
    from powerinfer.device.span import SpanMaker

    kind, kw = PLACEMENTS[placement]
    opts = _opts("f32", pool_device="cuda", n_seq=N_SEQ, **kw)
    graphs, eager = Engine(files[kind], opts), Engine(files[kind], opts)
    maker = eager.model.span_maker
    assert isinstance(maker, SpanMaker)
    maker.graphs = False  # read when the spans are made, on first use
    got, want = _decode_steps(graphs), _decode_steps(eager)
    span = graphs.model.step_spans_for(graphs.kv)[-1][2]
    assert isinstance(span, BatchSpan) and sorted(span.spans) == [2, 4]
    assert all(isinstance(s, DeviceSpan) and s.captured for s in span.spans.values())
    for g, w in zip(got, want, strict=True):
        # the same kernels replayed: within f32 rounding of the eager run
        assert (g - w).abs().max().item() <= 1e-5 * w.abs().max().item()
    cpu = _alone(Engine(files[kind], _opts("f32", n_seq=N_SEQ)))
    for g, c in zip(got, cpu, strict=True):
        # f32 on both sides, summed in other orders: bounded as the CUDA one-token span test bounds it
        assert (g - c).abs().max().item() <= 1e-4 * c.abs().max().item()
    if kind == "sparse":
        return
    # a replayed step queues its work and its copies without waiting on the device (STYLE.md 13)
    seqs, positions = torch.tensor([0, 1, 2]), torch.tensor([graphs.kv.n_past[s] for s in range(3)])
    x = torch.randn(3, span.spans[4].x.shape[1], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            out = span(x, seqs, positions)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.shape == x.shape and bool(torch.isfinite(out).all())
