"""Random "Linear + tail" models for the tail tests (tests/frontend/test_tails.py,
tests/frontend/test_tails_gpu.py, tests/backend/test_tails_compile.py).

:func:`generate` draws a whole model: ``Linear(K, N)`` (as ``nn.Linear``, ``F.linear``,
``x @ W.t()`` or a matmul with a (K, N) parameter), then 1..6 ops of the tail vocabulary
(constants, parameters, residuals, activations, row reductions, softmax, LayerNorm,
GroupNorm, BatchNorm1d, pooling, dropout, F.normalize, a second Linear, a second input
``y``, the GEMM input ``x`` added back ...). The model is a real ``nn.Module`` subclass
whose ``__init__`` and ``forward`` are Python source (``TailSpec.source``), compiled
under a file name registered with :mod:`linecache`, so torch.fx records stack traces and
cupyfuse's error messages can quote the line.

The draws go through a small interface (:class:`Draw`) with two implementations: one on
hypothesis' ``draw`` (property tests, shrinking) and one on ``random.Random(seed)``
(fixed seeds: the nvcc compile test, seeded GPU cases).

Values are kept well inside float32's range: the generator tracks a bound on the
magnitude of the current value and only draws an op that keeps it under :data:`CAP`
(``exp`` is always of a clamped value, ``x ** 3`` only of small values ...), so float32
and float64 agree on where infinities appear, except where the inputs themselves hold
NaN/inf.
"""
from __future__ import annotations

import copy
import hashlib
import linecache
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import runner_of

#: bound on |value| the generator keeps every intermediate under
CAP = 1e6
#: bound on |input| (randn * 50 + 100 over at most 33 * 70 draws stays well inside it)
X_MAX = 400.0
DISTS = ("rand", "randn3", "offset")
SPECIALS = (float("nan"), float("inf"), float("-inf"))


# ---------------------------------------------------------------------------------
# draws
class Draw:
    """What the generator asks for; see :class:`HypDraw` and :class:`RandDraw`."""

    def int(self, lo: int, hi: int) -> int:  # inclusive
        raise NotImplementedError

    def choice(self, seq: Sequence[Any]) -> Any:
        return seq[self.int(0, len(seq) - 1)]

    def float(self, lo: float, hi: float) -> float:
        raise NotImplementedError

    def bool(self, p: float = 0.5) -> bool:
        return self.int(0, 99) < int(round(p * 100))


class RandDraw(Draw):
    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.r.randint(lo, hi)

    def float(self, lo: float, hi: float) -> float:
        return round(self.r.uniform(lo, hi), 3)


class HypDraw(Draw):
    def __init__(self, draw: Callable[[Any], Any]) -> None:
        from hypothesis import strategies as st

        self.d = draw
        self.st = st

    def int(self, lo: int, hi: int) -> int:
        return self.d(self.st.integers(lo, hi))

    def float(self, lo: float, hi: float) -> float:
        # on a grid of 1/1000: readable sources, shrinks toward lo
        n = int(round((hi - lo) * 1000))
        return round(lo + self.d(self.st.integers(0, n)) / 1000, 3)


def _lit(v: float) -> str:
    return repr(float(v))


# ---------------------------------------------------------------------------------
# the spec
@dataclass
class TailSpec:
    """A drawn model: its source, sizes and what inputs it takes."""

    name: str
    K: int
    N: int
    mode: str                 # "train" or "eval" (what model.train(...) is set to)
    has_y: bool               # forward(self, x, y) with y (batch, N)
    batch_stats: bool         # some BatchNorm normalises with batch statistics
    source: str
    ops: list[str] = field(default_factory=list)
    function: bool = False    # a tail function ``tail_fn(h[, y])`` instead of a module
    closures: dict[str, torch.Tensor] = field(default_factory=dict)
    _cls: Any = None

    def __repr__(self) -> str:
        return (f"TailSpec({self.name}: K={self.K} N={self.N} mode={self.mode} "
                f"has_y={self.has_y} ops={self.ops})\n{self.source}")

    # --- building -------------------------------------------------------------------
    def namespace(self) -> dict[str, Any]:
        fname = f"<tailgen {self.name}>"
        if fname not in linecache.cache:
            linecache.cache[fname] = (len(self.source), None, self.source.splitlines(True), fname)
        ns: dict[str, Any] = {"torch": torch, "nn": nn, "F": F, "math": math,
                              "__name__": "tailgen_models"}
        ns.update(self.closures)
        exec(compile(self.source, fname, "exec"), ns)
        return ns

    def model_class(self) -> type:
        assert not self.function
        if self._cls is None:
            self._cls = self.namespace()[self.name]
        return self._cls

    def tail_fn(self) -> Callable:
        assert self.function
        return self.namespace()["tail_fn"]

    def make_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        m = self.model_class()()
        m.train(self.mode == "train")
        return m

    def make_inputs(self, batch: int, dist: str, seed: int, n_special: int = 0) -> list[torch.Tensor]:
        """x (batch, K) [and y (batch, N)] from ``dist``; ``n_special`` elements of x (and
        of y) set to NaN/+inf/-inf, at positions drawn from ``seed``; with n_special >= 4
        one whole row of x is +inf or -inf as well."""
        g = torch.Generator().manual_seed(seed)

        def one(width: int) -> torch.Tensor:
            if dist == "rand":
                return torch.rand(batch, width, generator=g)
            if dist == "randn3":
                return torch.randn(batch, width, generator=g) * 3
            if dist == "offset":
                return torch.randn(batch, width, generator=g) * 50 + 100
            raise ValueError(dist)

        xs = [one(self.K)] + ([one(self.N)] if self.has_y else [])
        r = random.Random(seed)
        for t in xs:
            for _ in range(n_special):
                t[r.randrange(batch), r.randrange(t.shape[1])] = r.choice(SPECIALS)
        if n_special >= 4:
            xs[0][r.randrange(batch)] = r.choice(SPECIALS[1:])
        return [t.contiguous() for t in xs]


# ---------------------------------------------------------------------------------
# the generator
class _Gen:
    def __init__(self, d: Draw, *, K: int | None, N: int | None, mode: str | None,
                 has_y: bool | None, n_ops: int | None, force: Sequence[str],
                 function: bool, allow: Sequence[str] | None,
                 reduce_kinds: Sequence[str] | None = None,
                 pools: Sequence[tuple[str, int, int]] | None = None) -> None:
        self.d = d
        self.pools = list(pools) if pools else None
        self.reduce_kinds = list(reduce_kinds) if reduce_kinds else [
            "sum", "mean", "max", "min", "amax", "amin", "logsumexp", "norm", "var", "std"]
        self.function = function
        self.K = K if K is not None else d.int(1, 40)
        self.N = N if N is not None else d.int(
            2 if "groupnorm" in force or "pool" in force else 1, 70)
        if function:
            mode = "eval"
        self.mode = mode if mode is not None else ("train" if d.bool(0.3) else "eval")
        self.has_y = has_y if has_y is not None else d.bool(0.2)
        self.n_ops = n_ops if n_ops is not None else d.int(1, 6)
        self.force = list(force)
        self.allow = set(allow) if allow is not None else None
        self.init: list[str] = []
        self.fwd: list[str] = []
        self.closures: dict[str, torch.Tensor] = {}
        self.W = self.N
        self.rank = 2
        self.mag = math.sqrt(self.K) * X_MAX + 1.0
        self.saved: list[tuple[str, int, int, float]] = []
        self.count = 0
        self.ops: list[str] = []
        self.batch_stats = False
        self.used_y = False
        self.stages = 0

    # --- helpers ------------------------------------------------------------------
    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"{stem}{self.count}"

    def module(self, stem: str, ctor: str, *post: str) -> str:
        """A submodule (module mode) created in __init__; returns ``self.name``."""
        name = self.fresh(stem)
        self.init.append(f"self.{name} = {ctor}")
        for p in post:
            self.init.append(p.format(m=f"self.{name}"))
        return f"self.{name}"

    def tensor(self, stem: str, shape: tuple, init: str, buffer: bool = False) -> str:
        """A parameter/buffer (module mode) or a closure tensor (function mode).
        ``init`` is a method chain on an empty tensor, e.g. 'uniform_(-2.0, 2.0)'."""
        name = self.fresh(stem)
        if self.function:
            g = torch.Generator().manual_seed(1000 + self.count)
            t = torch.empty(shape)
            if init.startswith("uniform_"):
                lo, hi = (float(v) for v in init[len("uniform_("):-1].split(","))
                t.uniform_(lo, hi, generator=g)
            else:
                t.normal_(generator=g)
            upper = name.upper()
            self.closures[upper] = t
            return upper
        ctor = f"torch.empty({shape!r}).{init}"
        if buffer:
            self.init.append(f"self.register_buffer({name!r}, {ctor})")
        else:
            self.init.append(f"self.{name} = nn.Parameter({ctor})")
        return f"self.{name}"

    def emit(self, expr: str) -> None:
        self.fwd.append(f"h = {expr}")

    def ok(self, m: float) -> bool:
        return m <= CAP

    # --- the ops ------------------------------------------------------------------
    # each returns False when it does not apply to the current value
    def op_const(self) -> bool:
        d = self.d
        kind = d.choice(["add", "radd", "sub", "rsub", "mul", "rmul", "div", "rdiv", "alpha",
                         "method"])
        c = d.float(-5, 5)
        sc = d.float(0.25, 2.0) * (1 if d.bool() else -1)
        if kind == "add":
            self.emit(f"h + {_lit(c)}")
        elif kind == "radd":
            self.emit(f"{_lit(c)} + h")
        elif kind == "sub":
            self.emit(f"h - {_lit(c)}")
        elif kind == "rsub":
            self.emit(f"{_lit(c)} - h")
        elif kind in ("mul", "rmul"):
            if not self.ok(self.mag * abs(sc)):
                return False
            self.emit(f"h * {_lit(sc)}" if kind == "mul" else f"{_lit(sc)} * h")
            self.mag *= abs(sc)
            return True
        elif kind == "div":
            dv = d.float(0.5, 4.0) * (1 if d.bool() else -1)
            if not self.ok(self.mag / abs(dv)):
                return False
            self.emit(f"h / {_lit(dv)}")
            self.mag /= abs(dv)
            return True
        elif kind == "rdiv":
            self.emit(f"{_lit(c)} / (h.abs() + 1.0)")
            self.mag = 5.0
            return True
        elif kind == "alpha":
            a = d.float(-2, 2)
            self.emit(f"torch.{d.choice(['add', 'sub'])}(h, {_lit(c)}, alpha={_lit(a)})")
            self.mag += 10
            return True
        else:
            meth = d.choice(["add", "sub", "mul"])
            if meth == "mul":
                if not self.ok(self.mag * abs(sc)):
                    return False
                self.emit(f"h.mul({_lit(sc)})")
                self.mag *= abs(sc)
                return True
            self.emit(f"h.{meth}({_lit(c)})")
        self.mag += 5
        return True

    def op_pow(self) -> bool:
        e = self.d.choice([2, 3, 0.5, "param"])
        if e == "param":   # a learnable exponent (GeM pooling): a (1,) or () parameter
            if self.mag > 100:
                return False
            shape = self.d.choice([(1,), ()])
            p = self.tensor("e", shape, "uniform_(0.5, 3.0)", self.d.bool(0.25))
            self.emit(self.d.choice([f"h.clamp(min=1e-3).pow({p})",
                                     f"torch.pow(h.abs() + 0.01, {p})",
                                     f"h.abs() ** {p}"]))
            self.mag = max(self.mag, 1.0) ** 3
            return True
        if e == 2 and self.mag <= 1e3:
            self.emit(self.d.choice(["h ** 2", "torch.pow(h, 2)", "h.pow(2)", "h * h"]))
            self.mag = self.mag ** 2
        elif e == 3 and self.mag <= 100:
            self.emit(self.d.choice(["h ** 3", "torch.pow(h, 3.0)"]))
            self.mag = self.mag ** 3
        elif e == 0.5:
            self.emit(self.d.choice(["h.abs() ** 0.5", "torch.pow(h.abs(), 0.5)"]))
            self.mag = math.sqrt(self.mag)
        else:
            return False
        return True

    def op_param(self) -> bool:
        d = self.d
        per_feature = self.rank == 2 and d.bool(0.7)
        shape: tuple = ((self.W if self.W > 1 else self.N),) if per_feature else \
            d.choice([(), (1,)])
        kind = d.choice(["mul", "add", "sub", "div", "maximum", "minimum"])
        buffer = d.bool(0.25)
        if per_feature and not self.function and d.bool(0.2):
            # the per-feature tensor computed from a matrix of the module's alone (an RBF
            # head's centres' squared norms; a derived source of the tail), in the range
            # the plain parameter of this kind is drawn from
            J = d.int(1, 5)
            rng, expr = {"mul": ("-2.0, 2.0", "{m}.mean(1)"),
                         "div": ("-1.5, 1.5", "({m}.abs().amax(1) + 0.5)"),
                         "add": ("-1.0, 1.0", "({m} ** 2).sum(1)"),
                         "sub": ("-1.0, 1.0", "{m}.pow(2).sum(dim=1)"),
                         "maximum": ("-1.0, 1.0", "{m}.norm(dim=1)"),
                         "minimum": ("-1.0, 1.0", "torch.linalg.vector_norm({m}, dim=1)")
                         }[kind]
            m = self.tensor("m", (shape[0], J), f"uniform_({rng})", buffer)
            p = expr.format(m=m)
            self.emit({"mul": f"h * {p}", "div": f"h / {p}", "add": f"h + {p}",
                       "sub": f"{p} - h", "maximum": f"torch.maximum(h, {p})",
                       "minimum": f"torch.minimum(h, {p})"}[kind])
            mag = self.mag * 2 if kind in ("mul", "div") else self.mag + 5
            if not self.ok(mag):
                return False
            self.mag = mag
            self.ops[-1] = "param.derived"
            if self.W == 1:
                self.W = self.N
            return True
        if kind == "mul":
            p = self.tensor("p", shape, "uniform_(-2.0, 2.0)", buffer)
            if not self.ok(self.mag * 2):
                return False
            self.emit(d.choice([f"h * {p}", f"{p} * h", f"torch.mul(h, {p})"]))
            self.mag *= 2
        elif kind == "div":
            p = self.tensor("p", shape, "uniform_(0.5, 2.0)", buffer)
            if not self.ok(self.mag * 2):
                return False
            self.emit(d.choice([f"h / {p}", f"torch.div(h, {p})"]))
            self.mag *= 2
        elif kind in ("add", "sub"):
            p = self.tensor("p", shape, "normal_()", buffer)
            op = "+" if kind == "add" else "-"
            self.emit(d.choice([f"h {op} {p}", f"{p} {op} h"]))
            self.mag += 5
        else:
            p = self.tensor("p", shape, "normal_()", buffer)
            self.emit(f"torch.{kind}(h, {p})")
            self.mag = max(self.mag, 5.0)
        if per_feature and self.W == 1:
            self.W = self.N
        return True

    def op_residual(self) -> bool:
        d = self.d
        cands = [s for s in self.saved if s[2] == self.rank and
                 (self.rank == 1 or s[1] == self.W or s[1] == 1 or self.W == 1)]
        if not cands:
            return False
        name, w, _, m = d.choice(cands)
        kind = d.choice(["add", "sub", "rsub", "maximum", "mul"])
        if kind == "mul":
            if not self.ok(self.mag * m):
                return False
            self.emit(f"h * {name}")
            self.mag *= m
        else:
            self.emit({"add": f"h + {name}", "sub": f"h - {name}", "rsub": f"{name} - h",
                       "maximum": f"torch.maximum(h, {name})"}[kind])
            self.mag += m
        self.W = max(self.W, w)
        return True

    def _unary(self, forms: Sequence[str]) -> None:
        """Emit one of ``forms``: an expression of h, or 'nn:Ctor(...)' for a module."""
        if self.function:
            forms = [f for f in forms if not f.startswith("nn:")]
        f = self.d.choice(list(forms))
        if f.startswith("nn:"):
            m = self.module("act", "nn." + f[3:])
            self.emit(f"{m}(h)")
        else:
            self.emit(f)

    def op_unary(self) -> bool:
        d = self.d
        kind = d.choice(["gelu", "silu", "relu", "leaky_relu", "mish", "sigmoid", "tanh",
                         "hardtanh", "relu6", "elu", "softplus", "hardswish", "hardsigmoid",
                         "clamp", "abs", "square", "exp", "log", "sqrt", "reciprocal", "neg",
                         "selu", "celu", "softsign", "tanhshrink", "logsigmoid", "erf",
                         "sincos", "expm1", "log2", "prelu", "rrelu", "select", "hyper",
                         "binmath"])
        m = self.mag
        if kind == "gelu":
            self._unary(["F.gelu(h)", 'F.gelu(h, approximate="tanh")', "nn:GELU()",
                         "nn:GELU(approximate='tanh')"])
        elif kind == "silu":
            self._unary(["F.silu(h)", "nn:SiLU()", "h * torch.sigmoid(h)"])
        elif kind == "relu":
            self._unary(["torch.relu(h)", "F.relu(h)", "h.relu()", "nn:ReLU()"])
        elif kind == "leaky_relu":
            s = _lit(d.float(0.0, 0.5))
            self._unary([f"F.leaky_relu(h, {s})", f"F.leaky_relu(h, negative_slope={s})",
                         f"nn:LeakyReLU({s})"])
        elif kind == "mish":
            self._unary(["F.mish(h)", "nn:Mish()"])
        elif kind == "sigmoid":
            self._unary(["torch.sigmoid(h)", "h.sigmoid()", "nn:Sigmoid()"])
            m = 1.0
        elif kind == "tanh":
            self._unary(["torch.tanh(h)", "h.tanh()", "nn:Tanh()"])
            m = 1.0
        elif kind == "hardtanh":
            lo, hi = _lit(d.float(-3.0, 0.0)), _lit(d.float(0.1, 3.0))
            self._unary([f"F.hardtanh(h, {lo}, {hi})", f"F.hardtanh(h, min_val={lo}, max_val={hi})",
                         f"nn:Hardtanh({lo}, {hi})"])
            m = 3.0
        elif kind == "relu6":
            self._unary(["F.relu6(h)", "nn:ReLU6()"])
            m = 6.0
        elif kind == "elu":
            a = _lit(d.float(0.1, 2.0))
            self._unary([f"F.elu(h, {a})", f"F.elu(h, alpha={a})", f"nn:ELU(alpha={a})"])
            m += 2
        elif kind == "softplus":
            b, t = _lit(d.float(0.5, 3.0)), _lit(d.float(1.0, 20.0))
            self._unary([f"F.softplus(h, {b}, {t})", f"F.softplus(h, beta={b}, threshold={t})",
                         f"nn:Softplus({b}, {t})"])
            m += 2
        elif kind == "hardswish":
            self._unary(["F.hardswish(h)", "nn:Hardswish()"])
        elif kind == "hardsigmoid":
            self._unary(["F.hardsigmoid(h)", "nn:Hardsigmoid()"])
            m = 1.0
        elif kind == "clamp":
            lo, hi = d.float(-4.0, 1.0), d.float(1.5, 6.0)
            L, H = _lit(lo), _lit(hi)
            form, has_lo, has_hi = d.choice([
                (f"torch.clamp(h, min={L})", True, False), (f"torch.clamp(h, max={H})", False, True),
                (f"torch.clamp(h, {L}, {H})", True, True), (f"h.clamp(min={L}, max={H})", True, True),
                (f"h.clamp_min({L})", True, False), (f"torch.clamp_max(h, {H})", False, True),
                (f"h.clip({L}, {H})", True, True)])
            self.emit(form)
            m = max(abs(lo), abs(hi)) if (has_lo and has_hi) else max(m, abs(lo), abs(hi))
        elif kind == "abs":
            self._unary(["h.abs()", "torch.abs(h)", "abs(h)"])
        elif kind == "square":
            if m > 1e3:
                return False
            self._unary(["torch.square(h)", "h.square()"])
            m = m * m
        elif kind == "exp":
            c = d.float(-2.0, 10.0)
            self._unary([f"torch.exp(torch.clamp(h, max={_lit(c)}))", f"h.clamp(max={_lit(c)}).exp()"])
            m = math.exp(c)
        elif kind == "log":
            self._unary(["torch.log(h.abs() + 1.0)", "torch.log1p(h.abs())"])
            m = math.log(m + 1) + 1
        elif kind == "sqrt":
            self._unary(["torch.sqrt(h.abs())", "torch.rsqrt(h.abs() + 0.5)"])
            m = max(math.sqrt(m), 1.5)
        elif kind == "reciprocal":
            self._unary(["torch.reciprocal(h.abs() + 0.5)", "1.0 / (h.abs() + 0.5)"])
            m = 2.0
        elif kind == "selu":
            self._unary(["F.selu(h)", "torch.selu(h)", "nn:SELU()"])
            m = 1.06 * m + 2
        elif kind == "celu":
            a = _lit(d.float(0.2, 2.0))
            self._unary([f"F.celu(h, {a})", f"F.celu(h, alpha={a})", f"nn:CELU({a})"])
            m += 2
        elif kind == "softsign":
            self._unary(["F.softsign(h)", "nn:Softsign()"])
            m = 1.0
        elif kind == "tanhshrink":
            self._unary(["F.tanhshrink(h)", "nn:Tanhshrink()"])
            m += 1
        elif kind == "logsigmoid":
            self._unary(["F.logsigmoid(h)", "nn:LogSigmoid()"])
            m += 1
        elif kind == "erf":
            self._unary(["torch.erf(h)", "h.erf()", "torch.special.erf(h)"])
            m = 1.0
        elif kind == "sincos":
            if m > 10:   # sin of a large value magnifies the GEMM's rounding error
                return False
            self._unary(["torch.sin(h)", "h.sin()", "torch.cos(h)", "h.cos()"])
            m = 1.0
        elif kind == "expm1":
            c = d.float(-2.0, 10.0)
            self._unary([f"torch.expm1(torch.clamp(h, max={_lit(c)}))",
                         f"h.clamp(max={_lit(c)}).expm1()"])
            m = math.exp(c)
        elif kind == "log2":
            self._unary(["torch.log2(h.abs() + 1.0)", "(h.abs() + 1.0).log2()"])
            m = math.log2(m + 1) + 1
        elif kind == "hyper":   # atan, asinh; sinh and cosh of a clamped value
            c = d.float(0.5, 4.0)
            forms = [("torch.atan(h)", math.pi / 2), ("h.arctan()", math.pi / 2),
                     ("torch.asinh(h)", math.log(2 * m + 1) + 1), ("h.asinh()", math.log(2 * m + 1) + 1),
                     (f"torch.sinh(h.clamp({_lit(-c)}, {_lit(c)}))", math.sinh(c)),
                     (f"torch.cosh(torch.clamp(h, {_lit(-c)}, {_lit(c)}))", math.cosh(c))]
            f, m = d.choice(forms)
            self.emit(f)
        elif kind == "binmath":   # binary math of h with itself (continuous forms only)
            q = _lit(2 * m + 1)
            forms = [("torch.hypot(h, 0.5 * h + 1.0)", 1.5 * m + 1),
                     ("h.hypot(h.abs())", 1.5 * m),
                     ("torch.atan2(h, h.abs() + 1.0)", math.pi / 2),
                     ("torch.logaddexp(h, 0.5 * h)", m + 1),
                     ("h.logaddexp(-h)", m + 1),
                     (f"torch.fmod(h, {q})", m), (f"h.fmod({q})", m)]
            f, m = d.choice(forms)
            self.emit(f)
        elif kind == "prelu":
            if self.function:
                return False   # a module with a parameter
            self._unary(["nn:PReLU()"] + ([f"nn:PReLU({self.W})"] if self.rank == 2 else []))
        elif kind == "select":   # comparisons and where (continuous forms only: a drawn
            # threshold must not turn the GEMM's last-bit rounding into a jump)
            s_, t = _lit(d.float(0.0, 0.5)), _lit(d.float(0.0, 1.5))
            self._unary([f"torch.where(h > 0, h, {s_} * h)", f"h.where(h >= 0, {s_} * h)",
                         "h * (h > 0)", "h * (h > 0).float()", f"F.threshold(h, {t}, {t})",
                         f"F.softshrink(h, {t})", f"nn:Softshrink({t})",
                         f"torch.where((h > 0) & (h < 1.0e30), h, torch.tanh(h) * {s_})"])
        elif kind == "rrelu":
            lo, hi = _lit(d.float(0.0, 0.3)), _lit(d.float(0.3, 0.5))
            self._unary([f"F.rrelu(h, {lo}, {hi}, training=False)",
                         f"F.rrelu(h, lower={lo}, upper={hi})"])
        else:
            self._unary(["-h", "torch.neg(h)", "h.neg()"])
        self.mag = m
        self.ops[-1] = kind
        return True

    def op_reduce(self) -> bool:
        if self.rank != 2:
            return False
        d = self.d
        kind = d.choice(self.reduce_kinds)
        dim = d.choice(["1", "-1"])
        keep = d.bool()
        k = f"keepdim={keep}"
        W, m = self.W, self.mag
        if kind == "sum":
            e = d.choice([f"h.sum(dim={dim}, {k})", f"torch.sum(h, {dim}, {k})"])
            m = m * W
        elif kind == "mean":
            e = d.choice([f"h.mean({dim}, {k})", f"torch.mean(h, dim={dim}, {k})"])
        elif kind in ("max", "min"):
            e = d.choice([f"h.{kind}(dim={dim}, {k})[0]", f"torch.{kind}(h, {dim}, {k})[0]",
                          f"torch.{kind}(h, dim={dim}, {k}).values"])
        elif kind in ("amax", "amin"):
            e = d.choice([f"torch.{kind}(h, dim={dim}, {k})", f"h.{kind}({dim}, {k})"])
        elif kind == "logsumexp":
            e = d.choice([f"torch.logsumexp(h, dim={dim}, {k})", f"h.logsumexp({dim}, {k})"])
            m = m + math.log(W) + 1
        elif kind == "norm":
            p = d.choice(["1", "2", "3", "0", "float('inf')", "-float('inf')"])
            e = d.choice([f"torch.norm(h, p={p}, dim={dim}, {k})", f"h.norm(p={p}, dim={dim}, {k})",
                          f"torch.linalg.vector_norm(h, ord={p}, dim={dim}, {k})"])
            m = m * W
        else:
            if m > 300:
                return False
            corr = d.choice(["", ", unbiased=False", ", correction=0", ", correction=1"])
            e = d.choice([f"h.{kind}(dim={dim}{corr}, {k})", f"torch.{kind}(h, dim={dim}{corr}, {k})"])
            m = 4 * m * m if kind == "var" else 2 * m
        if not self.ok(m):
            return False
        self.emit(e)
        self.mag = m
        self.W = 1
        self.rank = 2 if keep else 1
        self.ops[-1] = f"reduce.{kind}"
        return True

    def op_softmax(self) -> bool:
        if self.rank != 2:
            return False
        d = self.d
        dim = d.choice(["1", "-1"])
        if d.bool():
            self._unary([f"F.softmax(h, dim={dim})", f"torch.softmax(h, {dim})",
                         f"h.softmax(dim={dim})", f"nn:Softmax(dim={dim})",
                         f"F.softmin(-h, dim={dim})"])
            self.mag = 1.0
            self.ops[-1] = "softmax"
        else:
            self._unary([f"F.log_softmax(h, dim={dim})", f"torch.log_softmax(h, {dim})",
                         f"h.log_softmax({dim})", f"nn:LogSoftmax(dim={dim})"])
            self.mag = 2 * self.mag + math.log(self.W) + 1
            self.ops[-1] = "log_softmax"
        return True

    def op_layernorm(self) -> bool:
        if self.rank != 2:
            return False
        d = self.d
        W = self.W
        eps = d.choice(["1e-05", "0.001"])
        if self.function or d.bool(0.3):
            shape = d.choice([f"({W},)", "(h.shape[1],)", "(h.size(-1),)"])
            self.emit(f"F.layer_norm(h, {shape}, eps={eps})")
        else:
            aff = d.choice(["elementwise_affine=True", "elementwise_affine=False",
                            "elementwise_affine=True, bias=False"])
            post = [] if "False" in aff.split(",")[0] else [
                "with torch.no_grad(): {m}.weight.uniform_(0.5, 1.5)"]
            if aff.endswith("True"):
                post.append("with torch.no_grad(): {m}.bias.uniform_(-1.0, 1.0)")
            m = self.module("ln", f"nn.LayerNorm({W}, eps={eps}, {aff})", *post)
            self.emit(f"{m}(h)")
        self.mag = math.sqrt(W) * 1.5 + 1
        return True

    def op_groupnorm(self) -> bool:
        if self.rank != 2:
            return False
        d = self.d
        W = self.W
        G = d.choice([g for g in range(1, W + 1) if W % g == 0])
        eps = d.choice(["1e-05", "0.001"])
        if self.function or d.bool(0.3):
            self.emit(f"F.group_norm(h, {G}, eps={eps})")
        else:
            aff = d.bool(0.7)
            post = ["with torch.no_grad(): {m}.weight.uniform_(0.5, 1.5)",
                    "with torch.no_grad(): {m}.bias.uniform_(-1.0, 1.0)"] if aff else []
            m = self.module("gn", f"nn.GroupNorm({G}, {W}, eps={eps}, affine={aff})", *post)
            self.emit(f"{m}(h)")
        self.mag = math.sqrt(W // G) * 1.5 + 1
        self.ops[-1] = f"groupnorm.g{W // G}"
        return True

    def op_batchnorm(self) -> bool:
        if self.rank != 2 or self.function:
            return False
        d = self.d
        W = self.W
        eps = d.choice(["1e-05", "0.001"])
        momentum = d.choice(["0.1", "0.5", "None"])
        aff = d.bool(0.7)
        track = d.bool(0.85)
        post = []
        if aff:
            post += ["with torch.no_grad(): {m}.weight.uniform_(0.5, 1.5)",
                     "with torch.no_grad(): {m}.bias.uniform_(-1.0, 1.0)"]
        if track:
            post += ["with torch.no_grad(): {m}.running_mean.normal_().mul_(2.0)",
                     "with torch.no_grad(): {m}.running_var.uniform_(0.5, 2.0)",
                     f"with torch.no_grad(): {{m}}.num_batches_tracked.fill_({d.int(0, 5)})"]
        m = self.module("bn", f"nn.BatchNorm1d({W}, eps={eps}, momentum={momentum}, affine={aff}, "
                              f"track_running_stats={track})", *post)
        uses_batch = self.mode == "train" or not track
        if not uses_batch and aff and d.bool(0.3):
            self.emit(f"F.batch_norm(h, {m}.running_mean, {m}.running_var, {m}.weight, {m}.bias, "
                      f"False, 0.1, {eps})")
        else:
            self.emit(f"{m}(h)")
        if uses_batch:
            self.batch_stats = True
            self.mag = math.sqrt(33) * 1.5 + 1
        else:
            self.mag = (self.mag + 7) / math.sqrt(0.5) * 1.5 + 1
        self.ops[-1] = "batchnorm." + ("batch" if uses_batch else "running")
        return True

    def op_pool(self) -> bool:
        if self.rank != 2 or self._x_pending():
            return False
        d = self.d
        W = self.W
        if self.pools is not None:   # (kind, window, stride) drawn from the given ones
            fit = [p for p in self.pools if p[1] <= W]
            if not fit:
                return False
            kind, k, s = d.choice(fit)
        else:
            k = d.int(1, min(W, 6))
            s = d.int(1, 4)
            kind = d.choice(["max", "avg"])
        forms = [f"F.{kind}_pool1d(h.unsqueeze(1), {k}, {s}).squeeze(1)",
                 f"F.{kind}_pool1d(h.unsqueeze(1), kernel_size={k}, stride={s}).squeeze(1)",
                 f"F.{kind}_pool1d(h.unsqueeze(1), {k}).squeeze(1)"]
        if not self.function:
            forms.append("MOD")
        if W % k == 0:   # equal windows: adaptive pooling to W / k, stride k
            forms.append("ADAPTIVE")
        if self.pools is None:   # torch's other window rules
            forms += ["WINDOWS", "ADAPTIVE_ANY"]
        f = d.choice(forms)
        if f == "ADAPTIVE_ANY":   # any output size: windows of unequal sizes
            o = d.int(1, W + 2)
            self.emit(f"F.adaptive_{kind}_pool1d(h.unsqueeze(1), {o}).squeeze(1)")
            self.W = o
            self.ops[-1] = f"pool.{kind}.adaptive"
            return True
        if f == "WINDOWS":   # padding, ceil_mode, dilation, count_include_pad
            pad = d.int(0, k // 2)
            ceil = d.bool()
            dil = d.int(1, 3) if kind == "max" else 1
            incl = d.bool()
            probe = torch.zeros(1, 1, W)
            try:
                wo = (F.max_pool1d(probe, k, s, pad, dil, ceil_mode=ceil) if kind == "max" else
                      F.avg_pool1d(probe, k, s, pad, ceil, incl)).shape[-1]
            except RuntimeError:
                return False
            if kind == "max":
                if not self.function and d.bool():
                    m = self.module("pool", f"nn.MaxPool1d({k}, {s}, padding={pad}, "
                                            f"dilation={dil}, ceil_mode={ceil})")
                    self.emit(f"{m}(h.unsqueeze(1)).squeeze(1)")
                else:
                    self.emit(f"F.max_pool1d(h.unsqueeze(1), {k}, {s}, {pad}, {dil}, "
                              f"ceil_mode={ceil}).squeeze(1)")
            elif not self.function and d.bool():
                m = self.module("pool", f"nn.AvgPool1d({k}, {s}, {pad}, ceil_mode={ceil}, "
                                        f"count_include_pad={incl})")
                self.emit(f"{m}(h.unsqueeze(1)).squeeze(1)")
            else:
                self.emit(f"F.avg_pool1d(h.unsqueeze(1), {k}, {s}, padding={pad}, "
                          f"ceil_mode={ceil}, count_include_pad={incl}).squeeze(1)")
            self.W = wo
            self.ops[-1] = f"pool.{kind}.windows"
            return True
        if f == "ADAPTIVE":
            f = d.choice([f"F.adaptive_{kind}_pool1d(h.unsqueeze(1), {W // k}).squeeze(1)",
                          f"F.adaptive_{kind}_pool1d(h.unsqueeze(1), output_size={W // k}).squeeze(1)"])
            s = k
        elif f == "MOD":
            cls = "MaxPool1d" if kind == "max" else "AvgPool1d"
            m = self.module("pool", f"nn.{cls}({k}, stride={s})")
            f = f"{m}(h.unsqueeze(1)).squeeze(1)"
        elif f.endswith(f"{k}).squeeze(1)"):
            s = k  # stride defaults to the kernel size
        self.emit(f)
        self.W = (W - k) // s + 1
        self.ops[-1] = f"pool.{kind}"
        return True

    def op_dropout(self) -> bool:
        d = self.d
        p = _lit(d.float(0.05, 0.9)) if self.mode == "eval" else "0.0"
        if self.function:
            self.emit(f"F.dropout(h, {p}, training=False)")
            return True
        f = d.choice(["MOD", f"F.dropout(h, p={p}, training=self.training)",
                      f"F.dropout(h, {p}, self.training)"])
        if f == "MOD":
            m = self.module("drop", f"nn.Dropout({p})")
            f = f"{m}(h)"
        self.emit(f)
        return True

    def op_normalize(self) -> bool:
        if self.rank != 2:
            return False
        dim = self.d.choice(["1", "-1"])
        self.emit(self.d.choice([f"F.normalize(h, dim={dim})", f"F.normalize(h, p=1.0, dim={dim})",
                                 f"F.normalize(h, p=2.0, dim={dim}, eps=0.001)"]))
        self.mag = 1.0
        return True

    def op_y(self) -> bool:
        if not self.has_y or self.rank != 2 or self.W not in (self.N, 1):
            return False
        kind = self.d.choice(["add", "rsub", "maximum", "mul"])
        if kind == "mul":
            if not self.ok(self.mag * X_MAX):
                return False
            self.emit("h * y")
            self.mag *= X_MAX
        else:
            self.emit({"add": "h + y", "rsub": "y - h", "maximum": "torch.maximum(h, y)"}[kind])
            self.mag += X_MAX
        self.W = self.N
        self.used_y = True
        return True

    def op_x(self) -> bool:
        if self.function or self.rank != 2 or self.W not in (self.K, 1):
            return False
        self.emit(self.d.choice(["h + x", "h - x", "x + h"]))
        self.W = self.K
        self.mag += X_MAX
        return True

    def op_unsqueeze(self) -> bool:
        if self.rank != 1:
            return False
        self.emit(self.d.choice(["h.unsqueeze(1)", "h.view(-1, 1)", "h.reshape(-1, 1)",
                                 "torch.unsqueeze(h, -1)"]))
        self.rank = 2
        return True

    def op_view(self) -> bool:
        if self.rank != 2:
            return False
        self.emit(self.d.choice([f"h.reshape(h.shape[0], {self.W})", "h.flatten(1)",
                                 "h.contiguous()", f"h.view(-1, {self.W})",
                                 f"h.view(h.size(0), {self.W})", "h.view(h.size(0), -1)",
                                 "h.reshape(h.shape[0], -1)"]))
        return True

    def _x_pending(self) -> bool:
        """A forced `x` (the GEMM input added back) still to come: it needs width K."""
        return "x" in self.force and "x" not in self.ops

    def op_slice(self) -> bool:
        """Features taken apart: h[:, a:b], narrow, split, F.glu / nn.GLU, a SwiGLU."""
        if self.rank != 2 or self.W < 2 or self._x_pending():
            return False
        d, W = self.d, self.W
        kind = d.choice(["range", "narrow", "split", "glu", "swiglu"])
        if kind == "range":
            a = d.int(0, W - 1)
            b = d.int(a + 1, W)
            forms = [f"h[:, {a}:{b}]", f"h[..., {a}:{b}]"]
            if b == W:
                forms.append(f"h[:, {a}:]")
            if a == 0:
                forms.append(f"h[:, :{b}]")
            self.emit(d.choice(forms))
            self.W = b - a
        elif kind == "narrow":
            a = d.int(0, W - 1)
            n = d.int(1, W - a)
            self.emit(d.choice([f"h.narrow(1, {a}, {n})", f"torch.narrow(h, 1, {a}, {n})"]))
            self.W = n
        elif kind == "split":
            n = d.int(1, W)
            i = d.int(0, (W - 1) // n)
            self.emit(d.choice([f"torch.split(h, {n}, dim=1)[{i}]", f"h.split({n}, 1)[{i}]"]))
            self.W = min(n, W - i * n)
        elif kind == "glu":
            if W % 2:
                return False
            self._unary(["F.glu(h, dim=1)", "F.glu(h, -1)", "nn:GLU(dim=1)"])
            self.W = W // 2
        else:
            if W % 2 or self.mag > 1e3:
                return False
            self.emit(d.choice(["F.silu(h.chunk(2, dim=1)[0]) * h.chunk(2, dim=1)[1]",
                                "torch.chunk(h, 2, 1)[1] * torch.sigmoid(torch.chunk(h, 2, 1)[0])"]))
            self.W = W // 2
            self.mag = self.mag * self.mag + 1
        self.ops[-1] = f"slice.{kind}"
        return True

    def op_cat(self) -> bool:
        """Features joined: h with a function of itself or its row sum."""
        if self.rank != 2 or self._x_pending():
            return False
        d, W = self.d, self.W
        other, w2 = d.choice([("h", W), ("torch.sigmoid(h)", W), ("h.sum(1, keepdim=True)", 1),
                              ("torch.tanh(h)", W)])
        if other.startswith("h.sum"):
            if not self.ok(self.mag * W):
                return False
            self.mag = self.mag * W
        self.emit(d.choice([f"torch.cat([h, {other}], dim=1)", f"torch.cat(({other}, h), -1)"]))
        self.W = W + w2
        self.ops[-1] = "cat"
        return True

    def op_stack(self) -> bool:
        """Values stacked (torch.stack) along a new dim before, between or after the
        features, then reduced over it or flattened back."""
        if self._x_pending():
            return False
        d, W, m = self.d, self.W, self.mag
        other, om = d.choice([("torch.sigmoid(h)", 1.0), ("torch.tanh(h)", 1.0),
                              ("h * 0.5", m / 2), ("-h", m)])
        pair = f"[h, {other}]" if d.bool() else f"({other}, h)"
        if self.rank == 1:
            self.emit(d.choice([f"torch.stack({pair}, dim=1)", f"torch.stack({pair}, -1)"]))
            self.rank, self.W = 2, 2
            self.ops[-1] = "stack.rows"
            return True
        kind = d.choice(["sum", "mean", "amax", "max", "flat"])
        where = d.choice(["0", "1", "-1"])
        if kind == "flat":
            if where == "0":
                return False
            self.emit(f"torch.stack({pair}, dim={where}).flatten(1)")
            self.W = 2 * W
        elif kind == "max":
            self.emit(f"torch.max(torch.stack({pair}, {where}), {where})[0]")
        elif where == "0":
            self.emit(d.choice([f"torch.stack({pair}).{kind}(0)",
                                f"torch.{kind}(torch.stack({pair}, dim=0), dim=0)"]))
        else:
            self.emit(f"torch.stack({pair}, dim={where}).{kind}(dim={where})")
        self.mag = m + om if kind == "sum" else max(m, om)
        self.ops[-1] = f"stack.{kind}"
        return True

    def op_made(self) -> bool:
        """Tensors the forward makes: torch.zeros/ones/full/arange, new_ones/new_zeros, of a
        fixed or batch-dependent shape, and math functions of sizes."""
        if self.rank != 2 or self._x_pending():
            return False
        d, W, m = self.d, self.W, self.mag
        kind = d.choice(["cat_ones", "cat_full", "zeros_like_shape", "arange", "math_log",
                         "math_sqrt", "ones_fixed", "in_place"])
        if kind == "in_place":   # in-place ops on a tensor the forward made
            z = self.fresh("z")
            c = _lit(d.float(0.25, 2.0))
            self.fwd.append(d.choice([f"{z} = torch.zeros(h.shape, dtype=h.dtype)",
                                      f"{z} = h.new_zeros(h.size())",
                                      f"{z} = torch.zeros_like(h)"]))
            self.fwd.append(f"{z}.add_(h)")
            self.fwd.append(d.choice([f"{z}.mul_({c})", f"{z}.add_(1.0).sub_(1.0)",
                                      f"{z}.clamp_(min=-1e5)"]))
            self.emit(z)
            m = m * 2 + 2
        elif kind == "cat_ones":
            one = d.choice(["h.new_ones(h.size(0), 1)", "torch.ones((h.shape[0], 1))",
                            "torch.ones((h.size(0), 1), device=h.device)"])
            self.emit(f"torch.cat([h, {one}], dim=1)")
            self.W = W + 1
            m = max(m, 1.0)
        elif kind == "cat_full":
            v = _lit(d.float(-3, 3))
            self.emit(d.choice([f"torch.cat([torch.full((h.shape[0], 2), {v}), h], 1)",
                                f"torch.cat([h.new_full((h.size(0), 2), {v}), h], -1)"]))
            self.W = W + 2
            m = max(m, 3.0)
        elif kind == "zeros_like_shape":
            self.emit(d.choice(["h + torch.zeros(h.size(), device=h.device)",
                                "h - h.new_zeros(h.shape)"]))
        elif kind == "arange":
            self.emit(d.choice([f"h * torch.arange({W}, dtype=torch.float32) / {W}",
                                f"h + torch.arange(0, {W}, dtype=h.dtype, device=h.device)",
                                f"h * torch.exp(-math.log(100.0) * torch.arange(start=0, "
                                f"end={W}, dtype=h.dtype) / {W})"]))
            m = m + W
        elif kind == "math_log":
            self.emit(d.choice(["h - math.log(h.shape[1])", "h * math.log(h.size(-1) + 1)"]))
            m = m * (math.log(W + 1) + 1) + 5
        elif kind == "math_sqrt":
            self.emit(d.choice(["h / math.sqrt(h.size(-1))", "h * math.sqrt(h.shape[1])"]))
            m = m * math.sqrt(W)
        else:
            self.emit(d.choice([f"h + torch.ones({W})", f"h * torch.full((1, {W}), 0.5)",
                                "h - torch.zeros(1)"]))
            m = m + 1
        if not self.ok(m):
            return False
        self.mag = m
        self.ops[-1] = f"made.{kind}"
        return True

    def op_similarity(self) -> bool:
        """F.cosine_similarity / F.pairwise_distance of h and a function of it (a row
        value), or nn.CosineSimilarity / nn.PairwiseDistance modules."""
        if self.rank != 2 or self._x_pending():
            return False
        d, m = self.d, self.mag
        other = d.choice(["torch.tanh(h)", "h * 0.5 + 1.0", "torch.ones_like(h)",
                          "torch.sigmoid(h)"])
        if d.bool():
            eps = d.choice(["", ", eps=0.001", ", eps=1e-08"])
            dim = d.choice(["1", "-1"])
            self._unary([f"F.cosine_similarity(h, {other}, dim={dim}{eps})",
                         f"torch.cosine_similarity({other}, h{eps})"])
            self.mag = 1.0
            self.ops[-1] = "similarity.cosine"
        else:
            p = d.choice(["2.0", "1.0", "3.0"])
            keep = d.bool()
            if self.function:
                self.emit(f"F.pairwise_distance(h, {other}, p={p}, keepdim={keep})")
            else:
                mod = self.module("pdist", f"nn.PairwiseDistance(p={p}, keepdim={keep})")
                self.emit(d.choice([f"{mod}(h, {other})",
                                    f"F.pairwise_distance(h, {other}, p={p}, keepdim={keep})"]))
            self.mag = (m + 2) * self.W
            self.ops[-1] = "similarity.pdist"
            if not self.ok(self.mag):
                return False
            self.rank, self.W = (2, 1) if keep else (1, 1)
            return True
        self.rank, self.W = 1, 1
        return True

    def op_cumsum(self) -> bool:
        """A cumulative sum along the features (of the value, or of a positive function of
        it: monotone quantiles)."""
        if self.rank != 2 or self._x_pending():
            return False
        d, W, m = self.d, self.W, self.mag
        arg = d.choice(["h", "F.softplus(h)", "torch.sigmoid(h)"])
        self.emit(d.choice([f"torch.cumsum({arg}, dim=1)", f"{arg}.cumsum(-1)",
                            f"torch.cumsum({arg}, -1)"]))
        m = (m if arg == "h" else m + 1) * W
        if not self.ok(m):
            return False
        self.mag = m
        return True

    def op_stage(self) -> bool:
        if self.function or self.rank != 2 or self.stages >= 2 or self._x_pending():
            return False
        d = self.d
        n2 = d.int(1, 70)
        m = math.sqrt(self.W) * self.mag + 1
        if not self.ok(m):
            return False
        bias = d.bool(0.8)
        lin = self.module("fc", f"nn.Linear({self.W}, {n2}, bias={bias})")
        self.emit(d.choice([f"{lin}(h)", f"F.linear(h, {lin}.weight, {lin}.bias)"]))
        self.W, self.mag = n2, m
        self.stages += 1
        return True

    OPS = {  # name: weight
        "const": 6, "pow": 1, "param": 4, "residual": 3, "unary": 10, "reduce": 4,
        "softmax": 2, "layernorm": 2, "groupnorm": 2, "batchnorm": 2, "pool": 2,
        "dropout": 1, "normalize": 1, "y": 2, "x": 1, "unsqueeze": 3, "view": 1, "stage": 1,
        "slice": 2, "cat": 1, "stack": 1, "made": 1, "similarity": 1, "cumsum": 1,
    }

    # --- the whole model ------------------------------------------------------------
    def first_linear(self) -> None:
        d, K, N = self.d, self.K, self.N
        bias = d.bool(0.8)
        if self.function:
            return
        form = d.choice(["module", "module", "flinear", "matmul_t", "matmul_kn", "addmm",
                         "einsum"])
        if form == "matmul_kn":
            b = 1 / math.sqrt(K)
            w = self.tensor("w", (K, N), f"uniform_({-b!r}, {b!r})")
            e = d.choice([f"torch.matmul(x, {w})", f"x @ {w}", f"torch.einsum('bi,io->bo', x, {w})"])
            if bias:
                e += " + " + self.tensor("b", (N,), f"uniform_({-b!r}, {b!r})")
            self.emit(e)
            return
        lin = self.module("fc", f"nn.Linear({K}, {N}, bias={bias})")
        if form == "module":
            self.emit(f"{lin}(x)")
        elif form == "einsum":
            self.emit(f"torch.einsum('bi,oi->bo', x, {lin}.weight)"
                      + (f" + {lin}.bias" if bias else ""))
        elif form == "addmm" and bias:
            self.emit(f"torch.addmm({lin}.bias, x, {lin}.weight.t())")
        elif form == "flinear":
            self.emit(f"F.linear(x, {lin}.weight, {lin}.bias)" if bias else
                      f"F.linear(x, {lin}.weight)")
        else:
            self.emit(f"x @ {lin}.weight.t()" + (f" + {lin}.bias" if bias else ""))

    def step(self, name: str) -> bool:
        if self.allow is not None and name not in self.allow and name not in self.force \
                and name != "unsqueeze":
            return False
        self.ops.append(name)
        before = (len(self.fwd), len(self.init), self.count, dict(self.closures))
        ok = getattr(self, "op_" + name)()
        if not ok:
            self.ops.pop()
            del self.fwd[before[0]:]
            del self.init[before[1]:]
            self.closures = before[3]
        return ok

    def _drawn(self, name: str, forced: list[str]) -> bool:
        """One drawn op; the next forced op counts as placed when drawn. A stage still forced
        later is not drawn (it would use up the stage budget the forced one needs)."""
        if name == "stage" and "stage" in forced[1:]:
            return False
        if not self.step(name):
            return False
        if forced and name == forced[0]:
            forced.pop(0)
        return True

    def run(self) -> None:
        self.first_linear()
        table = [n for n, w in self.OPS.items() for _ in range(w)]
        forced = list(self.force)
        done = 0
        attempts = 0
        while done < self.n_ops or forced:
            attempts += 1
            if attempts > 200:
                raise RuntimeError(f"generator stuck: forced {forced}, ops {self.ops}")
            if self.d.bool(0.25):
                name = self.fresh("s")
                self.fwd.append(f"{name} = h")
                self.saved.append((name, self.W, self.rank, self.mag))
            if forced and (done >= self.n_ops - len(forced) or self.d.bool(0.5)):
                name = forced[0]
                if name != "unsqueeze" and self.rank == 1:
                    self.step("unsqueeze")
                if self.step(name):
                    forced.pop(0)
                    done += 1
                    continue
                # not placeable here (e.g. y after a stage changed the width): draw another
                # op, uncounted, so the shape can come back to one the forced op accepts
                self._drawn(self.d.choice(table), forced)
                continue
            if self._drawn(self.d.choice(table), forced):
                done += 1
        if self.has_y and not self.used_y:
            self.emit("h + y.sum(dim=1, keepdim=True)" if self.rank == 2 else "h + y.sum(dim=1)")
            self.mag += X_MAX * self.N
            self.ops.append("y.sum")

    def spec(self) -> TailSpec:
        body = "\n".join("        " + ln for ln in self.fwd)
        if self.function:
            args = "h, y" if self.has_y else "h"
            src = f"def tail_fn({args}):\n" + "\n".join("    " + ln for ln in self.fwd) + \
                "\n    return h\n"
        else:
            args = "self, x, y" if self.has_y else "self, x"
            init = "\n".join("        " + ln for ln in self.init)
            src = ("class {name}(nn.Module):\n"
                   "    def __init__(self):\n"
                   "        super().__init__()\n"
                   f"{init}\n\n"
                   f"    def forward({args}):\n"
                   f"{body}\n"
                   "        return h\n")
        digest = hashlib.sha1((src + repr(sorted(self.closures))).encode()).hexdigest()[:10]
        name = f"Tail_{digest}"
        src = src.replace("{name}", name)
        return TailSpec(name=name, K=self.K, N=self.N, mode=self.mode, has_y=self.has_y,
                        batch_stats=self.batch_stats, source=src, ops=list(self.ops),
                        function=self.function, closures=dict(self.closures))


def generate(d: Draw, *, K: int | None = None, N: int | None = None, mode: str | None = None,
             has_y: bool | None = None, n_ops: int | None = None, force: Sequence[str] = (),
             function: bool = False, allow: Sequence[str] | None = None,
             reduce_kinds: Sequence[str] | None = None,
             pools: Sequence[tuple[str, int, int]] | None = None) -> TailSpec:
    """Draw one model (or, with ``function=True``, a tail function of h [and y]).
    ``force``: ops that must occur; ``allow``: the only ops drawn besides them;
    ``reduce_kinds``: the row reductions drawn (default all); ``pools``: the (kind,
    window, stride) of the poolings drawn (default: any, windows 1-6, strides 1-4)."""
    g = _Gen(d, K=K, N=N, mode=mode, has_y=has_y, n_ops=n_ops, force=force, function=function,
             allow=allow, reduce_kinds=reduce_kinds, pools=pools)
    if function:
        g.W = g.N
        g.fwd = []
    g.run()
    return g.spec()


def seeded(seed: int, **kw: Any) -> TailSpec:
    return generate(RandDraw(seed), **kw)


# ---------------------------------------------------------------------------------
# references and comparisons
def value_masks(t: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"NaN": torch.isnan(t), "+inf": torch.isposinf(t), "-inf": torch.isneginf(t)}


def references(model: nn.Module, inputs: Sequence[torch.Tensor]
               ) -> tuple[torch.Tensor, nn.Module, torch.Tensor]:
    """(float64 output, the float64 twin after the call, float32 torch output); ``model``
    itself is not touched (both run on deep copies)."""
    with torch.no_grad():
        m64 = copy.deepcopy(model).double()
        ref64 = m64(*[t.double() for t in inputs])
        ref32 = copy.deepcopy(model)(*inputs)
    return ref64, m64, ref32


def assert_matches(out: Any, ref64: torch.Tensor, ref32: torch.Tensor, what: str = "",
                   atol: float = 1e-4, rtol: float = 1e-4) -> None:
    """``out`` (float32) against the float64 reference:

    * NaN / +inf / -inf placement equal to the float64 reference's (where PyTorch's own
      float32 model places them differently from float64 -- float32 rounding near a
      discontinuity -- the float32 placement is accepted instead);
    * ``torch.allclose(out, ref64, atol, rtol, equal_nan=True)`` on the rest. Where
      PyTorch's float32 model is itself farther than that from float64 (an
      ill-conditioned case, e.g. a normalisation of values whose spread is far below
      their size), the fused result must be no farther from float64 than 4 times
      PyTorch's float32 error plus the tolerance.
    """
    out = torch.as_tensor(out).detach().cpu()
    ref64 = ref64.detach().cpu().double()
    ref32 = ref32.detach().cpu()
    assert out.dtype == torch.float32, f"{what}: dtype {out.dtype}"
    assert tuple(out.shape) == tuple(ref64.shape), \
        f"{what}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    for name, got in value_masks(out).items():
        exp = value_masks(ref64)[name]
        if torch.equal(got, exp):
            continue
        exp32 = value_masks(ref32)[name]
        if not torch.equal(exp, exp32) and torch.equal(got, exp32):
            continue
        bad = (got != exp).nonzero().tolist()[:6]
        raise AssertionError(
            f"{what}: {name} placement differs from the float64 reference at "
            f"{int((got != exp).sum())} elements, e.g. {bad}: fused "
            f"{[out[tuple(i)].item() for i in bad]} vs float64 "
            f"{[ref64[tuple(i)].item() for i in bad]} (float32 torch "
            f"{[ref32[tuple(i)].item() for i in bad]})")
    # the values: where both are finite (non-finite ones were checked above, including
    # an overflow to inf that PyTorch's float32 model makes too, beside a float64 value
    # past float32's range)
    fin = torch.isfinite(out) & torch.isfinite(ref64)
    o, r = out.double()[fin], ref64[fin]
    if torch.allclose(o, r, atol=atol, rtol=rtol):
        return
    err = float((o - r).abs().max())
    t_fin = fin & torch.isfinite(ref32)
    t_ok = torch.allclose(ref32.double()[t_fin], ref64[t_fin], atol=atol, rtol=rtol)
    if not t_ok:
        t_err = float((ref32.double()[t_fin] - ref64[t_fin]).abs().max())
        if err <= 4 * t_err + atol:
            return
    worst = int(((o - r).abs() / (atol + rtol * r.abs())).argmax())
    raise AssertionError(
        f"{what}: not allclose to float64 (atol={atol}, rtol={rtol}): max |diff| {err:.3e}; "
        f"worst element fused {o[worst].item():.9g} vs float64 {r[worst].item():.9g}"
        + ("" if t_ok else " (float32 torch is off too, but less)"))


def assert_grad_matches(out: Any, ref64: torch.Tensor, ref32: torch.Tensor,
                        what: str = "") -> None:
    """A gradient against float64 autograd's: :func:`assert_matches` with the absolute
    tolerance 1e-4 times the gradient's scale (its largest finite magnitude, at least 1):
    a gradient is a sum over the batch and the features, its error is its scale's."""
    r = ref64.detach().cpu().double()
    fin = r[torch.isfinite(r)]
    scale = max(1.0, float(fin.abs().max())) if fin.numel() else 1.0
    assert_matches(out, ref64, ref32, what, atol=1e-4 * scale, rtol=1e-4)


def flat_outputs(out: Any) -> list[torch.Tensor]:
    """A forward's result (a tensor, a tuple/list or a dict of them) as a list."""
    if isinstance(out, torch.Tensor):
        return [out]
    return list(out.values()) if isinstance(out, dict) else list(out)


def grads_of(model: nn.Module, call: Any, inputs: Sequence[torch.Tensor], gs: Sequence[Any],
             dtype: Any) -> list[torch.Tensor]:
    """The gradients of ``call``'s float inputs (given as ``inputs`` in ``dtype``), then of
    every parameter of ``model`` requiring grad, after backward of sum(out * g) over the
    float outputs with a ``g`` (None: not differentiated); a missing gradient as zeros."""
    ins = [t.detach().to(dtype).requires_grad_(True) if t.is_floating_point() else t
           for t in inputs]
    outs = flat_outputs(call(*ins))
    loss = sum((o * g.to(o.dtype)).sum() for o, g in zip(outs, gs)
               if g is not None and o.is_floating_point())
    leaves = [t for t in ins if t.is_floating_point()] + \
        [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, got)]


def fused_side(case: "Case", model: nn.Module, device: Any = "cpu") -> tuple[nn.Module, Any]:
    """(the module holding the fused parameters, the callable to run) for a case's API:
    a ``fused_class`` instance built with the case's seed (its state the model's), or the
    model itself (moved to ``device``) and its ``from_model`` view."""
    from cupyfuse.api import from_model, fused_class

    spec = case.spec
    if case.api == "fused_class":
        torch.manual_seed(case.model_seed)
        side = fused_class(spec.model_class())()
        side.train(spec.mode == "train")
        assert isinstance(side, spec.model_class())
        assert_same_state(side, model, "fused_class vs original")
        side = side.to(device)
        return side, side
    side = model.to(device)
    return side, from_model(side)


def bn_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.BatchNorm1d)
            and m.track_running_stats]


def assert_running_stats(fused_side: nn.Module, m64: nn.Module, what: str = "") -> None:
    """Running statistics and num_batches_tracked of every BatchNorm1d equal to the
    float64 twin's after the same call(s)."""
    twin = dict(m64.named_modules())
    for name, bn in bn_modules(fused_side):
        ref = twin[name]
        assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked), \
            f"{what}: {name}.num_batches_tracked {int(bn.num_batches_tracked)} != " \
            f"{int(ref.num_batches_tracked)}"
        for buf in ("running_mean", "running_var"):
            got = getattr(bn, buf).detach().cpu().double()
            exp = getattr(ref, buf).detach().cpu().double()
            assert torch.equal(torch.isnan(got), torch.isnan(exp)), \
                f"{what}: {name}.{buf} NaN placement {got.tolist()} vs {exp.tolist()}"
            assert torch.allclose(got, exp, atol=1e-4, rtol=1e-4, equal_nan=True), \
                f"{what}: {name}.{buf} max |diff| {float((got - exp).nan_to_num().abs().max()):.3e}"


# ---------------------------------------------------------------------------------
# one whole case: model, inputs, references, fused run(s), checks
@dataclass
class Case:
    spec: TailSpec
    batch: int
    dist: str
    data_seed: int
    n_special: int = 0
    model_seed: int = 0
    api: str = "from_model"   # "from_model", "fused_class" or "numpy" (from_model, NumPy in/out)
    calls: int = 1            # successive calls (training mode: running stats accumulate)

    def __repr__(self) -> str:
        return (f"Case(batch={self.batch}, dist={self.dist!r}, data_seed={self.data_seed}, "
                f"n_special={self.n_special}, model_seed={self.model_seed}, api={self.api!r}, "
                f"calls={self.calls})\n{self.spec!r}")


def needs_two_rows(spec: TailSpec) -> bool:
    """Batch statistics need 2 rows (torch raises on 1); so does GroupNorm with one
    value per group (torch's F.group_norm raises on batch 1 there)."""
    return spec.batch_stats or "groupnorm.g1" in spec.ops


def cases(*, specials: Sequence[int] = (0, 0, 0, 1, 2, 5), apis: Sequence[str] = ("from_model",
          "fused_class"), calls: Sequence[int] = (1,), **gen_kw: Any) -> Any:
    """A hypothesis strategy of :class:`Case` s (``gen_kw`` go to :func:`generate`)."""
    from hypothesis import strategies as st

    @st.composite
    def strat(draw: Any) -> Case:
        spec = generate(HypDraw(draw), **gen_kw)
        batch = draw(st.integers(2 if needs_two_rows(spec) else 1, 33))
        return Case(spec, batch, draw(st.sampled_from(DISTS)), draw(st.integers(0, 2 ** 20)),
                    draw(st.sampled_from(list(specials))), draw(st.integers(0, 7)),
                    draw(st.sampled_from(list(apis))), draw(st.sampled_from(list(calls))))

    return strat()


def seeded_case(seed: int, **gen_kw: Any) -> Case:
    """The fixed-seed twin of :func:`cases` (same generator, ``random.Random(seed)``)."""
    d = RandDraw(seed)
    spec = generate(d, **gen_kw)
    batch = d.int(2 if needs_two_rows(spec) else 1, 33)
    return Case(spec, batch, d.choice(DISTS), d.int(0, 2 ** 20), d.choice([0, 0, 1, 3, 5]),
                d.int(0, 7), d.choice(["from_model", "fused_class"]),
                2 if spec.mode == "train" else 1)


def assert_same_state(a: nn.Module, b: nn.Module, what: str = "") -> None:
    """Same parameter/buffer names, shapes and values, same state_dict keys."""
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb), f"{what}: state_dict keys {list(sa)} != {list(sb)}"
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k].cpu(), sb[k].cpu()), \
            f"{what}: {k} differs"
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()], what
    assert [n for n, _ in a.named_buffers()] == [n for n, _ in b.named_buffers()], what


def run_case(case: Case, device: Any = "cpu", min_calls: int = 1) -> Any:
    """Build the case's model, run it fused on ``device`` (``case.calls`` times but at
    least ``min_calls``, new inputs each time) and check every output against the
    float64 twin (and float32 torch for the non-finite fallbacks), and BatchNorm running
    statistics after each call. On CUDA the second call of a small batch is the
    prepared launch (cupyfuse.backend.prepared). Returns the last fused output."""
    import numpy as np


    spec = case.spec
    model = spec.make_model(case.model_seed)
    with torch.no_grad():
        m64 = copy.deepcopy(model).double()
        m32 = copy.deepcopy(model)
    side, fused = fused_side(case, model, device)
    out = None
    for call in range(max(case.calls, min_calls)):
        inputs = spec.make_inputs(case.batch, case.dist, case.data_seed + call, case.n_special)
        with torch.no_grad():
            ref64 = m64(*[t.double() for t in inputs])
            ref32 = m32(*inputs)
            if case.api == "numpy":
                out = fused(*[t.numpy() for t in inputs])
                assert isinstance(out, np.ndarray), type(out)
                out = torch.from_numpy(out)
            else:
                out = fused(*[t.to(device) for t in inputs])
                assert isinstance(out, torch.Tensor) and out.device.type == torch.device(device).type
        assert_matches(out, ref64, ref32, f"call {call}")
        assert_running_stats(side, m64, f"call {call}")
    return out


# ---------------------------------------------------------------------------------
# a model for the pair-difference rewrite (rewrite._maxpool_pairs_sum)
class MaxPairsSum(nn.Module):
    """``sum(max_pool1d(a * h + c, 2)) * s`` of a Linear output h, as 55 (a = 1, c = bias)
    in general form: a per-feature scale of either sign, an odd width (the last feature is
    dropped by the pooling), keepdim or not, the weight given transposed or not."""

    def __init__(self, k_in: int, n: int, *, transposed: bool = False, keepdim: bool = False,
                 negative: bool = True, mean: bool = False) -> None:
        super().__init__()
        self.transposed, self.keepdim, self.mean = transposed, keepdim, mean
        self.w = nn.Parameter(torch.randn(k_in, n) if transposed else torch.randn(n, k_in))
        a = torch.rand(n) + 0.5
        if negative:
            a[::3] *= -1
        self.a = nn.Parameter(a)
        self.c = nn.Parameter(torch.randn(n))
        self.s = 0.75

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w if self.transposed else F.linear(x, self.w)
        p = F.max_pool1d((h * self.a + self.c).unsqueeze(1), 2).squeeze(1)
        r = p.mean(dim=1, keepdim=self.keepdim) if self.mean else \
            torch.sum(p, dim=1, keepdim=self.keepdim)
        return r * self.s


def guard_rows(batch: int, k: int, seed: int) -> torch.Tensor:
    """Normal rows, plus a NaN row, +inf and -inf rows, and rows large enough that a
    rewrite's guard must send them to its direct branch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, k, generator=g)
    for i, v in ((1, float("nan")), (2, float("inf")), (3, -float("inf"))):
        if i < batch:
            x[i, (i * 7) % k] = v
    if batch > 4:
        x[4] = 1e35 * torch.rand(k, generator=g)   # finite, flagged by the guard
    if batch > 5:
        x[5, 0] = 3e36                              # one huge element, flagged
    return x


def pairdiff_nodes(fm: Any) -> int:
    """How many pair-difference GEMMs a fused module's programs hold."""
    return sum(nd.kind == "gemm" and len(nd.attrs) > 2 and nd.attrs[2][0] == "pairdiff"
               for p in runner_of(fm).programs.values() for nd in p.nodes)


# ---------------------------------------------------------------------------------
# rewrites with a coefficient that is not finite (rewrite.NotExact)
class AffineCoeff(nn.Module):
    """A rewritable reduction of ``fc(x) / p`` or ``fc(x) * p`` (per-feature p): a feature
    sum or mean (the GEMV rewrite), average pooling (the fold) or the sum of max-pooled
    pairs (the pair differences). A zero in p for ``/`` or an inf for ``*`` makes the
    rewritten form ``a * h + c`` give NaN where torch's order gives +-inf."""

    FORMS = ("sum_div", "mean_mul", "avgpool_div", "maxpairs_mul")

    def __init__(self, k_in: int, n: int, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(k_in, n)
        self.p = nn.Parameter(torch.rand(n) + 0.5)

    def set_p(self, kind: str) -> None:
        """p finite, or with a non-finite coefficient at two features (one of each sign
        where that matters)."""
        with torch.no_grad():
            self.p.copy_(torch.rand(self.p.shape[0]) + 0.5)   # (CPU draw: same on any device)
            bad = 0.0 if self.form.endswith("_div") else float("inf")
            if kind != "finite":
                self.p[0] = bad
                self.p[-1] = -bad if bad else 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        v = h / self.p if self.form.endswith("_div") else h * self.p
        if self.form == "sum_div":
            return v.sum(-1)
        if self.form == "mean_mul":
            return v.mean(-1, keepdim=True)
        if self.form == "avgpool_div":
            return F.avg_pool1d(v.unsqueeze(1), 2).squeeze(1)
        return F.max_pool1d(v.unsqueeze(1), 2).squeeze(1).sum(-1)


def rewritten_nodes(fm: Any) -> int:
    """How many GEMV or folded GEMM nodes a fused module's programs hold."""
    return sum(nd.kind == "gemv" or (nd.kind == "gemm" and len(nd.attrs) > 2)
               for p in runner_of(fm).programs.values() for nd in p.nodes)


def check_nonfinite_coefficients(form: str, batch: int, device: str, calls: int = 1) -> None:
    """Finite p, then non-finite, then finite again (edited in place: the coefficient
    cache sees each version), ``calls`` calls each (prepared launches after the first on
    the GPU): every result matches float64, and the rewrite applied."""
    from cupyfuse.api import from_model

    torch.manual_seed(batch + len(form))
    m = AffineCoeff(24, 10, form).to(device)
    fm = from_model(m)
    x = torch.randn(batch, 24)
    xd = x.to(device)
    for kind in ("finite", "nonfinite", "finite"):
        m.set_p(kind)
        ref64, _, ref32 = references(copy.deepcopy(m).cpu(), [x])
        if kind == "nonfinite":
            assert not torch.isfinite(ref32).all(), "the case has no inf to place"
        for c in range(calls):
            with torch.no_grad():
                out = fm(xd).cpu()
            assert_matches(out, ref64, ref32, f"{form} p {kind} call {c}")
    assert rewritten_nodes(fm) >= 1, "the rewrite did not apply"
