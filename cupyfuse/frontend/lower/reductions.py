"""Reductions in a traced forward (:mod:`cupyfuse.frontend.translate`): sum, mean, amax/amin, max/min
(their indices, built where read), argmax/argmin along the features (positions: an
``_Index``), logsumexp, norm / vector_norm, var and std along dims
(of plain and split values), softmax's implicit dim, ``cumsum`` (a ``scan``), 1-D pooling
(plain windows, torch's clipped and adaptive windows as a ``wpool``, each channel of a
(batch, C, L) split value), and cosine similarity and pairwise distance as torch computes
them.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from cupyfuse.ir import splits
from cupyfuse.frontend.tables import _ARG_KINDS, _arg
from cupyfuse.frontend.values import Val, _Index, _Indices, _Int, _Split, _Tuple
from cupyfuse.ir.program import BATCH, LEAD, TailError, _fmt_dims
import torch.nn as nn
from cupyfuse.frontend import lower as lowering
from cupyfuse.frontend.lower import elementwise
from cupyfuse.frontend.tables import _REDUCE_FUNCS, _REDUCE_METHODS


# --- reductions along dims (plain and split values) ----------------------------------
def reduction(ctx, kind: str, args: tuple, kw: dict, name: str,
              axis_map: Callable[[int], int] | None = None) -> Any:
    """``axis_map``: the dims named (normalised) as dims of the value reduced (a stack
    along dim 0 is held with its stacked dim after the batch: ``_stacked_call``)."""
    if kind in _ARG_KINDS:
        return argreduction(ctx, kind, args, kw, name, axis_map)
    if ctx._is_bool(args[0]):
        raise ctx.refuse(name, "a reduction of a boolean tensor (torch gives bool or "
                          "int64 there); reduce `mask.float()` instead")
    if ctx._is_int(args[0]) and kind not in ("sum", "amax", "amin", "logsumexp"):
        raise ctx.refuse(name, f"{kind} of an integer tensor (int64 in torch: "
                          f"{'torch raises' if kind in ('mean', 'norm', 'vector_norm', 'var', 'std') else 'gives int64 values and indices'}); "
                          "reduce a float tensor, e.g. `mask.float() * 3`")
    sp = ctx._split_of(args[0])
    v = ctx.val(args[0], name) if sp is None else sp.v
    if kind in ("norm", "vector_norm"):
        p = _arg(args, kw, 1, "p" if kind == "norm" else "ord", 2)
        dim = _arg(args, kw, 2, "dim")
        keep = _arg(args, kw, 3, "keepdim", False)
        p = _norm_order(ctx, p, name)
    else:
        dim = _arg(args, kw, 1, "dim")
        keep = _arg(args, kw, 2, "keepdim", False)
    if kind in ("var", "std"):
        # var(input, dim, unbiased, keepdim) (legacy positional form) or
        # var(input, dim, *, correction, keepdim)
        corr = kw.get("correction", None)
        unb = kw.get("unbiased", None)
        keep = kw.get("keepdim", False)
        if len(args) > 2 and isinstance(args[2], bool):
            unb = args[2]
            keep = args[3] if len(args) > 3 else keep
        if unb is not None and not isinstance(unb, bool):
            raise ctx.refuse(name, f"unbiased={unb!r} is not a bool (torch raises)")
        if corr is None:
            corr = 0 if unb is False else 1
    if not isinstance(keep, bool):
        raise ctx.refuse(name, f"keepdim={keep!r} is not a bool (torch raises)")
    ctx._float32_only(kw, name)
    if dim is None or (isinstance(dim, (tuple, list)) and not dim):
        # dim=() or [] reduces over every dim in torch, like no dim
        raise ctx.refuse(name, "a reduction over the whole tensor (no dim) mixes rows")
    dims_list = list(dim) if isinstance(dim, (tuple, list)) else [dim]
    nd = len(ctx.dims(v) if sp is None else sp.dims)
    normed = [ctx._dim(d, nd, name) for d in dims_list]
    if axis_map is not None:
        normed = [axis_map(x) for x in normed]
    if len(set(normed)) != len(normed):
        raise ctx.refuse(name, f"dim {dims_list} names a dim twice (torch raises)")
    d0 = ctx.dims(v) if sp is None else sp.dims
    if sp is None and len(normed) > 1 and kind in ("norm", "vector_norm", "logsumexp") \
            and not any(d0[x] in (BATCH, LEAD) for x in normed):
        # over several dims at once, size-1 ones among them: one statistic over all
        # their elements (as a split value's), not one dim after the other
        sp = _Split(ctx.b.view(v, splits.flat_dims(d0)), d0, ctx._kind_of(args[0]))
    if sp is not None:
        return _split_reduction(ctx, kind, sp, normed, keep, p if kind in (
            "norm", "vector_norm") else None, corr if kind in ("var", "std") else None,
            name, kind in ("max", "min") and ("dim" in kw or len(args) > 1))
    dims_list = sorted(set(normed), reverse=True)
    out = v
    # (torch.max(h, dim): its gradient goes to the position it returns, Builder.reduce)
    index = "index" if kind in ("max", "min") and ("dim" in kw or len(args) > 1) else ""
    if kind in ("var", "std") and len(dims_list) > 1:
        # var/std over several dims at once is one statistic over all their elements;
        # reduced one dim at a time, a size-1 dim would give var(var(.)) = 0/0. Size-1
        # dims add no elements: drop them (a view) and reduce over the others (if
        # every dim named is size 1, one of them is the statistic of one element)
        d0 = ctx.dims(v)
        keepers = [d for d in dims_list if d0[d] != 1] or dims_list[-1:]
        if not keep:
            gone = [d for d in dims_list if d not in keepers]
            out = ctx.b.view(v, tuple(x for j, x in enumerate(d0) if j not in gone))
            keepers = [d - sum(1 for g in gone if g < d) for d in keepers]
        dims_list = keepers
    for i, d in enumerate(dims_list):
        if kind == "sum":
            out = ctx.b.reduce("sum", out, d, keep)
        elif kind == "mean":
            out = ctx.b.mean(out, d, keep)
        elif kind in ("amax", "max"):
            out = ctx.b.reduce("max", out, d, keep, index)
        elif kind in ("amin", "min"):
            out = ctx.b.reduce("min", out, d, keep, index)
        elif kind == "logsumexp":
            out = ctx.b.logsumexp(out, d, keep)
        elif kind in ("norm", "vector_norm"):
            out = ctx.b.norm(out, d, p, keep)
        elif kind in ("var", "std"):
            out = ctx.b.var(out, d, corr, keep)
            if kind == "std":
                out = ctx.b.map("sqrt", out)
        else:  # pragma: no cover
            raise ctx.refuse(name)
        if kind in ("norm", "vector_norm", "var", "std", "logsumexp") and len(dims_list) > 1:
            if any(ctx.dims(v)[x] != 1 for x in dims_list[i + 1:]):
                raise ctx.refuse(name, "this reduction over several dims at once")
    if kind in ("max", "min") and "dim" in kw or (kind in ("max", "min") and len(args) > 1):
        # the indices: argmax/argmin of the same value along the same dim, built where
        # something reads them
        ax0 = normed[0]
        return _Tuple((out, _Indices(
            lambda: _arg_index(ctx, "arg" + kind, v, None, ax0, keep, name, True), kind)))
    if ctx._is_int(args[0]) and kind != "logsumexp":
        return _Int(out)   # sum/amax/amin of an integer tensor: int64
    return out


def _norm_order(ctx, p: Any, name: str) -> float:
    """A vector norm's order as a float (None and "fro": 2); a matrix norm's ("nuc")
    or anything else refused."""
    if p is None or p == "fro":
        return 2.0
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise ctx.refuse(name, f"a norm of order {p!r} (vector norms of a number p are "
                                "fused)")
    if math.isnan(p):
        raise ctx.refuse(name, "a norm of order nan")
    return float(p)


def _split_reduction(ctx, kind: str, sp: "_Split", axes: list[int], keep: bool,
                     p: Any, corr: Any, name: str, indices: bool) -> Any:
    """sum/mean/amax/amin/max/min/logsumexp/norm/var/std of a split value over
    ``axes`` (normalised dims): groups of its features (``splits.reduce``), and over
    the sequence dim of a (batch, seq, ...) input a sequence reduction."""
    d = sp.dims
    for ax in axes:
        if d[ax] == BATCH:
            raise ctx.refuse(name, f"reduces over the batch dimension (dim {ax}); only "
                                    "BatchNorm may use statistics over the batch")
    b, v = ctx.b, sp.v
    if kind == "sum":
        r, out = splits.reduce(b, "sum", v, d, axes, keep)
    elif kind == "mean":
        r, out = splits.mean(b, v, d, axes, keep)
    elif kind in ("amax", "max", "amin", "min"):
        r, out = splits.reduce(b, "max" if kind in ("amax", "max") else "min", v, d, axes,
                               keep)
    elif kind == "logsumexp":
        r, out = splits.logsumexp(b, v, d, axes, keep)
    elif kind in ("norm", "vector_norm"):
        r, out = splits.norm(b, v, d, axes, p, keep)
    else:
        r, out = splits.var(b, v, d, axes, corr, keep)
        if kind == "std":
            r = b.map("sqrt", r)
    res = ctx._mk(r, out, "i" if sp.kind == "i" and kind in ("sum", "amax", "amin")
                   else "f")
    if indices:
        ax0 = axes[0]
        return _Tuple((res if isinstance(res, _Split) else int(res), _Indices(
            lambda: _arg_index(ctx, "arg" + kind, sp.v, sp, ax0, keep, name, True), kind)))
    return res


def _unused_indices(ctx, item: "_Indices", name: str) -> Any:
    """The indices of max/min with a dim (``v, i = torch.max(h, 1)``, ``h.max(1)[1]``):
    nothing where no op reads them (fx makes the node of an unpacking's ``_`` all the
    same), else the positions (an ``_Index``: argmax/argmin along that dim) where they
    are fused, refused where not."""
    if ctx.cur is not None and not ctx.cur.users:
        return item
    return _indices(ctx, item, f"{name}[1]")


def _indices(ctx, item: "_Indices", what: str) -> Any:
    """The positions of an ``_Indices`` (``.indices``, ``[1]``: ``what``), or its
    refusal."""
    if item.make is None:
        raise ctx.refuse(what, "the indices of max/min of this value are not "
                          "fused (take `.values` or `[0]`, or unpack them into a name "
                          "nothing reads)")
    return item.make()

# --- argmax / argmin: positions along the features ------------------------------------
def argreduction(ctx, kind: str, args: tuple, kw: dict, name: str,
                 axis_map: Callable[[int], int] | None = None) -> Any:
    """``torch.argmax(h, dim, keepdim)`` / ``h.argmin(...)``: the positions along the
    feature dim (of a plain value, or one dim of split features; along a size-1 dim,
    0), an ``_Index``. Without a dim (torch's position in the flattened tensor, across
    the rows), along the batch, a leading (sequence) dim or the stacked dim of a
    ``torch.stack``, of a boolean or integer tensor: refused."""
    if ctx._is_bool(args[0]):
        raise ctx.refuse(name, f"{kind} of a boolean tensor (torch raises); take it of "
                          "a float tensor, e.g. `mask.float()`")
    if ctx._is_int(args[0]):
        raise ctx.refuse(name, f"{kind} of an integer tensor; take it of a float "
                          "tensor, e.g. `(h > 0).float()`")
    ctx._float32_only(kw, name)
    dim = _arg(args, kw, 1, "dim")
    keep = _arg(args, kw, 2, "keepdim", False)
    if not isinstance(keep, bool):
        raise ctx.refuse(name, f"keepdim={keep!r} is not a bool (torch raises)")
    if dim is None:
        raise ctx.refuse(name, f"{kind} without a dim: torch's position in the "
                          "flattened tensor, across the batch rows; give the feature "
                          "dim, e.g. dim=-1")
    if axis_map is not None:
        raise ctx.refuse(name, f"{kind} over a stack along dim 0 (torch.stack of "
                          "values): positions along the features are fused; stack "
                          "along dim 1 or reduce the stack first")
    sp = ctx._split_of(args[0])
    v = ctx.val(args[0], name) if sp is None else sp.v
    nd = len(ctx.dims(v) if sp is None else sp.dims)
    return _arg_index(ctx, kind, v, sp, ctx._dim(dim, nd, name), keep, name)


def _arg_index(ctx, kind: str, v: int, sp: "_Split | None", ax: int, keep: bool,
               name: str, of_max: bool = False) -> "_Index":
    """The positions of the maximum ("argmax") or minimum ("argmin") along dim ``ax``
    (normalised) of program value ``v`` (with torch dims ``sp.dims`` where split);
    ``of_max``: the indices of max/min (as the refusals call them)."""
    d = ctx.dims(v) if sp is None else sp.dims
    what = "the indices of max/min" if of_max else kind
    if d[ax] == BATCH:
        raise ctx.refuse(name, f"{what} along the batch dimension (dim {ax} of "
                          f"{_fmt_dims(d)}): cupyfuse computes positions along the "
                          "features of each row (dim=-1)")
    if d[ax] == LEAD:
        raise ctx.refuse(name, f"{what} along a leading (sequence) dim (dim {ax} of "
                          f"{_fmt_dims(d)}): cupyfuse computes positions along the "
                          "features (the last dim) of each row")
    if sp is None:
        fa = next((i for i, x in enumerate(d) if x > 1), None)
        if fa is None or fa == ax:   # along the features (or a value of one feature)
            return _Index(Val(ctx.b.argreduce(kind, v, ax, keep)))
        flat = ctx.b.view(v, splits.flat_dims(d))
    else:
        flat = sp.v
    # one dim of split features (groups of its size, the features after it apart), or
    # a size-1 dim beside the features: groups of one feature, position 0 each
    g = d[ax]
    s = math.prod(x for i, x in enumerate(d) if i > ax and x not in (BATCH, LEAD))
    r = ctx.b.sred(kind, flat, g, s)
    out = tuple(1 if i == ax else x for i, x in enumerate(d) if keep or i != ax)
    return _Index(ctx._mk(r, out))

# --- softmax without a dim -----------------------------------------------------------
def _implicit_softmax_dim(ctx, a: Any, name: str, kind: str = "softmax") -> int:
    """The dim F.softmax / F.log_softmax / F.softmin and nn.Softmax & co. take where none
    is given (torch's deprecated ``_get_softmax_dim``: 0 for a 0-, 1- or 3-dim value,
    else 1); refused where that is the batch dim (a softmax across the rows)."""
    sp = ctx._split_of(a)
    d = sp.dims if sp is not None else ctx.dims(ctx.val(a, name))
    dim = 0 if len(d) in (0, 1, 3) else 1
    if d and d[dim] == BATCH:
        raise ctx.refuse(name, f"{kind} without an explicit dim of a {len(d)}-dim value "
                          f"{_fmt_dims(d)}: torch's legacy choice is dim {dim} there, the "
                          "batch (a softmax across the rows), which is not fused; give "
                          "the dim, e.g. dim=-1")
    return dim

# --- 1-D pooling ---------------------------------------------------------------------
def adaptive_pool1d(ctx, a: Any, op: str, out: Any, ret_idx: bool, name: str) -> int:
    """Adaptive pooling whose windows are all alike: an input length that the output
    size divides (a plain pool with kernel = stride = length / output size)."""
    out = out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out
    if out is not None:
        out = ctx._int(out, "output_size", name)
    sp = ctx._split_of(a)
    v = ctx.val(a, name) if sp is None else sp.v
    d = ctx.dims(v) if sp is None else sp.dims
    if ret_idx or out is None or len(d) < 2:
        raise ctx.refuse(name, "adaptive pooling with indices or no output size")
    if len(d) > 3:   # torch's 1-D pools take (C, L) or (N, C, L)
        raise ctx.refuse(name, f"1-D pooling of a {len(d)}-D value {_fmt_dims(d)} (torch "
                          "takes 2-D or 3-D input)")
    length = d[-1]
    if length in splits.ROW:
        raise ctx.refuse(name, "pools along the batch or a leading dim")
    if int(out) < 1 or length % int(out):
        # windows of unequal size: torch's adaptive windows (a wpool node)
        return _window_pool(ctx, a, op, name, out=int(out))
    k = length // int(out)
    if sp is not None:
        return _split_pool(ctx, sp, op, k, k, name)
    return ctx.b.pool(op, v, k, k)


def pool1d(ctx, a: Any, op: str, k: Any, s: Any, pad: Any, ceil: bool, dil: Any,
           ret_idx: bool, name: str, incl: Any = True) -> int:
    def one(x: Any, what: str) -> int:
        if isinstance(x, (tuple, list)) and len(x) == 1:
            x = x[0]
        return ctx._int(x, what, name)
    k = one(k, "kernel_size")
    s = one(s, "stride") if s is not None else k
    if k <= 0 or s <= 0:
        raise ctx.refuse(name, f"kernel_size {k} / stride {s}: must be greater than zero "
                                "(torch raises)")
    if ret_idx:
        raise ctx.refuse(name, "pooling with indices (return_indices=True): the indices "
                                "are not fused")
    pad, dil = one(pad, "padding"), one(dil, "dilation")
    if not isinstance(ceil, bool) or not isinstance(incl, bool):
        raise ctx.refuse(name, f"ceil_mode={ceil!r} / count_include_pad={incl!r}: not "
                                "bools")
    if pad != 0 or ceil or dil != 1:
        # torch's windows: clipped at the channel's ends (a wpool node)
        return _window_pool(ctx, a, op, name, k=k, s=s, pad=pad, dil=dil, ceil=ceil,
                                 incl=incl)
    sp = ctx._split_of(a)
    v = ctx.val(a, name) if sp is None else sp.v
    d = ctx.dims(v) if sp is None else sp.dims
    if len(d) < 2:
        raise ctx.refuse(name, "pooling a value with fewer than 2 dims")
    if len(d) > 3:   # torch's 1-D pools take (C, L) or (N, C, L)
        raise ctx.refuse(name, f"1-D pooling of a {len(d)}-D value {_fmt_dims(d)} (torch "
                          "takes 2-D or 3-D input)")
    if sp is not None:
        return _split_pool(ctx, sp, op, k, s, name)
    return ctx.b.pool(op, v, k, s)


def _window_pool(ctx, a: Any, op: str, name: str, k: int = 1, s: int = 1, pad: int = 0,
                 dil: int = 1, ceil: bool = False, incl: bool = True,
                 out: int | None = None) -> Any:
    """1-D pooling by torch's window rules (padding, ceil_mode, dilation,
    count_include_pad; ``out``: the adaptive windows of that many outputs) of a (batch,
    L), (batch, C, L) or (batch, seq, L) value along its last dim: a ``wpool`` node over
    its C channels of L positions (C the features before the last dim). The pooled
    length and torch's own errors come from torch's function on a probe."""
    v, d, kind = ctx._sv(a, name)
    if len(d) < 2 or len(d) > 3:   # torch's 1-D pools take (C, L) or (N, C, L)
        raise ctx.refuse(name, f"1-D pooling of a {len(d)}-D value {splits.fmt(d)} "
                                "(torch takes 2-D or 3-D input)")
    length = d[-1]
    if length in splits.ROW:
        raise ctx.refuse(name, "pools along the batch or a leading dim")
    c = splits.width(d) // length
    probe = torch.zeros(1, 1, length)
    try:
        if out is not None:
            r = (F.adaptive_max_pool1d if op == "max" else F.adaptive_avg_pool1d)(probe, out)
        elif op == "max":
            r = F.max_pool1d(probe, k, s, pad, dil, ceil_mode=ceil)
        else:
            r = F.avg_pool1d(probe, k, s, pad, ceil_mode=ceil, count_include_pad=incl)
    except RuntimeError as exc:
        raise ctx.refuse(name, f"torch raises: {str(exc).splitlines()[0]}") from None
    lo = int(r.shape[-1])
    w = ctx.b.wpool(op, v, c, length, lo, k, s, pad, dil, ceil, incl, out is not None)
    return ctx._mk(w, d[:-1] + (lo,), kind)


def _split_pool(ctx, sp: "_Split", op: str, k: int, s: int, name: str) -> Any:
    """1-D pooling of a (batch, C, L) split value: windows of ``k`` positions every
    ``s`` along L within each channel, the ones that would run past a channel's end
    dropped (as torch's). On the flat row (channel c at features [c * L, (c + 1) *
    L)) window j of channel c starts at ``c * L + j * s``: a multiple of ``g =
    gcd(L, s)``, so the flat pool with stride ``g`` has every such window, and a
    remap picks them ((C, Lo) read at strides (L / g, s / g)); where L is a multiple
    of s and k <= s that pick is every flat window, and the flat pool is the
    result."""
    d = sp.dims   # (boolean and integer operands: refused by _no_bool_operand)
    if d[0] != BATCH or d[1] in splits.ROW:   # pragma: no cover - (batch, C, L) only
        raise ctx._split_refusal(name, sp)
    c, length = d[1], d[2]
    if k > length:
        raise ctx.refuse(name, f"a window of {k} is longer than the {length} positions "
                                f"of each channel of a {splits.fmt(d)} value (torch "
                                "raises)")
    lo = (length - k) // s + 1
    g = math.gcd(length, s)
    r = ctx.b.pool(op, sp.v, k, g)
    r = ctx.b.remap(r, (c, lo), (length // g, s // g))
    return ctx._mk(r, (BATCH, c, lo))

# --- torch.cumsum --------------------------------------------------------------------
def cumsum(ctx, a: Any, dim: Any, kw: dict, name: str) -> Any:
    """torch.cumsum / Tensor.cumsum along a feature dim: a ``scan`` node (within groups
    of a split dim: its size, the features after it apart); along a size-1 dim each
    element itself (added to 0, as torch's sum from 0)."""
    if ctx._is_bool(a) or ctx._is_int(a):
        raise ctx.refuse(name, "a cumulative sum of a boolean or integer tensor (int64 in "
                                "torch); sum `mask.float()` instead")
    ctx._float32_only(kw, name)
    if dim is None:
        raise ctx.refuse(name, "cumsum without a dim (torch raises)")
    v, d, _ = ctx._sv(a, name)
    ax = ctx._feature_dim(d, dim, name, "adds up along")
    pos = [i for i, x in enumerate(d) if x not in splits.ROW and x != 1]
    if d[ax] == 1:
        return ctx._mk(ctx.b.map("add", v, ctx.b.const(0.0)), d)
    g = d[ax]
    s = math.prod(d[i] for i in pos if i > ax)
    return ctx._mk(ctx.b.scan(v, g, s), d)

# --- cosine similarity and pairwise distance (torch's formulas) -----------------------
def _pair(ctx, a: Any, b: Any, name: str) -> tuple:
    """(flat value, torch dims) of two tensor operands and their broadcast dims."""
    for x in (a, b):
        if not (ctx.is_tensor_like(x) or ctx._is_bool(x) or ctx._is_int(x)):
            raise ctx.refuse(name, "an operand that is not a tensor (torch raises)")
    v1, d1, _ = ctx._sv(a, name)
    v2, d2, _ = ctx._sv(b, name)
    try:
        out = splits.broadcast_all([d1, d2], name)
    except TailError as exc:
        raise ctx.err(str(exc)) from None
    if BATCH not in out:
        raise ctx.refuse(name, "operands without the batch dimension")
    return v1, d1, v2, d2, out


def cosine_similarity(ctx, a: Any, b: Any, dim: Any, eps: Any, name: str) -> Any:
    """F.cosine_similarity / nn.CosineSimilarity as torch computes it (ATen's
    cosine_similarity): each operand divided by its 2-norm along ``dim`` clamped below
    at ``eps``, then the sum of the products along ``dim``. Boolean and integer
    operands are converted to float as torch does."""
    eps = ctx.number(eps, name)
    v1, d1, v2, d2, out = _pair(ctx, a, b, name)
    ax = ctx._feature_dim(out, dim, name, "reduces along", seq=True)
    b_ = ctx.b

    def unit(v: int, d: tuple) -> int:
        k = ax - (len(out) - len(d))
        if k < 0 or d[k] != out[ax]:
            raise ctx.refuse(name, f"an operand of shape {splits.fmt(d)} broadcast along "
                                    f"dim {dim} of {splits.fmt(out)} (torch takes the norm "
                                    "of the expanded operand): expand it first")
        n, nd_ = splits.norm(b_, v, d, [k], 2.0, True)
        n = b_.map("clamp", n, attrs=(eps, math.inf))
        u = b_.map("div", v, splits.layout(b_, n, nd_, d))
        return splits.layout(b_, u, d, out)

    prod = b_.map("mul", unit(v1, d1), unit(v2, d2))
    r, rd = splits.reduce(b_, "sum", prod, out, [ax], False)
    return ctx._mk(r, rd)


def pairwise_distance(ctx, a: Any, b: Any, p: Any, eps: Any, keepdim: Any,
                      name: str) -> Any:
    """F.pairwise_distance / nn.PairwiseDistance as torch computes it:
    ``norm(x1 - x2 + eps, p)`` along the last dim of the broadcast operands."""
    ctx._no_bool_operand(a, name)
    ctx._no_bool_operand(b, name)
    eps, p = ctx.number(eps, name), _norm_order(ctx, p, name)
    if not isinstance(keepdim, bool):
        raise ctx.refuse(name, f"keepdim={keepdim!r} is not a bool (torch raises)")
    v1, d1, v2, d2, out = _pair(ctx, a, b, name)
    b_ = ctx.b
    diff = b_.map("add", b_.map("sub", splits.layout(b_, v1, d1, out),
                                splits.layout(b_, v2, d2, out)), b_.const(eps))
    ax = len(out) - 1
    if out[ax] == BATCH:
        raise ctx.refuse(name, f"a distance along the batch dimension (operands of shape "
                                f"{splits.fmt(out)})")
    r, rd = splits.norm(b_, diff, out, [ax], p, keepdim)
    return ctx._mk(r, rd)


# --- spellings ---------------------------------------------------------------------------
@lowering.function(*_REDUCE_FUNCS)
def _reduce_fn(ctx, node, args, kw, name):
    f = node.target
    if f in (torch.max, torch.min) and len(args) >= 2 and ctx.is_tensor_like(args[1]) \
            and "dim" not in kw:   # torch.max(a, b): elementwise
        return elementwise.binary(ctx, "maximum" if f is torch.max else "minimum", args[0],
                                  args[1], None, name, None)
    return reduction(ctx, _REDUCE_FUNCS[f], args, kw, name)


@lowering.method(*_REDUCE_METHODS)
def _reduce_method(ctx, node, self_, args, kw, name):
    m = node.target
    if m in ("max", "min") and len(args) >= 2 and ctx.is_tensor_like(args[1]):
        return elementwise.binary(ctx, "maximum" if m == "max" else "minimum", self_, args[1],
                                  None, name, None)
    return reduction(ctx, m, args, kw, name)


@lowering.function(torch.cosine_similarity)
def _cosine_fn(ctx, node, args, kw, name):
    return cosine_similarity(ctx, args[0], _arg(args, kw, 1, "x2"), _arg(args, kw, 2, "dim", 1),
                             _arg(args, kw, 3, "eps", 1e-8), name)


@lowering.function(torch.pairwise_distance)
def _pairwise_fn(ctx, node, args, kw, name):
    return pairwise_distance(ctx, args[0], _arg(args, kw, 1, "x2"), _arg(args, kw, 2, "p", 2.0),
                             _arg(args, kw, 3, "eps", 1e-6), _arg(args, kw, 4, "keepdim", False),
                             name)


@lowering.function(torch.cumsum)
def _cumsum_fn(ctx, node, args, kw, name):
    return cumsum(ctx, args[0], _arg(args, kw, 1, "dim"), kw, name)


@lowering.method("cumsum")
def _cumsum_method(ctx, node, self_, args, kw, name):
    return cumsum(ctx, self_, _arg(args, kw, 1, "dim"), kw, name)


@lowering.function(F.softmin)
def _softmin_fn(ctx, node, args, kw, name):
    dim = _arg(args, kw, 1, "dim")
    if dim is None:
        dim = _implicit_softmax_dim(ctx, args[0], name, "softmin")
    return ctx.b.softmax(ctx.b.map("neg", ctx.val(args[0], name)), dim)


@lowering.function(torch.softmax, F.softmax, torch.log_softmax, F.log_softmax)
def _softmax_fn(ctx, node, args, kw, name):
    f = node.target
    ctx._float32_only(kw, name, args)
    dim = _arg(args, kw, 1, "dim")
    if dim is None and f in (F.softmax, F.log_softmax):
        dim = _implicit_softmax_dim(ctx, args[0], name)
    if dim is None:   # (torch.softmax and torch.log_softmax need one: torch raises)
        raise ctx.refuse(name, "softmax without an explicit dim (torch raises)")
    return ctx.b.softmax(ctx.val(args[0], name), dim, log=f in (torch.log_softmax, F.log_softmax))


@lowering.method("softmax", "log_softmax")
def _softmax_method(ctx, node, self_, args, kw, name):
    ctx._no_bool_operand(self_, name)
    ctx._float32_only(kw, name, args)
    return ctx.b.softmax(ctx.val(self_, name), _arg(args, kw, 1, "dim"),
                         log=node.target == "log_softmax")


@lowering.function(F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d, F.adaptive_max_pool1d)
def _adaptive_pool_fn(ctx, node, args, kw, name):
    return adaptive_pool1d(ctx, args[0], "max" if node.target is F.adaptive_max_pool1d else "avg",
                           _arg(args, kw, 1, "output_size"), kw.get("return_indices", False), name)


@lowering.function(F.max_pool1d_with_indices, F.adaptive_max_pool1d_with_indices)
def _pool_indices_fn(ctx, node, args, kw, name):
    # (F.max_pool1d(..., return_indices=True) as fx records it)
    raise ctx.refuse(name, "pooling with indices (return_indices=True): the indices are not "
                           "fused")


@lowering.function(F.max_pool1d, F.avg_pool1d)
def _pool_fn(ctx, node, args, kw, name):
    # (input, kernel_size, stride, padding, dilation, ceil_mode, return_indices) for max;
    # (input, kernel_size, stride, padding, ceil_mode, count_include_pad) for avg
    mx = node.target is F.max_pool1d
    k = _arg(args, kw, 1, "kernel_size")
    s = _arg(args, kw, 2, "stride", None)
    if s is None or isinstance(s, (tuple, list)) and not s:
        s = k   # torch's default stride: the kernel size
    return pool1d(ctx, args[0], "max" if mx else "avg", k, s, _arg(args, kw, 3, "padding", 0),
                  _arg(args, kw, 5 if mx else 4, "ceil_mode", False),
                  _arg(args, kw, 4, "dilation", 1) if mx else 1,
                  _arg(args, kw, 6, "return_indices", False) if mx else False,
                  name, True if mx else _arg(args, kw, 5, "count_include_pad", True))


@lowering.function(F.normalize)
def _normalize_fn(ctx, node, args, kw, name):
    p = _arg(args, kw, 1, "p", 2.0)
    dim = _arg(args, kw, 2, "dim", 1)
    eps = _arg(args, kw, 3, "eps", 1e-12)
    v = ctx.val(args[0], name)
    n = ctx.b.norm(v, dim, _norm_order(ctx, p, name), True)
    return ctx.b.map("div", v, ctx.b.map("clamp", n, attrs=(eps, math.inf)))


@lowering.module(nn.Softmin)
def _softmin_module(ctx, node, mod, a, name):
    dim = mod.dim if mod.dim is not None else _implicit_softmax_dim(ctx, a, name, "softmin")
    return ctx.b.softmax(ctx.b.map("neg", ctx.val(a, name)), dim)


@lowering.module(nn.Softmax, nn.LogSoftmax)
def _softmax_module(ctx, node, mod, a, name):
    dim = mod.dim if mod.dim is not None else _implicit_softmax_dim(ctx, a, name)
    return ctx.b.softmax(ctx.val(a, name), dim, log=isinstance(mod, nn.LogSoftmax))


@lowering.module(nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d)
def _adaptive_pool_module(ctx, node, mod, a, name):
    return adaptive_pool1d(ctx, a, "avg" if isinstance(mod, nn.AdaptiveAvgPool1d) else "max",
                           mod.output_size, getattr(mod, "return_indices", False), name)


@lowering.module(nn.MaxPool1d, nn.AvgPool1d)
def _pool_module(ctx, node, mod, a, name):
    return pool1d(ctx, a, "max" if isinstance(mod, nn.MaxPool1d) else "avg", mod.kernel_size,
                  mod.stride, mod.padding, mod.ceil_mode, getattr(mod, "dilation", 1),
                  getattr(mod, "return_indices", False), name,
                  getattr(mod, "count_include_pad", True))


@lowering.module(nn.CosineSimilarity)
def _cosine_module(ctx, node, mod, a, name):
    return cosine_similarity(ctx, a, node.args[1] if len(node.args) > 1 else
                             node.kwargs.get("x2"), mod.dim, mod.eps, name)


@lowering.module(nn.PairwiseDistance)
def _pairwise_module(ctx, node, mod, a, name):
    return pairwise_distance(ctx, a, node.args[1] if len(node.args) > 1 else
                             node.kwargs.get("x2"), mod.norm, mod.eps, mod.keepdim, name)


# --- topk: the k largest features of each row, and their positions -------------------------
def topk(ctx, a: Any, k: Any, dim: Any, largest: Any, name: str) -> _Tuple:
    """``torch.topk(h, k, dim=-1)`` of a (batch, N) value (a router's gate): k rounds of a
    row maximum and its first position (``argmax``: NaN counts as the largest, as in
    torch's order), the positions taken masked to -inf for the next round; where only
    -inf is left, the first position not yet taken. Values (batch, k) and positions
    (batch, k, int64), largest first (``sorted=False`` gets that order too); among equal
    values the lowest position first (torch leaves that order unspecified). Gradients go
    to the picked positions, as torch's."""
    b = ctx.b
    v = ctx.val(a, name)
    d = ctx.dims(v)
    if len(d) != 2 or d[0] != BATCH:
        raise ctx.refuse(name, f"topk of a {_fmt_dims(d)} value: cupyfuse takes the top k "
                               "features of (batch, N) values")
    if dim not in (-1, 1):
        raise ctx.refuse(name, f"topk along dim {dim}: cupyfuse takes it along the features "
                               "(dim=-1)")
    if largest is not True:
        raise ctx.refuse(name, "topk with largest=False (torch's order puts NaN last there): "
                               "take `torch.topk(-h, k)` and negate the values")
    n = d[1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(n, 64):
        raise ctx.refuse(name, f"k={k!r}: cupyfuse takes 1 <= k <= min(N, 64) with N = {n}")
    pos = b.iota(n, 0.0, 1.0)
    taken = None
    vals, idxs = [], []
    for j in range(k):
        cur = v if taken is None else b.map("where", taken, b.const(-math.inf), v)
        m = b.reduce("max", cur, 1, True, "index")   # (the gradient to the one picked)
        i = b.argreduce("argmax", cur, 1, True)
        if taken is not None:
            # only -inf left: argmax may name a position taken before; the first free one
            free = b.argreduce("argmax", b.map("where", taken, b.const(0.0), b.const(1.0)),
                               1, True)
            i = b.map("where", b.map("eq", m, b.const(-math.inf)), free, i)
        hit = b.map("eq", pos, i)
        taken = hit if taken is None else b.map("maximum", taken, hit)
        vals.append(m)
        idxs.append(i)
    values = b.cat(vals, 1, name)
    index = b.cat(idxs, 1, name)
    return _Tuple((values, _Indices(lambda: _Index(Val(index)), "topk")))


@lowering.function(torch.topk)
def _topk_fn(ctx, node, args, kw, name):
    return topk(ctx, args[0], _arg(args, kw, 1, "k"), _arg(args, kw, 2, "dim", -1),
                _arg(args, kw, 3, "largest", True), name)


@lowering.method("topk")
def _topk_method(ctx, node, self_, args, kw, name):
    return topk(ctx, self_, _arg(args, kw, 1, "k"), _arg(args, kw, 2, "dim", -1),
                _arg(args, kw, 3, "largest", True), name)
