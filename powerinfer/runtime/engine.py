"""The engine: steps over KV-cache slots of a model assembled once (runtime.assembly: read, placed, built).

`step(seq_ids, tokens, positions)` is the one forward entry: prefill chunks, single-token decode and batches of
sequences all go through it; how it runs the model (here, or through a pipeline of ranks) is its forward
strategy (runtime.forward). Sequence lengths live in the KV cache (`kv.n_past`); `prefill`, `decode`, `eval`
and `logits_all` are thin helpers over `step`. Generation (sampling, stops, limits) is `runtime.generate`, the
report lines `runtime.report`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from powerinfer import ops
from powerinfer.errors import InputError
from powerinfer.model.batch import StepBatch
from powerinfer.model.blocks import Head
from powerinfer.model.head import (
    PROJ_TYPE,
    SCREEN,
    SCREEN_PROJ,
    SCREEN_TOKENS,
    SCREEN_TYPE,
    HeadScreen,
    HeadStats,
    SparseHead,
    build_head_screen,
    screen_pays,
    screen_rank,
)
from powerinfer.model.sparse import SparseStats
from powerinfer.placement import Placement
from powerinfer.quant import row_bytes
from powerinfer.runtime import head_cache, report
from powerinfer.runtime.assembly import (
    AssembledModel,
    EngineOptions,
    assemble,
    kernel_context,
    weights_in_memory,
)
from powerinfer.runtime.context_shift import shift_cache
from powerinfer.runtime.forward import Forward, LocalForward, PipelineForward
from powerinfer.runtime.generate import generate
from powerinfer.runtime.kv_cache import KVCache, kv_report
from powerinfer.runtime.threads import ThreadGovernor
from powerinfer.runtime.timings import Timings
from powerinfer.sampling import Sampler
from powerinfer.texts import calibration_mix

if TYPE_CHECKING:
    from powerinfer.runtime.pipeline import Pipeline

__all__ = ["AssembledModel", "Engine", "EngineOptions", "assemble", "kernel_context", "weights_in_memory"]

log = logging.getLogger(__name__)

# the packaged docstrings text (one of the calibration mix's kinds, powerinfer.texts)
CALIBRATION_TEXT = Path(__file__).resolve().parents[1] / "data" / "calibration.txt"


class Engine:
    """Steps an assembled model (its tokenizer, kernel context and weights) over its own KV cache (n_seq slots)."""

    def __init__(
        self,
        model: AssembledModel | str | os.PathLike[str],
        options: EngineOptions | None = None,
        forward: Forward | None = None,
    ) -> None:
        """Step an assembled model (runtime.assembly.assemble), or assemble the model file at `model` first.
        `forward` runs the model in each step (runtime.forward); None: here, or through the pipeline of the
        model's stage, with a thread governor unless options.fixed_threads."""
        t0 = time.perf_counter()
        if not isinstance(model, AssembledModel):
            model = assemble(model, options)
        elif options is not None and options is not model.options:
            raise ValueError("an assembled model carries its own options")
        self.assembled = m = model
        self.options, self.model_path, self.kc = m.options, m.model_path, m.kc
        self.gguf, self.config, self.tokenizer, self.n_ctx = m.gguf, m.config, m.tokenizer, m.n_ctx
        self.stage, self.plan, self.loader, self.model = m.stage, m.plan, m.loader, m.model
        self.sparse_stats: SparseStats | None = m.sparse_stats
        self.placement: Placement | None = m.placement
        self.pool_device = m.pool_device
        c, o = self.config, self.options
        self.kv = KVCache(
            c.n_layer,
            self.n_ctx,
            c.n_head_kv,
            c.head_dim,
            n_seq=o.n_seq,
            type_k=o.cache_type_k,
            type_v=o.cache_type_v,
            devices=[self.loader.kv_device(bid) for bid in range(c.n_layer)],
            zeroed=[self.plan.device is not None and bid in self.plan.kv_layers for bid in range(c.n_layer)],
        )
        self.head_stats: HeadStats | None = None
        self.pipeline: Pipeline | None = None
        self.governor: ThreadGovernor | None = None
        if forward is None:
            forward = self._default_forward()
        self.forward: Forward = forward
        self._setup_head(o.sparse_head)
        # after every refusal of the setup: bad input is one error line, no load lines before it
        log.info("%s", kv_report(self.kv, c.n_layer, c.n_embd_gqa))
        self.timings = Timings(load_ms=(time.perf_counter() - t0) * 1e3)

    def _default_forward(self) -> Forward:
        """The pipeline of this model's stage (connected now), else the model here under a thread governor."""
        if self.stage is not None:
            from powerinfer.runtime.pipeline import connect

            self.pipeline = connect(self.stage, self.config, self.gguf)
            return PipelineForward(self.pipeline, self.kc)
        # a step that waits on a device is not a sign of shared cores
        waits = self.pool_device is not None and self.pool_device.type != "cpu"
        adapt = not (self.options.fixed_threads or waits) and self.kc.n_threads > 1 and self.kc.uses_kernels
        self.governor = ThreadGovernor(self.kc) if adapt else None
        return LocalForward(self.kc, self.governor)

    def _setup_head(self, want: bool | None) -> None:
        """Screen the output head (model.head.SparseHead) as `want` says (EngineOptions.sparse_head)."""
        if want is False:
            return
        head = self.model.head
        on_cpu = self.plan.device is None and self.stage is None and isinstance(head, Head)
        if not on_cpu or not isinstance(head.output, ops.QWeight):
            if want:
                raise InputError(
                    "--sparse-head runs on the CPU head only (not with a pool device or pipeline)"
                )
            return
        n_vocab, n_embd = head.output.shape
        if self.loader.has(SCREEN) and self.loader.has(SCREEN_PROJ):
            rank = int(self.gguf.tensors[SCREEN_PROJ].shape[0])
            proj = self.loader.host_matrix(SCREEN_PROJ, (rank, n_embd))
            screen = self.loader.host_matrix(SCREEN, (n_vocab, rank))
        elif want:
            if not screen_pays(head.output):
                raise InputError("--sparse-head: this model's head is too small for a screen to pay")
            proj, screen = self._cached_screen(head.output).weights(n_vocab, n_embd)
        else:
            return
        sparse = SparseHead(head, proj, screen, self.kc)
        self.model.head = sparse
        self.head_stats = sparse.stats

    def _cached_screen(self, output: ops.QWeight) -> HeadScreen:
        """This file's screen from the cache folder (runtime.head_cache), else calibrated now and kept there."""
        n_vocab, n_embd = output.shape
        rank = screen_rank(n_embd)
        shapes = ((rank, row_bytes(PROJ_TYPE, n_embd)), (n_vocab, row_bytes(SCREEN_TYPE, rank)))
        screen = head_cache.load(self.model_path, shapes)
        if screen is None:
            screen = self.calibrated_screen(output)
            head_cache.save(self.model_path, screen)
        return screen

    def calibrated_screen(self, output: ops.QWeight, texts: Sequence[str] = ()) -> HeadScreen:
        """A screen from this model's hidden states over `texts` and the packaged calibration mix (powerinfer.texts),
        an equal share of SCREEN_TOKENS from each."""
        mix = [text for _, text in calibration_mix()]
        return build_head_screen(output, head_cache.screen_hidden(self, [*texts, *mix], SCREEN_TOKENS))

    # ------------------------------------------------------------------ forward
    @property
    def n_past(self) -> int:
        """Length of sequence 0 (the single-sequence front ends)."""
        return self.kv.n_past[0]

    @torch.inference_mode()
    def step(
        self,
        seq_ids: list[int],
        tokens: list[int],
        positions: list[int],
        all_logits: bool = False,
        hidden: bool = False,
    ) -> torch.Tensor:
        """Run tokens (of any sequences, at their positions) through the model.

        Returns logits (n, n_vocab): for every token when all_logits, else for the last token of each run of
        one sequence; with `hidden`, the final-normed hidden states (n, n_embd) of the same rows instead.
        A sequence's positions continue from at most its current length (lower rewinds it).
        """
        kv = self.kv
        for s, t in zip(seq_ids, tokens, strict=True):
            if not 0 <= s < kv.n_seq:
                raise InputError(f"sequence {s} out of range (0..{kv.n_seq - 1})")
            if not 0 <= t < self.config.n_vocab:
                raise InputError(f"token id {t} is out of range for a vocabulary of {self.config.n_vocab}")
        batch = StepBatch.build(seq_ids, tokens, positions)
        for seg in batch.segments:
            if seg.pos > kv.n_past[seg.seq] or seg.pos < 0:
                raise InputError(
                    f"sequence {seg.seq}: position {seg.pos} skips past its length {kv.n_past[seg.seq]}"
                )
            if seg.pos + seg.n > self.n_ctx:
                raise InputError(
                    f"context is full: {seg.pos} + {seg.n} tokens exceed the context size {self.n_ctx} (-c)"
                )
        rows: slice | torch.Tensor | None = None
        if not all_logits:
            if batch.kind == "run":
                rows = slice(-1, None)
            elif batch.kind == "mixed":
                rows = torch.tensor([seg.start + seg.n - 1 for seg in batch.segments])
        logits = self.forward(self.model, batch, kv, rows, hidden)
        for seg in batch.segments:
            kv.n_past[seg.seq] = seg.pos + seg.n
        return logits

    def prefill(self, seq: int, tokens: list[int], start: int = 0) -> torch.Tensor:
        """Evaluate tokens into sequence `seq` from position `start` in chunks of n_batch; last logits."""
        if not tokens:
            raise InputError("nothing to evaluate (empty token list)")
        if start + len(tokens) > self.n_ctx:
            raise InputError(
                f"context is full: {start} + {len(tokens)} tokens exceed the context size {self.n_ctx} (-c)"
            )
        logits = [self._chunk(seq, chunk, pos, False) for chunk, pos in self._chunks(tokens, start)][-1]
        return logits[-1]

    def _chunks(self, tokens: list[int], start: int) -> list[tuple[list[int], int]]:
        """tokens in chunks of n_batch with the position each starts at."""
        step = self.options.n_batch
        return [(tokens[i : i + step], start + i) for i in range(0, len(tokens), step)]

    def _chunk(self, seq: int, chunk: list[int], pos: int, all_logits: bool) -> torch.Tensor:
        return self.step([seq] * len(chunk), chunk, list(range(pos, pos + len(chunk))), all_logits=all_logits)

    def hidden_states(self, seq: int, tokens: list[int]) -> torch.Tensor:
        """The final-normed hidden states (T, n_embd) of tokens evaluated into sequence `seq` from position 0,
        in chunks of n_batch (embeddings); the sequence holds them afterwards."""
        if not tokens or len(tokens) > self.n_ctx:
            raise InputError(f"cannot embed {len(tokens)} tokens with a context of {self.n_ctx}")
        self.free(seq)
        out = [
            self.step([seq] * len(chunk), chunk, list(range(pos, pos + len(chunk))), True, hidden=True)
            for chunk, pos in self._chunks(tokens, 0)
        ]
        return torch.cat(out)

    def decode(self, seqs: list[int], tokens: list[int]) -> torch.Tensor:
        """Append tokens[i] to sequence seqs[i] (distinct); logits (len(seqs), n_vocab)."""
        if len(set(seqs)) != len(seqs):
            raise InputError("a decode step takes one token per sequence")
        return self.step(seqs, tokens, [self.kv.n_past[s] for s in seqs])

    def fork(self, src: int, dst: int) -> None:
        """Start sequence dst as a copy of sequence src (same prompt, evaluated once)."""
        for s in (src, dst):
            if not 0 <= s < self.kv.n_seq:
                raise InputError(f"sequence {s} out of range (0..{self.kv.n_seq - 1})")
        self.kv.copy_slot(src, dst, self.kv.n_past[src])
        self.forward.fork(src, dst, self.kv.n_past[src])

    def shift(self, seq: int, n_keep: int, n_discard: int) -> None:
        """Context shift of sequence `seq`: drop positions n_keep..n_keep+n_discard-1 from every layer's KV cache
        (here and on the other pipeline stages), re-rotating the later keys (runtime.context_shift); the
        sequence's length shrinks by n_discard."""
        if not 0 <= seq < self.kv.n_seq:
            raise InputError(f"sequence {seq} out of range (0..{self.kv.n_seq - 1})")
        n_past = self.kv.n_past[seq]
        if n_keep < 0 or n_discard <= 0 or n_keep + n_discard > n_past:
            raise InputError(f"cannot drop {n_discard} positions after {n_keep} of a sequence of {n_past}")
        shift_cache(self.model, self.kv, seq, n_keep, n_discard)
        self.forward.shift(seq, n_keep, n_discard)

    def keep(self, seq: int, n: int) -> None:
        """Shorten sequence `seq` to its first n positions, which must still hold the tokens they were
        evaluated with (free only resets the length, so a freed slot's rows stay until overwritten); the next
        step continues at n. Prompt reuse."""
        if not 0 <= n <= self.n_ctx:
            raise InputError(f"cannot keep {n} positions of a context of {self.n_ctx}")
        self.kv.n_past[seq] = n

    def free(self, seq: int) -> None:
        """Forget a sequence; its slot can take a new prompt."""
        self.kv.n_past[seq] = 0

    def reset(self) -> None:
        self.free(0)

    def eval(self, tokens: list[int]) -> torch.Tensor:
        """Run tokens through sequence 0 at its current length; the last token's logits (n_vocab,)."""
        return self.prefill(0, tokens, self.kv.n_past[0])

    def logits_all(self, tokens: list[int]) -> torch.Tensor:
        """Logits of every position for tokens evaluated from sequence 0's length, (T, n_vocab)."""
        if self.n_past + len(tokens) > self.n_ctx:
            raise InputError(f"{self.n_past + len(tokens)} tokens exceed the context size {self.n_ctx} (-c)")
        out = [self._chunk(0, chunk, pos, True) for chunk, pos in self._chunks(tokens, self.n_past)]
        return torch.cat(out)

    def generate(
        self,
        prompt: list[int],
        sampler: Sampler,
        n_predict: int = -1,
        ignore_eos: bool = False,
        n_keep: int | None = None,
    ) -> Iterator[int]:
        """runtime.generate.generate on this engine (n_keep: shift a full context, keeping that many tokens)."""
        return generate(self, prompt, sampler, n_predict, ignore_eos, n_keep=n_keep)

    # ------------------------------------------------------------------ reports (runtime.report)
    def head_read_bytes(self) -> int:
        return report.head_read_bytes(self.assembled)

    def read_bytes_per_token(self) -> float:
        return report.read_bytes_per_token(self.assembled)

    def head_report(self) -> list[str]:
        return report.head_report(self.assembled)

    def sparse_report(self) -> list[str]:
        return report.sparse_report(self.assembled)

    def placement_report(self) -> list[str]:
        return report.placement_report(self.assembled)

    @property
    def weight_bytes(self) -> int:
        """Bytes of tensor data in the model file (read once per decoded token)."""
        return report.weight_bytes(self.assembled)
