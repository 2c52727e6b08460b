"""Pipeline stages over torch.distributed: a model's layers split into ranges, one range per process.

Launched the standard way (`torchrun ... -m powerinfer main ...`): every rank runs the same command line and
reads the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Rank 0 owns the tokenizer,
sampling, the embedding, the first layer range and the output head; rank r > 0 owns one layer range and
serves rank 0's step requests until a stop message. Activations travel as a ring 0 -> 1 -> ... -> N-1 -> 0,
so each step costs one (T, n_embd) float32 transfer per stage. The head stays on rank 0 because the ring
then returns T x n_embd floats instead of T x n_vocab logits (576 vs 49152 for SmolLM2), and the head of a
tied-embedding model is the embedding matrix rank 0 maps anyway.

Each rank builds an ordinary Engine over a *stage view* of the file: the tensors of its layers renamed to local
indices 0..k-1 and the config's n_layer set to k, so the loader, the KV cache, the sparse selector and the pool
plan (under that rank's own --vram-budget) cover its layers only, and no other layer's pages are touched.

Messages, per step and micro-batch: a header int64 (4,) = (op, n tokens, a, b), then for a step the int64
(2, n) sequence ids and positions, then the float32 (n, n_embd) activation. Several sequences in one step
(batched, server slots) are cut into micro-batches by sequence, so that while rank r works on one, rank r-1
works on the next. A fork (copy a KV slot) or a context shift (runtime.context_shift) is a header alone, passed
along the ring.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import resource
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from powerinfer.errors import DistributedError, InputError
from powerinfer.gguf.constants import TensorNames
from powerinfer.gguf.reader import GGUFFile
from powerinfer.model.batch import StepBatch
from powerinfer.model.config import ModelConfig
from powerinfer.runtime.context_shift import shift_cache

if TYPE_CHECKING:
    from powerinfer.model.transformer import KVStore, Transformer


class StageEngine(Protocol):
    """What a rank > 0 serves through (`Pipeline.serve`): its engine's model and KV cache (runtime.engine.Engine,
    which imports this module)."""

    model: Transformer
    kv: KVStore


log = logging.getLogger(__name__)

OP_STOP, OP_STEP, OP_FORK, OP_SHIFT = 0, 1, 2, 3
HEADER = 4
# a worker waits for rank 0's next request without a deadline (a server may idle for hours); a dead peer
# still ends the wait at once, as its connection closes
IDLE_WAIT = timedelta(days=3650)
# architectures whose layers depend on their absolute index (Gemma 3's sliding-window pattern)
INDEX_DEPENDENT_ARCHS = ("gemma3",)


@dataclass(frozen=True)
class DistEnv:
    """The torchrun environment of this process."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> DistEnv | None:
        """The torchrun variables, None when this process was not launched as one of several ranks."""
        if "WORLD_SIZE" not in environ or "RANK" not in environ:
            return None
        try:
            world, rank = int(environ["WORLD_SIZE"]), int(environ["RANK"])
            port = int(environ.get("MASTER_PORT", "29500"))
        except ValueError:
            raise InputError("RANK, WORLD_SIZE and MASTER_PORT must be integers") from None
        if world <= 1:
            return None
        if not 0 <= rank < world:
            raise InputError(f"RANK {rank} is outside 0..{world - 1} (WORLD_SIZE {world})")
        return cls(rank, world, environ.get("MASTER_ADDR", "127.0.0.1"), port)


@dataclass(frozen=True)
class PipelineOptions:
    """split: layers per stage (None: balanced by bytes); timeout_s: how long any rank waits for a peer
    inside a step, and for the others to join; micro_batches: micro-batches per step of several sequences
    (0: one per stage)."""

    env: DistEnv
    split: tuple[int, ...] | None = None
    timeout_s: float = 60.0
    micro_batches: int = 0


def parse_split(text: str) -> tuple[int, ...]:
    """`--pipeline-split 10,12`: layers per stage, in rank order."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise InputError(f"--pipeline-split {text!r}: expected layer counts such as 10,12") from None
    if any(n <= 0 for n in counts):
        raise InputError(f"--pipeline-split {text!r}: every stage needs at least one layer")
    return counts


def pipeline_options(
    split: str | None, timeout_s: float, environ: Mapping[str, str]
) -> PipelineOptions | None:
    """The pipeline of this process from its environment and the CLI options (None: a single process)."""
    env = DistEnv.from_environ(environ)
    if timeout_s != timeout_s or timeout_s <= 0:
        raise InputError(f"--dist-timeout must be a positive number of seconds, got {timeout_s}")
    if env is None:
        if split is not None:
            log.warning("--pipeline-split ignored: not launched as several ranks (torchrun)")
        return None
    return PipelineOptions(env, parse_split(split) if split is not None else None, timeout_s)


def layer_bytes(gguf: GGUFFile, n_layer: int) -> list[int]:
    """Bytes of each layer's tensors in the file."""
    sizes = [0] * n_layer
    for name, info in gguf.tensors.items():
        if name.startswith("blk."):
            bid = int(name.split(".", 2)[1])
            if bid < n_layer:
                sizes[bid] += info.n_bytes
    return sizes


def balance(sizes: list[int], n_stages: int, first_extra: int = 0) -> tuple[int, ...]:
    """Contiguous layer counts per stage minimising the largest stage's bytes; the first stage also carries
    `first_extra` bytes (the output head rank 0 computes)."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: the least largest load of the first i layers cut into k stages
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                load = prefix[i] - prefix[j] + (first_extra if k == 1 else 0)
                value = max(best[k - 1][j], load)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], n
    for k in range(n_stages, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return tuple(reversed(counts))


def plan_stages(options: PipelineOptions, gguf: GGUFFile, config: ModelConfig) -> list[range]:
    """Every rank's layer range: the explicit split, checked, or one balanced by bytes."""
    n_layer, n_stages = config.n_layer, options.env.world_size
    if config.arch in INDEX_DEPENDENT_ARCHS:
        raise InputError(f"pipeline stages do not support the {config.arch} architecture yet")
    if n_stages > n_layer:
        raise InputError(f"{n_stages} pipeline stages (WORLD_SIZE) but the model has only {n_layer} layers")
    split = options.split
    if split is None:
        head = gguf.tensors.get(TensorNames.OUTPUT) or gguf.tensors.get(TensorNames.TOKEN_EMBD)
        split = balance(layer_bytes(gguf, n_layer), n_stages, head.n_bytes if head is not None else 0)
    if len(split) != n_stages:
        raise InputError(f"--pipeline-split gives {len(split)} stages, but WORLD_SIZE is {n_stages}")
    if sum(split) != n_layer:
        shown = ",".join(map(str, split))
        raise InputError(f"--pipeline-split {shown} covers {sum(split)} layers, the model has {n_layer}")
    ranges, start = [], 0
    for n in split:
        ranges.append(range(start, start + n))
        start += n
    return ranges


def stage_view(gguf: GGUFFile, config: ModelConfig, layers: range) -> tuple[GGUFFile, ModelConfig]:
    """The file as a model of `layers` only: their tensors renamed blk.{i} -> blk.{i - start}, other layers'
    tensors left out (never mapped into a weight, so their pages are never read), n_layer = len(layers)."""
    view = object.__new__(GGUFFile)  # the same parsed file (metadata, mapping), another tensor table
    view.__dict__.update(gguf.__dict__)
    tensors = {}
    for name, info in gguf.tensors.items():
        if not name.startswith("blk."):
            tensors[name] = info
            continue
        _, bid, rest = name.split(".", 2)
        if int(bid) in layers:
            tensors[f"blk.{int(bid) - layers.start}.{rest}"] = info
    view.tensors = tensors
    fields: dict[str, Any] = {"n_layer": len(layers)}
    if config.sparse_thresholds:
        fields["sparse_thresholds"] = config.sparse_thresholds[layers.start : layers.stop]
    return view, dataclasses.replace(config, **fields)


@dataclass(frozen=True)
class Stage:
    """This rank's part of the pipeline."""

    options: PipelineOptions
    ranges: tuple[range, ...]

    @property
    def rank(self) -> int:
        return self.options.env.rank

    @property
    def layers(self) -> range:
        return self.ranges[self.rank]

    @property
    def n_stages(self) -> int:
        return len(self.ranges)

    def describe(self) -> str:
        shown = ", ".join(f"rank {r}: layers {x.start}-{x.stop - 1}" for r, x in enumerate(self.ranges))
        return f"pipeline: {self.n_stages} stages ({shown})"


def plan_stage(options: PipelineOptions, gguf: GGUFFile, config: ModelConfig) -> Stage:
    return Stage(options, tuple(plan_stages(options, gguf, config)))


def _cause(error: BaseException, timeout_s: float) -> str:
    text = str(error)
    if "Connection closed" in text or "Connection reset" in text or "Broken pipe" in text:
        return "its connection closed (the process exited or was killed)"
    if "Timed out" in text or "timed out" in text or "Timeout" in text:
        return f"no answer within {timeout_s:g} s (--dist-timeout)"
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__


class Pipeline:
    """This rank's end of the ring: rank 0 drives steps (`forward`, `fork`, `close`), other ranks `serve`."""

    def __init__(self, stage: Stage, n_embd: int, gguf: GGUFFile) -> None:
        self.stage = stage
        self.model_path = gguf.path
        self.gguf = gguf  # keeps the mapping alive until `close` reports its resident pages
        self.rank = stage.rank
        self.n_stages = stage.n_stages
        self.n_embd = n_embd
        env = stage.options.env
        self.timeout_s = stage.options.timeout_s
        self.timeout = timedelta(seconds=self.timeout_s)
        self.next = (self.rank + 1) % self.n_stages
        self.prev = (self.rank - 1) % self.n_stages
        self.broken = False
        self.closed = False
        self.bytes_sent = 0  # by this rank
        self.ring_bytes = 0  # rank 0: by every rank, all hops of the ring
        self.n_micro = stage.options.micro_batches or self.n_stages
        where = f"{env.master_addr}:{env.master_port}"
        try:
            url = f"tcp://{where}?rank={env.rank}&world_size={env.world_size}"
            if ":" in env.master_addr:  # an IPv6 literal
                url = (
                    f"tcp://[{env.master_addr}]:{env.master_port}?rank={env.rank}&world_size={env.world_size}"
                )
            store, _, _ = next(dist.rendezvous(url, timeout=self.timeout))
        except (RuntimeError, ValueError, OSError) as e:
            who = "the other ranks did not join" if self.rank == 0 else f"cannot reach the master {where}"
            raise DistributedError(
                f"pipeline rank {self.rank}: {who} within {self.timeout_s:g} s ({_cause(e, self.timeout_s)})"
            ) from None
        self.store = dist.PrefixStore("powerinfer/pipeline", store)
        try:
            self.group = dist.ProcessGroupGloo(self.store, self.rank, self.n_stages, self.timeout)
            self.store.set(f"host/{self.rank}", socket.gethostname())
            self.hosts = [self.store.get(f"host/{r}").decode() for r in range(self.n_stages)]
        except (RuntimeError, ValueError, OSError) as e:
            raise DistributedError(
                f"pipeline rank {self.rank}: cannot connect the ranks: {_cause(e, self.timeout_s)}"
            ) from None
        self._handshake()
        if self.rank == 0:
            atexit.register(self.close)

    # ------------------------------------------------------------------ transport
    def _fail(self, error: BaseException, peer: int, what: str) -> DistributedError:
        """The error of a failed transfer with `peer`, or the failure another rank saw first: a rank whose
        neighbour died exits too, and the ranks after it should name the neighbour, not it."""
        self.broken = True
        message = f"pipeline rank {peer} ({self.hosts[peer]}): {_cause(error, self.timeout_s)}, while {what}"
        try:  # the store lives with rank 0 (or torchrun's agent) and may be gone as well
            self.store.set_timeout(timedelta(seconds=min(5.0, self.timeout_s)))
            message = self.store.compare_set("failure", "", message).decode() or message
        except (RuntimeError, ValueError, OSError):
            pass
        return DistributedError(message)

    def _send(self, t: torch.Tensor, peer: int, what: str) -> dist.Work:
        try:
            work = self.group.send([t], peer, 0)
        except RuntimeError as e:
            raise self._fail(e, peer, what) from None
        self.bytes_sent += t.nbytes
        return work

    def _recv(self, t: torch.Tensor, peer: int, what: str, timeout: timedelta | None = None) -> torch.Tensor:
        try:
            self.group.recv([t], peer, 0).wait(timeout or self.timeout)
        except RuntimeError as e:
            raise self._fail(e, peer, what) from None
        return t

    def _wait(self, works: list[dist.Work], peer: int, what: str) -> None:
        try:
            for w in works:
                w.wait(self.timeout)
        except RuntimeError as e:
            raise self._fail(e, peer, what) from None

    def _handshake(self) -> None:
        """Every rank tells rank 0 its layer range and width: different files or splits on different hosts
        fail here, with one line, instead of computing garbage."""
        mine = torch.tensor([self.stage.layers.start, self.stage.layers.stop, self.n_embd, self.n_stages])
        if self.rank != 0:
            self._wait([self._send(mine, 0, "joining")], 0, "joining")
            return
        for r in range(1, self.n_stages):
            got = self._recv(torch.zeros(4, dtype=torch.int64), r, "joining").tolist()
            want = [self.stage.ranges[r].start, self.stage.ranges[r].stop, self.n_embd, self.n_stages]
            if got != want:
                raise DistributedError(
                    f"pipeline rank {r} ({self.hosts[r]}) has layers {got[0]}..{got[1] - 1}, width {got[2]} and "
                    f"{got[3]} stages; rank 0 expects layers {want[0]}..{want[1] - 1}, width {want[2]} and "
                    f"{want[3]} stages (same model file and --pipeline-split on every host?)"
                )

    def _header(self, op: int, n: int = 0, a: int = 0, b: int = 0) -> torch.Tensor:
        return torch.tensor([op, n, a, b], dtype=torch.int64)

    # ------------------------------------------------------------------ rank 0
    def _parts(self, batch: StepBatch) -> list[StepBatch]:
        """The batch cut into micro-batches of whole segments (one per sequence), about equal in tokens."""
        segments = batch.segments
        n_parts = min(self.n_micro, len(segments))
        if n_parts <= 1:
            return [batch]
        total = batch.n_tokens
        bounds: list[int] = []  # the token where each part but the last ends
        for i, seg in enumerate(segments[:-1]):
            end = seg.start + seg.n
            parts_left = n_parts - len(bounds) - 1
            if parts_left == 0:
                break
            if end >= total * (len(bounds) + 1) / n_parts or len(segments) - i - 1 == parts_left:
                bounds.append(end)
        seq_ids, tokens, positions = batch.seq_ids.tolist(), batch.tokens.tolist(), batch.positions.tolist()
        starts = [0, *bounds]
        ends = [*bounds, total]
        return [
            StepBatch.build(seq_ids[a:b], tokens[a:b], positions[a:b])
            for a, b in zip(starts, ends, strict=True)
        ]

    def forward(
        self, model: Transformer, batch: StepBatch, kv: KVStore, rows: slice | torch.Tensor | None
    ) -> torch.Tensor:
        """Rank 0's step: embed and run its layers per micro-batch, send each on, collect the last stage's
        residual streams and apply the head. Logits as Transformer.forward returns them."""
        if self.broken:
            raise DistributedError("the pipeline failed earlier; restart every rank")
        parts = self._parts(batch)
        sends: list[dist.Work] = []
        for part in parts:
            x = model.forward_layers(model.embedding(part), part, kv)
            sends += self._send_step(part, x)
        outs = []
        for part in parts:
            y = torch.empty(part.n_tokens, self.n_embd)
            outs.append(self._recv(y, self.prev, "waiting for the last stage's activations"))
            self.ring_bytes += y.nbytes
        self._wait(sends, self.next, "sending activations")
        x = outs[0] if len(outs) == 1 else torch.cat(outs)
        return model.logits(x, rows)

    def _send_step(self, batch: StepBatch, x: torch.Tensor) -> list[dist.Work]:
        n = batch.n_tokens
        meta = torch.stack([batch.seq_ids, batch.positions])  # (2, n)
        x = x.to("cpu", torch.float32).contiguous()  # (n, D)
        what = "sending activations"
        works = [
            self._send(self._header(OP_STEP, n), self.next, what),
            self._send(meta, self.next, what),
            self._send(x, self.next, what),
        ]
        self.ring_bytes += (HEADER * 8 + meta.nbytes + x.nbytes) * (self.n_stages - 1)
        return works

    def fork(self, src: int, dst: int, n: int) -> None:
        """Copy a KV slot on every other stage."""
        if self.broken:
            raise DistributedError("the pipeline failed earlier; restart every rank")
        self._wait(
            [self._send(self._header(OP_FORK, n, src, dst), self.next, "forking")], self.next, "forking"
        )

    def shift(self, seq: int, n_keep: int, n_discard: int) -> None:
        """Shift a KV slot's context on every other stage (runtime.context_shift)."""
        if self.broken:
            raise DistributedError("the pipeline failed earlier; restart every rank")
        header = self._header(OP_SHIFT, seq, n_keep, n_discard)
        self._wait([self._send(header, self.next, "shifting")], self.next, "shifting")

    def close(self) -> None:
        """Rank 0: tell every stage to stop (once; nothing after a failure)."""
        if self.closed or self.broken:
            return
        self.closed = True
        try:
            self._wait([self._send(self._header(OP_STOP), self.next, "stopping")], self.next, "stopping")
        except DistributedError as e:
            log.warning("%s", e)
        log.info("%s", memory_report(self.model_path, self.rank))

    # ------------------------------------------------------------------ ranks > 0
    def serve(self, engine: StageEngine) -> int:
        """Run rank 0's requests through this stage's layers until the stop message; the number of steps."""
        model, kv = engine.model, engine.kv
        last = self.next == 0
        header = torch.empty(HEADER, dtype=torch.int64)
        pending: list[dist.Work] = []
        n_steps = 0
        with torch.inference_mode():
            while True:
                self._recv(header, self.prev, "waiting for the next step", IDLE_WAIT)
                op, n, a, b = header.tolist()
                if op == OP_STOP:
                    if not last:
                        pending.append(self._send(header.clone(), self.next, "stopping"))
                    self._wait(pending, self.next, "stopping")
                    log.info("%s", memory_report(self.model_path, self.rank))
                    return n_steps
                if op == OP_FORK:
                    kv.copy_slot(a, b, n)  # type: ignore[attr-defined]
                    if not last:
                        pending.append(self._send(header.clone(), self.next, "forking"))
                    continue
                if op == OP_SHIFT:  # (op, sequence, n_keep, n_discard)
                    shift_cache(model, kv, n, a, b)  # type: ignore[arg-type]
                    if not last:
                        pending.append(self._send(header.clone(), self.next, "shifting"))
                    continue
                if op != OP_STEP or n <= 0:
                    raise DistributedError(f"pipeline rank {self.prev}: unknown message {op} ({n} tokens)")
                meta = self._recv(torch.empty(2, n, dtype=torch.int64), self.prev, "receiving a step")
                x = self._recv(torch.empty(n, self.n_embd), self.prev, "receiving activations")
                seq_ids, positions = meta.tolist()
                batch = StepBatch.build(seq_ids, [0] * n, positions)
                y = model.forward_layers(x, batch, kv).to("cpu", torch.float32).contiguous()
                for seg in batch.segments:
                    kv.n_past[seg.seq] = seg.pos + seg.n  # type: ignore[attr-defined]
                done = [w for w in pending if w.is_completed()]
                self._wait(done, self.next, "sending activations")
                pending = [w for w in pending if w not in done]
                if not last:
                    pending.append(self._send(header.clone(), self.next, "sending activations"))
                    pending.append(self._send(meta, self.next, "sending activations"))
                pending.append(self._send(y, self.next, "sending activations"))
                n_steps += 1


def mapped_resident_bytes(path: str) -> int | None:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps; None where unreadable)."""
    target = os.path.realpath(path)
    total, inside = 0, False
    try:
        with open("/proc/self/smaps", encoding="utf-8", errors="replace") as f:
            for line in f:
                head = line.split(None, 5)
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                    inside = len(head) == 6 and head[5].strip() == target
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return total


def memory_report(path: str, rank: int) -> str:
    """Peak RSS of this rank and how much of the model file it has resident."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    resident = mapped_resident_bytes(path)
    shown = "unknown" if resident is None else f"{resident / 2**20:.1f} MiB"
    return (
        f"pipeline rank {rank}: peak RSS {peak / 2**20:.1f} MiB, model file pages resident {shown} "
        f"of {os.path.getsize(path) / 2**20:.1f} MiB"
    )


def connect(stage: Stage, config: ModelConfig, gguf: GGUFFile) -> Pipeline:
    """Join the other ranks (rendezvous at MASTER_ADDR:MASTER_PORT, then a gloo group over TCP)."""
    return Pipeline(stage, config.n_embd, gguf)
