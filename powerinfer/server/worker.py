"""The generation worker: one thread owns the Engine and its BatchDecoder and runs continuous batching.

HTTP handlers build a GenRequest (prompt tokens, sampling, limits, a sink callback) and `submit` it.
The worker admits pending requests into free KV slots between decode steps (prefill, first token), then
advances every active sequence by one token per `BatchDecoder.step`. A finished, failed or cancelled
sequence frees its slot before the next step, so a waiting request joins the running batch at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from powerinfer.errors import PowerInferError
from powerinfer.runtime.batch import BatchDecoder
from powerinfer.runtime.engine import Engine
from powerinfer.sampling import Sampler, SamplingParams
from powerinfer.tokenizer import StreamDecoder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenParams:
    """What to generate: sampling, a token limit (-1: until end of sequence or a full context) and stops."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    n_predict: int = -1
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); -inf bans the token


@dataclass(frozen=True)
class Chunk:
    """New text of a running sequence (complete UTF-8 characters; text that may start a stop word is held)."""

    text: str
    n_tokens: int  # tokens generated so far
    slot: int


@dataclass(frozen=True)
class Done:
    """The end of a sequence. reason: eos | stop | length | cancelled | timeout."""

    reason: str
    text: str  # the whole generated text (without the stop word)
    stopping_word: str
    slot: int
    seed: int
    n_prompt: int
    n_predicted: int
    prompt_ms: float
    predicted_ms: float


@dataclass(frozen=True)
class Failed:
    """The request could not run (status is the HTTP status the caller should answer with)."""

    status: int
    message: str


Event = Chunk | Done | Failed
Sink = Callable[[Event], None]


class QueueFull(PowerInferError):
    """Every slot is busy and the waiting queue is full."""


class GenRequest:
    """One generation: built by an HTTP handler, run by the worker, events delivered through `sink`."""

    def __init__(
        self, prompt: list[int], params: GenParams, sink: Sink, timeout_s: float | None = None
    ) -> None:
        self.prompt = prompt
        self.params = params
        self.sink = sink
        self.created = time.perf_counter()
        self.deadline = None if timeout_s is None or timeout_s <= 0 else self.created + timeout_s
        self.cancelled = threading.Event()

    def emit(self, event: Event) -> None:
        try:
            self.sink(event)
        except RuntimeError:  # the receiving event loop is closed (server shutting down)
            self.cancelled.set()


@dataclass
class Metrics:
    """Counters of the worker, read by /metrics and /health."""

    requests_total: int = 0  # finished sequences (any reason)
    requests_failed: int = 0
    requests_rejected: int = 0  # 503: queue full
    requests_cancelled: int = 0
    prompt_tokens_total: int = 0
    prompt_seconds_total: float = 0.0
    predicted_tokens_total: int = 0
    decode_seconds_total: float = 0.0  # wall time of batched decode steps (incl. sampling)
    decode_steps_total: int = 0
    processing: int = 0
    deferred: int = 0
    kv_tokens: int = 0


@dataclass
class _Seq:
    """A request that holds a KV slot."""

    req: GenRequest
    slot: int
    sampler: Sampler
    decoder: StreamDecoder
    history: list[int]
    t_start: float
    prompt_ms: float = 0.0
    t_first: float = 0.0
    n_gen: int = 0
    last_token: int = -1
    text: str = ""
    sent: int = 0  # characters of `text` already emitted
    bias: torch.Tensor | None = None  # (n_vocab,) additive logit bias


def _stop_holdback(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop word."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class Worker:
    """Continuous-batching generation over `engine.kv.n_seq` slots; the only thread that touches the model."""

    def __init__(self, engine: Engine, max_queue: int = 32) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.batch = BatchDecoder(engine)
        self.n_slots = self.batch.n_seq
        self.n_ctx = engine.n_ctx
        self.max_queue = max_queue
        self.metrics = Metrics()
        self._slots: list[_Seq | None] = [None] * self.n_slots
        self._pending: deque[GenRequest] = deque()
        self._cond = threading.Condition()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="powerinfer-worker", daemon=True)

    # ------------------------------------------------------------------ called from HTTP threads
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, req: GenRequest) -> None:
        """Queue a request; raises QueueFull when every slot is busy and `max_queue` requests already wait."""
        with self._cond:
            if not self._running:
                raise QueueFull("the server is shutting down")
            free = sum(s is None for s in self._slots)
            if len(self._pending) - free >= self.max_queue:
                self.metrics.requests_rejected += 1
                raise QueueFull(
                    f"all {self.n_slots} slots are busy and {self.max_queue} requests are waiting"
                )
            self._pending.append(req)
            self.metrics.deferred = len(self._pending)
            self._cond.notify()

    def cancel(self, req: GenRequest) -> None:
        """Drop a request (client gone): out of the queue now, out of its slot before the next decode step."""
        req.cancelled.set()
        with self._cond:
            if req in self._pending:
                self._pending.remove(req)
                self.metrics.deferred = len(self._pending)
                self.metrics.requests_cancelled += 1
            self._cond.notify()

    def slots_busy(self) -> int:
        with self._cond:
            return sum(s is not None for s in self._slots)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker: waiting and running requests end with an error event."""
        with self._cond:
            self._running = False
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the worker thread
    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        finally:
            with self._cond:
                pending, self._pending = list(self._pending), deque()
                active = [s for s in self._slots if s is not None]
                self._slots = [None] * self.n_slots
            for req in pending + [s.req for s in active]:
                req.emit(Failed(503, "the server is shutting down"))

    def _iterate(self) -> bool:
        """One scheduling round: admit, drop cancelled/expired, one decode step. False when stopping."""
        now = time.perf_counter()
        admitted: list[_Seq] = []
        expired: list[GenRequest] = []
        with self._cond:
            while self._running and not self._pending and all(s is None for s in self._slots):
                self._cond.wait()
            if not self._running:
                return False
            # while sequences are decoding, admit one new prompt per step: its prefill stalls them once,
            # instead of once per newcomer (a burst of arrivals at an idle server is admitted at once)
            budget = 1 if any(s is not None for s in self._slots) else self.n_slots
            for i in range(self.n_slots):
                while self._slots[i] is None and self._pending and len(admitted) < budget:
                    req = self._pending.popleft()
                    if req.cancelled.is_set():
                        self.metrics.requests_cancelled += 1
                        continue
                    if req.deadline is not None and now > req.deadline:
                        expired.append(req)
                        continue
                    seq = self._new_seq(req, i)
                    self._slots[i] = seq
                    admitted.append(seq)
            if expired and self._pending:  # expired requests further back in the queue
                keep = deque(r for r in self._pending if r.deadline is None or now <= r.deadline)
                expired += [r for r in self._pending if r not in keep]
                self._pending = keep
            self.metrics.deferred = len(self._pending)
        for req in expired:
            self.metrics.requests_failed += 1
            req.emit(Failed(503, "timed out waiting for a free slot"))
        for seq in admitted:
            self._prefill(seq)
        for seq in self._active():
            if seq.req.cancelled.is_set():
                self._finish(seq, "cancelled")
            elif seq.req.deadline is not None and now > seq.req.deadline:
                self._finish(seq, "timeout")
        active = self._active()
        if active:
            self._decode(active)
        with self._cond:
            self.metrics.processing = sum(s is not None for s in self._slots)
            self.metrics.kv_tokens = sum(self.batch.n_past)
        return True

    def _active(self) -> list[_Seq]:
        return [s for s in self._slots if s is not None]

    def _new_seq(self, req: GenRequest, slot: int) -> _Seq:
        sampler = Sampler(req.params.sampling)
        bias = None
        if req.params.logit_bias:
            bias = torch.zeros(self.engine.config.n_vocab)
            for tid, b in req.params.logit_bias:
                bias[tid] += b
        return _Seq(
            req,
            slot,
            sampler,
            StreamDecoder(self.tokenizer),
            list(req.prompt),
            time.perf_counter(),
            bias=bias,
        )

    def _prefill(self, seq: _Seq) -> None:
        self.batch.free(seq.slot)
        t = time.perf_counter()
        try:
            logits = self.batch.prefill(seq.slot, seq.req.prompt)
        except PowerInferError as e:
            self._fail(seq, 400, str(e))
            return
        except Exception as e:  # keep serving the other requests
            log.exception("prefill failed")
            self._fail(seq, 500, f"internal error during prompt evaluation: {type(e).__name__}")
            return
        seq.prompt_ms = (time.perf_counter() - t) * 1e3
        self.metrics.prompt_tokens_total += len(seq.req.prompt)
        self.metrics.prompt_seconds_total += seq.prompt_ms / 1e3
        seq.t_first = time.perf_counter()
        if seq.req.params.n_predict == 0:
            self._finish(seq, "length")
            return
        self._accept(seq, logits)

    def _decode(self, active: list[_Seq]) -> None:
        t = time.perf_counter()
        try:
            logits = self.batch.step([s.slot for s in active], [s.last_token for s in active])
        except Exception as e:
            log.exception("decode step failed")
            for seq in active:
                self._fail(seq, 500, f"internal error during decoding: {type(e).__name__}")
            return
        for seq, row in zip(active, logits, strict=True):
            self._accept(seq, row)
        self.metrics.decode_seconds_total += time.perf_counter() - t
        self.metrics.decode_steps_total += 1

    def _accept(self, seq: _Seq, logits: torch.Tensor) -> None:
        """Sample the next token of `seq` from its logits (n_vocab,), emit text, finish if a limit is hit."""
        p = seq.req.params
        eog = self.tokenizer.eog_ids
        if seq.bias is not None:
            logits = logits.float() + seq.bias
        if p.ignore_eos and eog:
            logits = logits.clone()
            logits[list(eog)] = float("-inf")
        token = seq.sampler(logits, seq.history)
        if token in eog and not p.ignore_eos:
            self._finish(seq, "eos")
            return
        seq.history.append(token)
        seq.n_gen += 1
        self.metrics.predicted_tokens_total += 1
        seq.text += seq.decoder.feed(token)
        if p.stop:
            hits = [(i, s) for s in p.stop if (i := seq.text.find(s, max(0, seq.sent - len(s)))) >= 0]
            if hits:
                at, word = min(hits)
                seq.text = seq.text[:at]
                self._finish(seq, "stop", word)
                return
        end = len(seq.text) - _stop_holdback(seq.text, p.stop)
        if end > seq.sent:
            seq.req.emit(Chunk(seq.text[seq.sent : end], seq.n_gen, seq.slot))
            seq.sent = end
        if (p.n_predict >= 0 and seq.n_gen >= p.n_predict) or self.batch.n_past[seq.slot] >= self.n_ctx:
            self._finish(seq, "length")
            return
        seq.last_token = token

    def _release(self, seq: _Seq) -> None:
        self.batch.free(seq.slot)
        with self._cond:
            if self._slots[seq.slot] is seq:
                self._slots[seq.slot] = None

    def _fail(self, seq: _Seq, status: int, message: str) -> None:
        self._release(seq)
        self.metrics.requests_failed += 1
        seq.req.emit(Failed(status, message))

    def _finish(self, seq: _Seq, reason: str, stopping_word: str = "") -> None:
        self._release(seq)
        if reason != "stop":
            seq.text += seq.decoder.flush()
        if len(seq.text) > seq.sent:
            seq.req.emit(Chunk(seq.text[seq.sent :], seq.n_gen, seq.slot))
            seq.sent = len(seq.text)
        if reason == "cancelled":
            self.metrics.requests_cancelled += 1
        self.metrics.requests_total += 1
        now = time.perf_counter()
        seq.req.emit(
            Done(
                reason,
                seq.text,
                stopping_word,
                seq.slot,
                seq.sampler.seed,
                len(seq.req.prompt),
                seq.n_gen,
                seq.prompt_ms,
                (now - seq.t_first) * 1e3 if seq.t_first else 0.0,
            )
        )
