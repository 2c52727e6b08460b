"""KL divergence and top-1 agreement of a model's next-token distributions against a reference model's."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from powerinfer.errors import InputError
from powerinfer.printable import printable


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


BASE_FORMAT = "powerinfer-kld-base-v1"


@dataclass
class BaseLogits:
    """A reference run's next-token distributions, top-k per scored token (the --kl-divergence-base file).

    The file is a torch.save dict (loaded with weights_only=True): format, n_ctx, stride, tokens (N,) int64,
    topk_logp (M, k) float32 log-probabilities in descending order, topk_ids (M, k) int64, target_logp (M,)
    float64 (log-probability of the true next token). M is the number of scored tokens over all chunks.
    """

    n_ctx: int
    stride: int
    tokens: list[int]
    topk_logp: list[torch.Tensor] = field(default_factory=list)  # per chunk (n, k)
    topk_ids: list[torch.Tensor] = field(default_factory=list)
    target_logp: list[torch.Tensor] = field(default_factory=list)

    def add(self, logp: torch.Tensor, targets: torch.Tensor, k: int) -> None:
        """Record one chunk's log-probability rows (n, n_vocab) and their true next tokens (n,)."""
        values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
        self.topk_logp.append(values.float())
        self.topk_ids.append(ids)
        self.target_logp.append(logp.gather(1, targets[:, None]).squeeze(1))

    def save(self, path: str | os.PathLike[str]) -> None:
        torch.save(
            {
                "format": BASE_FORMAT,
                "n_ctx": self.n_ctx,
                "stride": self.stride,
                "tokens": torch.tensor(self.tokens, dtype=torch.int64),
                "topk_logp": torch.cat(self.topk_logp),
                "topk_ids": torch.cat(self.topk_ids),
                "target_logp": torch.cat(self.target_logp),
            },
            path,
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BaseLogits:
        name = printable(os.fspath(path))
        if not os.path.exists(path):
            raise InputError(f"cannot read KL-divergence base {name}: no such file")
        if not os.path.isfile(path):  # a FIFO would block torch.load forever, a device never end
            raise InputError(f"cannot read KL-divergence base {name}: not a regular file")
        try:
            d = torch.load(path, weights_only=True)
        except FileNotFoundError:
            raise InputError(f"cannot read KL-divergence base {name}: no such file") from None
        except Exception as e:  # torch raises several unrelated types for a corrupt file
            raise InputError(f"{name} is not a KL-divergence base file ({type(e).__name__})") from None
        if not isinstance(d, dict) or d.get("format") != BASE_FORMAT:
            raise InputError(f"{name} is not a KL-divergence base file (format {BASE_FORMAT})")
        try:
            base = cls(int(d["n_ctx"]), int(d["stride"]), d["tokens"].tolist())
            parts = [d[key] for key in ("topk_logp", "topk_ids", "target_logp")]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InputError(f"{name} is not a valid KL-divergence base file ({type(e).__name__})") from None
        if not all(isinstance(t, torch.Tensor) for t in parts):
            raise InputError(f"{name} is not a valid KL-divergence base file (entries are not tensors)")
        base.topk_logp, base.topk_ids, base.target_logp = ([t] for t in parts)
        return base

    def rows(self, offset: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows offset .. offset+n of the loaded file: (top-k log-probs, top-k ids, target log-probs)."""
        sl = slice(offset, offset + n)
        return self.topk_logp[0][sl].double(), self.topk_ids[0][sl], self.target_logp[0][sl].double()


def compare_topk(
    acc: KLDivergence,
    ref_topk_logp: torch.Tensor,
    ref_topk_ids: torch.Tensor,
    ref_target_logp: torch.Tensor,
    logp: torch.Tensor,
) -> None:
    """Like compare_logits, with the reference known by its top-k: KL of the distributions coarsened to the k
    tokens plus one bucket for the rest (a lower bound of the full KL, equal when the rest is negligible)."""
    p = ref_topk_logp.exp()  # (n, k)
    logq = logp.gather(1, ref_topk_ids)
    q = logq.exp()
    p_rest = (1 - p.sum(-1)).clamp(min=0.0)
    q_rest = (1 - q.sum(-1)).clamp(min=1e-300)
    rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp(min=1e-300).log() - q_rest.log()), 0.0)
    kld = ((p * (ref_topk_logp - logq)).sum(-1) + rest).clamp(min=0.0)
    acc.kld.extend(kld.tolist())
    acc.same_top1 += int((ref_topk_ids[:, 0] == logp.argmax(dim=-1)).sum())
    acc.ref_nll_sum += float(-ref_target_logp.sum())
