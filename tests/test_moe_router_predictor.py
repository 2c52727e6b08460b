"""train-predictor on MoE files (profile.router_predictor): a linear predictor of the next layer's router logits,
written beside the model, which --memory-limit then reads ahead with (runtime.expert_store.TrainedRouter).

Files: the tiny synthetic MoE files of scripts/make_synthetic_moe.py (2 layers, 8 experts of 32, top 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from powerinfer.placement.experts import ROUTER_PREDICTOR_FILE, load_router_predictor
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.expert_store import TrainedRouter
from tests.conftest import load_script

REPO = Path(__file__).resolve().parents[1]
TEXT = (REPO / "powerinfer" / "data" / "calibration.txt").read_text()[:12000]


def train(path: Path, corpus: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "powerinfer",
        "train-predictor",
        "-m",
        str(path),
        "-f",
        str(corpus),
        "-c",
        "64",
    ]
    return subprocess.run([*cmd, "-t", "1"], capture_output=True, text=True, env=env, timeout=600)


def test_router_predictor_is_written_used_and_changes_no_logit(tmp_path):
    out = tmp_path / "m"
    path = load_script("make_synthetic_moe").generate(out, ["qwen3moe"], "tiny", ["q4_0"])[0]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    done = train(path, corpus)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    # one layer pair; held-out share of layer 1's top-2 among the predicted top-2 (chance: 2/8). Measured: 0.83 on
    # 2106 held-out tokens (the next layer's router on this layer's input, the fallback: 0.56)
    assert summary["n_test"] > 100 and summary["mean_accuracy"] >= 0.7
    assert summary["mean_accuracy"] >= summary["mean_baseline"]
    assert (out / ROUTER_PREDICTOR_FILE).is_file() and (out / "router_predictor.json").is_file()
    w_b = load_router_predictor(path, 2, 8, 64)
    assert w_b is not None and w_b[0].shape == (1, 8, 64)

    free = Engine(path, EngineOptions(n_ctx=64, n_threads=1))
    prompt = list(range(3, 30))
    want = free.logits_all(prompt)
    steps_want = torch.stack([free.eval([t]).clone() for t in (5, 9, 11, 40, 41)])
    limited = Engine(path, EngineOptions(n_ctx=64, n_threads=1, memory_limit_gib=8.0, memory_runtime_bytes=0))
    store = limited.assembled.loader.store
    assert store is not None and isinstance(store.predictors[0], TrainedRouter)
    got = limited.logits_all(prompt)
    steps = torch.stack([limited.eval([t]).clone() for t in (5, 9, 11, 40, 41)])
    assert torch.equal(got, want) and torch.equal(steps, steps_want)


def test_a_predictor_of_another_shape_is_ignored(tmp_path):
    path = load_script("make_synthetic_moe").generate(tmp_path, ["qwen3moe"], "tiny", ["q4_0"])[0]
    np.savez(
        tmp_path / ROUTER_PREDICTOR_FILE, w=np.zeros((1, 4, 64), np.float32), b=np.zeros((1, 4), np.float32)
    )
    assert load_router_predictor(path, 2, 8, 64) is None


def test_smallthinker_is_refused_in_one_line(tmp_path):
    path = load_script("make_synthetic_moe").generate(tmp_path, ["smallthinker"], "tiny", ["q4_0"])[0]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    done = train(path, corpus)
    assert done.returncode == 1
    errors = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "before its attention" in errors[0] and "Traceback" not in done.stderr
