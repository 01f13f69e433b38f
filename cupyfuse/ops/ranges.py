"""Range rules: how an interval of an op's operand maps through the op.

The certified row maxima (:mod:`cupyfuse.ir.certify`) bound a chain of elementwise ops
applied to a GEMM's output: each op's record (:mod:`cupyfuse.ops.registry`) says, per
operand position, whether and how a range [lo, hi] of that operand maps to a range of
the result. An op without a rule there is not bounded (its chains keep the 3xTF32
engine).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = ["Rule", "MONO", "AT0", "turn", "softplus_switch"]


@dataclass(frozen=True)
class Rule:
    """How a range [lo, hi] of the chain operand maps through an op: the op's values at
    lo, hi and at each turning point inside (where its monotonicity may change) bound it.
    ``pole``: unbounded where the interval holds 0 (1/v); ``finite``: the other operand
    must be finite (v * inf is NaN at v = 0); ``nonzero``: ... and not 0 (v / 0)."""

    turns: tuple[float, ...] = ()
    pole: bool = False
    finite: bool = False
    nonzero: bool = False
    #: more turning points from the op's attributes (softplus: where it switches to the
    #: identity, dropping by log1p(exp(-threshold)) / beta: not monotone there)
    attr_turns: Callable[..., tuple[float, ...]] | None = None

    def points(self, attrs: Sequence[float]) -> tuple[float, ...]:
        return self.turns + (self.attr_turns(*attrs) if self.attr_turns else ())


def turn(fn: Callable[[torch.Tensor], torch.Tensor], lo: float, hi: float) -> float:
    """The minimum of a unimodal ``fn`` on [lo, hi] by golden-section search in float64
    (to ~1e-8: the value there is within ~1e-16 of the minimum)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    for _ in range(80):
        c, d = b - g * (b - a), a + g * (b - a)
        fc, fd = (float(fn(torch.tensor(v, dtype=torch.float64))) for v in (c, d))
        if fc < fd:
            b = d
        else:
            a = c
    return (a + b) / 2


def softplus_switch(beta: float, threshold: float) -> tuple[float, ...]:
    """Either side of softplus's switch v * beta > threshold: the left branch's value just
    before it is the sup near the jump, the identity's just after it the inf (each to
    ~2^-20 of it: inside the kernel's 2^-12 margin)."""
    s = threshold / beta
    d = abs(s) * 2.0 ** -20 + 1e-30
    return (s - d, s + d) if math.isfinite(s) else ()


#: monotone in the operand: the values at the interval's ends bound it
MONO = Rule()
#: monotone on either side of 0 (|v|, v**2, cosh, leaky slopes)
AT0 = Rule(turns=(0.0,))
