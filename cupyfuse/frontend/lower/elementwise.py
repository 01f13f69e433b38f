"""Elementwise ops in a traced forward (:mod:`cupyfuse.frontend.translate`): arithmetic (``binary``,
``clamp``), activations written with vocabulary ops (``composite``, ``shrink``, GLU,
PReLU, RReLU), dropout (an identity where inactive), comparisons, ``torch.where`` /
``masked_fill`` and logical ops on boolean tensors, the dtype rules of boolean and integer
tensors (refusing what torch raises on or computes in integers), and the ops that read an
integer input of the forward (``_raw_int_call``: read as float32 where exact).
"""
from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse.frontend.tables import (_arg, _is_expand, _is_view_node, op_of_function,
                                      op_of_method)
from cupyfuse.ops.registry import MAPS
from cupyfuse.frontend.values import (Val, _Bool, _Const, _DEVICE, _Int, _RawInt, _Size, _Split, _Tuple,
                             _Weight, _sizes)
from cupyfuse.ir.program import TailError


class _ElementwiseMixin:
    """Elementwise ops, booleans and integers: methods of the translator
    (:class:`cupyfuse.frontend.translate._Translator` inherits them and holds the state they use)."""

    # --- integer inputs ------------------------------------------------------------------
    def _raw_int_call(self, node: torch.fx.Node) -> Any:
        """An op reading an integer input (``_RawInt``, float32 in the program): views of it
        (an integer input still), casts to float32, elementwise ops whose result torch
        computes in float32 (with a float tensor or number: torch converts the integers to
        float32 first, as the caller did), float-valued functions of it, comparisons with
        a float tensor, a float number or an integer of at most 2**24 - 1 (exact in
        float32), ``.bool()``. Integer results (``mask * 2``, ``mask.sum(1)``), lookups
        (an nn.Embedding) and other ops are refused."""
        raws = [a for a in node.all_input_nodes if isinstance(self.env.get(a), _RawInt)]
        raw = self.env[raws[0]]
        op, t = node.op, node.target
        args = tuple(self._plain(a) for a in node.args)
        kw = {k: self._plain(v) for k, v in node.kwargs.items()}
        if op == "call_module":
            mod = self._get_attr(t)
            name = f"{t} ({type(mod).__name__})"
        else:
            mod, name = None, f".{t}()" if op == "call_method" else getattr(t, "__name__", str(t))

        def refuse(why: str) -> TailError:
            return self.refuse(name, f"{why} of the integer input {raw.label} (cupyfuse reads "
                               "an integer input as float32 where each use is exact whatever "
                               "its values: views, `.float()` / `.to(h.dtype)` / `type_as` "
                               "casts, arithmetic with float tensors or numbers, comparisons "
                               f"with numbers); pass `{raw.label.strip('`')}.float()` or cast "
                               "it first")

        for x in node.all_input_nodes:
            # an integer buffer or parameter beside it: torch computes in int64 (exact),
            # the program would in float32
            if x.op == "get_attr" and isinstance(self.env.get(x), _Weight):
                obj = self._get_attr(x.target)
                if isinstance(obj, torch.Tensor) and not obj.is_floating_point():
                    raise refuse(f"an op with the {obj.dtype} tensor `{x.target}` (torch "
                                 "computes it in integers)")
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) or t in (F.embedding,
                                                                      F.embedding_bag):
            raise self.refuse(name, f"token ids (the integer input {raw.label}) looked up in "
                                    "an embedding: not fused (cupyfuse fuses Linear + tail "
                                    "models); run the embedding outside and pass its output")
        if op == "call_function" and t is getattr:
            if args[1] == "dtype":   # (int32 too: a cast to it is refused either way)
                return torch.int64
            if args[1] == "shape":
                return _sizes(self.dims(raw.v), raw.v)
            if args[1] == "device":
                return _DEVICE
            raise refuse(f"`.{args[1]}`")
        elif op == "call_method" and t in ("size", "dim", "ndimension"):
            pass
        elif (op == "call_method" and t in ("long", "int") or op == "call_method" and
              t in ("to", "type") and any(x in (torch.int64, torch.int32) for x in
                                          list(args[1:]) + list(kw.values()))) and \
                node.args[0] is raws[0]:
            # an integer cast: the same values (the program's float32 copy of them)
            return _RawInt(raw.v, raw.label, t == "long" or torch.int64 in
                           list(args[1:]) + list(kw.values()))
        elif t in ("scatter", "scatter_", torch.scatter) and \
                _arg(node.args, node.kwargs, 2, "index") is raws[0] and \
                node.args[0] is not raws[0]:
            if t == "scatter_":
                self._check_inplace(node, True, name)
            return self.scatter(args[0], _arg(args, kw, 1, "dim"), raw,
                                _arg(args, kw, 3, "value" if "value" in kw else "src"), kw,
                                name)
        elif (op == "call_function" and getattr(op_of_function(t), "kind", None) == "compare"
              or op == "call_method" and getattr(op_of_method(t), "kind", None) == "compare"):
            for x in list(args) + list(kw.values()):
                e = self.env.get(x) if isinstance(x, torch.fx.Node) else x
                if isinstance(e, (_RawInt, _Int, _Bool)) and x is not raws[0] or \
                        isinstance(e, _Split) and e.kind != "f":
                    raise refuse("a comparison with another integer or boolean tensor")
                n = e.v if isinstance(e, _Const) else e
                if type(n) is int and abs(n) >= 2 ** 24:
                    raise refuse(f"a comparison with the integer {n} (float32 holds integers "
                                 "exactly up to 2**24 only)")
        elif not (_is_view_node(node) or _is_expand(node) or self._elementwise(node, args, kw)
                  or op == "call_method" and t == "type_as"):
            raise refuse("a reduction, lookup or other op that torch computes in integers"
                         if op != "call_module" else "an op")
        saved = {a: self.env[a] for a in raws}
        try:
            for a in raws:
                self.env[a] = _Int(self.env[a].v)
            r = self._split_call(node) if self._touches_split(node) and \
                not _is_expand(node) else getattr(self, op)(node)
        finally:
            self.env.update(saved)
        r = Val(r) if type(r) is int else r
        if _is_view_node(node) or _is_expand(node):
            if isinstance(r, _Tuple) or isinstance(r, _Split):
                raise refuse("pieces or several dims (a split) of a view")
            if isinstance(r, (Val, _Int)):
                return _RawInt(int(r) if isinstance(r, Val) else r.v, raw.label, raw.int64)
            return r
        if isinstance(r, _Int) and op == "call_method" and t in ("to", "type"):
            return _RawInt(r.v, raw.label, raw.int64)   # (moved, not cast: still integers)
        if isinstance(r, _Int):
            raise refuse("integer arithmetic (int64 in torch: exact where float32 rounds "
                         "beyond 2**24)")
        return r

    # --- arithmetic, clamp, dropout, activations -----------------------------------------
    def binary(self, op: str, a: Any, b: Any, alpha: Any, name: str, rounding: Any) -> int:
        def is_bool(x: Any) -> bool:
            return isinstance(x, bool) or (isinstance(x, torch.fx.Node)
                                           and isinstance(self.env.get(x), _Bool))
        if is_bool(a) and is_bool(b):
            raise self.refuse(name, "arithmetic between two boolean tensors (bool in torch); "
                              "use .float() on one of them")
        if rounding is not None:
            raise self.refuse(name, f"division with rounding_mode={rounding!r}")
        if op == "sub" and (is_bool(a) or is_bool(b)):
            raise self.refuse(name, "subtraction with a boolean tensor (torch raises; use ~mask "
                                    "or mask.float())")
        ints = self._int_operands(a, b)
        if ints and op == "pow" and isinstance(ints[1], int) and ints[1] < 0:
            raise self.refuse(name, "an integer tensor to a negative integer power (torch "
                                    "raises: Integers to negative integer powers are not "
                                    "allowed)")
        if ints and op in ("add", "sub", "mul", "maximum", "minimum", "fmod", "pow") and \
                (alpha is None or isinstance(alpha, int) and not isinstance(alpha, bool)):
            # booleans / integer tensors with integer numbers: int64 in torch
            va, vb = self.val(a, name), self.val(b, name)
            if alpha is not None and alpha != 1:
                vb = self.b.map("mul", vb, self.b.const(float(alpha)))
            return _Int(self.b.map(op, va, vb))
        if op == "pow" and not self.is_tensor_like(a) and not (self._is_bool(a) or
                                                             self._is_int(a)):
            raise self.refuse(name, "a number raised to a tensor power")
        if op == "pow" and not self.is_value(b) and not self.is_tensor_like(b) and \
                alpha is None:
            # (a parameter or buffer exponent, GeM's x.pow(self.p): torch's pow of two
            # tensors, powf elementwise, below)
            e = self.number(b, name)
            if e in (0.5, -0.5):
                # torch computes these exponents as sqrt / rsqrt (-inf ** 0.5 is NaN there)
                return self.b.map("sqrt" if e == 0.5 else "rsqrt", self.val(a, name))
        va = self.val(a, name)
        vb = self.val(b, name)
        if alpha is not None and alpha != 1:
            vb = self.b.map("mul", vb, self.b.const(float(alpha)))
        return self.b.map(op, va, vb)

    def _intlike(self, x: Any) -> Any:
        """An integer tensor (``_Int`` or ``_Bool``: True) or an int number (its value) of
        an operand; None for anything float."""
        v = self.env.get(x) if isinstance(x, torch.fx.Node) else x
        if isinstance(v, (_Int, _Bool)):
            return True
        if isinstance(v, _Const):
            v = v.v
        if isinstance(v, _Size) and v.v >= 0:
            v = v.v
        if isinstance(v, int) and not isinstance(v, (bool, Val)):
            return v
        return None

    def _int_operands(self, a: Any, b: Any) -> tuple | None:
        """(a, b) as ``_intlike`` where both are integer and one is a tensor (torch's
        result is then int64), else None."""
        ia, ib = self._intlike(a), self._intlike(b)
        if ia is None or ib is None or not (ia is True or ib is True):
            return None
        return ia, ib

    def clamp(self, a: Any, lo: Any, hi: Any, name: str) -> int:
        if lo is not None and hi is not None and \
                self.is_tensor_like(lo) != self.is_tensor_like(hi):
            raise self.refuse(name, "one bound a tensor and the other a number (torch raises "
                                    "TypeError: no overload mixes them)")
        if (lo is not None and self.is_tensor_like(lo)) or (hi is not None and self.is_tensor_like(hi)):
            v = self.val(a, name)
            if lo is not None:
                v = self.b.map("maximum", v, self.val(lo, name))
            if hi is not None:
                v = self.b.map("minimum", v, self.val(hi, name))
            return v
        lo_f = -math.inf if lo is None else self.number(lo, name)
        hi_f = math.inf if hi is None else self.number(hi, name)
        r = self.b.map("clamp", self.val(a, name), attrs=(lo_f, hi_f))
        if self._intlike(a) is True and all(self._intlike(x) is not None
                                            for x in (lo, hi) if x is not None):
            return _Int(r)   # an integer tensor clamped by integers: int64 in torch
        return r

    def dropout(self, a: Any, p: float, training: bool, name: str) -> Any:
        if training and p > 0:
            raise self.refuse(name, f"active dropout (p={p} in training mode) is random; call "
                              "model.eval() or use p=0")
        return self.env[a]

    def table_op(self, op: Any, a: Any, attrs: tuple, name: str) -> int:
        """An op of the table with no tensor operand but ``a`` (``kind`` "unary", or "attr"
        with its float attributes: a map node) or a composite (``compose``: torch's formula in the table's other ops; within an ulp
        or two of torch's own kernels) of operand ``a``."""
        v = self.val(a, name)
        if op.kind != "composite":
            return self.b.map(op.name, v, attrs=attrs)
        try:
            return op.compose(self.b, v, *attrs)
        except ValueError as e:
            raise self.err(str(e)) from None

    def shrink(self, kind: str, a: Any, t: Any, value: Any, name: str) -> int:
        """threshold / hardshrink / softshrink with torch's NaN behaviour (NaN passes)."""
        b = self.b
        v = self.val(a, name)
        t = self.number(t, name)
        if kind == "threshold":   # v <= t ? value : v
            return b.map("where", b.map("le", v, b.const(t)), b.const(self.number(value, name)), v)
        if kind == "softshrink" and t < 0:
            raise self.refuse(name, f"lambda {t!r} is negative (torch raises)")
        inside = b.map("le", b.map("abs", v), b.const(t))
        if kind == "hardshrink":   # -t <= v <= t ? 0 : v
            return b.map("where", inside, b.const(0.0), v)
        step = b.map("where", b.map("gt", v, b.const(0.0)), b.const(t), b.const(-t))
        # (+0.0 inside the band, as torch's CUDA kernel and its vectorised CPU loop give;
        # only its scalar CPU loop, a tensor's last few elements, gives v * 0 = -0.0)
        return b.map("where", inside, b.const(0.0), b.map("sub", v, step))

    # --- comparisons, where, logical ops (boolean tensors) -------------------------------
    def compare(self, op: str, a: Any, b: Any, name: str) -> _Bool:
        if isinstance(a, torch.fx.Node) and isinstance(self.env.get(a), _Bool) or \
                isinstance(b, torch.fx.Node) and isinstance(self.env.get(b), _Bool):
            raise self.refuse(name, "a comparison of boolean tensors")
        return _Bool(self.b.map(op, self.val(a, name), self.val(b, name)))

    def where_(self, cond: Any, a: Any, b: Any, name: str, keep: Any = None) -> Any:
        """``keep``: masked_fill's tensor, whose dtype the result has."""
        c = self.env.get(cond) if isinstance(cond, torch.fx.Node) else cond
        if not isinstance(c, _Bool):
            raise self.refuse(name, "a condition that is not a comparison of tensors")
        r = self.b.map("where", c.v, self.val(a, name), self.val(b, name))
        if keep is not None:
            return _Int(r) if self._is_int(keep) else r
        ia, ib = self._intlike(a), self._intlike(b)
        if ia is not None and ib is not None:   # integer branches: int64 in torch
            return _Int(r)
        return r

    def logical(self, f: Any, args: tuple, name: str) -> _Bool:
        ops = [self.env.get(x) if isinstance(x, torch.fx.Node) else x for x in args]
        if not all(isinstance(o, _Bool) for o in ops):
            raise self.refuse(name, "a logical op of a non-boolean operand")
        b = self.b
        if f in (operator.invert, torch.logical_not):
            return _Bool(b.map("sub", b.const(1.0), ops[0].v))
        x, y = ops[0].v, ops[1].v
        if f in (operator.and_, torch.logical_and):
            return _Bool(b.map("mul", x, y))
        if f in (operator.or_, torch.logical_or):
            return _Bool(b.map("maximum", x, y))
        return _Bool(b.map("ne", x, y))   # xor

    # --- booleans and integers: torch's dtype rules --------------------------------------
    def _is_bool(self, a: Any) -> bool:
        e = self.env.get(a) if isinstance(a, torch.fx.Node) else None
        return isinstance(e, _Bool) or isinstance(e, _Split) and e.kind == "b"

    def _is_int(self, a: Any) -> bool:
        e = self.env.get(a) if isinstance(a, torch.fx.Node) else None
        return isinstance(e, _Int) or isinstance(e, _Split) and e.kind == "i"

    def _int_unary(self, op: str, a: Any, r: int) -> Any:
        """A unary op's result ``r``: integer where torch keeps an integer tensor's dtype."""
        return _Int(r) if MAPS[op].keeps_int and self._is_int(a) else r

    def _no_bool_unary(self, op: str, a: Any, name: str) -> None:
        """Refuse a unary op of a boolean tensor where torch does not compute it as float."""
        rec = MAPS[op]
        if self._is_int(a) and rec.on_bool != "float" and not rec.keeps_int:
            raise self.refuse(name, f"{op} of an integer tensor (int64 in torch: it raises "
                                    "or keeps int64); apply it to a float tensor")
        if rec.on_bool == "float" or not self._is_bool(a):
            return
        if op == "neg":
            raise self.refuse(name, "negation of a boolean tensor (torch raises; use ~mask)")
        if op == "square":
            raise self.refuse(name, "square of a boolean tensor (torch gives int64 there); "
                                    "square `mask.float()` instead")
        raise self.refuse(name, f"{op} of a boolean tensor (torch raises); apply it to "
                                "`mask.float()`")

    def _no_bool_operand(self, a: Any, name: str) -> None:
        """Refuse an op torch raises on for a boolean tensor (activations, norms, ...)."""
        if self._is_bool(a):
            raise self.refuse(name, "a boolean tensor operand (torch raises); apply it to "
                                    "`mask.float()`")
        if self._is_int(a):
            raise self.refuse(name, "an integer tensor operand (int64 in torch: it raises or "
                                    "keeps int64); apply it to a float tensor, e.g. "
                                    "`mask.float() * 3`")

    # --- GLU, PReLU, RReLU ---------------------------------------------------------------
    def glu(self, a: Any, dim: Any, name: str) -> int:
        """F.glu: first half * sigmoid(second half)."""
        v, ax, w = self._sections(a, dim, name)
        if w % 2:
            raise self.err(f"{name}: halving an odd dimension of {w} features")
        first = self.b.slice(v, ax, 0, w // 2, name)
        second = self.b.slice(v, ax, w // 2, w // 2, name)
        return self.b.map("mul", first, self.b.map("sigmoid", second))

    def prelu(self, a: Any, w_src: Any, n: int, name: str) -> int:
        """PReLU with one slope or one per channel (dim 1)."""
        v = self.val(a, name)
        d = self.dims(v)
        if n != 1:
            self._channel_check(self.dims(v), n, name)
        shape = ((n,) + (1,) * (len(d) - 2)) if n != 1 else (1,)
        return self.b.map("prelu", v, self.b.param(w_src, shape))

    def rrelu(self, a: Any, lower: float, upper: float, training: bool, name: str) -> int:
        if training:
            raise self.refuse(name, "RReLU in training mode draws random slopes; call "
                              "model.eval() or use training=False")
        return self.b.map("leaky_relu", self.val(a, name),
                          attrs=((float(lower) + float(upper)) / 2,))
