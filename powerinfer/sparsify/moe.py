"""CATS thresholds per expert for mixture-of-experts files (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE's routed experts).

One stage: neuron n of expert e is active for a token routed to e when |act(gate_n . u)| * w_n > t_e, w_n its mean
|up_n . u| over the calibration tokens routed to e, t_e the s-quantile of those scores over the expert's (token,
neuron) pairs, so that the share s of them is inactive; the engine compares |act(gate_n . u)| with t_e / w_n. An
expert routed fewer than MIN_EXPERT_TOKENS calibration tokens has too few scores for a quantile: every neuron of it
gets the layer's s-quantile of |act(gate . u)| over all the layer's (token, expert, neuron) pairs (no up weighting:
its w_n would come from those few tokens too). Shared experts (Qwen2-MoE) stay dense. The routing is the engine's
(`route`), from the FFN inputs the dense run recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from powerinfer import ops
from powerinfer.errors import ConfigError
from powerinfer.model.moe import MoEFFN, route
from powerinfer.runtime.engine import Engine
from powerinfer.sparsify.calibrate import CHUNK_TOKENS, neuron_thresholds, quantile

MIN_EXPERT_TOKENS = 16  # calibration tokens an expert needs for thresholds of its own


@dataclass
class ExpertLayerThreshold:
    neurons: np.ndarray  # (n_expert, n_ff) float32: the engine's thresholds on |act(gate)|
    fallback: float  # the layer's s-quantile of |act(gate)|, the thresholds of rarely routed experts
    tokens: np.ndarray  # (n_expert,) calibration tokens routed to each expert
    active_share: float  # share of the calibration (token, expert neuron) pairs active


def moe_ffn(engine: Engine, bid: int) -> MoEFFN:
    """Layer bid's MoE FFN, whose experts CATS thresholds (SiLU/GELU gated experts routed on the FFN input)."""
    ffn = engine.model.layers[bid].ffn
    if not isinstance(ffn, MoEFFN):
        raise ConfigError("sparsify needs a MoE FFN in every layer of a MoE model")
    if ffn.spec.act == "relu":
        raise ConfigError(
            "the experts are ReGLU (SmallThinker): the engine already skips every neuron whose gate is <= 0"
        )
    if ffn.spec.route_input != "ffn":
        raise ConfigError("sparsify needs experts routed on the FFN input")
    return ffn


def expert_layer_threshold(
    ffn: MoEFFN, u: torch.Tensor, s: float, kc: ops.KernelContext
) -> ExpertLayerThreshold:
    """Per-expert thresholds skipping the share s of each expert's calibration (token, neuron) pairs, for FFN
    inputs u (N, n_embd) routed by the layer's router."""
    spec, experts = ffn.spec, ffn.experts
    E, F = spec.n_expert, spec.n_ff_exp
    x = u.to(torch.float32).contiguous()
    ids = torch.cat(
        [route(ffn.logits(x[i : i + CHUNK_TOKENS]), spec, kc)[0] for i in range(0, x.shape[0], CHUNK_TOKENS)]
    )  # (N, k)
    acts: list[torch.Tensor | None] = []  # per expert: |act(gate u)| (n_e, F) of its tokens
    scales: list[torch.Tensor | None] = []  # per expert: mean |up u| (F,)
    tokens = np.zeros(E, dtype=np.int64)
    for e in range(E):
        rows = (ids == e).any(dim=-1).nonzero().reshape(-1)
        tokens[e] = rows.numel()
        if rows.numel() == 0:
            acts.append(None)
            scales.append(None)
            continue
        xe = x[rows]
        acts.append(ops.act(spec.act, ops.linear(xe, experts.gates[e], kc)).abs_())
        scales.append(ops.linear(xe, experts.ups[e], kc).abs_().mean(0))
    seen = [a for a in acts if a is not None]
    fallback = quantile(torch.cat(seen).reshape(-1), s) if seen and s > 0 else 0.0
    neurons = np.full((E, F), -1.0 if s <= 0 else fallback, dtype=np.float32)
    active = total = 0
    for e in range(E):
        a, w = acts[e], scales[e]
        if a is None or w is None:
            continue
        total += a.numel()
        if s <= 0:
            active += a.numel()
            continue
        if tokens[e] < MIN_EXPERT_TOKENS:
            active += int((a > fallback).sum())
            continue
        score = a * w
        t = quantile(score, s)
        neurons[e] = neuron_thresholds(t, w)
        active += int((score > t).sum())
    return ExpertLayerThreshold(neurons, fallback, tokens, active / max(1, total))
