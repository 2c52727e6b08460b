"""Where a MoE file's experts go: llama.cpp's static flags and, under a VRAM budget, the hottest experts first.

Pure data, no device is touched: `plan_experts` returns an `ExpertPlan` (per layer, the ids of the experts whose
gate, up and down rows the pool holds, whole), which the device plan carries and the loader carries out.

The rules, in the order they apply to one layer's stacked expert tensors `blk.N.ffn_{gate,up,down}_exps.weight`:
1. `-ot/--override-tensor REGEX=DEV[,REGEX=DEV...]`: the first pattern that matches (re.search on the tensor
   name, as llama.cpp does) decides: DEV `CPU` keeps the layer's experts on the CPU, the pool device's name puts
   them in the pool. A layer's three expert tensors move together: patterns that split them are an error.
2. `--cpu-moe` (every layer) and `--n-cpu-moe N` (layers 0..N-1) keep the experts on the CPU.
3. Otherwise, without a budget: the experts of the layers `-ngl` offloads go to the pool whole (llama.cpp's rule);
   with a budget (`--vram-budget` on the pool): the experts left free go in order of benefit per byte until the
   bytes the dense parts left are spent: selections per byte from the profile (`profile.json` beside the model,
   `expert_counts`), else whole layers from the last layer down.
4. Then, for ReLU experts with per-neuron counts (`expert_neurons.npy` beside the model, which `profile` writes:
   (n_layer, n_expert, n_ff) int64, how often each neuron of an expert had a positive gate), the hottest neurons
   of the experts not held whole, in order of activations per byte (a neuron's gate and up rows as stored and
   its down column in float32), until the budget is spent: the pool computes those neurons of a selected expert,
   the CPU the others (the CPU's copy of that expert's gate has the pooled neurons' rows zeroed, so their
   ReLU(gate) is 0 there and their up rows are not read).

The plan's expected hit rate is the share of the profile's selections its pooled experts took (without a profile,
the share of experts, as if routing were uniform); the engine measures the share it served (runtime.report).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from powerinfer import quant, stamps
from powerinfer.errors import InputError, PlacementError
from powerinfer.gguf.constants import TensorNames
from powerinfer.gguf.reader import GGUFFile
from powerinfer.printable import printable

log = logging.getLogger(__name__)

EXPERT_TENSORS = (TensorNames.FFN_GATE_EXPS, TensorNames.FFN_UP_EXPS, TensorNames.FFN_DOWN_EXPS)
CPU_NAMES = ("cpu", "CPU")
MAX_OVERRIDES = 256
MAX_PATTERN = 1000


@dataclass(frozen=True)
class ExpertRequest:
    """The static expert flags: --cpu-moe, --n-cpu-moe N, -ot (pattern, "cpu" | "pool") pairs in order."""

    cpu_moe: bool = False
    n_cpu_moe: int = 0
    overrides: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.n_cpu_moe < 0:
            raise InputError(f"--n-cpu-moe must be >= 0 (got {self.n_cpu_moe})")

    @property
    def active(self) -> bool:
        return self.cpu_moe or self.n_cpu_moe > 0 or bool(self.overrides)

    def flags(self) -> str:
        """The flags as typed, for the placement line."""
        parts = []
        if self.cpu_moe:
            parts.append("--cpu-moe")
        if self.n_cpu_moe:
            parts.append(f"--n-cpu-moe {self.n_cpu_moe}")
        if self.overrides:
            parts.append("-ot " + ",".join(f"{p}={d}" for p, d in self.overrides))
        return "; ".join(parts)


def parse_overrides(
    texts: list[str] | tuple[str, ...], pool_names: tuple[str, ...]
) -> tuple[tuple[str, str], ...]:
    """-ot values (each a comma-separated list of REGEX=DEV) as (pattern, "cpu" | "pool") pairs; DEV is CPU / cpu
    or one of `pool_names` (the pool device's names, e.g. "cuda", "cuda:0", "CUDA0"). InputError on anything else."""
    out: list[tuple[str, str]] = []
    for text in texts:
        for item in text.split(","):
            pattern, sep, dev = item.rpartition("=")
            if not sep or not pattern or not dev:
                raise InputError(f"-ot {printable(item)}: expected REGEX=DEVICE (e.g. 'exps=CPU')")
            if len(pattern) > MAX_PATTERN:
                raise InputError(f"-ot: pattern longer than {MAX_PATTERN} characters")
            try:
                re.compile(pattern)
            except re.error as e:
                raise InputError(f"-ot {printable(item)}: bad regular expression ({e})") from None
            if dev in CPU_NAMES:
                out.append((pattern, "cpu"))
            elif dev in pool_names:
                out.append((pattern, "pool"))
            else:
                known = ", ".join((*CPU_NAMES, *pool_names)) if pool_names else "CPU (no pool device)"
                raise InputError(f"-ot {printable(item)}: unknown device {printable(dev)} (known: {known})")
            if len(out) > MAX_OVERRIDES:
                raise InputError(f"-ot: more than {MAX_OVERRIDES} patterns")
    return tuple(out)


def pool_names(device: str | None) -> tuple[str, ...]:
    """The names -ot accepts for the pool device: "pool" (also for the CPU stand-in, where "CPU" means the
    host's memory) and, for CUDA device i, "cuda", "CUDA", "cuda:i", "CUDAi" (llama.cpp's buffer type names)."""
    if device is None:
        return ()
    if not device.startswith("cuda"):
        return ("pool",)
    index = device.partition(":")[2] or "0"
    return ("pool", "cuda", "CUDA", f"cuda:{index}", f"CUDA{index}")


@dataclass(frozen=True)
class ExpertPlan:
    """Per layer the pooled experts' ids (ascending; empty: none), their bytes in the pool, the share of expert
    calls the plan expects the pool to serve, and how it was decided."""

    experts: tuple[np.ndarray, ...]
    n_expert: int
    bytes: int
    expected_share: float
    source: str  # "profile" or "uniform" (the expected share's basis)
    flags: str = ""
    device: str = ""
    # per layer: expert id -> the ids (ascending) of its neurons in the pool, for experts not held whole
    neurons: tuple[dict[int, np.ndarray], ...] = ()
    neuron_share: float = 0.0  # of the profile's neuron activations in experts not held whole

    @property
    def n_neurons(self) -> int:
        return sum(len(ids) for layer in self.neurons for ids in layer.values())

    @property
    def n_pooled(self) -> int:
        return sum(len(e) for e in self.experts)

    def describe(self) -> str:
        total = self.n_expert * len(self.experts)
        text = f"experts: {self.n_pooled}/{total} in the pool ({self.device}), {self.bytes / 2**30:.3g} GiB"
        text += f", expected {self.expected_share:.1%} of expert calls ({self.source})"
        if self.n_neurons:
            n_partial = sum(len(layer) for layer in self.neurons)
            text += (
                f"; {self.n_neurons} neurons of {n_partial} more experts (expected {self.neuron_share:.1%} of "
                "their activations)"
            )
        return text + (f"; {self.flags}" if self.flags else "")


def expert_bytes(gguf: GGUFFile, bid: int, n_expert: int) -> int:
    """Pool bytes of one expert of layer bid (its gate, up and down rows, as DeviceWeight stores them)."""
    total = 0
    for t in EXPERT_TENSORS:
        info = gguf.tensors[t.format(bid=bid)]
        total += quant.pool_bytes(info.ggml_type, tuple(info.shape))
    return total // n_expert


NEURON_COUNTS_FILE = "expert_neurons.npy"
ROUTER_PREDICTOR_FILE = "router_predictor.npz"  # train-predictor on MoE files (profile.router_predictor)


def load_router_predictor(
    model_path: Path, n_layer: int, n_expert: int, n_embd: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """The next-layer router predictor beside the model: w (n_layer - 1, n_expert, n_embd) and b (n_layer - 1,
    n_expert) float32, or None (no file, or one that does not fit this model: then a warning)."""
    path = model_path.parent / ROUTER_PREDICTOR_FILE
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            w, b = np.asarray(z["w"], dtype=np.float32), np.asarray(z["b"], dtype=np.float32)
            stamp = (int(z["format"]), str(z["code"])) if "code" in z.files else (None, None)
        fd = os.open(path, os.O_RDONLY)  # its pages leave the page cache (a memory limit counts them)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except (OSError, ValueError, KeyError) as e:
        log.warning("%s: unreadable (%s); the next layer's router predicts instead", path, e)
        return None
    if not stamp_usable(path, stamps.check("profile", *stamp)):
        return None
    if (
        w.shape != (n_layer - 1, n_expert, n_embd)
        or b.shape != (n_layer - 1, n_expert)
        or not (np.isfinite(w).all() and np.isfinite(b).all())
    ):
        log.warning("%s: does not fit this model; the next layer's router predicts instead", path)
        return None
    return w, b


def neuron_bytes(gguf: GGUFFile, bid: int, n_embd: int) -> int:
    """Pool bytes of one neuron of an expert of layer bid: its gate and up rows as stored, its down column in
    float32."""
    total = 4 * n_embd
    for t in EXPERT_TENSORS[:2]:
        info = gguf.tensors[t.format(bid=bid)]
        total += quant.pool_bytes(info.ggml_type, (1, int(info.shape[-1])))
    return total


def stamp_usable(path: Path, verdict: stamps.Verdict) -> bool:
    """A profile output's stamp (powerinfer.stamps): another format -> ignored with a warning; other code -> used
    with a warning (no stamp: made before stamps, or by PowerInfer: used)."""
    if verdict.changed:
        log.warning("%s has another format (%s); ignored: profile again", path, verdict.found)
        return False
    if verdict.state == "stale":
        stamps.warn_user_file(str(path), verdict)
    return True


def load_neuron_counts(model_path: Path, n_layer: int, n_expert: int, n_ff: int) -> np.ndarray | None:
    """Per-neuron activation counts of ReLU experts (n_layer, n_expert, n_ff) from expert_neurons.npy beside the
    model, or None (no file, or one of another shape or content: then a warning)."""
    path = model_path.parent / NEURON_COUNTS_FILE
    if not path.is_file():
        return None
    try:
        counts = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable (%s); no neurons of experts placed", path, e)
        return None
    if counts.shape != (n_layer, n_expert, n_ff) or counts.dtype.kind not in "iu" or (counts < 0).any():
        log.warning("%s: counts of shape %s do not fit this model; ignored", path, counts.shape)
        return None
    return counts


def load_expert_counts(model_path: Path, n_layer: int, n_expert: int) -> np.ndarray | None:
    """The profile's selections per expert (n_layer, n_expert) from profile.json beside the model, or None (no
    file, no expert counts in it, or counts of another shape: then a warning)."""
    path = model_path.parent / "profile.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        counts = np.asarray(data["expert_counts"], dtype=np.float64)
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("%s: no usable expert counts (%s); experts placed from the last layer down", path, e)
        return None
    if not stamp_usable(path, stamps.check_header("profile", data.get("stamp"))):
        return None
    if counts.shape != (n_layer, n_expert) or not np.isfinite(counts).all() or (counts < 0).any():
        log.warning(
            "%s: expert counts of shape %s do not fit %d layers x %d experts; ignored",
            path,
            counts.shape,
            n_layer,
            n_expert,
        )
        return None
    return counts


def static_choice(request: ExpertRequest, gguf: GGUFFile, bid: int) -> str | None:
    """Where the flags put layer bid's experts: "cpu", "pool" or None (the default rule decides)."""
    names = [t.format(bid=bid) for t in EXPERT_TENSORS]
    choices = [next((dev for pat, dev in request.overrides if re.search(pat, n)), None) for n in names]
    if len(set(choices)) > 1:
        detail = ", ".join(f"{n} -> {c or 'default'}" for n, c in zip(names, choices, strict=True))
        raise PlacementError(
            f"-ot splits the experts of layer {bid} ({detail}); a layer's expert tensors move together"
        )
    if choices[0] is not None:
        return choices[0]
    if request.cpu_moe or bid < request.n_cpu_moe:
        return "cpu"
    return None


def warn_other_matches(request: ExpertRequest, names: list[str]) -> None:
    """A warning when -ot patterns match tensors other than the stacked experts: those follow -ngl here."""
    experts = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)_exps\.weight$")
    others = [n for n in names if not experts.match(n) and any(re.search(p, n) for p, _ in request.overrides)]
    if others:
        log.warning(
            "-ot matches %d tensors that are not stacked experts (e.g. %s): they follow -ngl / the budget",
            len(others),
            printable(others[0]),
        )


def plan_experts(
    gguf: GGUFFile,
    n_layer: int,
    n_expert: int,
    request: ExpertRequest,
    device: str,
    default_layers: frozenset[int] = frozenset(),
    budget: int | None = None,
    counts: np.ndarray | None = None,
    neuron_counts: np.ndarray | None = None,
) -> ExpertPlan:
    """The experts in the pool: forced by the flags, then those of `default_layers` (no budget) or, with `budget`
    bytes, the free ones in order of selections per byte (`counts` (n_layer, n_expert)), else by layer from the
    last down, as long as they fit. The expected share comes from `counts` when given."""
    warn_other_matches(request, list(gguf.tensors))
    per_expert = [expert_bytes(gguf, bid, n_expert) for bid in range(n_layer)]
    chosen = [np.zeros(n_expert, dtype=bool) for _ in range(n_layer)]
    free: list[int] = []
    for bid in range(n_layer):
        choice = static_choice(request, gguf, bid)
        if choice == "pool" or (choice is None and budget is None and bid in default_layers):
            chosen[bid][:] = True
        elif choice is None and budget is not None:
            free.append(bid)
    used = sum(int(c.sum()) * per_expert[bid] for bid, c in enumerate(chosen))
    if budget is not None:
        if used > budget:
            log.warning("-ot puts %.3g GB of experts in the pool, past the budget left", used / 2**30)
        # candidates (layer, expert), best first: selections per byte, then the last layer first, lower ids first
        cand = [(bid, e) for bid in sorted(free, reverse=True) for e in range(n_expert)]
        if counts is not None:
            cand.sort(key=lambda be: -counts[be[0], be[1]] / max(1, per_expert[be[0]]))
        for bid, e in cand:
            if used + per_expert[bid] > budget:
                if counts is None:
                    break  # whole layers in order: stop at the first that does not fit
                continue
            chosen[bid][e] = True
            used += per_expert[bid]
    if counts is not None and counts.sum() > 0:
        share = float(sum(counts[bid][c].sum() for bid, c in enumerate(chosen)) / counts.sum())
        source = "profile"
    else:
        share = sum(int(c.sum()) for c in chosen) / max(1, n_layer * n_expert)
        source = "uniform"
    neurons: list[dict[int, np.ndarray]] = [{} for _ in range(n_layer)]
    neuron_share = 0.0
    if budget is not None and neuron_counts is not None and free:
        n_embd = int(gguf.tensors[EXPERT_TENSORS[0].format(bid=0)].shape[-1])
        per_neuron = np.array([neuron_bytes(gguf, bid, n_embd) for bid in range(n_layer)], dtype=np.float64)
        warm = np.zeros(neuron_counts.shape, dtype=bool)  # neurons of experts the flags left free, not whole
        for bid in free:
            warm[bid][~chosen[bid]] = True
        value = np.where(warm & (neuron_counts > 0), neuron_counts / per_neuron[:, None, None], -1.0)
        order = np.argsort(-value, axis=None, kind="stable")
        n_warm = int((value > 0).sum())
        room = budget - used
        # a prefix of the ranking that fits (each neuron of layer bid costs per_neuron[bid])
        costs = per_neuron[np.unravel_index(order[:n_warm], value.shape)[0]]
        take = int(np.searchsorted(np.cumsum(costs), room, side="right"))
        picked = np.zeros(neuron_counts.shape, dtype=bool)
        picked[np.unravel_index(order[:take], value.shape)] = True
        used += int(costs[:take].sum())
        for bid, e in zip(*np.nonzero(picked.any(axis=2)), strict=True):
            neurons[int(bid)][int(e)] = np.flatnonzero(picked[bid, e]).astype(np.int64)
        total = float(neuron_counts[warm].sum())
        neuron_share = float(neuron_counts[picked].sum()) / total if total else 0.0
    experts = tuple(np.flatnonzero(c).astype(np.int64) for c in chosen)
    return ExpertPlan(
        experts, n_expert, used, share, source, request.flags(), device, tuple(neurons), neuron_share
    )
