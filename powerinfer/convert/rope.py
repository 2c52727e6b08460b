"""config.json's RoPE scaling (`rope_scaling`, or transformers 5's `rope_parameters`) into what llama.cpp's
convert_hf_to_gguf.py writes for it: linear and YaRN as `{arch}.rope.scaling.*` keys, Llama 3's scaling as the
`rope_freqs.weight` tensor of per-pair frequency divisors (and no scaling keys)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from powerinfer.convert.common import config_number
from powerinfer.errors import ConfigError
from powerinfer.gguf.constants import Keys, ValueType
from powerinfer.printable import printable

# config.json's YaRN fields -> the keys llama.cpp's converter writes them to
YARN_KEYS = (
    ("extrapolation_factor", Keys.ROPE_SCALING_YARN_EXT_FACTOR),
    ("attention_factor", Keys.ROPE_SCALING_YARN_ATTN_FACTOR),
    ("attn_factor", Keys.ROPE_SCALING_YARN_ATTN_FACTOR),
    ("beta_fast", Keys.ROPE_SCALING_YARN_BETA_FAST),
    ("beta_slow", Keys.ROPE_SCALING_YARN_BETA_SLOW),
)


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's RoPE scaling: kind "default", "linear", "yarn" or "llama3", and its parameters."""

    kind: str = "default"
    params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_config(cls, cfg: dict[str, Any], path: Path) -> RopeScaling:
        """The scaling config.json describes (top-level original_max_position_embeddings folded in, as llama.cpp's
        converter does); ConfigError for a kind llama.cpp's llama graph does not compute (dynamic, LongRoPE)."""
        params = cfg.get("rope_parameters", cfg.get("rope_scaling")) or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{printable(str(path))}: rope_scaling / rope_parameters must be objects")
        params = dict(params)
        if "original_max_position_embeddings" not in params and "original_max_position_embeddings" in cfg:
            params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        if "rope_theta" not in params and cfg.get("rope_theta") is not None:
            params["rope_theta"] = cfg["rope_theta"]
        kind = str(params.get("rope_type", params.get("type")) or "default").lower()
        if kind not in ("default", "linear", "yarn", "llama3"):
            raise ConfigError(f"{printable(str(path))}: unsupported RoPE scaling '{printable(kind)}'")
        if kind != "default":
            config_number(params, path, "factor", float)
        if kind == "yarn":  # transformers' default for the original context: max_position_embeddings
            params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
            config_number(params, path, "original_max_position_embeddings")
            for field, _ in YARN_KEYS:
                config_number(params, path, field, float, default=1.0, positive=False)
        return cls(kind, tuple(params.items()))

    def keys(self, arch: str) -> list[tuple[str, Any, ValueType]]:
        """The metadata (key, value, type) triples llama.cpp's converter writes, in its order."""
        p = dict(self.params)
        if self.kind not in ("linear", "yarn"):
            return []
        out = [
            (Keys.ROPE_SCALING_TYPE, self.kind, ValueType.STRING),
            (Keys.ROPE_SCALING_FACTOR, float(p["factor"]), ValueType.FLOAT32),
        ]
        if self.kind == "yarn":
            out.append(
                (Keys.ROPE_SCALING_ORIG_CTX_LEN, int(p["original_max_position_embeddings"]), ValueType.UINT32)
            )
            written = set()
            for field, key in YARN_KEYS:
                if p.get(field) is not None and key not in written:
                    out.append((key, float(p[field]), ValueType.FLOAT32))
                    written.add(key)
        return [(key.format(arch=arch), value, kind) for key, value, kind in out]

    def freq_factors(self, head_dim: int) -> np.ndarray | None:
        """Llama 3's per-pair frequency divisors (head_dim/2,) float32, as llama.cpp's converter computes them:
        1 for wavelengths below original/high_freq_factor, `factor` above original/low_freq_factor, a smooth
        blend between; None for the other kinds."""
        if self.kind != "llama3":
            return None
        p = dict(self.params)
        base = float(p.get("rope_theta", 10000.0))
        factor = float(p.get("factor", 8.0))
        low_freq_factor = float(p.get("low_freq_factor", 1.0))
        high_freq_factor = float(p.get("high_freq_factor", 4.0))
        old_context = float(p.get("original_max_position_embeddings", 8192))
        freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
        out = []
        for freq in freqs.astype(np.float64):
            wavelen = 2 * math.pi / freq
            if wavelen < old_context / high_freq_factor:
                out.append(1.0)
            elif wavelen > old_context / low_freq_factor:
                out.append(factor)
            else:
                smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
                out.append(1 / ((1 - smooth) / factor + smooth))
        return np.array(out, dtype=np.float32)
