"""Shared parts of architecture modules: typed metadata access, the common config and the FFN builder."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from powerinfer import ops
from powerinfer.errors import ConfigError, FormatError
from powerinfer.gguf.constants import Keys, TensorNames
from powerinfer.gguf.reader import GGUFFile
from powerinfer.model.blocks import FFN, DenseFFN
from powerinfer.model.config import ModelConfig
from powerinfer.model.source import WeightSource
from powerinfer.model.sparse import PredictorSelector, SparseFFN, ThresholdFFN
from powerinfer.printable import printable
from powerinfer.quant import check_weight_type


class MetadataView:
    """Reads `{arch}`-templated keys from GGUF metadata with type checks and clear errors."""

    def __init__(self, metadata: dict[str, Any], arch: str) -> None:
        self.metadata = metadata
        self.arch = arch

    def _key(self, template: str) -> str:
        return template.format(arch=self.arch)

    def require(self, template: str, kind: type = int, minimum: float | None = None) -> Any:
        key = self._key(template)
        if key not in self.metadata:
            raise ConfigError(f"missing required metadata key '{key}'")
        return self._cast(key, self.metadata[key], kind, minimum)

    def optional(self, template: str, default: Any, kind: type = int, minimum: float | None = None) -> Any:
        key = self._key(template)
        if key not in self.metadata:
            return default
        return self._cast(key, self.metadata[key], kind, minimum)

    @staticmethod
    def _cast(key: str, value: Any, kind: type, minimum: float | None = None, infinite: bool = False) -> Any:
        """`value` as `kind` (str, int or float): integers must be stored as integers, floats as numbers, finite
        unless `infinite`; ConfigError for any other type, NaN, a negative integer or a value below `minimum`."""
        if kind is str:
            if not isinstance(value, str):
                raise ConfigError(f"metadata key '{key}' should be a string, got {type(value).__name__}")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ConfigError(f"metadata key '{key}' should be a number, got {type(value).__name__}")
        if kind is int:
            if not isinstance(value, (int, np.integer)):
                raise ConfigError(f"metadata key '{key}' should be an integer, got {printable(value)}")
            out: int | float = int(value)
            if out < 0:
                raise ConfigError(f"metadata key '{key}' must not be negative (got {out})")
        else:
            out = float(value)
            if math.isnan(out):
                raise ConfigError(f"metadata key '{key}' is NaN")
            if math.isinf(out) and not infinite:
                raise ConfigError(f"metadata key '{key}' must be finite (got {out})")
        if minimum is not None and out < minimum:
            raise ConfigError(f"metadata key '{key}' must be at least {minimum} (got {out})")
        return out


# Our converter records the FFN activation; GGUF itself has no key for it (spec 8.6).
ACTIVATION_KEY = "powerinfer.ffn_activation"
THRESHOLD_ENV = "LLAMA_SPARSE_PRED_THRESHOLD"


def n_vocab_of(metadata: dict[str, Any]) -> int:
    tokens = metadata.get(Keys.TOKENIZER_TOKENS)
    if tokens is None:
        raise ConfigError(f"missing required metadata key '{Keys.TOKENIZER_TOKENS}'")
    if not isinstance(tokens, list) or not tokens:
        raise ConfigError(f"metadata key '{Keys.TOKENIZER_TOKENS}' should be a non-empty array of strings")
    return len(tokens)


def ffn_activation(metadata: dict[str, Any], default: str) -> str:
    """The FFN activation our converter recorded, else the architecture's default."""
    act = metadata.get(ACTIVATION_KEY, default)
    if not isinstance(act, str):
        raise ConfigError(f"metadata key '{ACTIVATION_KEY}' should be a string")
    return act


def sparse_threshold(metadata: dict[str, Any]) -> float:
    """The predictor threshold: the file's, overridden by LLAMA_SPARSE_PRED_THRESHOLD as in the original
    (-inf: every neuron active, inf: none; NaN is refused)."""
    value = metadata.get(Keys.SPARSE_THRESHOLD, 0.0)
    threshold = MetadataView._cast(Keys.SPARSE_THRESHOLD, value, float, infinite=True)
    if os.environ.get(THRESHOLD_ENV):
        text = os.environ[THRESHOLD_ENV]
        try:
            threshold = float(text)
        except ValueError:
            raise ConfigError(f"{THRESHOLD_ENV}={printable(text)!r} is not a number") from None
        if math.isnan(threshold):
            raise ConfigError(f"{THRESHOLD_ENV}={printable(text)!r} is NaN")
    return threshold


SPARSE_METHODS = ("predictor", "cats")


def sparse_method(metadata: dict[str, Any], sparse: bool, n_layer: int) -> tuple[str, tuple[float, ...]]:
    """How a sparse file selects neurons, and the per-layer thresholds of "cats" (`powerinfer sparsify`).

    PowerInfer's own files have no method key: "predictor". A "cats" file needs one finite threshold per layer."""
    if not sparse:
        return "predictor", ()
    method = metadata.get(Keys.SPARSITY_METHOD, "predictor")
    if not isinstance(method, str) or method not in SPARSE_METHODS:
        raise ConfigError(
            f"metadata key '{Keys.SPARSITY_METHOD}' should be one of {', '.join(SPARSE_METHODS)}, "
            f"got {printable(method)}"
        )
    if method != "cats":
        return method, ()
    values = metadata.get(Keys.SPARSITY_THRESHOLDS)
    if isinstance(values, np.ndarray) and values.ndim == 1:  # numeric arrays are read as numpy arrays
        values = values.tolist()
    if not isinstance(values, list) or len(values) != n_layer:
        got = f"{len(values)} values" if isinstance(values, list) else type(values).__name__
        raise ConfigError(
            f"metadata key '{Keys.SPARSITY_THRESHOLDS}' should hold {n_layer} numbers, got {got}"
        )
    thresholds = tuple(MetadataView._cast(Keys.SPARSITY_THRESHOLDS, v, float) for v in values)
    return method, thresholds


@dataclass(frozen=True)
class TensorTable:
    """The tensors an architecture reads, with the shapes its config gives them.

    shapes: name -> shape; a str dimension is a size the config does not fix (a predictor's rank), bound by
    the first tensor that has it and checked against every other. required: names that must be present;
    one_of: groups of names of which at least one must be present (ffn_down or the transposed ffn_down_t).
    """

    shapes: dict[str, tuple[int | str, ...]]
    required: frozenset[str]
    one_of: tuple[tuple[str, ...], ...] = ()


def check_tensors(gguf: GGUFFile, config: ModelConfig, table: TensorTable) -> None:
    """Every tensor the model reads is present with the type and shape the config expects: one pass over the
    tensor table before anything sized by metadata is allocated (FormatError naming the first mismatch)."""
    tensors = gguf.tensors
    for name in sorted(table.required):
        if name not in tensors:
            raise FormatError(f"{gguf.path}: missing required tensor '{name}'")
    for group in table.one_of:
        if not any(name in tensors for name in group):
            raise FormatError(f"{gguf.path}: missing required tensor '{group[0]}' (or '{group[-1]}')")
    bound: dict[str, int] = {}
    for name, expected in table.shapes.items():
        info = tensors.get(name)
        if info is None:
            continue
        check_weight_type(info.ggml_type, name, f"{gguf.path}: ")
        actual = info.shape
        ok = len(actual) == len(expected)
        for have, want in zip(actual, expected, strict=False):
            if isinstance(want, str):
                want = bound.setdefault(want, have)
            ok = ok and have == want
        if not ok:
            shown = tuple(bound.get(d, d) if isinstance(d, str) else d for d in expected)
            raise FormatError(
                f"{gguf.path}: tensor '{name}' has shape {actual}, expected {shown} "
                f"(n_embd {config.n_embd}, n_ff {config.n_ff}, n_vocab {config.n_vocab})"
            )


def check_layer_count(gguf: GGUFFile, config: ModelConfig, per_layer: int) -> None:
    """block_count against the tensors that exist: a layer needs `per_layer` tensors, so a count the file cannot
    hold is refused before a per-layer table is built."""
    if config.n_layer > len(gguf.tensors) // per_layer:
        raise FormatError(
            f"{gguf.path}: block_count {config.n_layer} needs {per_layer} tensors per layer, the file has "
            f"{len(gguf.tensors)} tensors"
        )


def vector(src: WeightSource, template: str, n: int, bid: int | None = None) -> torch.Tensor:
    return src.vector(template.format(bid=bid), n)


def gate_up(src: WeightSource, bid: int, shape: tuple[int, int], host: bool) -> tuple[Any, Any]:
    """A layer's gate and up matrices, each (n_ff, n_embd): ffn_gate and ffn_up, or, in files without ffn_gate
    (Phi-3), the two halves of ffn_up (2 n_ff, n_embd), gate first; `host`: both from the memory-mapped file."""
    read = src.host_matrix if host else src.matrix
    gate_name, up_name = TensorNames.FFN_GATE.format(bid=bid), TensorNames.FFN_UP.format(bid=bid)
    if src.has(gate_name):
        return read(gate_name, shape), read(up_name, shape)
    n_ff, n_embd = shape
    fused = read(up_name, (2 * n_ff, n_embd))
    return ops.weight_rows(fused, 0, n_ff), ops.weight_rows(fused, n_ff, 2 * n_ff)


def gated_ffn(config: ModelConfig, bid: int, src: WeightSource) -> FFN:
    """A layer's gated FFN from the standard tensor names: sparse when the source asks for a selector.

    PowerInfer files hold ffn_down_t (n_ff, n_embd) instead of ffn_down; predictors fc1 (r, n_embd), fc2 (n_ff, r)
    ("predictor"); "cats" files (`powerinfer sparsify`) thresholds on |act(gate)| instead: one per neuron
    (blk.N.ffn_act_threshold) or, in files without that tensor, the layer's one value for every neuron; with
    blk.N.ffn_out_threshold, a second stage on |act(gate) * up| per neuron.
    """
    c, kc = config, src.kc
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
        gate, up = gate_up(src, bid, shape, host=True)
        down_t = src.host_matrix(down_t_name, shape)
        selector = PredictorSelector(fc1, fc2, c.sparse_threshold, kc)
        hot = src.hot_rows(bid, gate, up, down_t)
        return SparseFFN(c.ffn, bid, selector, gate, up, down_t, hot, src.stats, kc, src.workspace)
    if src.sparsity.selector == "cats":
        if src.stats is None:
            raise ConfigError("sparse FFNs need a statistics owner")
        gate, up = gate_up(src, bid, shape, host=True)
        down_t = src.host_matrix(down_t_name, shape)
        hot = src.hot_rows(bid, gate, up, down_t)
        thr_name = TensorNames.FFN_ACT_THRESHOLD.format(bid=bid)
        if src.has(thr_name):
            thresholds = src.vector(thr_name, c.n_ff).to("cpu")
        else:
            thresholds = torch.full((c.n_ff,), c.sparse_thresholds[bid], dtype=torch.float32)
        out_name = TensorNames.FFN_OUT_THRESHOLD.format(bid=bid)
        out = src.vector(out_name, c.n_ff).to("cpu") if src.has(out_name) else None
        return ThresholdFFN(c.ffn, bid, thresholds, gate, up, down_t, hot, src.stats, kc, src.workspace, out)
    if src.sparsity.selector != "none":
        raise ConfigError(f"unknown sparsity selector '{src.sparsity.selector}'")
    gate, up = gate_up(src, bid, shape, host=False)
    if src.has(down_name):
        return DenseFFN(c.ffn, up, gate, src.matrix(down_name, (c.n_embd, c.n_ff)), None, kc)
    return DenseFFN(c.ffn, up, gate, None, src.matrix(down_t_name, shape), kc)
