"""Issue 33: what the engine knows about each block type lives in one registry per language. A quantized type's name
(Q5_1, Q4_K_M, IQ4_NL, ...) appears in powerinfer/ and kernels/ only in the registry and format files listed here,
so a new block type is a row in powerinfer/quant/types.py, its C format files and kernels, its Triton decoder, and
their tests; a plain `git grep -i -w Q5_1 -- powerinfer kernels` shows those files and the C tests only.

Every line counts, code, comments and docstrings alike: measurements taken on one type are recorded in docs/ (which
may name types), and generic code describes a type by its properties ("a 4-bit block type with a minimum"). The
match is stricter than git grep's -w: a name joined to others by an underscore (pi_matmul_q5_1, PI_TYPE_Q4_K)
counts too. The float types (F32, F16, BF16) are element types the whole engine stores and computes in (norms,
activations, the safetensors dtypes), not block formats: they are not checked."""

from __future__ import annotations

import re
from pathlib import Path

from powerinfer.gguf.constants import QUANT_SIZES
from powerinfer.quant.types import FILE_TYPES, TYPES

ROOT = Path(__file__).resolve().parents[1]

# The registry files, each for a reason that is about the types themselves:
REGISTRIES = {
    # Python: the type table, llama.cpp's per-tensor mix recipes (rules written in type names), the Triton decoders
    "powerinfer/quant/types.py",
    "powerinfer/quant/mix.py",
    "powerinfer/ops/triton_quant.py",
    "powerinfer/ops/triton_experts.py",  # the pooled experts' Triton kernels read each type's blocks too
    # C format files: type ids, block layouts, scalar decoders and integer views, the type lists and TYPE_TRAITS
    "kernels/cpu/quants.h",
    "kernels/cpu/kquants.h",
    # the SIMD decoders of each format
    "kernels/cpu/quants_x86.h",
    "kernels/cpu/kquants_x86.h",
    # the quantizers (llama.cpp's per-type searches) and the per-type SIMD matmul kernels
    "kernels/cpu/quantize_k.c",
    "kernels/cpu/matmul_x86.h",
    "kernels/cpu/matmul_q8k_x86.h",
    # the per-ISA traits tables that register each type's kernels
    "kernels/cpu/matmul_types.h",
    "kernels/cpu/matmul_q8k_types.h",
    # the KV cache's row formats (-ctk / -ctv: llama.cpp's names and blocks): their encoders and decoders
    "powerinfer/ops/kv_types.py",
    "kernels/cpu/attention.c",
    "kernels/cpu/attention.h",
    "kernels/cpu/attention_body.h",
}
# the bundled model's file name is a name, not a type fact: the one literal allowed outside the registries
LITERALS_ALLOWED = {"powerinfer/sparsify/default.py": "SmolLM2-135M-Instruct.Q4_1.gguf"}
# the C tests (a test may name the types it checks), like tests/
NOT_CHECKED = ("kernels/tests/",)


def _names() -> list[str]:
    quantized = {t.name for t in TYPES if QUANT_SIZES[t][0] > 1} | {"Q8_1", "Q8_K"}
    quantized |= {ft.name for ft in FILE_TYPES if ft.ggml_type is not None and ft.ggml_type.name in quantized}
    return sorted(quantized, key=len, reverse=True)


PATTERN = re.compile(rf"(?<![A-Za-z0-9])({'|'.join(_names())})(?![A-Za-z0-9])", re.IGNORECASE)


def checked_files() -> list[tuple[str, str]]:
    """(path, text) of every text file under powerinfer/ and kernels/ that is neither a registry nor a C test (a
    binary such as the built library is skipped, as git grep skips it)."""
    files = []
    for top in ("powerinfer", "kernels"):
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT).as_posix()
            if not path.is_file() or "__pycache__" in rel or rel in REGISTRIES or rel.startswith(NOT_CHECKED):
                continue
            try:
                files.append((rel, path.read_text()))
            except UnicodeDecodeError:
                continue
    return files


def hits_in(text: str, rel: str) -> list[str]:
    """file:line: text for every line naming a type, the allowed literal taken out first"""
    if rel in LITERALS_ALLOWED:
        text = text.replace(LITERALS_ALLOWED[rel], "")
    return [
        f"{rel}:{i}: {line.strip()}" for i, line in enumerate(text.split("\n"), 1) if PATTERN.search(line)
    ]


def test_type_names_only_in_the_registries():
    hits = []
    for rel, text in checked_files():
        hits += hits_in(text, rel)
    assert not hits, "type names outside the registry files:\n" + "\n".join(hits)


def test_the_allowlists_are_needed():
    # a registry that no longer names a type, or a literal no longer there, would be a stale exemption
    for rel in sorted(REGISTRIES):
        assert PATTERN.search((ROOT / rel).read_text()), rel
    for rel, literal in LITERALS_ALLOWED.items():
        assert literal in (ROOT / rel).read_text(), rel


def test_the_check_sees_a_type_name():
    # the pattern is not vacuous: each form a type name takes in code is found
    assert (
        PATTERN.search("GGMLType.Q5_1")
        and PATTERN.search("pi_matmul_q5_1")
        and PATTERN.search("PI_TYPE_Q4_K")
    )
    assert PATTERN.search("'Q4_K_M'") and PATTERN.search("block_iq4_nl") and not PATTERN.search("q4_10")
    assert not PATTERN.search("F16") and not PATTERN.search("bf16_to_fp32")
    # comments and docstrings count as code does
    assert hits_in("x = 1  # measured on a Q4_0 file\n", "powerinfer/x.py") == [
        "powerinfer/x.py:1: x = 1  # measured on a Q4_0 file"
    ]
    assert hits_in('"""SmolLM2-135M-Instruct.Q4_1.gguf"""', "powerinfer/sparsify/default.py") == []
    assert len(hits_in("/* SmolLM2 Q4_1 decode */", "kernels/cpu/matmul.h")) == 1
