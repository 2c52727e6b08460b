"""Model evaluation: llama.cpp-style perplexity, KL divergence against a dense reference, predictor recall."""

from powerinfer.eval.kld import BaseLogits, KLDivergence, compare_logits, compare_topk
from powerinfer.eval.perplexity import (
    Chunk,
    PerplexityOptions,
    PerplexityResult,
    context_size,
    perplexity,
    plan_chunks,
    tokenize_text,
)
from powerinfer.eval.recall import LayerRecall, predictor_recall

__all__ = [
    "BaseLogits",
    "Chunk",
    "KLDivergence",
    "LayerRecall",
    "PerplexityOptions",
    "PerplexityResult",
    "compare_logits",
    "compare_topk",
    "context_size",
    "perplexity",
    "plan_chunks",
    "predictor_recall",
    "tokenize_text",
]
