"""The config every architecture's config extends: sizes, the attention and FFN specs, the sparse settings."""

from __future__ import annotations

from dataclasses import dataclass

from powerinfer.model.specs import AttentionSpec, FFNSpec, NormSpec


@dataclass(frozen=True)
class ModelConfig:
    """What every architecture's config has: sizes, the attention and FFN specs and the sparse settings."""

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    attention: AttentionSpec
    ffn: FFNSpec
    norm: NormSpec
    sparse: bool = (
        False  # a PowerInfer (PWRI) file: ffn_down_t, and predictors unless the method says otherwise
    )
    sparse_threshold: float = 0.0
    # how a sparse file selects neurons: "predictor" (PowerInfer's MLPs) or "cats" (|act(gate)| > a per-layer
    # threshold, `powerinfer sparsify`)
    sparse_method: str = "predictor"
    sparse_thresholds: tuple[float, ...] = ()  # "cats": one per layer

    @property
    def n_head(self) -> int:
        return self.attention.n_head

    @property
    def n_head_kv(self) -> int:
        return self.attention.n_head_kv

    @property
    def head_dim(self) -> int:
        return self.attention.head_dim

    @property
    def n_embd_gqa(self) -> int:
        return self.attention.n_embd_kv

    @property
    def activation(self) -> str:
        return self.ffn.act

    @property
    def relu_up(self) -> bool:
        return self.ffn.relu_up
