"""Model building blocks: specs (data), blocks (norm, attention, FFN), the sparse FFN and the transformer."""
