"""MoE ops: the down projections of one token's selected experts, read from the stacked ffn_down_exps blocks.

`experts_down` runs each selected expert's rows through the dense matmul kernel (the one `linear` calls, so each
output is bit for bit what `linear` gives on the expert's row slice) into one preallocated output, without a
`linear` call, weight slice or output tensor per expert; `experts_down_ref` is `linear` on each slice.
"""

from __future__ import annotations

import torch

from powerinfer.ops.context import KernelContext, default_context
from powerinfer.ops.dense import linear
from powerinfer.ops.library import check_status
from powerinfer.ops.weights import QWeight, weight_rows

__all__ = ["experts_down", "experts_down_ref"]


def experts_down_ref(
    h: torch.Tensor, down: QWeight, n_embd: int, experts: list[int], kc: KernelContext | None = None
) -> torch.Tensor:
    """y[j] = down_{experts[j]} @ h[j] with `linear` on each expert's rows: (k, n_embd) float32."""
    return torch.cat(
        [
            linear(h[j : j + 1], weight_rows(down, e * n_embd, (e + 1) * n_embd), kc)
            for j, e in enumerate(experts)
        ]
    )


def experts_down(
    h: torch.Tensor, down: QWeight, n_embd: int, experts: list[int], kc: KernelContext | None = None
) -> torch.Tensor:
    """y[j] = down_{experts[j]} @ h[j]: h (k, F) float32, down the stack (n_expert * n_embd, F) -> (k, n_embd)."""
    if kc is None:
        kc = default_context()
    k, F = h.shape
    n_expert = down.shape[0] // n_embd
    if any(not 0 <= e < n_expert for e in experts) or len(experts) != k or down.shape[1] != F:
        raise ValueError(
            f"experts_down: experts {experts} of {n_expert}, h {tuple(h.shape)}, down {down.shape}"
        )
    kernel = kc.kernels.matmul.get(down.ggml_type)
    if kernel is None or h.dtype is not torch.float32 or not h.is_contiguous() or not h.is_cpu:
        return experts_down_ref(h.to("cpu", torch.float32), down, n_embd, experts, kc)
    y = torch.empty(k, n_embd, dtype=torch.float32)
    w, stride, x, out = down._raw_ptr, down._raw_stride, h.data_ptr(), y.data_ptr()
    threads, level = kc.threads_now, kc.level
    for j, e in enumerate(experts):
        status = kernel(
            w + e * n_embd * stride, stride, n_embd, F, x + 4 * j * F, F, 1, out + 4 * j * n_embd, n_embd,
            threads, level,
        )  # fmt: skip
        if status:
            check_status(status, "experts_down")
    return y
