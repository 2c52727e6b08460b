"""The option table (cli/options.py): each shared option declared once and taken by the commands that use it,
and the argument groups that check the values and build the library's options."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import get_args, get_type_hints

import pytest
import typer

from powerinfer.cli import app
from powerinfer.cli.options import THREADS_PER_CORE, EngineArgs, SamplingArgs, takes
from powerinfer.errors import InputError


def table(group: type) -> dict[str, str]:
    """First flag -> help text of each field of an argument group."""
    hints = get_type_hints(group, include_extras=True)
    out = {}
    for field in dataclasses.fields(group):
        info = get_args(hints[field.name])[1]
        flags = [d for d in (info.default, *info.param_decls) if isinstance(d, str) and d.startswith("--")]
        out[flags[0].split("/")[0]] = info.help
    return out


def command_help(name: str) -> dict[str, str | None]:
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return {p.opts[-1] if p.opts[-1].startswith("--") else p.opts[0]: p.help for p in command.params}


@pytest.mark.parametrize(
    "name,left_out",
    [("main", set()), ("server", set()), ("perplexity", {"--n-gpu-layers"})],
)
def test_commands_take_the_table_entries(name: str, left_out: set[str]):
    shown = command_help(name)
    for group in (EngineArgs, SamplingArgs) if name != "perplexity" else (EngineArgs,):
        for flag, help_text in table(group).items():
            if flag in left_out:
                assert flag not in shown
            else:
                assert shown[flag] == help_text, flag


def test_batched_keeps_its_own_threads_and_budget_flags():
    shown = command_help("batched")
    assert shown["--threads"] == "CPU threads."  # N_THREAD positional fallback, not the table's entry
    assert shown["--vram-budget"] == "VRAM budget (GiB)."
    assert shown["--pool-device"] == table(EngineArgs)["--pool-device"]
    assert "--n-gpu-layers" not in shown and "--batch-size" not in shown


def test_takes_hands_the_command_one_object_per_group():
    seen = {}

    @takes(EngineArgs, skip=("n_gpu_layers",), ctx_size=7)
    def command(engine: EngineArgs, extra: int = 1) -> None:
        seen.update(engine=engine, extra=extra)

    import inspect

    names = list(inspect.signature(command).parameters)
    assert names[0] == "extra" and "ctx_size" in names and "n_gpu_layers" not in names
    assert inspect.signature(command).parameters["ctx_size"].default == 7
    command(extra=2, **{n: inspect.signature(command).parameters[n].default for n in names[1:]})
    assert seen["extra"] == 2 and seen["engine"] == EngineArgs(ctx_size=7)
    with pytest.raises(AssertionError, match="no such options"):
        takes(EngineArgs, ctx=7)(lambda engine: None)


def test_engine_args_build_checked_engine_options():
    cores = os.cpu_count() or 1
    o = EngineArgs(ctx_size=64, threads=10**6, vram_budget=-1.0, pool_device="cpu").options(n_seq=3)
    assert (o.n_ctx, o.n_batch, o.n_seq) == (64, 512, 3)
    assert o.n_threads == min(THREADS_PER_CORE * cores, 1024) and o.vram_budget_gib is None
    assert o.pool_device == "cpu" and o.act_precision == "q8" and o.pipeline is None
    assert EngineArgs(threads=0).options().n_threads == cores
    with pytest.raises(InputError, match="--vram-budget must be -1"):
        EngineArgs(vram_budget=-2.0).options()
    with pytest.raises(InputError, match="--pool-device tpu: expected cpu, cuda or cuda:N"):
        EngineArgs(pool_device="tpu").options()
    with pytest.raises(InputError, match="--dist-timeout"):
        EngineArgs(dist_timeout=math.nan).options()


def test_sampling_args_check_values_and_reduce_the_seed():
    p = SamplingArgs(seed=2**32 + 5, temp=0.0, top_k=3).params()
    assert (p.seed, p.temp, p.top_k, p.repeat_penalty) == (5, 0.0, 3, 1.1)
    assert SamplingArgs(seed=2**32 - 1).params().seed == -1  # LLAMA_DEFAULT_SEED: random
    with pytest.raises(InputError, match="--min-p must be a finite number"):
        SamplingArgs(min_p=math.inf).params()
    with pytest.raises(InputError, match="--temp 1e-40 is too small"):
        SamplingArgs(temp=1e-40).params()
    with pytest.raises(InputError, match="--repeat-penalty must be > 0"):
        SamplingArgs(repeat_penalty=0.0).params()


def test_library_and_commands_share_one_activation_precision() -> None:
    """EngineOptions() and every command (EngineArgs' default) run the quant matmuls the same way: q8."""
    from powerinfer.runtime.engine import EngineOptions, kernel_context

    assert EngineOptions().act_precision == "q8" == EngineArgs().act_precision.value
    assert kernel_context(EngineOptions(n_threads=1)).act_precision == "q8"
    assert kernel_context(EngineOptions(n_threads=1, act_precision="f32")).act_precision == "f32"
