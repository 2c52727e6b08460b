"""Shared helpers for architecture modules: typed metadata access."""

from __future__ import annotations

from typing import Any

from powerinfer.errors import ConfigError


class MetadataView:
    """Reads `{arch}`-templated keys from GGUF metadata with type checks and clear errors."""

    def __init__(self, metadata: dict[str, Any], arch: str) -> None:
        self.metadata = metadata
        self.arch = arch

    def _key(self, template: str) -> str:
        return template.format(arch=self.arch)

    def require(self, template: str, kind: type = int) -> Any:
        key = self._key(template)
        if key not in self.metadata:
            raise ConfigError(f"missing required metadata key '{key}'")
        return self._cast(key, self.metadata[key], kind)

    def optional(self, template: str, default: Any, kind: type = int) -> Any:
        key = self._key(template)
        if key not in self.metadata:
            return default
        return self._cast(key, self.metadata[key], kind)

    @staticmethod
    def _cast(key: str, value: Any, kind: type) -> Any:
        if kind is str:
            if not isinstance(value, str):
                raise ConfigError(f"metadata key '{key}' should be a string, got {type(value).__name__}")
            return value
        if isinstance(value, (str, list)) or getattr(value, "ndim", 0):
            raise ConfigError(f"metadata key '{key}' should be a number, got {type(value).__name__}")
        out = kind(value)
        if kind is int and out < 0:
            raise ConfigError(f"metadata key '{key}' must not be negative (got {out})")
        return out
