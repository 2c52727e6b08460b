"""The generation worker: one thread owns the Engine and its Generator and runs continuous batching.

HTTP handlers build a GenRequest (prompt tokens, generation parameters, per-slot options, a sink callback)
and `submit` it. The worker admits pending requests into free KV slots between decode steps, each into the
free slot whose cached tokens share the longest prefix with its prompt (`SlotGenerator.start_request`:
prefill of the rest, first token), then advances every live sequence by one token per `Generator.step`, the
loop `main` and `batched` use too. A finished, failed or cancelled sequence frees its slot before the next
step, so a waiting request joins the running batch at once. An embedding request borrows a free slot for
one prefill.

Each request is isolated: an exception in its prefill or sampling ends that request alone (400 for a
PowerInferError, i.e. bad input, 500 otherwise) and a failed decode step ends the requests of that batch; the
worker then goes on. Anything else that goes wrong in a scheduling round fails the requests holding slots and
the loop continues, so the thread only ends through `stop`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from powerinfer.errors import PowerInferError
from powerinfer.printable import printable
from powerinfer.runtime.engine import Engine
from powerinfer.runtime.generate import Event as GenEvent
from powerinfer.runtime.generate import GenParams
from powerinfer.runtime.speculative import Speculator
from powerinfer.server.slots import SlotGenerator, SlotRequest, TokenProb

log = logging.getLogger(__name__)

__all__ = [
    "Chunk",
    "Done",
    "Failed",
    "GenParams",
    "GenRequest",
    "QueueFull",
    "SlotRequest",
    "TokenProb",
    "Worker",
]


@dataclass(frozen=True)
class Chunk:
    """New text of a running sequence (complete UTF-8 characters; text that may start a stop word is held)."""

    text: str
    n_tokens: int  # tokens generated so far
    slot: int
    probs: tuple[TokenProb, ...] = ()  # of the tokens generated since the previous chunk (when requested)


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
    n_evaluated: int = 0  # prompt tokens evaluated; the others came from the slot's cache
    probs: tuple[TokenProb, ...] = ()  # every generated token's (when requested)
    n_probs_sent: int = 0  # how many of `probs` went out with the chunks
    truncated: bool = False  # the prompt was cut or the context shifted (--context-shift)
    n_draft: int = 0  # speculative decoding: tokens drafted, and those accepted
    n_draft_accepted: int = 0


@dataclass(frozen=True)
class Failed:
    """The request could not run (status is the HTTP status the caller should answer with)."""

    status: int
    message: str


@dataclass(frozen=True)
class Embedded:
    """The pooled, L2-normalised final hidden state of an embedding request's tokens."""

    vector: list[float]
    n_prompt: int


Event = Chunk | Done | Failed | Embedded
Sink = Callable[[Event], None]


class QueueFull(PowerInferError):
    """Every slot is busy and the waiting queue is full."""


class GenRequest:
    """One generation: built by an HTTP handler, run by the worker, events delivered through `sink`."""

    def __init__(
        self,
        prompt: list[int],
        params: GenParams,
        sink: Sink,
        timeout_s: float | None = None,
        options: SlotRequest | None = None,
    ) -> None:
        self.prompt = prompt
        self.params = params
        self.options = options or SlotRequest()
        self.n_probs_sent = 0
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
class _Slot:
    """A request that holds a KV slot."""

    req: GenRequest
    slot: int
    t_start: float
    seed: int = 0


class Worker:
    """Continuous-batching generation over `engine.kv.n_seq` slots; the only thread that touches the model."""

    def __init__(self, engine: Engine, max_queue: int = 32, spec: Speculator | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.gen = SlotGenerator(engine, spec)
        self.n_slots = engine.kv.n_seq
        md = engine.gguf.metadata
        # llama.cpp's pooling types: 1 mean, 2 first token (CLS), 3 last token; none (0) and absent: mean
        self.pooling = int(md.get(f"{md.get('general.architecture', '')}.pooling_type", 1) or 1)
        self.n_ctx = engine.n_ctx
        self.max_queue = max_queue
        self.metrics = Metrics()
        self._slots: list[_Slot | None] = [None] * self.n_slots
        self._last_used = [0.0] * self.n_slots
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
            while True:
                try:
                    if not self._iterate():
                        break
                except Exception:
                    log.exception("generation worker: scheduling round failed; its requests get an error")
                    self._recover()
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
        admitted: list[_Slot] = []
        expired: list[GenRequest] = []
        with self._cond:
            while self._running and not self._pending and all(s is None for s in self._slots):
                self._cond.wait()
            if not self._running:
                return False
            # while sequences are decoding, admit one new prompt per step: its prefill stalls them once,
            # instead of once per newcomer (a burst of arrivals at an idle server is admitted at once)
            budget = 1 if any(s is not None for s in self._slots) else self.n_slots
            while self._pending and len(admitted) < budget:
                free = [i for i in range(self.n_slots) if self._slots[i] is None]
                if not free:
                    break
                req = self._pending.popleft()
                if req.cancelled.is_set():
                    self.metrics.requests_cancelled += 1
                    continue
                if req.deadline is not None and now > req.deadline:
                    expired.append(req)
                    continue
                seq = _Slot(req, self._pick_slot(req, free), time.perf_counter())
                self._slots[seq.slot] = seq
                self._last_used[seq.slot] = seq.t_start
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
            self.metrics.kv_tokens = sum(self.engine.kv.n_past)
        return True

    def _pick_slot(self, req: GenRequest, free: list[int]) -> int:
        """The free slot whose cache shares the longest prefix with the prompt (as llama-server picks);
        ties, and requests without cache_prompt, take the least recently used one."""

        def score(i: int) -> tuple[int, float]:
            reuse = self.gen.reusable(i, req.prompt) if req.options.cache_prompt and req.prompt else 0
            return reuse, -self._last_used[i]

        return max(free, key=score)

    def _recover(self) -> None:
        """After an unexpected failure: every request holding a slot ends with a 500, the slots are freed."""
        for seq in self._active():
            try:
                self._fail(seq, 500, "internal error in the generation worker")
            except Exception:  # freeing the slot failed too: forget it anyway
                log.exception("generation worker: cannot free slot %d", seq.slot)
                self.gen.live.pop(seq.slot, None)
                self._release(seq)

    def _active(self) -> list[_Slot]:
        return [s for s in self._slots if s is not None]

    def _embed(self, seq: _Slot) -> None:
        """Run an embedding request in its slot: pooled final hidden state, then free the slot."""
        t = time.perf_counter()
        prompt = seq.req.prompt
        try:
            self.gen.cached[seq.slot] = []  # its KV rows are overwritten
            h = self.engine.hidden_states(seq.slot, prompt).float()  # (T, n_embd)
            self.engine.free(seq.slot)
            v = h[0] if self.pooling == 2 else h[-1] if self.pooling == 3 else h.mean(dim=0)
            v = v / v.norm().clamp_min(1e-12)
        except Exception as e:
            self._fail_with(seq, e, "embedding")
            return
        self._release(seq)
        self.metrics.prompt_tokens_total += len(prompt)
        self.metrics.prompt_seconds_total += time.perf_counter() - t
        self.metrics.requests_total += 1
        seq.req.emit(Embedded(v.tolist(), len(prompt)))

    def _prefill(self, seq: _Slot) -> None:
        if seq.req.options.embed:
            self._embed(seq)
            return
        t = time.perf_counter()
        try:
            events = self.gen.start_request(seq.slot, seq.req.prompt, seq.req.params, seq.req.options)
        except Exception as e:  # this request fails, the others go on
            self._fail_with(seq, e, "prompt evaluation")
            return
        self.metrics.prompt_tokens_total += seq.req.options.n_evaluated
        self.metrics.prompt_seconds_total += time.perf_counter() - t
        for ev in events:
            self._deliver(ev)

    def _decode(self, active: list[_Slot]) -> None:
        t = time.perf_counter()
        try:
            events = self.gen.step(isolate=True)
        except Exception as e:  # the step's own bookkeeping failed: end the batch, keep the worker
            for seq in active:
                self._fail_with(seq, e, "decoding")
            return
        for ev in events:
            self._deliver(ev)
        self.metrics.decode_seconds_total += time.perf_counter() - t
        self.metrics.decode_steps_total += 1

    def _deliver(self, ev: GenEvent) -> None:
        """Turn a generator event into the request's Chunk / Done."""
        holder = self._slots[ev.slot]
        if holder is None or ev.seq is None:
            return
        if ev.end == "error":
            self._fail_with(holder, ev.error or RuntimeError("unknown"), "decoding")
            return
        seq = ev.seq
        if ev.token is not None:
            self.metrics.predicted_tokens_total += 1
        req = holder.req
        if ev.text:
            probs = tuple(req.options.probs[req.n_probs_sent :])
            req.n_probs_sent += len(probs)
            req.emit(Chunk(ev.text, seq.n_gen, ev.slot, probs))
        if ev.end is None:
            return
        self._release(holder)
        if ev.end == "cancelled":
            self.metrics.requests_cancelled += 1
        self.metrics.requests_total += 1
        holder.req.emit(
            Done(
                ev.end,
                seq.text,
                ev.stopping_word,
                ev.slot,
                seq.sampler.seed,
                len(seq.prompt),
                seq.n_gen,
                seq.prompt_ms,
                (time.perf_counter() - seq.t_first) * 1e3 if seq.t_first else 0.0,
                req.options.n_evaluated,
                tuple(req.options.probs),
                req.n_probs_sent,
                req.options.truncated or bool(seq.shifts),
                seq.n_draft,
                seq.n_draft_accepted,
            )
        )

    def _release(self, seq: _Slot) -> None:
        with self._cond:
            if self._slots[seq.slot] is seq:
                self._slots[seq.slot] = None

    def _fail(self, seq: _Slot, status: int, message: str) -> None:
        self.gen.drop(seq.slot)
        self._release(seq)
        self.metrics.requests_failed += 1
        seq.req.emit(Failed(status, message))

    def _fail_with(self, seq: _Slot, error: BaseException, phase: str) -> None:
        """End one request because of `error`: 400 with its message for a PowerInferError (bad input),
        500 otherwise (logged with its traceback)."""
        if isinstance(error, PowerInferError):
            self._fail(seq, 400, printable(str(error)))
            return
        log.error("generation worker: %s failed for slot %d", phase, seq.slot, exc_info=error)
        self._fail(seq, 500, f"internal error during {phase}: {type(error).__name__}")

    def _finish(self, seq: _Slot, reason: str) -> None:
        """End a sequence from outside the generator (cancelled, timed out)."""
        ev = self.gen.end(seq.slot, reason)
        if ev is None:
            self._release(seq)
        else:
            self._deliver(ev)
