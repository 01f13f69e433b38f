"""The notation of the op records' derivatives.

A record's ``derivative`` is a function of one :class:`Grad`: the upstream gradient
``d.g``, the op's result ``d.y``, its operands ``d.x`` (``d.a``, ``d.b``, ``d.c`` by
position) and float attributes ``d.attrs``; it returns one entry per operand: the
gradient reaching that operand (an :class:`Expr`), ``None`` where none does (a
comparison's operands, a mask), or :data:`UNDEFINED` where the table has no formula
(the call then differentiates with torch's autograd instead). The formulas are
torch's (``tools/autograd/derivatives.yaml`` and the backward kernels it names),
written so that NaN and infinity land where torch's autograd puts them; the
per-record test (``tests/ops/test_derivatives.py``) checks each against torch at
special values.

An :class:`Expr` is a program value under construction: ``+ - * /`` and unary ``-``
with other values or Python numbers, a method per primitive op of the table
(``e.exp()``, ``e.sigmoid()``, ``e.gt(0)``, ``e.softplus(1.0, 20.0)`` ...), and
``d.where(c, a, b)``. Each becomes one ``map`` node of the derivative program
(:mod:`cupyfuse.ir.derivative`), so the backward runs on the CPU path and in the
generated kernels alike.
"""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["Expr", "Grad", "UNDEFINED"]

#: a derivative entry for an operand the table has no formula for
UNDEFINED = object()


class Expr:
    """A value of the derivative program being built (see the module docstring)."""

    __slots__ = ("b", "v")

    def __init__(self, b: Any, v: int) -> None:
        self.b, self.v = b, v

    def _val(self, o: Any) -> int:
        return o.v if isinstance(o, Expr) else self.b.const(float(o))

    def _map(self, op: str, *operands: Any, attrs: Sequence[float] = ()) -> "Expr":
        return Expr(self.b, self.b.map(op, *(self._val(o) for o in operands), attrs=attrs))

    def __add__(self, o: Any) -> "Expr":
        return self._map("add", self, o)

    def __radd__(self, o: Any) -> "Expr":
        return self._map("add", o, self)

    def __sub__(self, o: Any) -> "Expr":
        return self._map("sub", self, o)

    def __rsub__(self, o: Any) -> "Expr":
        return self._map("sub", o, self)

    def __mul__(self, o: Any) -> "Expr":
        return self._map("mul", self, o)

    def __rmul__(self, o: Any) -> "Expr":
        return self._map("mul", o, self)

    def __truediv__(self, o: Any) -> "Expr":
        return self._map("div", self, o)

    def __rtruediv__(self, o: Any) -> "Expr":
        return self._map("div", o, self)

    def __neg__(self) -> "Expr":
        return self._map("neg", self)

    def __getattr__(self, op: str) -> Any:
        # e.exp(), e.gt(0), e.softplus(1.0, 20.0): the primitive op of that name, with
        # this value as its first operand; further operands, then float attributes
        from cupyfuse.ops.registry import MAPS

        entry = MAPS.get(op)
        if entry is None:
            raise AttributeError(op)

        def call(*rest: Any) -> Expr:
            k = entry.arity - 1
            return self._map(op, self, *rest[:k], attrs=tuple(float(a) for a in rest[k:]))
        return call


class Grad:
    """What a record's derivative reads (see the module docstring)."""

    __slots__ = ("g", "y", "xs", "attrs")

    def __init__(self, bld: Any, g: int, y: int, xs: Sequence[int],
                 attrs: Sequence[float]) -> None:
        self.g, self.y = Expr(bld, g), Expr(bld, y)
        self.xs = tuple(Expr(bld, v) for v in xs)
        self.attrs = tuple(attrs)

    @property
    def x(self) -> Expr:
        return self.xs[0]

    @property
    def a(self) -> Expr:
        return self.xs[0]

    @property
    def b(self) -> Expr:
        return self.xs[1]

    @property
    def c(self) -> Expr:
        return self.xs[2]

    def where(self, c: Any, a: Any, b: Any) -> Expr:
        """``a`` where ``c`` is nonzero, else ``b`` (torch.where)."""
        return self.g._map("where", c, a, b)
