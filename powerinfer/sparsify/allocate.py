"""Per-layer sparsity under a mean target: uniform, or greedy on per-layer error curves (TEAL-style)."""

from __future__ import annotations

import heapq
import math

import numpy as np

MAX_LAYER_SPARSITY = 0.95
STEP = 0.01  # greedy allocation unit


def allocate_uniform(target: float, n_layer: int) -> np.ndarray:
    """Every layer at the target."""
    return np.full(n_layer, min(target, MAX_LAYER_SPARSITY), dtype=np.float64)


def allocate_greedy(curves: np.ndarray, grid: np.ndarray, target: float) -> np.ndarray:
    """Per-layer sparsity s_l with mean target, built in steps of STEP, each to the layer whose error grows least.

    curves: (n_layer, G) error of each layer at the sparsities `grid` (increasing, from 0), interpolated
    linearly in between. Layers stay in [0, MAX_LAYER_SPARSITY]; when target * n_layer is not a whole number of
    steps, the remainder goes to the layer with the cheapest next step, so the mean is the target.
    """
    n_layer = curves.shape[0]
    n_fine = int(round(MAX_LAYER_SPARSITY / STEP))
    fine = np.arange(n_fine + 1) * STEP  # 0, 0.01, ..., 0.95
    error = np.stack([np.interp(fine, grid, c) for c in curves])  # (n_layer, n_fine + 1)
    marginal = np.diff(error, axis=1)  # cost of step i -> i + 1
    units = target * n_layer / STEP
    if units > n_layer * n_fine + 1e-6:
        raise ValueError(f"target {target} is above the per-layer cap {MAX_LAYER_SPARSITY}")
    n_steps = min(n_layer * n_fine, int(math.floor(units + 1e-9)))
    remainder = max(0.0, units - n_steps)
    pos = np.zeros(n_layer, dtype=np.int64)
    heap = [(float(marginal[layer, 0]), layer) for layer in range(n_layer)]
    heapq.heapify(heap)
    for _ in range(n_steps):
        _, layer = heapq.heappop(heap)
        pos[layer] += 1
        if pos[layer] < n_fine:
            heapq.heappush(heap, (float(marginal[layer, pos[layer]]), layer))
    s = pos * STEP
    if remainder > 1e-9 and heap:
        s[heap[0][1]] += remainder * STEP
    out: np.ndarray = np.clip(s, 0.0, MAX_LAYER_SPARSITY)
    return out


def interpolate(curves: np.ndarray, grid: np.ndarray, sparsity: np.ndarray) -> np.ndarray:
    """Each layer's curve read at its own sparsity."""
    return np.array([np.interp(s, grid, c) for c, s in zip(curves, sparsity, strict=True)])
