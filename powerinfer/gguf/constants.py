"""GGUF constants: magics, value types, metadata keys, tensor-name templates, quant types.

The quant-type enum and block-size table come from the `gguf` package so that there is one source of truth.
"""

from __future__ import annotations

from enum import IntEnum

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
PWRI_MAGIC = b"PWRI"
GGUF_VERSION = 3
GGUF_DEFAULT_ALIGNMENT = 32

GGMLType = GGMLQuantizationType
QUANT_SIZES: dict[GGMLType, tuple[int, int]] = dict(GGML_QUANT_SIZES)  # type -> (block elems, block bytes)

# PowerInfer's ggml predates the IQ types: in PWRI files ids 16-18 are I8, I16, I32 (today 24-26)
PWRI_LEGACY_TYPES: dict[int, GGMLType] = {16: GGMLType.I8, 17: GGMLType.I16, 18: GGMLType.I32}
PWRI_LEGACY_IDS: dict[GGMLType, int] = {v: k for k, v in PWRI_LEGACY_TYPES.items()}


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# numpy dtype string of each scalar value type (STRING and ARRAY are handled separately)
VALUE_DTYPES: dict[ValueType, str] = {
    ValueType.UINT8: "<u1",
    ValueType.INT8: "<i1",
    ValueType.UINT16: "<u2",
    ValueType.INT16: "<i2",
    ValueType.UINT32: "<u4",
    ValueType.INT32: "<i4",
    ValueType.FLOAT32: "<f4",
    ValueType.BOOL: "<u1",
    ValueType.UINT64: "<u8",
    ValueType.INT64: "<i8",
    ValueType.FLOAT64: "<f8",
}


class Keys:
    """Metadata keys; `{arch}` is filled with general.architecture."""

    ARCHITECTURE = "general.architecture"
    NAME = "general.name"
    ALIGNMENT = "general.alignment"
    FILE_TYPE = "general.file_type"
    QUANTIZATION_VERSION = "general.quantization_version"

    CONTEXT_LENGTH = "{arch}.context_length"
    EMBEDDING_LENGTH = "{arch}.embedding_length"
    BLOCK_COUNT = "{arch}.block_count"
    FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
    HEAD_COUNT = "{arch}.attention.head_count"
    HEAD_COUNT_KV = "{arch}.attention.head_count_kv"
    LAYERNORM_RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"
    LAYERNORM_EPS = "{arch}.attention.layer_norm_epsilon"
    TENSOR_DATA_LAYOUT = "{arch}.tensor_data_layout"
    KEY_LENGTH = "{arch}.attention.key_length"  # head size of q and k when it is not n_embd / n_head
    VALUE_LENGTH = "{arch}.attention.value_length"
    SLIDING_WINDOW = "{arch}.attention.sliding_window"
    ATTENTION_SCALE = "{arch}.attention.scale"  # Gemma 3's query scale when not 1 / sqrt(key_length)
    FINAL_LOGIT_SOFTCAPPING = "{arch}.final_logit_softcapping"
    SLIDING_WINDOW_PATTERN = (
        "{arch}.attention.sliding_window_pattern"  # per layer: True where the window applies
    )
    ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"
    ROPE_FREQ_BASE = "{arch}.rope.freq_base"
    ROPE_SCALING_TYPE = "{arch}.rope.scaling.type"
    ROPE_SCALING_FACTOR = "{arch}.rope.scaling.factor"
    ROPE_SCALING_ATTN_FACTOR = "{arch}.rope.scaling.attn_factor"
    ROPE_SCALING_ORIG_CTX_LEN = "{arch}.rope.scaling.original_context_length"
    ROPE_SCALING_YARN_EXT_FACTOR = "{arch}.rope.scaling.yarn_ext_factor"
    ROPE_SCALING_YARN_ATTN_FACTOR = "{arch}.rope.scaling.yarn_attn_factor"
    ROPE_SCALING_YARN_BETA_FAST = "{arch}.rope.scaling.yarn_beta_fast"
    ROPE_SCALING_YARN_BETA_SLOW = "{arch}.rope.scaling.yarn_beta_slow"
    VOCAB_SIZE = "{arch}.vocab_size"
    # mixture of experts (llama.cpp's names; expert_gating_func: 1 softmax, 2 sigmoid)
    EXPERT_COUNT = "{arch}.expert_count"
    EXPERT_USED_COUNT = "{arch}.expert_used_count"
    EXPERT_FEED_FORWARD_LENGTH = "{arch}.expert_feed_forward_length"
    EXPERT_SHARED_FEED_FORWARD_LENGTH = "{arch}.expert_shared_feed_forward_length"
    EXPERT_WEIGHTS_SCALE = "{arch}.expert_weights_scale"
    EXPERT_WEIGHTS_NORM = "{arch}.expert_weights_norm"
    EXPERT_GATING_FUNC = "{arch}.expert_gating_func"

    SPARSE_THRESHOLD = "powerinfer.sparse_threshold"
    # training-free sparsity (`powerinfer sparsify`): method ("cats"), target share S of skipped FFN neurons,
    # per-layer thresholds on |act(gate)| and the calibrated per-layer skipped shares
    SPARSITY_METHOD = "powerinfer.sparsity.method"
    SPARSITY_TARGET = "powerinfer.sparsity.target"
    SPARSITY_THRESHOLDS = "powerinfer.sparsity.thresholds"  # t_l on |act| * mean|up| (per-neuron: a tensor)
    SPARSITY_LAYER_SPARSITY = "powerinfer.sparsity.layer_sparsity"
    # MoE files: float32[n_layer * n_expert * n_ff], layer-major then expert: the thresholds on |act(gate)| of
    # every expert's neurons (a key, not a tensor: llama.cpp refuses a file with tensors it does not know)
    SPARSITY_EXPERT_THRESHOLDS = "powerinfer.sparsity.expert_act_thresholds"

    TOKENIZER_MODEL = "tokenizer.ggml.model"
    TOKENIZER_PRE = "tokenizer.ggml.pre"
    TOKENIZER_TOKENS = "tokenizer.ggml.tokens"
    TOKENIZER_SCORES = "tokenizer.ggml.scores"
    TOKENIZER_TOKEN_TYPE = "tokenizer.ggml.token_type"
    TOKENIZER_MERGES = "tokenizer.ggml.merges"
    TOKENIZER_BOS_ID = "tokenizer.ggml.bos_token_id"
    TOKENIZER_EOS_ID = "tokenizer.ggml.eos_token_id"
    TOKENIZER_EOT_ID = "tokenizer.ggml.eot_token_id"
    TOKENIZER_UNK_ID = "tokenizer.ggml.unknown_token_id"
    TOKENIZER_PAD_ID = "tokenizer.ggml.padding_token_id"
    TOKENIZER_ADD_BOS = "tokenizer.ggml.add_bos_token"
    TOKENIZER_ADD_EOS = "tokenizer.ggml.add_eos_token"
    TOKENIZER_ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"
    CHAT_TEMPLATE = "tokenizer.chat_template"

    GPU_INDEX_ARCH = "generic.gpu_index"
    GPU_INDEX_BLOCK_COUNT = "generic.gpu_index.block_count"
    VRAM_CAPACITY = "split.vram_capacity"


class TensorNames:
    """Tensor-name templates, defined once; `{bid}` is the block index."""

    TOKEN_EMBD = "token_embd.weight"
    OUTPUT_NORM = "output_norm.weight"
    OUTPUT = "output.weight"
    OUTPUT_SCREEN_PROJ = "output_screen_proj.weight"  # the sparse head's basis (r, n_embd) (model.head)
    OUTPUT_SCREEN = "output_screen.weight"  # the head seen in that basis (n_vocab, r)
    ROPE_FREQS = "rope_freqs.weight"
    ATTN_NORM = "blk.{bid}.attn_norm.weight"
    ATTN_Q = "blk.{bid}.attn_q.weight"
    ATTN_K = "blk.{bid}.attn_k.weight"
    ATTN_V = "blk.{bid}.attn_v.weight"
    ATTN_OUT = "blk.{bid}.attn_output.weight"
    ATTN_Q_BIAS = "blk.{bid}.attn_q.bias"
    ATTN_K_BIAS = "blk.{bid}.attn_k.bias"
    ATTN_V_BIAS = "blk.{bid}.attn_v.bias"
    ATTN_Q_NORM = "blk.{bid}.attn_q_norm.weight"  # per-head RMSNorm weights (head_dim,)
    ATTN_K_NORM = "blk.{bid}.attn_k_norm.weight"
    ATTN_POST_NORM = "blk.{bid}.post_attention_norm.weight"  # Gemma's norms of each block's output
    FFN_POST_NORM = "blk.{bid}.post_ffw_norm.weight"
    FFN_NORM = "blk.{bid}.ffn_norm.weight"
    FFN_GATE = "blk.{bid}.ffn_gate.weight"
    FFN_UP = "blk.{bid}.ffn_up.weight"
    FFN_DOWN = "blk.{bid}.ffn_down.weight"
    FFN_DOWN_T = "blk.{bid}.ffn_down_t.weight"
    FFN_ACT_THRESHOLD = "blk.{bid}.ffn_act_threshold"  # F32 (n_ff,): per-neuron |act(gate)| thresholds (cats)
    FFN_OUT_THRESHOLD = "blk.{bid}.ffn_out_threshold"  # F32 (n_ff,): per-neuron |act(gate) * up| thresholds
    # TEAL files (`sparsify --method teal`) hold each of these matrices W (N, K) transposed as `blk.N.X_t.weight`
    # (K, N), with `blk.N.X.input_threshold` (F32 (1,)): its inputs with |x| at or below it are skipped
    TEAL_MATRICES = (
        "blk.{bid}.attn_q.weight",
        "blk.{bid}.attn_k.weight",
        "blk.{bid}.attn_v.weight",
        "blk.{bid}.attn_output.weight",
        "blk.{bid}.ffn_gate.weight",
        "blk.{bid}.ffn_up.weight",
        "blk.{bid}.ffn_down.weight",
    )
    # mixture of experts: router (n_expert, n_embd), experts stacked (n_expert, n_ff_exp, n_embd) and down
    # (n_expert, n_embd, n_ff_exp); Qwen2-MoE's shared expert and its gate (n_embd,)
    FFN_GATE_INP = "blk.{bid}.ffn_gate_inp.weight"
    FFN_GATE_EXPS = "blk.{bid}.ffn_gate_exps.weight"
    FFN_UP_EXPS = "blk.{bid}.ffn_up_exps.weight"
    FFN_DOWN_EXPS = "blk.{bid}.ffn_down_exps.weight"
    FFN_GATE_INP_SHEXP = "blk.{bid}.ffn_gate_inp_shexp.weight"
    FFN_GATE_SHEXP = "blk.{bid}.ffn_gate_shexp.weight"
    FFN_UP_SHEXP = "blk.{bid}.ffn_up_shexp.weight"
    FFN_DOWN_SHEXP = "blk.{bid}.ffn_down_shexp.weight"
    PRED_FC1 = "blk.{bid}.fc1.weight"
    PRED_FC2 = "blk.{bid}.fc2.weight"
    GPU_IDX = "blk.{bid}.gpu_idx"
    GPU_BUCKET = "blk.{bid}.gpu_bucket"
    # Falcon and OPT
    POS_EMBD = "position_embd.weight"
    ATTN_NORM_2 = "blk.{bid}.attn_norm_2.weight"  # Falcon's ln_attn (attn_norm is its ln_mlp)
    ATTN_QKV = "blk.{bid}.attn_qkv.weight"

    @staticmethod
    def transposed(name: str) -> str:
        """The name of a matrix's transpose: blk.0.ffn_down.weight -> blk.0.ffn_down_t.weight."""
        return name.removesuffix(".weight") + "_t.weight"

    @staticmethod
    def input_threshold(name: str) -> str:
        """The name of a TEAL matrix's input threshold: blk.0.attn_q.weight -> blk.0.attn_q.input_threshold."""
        return name.removesuffix(".weight") + ".input_threshold"


def bias_of(weight_name: str) -> str:
    """The bias tensor's name beside a weight template or name (`x.weight` -> `x.bias`)."""
    return weight_name.removesuffix(".weight") + ".bias"
