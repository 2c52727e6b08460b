"""The sparse output head: a low-rank screen picks candidate vocabulary rows, only those are computed exactly.

For a small model with a large vocabulary the output matrix is a third of the bytes a token reads (SmolLM2-135M:
28.7 of 92 MiB). Per token u = norm(x):
  z = P . u               P (r, D): the r leading principal directions of calibration hidden states
  s = A . z               A (V, r) = W P^T, the head seen through that basis: every row screened
  C = about K top rows    (every row over a threshold sampled from s: ops.top_about_k) get exact logits
                          e_c = W_c . u, from the rows of the real head in its own type
  safe when max_c e_c > max_{i not in C} s_i + max_c |e_c - s_c|: the best exact candidate beats the best row
  left out by more than the screen erred on the candidates; otherwise the rows left out whose screen value is
  within that error of the best are computed exactly too (the whole head where they exceed an eighth of the
  vocabulary). The margin is an estimate, not a bound: the rows left out with a high logit are those the screen
  underrated most, so a weak screen (low rank, or not calibrated on the model's own states) can slip past it.
The logits are s with the candidates' exact values written in: greedy picks the dense head's token whenever the
screen ranked it among the candidates, and samplers see exact values for the candidates (top-k, top-p and min-p
act among them) and the screen's estimate elsewhere. Each token is computed on its own (its screen row, its
candidates), so a token's logits do not depend on the other rows of the step. Measured on SmolLM2 (r = 256,
K = 1024, held-out Python-docs text, calibration on standard-library docstrings): greedy agreement with the
whole head on 4096 of 4096 tokens, perplexity +0.4%, KL divergence 0.0004; the head reads 7.5 of 28.7 MiB a token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from powerinfer import ops
from powerinfer.gguf import GGMLType
from powerinfer.gguf.constants import TensorNames
from powerinfer.model.blocks import Head, Norm
from powerinfer.ops.weights import QWeight
from powerinfer.quant import dequantize, quantize
from powerinfer.quant.types import SPARSE_HEAD_PROJ_TYPE, SPARSE_HEAD_SCREEN_TYPE

# candidates computed exactly per token; 2048 rows of SmolLM2's 8-bit head are 1.2 MiB against the screen's 6.75
# (1024 had KL divergence 0.013-0.018 against the whole head on held-out prose, code docs and dialogue, 2048 0.006-0.009)
HEAD_CANDIDATES = 2048
# a token whose estimated probability outside its exact rows (screen values there) exceeds WIDEN_MASS gets exact
# values for the rows the screen ranks next, up to WIDEN_FACTORS[0] times the candidates, and while the mass left
# outside still exceeds it, up to the next factor. On SmolLM2's held-out prose, code docs, dialogue and Python docs
# (3175-3810 tokens each, narrow + mix screen, docs/sparsity.md) against the whole head: one step at 0.02 (to 4096
# rows) had KL divergence 0.0056-0.0079; these two steps at 0.01 0.0034-0.0052, widening 27% of tokens, +0.4 MiB a
# token on average. The perplexity cost comes from the ~1% of tokens whose target row stays outside the exact rows
# (rare targets the screen underrated by 2-5 nats): more exact rows leave fewer outside.
WIDEN_MASS = 0.01
WIDEN_FACTORS = (2, 4)


@dataclass
class HeadStats:
    """Tokens through the sparse head and how many of them fell back to the whole head."""

    tokens: int = 0
    fallbacks: int = 0  # computed whole
    widened: int = 0  # rows near the best computed exactly too
    extra_rows: int = 0  # how many, over all widened tokens (both kinds of widening)
    spread: int = 0  # tokens whose mass outside the candidates widened them (WIDEN_MASS)
    spread_steps: int = 0  # widening steps over those tokens (one per factor of WIDEN_FACTORS taken)


class SparseHead:
    """Final norm, the screen, exact logits of the candidates (the whole head where the margin is not safe)."""

    def __init__(
        self,
        head: Head,
        proj: ops.QWeight,
        screen: ops.QWeight,
        kc: ops.KernelContext,
        n_candidates: int = HEAD_CANDIDATES,
        widen_mass: float = WIDEN_MASS,
    ) -> None:
        n_vocab, n_embd = head.output.shape
        rank = proj.shape[0]
        if proj.shape != (rank, n_embd) or screen.shape != (n_vocab, rank):
            raise ValueError(
                f"head screen: projection {proj.shape} and screen {screen.shape} do not fit a head of "
                f"{(n_vocab, n_embd)}"
            )
        self.norm, self.output, self.kc = head.norm, head.output, kc
        self.proj, self.screen = proj, screen
        self.n_candidates = max(1, min(n_candidates, n_vocab - 1))
        self.widen_mass = widen_mass
        # the exact rows of each widening step, increasing (WIDEN_FACTORS)
        self.n_wides = sorted(
            {min(n_vocab - 1, self.n_candidates * f) for f in WIDEN_FACTORS} - {self.n_candidates}
        )
        # a token whose near rows exceed this computes the whole head instead
        self.max_extra = max(self.n_candidates, n_vocab // 8)
        self.stats = HeadStats()
        # one token's chain in one kernel call (None where the kernels do not apply: the torch path)
        # the norm too where it is an RMSNorm of the kernels (Norm's kinds "rms" and "rms_1p")
        norm = self.norm
        self.chain_norms = isinstance(norm, Norm) and norm.spec.kind != "layer"
        rms = (norm.weight, norm.spec.eps) if self.chain_norms else None
        wides = tuple(self.n_wides)
        self.chain = ops.head_chain(proj, screen, self.output, self.n_candidates, kc, rms, widen_mass, wides)
        if self.chain is None and rms is not None:
            self.chain_norms = False
            self.chain = ops.head_chain(
                proj, screen, self.output, self.n_candidates, kc, None, widen_mass, wides
            )

    def read_bytes(self) -> int:
        """Weight bytes a safe token reads: projection, screen and the candidates' rows."""
        row = self.output.raw.shape[1]
        return int(self.proj.raw.numel() + self.screen.raw.numel() + self.n_candidates * row)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kc, chain = self.kc, self.chain
        self.stats.tokens += x.shape[0]
        if x.shape[0] == 1 and chain is not None:  # one token: the whole chain in one kernel call
            if not self.chain_norms:
                x = self.norm(x)
            if x.dtype is not torch.float32 or not x.is_contiguous():
                x = x.to(torch.float32).contiguous()
            r = chain(x)
            self._settle(r, r.logits, 0)
            return r.logits
        u = self.norm(x).contiguous()
        z = ops.linear(u, self.proj, kc)
        logits = ops.linear(z.contiguous(), self.screen, kc)  # (T, V)
        for t in range(u.shape[0]):
            ut = u[t : t + 1]
            if chain is not None:  # the chain after its screen: the bits of the token alone
                self._settle(chain.pick(ut, logits[t : t + 1]), logits, t)
            else:
                self._settle(self._pick_torch(ut, logits[t]), logits, t)
        return logits

    def _pick_torch(self, u: torch.Tensor, row: torch.Tensor) -> ops.HeadResult:
        """The chain's pick where the kernels do not apply (ops.top_about_k's rows, the widening by torch's
        logsumexp over the row with the exact values written in); the same rule, not the same bits."""
        kc = self.kc
        cand, left_out = ops.top_about_k(row, self.n_candidates)
        exact = ops.rows_matmul(u, self.output, cand, kc)[0]
        err = float((exact - row[cand]).abs().max())
        best = float(exact.max())
        row[cand] = exact
        steps = new_rows = 0
        if self.widen_mass < 1.0:
            done: torch.Tensor | None = None
            for n_wide in self.n_wides:
                outside = 1.0 - float(torch.exp(torch.logsumexp(row[cand], 0) - torch.logsumexp(row, 0)))
                if outside <= self.widen_mass:
                    break
                wide, left_out = ops.top_about_k(row, n_wide)
                if done is None:
                    done = torch.zeros(row.shape[0], dtype=torch.bool)
                    done[cand] = True
                new = wide[~done[wide]]  # only the rows not exact yet are read
                if new.numel():
                    row[new] = ops.rows_matmul(u, self.output, new, kc)[0]
                    best = max(best, float(row[new].max()))
                    done[new] = True
                    cand = torch.cat([cand, new])
                steps += 1
                new_rows += new.numel()
        return ops.HeadResult(u, row[None], cand, cand.numel(), left_out, err, best, steps, new_rows, False)

    def _settle(self, r: ops.HeadResult, logits: torch.Tensor, t: int) -> None:
        """Row t of logits after the pick r (its exact rows written in): where the pick's set overflowed, the whole
        head; where the margin is not safe, the rows left out whose screen value is within the error of the best
        get exact values too (the whole head instead where they are too many)."""
        stats, u = self.stats, r.u
        if r.whole:
            logits[t] = ops.linear(u, self.output, self.kc)[0]
            stats.fallbacks += 1
            return
        stats.spread += int(r.steps > 0)
        stats.spread_steps += r.steps
        stats.extra_rows += r.new_rows
        if r.best > r.left_out + r.err:
            return
        row = logits[t]
        near = row > r.best - r.err
        near[r.candidates] = False
        extra = near.nonzero().view(-1)
        if extra.numel() > self.max_extra:
            logits[t] = ops.linear(u, self.output, self.kc)[0]
            stats.fallbacks += 1
            return
        row[extra] = ops.rows_matmul(u, self.output, extra, self.kc)[0]
        stats.widened += 1
        stats.extra_rows += extra.numel()


# ---- the screen: a principal basis of calibration hidden states and the head seen in it.
#
# P (r, D) holds the r leading eigenvectors of the final-normed hidden states' second moment over the calibration
# windows; A = W P^T (V, r). P and A are stored as `output_screen_proj.weight` and `output_screen.weight`, in the
# registry's SPARSE_HEAD_PROJ_TYPE and SPARSE_HEAD_SCREEN_TYPE (powerinfer.quant.types).
# A basis of the weights alone (the head's own SVD) screens poorly: on SmolLM2 its rank-256 screen held the dense
# argmax among 256 candidates for 29% of held-out tokens, the hidden states' basis for 100%.

SCREEN_PROJ = TensorNames.OUTPUT_SCREEN_PROJ
SCREEN = TensorNames.OUTPUT_SCREEN
PROJ_TYPE = SPARSE_HEAD_PROJ_TYPE
SCREEN_TYPE = SPARSE_HEAD_SCREEN_TYPE
# calibration tokens whose hidden states define the screen's basis, an equal share from each calibration text (the
# packaged mix, powerinfer.texts, and the user's text where there is one): a screen calibrated on one narrow kind
# of text alone cost +8-14% perplexity on other kinds (docs/sparsity.md)
SCREEN_TOKENS = 4096
# the screen pays when it reads at most this share of the head's bytes, on a head of at least MIN_HEAD_BYTES (below,
# the step's fixed costs, ~0.2 ms of top-k and row lists a token, outweigh the bytes saved)
MAX_SCREEN_SHARE = 0.5
MIN_HEAD_BYTES = 8 << 20


@dataclass(frozen=True)
class HeadScreen:
    proj: np.ndarray  # raw PROJ_TYPE rows (r, row bytes)
    screen: np.ndarray  # raw SCREEN_TYPE rows (V, row bytes)
    rank: int

    def tensors(self, n_vocab: int, n_embd: int) -> list[tuple[str, np.ndarray, GGMLType, tuple[int, int]]]:
        """(name, raw, type, shape (rows, cols)) of the two tensors, for a GGUF writer."""
        return [
            (SCREEN_PROJ, self.proj, PROJ_TYPE, (self.rank, n_embd)),
            (SCREEN, self.screen, SCREEN_TYPE, (n_vocab, self.rank)),
        ]

    def weights(self, n_vocab: int, n_embd: int) -> tuple[QWeight, QWeight]:
        return (
            QWeight(torch.from_numpy(self.proj), PROJ_TYPE, (self.rank, n_embd)),
            QWeight(torch.from_numpy(self.screen), SCREEN_TYPE, (n_vocab, self.rank)),
        )


def screen_rank(n_embd: int) -> int:
    """r: 4/9 of the width in whole blocks of 32 (SmolLM2's 576 -> 256), at least 32."""
    return max(32, (n_embd * 4 // 9) // 32 * 32)


def screen_pays(head: QWeight) -> bool:
    """Whether a screen of screen_rank reads at most MAX_SCREEN_SHARE of the head's bytes (and fits the blocks)."""
    n_vocab, n_embd = head.shape
    if n_embd % 32 or n_embd < 64 or head.raw.numel() < MIN_HEAD_BYTES:
        return False
    rank = screen_rank(n_embd)
    screen_bytes = n_vocab * rank // 32 * 18 + rank * n_embd // 32 * 34
    return screen_bytes <= MAX_SCREEN_SHARE * head.raw.numel()


def build_head_screen(head: QWeight, hidden: torch.Tensor, rank: int | None = None) -> HeadScreen:
    """The screen of `head` (V, D) from final-normed calibration hidden states (N, D)."""
    n_vocab, n_embd = head.shape
    rank = screen_rank(n_embd) if rank is None else rank
    h = hidden.to(torch.float64)
    _, vectors = torch.linalg.eigh(h.T @ h / max(1, h.shape[0]))  # ascending eigenvalues
    basis = vectors.flip(1)[:, :rank].to(torch.float32)  # (D, r)
    w = torch.from_numpy(dequantize(head.raw.numpy(), head.ggml_type, head.shape)).to(torch.float32)
    seen = (w @ basis).numpy()  # (V, r)
    return HeadScreen(
        proj=quantize(np.ascontiguousarray(basis.T.numpy()), PROJ_TYPE),
        screen=quantize(seen, SCREEN_TYPE),
        rank=rank,
    )
