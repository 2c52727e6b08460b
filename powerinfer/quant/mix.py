"""Per-tensor types of a quantization mix, as llama.cpp's quantize chooses them.

The rules are those of llama.cpp's `llama_tensor_get_type` (src/llama-quant.cpp, llama.cpp as vendored by
llama-cpp-python 0.3.36): the tensor's category from its name, the ftype's mix (Q4_K_M gives attn_v and ffn_down
Q6_K on the layers `use_more_bits` picks, ...), the output/embedding rule, then the fallback when the row length
is not a multiple of the type's block. Only the branches of the ftypes we can produce are kept (the IQ1/IQ2/IQ3,
TQ and MXFP4 ones are not). Two PowerInfer rules come first: the predictor matrices fc1/fc2 become Q4_0 for a
Q4_0 target and Q5_0 otherwise (the original's get_k_quant_type). `ffn_down_t` (the sparse layout's transposed
down matrix) is in the ffn_down category, as llama.cpp's substring match puts it, so a sparse file gets the same
extra bits on its down matrices as a dense one.

Counters (the i-th attn_v, the i-th ffn_down) advance in file order, as in llama.cpp; `MixState` carries them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from powerinfer.gguf.constants import QUANT_SIZES, GGMLType
from powerinfer.quant.types import TYPES


class Ftype:
    """llama_ftype numbers (llama.h) of the mixes implemented here."""

    F32, F16, Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 = 0, 1, 2, 3, 7, 8, 9
    Q2_K, Q3_K_S, Q3_K_M, Q3_K_L, Q4_K_S, Q4_K_M, Q5_K_S, Q5_K_M, Q6_K = 10, 11, 12, 13, 14, 15, 16, 17, 18
    Q2_K_S, IQ4_NL, IQ4_XS, BF16 = 21, 25, 30, 32


# the rules in a sentence, for `quantize --help`
RULES_HELP = (
    "the K-quant mixes (e.g. Q4_K_M gives half the attn_v and ffn_down matrices Q6_K; ffn_down_t of sparse files "
    "counts as ffn_down), output.weight Q6_K (Q8_0 when n_embd % 256 != 0), the predictor matrices fc1/fc2 Q4_0 "
    "for a Q4_0 target and Q5_0 otherwise (as the original)"
)


class Category(Enum):
    TOKEN_EMBD = "token_embd"
    ATTN_Q = "attn_q"
    ATTN_K = "attn_k"
    ATTN_V = "attn_v"
    ATTN_QKV = "attn_qkv"
    ATTN_KV_B = "attn_kv_b"
    ATTN_OUTPUT = "attn_output"
    FFN_UP = "ffn_up"
    FFN_GATE = "ffn_gate"
    FFN_DOWN = "ffn_down"
    OUTPUT = "output"
    OTHER = "other"


# substring -> category, checked in this order (llama.cpp's tensor_get_category)
_CATEGORY_SUBSTRINGS = (
    ("attn_qkv.weight", Category.ATTN_QKV),
    ("attn_kv_b.weight", Category.ATTN_KV_B),
    ("attn_v.weight", Category.ATTN_V),
    ("attn_k.weight", Category.ATTN_K),
    ("attn_q.weight", Category.ATTN_Q),
    ("attn_output.weight", Category.ATTN_OUTPUT),
    ("ffn_up", Category.FFN_UP),
    ("ffn_gate", Category.FFN_GATE),
    ("ffn_down", Category.FFN_DOWN),
)
_ATTN_V_LIKE = frozenset({Category.ATTN_V, Category.ATTN_QKV, Category.ATTN_KV_B})
# 2-D weights llama.cpp never quantizes (the ones of the architectures we load)
_NEVER_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "attn_rel_b.weight")
_NEVER_QUANTIZED_NAMES = frozenset({"position_embd.weight", "token_types.weight"})


def category(name: str) -> Category:
    if name == "output.weight":
        return Category.OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return Category.TOKEN_EMBD
    return next((cat for sub, cat in _CATEGORY_SUBSTRINGS if sub in name), Category.OTHER)


def allows_quantization(name: str, n_dims: int, powerinfer_file: bool = False) -> bool:
    """llama.cpp's tensor_allows_quantization for the tensors of the architectures we load; in a PowerInfer
    (PWRI) file every 2-D weight but the norms, as PowerInfer's quantize does (OPT's position table included)."""
    if n_dims < 2 or not name.endswith("weight"):
        return False
    if any(s in name for s in _NEVER_QUANTIZED):
        return False
    return powerinfer_file or name not in _NEVER_QUANTIZED_NAMES


@dataclass(frozen=True)
class ModelFacts:
    """What the mix rules read from the model: from its metadata and tensor names."""

    arch: str
    n_layer: int
    n_gqa: int  # n_head / n_head_kv of layer 0
    n_expert: int
    is_70b: bool  # llama.cpp's LLM_TYPE_70B (LLaMA, 80 layers, grouped-query attention)
    tied_embeddings: bool  # no output.weight: token_embd is the output head too
    n_attention_wv: int  # tensors in the attn_v-like categories
    powerinfer_file: bool = False  # a PWRI file: PowerInfer's quantize rules


def model_facts(metadata: dict[str, object], names: list[str]) -> ModelFacts:
    arch = str(metadata.get("general.architecture", ""))

    def number(key: str, default: int) -> int:
        value = metadata.get(f"{arch}.{key}", default)
        if isinstance(value, list | tuple):  # per-layer arrays: layer 0, as llama.cpp's n_gqa() reads
            value = value[0] if value else default
        try:
            return int(value)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            return default

    n_layer = number("block_count", 0)
    n_head = number("attention.head_count", 0)
    n_head_kv = number("attention.head_count_kv", n_head)
    n_gqa = n_head // n_head_kv if n_head > 0 and n_head_kv > 0 else 0
    return ModelFacts(
        arch=arch,
        n_layer=n_layer,
        n_gqa=n_gqa,
        n_expert=max(1, number("expert_count", 0)),
        is_70b=arch == "llama" and n_layer == 80 and n_head != n_head_kv,
        tied_embeddings="output.weight" not in names,
        n_attention_wv=sum(category(n) in _ATTN_V_LIKE for n in names),
    )


@dataclass
class MixState:
    """llama.cpp's per-run counters: the next attn_v-like and ffn_down / gate / up tensor, in file order."""

    i_attention_wv: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """The layers the _M mixes give more bits: the first and last eighth and every third one between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or _cmod(i_layer - n_layers // 8, 3) == 2


def _cmod(a: int, b: int) -> int:
    """C's % (truncating toward zero), which llama.cpp's use_more_bits relies on for negative operands."""
    r = abs(a) % b
    return -r if a < 0 else r


def llama_order(names: list[str]) -> list[str]:
    """The order llama.cpp's quantize visits tensors in (its weights map): by block index (tensors outside the
    blocks first), then by name. The counters of the mix rules advance in this order."""

    def key(name: str) -> tuple[int, str]:
        head = name[4:].split(".", 1)[0] if name.startswith("blk.") else ""
        return (int(head) if head.isdigit() else -1, name)

    return sorted(names, key=key)


def fallback(ggml_type: GGMLType, n_cols: int) -> GGMLType:
    """llama.cpp's tensor_type_fallback: a type whose block divides the row length (F16 as the last resort)."""
    block = QUANT_SIZES[ggml_type][0]
    if n_cols % block == 0:
        return ggml_type
    row = TYPES.get(ggml_type)
    new_type = row.fallback if row is not None and row.fallback is not None else ggml_type
    if n_cols % QUANT_SIZES[new_type][0] != 0:
        new_type = GGMLType.F16
    return new_type


def predictor_type(target: GGMLType) -> GGMLType:
    """PowerInfer's rule (spec 1.7) for its predictor matrices fc1/fc2: Q4_0 for a Q4_0 target, Q5_0 otherwise."""
    return GGMLType.Q4_0 if target == GGMLType.Q4_0 else GGMLType.Q5_0


def mix_type(
    ftype: int, new_type: GGMLType, name: str, n_cols: int, facts: ModelFacts, state: MixState
) -> GGMLType:
    """llama.cpp's llama_tensor_get_type_impl for `ftype` (before the fallback); advances `state`."""
    cat = category(name)
    n_layer = facts.n_layer
    if cat == Category.OUTPUT or (facts.tied_embeddings and cat == Category.TOKEN_EMBD):
        if facts.arch == "falcon" or n_cols % QUANT_SIZES[new_type][0] != 0:
            return GGMLType.Q8_0
        return GGMLType.Q6_K if new_type != GGMLType.Q8_0 else new_type
    if cat == Category.TOKEN_EMBD:
        return new_type
    if cat in _ATTN_V_LIKE:
        i = state.i_attention_wv
        if ftype == Ftype.Q2_K:
            new_type = GGMLType.Q4_K if facts.n_gqa >= 4 else GGMLType.Q3_K
        elif ftype == Ftype.Q2_K_S and facts.n_gqa >= 4:
            new_type = GGMLType.Q4_K
        elif ftype == Ftype.Q3_K_M:
            new_type = GGMLType.Q5_K if i < 2 else GGMLType.Q4_K
        elif ftype == Ftype.Q3_K_L:
            new_type = GGMLType.Q5_K
        elif ftype in (Ftype.IQ4_NL, Ftype.IQ4_XS) and facts.n_gqa >= 4:
            new_type = GGMLType.Q5_K
        elif ftype in (Ftype.Q4_K_M, Ftype.Q5_K_M) and use_more_bits(i, facts.n_attention_wv):
            new_type = GGMLType.Q6_K
        elif ftype == Ftype.Q4_K_S and i < 4:
            new_type = GGMLType.Q5_K
        if facts.is_70b and new_type in (GGMLType.Q3_K, GGMLType.Q4_K):
            new_type = GGMLType.Q5_K
        if facts.n_expert == 8:
            new_type = GGMLType.Q8_0
        state.i_attention_wv += 1
    elif cat == Category.ATTN_K:
        if facts.n_expert == 8:
            new_type = GGMLType.Q8_0
    elif cat == Category.FFN_DOWN:
        i_layer = _layer_of(name, state.i_ffn_down, facts)
        falcon = facts.arch == "falcon"
        if ftype == Ftype.Q2_K:
            new_type = GGMLType.Q3_K
        elif ftype == Ftype.Q2_K_S:
            if i_layer < n_layer // 8:
                new_type = GGMLType.Q4_K
        elif ftype == Ftype.Q3_K_M:
            if i_layer < n_layer // 16:
                new_type = GGMLType.Q5_K
            elif not falcon or use_more_bits(i_layer, n_layer):
                new_type = GGMLType.Q4_K
            else:
                new_type = GGMLType.Q3_K
        elif ftype == Ftype.Q3_K_L:
            new_type = GGMLType.Q4_K if falcon else GGMLType.Q5_K
        elif ftype == Ftype.Q4_K_M:
            if falcon:
                new_type = (
                    GGMLType.Q6_K
                    if i_layer < n_layer // 16
                    else GGMLType.Q5_K
                    if use_more_bits(i_layer, n_layer)
                    else GGMLType.Q4_K
                )
            elif use_more_bits(i_layer, n_layer):
                new_type = GGMLType.Q6_K
        elif i_layer < n_layer // 8 and ftype in (Ftype.IQ4_NL, Ftype.IQ4_XS):  # no imatrix
            new_type = GGMLType.Q5_K
        elif ftype == Ftype.Q5_K_M and use_more_bits(i_layer, n_layer):
            new_type = GGMLType.Q6_K
        elif ftype == Ftype.Q4_K_S and not falcon and i_layer < n_layer // 8:
            new_type = GGMLType.Q5_K
        state.i_ffn_down += 1
    elif cat == Category.ATTN_OUTPUT:
        if facts.arch != "falcon":
            if facts.n_expert == 8:
                if ftype in (
                    Ftype.Q2_K, Ftype.Q3_K_S, Ftype.Q3_K_M, Ftype.IQ4_NL, Ftype.Q4_K_S, Ftype.Q4_K_M, Ftype.IQ4_XS,
                ):  # fmt: skip
                    new_type = GGMLType.Q5_K
            elif ftype == Ftype.Q2_K:
                new_type = GGMLType.Q3_K
            elif ftype == Ftype.Q3_K_M:
                new_type = GGMLType.Q4_K
            elif ftype == Ftype.Q3_K_L:
                new_type = GGMLType.Q5_K
        elif ftype == Ftype.Q3_K_L:
            new_type = GGMLType.Q4_K
    elif cat == Category.FFN_GATE:
        state.i_ffn_gate += 1
    elif cat == Category.FFN_UP:
        state.i_ffn_up += 1
    # (attn_qkv is attn_v-like above: its own Q3_K_M/Q4_K_M/Q5_K_M branch in llama.cpp is unreachable)
    return new_type


def _layer_of(name: str, counter: int, facts: ModelFacts) -> int:
    """The layer index of an ffn tensor: the counter (one per layer), or blk.N of the name for MoE models."""
    if facts.n_expert > 1 and name.startswith("blk."):
        head = name[4:].split(".", 1)[0]
        if head.isdigit():
            return int(head)
    return counter


__all__ = [
    "Category",
    "Ftype",
    "MixState",
    "ModelFacts",
    "allows_quantization",
    "category",
    "fallback",
    "llama_order",
    "mix_type",
    "model_facts",
    "use_more_bits",
]
