"""The Python face of the CPU kernels: the only package that names a kernel.

The C kernels are built by setup.py as the extension `powerinfer._kernels` and called through ctypes
(`library`). How they run (threads, activation precision, SIMD variant, on or off) is a `KernelContext` value
passed to every op as its optional last argument; None means `default_context()`. When the extension is missing
or a weight type has no kernel, every op falls back to its pure-torch reference (`reference`, the `*_ref`
functions), which is also the oracle in tests.

Modules: library (loading, symbols), context (KernelContext), qweight (QWeight), weights (DeviceWeight),
dense (linear, get_rows), layer (fused decode blocks, rms_norm), sparse (the sparse FFN ops), attention (decode attention),
activation (FFN activations as data), reference (torch references), stacked_experts (a pool's whole experts),
triton_quant and triton_experts (the CUDA pool's kernels, imported only for a CUDA pool).
"""

from powerinfer.ops.activation import ACTIVATIONS, act, activation_code, gated, gated_ref
from powerinfer.ops.attention import (
    ATTN_KERNEL_MAX_POS,
    apply_rope,
    attend_batch,
    attend_one,
    attn_decode,
    attn_prefill,
    attn_scratch_bytes,
    decode_attention,
)
from powerinfer.ops.context import ACT_PRECISIONS, KernelContext, default_context
from powerinfer.ops.dense import get_rows, linear, top_about_k, top_k
from powerinfer.ops.head import HeadChain, HeadResult, head_chain
from powerinfer.ops.layer import (
    AttnBlock,
    CATSFFNBlock,
    DecodeStack,
    FFNBlock,
    SparseFFNBlock,
    TealLayer,
    attn_block,
    cats_ffn_block,
    decode_stack,
    ffn_block,
    rms_norm,
    sparse_ffn_block,
    teal_layer,
)
from powerinfer.ops.library import ISA_NAMES, isa_best, kernels_available
from powerinfer.ops.sparse import (
    cats_ffn,
    cats_ffn_ref,
    cats_scratch_bytes,
    cats_thresholds,
    decode_rows,
    ffn_rows,
    ffn_rows_ref,
    ffn_scratch_bytes,
    predict_ffn,
    rows_axpy,
    rows_axpy_ref,
    rows_matmul,
    rows_matmul_ref,
)
from powerinfer.ops.stacked_experts import ExpertNeurons, StackedExperts
from powerinfer.ops.weights import DeviceWeight, InputMeter, InputSparseWeight, QWeight, weight_rows

__all__ = [
    "ACTIVATIONS",
    "AttnBlock",
    "DecodeStack",
    "decode_stack",
    "HeadChain",
    "HeadResult",
    "head_chain",
    "CATSFFNBlock",
    "FFNBlock",
    "TealLayer",
    "attn_block",
    "cats_ffn_block",
    "ffn_block",
    "SparseFFNBlock",
    "sparse_ffn_block",
    "teal_layer",
    "rms_norm",
    "cats_ffn",
    "cats_ffn_ref",
    "cats_scratch_bytes",
    "cats_thresholds",
    "ACT_PRECISIONS",
    "ATTN_KERNEL_MAX_POS",
    "ISA_NAMES",
    "DeviceWeight",
    "ExpertNeurons",
    "InputMeter",
    "InputSparseWeight",
    "KernelContext",
    "QWeight",
    "StackedExperts",
    "act",
    "activation_code",
    "apply_rope",
    "attend_batch",
    "attend_one",
    "attn_decode",
    "attn_prefill",
    "attn_scratch_bytes",
    "decode_attention",
    "decode_rows",
    "default_context",
    "ffn_rows",
    "ffn_rows_ref",
    "ffn_scratch_bytes",
    "gated",
    "gated_ref",
    "get_rows",
    "isa_best",
    "kernels_available",
    "linear",
    "top_about_k",
    "top_k",
    "predict_ffn",
    "rows_axpy",
    "rows_axpy_ref",
    "rows_matmul",
    "rows_matmul_ref",
    "weight_rows",
]
