"""How an engine's step runs its model: in this process, or through a pipeline of ranks.

`Engine.step` validates a batch and keeps the KV lengths; the forward strategy it was given runs the model over
the batch. `LocalForward` calls the model here, under this engine's torch thread count and its thread governor;
`PipelineForward` sends the batch through the stages of runtime.pipeline (rank 0's side).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from powerinfer.errors import InputError
from powerinfer.ops import KernelContext
from powerinfer.runtime.threads import ThreadGovernor, torch_threads

if TYPE_CHECKING:
    from powerinfer.model.batch import StepBatch
    from powerinfer.model.transformer import KVStore, Transformer
    from powerinfer.runtime.pipeline import Pipeline


class Forward(Protocol):
    """A step's model run: logits (or final hidden states) as Transformer.forward returns them."""

    def __call__(
        self,
        model: Transformer,
        batch: StepBatch,
        kv: KVStore,
        rows: slice | torch.Tensor | None,
        hidden: bool,
    ) -> torch.Tensor: ...

    def fork(self, src: int, dst: int, n: int) -> None:
        """Copy the first n positions of KV slot src to dst wherever else the model's layers live."""

    def shift(self, seq: int, n_keep: int, n_discard: int) -> None:
        """Shift KV slot seq's context (runtime.context_shift) wherever else the model's layers live."""


@dataclass
class LocalForward:
    """The whole model in this process; torch's ops at the kernels' current thread count (runtime.threads)."""

    kc: KernelContext
    governor: ThreadGovernor | None = None

    def __call__(
        self,
        model: Transformer,
        batch: StepBatch,
        kv: KVStore,
        rows: slice | torch.Tensor | None,
        hidden: bool,
    ) -> torch.Tensor:
        if self.governor is not None:
            self.governor.begin()
        with torch_threads(self.kc.threads_now):
            logits = model.forward(batch, kv, rows, hidden=hidden)
        if self.governor is not None:
            self.governor.end()
        return logits

    def fork(self, src: int, dst: int, n: int) -> None:
        return None  # every layer's KV cache is the engine's own

    def shift(self, seq: int, n_keep: int, n_discard: int) -> None:
        return None


@dataclass
class PipelineForward:
    """Rank 0 of a pipeline: its layers here, the others' on their ranks (runtime.pipeline.Pipeline)."""

    pipeline: Pipeline
    kc: KernelContext

    def __call__(
        self,
        model: Transformer,
        batch: StepBatch,
        kv: KVStore,
        rows: slice | torch.Tensor | None,
        hidden: bool,
    ) -> torch.Tensor:
        if hidden:
            raise InputError("embeddings are not served by a pipeline of several ranks")
        with torch_threads(self.kc.threads_now):
            return self.pipeline.forward(model, batch, kv, rows)

    def fork(self, src: int, dst: int, n: int) -> None:
        self.pipeline.fork(src, dst, n)

    def shift(self, seq: int, n_keep: int, n_discard: int) -> None:
        self.pipeline.shift(seq, n_keep, n_discard)
