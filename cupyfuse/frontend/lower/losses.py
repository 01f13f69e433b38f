"""Ops that read integer targets (an integer input of the forward, ``_RawInt``: float32
in the program, exact for every class position below 2**24): ``gather`` /
``take_along_dim`` along the features, ``F.cross_entropy`` / ``nn.CrossEntropyLoss``
and ``F.nll_loss`` / ``nn.NLLLoss`` with class indices (``ignore_index``, class
``weight``, ``label_smoothing``; reductions none, mean and sum: a mean or sum over the
batch is a ``_BatchStat``, summed after the fused call), and ``F.one_hot``.

All of them are built from vocabulary primitives: a feature's position (an ``iota``)
compared with the row's target picks the target's value out of a row sum
(``where(pos == t, v, 0)``: exact, and the other features' NaN/inf do not leak in, as in
torch). Where torch raises for a target outside [0, N) (a host sync cupyfuse does not
make on the GPU), that row's result is NaN instead.
"""
from __future__ import annotations

import math
from typing import Any

import torch.fx

from cupyfuse.frontend.values import Val, _BatchStat, _Int, _RawInt
from cupyfuse.ir.program import BATCH, _fmt_dims

__all__ = ["gather", "cross_entropy", "one_hot"]


def _target_row(ctx, t: _RawInt, name: str) -> int:
    """The (batch, 1) program value of a (batch,) target."""
    d = ctx.dims(t.v)
    if d == (BATCH,):
        return ctx.b.view(t.v, (BATCH, 1))
    raise ctx.refuse(name, f"targets {t.label} of shape {_fmt_dims(d)}: cupyfuse takes one "
                           "class index per row, (batch,)")


def _logits(ctx, h: Any, name: str) -> tuple[int, int]:
    v = ctx.val(h, name)
    d = ctx.dims(v)
    if len(d) != 2 or d[0] != BATCH or d[1] < 1:
        raise ctx.refuse(name, f"an input of shape {_fmt_dims(d)}: cupyfuse takes "
                               "(batch, classes) scores, the classes along the features")
    return v, d[1]


def _inside(ctx, t: int, n: int) -> int:
    """1 where the (batch, 1) target ``t`` is a position of n features, else 0."""
    b = ctx.b
    return b.map("mul", b.map("ge", t, b.const(0.0)), b.map("lt", t, b.const(float(n))))


def _pick(ctx, v: int, t: int, n: int) -> int:
    """``v[row, t[row]]`` as a (batch, 1) value (0 where t is no position)."""
    b = ctx.b
    hit = b.map("eq", t, b.iota(n, 0.0, 1.0))
    return b.reduce("sum", b.map("where", hit, v, b.const(0.0)), 1, True)


def gather(ctx, base: Any, dim: Any, idx: _RawInt, name: str) -> Val:
    """``h.gather(1, t)`` / ``torch.take_along_dim(h, t, 1)`` of a (batch, N) value with
    (batch, k) integer indices (``t.unsqueeze(1)``, ``t.view(-1, 1)``): (batch, k)."""
    b = ctx.b
    v, n = _logits(ctx, base, name)
    if dim not in (1, -1):
        raise ctx.refuse(name, f"a gather along dim {dim}: cupyfuse gathers along the "
                               "features of a (batch, N) value (dim=1)")
    d = ctx.dims(idx.v)
    if len(d) != 2 or d[0] != BATCH:
        raise ctx.refuse(name, f"indices {idx.label} of shape {_fmt_dims(d)}: (batch, k) "
                               "indices go with a (batch, N) value (`t.unsqueeze(1)`)")
    cols = []
    for j in range(max(d[1], 1)):
        ij = b.slice(idx.v, 1, j, 1, name) if d[1] > 1 else idx.v
        cols.append(b.map("where", _inside(ctx, ij, n), _pick(ctx, v, ij, n),
                          b.const(math.nan)))
    return Val(cols[0] if len(cols) == 1 else b.cat(cols, 1, name))


def cross_entropy(ctx, h: Any, t: _RawInt, weight: Any, ignore_index: Any, reduction: Any,
                  label_smoothing: Any, name: str, log_input: bool = False) -> Val:
    """torch's cross entropy with class-index targets, per row (``reduction="none"``):
    ``-w[t] * log_softmax(h)[t]``, with label smoothing ``(1 - e) * that + e / N *
    -(w * log_softmax(h)).sum(1)``; 0 on rows whose target is ``ignore_index``.
    ``log_input``: ``h`` is already log-probabilities (``F.nll_loss``)."""
    b = ctx.b
    _check_reduction(ctx, reduction, name)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int) or \
            abs(ignore_index) >= 2 ** 24:
        raise ctx.refuse(name, f"ignore_index={ignore_index!r}: cupyfuse takes an integer "
                               "of magnitude below 2**24 (exact in float32)")
    eps = float(label_smoothing or 0.0)
    if not 0.0 <= eps <= 1.0:
        raise ctx.refuse(name, f"label_smoothing={label_smoothing!r}: torch takes 0..1")
    v, n = _logits(ctx, h, name)
    tt = _target_row(ctx, t, name)
    logp = v if log_input else b.softmax(v, 1, log=True)
    w = None
    if weight is not None:
        w = ctx.val(weight, name)
        if ctx.dims(w) not in ((n,), (1, n)):
            raise ctx.refuse(name, f"a class weight of shape {_fmt_dims(ctx.dims(w))}: "
                                   f"torch takes one per class, ({n},)")
    wl = logp if w is None else b.map("mul", logp, w)
    loss = b.map("neg", _pick(ctx, wl, tt, n))
    if eps > 0.0:
        smooth = b.map("neg", b.reduce("sum", wl, 1, True))
        loss = b.map("add", b.map("mul", loss, b.const(1.0 - eps)),
                     b.map("mul", smooth, b.const(eps / n)))
    ign = b.map("eq", tt, b.const(float(ignore_index)))
    loss = b.map("where", ign, b.const(0.0), loss)
    ok = b.map("maximum", _inside(ctx, tt, n), ign)
    loss = b.map("where", ok, loss, b.const(math.nan))
    if reduction == "sum":
        return _BatchStat(("sum", loss))
    if reduction == "mean":
        # torch's weighted mean: over the rows not ignored, each weighing its class's weight
        den = b.map("where", ign, b.const(0.0),
                    _pick(ctx, w, tt, n) if w is not None else b.const(1.0))
        return _BatchStat(("div", ("sum", loss), ("sum", den)))
    return Val(b.view(loss, (BATCH,)))


def _check_reduction(ctx, reduction: Any, name: str) -> None:
    if reduction not in ("none", "mean", "sum"):
        raise ctx.refuse(name, f"reduction={reduction!r}: torch takes 'none', 'mean' or "
                               "'sum'")


def one_hot(ctx, t: _RawInt, num_classes: Any, name: str) -> _Int:
    """``F.one_hot(t, N)`` of (batch,) targets: (batch, N) integers (NaN rows where a
    target is outside [0, N), where torch raises)."""
    b = ctx.b
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ctx.refuse(name, f"num_classes={num_classes!r}: pass the number of classes "
                               "(`F.one_hot(t, num_classes=N)`; without it the width depends "
                               "on the targets' values)")
    if num_classes >= 2 ** 24:
        raise ctx.refuse(name, f"num_classes={num_classes}: at most 2**24 - 1 positions are "
                               "exact in float32")
    tt = _target_row(ctx, t, name)
    hit = b.map("eq", tt, b.iota(num_classes, 0.0, 1.0))
    return _Int(b.map("where", _inside(ctx, tt, num_classes), hit, b.const(math.nan)))


def dispatch(ctx, node: torch.fx.Node, raw_node: torch.fx.Node, raw: _RawInt,
             mod: Any, args: tuple, kw: dict, name: str) -> Any:
    """The loss/gather/one-hot reading integer input ``raw`` at ``node``, or None where
    ``node`` is none of them."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from cupyfuse.frontend.tables import _arg

    op, t = node.op, node.target

    def tensor_arg(i: int, key: str) -> Any:
        a = node.args[i] if len(node.args) > i else node.kwargs.get(key)
        return a

    if op == "call_function" and t is torch.gather or op == "call_method" and t == "gather":
        if tensor_arg(2, "index") is not raw_node or node.args[0] is raw_node:
            return None
        return gather(ctx, node.args[0], _arg(args, kw, 1, "dim"), raw, name)
    if op == "call_function" and t is torch.take_along_dim or \
            op == "call_method" and t == "take_along_dim":
        if tensor_arg(1, "indices") is not raw_node or node.args[0] is raw_node:
            return None
        return gather(ctx, node.args[0], _arg(args, kw, 2, "dim", None), raw, name)
    if op == "call_function" and t is F.one_hot:
        if node.args[0] is not raw_node:
            return None
        return one_hot(ctx, raw, _arg(args, kw, 1, "num_classes", -1), name)
    if op == "call_function" and t in (F.cross_entropy, F.nll_loss):
        if tensor_arg(1, "target") is not raw_node or node.args[0] is raw_node:
            return None
        for legacy in ("size_average", "reduce"):
            if _arg(args, kw, 3 if legacy == "size_average" else 5, legacy, None) is not None:
                raise ctx.refuse(name, f"the deprecated `{legacy}` argument: pass reduction=")
        return cross_entropy(
            ctx, node.args[0], raw, tensor_arg(2, "weight"),
            _arg(args, kw, 4, "ignore_index", -100), _arg(args, kw, 6, "reduction", "mean"),
            _arg(args, kw, 7, "label_smoothing", 0.0) if t is F.cross_entropy else 0.0,
            name, log_input=t is F.nll_loss)
    if op == "call_module" and isinstance(mod, (nn.CrossEntropyLoss, nn.NLLLoss)):
        if len(node.args) < 2 or node.args[1] is not raw_node or node.args[0] is raw_node:
            return None
        w = None
        if mod.weight is not None:
            from cupyfuse.frontend.values import _Weight

            w = _Weight(f"{t}.weight", tuple(mod.weight.shape))
        return cross_entropy(ctx, node.args[0], raw, w, mod.ignore_index, mod.reduction,
                             getattr(mod, "label_smoothing", 0.0), name,
                             log_input=isinstance(mod, nn.NLLLoss))
    return None


def soft_cross_entropy(ctx, h: Any, p: Any, weight: Any, reduction: Any,
                       label_smoothing: Any, name: str) -> Val:
    """torch's cross entropy with class probabilities as the target ((batch, N) floats:
    distillation, mixup), per row: ``-(w * p' * log_softmax(h)).sum(1)`` where ``p' = p
    * (1 - e) + e / N`` (label smoothing ``e``)."""
    b = ctx.b
    _check_reduction(ctx, reduction, name)
    eps = float(label_smoothing or 0.0)
    if not 0.0 <= eps <= 1.0:
        raise ctx.refuse(name, f"label_smoothing={label_smoothing!r}: torch takes 0..1")
    v, n = _logits(ctx, h, name)
    pv = ctx.val(p, name)
    if ctx.dims(pv) != (BATCH, n):
        raise ctx.refuse(name, f"a target of shape {_fmt_dims(ctx.dims(pv))} with (batch, "
                               f"{n}) scores: class indices are an integer input of shape "
                               f"(batch,), probabilities a (batch, {n}) float tensor")
    if eps > 0.0:
        pv = b.map("add", b.map("mul", pv, b.const(1.0 - eps)), b.const(eps / n))
    terms = b.map("mul", b.softmax(v, 1, log=True), pv)
    if weight is not None:
        w = ctx.val(weight, name)
        if ctx.dims(w) not in ((n,), (1, n)):
            raise ctx.refuse(name, f"a class weight of shape {_fmt_dims(ctx.dims(w))}: "
                                   f"torch takes one per class, ({n},)")
        terms = b.map("mul", terms, w)
    loss = b.map("neg", b.reduce("sum", terms, 1, True))
    if reduction == "sum":
        return _BatchStat(("sum", loss))
    if reduction == "mean":   # (torch divides by the rows, weights or not)
        return _BatchStat(("div", ("sum", loss), ("count",)))
    return Val(b.view(loss, (BATCH,)))


def _register() -> None:
    import torch.nn as nn
    import torch.nn.functional as F

    from cupyfuse.frontend import lower as lowering
    from cupyfuse.frontend.tables import _arg
    from cupyfuse.frontend.values import _Weight

    @lowering.function(F.cross_entropy)
    def _cross_entropy_fn(ctx, node, args, kw, name):
        for i, legacy in ((3, "size_average"), (5, "reduce")):
            if _arg(args, kw, i, legacy, None) is not None:
                raise ctx.refuse(name, f"the deprecated `{legacy}` argument: pass reduction=")
        return soft_cross_entropy(ctx, args[0], _arg(args, kw, 1, "target"),
                                  _arg(args, kw, 2, "weight"),
                                  _arg(args, kw, 6, "reduction", "mean"),
                                  _arg(args, kw, 7, "label_smoothing", 0.0), name)

    @lowering.module(nn.CrossEntropyLoss)
    def _cross_entropy_module(ctx, node, mod, a, name):
        if len(node.args) < 2:
            raise ctx.refuse(name, "a loss called without its target")
        w = _Weight(f"{node.target}.weight", tuple(mod.weight.shape)) \
            if mod.weight is not None else None
        return soft_cross_entropy(ctx, a, node.args[1], w, mod.reduction,
                                  mod.label_smoothing, name)


_register()
