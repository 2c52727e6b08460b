"""The sparse output head's chain for one token in one kernel call (kernels/cpu/head.c).

`head_chain` describes the screen's projection P, the screen A and the head W once, as a C struct of weight
pointers and the matmul kernels ops.linear / ops.rows_matmul would call for them in the context's precision; each
call then computes u = RMSNorm(x) (where asked), z = P u, s = A z, about k candidates of s (every value at or above
a threshold sampled from every 16th value), their exact logits, the widening (more rows while the screen leaves
more than widen_mass of the probability outside the exact rows), the exact values written over s, and the numbers
the head's safety check needs. `pick` does the same after the screen, for one token of a step whose products ran
over all its tokens (ops.linear: the same bits per row). It returns None where the kernels do not apply (no
kernels, a weight on a device or of a type without a kernel), and the caller runs its torch path.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from powerinfer.ops import library
from powerinfer.ops.context import KernelContext
from powerinfer.ops.library import check_status
from powerinfer.ops.weights import QWeight
from powerinfer.quant import types as quant_types

__all__ = ["HeadChain", "HeadResult", "head_chain"]

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
_R8_BLOCK_BYTES = 144  # kernels/cpu/matmul.h: 8 rows' block of 32, repacked
MAX_WIDE = 2  # kernels/cpu/head.c: HEAD_MAX_WIDE, the widening steps a descriptor holds


class _HeadDesc(ctypes.Structure):  # head_desc
    _fields_ = [
        ("n_vocab", _i64), ("n_embd", _i64), ("rank", _i64), ("k", _i64), ("norm", _i32), ("eps", _f32),
        ("norm_weight", _ptr),
        ("proj", _ptr), ("proj_stride", _i64), ("proj_matmul", _ptr),
        ("screen", _ptr), ("screen_stride", _i64), ("screen_matmul", _ptr),
        ("output", _ptr), ("output_stride", _i64), ("output_rows", _ptr),
        ("screen_type", _i32), ("screen_r8", _ptr),
        ("widen_mass", _f32), ("n_wide", _i64), ("wide", _i64 * MAX_WIDE),
    ]  # fmt: skip


class _HeadResult(ctypes.Structure):  # head_result
    _fields_ = [
        ("m", _i64), ("steps", _i64), ("new_rows", _i64), ("whole", _i32),
        ("left", _f32), ("err", _f32), ("best", _f32),
    ]  # fmt: skip


class HeadResult(NamedTuple):
    u: torch.Tensor  # (1, n_embd): the final-normed hidden state; valid until the chain's next call
    logits: torch.Tensor  # (1, n_vocab): the screen's values with the exact rows' logits
    ids: (
        torch.Tensor
    )  # the exact rows' ids in its first m entries, increasing; valid until the chain's next call
    m: int
    left_out: float  # the largest screen value not among them
    err: float  # max |exact - screen| over the first (about k) candidates
    best: float  # the largest exact logit
    steps: int  # widening steps taken
    new_rows: int  # rows the widening added
    whole: bool  # a set overflowed its room (a screen of many ties): the caller computes the whole head

    @property
    def candidates(self) -> torch.Tensor:
        """(m,) int64: every exact row, increasing."""
        return self.ids[: self.m]


class HeadChain:
    """One token through the screen, the candidates' rows and the widening (head_chain builds it)."""

    def __init__(self, desc: _HeadDesc, keep: tuple[object, ...], kc: KernelContext) -> None:
        lib = library.load()
        assert lib is not None
        self.desc, self._keep, self.kc = desc, keep, kc  # keep: the tensors the struct points into
        self._desc_ref = ctypes.byref(desc)
        self._t1, self._pick = lib.head_t1, lib.head_pick
        self.n_vocab, self.n_embd = int(desc.n_vocab), int(desc.n_embd)
        need, room = int(lib.head_scratch_bytes(self._desc_ref)), int(lib.head_ids_room(self._desc_ref))
        if need < 0 or room < 0:
            raise ValueError("head chain: the descriptor does not fit its head")
        self._scratch = torch.empty(need, dtype=torch.uint8)
        self._ids = torch.empty(room, dtype=torch.int64)
        self._u = torch.empty(1, int(desc.n_embd), dtype=torch.float32)
        self._r = _HeadResult()
        self._r_ref = ctypes.byref(self._r)
        self._u_ptr, self._ids_ptr = self._u.data_ptr(), self._ids.data_ptr()
        self._scratch_ptr, self._scratch_bytes = self._scratch.data_ptr(), self._scratch.numel()

    def __call__(self, x: torch.Tensor) -> HeadResult:
        """x (1, n_embd) float32 contiguous CPU: one token's hidden state (its final-normed state where the chain was
        built without the norm)."""
        if x.numel() != self.n_embd or x.dtype is not torch.float32 or not x.is_contiguous() or not x.is_cpu:
            raise ValueError("head chain: x does not match the head")
        logits = torch.empty(1, self.n_vocab, dtype=torch.float32)
        kc = self.kc
        status = self._t1(
            self._desc_ref, x.data_ptr(), self._u_ptr, logits.data_ptr(), self._ids_ptr, self._r_ref,
            self._scratch_ptr, self._scratch_bytes, kc.threads_now, kc.level,
        )  # fmt: skip
        if status:
            check_status(status, "head_t1")
        return self._result(self._u, logits)

    def pick(self, u: torch.Tensor, logits: torch.Tensor) -> HeadResult:
        """The chain after its screen, for one token of a step whose screen values were computed over all of them:
        u (1, n_embd) its final-normed state, logits (1, n_vocab) its screen values, overwritten as __call__'s (both
        float32 contiguous CPU)."""
        for t, n in ((u, self.n_embd), (logits, self.n_vocab)):
            if t.numel() != n or t.dtype is not torch.float32 or not t.is_contiguous() or not t.is_cpu:
                raise ValueError("head chain: a row does not match the head")
        kc = self.kc
        status = self._pick(
            self._desc_ref, u.data_ptr(), logits.data_ptr(), self._ids_ptr, self._r_ref,
            self._scratch_ptr, self._scratch_bytes, kc.threads_now, kc.level,
        )  # fmt: skip
        if status:
            check_status(status, "head_pick")
        return self._result(u, logits)

    def _result(self, u: torch.Tensor, logits: torch.Tensor) -> HeadResult:
        r = self._r
        return HeadResult(
            u, logits, self._ids, r.m, r.left, r.err, r.best, r.steps, r.new_rows, bool(r.whole)
        )


def _address(fn: object) -> int:
    return int(ctypes.cast(fn, _ptr).value or 0)


def head_chain(
    proj: QWeight,
    screen: QWeight,
    output: QWeight,
    k: int,
    kc: KernelContext,
    norm: tuple[torch.Tensor | None, float] | None = None,
    widen_mass: float = 1.0,
    wides: tuple[int, ...] = (),
) -> HeadChain | None:
    """The chain of a head W (n_vocab, n_embd) screened by P (rank, n_embd) and A (n_vocab, rank) with about k
    candidates, widened to about wides[j] rows (increasing, each over k, at most MAX_WIDE of them) while the screen
    leaves more than widen_mass of the probability outside the exact rows, or None where the kernels do not apply
    (or the vocabulary is too small for the sampled selection: ceil(n / 16) rows of every 16th value). norm (weight
    or None, eps): the chain applies that RMSNorm (ops.rms_norm's kernel) to its input first; None: its input is the
    normed state already."""
    lib = library.load()
    if lib is None or not kc.uses_kernels:
        return None
    weights = (proj, screen, output)
    if any(not isinstance(w, QWeight) or w.on_device or not w.raw.is_cpu for w in weights):
        return None
    proj_mm = kc.kernels.matmul.get(proj.ggml_type)
    screen_mm = kc.kernels.matmul.get(screen.ggml_type)
    rows = kc.kernels.rows_matmul.get(output.ggml_type)
    if proj_mm is None or screen_mm is None or rows is None:
        return None
    n_vocab, n_embd = output.shape
    rank = proj.shape[0]
    if proj.shape != (rank, n_embd) or screen.shape != (n_vocab, rank) or not 0 < k < n_vocab:
        return None
    sizes = (k, *wides)
    increasing = all(a < b for a, b in zip(sizes, sizes[1:], strict=False))
    if len(wides) > MAX_WIDE or not increasing or -(-sizes[-1] // 16) > n_vocab // 16:
        return None
    weight, eps = norm if norm is not None else (None, 0.0)
    if weight is not None and (
        weight.dtype is not torch.float32 or not weight.is_cpu or weight.shape != (n_embd,)
    ):
        return None
    if weight is not None:
        weight = weight.contiguous()
    packed = repacked_screen(screen, kc)
    desc = _HeadDesc(
        n_vocab, n_embd, rank, k, int(norm is not None), eps, 0 if weight is None else weight.data_ptr(),
        proj._raw_ptr, proj._raw_stride, _address(proj_mm),
        screen._raw_ptr, screen._raw_stride, _address(screen_mm),
        output._raw_ptr, output._raw_stride, _address(rows),
        int(screen.ggml_type), 0 if packed is None else packed.data_ptr(),
        widen_mass, len(wides), (_i64 * MAX_WIDE)(*wides),
    )  # fmt: skip
    return HeadChain(desc, (*weights, weight, packed), kc)


def repacked_screen(screen: QWeight, kc: KernelContext) -> torch.Tensor | None:
    """The screen's rows repacked by 8 for the q8 precision's one-token product (pi_matvec_rows8: the bits of the
    type's int8 matmul, without its per-call transpose of short rows), or None where it does not apply (a type
    without rows8 in the registry, f32 activations, a row count that is not a multiple of 8)."""
    n, k = screen.shape
    row = quant_types.info(screen.ggml_type)
    if row is None or not row.rows8 or kc.act_precision != "q8" or n % 8 or k % 32 or n == 0:
        return None
    lib = library.load()
    assert lib is not None
    packed = torch.empty(n // 8 * (k // 32) * _R8_BLOCK_BYTES, dtype=torch.uint8)
    status = lib.repack_rows8(
        int(screen.ggml_type), screen._raw_ptr, screen._raw_stride, n, k, packed.data_ptr()
    )
    if status != 0:
        check_status(status, "repack_rows8")
    return packed
