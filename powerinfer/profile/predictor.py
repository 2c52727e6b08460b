"""`powerinfer train-predictor`: fit PowerInfer's per-layer activation predictors, write a predictor folder.

Per layer the predictor is score = fc2 . ReLU(fc1 . x) (fc1 (r, n_embd), fc2 (n_ff, r), no biases) on the
pre-norm residual x, and neuron j is computed iff score_j >= threshold (spec section 2). Training data comes
from a dense run over the corpus: inputs x and the true firing masks. The corpus windows are split into
train / calibration / test: the weights are fit on train with a recall-favouring BCE (pos_weight > 1), each
layer's threshold tau_l is the score quantile that reaches the target recall on calibration, and the metrics
are measured on test.

The format has one global `sparse_threshold`. Scores are positively homogeneous in fc2, so a per-layer
threshold is folded into the weights: with a global threshold t of the same sign as tau_l, fc2_l * (t / tau_l)
decides exactly like fc2_l with tau_l. A layer whose tau_l has the other sign (or is ~0) falls back to a
threshold just below zero on the recall side.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from powerinfer import stamps
from powerinfer.errors import InputError
from powerinfer.profile.collect import (
    LayerSamples,
    Progress,
    make_windows,
    read_corpus,
    recording,
    require_relu,
    run_windows,
    tokenize_corpus,
    write_folder_atomically,
)
from powerinfer.runtime.engine import Engine, EngineOptions

# (stage, layer, step, steps) for the progress display
TrainProgress = Callable[[str, int, int, int], None]


@dataclass(frozen=True)
class PredictorOptions:
    model: Path
    corpus: Path
    out_dir: Path
    rank: int = 0  # 0: auto, min(n_embd, n_ff) / 2 rounded up to a multiple of 32, at most 1024
    target_recall: float = 0.95
    n_ctx: int = 0  # window size; 0 = min(model context, 512)
    n_threads: int | None = None
    max_tokens: int = 65536  # corpus tokens used in all (train + calibration + test)
    min_tokens: int = 2048  # fewer corpus tokens than this is an error
    heldout: float = 0.2  # share of windows for calibration + test (half each)
    steps: int = 1500
    batch: int = 1024
    lr: float = 3e-3
    pos_weight: float = 3.0
    device: str | None = None  # default: cuda when available
    seed: int = 0


@dataclass
class LayerMetrics:
    recall: float
    precision: float
    true_sparsity: float
    predicted_sparsity: float

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in self.__dict__.items()}


@dataclass
class PredictorSet:
    """Per-layer predictor weights as written (float16) and the global threshold."""

    fc1: list[torch.Tensor]  # (r, n_embd) float16
    fc2: list[torch.Tensor]  # (n_ff, r) float16
    threshold: float
    layer_thresholds: list[float] = field(default_factory=list)  # tau_l before folding (diagnostic)

    def scores(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Raw scores (N, n_ff) for inputs x (N, n_embd), in float32 from the stored weights."""
        w1, w2 = self.fc1[layer].to(x.device).float(), self.fc2[layer].to(x.device).float()
        return F.relu(x.float() @ w1.T) @ w2.T


def auto_rank(n_embd: int, n_ff: int) -> int:
    return int(min(1024, max(32, math.ceil(min(n_embd, n_ff) / 2 / 32) * 32)))


def default_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ------------------------------------------------------------------------------------------------ data


@dataclass
class Split:
    """Samples of one split: per layer x (N, D) float16 and packed masks (N, n_ff/8) uint8."""

    x: list[torch.Tensor]
    fired: list[np.ndarray]

    @property
    def n_tokens(self) -> int:
        return int(self.x[0].shape[0]) if self.x else 0


def collect_samples(
    engine: Engine, windows: list[list[int]], progress: Progress | None = None
) -> list[LayerSamples]:
    """Predictor inputs and true firing masks of the windows' tokens per layer, one entry per window."""
    with recording(engine, keep_samples=True) as recorders:
        run_windows(engine, windows, progress)
    samples = [r.samples for r in recorders if r.samples is not None]
    if any(len(s.x) != len(windows) for s in samples):  # one forward per window: n_batch >= window length
        raise InputError(f"batch size {engine.options.n_batch} is smaller than the window size")
    return samples


def take(samples: list[LayerSamples], window_ids: range) -> Split:
    """Concatenate the samples of the given windows (one entry per window)."""
    return Split(
        [torch.cat([s.x[i] for i in window_ids]) for s in samples],
        [np.concatenate([s.fired[i] for i in window_ids]) for s in samples],
    )


def unpack(fired: np.ndarray, n_ff: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(fired, axis=1, count=n_ff).astype(bool))


# ------------------------------------------------------------------------------------------------ training


def train_layer(
    x: torch.Tensor,
    fired: np.ndarray,
    n_ff: int,
    rank: int,
    opts: PredictorOptions,
    device: torch.device,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit fc1 (rank, D), fc2 (n_ff, rank) on one layer (input scaling folded into fc1); float32, CPU."""
    gen = torch.Generator().manual_seed(opts.seed)
    N, D = x.shape
    x_dev = x.to(device)
    # per-dimension RMS scaling (no centring: there is no bias to absorb it), folded into fc1 afterwards
    scale = x_dev.float().pow(2).mean(dim=0).sqrt().clamp_min(1e-6)  # (D,)
    fc1 = torch.nn.Linear(D, rank, bias=False).to(device)
    fc2 = torch.nn.Linear(rank, n_ff, bias=False).to(device)
    with torch.no_grad():
        fc2.weight.mul_(math.sqrt(3.0))
    params = list(fc1.parameters()) + list(fc2.parameters())
    optim = torch.optim.Adam(params, lr=opts.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * s / max(1, opts.steps)))
    )
    pos_weight = torch.full((n_ff,), opts.pos_weight, device=device)
    batch = min(opts.batch, N)
    with torch.enable_grad():
        for step in range(opts.steps):
            idx = torch.randint(0, N, (batch,), generator=gen)
            xb = x_dev[idx.to(device)].float() / scale
            yb = unpack(fired[idx.numpy()], n_ff).to(device=device, dtype=torch.float32)
            logits = fc2(F.relu(fc1(xb)))
            loss = F.binary_cross_entropy_with_logits(logits, yb, pos_weight=pos_weight)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            if progress is not None and (step % 10 == 0 or step == opts.steps - 1):
                progress(step + 1, opts.steps)
    w1 = (fc1.weight.detach() / scale[None, :]).float().cpu()
    return w1, fc2.weight.detach().float().cpu()


def score_chunks(
    w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, device: torch.device, chunk: int = 8192
) -> torch.Tensor:
    """Scores (N, n_ff) float32 on the CPU."""
    w1d, w2d = w1.to(device).float(), w2.to(device).float()
    out = [
        (F.relu(x[i : i + chunk].to(device).float() @ w1d.T) @ w2d.T).cpu()
        for i in range(0, x.shape[0], chunk)
    ]
    return torch.cat(out)


def calibrate_threshold(scores: torch.Tensor, fired: torch.Tensor, target_recall: float) -> float:
    """The largest threshold that keeps at least `target_recall` of the fired (token, neuron) pairs."""
    pos = scores[fired]
    if pos.numel() == 0:
        return 0.0
    k = int(math.floor((1.0 - target_recall) * pos.numel()))  # up to k positives may fall below
    return float(torch.sort(pos).values[k]) if k < pos.numel() else float(pos.max())


def fold_thresholds(fc2: list[torch.Tensor], taus: list[float]) -> tuple[list[torch.Tensor], float]:
    """Scale each layer's fc2 so one global threshold decides like the per-layer taus; (fc2, threshold)."""
    arr = np.array(taus)
    sign = -1.0 if np.any(arr < 0) else 1.0
    same = arr[np.sign(arr) == sign]
    t = sign * float(np.median(np.abs(same))) if same.size else 0.0
    if t == 0.0:
        return [w.clone() for w in fc2], 0.0
    eps = 1e-3 * abs(t)
    out = []
    for w, tau in zip(fc2, taus, strict=True):
        if tau * sign < eps:  # other sign or ~0: move to the recall side (a threshold of sign*eps)
            tau = -eps if sign < 0 else eps
        out.append(w * (t / tau))
    return out, t


def evaluate(predictors: PredictorSet, split: Split, n_ff: int, device: torch.device) -> list[LayerMetrics]:
    """Recall, precision, true and predicted sparsity per layer on a split, with the stored fp16 weights."""
    metrics = []
    for layer in range(len(predictors.fc1)):
        scores = score_chunks(predictors.fc1[layer], predictors.fc2[layer], split.x[layer], device)
        pred = scores >= predictors.threshold
        true = unpack(split.fired[layer], n_ff)
        tp = int((pred & true).sum())
        n_true, n_pred, total = int(true.sum()), int(pred.sum()), true.numel()
        metrics.append(
            LayerMetrics(
                recall=tp / n_true if n_true else 1.0,
                precision=tp / n_pred if n_pred else 1.0,
                true_sparsity=1.0 - n_true / total,
                predicted_sparsity=1.0 - n_pred / total,
            )
        )
    return metrics


# ------------------------------------------------------------------------------------------------ folder


def write_predictor_folder(folder: Path, predictors: PredictorSet) -> Path:
    """model_<N>.pt (fc1.weight, fc2.weight float16) and config.json (sparse_threshold), atomically."""

    def write(tmp: Path) -> None:
        for layer, (w1, w2) in enumerate(zip(predictors.fc1, predictors.fc2, strict=True)):
            half = [w.to(torch.float16).contiguous() for w in (w1, w2)]
            torch.save({"fc1.weight": half[0], "fc2.weight": half[1]}, tmp / f"model_{layer}.pt")
        (tmp / "config.json").write_text(json.dumps({"sparse_threshold": predictors.threshold}) + "\n")
        stamps.write_stamp_file(tmp, "profile")

    return write_folder_atomically(folder, write)


def load_predictor_folder(folder: Path) -> PredictorSet:
    """Read a predictor folder (model_<N>.pt for N = 0.. and optional config.json)."""
    folder = Path(folder)
    stamps.check_folder(folder, "profile", "predictor folder")
    fc1, fc2 = [], []
    layer = 0
    while (folder / f"model_{layer}.pt").is_file():
        state = torch.load(folder / f"model_{layer}.pt", map_location="cpu", weights_only=True)
        fc1.append(state["fc1.weight"])
        fc2.append(state["fc2.weight"])
        layer += 1
    if not fc1:
        raise InputError(f"no predictor files (model_0.pt ...) in {folder}")
    config = folder / "config.json"
    threshold = (
        float(json.loads(config.read_text()).get("sparse_threshold", 0.0)) if config.is_file() else 0.0
    )
    return PredictorSet(fc1, fc2, threshold)


# ------------------------------------------------------------------------------------------------ pipeline


@dataclass
class PredictorReport:
    predictors: PredictorSet
    test: list[LayerMetrics]
    calibration: list[LayerMetrics]
    rank: int
    n_tokens: dict[str, int]

    def summary(self) -> dict[str, object]:
        rec = [m.recall for m in self.test]
        return {
            "rank": self.rank,
            "threshold": self.predictors.threshold,
            "tokens": self.n_tokens,
            "layer_thresholds": [round(t, 6) for t in self.predictors.layer_thresholds],
            "test": [m.as_dict() for m in self.test],
            "mean_recall": round(float(np.mean(rec)), 6),
            "min_recall": round(float(np.min(rec)), 6),
            "calibration": [m.as_dict() for m in self.calibration],
        }


def split_windows(n_windows: int, heldout: float) -> tuple[range, range, range]:
    """Train / calibration / test windows: the last `heldout` share is calibration then test (half each)."""
    n_test = max(1, round(n_windows * heldout / 2))
    n_train = n_windows - 2 * n_test
    if n_train < 1:
        raise InputError(
            f"corpus too small: {n_windows} windows cannot be split into train, calibration and test"
        )
    return range(0, n_train), range(n_train, n_train + n_test), range(n_train + n_test, n_windows)


def train_predictors(
    opts: PredictorOptions, progress: Progress | None = None, train_progress: TrainProgress | None = None
) -> PredictorReport:
    """Collect samples with a dense run, train, calibrate and evaluate per layer. Nothing is written."""
    if not 0.0 < opts.target_recall < 1.0:
        raise InputError(f"--target-recall must be between 0 and 1 (got {opts.target_recall})")
    if opts.rank < 0 or opts.rank % 32 and opts.rank:
        raise InputError(
            f"--rank must be a positive multiple of 32 (got {opts.rank}); fc2's rows are quantized "
            "in blocks of 32"
        )
    text = read_corpus(opts.corpus)
    n_ctx = opts.n_ctx or 512
    # exact activations (f32): statistics of the model itself, not of int8-rounded inputs
    engine = Engine(
        opts.model,
        EngineOptions(
            act_precision="f32", n_ctx=n_ctx, n_batch=n_ctx, n_threads=opts.n_threads, dense_ffn=True
        ),
    )
    c = engine.config
    require_relu(c)
    if not opts.n_ctx:
        n_ctx = min(n_ctx, c.n_ctx_train)
    ids = tokenize_corpus(engine, text)
    if len(ids) < opts.min_tokens:
        raise InputError(
            f"corpus too small: {len(ids)} tokens, training predictors needs at least {opts.min_tokens}"
        )
    ids = ids[: opts.max_tokens] if opts.max_tokens > 0 else ids
    windows = make_windows(ids, n_ctx, engine.tokenizer.bos_id)
    train_w, calib_w, test_w = split_windows(len(windows), opts.heldout)
    samples = collect_samples(engine, windows, progress)
    train, calib, test = take(samples, train_w), take(samples, calib_w), take(samples, test_w)
    del samples
    device = default_device(opts.device)
    rank = opts.rank or auto_rank(c.n_embd, c.n_ff)
    fc1, fc2, taus = [], [], []
    for layer in range(c.n_layer):
        cb = (lambda s, n, layer=layer: train_progress("train", layer, s, n)) if train_progress else None
        w1, w2 = train_layer(train.x[layer], train.fired[layer], c.n_ff, rank, opts, device, cb)
        w1, w2 = w1.half(), w2.half()  # calibrate on the weights as stored
        scores = score_chunks(w1, w2, calib.x[layer], device)
        taus.append(calibrate_threshold(scores, unpack(calib.fired[layer], c.n_ff), opts.target_recall))
        fc1.append(w1)
        fc2.append(w2)
    folded, threshold = fold_thresholds([w.float() for w in fc2], taus)
    predictors = PredictorSet(fc1, [w.half() for w in folded], threshold, taus)
    return PredictorReport(
        predictors,
        evaluate(predictors, test, c.n_ff, device),
        evaluate(predictors, calib, c.n_ff, device),
        rank,
        {"train": train.n_tokens, "calibration": calib.n_tokens, "test": test.n_tokens},
    )


def evaluate_on_text(
    model: Path,
    predictors: PredictorSet,
    text: str,
    n_ctx: int = 512,
    max_tokens: int = 0,
    n_threads: int | None = None,
    device: str | None = None,
) -> list[LayerMetrics]:
    """Per-layer metrics of a predictor set on the dense run of a text (e.g. held-out text)."""
    # exact activations (f32): statistics of the model itself, not of int8-rounded inputs
    engine = Engine(
        model,
        EngineOptions(act_precision="f32", n_ctx=n_ctx, n_batch=n_ctx, n_threads=n_threads, dense_ffn=True),
    )
    ids = tokenize_corpus(engine, text)
    ids = ids[:max_tokens] if max_tokens > 0 else ids
    windows = make_windows(ids, engine.n_ctx, engine.tokenizer.bos_id)
    if not windows:
        raise InputError("no tokens to evaluate on")
    samples = collect_samples(engine, windows)
    return evaluate(
        predictors, take(samples, range(len(windows))), engine.config.n_ff, default_device(device)
    )
