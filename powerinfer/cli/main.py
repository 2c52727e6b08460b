"""`powerinfer main`: generate text from a prompt, as llama.cpp's `main` does."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from powerinfer.cli.common import (
    DEFAULT_ACT_PRECISION,
    ActPrecisionOpt,
    BatchOpt,
    CtxOpt,
    DisableIdxOpt,
    FixedThreadsOpt,
    FrequencyPenaltyOpt,
    LogDisableOpt,
    MinPOpt,
    MmapOpt,
    ModelOpt,
    NglOpt,
    PoolDeviceOpt,
    PresencePenaltyOpt,
    RepeatLastNOpt,
    RepeatPenaltyOpt,
    ResetIdxOpt,
    SeedOpt,
    SparseHeadOpt,
    TempOpt,
    ThreadsOpt,
    TopKOpt,
    TopPOpt,
    VramOpt,
    check_output_file,
    engine_options,
    err_console,
    read_text_file,
    resolve_model,
    run_guarded,
    sampling_params,
    setup_logging,
    utf8_argument,
)
from powerinfer.cli.distributed import (
    DEFAULT_DIST_TIMEOUT,
    DistTimeoutOpt,
    PipelineSplitOpt,
    pipeline,
    serve_if_worker,
)
from powerinfer.cli.interactive import InteractiveOptions, run_session
from powerinfer.errors import InputError
from powerinfer.runtime.engine import Engine, EngineOptions, Timings
from powerinfer.sampling import Sampler, SamplingParams
from powerinfer.textfile import MAX_PROMPT_BYTES
from powerinfer.tokenizer import StreamDecoder

_D = SamplingParams()  # llama.cpp's sampling defaults

_ESCAPES = {
    "n": b"\n",
    "r": b"\r",
    "t": b"\t",
    "'": b"'",
    '"': b'"',
    "\\": b"\\",
    "a": b"\a",
    "b": b"\b",
    "f": b"\f",
    "v": b"\v",
    "?": b"?",
}
_HEX = frozenset(b"0123456789abcdefABCDEF")


def process_escapes(text: str) -> str:
    """Turn \\n, \\t, \\xNN ... into what they name, on bytes as llama.cpp's -e does (so \\xc3\\xa9 is é).

    Other escapes stay as written. Raises InputError for a \\x without two hex digits after it and for
    escapes that leave invalid UTF-8."""
    data = text.encode("utf-8", errors="surrogateescape")
    out = bytearray()
    i, n = 0, len(data)
    while i < n:
        if data[i] != 0x5C or i + 1 == n:  # not a backslash, or a lone one at the end
            out.append(data[i])
            i += 1
            continue
        kind = chr(data[i + 1])
        if kind == "x":
            digits = data[i + 2 : i + 4]
            if len(digits) < 2 or not set(digits) <= _HEX:
                raise InputError(
                    f"-e: \\x at byte {i} of the prompt needs two hex digits after it (\\x41 = 'A')"
                )
            out.append(int(digits, 16))
            i += 4
        elif kind in _ESCAPES:
            out += _ESCAPES[kind]
            i += 2
        else:
            out += data[i : i + 2]
            i += 2
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            f"-e: the prompt is not valid UTF-8 after escape processing "
            f"(byte 0x{out[e.start]:02x} at offset {e.start})"
        ) from None


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


def format_timings(tm: Timings) -> list[str]:
    """The llama_print_timings block."""

    def rate(ms: float, n: int, unit: str) -> str:
        per = ms / n if n else float("nan")
        tps = 1e3 * n / ms if ms > 0 else float("nan")
        return f"{ms:10.2f} ms / {n:5d} {unit} ({per:8.2f} ms per token, {tps:8.2f} tokens per second)"

    total = (time.perf_counter() - tm.start) * 1e3
    return [
        f"llama_print_timings:        load time = {tm.load_ms:10.2f} ms",
        f"llama_print_timings:      sample time = {rate(tm.sample_ms, tm.n_sample, 'runs  ')}",
        f"llama_print_timings: prompt eval time = {rate(tm.prompt_ms, tm.n_prompt, 'tokens')}",
        f"llama_print_timings:        eval time = {rate(tm.eval_ms, tm.n_eval, 'runs  ')}",
        f"llama_print_timings:       total time = {total:10.2f} ms",
    ]


def print_timings(engine: Engine) -> None:
    """The timings block, the decode bandwidth and the sparse report, on stderr."""
    err = err_console
    tm = engine.timings
    for line in format_timings(tm):
        err.print(line, markup=False)
    if tm.n_eval and tm.eval_ms > 0:
        gbs = engine.weight_bytes * tm.n_eval / (tm.eval_ms / 1e3) / 1e9
        err.print(
            f"llama_print_timings:   decode bandwidth = {gbs:10.2f} GB/s (model bytes x tokens/s)",
            markup=False,
        )
    for line in engine.sparse_report():
        err.print(line, markup=False)


def run_main(opts: MainOptions) -> None:
    """Load the model, stream the continuation of the prompt to stdout and timings to stderr (an interactive
    run that ends with Ctrl-C at the prompt exits with code 130 after them)."""
    engine = Engine(opts.model, opts.engine)
    tok = engine.tokenizer
    c = engine.config
    sampler = Sampler(opts.sampling)
    err = err_console
    err.print(f"main: seed  = {sampler.seed}")
    err.print(
        f"llm_load_print_meta: arch = {c.arch}, mode = {'sparse (PWRI)' if c.sparse else 'dense'}"
        f"{' + sparse head' if engine.head_stats is not None else ''}, "
        f"n_layer = {c.n_layer}, n_embd = {c.n_embd}, n_ff = {c.n_ff}, n_vocab = {c.n_vocab}, "
        f"file = {engine.weight_bytes / 2**20:.2f} MiB"
    )
    for line in engine.placement_report():
        err.print(line, markup=False)
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
    p = opts.sampling
    err.print(
        f"sampling: repeat_last_n = {p.repeat_last_n}, repeat_penalty = {p.repeat_penalty:.3f}, "
        f"frequency_penalty = {p.frequency_penalty:.3f}, presence_penalty = {p.presence_penalty:.3f}, "
        f"top_k = {p.top_k}, top_p = {p.top_p:.3f}, min_p = {p.min_p:.3f}, temp = {p.temp:.3f}",
        markup=False,
    )
    err.print(
        f"generate: n_ctx = {engine.n_ctx}, n_batch = {engine.options.n_batch}, "
        f"n_predict = {opts.n_predict}, n_threads = {engine.kc.n_threads}"
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
        )
        print_timings(engine)
        if code:
            raise typer.Exit(code=code)
        return
    out = sys.stdout
    if opts.display_prompt:
        out.write(opts.prompt)
        out.flush()
    decoder = StreamDecoder(tok)
    for token in engine.generate(prompt_ids, sampler, opts.n_predict, opts.ignore_eos):
        piece = decoder.feed(token)
        if piece:
            out.write(piece)
            out.flush()
    out.write(decoder.flush())
    out.write("\n")
    out.flush()
    print_timings(engine)


def interactive_options(
    *,
    interactive: bool,
    interactive_first: bool,
    conversation: bool,
    chat_template: str | None,
    system_prompt: str,
    reverse_prompts: list[str],
    in_prefix: str,
    in_suffix: str,
    multiline_input: bool,
    prompt_cache: Path | None,
    prompt_cache_all: bool,
    prompt_cache_ro: bool,
    escape: bool,
) -> InteractiveOptions:
    """InteractiveOptions from the flags: texts checked as UTF-8 (and unescaped with -e), the template resolved,
    the session file's folder checked before any work."""

    def text(value: str, option: str) -> str:
        value = utf8_argument(value, option)
        return process_escapes(value) if escape else value

    reverse = tuple(text(r, "-r") for r in reverse_prompts)
    if any(not r for r in reverse):
        raise InputError("-r: a reverse prompt cannot be empty")
    source, stops = None, ()
    if chat_template is not None:
        from powerinfer.chat_templates import chat_template_source

        source, stops = chat_template_source(utf8_argument(chat_template, "--chat-template"))
    if prompt_cache is not None and not prompt_cache_ro:
        check_output_file(prompt_cache, "session file")
    if (prompt_cache_all or prompt_cache_ro) and prompt_cache is None:
        raise InputError("--prompt-cache-all and --prompt-cache-ro need --prompt-cache FILE")
    return InteractiveOptions(
        interactive=interactive or interactive_first or conversation,
        interactive_first=interactive_first or conversation,
        conversation=conversation,
        chat_template=source,
        chat_stop=stops,
        system_prompt=text(system_prompt, "-sys"),
        reverse_prompts=reverse,
        in_prefix=text(in_prefix, "--in-prefix"),
        in_suffix=text(in_suffix, "--in-suffix"),
        multiline_input=multiline_input,
        prompt_cache=prompt_cache,
        prompt_cache_all=prompt_cache_all,
        prompt_cache_ro=prompt_cache_ro,
    )


def main(
    model: ModelOpt = None,
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="Prompt text.")] = "",
    file: Annotated[Path | None, typer.Option("-f", "--file", help="Read the prompt from a file.")] = None,
    n_predict: Annotated[
        int, typer.Option("-n", "--n-predict", help="Tokens to generate (-1 = until EOS).")
    ] = -1,
    ctx_size: CtxOpt = 512,
    batch_size: BatchOpt = 512,
    threads_: ThreadsOpt = 0,
    fixed_threads: FixedThreadsOpt = False,
    mmap: MmapOpt = None,
    sparse_head: SparseHeadOpt = None,
    act_precision: ActPrecisionOpt = DEFAULT_ACT_PRECISION,
    seed: SeedOpt = _D.seed,
    temp: TempOpt = _D.temp,
    top_k: TopKOpt = _D.top_k,
    top_p: TopPOpt = _D.top_p,
    min_p: MinPOpt = _D.min_p,
    repeat_penalty: RepeatPenaltyOpt = _D.repeat_penalty,
    repeat_last_n: RepeatLastNOpt = _D.repeat_last_n,
    frequency_penalty: FrequencyPenaltyOpt = _D.frequency_penalty,
    presence_penalty: PresencePenaltyOpt = _D.presence_penalty,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Keep generating past end-of-sequence.")
    ] = False,
    escape: Annotated[
        bool, typer.Option("-e", "--escape", help="Process \\n, \\t ... in the prompt.")
    ] = False,
    vram_budget: VramOpt = -1.0,
    n_gpu_layers: NglOpt = 0,
    reset_gpu_index: ResetIdxOpt = False,
    disable_gpu_index: DisableIdxOpt = False,
    pool_device: PoolDeviceOpt = None,
    verbose_prompt: Annotated[
        bool, typer.Option("--verbose-prompt", help="Print the prompt tokens.")
    ] = False,
    no_display_prompt: Annotated[
        bool, typer.Option("--no-display-prompt", help="Do not echo the prompt.")
    ] = False,
    pipeline_split: PipelineSplitOpt = None,
    dist_timeout: DistTimeoutOpt = DEFAULT_DIST_TIMEOUT,
    log_disable: LogDisableOpt = False,
    interactive: Annotated[
        bool,
        typer.Option(
            "-i",
            "--interactive",
            help="Interactive: after the reply (a reverse prompt, -n tokens or end of text) read more input "
            "from stdin; Ctrl-C interjects, Ctrl-C at the prompt or end of input quits.",
        ),
    ] = False,
    interactive_first: Annotated[
        bool, typer.Option("--interactive-first", help="Interactive, and wait for input before generating.")
    ] = False,
    conversation: Annotated[
        bool,
        typer.Option(
            "-cnv",
            "--conversation",
            help="Chat: each input is a user message, formatted with the chat template; the '> ' marker asks.",
        ),
    ] = False,
    chat_template: Annotated[
        str | None,
        typer.Option(
            "--chat-template",
            help="-cnv template: a Jinja2 file or a built-in name (chatml, llama3, zephyr, gemma); default: the "
            "model's tokenizer.chat_template, else chatml.",
            show_default=False,
        ),
    ] = None,
    system_prompt: Annotated[
        str, typer.Option("-sys", "--system-prompt", help="-cnv system message (default: -p).")
    ] = "",
    reverse_prompt: Annotated[
        list[str] | None,
        typer.Option(
            "-r",
            "--reverse-prompt",
            help="Stop generating when the output ends with this text and (with -i) hand over to the user; "
            "repeatable.",
            show_default=False,
        ),
    ] = None,
    in_prefix: Annotated[
        str, typer.Option("--in-prefix", help="-i: text put (and shown) before each input.")
    ] = "",
    in_suffix: Annotated[
        str, typer.Option("--in-suffix", help="-i: text put (and shown) after each input.")
    ] = "",
    multiline_input: Annotated[
        bool,
        typer.Option(
            "--multiline-input",
            help="Input goes on over lines until one ends in \\ (without it, a line ending in \\ goes on); "
            "a line ending in / ends the input without its newline.",
        ),
    ] = False,
    prompt_cache: Annotated[
        Path | None,
        typer.Option(
            "--prompt-cache",
            help="Session file: load the evaluated prompt (tokens and KV cache) from it, evaluate only what "
            "is new, save the prompt to it.",
            show_default=False,
        ),
    ] = None,
    prompt_cache_all: Annotated[
        bool,
        typer.Option("--prompt-cache-all", help="Save the generated tokens too, at the end of the run."),
    ] = False,
    prompt_cache_ro: Annotated[
        bool, typer.Option("--prompt-cache-ro", help="Read the session file, never write it.")
    ] = False,
) -> None:
    """Generate text from a prompt (llama.cpp `main`)."""
    setup_logging(log_disable)
    err_console.quiet = log_disable

    def body() -> None:
        text = prompt
        if file is not None:
            text = read_text_file(file, "prompt file", limit=MAX_PROMPT_BYTES)
            text = text[:-1] if text.endswith("\n") else text
        if escape:
            text = process_escapes(text)
        text = utf8_argument(text, "the prompt (-p)")
        if len(text) > MAX_PROMPT_BYTES:
            raise InputError(f"the prompt is longer than {MAX_PROMPT_BYTES >> 20} MiB")
        opts = MainOptions(
            model=resolve_model(model),
            prompt=text,
            n_predict=n_predict,
            ignore_eos=ignore_eos,
            verbose_prompt=verbose_prompt,
            display_prompt=not no_display_prompt,
            engine=engine_options(
                threads_=threads_,
                fixed_threads=fixed_threads,
                mmap=mmap,
                sparse_head=sparse_head,
                act_precision=act_precision,
                vram_budget=vram_budget,
                pool_device=pool_device,
                reset_gpu_index=reset_gpu_index,
                disable_gpu_index=disable_gpu_index,
                n_ctx=ctx_size,
                n_batch=batch_size,
                n_gpu_layers=n_gpu_layers,
                pipeline=pipeline(pipeline_split, dist_timeout),
            ),
            sampling=sampling_params(
                temp=temp,
                top_k=top_k,
                top_p=top_p,
                min_p=min_p,
                repeat_penalty=repeat_penalty,
                repeat_last_n=repeat_last_n,
                frequency_penalty=frequency_penalty,
                presence_penalty=presence_penalty,
                seed_=seed,
            ),
            interactive=interactive_options(
                interactive=interactive,
                interactive_first=interactive_first,
                conversation=conversation,
                chat_template=chat_template,
                system_prompt=system_prompt,
                reverse_prompts=reverse_prompt or [],
                in_prefix=in_prefix,
                in_suffix=in_suffix,
                multiline_input=multiline_input,
                prompt_cache=prompt_cache,
                prompt_cache_all=prompt_cache_all,
                prompt_cache_ro=prompt_cache_ro,
                escape=escape,
            ),
        )
        serve_if_worker(opts.model, opts.engine)  # ranks > 0 of a pipeline serve rank 0 and exit
        run_main(opts)

    run_guarded(body)
