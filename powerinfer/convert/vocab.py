"""Tokenizer metadata of a HF folder: SentencePiece (tokenizer.model) or GPT-2 BPE (tokenizer.json)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from powerinfer.errors import ConfigError, FormatError
from powerinfer.gguf.constants import Keys, ValueType
from powerinfer.printable import printable

log = logging.getLogger(__name__)

# llama.cpp token types
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
SEP_ID_KEY = "tokenizer.ggml.seperator_token_id"  # llama.cpp's spelling
SPECIAL_KEYS = {
    "bos": Keys.TOKENIZER_BOS_ID,
    "eos": Keys.TOKENIZER_EOS_ID,
    "unk": Keys.TOKENIZER_UNK_ID,
    "sep": SEP_ID_KEY,
    "pad": Keys.TOKENIZER_PAD_ID,
}
ADDED_TOKEN_SCORE = -1000.0


@dataclass
class Vocab:
    """A vocabulary ready for GGUF: parallel token, score and type lists plus special-token settings."""

    model: str  # "llama" (SentencePiece) or "gpt2" (byte-level BPE)
    tokens: list[str]
    scores: np.ndarray | None  # float32 (n_vocab,); None for BPE (llama.cpp writes no scores there)
    types: np.ndarray  # int32 (n_vocab,)
    merges: list[str] | None = None
    pre: str | None = None
    special_ids: dict[str, int] = field(default_factory=dict)  # "bos"/"eos"/... -> id, in write order
    add_bos: bool | None = None
    add_eos: bool | None = None
    chat_template: str | None = None

    def pad_to(self, n_vocab: int) -> None:
        """Append placeholder tokens so the vocabulary covers every embedding row."""
        n = len(self.tokens)
        if n > n_vocab:
            raise FormatError(f"the tokenizer has {n} tokens but the embedding only {n_vocab} rows")
        if n < n_vocab:
            log.warning("padding the vocabulary from %d to %d tokens", n, n_vocab)
            self.tokens += [f"[PAD{i}]" for i in range(n, n_vocab)]
            if self.scores is not None:
                self.scores = np.concatenate(
                    [self.scores, np.full(n_vocab - n, ADDED_TOKEN_SCORE, np.float32)]
                )
            self.types = np.concatenate([self.types, np.full(n_vocab - n, TOKEN_USER_DEFINED, np.int32)])

    def add_to(self, writer: Any) -> None:
        """Write the tokenizer keys (llama.cpp's order: model, tokens, scores, types, merges, special ids)."""
        writer.add(Keys.TOKENIZER_MODEL, self.model, ValueType.STRING)
        if self.pre is not None:
            writer.add(Keys.TOKENIZER_PRE, self.pre, ValueType.STRING)
        writer.add(Keys.TOKENIZER_TOKENS, self.tokens, ValueType.ARRAY, ValueType.STRING)
        if self.scores is not None:
            writer.add(
                Keys.TOKENIZER_SCORES, self.scores.astype(np.float32), ValueType.ARRAY, ValueType.FLOAT32
            )
        writer.add(Keys.TOKENIZER_TOKEN_TYPE, self.types.astype(np.int32), ValueType.ARRAY, ValueType.INT32)
        if self.merges is not None:
            writer.add(Keys.TOKENIZER_MERGES, self.merges, ValueType.ARRAY, ValueType.STRING)
        for kind, token_id in self.special_ids.items():
            writer.add(SPECIAL_KEYS[kind], int(token_id), ValueType.UINT32)
        if self.add_bos is not None:
            writer.add(Keys.TOKENIZER_ADD_BOS, self.add_bos, ValueType.BOOL)
        if self.add_eos is not None:
            writer.add(Keys.TOKENIZER_ADD_EOS, self.add_eos, ValueType.BOOL)
        if self.chat_template is not None:
            writer.add(Keys.CHAT_TEMPLATE, self.chat_template, ValueType.STRING)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; FormatError when it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{printable(str(path))}: cannot read JSON: {printable(str(e))}") from None
    except RecursionError:
        raise FormatError(f"{printable(str(path))}: cannot read JSON: nested too deep") from None
    if not isinstance(data, dict):
        raise FormatError(f"{printable(str(path))}: expected a JSON object")
    return data


def load_vocab(hf_dir: Path, config: dict[str, Any]) -> Vocab:
    """The vocabulary of a HF folder: tokenizer.model when present, else a byte-level BPE tokenizer.json."""
    tok_config_path = hf_dir / "tokenizer_config.json"
    tok_config = read_json(tok_config_path) if tok_config_path.is_file() else {}
    if (hf_dir / "tokenizer.model").is_file():
        vocab = _sentencepiece_vocab(hf_dir, config, tok_config)
    elif (hf_dir / "tokenizer.json").is_file():
        vocab = _bpe_vocab(hf_dir, config, tok_config)
    else:
        raise FormatError(f"{printable(str(hf_dir))}: no tokenizer.model or tokenizer.json")
    vocab.chat_template = chat_template(hf_dir, tok_config)
    return vocab


def chat_template(hf_dir: Path, tok_config: dict[str, Any]) -> str | None:
    """The chat template as llama.cpp's converter finds it: chat_template.jinja (transformers' own file since
    4.43) over tokenizer_config.json's chat_template (a string, or named templates: the "default" one)."""
    jinja = hf_dir / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise FormatError(f"{printable(str(jinja))}: cannot read: {printable(str(e))}") from None
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        log.warning(
            "tokenizer_config.json: chat_template is a %s, not a template (or named templates with a default); "
            "the GGUF gets none",
            type(template).__name__,
        )
        return None
    return template


def _config_special_ids(config: dict[str, Any], n_vocab: int) -> dict[str, int]:
    out = {}
    for kind in SPECIAL_KEYS:
        value = config.get(f"{kind}_token_id")
        if isinstance(value, list):  # some configs list several EOS ids; the first is the primary one
            value = value[0] if value else None
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n_vocab:
            out[kind] = value
    return out


def _sentencepiece_vocab(hf_dir: Path, config: dict[str, Any], tok_config: dict[str, Any]) -> Vocab:
    import sentencepiece

    path = hf_dir / "tokenizer.model"
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(path.read_bytes())
    except (OSError, RuntimeError) as e:
        raise FormatError(f"{printable(str(path))}: not a SentencePiece model: {printable(str(e))}") from None
    n = sp.vocab_size()
    tokens, scores, types = [], [], []
    for i in range(n):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(TOKEN_UNKNOWN)
        elif sp.is_control(i):
            types.append(TOKEN_CONTROL)
        elif sp.is_unused(i):
            types.append(TOKEN_UNUSED)
        elif sp.is_byte(i):
            types.append(TOKEN_BYTE)
        else:
            types.append(TOKEN_NORMAL)
    added_path = hf_dir / "added_tokens.json"
    if added_path.is_file():
        added = read_json(added_path)
        for text, token_id in sorted(added.items(), key=lambda kv: kv[1]):
            if token_id < n:
                continue
            if token_id != len(tokens):
                raise FormatError(
                    f"{printable(str(added_path))}: added token ids are not contiguous after {len(tokens) - 1}"
                )
            tokens.append(text)
            scores.append(ADDED_TOKEN_SCORE)
            types.append(TOKEN_USER_DEFINED)
    special = _config_special_ids(config, len(tokens))
    # fall back to the model's own ids; the original converter reads these from config.json only
    for kind, token_id in (("bos", sp.bos_id()), ("eos", sp.eos_id())):
        if kind not in special and token_id >= 0:
            special[kind] = token_id
    special = {k: special[k] for k in SPECIAL_KEYS if k in special}
    # llama.cpp adds BOS and no EOS for SentencePiece by default: write the flags only when they differ
    add_bos = tok_config.get("add_bos_token")
    add_eos = tok_config.get("add_eos_token")
    return Vocab(
        model="llama",
        tokens=tokens,
        scores=np.asarray(scores, np.float32),
        types=np.asarray(types, np.int32),
        special_ids=special,
        add_bos=add_bos if add_bos is False else None,
        add_eos=add_eos if add_eos is True else None,
    )


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _guess_pre(tokenizer: dict[str, Any]) -> str:
    """llama.cpp's pre-tokenizer name, guessed from tokenizer.json's split regexes (best effort)."""
    text = json.dumps(tokenizer.get("pre_tokenizer") or {})
    if "\\\\p{N}{1,3}" in text:
        return "llama-bpe"
    if "[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+" in text:
        return "qwen2"
    return "gpt2" if "ByteLevel" in text else "default"


def _bpe_vocab(hf_dir: Path, config: dict[str, Any], tok_config: dict[str, Any]) -> Vocab:
    path = hf_dir / "tokenizer.json"
    tokenizer = read_json(path)
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ConfigError(
            f"{printable(str(path))}: unsupported tokenizer model {printable(model.get('type'))} (expected BPE)"
        )
    if "ByteLevel" not in json.dumps(tokenizer.get("pre_tokenizer") or tokenizer.get("decoder") or {}):
        raise ConfigError(
            f"{path}: not a byte-level BPE tokenizer; a SentencePiece tokenizer.model is needed"
        )
    by_id: dict[int, tuple[str, int]] = {int(i): (t, TOKEN_NORMAL) for t, i in model["vocab"].items()}
    for added in tokenizer.get("added_tokens") or []:
        by_id[int(added["id"])] = (
            added["content"],
            TOKEN_CONTROL if added.get("special") else TOKEN_USER_DEFINED,
        )
    n = max(by_id) + 1 if by_id else 0
    tokens = [by_id[i][0] if i in by_id else f"[PAD{i}]" for i in range(n)]
    types = [by_id[i][1] if i in by_id else TOKEN_USER_DEFINED for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    ids = {t: i for i, t in enumerate(tokens)}
    special = {}
    for kind in SPECIAL_KEYS:
        text = _token_text(tok_config.get(f"{kind}_token"))
        if text is not None and text in ids:
            special[kind] = ids[text]
    for kind, token_id in _config_special_ids(config, n).items():
        special.setdefault(kind, token_id)
    special = {k: special[k] for k in SPECIAL_KEYS if k in special}
    add_bos, add_eos = tok_config.get("add_bos_token"), tok_config.get("add_eos_token")
    return Vocab(
        model="gpt2",
        tokens=tokens,
        scores=None,
        types=np.asarray(types, np.int32),
        merges=merges,
        pre=_guess_pre(tokenizer),
        special_ids=special,
        add_bos=add_bos if isinstance(add_bos, bool) else None,
        add_eos=add_eos if isinstance(add_eos, bool) else None,
    )
