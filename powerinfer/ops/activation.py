"""FFN activations as data: a name per activation, the torch reference, and the gating h = act(g) * up (`gated`,
the kernels' arithmetic; `gated_ref`, torch's).

The fused sparse kernels (pi_ffn_rows, pi_predict_ffn) take the activation as its index in ACTIVATIONS. ReLU is
bit-identical between the kernels and torch; the others use libm in torch's formulas (see kernels/cpu/sparse.c).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F

from powerinfer.ops import library

__all__ = ["ACTIVATIONS", "act", "activation_code", "gated", "gated_ref"]

# index = the kernels' act code (enum ffn_act in kernels/cpu/sparse.c)
ACTIVATIONS = ("relu", "silu", "gelu", "gelu_tanh")

_TORCH: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = MappingProxyType(
    {
        "relu": torch.relu,
        "silu": F.silu,
        "gelu": F.gelu,  # erf form
        "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    }
)
assert tuple(_TORCH) == ACTIVATIONS


def activation_code(name: str) -> int:
    """The kernels' code of an activation name; a ValueError naming the choices otherwise."""
    try:
        return ACTIVATIONS.index(name)
    except ValueError:
        raise ValueError(f"FFN activation must be one of {ACTIVATIONS}, got {name!r}") from None


def act(name: str, g: torch.Tensor) -> torch.Tensor:
    """The activation `name` of g as torch computes it (a new tensor): relu, silu, gelu (erf) or gelu_tanh."""
    fn = _TORCH.get(name)
    if fn is None:
        activation_code(name)  # raises the error naming the choices
    return fn(g)


def gated_ref(g: torch.Tensor, u: torch.Tensor, act: str, relu_up: bool) -> torch.Tensor:
    """h = act(g) * (relu(u) if relu_up else u), elementwise over g and u of one shape, with torch's activation."""
    fn = _TORCH.get(act)
    if fn is None:
        activation_code(act)
    return fn(g).mul_(torch.relu(u) if relu_up else u)


def gated(g: torch.Tensor, u: torch.Tensor, act: str, relu_up: bool) -> torch.Tensor:
    """h = act(g) * (relu(u) if relu_up else u) as the fused kernels compute it (pi_gated: libm's activation in
    torch's formulas, within a few float32 ulps of gated_ref; ReLU bit for bit) for float32 CPU tensors of one
    shape, else gated_ref. A new tensor."""
    lib = library.load()
    if (
        lib is None
        or g.dtype is not torch.float32
        or u.dtype is not torch.float32
        or g.shape != u.shape
        or not (g.is_cpu and u.is_cpu)
    ):
        return gated_ref(g, u, act, relu_up)
    g, u = g.contiguous(), u.contiguous()
    out = torch.empty_like(g)
    if lib.gated(g.data_ptr(), u.data_ptr(), g.numel(), activation_code(act), int(relu_up), out.data_ptr()):
        raise ValueError(f"gated: kernel rejected {act!r} over {g.numel()} elements")
    return out
