"""GGUF vocabularies tokenized the way llama.cpp tokenizes them (see vocab.py for the rules)."""

from powerinfer.tokenizer.vocab import (
    TT_BYTE,
    TT_CONTROL,
    TT_NORMAL,
    TT_UNKNOWN,
    TT_UNUSED,
    TT_USER_DEFINED,
    StreamDecoder,
    Tokenizer,
)

__all__ = [
    "TT_BYTE",
    "TT_CONTROL",
    "TT_NORMAL",
    "TT_UNKNOWN",
    "TT_UNUSED",
    "TT_USER_DEFINED",
    "StreamDecoder",
    "Tokenizer",
]
