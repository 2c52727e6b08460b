"""Hostile or careless command lines: one clean line on stderr (exit 1; 130 for Ctrl-C, 143 for SIGTERM), never a
traceback, a hang, a crash in the kernels or a FIFO / device replaced by a file; temp files gone on every way out.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_llama_state, write_llama_gguf
from typer.testing import CliRunner

import powerinfer.app.batched as app_batched
import powerinfer.cli.batched as cli_batched
import powerinfer.cli.main as cli_main
from powerinfer.cli import app
from powerinfer.cli.common import one_line, run_guarded
from powerinfer.cli.options import THREADS_PER_CORE, seed, threads
from powerinfer.errors import FormatError, InputError
from powerinfer.gguf import GGUFWriter
from powerinfer.placement.gpu_index import GPUIndex, write_gpu_index
from powerinfer.profile.collect import write_folder_atomically

runner = CliRunner()
CORES = os.cpu_count() or 1
MAX_T = min(THREADS_PER_CORE * CORES, 1024)


def _control_chars(text: str) -> list[str]:
    return [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0]


def assert_clean(stderr: str, code: int, exit_code: int, first: str = "error:", *needles: str) -> str:
    """Exit code, exactly one line starting with `first` holding every needle, no traceback, no raw control
    characters, the line under 500 bytes. Returns the line."""
    assert exit_code == code, (exit_code, stderr)
    lines = [ln for ln in stderr.splitlines() if ln.startswith(first)]
    assert len(lines) == 1, stderr
    line = lines[0]
    for needle in needles:
        assert needle in line, line
    assert "Traceback" not in stderr, stderr
    assert not _control_chars(stderr), repr(stderr)
    assert len(line.encode()) < 500, line
    return line


def cli(*args: str, needles: tuple[str, ...] = ()) -> str:
    """Run a command in-process; it must fail cleanly (exit 1, one `error:` line holding every needle)."""
    result = runner.invoke(app, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return assert_clean(result.stderr, 1, result.exit_code, "error:", *needles)


def process(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m powerinfer ARGS` in a real process (with a timeout: a hang fails the test)."""
    return subprocess.run(
        [sys.executable, "-m", "powerinfer", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_llama_gguf(tmp_path / "tiny.gguf", random_llama_state(n_head_kv=2), n_head=4, n_head_kv=2)


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("hello world " * 20)
    return path


def _tmp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".tmp"))


# ---- thread counts: clamped to THREADS_PER_CORE x cores with a warning, for every command ------------------


def test_threads_clamped_unit():
    assert threads(0) == CORES and threads(-3) == CORES
    assert threads(1) == 1
    assert threads(MAX_T) == MAX_T
    assert threads(100000) == MAX_T
    assert threads(10**30) == MAX_T


def test_huge_thread_count_is_clamped(tiny: Path):
    result = runner.invoke(
        app, ["main", "-m", str(tiny), "-p", "hi", "-n", "2", "--temp", "0", "-t", "100000"]
    )
    assert result.exit_code == 0, result.stderr
    assert f"using {MAX_T} threads" in result.stderr
    assert f"n_threads = {MAX_T}" in result.stderr
    out = tiny.parent / "q.gguf"
    result = runner.invoke(app, ["quantize", str(tiny), str(out), "q8_0", "100000"])
    assert result.exit_code == 0, result.stderr
    assert f"using {MAX_T} threads" in result.stderr and out.is_file()


def test_batched_and_perplexity_threads_go_through_the_clamp(monkeypatch, tiny: Path, text_file: Path):
    seen = []

    def engine(path, options):
        seen.append(options.n_threads)
        raise InputError("stop here")

    monkeypatch.setattr(app_batched, "Engine", engine)
    cli("batched", str(tiny), "-t", "100000", needles=("stop here",))
    import powerinfer.app.perplexity as app_ppl

    monkeypatch.setattr(app_ppl, "Engine", engine)
    cli(
        "perplexity",
        "-m",
        str(tiny),
        "-f",
        str(text_file),
        "-c",
        "16",
        "-t",
        "100000",
        needles=("stop here",),
    )
    assert seen == [MAX_T, MAX_T]


# ---- seeds: any integer reduced to uint32 as llama.cpp does, 0xFFFFFFFF / -1 = random ------------------------


def test_seed_unit():
    assert seed(5) == 5
    assert seed(-1) == -1 and seed(2**32 - 1) == -1
    assert seed(2**32 + 5) == 5
    assert seed(-5) == 2**32 - 5
    assert seed(10**30) == 10**30 % 2**32


@pytest.mark.parametrize("given,expected", [("99999999999999", 99999999999999 % 2**32), ("-5", 2**32 - 5)])
def test_seed_past_its_range_main(monkeypatch, given: str, expected: int):
    seen = {}
    monkeypatch.setattr(cli_main, "run_main", lambda opts: seen.update(opts=opts))
    result = runner.invoke(app, ["main", "-m", "m.gguf", "-p", "hi", "-s", given])
    assert result.exit_code == 0, result.stderr
    assert seen["opts"].sampling.seed == expected


def test_seed_past_its_range_batched_and_perplexity(monkeypatch, tiny: Path, tmp_path: Path):
    seen = []

    def engine(path, options):
        raise InputError("stop here")

    monkeypatch.setattr(app_batched, "Engine", engine)
    monkeypatch.setattr(
        cli_batched, "run_batched_main", lambda opts: seen.append(opts.sampling) or engine(0, 0)
    )
    cli("batched", str(tiny), "-s", str(2**40 + 7), needles=("stop here",))
    assert seen[0].seed == 7
    # perplexity only prints its seed (llama.cpp's does too): reduced the same way
    result = runner.invoke(
        app,
        ["perplexity", "-m", str(tiny), "-f", str(tmp_path / "none.txt"), "-c", "16", "-s", str(2**33 + 9)],
    )
    assert "perplexity: seed  = 9" in result.stderr
    assert_clean(result.stderr, 1, result.exit_code, "error:", "no such file")


# ---- sampling values: NaN / inf / zero / denormal refused at the edge ----------------------------------------


@pytest.mark.parametrize(
    "flag,value,needle",
    [
        ("--temp", "nan", "--temp must be a finite number"),
        ("--temp", "inf", "--temp must be a finite number"),
        ("--temp", "-inf", "--temp must be a finite number"),
        ("--temp", "1e-310", "--temp 1e-310 is too small"),
        ("--repeat-penalty", "nan", "--repeat-penalty must be a finite number"),
        ("--repeat-penalty", "0", "--repeat-penalty must be > 0"),
        ("--repeat-penalty", "1e-310", "--repeat-penalty must be > 0"),
        ("--top-p", "nan", "--top-p must be a finite number"),
        ("--min-p", "inf", "--min-p must be a finite number"),
    ],
)
def test_bad_sampling_values_main(tiny: Path, flag: str, value: str, needle: str):
    cli("main", "-m", str(tiny), "-p", "hi", "-n", "2", flag, value, needles=(needle,))


def test_bad_sampling_values_batched(tiny: Path):
    cli("batched", str(tiny), "--temp", "nan", needles=("--temp must be a finite number",))
    cli("batched", str(tiny), "--top-p", "inf", needles=("--top-p must be a finite number",))


def test_sampling_values_in_a_real_process(tiny: Path):
    proc = process("main", "-m", str(tiny), "-p", "hi", "-n", "2", "--temp", "nan")
    assert_clean(proc.stderr, 1, proc.returncode, "error:", "--temp must be a finite number, got nan")
    assert proc.stdout == ""


# ---- text files and escapes --------------------------------------------------------------------------------


def test_invalid_utf8_prompt_files(tiny: Path, tmp_path: Path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hi \xff\xfe there\n")
    cli("main", "-m", str(tiny), "-f", str(bad), needles=("prompt file", "not UTF-8", "0xff at offset 3"))
    cli("batched", str(tiny), "--prompt-file", str(bad), needles=("prompt file", "not UTF-8"))
    cli("perplexity", "-m", str(tiny), "-f", str(bad), "-c", "16", needles=("text file", "not UTF-8"))
    cli(
        "profile", "-m", str(tiny), "-f", str(bad), "-o", str(tmp_path / "p"), needles=("corpus", "not UTF-8")
    )


@pytest.mark.parametrize("prompt", [r"abc\x", r"abc\x4", r"abc\xZZ", "\\x"])
def test_dangling_hex_escape(tiny: Path, prompt: str):
    cli("main", "-m", str(tiny), "-e", "-p", prompt, needles=("-e:", "two hex digits"))


def test_escapes_work_on_bytes():
    assert cli_main.process_escapes(r"caf\xc3\xa9 \x41\n") == "café A\n"
    assert cli_main.process_escapes("end\\") == "end\\"
    with pytest.raises(InputError, match="not valid UTF-8"):
        cli_main.process_escapes(r"a\xff")


def test_prompt_arguments_that_are_not_utf8(tiny: Path):
    # undecodable argv bytes reach Python as lone surrogates, which the tokenizer cannot take
    cli("main", "-m", str(tiny), "-p", "a\udcff\udcfe", needles=("not UTF-8", "0xff at offset 1"))
    cli("batched", str(tiny), "a\udcff", needles=("not UTF-8",))
    cli("main", "-m", str(tiny), "-e", "-p", "a\udcff", needles=("not valid UTF-8",))


def test_missing_unreadable_and_folder_prompt_files(tiny: Path, tmp_path: Path):
    cli(
        "main",
        "-m",
        str(tiny),
        "-f",
        str(tmp_path / "none.txt"),
        needles=("cannot read prompt file", "no such"),
    )
    cli("main", "-m", str(tiny), "-f", str(tmp_path), needles=("cannot read prompt file", "folder"))
    cli("batched", str(tiny), "--prompt-file", str(tmp_path), needles=("cannot read prompt file", "folder"))
    cli("perplexity", "-m", str(tiny), "-f", str(tmp_path), "-c", "16", needles=("cannot read text file",))
    locked = tmp_path / "locked.txt"
    locked.write_text("hi")
    locked.chmod(0)
    try:
        if os.geteuid() != 0:  # root reads it anyway
            cli("main", "-m", str(tiny), "-f", str(locked), needles=("cannot read prompt file", "ermission"))
    finally:
        locked.chmod(0o644)


def test_hostile_path_is_escaped_and_short(tiny: Path, tmp_path: Path):
    folder = tmp_path / "a\x1b[2J\x07b\nc"
    folder.mkdir()
    deep = folder
    for _ in range(6):  # a path far past the 500-byte line budget
        deep = deep / ("d" * 60 + "é" * 30)
    line = cli("main", "-m", str(tiny), "-f", str(deep / "p.txt"), needles=("cannot read prompt file",))
    assert "\\x1b[2J\\x07b\\nc" in line


# ---- budgets, devices ----------------------------------------------------------------------------------------


def test_vram_budget_inf_and_nan(tiny: Path, text_file: Path):
    cli("main", "-m", str(tiny), "-p", "hi", "--vram-budget", "inf", needles=("--vram-budget", "inf"))
    cli("main", "-m", str(tiny), "-p", "hi", "--vram-budget", "nan", needles=("--vram-budget", "nan"))
    cli(
        "perplexity",
        "-m",
        str(tiny),
        "-f",
        str(text_file),
        "-c",
        "16",
        "--vram-budget",
        "inf",
        needles=("inf",),
    )
    cli("batched", str(tiny), "hi", "1", "8", "1", "inf", needles=("--vram-budget",))


@pytest.mark.parametrize("device", ["gpu0", "cuda:-1", "meta", "cuda:99", "cpu:3", ""])
def test_bogus_pool_device(tiny: Path, device: str):
    line = cli("main", "-m", str(tiny), "-p", "hi", "--pool-device", device, needles=("--pool-device",))
    if device == "cuda:99":
        expected = "no such CUDA device" if torch.cuda.is_available() else "no CUDA device"
        assert expected in line


def test_bogus_training_device(tiny: Path, text_file: Path, tmp_path: Path):
    cli("train-predictor", "-m", str(tiny), "-f", str(text_file), "-o", str(tmp_path / "p"), "--device", "tpu7",
        needles=("--device",))  # fmt: skip


# ---- output paths: missing folders, FIFOs and devices are refused before any work, never replaced ----------


def test_outputs_in_missing_folders(tiny: Path, text_file: Path, tmp_path: Path):
    nowhere = tmp_path / "nowhere"
    cli("quantize", str(tiny), str(nowhere / "o.gguf"), "q8_0", needles=("does not exist",))
    cli("convert", str(tmp_path), "--outfile", str(nowhere / "o.gguf"), needles=("does not exist",))
    cli(
        "perplexity", "-m", str(tiny), "-f", str(text_file), "-c", "16",
        "--kl-divergence-base", str(nowhere / "base.kld"), needles=("KL-divergence base", "does not exist"),
    )  # fmt: skip
    cli(
        "profile",
        "-m",
        str(tiny),
        "-f",
        str(text_file),
        "-o",
        str(nowhere / "p"),
        needles=("does not exist",),
    )
    cli(
        "train-predictor",
        "-m",
        str(tiny),
        "-f",
        str(text_file),
        "-o",
        str(nowhere / "p"),
        needles=("does not exist",),
    )
    assert not nowhere.exists()


def test_kl_base_into_missing_folder_in_a_real_process(tiny: Path, text_file: Path, tmp_path: Path):
    proc = process(
        "perplexity", "-m", str(tiny), "-f", str(text_file), "-c", "16",
        "--kl-divergence-base", str(tmp_path / "nowhere" / "base.kld"),
    )  # fmt: skip
    assert_clean(proc.stderr, 1, proc.returncode, "error:", "does not exist")
    assert "Final estimate" not in proc.stdout  # refused before the run, not after it


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "out.fifo"
    os.mkfifo(path)
    return path


def _is_fifo(path: Path) -> bool:
    return stat.S_ISFIFO(os.lstat(path).st_mode)


def test_quantize_refuses_a_fifo(tiny: Path, fifo: Path):
    proc = process(
        "quantize", str(tiny), str(fifo), "q8_0", timeout=60
    )  # a write into it would block: timeout
    assert_clean(proc.stderr, 1, proc.returncode, "error:", "FIFO", "not a regular file")
    assert _is_fifo(fifo) and _tmp_files(fifo.parent) == []


def test_quantize_refuses_a_device_behind_a_symlink(tiny: Path, tmp_path: Path):
    null_before = os.stat("/dev/null")
    assert stat.S_ISCHR(null_before.st_mode)
    link = tmp_path / "null.gguf"
    link.symlink_to("/dev/null")
    cli("quantize", str(tiny), str(link), "q8_0", needles=("character device",))
    assert link.is_symlink() and os.readlink(link) == "/dev/null"
    null_after = os.stat("/dev/null")
    assert stat.S_ISCHR(null_after.st_mode) and null_after.st_rdev == null_before.st_rdev
    assert _tmp_files(tmp_path) == []


def test_other_writers_refuse_fifos(tiny: Path, text_file: Path, fifo: Path, tmp_path: Path):
    cli("convert", str(tmp_path), "--outfile", str(fifo), needles=("FIFO",))
    cli(
        "perplexity", "-m", str(tiny), "-f", str(text_file), "-c", "16", "--kl-divergence-base", str(fifo),
        needles=("FIFO",),
    )  # fmt: skip
    cli("train-predictor", "-m", str(tiny), "-f", str(text_file), "-o", str(fifo), needles=("not a folder",))
    # profile: the output folder's activation/ and profile.json
    out = tmp_path / "prof"
    out.mkdir()
    os.mkfifo(out / "profile.json")
    cli("profile", "-m", str(tiny), "-f", str(text_file), "-o", str(out), needles=("profile.json", "FIFO"))
    assert _is_fifo(fifo) and _is_fifo(out / "profile.json")
    # the library writers themselves
    w = GGUFWriter(fifo)
    w.add("general.architecture", "llama")
    with pytest.raises(FormatError, match="FIFO"):
        w.write()
    index = GPUIndex.from_neurons([np.array([0, 2])], n_ff=4, vram_capacity=0)
    with pytest.raises(FormatError, match="FIFO"):
        write_gpu_index(fifo, index)
    with pytest.raises(InputError, match="not a folder"):
        write_folder_atomically(fifo, lambda tmp: (tmp / "x").write_text("x"))
    assert _is_fifo(fifo) and _tmp_files(tmp_path) == []


def test_gpu_index_cache_that_is_a_fifo_is_left_alone(tmp_path: Path):
    from conftest import write_relu_sparse_model

    model = write_relu_sparse_model(tmp_path / "m.powerinfer.gguf", n_ff=128, seed=0, stats=True)
    cache = Path(str(model) + ".generated.gpuidx")
    os.mkfifo(cache)
    result = runner.invoke(
        app,
        ["main", "-m", str(model), "-p", "hi", "-n", "2", "--temp", "0", "--pool-device", "cpu",
         "--vram-budget", "0.001"],
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "cannot cache the GPU index" in result.stderr and "FIFO" in result.stderr
    assert _is_fifo(cache) and _tmp_files(tmp_path) == []


def test_folder_writer_replaces_folders_only(tmp_path: Path):
    target = tmp_path / "pred"
    target.mkdir()
    (target / "old.txt").write_text("old")
    write_folder_atomically(target, lambda tmp: (tmp / "new.txt").write_text("new"))
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pred"]  # nothing left beside it

    def boom(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_folder_atomically(target, boom)
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pred"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    with pytest.raises(InputError, match="symlink"):
        write_folder_atomically(link, lambda tmp: None)
    with pytest.raises(InputError, match="does not exist"):
        write_folder_atomically(tmp_path / "a" / "b", lambda tmp: None)


# ---- signals: Ctrl-C one line and 130, SIGTERM runs the cleanups and exits 143 --------------------------------


def test_interrupt_prints_one_line_even_with_log_disable(capsys):
    import typer

    from powerinfer.cli.common import err_console

    err_console.quiet = True
    try:

        def body() -> None:
            raise KeyboardInterrupt

        with pytest.raises(typer.Exit) as exc:
            run_guarded(body)
    finally:
        err_console.quiet = False
    assert exc.value.exit_code == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_environment_errors_are_one_line(capsys):
    import typer

    def full() -> None:
        raise OSError(28, "No space left on device", "/data/out\x1b.gguf")

    with pytest.raises(typer.Exit) as exc:
        run_guarded(full)
    assert exc.value.exit_code == 1
    assert capsys.readouterr().err == "error: No space left on device: /data/out\\x1b.gguf\n"


def test_one_line_escapes_and_caps():
    line = one_line("a\nb\x1b[31m\udcff" + "é" * 400)
    assert "\n" not in line and "\x1b" not in line and "\\udcff" in line
    assert len(line.encode()) <= 480 and line.endswith("...")


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    """A GGUF of 128 MiB of F32 matrices: quantizing and writing it takes a second or more."""
    path = tmp_path_factory.mktemp("big") / "big.gguf"
    rng = np.random.default_rng(0)
    w = GGUFWriter(path)
    w.add("general.architecture", "llama")
    for i in range(4):
        w.add_tensor(f"blk.{i}.ffn_up.weight", rng.standard_normal((2048, 4096), dtype=np.float32))
    w.write()
    return path


def _default_sigint() -> None:
    # a test run started in the background by a non-interactive shell ignores SIGINT, and its children inherit
    # that (a background job keeps ignoring Ctrl-C, as it should); these tests are about a terminal's Ctrl-C
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "powerinfer", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


def _wait_for_temp_file(proc: subprocess.Popen, folder: Path, deadline_s: float = 60) -> bool:
    """Poll until a temp file shows up in `folder` (the output is being written); False if the process ended."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and proc.poll() is None:
        if any(p.name.startswith(".tmp-") and p.suffix == ".gguf" for p in folder.iterdir()):
            return True
        time.sleep(0.0005)
    return False


def test_sigterm_while_writing_removes_the_temp_file(big_model: Path, tmp_path: Path):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"the old output")
    proc = _start("quantize", str(big_model), str(out), "copy", "1")
    caught = _wait_for_temp_file(proc, tmp_path)
    proc.send_signal(signal.SIGTERM)
    code, err = _finish(proc)
    if not caught and code == 0:
        pytest.skip("the write finished before the temp file could be seen")
    assert_clean(err, 143, code, "terminated")
    assert _tmp_files(tmp_path) == []
    assert out.read_bytes() == b"the old output"


def test_sigint_while_quantizing_leaves_no_output(big_model: Path, tmp_path: Path):
    out = tmp_path / "out.gguf"
    proc = _start("quantize", str(big_model), str(out), "q4_0", "1")
    assert proc.stderr is not None
    err_head = ""
    while proc.poll() is None:  # the first per-tensor line: imports are done, the work has started
        line = proc.stderr.readline()
        err_head += line
        if "quantizing to q4_0" in line or not line:
            break
    proc.send_signal(signal.SIGINT)
    code, err = _finish(proc)
    assert_clean(err_head + err, 130, code, "interrupted")
    assert _tmp_files(tmp_path) == [] and not out.exists()


@pytest.mark.parametrize(
    "sig,codes,line",
    [(signal.SIGINT, (130, -signal.SIGINT), "interrupted"), (signal.SIGTERM, (143,), "terminated")],
)
def test_signal_during_startup(tiny: Path, tmp_path: Path, sig: int, codes: tuple[int, ...], line: str):
    """Ctrl-C (or SIGTERM) while the CLI is still importing torch: one line, no traceback. The prompt file is a
    FIFO nobody writes to, so the command cannot end on its own before the signal.

    SIGINT may end the process by SIGINT itself after the line (returncode -2; a shell shows 130 either way):
    CPython 3.11 marks a KeyboardInterrupt raised inside a nested eval (pybind11 runs Python code while torch
    imports) as unhandled even when it is caught, and then re-raises SIGINT at exit."""
    prompt = tmp_path / "prompt.fifo"
    os.mkfifo(prompt)
    proc = _start("main", "-m", str(tiny), "-f", str(prompt))
    time.sleep(0.4)
    assert proc.poll() is None
    proc.send_signal(sig)
    exit_code, err = _finish(proc)
    assert exit_code in codes, (exit_code, err)
    assert_clean(err, exit_code, exit_code, line)
    assert err.strip() == line


def test_signal_while_blocked_on_a_fifo(tiny: Path, tmp_path: Path):
    """Past the imports (blocked opening a FIFO nobody writes to): SIGTERM still ends it with one line."""
    prompt = tmp_path / "prompt.fifo"
    os.mkfifo(prompt)
    proc = _start("main", "-m", str(tiny), "-f", str(prompt))
    time.sleep(4)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    exit_code, err = _finish(proc)
    assert_clean(err, 143, exit_code, "terminated")


def test_a_huge_prompt_file_is_refused_before_tokenizing(tiny: Path, tmp_path: Path):
    """A 200 MB prompt aborted the process inside the tokenizer library (exit 134): prompts past 16 MiB are one
    error line, read no further than the limit."""
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate((1 << 24) + 1)  # sparse: 16 MiB + 1 of zero bytes (valid UTF-8)
    cli("main", "-m", str(tiny), "-f", str(big), needles=("prompt file", "larger than 16 MiB"))
