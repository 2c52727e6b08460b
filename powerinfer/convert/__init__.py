"""Converters from training checkpoints into GGUF / PowerInfer GGUF files."""

from powerinfer.convert.hf import ConversionResult, convert_checkpoint, convert_hf_to_gguf

__all__ = ["ConversionResult", "convert_checkpoint", "convert_hf_to_gguf"]
