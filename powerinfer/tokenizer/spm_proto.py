"""A minimal protobuf writer for sentencepiece's ModelProto, so a SentencePieceProcessor can be built from a GGUF
vocabulary without a protobuf dependency (field numbers from sentencepiece_model.proto)."""

from __future__ import annotations

import struct
from collections.abc import Sequence


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32 values are written as 10-byte two's complement varints
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _pb_int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(int(value))


def _pb_float(field: int, value: float) -> bytes:
    return _varint(field << 3 | 5) + struct.pack("<f", float(value))


def _pb_bytes(field: int, value: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(value)) + value


def spm_model_proto(
    pieces: Sequence[tuple[str, float, int]],
    *,
    byte_fallback: bool,
    unk_id: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
) -> bytes:
    """ModelProto{pieces=1 {piece=1, score=2, type=3}, trainer_spec=2, normalizer_spec=3}."""
    out = bytearray()
    for text, score, ptype in pieces:
        body = _pb_bytes(1, text.encode("utf-8")) + _pb_float(2, score) + _pb_int(3, ptype)
        out += _pb_bytes(1, body)
    trainer = (
        _pb_int(3, 2)  # model_type = BPE
        + _pb_int(4, len(pieces))  # vocab_size
        + _pb_int(35, int(byte_fallback))
        + _pb_int(40, unk_id)
        + _pb_int(41, bos_id)
        + _pb_int(42, eos_id)
        + _pb_int(43, pad_id)
    )
    normalizer = (
        _pb_bytes(1, b"identity")
        + _pb_int(3, 0)  # add_dummy_prefix: done by us, per fragment (llama.cpp rule)
        + _pb_int(4, 0)  # remove_extra_whitespaces
        + _pb_int(5, 1)  # escape_whitespaces
    )
    out += _pb_bytes(2, trainer) + _pb_bytes(3, normalizer)
    return bytes(out)
