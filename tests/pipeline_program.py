"""One rank of a pipeline test (tests/test_pipeline.py): `python tests/pipeline_program.py SPEC_JSON`.

Every rank builds an Engine with the pipeline options of its environment (RANK, WORLD_SIZE, MASTER_*); ranks
> 0 serve, rank 0 runs `compute` and saves what it computed to spec["out"]. The test runs `compute` on a
single-process engine too and compares.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.pipeline import pipeline_options

PROMPT = "The quick brown fox jumps over the lazy dog. def main():"


def engine_options(spec: dict, pipeline: bool) -> EngineOptions:
    """Options of this rank: spec["pool"] maps a rank to a stand-in pool budget in GiB."""
    pool = spec.get("pool", {}).get(os.environ.get("RANK", "-") if pipeline else "single")
    return EngineOptions(
        n_ctx=spec.get("n_ctx", 128),
        n_seq=spec.get("n_seq", 1),
        n_threads=1,
        act_precision="f32",
        pool_device="cpu" if pool is not None else None,
        vram_budget_gib=pool,
        pipeline=pipeline_options(spec.get("split"), spec.get("timeout", 30.0), os.environ)
        if pipeline
        else None,
    )


@torch.inference_mode()
def compute(engine: Engine, spec: dict) -> dict[str, torch.Tensor]:
    """Logits of every prompt position, a greedy continuation, and several sequences decoded together."""
    prompt = engine.tokenizer.encode(PROMPT, add_bos=True)
    logits = engine.logits_all(prompt)  # (T, n_vocab)
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(prompt[1:]))
    ids, last = [], logits[-1]
    for _ in range(spec.get("n_predict", 6)):
        ids.append(int(last.argmax()))
        last = engine.decode([0], [ids[-1]])[0]
    out = {"logits": logits, "ppl": torch.exp(nll), "ids": torch.tensor(ids)}
    if "shift" in spec:  # (n_keep, n_discard) of a context shift of slot 0, then three greedy steps
        engine.shift(0, *spec["shift"])
        shifted = []
        for _ in range(3):
            ids.append(int(last.argmax()))
            last = engine.decode([0], [ids[-1]])[0]
            shifted.append(last)
        out["shifted"] = torch.stack(shifted)
    n_seq = engine.kv.n_seq
    if n_seq > 1:  # slot 0 goes on; slots 1.. hold shorter prompts, the last one a fork of slot 0
        top2 = last.topk(2).indices.tolist()
        tokens = [top2[0]]
        for s in range(1, n_seq - 1):
            engine.free(s)
            engine.prefill(s, prompt[: len(prompt) - s])
            tokens.append(prompt[len(prompt) - s])
        engine.fork(0, n_seq - 1)
        tokens.append(top2[1])
        steps = []
        for _ in range(3):
            rows = engine.decode(list(range(n_seq)), tokens)
            steps.append(rows)
            tokens = [int(t) for t in rows.argmax(-1)]
        out["batched"] = torch.stack(steps)  # (3, n_seq, n_vocab)
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    engine = Engine(spec["model"], engine_options(spec, pipeline=True))
    assert engine.pipeline is not None
    if engine.pipeline.rank != 0:
        engine.pipeline.serve(engine)
        torch.save({"pool_bytes": engine.loader.device_bytes}, f"{spec['out']}.rank{engine.pipeline.rank}")
        return
    result = compute(engine, spec)
    result["ring_bytes"] = torch.tensor(engine.pipeline.ring_bytes)
    torch.save(result, spec["out"])
    engine.pipeline.close()


if __name__ == "__main__":
    main()
