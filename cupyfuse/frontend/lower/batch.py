"""Numbers over the whole batch (``_BatchStat``): a sum or mean over every row of a
value (``loss.mean()``, ``h.sum()``, ``loss.sum(0)`` of a (batch,) value, a loss's
default ``reduction="mean"``), and arithmetic of them with numbers and each other
(``ce + 0.01 * z.mean()``). The program keeps computing per-row values; the sums over
the rows run after the fused call, in float64 (:class:`cupyfuse.ir.program.BatchStats`).
Anything else that reads such a number -- a per-row op with it (``h - h.mean()``), a
reduction of it -- is refused: it mixes the batch's rows.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from cupyfuse.frontend.values import Val, _BatchStat, _Const
from cupyfuse.ir.program import BATCH, _fmt_dims

__all__ = ["batch_reduce", "stat_call", "mean_of", "sum_of"]

_WHY = ("it reads a number over the whole batch (a mean or sum with no dim, or a loss's "
        "mean): such numbers are fused only as results of the forward, or in arithmetic "
        "with numbers and other such numbers; for each row's mean or sum, give the dim "
        "(`h.mean(-1)`)")


def sum_of(ctx, v: int) -> tuple:
    """The expression of the sum over every row and feature of program value ``v``."""
    d = ctx.dims(v)
    feats = [x for x in d if x not in (BATCH, 1)]
    if len(feats) > 1:
        raise ctx.refuse("a sum over the batch", f"of a {_fmt_dims(d)} value: cupyfuse sums "
                                                  "(batch, N) values over every row")
    if feats:
        v = ctx.b.reduce("sum", v, d.index(feats[0]), True)
    return ("sum", v)


def mean_of(ctx, v: int) -> tuple:
    d = ctx.dims(v)
    n = 1
    for x in d:
        if x not in (BATCH, 1):
            n *= x
    count = ("count",) if n == 1 else ("mul", ("count",), ("const", float(n)))
    return ("div", sum_of(ctx, v), count)


def batch_reduce(ctx, node: torch.fx.Node) -> _BatchStat | None:
    """``v.sum()`` / ``v.mean()`` (and ``torch.sum``/``torch.mean``) over every dim of a
    value of the batch's rows, or over dim 0 of a (batch,) value; None where ``node`` is
    no such reduction (the plain translation takes it)."""
    op, t = node.op, node.target
    kinds = {"sum": "sum", "mean": "mean"}
    if op == "call_method" and t in kinds:
        kind = kinds[t]
    elif op == "call_function" and t in (torch.sum, torch.mean):
        kind = "sum" if t is torch.sum else "mean"
    else:
        return None
    if not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    e = ctx.env.get(node.args[0])
    if not isinstance(e, Val):
        return None
    v = int(e)
    d = ctx.dims(v)
    if BATCH not in d or ctx.lead:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if isinstance(dim, (tuple, list)) and len(dim) == len(d):
        dim = None if sorted(x % len(d) for x in dim) == list(range(len(d))) else dim
    if dim is not None and not (d == (BATCH,) and dim in (0, -1, (0,), [0])):
        return None
    if node.kwargs.get("keepdim") or len(node.args) > 2 and node.args[2] is True:
        raise ctx.refuse(f".{t}()" if op == "call_method" else t.__name__,
                         "keepdim=True over the batch: return the number (keepdim=False)")
    if node.kwargs.get("dtype") is not None:
        return None
    return _BatchStat(mean_of(ctx, v) if kind == "mean" else sum_of(ctx, v))


_BINARY = {operator.add: "add", operator.sub: "sub", operator.mul: "mul",
           operator.truediv: "div", torch.add: "add", torch.sub: "sub", torch.mul: "mul",
           torch.div: "div", "add": "add", "sub": "sub", "mul": "mul", "div": "div",
           "__add__": "add", "__sub__": "sub", "__mul__": "mul", "__truediv__": "div",
           "__radd__": "radd", "__rsub__": "rsub", "__rmul__": "rmul",
           "__rtruediv__": "rdiv"}


def _operand(ctx, a: Any, name: str) -> tuple:
    e = ctx.env.get(a) if isinstance(a, torch.fx.Node) else a
    if isinstance(e, _BatchStat):
        return e.expr
    if isinstance(e, _Const):
        e = e.v
    if type(e) in (int, float):   # (a Python number: a program value is a Val, an int too)
        return ("const", float(e))
    raise ctx.refuse(name, _WHY)


def stat_call(ctx, node: torch.fx.Node) -> Any:
    """An op reading a ``_BatchStat``: arithmetic with numbers and other statistics,
    ``neg``, and the no-op casts; anything else refused."""
    op, t = node.op, node.target
    name = f".{t}()" if op == "call_method" else getattr(t, "__name__", str(t))
    if op == "call_module":
        raise ctx.refuse(f"{t}", _WHY)
    if (op == "call_method" and t in ("float", "contiguous", "clone", "detach", "squeeze",
                                      "sum", "mean") or
            op == "call_function" and t in (torch.sum, torch.mean)) \
            and len(node.args) == 1 and not node.kwargs:
        return ctx.env[node.args[0]]   # (a 0-d tensor's own value)
    if t in (operator.neg, torch.neg, "neg", "__neg__") and len(node.args) == 1:
        return _BatchStat(("neg", _operand(ctx, node.args[0], name)))
    key = t
    if key in _BINARY and len(node.args) == 2 and not node.kwargs:
        o = _BINARY[key]
        a, b = (_operand(ctx, x, name) for x in node.args)
        if o.startswith("r"):
            o, a, b = o[1:], b, a
        return _BatchStat((o, a, b))
    raise ctx.refuse(name, _WHY)


def outputs(ctx, res: Any) -> int:
    """The forward's results where some are numbers over the batch: the program returns
    its plain results, then the values the statistics sum; its ``outs_type`` (a
    :class:`BatchStats`) does the rest. Returns the program's first result."""
    from cupyfuse.ir.program import BatchStats, DictResult, _stat_leaves, _stat_map

    if isinstance(res, dict):
        items, kind = list(res.values()), DictResult(list(res))
    elif isinstance(res, (tuple, list)):
        items, kind = list(res), (list if isinstance(res, list) else tuple)
    else:
        items, kind = [res], None
    plain: list[int] = []
    spec: list[tuple] = []
    for it in items:
        e = ctx.env.get(it) if isinstance(it, torch.fx.Node) else None
        if isinstance(e, _BatchStat):
            spec.append(("stat", e.expr))
        elif isinstance(e, Val) and BATCH in ctx.dims(int(e)) and not ctx.lead:
            spec.append(("out", len(plain)))
            plain.append(int(e))
        else:
            if isinstance(it, torch.fx.Node):
                ctx.cur = it
            raise ctx.err("the forward returns a number over the whole batch beside a "
                          "result that is not a float32 tensor of the batch rows (cupyfuse "
                          "returns such numbers beside plain (batch, ...) results only)")
    leaves: list[int] = []
    for s in spec:
        if s[0] == "stat":
            _stat_leaves(s[1], leaves)
    pos = {v: len(plain) + i for i, v in enumerate(leaves)}
    values = plain + leaves
    ctx.b.p.more_outs = tuple(values[1:])
    ctx.b.p.outs_type = BatchStats([s if s[0] == "out" else ("stat", _stat_map(s[1], pos))
                                    for s in spec], kind)
    return values[0]


def has_stats(ctx, res: Any) -> bool:
    items = list(res.values()) if isinstance(res, dict) else \
        list(res) if isinstance(res, (tuple, list)) else [res]
    return any(isinstance(ctx.env.get(it), _BatchStat) for it in items
               if isinstance(it, torch.fx.Node))
