"""A token's logits do not depend on how it reached the engine (a property, checked with hypothesis).

For a dense Q4_0 file, a PowerInfer (PWRI, predictor) Q4_0 file, a CATS file and a TEAL file (each sparsified at
S = 0.5, then quantized Q4_0 by our quantize), all in the q8 precision the CLI runs: a target sequence is evaluated in random
chunks, each chunk in a step shared with up to 7 other sequences (some prefilling a chunk of their own prompt,
some decoding one token), optionally after a detour (junk tokens evaluated after a prefix, then rewound with
`keep`, so the prefix's cache is reused), by an engine of 1, 2 or 3 threads. Every target token's logits must be
the same bits as in one fresh single-sequence prompt on a 1-thread engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    random_llama_state,
    random_predictors,
    tiny_hf_llama,
    write_hf_llama_gguf,
    write_llama_gguf,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from powerinfer.gguf.constants import GGMLType
from powerinfer.ops import kernels_available
from powerinfer.quantize import QuantizeOptions, parse_file_type, quantize_model
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sparsify import SparsifyOptions, run_sparsify

pytestmark = pytest.mark.skipif(not kernels_available(), reason="powerinfer._kernels is not built")

PROSE = Path(__file__).parent / "data" / "python-reference-prose.txt"
N_CTX, N_SEQ = 64, 8


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("invariance")
    sd = random_llama_state(n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=11)
    dense = write_llama_gguf(root / "dense.gguf", sd, n_head=4, n_head_kv=2, dtype=GGMLType.Q4_0)
    pwri = write_llama_gguf(
        root / "pwri.gguf",
        sd,
        n_head=4,
        n_head_kv=2,
        act="relu",
        dtype=GGMLType.Q4_0,
        predictors=random_predictors(sd),
        threshold=0.0,
    )
    f32 = write_hf_llama_gguf(tiny_hf_llama(n_embd=64, n_ff=256, n_layer=2), root / "tiny.gguf", GGMLType.F32)
    text = root / "calib.txt"
    text.write_text(PROSE.read_text()[:20000])
    opts = SparsifyOptions(f32, text, root / "cats-f32.powerinfer.gguf", 0.5, n_ctx=128, max_tokens=1024)
    cats_f32 = run_sparsify(opts).output
    file_type = parse_file_type("q4_0")
    assert file_type is not None
    cats = root / "cats.powerinfer.gguf"
    quantize_model(QuantizeOptions(cats_f32, cats, file_type))
    opts = dataclasses.replace(opts, output=root / "teal-f32.powerinfer.gguf", method="teal")
    teal = root / "teal.powerinfer.gguf"
    quantize_model(QuantizeOptions(run_sparsify(opts).output, teal, file_type))
    # heads of 64 (whole q8_0 / q4_0 blocks, stored rotated) for the typed KV caches
    sd64 = random_llama_state(n_embd=128, n_head=2, n_head_kv=1, n_ff=128, seed=12)
    dense64 = write_llama_gguf(root / "dense64.gguf", sd64, n_head=2, n_head_kv=1, dtype=GGMLType.Q4_0)
    return {"dense": dense, "pwri": pwri, "cats": cats, "teal": teal, "dense64": dense64}


class Engines:
    """One scenario engine per thread count and the reference, per model (built once: loading dominates)."""

    def __init__(self, path: Path, cache_type: str = "f32") -> None:
        kv = {"cache_type_k": cache_type, "cache_type_v": cache_type}
        self.reference = Engine(path, EngineOptions(n_ctx=N_CTX, n_threads=1, act_precision="q8", **kv))
        self.by_threads = {
            t: Engine(path, EngineOptions(n_ctx=N_CTX, n_threads=t, n_seq=N_SEQ, act_precision="q8", **kv))
            for t in (1, 2, 3)
        }
        self.vocab = self.reference.config.n_vocab


@pytest.fixture(scope="module")
def engines(models) -> dict[str, Engines]:
    return {name: Engines(path) for name, path in models.items() if name != "dense64"}


@pytest.fixture(scope="module")
def typed_engines(models) -> dict[str, Engines]:
    return {t: Engines(models["dense64"], t) for t in ("f16", "bf16", "q8_0", "q4_0")}


def reference_logits(e: Engine, tokens: list[int]) -> torch.Tensor:
    e.free(0)
    return e.step([0] * len(tokens), tokens, list(range(len(tokens))), all_logits=True)


scenario = st.fixed_dictionaries(
    {
        "target": st.lists(st.integers(0, 10**6), min_size=2, max_size=12),
        "cuts": st.lists(st.integers(1, 11), max_size=4),
        "others": st.lists(
            st.tuples(st.lists(st.integers(0, 10**6), min_size=1, max_size=6), st.booleans()), max_size=7
        ),
        "detour": st.one_of(
            st.none(), st.tuples(st.integers(1, 11), st.lists(st.integers(0, 10**6), min_size=1, max_size=4))
        ),
        "threads": st.sampled_from([1, 2, 3]),
        "seed": st.integers(0, 2**31 - 1),
    }
)


def run_scenario(e: Engine, vocab: int, s: dict) -> torch.Tensor:
    """The target's logits, row by row, as the scenario evaluates it in sequence 0."""
    target = [t % vocab for t in s["target"]]
    rng = np.random.default_rng(s["seed"])
    for seq in range(N_SEQ):
        e.free(seq)
    cuts = sorted({c for c in s["cuts"] if 0 < c < len(target)})
    chunks = [target[a:b] for a, b in zip([0, *cuts], [*cuts, len(target)], strict=True)]
    # others: sequences 1..7, each (tokens, decode-style); a decode-style one is prefilled first, then adds one
    # token a step; the others add a random-sized chunk of their prompt a step
    others = []
    for i, (toks, decode) in enumerate(s["others"]):
        toks = [t % vocab for t in toks]
        if decode:
            e.prefill(i + 1, toks[:1])
        others.append((i + 1, toks[1:] if decode else toks, decode))
    pos = 0
    rows = []
    if s["detour"] is not None:
        keep, junk = s["detour"]
        keep = min(keep, len(target) - 1)
        e.prefill(0, target[:keep] + [t % vocab for t in junk])
        e.keep(0, keep)  # the prefix's keys and values are reused
        pos = keep
        later = [c for c in cuts if c > keep]
        chunks = [target[a:b] for a, b in zip([keep, *later], [*later, len(target)], strict=True)]
    for chunk in chunks:
        seq_ids, tokens, positions = [0] * len(chunk), list(chunk), list(range(pos, pos + len(chunk)))
        n_target = len(chunk)
        for seq, toks, decode in others:
            start = e.kv.n_past[seq]
            if decode:
                take = [int(rng.integers(0, vocab))]
            else:
                n = int(rng.integers(0, 3))
                take = toks[start : start + n]
            if not take or start + len(take) > N_CTX:
                continue
            seq_ids += [seq] * len(take)
            tokens += take
            positions += list(range(start, start + len(take)))
        # the target's run goes first, others after it (StepBatch keeps a sequence's tokens contiguous)
        logits = e.step(seq_ids, tokens, positions, all_logits=True)
        rows.append(logits[:n_target])
        pos += len(chunk)
    return torch.cat(rows)


@pytest.mark.parametrize("model", ["dense", "pwri", "cats", "teal"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(s=scenario)
def test_logits_do_not_depend_on_how_a_token_arrives(engines, model, s):
    eng = engines[model]
    target = [t % eng.vocab for t in s["target"]]
    want = reference_logits(eng.reference, target)
    got = run_scenario(eng.by_threads[s["threads"]], eng.vocab, s)
    first = len(target) - got.shape[0]  # a reused prefix has no rows of its own
    assert torch.equal(got, want[first:]), (got - want[first:]).abs().max()


# the KV cache types (-ctk / -ctv): a row's bytes depend on its floats alone (kernels/cpu/attention.c), so the
# property holds for each type as for f32
@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0", "q4_0"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(s=scenario)
def test_logits_do_not_depend_on_how_a_token_arrives_typed_cache(typed_engines, cache_type, s):
    eng = typed_engines[cache_type]
    assert eng.reference.kv.type_k.name == cache_type
    target = [t % eng.vocab for t in s["target"]]
    want = reference_logits(eng.reference, target)
    got = run_scenario(eng.by_threads[s["threads"]], eng.vocab, s)
    first = len(target) - got.shape[0]
    assert torch.equal(got, want[first:]), (got - want[first:]).abs().max()
