"""Indexing in a traced forward (:mod:`cupyfuse.frontend.translate`): ``h[...]`` (integers, plain
slices, None, an ellipsis; one position of a sequence) of plain and split values, select,
unbind and narrow along feature dims, and the one-hot scatter of a number at integer
indices (``t.scatter_(1, labels.view(-1, 1).long(), 1)``).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

from cupyfuse.ir import splits
from cupyfuse.frontend.values import Val, _Bool, _Const, _Int, _RawInt, _Split, _Tuple
from cupyfuse.ir.program import BATCH, LEAD, LEAD_WHY, _fmt_dims
from cupyfuse.frontend import lower as lowering
from cupyfuse.frontend.tables import _arg


# --- h[...]: integers, plain slices, None --------------------------------------------
def getitem(ctx, a: Any, idx: Any) -> Val:
    """h[:, a:b] and the like: plain slices (step 1) along the features, integers (one
    feature, its dim dropped), None (a new size-1 dim); the batch dim taken whole."""
    what = "indexing/slicing a tensor"
    v = ctx.val(a, what)
    d = ctx.dims(v)
    idx = idx if isinstance(idx, tuple) else (idx,)
    if sum(i is Ellipsis for i in idx) > 1:
        raise ctx.refuse(what, "more than one ellipsis")
    nnew = sum(i is None for i in idx)   # new axes take no dim of the value
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        idx = idx[:k] + (slice(None),) * max(0, len(d) - (len(idx) - 1 - nnew)) + idx[k + 1:]
    if len(idx) - nnew > len(d):
        raise ctx.refuse(what, "more indices than dims")
    idx = idx + (slice(None),) * (len(d) - (len(idx) - nnew))
    ax, kinds = 0, []   # per entry of idx: "new", "drop" (an integer) or "keep"
    for it in idx:
        if it is None:
            kinds.append("new")
            continue
        ax += 1
        if isinstance(it, int) and not isinstance(it, (bool, Val)):
            # one feature (or the only element of a size-1 dim), its dim dropped
            if d[ax - 1] == BATCH:
                raise ctx.refuse(what, "indexes the batch dimension")
            if d[ax - 1] == LEAD:   # one position of the sequence (h[:, 0], h[:, -1])
                s = ctx.b.size(v, ax - 1, what)
                i = it + s if it < 0 else it
                if not 0 <= i < s:
                    raise ctx.refuse(what, f"index {it} out of range for a sequence of "
                                            f"{s} (torch raises IndexError)")
                v = ctx.b.seq_take(v, ax - 1, i, 1, what)
                kinds.append("drop")
                continue
            i = it + d[ax - 1] if it < 0 else it
            if not 0 <= i < d[ax - 1]:
                raise ctx.refuse(what, f"index {it} out of range for size {d[ax - 1]}")
            if d[ax - 1] > 1:
                v = ctx.b.slice(v, ax - 1, i, 1, what)
            kinds.append("drop")
            continue
        kinds.append("keep")
        if isinstance(it, slice) and it == slice(None):
            continue
        _plain_slice(ctx, it, what)
        if d[ax - 1] == BATCH:
            raise ctx.refuse(what, "slices the batch dimension")
        if d[ax - 1] == LEAD:   # h[:, -1:]: one position of the sequence, kept as a dim
            start, stop, _ = it.indices(ctx.b.size(v, ax - 1, what))
            if stop - start != 1:
                raise ctx.refuse(what, "slices a leading (sequence) dim (positions "
                                  f"{start}:{stop}): cupyfuse takes one position of a "
                                  "sequence (h[:, k] or h[:, k:k + 1]) or reduces over "
                                  "it, and otherwise fuses ops along the last dim, row "
                                  "by row")
            v = ctx.b.seq_take(v, ax - 1, start, 1, what)
            continue
        start, stop, _ = it.indices(d[ax - 1])
        if stop <= start:
            raise ctx.refuse(what, "an empty slice")
        v = ctx.b.slice(v, ax - 1, start, stop - start, what)
    if "new" in kinds or "drop" in kinds:
        cur, out, ax = ctx.dims(v), [], 0
        for k in kinds:
            if k == "new":
                out.append(1)
                continue
            if k == "keep":
                out.append(cur[ax])
            ax += 1
        v = ctx.b.view(v, out)
    return Val(v)


def _plain_slice(ctx, it: Any, what: str) -> None:
    """An index item of a getitem that is not an int or None: a plain slice (unit
    step, int bounds) or refused."""
    if not isinstance(it, slice) or it.step not in (None, 1) or not all(
            x is None or (isinstance(x, int) and not isinstance(x, (bool, Val)))
            for x in (it.start, it.stop)):
        raise ctx.refuse(what, "only plain slices of the features (h[:, a:b]), "
                          "integers and None (a new axis) are fused, not tensor, "
                          "stepped or computed indices")


def _index_sv(ctx, a: Any, idx: Any) -> Any:
    """h[...] of a split value: integers (an entry, its dim dropped), plain slices
    (step 1) and None (a new size-1 dim) along the feature dims."""
    what = "indexing/slicing a tensor"
    v, d, kind = ctx._sv(a, what)
    idx = idx if isinstance(idx, tuple) else (idx,)
    if sum(i is Ellipsis for i in idx) > 1:
        raise ctx.refuse(what, "more than one ellipsis")
    nnew = sum(i is None for i in idx)
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        idx = idx[:k] + (slice(None),) * max(0, len(d) - (len(idx) - 1 - nnew)) + idx[k + 1:]
    if len(idx) - nnew > len(d):
        raise ctx.refuse(what, "more indices than dims")
    idx = idx + (slice(None),) * (len(d) - (len(idx) - nnew))
    ax, kinds = 0, []
    for it in idx:
        if it is None:
            kinds.append("new")
            continue
        ax += 1
        if isinstance(it, int) and not isinstance(it, (bool, Val)):
            if d[ax - 1] == BATCH:
                raise ctx.refuse(what, "indexes the batch dimension")
            if d[ax - 1] == LEAD:
                raise ctx.refuse(what, "indexes a leading (sequence) dim: " + LEAD_WHY)
            i = it + d[ax - 1] if it < 0 else it
            if not 0 <= i < d[ax - 1]:
                raise ctx.refuse(what, f"index {it} out of range for size {d[ax - 1]}")
            v, d = _pick(ctx, v, d, ax - 1, i, 1, what)
            kinds.append("drop")
            continue
        kinds.append("keep")
        if isinstance(it, slice) and it == slice(None):
            continue
        _plain_slice(ctx, it, what)
        if d[ax - 1] in (BATCH, LEAD):
            raise ctx.refuse(what, "slices the batch dimension" if d[ax - 1] == BATCH
                              else "slices a leading (sequence) dim: " + LEAD_WHY)
        start, stop, _ = it.indices(d[ax - 1])
        if stop <= start:
            raise ctx.refuse(what, "an empty slice")
        v, d = _pick(ctx, v, d, ax - 1, start, stop - start, what)
    out, ax = [], 0
    for k in kinds:
        if k == "new":
            out.append(1)
            continue
        if k == "keep":
            out.append(d[ax])
        ax += 1
    return ctx._mk(v, out, kind)

# --- select, unbind, narrow ----------------------------------------------------------
def _pick(ctx, v: int, d: tuple[int, ...], ax: int, start: int, length: int,
          name: str) -> tuple[int, tuple[int, ...]]:
    """Entries [start, start + length) of feature dim ``ax`` (refusing the batch and
    leading dims, and ranges torch refuses)."""
    if d[ax] == BATCH:
        raise ctx.refuse(name, "slices the batch dimension")
    if d[ax] == LEAD:
        raise ctx.refuse(name, "slices a leading (sequence) dim: " + LEAD_WHY)
    if length < 1:
        raise ctx.refuse(name, f"an empty slice (entries [{start}, {start + length}))")
    if not (0 <= start and start + length <= d[ax]):
        raise ctx.refuse(name, f"entries [{start}, {start + length}) of {d[ax]} (torch "
                                "raises)")
    return splits.narrow(ctx.b, v, d, ax, start, length)


def select(ctx, a: Any, dim: Any, index: Any, name: str) -> Any:
    """``select(dim, i)``: entry i of a feature dim, the dim dropped."""
    v, d, kind = ctx._sv(a, name)
    ax = ctx._dim(dim, len(d), name)
    if d[ax] == BATCH:
        raise ctx.refuse(name, "indexes the batch dimension")
    if d[ax] == LEAD and ctx._split_of(a) is None:
        # h.select(1, k) of a (batch, seq, features) value: h[:, k] (one position)
        i = ctx._int(index, "index", name)
        return ctx._wrap(kind, int(getitem(ctx, a, (slice(None),) * ax + (i,))))
    if d[ax] == LEAD:
        raise ctx.refuse(name, "indexes a leading (sequence) dim: " + LEAD_WHY)
    i = ctx._int(index, "index", name)
    if not -d[ax] <= i < d[ax]:
        raise ctx.refuse(name, f"index {i} out of range for size {d[ax]} (torch raises)")
    r, out = _pick(ctx, v, d, ax, i % d[ax], 1, name)
    return ctx._mk(r, out[:ax] + out[ax + 1:], kind)


def unbind(ctx, a: Any, dim: Any, name: str) -> "_Tuple":
    """``unbind(dim)``: the entries of a feature dim, each with the dim dropped."""
    _, d, _ = ctx._sv(a, name)
    ax = ctx._dim(dim, len(d), name)
    if d[ax] in (BATCH, LEAD):
        raise ctx.refuse(name, "unbinds the batch dimension" if d[ax] == BATCH else
                          "unbinds a leading (sequence) dim: " + LEAD_WHY)
    items = []
    for i in range(d[ax]):
        r = select(ctx, a, ax, i, name)
        items.append(r if isinstance(r, _Split) else _item(ctx, r))
    return _Tuple(tuple(items))


def _item(ctx, r: Any) -> Any:
    """A piece of a tuple result: a plain float value as its id (as chunk's pieces)."""
    if isinstance(r, (_Bool, _Int)):
        raise ctx.refuse("unbind", "pieces of a boolean or integer tensor (unbind "
                                    "`mask.float()`)")
    return int(r)


def _narrow_sv(ctx, a: Any, dim: Any, start: Any, length: Any, name: str) -> Any:
    v, d, kind = ctx._sv(a, name)
    ax = ctx._dim(dim, len(d), name)
    start, length = ctx._int(start, "start", name), ctx._int(length, "length", name)
    if start < 0:
        start += d[ax] if d[ax] > 0 else 0
    r, out = _pick(ctx, v, d, ax, start, length, name)
    return ctx._mk(r, out, kind)

# --- scatter of a number at integer indices (a one-hot) -----------------------------
def scatter(ctx, base: Any, dim: Any, idx: "_RawInt", value: Any, kw: dict,
            name: str) -> Any:
    """``t.scatter_(1, labels.view(-1, 1).long(), 1)`` (ArcFace's one-hot) of a (batch,
    N) tensor ``t``: ``value`` where a feature's position equals one of the row's
    indices (an ``iota`` compared with each), ``t`` elsewhere. The indices are an
    integer input (read as float32: exact for positions below 2**24, and every
    position of N < 2**24 features is). An index outside [0, N) makes the row NaN,
    where torch raises (no host sync on the GPU to raise there)."""
    if kw.get("reduce") is not None:
        raise ctx.refuse(name, f"scatter with reduce={kw['reduce']!r}")
    if not idx.int64:
        raise ctx.refuse(name, f"indices {idx.label} not cast to int64 in the forward "
                                "(torch's scatter takes int64 indices): write "
                                f"`{idx.label.strip('`')}.long()`")
    if isinstance(value, torch.fx.Node):
        e = ctx.env.get(value)
        value = e.v if isinstance(e, _Const) else e
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            isinstance(value, Val):
        raise ctx.refuse(name, "a scatter of a tensor (src): cupyfuse scatters a number "
                                "(value), a one-hot")
    if ctx._split_of(base) is not None or not ctx.is_tensor_like(base):
        raise ctx.refuse(name, "a scatter into something other than a (batch, N) "
                                "float tensor")
    b = ctx.b
    bv = ctx.val(base, name)
    bd = ctx.dims(bv)
    if len(bd) != 2 or bd[0] != BATCH or ctx._dim(dim, 2, name) != 1:
        raise ctx.refuse(name, f"a scatter along dim {dim} of a {_fmt_dims(bd)} tensor: "
                                "cupyfuse scatters along the features of a (batch, N) "
                                "tensor")
    idd = ctx.dims(idx.v)
    if len(idd) != 2 or idd[0] != BATCH:
        raise ctx.refuse(name, f"indices of shape {_fmt_dims(idd)}: (batch, k) indices "
                                "go with a (batch, N) tensor")
    n = max(bd[1], 1)
    pos = b.iota(n, 0.0, 1.0)
    hit = ok = None
    for j in range(max(idd[1], 1)):
        ij = b.slice(idx.v, 1, j, 1, name) if idd[1] > 1 else idx.v
        e = b.map("eq", ij, pos)
        hit = e if hit is None else b.map("maximum", hit, e)
        inside = b.map("mul", b.map("ge", ij, b.const(0.0)),
                       b.map("lt", ij, b.const(float(n))))
        ok = inside if ok is None else b.map("mul", ok, inside)
    r = b.map("where", hit, b.const(float(value)), bv)
    return Val(b.map("where", ok, r, b.const(math.nan)))


# --- spellings ---------------------------------------------------------------------------
@lowering.function(torch.select)
def _select_fn(ctx, node, args, kw, name):
    return select(ctx, args[0], _arg(args, kw, 1, "dim"), _arg(args, kw, 2, "index"), name)


@lowering.function(torch.unbind)
def _unbind_fn(ctx, node, args, kw, name):
    return unbind(ctx, args[0], _arg(args, kw, 1, "dim", 0), name)


@lowering.function(torch.narrow)
def _narrow_fn(ctx, node, args, kw, name):
    return Val(ctx.b.slice(ctx.val(args[0], name), _arg(args, kw, 1, "dim"),
                           _arg(args, kw, 2, "start"), _arg(args, kw, 3, "length"), name))


@lowering.method("__getitem__")
def _getitem_method(ctx, node, self_, args, kw, name):
    return getitem(ctx, self_, args[1])


@lowering.method("select")
def _select_method(ctx, node, self_, args, kw, name):
    return select(ctx, self_, _arg(args, kw, 1, "dim"), _arg(args, kw, 2, "index"), name)


@lowering.method("unbind")
def _unbind_method(ctx, node, self_, args, kw, name):
    return unbind(ctx, self_, _arg(args, kw, 1, "dim", 0), name)


@lowering.method("narrow")
def _narrow_method(ctx, node, self_, args, kw, name):
    return Val(ctx.b.slice(ctx.val(self_, name), _arg(args, kw, 1, "dim"),
                           _arg(args, kw, 2, "start"), _arg(args, kw, 3, "length"), name))
