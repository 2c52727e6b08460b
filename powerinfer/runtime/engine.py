"""The engine: load a model file once, then prefill in chunks and decode one token per step."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from powerinfer import ops
from powerinfer.arch import load_model
from powerinfer.errors import InputError
from powerinfer.gguf.reader import read_gguf
from powerinfer.placement import Placement
from powerinfer.runtime.kv_cache import KVCache
from powerinfer.runtime.pool import PoolRequest, offload_dense, plan_pool, pool_device
from powerinfer.runtime.sparse_ffn import SparseFFN, SparseStats
from powerinfer.sampling import Sampler
from powerinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineOptions:
    n_ctx: int = 512  # 0: the model's training context
    n_batch: int = 512
    n_seq: int = 1  # KV cache slots: independent sequences decoded together (batched, server)
    n_threads: int | None = None
    # activations of the quant matmuls: "f32" (exact) or "q8" (int8 blocks, llama.cpp's arithmetic); None: as set
    act_precision: str | None = None
    vram_budget_gib: float | None = None
    n_gpu_layers: int = 0
    reset_gpu_index: bool = False
    disable_gpu_index: bool = False
    dense_ffn: bool = False  # PWRI files: compute every FFN neuron (no predictor)
    pool_device: str | None = None  # device of the hot-neuron pool: "cuda", "cuda:1", or "cpu" (stand-in)
    gpu_index_path: str | None = None  # use this GPU index instead of planning one


@dataclass
class Timings:
    """Wall-clock accounting in the shape of llama_print_timings."""

    load_ms: float = 0.0
    sample_ms: float = 0.0
    n_sample: int = 0
    prompt_ms: float = 0.0
    n_prompt: int = 0
    eval_ms: float = 0.0
    n_eval: int = 0
    start: float = field(default_factory=time.perf_counter)


class Engine:
    """Owns the model, tokenizer and KV cache of one sequence."""

    def __init__(self, model_path: str | os.PathLike[str], options: EngineOptions | None = None) -> None:
        t0 = time.perf_counter()
        self.options = options or EngineOptions()
        o = self.options
        if o.n_threads is not None and o.n_threads > 0:
            ops.set_num_threads(o.n_threads)
        if o.act_precision is not None:
            ops.set_activation_precision(o.act_precision)
        self.gguf = read_gguf(model_path)
        self.model = load_model(self.gguf)
        self.config = self.model.config
        self.tokenizer = Tokenizer.from_metadata(self.gguf.metadata)
        if self.tokenizer.n_vocab != self.config.n_vocab:
            raise InputError(f"tokenizer has {self.tokenizer.n_vocab} tokens, model {self.config.n_vocab}")
        self._check_device_flags()
        self.n_ctx = o.n_ctx if o.n_ctx > 0 else self.config.n_ctx_train
        if self.n_ctx > self.config.n_ctx_train:
            # positions past the training context degrade the text; take the model's own limit
            log.warning(
                "context %d exceeds the model's training context %d; using %d",
                self.n_ctx,
                self.config.n_ctx_train,
                self.config.n_ctx_train,
            )
            self.n_ctx = self.config.n_ctx_train
        self.sparse_stats: SparseStats | None = None
        self.placement: Placement | None = None
        self.pool_device: torch.device | None = None
        self.kv_device = torch.device("cpu")
        if self.gguf.is_sparse and not o.dense_ffn:
            self._setup_sparse()
        if o.n_batch <= 0:
            raise InputError(f"batch size must be positive (got {o.n_batch})")
        c = self.config
        if o.n_seq < 1:
            raise InputError(f"the number of sequences must be >= 1 (got {o.n_seq})")
        self.kv = KVCache(
            c.n_layer, self.n_ctx, c.n_head_kv, c.head_dim, n_seq=o.n_seq, device=self.kv_device
        )
        self.model.setup(self.n_ctx)
        self.n_past = 0
        self.timings = Timings(load_ms=(time.perf_counter() - t0) * 1e3)

    def _check_device_flags(self) -> None:
        o = self.options
        cuda = torch.cuda.is_available()
        if o.n_gpu_layers > 0 and self.gguf.is_sparse:
            log.warning("sparse models ignore -ngl/--n-gpu-layers; use --vram-budget instead")
        elif o.n_gpu_layers > 0 and not cuda:
            log.warning("no CUDA device: -ngl %d ignored, running on the CPU", o.n_gpu_layers)
        if o.vram_budget_gib is not None and o.vram_budget_gib >= 0 and not cuda and o.pool_device is None:
            log.warning("no CUDA device: --vram-budget ignored, running on the CPU")

    def _setup_sparse(self) -> None:
        """Replace the dense FFNs by predictor-driven sparse FFNs and carry out the pool placement."""
        c, o = self.config, self.options
        self.sparse_stats = SparseStats.zeros(c.n_layer)
        request = PoolRequest(
            o.pool_device, o.vram_budget_gib, o.gpu_index_path, o.reset_gpu_index, o.disable_gpu_index
        )
        device = pool_device(request)
        gpu_ids: list[np.ndarray | None] = [None] * c.n_layer
        if device is not None:
            self.placement, planned = plan_pool(self.gguf, self.model, request, device, self.n_ctx)
            gpu_ids = list(planned)
        self.pool_device = device
        self.model.ffns = [
            SparseFFN(c, layer.tensors, bid, gpu_ids[bid], device, self.sparse_stats)
            for bid, layer in enumerate(self.model.layers)
        ]
        if self.placement is not None and device is not None:
            if offload_dense(self.model, self.placement, device) and self.placement.kv_on_gpu:
                self.kv_device = device

    def sparse_report(self) -> list[str]:
        """Telemetry lines of sparse mode: predicted active share per layer, pool share, bytes per token."""
        s = self.sparse_stats
        if s is None or int(s.tokens.sum()) == 0:
            return []
        c = self.config
        active = (s.active / (np.maximum(s.tokens, 1) * c.n_ff)).tolist()  # per layer
        pool = float(s.active_gpu.sum()) / max(1.0, float(s.active.sum()))
        ffn_bytes = sum(
            self.gguf.tensors[n].n_bytes
            for n in self.gguf.tensors
            if n.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down_t.weight"))
        )
        per_token = self.weight_bytes - ffn_bytes + ffn_bytes * sum(active) / len(active)
        per_layer = " ".join(f"{a:.2f}" for a in active)
        lines = [
            f"sparse: predicted active {sum(active) / len(active):.1%} of FFN neurons, per layer: {per_layer}",
            f"sparse: {pool:.1%} of active neurons served by the pool"
            + (f" on {self.pool_device}" if self.pool_device is not None else " (no pool: all on the CPU)"),
            f"sparse: ~{per_token / 2**20:.1f} MiB of weights read per token "
            f"(dense: {self.weight_bytes / 2**20:.1f} MiB), predictor {s.predictor_ms:.2f} ms in total",
        ]
        if self.placement is not None:
            lines.append(f"placement: {self.placement.reason}")
        return lines

    @property
    def weight_bytes(self) -> int:
        """Bytes of tensor data in the model file (read once per decoded token)."""
        return sum(t.n_bytes for t in self.gguf.tensors.values())

    def reset(self) -> None:
        self.n_past = 0

    @torch.inference_mode()
    def eval(self, tokens: list[int]) -> torch.Tensor:
        """Run tokens through the model at the current position; returns the last token's logits (n_vocab,)."""
        if not tokens:
            raise InputError("nothing to evaluate (empty token list)")
        if self.n_past + len(tokens) > self.n_ctx:
            raise InputError(
                f"context is full: {self.n_past} + {len(tokens)} tokens exceed the context size {self.n_ctx} (-c)"
            )
        bad = [t for t in tokens if not 0 <= t < self.config.n_vocab]
        if bad:
            raise InputError(f"token id {bad[0]} is out of range for a vocabulary of {self.config.n_vocab}")
        logits = None
        step = self.options.n_batch
        for i in range(0, len(tokens), step):
            chunk = torch.tensor(tokens[i : i + step], dtype=torch.int64)
            logits = self.model.forward(chunk, self.n_past, self.kv, last_only=True)
            self.n_past += chunk.numel()
        assert logits is not None
        return logits[-1]

    @torch.inference_mode()
    def logits_all(self, tokens: list[int]) -> torch.Tensor:
        """Logits of every position for tokens evaluated from the current position, (T, n_vocab)."""
        if self.n_past + len(tokens) > self.n_ctx:
            raise InputError(f"{self.n_past + len(tokens)} tokens exceed the context size {self.n_ctx} (-c)")
        out = []
        step = self.options.n_batch
        for i in range(0, len(tokens), step):
            chunk = torch.tensor(tokens[i : i + step], dtype=torch.int64)
            out.append(self.model.forward(chunk, self.n_past, self.kv))
            self.n_past += chunk.numel()
        return torch.cat(out)

    def generate(
        self, prompt: list[int], sampler: Sampler, n_predict: int = -1, ignore_eos: bool = False
    ) -> Iterator[int]:
        """Prefill the prompt, then yield sampled tokens until EOS, n_predict tokens or a full context."""
        if len(prompt) > self.n_ctx - 4:
            raise InputError(
                f"prompt is too long ({len(prompt)} tokens, max {self.n_ctx - 4} for -c {self.n_ctx})"
            )
        tm = self.timings
        self.reset()
        t = time.perf_counter()
        logits = self.eval(prompt)
        tm.prompt_ms += (time.perf_counter() - t) * 1e3
        tm.n_prompt += len(prompt)
        history = list(prompt)
        eog = self.tokenizer.eog_ids
        n = 0
        while n_predict < 0 or n < n_predict:
            t = time.perf_counter()
            if ignore_eos and eog:
                logits = logits.clone()
                logits[list(eog)] = float("-inf")
            token = sampler(logits, history)
            tm.sample_ms += (time.perf_counter() - t) * 1e3
            tm.n_sample += 1
            if token in eog and not ignore_eos:
                return
            yield token
            n += 1
            history.append(token)
            if self.n_past >= self.n_ctx or (n_predict >= 0 and n >= n_predict):
                return
            t = time.perf_counter()
            logits = self.eval([token])
            tm.eval_ms += (time.perf_counter() - t) * 1e3
            tm.n_eval += 1
