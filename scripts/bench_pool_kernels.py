"""Time the CUDA pool's Triton kernels (powerinfer.ops.triton_quant) against the device's copy rate and torch's f16
matmul, and print one table.

For each type (Q4_0, Q4_1, Q8_0, F16, Q4_K), each weight shape N x K (11008 x 4096: gate/up rows, or the
transposed down rows for axpy; 4096 x 11008) and T in (1, 16, 64, 512): matmul y = x @ W.T (x (T, K)) and
axpy y = h @ W (h (T, N), every row active). A call is captured in a CUDA graph (the pool's decode replays graphs;
this leaves out Python's launch cost, not the gaps between a call's kernels) with the weight rotated among copies
that together pass 256 MiB, so the L2 cache (50 MiB on an H200) does not hold it; the median of the replays'
CUDA-event times is reported. GB/s is the weight's bytes over the call's time; "/ copy" compares it with the
device's copy rate (read + write bytes of a clone of 1 GiB); torch f16 is x @ W.T on an f16 copy of the weight
(cuBLAS), in the same units. Rows of the table start with "| " (scripts/gpu_check.sh greps them).

Usage: python scripts/bench_pool_kernels.py [--reps N] [--budget-s S]. Without a CUDA device it prints one line and
exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

TYPES = ("Q4_0", "Q4_1", "Q8_0", "F16", "Q4_K")
SHAPES = ((11008, 4096), (4096, 11008))
TOKENS = (1, 16, 64, 512)
ROTATE_BYTES = 256 << 20


def random_rows(ggml_type, n_rows: int, n_cols: int, device: torch.device) -> torch.Tensor:
    """Raw ggml rows (uint8 (n_rows, row_bytes)) on the device: random quants, finite random fp16 scales."""
    from powerinfer.gguf.constants import GGMLType
    from powerinfer.quant import row_bytes

    if ggml_type == GGMLType.F16:
        return (torch.randn(n_rows, n_cols, device=device) * 0.02).half().view(torch.uint8)
    per_block = {GGMLType.Q4_0: 32, GGMLType.Q4_1: 32, GGMLType.Q8_0: 32, GGMLType.Q4_K: 256}[ggml_type]
    scale_offsets = {GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q8_0: (0,), GGMLType.Q4_K: (0, 2)}
    block_bytes = row_bytes(ggml_type, per_block)
    n_blocks = n_cols // per_block
    raw = torch.randint(0, 256, (n_rows, n_blocks, block_bytes), dtype=torch.uint8, device=device)
    for off in scale_offsets[ggml_type]:
        scales = (torch.rand(n_rows, n_blocks, device=device) * 0.01).half()
        raw[:, :, off : off + 2] = scales.view(torch.uint8).view(n_rows, n_blocks, 2)
    return raw.view(n_rows, n_blocks * block_bytes)


def graph_time_us(fn, reps: int) -> float:
    """Median time of one call of fn (seconds -> microseconds), fn captured in a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def time_calls(op, inputs: torch.Tensor, weights: list, reps: int) -> float:
    """Median microseconds of one call op(inputs, w): one graph calls it once per weight (a rotation past L2)."""

    def calls() -> None:
        for w in weights:
            op(inputs, w)

    return graph_time_us(calls, reps) / len(weights)


def copy_gbps() -> float:
    """Read + write bytes per second of a clone of 1 GiB."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    del src, dst
    return 2 * (1 << 30) / statistics.median(times) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20, help="graph replays timed per cell")
    parser.add_argument(
        "--budget-s", type=float, default=50.0, help="skip the cells left after this many seconds"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_pool_kernels: no CUDA device, nothing measured")
        return 0
    from powerinfer.gguf.constants import GGMLType
    from powerinfer.ops import triton_quant as tq
    from powerinfer.quant import row_bytes

    t_start = time.monotonic()
    device = torch.device("cuda")
    torch.manual_seed(0)
    copy = copy_gbps()
    print(
        f"device: {torch.cuda.get_device_name(device)}; copy rate {copy:.0f} GB/s (clone of 1 GiB, read + write)"
    )
    print(
        f"times: median of {args.reps} CUDA-graph replays per cell; weights rotated among copies over 256 MiB"
    )
    print()
    print("| type | shape N x K | T | matmul GB/s | axpy GB/s | matmul / copy | axpy / copy | torch f16 GB/s "
          "| matmul us | axpy us |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    torch_f16: dict[tuple[int, int, int], float] = {}
    skipped = 0
    for name in TYPES:
        ggml_type = GGMLType[name]
        for N, K in SHAPES:
            if time.monotonic() - t_start > args.budget_s:
                skipped += len(TOKENS)
                continue
            n_bytes = N * row_bytes(ggml_type, K)
            n_copies = max(1, -(-ROTATE_BYTES // n_bytes))
            weights = [tq.pack(random_rows(ggml_type, N, K, device), ggml_type, K) for _ in range(n_copies)]
            for T in TOKENS:
                if time.monotonic() - t_start > args.budget_s:
                    skipped += 1
                    continue
                x = torch.randn(T, K, device=device)
                h = torch.randn(T, N, device=device)
                mm_us = time_calls(tq.matmul, x, weights, args.reps)
                ax_us = time_calls(tq.axpy, h, weights, args.reps)
                if (N, K, T) not in torch_f16:
                    w16 = [torch.randn(N, K, device=device, dtype=torch.float16) for _ in range(2)]
                    us = time_calls(lambda a, w: a @ w.T, x.half(), w16, args.reps)
                    torch_f16[(N, K, T)] = N * K * 2 / (us * 1e-6) / 1e9
                    del w16
                mm, ax = n_bytes / (mm_us * 1e-6) / 1e9, n_bytes / (ax_us * 1e-6) / 1e9
                print(
                    f"| {name} | {N} x {K} | {T} | {mm:.0f} | {ax:.0f} | {mm / copy:.2f} | {ax / copy:.2f} "
                    f"| {torch_f16[(N, K, T)]:.0f} | {mm_us:.1f} | {ax_us:.1f} |",
                    flush=True,
                )
            weights.clear()
            torch.cuda.empty_cache()
    took = time.monotonic() - t_start
    tail = f"; {skipped} cells skipped past --budget-s {args.budget_s:.0f}" if skipped else ""
    print(f"\n{took:.0f} s{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
