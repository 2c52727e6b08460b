"""A decoder-only transformer composed of blocks: embedding -> layers (norm, attention, norm, FFN) -> head.

Every architecture builds one of these; the placement decided where each weight lives before the blocks were
made, and `device` of each layer says where its residual stream is computed (the pool device for layers the
plan offloads, e.g. `-ngl`). One `forward(batch, kv)` serves prefill, decode and batches of sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from powerinfer import ops
from powerinfer.model.batch import StepBatch
from powerinfer.model.blocks import (
    FFN,
    Attention,
    DenseFFN,
    Embedding,
    Head,
    KVLayer,
    Norm,
    Rope,
    fuse_teal_layer,
    identity_pairs,
)
from powerinfer.model.moe import FusedMoEFFN, MoEFFN
from powerinfer.model.sparse import FusedSparseFFN, FusedThresholdFFN, SparseFFN, ThresholdFFN

# observer of a layer's FFN input: (layer index, x_norm (T, D), x_residual (T, D)); profiling uses it
FFNObserver = Callable[[int, torch.Tensor, torch.Tensor], None]


class DeviceSpan(Protocol):
    """Device-resident layers for one token (powerinfer.device.span): the residual x (1, D) at position pos in,
    the residual after the span's last layer out, on the device."""

    def __call__(self, x: torch.Tensor, pos: int) -> torch.Tensor: ...


class BatchSpan(Protocol):
    """The same layers for one token of each of several sequences (powerinfer.device.span): the residual x (B, D)
    of the sequences seqs (B,) at positions (B,) in, the residual after the span's last layer out, on the device."""

    def __call__(self, x: torch.Tensor, seqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...


class SpanMaker(Protocol):
    """Which layers run whole on the pool device, and their span for one token of one sequence or for one token
    of each of several sequences (powerinfer.device.span)."""

    def accepts(self, layer: Layer) -> bool: ...

    def make(self, layers: list[Layer], slots: list[tuple[torch.Tensor, torch.Tensor]]) -> DeviceSpan: ...

    def make_batch(
        self, layers: list[Layer], caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> BatchSpan: ...


# layers start..stop-1 of one token's step: CPU layers as one kernel call (a stack), device layers as one device
# span, or (None) each layer by itself
Span = tuple[int, int, "ops.DecodeStack | DeviceSpan | None"]
# layers start..stop-1 of a decode step of several sequences: a batch span, or (None) each layer op by op
StepSpan = tuple[int, int, "BatchSpan | None"]


# a run of at most this many tokens of one sequence (a speculative step's, a short chunk) goes through the sequence's
# decode stack in one kernel call where every layer is dense (ops.DecodeStack.tokens), not op by op
STACK_TOKENS_MAX = 32


def _host(x: torch.Tensor) -> torch.Tensor:
    """The residual stream on the CPU, contiguous (the fused blocks update it in place)."""
    return x if x.is_cpu and x.is_contiguous() else x.to("cpu").contiguous()


class KVStore(Protocol):
    """What the transformer needs from a KV cache: one view per layer (runtime.kv_cache.KVCache)."""

    def layer_view(self, layer: int) -> KVLayer: ...


@dataclass
class Layer:
    attn_norm: Norm
    attn: Attention
    ffn_norm: Norm | None  # None: parallel attention and FFN from the same norm (Falcon-7B-style)
    ffn: FFN
    device: torch.device  # where the residual stream of this layer is computed
    # attention and FFN both read the layer input (Falcon): x + attn(attn_norm(x)) + ffn(ffn_norm(x)), with
    # ffn_norm None meaning the attention's normed input
    parallel: bool = False
    post_attn_norm: Norm | None = None  # Gemma-style norms of each block's output
    post_ffn_norm: Norm | None = None
    # reads the layer input before attention (SmallThinker's router, model.moe.MoEFFN.route_early)
    pre_attn: Callable[[torch.Tensor], None] | None = None
    # the blocks as single fused ops for one token on the CPU (setup decides; None: op by op)
    fused_attn: ops.AttnBlock | None = None
    fused_ffn: ops.FFNBlock | FusedSparseFFN | FusedThresholdFFN | FusedMoEFFN | None = None
    # a TEAL layer (input-sparse matrices) as one fused op for one token (blocks.fuse_teal_layer)
    fused_layer: ops.TealLayer | None = None


class Transformer:
    """Embedding, layers and head; `forward` returns logits for the rows asked for."""

    def __init__(
        self,
        embedding: Embedding,
        layers: list[Layer],
        head: Head,
        head_device: torch.device,
        rope_factory: Callable[[int, int], Rope | None] | None = None,
    ) -> None:
        self.embedding = embedding
        self.layers = layers
        self.head = head
        self.head_device = head_device
        self.rope_factory = rope_factory  # (layer index, n_ctx) -> that layer's RoPE tables
        self.observers: list[FFNObserver] = []
        self.placed = False
        # one token's layers in one kernel call (ops.decode_stack) where they chain; False: block by block
        self.stack_decode = True
        # the device spans of a placed model's resident layers (the runtime sets it; None: op by op)
        self.span_maker: SpanMaker | None = None
        # the spans made, per (KV store, sequence): the store, the fused blocks they chain, the spans
        self._spans: dict[tuple[int, int], tuple[KVStore, tuple[object, ...], list[Span]]] = {}
        # the batch spans of a decode step of several sequences, per KV store: the store, the spans
        self._step_spans: dict[int, tuple[KVStore, list[StepSpan]]] = {}

    @property
    def ffns(self) -> list[FFN]:
        """Each layer's FFN block."""
        return [layer.ffn for layer in self.layers]

    def setup(self, n_ctx: int, placed: bool = False) -> None:
        """Precompute position tables for a context of n_ctx tokens; `placed`: some weights live on a device
        other than the CPU (the forward then moves activations between devices). A layer computed on the CPU keeps
        its fused blocks whatever the other layers do: only its own weights' places decide (the fuse methods refuse
        device weights and pool parts)."""
        self.placed = placed
        self._spans.clear()
        self._step_spans.clear()
        ropes: dict[object, Rope | None] = {}
        identities: dict[int, torch.Tensor] = {}
        for bid, layer in enumerate(self.layers):
            rope = None
            if self.rope_factory is not None:
                rope = self.rope_factory(bid, n_ctx)
                if rope is not None:  # layers with the same spec share one table
                    rope = ropes.setdefault(rope.spec, rope)
            attn = layer.attn
            no_rope = None
            if (
                rope is None and attn.spec.rope is None and attn.plain
            ):  # one identity table for all such layers
                half = attn.spec.head_dim // 2
                if half not in identities:
                    identities[half] = identity_pairs(n_ctx, half)
                no_rope = identities[half]
            attn.setup(rope, n_ctx, no_rope)
            layer.fused_attn = layer.fused_ffn = layer.fused_layer = None
            if (
                layer.device.type != "cpu"
                or layer.parallel
                or layer.ffn_norm is None
                or layer.post_attn_norm is not None
                or layer.post_ffn_norm is not None
            ):
                continue
            layer.fused_attn = layer.attn.fuse(layer.attn_norm, n_ctx)
            if layer.fused_attn is None:
                layer.fused_layer = fuse_teal_layer(
                    layer.attn_norm, layer.attn, layer.ffn_norm, layer.ffn, n_ctx
                )
            # a MoE FFN block fuses behind either attention path (its kernel gives the op-by-op bits)
            if isinstance(layer.ffn, MoEFFN) or (
                layer.fused_attn is not None and isinstance(layer.ffn, DenseFFN | SparseFFN | ThresholdFFN)
            ):
                layer.fused_ffn = layer.ffn.fuse(layer.ffn_norm)
                if layer.fused_ffn is not None:
                    layer.attn.workspace.reserve("ffn_block", layer.fused_ffn.scratch_bytes())

    def forward(
        self, batch: StepBatch, kv: KVStore, rows: slice | torch.Tensor | None = None, hidden: bool = False
    ) -> torch.Tensor:
        """Logits (n_rows, n_vocab) of the batch's tokens at `rows` (None: all); with `hidden`, the
        final-normed hidden states (n_rows, n_embd) instead (embeddings)."""
        return self.logits(self.forward_layers(self.embedding(batch), batch, kv), rows, hidden)

    def forward_layers(self, x: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
        """The residual stream x (N, D) after every layer (a pipeline stage runs only these)."""
        if batch.kind == "run" and not self.observers:
            n = batch.segments[0].n
            if n == 1:
                return self._forward_one(x.contiguous(), batch, kv)
            if n <= STACK_TOKENS_MAX:
                stack = self.stack_for(kv, batch.segments[0].seq)
                if stack is not None and stack.takes_tokens:
                    x = _host(x).contiguous()
                    stack.tokens(x, batch.segments[0].pos)
                    return x
        elif batch.kind == "decode" and not self.observers and self.span_maker is not None:
            return self._forward_decode(x, batch, kv)
        for bid, layer in enumerate(self.layers):
            x = self._layer(bid, layer, x, batch, kv.layer_view(bid))
        return x

    def logits(
        self, x: torch.Tensor, rows: slice | torch.Tensor | None = None, hidden: bool = False
    ) -> torch.Tensor:
        """The head over the residual stream's `rows` (None: all), on the CPU; with `hidden`, the final norm only."""
        if rows is not None:
            x = x[rows]
        head = self.head.norm if hidden else self.head
        if not self.placed:  # all on the CPU: no device moves (a no-op .to still costs ~1 us, 3 per layer)
            return head(x)
        return head(x.to(self.head_device)).to("cpu")

    def _forward_one(self, x: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
        """The residual stream of one token of one sequence, span by span (spans_for): a chain of CPU layers in one
        kernel call (x updated in place), other layers each by its fused blocks where it has them, else op by op
        on its device (the residual stays there across consecutive device layers)."""
        seg = batch.segments[0]
        seq, pos = seg.seq, seg.pos
        workspace = self.layers[0].attn.workspace if self.layers else None
        for start, stop, span in self.spans_for(kv, seq):
            if isinstance(span, ops.DecodeStack):
                assert workspace is not None
                x = _host(x)
                span(x, pos, workspace.get("attn_block"), workspace.get("ffn_block"))
                continue
            if span is not None:
                x = span(x, pos)
                continue
            for bid in range(start, stop):
                x = self._one(bid, self.layers[bid], x, batch, kv, seq, pos)
        return x

    def _forward_decode(self, x: torch.Tensor, batch: StepBatch, kv: KVStore) -> torch.Tensor:
        """The residual stream of one token of each of several sequences: each run of resident layers as one batch
        span (step_spans_for), every other layer op by op."""
        for start, stop, span in self.step_spans_for(kv):
            if span is not None:
                x = span(x, batch.seq_ids, batch.positions)
                continue
            for bid in range(start, stop):
                x = self._layer(bid, self.layers[bid], x, batch, kv.layer_view(bid))
        return x

    def step_spans_for(self, kv: KVStore) -> list[StepSpan]:
        """The layers of a decode step of several sequences: each longest run of layers the span maker accepts as
        one batch span over every sequence's KV rows, every other layer by itself (None). Made on first use; none
        where spans_for makes none (recall tracked, stack_decode False)."""
        if self._op_by_op():
            return [(bid, bid + 1, None) for bid in range(len(self.layers))]
        entry = self._step_spans.get(id(kv))
        if entry is None or entry[0] is not kv:
            entry = (kv, self._make_step_spans(kv))
            self._step_spans[id(kv)] = entry
        return entry[1]

    def _make_step_spans(self, kv: KVStore) -> list[StepSpan]:
        maker = self.span_maker
        assert maker is not None
        spans: list[StepSpan] = []
        resident: list[int] = []

        def close() -> None:
            if resident:
                caches = [kv.layer_view(bid).stacked() for bid in resident]
                span = maker.make_batch([self.layers[bid] for bid in resident], caches)
                spans.append((resident[0], resident[-1] + 1, span))
                resident.clear()

        for bid, layer in enumerate(self.layers):
            if maker.accepts(layer):
                resident.append(bid)
                continue
            close()
            spans.append((bid, bid + 1, None))
        close()
        return spans

    def _one(
        self, bid: int, layer: Layer, x: torch.Tensor, batch: StepBatch, kv: KVStore, seq: int, pos: int
    ) -> torch.Tensor:
        """Layer bid for one token: its fused blocks where it has them (x on the CPU, updated in place), else op by
        op on the layer's device."""
        attn = layer.fused_attn
        if layer.fused_layer is not None:
            x = _host(x)
            if layer.pre_attn is not None:
                layer.pre_attn(x)
            pairs = layer.attn.rope_pairs
            assert pairs is not None
            slot = kv.layer_view(bid).slot(seq)
            layer.fused_layer(x, *slot, pos, pairs, layer.attn.workspace.get("teal_layer"))
            return x
        if attn is None and layer.fused_ffn is None:
            return self._layer(bid, layer, x, batch, kv.layer_view(bid))
        x = _host(x)
        workspace = layer.attn.workspace
        if layer.pre_attn is not None:
            layer.pre_attn(x)
        if attn is not None:
            pairs = layer.attn.rope_pairs
            assert pairs is not None
            attn(x, *kv.layer_view(bid).slot(seq), pos, pairs, workspace.get("attn_block"))
        else:  # op by op (setup fused the FFN only where the layer is plain: no post-norms, not parallel)
            a = layer.attn(layer.attn_norm(x), batch, kv.layer_view(bid))
            x = x + (a.to(x.device) if self.placed else a)
        if layer.fused_ffn is not None:
            layer.fused_ffn(x, workspace.get("ffn_block"), pos == 0)  # position 0: CATS runs it dense
            return x
        assert layer.ffn_norm is not None
        f = layer.ffn(layer.ffn_norm(x), x, batch)
        return x + (f.to(x.device) if self.placed else f)

    def stack_for(self, kv: KVStore, seq: int) -> ops.DecodeStack | None:
        """Sequence seq's layers as one kernel call when one stack chains them all (spans_for), else None."""
        spans = self.spans_for(kv, seq)
        if (
            len(spans) == 1
            and isinstance(spans[0][2], ops.DecodeStack)
            and spans[0][:2] == (0, len(self.layers))
        ):
            return spans[0][2]
        return None

    def spans_for(self, kv: KVStore, seq: int) -> list[Span]:
        """Sequence seq's layers as spans (start, stop, stack or device span): each longest run of layers that
        chain (a fused attention block and a fused dense, sparse or CATS FFN block, or a fused TEAL layer; no
        pre-attention hook, one workspace and one kernel context) as one kernel call (ops.decode_stack), each longest run of layers the
        span maker accepts as one device span, every other layer a span of its own (None). Made on first use and
        again when a layer's fused blocks or hook change; none of them while recall is tracked (perplexity runs
        the sparse FFNs op by op) or with stack_decode False."""
        blocks = tuple(
            b
            for layer in self.layers
            for b in (layer.fused_attn, layer.fused_ffn, layer.pre_attn, layer.fused_layer)
        )
        key = (id(kv), seq)
        entry = self._spans.get(key)
        if entry is None or entry[0] is not kv or entry[1] != blocks:
            entry = (kv, blocks, self._make_spans(kv, seq))
            self._spans[key] = entry
        if self._op_by_op():
            return [(bid, bid + 1, None) for bid in range(len(self.layers))]
        return entry[2]

    def _op_by_op(self) -> bool:
        """No stack and no span: stack_decode is off, or recall is tracked (the sparse FFNs count their truly
        active neurons op by op)."""
        return not self.stack_decode or any(
            isinstance(ffn, FusedSparseFFN | FusedThresholdFFN) and ffn.ffn.stats.true_active is not None
            for ffn in (layer.fused_ffn for layer in self.layers)
        )

    def _make_spans(self, kv: KVStore, seq: int) -> list[Span]:
        spans: list[Span] = []
        run: list[int] = []
        resident: list[int] = []
        maker = self.span_maker

        def close_resident() -> None:
            if resident:
                assert maker is not None
                slots = [kv.layer_view(bid).slot(seq) for bid in resident]
                span = maker.make([self.layers[bid] for bid in resident], slots)
                spans.append((resident[0], resident[-1] + 1, span))
                resident.clear()

        def close() -> None:
            if not run:
                return
            parts = []
            for bid in run:
                layer = self.layers[bid]
                k, v = kv.layer_view(bid).slot(seq)
                pairs = layer.attn.rope_pairs
                assert pairs is not None
                if layer.fused_layer is not None:  # a TEAL layer: the whole layer as one block
                    parts.append((layer.fused_layer, k, v, pairs, None))
                    continue
                attn, ffn = layer.fused_attn, layer.fused_ffn
                assert attn is not None and ffn is not None
                block = ffn.block if isinstance(ffn, FusedSparseFFN | FusedThresholdFFN) else ffn
                parts.append((attn, k, v, pairs, block))  # decode_stack refuses what it can't chain
            stack = ops.decode_stack(parts, parts[0][0].kc)  # type: ignore[arg-type]
            if stack is None:
                spans.extend((bid, bid + 1, None) for bid in run)
            else:
                spans.append((run[0], run[-1] + 1, stack))
            run.clear()

        workspace = self.layers[0].attn.workspace if self.layers else None
        for bid, layer in enumerate(self.layers):
            chains = (
                (
                    layer.fused_layer is not None
                    or (layer.fused_attn is not None and layer.fused_ffn is not None)
                )
                and layer.pre_attn is None
                and layer.attn.workspace is workspace
                and layer.attn.rope_pairs is not None
            )
            if chains:
                close_resident()
                run.append(bid)
                continue
            close()
            if maker is not None and maker.accepts(layer):
                resident.append(bid)
                continue
            close_resident()
            spans.append((bid, bid + 1, None))
        close()
        close_resident()
        return spans

    def _layer(self, bid: int, layer: Layer, x: torch.Tensor, batch: StepBatch, kv: KVLayer) -> torch.Tensor:
        """One layer op by op: the residual stream after it (on the layer's device when placed)."""
        placed = self.placed
        if placed:
            x = x.to(layer.device)
        if layer.pre_attn is not None:
            layer.pre_attn(x)
        h = layer.attn_norm(x)
        a = layer.attn(h, batch, kv)
        if layer.post_attn_norm is not None:
            a = layer.post_attn_norm(a)
        if placed:
            a = a.to(x.device)
        if layer.parallel or layer.ffn_norm is None:  # parallel block: attention and FFN read the layer input
            u = h if layer.ffn_norm is None else layer.ffn_norm(x)
            for observe in self.observers:
                observe(bid, u, x)
            f = layer.ffn(u, x, batch)
            return x + a + (f.to(x.device) if placed else f)
        x = x + a
        h = layer.ffn_norm(x)
        for observe in self.observers:
            observe(bid, h, x)
        f = layer.ffn(h, x, batch)
        if layer.post_ffn_norm is not None:
            f = layer.post_ffn_norm(f)
        return x + (f.to(x.device) if placed else f)
