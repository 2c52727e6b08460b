#!/usr/bin/env python3
"""MoE decode under a memory limit: ours (--memory-limit) against llama.cpp (mmap) in the same memory cgroup.

Each run is a fresh process placed in a memory cgroup this script creates with the limit (cgroup v1
`memory.limit_in_bytes` or v2 `memory.max`; page cache included) and removes after the run; the model file's
pages are dropped from the page cache before every run (posix_fadvise DONTNEED), so each side starts cold. A run
loads the model, evaluates a prompt of --n-prompt tokens, then decodes --n-gen greedy tokens; the decode tokens/s,
the prompt time and the cgroup's peak usage are recorded. Repetitions alternate ours / llama.cpp at each thread
count; the table has the medians. Ours also runs once without a limit (outside any cgroup) for the reference
greedy ids, which both limited runs must reproduce (llama.cpp: up to the near-ties of its own arithmetic).

Ours reads profile.json beside the model (`powerinfer profile`) for the experts it pins. llama.cpp runs through
llama-cpp-python in the Python given by --llama-python (it may live in its own venv). Needs root (cgroups).

Usage: python scripts/bench_memory_limit.py -m FILE --limit 2.5 [-t 1,2] [-r 5] [--n-prompt 16] [--n-gen 32]
                                            [--llama-python PYTHON] [--no-llama-cpp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def prompt_tokens(n_vocab: int, n: int) -> list[int]:
    # a fixed, deterministic token sequence away from the special ids (powerinfer.bench.prompt_tokens)
    low = min(1000, n_vocab // 2)
    return [(low + 7919 * i) % (n_vocab - low) + low for i in range(n)]


# ---- workers: one run each, a JSON line on stdout ----


def ours_worker(model: str, threads: int, limit: float | None, n_prompt: int, n_gen: int, n_ctx: int) -> dict:
    from powerinfer.runtime.engine import Engine, EngineOptions

    t0 = time.perf_counter()
    opts = EngineOptions(
        n_ctx=n_ctx,
        n_threads=threads,
        fixed_threads=True,
        memory_limit_gib=limit,
        mmap=True if limit else None,
    )
    engine = Engine(model, opts)
    load = time.perf_counter() - t0
    prompt = prompt_tokens(engine.config.n_vocab, n_prompt)
    t0 = time.perf_counter()
    logits = engine.eval(prompt)
    prompt_s = time.perf_counter() - t0
    ids = [int(logits.argmax())]
    t0 = time.perf_counter()
    for _ in range(n_gen - 1):
        ids.append(int(engine.eval([ids[-1]]).argmax()))
    decode_s = time.perf_counter() - t0
    out = {"load_s": load, "prompt_s": prompt_s, "decode_tps": (n_gen - 1) / decode_s, "ids": ids}
    store = engine.assembled.loader.store
    if store is not None:
        st = store.stats
        out["store"] = {
            "calls": st.calls, "pinned": st.pinned, "cached": st.cached, "prefetched": st.prefetched,
            "disk": st.disk, "bytes_read": st.bytes_read, "prefetch_issued": st.prefetch_issued,
            "prefetch_used": st.prefetch_used, "n_slots": store.plan.n_slots, "n_pinned": store.plan.n_pinned,
            "expected_share": store.plan.share, "direct": store.direct,
        }  # fmt: skip
    return out


def llama_worker(model: str, threads: int, n_prompt: int, n_gen: int, n_ctx: int) -> dict:
    import llama_cpp
    import llama_cpp.llama_cpp as low
    import numpy as np

    # llama.cpp's --no-repack: by default its CPU backend repacks Q4_0 weights into anonymous memory at load (the
    # whole model: killed by the cgroup at any limit below the file's size); without it the weights stay on the
    # file mapping, llama.cpp's way of running a model larger than memory
    default_params = low.llama_model_default_params

    def no_repack():  # type: ignore[no-untyped-def]
        params = default_params()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = no_repack
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=model, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads, n_gpu_layers=0,
        use_mmap=True, verbose=False, logits_all=False,
    )  # fmt: skip
    load = time.perf_counter() - t0
    prompt = prompt_tokens(llm.n_vocab(), n_prompt)
    t0 = time.perf_counter()
    llm.eval(prompt)
    prompt_s = time.perf_counter() - t0
    ids = [int(np.argmax(llm.scores[llm.n_tokens - 1]))]
    t0 = time.perf_counter()
    for _ in range(n_gen - 1):
        llm.eval([ids[-1]])
        ids.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    decode_s = time.perf_counter() - t0
    return {"load_s": load, "prompt_s": prompt_s, "decode_tps": (n_gen - 1) / decode_s, "ids": ids}


# ---- the memory cgroup ----


class MemoryCgroup:
    """A memory cgroup under this process's own (v1 memory controller or v2), with a byte limit; removed on close."""

    def __init__(self, limit: int) -> None:
        self.v2 = False
        rel = None
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hid, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                rel = path
        if rel is not None and Path("/sys/fs/cgroup/memory").is_dir():
            root = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
        else:
            self.v2 = True
            rel = next(
                ln.split(":", 2)[2]
                for ln in Path("/proc/self/cgroup").read_text().splitlines()
                if ln[:3] == "0::"
            )
            base = (
                Path("/sys/fs/cgroup/unified")
                if Path("/sys/fs/cgroup/unified").is_dir()
                else Path("/sys/fs/cgroup")
            )
            root = base / rel.lstrip("/")
        self.path = root / f"powerinfer-bench-{os.getpid()}"
        self.path.mkdir()
        if self.v2:
            (self.path / "memory.max").write_text(str(limit))
            (self.path / "memory.swap.max").write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            try:  # no swap either, where the kernel accounts it
                (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit))
            except OSError:
                pass

    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    def peak(self) -> int:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        return int((self.path / name).read_text())

    def close(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_worker(python: str, args: list[str], cgroup_limit: int | None, timeout: float) -> tuple[dict, int]:
    """One worker process (in a fresh cgroup when limited): its JSON answer and the cgroup's peak bytes."""
    cg = MemoryCgroup(cgroup_limit) if cgroup_limit is not None else None
    try:
        cmd = [python, str(Path(__file__).resolve()), *args]
        if cg is not None:  # the shell joins the cgroup, then becomes the worker
            cmd = ["sh", "-c", f'echo $$ > "{cg.procs_file()}" && exec "$@"', "sh", *cmd]
        env = dict(os.environ, PYTHONPATH=str(HERE.parent))
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
        if res.returncode != 0:
            tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"worker {args[:2]} failed ({res.returncode}): {' | '.join(tail)}")
        answer = json.loads(res.stdout.strip().splitlines()[-1])
        return answer, (cg.peak() if cg is not None else 0)
    finally:
        if cg is not None:
            cg.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", type=Path)
    ap.add_argument("--limit", type=float, default=2.5, help="GiB")
    ap.add_argument("-t", "--threads", default="1,2")
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("--n-prompt", type=int, default=16)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("-c", "--ctx", type=int, default=256)
    ap.add_argument("--llama-python", default=None)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--worker", choices=("ours", "llama"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker-limit", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "ours":
        ans = ours_worker(
            str(args.model), args.worker_threads, args.worker_limit, args.n_prompt, args.n_gen, args.ctx
        )
        print(json.dumps(ans))
        return 0
    if args.worker == "llama":
        print(
            json.dumps(
                llama_worker(str(args.model), args.worker_threads, args.n_prompt, args.n_gen, args.ctx)
            )
        )
        return 0
    if args.model is None:
        print("-m FILE is required", file=sys.stderr)
        return 1
    from powerinfer.runtime.session import (
        common_prefix as agree,  # (the workers need only the standard library)
    )

    limit = int(args.limit * 2**30)
    common = [
        "-m",
        str(args.model),
        "--n-prompt",
        str(args.n_prompt),
        "--n-gen",
        str(args.n_gen),
        "-c",
        str(args.ctx),
    ]
    llama = None if args.no_llama_cpp else (args.llama_python or sys.executable)
    size = args.model.stat().st_size
    print(
        f"model {args.model.name}: {size / 2**30:.2f} GiB; limit {args.limit} GiB ({size / limit:.2f}x smaller)"
    )
    ref, _ = run_worker(
        sys.executable, ["--worker", "ours", "--worker-threads", "1", *common], None, args.timeout
    )
    print(f"reference (ours, no limit, -t 1): decode {ref['decode_tps']:.2f} tok/s")
    lref = None
    if llama:
        lref, _ = run_worker(
            llama, ["--worker", "llama", "--worker-threads", "1", *common], None, args.timeout
        )
        print(f"reference (llama.cpp, no limit, -t 1): decode {lref['decode_tps']:.2f} tok/s")
    rows = []
    for t in [int(x) for x in args.threads.split(",")]:
        got: dict[str, list[dict]] = {"ours": [], "llama": []}
        peaks: dict[str, list[int]] = {"ours": [], "llama": []}
        for r in range(args.reps):
            sides = ["ours"] + (["llama"] if llama else [])
            if r % 2:
                sides.reverse()
            for side in sides:
                drop_page_cache(args.model)
                wargs = ["--worker", side, "--worker-threads", str(t), *common]
                if side == "ours":
                    wargs += ["--worker-limit", str(args.limit)]
                ans, peak = run_worker(
                    sys.executable if side == "ours" else llama, wargs, limit, args.timeout
                )
                ans["ref"] = ref["ids"] if side == "ours" else (lref or ref)["ids"]
                got[side].append(ans)
                peaks[side].append(peak)
                print(
                    f"  -t {t} rep {r} {side}: decode {ans['decode_tps']:.2f} tok/s, prompt {ans['prompt_s']:.2f} s, "
                    f"peak {peak / 2**30:.3f} GiB, ids agree with its own unlimited run for "
                    f"{agree(ans['ids'], ans['ref'])}/{len(ref['ids'])}"
                    + (f", store {ans['store']}" if "store" in ans else ""),
                    flush=True,
                )
        row = {"threads": t}
        for side in got:
            if got[side]:
                row[side] = {
                    "decode_tps": statistics.median(a["decode_tps"] for a in got[side]),
                    "prompt_s": statistics.median(a["prompt_s"] for a in got[side]),
                    "peak_gib": max(peaks[side]) / 2**30,
                    "ids_equal": all(a["ids"] == a["ref"] for a in got[side]),
                    "ids_agree_min": min(agree(a["ids"], a["ref"]) for a in got[side]),
                }
        rows.append(row)
    print(
        "\n| -t | ours tok/s | llama.cpp tok/s | ratio | peak GiB ours / llama.cpp | ids = unlimited (ours / llama.cpp) |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for row in rows:
        o, lc = row.get("ours"), row.get("llama")
        ratio = f"{o['decode_tps'] / lc['decode_tps']:.2f}x" if o and lc else "-"
        lt = f"{lc['decode_tps']:.2f}" if lc else "-"
        lp = f"{lc['peak_gib']:.3f}" if lc else "-"
        print(
            f"| {row['threads']} | {o['decode_tps']:.2f} | {lt} | {ratio} | {o['peak_gib']:.3f} / {lp} | "
            f"{o['ids_equal']} / {lc['ids_equal'] if lc else '-'} |"
        )
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
