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
from cupyfuse.frontend.lower import indexing, losses
from cupyfuse.frontend import lower as lowering
from cupyfuse.frontend.tables import _IDENTITY_METHODS, _REFUSED_BINARY, _SHRINK_FUNCS


# --- integer inputs ------------------------------------------------------------------
def _raw_int_call(ctx, node: torch.fx.Node) -> Any:
    """An op reading an integer input (``_RawInt``, float32 in the program): views of it
    (an integer input still), casts to float32, elementwise ops whose result torch
    computes in float32 (with a float tensor or number: torch converts the integers to
    float32 first, as the caller did), float-valued functions of it, comparisons with
    a float tensor, a float number or an integer of at most 2**24 - 1 (exact in
    float32), ``.bool()``. Integer results (``mask * 2``, ``mask.sum(1)``), lookups
    (an nn.Embedding) and other ops are refused."""
    raws = [a for a in node.all_input_nodes if isinstance(ctx.env.get(a), _RawInt)]
    raw = ctx.env[raws[0]]
    op, t = node.op, node.target
    args = tuple(ctx._plain(a) for a in node.args)
    kw = {k: ctx._plain(v) for k, v in node.kwargs.items()}
    if op == "call_module":
        mod = ctx._get_attr(t)
        name = f"{t} ({type(mod).__name__})"
    else:
        mod, name = None, f".{t}()" if op == "call_method" else getattr(t, "__name__", str(t))

    def refuse(why: str) -> TailError:
        return ctx.refuse(name, f"{why} of the integer input {raw.label} (cupyfuse reads "
                           "an integer input as float32 where each use is exact whatever "
                           "its values: views, `.float()` / `.to(h.dtype)` / `type_as` "
                           "casts, arithmetic with float tensors or numbers, comparisons "
                           f"with numbers); pass `{raw.label.strip('`')}.float()` or cast "
                           "it first")

    for x in node.all_input_nodes:
        # an integer buffer or parameter beside it: torch computes in int64 (exact),
        # the program would in float32
        if x.op == "get_attr" and isinstance(ctx.env.get(x), _Weight):
            obj = ctx._get_attr(x.target)
            if isinstance(obj, torch.Tensor) and not obj.is_floating_point():
                raise refuse(f"an op with the {obj.dtype} tensor `{x.target}` (torch "
                             "computes it in integers)")
    if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) or t in (F.embedding,
                                                                  F.embedding_bag):
        raise ctx.refuse(name, f"token ids (the integer input {raw.label}) looked up in "
                                "an embedding: not fused (cupyfuse fuses Linear + tail "
                                "models); run the embedding outside and pass its output")
    r = losses.dispatch(ctx, node, raws[0], raw, mod, args, kw, name)
    if r is not None:   # gather, cross entropy / NLL, one_hot of integer targets
        return r
    if op == "call_function" and t is getattr:
        if args[1] == "dtype":   # (int32 too: a cast to it is refused either way)
            return torch.int64
        if args[1] == "shape":
            return _sizes(ctx.dims(raw.v), raw.v)
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
            ctx._check_inplace(node, True, name)
        return indexing.scatter(ctx, args[0], _arg(args, kw, 1, "dim"), raw,
                            _arg(args, kw, 3, "value" if "value" in kw else "src"), kw,
                            name)
    elif (op == "call_function" and getattr(op_of_function(t), "kind", None) == "compare"
          or op == "call_method" and getattr(op_of_method(t), "kind", None) == "compare"):
        for x in list(args) + list(kw.values()):
            e = ctx.env.get(x) if isinstance(x, torch.fx.Node) else x
            if isinstance(e, (_RawInt, _Int, _Bool)) and x is not raws[0] or \
                    isinstance(e, _Split) and e.kind != "f":
                raise refuse("a comparison with another integer or boolean tensor")
            n = e.v if isinstance(e, _Const) else e
            if type(n) is int and abs(n) >= 2 ** 24:
                raise refuse(f"a comparison with the integer {n} (float32 holds integers "
                             "exactly up to 2**24 only)")
    elif not (_is_view_node(node) or _is_expand(node) or ctx._elementwise(node, args, kw)
              or op == "call_method" and t == "type_as"):
        raise refuse("a reduction, lookup or other op that torch computes in integers"
                     if op != "call_module" else "an op")
    saved = {a: ctx.env[a] for a in raws}
    try:
        for a in raws:
            ctx.env[a] = _Int(ctx.env[a].v)
        r = ctx.split_call(node) if ctx._touches_split(node) and \
            not _is_expand(node) else getattr(ctx, op)(node)
    finally:
        ctx.env.update(saved)
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
def binary(ctx, op: str, a: Any, b: Any, alpha: Any, name: str, rounding: Any) -> int:
    def is_bool(x: Any) -> bool:
        return isinstance(x, bool) or (isinstance(x, torch.fx.Node)
                                       and isinstance(ctx.env.get(x), _Bool))
    if is_bool(a) and is_bool(b):
        raise ctx.refuse(name, "arithmetic between two boolean tensors (bool in torch); "
                          "use .float() on one of them")
    if rounding is not None:
        raise ctx.refuse(name, f"division with rounding_mode={rounding!r}")
    if op == "sub" and (is_bool(a) or is_bool(b)):
        raise ctx.refuse(name, "subtraction with a boolean tensor (torch raises; use ~mask "
                                "or mask.float())")
    ints = _int_operands(ctx, a, b)
    if ints and op == "pow" and isinstance(ints[1], int) and ints[1] < 0:
        raise ctx.refuse(name, "an integer tensor to a negative integer power (torch "
                                "raises: Integers to negative integer powers are not "
                                "allowed)")
    if ints and op in ("add", "sub", "mul", "maximum", "minimum", "fmod", "pow") and \
            (alpha is None or isinstance(alpha, int) and not isinstance(alpha, bool)):
        # booleans / integer tensors with integer numbers: int64 in torch
        va, vb = ctx.val(a, name), ctx.val(b, name)
        if alpha is not None and alpha != 1:
            vb = ctx.b.map("mul", vb, ctx.b.const(float(alpha)))
        return _Int(ctx.b.map(op, va, vb))
    if op == "pow" and not ctx.is_tensor_like(a) and not (ctx._is_bool(a) or
                                                         ctx._is_int(a)):
        raise ctx.refuse(name, "a number raised to a tensor power")
    if op == "pow" and not ctx.is_value(b) and not ctx.is_tensor_like(b) and \
            alpha is None:
        # (a parameter or buffer exponent, GeM's x.pow(ctx.p): torch's pow of two
        # tensors, powf elementwise, below)
        e = ctx.number(b, name)
        if e in (0.5, -0.5):
            # torch computes these exponents as sqrt / rsqrt (-inf ** 0.5 is NaN there)
            return ctx.b.map("sqrt" if e == 0.5 else "rsqrt", ctx.val(a, name))
    va = ctx.val(a, name)
    vb = ctx.val(b, name)
    if alpha is not None and alpha != 1:
        vb = ctx.b.map("mul", vb, ctx.b.const(float(alpha)))
    return ctx.b.map(op, va, vb)


def _intlike(ctx, x: Any) -> Any:
    """An integer tensor (``_Int`` or ``_Bool``: True) or an int number (its value) of
    an operand; None for anything float."""
    v = ctx.env.get(x) if isinstance(x, torch.fx.Node) else x
    if isinstance(v, (_Int, _Bool)):
        return True
    if isinstance(v, _Const):
        v = v.v
    if isinstance(v, _Size) and v.v >= 0:
        v = v.v
    if isinstance(v, int) and not isinstance(v, (bool, Val)):
        return v
    return None


def _int_operands(ctx, a: Any, b: Any) -> tuple | None:
    """(a, b) as ``_intlike`` where both are integer and one is a tensor (torch's
    result is then int64), else None."""
    ia, ib = _intlike(ctx, a), _intlike(ctx, b)
    if ia is None or ib is None or not (ia is True or ib is True):
        return None
    return ia, ib


def clamp(ctx, a: Any, lo: Any, hi: Any, name: str) -> int:
    if lo is not None and hi is not None and \
            ctx.is_tensor_like(lo) != ctx.is_tensor_like(hi):
        raise ctx.refuse(name, "one bound a tensor and the other a number (torch raises "
                                "TypeError: no overload mixes them)")
    if (lo is not None and ctx.is_tensor_like(lo)) or (hi is not None and ctx.is_tensor_like(hi)):
        v = ctx.val(a, name)
        if lo is not None:
            v = ctx.b.map("maximum", v, ctx.val(lo, name))
        if hi is not None:
            v = ctx.b.map("minimum", v, ctx.val(hi, name))
        return v
    lo_f = -math.inf if lo is None else ctx.number(lo, name)
    hi_f = math.inf if hi is None else ctx.number(hi, name)
    r = ctx.b.map("clamp", ctx.val(a, name), attrs=(lo_f, hi_f))
    if _intlike(ctx, a) is True and all(_intlike(ctx, x) is not None
                                        for x in (lo, hi) if x is not None):
        return _Int(r)   # an integer tensor clamped by integers: int64 in torch
    return r


def dropout(ctx, a: Any, p: float, training: bool, name: str) -> Any:
    if training and p > 0:
        raise ctx.refuse(name, f"active dropout (p={p} in training mode) is random; call "
                          "model.eval() or use p=0")
    return ctx.env[a]


def table_op(ctx, op: Any, a: Any, attrs: tuple, name: str) -> int:
    """An op of the table with no tensor operand but ``a`` (``kind`` "unary", or "attr"
    with its float attributes: a map node) or a composite (``compose``: torch's formula in the table's other ops; within an ulp
    or two of torch's own kernels) of operand ``a``."""
    v = ctx.val(a, name)
    if op.kind != "composite":
        return ctx.b.map(op.name, v, attrs=attrs)
    try:
        return op.compose(ctx.b, v, *attrs)
    except ValueError as e:
        raise ctx.err(str(e)) from None


def shrink(ctx, kind: str, a: Any, t: Any, value: Any, name: str) -> int:
    """threshold / hardshrink / softshrink with torch's NaN behaviour (NaN passes)."""
    b = ctx.b
    v = ctx.val(a, name)
    t = ctx.number(t, name)
    if kind == "threshold":   # v <= t ? value : v
        return b.map("where", b.map("le", v, b.const(t)), b.const(ctx.number(value, name)), v)
    if kind == "softshrink" and t < 0:
        raise ctx.refuse(name, f"lambda {t!r} is negative (torch raises)")
    inside = b.map("le", b.map("abs", v), b.const(t))
    if kind == "hardshrink":   # -t <= v <= t ? 0 : v
        return b.map("where", inside, b.const(0.0), v)
    step = b.map("where", b.map("gt", v, b.const(0.0)), b.const(t), b.const(-t))
    # (+0.0 inside the band, as torch's CUDA kernel and its vectorised CPU loop give;
    # only its scalar CPU loop, a tensor's last few elements, gives v * 0 = -0.0)
    return b.map("where", inside, b.const(0.0), b.map("sub", v, step))

# --- comparisons, where, logical ops (boolean tensors) -------------------------------
def compare(ctx, op: str, a: Any, b: Any, name: str) -> _Bool:
    if isinstance(a, torch.fx.Node) and isinstance(ctx.env.get(a), _Bool) or \
            isinstance(b, torch.fx.Node) and isinstance(ctx.env.get(b), _Bool):
        raise ctx.refuse(name, "a comparison of boolean tensors")
    return _Bool(ctx.b.map(op, ctx.val(a, name), ctx.val(b, name)))


def where_(ctx, cond: Any, a: Any, b: Any, name: str, keep: Any = None) -> Any:
    """``keep``: masked_fill's tensor, whose dtype the result has."""
    c = ctx.env.get(cond) if isinstance(cond, torch.fx.Node) else cond
    if not isinstance(c, _Bool):
        raise ctx.refuse(name, "a condition that is not a comparison of tensors")
    r = ctx.b.map("where", c.v, ctx.val(a, name), ctx.val(b, name))
    if keep is not None:
        return _Int(r) if ctx._is_int(keep) else r
    ia, ib = _intlike(ctx, a), _intlike(ctx, b)
    if ia is not None and ib is not None:   # integer branches: int64 in torch
        return _Int(r)
    return r


def logical(ctx, f: Any, args: tuple, name: str) -> _Bool:
    ops = [ctx.env.get(x) if isinstance(x, torch.fx.Node) else x for x in args]
    if not all(isinstance(o, _Bool) for o in ops):
        raise ctx.refuse(name, "a logical op of a non-boolean operand")
    b = ctx.b
    if f in (operator.invert, torch.logical_not):
        return _Bool(b.map("sub", b.const(1.0), ops[0].v))
    x, y = ops[0].v, ops[1].v
    if f in (operator.and_, torch.logical_and):
        return _Bool(b.map("mul", x, y))
    if f in (operator.or_, torch.logical_or):
        return _Bool(b.map("maximum", x, y))
    return _Bool(b.map("ne", x, y))   # xor

# --- booleans and integers: torch's dtype rules --------------------------------------



def _int_unary(ctx, op: str, a: Any, r: int) -> Any:
    """A unary op's result ``r``: integer where torch keeps an integer tensor's dtype."""
    return _Int(r) if MAPS[op].keeps_int and ctx._is_int(a) else r


def _no_bool_unary(ctx, op: str, a: Any, name: str) -> None:
    """Refuse a unary op of a boolean tensor where torch does not compute it as float."""
    rec = MAPS[op]
    if ctx._is_int(a) and rec.on_bool != "float" and not rec.keeps_int:
        raise ctx.refuse(name, f"{op} of an integer tensor (int64 in torch: it raises "
                                "or keeps int64); apply it to a float tensor")
    if rec.on_bool == "float" or not ctx._is_bool(a):
        return
    if op == "neg":
        raise ctx.refuse(name, "negation of a boolean tensor (torch raises; use ~mask)")
    if op == "square":
        raise ctx.refuse(name, "square of a boolean tensor (torch gives int64 there); "
                                "square `mask.float()` instead")
    raise ctx.refuse(name, f"{op} of a boolean tensor (torch raises); apply it to "
                            "`mask.float()`")


# --- GLU, PReLU, RReLU ---------------------------------------------------------------
def glu(ctx, a: Any, dim: Any, name: str) -> int:
    """F.glu: first half * sigmoid(second half)."""
    v, ax, w = ctx._sections(a, dim, name)
    if w % 2:
        raise ctx.err(f"{name}: halving an odd dimension of {w} features")
    first = ctx.b.slice(v, ax, 0, w // 2, name)
    second = ctx.b.slice(v, ax, w // 2, w // 2, name)
    return ctx.b.map("mul", first, ctx.b.map("sigmoid", second))


def prelu(ctx, a: Any, w_src: Any, n: int, name: str) -> int:
    """PReLU with one slope or one per channel (dim 1)."""
    v = ctx.val(a, name)
    d = ctx.dims(v)
    if n != 1:
        ctx._channel_check(ctx.dims(v), n, name)
    shape = ((n,) + (1,) * (len(d) - 2)) if n != 1 else (1,)
    return ctx.b.map("prelu", v, ctx.b.param(w_src, shape))


def rrelu(ctx, a: Any, lower: float, upper: float, training: bool, name: str) -> int:
    if training:
        raise ctx.refuse(name, "RReLU in training mode draws random slopes; call "
                          "model.eval() or use training=False")
    return ctx.b.map("leaky_relu", ctx.val(a, name),
                      attrs=((float(lower) + float(upper)) / 2,))


# --- spellings ---------------------------------------------------------------------------
def table_call(ctx, node: torch.fx.Node, rec: Any, args: tuple, kw: dict, name: str) -> Any:
    """A function spelling of an op-table record (``torch.sinh(h)``, ``F.elu(h, 0.5)``,
    ``h > 0``, ``torch.add(h, 1, alpha=2)``)."""
    f = node.target
    if rec.kind == "compare":
        return compare(ctx, rec.name, args[0], _arg(args, kw, 1, "other"), name)
    if rec.kind == "unary":
        if type(args[0]) in (int, float) and f not in (operator.neg, operator.abs):
            raise ctx.refuse(name, "a Python number where torch takes a tensor "
                                   "(torch raises)")
        _no_bool_unary(ctx, rec.name, args[0], name)
        return _int_unary(ctx, rec.name, args[0], ctx.b.map(rec.name, ctx.val(args[0], name)))
    if rec.kind in ("attr", "composite"):
        return table_op(ctx, rec, args[0], tuple(
            _arg(args, kw, i + 1, at, d) for i, (at, d) in enumerate(zip(rec.attrs, rec.defaults))),
            name)
    return binary(ctx, rec.name, args[0], _arg(args, kw, 1, "other"), kw.get("alpha"), name,
                  kw.get("rounding_mode"))


def table_method(ctx, node: torch.fx.Node, rec: Any, self_: Any, args: tuple, kw: dict,
                 name: str) -> Any:
    """A method spelling of an op-table record (``h.sinh()``, ``h.sinh_()``, ``h.gt(0)``,
    ``h.add_(x)``)."""
    if rec.kind == "compare":
        return compare(ctx, rec.name, self_, _arg(args, kw, 1, "other"), name)
    if rec.kind == "unary":
        _no_bool_unary(ctx, rec.name, self_, name)
        return _int_unary(ctx, rec.name, self_, ctx.b.map(rec.name, ctx.val(self_, name)))
    return binary(ctx, rec.name, self_, _arg(args, kw, 1, "other"), kw.get("alpha"), name,
                  kw.get("rounding_mode"))


@lowering.function(torch.where)
def _where_fn(ctx, node, args, kw, name):
    if len(args) + len(kw) < 3:
        raise ctx.refuse(name, "torch.where(condition) (indices) is not fused")
    return where_(ctx, args[0], _arg(args, kw, 1, "input"), _arg(args, kw, 2, "other"), name)


@lowering.function(operator.invert, torch.logical_not, operator.and_, torch.logical_and,
                   operator.or_, torch.logical_or, operator.xor, torch.logical_xor)
def _logical_fn(ctx, node, args, kw, name):
    return logical(ctx, node.target, args, name)


@lowering.function(*_SHRINK_FUNCS)
def _shrink_fn(ctx, node, args, kw, name):
    kind = _SHRINK_FUNCS[node.target]
    if kind == "threshold":
        return shrink(ctx, kind, args[0], _arg(args, kw, 1, "threshold"),
                      _arg(args, kw, 2, "value"), name)
    return shrink(ctx, kind, args[0], _arg(args, kw, 1, "lambd", 0.5), 0.0, name)


@lowering.function(F.prelu, torch.prelu)
def _prelu_fn(ctx, node, args, kw, name):
    w = ctx.env.get(args[1]) if isinstance(args[1], torch.fx.Node) else None
    if not isinstance(w, _Weight) or len(w.shape) != 1:
        raise ctx.refuse(name, "its weight is not a 1-D parameter")
    return prelu(ctx, args[0], w.source, w.shape[0], name)


@lowering.function(F.rrelu)
def _rrelu_fn(ctx, node, args, kw, name):
    return rrelu(ctx, args[0], _arg(args, kw, 1, "lower", 1.0 / 8),
                 _arg(args, kw, 2, "upper", 1.0 / 3), _arg(args, kw, 3, "training", False), name)


@lowering.function(*_REFUSED_BINARY)
def _refused_fn(ctx, node, args, kw, name):
    raise ctx.refuse(name)


@lowering.function(F.gelu)
def _gelu_fn(ctx, node, args, kw, name):
    ap = _arg(args, kw, 1, "approximate", "none")
    return ctx.b.map("gelu_tanh" if ap == "tanh" else "gelu", ctx.val(args[0], name))


@lowering.function(F.hardtanh)
def _hardtanh_fn(ctx, node, args, kw, name):
    lo, hi = _arg(args, kw, 1, "min_val", -1.0), _arg(args, kw, 2, "max_val", 1.0)
    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo > hi:
        raise ctx.refuse(name, f"min_val {lo!r} is greater than max_val {hi!r} (torch raises)")
    return ctx.b.map("hardtanh", ctx.val(args[0], name), attrs=(lo, hi))


@lowering.function(torch.clamp, torch.clip)
def _clamp_fn(ctx, node, args, kw, name):
    return clamp(ctx, args[0], _arg(args, kw, 1, "min"), _arg(args, kw, 2, "max"), name)


@lowering.function(torch.clamp_min)
def _clamp_min_fn(ctx, node, args, kw, name):
    return clamp(ctx, args[0], _arg(args, kw, 1, "min"), None, name)


@lowering.function(torch.clamp_max)
def _clamp_max_fn(ctx, node, args, kw, name):
    return clamp(ctx, args[0], None, _arg(args, kw, 1, "max"), name)


@lowering.function(F.dropout, F.dropout1d, F.alpha_dropout, F.feature_alpha_dropout)
def _dropout_fn(ctx, node, args, kw, name):
    # (F.alpha_dropout's and F.feature_alpha_dropout's training default False)
    f = node.target
    if f is F.dropout1d and len(ctx.dims(ctx.val(args[0], name))) not in (2, 3):
        raise ctx.refuse(name, "dropout1d of a value that is not 2-D or 3-D (torch raises)")
    return dropout(ctx, args[0], _arg(args, kw, 1, "p", 0.5),
                   _arg(args, kw, 2, "training", f in (F.dropout, F.dropout1d)), name)


@lowering.function(F.glu)
def _glu_fn(ctx, node, args, kw, name):
    return glu(ctx, args[0], _arg(args, kw, 1, "dim", -1), name)


@lowering.method("type_as")
def _type_as(ctx, node, self_, args, kw, name):
    base = ctx.env.get(self_)
    other = ctx.env.get(args[1]) if isinstance(args[1], torch.fx.Node) else args[1]
    if isinstance(other, _Bool) or not (isinstance(other, (_Weight, Val))):
        raise ctx.refuse(name, "converts to the dtype of something other than a float32 tensor")
    return Val(base.v) if isinstance(base, (_Bool, _Int)) else ctx.env[self_]


@lowering.method("to", "type")
def _to(ctx, node, self_, args, kw, name):
    base = ctx.env.get(self_)
    rest = list(args[1:]) + list(kw.values())
    if any(isinstance(r, torch.dtype) and r != torch.float32 for r in rest):
        raise ctx.refuse(name, "converts to another dtype")
    if isinstance(base, _Bool) and not any(r == torch.float32 for r in rest):
        raise ctx.refuse(name, "a boolean tensor moved without a float32 cast")
    if isinstance(base, _Int):
        return Val(base.v) if any(r == torch.float32 for r in rest) else base
    return Val(base.v) if isinstance(base, _Bool) else ctx.env[self_]


@lowering.method("bool")
def _bool(ctx, node, self_, args, kw, name):
    if len(args) != 1 or kw:
        raise ctx.refuse(name)
    # nonzero -> True (NaN too, as torch's cast: NaN != 0)
    base = ctx.env.get(self_)
    if isinstance(base, _Bool):
        return base
    return _Bool(ctx.b.map("ne", ctx.val(self_, name), ctx.b.const(0.0)))


@lowering.method(*_IDENTITY_METHODS)
def _identity(ctx, node, self_, args, kw, name):
    base = ctx.env.get(self_)
    m = node.target
    if isinstance(base, _Int):
        return Val(base.v) if m == "float" else base
    if isinstance(base, _Bool):
        if m != "float":
            return base
        return Val(base.v)   # .float(): 0.0 / 1.0
    if m == "detach" and isinstance(base, Val):
        # the same value; the gradient stops here (cupyfuse.autograd's recompute)
        return Val(ctx.b.map("detach", ctx.val(self_, name)))
    return ctx.env[self_]


@lowering.method("masked_fill")
def _masked_fill(ctx, node, self_, args, kw, name):
    value = _arg(args, kw, 2, "value")
    vv = ctx.env.get(value) if isinstance(value, torch.fx.Node) else value
    nd = (len(ctx.dims(int(vv))) if isinstance(vv, Val) else
          len(vv.shape) if isinstance(vv, _Weight) else
          vv.dim() if isinstance(vv, torch.Tensor) else 0)
    if nd:
        raise ctx.refuse(name, f"a value tensor of {nd} dimension(s) (torch raises: "
                               "masked_fill_ only supports a 0-dimensional value tensor)")
    return where_(ctx, _arg(args, kw, 1, "mask"), _arg(args, kw, 2, "value"), self_, name,
                  keep=self_)


@lowering.method("where")
def _where_method(ctx, node, self_, args, kw, name):
    return where_(ctx, _arg(args, kw, 1, "condition"), self_, _arg(args, kw, 2, "other"), name)


@lowering.method("logical_not", "logical_and", "logical_or", "logical_xor")
def _logical_method(ctx, node, self_, args, kw, name):
    return logical(ctx, getattr(torch, node.target), args, name)


@lowering.method("clamp", "clip", "clamp_", "clip_")
def _clamp_method(ctx, node, self_, args, kw, name):
    return clamp(ctx, self_, _arg(args, kw, 1, "min"), _arg(args, kw, 2, "max"), name)


@lowering.method("clamp_min", "clamp_min_")
def _clamp_min_method(ctx, node, self_, args, kw, name):
    return clamp(ctx, self_, _arg(args, kw, 1, "min"), None, name)


@lowering.method("clamp_max", "clamp_max_")
def _clamp_max_method(ctx, node, self_, args, kw, name):
    return clamp(ctx, self_, None, _arg(args, kw, 1, "max"), name)


@lowering.module(nn.Hardshrink, nn.Softshrink)
def _shrink_module(ctx, node, mod, a, name):
    return shrink(ctx, "hardshrink" if isinstance(mod, nn.Hardshrink) else "softshrink", a,
                  mod.lambd, 0.0, name)


@lowering.module(nn.Threshold)
def _threshold_module(ctx, node, mod, a, name):
    return shrink(ctx, "threshold", a, mod.threshold, mod.value, name)


@lowering.module(nn.GLU)
def _glu_module(ctx, node, mod, a, name):
    return glu(ctx, a, mod.dim, name)


@lowering.module(nn.PReLU)
def _prelu_module(ctx, node, mod, a, name):
    return prelu(ctx, a, f"{node.target}.weight", mod.num_parameters, name)


@lowering.module(nn.RReLU)
def _rrelu_module(ctx, node, mod, a, name):
    return rrelu(ctx, a, mod.lower, mod.upper, mod.training, name)


@lowering.module(nn.GELU)
def _gelu_module(ctx, node, mod, a, name):
    return ctx.b.map("gelu_tanh" if mod.approximate == "tanh" else "gelu", ctx.val(a, name))


@lowering.module(nn.Hardtanh)
def _hardtanh_module(ctx, node, mod, a, name):
    return ctx.b.map("hardtanh", ctx.val(a, name), attrs=(mod.min_val, mod.max_val))


@lowering.module(nn.Dropout, nn.AlphaDropout, nn.FeatureAlphaDropout, nn.Dropout1d)
def _dropout_module(ctx, node, mod, a, name):
    # (identities in eval mode or with p = 0; Dropout1d takes 2-D or 3-D input)
    if isinstance(mod, nn.Dropout1d) and len(ctx.dims(ctx.val(a, name))) not in (2, 3):
        raise ctx.refuse(name, "Dropout1d of a value that is not 2-D or 3-D (torch raises)")
    return dropout(ctx, a, mod.p, mod.training, name)
