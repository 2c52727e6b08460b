"""The type registry: every ggml tensor type the engine knows, and what each part of it can do with that type.

One row per type; every Python table about types (the kernel symbol suffixes, which types the fused FFN kernels and
the Triton pool kernels take, which types the CPU kernels compute on, which ones quantize produces, the device
pool keeps, the K-quant fallbacks, llama.cpp's ftype numbers and names) is derived from here. A new block type is
a row here, its kernels (kernels/cpu, the Triton decoder in ops/triton_quant.py) and their tests.

Every kernel that takes a type as an argument (the fused FFN kernels, pi_quantize_rows, the Triton decoder) takes
its ggml type number: the C kernels' `enum pi_type` (kernels/cpu/quants.h) is ggml's numbering.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from powerinfer.gguf.constants import GGMLType

__all__ = [
    "CONVERT_FILE_TYPES",
    "DOWN_T_DEFAULT",
    "DOWN_T_KEPT",
    "DOWN_T_TYPES",
    "FILE_TYPES",
    "FILE_TYPE_ALIASES",
    "FILE_TYPES_NEED_IMATRIX",
    "FTYPES",
    "FTYPE_GUESSED",
    "TYPES",
    "FileType",
    "TypeInfo",
    "SPARSE_HEAD_PROJ_TYPE",
    "SPARSE_HEAD_SCREEN_TYPE",
    "guess_ftype",
    "info",
    "types_where",
]


@dataclass(frozen=True)
class TypeInfo:
    """What the engine does with one ggml type.

    c_name: suffix of the C symbols (pi_matmul_<c_name>, pi_get_rows_<c_name>, ...), None: no C kernel.
    producer: who writes its blocks: "gguf" (the gguf package's reference quantizers), "c" (our C quantizers,
        bit-exact with llama.cpp's without an importance matrix) or None (quantize cannot produce it).
    dense: the CPU's dense kernels compute on its blocks ("block32": the int8 kernel plus an exact `_f` one for a
        quantized block of 32; "plain": float elements, one kernel; "super": a super-block type with get_rows, the
        "q8" matmul on Q8_K activations and the exact `_f` one), None: decoded to float32 first.
    sparse_rows: the row kernels pi_rows_matmul_<c_name>[_f] / pi_rows_axpy_<c_name> exist, and the fused FFN
        kernels (pi_ffn_rows, ...) and the Triton pool kernels take it (by its ggml number).
    decodable: the gguf package decodes its blocks (any weight of it can be computed on a float copy).
    fallback: the type a 256-element type falls back to when a row is not a multiple of 256 (llama.cpp's rule).
    ftype: llama_ftype number llama.cpp guesses for a file whose commonest tensor type this is.
    rows8: one token's int8 product also runs on its rows repacked by 8 (pi_repack_rows8 / pi_matvec_rows8: the
        4-bit type with offset 8 whose blocks are the C kernels' block_coef4), as the sparse head's screen does.
    """

    ggml: GGMLType
    c_name: str | None = None
    producer: str | None = None
    dense: str | None = None
    sparse_rows: bool = False
    decodable: bool = True
    fallback: GGMLType | None = None
    ftype: int | None = None
    rows8: bool = False


def _t(name: str, **kw) -> TypeInfo:
    return TypeInfo(GGMLType[name], **kw)


_ROWS = (
    _t("F32", c_name="f32", producer="gguf", dense="plain", sparse_rows=True, ftype=0),
    _t("F16", c_name="f16", producer="gguf", dense="plain", sparse_rows=True, ftype=1),
    _t("BF16", c_name="bf16", producer="gguf", dense="plain", sparse_rows=True, ftype=32),
    _t("Q4_0", c_name="q4_0", producer="gguf", dense="block32", sparse_rows=True, ftype=2, rows8=True),
    _t("Q4_1", c_name="q4_1", producer="gguf", dense="block32", sparse_rows=True, ftype=3),
    _t("Q5_0", c_name="q5_0", producer="gguf", dense="block32", sparse_rows=True, ftype=8),
    _t("Q5_1", c_name="q5_1", producer="gguf", dense="block32", sparse_rows=True, ftype=9),
    _t("Q8_0", c_name="q8_0", producer="gguf", dense="block32", sparse_rows=True, ftype=7),
    _t("Q2_K", c_name="q2_k", producer="c", dense="super", sparse_rows=True, fallback=GGMLType.Q4_0, ftype=10),
    _t("Q3_K", c_name="q3_k", producer="c", dense="super", sparse_rows=True, fallback=GGMLType.Q4_0, ftype=12),
    _t("Q4_K", c_name="q4_k", producer="c", dense="super", sparse_rows=True, fallback=GGMLType.Q5_0, ftype=15),
    _t("Q5_K", c_name="q5_k", producer="c", dense="super", sparse_rows=True, fallback=GGMLType.Q5_1, ftype=17),
    _t("Q6_K", c_name="q6_k", producer="c", dense="super", sparse_rows=True, fallback=GGMLType.Q8_0, ftype=18),
    _t("IQ4_NL", c_name="iq4_nl", producer="c", dense="super", ftype=25),
    _t("IQ4_XS", c_name="iq4_xs", producer="c", dense="super", fallback=GGMLType.IQ4_NL, ftype=30),
    # decoded by the gguf package to a float32 copy, no kernel of ours
    *(
        _t(name, ftype=ftype)
        for name, ftype in (
            ("IQ2_XXS", 19), ("IQ2_XS", 20), ("IQ3_XXS", 23), ("IQ1_S", 24), ("IQ3_S", 26), ("IQ2_S", 28),
            ("IQ1_M", 31), ("TQ1_0", 36), ("TQ2_0", 37), ("MXFP4", None),
        )
        if name in GGMLType.__members__
    ),
)  # fmt: skip

# Q8_1 and Q8_K (activation formats), the integer types and F64 hold no weights anything here decodes: not listed
TYPES: Mapping[GGMLType, TypeInfo] = MappingProxyType({row.ggml: row for row in _ROWS})


def info(ggml_type: GGMLType) -> TypeInfo | None:
    """The registry row of a type, None when the engine cannot compute on it."""
    return TYPES.get(GGMLType(ggml_type))


def types_where(**want) -> frozenset[GGMLType]:
    """The types whose rows have every given field value, e.g. types_where(producer="c")."""
    return frozenset(t for t, row in TYPES.items() if all(getattr(row, k) == v for k, v in want.items()))


@dataclass(frozen=True)
class FileType:
    """A `quantize` TYPE: name, llama_ftype number (stored in general.file_type) and target ggml type."""

    name: str
    ftype: int
    ggml_type: GGMLType | None  # None: COPY (tensors copied as they are)
    description: str


# quantize.cpp's QUANT_OPTIONS that we can produce, in its order (plus BF16, llama.cpp's ftype 32); a K-quant or
# IQ4 TYPE names a mix (powerinfer.quant.mix): its ggml type is the default the mix rules start from
FILE_TYPES: tuple[FileType, ...] = (
    FileType("Q4_0", 2, GGMLType.Q4_0, "4.5 bpw; the type PowerInfer's sparse models ship in"),
    FileType("Q4_1", 3, GGMLType.Q4_1, "5.0 bpw"),
    FileType("Q5_0", 8, GGMLType.Q5_0, "5.5 bpw"),
    FileType("Q5_1", 9, GGMLType.Q5_1, "6.0 bpw"),
    FileType("Q2_K", 10, GGMLType.Q2_K, "2.6 bpw mix: attn_v Q3_K/Q4_K, ffn_down and attn_output Q3_K"),
    FileType("Q3_K_S", 11, GGMLType.Q3_K, "3.4 bpw"),
    FileType(
        "Q3_K_M", 12, GGMLType.Q3_K, "3.9 bpw mix: attn_v Q5_K/Q4_K, ffn_down Q5_K/Q4_K, attn_output Q4_K"
    ),
    FileType("Q3_K_L", 13, GGMLType.Q3_K, "4.3 bpw mix: attn_v, ffn_down and attn_output Q5_K"),
    FileType("IQ4_NL", 25, GGMLType.IQ4_NL, "4.5 bpw non-linear"),
    FileType("IQ4_XS", 30, GGMLType.IQ4_XS, "4.25 bpw non-linear"),
    FileType("Q4_K_S", 14, GGMLType.Q4_K, "4.5 bpw"),
    FileType("Q4_K_M", 15, GGMLType.Q4_K, "4.8 bpw mix: half of attn_v and ffn_down Q6_K"),
    FileType("Q5_K_S", 16, GGMLType.Q5_K, "5.5 bpw"),
    FileType("Q5_K_M", 17, GGMLType.Q5_K, "5.7 bpw mix: half of attn_v and ffn_down Q6_K"),
    FileType("Q6_K", 18, GGMLType.Q6_K, "6.6 bpw"),
    FileType("Q8_0", 7, GGMLType.Q8_0, "8.5 bpw"),
    FileType("F16", 1, GGMLType.F16, "16 bpw"),
    FileType("BF16", 32, GGMLType.BF16, "16 bpw"),
    FileType("F32", 0, GGMLType.F32, "32 bpw"),
    FileType("COPY", 0, None, "copy tensors as they are (general.file_type kept)"),
)

# quantize.cpp's aliases of TYPE names
FILE_TYPE_ALIASES: Mapping[str, str] = MappingProxyType(
    {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
)
# mixes llama.cpp only makes with an importance matrix (which `quantize` does not read yet): name -> llama_ftype
FILE_TYPES_NEED_IMATRIX: Mapping[str, int] = MappingProxyType({"Q2_K_S": 21})
# `convert --outtype` (lower-cased): the file types convert writes its 2-D tensors in
CONVERT_FILE_TYPES = ("F32", "F16", "Q8_0")

# The types of tensors the engine writes itself, by role.
# The sparse head (model.head): the basis P (r, n_embd) and the head seen in it, A (n_vocab, r)
SPARSE_HEAD_PROJ_TYPE = GGMLType.Q8_0
SPARSE_HEAD_SCREEN_TYPE = GGMLType.Q4_0
# The transposed down projection ffn_down_t (sparsify.write): the types `sparsify --down-type` offers (in its help's
# order), those a source keeps (exact, or one 8-bit rounding), and the one every other source gets: rounding the
# transpose to 4 or 5 bits again along the other axis costs SmolLM2 Q4_1 +8% (4 bits) and +1.7% (5 bits, S = 0.4)
# perplexity on its own
DOWN_T_TYPES = tuple(GGMLType[n] for n in ("F32", "F16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0"))
DOWN_T_KEPT = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0})
DOWN_T_DEFAULT = GGMLType.Q8_0

# llama_ftype number -> the name llama.cpp prints for it (llama_model_ftype_name)
FTYPES: Mapping[int, str] = MappingProxyType(
    {
        0: "all F32",
        1: "F16",
        2: "Q4_0",
        3: "Q4_1",
        7: "Q8_0",
        8: "Q5_0",
        9: "Q5_1",
        10: "Q2_K - Medium",
        11: "Q3_K - Small",
        12: "Q3_K - Medium",
        13: "Q3_K - Large",
        14: "Q4_K - Small",
        15: "Q4_K - Medium",
        16: "Q5_K - Small",
        17: "Q5_K - Medium",
        18: "Q6_K",
        21: "Q2_K - Small",
        19: "IQ2_XXS - 2.0625 bpw",
        20: "IQ2_XS - 2.3125 bpw",
        23: "IQ3_XXS - 3.0625 bpw",
        24: "IQ1_S - 1.5625 bpw",
        25: "IQ4_NL - 4.5 bpw",
        26: "IQ3_S - 3.4375 bpw",
        28: "IQ2_S - 2.5 bpw",
        30: "IQ4_XS - 4.25 bpw",
        31: "IQ1_M - 1.75 bpw",
        32: "BF16",
        36: "TQ1_0 - 1.69 bpw ternary",
        37: "TQ2_0 - 2.06 bpw ternary",
    }
)
FTYPE_GUESSED = 1024  # llama.cpp's LLAMA_FTYPE_GUESSED bit


def guess_ftype(tensor_types: Iterable[GGMLType]) -> int:
    """llama.cpp's guess of general.file_type for a file without the key: the ftype of the type most tensors have
    (the first type to reach the highest count, in tensor order), ALL_F32 for a type it does not know, with the
    FTYPE_GUESSED bit."""
    counts: dict[GGMLType, int] = {}
    top, top_n = GGMLType.F32, 0
    for t in tensor_types:
        counts[t] = counts.get(t, 0) + 1
        if counts[t] > top_n:
            top, top_n = t, counts[t]
    row = TYPES.get(top)
    return (row.ftype if row is not None and row.ftype is not None else 0) | FTYPE_GUESSED


# the KV cache's row types (-ctk / -ctv values, llama.cpp's names; their layouts: ops.kv_types)
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")
