"""A span of device-resident layers for one token: the residual stream stays on the device from the first layer
of the span to its last, and on CUDA the whole span is one captured graph replayed per token.

A layer is resident when every weight it computes with lives on the pool device (`-ngl`, the dense parts a plan
moves): norms, q/k/v, RoPE, attention over its KV cache on the device, output projection and a dense FFN. The span
runs the layers' own blocks (their device weights' kernels: Triton on CUDA, the C kernels on the CPU stand-in)
except for attention, which it computes for a position held in a device tensor:

- RoPE rotates by the row of a device copy of the layer's (cos, sin) table picked with that tensor (no host row
  copied per layer and token);
- the token's key and value are written into row `pos` of the cache with index_copy_;
- attention reads the whole cache (n_ctx rows) with the rows after `pos` masked out, so every shape is fixed.

Fixed shapes and a position on the device are what CUDA graphs need: the first call of a CUDA span runs it once
eagerly on a side stream (Triton compiles its kernels; the token's K/V rows are written, and the replay writes the
same values again), then captures it with torch.cuda.CUDAGraph over static input, position and output buffers, and
every call replays the graph after one host-to-device copy of the residual (through a pinned buffer) and one fill
of the position. torch.cuda.CUDAGraph rather than torch.compile(mode="reduce-overhead"): the span calls Triton
kernels and C-kernel stand-ins that compile would have to trace or break around, and a graph needs nothing but
static buffers, which the span has anyway. Python work per token is then one replay per span, whatever its layers.
The CPU stand-in runs the same `_run` eagerly (no capture), so CI tests the span's arithmetic.

The KV rows past a sequence's length must hold finite values (masked scores are dropped, but 0 * NaN is NaN in the
product with V): the engine allocates device-resident caches zeroed (runtime.kv_cache.KVCache `zeroed`).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from powerinfer import ops
from powerinfer.model.blocks import DenseFFN

if TYPE_CHECKING:
    from powerinfer.model.transformer import Layer

log = logging.getLogger(__name__)


def _on_device(w: object) -> bool:
    return w is not None and isinstance(w, ops.DeviceWeight)


class SpanMaker:
    """Makes the device spans of one model: which layers a span may hold, and the span of a run of them for one
    sequence's KV rows. `graphs`: capture CUDA graphs (a CUDA device); False runs the span eagerly (the stand-in)."""

    def __init__(self, device: torch.device, n_ctx: int, graphs: bool | None = None) -> None:
        self.device, self.n_ctx = torch.device(device), n_ctx
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        self._tables: dict[int, torch.Tensor] = {}  # id of a host (cos, sin) table -> its copy on the device

    def accepts(self, layer: Layer) -> bool:
        """Whether the layer runs whole on the device in the span's form: a plain attention (no biases, full RoPE
        or none, no sliding window within the context) and a dense FFN, every matrix a device weight, a sequential
        block (no parallel attention/FFN, no post-norms, no pre-attention hook)."""
        attn, ffn = layer.attn, layer.ffn
        return (
            attn.one_token_kernel
            and attn.rope_pairs is not None
            and all(_on_device(w) for w in (attn.wq, attn.wk, attn.wv, attn.wo))
            and isinstance(ffn, DenseFFN)
            and _on_device(ffn.up)
            and (ffn.gate is None or _on_device(ffn.gate))
            and _on_device(ffn.down if ffn.down is not None else ffn.down_t)
            and ffn.gate_up is None
            and not layer.parallel
            and layer.ffn_norm is not None
            and layer.post_attn_norm is None
            and layer.post_ffn_norm is None
            and layer.pre_attn is None
        )

    def make(self, layers: list[Layer], slots: list[tuple[torch.Tensor, torch.Tensor]]) -> DeviceSpan:
        """The span of `layers` (each accepted) over their KV rows `slots` ((n_ctx, H_kv, D) each, on the device)."""
        tables = []
        for layer in layers:
            pairs = layer.attn.rope_pairs
            assert pairs is not None
            table = self._tables.get(id(pairs))
            if table is None:
                table = self._tables[id(pairs)] = pairs.to(self.device, torch.float32).contiguous()
            tables.append(table)
        return DeviceSpan(layers, slots, tables, self.device, self.graphs)


class DeviceSpan:
    """Layers run for one token of one sequence on one device: `span(x, pos)` takes the residual x (1, D) at
    position pos (on any device) and returns it after the last layer, on the span's device (the buffer of the
    span's output: read it before the next call)."""

    def __init__(
        self,
        layers: list[Layer],
        slots: list[tuple[torch.Tensor, torch.Tensor]],
        tables: list[torch.Tensor],
        device: torch.device,
        graphs: bool,
    ) -> None:
        self.layers, self.slots, self.tables, self.device = layers, slots, tables, device
        for k, v in slots:
            if k.device != device or v.device != device:
                raise ValueError("a device span's KV rows must live on its device")
        n_embd = layers[0].attn.wo.shape[0]
        n_ctx = slots[0][0].shape[0]
        self.x = torch.zeros(1, n_embd, dtype=torch.float32, device=device)  # static input
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)  # static position
        self.rows = torch.arange(n_ctx, device=device)  # key positions, against pos for the mask
        self.graphs = graphs
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.x_host = torch.zeros(1, n_embd, dtype=torch.float32, pin_memory=device.type == "cuda")

    def __call__(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        if x.device == self.device:
            self.x.copy_(x)
        else:  # through a pinned buffer: an asynchronous copy on CUDA
            self.x_host.copy_(x)
            self.x.copy_(self.x_host, non_blocking=True)
        self.pos.fill_(pos)
        if not self.graphs:
            return self._run()
        if self.graph is None:
            try:
                self._capture()
            except RuntimeError as e:  # a kernel the capture refuses: run eagerly from now on, said once
                log.warning("device span not captured as a CUDA graph (%s); it runs op by op", e)
                self.graphs = False
                return self._run()
        assert self.graph is not None and self.out is not None
        self.graph.replay()
        return self.out

    def _capture(self) -> None:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._run()  # compiles the kernels; writes this token's K/V rows (the replay writes the same)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self._run()
        self.graph = graph

    def _run(self) -> torch.Tensor:
        x = self.x
        for layer, (k_cache, v_cache), table in zip(self.layers, self.slots, self.tables, strict=True):
            attn = layer.attn
            q, k, v = attn._project(layer.attn_norm(x))
            q, k = attn._qk_normed(q, k)
            a = self._attention(layer, q, k, v, k_cache, v_cache, table)
            x = x + attn._out(a)
            assert layer.ffn_norm is not None
            x = x + layer.ffn(layer.ffn_norm(x), x)
        return x

    def _attention(
        self,
        layer: Layer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        table: torch.Tensor,
    ) -> torch.Tensor:
        """One token's attention at the position self.pos over the whole cache, later rows masked: (1, H * D)."""
        s = layer.attn.spec
        H, H_kv, D = s.n_head, s.n_head_kv, s.head_dim
        rot = table.index_select(0, self.pos)  # (1, D/2, 2)
        cos, sin = rot[..., 0], rot[..., 1]
        q = rotate(q.view(1, H, D), cos, sin, layer.attn.neox)
        k = rotate(k.view(1, H_kv, D), cos, sin, layer.attn.neox)
        k_cache.index_copy_(0, self.pos, k)
        v_cache.index_copy_(0, self.pos, v.view(1, H_kv, D))
        scale = s.scale if s.scale is not None else 1.0 / math.sqrt(D)
        qg = q.view(H_kv, H // H_kv, D)  # query heads grouped by the KV head they read
        scores = torch.matmul(qg, k_cache.permute(1, 2, 0)) * scale  # (H_kv, G, n_ctx)
        scores = scores.masked_fill(self.rows > self.pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v_cache.transpose(0, 1))  # (H_kv, G, D)
        return out.reshape(1, H * D)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x (T, H, D) rotated by cos, sin (T, D/2): pairs (2i, 2i+1), or (i, i + D/2) with neox."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    if neox:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
