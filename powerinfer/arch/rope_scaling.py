"""RoPE scaling as llama.cpp reads and applies it: the file's `{arch}.rope.*` keys, the `rope_freqs.weight`
frequency factors (Llama 3's scaling), and the command line's overrides of both.

The overrides reach every architecture through one place: `effective_metadata` lays them over the file's keys
(llama.cpp's context parameters take precedence over the model's hyperparameters the same way) and adds the
frequency factors, and each architecture's config reads the result with `rope_spec`.

Differences from llama.cpp, on purpose: the YaRN keys `rope.scaling.yarn_{ext_factor,attn_factor,beta_fast,
beta_slow}` that llama.cpp's converter writes are read for every architecture (llama.cpp reads them for a few only
and uses its defaults for Llama); `yarn_attn_factor` multiplies YaRN's magnitude 0.1 ln(factor) + 1 (llama.cpp
before PR 17945 did the same; since then it ignores the value while ext_factor != 0). With the defaults both
agree: cos and sin are scaled by 0.1 ln(factor) + 1 (times `rope.scaling.attn_factor`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from powerinfer.arch.metadata import MetadataView
from powerinfer.errors import ConfigError, FormatError, InputError
from powerinfer.gguf.constants import GGMLType, Keys, TensorNames
from powerinfer.model.specs import RopeSpec
from powerinfer.printable import printable

if TYPE_CHECKING:
    from powerinfer.gguf.reader import GGUFFile

SCALING_TYPES = ("none", "linear", "yarn")
# the values of rope_freqs.weight, carried in the metadata the configs read (never written to a file)
FREQ_FACTORS_KEY = "powerinfer.rope.freq_factors"
# llama.cpp's defaults (llama_hparams) for what the file and the command line leave unset
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0


@dataclass(frozen=True)
class RopeOverrides:
    """The command line's RoPE options (llama.cpp's names); None or a negative YaRN value: the file's."""

    scaling: str | None = None  # --rope-scaling none|linear|yarn
    freq_base: float | None = None  # --rope-freq-base
    freq_scale: float | None = None  # --rope-freq-scale, or 1 / --rope-scale
    yarn_orig_ctx: int = 0  # --yarn-orig-ctx (0: the file's)
    yarn_ext_factor: float = -1.0
    yarn_attn_factor: float = -1.0
    yarn_beta_fast: float = -1.0
    yarn_beta_slow: float = -1.0

    def __post_init__(self) -> None:
        if self.scaling is not None and self.scaling not in SCALING_TYPES:
            raise InputError(
                f"--rope-scaling must be one of {', '.join(SCALING_TYPES)} (got {printable(self.scaling)})"
            )
        for option, value in (
            ("--rope-freq-base", self.freq_base),
            ("--rope-freq-scale (or 1 / --rope-scale)", self.freq_scale),
        ):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise InputError(f"{option} must be a positive number, got {value}")
        for option, value in (
            ("--yarn-ext-factor", self.yarn_ext_factor),
            ("--yarn-attn-factor", self.yarn_attn_factor),
            ("--yarn-beta-fast", self.yarn_beta_fast),
            ("--yarn-beta-slow", self.yarn_beta_slow),
        ):
            if not math.isfinite(value):
                raise InputError(f"{option} must be a finite number, got {value}")
        if self.yarn_orig_ctx < 0:
            raise InputError(f"--yarn-orig-ctx must be >= 0 (0 = the model's), got {self.yarn_orig_ctx}")

    def keys(self) -> dict[str, Any]:
        """The file keys (templates with {arch}) these overrides replace, with their values."""
        out: dict[str, Any] = {}
        if self.scaling is not None:
            out[Keys.ROPE_SCALING_TYPE] = self.scaling
        if self.freq_base is not None:
            out[Keys.ROPE_FREQ_BASE] = self.freq_base
        if self.freq_scale is not None:
            out[Keys.ROPE_SCALING_FACTOR] = 1.0 / self.freq_scale
        if self.yarn_orig_ctx > 0:
            out[Keys.ROPE_SCALING_ORIG_CTX_LEN] = self.yarn_orig_ctx
        for key, value in (
            (Keys.ROPE_SCALING_YARN_EXT_FACTOR, self.yarn_ext_factor),
            (Keys.ROPE_SCALING_YARN_ATTN_FACTOR, self.yarn_attn_factor),
            (Keys.ROPE_SCALING_YARN_BETA_FAST, self.yarn_beta_fast),
            (Keys.ROPE_SCALING_YARN_BETA_SLOW, self.yarn_beta_slow),
        ):
            if value >= 0:
                out[key] = value
        return out


def freq_factors(gguf: GGUFFile) -> tuple[float, ...] | None:
    """The values of rope_freqs.weight (F32 or F16), each finite and positive; None when the file has none."""
    info = gguf.tensors.get(TensorNames.ROPE_FREQS)
    if info is None:
        return None
    dtypes = {GGMLType.F32: np.float32, GGMLType.F16: np.float16}
    if info.ggml_type not in dtypes or len(info.shape) != 1:
        raise FormatError(f"{gguf.path}: '{TensorNames.ROPE_FREQS}' must be a 1-d F32 or F16 tensor")
    values = info.data.view(dtypes[info.ggml_type]).astype(np.float64)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise FormatError(
            f"{gguf.path}: '{TensorNames.ROPE_FREQS}' holds a value that is not finite and positive"
        )
    return tuple(float(v) for v in values)


def effective_metadata(gguf: GGUFFile, overrides: RopeOverrides | None = None) -> dict[str, Any]:
    """The file's metadata with the command line's RoPE overrides laid over it and its frequency factors added
    (the metadata itself when there is neither)."""
    factors = freq_factors(gguf)
    if factors is None and (overrides is None or not overrides.keys()):
        return gguf.metadata
    arch = gguf.metadata.get(Keys.ARCHITECTURE)
    out = dict(gguf.metadata)
    if factors is not None:
        out[FREQ_FACTORS_KEY] = factors
    if overrides is not None and isinstance(arch, str):
        scaling = overrides.scaling or out.get(Keys.ROPE_SCALING_TYPE.format(arch=arch), "linear")
        if overrides.freq_scale is not None and scaling == "none":
            raise InputError(
                "--rope-scale / --rope-freq-scale do nothing with RoPE scaling type none (the model's or "
                "--rope-scaling's): use --rope-scaling linear or yarn"
            )
        out |= {key.format(arch=arch): value for key, value in overrides.keys().items()}
    return out


def yarn_mscale(factor: float) -> float:
    """YaRN's magnitude for a context `factor` times longer: 0.1 ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1.0 else 0.1 * math.log(factor) + 1.0


def rope_spec(
    m: MetadataView, kind: str, head_dim: int, n_rot: int | None = None, default_base: float = 10000.0
) -> RopeSpec:
    """RoPE of `kind` over n_rot dimensions (default: rope.dimension_count, which must then be the head size)
    with the file's base and scaling, resolved as llama.cpp resolves them: no scaling type means linear with the
    file's factor (1 without one); `none` never scales; YaRN's ext_factor defaults to 1 for `yarn` and 0 else."""
    if n_rot is None:
        n_rot = m.optional(Keys.ROPE_DIMENSION_COUNT, head_dim)
        if n_rot != head_dim:
            raise ConfigError(f"rope dimension {n_rot} != head size {head_dim} (partial RoPE unsupported)")
    base = m.optional(Keys.ROPE_FREQ_BASE, default_base, float)
    if base <= 0:
        raise ConfigError(f"rope frequency base must be positive (got {base})")
    scaling = m.optional(Keys.ROPE_SCALING_TYPE, "linear", str)
    if scaling not in SCALING_TYPES:
        raise ConfigError(f"unsupported rope scaling type '{printable(scaling)}'")
    factor = m.optional(Keys.ROPE_SCALING_FACTOR, 0.0, float)
    if factor < 0:
        raise ConfigError(f"rope scaling factor must be positive (got {factor})")
    if factor == 0 or scaling == "none":  # llama.cpp: a factor of 0 is 1
        factor = 1.0
    ext_factor = m.optional(Keys.ROPE_SCALING_YARN_EXT_FACTOR, -1.0, float)
    if ext_factor < 0:  # not set
        ext_factor = 1.0 if scaling == "yarn" else 0.0
    magnitude = m.optional(Keys.ROPE_SCALING_YARN_ATTN_FACTOR, 1.0, float, minimum=0.0)
    magnitude *= m.optional(Keys.ROPE_SCALING_ATTN_FACTOR, 1.0, float, minimum=0.0)
    if ext_factor:
        magnitude *= yarn_mscale(factor)
    n_ctx_orig = m.optional(Keys.ROPE_SCALING_ORIG_CTX_LEN, 0) or m.optional(Keys.CONTEXT_LENGTH, 0)
    factors = m.metadata.get(FREQ_FACTORS_KEY)
    return RopeSpec(
        kind,
        n_rot,
        base,
        factor,
        ext_factor=ext_factor,
        beta_fast=m.optional(Keys.ROPE_SCALING_YARN_BETA_FAST, YARN_BETA_FAST, float),
        beta_slow=m.optional(Keys.ROPE_SCALING_YARN_BETA_SLOW, YARN_BETA_SLOW, float),
        n_ctx_orig=n_ctx_orig,
        magnitude=magnitude,
        freq_factors=None if factors is None else tuple(factors),
    )
