"""Architecture registry: general.architecture -> (config class, model class)."""

from __future__ import annotations

from powerinfer.arch.llama import LlamaConfig, LlamaModel
from powerinfer.errors import FormatError
from powerinfer.gguf.constants import Keys
from powerinfer.gguf.reader import GGUFFile

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaModel),
    "bamboo": (LlamaConfig, LlamaModel),
}


def load_model(gguf: GGUFFile) -> LlamaModel:
    """Build the model object of a parsed GGUF file from its metadata (never from its file name)."""
    arch = gguf.metadata.get(Keys.ARCHITECTURE)
    if arch is None:
        raise FormatError(f"{gguf.path}: missing required metadata key '{Keys.ARCHITECTURE}'")
    if arch not in ARCHITECTURES:
        raise FormatError(
            f"{gguf.path}: unknown architecture '{arch}' (supported: {', '.join(ARCHITECTURES)})"
        )
    config_cls, model_cls = ARCHITECTURES[arch]
    return model_cls(config_cls.from_gguf(gguf.metadata, gguf.is_sparse), gguf)
