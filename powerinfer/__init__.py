"""powerinfer: CPU/GPU hybrid LLM inference exploiting activation sparsity."""

__version__ = "0.1.0"
