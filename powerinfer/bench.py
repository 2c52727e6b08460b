"""Prompt and decode speed measured as llama.cpp's llama-bench measures it.

A run is the cartesian product models x n_batch x activation precision x threads x tests, where each -p value
> 0 is a prompt test (ppN: N tokens evaluated from an empty cache in batches of n_batch) and each -n value > 0
a generation test (tgN: N tokens decoded one at a time from an empty cache). Each test runs once to warm up
(a tg test: one token), then `repetitions` timed times; a result holds the per-repetition nanoseconds and
derives tokens/s and their sample standard deviation. Token ids are a fixed sequence away from the special
ids, so no tokenizer is involved. One engine serves the consecutive tests of one (model, n_batch, precision,
threads).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from powerinfer.errors import InputError
from powerinfer.gguf.constants import Keys, TensorNames
from powerinfer.gguf.reader import GGUFFile, read_gguf
from powerinfer.printable import printable
from powerinfer.quant.types import FTYPE_GUESSED, FTYPES, guess_ftype
from powerinfer.runtime.defaults import DEFAULT_ACT_PRECISION

if TYPE_CHECKING:
    import torch

    from powerinfer.runtime.engine import Engine, EngineOptions
    from powerinfer.runtime.report import PoolSummary

SIZE_SCALES = ((1e12, "T"), (1e9, "B"), (1e6, "M"))
# predictor tensors of PowerInfer files: counted in params and size, left out of the size class so that a
# sparse file and its dense twin get the same class
PREDICTOR_SUFFIXES = tuple(
    "." + template.split(".", 2)[2] for template in (TensorNames.PRED_FC1, TensorNames.PRED_FC2)
)


@dataclass(frozen=True)
class ModelInfo:
    """What a bench row says about a model file, read from its GGUF header."""

    path: Path
    arch: str
    size_class: str  # general.size_label, else the weight count in its notation ("8.4M", "1.1B")
    ftype_name: str  # llama.cpp's file type name (llama_model_ftype_name; powerinfer.quant.types.FTYPES)
    sparse: bool  # a PowerInfer (PWRI) file: predictor-selected sparse FFN
    size_bytes: int  # tensor data bytes
    n_params: int  # elements of every tensor
    n_ctx_train: int
    n_vocab: int

    @property
    def description(self) -> str:
        """llama-bench's model_type: architecture, size class and file type name ("llama 1B " then the name), with
        " sparse" for PowerInfer files."""
        return f"{self.arch} {self.size_class} {self.ftype_name}" + (" sparse" if self.sparse else "")


def size_class(n_params: int) -> str:
    """A weight count in the notation of GGUF's general.size_label (convert_hf_to_gguf): at least two
    significant digits, suffix K, M, B or T."""
    scale, suffix = next(((s, x) for s, x in SIZE_SCALES if n_params > s), (1e3, "K"))
    scaled = n_params / scale
    digits = max(2 - len(str(round(scaled)).lstrip("0")), 0)
    return f"{scaled:.{digits}f}{suffix}"


def ftype_name(gguf: GGUFFile) -> str:
    """general.file_type as llama.cpp names it; without the key, llama.cpp's guess from the type most tensors
    have, marked "(guessed)"."""
    value = gguf.metadata.get(Keys.FILE_TYPE)
    if not isinstance(value, int) or isinstance(value, bool):
        value = guess_ftype(t.ggml_type for t in gguf.tensors.values())
    name = FTYPES.get(value & ~FTYPE_GUESSED, "unknown, may not work")
    return name + (" (guessed)" if value & FTYPE_GUESSED else "")


def model_info(path: Path) -> ModelInfo:
    """Read a model file's header and check it as the engine would (FormatError / ConfigError otherwise)."""
    from powerinfer.arch import load_config

    gguf = read_gguf(path)
    config = load_config(gguf)
    n_params = sum(t.n_elements for t in gguf.tensors.values())
    label = gguf.metadata.get("general.size_label")
    if not isinstance(label, str) or not label.strip():
        weights = sum(t.n_elements for t in gguf.tensors.values() if not t.name.endswith(PREDICTOR_SUFFIXES))
        label = size_class(weights)
    return ModelInfo(
        path=path,
        arch=printable(str(gguf.metadata.get(Keys.ARCHITECTURE)), 40),
        size_class=printable(label.strip(), 20),
        ftype_name=ftype_name(gguf),
        sparse=gguf.is_sparse,
        size_bytes=sum(t.n_bytes for t in gguf.tensors.values()),
        n_params=n_params,
        n_ctx_train=config.n_ctx_train,
        n_vocab=config.n_vocab,
    )


@dataclass(frozen=True)
class BenchTest:
    """One row: a model, the engine settings and either a prompt test (n_gen 0) or a generation test."""

    model: int  # index into the run's models
    n_batch: int
    act_precision: str
    n_threads: int
    n_prompt: int
    n_gen: int

    @property
    def name(self) -> str:
        """llama-bench's test name: ppN or tgN."""
        return f"pp{self.n_prompt}" if self.n_prompt else f"tg{self.n_gen}"

    @property
    def n_tokens(self) -> int:
        return self.n_prompt + self.n_gen

    @property
    def engine_key(self) -> tuple[int, int, str, int]:
        return (self.model, self.n_batch, self.act_precision, self.n_threads)


@dataclass(frozen=True)
class BenchParams:
    """The value lists of one run (each flag's values in the order given)."""

    models: tuple[ModelInfo, ...]
    n_prompt: tuple[int, ...] = (512,)
    n_gen: tuple[int, ...] = (128,)
    n_threads: tuple[int, ...] = (1,)
    act_precision: tuple[str, ...] = (DEFAULT_ACT_PRECISION,)
    n_batch: tuple[int, ...] = (512,)
    repetitions: int = 5


def bench_plan(params: BenchParams) -> list[BenchTest]:
    """Every test of a run in llama-bench's order: models, then n_batch, precision and threads, then the
    prompt tests and the generation tests of each combination."""
    tests = []
    for model, n_batch, act, n_threads in itertools.product(
        range(len(params.models)), params.n_batch, params.act_precision, params.n_threads
    ):
        tests += [BenchTest(model, n_batch, act, n_threads, p, 0) for p in params.n_prompt if p > 0]
        tests += [BenchTest(model, n_batch, act, n_threads, 0, n) for n in params.n_gen if n > 0]
    return tests


def check_context(params: BenchParams) -> None:
    """Refuse, before any work, a test longer than a model's training context (the engine's limit)."""
    longest = max((*params.n_prompt, *params.n_gen))
    for info in params.models:
        if longest > info.n_ctx_train:
            flag = "-p" if longest in params.n_prompt else "-n"
            raise InputError(
                f"{flag} {longest} is longer than the training context of {printable(str(info.path))} "
                f"({info.n_ctx_train} tokens)"
            )


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def stdev(values: list[float]) -> float:
    """Sample standard deviation; 0 for fewer than two values (llama-bench's stdev)."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


@dataclass(frozen=True)
class BenchResult:
    """The timed repetitions of one test."""

    test: BenchTest
    model: ModelInfo
    backend: str  # "CPU", "CUDA", "CUDA+CPU" or "CPU (stand-in pool)" (runtime.report.PoolSummary)
    gpu_info: str
    test_time: str  # ISO 8601, UTC, when the test started
    samples_ns: tuple[int, ...]
    pool: PoolSummary | None = None  # the pool's bytes and the FFN work's share there (timed runs)

    @property
    def samples_ts(self) -> list[float]:
        return [self.test.n_tokens * 1e9 / ns for ns in self.samples_ns]

    @property
    def avg_ns(self) -> int:
        return round(mean([float(ns) for ns in self.samples_ns]))

    @property
    def stddev_ns(self) -> int:
        return round(stdev([float(ns) for ns in self.samples_ns]))

    @property
    def avg_ts(self) -> float:
        return mean(self.samples_ts)

    @property
    def stddev_ts(self) -> float:
        return stdev(self.samples_ts)


def prompt_tokens(n_vocab: int, n: int) -> list[int]:
    """A fixed, deterministic token sequence away from the special ids at the start of the vocabulary
    (scripts/bench_decode.py's for vocabularies of 2000 and more)."""
    low = min(1000, n_vocab // 2)
    return [(low + 7919 * i) % (n_vocab - low) + low for i in range(n)]


def _sync(logits: torch.Tensor) -> None:
    import torch

    if logits.device.type == "cuda":
        torch.cuda.synchronize(logits.device)


def _time_test(engine: Engine, test: BenchTest, tokens: list[int]) -> int:
    """One repetition from an empty cache, in nanoseconds."""
    engine.reset()
    t0 = time.perf_counter_ns()
    if test.n_prompt:
        _sync(engine.eval(tokens[: test.n_prompt]))
    for token in tokens[: test.n_gen]:
        _sync(engine.eval([token]))
    return max(time.perf_counter_ns() - t0, 1)  # a clock too coarse for the test must not divide by 0


def cpu_info() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_bench(
    params: BenchParams,
    base: EngineOptions,
    on_progress: Callable[[str], None] | None = None,
) -> Iterator[BenchResult]:
    """Run every test of bench_plan(params) and yield its result as it completes.

    base: the EngineOptions every engine starts from (pool, VRAM budget, -ngl); n_ctx, n_batch, threads and
    precision are set per engine.
    """
    from powerinfer.runtime.engine import Engine
    from powerinfer.runtime.report import ffn_work, pool_summary

    tests = bench_plan(params)
    n_ctx = max((*params.n_prompt, *params.n_gen, 1))
    engine: Engine | None = None
    key: tuple[int, int, str, int] | None = None
    for i, test in enumerate(tests, 1):
        info = params.models[test.model]
        if on_progress is not None:
            on_progress(
                f"bench: {i}/{len(tests)}: {info.description}, threads {test.n_threads}, "
                f"{test.act_precision}, n_batch {test.n_batch}, {test.name}"
            )
        if test.engine_key != key:
            engine = None
            gc.collect()  # the previous engine's weights go before the next one loads
            options = dataclasses.replace(
                base,
                n_ctx=n_ctx,
                n_batch=test.n_batch,
                n_threads=test.n_threads,
                act_precision=test.act_precision,
            )
            engine, key = Engine(os.fspath(info.path), options), test.engine_key
        assert engine is not None
        tokens = prompt_tokens(info.n_vocab, max(test.n_prompt, test.n_gen))
        test_time = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        # warm-up as llama-bench: the whole prompt, or one generated token
        warm = dataclasses.replace(test, n_gen=min(test.n_gen, 1))
        _time_test(engine, warm, tokens)
        since = ffn_work(engine.assembled)
        samples = tuple(_time_test(engine, test, tokens) for _ in range(params.repetitions))
        pool = pool_summary(engine.assembled, since)
        device = engine.pool_device
        gpu = ""
        if device is not None and device.type == "cuda":
            import torch

            gpu = torch.cuda.get_device_name(device)
        yield BenchResult(test, info, pool.backend, gpu, test_time, samples, pool)
