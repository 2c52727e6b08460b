"""Bamboo (PowerInfer's Mistral-based ReLU models): Llama's layout with ReLU(gate) * ReLU(up) FFNs."""

from __future__ import annotations

from typing import Any

from powerinfer.arch.llama import LlamaConfig, build, check

__all__ = ["BambooConfig", "build", "check"]


class BambooConfig(LlamaConfig):
    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], sparse: bool, relu_up: bool = True) -> LlamaConfig:
        return LlamaConfig.from_gguf(metadata, sparse, relu_up=True)
