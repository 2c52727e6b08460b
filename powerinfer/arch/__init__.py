"""Architecture registry: general.architecture -> the module that declares its config and builds its model.

A new architecture is one file here (a config with `from_gguf(metadata, sparse)` and `build(config, source)`
composing the blocks of powerinfer.model) plus one line in ARCHITECTURES.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from powerinfer.arch import (
    bamboo,
    falcon,
    gemma3,
    llama,
    olmoe,
    opt,
    phi3,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3moe,
    smallthinker,
)
from powerinfer.arch.rope_scaling import RopeOverrides, effective_metadata
from powerinfer.errors import FormatError
from powerinfer.gguf.constants import Keys
from powerinfer.gguf.reader import GGUFFile
from powerinfer.model.config import ModelConfig
from powerinfer.model.source import WeightSource
from powerinfer.model.transformer import Transformer
from powerinfer.printable import printable


@dataclass(frozen=True)
class Architecture:
    config: Callable[[dict[str, Any], bool], ModelConfig]
    build: Callable[[ModelConfig, WeightSource], Transformer]
    # the file's tensors against the config (types and shapes), before anything is allocated
    check: Callable[[ModelConfig, GGUFFile], None]


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(llama.LlamaConfig.from_gguf, llama.build, llama.check),
    "bamboo": Architecture(bamboo.BambooConfig.from_gguf, bamboo.build, bamboo.check),
    "falcon": Architecture(falcon.FalconConfig.from_gguf, falcon.build, falcon.check),
    "opt": Architecture(opt.OPTConfig.from_gguf, opt.build, opt.check),
    "qwen2": Architecture(qwen2.Qwen2Config.from_gguf, qwen2.build, qwen2.check),
    "qwen3": Architecture(qwen3.Qwen3Config.from_gguf, qwen3.build, qwen3.check),
    "gemma3": Architecture(gemma3.Gemma3Config.from_gguf, gemma3.build, gemma3.check),
    "phi3": Architecture(phi3.Phi3Config.from_gguf, phi3.build, phi3.check),
    "qwen2moe": Architecture(qwen2moe.Qwen2MoEConfig.from_gguf, qwen2moe.build, qwen2moe.check),
    "qwen3moe": Architecture(qwen3moe.Qwen3MoEConfig.from_gguf, qwen3moe.build, qwen3moe.check),
    "olmoe": Architecture(olmoe.OLMoEConfig.from_gguf, olmoe.build, olmoe.check),
    "smallthinker": Architecture(
        smallthinker.SmallThinkerConfig.from_gguf, smallthinker.build, smallthinker.check
    ),
}


def architecture(gguf: GGUFFile) -> Architecture:
    """The registered architecture of a parsed GGUF file (from its metadata, never its file name)."""
    arch = gguf.metadata.get(Keys.ARCHITECTURE)
    if arch is None:
        raise FormatError(f"{gguf.path}: missing required metadata key '{Keys.ARCHITECTURE}'")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise FormatError(
            f"{gguf.path}: unknown architecture '{printable(arch)}' (supported: {', '.join(ARCHITECTURES)})"
        )
    return ARCHITECTURES[arch]


def load_config(gguf: GGUFFile, rope: RopeOverrides | None = None) -> ModelConfig:
    """The model config of a parsed GGUF file, checked against the file's tensors (types and shapes); `rope`:
    the command line's RoPE overrides."""
    arch = architecture(gguf)
    config = arch.config(effective_metadata(gguf, rope), gguf.is_sparse)
    arch.check(config, gguf)
    return config


def build_model(gguf: GGUFFile, config: ModelConfig, source: WeightSource) -> Transformer:
    """The model of a parsed GGUF file, built from weights the source placed."""
    return architecture(gguf).build(config, source)
