"""llama.cpp's perplexity over a token stream, optionally with a dense reference run for KL divergence.

Algorithm (spec section 5.3): the whole text is tokenized once; chunk i is tokens [i*n_ctx, (i+1)*n_ctx),
its first token replaced by BOS when the vocabulary adds one, evaluated from position 0 with a cleared KV
cache; the logits at positions n_ctx/2 .. n_ctx-2 predict the next token. The running PPL after each chunk is
exp(sum nll / count); the final error is ppl * sqrt((mean(nll^2) - mean(nll)^2) / (count - 1)).

Strided variant (`stride > 0`, llama.cpp perplexity_v2): the context grows by stride/2, chunk i starts at
i*stride and scores its last `stride` predictions. As in llama.cpp, its BOS substitution happens after the
decode, so no token is replaced.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from powerinfer.errors import InputError
from powerinfer.eval.kld import BaseLogits, KLDivergence, compare_logits, compare_topk
from powerinfer.runtime.engine import Engine


@dataclass(frozen=True)
class Chunk:
    """One evaluation window: the tokens fed to the model and the rows of its logits that are scored."""

    start: int  # offset of the window in the token stream
    tokens: list[int]  # what the model sees (first token possibly replaced by BOS)
    targets: list[int]  # the true next tokens, one per scored row
    first: int  # first scored logit row; rows first .. first+len(targets)-1


@dataclass(frozen=True)
class PerplexityOptions:
    n_ctx: int
    n_chunks: int = -1  # <0: as many as the text allows
    stride: int = 0  # >0: llama.cpp's strided variant (--ppl-stride)


@dataclass
class PerplexityResult:
    running: list[float] = field(default_factory=list)  # PPL after each chunk
    nll_sum: float = 0.0
    nll2_sum: float = 0.0
    count: int = 0
    n_tokens: int = 0  # tokens in the text (with BOS where added)
    n_ctx: int = 0
    seconds: float = 0.0
    kld: KLDivergence | None = None  # sparse vs dense, when a reference engine ran too

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / self.count) if self.count else float("nan")

    @property
    def ppl_error(self) -> float | None:
        """Standard error of the PPL estimate; None where llama.cpp reports a negative variance."""
        if self.count < 2:
            return None
        mean = self.nll_sum / self.count
        var = self.nll2_sum / self.count - mean * mean
        if var <= 0:
            return None
        return self.ppl * math.sqrt(var / (self.count - 1))


def context_size(n_ctx: int, stride: int) -> int:
    """The context the model needs: n_ctx, enlarged by stride/2 in the strided variant (as llama.cpp does)."""
    return n_ctx + stride // 2 if stride > 0 else n_ctx


def plan_chunks(tokens: list[int], opts: PerplexityOptions, bos_id: int | None) -> list[Chunk]:
    """The evaluation windows of llama.cpp's perplexity (bos_id: replaces each chunk's first token)."""
    n_ctx, stride = context_size(opts.n_ctx, opts.stride), opts.stride
    if n_ctx < 4:
        raise InputError(f"context size {n_ctx} is too small for perplexity (-c >= 4)")
    if len(tokens) < 2 * n_ctx:
        raise InputError(
            f"perplexity needs at least {2 * n_ctx} tokens for a context of {n_ctx} (2 x -c), "
            f"the text has {len(tokens)}"
        )
    chunks = []
    if stride > 0:
        if stride >= n_ctx:
            raise InputError(f"--ppl-stride {stride} must be smaller than the context {n_ctx}")
        n_max = (len(tokens) - n_ctx + stride - 1) // stride
        n = n_max if opts.n_chunks < 0 else min(opts.n_chunks, n_max)
        first = n_ctx - stride - 1
        for i in range(n):
            start = i * stride
            window = tokens[start : start + n_ctx]
            chunks.append(Chunk(start, window, window[first + 1 :], first))
        return chunks
    n_max = len(tokens) // n_ctx
    n = n_max if opts.n_chunks < 0 else min(opts.n_chunks, n_max)
    first = n_ctx // 2
    for i in range(n):
        start = i * n_ctx
        window = tokens[start : start + n_ctx]
        targets = window[first + 1 :]
        if bos_id is not None:
            window = [bos_id, *window[1:]]
        chunks.append(Chunk(start, window, targets, first))
    return chunks


def tokenize_text(engine: Engine, text: str) -> list[int]:
    """The token stream as llama.cpp's perplexity builds it (BOS per the vocabulary, no special parsing)."""
    if not text:
        raise InputError("the text is empty")
    return engine.tokenizer.encode(text, add_bos=None, parse_special=False)


def chunk_logprobs(engine: Engine, chunk: Chunk) -> torch.Tensor:
    """Log-probabilities (float64) of the scored rows of one chunk, (len(targets), n_vocab)."""
    engine.reset()
    t = time.perf_counter()
    logits = engine.logits_all(chunk.tokens)  # (n_ctx, n_vocab)
    tm = engine.timings
    tm.prompt_ms += (time.perf_counter() - t) * 1e3
    tm.n_prompt += len(chunk.tokens)
    rows = logits[chunk.first : chunk.first + len(chunk.targets)]
    return torch.log_softmax(rows.double(), dim=-1)


def perplexity(
    engine: Engine,
    tokens: list[int],
    opts: PerplexityOptions,
    reference: Engine | None = None,
    on_chunk: Callable[[int, int, PerplexityResult], None] | None = None,
    base: BaseLogits | None = None,
    record: BaseLogits | None = None,
    record_top_k: int = 64,
) -> PerplexityResult:
    """llama.cpp's perplexity over `tokens`; KL divergence against a `reference` engine or a `base` file.

    record: a BaseLogits that receives this run's top-k log-probabilities (to save as a base file).
    on_chunk(i, n_chunks, result) is called after chunk i (0-based) with the running result.
    """
    n_ctx = context_size(opts.n_ctx, opts.stride)
    if engine.n_ctx < n_ctx or (reference is not None and reference.n_ctx < n_ctx):
        raise InputError(f"the engine's context is smaller than the {n_ctx} tokens perplexity needs")
    if base is not None:
        if (base.n_ctx, base.stride) != (opts.n_ctx, opts.stride):
            raise InputError(
                f"the KL-divergence base was made with -c {base.n_ctx} --ppl-stride {base.stride}, "
                f"this run uses -c {opts.n_ctx} --ppl-stride {opts.stride}"
            )
        if base.tokens != tokens:
            raise InputError("the KL-divergence base was made from other tokens (another text or vocabulary)")
    tok = engine.tokenizer
    bos = tok.bos_id if tok.add_bos and opts.stride == 0 else None
    chunks = plan_chunks(tokens, opts, bos)
    if base is not None and base.topk_logp[0].shape[0] < sum(len(c.targets) for c in chunks):
        raise InputError("the KL-divergence base covers fewer chunks than this run (--chunks)")
    result = PerplexityResult(n_tokens=len(tokens), n_ctx=n_ctx)
    if reference is not None or base is not None:
        result.kld = KLDivergence()
    t0 = time.perf_counter()
    row = 0
    for i, chunk in enumerate(chunks):
        logp = chunk_logprobs(engine, chunk)
        target = torch.tensor(chunk.targets, dtype=torch.int64)
        nll = -logp.gather(1, target[:, None]).squeeze(1)  # (n,)
        result.nll_sum += float(nll.sum())
        result.nll2_sum += float((nll * nll).sum())
        result.count += nll.numel()
        result.running.append(result.ppl)
        if result.kld is not None and reference is not None:
            compare_logits(result.kld, chunk_logprobs(reference, chunk), logp, target)
        elif result.kld is not None and base is not None:
            compare_topk(result.kld, *base.rows(row, len(chunk.targets)), logp)
        if record is not None:
            record.add(logp, target, record_top_k)
        row += len(chunk.targets)
        result.seconds = time.perf_counter() - t0
        if on_chunk is not None:
            on_chunk(i, len(chunks), result)
    return result
