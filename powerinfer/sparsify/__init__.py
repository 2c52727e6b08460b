"""`powerinfer sparsify`: training-free activation sparsity for SiLU/GELU gated models (CATS, Lee et al. 2024).

A neuron n of layer l is active for a token when |act(gate_n . u)| * w_n > t_l, u the FFN input and w_n the
neuron's mean |up_n . u| over the calibration tokens; inactive neurons contribute nothing, and a sequence's first
token runs dense. The thresholds come from a dense run over calibration text: t_l is the s_l-quantile of the
scores over the calibration (token, neuron) pairs (first tokens left out), with the per-layer sparsity s_l either
the target S for every layer or allocated greedily on per-layer output-error curves (TEAL-style) so that
mean_l s_l = S. The file holds t_l (key powerinfer.sparsity.thresholds) and, per layer, the engine's thresholds
on |act| itself, t_l / w_n (tensor blk.N.ffn_act_threshold).
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
