"""The type registry (powerinfer/quant/types.py) against what it describes: the C kernels' type ids and symbols,
the gguf package's block sizes and quantizers, llama.cpp's file-type guess."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from powerinfer.gguf.constants import QUANT_SIZES, GGMLType
from powerinfer.ops import library
from powerinfer.quant import C_QUANTIZABLE, QUANTIZABLE, WEIGHT_TYPES, dequantize, quantize
from powerinfer.quant.types import FILE_TYPES, FTYPE_GUESSED, FTYPES, TYPES, guess_ftype, types_where

QUANTS_H = Path(__file__).resolve().parents[1] / "kernels" / "cpu" / "quants.h"


def test_c_type_ids_are_ggml_numbers():
    enum = dict(re.findall(r"PI_TYPE_(\w+) = (\d+)", QUANTS_H.read_text()))
    enum.pop("COUNT")
    assert {name: int(code) for name, code in enum.items()} == {name: int(GGMLType[name]) for name in enum}
    # every type with a C kernel has its id there, and the fused FFN kernels take the ggml numbers
    assert {t.name for t, row in TYPES.items() if row.c_name is not None} == set(enum)
    assert dict(library.FFN_KINDS) == {t: int(t) for t, row in TYPES.items() if row.sparse_rows}


def test_every_c_name_has_its_symbols():
    lib = library.load()
    if lib is None:
        pytest.skip("kernels not built")
    for t, row in TYPES.items():
        if row.c_name is None:
            continue
        assert t in lib.matmul and t in lib.get_rows, t.name
        if row.sparse_rows:
            assert t in lib.rows_axpy, t.name


def test_rows_describe_block_formats():
    for t, row in TYPES.items():
        assert t in QUANT_SIZES, t.name
        if row.fallback is not None:  # a 256-element type falls back to a 32-element one
            assert QUANT_SIZES[t][0] == 256 and QUANT_SIZES[row.fallback][0] == 32
    assert QUANTIZABLE.isdisjoint(C_QUANTIZABLE)
    assert WEIGHT_TYPES == frozenset(TYPES)


@pytest.mark.parametrize("ggml_type", sorted(types_where(producer="gguf")))
def test_gguf_producer_round_trips(ggml_type):
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    back = dequantize(quantize(x, ggml_type), ggml_type, x.shape)
    # measured: Q4_0's worst element error is ~0.35 of a block's max / 8; every type well inside 0.5
    assert np.abs(back - x).max() < 0.5


def test_file_types_and_names():
    names = [ft.name for ft in FILE_TYPES]
    assert len(names) == len(set(names))
    for ft in FILE_TYPES:
        if ft.ggml_type is not None:
            assert ft.ftype in FTYPES
            assert ft.ggml_type in TYPES


def test_guess_ftype_is_llama_cpps():
    # llama.cpp (llama-model-loader.cpp): the first type to reach the highest count; K types guess the _M mixes
    Q3K, Q4K, F32, Q8 = GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.F32, GGMLType.Q8_0
    assert guess_ftype([F32, Q3K, Q3K]) == 12 | FTYPE_GUESSED  # Q3_K_M, not Q3_K_S
    assert guess_ftype([Q4K]) == 15 | FTYPE_GUESSED
    assert guess_ftype([Q8, F32, F32, Q8]) == 0 | FTYPE_GUESSED  # F32 reached 2 first
    assert guess_ftype([]) == 0 | FTYPE_GUESSED
    assert guess_ftype([GGMLType.I32]) == 0 | FTYPE_GUESSED  # unknown: ALL_F32
