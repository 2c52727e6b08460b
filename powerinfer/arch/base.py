"""Shared parts of architecture modules: typed metadata access, the common config and the FFN builder."""

from __future__ import annotations

import os
from typing import Any

import torch

from powerinfer.errors import ConfigError, FormatError
from powerinfer.gguf.constants import Keys, TensorNames
from powerinfer.model.blocks import FFN, DenseFFN
from powerinfer.model.config import ModelConfig
from powerinfer.model.source import WeightSource
from powerinfer.model.sparse import PredictorSelector, SparseFFN


class MetadataView:
    """Reads `{arch}`-templated keys from GGUF metadata with type checks and clear errors."""

    def __init__(self, metadata: dict[str, Any], arch: str) -> None:
        self.metadata = metadata
        self.arch = arch

    def _key(self, template: str) -> str:
        return template.format(arch=self.arch)

    def require(self, template: str, kind: type = int) -> Any:
        key = self._key(template)
        if key not in self.metadata:
            raise ConfigError(f"missing required metadata key '{key}'")
        return self._cast(key, self.metadata[key], kind)

    def optional(self, template: str, default: Any, kind: type = int) -> Any:
        key = self._key(template)
        if key not in self.metadata:
            return default
        return self._cast(key, self.metadata[key], kind)

    @staticmethod
    def _cast(key: str, value: Any, kind: type) -> Any:
        if kind is str:
            if not isinstance(value, str):
                raise ConfigError(f"metadata key '{key}' should be a string, got {type(value).__name__}")
            return value
        if isinstance(value, (str, list)) or getattr(value, "ndim", 0):
            raise ConfigError(f"metadata key '{key}' should be a number, got {type(value).__name__}")
        out = kind(value)
        if kind is int and out < 0:
            raise ConfigError(f"metadata key '{key}' must not be negative (got {out})")
        return out


# Our converter records the FFN activation; GGUF itself has no key for it (spec 8.6).
ACTIVATION_KEY = "powerinfer.ffn_activation"
THRESHOLD_ENV = "LLAMA_SPARSE_PRED_THRESHOLD"


def n_vocab_of(metadata: dict[str, Any]) -> int:
    tokens = metadata.get(Keys.TOKENIZER_TOKENS)
    if tokens is None:
        raise ConfigError(f"missing required metadata key '{Keys.TOKENIZER_TOKENS}'")
    return len(tokens)


def ffn_activation(metadata: dict[str, Any], default: str) -> str:
    """The FFN activation our converter recorded, else the architecture's default."""
    act = metadata.get(ACTIVATION_KEY, default)
    if not isinstance(act, str):
        raise ConfigError(f"metadata key '{ACTIVATION_KEY}' should be a string")
    return act


def sparse_threshold(metadata: dict[str, Any]) -> float:
    """The predictor threshold: the file's, overridden by LLAMA_SPARSE_PRED_THRESHOLD as in the original."""
    threshold = MetadataView._cast(Keys.SPARSE_THRESHOLD, metadata.get(Keys.SPARSE_THRESHOLD, 0.0), float)
    if os.environ.get(THRESHOLD_ENV):
        try:
            threshold = float(os.environ[THRESHOLD_ENV])
        except ValueError:
            raise ConfigError(f"{THRESHOLD_ENV}={os.environ[THRESHOLD_ENV]!r} is not a number") from None
    return threshold


def vector(src: WeightSource, template: str, n: int, bid: int | None = None) -> torch.Tensor:
    return src.vector(template.format(bid=bid), n)


def gated_ffn(config: ModelConfig, bid: int, src: WeightSource) -> FFN:
    """A layer's gated FFN from the standard tensor names: sparse when the source asks for a selector.

    PowerInfer files hold ffn_down_t (n_ff, n_embd) instead of ffn_down; predictors fc1 (r, n_embd), fc2 (n_ff, r).
    """
    c, kc = config, src.kc
    gate_name, up_name = TensorNames.FFN_GATE.format(bid=bid), TensorNames.FFN_UP.format(bid=bid)
    down_name, down_t_name = TensorNames.FFN_DOWN.format(bid=bid), TensorNames.FFN_DOWN_T.format(bid=bid)
    shape = (c.n_ff, c.n_embd)
    if src.sparsity.selector == "predictor":
        if src.stats is None:
            raise ConfigError("sparse FFNs need a statistics owner")
        fc1 = src.matrix(TensorNames.PRED_FC1.format(bid=bid))
        if fc1.shape[1] != c.n_embd:
            raise FormatError(
                f"predictor {TensorNames.PRED_FC1.format(bid=bid)} has shape {fc1.shape}, expected (r, {c.n_embd})"
            )
        fc2 = src.matrix(TensorNames.PRED_FC2.format(bid=bid), (c.n_ff, fc1.shape[0]))
        gate, up = src.host_matrix(gate_name, shape), src.host_matrix(up_name, shape)
        down_t = src.host_matrix(down_t_name, shape)
        selector = PredictorSelector(fc1, fc2, c.sparse_threshold, kc)
        hot = src.hot_rows(bid, gate, up, down_t)
        return SparseFFN(c.ffn, bid, selector, gate, up, down_t, hot, src.stats, kc, src.workspace)
    if src.sparsity.selector != "none":
        raise ConfigError(f"unknown sparsity selector '{src.sparsity.selector}'")
    gate, up = src.matrix(gate_name, shape), src.matrix(up_name, shape)
    if src.has(down_name):
        return DenseFFN(c.ffn, up, gate, src.matrix(down_name, (c.n_embd, c.n_ff)), None, kc)
    return DenseFFN(c.ffn, up, gate, None, src.matrix(down_t_name, shape), kc)
