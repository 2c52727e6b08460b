"""GGUF vocabularies tokenized the way llama.cpp tokenizes them.

Two vocabulary kinds (`tokenizer.ggml.model`):

* ``"llama"`` -> ``kind == "spm"``: a real ``sentencepiece.SentencePieceProcessor`` built from the GGUF
  tokens/scores/types. The ModelProto is serialised by spm_proto.py's small protobuf wire encoder (no protobuf
  dependency). model_type BPE merges the highest-scoring adjacent pair first, leftmost on ties, which is exactly
  llama.cpp's SPM tokenizer; identity normaliser, whitespace escaped to U+2581, no whitespace collapsing, byte
  fallback when all 256 ``<0xXX>`` tokens exist.
* ``"gpt2"`` -> ``kind == "bpe"``: a Hugging Face ``tokenizers.Tokenizer`` (models.BPE over the GGUF vocab and
  merges) whose pre-tokenizer is the llama.cpp regex sequence chosen by ``tokenizer.ggml.pre``, followed by the
  GPT-2 byte-to-unicode mapping.

Special tokens are split out of the text by our own partition step, the way llama.cpp does it: every
control / user-defined / unknown token, longest text first, is cut out of the raw-text fragments; with
``parse_special=False`` only user-defined tokens are cut out. Each remaining fragment is tokenized on its own.
For SPM, a fragment that starts the text or follows a special token gets the ``' '`` prefix when
``add_space_prefix`` is on (llama.cpp's ``is_prev_special`` rule). Because of that, the sentencepiece model itself is
built with ``add_dummy_prefix=False`` and with every piece except the unknown and byte pieces typed NORMAL, so that
(like llama.cpp) merges may form any vocabulary entry and no piece is matched specially inside sentencepiece.

Decoding is llama.cpp's ``token_to_piece``: normal tokens give their text (SPM: U+2581 -> space; BPE: byte-level
characters mapped back to bytes), byte tokens their byte, user-defined tokens their literal text, control / unknown /
unused tokens nothing unless ``special=True``.
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

from powerinfer.errors import ConfigError
from powerinfer.gguf.constants import Keys
from powerinfer.printable import printable
from powerinfer.tokenizer.pretokenize import CHAR_TO_BYTE, PRE_REGEXES, PRE_TYPES, byte_token_text
from powerinfer.tokenizer.spm_proto import spm_model_proto

log = logging.getLogger(__name__)

# GGUF token types (llama.cpp LLAMA_TOKEN_TYPE_*)
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6

_SPACE_MARK = "\u2581"  # SentencePiece's visible space
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")

# keys not (yet) in gguf/constants.Keys
_KEY_EOM_ID = "tokenizer.ggml.eom_token_id"
_KEY_FIM_PAD_ID = "tokenizer.ggml.fim_pad_token_id"
_KEY_FIM_REP_ID = "tokenizer.ggml.fim_rep_token_id"
_KEY_FIM_SEP_ID = "tokenizer.ggml.fim_sep_token_id"

# Token texts llama.cpp auto-detects (llama-vocab.cpp, load): end-of-turn candidates, end-of-generation tokens and
# the FIM pad/repo/separator tokens (which llama.cpp also treats as end of generation). Detected tokens that are not
# control-typed become control tokens, as llama.cpp does.
_EOT_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
        "<end_of_utterance>",
    }
)
_EOM_TEXTS = frozenset({"<|eom_id|>"})
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
        "[e~[",
    }
)
_FIM_PAD_TEXTS = frozenset({"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"})
_FIM_REP_TEXTS = frozenset({"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"})
_FIM_SEP_TEXTS = frozenset({"<|file_sep|>"})


# ---------------------------------------------------------------------------------------------------------------
# metadata helpers
# ---------------------------------------------------------------------------------------------------------------
def _get_bool(md: dict[str, Any], key: str, default: bool) -> bool:
    v = md.get(key)
    if v is None:
        return default
    if isinstance(v, (bool, int, np.integer, np.bool_)):
        return bool(v)
    raise ConfigError(f"{key} must be a bool, got {type(v).__name__}")


def _get_int_array(md: dict[str, Any], key: str, n: int) -> np.ndarray | None:
    v = md.get(key)
    if v is None:
        return None
    try:
        arr = np.asarray(v)
    except Exception as e:  # pragma: no cover - defensive
        raise ConfigError(f"{key} is not a numeric array: {printable(str(e))}") from e
    if arr.ndim != 1 or arr.dtype.kind not in "iuf" or len(arr) < n:
        raise ConfigError(
            f"{key} must be a numeric array with at least {n} entries (one per token), "
            f"got shape {arr.shape} dtype {arr.dtype}"
        )
    return arr[:n]


class Tokenizer:
    """A GGUF vocabulary with llama.cpp's tokenization rules. Build it with `Tokenizer.from_metadata`."""

    kind: str  # "spm" or "bpe"
    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eog_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None
    pre: str | None  # the `tokenizer.ggml.pre` value in effect (BPE only)

    def __init__(self) -> None:  # use from_metadata
        self._tokens: list[str] = []
        self._types: np.ndarray = np.zeros(0, dtype=np.int32)
        self._attr_control: np.ndarray = np.zeros(0, dtype=bool)
        self._special_order: list[int] = []
        self._token_to_id: dict[str, int] = {}
        self._piece_cache: list[bytes] = []
        self._sp: Any = None
        self._hf: Any = None

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_metadata(cls, metadata: dict[str, Any], powerinfer_file: bool = False) -> Tokenizer:
        """The tokenizer a GGUF's metadata describes. powerinfer_file: a PowerInfer (PWRI) file; one without
        `tokenizer.ggml.pre` (PowerInfer's converter writes none) is tokenized as PowerInfer does: byte-level BPE
        split with the GPT-2 regex and no BOS in main and perplexity (its loader ignores
        `tokenizer.ggml.add_bos_token` for BPE; README section 8.2 of the Falcon/OPT fixtures)."""
        md = metadata
        model = md.get(Keys.TOKENIZER_MODEL)
        if model is None:
            raise ConfigError(f"{Keys.TOKENIZER_MODEL} is missing: the file carries no tokenizer")
        if not isinstance(model, str) or model not in ("llama", "gpt2"):
            raise ConfigError(
                f"unsupported tokenizer model {Keys.TOKENIZER_MODEL}='{printable(model)}' "
                "(supported: 'llama' (SentencePiece), 'gpt2' (byte-level BPE))"
            )
        tokens = md.get(Keys.TOKENIZER_TOKENS)
        if tokens is None:
            raise ConfigError(f"{Keys.TOKENIZER_TOKENS} is missing: the vocabulary token list is required")
        if not isinstance(tokens, (list, tuple)) or not all(isinstance(t, str) for t in tokens):
            raise ConfigError(f"{Keys.TOKENIZER_TOKENS} must be an array of strings")
        if len(tokens) == 0:
            raise ConfigError(f"{Keys.TOKENIZER_TOKENS} is empty")
        n = len(tokens)
        self = cls()
        self.kind = "spm" if model == "llama" else "bpe"
        self.n_vocab = n
        toks = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        empty = [i for i, t in enumerate(tokens) if not t]
        if empty:  # one line however many: a hostile vocabulary must not flood the terminal
            log.warning("%d empty tokens (first at index %d) renamed [EMPTY_<id>]", len(empty), empty[0])
        self._tokens = toks
        self._token_to_id = {}
        for i, t in enumerate(toks):
            if t in self._token_to_id:
                raise ConfigError(
                    f"duplicate token in {Keys.TOKENIZER_TOKENS}: '{printable(t)}' has ids "
                    f"{self._token_to_id[t]} and {i}"
                )
            self._token_to_id[t] = i

        types = _get_int_array(md, Keys.TOKENIZER_TOKEN_TYPE, n)
        self._types = np.full(n, TT_NORMAL, dtype=np.int32) if types is None else types.astype(np.int32)
        scores = _get_int_array(md, Keys.TOKENIZER_SCORES, n)
        scores_f = np.zeros(n, dtype=np.float32) if scores is None else scores.astype(np.float32)
        self.chat_template = md.get(Keys.CHAT_TEMPLATE)
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ConfigError(
                f"{Keys.CHAT_TEMPLATE} must be a string, got {type(self.chat_template).__name__}"
            )

        # vocab-kind defaults (llama.cpp), then metadata overrides
        if self.kind == "spm":
            bos, eos, unk = 1, 2, 0
            self.add_space_prefix = True
            add_bos_default = True
            self.pre = None
            family, ignore_merges, legacy = "", False, False
        else:
            bos, eos, unk = 11, 11, None  # llama.cpp's BPE defaults
            self.add_space_prefix = False
            pre = md.get(Keys.TOKENIZER_PRE)
            if pre is not None and not isinstance(pre, str):
                raise ConfigError(f"{Keys.TOKENIZER_PRE} must be a string, got {type(pre).__name__}")
            legacy = pre is None and powerinfer_file  # written by PowerInfer's own converter
            if legacy:
                pre = "gpt2"
            if pre is None:
                log.warning(
                    "%s is missing; using the 'default' pre-tokenizer (quality may be degraded)",
                    Keys.TOKENIZER_PRE,
                )
                pre = "default"
            if pre not in PRE_TYPES:
                log.warning(
                    "unknown %s='%s'; falling back to the gpt2 pre-tokenizer",
                    Keys.TOKENIZER_PRE,
                    printable(pre),
                )
                family, ignore_merges, add_bos_default = "gpt2", False, False
            else:
                family, ignore_merges, add_bos_default = PRE_TYPES[pre]
            self.pre = pre
        self.add_space_prefix = _get_bool(md, Keys.TOKENIZER_ADD_SPACE_PREFIX, self.add_space_prefix)
        self.add_bos = _get_bool(md, Keys.TOKENIZER_ADD_BOS, add_bos_default)
        if self.kind == "bpe" and legacy:
            self.add_bos = False
        self.add_eos = _get_bool(md, Keys.TOKENIZER_ADD_EOS, False)

        def special_id(key: str, default: int | None) -> int | None:
            if default is not None and not 0 <= default < n:
                default = None
            v = md.get(key)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ConfigError(f"{key} must be an integer token id, got {printable(v)}")
            v = int(v)
            if not 0 <= v < n:
                log.warning("bad special token %s=%d (vocab size %d), using default %s", key, v, n, default)
                return default
            return v

        self.bos_id = special_id(Keys.TOKENIZER_BOS_ID, bos)
        self.eos_id = special_id(Keys.TOKENIZER_EOS_ID, eos)
        self.unk_id = special_id(Keys.TOKENIZER_UNK_ID, unk)
        pad_id = special_id(Keys.TOKENIZER_PAD_ID, None)
        if self.add_bos and self.bos_id is None:
            raise ConfigError(f"{Keys.TOKENIZER_ADD_BOS} is true but {Keys.TOKENIZER_BOS_ID} is not set")
        if self.add_eos and self.eos_id is None:
            raise ConfigError(f"{Keys.TOKENIZER_ADD_EOS} is true but {Keys.TOKENIZER_EOS_ID} is not set")

        # control attribute (GGUF type 3) plus llama.cpp's text-based auto-detection
        control = self._types == TT_CONTROL

        def detect(key: str, texts: frozenset[str]) -> int | None:
            found = special_id(key, None)
            if found is not None:
                return found
            for tid in sorted(self._token_to_id[t] for t in texts if t in self._token_to_id):
                control[tid] = True
                return tid  # llama.cpp takes the first hit of a hash-map walk; we take the lowest id
            return None

        self.eot_id = detect(Keys.TOKENIZER_EOT_ID, _EOT_TEXTS)
        eom_id = detect(_KEY_EOM_ID, _EOM_TEXTS)
        eog = {
            t
            for t in (
                detect(_KEY_FIM_PAD_ID, _FIM_PAD_TEXTS),
                detect(_KEY_FIM_REP_ID, _FIM_REP_TEXTS),
                detect(_KEY_FIM_SEP_ID, _FIM_SEP_TEXTS),
            )
            if t is not None
        }
        for t in _EOG_TEXTS:
            tid = self._token_to_id.get(t)
            if tid is not None:
                eog.add(tid)
                control[tid] = True
        eog.update(t for t in (self.eos_id, self.eot_id, eom_id) if t is not None)
        self.eog_ids = frozenset(eog)
        self._attr_control = control

        # special-token partition order: control, user-defined and unknown tokens, longest text first
        special = np.nonzero(control | (self._types == TT_USER_DEFINED) | (self._types == TT_UNKNOWN))[0]
        self._special_order = sorted((int(i) for i in special), key=lambda i: (-len(toks[i].encode()), i))

        self._piece_cache = [self._compute_piece(i) for i in range(n)]
        if self.kind == "spm":
            self._sp = self._build_spm(scores_f, pad_id)
        else:
            self._hf = self._build_bpe(md, family, ignore_merges)
        return self

    def _build_spm(self, scores: np.ndarray, pad_id: int | None) -> Any:
        import sentencepiece as spm

        n = self.n_vocab
        has_bytes = all(byte_token_text(b) in self._token_to_id for b in range(256))
        byte_ids = {self._token_to_id[byte_token_text(b)] for b in range(256)} if has_bytes else set()
        unk_candidates = [i for i in range(n) if self._types[i] == TT_UNKNOWN]
        unk = unk_candidates[0] if unk_candidates else (self.unk_id if self.unk_id is not None else 0)
        pieces = []
        for i in range(n):
            ptype = 2 if i == unk else 6 if i in byte_ids else 1  # UNKNOWN / BYTE / NORMAL
            pieces.append((self._tokens[i], float(scores[i]), ptype))
        proto = spm_model_proto(
            pieces,
            byte_fallback=has_bytes,
            unk_id=unk,
            bos_id=-1 if self.bos_id is None or self.bos_id == unk else self.bos_id,
            eos_id=-1 if self.eos_id is None or self.eos_id in (unk, self.bos_id) else self.eos_id,
            pad_id=-1 if pad_id is None or pad_id in (unk, self.bos_id, self.eos_id) else pad_id,
        )
        try:
            sp = spm.SentencePieceProcessor(model_proto=proto)
        except Exception as e:
            raise ConfigError(
                f"cannot build a SentencePiece model from the GGUF vocabulary: {printable(str(e))}"
            ) from e
        return sp

    def _build_bpe(self, md: dict[str, Any], family: str, ignore_merges: bool) -> Any:
        from tokenizers import Regex, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        merges_raw = md.get(Keys.TOKENIZER_MERGES)
        if merges_raw is None:
            raise ConfigError(f"{Keys.TOKENIZER_MERGES} is missing: a gpt2 (BPE) vocabulary needs its merges")
        if not isinstance(merges_raw, (list, tuple)) or not all(isinstance(m, str) for m in merges_raw):
            raise ConfigError(f"{Keys.TOKENIZER_MERGES} must be an array of strings")
        vocab = self._token_to_id
        merges: list[tuple[str, str]] = []
        dropped = 0
        for m in merges_raw:
            pos = m.find(" ", 1)
            if pos < 0:
                dropped += 1
                continue
            a, b = m[:pos], m[pos + 1 :]
            if a in vocab and b in vocab and a + b in vocab:
                merges.append((a, b))
            else:
                dropped += 1
        if dropped:
            log.warning(
                "%d of %d BPE merges ignored (malformed or producing tokens not in the vocabulary)",
                dropped,
                len(merges_raw),
            )
        bpe = models.BPE(vocab=dict(vocab), merges=merges, ignore_merges=ignore_merges)
        tok = HFTokenizer(bpe)
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_REGEXES[family]]
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        return tok

    # ---------------------------------------------------------------- per-token queries
    def _compute_piece(self, i: int) -> bytes:
        t, ty = self._tokens[i], int(self._types[i])
        if self._attr_control[i] or ty in (TT_UNKNOWN, TT_UNUSED):
            return b""
        if ty == TT_USER_DEFINED:
            return t.encode("utf-8")
        if ty == TT_BYTE and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            digits = t[3:5]
            if not all(c in _HEX_DIGITS for c in digits):
                raise ConfigError(f"byte token {i} has malformed text '{printable(t)}' (expected <0xNN>)")
            return bytes([int(digits, 16)])
        if self.kind == "spm":
            if ty != TT_NORMAL:
                return b""
            return t.replace(_SPACE_MARK, " ").encode("utf-8")
        # byte-level BPE; a character outside the GPT-2 alphabet is kept as its UTF-8 bytes
        return b"".join(bytes([CHAR_TO_BYTE[c]]) if c in CHAR_TO_BYTE else c.encode("utf-8") for c in t)

    def token_text(self, token_id: int) -> str:
        """The raw vocabulary string of a token (e.g. '▁the', 'Ġthe', '<|im_end|>')."""
        return self._tokens[token_id]

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """The exact bytes a token stands for; control/unknown/unused tokens give b'' unless `special`."""
        if not 0 <= token_id < self.n_vocab:
            raise IndexError(f"token id {token_id} out of range (vocab size {self.n_vocab})")
        piece = self._piece_cache[token_id]
        if special and not piece and self._is_special_text(token_id):
            return self._tokens[token_id].encode("utf-8")
        return piece

    def _is_special_text(self, token_id: int) -> bool:
        return bool(self._attr_control[token_id]) or int(self._types[token_id]) in (TT_UNKNOWN, TT_UNUSED)

    def is_control(self, token_id: int) -> bool:
        return bool(self._attr_control[token_id])

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def token_id(self, text: str) -> int | None:
        """The id of the token whose vocabulary string is exactly `text`, or None."""
        return self._token_to_id.get(text)

    # ---------------------------------------------------------------- encode
    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        frags: list[str | int] = [text]
        for tid in self._special_order:
            if not parse_special and int(self._types[tid]) != TT_USER_DEFINED:
                continue  # with parse_special off only user-defined tokens are split out (llama.cpp)
            t = self._tokens[tid]
            if not any(isinstance(f, str) and t in f for f in frags):
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or t not in f:
                    out.append(f)
                    continue
                parts = f.split(t)
                for k, p in enumerate(parts):
                    if k:
                        out.append(tid)
                    if p:
                        out.append(p)
            frags = out
        return frags

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True, add_eos: bool = False
    ) -> list[int]:
        """Token ids of `text` as llama.cpp's llama_tokenize gives them.

        add_bos: None -> the vocabulary default (`tokenizer.ggml.add_bos_token`; SPM True, BPE False unless the
        pre-tokenizer is llama3-like). parse_special: control/unknown token texts in `text` map to their ids
        (user-defined tokens always do). add_eos: append eos (llama.cpp does when add_special and the vocabulary
        says add_eos_token; see the `add_eos` attribute).
        """
        if add_bos is None:
            add_bos = self.add_bos
        out: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise ConfigError("add_bos requested but the vocabulary has no BOS token")
            out.append(self.bos_id)
        frags = self._partition(text, parse_special) if text else []
        prev_special = True
        for f in frags:
            if isinstance(f, int):
                out.append(f)
                prev_special = True
                continue
            if self.kind == "spm":
                if self.add_space_prefix and prev_special:
                    f = " " + f
                out.extend(self._sp.EncodeAsIds(f))
            else:
                out.extend(self._hf.encode(f, add_special_tokens=False).ids)
            prev_special = False
        if add_eos:
            if self.eos_id is None:
                raise ConfigError("add_eos requested but the vocabulary has no EOS token")
            out.append(self.eos_id)
        return out

    # ---------------------------------------------------------------- decode
    def decode(self, ids: Iterable[int], special: bool = False, strip_leading_space: bool = True) -> str:
        """Concatenated token pieces as text (invalid UTF-8 becomes U+FFFD).

        For an SPM vocabulary with add_space_prefix on and `strip_leading_space`, one leading space is removed from
        the first token that produces text (after any leading BOS/control tokens): the space the tokenizer prefixed,
        so decode(encode(s)) == s. llama.cpp's llama_detokenize strips it the same way. Streaming generated text
        (StreamDecoder) keeps it. special: render control/unknown tokens as their text.
        """
        strip = strip_leading_space and self.kind == "spm" and self.add_space_prefix
        buf = bytearray()
        for tid in ids:
            piece = self.token_bytes(int(tid), special)
            if strip and piece:
                if piece.startswith(b" "):
                    piece = piece[1:]
                strip = False
            buf += piece
        return buf.decode("utf-8", errors="replace")

    def stream_decoder(self, special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, special=special)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(kind={self.kind!r}, n_vocab={self.n_vocab}, pre={self.pre!r}, bos={self.bos_id}, "
            f"eos={self.eos_id}, eot={self.eot_id}, add_bos={self.add_bos})"
        )


class StreamDecoder:
    """Token-by-token text: `feed` returns only complete UTF-8 characters, holding back a partial multi-byte
    sequence until the byte(s) completing it arrive; bytes that can never form a valid character become U+FFFD.
    `flush` returns what is held back (an incomplete tail becomes U+FFFD). No leading-space stripping: this is for
    generated tokens, whose leading space is real text."""

    def __init__(self, tokenizer: Tokenizer, special: bool = False) -> None:
        self._tok = tokenizer
        self._special = special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._dec.decode(self._tok.token_bytes(int(token_id), self._special), final=False)

    def flush(self) -> str:
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out
