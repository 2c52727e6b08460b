"""A span of device-resident layers for a decode step: the residual stream stays on the device from the first layer
of the span to its last, and on CUDA the span's device work is a few captured graphs replayed per step.

A layer is resident when its attention's matrices live on the pool device (`-ngl`, or the attention a sparse plan
moves): its norms, q/k/v, RoPE, attention over its KV cache on the device and output projection run there. Its FFN
is either dense on the device, or PowerInfer's hybrid: the predictor on the device picks the active neurons, the
pool computes the hot ones (`HotRows.compute`) while the CPU's C kernels compute the cold ones, and the two partial
outputs merge once per layer. The traffic between the two per hybrid layer is the FFN input and the mask to the
host and the CPU's partial output back (pinned buffers on CUDA), never weights.

A `DeviceSpan` runs B rows over static buffers: the residual (B, D), and as device tensors each row's sequence (a
row of the layers' stacked caches, (n_seq, n_ctx, H_kv, D)) and position. B = 1 over a stack of one sequence's
cache is a single sequence's decode token (`Transformer.spans_for`); a `BatchSpan` holds one DeviceSpan per batch
size (the powers of two below n_seq, and n_seq) over every sequence's cache for the server's and `batched`'s
decode steps (`Transformer.step_spans_for`): a step of n tokens runs in the smallest size >= n, the rows past n
repeating row 0 (its sequence, position and input), so they compute and write row 0's keys and values again and
their outputs are dropped; nothing else in any cache changes.

On CUDA attention is computed for positions held in device tensors (`masked_attention`): RoPE rotates by the rows
of a device copy of the layer's (cos, sin) table picked with them, each token's key and value are written into the
stacked cache at (sequence, position) through one flat row index with index_copy_, and each row reads its
sequence's whole cache (n_ctx rows) with the rows after its position masked out, so every shape is fixed. The KV
rows past a sequence's length must hold finite values (masked scores are dropped, but 0 * NaN is NaN in the product
with V): the engine allocates device-resident caches zeroed. The CPU standing in computes attention with the CPU's
one-token kernel instead, once for all rows (`ops.attend_batch`: the kernel its prompts use, so a token's bits do
not depend on how it arrived, nor on the other rows of its step); tests check masked_attention against that kernel
directly.

The span's work is cut into pieces at each hybrid layer with cold neurons: piece j runs from the merge of the
previous hybrid layer's outputs to this hybrid layer's predictor and the copies of its FFN input and mask to the
host; the hot part of that layer is a piece of its own. Per step: replay piece j, record an event, replay the hot
piece (the device computes the hot neurons), wait for the event, compute the cold neurons of the real rows on the
CPU into the pinned buffer the next piece copies in. Fixed shapes and device-side positions are what CUDA graphs
need: on CUDA each piece is captured once per batch size (after one eager run on a side stream, which compiles the
Triton kernels; the K/V rows it writes are written again, with the same values, by the replay) with
torch.cuda.CUDAGraph, rather than torch.compile(mode="reduce-overhead"): the pieces call Triton kernels and C-kernel
stand-ins that compile would have to trace or break around, and a graph needs nothing but static buffers, which
the span has anyway. Python work per step is then a few calls per hybrid layer and one replay per stretch of
device-only layers, whatever B. The CPU stand-in runs the same pieces eagerly (no capture, the copies are plain),
so CI tests the span's pieces, links, padding and order.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from powerinfer import ops
from powerinfer.model.blocks import DenseFFN, Norm
from powerinfer.model.sparse import PredictorSelector, SparseFFN

if TYPE_CHECKING:
    from powerinfer.model.specs import AttentionSpec
    from powerinfer.model.transformer import Layer

log = logging.getLogger(__name__)


def _on_device(w: object) -> bool:
    return isinstance(w, ops.DeviceWeight)


def _norm_on(norm: Norm, device: torch.device) -> Norm:
    """The norm with its weight (and bias) on `device` (a sparse plan leaves the norms on the CPU)."""
    if norm.weight.device == device and (norm.bias is None or norm.bias.device == device):
        return norm
    moved = copy.copy(norm)  # not Norm(...): an "rms_1p" weight already holds its + 1
    moved.weight = norm.weight.to(device)
    moved.bias = None if norm.bias is None else norm.bias.to(device)
    return moved


def _dense_on_device(ffn: object) -> bool:
    return (
        isinstance(ffn, DenseFFN)
        and _on_device(ffn.up)
        and (ffn.gate is None or _on_device(ffn.gate))
        and _on_device(ffn.down if ffn.down is not None else ffn.down_t)
        and ffn.gate_up is None
    )


def _hybrid(ffn: object) -> bool:
    """A predictor-selected sparse FFN whose predictor is on the device (its hot rows, if any, in the pool)."""
    return (
        isinstance(ffn, SparseFFN)
        and isinstance(ffn.selector, PredictorSelector)
        and _on_device(ffn.selector.fc1)
        and _on_device(ffn.selector.fc2)
        and ffn.gate is not None
        and not ffn.spec.bias
    )


class SpanMaker:
    """Makes the device spans of one model: which layers a span may hold, and the span of a run of them for one
    sequence's KV rows or for decode steps over every sequence's. `graphs`: capture CUDA graphs (a CUDA device);
    False runs the spans eagerly (the stand-in). `masked`: attention by masked_attention (off the CPU); False: by
    the CPU's one-token kernel (the stand-in; tests turn it on there to run the CUDA path on CPU tensors)."""

    def __init__(
        self, device: torch.device, n_ctx: int, graphs: bool | None = None, masked: bool | None = None
    ) -> None:
        self.device, self.n_ctx = torch.device(device), n_ctx
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self.masked = self.device.type != "cpu" if masked is None else masked
        self._tables: dict[int, torch.Tensor] = {}  # id of a host (cos, sin) table -> its copy on the device

    def accepts(self, layer: Layer) -> bool:
        """Whether the layer runs in a span: a plain attention (no biases, full RoPE or none, no sliding window
        within the context) with every matrix a device weight, a dense FFN on the device or a hybrid sparse FFN
        (predictor on the device), in a sequential block (no parallel attention/FFN, no post-norms, no
        pre-attention hook)."""
        attn = layer.attn
        return (
            attn.one_token_kernel
            and attn.rope_pairs is not None
            and all(_on_device(w) for w in (attn.wq, attn.wk, attn.wv, attn.wo))
            and (_dense_on_device(layer.ffn) or _hybrid(layer.ffn))
            and not layer.parallel
            and layer.ffn_norm is not None
            and layer.post_attn_norm is None
            and layer.post_ffn_norm is None
            and layer.pre_attn is None
        )

    def make(self, layers: list[Layer], slots: list[tuple[torch.Tensor, torch.Tensor]]) -> DeviceSpan:
        """The span of `layers` (each accepted) for one token of one sequence over its KV rows `slots`
        ((n_ctx, H_kv, D) each, on the device)."""
        caches = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in slots]  # a stack of one sequence
        return DeviceSpan(layers, caches, self._tables_of(layers), self.device, self.graphs, self.masked)

    def make_batch(self, layers: list[Layer], caches: list[tuple[torch.Tensor, torch.Tensor]]) -> BatchSpan:
        """The span of `layers` (each accepted) for one token of each of several sequences over every sequence's
        KV rows `caches` ((n_seq, n_ctx, H_kv, D) each, on the device)."""
        return BatchSpan(layers, caches, self._tables_of(layers), self.device, self.graphs, self.masked)

    def _tables_of(self, layers: list[Layer]) -> list[torch.Tensor]:
        """Each layer's (cos, sin) table on the device (one copy per host table)."""
        tables = []
        for layer in layers:
            pairs = layer.attn.rope_pairs
            assert pairs is not None
            table = self._tables.get(id(pairs))
            if table is None:
                table = self._tables[id(pairs)] = pairs.to(self.device, torch.float32).contiguous()
            tables.append(table)
        return tables


@dataclass(eq=False)
class _Resident:
    """One layer as the span runs it: the layer, its norms on the device, KV rows, RoPE table and hybrid link."""

    layer: Layer
    attn_norm: Norm
    ffn_norm: Norm
    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    link: _Link | None  # a hybrid FFN's (None: a dense FFN on the device)


class _Link:
    """A hybrid FFN's buffers between the device and the CPU for the span's B rows: the FFN input and the active mask
    copied to the host, the CPU's partial output copied back (pinned on CUDA), the hot neurons' ids on the device."""

    def __init__(self, ffn: SparseFFN, device: torch.device, n_rows: int) -> None:
        pinned = device.type == "cuda"
        self.ffn = ffn
        n_embd, n_ff = ffn.up.shape[1], ffn.n_ff
        hot = ffn.hot
        self.hot_ids = None if hot is None else hot.ids.to(device)
        self.hot_ids_host = None if hot is None else hot.ids
        self.has_cold = bool(ffn.cpu_rows.any())
        self.u = torch.zeros(n_rows, n_embd, dtype=torch.float32, pin_memory=pinned)
        self.mask = torch.zeros(n_rows, n_ff, dtype=torch.bool, pin_memory=pinned)
        self.y = torch.zeros(n_rows, n_embd, dtype=torch.float32, pin_memory=pinned)

    def cold(self, n: int, fill: torch.Tensor) -> None:
        """The CPU's part, once the FFN input and mask are on the host: the active cold neurons of the n real rows
        into self.y (the padding rows a copy of the row they repeat, `fill`), and the layer's counters."""
        ffn = self.ffn
        # one token: the selected rows are exactly the active ones (SparseFFN's decode)
        if self.u.shape[0] == 1:
            mask = self.mask[0]
            idx = (mask & ffn.cpu_rows).nonzero().view(-1)
            self.y.copy_(ffn.rows(self.u, idx))
            n_cpu = idx.numel()
        else:  # several: per-token masks over the union of rows (the same bits per token, SparseFFN.cold)
            cpu_active = self.mask[:n] & ffn.cpu_rows
            self.y.copy_(ffn.cold(self.u[:n], cpu_active).index_select(0, fill))
            n_cpu = int(cpu_active.sum())
        n_hot = 0 if self.hot_ids_host is None else int(self.mask[:n, self.hot_ids_host].sum())
        self._count(n, n_cpu, n_hot)

    def count_pooled(self, n: int) -> None:
        """The counters of a layer with every neuron pooled, from the n real rows of its mask's copy on the host."""
        self._count(n, 0, int(self.mask[:n].sum()))

    def _count(self, n_tokens: int, n_cpu: int, n_pool: int) -> None:
        s, b = self.ffn.stats, self.ffn.bid
        s.tokens[b] += n_tokens
        s.active[b] += n_cpu + n_pool
        s.active_gpu[b] += n_pool


class DeviceSpan:
    """Layers run on one device for B rows, one token each of up to B sequences, over static buffers: `span(x, pos)`
    (B = 1, a stack of one sequence's KV rows) takes the residual x (1, D) at position pos, `span.step(x, seqs,
    positions)` the residual (n, D) of n <= B tokens of the sequences seqs at their positions, padded to B rows;
    both return the residual after the last layer on the span's device (a buffer of the span's: read it before the
    next call)."""

    def __init__(
        self,
        layers: list[Layer],
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        tables: list[torch.Tensor],
        device: torch.device,
        graphs: bool,
        masked: bool,
        n_rows: int = 1,
    ) -> None:
        self.device, self.graphs, self.masked, self.n_rows = device, graphs, masked, n_rows
        self.residents: list[_Resident] = []
        for layer, (k, v), table in zip(layers, caches, tables, strict=True):
            if k.device != device or v.device != device:
                raise ValueError("a device span's KV rows must live on its device")
            assert layer.ffn_norm is not None
            link = _Link(layer.ffn, device, n_rows) if isinstance(layer.ffn, SparseFFN) else None
            self.residents.append(
                _Resident(
                    layer,
                    _norm_on(layer.attn_norm, device),
                    _norm_on(layer.ffn_norm, device),
                    k,
                    v,
                    table,
                    link,
                )
            )
        n_embd = layers[0].attn.wo.shape[0]
        n_ctx = caches[0][0].shape[1]
        pinned = device.type == "cuda"
        B = n_rows
        self.x = torch.zeros(B, n_embd, dtype=torch.float32, device=device)  # static input
        self.x_host = torch.zeros(B, n_embd, dtype=torch.float32, pin_memory=pinned)
        # static sequence ids (rows of the stacked caches) and positions, and their host copies
        self.seqs = torch.zeros(B, dtype=torch.int64, device=device)
        self.pos = torch.zeros(B, dtype=torch.int64, device=device)
        self.seqs_host = torch.zeros(B, dtype=torch.int64, pin_memory=pinned)
        self.pos_host = torch.zeros(B, dtype=torch.int64, pin_memory=pinned)
        self.rows = torch.arange(n_ctx, device=device)  # key positions, against pos for the mask
        # per n real rows: the row each of the B rows repeats (the n real ones, then row 0 as padding)
        self.fills = [
            torch.cat((torch.arange(n), torch.zeros(B - n, dtype=torch.int64))) for n in range(B + 1)
        ]
        self.fills_device = [f.to(device) for f in self.fills]
        self.n = 1  # real rows of the current call
        # the pieces: (device work, the hybrid link whose cold part follows it, or None after the last)
        self.pieces = self._pieces()
        self.graphs_made: list[tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = [None] * len(self.pieces)
        # recorded after a piece whose copies to the host the CPU waits for
        self.done = torch.cuda.Event() if device.type == "cuda" else None
        self.pooled_links = [r.link for r in self.residents if r.link is not None and not r.link.has_cold]

    @property
    def captured(self) -> bool:
        """Every piece of the span is a captured CUDA graph."""
        return all(g is not None for g in self.graphs_made)

    def _pieces(self) -> list[tuple[Callable[[], torch.Tensor], _Link | None, bool]]:
        """The span's device work in pieces: (run, link, hot) where run computes from the static buffers and
        returns the piece's output; after a piece with a link the CPU computes that link's cold neurons; `hot`:
        the piece is that link's hot part, queued while the CPU works."""
        pieces: list[tuple[Callable[[], torch.Tensor], _Link | None, bool]] = []
        start = 0
        state: dict[str, torch.Tensor] = {}
        for i, r in enumerate(self.residents):
            link = r.link
            if link is None or not link.has_cold:
                continue
            pieces.append((self._stretch(start, i, state, len(pieces)), link, False))
            pieces.append((self._hot(r, state, len(pieces)), None, True))
            start = i + 1
        pieces.append((self._stretch(start, len(self.residents), state, len(pieces)), None, False))
        return pieces

    def _stretch(
        self, start: int, split: int, state: dict[str, torch.Tensor], index: int
    ) -> Callable[[], torch.Tensor]:
        """Layers start..split-1 whole, then (split < len) layer split's attention, FFN input, predictor and the
        copies to the host. The stretch begins by merging the previous split layer's parts (state)."""

        def run() -> torch.Tensor:
            if index == 0:
                x = self.x
            else:  # the previous split layer: its residual after attention + (the CPU's part + its hot part), the
                # sum SparseFFN makes for several tokens (the same bits whichever way a token came)
                prev = self.residents[start - 1].link
                assert prev is not None
                x = state["x"] + (prev.y.to(self.device, non_blocking=True) + state["hot"])
            for r in self.residents[start:split]:
                x = self._layer(r, x)
            if split < len(self.residents):
                r = self.residents[split]
                x = x + self._attention(r, x)
                u = r.ffn_norm(x)
                link = r.link
                assert link is not None
                mask = link.ffn.selector.select(x)
                link.u.copy_(u, non_blocking=True)
                link.mask.copy_(mask, non_blocking=True)
                state["x"], state["u"], state["active"] = x, u, mask
            return x

        return run

    def _hot(self, r: _Resident, state: dict[str, torch.Tensor], index: int) -> Callable[[], torch.Tensor]:
        """The split layer's hot neurons' output on the device (zeros without a hot part); the CPU's part and the
        residual are added by the next stretch."""

        def run() -> torch.Tensor:
            link = r.link
            assert link is not None
            hot = link.ffn.hot
            if hot is not None and link.hot_ids is not None:
                active = state["active"].index_select(1, link.hot_ids)
                y = hot.compute(state["u"], active, link.ffn.spec.act, link.ffn.spec.relu_up)
            else:
                y = torch.zeros_like(state["x"])
            state["hot"] = y
            return y

        return run

    def _layer(self, r: _Resident, x: torch.Tensor) -> torch.Tensor:
        """A whole layer on the device: attention, then a dense FFN or a hybrid one with every neuron pooled."""
        x = x + self._attention(r, x)
        u = r.ffn_norm(x)
        link = r.link
        if link is None:
            return x + r.layer.ffn(u, x)
        hot = link.ffn.hot
        assert hot is not None and link.hot_ids is not None  # no cold neuron: the pool holds them all
        mask = link.ffn.selector.select(x)
        link.mask.copy_(mask, non_blocking=True)  # counted on the host once the span is done
        active = mask.index_select(1, link.hot_ids)
        return x + hot.compute(u, active, link.ffn.spec.act, link.ffn.spec.relu_up)

    def __call__(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """One token (B = 1) of the span's one sequence at position pos: the residual (1, D) after the span."""
        self._load_x(x)
        self.pos.fill_(pos)
        self.n = 1
        return self._run()

    def step(self, x: torch.Tensor, seqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """n <= B tokens, row i of sequence seqs[i] (a row of the stacked caches) at positions[i] (both (n,) int64 on
        the CPU): the residual (n, D) after the span. The rows past n repeat row 0 (its sequence, position and
        input), so they write row 0's keys and values again, the same values, and their outputs are dropped."""
        n = x.shape[0]
        fill = self.fills[n]
        self._load_x(x.index_select(0, fill if x.is_cpu else self.fills_device[n]))
        if self.device.type == "cpu":
            torch.index_select(seqs, 0, fill, out=self.seqs)
            torch.index_select(positions, 0, fill, out=self.pos)
        else:  # through pinned buffers: asynchronous copies
            torch.index_select(seqs, 0, fill, out=self.seqs_host)
            torch.index_select(positions, 0, fill, out=self.pos_host)
            self.seqs.copy_(self.seqs_host, non_blocking=True)
            self.pos.copy_(self.pos_host, non_blocking=True)
        self.n = n
        return self._run()[:n]

    def _load_x(self, x: torch.Tensor) -> None:
        if x.device == self.device:
            self.x.copy_(x)
        else:  # through a pinned buffer: an asynchronous copy on CUDA
            self.x_host.copy_(x)
            self.x.copy_(self.x_host, non_blocking=True)

    def _run(self) -> torch.Tensor:
        """The pieces over the static buffers, the cold parts of the hybrid layers between them."""
        out, done, n = self.x, self.done, self.n
        fill = self.fills[n]
        for index, (run, link, hot) in enumerate(self.pieces):
            if hot:  # replayed right after its stretch, below
                continue
            out = self._replay(index, run)
            if link is None:
                continue
            if done is not None:  # the FFN input and mask are on the host once the stretch is done
                done.record(torch.cuda.current_stream(self.device))
            out = self._replay(index + 1, self.pieces[index + 1][0])  # queued: the hot part meanwhile
            if done is not None:
                done.synchronize()
            link.cold(n, fill)
        if self.pooled_links:  # the layers with every neuron pooled: their masks' copies, counted
            if done is not None:
                done.record(torch.cuda.current_stream(self.device))
                done.synchronize()
            for link in self.pooled_links:
                link.count_pooled(n)
        return out

    def _replay(self, index: int, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        if not self.graphs:
            return run()
        made = self.graphs_made[index]
        if made is None:
            try:
                made = self._capture(run)
            except RuntimeError as e:  # a kernel the capture refuses: run eagerly from now on, said once
                log.warning("device span not captured as CUDA graphs (%s); it runs op by op", e)
                self.graphs = False
                return run()
            self.graphs_made[index] = made
        graph, out = made
        graph.replay()
        return out

    def _capture(self, run: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            run()  # compiles the kernels; writes this token's K/V rows (the replay writes the same)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        return graph, out

    def _attention(self, r: _Resident, x: torch.Tensor) -> torch.Tensor:
        """The layer's attention output (B, n_embd) for the rows' tokens at the positions self.pos of the sequences
        self.seqs: on CUDA over the whole cache with later rows masked (masked_attention, fixed shapes for the
        graph); on the CPU standing in, the one-token kernel the CPU's layers and prompts use, once for all rows
        (ops.attend_batch), so a token's bits do not depend on whether it came in a prompt, a decode step or a
        batch."""
        attn = r.layer.attn
        s = attn.spec
        q, k, v = attn._project(r.attn_norm(x))
        q, k = attn._qk_normed(q, k)
        if not self.masked:
            pairs = attn.rope_pairs
            assert pairs is not None
            rope = pairs.index_select(0, self.pos)
            out = ops.attend_batch(q, k, v, rope, r.k, r.v, self.seqs, self.pos, attn.kc, neox=attn.neox)
        else:
            out = masked_attention(q, k, v, r.k, r.v, r.table, self.seqs, self.pos, self.rows, s, attn.neox)
        return attn._out(out)


class BatchSpan:
    """The same layers for a decode step of several sequences, one token each: a DeviceSpan of B rows per size B
    (the powers of two below the number of sequences, and that number) over the stacked caches, made (and on CUDA
    captured) on first use; a step of n tokens runs in the smallest B >= n, its rows past n padding."""

    def __init__(
        self,
        layers: list[Layer],
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        tables: list[torch.Tensor],
        device: torch.device,
        graphs: bool,
        masked: bool,
    ) -> None:
        self.layers, self.caches, self.tables = layers, caches, tables
        self.device, self.graphs, self.masked = device, graphs, masked
        n_seq = caches[0][0].shape[0]
        self.sizes = sorted({min(1 << i, n_seq) for i in range(n_seq.bit_length() + 1)})
        self.size_of = [next(b for b in self.sizes if b >= n) for n in range(n_seq + 1)]  # n tokens -> B
        self.spans: dict[int, DeviceSpan] = {}

    def __call__(self, x: torch.Tensor, seqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (n, D): one token of each sequence seqs (n,) at positions (n,) (int64, CPU); the residual (n, D) after
        the span, on its device (a view of the span's buffer: read it before the next call)."""
        size = self.size_of[x.shape[0]]
        span = self.spans.get(size)
        if span is None:
            span = DeviceSpan(
                self.layers, self.caches, self.tables, self.device, self.graphs, self.masked, size
            )
            self.spans[size] = span
        return span.step(x, seqs, positions)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    seqs: torch.Tensor,
    pos: torch.Tensor,
    rows: torch.Tensor,
    spec: AttentionSpec,
    neox: bool,
) -> torch.Tensor:
    """B tokens' attention, row b of the sequence seqs[b] at the position pos[b] (device tensors (B,)), each over
    its sequence's whole cache with the rows after its position masked: q (B, H * D), k and v (B, H_kv * D) before
    RoPE; k_cache, v_cache (n_seq, n_ctx, H_kv, D) stacked, the rotated k and v written at (seqs[b], pos[b]) through
    one flat row index; table (n_ctx, D/2, 2) the (cos, sin) pairs, rows (n_ctx,) the key positions. (B, H * D).
    A row may repeat another's sequence, position and inputs (padding): it writes the same values."""
    H, H_kv, D = spec.n_head, spec.n_head_kv, spec.head_dim
    B = q.shape[0]
    n_seq, n_ctx = k_cache.shape[0], k_cache.shape[1]
    rot = table.index_select(0, pos)  # (B, D/2, 2)
    cos, sin = rot[..., 0], rot[..., 1]
    q = rotate(q.view(B, H, D), cos, sin, neox)
    k = rotate(k.view(B, H_kv, D), cos, sin, neox)
    flat = seqs * n_ctx + pos  # (B,) rows of the stacked caches
    k_cache.view(n_seq * n_ctx, H_kv, D).index_copy_(0, flat, k)
    v_cache.view(n_seq * n_ctx, H_kv, D).index_copy_(0, flat, v.view(B, H_kv, D))
    if n_seq == 1:  # one sequence's span: its cache read in place
        keys, values = k_cache.expand(B, -1, -1, -1), v_cache.expand(B, -1, -1, -1)
    else:
        keys, values = k_cache.index_select(0, seqs), v_cache.index_select(0, seqs)  # (B, n_ctx, H_kv, D)
    scale = spec.scale if spec.scale is not None else 1.0 / math.sqrt(D)
    qg = q.view(B, H_kv, H // H_kv, D)  # query heads grouped by the KV head they read
    scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)) * scale  # (B, H_kv, G, n_ctx)
    later = rows[None, :] > pos[:, None]  # (B, n_ctx)
    scores = scores.masked_fill(later[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # (B, H_kv, G, D)
    return out.reshape(B, H * D)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x (T, H, D) rotated by cos, sin (T, D/2): pairs (2i, 2i+1), or (i, i + D/2) with neox."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    if neox:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
