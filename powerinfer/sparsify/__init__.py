"""`powerinfer sparsify`: training-free activation sparsity for SiLU/GELU gated models (CATS, Lee et al. 2024).

A neuron n of layer l passes the gate stage for a token when |act(gate_n . u)| * w_n > t_l, u the FFN input and
w_n the neuron's mean |up_n . u| over the calibration tokens; its up row is then read. With two stages (the
default, --up-ratio < 1) it is active when also |h_n| * d_n > t2_l, h_n = act(gate_n . u) * up_n . u its
activation and d_n the norm of its down column (its output's size per unit of h); with one stage every neuron
passing the gate stage is active. Inactive neurons contribute nothing, and a sequence's first token runs dense.
The thresholds come from a dense run over calibration text: with per-layer sparsity s_l, t_l is the
(r * s_l)-quantile of the gate scores over the calibration (token, neuron) pairs (first tokens left out; r the
up ratio, 1 for one stage) and t2_l the quantile of the output scores that leaves s_l of the pairs inactive;
s_l is either the target S for every layer or allocated greedily on per-layer output-error curves (TEAL-style)
so that mean_l s_l = S. The file holds t_l (key powerinfer.sparsity.thresholds) and, per layer, the engine's
thresholds t_l / w_n on |act| (tensor blk.N.ffn_act_threshold) and t2_l / d_n on |h| (blk.N.ffn_out_threshold,
two stages only). Mixture-of-experts files get one-stage thresholds per expert instead (sparsify.moe), written as
a key of a GGUF copy (write.write_moe_gguf).
"""

from powerinfer.sparsify.allocate import MAX_LAYER_SPARSITY, allocate_greedy, allocate_uniform
from powerinfer.sparsify.calibrate import Calibration, calibrate
from powerinfer.sparsify.pipeline import (
    ALLOCATIONS,
    METHODS,
    MIN_TOKENS,
    SparsifyOptions,
    SparsifyResult,
    StageProgress,
    default_output,
    run_sparsify,
)
from powerinfer.sparsify.write import (
    SPARSITY_KEYS,
    SPARSITY_LAYER_KEY,
    SPARSITY_METHOD_KEY,
    SPARSITY_TARGET_KEY,
    SPARSITY_THRESHOLDS_KEY,
    write_activation_folder,
    write_sparse_gguf,
)

__all__ = [
    "ALLOCATIONS",
    "Calibration",
    "MAX_LAYER_SPARSITY",
    "METHODS",
    "MIN_TOKENS",
    "SPARSITY_KEYS",
    "SPARSITY_LAYER_KEY",
    "SPARSITY_METHOD_KEY",
    "SPARSITY_TARGET_KEY",
    "SPARSITY_THRESHOLDS_KEY",
    "SparsifyOptions",
    "SparsifyResult",
    "StageProgress",
    "allocate_greedy",
    "allocate_uniform",
    "calibrate",
    "default_output",
    "run_sparsify",
    "write_activation_folder",
    "write_sparse_gguf",
]
