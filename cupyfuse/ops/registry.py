"""The op table: one record per elementwise op and per row reduction of the vocabulary.

An :class:`Op` record says everything the library knows of an op:

* its **torch spellings** -- the functions (``torch.sinh``, ``F.silu``, ``operator.add``),
  tensor methods (``"sinh"``; a unary op's in-place ``"sinh_"`` comes with it) and
  module classes (``nn.SiLU``; matched by exact type) that the front end
  (:mod:`cupyfuse.frontend`) maps onto it;
* its **arguments**: ``arity`` tensor operands, float ``attrs`` (with torch's
  ``defaults``, read from a function's arguments by position or name, or from a module's
  attributes of the same names);
* its **torch semantics** (``torch_fn``: the CPU path and every test's reference);
* its **CUDA fragment** (``cuda``: a ``str.format`` template, ``{0}``, ``{1}`` the
  operands, ``{a0}``, ``{a1}`` the attributes; helpers in ``kernels_cu/tail_ops.cuh``),
  or, for a composite, ``compose``: the op written with other records' ops (one
  :class:`~cupyfuse.ir.program.Builder` call each);
* its **cost** inside a GEMM epilogue (transcendental functions per element);
* its **range rule** per operand position (``ranges``: the certified row maxima);
* its **dtype rules**: how torch treats boolean and integer operands (``on_bool``,
  ``keeps_int``), and ``autocast`` (the dtype an autocast region computes it in);
* its **derivative** (``derivative``, in the notation of :mod:`cupyfuse.ops.derivatives`).

Adding an op is one :func:`register` call (plus a CUDA helper where the fragment needs
one): the front end's spellings, the CPU path, the generated kernels, the epilogue cost
and the certification's rules all read this table (:func:`spellings`, :data:`MAPS`,
:func:`range_rules`), and ``tests/ops/test_registry.py`` covers every record.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse.ops.derivatives import UNDEFINED, Expr, Grad
from cupyfuse.ops.ranges import AT0, MONO, Rule, softplus_switch, turn

__all__ = ["Op", "Reduction", "MAPS", "REDUCTIONS", "register", "unregister", "spellings",
           "range_rules", "unbounded", "cuda_float", "SELU_ALPHA", "SELU_SCALE"]

#: the kinds of records, by how the front end lowers their spellings
KINDS = ("unary", "binary", "compare", "attr", "composite", "internal")


@dataclass(frozen=True)
class Op:
    """One op of the vocabulary (see the module docstring for the fields)."""

    name: str
    arity: int
    torch_fn: Callable[..., torch.Tensor] | None   # (operands..., *attrs) -> tensor
    cuda: str | None = None
    attrs: tuple[str, ...] = ()
    defaults: tuple[Any, ...] = ()
    cost: int = 0
    #: how the front end lowers a spelling: "unary" / "binary" / "compare" (the generic
    #: lowerings of those shapes), "attr" (one operand and float attributes), "composite"
    #: (``compose``), "internal" (no spelling of its own: other lowerings emit it)
    kind: str = "internal"
    functions: tuple[Any, ...] = ()
    methods: tuple[str, ...] = ()
    modules: tuple[type, ...] = ()
    #: operand position -> range rule; a position absent is not bounded
    ranges: dict[int, Rule] = field(default_factory=dict)
    #: "float": torch computes it on a boolean tensor (promoted to float); "raise": torch
    #: raises there (or gives another dtype)
    on_bool: str = "raise"
    #: torch keeps an integer tensor integer through it (abs, neg, square, relu)
    keeps_int: bool = False
    #: a composite's formula: (builder, operand value, *attrs) -> value
    compose: Callable[..., int] | None = None
    #: the dtype an autocast region computes it in ("fp32": upcast; "same": the operands')
    autocast: str = "same"
    #: the op's derivative: (Grad) -> one gradient per operand (cupyfuse.ops.derivatives);
    #: None: none written (calls reading it differentiate with torch's autograd)
    derivative: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"op {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "composite" and self.compose is None:
            raise ValueError(f"op {self.name!r}: a composite needs `compose`")
        if self.kind != "composite" and (self.cuda is None or self.torch_fn is None):
            raise ValueError(f"op {self.name!r}: a primitive needs `torch_fn` and `cuda`")
        if len(self.defaults) not in (0, len(self.attrs)):
            raise ValueError(f"op {self.name!r}: `defaults` must give one value per attribute")

    @property
    def primitive(self) -> bool:
        """A map node of its own (a composite is written with other ops)."""
        return self.kind != "composite"


class Reduction(NamedTuple):
    """A row reduction over the features: identity, CUDA combine function, accumulator
    type (sums in double, max/min in float with torch's NaN propagation)."""

    identity: str
    combine: str
    acc: str


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


# torch's SELU constants
SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946


def _celu(b: Any, v: int, alpha: float) -> int:
    """v > 0 ? v : alpha * elu(v / alpha) (v itself where positive, as torch: v / alpha
    overflows there for alpha < 1; NaN is not > 0 and stays NaN through the other branch)."""
    a = float(alpha)
    if a == 0.0:
        raise ValueError("celu: alpha = 0 divides by zero")
    neg = b.map("mul", b.map("elu", b.map("div", v, b.const(a)), attrs=(1.0,)), b.const(a))
    return b.map("where", b.map("gt", v, b.const(0.0)), v, neg)


def _unary(name: str, fn: Callable, cuda: str, *, cost: int = 0, functions: tuple = (),
           methods: tuple = (), modules: tuple = (), ranges: Rule | None = None,
           on_bool: str = "raise", keeps_int: bool = False, autocast: str = "same",
           derivative: Callable | None = None) -> Op:
    return Op(name, 1, fn, cuda, cost=cost, kind="unary", functions=functions,
              methods=methods, modules=modules, ranges={0: ranges} if ranges else {},
              on_bool=on_bool, keeps_int=keeps_int, autocast=autocast,
              derivative=derivative)


def _binary(name: str, fn: Callable, cuda: str, *, cost: int = 0, functions: tuple = (),
            methods: tuple = (), ranges: tuple[Rule, Rule] | None = None,
            derivative: Callable | None = None) -> Op:
    return Op(name, 2, fn, cuda, cost=cost, kind="binary", functions=functions,
              methods=methods, ranges=dict(enumerate(ranges)) if ranges else {},
              derivative=derivative)


def _compare(name: str, fn: Callable, cuda: str, functions: tuple, methods: tuple,
             bounded: bool) -> Op:
    return Op(name, 2, lambda a, b: _as_float(fn(a, b), a, b), cuda, kind="compare",
              functions=functions, methods=methods,
              ranges={0: MONO, 1: MONO} if bounded else {}, derivative=_no_grad)


_GELU_MIN = turn(F.gelu, -1.0, -0.5)
_GELU_TANH_MIN = turn(lambda v: F.gelu(v, approximate="tanh"), -1.0, -0.5)
_SILU_MIN = turn(F.silu, -2.0, -1.0)
_MISH_MIN = turn(F.mish, -2.0, -0.5)
_FLOAT = "float"


# --- derivatives (cupyfuse.ops.derivatives: torch's formulas; NaN/inf where torch's
# autograd puts them) ------------------------------------------------------------------
def _no_grad(d: Grad) -> tuple:
    return (None,) * len(d.xs)


def _d_extreme(d: Grad, loses: str, wins: str) -> tuple:
    """maximum / minimum: the gradient to the operand chosen, halved on ties; a NaN
    operand on either side passes it to both (neither comparison holds)."""
    half = d.where(d.a.eq(d.b), d.g * 0.5, d.g)
    return (d.where(getattr(d.a, loses)(d.b), 0.0, half),
            d.where(getattr(d.a, wins)(d.b), 0.0, half))


def _d_prelu(d: Grad) -> tuple:
    """torch_fn's (a ``where`` of ``v`` and ``w * v``): the branch not taken passes 0,
    times ``w`` on the way (0 * inf is NaN there, as in torch)."""
    neg = d.where(d.a.gt(0.0), 0.0, d.g)
    return d.where(d.a.gt(0.0), d.g, 0.0) + neg * d.b, neg * d.a


def _d_pow(d: Grad) -> tuple:
    da = d.where(d.b.eq(0.0), 0.0, d.g * (d.b * d.a.pow(d.b - 1.0)))
    db = d.g * d.where(d.a.eq(0.0) * d.b.ge(0.0), 0.0, d.y * d.a.log())
    return da, db


def _d_atan2(d: Grad) -> tuple:
    r = (d.a * d.a + d.b * d.b).reciprocal()
    return d.g * d.b * r, d.g * -d.a * r


def _d_gelu(d: Grad) -> tuple:
    cdf = 0.5 * (1.0 + (d.x * math.sqrt(0.5)).erf())
    pdf = (d.x * d.x * -0.5).exp() * (1.0 / math.sqrt(2.0 * math.pi))
    return (d.g * (cdf + d.x * pdf),)


def _d_gelu_tanh(d: Grad) -> tuple:
    beta, kappa = math.sqrt(2.0 / math.pi), 0.044715
    xx = d.x * d.x
    t = (beta * (d.x + kappa * (xx * d.x))).tanh()
    left = 0.5 * (1.0 + t)
    right = 0.5 * d.x * (1.0 - t * t) * (beta * (1.0 + 3.0 * kappa * xx))
    return (d.g * (left + right),)


def _d_silu(d: Grad) -> tuple:
    s = d.x.sigmoid()
    return (d.g * s * (1.0 + d.x * (1.0 - s)),)


def _d_mish(d: Grad) -> tuple:
    t = d.x.softplus(1.0, 20.0).tanh()
    return (d.g * (t + d.x * d.x.sigmoid() * (1.0 - t * t)),)


def _d_softplus(d: Grad) -> tuple:
    beta, threshold = d.attrs
    z = (d.x * beta).exp()
    return (d.where((d.x * beta).gt(threshold), d.g, d.g * z / (z + 1.0)),)


def _inside(d: Grad, lo: float, hi: float) -> Expr:
    """The gradient strictly inside (lo, hi), 0 on the bounds and at NaN (hardtanh's)."""
    return d.where(d.x.gt(lo), d.where(d.x.lt(hi), d.g, 0.0), 0.0)


def _d_clamp(d: Grad) -> tuple:
    lo, hi = d.attrs
    if lo == -math.inf and hi == math.inf:   # (no bound: the value itself)
        return (d.g,)
    return (d.where(d.x.ge(lo), d.where(d.x.le(hi), d.g, 0.0), 0.0),)


_ENTRIES: list[Op] = [
    # --- binary arithmetic ---------------------------------------------------------------
    _binary("add", lambda a, b: a + b, "({0} + {1})",
            functions=(operator.add, torch.add, operator.iadd),
            methods=("add", "add_"), ranges=(MONO, MONO),
           derivative=lambda d: (d.g, d.g)),
    _binary("sub", lambda a, b: a - b, "({0} - {1})",
            functions=(operator.sub, torch.sub, torch.subtract, operator.isub),
            methods=("sub", "sub_", "subtract"), ranges=(MONO, MONO),
           derivative=lambda d: (d.g, -d.g)),
    _binary("mul", lambda a, b: a * b, "({0} * {1})",
            functions=(operator.mul, torch.mul, torch.multiply, operator.imul),
            methods=("mul", "mul_", "multiply"),
            ranges=(Rule(finite=True), Rule(finite=True)),
           derivative=lambda d: (d.g * d.b, d.g * d.a)),
    _binary("div", lambda a, b: a / b, "({0} / {1})",
            functions=(operator.truediv, torch.div, torch.divide, torch.true_divide,
                       operator.itruediv),
            methods=("div", "div_", "true_divide", "divide"),
            ranges=(Rule(finite=True, nonzero=True), Rule(finite=True, pole=True)),
           derivative=lambda d: (d.g / d.b, -d.g * ((d.a / d.b) / d.b))),
    _binary("maximum", torch.maximum, "cf_nanmax({0}, {1})", functions=(torch.maximum,),
            methods=("maximum",), ranges=(MONO, MONO),
           derivative=lambda d: _d_extreme(d, "lt", "gt")),
    _binary("minimum", torch.minimum, "cf_nanmin({0}, {1})", functions=(torch.minimum,),
            methods=("minimum",), ranges=(MONO, MONO),
           derivative=lambda d: _d_extreme(d, "gt", "lt")),
    _binary("pow", torch.pow, "cf_pow({0}, {1})", cost=1, functions=(operator.pow, torch.pow),
            methods=("pow",),
           derivative=_d_pow),
    _binary("hypot", torch.hypot, "hypotf({0}, {1})", cost=1, functions=(torch.hypot,),
            methods=("hypot",), ranges=(AT0, AT0),
           derivative=lambda d: (d.g * d.a / d.y, d.g * d.b / d.y)),
    _binary("atan2", torch.atan2, "atan2f({0}, {1})", cost=1,
            functions=(torch.atan2, torch.arctan2), methods=("atan2", "arctan2"),
           derivative=_d_atan2),
    _binary("logaddexp", torch.logaddexp, "cf_logaddexp({0}, {1})", cost=2,
            functions=(torch.logaddexp,), methods=("logaddexp",), ranges=(MONO, MONO),
           derivative=lambda d: (d.g / (1.0 + (d.b - d.a).exp()), d.g / (1.0 + (d.a - d.b).exp()))),
    _binary("fmod", torch.fmod, "fmodf({0}, {1})", cost=1, functions=(torch.fmod,),
            methods=("fmod",),
           derivative=lambda d: (d.g, UNDEFINED)),
    # --- unary ---------------------------------------------------------------------------
    _unary("neg", torch.neg, "(-{0})", functions=(torch.neg, operator.neg), methods=("neg",),
           ranges=MONO, keeps_int=True,
           derivative=lambda d: (-d.g,)),
    _unary("relu", torch.relu, "cf_relu({0})", functions=(torch.relu, F.relu),
           methods=("relu",), modules=(nn.ReLU,), ranges=MONO, keeps_int=True,
           derivative=lambda d: (d.where(d.y.le(0.0), 0.0, d.g),)),
    _unary("sigmoid", torch.sigmoid, "cf_sigmoid({0})", cost=1,
           functions=(torch.sigmoid, F.sigmoid, torch.special.expit), methods=("sigmoid",),
           modules=(nn.Sigmoid,), ranges=MONO, on_bool=_FLOAT,
           derivative=lambda d: (d.g * (1.0 - d.y) * d.y,)),
    _unary("tanh", torch.tanh, "tanhf({0})", cost=1, functions=(torch.tanh, F.tanh),
           methods=("tanh",), modules=(nn.Tanh,), ranges=MONO, on_bool=_FLOAT,
           derivative=lambda d: (d.g * (1.0 - d.y * d.y),)),
    _unary("gelu", F.gelu, "cf_gelu({0})", cost=1, ranges=Rule(turns=(_GELU_MIN,)),
           derivative=_d_gelu),
    _unary("gelu_tanh", lambda v: F.gelu(v, approximate="tanh"), "cf_gelu_tanh({0})", cost=1,
           ranges=Rule(turns=(_GELU_TANH_MIN,)),
           derivative=_d_gelu_tanh),
    _unary("silu", F.silu, "cf_silu({0})", cost=1, functions=(F.silu,), modules=(nn.SiLU,),
           ranges=Rule(turns=(_SILU_MIN,)),
           derivative=_d_silu),
    _unary("mish", F.mish, "cf_mish({0})", cost=3, functions=(F.mish,), modules=(nn.Mish,),
           ranges=Rule(turns=(_MISH_MIN,)),
           derivative=_d_mish),
    _unary("exp", torch.exp, "expf({0})", cost=1, functions=(torch.exp,), methods=("exp",),
           ranges=MONO, on_bool=_FLOAT,
           derivative=lambda d: (d.g * d.y,)),
    _unary("log", torch.log, "logf({0})", cost=1, functions=(torch.log,), methods=("log",),
           ranges=MONO, on_bool=_FLOAT,
           derivative=lambda d: (d.g / d.x,)),
    _unary("log1p", torch.log1p, "log1pf({0})", cost=1, functions=(torch.log1p,),
           methods=("log1p",), ranges=MONO, on_bool=_FLOAT,
           derivative=lambda d: (d.g / (d.x + 1.0),)),
    _unary("abs", torch.abs, "fabsf({0})", functions=(torch.abs, operator.abs),
           methods=("abs",), ranges=AT0, keeps_int=True,
           derivative=lambda d: (d.g * (d.x.gt(0.0) - d.x.lt(0.0)),)),
    _unary("sqrt", torch.sqrt, "sqrtf({0})", functions=(torch.sqrt,), methods=("sqrt",),
           ranges=MONO, on_bool=_FLOAT,
           derivative=lambda d: (d.g / (2.0 * d.y),)),
    _unary("rsqrt", torch.rsqrt, "rsqrtf({0})", functions=(torch.rsqrt,), methods=("rsqrt",),
           ranges=MONO, on_bool=_FLOAT,
           derivative=lambda d: (-0.5 * d.g * (d.y * d.y * d.y),)),
    _unary("square", torch.square, "cf_square({0})", functions=(torch.square,),
           methods=("square",), ranges=AT0, keeps_int=True,
           derivative=lambda d: (d.g * (2.0 * d.x),)),
    _unary("reciprocal", torch.reciprocal, "(1.0f / {0})", functions=(torch.reciprocal,),
           methods=("reciprocal",), ranges=Rule(pole=True), on_bool=_FLOAT,
           derivative=lambda d: (-d.g * (d.y * d.y),)),
    _unary("hardswish", F.hardswish, "cf_hardswish({0})", functions=(F.hardswish,),
           modules=(nn.Hardswish,), ranges=Rule(turns=(-1.5,)),
           derivative=lambda d: (d.where(d.x.le(-3.0), 0.0, d.where(d.x.ge(3.0), d.g, d.g * (d.x / 3.0 + 0.5))),)),
    _unary("hardsigmoid", F.hardsigmoid, "cf_hardsigmoid({0})", functions=(F.hardsigmoid,),
           modules=(nn.Hardsigmoid,), ranges=MONO,
           derivative=lambda d: (d.where(d.x.gt(-3.0), d.where(d.x.lt(3.0), d.g / 6.0, 0.0), 0.0),)),
    _unary("relu6", F.relu6, "cf_clamp({0}, 0.0f, 6.0f)", functions=(F.relu6,),
           modules=(nn.ReLU6,), ranges=MONO,
           derivative=lambda d: (_inside(d, 0.0, 6.0),)),
    _unary("erf", torch.erf, "erff({0})", cost=1, functions=(torch.erf, torch.special.erf),
           methods=("erf",), ranges=MONO, on_bool=_FLOAT,
           derivative=lambda d: (2.0 / math.sqrt(math.pi) * (-(d.x * d.x)).exp() * d.g,)),
    _unary("sin", torch.sin, "sinf({0})", cost=1, functions=(torch.sin,), methods=("sin",),
           on_bool=_FLOAT,
           derivative=lambda d: (d.g * d.x.cos(),)),
    _unary("cos", torch.cos, "cosf({0})", cost=1, functions=(torch.cos,), methods=("cos",),
           on_bool=_FLOAT,
           derivative=lambda d: (d.g * -d.x.sin(),)),
    _unary("expm1", torch.expm1, "expm1f({0})", cost=1,
           functions=(torch.expm1, torch.special.expm1), methods=("expm1",), ranges=MONO,
           on_bool=_FLOAT,
           derivative=lambda d: (d.g * (d.y + 1.0),)),
    _unary("log2", torch.log2, "log2f({0})", cost=1, functions=(torch.log2,),
           methods=("log2",), ranges=MONO, on_bool=_FLOAT,
           derivative=lambda d: (d.g / (d.x * math.log(2.0)),)),
    _unary("atan", torch.atan, "atanf({0})", cost=1, functions=(torch.atan, torch.arctan),
           methods=("atan", "arctan"), ranges=MONO, on_bool=_FLOAT,
           derivative=lambda d: (d.g / (d.x * d.x + 1.0),)),
    _unary("sinh", torch.sinh, "sinhf({0})", cost=1, functions=(torch.sinh,),
           methods=("sinh",), ranges=MONO, on_bool=_FLOAT,
           derivative=lambda d: (d.g * d.x.cosh(),)),
    _unary("cosh", torch.cosh, "coshf({0})", cost=1, functions=(torch.cosh,),
           methods=("cosh",), ranges=AT0, on_bool=_FLOAT,
           derivative=lambda d: (d.g * d.x.sinh(),)),
    _unary("asinh", torch.asinh, "asinhf({0})", cost=1, functions=(torch.asinh, torch.arcsinh),
           methods=("asinh", "arcsinh"), ranges=MONO, on_bool=_FLOAT,
           derivative=lambda d: (d.g * (d.x * d.x + 1.0).rsqrt(),)),
    # --- activations with float attributes (function arguments / module attributes) -------
    Op("leaky_relu", 1, lambda v, s: F.leaky_relu(v, s), "cf_leaky_relu({0}, {a0})",
       ("negative_slope",), (0.01,), kind="attr", functions=(F.leaky_relu,),
       modules=(nn.LeakyReLU,), ranges={0: AT0},
           derivative=lambda d: (d.where(d.x.gt(0.0), d.g, d.g * d.attrs[0]),)),
    Op("elu", 1, lambda v, a: F.elu(v, a), "cf_elu({0}, {a0})", ("alpha",), (1.0,), cost=1,
       kind="attr", functions=(F.elu,), modules=(nn.ELU,), ranges={0: AT0},
           derivative=lambda d: (d.where(d.x.gt(0.0), d.g, d.g * d.attrs[0] * d.x.exp()),)),
    Op("softplus", 1, lambda v, b, t: F.softplus(v, b, t), "cf_softplus({0}, {a0}, {a1})",
       ("beta", "threshold"), (1.0, 20.0), cost=2, kind="attr", functions=(F.softplus,),
       modules=(nn.Softplus,), ranges={0: Rule(attr_turns=softplus_switch)},
           derivative=_d_softplus),
    # hardtanh / clamp / clip spell it with bounds of their own (the front end's clamp)
    Op("clamp", 1, _clamp, "cf_clamp({0}, {a0}, {a1})", ("min", "max"), ranges={0: MONO},
           derivative=_d_clamp),
    # F.hardtanh / nn.Hardtanh: clamp's values, its own derivative (torch's passes the
    # gradient strictly inside the bounds; clamp's on the bounds too; neither at NaN)
    Op("hardtanh", 1, lambda v, lo, hi: F.hardtanh(v, lo, hi), "cf_clamp({0}, {a0}, {a1})",
       ("min_val", "max_val"), ranges={0: MONO},
           derivative=lambda d: (_inside(d, *d.attrs),)),
    # --- comparisons: a boolean as 0.0 / 1.0 (NaN compares false, except !=) -------------
    _compare("gt", torch.gt, "({0} > {1} ? 1.0f : 0.0f)",
             (operator.gt, torch.gt, torch.greater), ("gt", "greater"), True),
    _compare("lt", torch.lt, "({0} < {1} ? 1.0f : 0.0f)",
             (operator.lt, torch.lt, torch.less), ("lt", "less"), True),
    _compare("ge", torch.ge, "({0} >= {1} ? 1.0f : 0.0f)",
             (operator.ge, torch.ge, torch.greater_equal), ("ge", "greater_equal"), True),
    _compare("le", torch.le, "({0} <= {1} ? 1.0f : 0.0f)",
             (operator.le, torch.le, torch.less_equal), ("le", "less_equal"), True),
    _compare("eq", torch.eq, "({0} == {1} ? 1.0f : 0.0f)", (operator.eq, torch.eq), ("eq",),
             False),
    _compare("ne", torch.ne, "({0} != {1} ? 1.0f : 0.0f)",
             (operator.ne, torch.ne, torch.not_equal), ("ne", "not_equal"), False),
    # --- emitted by other lowerings --------------------------------------------------------
    # where(c, a, b) (torch.where, masked_fill, the logical ops' results)
    Op("where", 3, lambda c, a, b: torch.where(torch.as_tensor(c) != 0, a, b),
       "({0} != 0.0f ? {1} : {2})",
           derivative=lambda d: (None, d.where(d.a, d.g, 0.0), d.where(d.a, 0.0, d.g))),
    # PReLU: a leaky ReLU whose slope is an operand (a parameter)
    Op("prelu", 2, lambda v, w: torch.where(v > 0, v, w * v), "cf_leaky_relu({0}, {1})",
       ranges={0: AT0},
           derivative=_d_prelu),
    # .detach() / torch.detach: the value itself, no gradient (the backward's recompute)
    Op("detach", 1, lambda v: v.detach(), "({0})", ranges={0: MONO},
           derivative=lambda d: (None,)),
    # the logsumexp shift: the row max, or 0 where it is infinite (torch's rule)
    Op("finite_or_zero", 1, lambda v: torch.where(torch.isinf(v), torch.zeros_like(v), v),
       "cf_finite_or_zero({0})",
           derivative=lambda d: (None,)),
    # --- composites: written with the ops above (torch's formulas) ------------------------
    Op("selu", 1, None, kind="composite", functions=(F.selu, torch.selu), modules=(nn.SELU,),
       compose=lambda b, v: b.map("mul", b.map("elu", v, attrs=(SELU_ALPHA,)),
                                  b.const(SELU_SCALE))),
    Op("celu", 1, None, attrs=("alpha",), defaults=(1.0,), kind="composite",
       functions=(F.celu, torch.celu), modules=(nn.CELU,), compose=_celu),
    Op("softsign", 1, None, kind="composite", functions=(F.softsign,), modules=(nn.Softsign,),
       compose=lambda b, v: b.map("div", v, b.map("add", b.map("abs", v), b.const(1.0)))),
    Op("tanhshrink", 1, None, kind="composite", functions=(F.tanhshrink,),
       modules=(nn.Tanhshrink,), compose=lambda b, v: b.map("sub", v, b.map("tanh", v))),
    Op("logsigmoid", 1, None, kind="composite",
       functions=(F.logsigmoid,), modules=(nn.LogSigmoid,),
       compose=lambda b, v: b.map("neg", b.map("softplus", b.map("neg", v),
                                                attrs=(1.0, 20.0)))),
]

#: every record by name (primitives and composites)
OPS: dict[str, Op] = {}
#: the primitive ops: what a program's ``map`` nodes name
MAPS: dict[str, Op] = {}

#: Row reductions over the features. Sums accumulate in double; max/min propagate NaN
#: like torch.
REDUCTIONS: dict[str, Reduction] = {
    "sum": Reduction("0.0", "cf_add_d", "double"),
    "max": Reduction("-CF_INF", "cf_nanmax", "float"),
    "min": Reduction("CF_INF", "cf_nanmin", "float"),
}

#: bumped by every register / unregister: tables derived from the records rebuild
_generation = [0]


def register(op: Op) -> Op:
    """Add ``op`` to the vocabulary (a record of the same name is replaced). Its
    spellings are fused from the next translation on."""
    OPS[op.name] = op
    if op.primitive:
        MAPS[op.name] = op
    else:
        MAPS.pop(op.name, None)
    _generation[0] += 1
    _spellings.clear()
    return op


def unregister(name: str) -> None:
    """Remove the record ``name`` (its spellings are refused again)."""
    OPS.pop(name, None)
    MAPS.pop(name, None)
    _generation[0] += 1
    _spellings.clear()


def generation() -> int:
    """A number that changes whenever the table does (what caches of derived tables and
    traced programs key on)."""
    return _generation[0]


_spellings: dict[str, Any] = {}


def spellings() -> Any:
    """The front end's lookup tables, derived from the records: ``functions`` (torch
    callable -> Op), ``methods`` (method name -> Op; a unary op's in-place ``name_``
    too), ``modules`` (module class -> Op), rebuilt after any change of the table."""
    if not _spellings:
        funcs: dict[Any, Op] = {}
        methods: dict[str, Op] = {}
        modules: dict[type, Op] = {}
        for op in OPS.values():
            for f in op.functions:
                funcs[f] = op
            for m in op.methods:
                methods[m] = op
                if op.kind == "unary" and not m.endswith("_"):
                    methods.setdefault(m + "_", op)
            for c in op.modules:
                modules[c] = op
        _spellings.update(functions=funcs, methods=methods, modules=modules)
    return _spellings


def range_rules() -> dict[tuple[str, int], Rule]:
    """(op, operand position) -> its range rule, for every primitive op that has one."""
    return {(op.name, pos): rule for op in MAPS.values() for pos, rule in op.ranges.items()}


def unbounded() -> tuple[str, ...]:
    """The primitive ops with no range rule at any position."""
    return tuple(op.name for op in MAPS.values() if not op.ranges)


def cuda_float(v: float) -> str:
    """A float32 literal for CUDA C (infinities and NaN spelled through helpers)."""
    if math.isnan(v):
        return "CF_NAN"
    if math.isinf(v):
        return "CF_INF" if v > 0 else "(-CF_INF)"
    import numpy as np

    return repr(float(np.float32(v))) + "f"


for _op in _ENTRIES:
    register(_op)
del _op
