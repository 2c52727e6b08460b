"""Run a model over a corpus and record, per layer, which FFN neurons fire and what the predictor sees.

The model is left untouched: a FiringRecorder observes each layer's FFN input (the transformer's observer
hook) for the duration of a run. A neuron fires for a token when its activation is non-zero: ReLU(gate . u) > 0
(llama), and also ReLU(up . u) > 0 for bamboo's ReLU(gate) * ReLU(up). The Python work per forward is
constant per layer: one gate matmul, one comparison and one sum over the batch.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from powerinfer import ops
from powerinfer.errors import ConfigError, InputError
from powerinfer.model.blocks import FFN, DenseFFN
from powerinfer.model.config import ModelConfig
from powerinfer.printable import printable
from powerinfer.runtime.engine import Engine
from powerinfer.textfile import read_text_file

Progress = Callable[[int, int], None]  # (tokens done, tokens in total)


MAX_CORPUS_BYTES = 1 << 30  # a corpus file past this is refused (and /dev/zero ends instead of eating memory)


def read_corpus(path: str | Path) -> str:
    """The text of a corpus file; a missing, unreadable, non-UTF-8, oversized or empty file raises InputError.

    Pipes (`-f <(zcat corpus.gz)`) are read like files."""
    text = read_text_file(Path(path), "corpus file", limit=MAX_CORPUS_BYTES)
    if not text.strip():
        raise InputError(f"corpus file {printable(str(path))} is empty")
    return text


def tokenize_corpus(engine: Engine, text: str) -> list[int]:
    """Token ids of the corpus without BOS (special-token texts are not parsed)."""
    return engine.tokenizer.encode(text, add_bos=False, parse_special=False)


def make_windows(ids: list[int], n_ctx: int, bos_id: int | None) -> list[list[int]]:
    """Consecutive windows of n_ctx tokens: BOS + n_ctx-1 corpus tokens; the tail is kept."""
    if n_ctx < 2:
        raise InputError(f"window size must be at least 2 tokens (got -c {n_ctx})")
    step = n_ctx - 1 if bos_id is not None else n_ctx
    prefix = [bos_id] if bos_id is not None else []
    return [prefix + ids[i : i + step] for i in range(0, len(ids), step) if ids[i : i + step]]


def require_relu(config: ModelConfig) -> None:
    """Activation counting and predictors need a ReLU-family FFN (a SiLU neuron is never exactly zero)."""
    if config.activation != "relu":
        raise ConfigError(
            f"the model's FFN activation is {config.activation}: profiling and predictors need a "
            "ReLU model (PowerInfer's ReLU-LLaMA / bamboo); a dense GGUF made by our converter records "
            "'powerinfer.ffn_activation'"
        )


@dataclass
class LayerSamples:
    """Predictor training data of one layer: inputs (N, D) float16, firing masks as bits (N, n_ff/8)."""

    x: list[torch.Tensor] = field(default_factory=list)
    fired: list[np.ndarray] = field(default_factory=list)


class FiringRecorder:
    """Observes one layer's dense FFN input: counts firing neurons, optionally keeps (predictor input, mask)."""

    def __init__(self, ffn: FFN, config: ModelConfig, kc: ops.KernelContext, keep_samples: bool) -> None:
        if not isinstance(ffn, DenseFFN):
            raise ConfigError("profiling needs the dense FFN (run the engine with dense_ffn=True)")
        # a neuron fires when ReLU(gate . u) > 0, or ReLU(up . u + b_up) > 0 in ungated FFNs (Falcon, OPT)
        self.gate = ffn.gate if ffn.gate is not None else ffn.up
        self.bias = ffn.b_up if ffn.gate is None else None
        self.kc = kc
        self.up = ffn.up if config.relu_up else None
        self.counts = torch.zeros(config.n_ff, dtype=torch.int64)
        self.samples: LayerSamples | None = LayerSamples() if keep_samples else None

    def __call__(self, x_norm: torch.Tensor, x_residual: torch.Tensor) -> None:
        pre = ops.linear(x_norm, self.gate, self.kc)  # (T, n_ff), the same matmul the dense FFN does
        fired = (pre if self.bias is None else pre + self.bias) > 0
        if self.up is not None:
            fired &= ops.linear(x_norm, self.up, self.kc) > 0
        self.counts += fired.sum(dim=0)
        if self.samples is not None:
            self.samples.x.append(x_residual.to(torch.float16).clone())
            self.samples.fired.append(np.packbits(fired.numpy(), axis=1))


@contextmanager
def recording(engine: Engine, keep_samples: bool = False) -> Iterator[list[FiringRecorder]]:
    """Observe the engine's FFN inputs with recorders for the duration of the block."""
    require_relu(engine.config)
    model = engine.model
    recorders = [FiringRecorder(layer.ffn, engine.config, engine.kc, keep_samples) for layer in model.layers]

    def observe(bid: int, x_norm: torch.Tensor, x_residual: torch.Tensor) -> None:
        recorders[bid](x_norm, x_residual)

    model.observers.append(observe)
    try:
        yield recorders
    finally:
        model.observers.remove(observe)


def run_windows(engine: Engine, windows: list[list[int]], progress: Progress | None = None) -> int:
    """Evaluate each window from position 0 (a fresh sequence each); returns the number of tokens run."""
    total = sum(len(w) for w in windows)
    done = 0
    for w in windows:
        engine.reset()
        engine.eval(w)
        done += len(w)
        if progress is not None:
            progress(done, total)
    return done


def output_folder_problem(folder: Path) -> str | None:
    """Why an output folder cannot be put at `folder`, or None: its parent must exist (no folders are made on
    the way) and anything already there must be a real folder (a file, FIFO, device or symlink is never
    replaced)."""
    parent = Path(folder).absolute().parent
    if not parent.is_dir():
        return f"folder {printable(str(parent))} does not exist"
    try:
        mode = os.lstat(folder).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        return e.strerror or str(e)
    if stat.S_ISLNK(mode):
        return "it is a symlink, not a folder"
    if not stat.S_ISDIR(mode):
        return "it exists and is not a folder"
    return None


def check_output_folder(folder: Path) -> None:
    """InputError unless `output_folder_problem(folder)` is None."""
    problem = output_folder_problem(folder)
    if problem is not None:
        raise InputError(f"cannot write {printable(str(folder))}: {problem}")


def write_folder_atomically(folder: Path, write: Callable[[Path], None]) -> Path:
    """Fill a temporary sibling folder with `write`, then put it in place of `folder` (no partial output).

    An existing `folder` is moved aside, replaced, then deleted (put back if the swap fails). The temporary
    folders are removed on every way out, KeyboardInterrupt and signal exits included.
    """
    folder = Path(folder)
    check_output_folder(folder)
    parent = folder.absolute().parent
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=parent))
    aside: Path | None = None
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes 0700; the finished folder gets the usual mode
        write(tmp)
        check_output_folder(folder)  # something may have appeared there meanwhile
        if folder.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=parent))
            os.rename(folder, aside)  # onto the empty folder mkdtemp made
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None:
            if folder.exists():
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.rename(aside, folder)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return folder
