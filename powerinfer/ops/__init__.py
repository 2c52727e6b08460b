"""The Python face of the CPU kernels: the only module that names a kernel.

The C kernels are built by setup.py as the extension `powerinfer._kernels` and called through ctypes. When the
extension is missing (plain checkout, no build) or a weight type has no kernel, every op falls back to the
pure-torch reference in `powerinfer.ops.reference`, which is also the oracle in tests.

Kernel types (`supported_types()` while the kernels are on) are always computed from the raw bytes. Other
types (K-quants, ...) are decoded to a float32 copy on first use, cached on the QWeight.

Activation precision of the quant kernels (Q4_0, Q4_1, Q8_0; Q5_0/Q5_1 are always exact), `set_activation_precision`:
- "f32" (default, exact mode): x stays float32; each weight block is decoded in registers to the reference
  dequantiser's floats and multiplied in float32. Equal to x @ dequant(W).T up to summation order, as
  transformers computes it.
- "q8": x is rounded to int8 blocks of 32 and the block dot products are integer (llama.cpp's arithmetic):
  faster on prompts, slightly less precise.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from powerinfer.errors import PlacementError
from powerinfer.gguf.constants import GGMLType
from powerinfer.ops import reference
from powerinfer.quant import KERNEL_TYPES, POOL_TYPES, row_bytes

__all__ = [
    "DeviceWeight",
    "QWeight",
    "attn_decode",
    "get_activation_precision",
    "get_num_threads",
    "get_rows",
    "kernels_available",
    "linear",
    "set_activation_precision",
    "set_num_threads",
    "supported_types",
    "use_kernels",
]

log = logging.getLogger(__name__)

# ggml type -> suffix of the C symbols pi_matmul_<suffix> and pi_get_rows_<suffix>
_C_NAMES: dict[GGMLType, str] = {
    GGMLType.F32: "f32",
    GGMLType.F16: "f16",
    GGMLType.BF16: "bf16",
    GGMLType.Q4_0: "q4_0",
    GGMLType.Q4_1: "q4_1",
    GGMLType.Q8_0: "q8_0",
    GGMLType.Q5_0: "q5_0",
    GGMLType.Q5_1: "q5_1",
}
assert frozenset(_C_NAMES) == KERNEL_TYPES
# types whose matmul has an exact (float activation) kernel pi_matmul_<suffix>_f next to the int8 one
_QUANT_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0})
# block types with only the exact kernels (pi_matmul_<suffix>_f), used in both precisions
_EXACT_ONLY_TYPES = frozenset({GGMLType.Q5_0, GGMLType.Q5_1})
_ACT_PRECISIONS = ("f32", "q8")

_PI_ERR_SHAPE, _PI_ERR_ALLOC, _PI_ERR_INDEX = 1, 2, 3

_i64, _i32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
# (w, w_stride_bytes, N, K, x, x_stride, T, y, y_stride, n_threads)
_MATMUL_ARGTYPES = [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i32]
# (w, w_stride_bytes, N, K, ids, n_ids, y, y_stride, n_threads)
_GET_ROWS_ARGTYPES = [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i32]
# rows_matmul (w, w_stride_bytes, N, K, idx, M, x, x_stride, T, y, y_stride, n_threads) and
# rows_axpy (w_t, w_stride_bytes, N, D, idx or NULL, M, h, h_stride, T, y, y_stride, n_threads)
_SPARSE_ARGTYPES = [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _i32]
# ffn_rows (u, K, D, N, gate, gate_stride, gate_kind, up, up_stride, up_kind, down_t, down_stride, down_kind,
#           idx, M, relu_up, q8_act, y, n_threads)
_FFN_ROWS_ARGTYPES = [_ptr, _i64, _i64, _i64] + [_ptr, _i64, _i32] * 3 + [_ptr, _i64, _i32, _i32, _ptr, _i32]
# predict_ffn (x, u, K, D, N, fc1, fc1_stride, fc1_kind, rank, fc2, fc2_stride, fc2_kind, threshold,
#              gate, gate_stride, gate_kind, up, .., down_t, .., relu_up, idx, n_active, predictor_seconds, y, n_threads)
_PREDICT_FFN_ARGTYPES = (
    [_ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _i32, _i64, _ptr, _i64, _i32, ctypes.c_float]
    + [_ptr, _i64, _i32] * 3
    + [_i32, _ptr, _ptr, _ptr, _ptr, _i32]
)
# weight kind codes of pi_ffn_rows (enum axpy_kind in kernels/cpu/sparse.c)
_FFN_KINDS: dict[GGMLType, int] = {
    GGMLType.Q4_0: 0,
    GGMLType.Q4_1: 1,
    GGMLType.Q8_0: 2,
    GGMLType.F32: 3,
    GGMLType.F16: 4,
    GGMLType.BF16: 5,
    GGMLType.Q5_0: 6,
    GGMLType.Q5_1: 7,
}


class _Kernels:
    """ctypes handles of the built library, resolved once."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.matmul: dict[GGMLType, Any] = {}  # int8 activations for the quant types ("q8")
        self.matmul_f: dict[GGMLType, Any] = {}  # float activations for every type ("f32")
        self.get_rows: dict[GGMLType, Any] = {}
        self.rows_matmul: dict[GGMLType, Any] = {}  # int8 activations for the quant types ("q8")
        self.rows_matmul_f: dict[GGMLType, Any] = {}  # float activations ("f32")
        self.rows_axpy: dict[GGMLType, Any] = {}
        for ggml_type, name in _C_NAMES.items():
            matmul = getattr(lib, f"pi_matmul_{name}{'_f' if ggml_type in _EXACT_ONLY_TYPES else ''}")
            matmul.argtypes, matmul.restype = _MATMUL_ARGTYPES, _i32
            self.matmul[ggml_type] = matmul
            if ggml_type in _QUANT_TYPES:
                matmul = getattr(lib, f"pi_matmul_{name}_f")
                matmul.argtypes, matmul.restype = _MATMUL_ARGTYPES, _i32
            self.matmul_f[ggml_type] = matmul
            rows = getattr(lib, f"pi_get_rows_{name}")
            rows.argtypes, rows.restype = _GET_ROWS_ARGTYPES, _i32
            self.get_rows[ggml_type] = rows
            # sparse FFN kernels (kernels/cpu/sparse.c): same activation-precision split as matmul
            for table, suffix in ((self.rows_matmul, ""), (self.rows_matmul_f, "_f")):
                exact_only = ggml_type in _EXACT_ONLY_TYPES
                symbol = f"pi_rows_matmul_{name}{suffix if ggml_type in _QUANT_TYPES else '_f' if exact_only else ''}"
                kernel = getattr(lib, symbol)
                kernel.argtypes, kernel.restype = _SPARSE_ARGTYPES, _i32
                table[ggml_type] = kernel
            axpy = getattr(lib, f"pi_rows_axpy_{name}")
            axpy.argtypes, axpy.restype = _SPARSE_ARGTYPES, _i32
            self.rows_axpy[ggml_type] = axpy
        self.ffn_rows = lib.pi_ffn_rows  # fused decode FFN over a row list (one token)
        self.ffn_rows.argtypes, self.ffn_rows.restype = _FFN_ROWS_ARGTYPES, _i32
        self.predict_ffn = lib.pi_predict_ffn  # predictor + fused decode FFN (one token, float activations)
        self.predict_ffn.argtypes, self.predict_ffn.restype = _PREDICT_FFN_ARGTYPES, _i32
        self.attn_decode = lib.pi_attn_decode  # RoPE + KV write + attention of one token
        self.attn_decode.argtypes = [_ptr] * 6 + [_i64] * 4 + [ctypes.c_float, _ptr, _i32]
        self.attn_decode.restype = _i32
        self.isa = lib.pi_kernels_isa
        self.isa.argtypes, self.isa.restype = [], ctypes.c_char_p
        self.set_isa = lib.pi_kernels_set_isa
        self.set_isa.argtypes, self.set_isa.restype = [_i32], _i32


def _load_kernels() -> _Kernels | None:
    try:
        spec = importlib.util.find_spec("powerinfer._kernels")
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        log.debug("powerinfer._kernels is not built; ops use the torch reference")
        return None
    try:
        kernels = _Kernels(ctypes.CDLL(spec.origin))
    except (OSError, AttributeError) as exc:
        log.debug("cannot load %s (%s); ops use the torch reference", spec.origin, exc)
        return None
    log.debug("loaded kernels from %s (%s)", spec.origin, kernels.isa().decode())
    return kernels


_KERNELS = _load_kernels()


@dataclass
class _Settings:
    """Thread count, activation precision and the kernels in use (empty dicts while switched off or not built)."""

    n_threads: int
    enabled: bool = True
    act: str = "f32"
    matmul: dict[GGMLType, Any] = field(default_factory=dict)
    get_rows: dict[GGMLType, Any] = field(default_factory=dict)
    rows_matmul: dict[GGMLType, Any] = field(default_factory=dict)
    rows_axpy: dict[GGMLType, Any] = field(default_factory=dict)
    ffn_rows: Any = None  # pi_ffn_rows while the kernels are on
    predict_ffn: Any = None  # pi_predict_ffn while the kernels are on in f32 precision
    attn_decode: Any = None  # pi_attn_decode while the kernels are on
    ffn_kinds: dict[GGMLType, int] = field(default_factory=dict)  # its weight kind codes (kernel types)

    def select(self, enabled: bool, act: str) -> None:
        self.enabled, self.act = enabled, act
        on = enabled and _KERNELS is not None
        matmul = (_KERNELS.matmul_f if act == "f32" else _KERNELS.matmul) if on else {}
        self.matmul = dict(matmul)
        self.get_rows = dict(_KERNELS.get_rows) if on else {}
        rows_matmul = (_KERNELS.rows_matmul_f if act == "f32" else _KERNELS.rows_matmul) if on else {}
        self.rows_matmul = dict(rows_matmul)
        self.rows_axpy = dict(_KERNELS.rows_axpy) if on else {}
        self.ffn_rows = _KERNELS.ffn_rows if on else None
        self.predict_ffn = _KERNELS.predict_ffn if on and act == "f32" else None
        self.attn_decode = _KERNELS.attn_decode if on else None
        self.ffn_kinds = dict(_FFN_KINDS) if on else {}


_settings = _Settings(n_threads=torch.get_num_threads())
_settings.select(True, "f32")


def kernels_available() -> bool:
    """True when the C kernels are built and loaded."""
    return _KERNELS is not None


def use_kernels(enabled: bool) -> bool:
    """Switch the C kernels on or off (off forces the torch reference); returns the previous setting."""
    previous = _settings.enabled
    _settings.select(bool(enabled), _settings.act)
    return previous


def set_activation_precision(precision: str) -> str:
    """Activation precision of the quant kernels: "f32" (exact, default) or "q8" (int8 blocks, llama.cpp's
    arithmetic); returns the previous setting. F32/F16 weights and the torch fallback always use float32."""
    if precision not in _ACT_PRECISIONS:
        raise ValueError(f"activation precision must be one of {_ACT_PRECISIONS}, got {precision!r}")
    previous = _settings.act
    _settings.select(_settings.enabled, precision)
    return previous


def get_activation_precision() -> str:
    """The activation precision of the quant kernels, "f32" or "q8"."""
    return _settings.act


def supported_types() -> frozenset[GGMLType]:
    """ggml types computed by the C kernels right now (empty when they are missing or switched off)."""
    return frozenset(_settings.matmul)


def set_num_threads(n: int) -> None:
    """Threads used by the kernels and by torch."""
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    _settings.n_threads = int(n)
    torch.set_num_threads(int(n))


def get_num_threads() -> int:
    """Threads used by the kernels."""
    return _settings.n_threads


def _set_isa(name: str) -> str:
    """Testing hook: pick the kernel variant ("scalar", "avx2", "avx512"), capped at what the CPU has."""
    if _KERNELS is None:
        raise RuntimeError("kernels are not built")
    _KERNELS.set_isa(("scalar", "avx2", "avx512").index(name))
    return _KERNELS.isa().decode()


@dataclass(frozen=True, eq=False)
class QWeight:
    """A 2-D ggml weight kept as its raw bytes.

    raw: uint8 tensor (N, row_bytes), usually a zero-copy view of the memory-mapped model file.
    shape: (N, K) in elements. Only non-kernel types ever get a dequantised copy (`_dense`, built lazily).
    """

    raw: torch.Tensor
    ggml_type: GGMLType
    shape: tuple[int, int]
    _dense: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _raw_ptr: int = field(init=False, repr=False)  # address and row stride (bytes) of raw, for the kernels
    _raw_stride: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ggml_type", GGMLType(self.ggml_type))
        object.__setattr__(self, "shape", (int(self.shape[0]), int(self.shape[1])))
        n_rows, n_cols = self.shape
        expected = (n_rows, row_bytes(self.ggml_type, n_cols))
        if (
            self.raw.dtype != torch.uint8
            or tuple(self.raw.shape) != expected
            or self.raw.device.type != "cpu"
        ):
            raise ValueError(
                f"raw must be a CPU uint8 tensor of shape {expected} for a {self.ggml_type.name} weight of "
                f"shape {self.shape}, got {self.raw.dtype} {tuple(self.raw.shape)} on {self.raw.device}"
            )
        if n_rows > 1 and self.raw.stride(1) != 1:
            raise ValueError("raw rows must be contiguous")
        object.__setattr__(self, "_raw_ptr", self.raw.data_ptr())
        object.__setattr__(self, "_raw_stride", self.raw.stride(0))

    @classmethod
    def from_numpy(cls, raw: np.ndarray, ggml_type: GGMLType, shape: tuple[int, int]) -> QWeight:
        """Wrap raw tensor bytes (e.g. a read-only memmap) without copying."""
        ggml_type = GGMLType(ggml_type)
        rows = raw.reshape(-1).view(np.uint8).reshape(int(shape[0]), row_bytes(ggml_type, int(shape[1])))
        with warnings.catch_warnings():
            # memmaps are read-only; the ops never write to weights
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(rows)
        return cls(tensor, ggml_type, (int(shape[0]), int(shape[1])))


def _dense_cached(w: QWeight) -> torch.Tensor:
    dense = w._dense.get("f32")
    if dense is None:
        dense = w._dense["f32"] = reference.dense(w)
    return dense


def _output(x: torch.Tensor, n_out: int) -> tuple[int, torch.Tensor]:
    """Token count of a (T, K) or (K,) input and an empty float32 output (T, n_out) or (n_out,)."""
    if x.dim() == 2:
        return x.shape[0], torch.empty(x.shape[0], n_out, dtype=torch.float32)
    return 1, torch.empty(n_out, dtype=torch.float32)


def _check_status(status: int, op: str) -> None:
    if status == _PI_ERR_INDEX:
        raise IndexError(f"{op}: row id out of range")
    if status == _PI_ERR_ALLOC:
        raise MemoryError(f"{op}: scratch allocation failed")
    raise ValueError(f"{op}: kernel rejected the arguments (status {status})")


_BACKENDS = ("kernels", "triton")
_triton_quant: Any = None  # powerinfer.ops.triton_quant once a Triton weight was made


def _load_triton() -> Any:
    """The Triton kernels module (imported on first use: only a CUDA pool, or a test, needs triton)."""
    global _triton_quant
    if _triton_quant is None:
        try:
            from powerinfer.ops import triton_quant
        except ImportError as e:
            raise PlacementError(
                f"the CUDA pool computes on quantized weights with Triton kernels, but triton cannot be "
                f"imported ({e}); install it (pip install 'powerinfer[cuda]'; CUDA builds of torch ship it)"
            ) from e
        _triton_quant = triton_quant
    return _triton_quant


@dataclass(frozen=True, eq=False)
class DeviceWeight:
    """A weight, or some of its rows, kept on a compute device (the GPU pool, or the CPU standing in for it)
    in the file's own block format: no dequantised copy is resident, blocks are decoded inside the kernels.

    raw: uint8 (N, row_bytes) on the device, the ggml blocks of the rows (n_bytes = what the planner
    budgets, `quant.pool_bytes`). Types outside `quant.POOL_TYPES` are stored as F16 blocks.
    backend: "kernels" (CPU stand-in: the C kernels through a QWeight over raw) or "triton" (CUDA; the
    kernels of powerinfer.ops.triton_quant, which the Triton interpreter also runs on CPU tensors in tests).
    `linear` (y = x @ W.T) and `axpy` (y = h @ W) run on the weight's device and return float32 there; they
    move their input to that device.
    """

    raw: torch.Tensor
    ggml_type: GGMLType
    shape: tuple[int, int]
    backend: str = "kernels"
    _host: QWeight | None = field(default=None, init=False, repr=False)  # the C kernels' view of raw

    def __post_init__(self) -> None:
        object.__setattr__(self, "ggml_type", GGMLType(self.ggml_type))
        object.__setattr__(self, "shape", (int(self.shape[0]), int(self.shape[1])))
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {self.backend!r}")
        expected = (self.shape[0], row_bytes(self.ggml_type, self.shape[1]))
        if self.raw.dtype != torch.uint8 or tuple(self.raw.shape) != expected:
            raise ValueError(
                f"raw must be uint8 {expected} for a {self.ggml_type.name} weight of shape {self.shape}, "
                f"got {self.raw.dtype} {tuple(self.raw.shape)}"
            )
        if self.backend == "kernels":
            # raises unless raw is a CPU tensor with contiguous rows; keeps raw alive with the weight
            object.__setattr__(self, "_host", QWeight(self.raw, self.ggml_type, self.shape))
        else:
            if self.ggml_type not in _load_triton().SUPPORTED_TYPES:
                raise ValueError(f"no Triton kernel for {self.ggml_type.name} weights")

    @classmethod
    def from_qweight(
        cls,
        w: QWeight,
        device: torch.device,
        rows: torch.Tensor | None = None,
        backend: str | None = None,
    ) -> DeviceWeight:
        """Copy the raw blocks of `rows` of w (int64 ids; None = all rows) to `device`.

        Rows are gathered from the memory-mapped bytes with one index op; types outside POOL_TYPES are
        decoded to F16 blocks first. backend None: "triton" on CUDA, "kernels" on the CPU.
        """
        device = torch.device(device)
        if backend is None:
            backend = "triton" if device.type == "cuda" else "kernels"
        if backend == "triton":
            _load_triton()
        ids = None if rows is None else rows.to(device="cpu", dtype=torch.int64).reshape(-1)
        n_rows = w.shape[0] if ids is None else int(ids.shape[0])
        if w.ggml_type in POOL_TYPES:
            ggml_type = w.ggml_type
            raw = w.raw.clone() if ids is None else w.raw[ids]  # (n_rows, row_bytes), a contiguous copy
        else:
            ggml_type = GGMLType.F16
            every = torch.arange(w.shape[0], dtype=torch.int64) if ids is None else ids
            raw = get_rows(w, every).to(torch.float16).view(torch.uint8)  # (n_rows, 2 K)
        return cls(raw.to(device), ggml_type, (n_rows, w.shape[1]), backend)

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def n_bytes(self) -> int:
        return self.raw.nbytes

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """y = x @ W.T: x (..., K) -> (..., N) float32 on the weight's device."""
        host = self._host
        if host is not None:
            return linear(x.to("cpu"), host)
        x = x.to(self.raw.device, non_blocking=True)
        return _triton_quant.matmul(x, self.raw, self.ggml_type, self.shape[1])

    def axpy(self, h: torch.Tensor) -> torch.Tensor:
        """y = h @ W (W holds transposed rows, e.g. ffn_down_t): h (..., N) -> (..., K) float32 on the device."""
        host = self._host
        if host is not None:
            return _sparse.rows_axpy(h.to("cpu"), host, None)
        h = h.to(self.raw.device, non_blocking=True)
        return _triton_quant.axpy(h, self.raw, self.ggml_type, self.shape[1])


def _linear_fallback(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    if w.ggml_type in KERNEL_TYPES:
        return reference.linear(x, w)
    return x.to(torch.float32) @ _dense_cached(w).to(x.device).T


def linear(x: torch.Tensor, w: QWeight | DeviceWeight) -> torch.Tensor:
    """y = x @ W.T for x of shape (..., K) float32; returns (..., N) float32 (T = 1 is the decode matvec).

    A DeviceWeight computes on its own device and returns the result there.
    """
    # lean path: about 200 calls per token, so every attribute access here counts
    if type(w) is DeviceWeight:
        return w.linear(x)
    n_rows, n_cols = w.shape
    kernel = _settings.matmul.get(w.ggml_type)
    if kernel is None or not x.is_cpu:
        if x.shape[-1] != n_cols:
            raise ValueError(f"linear: x has {x.shape[-1]} features, weight {w.shape} expects {n_cols}")
        return _linear_fallback(x, w)
    ndim = x.dim()
    if x.dtype is not torch.float32 or not x.is_contiguous() or ndim > 2:
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()  # (T, K)
        return linear(x2, w).view(*x.shape[:-1], n_rows)
    if x.shape[-1] != n_cols:
        raise ValueError(f"linear: x has {x.shape[-1]} features, weight {w.shape} expects {n_cols}")
    n_tokens, y = _output(x, n_rows)
    status = kernel(
        w._raw_ptr,
        w._raw_stride,
        n_rows,
        n_cols,
        x.data_ptr(),
        n_cols,
        n_tokens,
        y.data_ptr(),
        n_rows,
        _settings.n_threads,
    )
    if status:
        _check_status(status, "linear")
    return y


def get_rows(w: QWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64 token ids) of W decoded to float32: shape ids.shape + (K,)."""
    kernel = _settings.get_rows.get(w.ggml_type)
    if kernel is None:
        if w.ggml_type in KERNEL_TYPES:
            return reference.get_rows(w, ids.reshape(-1)).view(*ids.shape, w.shape[1])
        return _dense_cached(w)[ids.to(torch.int64)]
    flat = ids
    if ids.dtype is not torch.int64 or ids.dim() != 1 or not ids.is_contiguous() or not ids.is_cpu:
        flat = ids.to(device="cpu", dtype=torch.int64).reshape(-1).contiguous()  # (n_ids,)
    n_ids, n_cols = flat.shape[0], w.shape[1]
    y = torch.empty(n_ids, n_cols, dtype=torch.float32)
    status = kernel(
        w._raw_ptr,
        w._raw_stride,
        w.shape[0],
        n_cols,
        flat.data_ptr(),
        n_ids,
        y.data_ptr(),
        n_cols,
        _settings.n_threads,
    )
    if status:
        _check_status(status, "get_rows")
    return y if ids.dim() == 1 else y.view(*ids.shape, n_cols)


def attn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: int,
) -> torch.Tensor | None:
    """Attention of one token at position `pos` in one kernel call; None where the kernel does not apply.

    q (1, H * D), k and v (1, H_kv * D): the token's projections (float32, CPU); rope (D / 2, 2): cos and sin of
    each pair's rotation at pos; k_cache, v_cache (n_ctx, H_kv, D): the sequence's cache of the layer (float32,
    contiguous, CPU), into which the rotated k and v are written at row pos. Returns (1, H * D): per head,
    softmax(q . K[0..pos] / sqrt(D)) . V[0..pos] with the query heads grouped over the KV heads (GQA).
    """
    kernel = _settings.attn_decode
    n_ctx, n_head_kv, head_dim = k_cache.shape
    if (
        kernel is None
        or not (q.is_cpu and k_cache.is_cpu)
        or k_cache.dtype is not torch.float32
        or not (k_cache.is_contiguous() and v_cache.is_contiguous() and rope.is_contiguous())
        or not 0 <= pos < n_ctx
    ):
        return None
    q = q.to(torch.float32).contiguous().clone()  # rotated in place by the kernel
    k = k.to(torch.float32).contiguous().clone()
    v = v.to(torch.float32).contiguous()
    n_head = q.numel() // head_dim
    out = torch.empty(1, n_head * head_dim, dtype=torch.float32)
    status = kernel(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), rope.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        pos, n_head, n_head_kv, head_dim, head_dim**-0.5, out.data_ptr(), _settings.n_threads,
    )  # fmt: skip
    if status:
        _check_status(status, "attn_decode")
    return out


# the sparse ops use this module's settings and helpers, so they are imported once it is complete
from powerinfer.ops import sparse as _sparse  # noqa: E402
