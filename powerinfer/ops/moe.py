"""MoE ops: one token's selected experts, read from the stacked ffn_{gate,up,down}_exps blocks.

`experts_matmul` runs each selected expert's rows through the dense matmul kernel (the one `linear` calls, so each
output is bit for bit what `linear` gives on the expert's row slice) into one preallocated output, without a
`linear` call, weight slice or output tensor per expert; `experts_matmul_ref` is `linear` on each slice.
`grouped_matmul` does the same for a batch's tokens grouped by expert (one kernel call per group).
"""

from __future__ import annotations

import torch

from powerinfer.ops.context import KernelContext, default_context
from powerinfer.ops.dense import linear
from powerinfer.ops.library import check_status
from powerinfer.ops.weights import QWeight, weight_rows

__all__ = ["experts_matmul", "experts_matmul_ref", "grouped_matmul", "grouped_matmul_ref"]


def experts_matmul_ref(
    x: torch.Tensor, w: QWeight, n_rows: int, experts: list[int], kc: KernelContext | None = None
) -> torch.Tensor:
    """y[j] = W_{experts[j]} @ x[j] (x[0] for every j when x has one row) with `linear` on each expert's rows."""
    shared = x.shape[0] == 1
    return torch.cat(
        [
            linear(x[0:1] if shared else x[j : j + 1], weight_rows(w, e * n_rows, (e + 1) * n_rows), kc)
            for j, e in enumerate(experts)
        ]
    )


def experts_matmul(
    x: torch.Tensor, w: QWeight, n_rows: int, experts: list[int], kc: KernelContext | None = None
) -> torch.Tensor:
    """y[j] = W_{experts[j]} @ x[j]: w the stack (n_expert * n_rows, K) of n_rows-row matrices, x (k, K) one input
    per expert or (1, K) one for all, float32 -> (k, n_rows) float32."""
    if kc is None:
        kc = default_context()
    k, K = len(experts), w.shape[1]
    n_expert = w.shape[0] // n_rows
    if (
        any(not 0 <= e < n_expert for e in experts)
        or x.shape[-1] != K
        or x.shape[0] not in (1, k)
        or x.dim() != 2
    ):
        raise ValueError(f"experts_matmul: experts {experts} of {n_expert}, x {tuple(x.shape)}, w {w.shape}")
    kernel = kc.kernels.matmul.get(w.ggml_type)
    if kernel is None or x.dtype is not torch.float32 or not x.is_contiguous() or not x.is_cpu:
        return experts_matmul_ref(x.to("cpu", torch.float32), w, n_rows, experts, kc)
    y = torch.empty(k, n_rows, dtype=torch.float32)
    base, stride, x_ptr, out = w._raw_ptr, w._raw_stride, x.data_ptr(), y.data_ptr()
    x_step = 0 if x.shape[0] == 1 else 4 * K
    threads, level = kc.threads_now, kc.level
    for j, e in enumerate(experts):
        status = kernel(
            base + e * n_rows * stride, stride, n_rows, K, x_ptr + j * x_step, K, 1, out + 4 * j * n_rows,
            n_rows, threads, level,
        )  # fmt: skip
        if status:
            check_status(status, "experts_matmul")
    return y


def grouped_matmul_ref(
    x: torch.Tensor,
    w: QWeight,
    n_rows: int,
    experts: list[int],
    counts: list[int],
    kc: KernelContext | None = None,
) -> torch.Tensor:
    """`grouped_matmul` with `linear` on each group and expert slice."""
    out, start = [], 0
    for e, n in zip(experts, counts, strict=True):
        out.append(linear(x[start : start + n], weight_rows(w, e * n_rows, (e + 1) * n_rows), kc))
        start += n
    return torch.cat(out) if out else torch.empty(0, n_rows)


def grouped_matmul(
    x: torch.Tensor,
    w: QWeight,
    n_rows: int,
    experts: list[int],
    counts: list[int],
    kc: KernelContext | None = None,
) -> torch.Tensor:
    """A batch's tokens grouped by expert: rows start_j .. start_j + counts[j] of x (N, K) times expert experts[j]'s
    matrix of the stack w (n_expert * n_rows, K), each group in one matmul kernel call (bit for bit `linear`):
    (N, n_rows) float32, N = sum(counts)."""
    if kc is None:
        kc = default_context()
    K = w.shape[1]
    n_expert = w.shape[0] // n_rows
    if (
        any(not 0 <= e < n_expert for e in experts)
        or len(counts) != len(experts)
        or any(n < 0 for n in counts)
        or x.dim() != 2
        or x.shape != (sum(counts), K)
    ):
        raise ValueError(
            f"grouped_matmul: experts {experts} of {n_expert}, counts {counts}, x {tuple(x.shape)}"
        )
    kernel = kc.kernels.matmul.get(w.ggml_type)
    if kernel is None or x.dtype is not torch.float32 or not x.is_contiguous() or not x.is_cpu:
        return grouped_matmul_ref(x.to("cpu", torch.float32), w, n_rows, experts, counts, kc)
    y = torch.empty(x.shape[0], n_rows, dtype=torch.float32)
    base, stride, x_ptr, out = w._raw_ptr, w._raw_stride, x.data_ptr(), y.data_ptr()
    threads, level = kc.threads_now, kc.level
    start = 0
    for e, n in zip(experts, counts, strict=True):
        if n:
            status = kernel(
                base + e * n_rows * stride, stride, n_rows, K, x_ptr + 4 * start * K, K, n, out + 4 * start * n_rows,
                n_rows, threads, level,
            )  # fmt: skip
            if status:
                check_status(status, "grouped_matmul")
        start += n
    return y
