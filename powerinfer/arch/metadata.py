"""Typed access to a GGUF file's `{arch}`-templated metadata keys, with clear errors."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from powerinfer.errors import ConfigError
from powerinfer.printable import printable


class MetadataView:
    """Reads `{arch}`-templated keys from GGUF metadata with type checks and clear errors."""

    def __init__(self, metadata: dict[str, Any], arch: str) -> None:
        self.metadata = metadata
        self.arch = arch

    def _key(self, template: str) -> str:
        return template.format(arch=self.arch)

    def require(self, template: str, kind: type = int, minimum: float | None = None) -> Any:
        key = self._key(template)
        if key not in self.metadata:
            raise ConfigError(f"missing required metadata key '{key}'")
        return self._cast(key, self.metadata[key], kind, minimum)

    def optional(self, template: str, default: Any, kind: type = int, minimum: float | None = None) -> Any:
        key = self._key(template)
        if key not in self.metadata:
            return default
        return self._cast(key, self.metadata[key], kind, minimum)

    @staticmethod
    def _cast(key: str, value: Any, kind: type, minimum: float | None = None, infinite: bool = False) -> Any:
        """`value` as `kind` (str, int or float): integers must be stored as integers, floats as numbers, finite
        unless `infinite`; ConfigError for any other type, NaN, a negative integer or a value below `minimum`."""
        if kind is str:
            if not isinstance(value, str):
                raise ConfigError(f"metadata key '{key}' should be a string, got {type(value).__name__}")
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ConfigError(f"metadata key '{key}' should be a number, got {type(value).__name__}")
        if kind is int:
            if not isinstance(value, (int, np.integer)):
                raise ConfigError(f"metadata key '{key}' should be an integer, got {printable(value)}")
            out: int | float = int(value)
            if out < 0:
                raise ConfigError(f"metadata key '{key}' must not be negative (got {out})")
        else:
            out = float(value)
            if math.isnan(out):
                raise ConfigError(f"metadata key '{key}' is NaN")
            if math.isinf(out) and not infinite:
                raise ConfigError(f"metadata key '{key}' must be finite (got {out})")
        if minimum is not None and out < minimum:
            raise ConfigError(f"metadata key '{key}' must be at least {minimum} (got {out})")
        return out
