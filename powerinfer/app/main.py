"""`main`: the continuation of a prompt streamed to stdout, timings to stderr (llama.cpp's `main`); interactive
runs go through `app.interactive`."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from powerinfer.app.console import err_console
from powerinfer.app.interactive import InteractiveOptions, run_session
from powerinfer.errors import InputError
from powerinfer.runtime.context_shift import check_keep, resolve_keep
from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.generate import generate
from powerinfer.runtime.report import pool_summary, sparse_mode
from powerinfer.runtime.speculative import SpecOptions, load_speculator
from powerinfer.runtime.timings import format_timings
from powerinfer.sampling import Sampler, SamplingParams
from powerinfer.tokenizer import StreamDecoder


@dataclass(frozen=True)
class MainOptions:
    model: Path
    prompt: str
    n_predict: int
    ignore_eos: bool
    verbose_prompt: bool
    display_prompt: bool
    engine: EngineOptions
    sampling: SamplingParams
    interactive: InteractiveOptions = InteractiveOptions()
    n_keep: int = 0  # --keep (runtime.context_shift.resolve_keep)
    context_shift: bool = True
    speculative: SpecOptions | None = None


def print_timings(engine: Engine) -> None:
    """The timings block, the decode bandwidth, the pool's line (with a pool device) and the sparse report, on
    stderr."""
    err = err_console
    tm = engine.timings
    for line in format_timings(tm):
        err.print(line, markup=False)
    if tm.n_eval and tm.eval_ms > 0:
        # the bytes a decoded token reads (a MoE token its k experts' rows, a sparse one its active rows), not the
        # file's: the whole file overstated MoE files by n_expert / k on their expert tensors
        gbs = engine.read_bytes_per_token() * tm.n_eval / (tm.eval_ms / 1e3) / 1e9
        err.print(
            f"llama_print_timings:   decode bandwidth = {gbs:10.2f} GB/s (weight bytes read per token x tokens/s)",
            markup=False,
        )
    if engine.pool_device is not None:
        err.print(pool_summary(engine.assembled).line(), markup=False)
    for line in engine.sparse_report():
        err.print(line, markup=False)


def run_main(opts: MainOptions) -> int:
    """Load the model, stream the continuation of the prompt to stdout and timings to stderr; the exit code (130
    for an interactive run that ends with Ctrl-C at the prompt, after the timings)."""
    engine = Engine(opts.model, opts.engine)
    tok = engine.tokenizer
    c = engine.config
    sampler = Sampler(opts.sampling)
    err = err_console
    err.print(f"main: seed  = {sampler.seed}")
    err.print(
        f"llm_load_print_meta: arch = {c.arch}, mode = {sparse_mode(c) if c.sparse else 'dense'}"
        f"{' + sparse head' if engine.head_stats is not None else ''}, "
        f"n_layer = {c.n_layer}, n_embd = {c.n_embd}, n_ff = {c.n_ff}, n_vocab = {c.n_vocab}, "
        f"file = {engine.weight_bytes / 2**20:.2f} MiB"
    )
    for line in engine.placement_report():
        err.print(line, markup=False)
    spec = None
    if opts.speculative is not None:
        spec = load_speculator(opts.speculative, engine)
        err.print(f"main: speculative decoding: {spec.describe()}", markup=False)
    chat = opts.interactive.conversation
    prompt_ids = [] if chat else tok.encode(opts.prompt, add_bos=None, parse_special=True)
    if not prompt_ids and not chat:
        prompt_ids = [tok.bos_id] if tok.bos_id is not None else []
    if not prompt_ids and not chat:
        raise InputError("empty prompt and the vocabulary has no BOS token to start from")
    if opts.verbose_prompt:
        err.print(f"main: prompt: '{opts.prompt}'")
        err.print(f"main: number of tokens in prompt = {len(prompt_ids)}")
        for t in prompt_ids:
            err.print(f"{t:6d} -> '{tok.token_bytes(t).decode('utf-8', errors='replace')}'", markup=False)
    check_keep(opts.n_keep, engine.n_ctx)
    add_bos = bool(prompt_ids) and tok.add_bos and prompt_ids[0] == tok.bos_id
    n_keep = resolve_keep(opts.n_keep, len(prompt_ids), add_bos)
    shift = n_keep if opts.context_shift and opts.n_predict != -2 else None  # -2: until the context fills
    p = opts.sampling
    err.print(
        f"sampling: repeat_last_n = {p.repeat_last_n}, repeat_penalty = {p.repeat_penalty:.3f}, "
        f"frequency_penalty = {p.frequency_penalty:.3f}, presence_penalty = {p.presence_penalty:.3f}, "
        f"top_k = {p.top_k}, top_p = {p.top_p:.3f}, min_p = {p.min_p:.3f}, temp = {p.temp:.3f}",
        markup=False,
    )
    err.print(
        f"generate: n_ctx = {engine.n_ctx}, n_batch = {engine.options.n_batch}, "
        f"n_predict = {opts.n_predict}, n_keep = {n_keep}, n_threads = {engine.kc.n_threads}"
    )
    if opts.interactive.needs_session:
        code = run_session(
            engine,
            sampler,
            opts.interactive,
            opts.sampling,
            opts.prompt,
            prompt_ids,
            opts.n_predict,
            opts.ignore_eos,
            opts.display_prompt,
            shift,
            spec,
        )
        print_timings(engine)
        return code
    out = sys.stdout
    if opts.display_prompt:
        out.write(opts.prompt)
        out.flush()
    decoder = StreamDecoder(tok)
    for token in generate(
        engine, prompt_ids, sampler, opts.n_predict, opts.ignore_eos, n_keep=shift, spec=spec
    ):
        piece = decoder.feed(token)
        if piece:
            out.write(piece)
            out.flush()
    out.write(decoder.flush())
    out.write("\n")
    out.flush()
    print_timings(engine)
    return 0
