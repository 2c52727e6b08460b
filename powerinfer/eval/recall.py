"""Per-layer predictor quality from the sparse FFN's counters: recall, precision and predicted sparsity."""

from __future__ import annotations

from dataclasses import dataclass

from powerinfer.model.sparse import SparseStats


@dataclass(frozen=True)
class LayerRecall:
    layer: int
    tokens: int
    predicted: int  # (token, neuron) pairs the predictor marked active
    true_active: int  # pairs with ReLU(gate) > 0
    hit: int  # truly active and predicted
    n_ff: int

    @property
    def recall(self) -> float:
        """Share of truly active neurons the predictor found (1.0 when none were active)."""
        return self.hit / self.true_active if self.true_active else 1.0

    @property
    def precision(self) -> float:
        """Share of predicted neurons that were truly active (1.0 when none were predicted)."""
        return self.hit / self.predicted if self.predicted else 1.0

    @property
    def missed(self) -> int:
        """Truly active (token, neuron) pairs the predictor skipped."""
        return self.true_active - self.hit

    @property
    def predicted_share(self) -> float:
        """Predicted active share of (token, neuron) pairs: 1 - predicted sparsity."""
        return self.predicted / (self.tokens * self.n_ff) if self.tokens else 0.0

    @property
    def true_share(self) -> float:
        return self.true_active / (self.tokens * self.n_ff) if self.tokens else 0.0


def predictor_recall(stats: SparseStats, n_ff: int) -> list[LayerRecall]:
    """Per-layer recall/precision; stats must have had track_recall() called before the run."""
    if stats.true_active is None or stats.true_hit is None:
        raise ValueError("recall was not tracked: call SparseStats.track_recall() before running the model")
    return [
        LayerRecall(
            layer=i,
            tokens=int(stats.tokens[i]),
            predicted=int(stats.active[i]),
            true_active=int(stats.true_active[i]),
            hit=int(stats.true_hit[i]),
            n_ff=n_ff,
        )
        for i in range(stats.tokens.size)
    ]
