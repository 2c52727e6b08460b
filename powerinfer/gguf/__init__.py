"""GGUF and PowerInfer (PWRI) file reading and writing."""

from powerinfer.gguf.constants import GGMLType, Keys, TensorNames, ValueType
from powerinfer.gguf.reader import GGUFFile, TensorInfo, read_gguf
from powerinfer.gguf.writer import GGUFWriter

__all__ = [
    "GGMLType",
    "GGUFFile",
    "GGUFWriter",
    "Keys",
    "TensorInfo",
    "TensorNames",
    "ValueType",
    "read_gguf",
]
