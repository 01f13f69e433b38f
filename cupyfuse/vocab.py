"""The tail vocabulary: one entry per elementwise op and per row reduction.

Each entry says how many operands the op takes, its float attributes, its torch
semantics (the CPU path and the tests' reference) and its CUDA fragment (the generated
kernels). Adding an op is one entry here; the front end (:mod:`cupyfuse.capture`) maps
torch calls onto these names, and the tests draw tails from :data:`MAPS` directly.

CUDA fragments are ``str.format`` templates: ``{0}``, ``{1}`` are the operands (float
expressions), ``{a0}``, ``{a1}`` the attributes (float literals). The helper functions
they call live in ``kernels_cu/tail_ops.cuh`` and follow PyTorch's float32 formulas,
NaN propagation included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["MapOp", "MAPS", "REDUCTIONS", "cuda_float"]


@dataclass(frozen=True)
class MapOp:
    """An elementwise op: ``arity`` operands, ``attrs`` names of its float attributes."""

    name: str
    arity: int
    torch_fn: Callable[..., torch.Tensor]  # (operands..., *attrs) -> tensor
    cuda: str
    attrs: tuple[str, ...] = ()
    #: transcendental functions per element (expf, logf, tanhf, erff ... each 1): what the
    #: op costs inside the GEMM's epilogue, where its math is not hidden behind memory
    cost: int = 0


def _clamp(v: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    if lo == -math.inf and hi == math.inf:   # no bound at all: torch.clamp(v, None, None) raises
        return v.clone()
    return torch.clamp(v, None if lo == -math.inf else lo, None if hi == math.inf else hi)


def _as_float(m: torch.Tensor, *like: object) -> torch.Tensor:
    """A comparison's boolean result as 0/1 in the operands' float dtype."""
    for x in like:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return m.to(x.dtype)
    return m.float()


_ENTRIES = [
    # binary
    MapOp("add", 2, lambda a, b: a + b, "({0} + {1})"),
    MapOp("sub", 2, lambda a, b: a - b, "({0} - {1})"),
    MapOp("mul", 2, lambda a, b: a * b, "({0} * {1})"),
    MapOp("div", 2, lambda a, b: a / b, "({0} / {1})"),
    MapOp("maximum", 2, torch.maximum, "cf_nanmax({0}, {1})"),
    MapOp("minimum", 2, torch.minimum, "cf_nanmin({0}, {1})"),
    MapOp("pow", 2, torch.pow, "cf_pow({0}, {1})", cost=1),
    MapOp("hypot", 2, torch.hypot, "hypotf({0}, {1})", cost=1),
    MapOp("atan2", 2, torch.atan2, "atan2f({0}, {1})", cost=1),
    MapOp("logaddexp", 2, torch.logaddexp, "cf_logaddexp({0}, {1})", cost=2),
    MapOp("fmod", 2, torch.fmod, "fmodf({0}, {1})", cost=1),
    # unary
    MapOp("neg", 1, torch.neg, "(-{0})"),
    MapOp("relu", 1, torch.relu, "cf_relu({0})"),
    MapOp("sigmoid", 1, torch.sigmoid, "cf_sigmoid({0})", cost=1),
    MapOp("tanh", 1, torch.tanh, "tanhf({0})", cost=1),
    MapOp("gelu", 1, F.gelu, "cf_gelu({0})", cost=1),
    MapOp("gelu_tanh", 1, lambda v: F.gelu(v, approximate="tanh"), "cf_gelu_tanh({0})", cost=1),
    MapOp("silu", 1, F.silu, "cf_silu({0})", cost=1),
    MapOp("mish", 1, F.mish, "cf_mish({0})", cost=3),
    MapOp("exp", 1, torch.exp, "expf({0})", cost=1),
    MapOp("log", 1, torch.log, "logf({0})", cost=1),
    MapOp("log1p", 1, torch.log1p, "log1pf({0})", cost=1),
    MapOp("abs", 1, torch.abs, "fabsf({0})"),
    MapOp("sqrt", 1, torch.sqrt, "sqrtf({0})"),
    MapOp("rsqrt", 1, torch.rsqrt, "rsqrtf({0})"),
    MapOp("square", 1, torch.square, "cf_square({0})"),
    MapOp("reciprocal", 1, torch.reciprocal, "(1.0f / {0})"),
    MapOp("hardswish", 1, F.hardswish, "cf_hardswish({0})"),
    MapOp("hardsigmoid", 1, F.hardsigmoid, "cf_hardsigmoid({0})"),
    MapOp("relu6", 1, F.relu6, "cf_clamp({0}, 0.0f, 6.0f)"),
    MapOp("leaky_relu", 1, lambda v, s: F.leaky_relu(v, s), "cf_leaky_relu({0}, {a0})",
          ("negative_slope",)),
    MapOp("elu", 1, lambda v, a: F.elu(v, a), "cf_elu({0}, {a0})", ("alpha",), cost=1),
    MapOp("softplus", 1, lambda v, b, t: F.softplus(v, b, t), "cf_softplus({0}, {a0}, {a1})",
          ("beta", "threshold"), cost=2),
    MapOp("clamp", 1, _clamp, "cf_clamp({0}, {a0}, {a1})", ("min", "max")),
    MapOp("erf", 1, torch.erf, "erff({0})", cost=1),
    MapOp("sin", 1, torch.sin, "sinf({0})", cost=1),
    MapOp("cos", 1, torch.cos, "cosf({0})", cost=1),
    MapOp("expm1", 1, torch.expm1, "expm1f({0})", cost=1),
    MapOp("log2", 1, torch.log2, "log2f({0})", cost=1),
    MapOp("atan", 1, torch.atan, "atanf({0})", cost=1),
    MapOp("sinh", 1, torch.sinh, "sinhf({0})", cost=1),
    MapOp("cosh", 1, torch.cosh, "coshf({0})", cost=1),
    MapOp("asinh", 1, torch.asinh, "asinhf({0})", cost=1),
    # comparisons: a boolean as 0.0 / 1.0 (NaN compares false, except !=); where(c, a, b)
    MapOp("gt", 2, lambda a, b: _as_float(torch.gt(a, b), a, b), "({0} > {1} ? 1.0f : 0.0f)"),
    MapOp("lt", 2, lambda a, b: _as_float(torch.lt(a, b), a, b), "({0} < {1} ? 1.0f : 0.0f)"),
    MapOp("ge", 2, lambda a, b: _as_float(torch.ge(a, b), a, b), "({0} >= {1} ? 1.0f : 0.0f)"),
    MapOp("le", 2, lambda a, b: _as_float(torch.le(a, b), a, b), "({0} <= {1} ? 1.0f : 0.0f)"),
    MapOp("eq", 2, lambda a, b: _as_float(torch.eq(a, b), a, b), "({0} == {1} ? 1.0f : 0.0f)"),
    MapOp("ne", 2, lambda a, b: _as_float(torch.ne(a, b), a, b), "({0} != {1} ? 1.0f : 0.0f)"),
    MapOp("where", 3, lambda c, a, b: torch.where(torch.as_tensor(c) != 0, a, b),
          "({0} != 0.0f ? {1} : {2})"),
    # PReLU: a leaky ReLU whose slope is an operand (a parameter)
    MapOp("prelu", 2, lambda v, w: torch.where(v > 0, v, w * v), "cf_leaky_relu({0}, {1})"),
    # the logsumexp shift: the row max, or 0 where it is infinite (torch's rule)
    MapOp("finite_or_zero", 1, lambda v: torch.where(torch.isinf(v), torch.zeros_like(v), v),
          "cf_finite_or_zero({0})"),
]

MAPS: dict[str, MapOp] = {e.name: e for e in _ENTRIES}

#: Row reductions over the features: name -> (identity, CUDA combine function, acc type).
#: Sums accumulate in double; max/min propagate NaN like torch.
REDUCTIONS: dict[str, tuple[str, str, str]] = {
    "sum": ("0.0", "cf_add_d", "double"),
    "max": ("-CF_INF", "cf_nanmax", "float"),
    "min": ("CF_INF", "cf_nanmin", "float"),
}


def cuda_float(v: float) -> str:
    """A float32 literal for CUDA C (infinities and NaN spelled through helpers)."""
    if math.isnan(v):
        return "CF_NAN"
    if math.isinf(v):
        return "CF_INF" if v > 0 else "(-CF_INF)"
    import numpy as np

    return repr(float(np.float32(v))) + "f"
