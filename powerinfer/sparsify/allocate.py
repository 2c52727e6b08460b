"""Per-layer (or per-input) sparsity under a mean target: uniform, or greedy on error curves (TEAL-style)."""

from __future__ import annotations

import heapq

import numpy as np

MAX_LAYER_SPARSITY = 0.95
STEP = 0.01  # greedy allocation unit


def allocate_uniform(target: float, n_layer: int) -> np.ndarray:
    """Every layer at the target."""
    return np.full(n_layer, min(target, MAX_LAYER_SPARSITY), dtype=np.float64)


def allocate_greedy(
    curves: np.ndarray, grid: np.ndarray, target: float, weights: np.ndarray | None = None
) -> np.ndarray:
    """Per-unit sparsity s_u (layers, or TEAL's inputs) with weighted mean target, built in steps of STEP, each to
    the unit whose error grows least per unit of weight.

    curves: (n_unit, G) error of each unit at the sparsities `grid` (increasing, from 0), interpolated linearly in
    between. weights: (n_unit,) what a unit's share weighs in the mean (the bytes it reads; None: 1 each, the plain
    mean). Units stay in [0, MAX_LAYER_SPARSITY]; the last step is the fraction of a step that reaches the target,
    given to the unit with the cheapest next step, so the weighted mean is the target.
    """
    n_unit = curves.shape[0]
    w = np.ones(n_unit) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (n_unit,) or not np.all(w > 0):
        raise ValueError("weights must be positive, one per unit")
    n_fine = int(round(MAX_LAYER_SPARSITY / STEP))
    fine = np.arange(n_fine + 1) * STEP  # 0, 0.01, ..., 0.95
    error = np.stack([np.interp(fine, grid, c) for c in curves])  # (n_unit, n_fine + 1)
    marginal = np.diff(error, axis=1)  # cost of step i -> i + 1
    budget = target * float(w.sum()) / STEP  # weighted steps to take
    if budget > float(w.sum()) * n_fine + 1e-6:
        raise ValueError(f"target {target} is above the per-unit cap {MAX_LAYER_SPARSITY}")
    pos = np.zeros(n_unit, dtype=np.int64)
    s = np.zeros(n_unit)
    heap = [(float(marginal[u, 0]) / w[u], u) for u in range(n_unit)]
    heapq.heapify(heap)
    while heap and budget > 1e-9:
        _, u = heap[0]
        if w[u] > budget + 1e-9:  # a fraction of this unit's next step reaches the target
            s[u] += budget / w[u] * STEP
            break
        heapq.heappop(heap)
        budget -= w[u]
        pos[u] += 1
        s[u] = pos[u] * STEP
        if pos[u] < n_fine:
            heapq.heappush(heap, (float(marginal[u, pos[u]]) / w[u], u))
    out: np.ndarray = np.clip(s, 0.0, MAX_LAYER_SPARSITY)
    return out


def interpolate(curves: np.ndarray, grid: np.ndarray, sparsity: np.ndarray) -> np.ndarray:
    """Each layer's curve read at its own sparsity."""
    return np.array([np.interp(s, grid, c) for c, s in zip(curves, sparsity, strict=True)])
