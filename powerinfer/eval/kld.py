"""KL divergence and top-1 agreement of a model's next-token distributions against a reference model's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class KLDivergence:
    """Per-token KL(reference || model), top-1 agreement and the reference's NLL, accumulated over chunks."""

    kld: list[float] = field(default_factory=list)  # one value per scored token
    same_top1: int = 0
    ref_nll_sum: float = 0.0

    @property
    def count(self) -> int:
        return len(self.kld)

    @property
    def mean(self) -> float:
        return sum(self.kld) / self.count if self.count else float("nan")

    @property
    def mean_error(self) -> float:
        """Standard error of the mean KLD."""
        n = self.count
        if n < 2:
            return float("nan")
        mean = self.mean
        var = sum((k - mean) ** 2 for k in self.kld) / (n - 1)
        return math.sqrt(var / n)

    @property
    def max(self) -> float:
        return max(self.kld) if self.kld else float("nan")

    def quantile(self, q: float) -> float:
        return float(torch.tensor(self.kld, dtype=torch.float64).quantile(q)) if self.kld else float("nan")

    @property
    def top1(self) -> float:
        """Share of scored tokens where both models' most likely next token is the same."""
        return self.same_top1 / self.count if self.count else float("nan")

    @property
    def top1_error(self) -> float:
        n, p = self.count, self.top1
        return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")

    @property
    def ref_ppl(self) -> float:
        return math.exp(self.ref_nll_sum / self.count) if self.count else float("nan")


def compare_logits(
    acc: KLDivergence, ref_logp: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor
) -> None:
    """Add log-probability rows (n, n_vocab) of the reference and the model, with the true next tokens."""
    kld = (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1).clamp(min=0.0)  # (n,)
    acc.kld.extend(kld.tolist())
    acc.same_top1 += int((ref_logp.argmax(dim=-1) == logp.argmax(dim=-1)).sum())
    acc.ref_nll_sum += float(-ref_logp.gather(1, targets[:, None]).sum())
