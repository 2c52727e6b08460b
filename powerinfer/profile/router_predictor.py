"""`train-predictor` on MoE files: per layer, a linear predictor of the next layer's router logits from this layer's
routed FFN input, for the read-ahead of --memory-limit (runtime.expert_store reads the predicted experts of layer
l + 1 while layer l's experts compute).

The samples come from one run over the corpus (every token of every window): X_l, the normed FFN input layer l
routes on, and Y_{l+1}, the router logits of layer l + 1. The predictor starts from the training-free rule the
engine uses without one, B_l = R_{l+1} diag(g_{l+1} / g_l) (layer l + 1's router on X_l rescaled by the ratio of
the two FFN norm weights), and learns a correction by ridge regression with a bias: W_l = B_l + D_l,
[D_l c_l] = argmin |X_l D_l^T + c_l - (Y_{l+1} - X_l B_l^T)|^2 + lam |D_l|^2, closed form, lam chosen among
RIDGES (times the mean squared centred input) on the last fifth of the training tokens, then refitted on all of
them: a small corpus leaves it near the rule, a large one lets it learn. Fitted on the first (1 - HELD_OUT) of
the tokens and scored on the rest: the share of layer l + 1's top-k experts among the predicted top-k, against the
rule alone. Written as router_predictor.npz (w (n_layer - 1,
n_expert, n_embd) float32, b (n_layer - 1, n_expert) float32) beside the model, where the engine looks for it.
SmallThinker routes each layer before its attention, exactly: nothing to predict, refused.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from powerinfer import ops, quant, stamps
from powerinfer.errors import InputError
from powerinfer.gguf.writer import write_file_atomically
from powerinfer.placement.experts import ROUTER_PREDICTOR_FILE
from powerinfer.profile.collect import Progress, make_windows, read_corpus, run_windows, tokenize_corpus
from powerinfer.profile.experts import moe_ffns
from powerinfer.runtime.engine import Engine, EngineOptions

HELD_OUT = 0.2
RIDGES = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 1e3)
MIN_TOKENS = 64


@dataclass
class RouterPredictors:
    w: np.ndarray  # (n_layer - 1, n_expert, n_embd) float32
    b: np.ndarray  # (n_layer - 1, n_expert) float32
    accuracy: list[float]  # per layer l: held-out share of layer l + 1's top-k found in the predicted top-k
    baseline: list[
        float
    ]  # the same for the next layer's router on this layer's input (the engine's fallback)
    n_train: int
    n_test: int

    def summary(self) -> dict[str, object]:
        return {
            "n_train": self.n_train,
            "n_test": self.n_test,
            "mean_accuracy": float(np.mean(self.accuracy)),
            "mean_baseline": float(np.mean(self.baseline)),
            "accuracy": [round(a, 4) for a in self.accuracy],
            "baseline": [round(a, 4) for a in self.baseline],
        }


def topk_overlap(pred: torch.Tensor, true: torch.Tensor, k: int) -> float:
    """Mean share of the k largest of `true` (T, E) among the k largest of `pred` (T, E)."""
    p = pred.topk(k, dim=-1).indices
    t = true.topk(k, dim=-1).indices
    hits = (p[:, :, None] == t[:, None, :]).any(dim=-1).sum()
    return float(hits) / float(t.numel())


def ridge(x: torch.Tensor, y: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge regression with a bias in float64: y ~ x d^T + c, lam = scale times the mean squared centred input."""
    x64, y64 = x.double(), y.double()
    xm, ym = x64.mean(dim=0), y64.mean(dim=0)
    xc, yc = x64 - xm, y64 - ym
    gram = xc.T @ xc
    lam = scale * float(gram.diagonal().mean())
    d = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=torch.float64), xc.T @ yc).T
    return d, ym - d @ xm


def fit(x: torch.Tensor, y: torch.Tensor, base: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W = base + D and b for y ~ x W^T + b, the ridge strength chosen on the last fifth of (x, y)."""
    n = x.shape[0]
    cut = max(1, int(n * 0.8))
    resid = y.double() - x.double() @ base.double().T
    best, best_score = RIDGES[-1], -1.0
    if n - cut >= 8:
        for scale in RIDGES:
            d, c = ridge(x[:cut], resid[:cut], scale)
            pred = x[cut:].double() @ (base.double() + d).T + c
            score = topk_overlap(pred, y[cut:].double(), k)
            if score > best_score:
                best, best_score = scale, score
    d, c = ridge(x, resid, best)
    return (base.double() + d).float(), c.float()


def train_router_predictors(
    model: Path,
    corpus: Path,
    n_ctx: int,
    max_tokens: int,
    n_threads: int | None,
    progress: Progress | None = None,
) -> RouterPredictors:
    """One run over the corpus, then a predictor per layer (nothing written)."""
    text = read_corpus(corpus)
    n_ctx = n_ctx or 512
    engine = Engine(
        model, EngineOptions(act_precision="f32", n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads)
    )
    ffns = moe_ffns(engine)
    if ffns is None:
        raise InputError(f"{model}: not a mixture-of-experts model")
    if any(f.spec.route_input != "ffn" for f in ffns):
        raise InputError(
            "this model routes each layer before its attention (SmallThinker): nothing to predict"
        )
    if len(ffns) < 2:
        raise InputError("a router predictor needs at least two MoE layers")
    ids = tokenize_corpus(engine, text)
    if max_tokens > 0:
        ids = ids[:max_tokens]
    if len(ids) < MIN_TOKENS:
        raise InputError(
            f"corpus too small: {len(ids)} tokens, a router predictor needs at least {MIN_TOKENS}"
        )
    windows = make_windows(ids, min(n_ctx, engine.config.n_ctx_train), engine.tokenizer.bos_id)
    for f in ffns:
        f.record = []
    try:
        run_windows(engine, windows, progress)
        xs = [torch.cat([r[0] for r in f.record or []]) for f in ffns]
        ys = [torch.cat([r[1] for r in f.record or []]) for f in ffns]
    finally:
        for f in ffns:
            f.record = None
    n = xs[0].shape[0]
    n_train = max(1, int(n * (1 - HELD_OUT)))
    k = ffns[0].spec.n_expert_used
    ws, bs, acc, base = [], [], [], []
    for bid in range(len(ffns) - 1):
        x, y = xs[bid], ys[bid + 1]
        router = ffns[bid + 1].router
        if router.on_device:
            raise InputError("train-predictor reads the routers on the CPU")
        r = torch.from_numpy(quant.dequantize(router.raw.numpy(), router.ggml_type, router.shape)).reshape(
            router.shape
        )
        rule = r * ffns_norm_ratio(engine, bid)[None, :]  # the engine's fallback as a matrix
        w, b = fit(x[:n_train], y[:n_train], rule, k)
        ws.append(w.numpy())
        bs.append(b.numpy())
        xt, yt = x[n_train:], y[n_train:]
        if xt.shape[0]:
            acc.append(topk_overlap(xt @ w.T + b, yt, k))
            guess = ops.linear((xt * ffns_norm_ratio(engine, bid)).contiguous(), router, engine.assembled.kc)
            base.append(topk_overlap(guess.to("cpu"), yt, k))
    return RouterPredictors(np.stack(ws), np.stack(bs), acc, base, n_train, n - n_train)


def ffns_norm_ratio(engine: Engine, bid: int) -> torch.Tensor:
    """The ratio of layer bid + 1's FFN norm weight to layer bid's (the training-free rule's rescaling)."""
    layers = engine.model.layers
    return (layers[bid + 1].ffn_norm.weight.to("cpu") / layers[bid].ffn_norm.weight.to("cpu")).float()


def write_router_predictors(folder: Path, p: RouterPredictors) -> Path:
    """router_predictor.npz (and router_predictor.json, the report) in `folder`, each written atomically."""
    buf = io.BytesIO()
    stamp = stamps.header("profile")
    np.savez(
        buf,
        w=p.w.astype(np.float32),
        b=p.b.astype(np.float32),
        format=np.int64(stamp["format"]),  # type: ignore[call-overload]
        code=np.array(stamp["code"]),
    )
    data = buf.getvalue()
    path = folder / ROUTER_PREDICTOR_FILE
    write_file_atomically(path, lambda f: f.write(data))
    report = (json.dumps(p.summary(), indent=1) + "\n").encode()
    write_file_atomically(folder / "router_predictor.json", lambda f: f.write(report))
    return path
