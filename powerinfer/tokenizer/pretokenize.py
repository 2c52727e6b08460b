"""llama.cpp's BPE pre-tokenizer regex sequences (per `tokenizer.ggml.pre`) and the GPT-2 byte-level alphabet.

Each regex of a sequence splits every piece produced by the previous one; matches and the text between them both
become pieces (tokenizers' Split behaviour "isolated"). Non-ASCII character classes are written as code-point
escapes so that no editor or Unicode normalisation can alter them.
"""

from __future__ import annotations

from collections.abc import Sequence

RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS_CI = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_RE_LLAMA3 = (
    _CONTRACTIONS_CI
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = (
    _CONTRACTIONS_CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _char_class(ranges: Sequence[tuple[int, int]]) -> str:
    """A regex character class from code-point ranges, written with escapes (no literal characters that a text
    editor or Unicode normalisation could alter)."""

    def esc(cp: int) -> str:
        return chr(cp) if chr(cp).isalnum() and cp < 0x80 else f"\\x{{{cp:X}}}"

    return "[" + "".join(esc(a) if a == b else f"{esc(a)}-{esc(b)}" for a, b in ranges) + "]"


_CJK_HANGUL = _char_class([(0x4E00, 0x9FA5), (0x0800, 0x4E00), (0xAC00, 0xD7FF)]) + "+"
# DeepSeek LLM's letter class (upper/lower/title-case letters), as code-point ranges
_DEEPSEEK_LLM_LETTERS = (
    r"\s?"
    + _char_class(
        [
            (0x41, 0x5A),
            (0x61, 0x7A),
            (0xB5, 0xB5),
            (0xC0, 0xD6),
            (0xD8, 0xF6),
            (0xF8, 0x1BA),
            (0x1BC, 0x1BF),
            (0x1C4, 0x293),
            (0x295, 0x2AF),
            (0x370, 0x373),
            (0x376, 0x377),
            (0x37B, 0x37D),
            (0x37F, 0x37F),
            (0x386, 0x386),
            (0x388, 0x38A),
            (0x38C, 0x38C),
            (0x38E, 0x3A1),
            (0x3A3, 0x3F5),
            (0x3F7, 0x481),
            (0x48A, 0x52F),
            (0x531, 0x556),
            (0x10A0, 0x10C5),
            (0x13A0, 0x13F5),
            (0x13F8, 0x13FD),
            (0x1C90, 0x1CBA),
            (0x1CBD, 0x1CBF),
            (0x1D00, 0x1D2B),
            (0x1D6B, 0x1D77),
            (0x1D79, 0x1D9A),
            (0x1E00, 0x1F15),
            (0x1F18, 0x1F1D),
            (0x1F20, 0x1F45),
            (0x1F48, 0x1F4D),
            (0x1F50, 0x1F57),
            (0x1F59, 0x1F59),
            (0x1F5B, 0x1F5B),
            (0x1F5D, 0x1F5D),
            (0x1F5F, 0x1F7D),
            (0x1F80, 0x1FB4),
            (0x1FB6, 0x1FBC),
            (0x1FBE, 0x1FBE),
            (0x1FC2, 0x1FC4),
            (0x1FC6, 0x1FCC),
            (0x1FD0, 0x1FD3),
            (0x1FD6, 0x1FDB),
            (0x1FE0, 0x1FEC),
            (0x1FF2, 0x1FF4),
            (0x1FF6, 0x1FFC),
            (0x2102, 0x2102),
            (0x2107, 0x2107),
            (0x210A, 0x2113),
            (0x2115, 0x2115),
            (0x2119, 0x211D),
            (0x2124, 0x2124),
            (0x2126, 0x2126),
            (0x2128, 0x2128),
            (0x212A, 0x212D),
            (0x212F, 0x2134),
            (0x2139, 0x2139),
            (0x213C, 0x213F),
            (0x2145, 0x2149),
            (0x214E, 0x214E),
            (0x2183, 0x2184),
            (0x2C00, 0x2C7B),
            (0x2C7E, 0x2CE4),
            (0x2CEB, 0x2CEE),
            (0x2CF2, 0x2CF3),
            (0xA640, 0xA66D),
            (0xA680, 0xA69B),
            (0xA722, 0xA76F),
            (0xA771, 0xA787),
            (0xA78B, 0xA78E),
            (0xAB70, 0xABBF),
            (0xFB00, 0xFB06),
            (0xFB13, 0xFB17),
            (0xFF21, 0xFF3A),
            (0xFF41, 0xFF5A),
            (0x10400, 0x1044F),
            (0x104B0, 0x104D3),
            (0x104D8, 0x104FB),
            (0x10C80, 0x10CB2),
            (0x10CC0, 0x10CF2),
            (0x118A0, 0x118DF),
            (0x1E900, 0x1E943),
        ]
    )
    + "+"
)
_DEEPSEEK_LLM_PUNCT = (
    r"\s?"
    + _char_class(
        [
            (0x21, 0x2F),
            (0x3A, 0x7E),
            (0xFF01, 0xFF0F),
            (0xFF1A, 0xFF5E),
            (0x2018, 0x201F),
            (0x3000, 0x3002),
        ]
    )
    + "+"
)


PRE_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", RE_GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "gpt2": (RE_GPT2,),
    "llama3": (_RE_LLAMA3,),
    "qwen2": (_RE_QWEN2,),
    "starcoder": (r"\p{N}", RE_GPT2),  # also refact, smollm, command-r, codeshell, exaone, minerva
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", RE_GPT2, "[0-9][0-9][0-9]"),
    "deepseek-llm": (
        "[\r\n]",
        _DEEPSEEK_LLM_LETTERS,
        _DEEPSEEK_LLM_PUNCT,
        r"\s+$",
        _CJK_HANGUL,
        r"\p{N}+",
    ),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"),
}
# `tokenizer.ggml.pre` value -> (regex family, ignore_merges, default add_bos)
PRE_TYPES: dict[str, tuple[str, bool, bool]] = {
    "default": ("default", False, False),
    **{
        n: ("gpt2", False, False)
        for n in (
            "gpt2",
            "gpt-2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "jina-es",
            "jina-de",
            "jina-v2-es",
            "jina-v2-de",
            "roberta-bpe",
            "exaone4",
            "trillion",
        )
    },
    **{n: ("llama3", True, True) for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    **{n: ("llama3", False, False) for n in ("dbrx", "smaug-bpe")},
    **{n: ("qwen2", False, False) for n in ("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez", "hunyuan")},
    **{
        n: ("starcoder", False, False)
        for n in ("starcoder", "refact", "smollm", "command-r", "codeshell", "exaone", "minerva-7b")
    },
    "falcon": ("falcon", False, False),
    "deepseek-llm": ("deepseek-llm", False, False),
    "deepseek-coder": ("deepseek-coder", False, False),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable Latin-1 bytes stand for themselves, the rest are shifted past 255."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def byte_token_text(b: int) -> str:
    return f"<0x{b:02X}>"
