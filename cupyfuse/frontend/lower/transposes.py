"""Transposes and permutes in a traced forward (:mod:`cupyfuse.frontend.translate`): transpose /
swapaxes / permute / t / movedim / ``.T`` / ``.mT`` (a plain view where the dims other
than 1 keep their order; a value with its dims after the batch reordered, ``_Perm``,
where they do not: the same storage relabelled), and the ops that read such a value
(``_perm_call``: its shape, reorders back, elementwise ops, reductions, softmax and
normalize along a dim, BatchNorm over its channels, pooling over a whole sequence, a
Linear whose features are still last); anything else refused saying why.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse.frontend.tables import (_REDUCE_FUNCS, _REDUCE_METHODS, _REORDER_FUNCS, _REORDER_METHODS,
                             _arg)
from cupyfuse.frontend.values import (Val, _Bool, _Const, _DEVICE, _Indices, _Int, _Perm, _RawInt,
                             _Rows, _Size, _Split, _Tuple, _Weight)
from cupyfuse.ir.program import BATCH, LEAD, TailError, _fmt_dims
from cupyfuse.frontend.lower import norms, reductions
from cupyfuse.frontend import lower as lowering
from cupyfuse.frontend.lower.linear import _weight_transpose


# --- transpose, permute, movedim -----------------------------------------------------
def transpose(ctx, a: Any, d0: int, d1: int, name: str) -> int:
    v = ctx.val(a, name)
    n = len(ctx.dims(v))
    perm = list(range(n))
    d0, d1 = ctx._dim(d0, n, name), ctx._dim(d1, n, name)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return permute(ctx, a, perm, name)


def _perm(ctx, d: Sequence[int], perm: list, name: str) -> tuple[list[int], bool]:
    """A permutation of a value of dims ``d`` with its dims made non-negative, and
    whether it keeps the order of the dims that are not size 1 (a view); torch's
    errors for a bad permutation refused."""
    if len(perm) != len(d):
        raise ctx.refuse(name, f"a permutation of {len(perm)} dims of a {len(d)}-dim "
                                "value (torch raises)")
    perm = [ctx._dim(p, len(d), name) for p in perm]
    if len(set(perm)) != len(perm):
        raise ctx.refuse(name, f"a permutation {perm} that repeats a dim (torch raises)")
    moved = [p for p in perm if d[p] != 1]
    return perm, moved == sorted(moved)


def permute(ctx, a: Any, perm: list, name: str) -> Any:
    v = ctx.val(a, name)
    d = ctx.dims(v)
    perm, in_order = _perm(ctx, d, perm, name)
    if not in_order:
        out = [d[p] for p in perm]
        if BATCH not in d or next(x for x in out if x != 1) != BATCH:
            # a value is stored row by row: a transpose that moves the batch dim after
            # another (h.t() of a (batch, n) value) is data movement across rows
            raise ctx.refuse(name, f"moves the batch dim: {_fmt_dims(d)} to "
                              f"{_fmt_dims(out)}; cupyfuse computes each row of the batch "
                              "on its own, so an op across the batch's rows after it (a "
                              "product `a @ b.t()` of two values, a similarity matrix) is "
                              "not fused (dims after the batch may be reordered)")
        # dims after the batch reordered ((batch, seq, C) as (batch, C, seq)): a
        # relabelling of the same storage (_Perm)
        return _perm_mk(ctx, v, perm, ctx._kind_of(a))
    return ctx.b.view(v, [d[p] for p in perm])


def _reorder(ctx, node: torch.fx.Node, args: tuple, kw: dict, n: int,
             name: str) -> list[int]:
    """The permutation of an ``n``-dim value that a transposing op makes
    (``transpose``/``swapaxes``/``swapdims``, ``permute``, ``t``, ``movedim``/
    ``moveaxis``, ``.T``, ``.mT``: methods, functions and attributes alike)."""
    t = node.target
    m = t if node.op == "call_method" else _REORDER_FUNCS.get(t) if \
        node.op == "call_function" and t is not getattr else args[1]
    if m in ("transpose", "swapaxes", "swapdims"):
        a0 = _arg(args, kw, 1, "dim0", kw.get("axis0"))
        a1 = _arg(args, kw, 2, "dim1", kw.get("axis1"))
        perm = list(range(n))
        d0, d1 = ctx._dim(a0, n, name), ctx._dim(a1, n, name)
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return perm
    if m == "permute":
        perm = args[1:] if not (len(args) == 2 and isinstance(args[1], (tuple, list))) \
            else args[1]
        perm = kw.get("dims", perm)
        return list(perm)
    if m == "t":
        if n > 2:
            raise ctx.refuse(name, f"t() of a {n}-dim value (torch raises: it takes "
                                    "at most 2 dims)")
        return list(range(n))[::-1]
    if m in ("movedim", "moveaxis"):
        return _movedim_perm(ctx, n, _arg(args, kw, 1, "source"),
                                  _arg(args, kw, 2, "destination"), name)
    if m == "T":
        return list(range(n))[::-1]
    if m == "mT":
        if n < 2:
            raise ctx.refuse(name, "mT of a value of fewer than 2 dims (torch raises)")
        return list(range(n - 2)) + [n - 1, n - 2]
    raise ctx.refuse(name)   # pragma: no cover - the callers pass these only


def _movedim_perm(ctx, n: int, src: Any, dst: Any, name: str) -> list[int]:
    """torch.movedim's permutation of an ``n``-dim value."""
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    if len(src) != len(dst):
        raise ctx.refuse(name, "source and destination of different lengths (torch "
                                "raises)")
    src = [ctx._dim(x, n, name) for x in src]
    dst = [ctx._dim(x, n, name) for x in dst]
    if len(set(src)) != len(src) or len(set(dst)) != len(dst):
        raise ctx.refuse(name, "repeats a dim in source or destination (torch raises)")
    order: list[Any] = [None] * n
    for s_, t_ in zip(src, dst):
        order[t_] = s_
    rest = iter(i for i in range(n) if i not in src)
    return [x if x is not None else next(rest) for x in order]

# --- values with their dims after the batch reordered (_Perm) -----------------------
def _perm_dims(ctx, P: "_Perm") -> tuple[int, ...]:
    """torch's dims of a ``_Perm`` value."""
    d = ctx.dims(P.v)
    return tuple(d[p] for p in P.perm)


def _perm_mk(ctx, v: int, perm: Sequence[int], kind: str = "f") -> Any:
    """Program value ``v`` seen with its dims in the order ``perm``: a ``_Perm``, or
    a plain view where the dims other than 1 keep their order."""
    d = ctx.dims(v)
    perm = tuple(perm)
    moved = [p for p in perm if d[p] != 1]
    if moved == sorted(moved):
        return ctx._wrap(kind, ctx.b.view(v, [d[p] for p in perm]))
    return _Perm(v, perm, kind)


def _perm_sizes(ctx, P: "_Perm") -> tuple[_Size, ...]:
    """``.shape`` of a ``_Perm`` value: torch's order, each leading dim still the
    input's k-th."""
    d = ctx.dims(P.v)
    return tuple(_Size(d[p], i, d[:p].count(LEAD) if d[p] == LEAD else None)
                 for i, p in enumerate(P.perm))

# --- ops reading a transposed value (_Perm) ------------------------------------------
def _perm_call(ctx, node: torch.fx.Node) -> Any:
    """An op reading a value whose dims after the batch torch sees reordered
    (``_Perm``: ``h.transpose(1, 2)`` of a (batch, seq, C) value): its shape, more
    reorders (back to the program's order: the value again), elementwise ops (other
    operands laid out in the value's own order), reductions, softmax and normalize
    along a dim (mapped to the value's), BatchNorm over the channels of (batch, C,
    seq...), pooling over a whole sequence, ``h.transpose(1, 2) @ w`` with weights
    (batch, seq, 1); anything else refused saying why."""
    op, t, args, kw, mod, name = ctx._call_parts(node)
    m = t if op == "call_method" else None
    f = t if op == "call_function" else None
    a0 = args[0] if args else None
    P = ctx.env.get(a0) if isinstance(a0, torch.fx.Node) else None
    P = P if isinstance(P, _Perm) else None
    first = next(ctx.env[a] for a in node.all_input_nodes
                 if isinstance(ctx.env.get(a), _Perm))
    T = _perm_dims(ctx, first)
    n = len(T)
    shown = _fmt_dims(T)

    def refuse(why: str = "") -> TailError:
        return ctx.refuse(name, (why or f"an op on a transposed value {shown} (its dims "
                                  "after the batch reordered)") + ": cupyfuse fuses "
                           "elementwise ops, reductions, softmax and normalize along a "
                           "dim, BatchNorm over the channels (dim 1) and pooling over "
                           "a whole sequence of such a value, and a transpose back to "
                           "the order it came in")

    # --- its shape, and reorders
    if P is not None and f is getattr:
        attr = args[1]
        if attr == "shape":
            return _perm_sizes(ctx, P)
        if attr == "dtype":
            return {"b": torch.bool, "i": torch.int64}.get(P.kind, torch.float32)
        if attr == "device":
            return _DEVICE
        if attr in ("T", "mT"):
            return _perm_reorder(ctx, P, _reorder(ctx, node, args, kw, n, f".{attr}"),
                                      f".{attr}")
        raise refuse(f"`.{attr}` of a transposed value {shown}")
    if P is not None and m == "size":
        dd = _arg(args, kw, 1, "dim")
        sz = _perm_sizes(ctx, P)
        return sz if dd is None else sz[ctx._dim(dd, n, name)]
    if P is not None and m in ("dim", "ndimension"):
        return _Const(n)
    if P is not None and (m in _REORDER_METHODS or f in _REORDER_FUNCS):
        return _perm_reorder(ctx, P, _reorder(ctx, node, args, kw, n, name), name)
    if P is not None and (m == "unsqueeze" or f is torch.unsqueeze):
        dim = ctx._dim(_arg(args, kw, 1, "dim"), n + 1, name)
        d = ctx.dims(P.v)
        v = ctx.b.view(P.v, d + (1,))   # the new dim last in storage: a size-1 dim
        perm = list(P.perm)
        perm.insert(dim, len(d))
        return _perm_mk(ctx, v, perm, P.kind)
    if P is not None and (m == "squeeze" or f is torch.squeeze) and \
            _arg(args, kw, 1, "dim") is not None:
        dim = _arg(args, kw, 1, "dim")
        dl = list(dim) if isinstance(dim, (list, tuple)) else [dim]
        gone = {P.perm[ctx._dim(x, n, name)] for x in dl}
        return _perm_drop(ctx, P.v, P.perm, {p for p in gone if ctx.dims(P.v)[p] == 1},
                               P.kind)
    # --- what may read it
    for x in node.all_input_nodes:
        e = ctx.env.get(x)
        if isinstance(e, _Perm) and e.perm != first.perm:
            raise refuse(f"an op between values transposed differently ({shown} and "
                         f"{_fmt_dims(_perm_dims(ctx, e))})")
        if isinstance(e, (_Rows, _Split, _RawInt, _Tuple)):
            raise refuse("an op between a transposed value and a (batch * seq, F) view, "
                         "a split value, an integer input or a tuple")
    is_linear = isinstance(mod, nn.Linear) or f in (F.linear, torch.mm, torch.addmm,
                                                 torch.einsum) or \
        f in (torch.matmul, operator.matmul, torch.bmm) or \
        m in ("matmul", "mm", "bmm", "__matmul__")
    if is_linear:
        return _perm_matmul(ctx, node, mod, f, m, args, kw, name, T)
    if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d)) or f in (
            F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d):
        raise refuse(f"a convolution of a transposed value {shown}: it mixes positions "
                     "along the sequence (the rows of the program), which cupyfuse does "
                     "not fuse (it fuses ops along the features, row by row, and "
                     "reductions over a whole sequence)")
    if type(mod) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d) or f is F.batch_norm:
        return _perm_batch_norm(ctx, node, mod, f, args, kw, name, P, T)
    if isinstance(mod, (nn.MaxPool1d, nn.AvgPool1d, nn.AdaptiveAvgPool1d,
                        nn.AdaptiveMaxPool1d)) or f in (
            F.max_pool1d, F.avg_pool1d, F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d,
            F.adaptive_max_pool1d, torch.avg_pool1d, torch.max_pool1d):
        return _perm_pool(ctx, mod, f, args, kw, name, P, T)
    # --- ops along a dim: the dim mapped to the value's own
    red = _REDUCE_FUNCS.get(f) if f is not None else m if m in _REDUCE_METHODS else None
    binary = len(args) >= 2 and ctx.is_tensor_like(args[1]) and "dim" not in kw
    if red is not None and not (red in ("max", "min") and binary) and P is not None:
        return _perm_reduce(ctx, red, args, kw, name, P)
    soft = None
    if isinstance(mod, (nn.Softmax, nn.LogSoftmax, nn.Softmin)):
        soft = (mod.dim, isinstance(mod, nn.LogSoftmax), isinstance(mod, nn.Softmin))
    elif f in (torch.softmax, F.softmax, torch.log_softmax, F.log_softmax, F.softmin) or \
            m in ("softmax", "log_softmax"):
        ctx._float32_only(kw, name, args)
        soft = (_arg(args, kw, 1, "dim"), f in (torch.log_softmax, F.log_softmax) or
                m == "log_softmax", f is F.softmin)
        if soft[0] is None and f in (torch.softmax, torch.log_softmax):
            raise ctx.refuse(name, "softmax without an explicit dim (torch raises)")
    if soft is not None and P is not None:
        ctx._no_bool_operand(a0, name)
        dim, log, neg = soft
        if dim is None:   # torch's legacy dim (the same place in either order)
            dim = reductions._implicit_softmax_dim(ctx, a0, name, "softmin" if neg else "softmax")
        v = ctx.b.map("neg", P.v) if neg else P.v
        return _perm_mk(ctx, ctx.b.softmax(v, P.perm[ctx._dim(dim, n, name)], log=log),
                             P.perm)
    if f is F.normalize and P is not None:
        p_, dim = _arg(args, kw, 1, "p", 2.0), _arg(args, kw, 2, "dim", 1)
        eps = _arg(args, kw, 3, "eps", 1e-12)
        ctx._no_bool_operand(a0, name)
        nrm = ctx.b.norm(P.v, P.perm[ctx._dim(dim, n, name)], float(p_), True)
        return _perm_mk(ctx, ctx.b.map("div", P.v, ctx.b.map("clamp", nrm,
                                                               attrs=(eps, math.inf))),
                             P.perm)
    if not ctx._elementwise(node, args, kw):
        if isinstance(mod, (nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d,
                            nn.InstanceNorm2d)) or f in (F.layer_norm, F.group_norm,
                                                          F.instance_norm):
            raise refuse(f"a norm of a transposed value {shown} over its channels or "
                         "last dim (statistics along the sequence, or across features "
                         "and positions)")
        if m in ("view", "reshape", "flatten", "contiguous_view", "expand", "expand_as",
                 "unflatten") or f in (torch.reshape, torch.flatten, torch.unflatten,
                                       torch.broadcast_to, torch.cat, torch.concat,
                                       torch.stack) or isinstance(mod, nn.Flatten):
            raise refuse(f"a reshape or join of a transposed value {shown}: it would "
                         "move data between positions (the program keeps each row's "
                         "features in order); transpose it back first")
        raise refuse()
    return _perm_elementwise(ctx, node, args, kw, name, first.perm, n, refuse)


def _perm_reorder(ctx, P: "_Perm", perm: list, name: str) -> Any:
    """A transpose/permute of a ``_Perm`` value: the composed order (the plain value
    where it is the program's again)."""
    d = _perm_dims(ctx, P)
    perm, _ = _perm(ctx, d, perm, name)
    out = [d[p] for p in perm]
    if next(x for x in out if x != 1) != BATCH:
        raise ctx.refuse(name, f"moves the batch dim: {_fmt_dims(d)} to "
                          f"{_fmt_dims(out)}; cupyfuse computes each row of the batch on "
                          "its own (dims after the batch may be reordered)")
    return _perm_mk(ctx, P.v, [P.perm[p] for p in perm], P.kind)


def _perm_drop(ctx, v: int, perm: Sequence[int], gone: set, kind: str = "f") -> Any:
    """``v`` (dims in torch's order ``perm``) with its size-1 dims ``gone`` (positions
    in ``v``'s dims) dropped."""
    d = ctx.dims(v)
    r = ctx.b.view(v, [x for i, x in enumerate(d) if i not in gone])
    left = [p - sum(1 for g in gone if g < p) for p in perm if p not in gone]
    return _perm_mk(ctx, r, left, kind)


def _perm_reduce(ctx, kind: str, args: tuple, kw: dict, name: str, P: "_Perm") -> Any:
    """sum/mean/max/... of a ``_Perm`` value over torch dims: over the value's own
    (positions -- argmax/argmin, max/min's indices -- refused)."""
    n = len(P.perm)
    if kind in ("argmax", "argmin"):
        raise ctx.refuse(name, f"{kind} of a transposed value "
                          f"{_fmt_dims(_perm_dims(ctx, P))}: positions along the "
                          "features of a value in its own order are fused; take them "
                          "before the transpose")
    di = 2 if kind in ("norm", "vector_norm") else 1
    dim = _arg(args, kw, di, "dim")
    if dim is None or isinstance(dim, (tuple, list)) and not dim:
        return reductions.reduction(ctx, kind, args, kw, name)   # (refuses: no dim)
    dl = list(dim) if isinstance(dim, (tuple, list)) else [dim]
    tdims = [ctx._dim(x, n, name) for x in dl]
    mapped = [P.perm[x] for x in tdims]
    new_dim: Any = tuple(mapped) if isinstance(dim, (tuple, list)) else mapped[0]
    if len(args) > di:
        new_args, new_kw = args[:di] + (new_dim,) + args[di + 1:], kw
    else:
        new_args, new_kw = args, {**kw, "dim": new_dim}
    a0 = args[0]
    saved = ctx.env[a0]
    try:
        ctx.env[a0] = ctx._wrap(P.kind, P.v)
        r = reductions.reduction(ctx, kind, new_args, new_kw, name)
    finally:
        ctx.env[a0] = saved
    out = r.items[0] if isinstance(r, _Tuple) else r
    kind_ = "i" if isinstance(out, _Int) else "f"
    v = out.v if isinstance(out, _Int) else int(out)
    rd = ctx.dims(v)
    if len(rd) == n:   # keepdim
        res = _perm_mk(ctx, v, P.perm, kind_)
    else:   # the reduced dims gone: put them back as size 1 to reorder, then drop
        full = list(rd)
        for p in sorted(set(mapped)):
            full.insert(p, 1)
        w = ctx.b.view(v, full)
        res = _perm_drop(ctx, w, P.perm, set(mapped), kind_)
    # (the indices, in the value's own order, would be positions along another dim)
    return _Tuple((res, _Indices(None, r.items[1].op))) if isinstance(r, _Tuple) else res


def _perm_batch_norm(ctx, node: torch.fx.Node, mod: Any, f: Any, args: tuple, kw: dict,
                     name: str, P: "_Perm | None", T: tuple[int, ...]) -> Any:
    """BatchNorm of a transposed (batch, C, seq...) value whose channels are the
    program value's features and whose other dims are the sequence: statistics of
    each feature over all (batch, seq) rows, a BatchNorm of the program value's rows
    as they are."""
    if P is None:
        raise ctx.refuse(name, "BatchNorm with a transposed tensor as its weight, bias "
                                "or running statistics")
    ctx._no_bool_operand(args[0], name)
    d = ctx.dims(P.v)
    nd = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}.get(
        type(mod), (len(T),))
    if len(T) not in nd:
        raise ctx.refuse(name, f"a {len(T)}-dim input {_fmt_dims(T)} (torch raises: "
                                f"expected {' or '.join(map(str, nd))}D input)")
    if P.perm[1] != len(d) - 1 or any(x not in (LEAD, 1) for x in T[2:]):
        raise ctx.refuse(name, f"BatchNorm of a transposed value {_fmt_dims(T)} whose "
                                "channels (dim 1) are not its features, or whose other "
                                "dims are not the sequence: statistics across features "
                                "of a row")
    saved = ctx.env[args[0]]
    try:
        ctx.env[args[0]] = Val(P.v)
        if mod is not None:
            r = norms.batch_norm(ctx, args[0], node.target, mod, name, rows=True)
        else:
            r = norms.batch_norm_fn(ctx, args, kw, name, rows=True)
    finally:
        ctx.env[args[0]] = saved
    return _perm_mk(ctx, r, P.perm)


def _perm_pool(ctx, mod: Any, f: Any, args: tuple, kw: dict, name: str,
               P: "_Perm | None", T: tuple[int, ...]) -> Any:
    """1-D pooling of a transposed (batch, C, seq) value: over the sequence. Windows
    covering the whole sequence (kernel its length; adaptive output 1) are a
    reduction over it; other windows would mix positions (rows): refused."""
    if P is None or len(T) != 3 or T[2] != LEAD:
        raise ctx.refuse(name, f"pooling of a transposed value {_fmt_dims(T)} over a "
                                "dim that is not the sequence")
    ctx._no_bool_operand(args[0], name)
    ax = P.perm[2]
    L = ctx.b.size(P.v, ax, name)
    adaptive = isinstance(mod, (nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d)) or f in (
        F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d, F.adaptive_max_pool1d)
    mx = isinstance(mod, (nn.MaxPool1d, nn.AdaptiveMaxPool1d)) or f in (
        F.max_pool1d, F.adaptive_max_pool1d, torch.max_pool1d)

    def length(x: Any) -> Any:
        e = ctx.env.get(x) if isinstance(x, torch.fx.Node) else x
        if isinstance(e, _Const):
            e = e.v
        if isinstance(e, _Size):
            e = L if e.v == LEAD else e.v if e.v != BATCH else None
        if isinstance(e, (tuple, list)) and len(e) == 1:
            return length(e[0])
        return e if type(e) is int else None

    if adaptive:
        out = length(mod.output_size if mod is not None else _arg(args, kw, 1, "output_size"))
        if (mod.return_indices if isinstance(mod, nn.AdaptiveMaxPool1d) else
                kw.get("return_indices", False)):
            raise ctx.refuse(name, "pooling with indices (return_indices=True): the "
                                    "indices are not fused")
        if out == L:
            return P
        if out != 1:
            raise ctx.refuse(name, f"adaptive pooling of a sequence of {L} to {out}: "
                                    "windows of positions (rows of the program); "
                                    "cupyfuse pools a whole sequence (output size 1)")
    else:
        if mod is not None:
            k, s_, pad, ceil = mod.kernel_size, mod.stride, mod.padding, mod.ceil_mode
            dil, ret = getattr(mod, "dilation", 1), getattr(mod, "return_indices", False)
        else:
            k = _arg(args, kw, 1, "kernel_size")
            s_ = _arg(args, kw, 2, "stride", None)
            pad = _arg(args, kw, 3, "padding", 0)
            ceil = _arg(args, kw, 5 if mx else 4, "ceil_mode", False)
            dil = _arg(args, kw, 4, "dilation", 1) if mx else 1
            ret = _arg(args, kw, 6, "return_indices", False) if mx else False
        k = length(k)
        s_ = k if s_ is None or isinstance(s_, (tuple, list)) and not s_ else length(s_)
        if length(pad) != 0 or ceil or length(dil) != 1 or ret:
            raise ctx.refuse(name, "pooling with padding, ceil_mode, dilation or indices")
        if k is None or s_ is None or k < 1 or s_ < 1:
            raise ctx.refuse(name, "a pooling window or stride that is not a positive "
                                    "int")
        if k > L:
            raise ctx.refuse(name, f"a window of {k} over a sequence of {L} (torch "
                                    "raises)")
        if k != L:
            raise ctx.refuse(name, f"pooling windows of {k} positions of a sequence of "
                                    f"{L} (a transposed (batch, C, seq) value): they mix "
                                    "rows of the program; cupyfuse pools a whole sequence "
                                    "(kernel_size = its length, h.size(2)) or features "
                                    "within a row")
    v = ctx.b.reduce("max", P.v, ax, True) if mx else ctx.b.mean(P.v, ax, True)
    return _perm_mk(ctx, v, P.perm)


def _perm_matmul(ctx, node: torch.fx.Node, mod: Any, f: Any, m: Any, args: tuple,
                 kw: dict, name: str, T: tuple[int, ...]) -> Any:
    """A matmul or Linear with a transposed operand: ``h.transpose(1, 2) @ w`` of
    weights w (batch, seq, 1) is a sum over the sequence of ``h * w``; a Linear of a
    transposed value whose last dim is still its features runs on it as it is;
    anything else works across rows (a Linear over the sequence, a product of two
    values): refused saying so."""
    a0 = args[0] if args else None
    ea = ctx.env.get(a0) if isinstance(a0, torch.fx.Node) else None
    b1 = args[1] if len(args) > 1 else None
    eb = ctx.env.get(b1) if isinstance(b1, torch.fx.Node) else None
    mm = f in (torch.matmul, operator.matmul, torch.bmm) or \
        m in ("matmul", "bmm", "__matmul__")
    if mm and isinstance(ea, _Perm) and isinstance(eb, Val):
        d, db = ctx.dims(ea.v), ctx.dims(int(eb))
        if T[1:] and len(T) == 3 and T[2] == LEAD and ea.kind == "f" and \
                db == (BATCH, LEAD, 1) and d == (BATCH, LEAD, T[1]):
            # (batch, n, seq) @ (batch, seq, 1): sum over the sequence of h * w
            r = ctx.b.reduce("sum", ctx.b.map("mul", ea.v, int(eb)), 1, True)
            return _perm_mk(ctx, r, ea.perm)
    if mm and (isinstance(ea, (Val, _Perm)) and isinstance(eb, (Val, _Perm))):
        shown = [_fmt_dims(_perm_dims(ctx, e) if isinstance(e, _Perm) else
                           ctx.dims(int(e))) for e in (ea, eb)]
        raise ctx.refuse(name, f"a product of two values of the batch ({shown[0]} @ "
                                f"{shown[1]}, e.g. attention scores q @ k.transpose(-2, "
                                "-1)): it pairs positions of the sequence (rows of the "
                                "program) with each other, which cupyfuse does not "
                                "fuse; it fuses a Linear with a weight parameter, and "
                                "attention pooling (weights (batch, 1, seq) @ values)")
    P = ea if isinstance(ea, _Perm) else None
    if P is not None and P.perm[-1] == len(P.perm) - 1 and P.kind == "f":
        # the features still last (leading dims reordered): a Linear row by row
        saved = ctx.env[a0]
        try:
            ctx.env[a0] = Val(P.v)
            r = getattr(ctx, node.op)(node)
        finally:
            ctx.env[a0] = saved
        if type(r) in (int, Val) and len(ctx.dims(int(r))) == len(P.perm):
            return _perm_mk(ctx, int(r), P.perm)
    Tn = _fmt_dims(T)
    raise ctx.refuse(name, f"a Linear or matmul over the last dim of a transposed "
                            f"value {Tn}, which is not its features (a GEMM along the "
                            "sequence, across rows of the program: token mixing), or "
                            "with a transposed weight operand: not fused (cupyfuse "
                            "fuses Linear layers along the features)")


def _perm_elementwise(ctx, node: torch.fx.Node, args: tuple, kw: dict, name: str,
                      perm: tuple[int, ...], n: int, refuse: Callable) -> Any:
    """An elementwise op with a ``_Perm`` operand: every tensor operand laid out in
    the value's own order (torch's broadcast of the transposed shapes), the op run
    there, its result seen in torch's order again."""
    saved: dict[torch.fx.Node, Any] = {}
    inv = [0] * n
    for i, p in enumerate(perm):
        inv[p] = i
    try:
        for x in node.all_input_nodes:
            e = ctx.env.get(x)
            if isinstance(e, _Perm):
                saved[x] = e
                ctx.env[x] = ctx._wrap(e.kind, e.v)
                continue
            if isinstance(e, (Val, _Bool, _Int)):
                td = ctx.dims(int(e) if isinstance(e, Val) else e.v)
            elif isinstance(e, _Weight):
                if e.transposed:
                    raise refuse("a transposed matrix parameter with a transposed value")
                td = tuple(e.shape)
            elif isinstance(e, torch.Tensor) and e.dim() > 0:
                td = tuple(e.shape)
            else:
                continue   # numbers, 0-d tensors, devices, dtypes
            if len(td) > n:
                raise refuse(f"an operand of {len(td)} dims with a transposed value "
                             f"of {n} dims")
            pad = (1,) * (n - len(td)) + tuple(td)
            ud = [pad[inv[p]] for p in range(n)]
            moved = [inv[p] for p in range(n) if ud[p] != 1]
            if moved != sorted(moved):
                raise refuse(f"an operand of shape {_fmt_dims(pad)} with a transposed "
                             "value, laid out in another order than its own")
            saved[x] = e
            if isinstance(e, _Weight):
                ctx.env[x] = Val(ctx.b.param(e.source, tuple(ud)))
            elif isinstance(e, torch.Tensor):
                if e.is_floating_point() and e.dtype != torch.float32:
                    raise ctx.refuse(name, f"a {e.dtype} tensor (cupyfuse runs float32)")
                ctx.env[x] = Val(ctx.b.param(e.detach().float().reshape(ud), tuple(ud)))
            else:
                v0 = int(e) if isinstance(e, Val) else e.v
                ctx.env[x] = ctx._wrap(ctx._kind_of(x), ctx.b.view(v0, ud))
        r = getattr(ctx, node.op)(node)
    finally:
        ctx.env.update(saved)
    kind = "b" if isinstance(r, _Bool) else "i" if isinstance(r, _Int) else "f"
    v = r.v if isinstance(r, (_Bool, _Int)) else r
    if type(v) not in (int, Val) or len(ctx.dims(int(v))) != n:
        raise refuse()
    return _perm_mk(ctx, int(v), perm, kind)


# --- spellings ---------------------------------------------------------------------------
@lowering.function(*_REORDER_FUNCS)
def _reorder_fn(ctx, node, args, kw, name):
    w = ctx.env.get(args[0]) if args and isinstance(args[0], torch.fx.Node) else None
    if node.target in (torch.t, torch.transpose) and isinstance(w, _Weight) and \
            len(w.shape) == 2 and _weight_transpose(node):
        # torch.t(W), torch.transpose(W, 0, 1) of a 2-D weight: read transposed
        return _Weight(w.source, w.shape[::-1], not w.transposed)
    return permute(ctx, args[0], _reorder(ctx, node, args, kw, len(ctx.dims(
        ctx.val(args[0], name))), name), name)


@lowering.method(*_REORDER_METHODS)
def _reorder_method(ctx, node, self_, args, kw, name):
    base = ctx.env.get(self_)
    if node.target in ("t", "transpose") and isinstance(base, _Weight):
        return _Weight(base.source, base.shape[::-1], not base.transposed)
    return permute(ctx, self_, _reorder(ctx, node, args, kw, len(ctx.dims(
        ctx.val(self_, name))), name), name)
