"""Issue 33: what the engine knows about each block type lives in one registry per language. A quantized type's name
(Q5_1, Q4_K_M, IQ4_NL, ...) appears in code only in the registry and format files listed here, so a new block type
is a row in powerinfer/quant/types.py, its C format files and kernels, its Triton decoder, and their tests.

Code means identifiers and string literals (Python) or everything outside comments (C); comments and docstrings may
name the types a measurement was taken on. The float types (F32, F16, BF16) are element types the whole engine
stores and computes in (norms, activations, the safetensors dtypes), not block formats: they are not checked."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from powerinfer.gguf.constants import QUANT_SIZES
from powerinfer.quant.types import FILE_TYPES, TYPES

ROOT = Path(__file__).resolve().parents[1]

# the registry files: Python's type table, llama.cpp's per-tensor mix recipes, the Triton block decoders
PY_ALLOWED = {"powerinfer/quant/types.py", "powerinfer/quant/mix.py", "powerinfer/ops/triton_quant.py"}
# the bundled model's file name is a name, not a type fact
PY_LITERALS_ALLOWED = {("powerinfer/sparsify/default.py", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# the C format files: type ids and block layouts, decoders, quantizers, the per-ISA kernels each type registers in
# the traits tables, and those tables
C_ALLOWED = {
    "quants.h",
    "quants_x86.h",
    "kquants.h",
    "kquants_x86.h",
    "quantize_k.c",
    "matmul_types.h",
    "matmul_x86.h",
    "matmul_q8k_types.h",
    "matmul_q8k_x86.h",
}


def _names() -> list[str]:
    quantized = {t.name for t in TYPES if QUANT_SIZES[t][0] > 1} | {"Q8_1", "Q8_K"}
    quantized |= {ft.name for ft in FILE_TYPES if ft.ggml_type is not None and ft.ggml_type.name in quantized}
    return sorted(quantized, key=len, reverse=True)


PATTERN = re.compile(rf"(?<![A-Za-z0-9])({'|'.join(_names())})(?![A-Za-z0-9])", re.IGNORECASE)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are statements of their own (docstrings, string comments)"""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    }


def python_hits(path: Path, rel: str) -> list[str]:
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    hits = []
    for node in ast.walk(tree):
        words = []
        if isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words.append(node.name)
        elif isinstance(node, ast.arg):
            words.append(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            words.append(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if (rel, node.value) not in PY_LITERALS_ALLOWED:
                words.append(node.value)
        hits += [f"{rel}:{getattr(node, 'lineno', '?')}: {w!r}" for w in words if PATTERN.search(w)]
    return hits


def c_hits(path: Path, rel: str) -> list[str]:
    text = path.read_text()
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return [
        f"{rel}:{i}: {line.strip()}" for i, line in enumerate(text.split("\n"), 1) if PATTERN.search(line)
    ]


def test_type_names_only_in_the_registries():
    hits = []
    for path in sorted((ROOT / "powerinfer").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in PY_ALLOWED:
            hits += python_hits(path, rel)
    for path in sorted((ROOT / "kernels" / "cpu").glob("*.[ch]")):
        if path.name not in C_ALLOWED:
            hits += c_hits(path, f"kernels/cpu/{path.name}")
    assert not hits, "type names outside the registry files:\n" + "\n".join(hits)


def test_the_check_sees_a_type_name():
    # the pattern is not vacuous: each form a type name takes in code is found
    assert (
        PATTERN.search("GGMLType.Q5_1")
        and PATTERN.search("pi_matmul_q5_1")
        and PATTERN.search("PI_TYPE_Q4_K")
    )
    assert PATTERN.search("'Q4_K_M'") and PATTERN.search("block_iq4_nl") and not PATTERN.search("q4_10")
    assert not PATTERN.search("F16") and not PATTERN.search("bf16_to_fp32")
