"""`perplexity`: llama.cpp's perplexity of a text file, and the cost of sparsity against the dense FFN or a saved
base; results on stdout, progress and timings on stderr."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from powerinfer.app.console import err_console
from powerinfer.errors import InputError
from powerinfer.eval import (
    BaseLogits,
    PerplexityOptions,
    PerplexityResult,
    context_size,
    perplexity,
    plan_chunks,
    predictor_recall,
    tokenize_text,
)
from powerinfer.printable import printable
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.report import sparse_mode
from powerinfer.runtime.timings import format_timings
from powerinfer.textfile import check_output_file, read_text_file


@dataclass(frozen=True)
class PerplexityRun:
    model: Path
    text_file: Path
    ppl: PerplexityOptions
    engine: EngineOptions
    kl_divergence: bool
    kl_base: Path | None = None  # with kl_divergence: compare against it; without: write it
    seed: int = 0  # printed only, as llama.cpp's perplexity (which shuffles HellaSwag tasks with it) does


def read_text(path: Path) -> str:
    """The text file as llama.cpp's -f reads it: whole file, one trailing newline removed."""
    text = read_text_file(path, "text file")
    text = text[:-1] if text.endswith("\n") else text
    if not text:
        raise InputError(
            f"text file {printable(str(path))} is empty: perplexity needs at least two contexts of tokens"
        )
    return text


def check_base_target(path: Path) -> None:
    """A --kl-divergence-base file to write: a path check_output_file accepts, and never a model file (a GGUF or
    PowerInfer file there is almost always the -m of a mistyped command: replacing it with logits destroys it)."""
    check_output_file(path, "KL-divergence base")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError:
        return
    if magic in (b"GGUF", b"PWRI"):
        raise InputError(
            f"--kl-divergence-base {printable(str(path))} is a model file: refusing to replace it with logits "
            "(without --kl-divergence the base is written; give a new file name)"
        )


def save_base(record: BaseLogits, path: Path) -> None:
    """Write the --kl-divergence-base file through a temp file beside it (never a partial file, never over a
    FIFO or device)."""
    check_base_target(path)
    folder = path.absolute().parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".kld", dir=folder)
    except OSError as e:
        raise InputError(f"cannot write {printable(str(path))}: {e.strerror}") from None
    try:
        os.close(fd)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        record.save(tmp)
        check_output_file(path, "KL-divergence base")
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        raise InputError(
            f"cannot write {printable(str(path))}: {getattr(e, 'strerror', None) or e}"
        ) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def format_running(result: PerplexityResult, i: int) -> str:
    return f"[{i + 1}]{result.running[i]:.4f},"


def print_final(result: PerplexityResult) -> None:
    err = result.ppl_error
    if err is None:
        sys.stdout.write("Unexpected negative standard deviation of log(prob)\n")
    else:
        sys.stdout.write(f"Final estimate: PPL = {result.ppl:.4f} +/- {err:.5f}\n")


def print_kld(result: PerplexityResult, sparse: Engine, against: str) -> None:
    """The KL divergence and predictor-recall report (stdout: these are results)."""
    k = result.kld
    assert k is not None
    out = sys.stdout
    ratio = (result.nll_sum - k.ref_nll_sum) / k.count
    out.write(f"====== this model vs {against}, {k.count} scored tokens ======\n")
    out.write(f"PPL: {result.ppl:.4f}, reference: {k.ref_ppl:.4f}, ln(PPL / PPL reference): {ratio:.6f}\n")
    out.write(f"Mean    KLD: {k.mean:10.6f} +/- {k.mean_error:.6f}\n")
    out.write(f"Maximum KLD: {k.max:10.6f}\n")
    out.write(f"99.0%   KLD: {k.quantile(0.99):10.6f}\n")
    out.write(f"Median  KLD: {k.quantile(0.5):10.6f}\n")
    out.write(f"Same top-1: {100 * k.top1:.3f} +/- {100 * k.top1_error:.3f} %\n")
    stats = sparse.sparse_stats
    if stats is None:
        return
    layers = predictor_recall(stats, sparse.config.n_ff)
    out.write("====== predictor vs true activation ReLU(gate) > 0, per layer ======\n")
    out.write("layer   recall  precision  predicted  truly-active  missed (of truly active)\n")
    for r in layers:
        out.write(
            f"{r.layer:5d}  {r.recall:7.4f}  {r.precision:9.4f}  "
            f"{r.predicted_share:8.2%}  {r.true_share:12.2%}  "
            f"{r.missed} ({1 - r.recall:.2%})\n"
        )
    hit = sum(r.hit for r in layers)
    true = sum(r.true_active for r in layers)
    pred = sum(r.predicted for r in layers)
    out.write(
        f"all    {hit / max(true, 1):7.4f}  {hit / max(pred, 1):9.4f}  "
        f"predicted sparsity {1 - pred / max(1, sum(r.tokens * r.n_ff for r in layers)):.2%}\n"
    )


def comparison(
    run: PerplexityRun, engine: Engine
) -> tuple[Engine | None, BaseLogits | None, BaseLogits | None, str]:
    """What the run compares against: (the dense reference engine, the base read, the base to record, its name)."""
    if run.kl_divergence and run.kl_base is not None:
        return None, BaseLogits.load(run.kl_base), None, f"the base {printable(run.kl_base.name)}"
    if run.kl_divergence:
        if engine.sparse_stats is None:
            raise InputError(
                f"--kl-divergence without --kl-divergence-base compares the sparse FFN of a PowerInfer "
                f"(PWRI) file with its dense FFN; {printable(str(run.model))} is a dense GGUF"
            )
        reference = Engine(run.model, replace(run.engine, dense_ffn=True, sparse_head=False))
        return reference, None, None, dense_name(engine)
    record = BaseLogits(run.ppl.n_ctx, run.ppl.stride, []) if run.kl_base is not None else None
    return None, None, record, dense_name(engine)


def dense_name(engine: Engine) -> str:
    """What the dense reference of a sparse engine computes in full: a TEAL file's every matrix (every input
    channel), else the FFN; the whole output head where the engine screens it."""
    name = "the dense model" if engine.config.sparse_method == "teal" else "the dense FFN"
    return name + (" and the whole head" if engine.head_stats is not None else "")


def score_with_progress(
    engine: Engine, tokens: list[int], opts: PerplexityOptions, n_chunks: int, **compare: Any
) -> PerplexityResult:
    """`eval.perplexity` with a progress bar on stderr and the running [i]PPL values on stdout (streamed, or at the
    end when stdout and stderr share a terminal, where the live bar would tear the stdout line)."""
    stream = not (sys.stdout.isatty() and err_console.is_terminal)
    progress = Progress(
        TextColumn("perplexity"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[ppl]}"),
        console=err_console,
        transient=True,
        redirect_stdout=False,
        redirect_stderr=False,
    )
    pending: list[str] = []

    def on_chunk(i: int, n: int, result: PerplexityResult) -> None:
        if i == 0:
            per_pass = result.seconds
            eta = int(per_pass * n)
            hours = f"{eta // 3600} hours " if eta >= 3600 else ""
            progress.console.print(
                f"perplexity: {per_pass:.2f} seconds per pass - ETA {hours}{(eta % 3600) / 60:.2f} minutes",
                markup=False,
            )
        progress.update(task, advance=1, ppl=f"PPL {result.running[i]:.4f}")
        piece = format_running(result, i)
        if stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        else:
            pending.append(piece)

    with progress:
        task = progress.add_task("perplexity", total=n_chunks, ppl="")
        result = perplexity(engine, tokens, opts, on_chunk=on_chunk, **compare)
    sys.stdout.write("".join(pending) + "\n")
    return result


def run_perplexity(run: PerplexityRun) -> PerplexityResult:
    """Load the model(s), compute the perplexity, print results on stdout and progress/timings on stderr."""
    err = err_console
    err.print(f"perplexity: seed  = {run.seed}")
    text = read_text(run.text_file)
    if run.kl_base is not None and not run.kl_divergence:  # a base to write: refuse a bad path before the run
        check_base_target(run.kl_base)
    engine = Engine(run.model, run.engine)
    c = engine.config
    err.print(
        f"llm_load_print_meta: arch = {c.arch}, "
        f"mode = {sparse_mode(engine.config) if engine.sparse_stats else 'dense'}, "
        f"n_layer = {c.n_layer}, n_embd = {c.n_embd}, n_ff = {c.n_ff}, n_vocab = {c.n_vocab}, "
        f"file = {engine.weight_bytes / 2**20:.2f} MiB",
        markup=False,
    )
    err.print(
        f"perplexity: n_ctx = {engine.n_ctx}, n_batch = {engine.options.n_batch}, "
        f"n_threads = {engine.kc.n_threads}",
        markup=False,
    )
    reference, base, record, against = comparison(run, engine)
    if run.kl_divergence and engine.sparse_stats is not None:
        engine.sparse_stats.track_recall()
    err.print("perplexity: tokenizing the input ..")
    t = time.perf_counter()
    tokens = tokenize_text(engine, text)
    err.print(f"perplexity: tokenization took {(time.perf_counter() - t) * 1e3:g} ms")
    opts = run.ppl
    if opts.stride > 0:
        err.print(
            f"perplexity: strided calculation, context size adjusted from {opts.n_ctx} to "
            f"{context_size(opts.n_ctx, opts.stride)}"
        )
    n_chunks = len(plan_chunks(tokens, opts, None))
    err.print(
        f"perplexity: calculating perplexity over {n_chunks} chunks, batch_size={engine.options.n_batch}"
    )
    result = score_with_progress(
        engine, tokens, opts, n_chunks, reference=reference, base=base, record=record
    )
    print_final(result)
    if result.kld is not None:
        print_kld(result, engine, against)
    if record is not None and run.kl_base is not None:
        record.tokens = tokens
        save_base(record, run.kl_base)
        err.print(
            f"perplexity: wrote the top-64 log-probabilities of {result.count} tokens to {run.kl_base}",
            markup=False,
        )
    sys.stdout.flush()
    err.print("")
    for line in format_timings(engine.timings):
        err.print(line, markup=False)
    if reference is not None:
        err.print(
            f"dense reference: prompt eval time = {reference.timings.prompt_ms:10.2f} ms / "
            f"{reference.timings.n_prompt:5d} tokens",
            markup=False,
        )
    for line in engine.sparse_report():
        err.print(line, markup=False)
    return result
