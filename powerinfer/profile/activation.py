"""`powerinfer profile`: per-neuron firing counts over a corpus, written as PowerInfer's activation/ folder.

Output (spec 3.4): `activation/activation_<N>.pt`, a torch.save'd 1-D float32 tensor of length n_ff per layer
holding how many tokens each neuron fired for. Beside it `profile.json` (per-layer sparsity and hot-neuron
concentration) and, when matplotlib is installed, `activation_curve.png`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from powerinfer import stamps
from powerinfer.errors import InputError
from powerinfer.gguf.writer import output_problem, write_file_atomically
from powerinfer.placement.experts import NEURON_COUNTS_FILE
from powerinfer.placement.stats import activation_file
from powerinfer.printable import printable
from powerinfer.profile.collect import (
    Progress,
    check_output_folder,
    make_windows,
    read_corpus,
    recording,
    require_relu,
    run_windows,
    tokenize_corpus,
    write_folder_atomically,
)
from powerinfer.profile.experts import (
    ExpertProfile,
    moe_ffns,
    profile_experts,
    write_expert_report,
    write_neuron_counts,
)
from powerinfer.runtime.engine import Engine, EngineOptions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileOptions:
    model: Path
    corpus: Path
    out_dir: Path  # activation/ and the report go here
    n_ctx: int = 0  # window size in tokens (BOS + n_ctx-1 corpus tokens); 0 = the model's training context
    n_threads: int | None = None
    max_tokens: int = 0  # 0 = the whole corpus
    plot: bool = True


@dataclass
class ActivationProfile:
    """Firing counts per layer over n_tokens tokens."""

    counts: list[np.ndarray]  # n_layer x (n_ff,) int64
    n_tokens: int

    @property
    def n_ff(self) -> int:
        return int(self.counts[0].shape[0])

    def sparsity(self) -> np.ndarray:
        """Per layer: share of (token, neuron) pairs that did not fire."""
        return np.array([1.0 - c.sum() / max(1, self.n_tokens * self.n_ff) for c in self.counts])

    def cumulative(self, layer: int) -> np.ndarray:
        """Share of all firings covered by the k hottest neurons, k = 1..n_ff."""
        c = np.sort(self.counts[layer].astype(np.float64))[::-1]
        total = c.sum()
        return np.cumsum(c) / total if total > 0 else np.zeros_like(c)

    def hot_share(self, coverage: float = 0.8) -> np.ndarray:
        """Per layer: the smallest share of neurons that makes up `coverage` of the layer's firings."""
        out = []
        for layer in range(len(self.counts)):
            cum = self.cumulative(layer)
            k = int(np.searchsorted(cum, coverage - 1e-12) + 1) if cum[-1] > 0 else 0
            out.append(k / self.n_ff)
        return np.array(out)

    def summary(self) -> dict[str, object]:
        return {
            "n_tokens": self.n_tokens,
            "n_layer": len(self.counts),
            "n_ff": self.n_ff,
            "sparsity": [round(float(s), 6) for s in self.sparsity()],
            "hot_share_80": [round(float(s), 6) for s in self.hot_share(0.8)],
        }


def profile_engine(
    engine: Engine, windows: list[list[int]], progress: Progress | None = None
) -> ActivationProfile:
    """Run the windows through a dense-FFN engine and count, per layer, how often each neuron fires."""
    with recording(engine) as recorders:
        n_tokens = run_windows(engine, windows, progress)
    return ActivationProfile([r.counts.numpy().copy() for r in recorders], n_tokens)


def write_activation_folder(folder: Path, profile: ActivationProfile) -> Path:
    """Write activation_<N>.pt files (float32 counts) into `folder`, replacing it whole."""

    def write(tmp: Path) -> None:
        for layer, counts in enumerate(profile.counts):
            torch.save(torch.tensor(counts.astype(np.float32)), activation_file(tmp, layer))
        stamps.write_stamp_file(tmp, "profile")

    return write_folder_atomically(folder, write)


def plot_curves(path: Path, profile: ActivationProfile) -> Path | None:
    """PNG of each layer's cumulative activation curve; None (with a log line) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: no plot (pip install 'powerinfer[plot]')")
        return None
    fig, ax = plt.subplots(figsize=(6, 4.5), dpi=100)
    x = np.arange(1, profile.n_ff + 1) / profile.n_ff
    for layer in range(len(profile.counts)):
        ax.plot(x, profile.cumulative(layer), label=f"layer {layer}", linewidth=1)
    ax.axhline(0.8, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("share of neurons (hottest first)")
    ax.set_ylabel("share of all activations")
    ax.set_title(f"Cumulative FFN activations over {profile.n_tokens} tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(profile.counts) > 8 else 1)
    fig.tight_layout()
    try:
        write_file_atomically(path, lambda f: fig.savefig(f, format="png"), suffix=".png")
    finally:
        plt.close(fig)
    return path


def check_profile_outputs(out: Path, plot: bool) -> None:
    """InputError when the profile's outputs cannot be put into `out` (see check_output_folder and
    output_problem): `out` may be missing (its parent must exist), activation/ must be a folder, and
    profile.json and the plot missing or regular files."""
    check_output_folder(out)
    if not out.is_dir():
        return
    check_output_folder(out / "activation")
    for name in ("profile.json", "activation_curve.png") if plot else ("profile.json",):
        problem = output_problem(out / name)
        if problem is not None:
            raise InputError(f"cannot write {printable(str(out / name))}: {problem}")


def run_profile(
    opts: ProfileOptions, progress: Progress | None = None
) -> tuple[ActivationProfile | ExpertProfile, dict[str, Path]]:
    """Profile a model over a corpus and write activation/, profile.json and the plot into opts.out_dir; for a
    MoE model, its expert selections per layer into profile.json (powerinfer.profile.experts)."""
    text = read_corpus(opts.corpus)
    out = Path(opts.out_dir)
    check_profile_outputs(out, opts.plot)  # before the run: a bad -o must not cost the whole profile
    # exact activations (f32): statistics of the model itself, not of int8-rounded inputs
    engine = Engine(
        opts.model,
        EngineOptions(act_precision="f32", n_ctx=opts.n_ctx, n_threads=opts.n_threads, dense_ffn=True),
    )
    moe = moe_ffns(engine) is not None
    if not moe:
        require_relu(engine.config)
    ids = tokenize_corpus(engine, text)
    if opts.max_tokens > 0:
        ids = ids[: opts.max_tokens]
    windows = make_windows(ids, engine.n_ctx, engine.tokenizer.bos_id)
    if not windows:
        raise InputError(f"corpus file {printable(str(opts.corpus))} has no tokens")
    if moe:  # expert selections instead of neuron firings: profile.json (and ReLU experts' neuron counts)
        experts = profile_experts(engine, windows, progress)
        out.mkdir(exist_ok=True)
        info = {"model": str(opts.model), "corpus": str(opts.corpus), "n_ctx": engine.n_ctx}
        written = {"report": write_expert_report(out / "profile.json", info | experts.summary())}
        if experts.neurons is not None:
            written["neuron counts"] = write_neuron_counts(out / NEURON_COUNTS_FILE, experts.neurons)
        return experts, written
    profile = profile_engine(engine, windows, progress)
    out.mkdir(exist_ok=True)  # its parent exists (checked above)
    paths = {"activation": write_activation_folder(out / "activation", profile)}
    report = out / "profile.json"
    summary = {
        "model": str(opts.model),
        "corpus": str(opts.corpus),
        "n_ctx": engine.n_ctx,
        **profile.summary(),
        "stamp": stamps.header("profile"),
    }
    text_out = (json.dumps(summary, indent=1) + "\n").encode()
    write_file_atomically(report, lambda f: f.write(text_out))
    paths["report"] = report
    if opts.plot:
        png = plot_curves(out / "activation_curve.png", profile)
        if png is not None:
            paths["plot"] = png
    return profile, paths
