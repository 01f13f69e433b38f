"""Pieces and joins in a traced forward (:mod:`cupyfuse.frontend.translate`): chunk and split of plain
and split values (a tuple of pieces), torch.cat of split values, and torch.stack (after
the batch: a value whose features are split into several dims; before it, ``dim=0``: a
``_Stacked`` value) with the ops that read a stack along dim 0 (``_stacked_call``:
reductions over that dim, indexing it, elementwise ops with numbers).
"""
from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx

from cupyfuse.ir import splits
from cupyfuse.frontend.tables import _IDENTITY_METHODS, _REDUCE_FUNCS, _REDUCE_METHODS, _arg
from cupyfuse.frontend.values import (Val, _Bool, _Const, _DEVICE, _Device, _Indices, _Int, _Split,
                             _Stacked, _Tuple, _sizes)
from cupyfuse.ir.program import BATCH, LEAD, LEAD_WHY, TailError
from cupyfuse.frontend import lower as lowering
from cupyfuse.frontend.lower import indexing, reductions


# --- chunk and split -----------------------------------------------------------------
def chunk(ctx, a: Any, chunks: Any, dim: Any, name: str) -> "_Tuple":
    """torch.chunk: pieces of ceil(width / chunks) features, the last one shorter."""
    chunks = ctx._int(chunks, "chunks", name)
    v, ax, w = ctx._sections(a, dim, name)
    size = -(-w // int(chunks))
    return _pieces(ctx, v, ax, [min(size, w - s) for s in range(0, w, size)], name)


def split(ctx, a: Any, sizes: Any, dim: Any, name: str) -> "_Tuple":
    if isinstance(sizes, (list, tuple)):
        sizes = [ctx._int(x, "a split size", name) for x in sizes]
    else:
        sizes = ctx._int(sizes, "split_size", name)
    v, ax, w = ctx._sections(a, dim, name)
    if isinstance(sizes, int):
        sizes = [min(sizes, w - s) for s in range(0, w, sizes)]
    if sum(sizes) != w:
        raise ctx.err(f"{name}: sections {sizes} do not add up to {w} features")
    return _pieces(ctx, v, ax, sizes, name)



def _pieces(ctx, v: int, ax: int, sizes: list[int], name: str) -> "_Tuple":
    items, start = [], 0
    for n in sizes:
        items.append(ctx.b.slice(v, ax, start, n, name))
        start += n
    return _Tuple(tuple(items))


def _chunk_sv(ctx, a: Any, chunks: Any, dim: Any, name: str) -> "_Tuple":
    chunks = ctx._int(chunks, "chunks", name)
    _, d, _ = ctx._sv(a, name)
    ax = ctx._dim(dim, len(d), name)
    if d[ax] in (BATCH, LEAD):
        raise ctx.refuse(name, "splits the batch dimension" if d[ax] == BATCH else
                          "splits a leading (sequence) dim: " + LEAD_WHY)
    if chunks < 1:
        raise ctx.refuse(name, f"chunks {chunks} (torch raises)")
    w = d[ax]
    size = -(-w // chunks)
    return _pieces_sv(ctx, a, ax, [min(size, w - s) for s in range(0, w, size)], name)


def _split_sv(ctx, a: Any, sizes: Any, dim: Any, name: str) -> "_Tuple":
    _, d, _ = ctx._sv(a, name)
    ax = ctx._dim(dim, len(d), name)
    if d[ax] in (BATCH, LEAD):
        raise ctx.refuse(name, "splits the batch dimension" if d[ax] == BATCH else
                          "splits a leading (sequence) dim: " + LEAD_WHY)
    w = d[ax]
    if isinstance(sizes, (list, tuple)):
        sizes = [ctx._int(x, "a split size", name) for x in sizes]
    else:
        n = ctx._int(sizes, "split_size", name)
        if n < 1:
            raise ctx.refuse(name, f"split_size {n} (torch raises)")
        sizes = [min(n, w - s) for s in range(0, w, n)]
    if sum(sizes) != w:
        raise ctx.err(f"{name}: sections {sizes} do not add up to {w} features")
    return _pieces_sv(ctx, a, ax, sizes, name)


def _pieces_sv(ctx, a: Any, ax: int, sizes: list[int], name: str) -> "_Tuple":
    v, d, kind = ctx._sv(a, name)
    items, start = [], 0
    for n in sizes:
        r, out = indexing._pick(ctx, v, d, ax, start, n, name)
        r = ctx._mk(r, out, kind)
        items.append(r if isinstance(r, _Split) else indexing._item(ctx, r))
        start += n
    return _Tuple(tuple(items))

# --- torch.cat of split values -------------------------------------------------------
def _split_cat(ctx, seq: Any, dim: Any, name: str) -> Any:
    """torch.cat of split values along their outermost feature dim (their flat
    features one after the other); along an inner dim refused (it interleaves)."""
    pieces = ctx.env.get(seq) if isinstance(seq, torch.fx.Node) else None
    if isinstance(pieces, _Tuple):
        if any(isinstance(i, _Indices) for i in pieces.items):
            raise ctx.refuse(name, "the indices of max/min are not fused")
        items = [i if isinstance(i, _Split) else Val(i) for i in pieces.items]
    elif isinstance(seq, (tuple, list)):
        items = [ctx.env[x] if isinstance(x, torch.fx.Node) else x for x in seq]
    else:
        raise ctx.refuse(name, "a sequence of tensors built at run time")
    svs = []
    for it in items:
        if isinstance(it, _Split):
            svs.append((it.v, it.dims, it.kind))
        elif isinstance(it, Val):
            d = ctx.dims(int(it))
            svs.append((ctx.b.view(int(it), splits.flat_dims(d)), d, "f"))
        else:
            raise ctx.refuse(name, "joins a value split into several dims with "
                                    "something other than float tensors of the batch")
    d0 = svs[0][1]
    ax = ctx._dim(dim, len(d0), name)
    if any(len(d) != len(d0) or any(x != y for i, (x, y) in enumerate(zip(d, d0)) if i != ax)
           for _, d, _ in svs):
        raise ctx.refuse(name, "values of shapes " + " and ".join(
            splits.fmt(d) for _, d, _ in svs) + " differ outside the joined dim "
            "(torch raises)")
    if d0[ax] in splits.ROW:
        raise ctx.refuse(name, "joins along the batch dimension" if d0[ax] == BATCH
                          else "joins along a leading (sequence) dim: " + LEAD_WHY)
    if any(x not in splits.ROW and x != 1 for x in d0[:ax]) or \
            any(k != "f" for _, _, k in svs):
        raise ctx.refuse(name, f"joins values of shape {splits.fmt(d0)} along dim {dim}, "
                                "an inner one of their split features (each row's "
                                "features would interleave): join along their outermost "
                                "feature dim, or reshape them to their features first "
                                "(`.flatten(...)`) and join those")
    total = sum(d[ax] for _, d, _ in svs)
    r = ctx.b.cat([v for v, _, _ in svs], len(splits.flat_dims(d0)) - 1, name)
    return ctx._mk(r, d0[:ax] + (total,) + d0[ax + 1:])

# --- torch.stack ---------------------------------------------------------------------
def _seq_entries(ctx, seq: Any, name: str) -> list:
    """The entries of a sequence of tensors (a list or tuple written in the forward, or
    the pieces of a chunk/split/unbind)."""
    pieces = ctx.env.get(seq) if isinstance(seq, torch.fx.Node) else None
    if isinstance(pieces, _Tuple):
        if any(isinstance(i, _Indices) for i in pieces.items):
            raise ctx.refuse(name, "the indices of max/min are not fused")
        return list(pieces.items)
    if isinstance(seq, (tuple, list)):
        return [ctx.env[x] if isinstance(x, torch.fx.Node) else x for x in seq]
    raise ctx.refuse(name, "a sequence of tensors built at run time")


def _entry_sv(ctx, e: Any, name: str) -> tuple[int, tuple[int, ...], str]:
    """(flat program value, torch dims, kind) of an entry of a sequence of tensors."""
    if isinstance(e, _Split):
        return e.v, e.dims, e.kind
    if isinstance(e, (_Bool, _Int)):
        v, kind = e.v, "b" if isinstance(e, _Bool) else "i"
    elif type(e) in (int, Val):
        v, kind = int(e), "f"
    else:
        raise ctx.refuse(name, "stacks something other than tensors computed from the "
                                "batch rows (a parameter, a number, a stack)")
    d = ctx.dims(v)
    if BATCH not in d:
        raise ctx.refuse(name, "stacks values without a batch dimension")
    return ctx.b.view(v, splits.flat_dims(d)), d, kind


def stack(ctx, seq: Any, dim: Any, kw: dict, name: str) -> Any:
    """``torch.stack(values, dim)`` of k values of one shape: a new dim of size k. At or
    after the batch and leading dims it is a value whose features are split into
    several dims: the values' flat features one after the other (their ``cat``),
    gathered by a ``remap`` where the new dim is not the outermost feature dim
    (``dim=-1`` of (batch, N) values: (batch, N, k), entry (n, j) is feature j * N + n
    of the cat). Before the batch (``dim=0``) it is a :class:`_Stacked`."""
    entries = _seq_entries(ctx, seq, name)
    if not entries:
        raise ctx.refuse(name, "an empty sequence (torch raises)")
    svs = [_entry_sv(ctx, e, name) for e in entries]
    d0 = svs[0][1]
    if any(d != d0 for _, d, _ in svs):
        raise ctx.refuse(name, "values of shapes " + ", ".join(
            splits.fmt(d) for _, d, _ in svs) + " (torch raises: stack expects each "
            "tensor to be equal size)")
    kinds = {k for _, _, k in svs}
    # torch's type promotion: a float among them makes floats, else bool and integer
    # make integers
    kind = kinds.pop() if len(kinds) == 1 else "f" if "f" in kinds else "i"
    k = len(svs)
    ax = ctx._dim(dim, len(d0) + 1, name)
    out = d0[:ax] + (k,) + d0[ax:]
    if k == 1:   # (an unsqueeze)
        return ctx._mk(svs[0][0], out, kind)
    flat_ax = len(splits.flat_dims(d0)) - 1
    cat = ctx.b.cat([v for v, _, _ in svs], flat_ax, name)
    if any(x in splits.ROW for x in d0[ax:]):
        if BATCH in d0[:ax]:
            raise ctx.refuse(name, f"stacks along dim {dim} of {splits.fmt(d0)} values, "
                              "between the batch and a leading (sequence) dim: stack "
                              "along a dim after the sequence, e.g. `dim=-1`")
        # before the batch: the stacked dim goes right after the row marks, where the
        # cat's flat features put it (the outermost feature dim)
        p = max(i for i, x in enumerate(d0) if x in splits.ROW) + 1
        return _Stacked(_Split(cat, d0[:p] + (k,) + d0[p:], kind), p, tuple(entries))
    W = splits.width(d0)
    r = cat
    if W > 1:
        feats = list(splits.feat_sizes(d0))
        q = sum(1 for x in d0[:ax] if x not in splits.ROW and x != 1)
        strides = [math.prod(feats[i + 1:]) for i in range(len(feats))]
        r = ctx.b.remap(cat, feats[:q] + [k] + feats[q:], strides[:q] + [W] + strides[q:])
    return ctx._mk(r, out, kind)


def _stacked_call(ctx, node: torch.fx.Node) -> Any:
    """An op reading a stack along dim 0 (``_Stacked``): a reduction over that dim (and
    others), indexing it, its shape, identities and elementwise ops with numbers;
    anything else refused, saying what is fused."""
    op, t, args, kw, mod, name = ctx._call_parts(node)
    a0 = args[0] if args else None
    st = ctx.env.get(a0) if isinstance(a0, torch.fx.Node) else None
    f = t if op == "call_function" else None
    m = t if op == "call_method" else None

    def refuse(why: str = "") -> TailError:
        return ctx.refuse(name, (why or "an op on a stack along dim 0, before the batch "
                                  "(torch.stack(values))") + ": cupyfuse fuses a "
                           "reduction over that dim (`.mean(0)`, sum, amax/amin, "
                           "max/min, logsumexp, norm, var, std), indexing it (`s[i]`, "
                           "`unbind(0)`) and elementwise ops with numbers there; for "
                           "other ops stack along a dim after the batch "
                           "(`torch.stack(values, dim=1)`)")

    others = [a for a in node.all_input_nodes if a is not a0]
    if not isinstance(st, _Stacked) or any(
            isinstance(ctx.env.get(a), _Stacked) for a in others):
        raise refuse()
    sp, p = st.sp, st.ax
    k = sp.dims[p]
    tdims = (k,) + sp.dims[:p] + sp.dims[p + 1:]   # torch's: the stacked dim first
    nd = len(tdims)

    def to_inner(j: int) -> int:   # a torch dim of the stack -> its dim in sp
        return p if j == 0 else j - 1 if j - 1 < p else j

    if f is getattr:
        if args[1] == "shape":
            return _sizes(tdims, sp.v)
        if args[1] == "dtype":
            return {"b": torch.bool, "i": torch.int64}.get(sp.kind, torch.float32)
        if args[1] == "device":
            return _DEVICE
        raise refuse()
    if m == "size":
        dd = _arg(args, kw, 1, "dim")
        return _sizes(tdims, sp.v) if dd is None else \
            _sizes(tdims, sp.v)[ctx._dim(dd, nd, name)]
    if m in ("dim", "ndimension"):
        return _Const(nd)
    if m in _IDENTITY_METHODS or f in (torch.clone, torch.detach) or (
            m == "to" and all(r == torch.float32 or isinstance(r, _Device)
                              for r in list(args[1:]) + list(kw.values()))):
        if sp.kind != "f" and (m == "float" or torch.float32 in args[1:] or
                               torch.float32 in kw.values()):
            return _Stacked(_Split(sp.v, sp.dims, "f"), p, ())
        return st

    def entry(i: Any) -> Any:
        i = ctx._int(i, "index", name)
        if not -k <= i < k:
            raise ctx.refuse(name, f"index {i} out of range for size {k} (torch raises)")
        i %= k
        if st.items:
            e = st.items[i]
            return e if isinstance(e, _Split) or type(e) is not int else Val(e)
        r, d = splits.narrow(ctx.b, sp.v, sp.dims, p, i, 1)
        return ctx._mk(r, d[:p] + d[p + 1:], sp.kind)

    if f is operator.getitem or m == "__getitem__":
        idx = args[1]
        if isinstance(idx, tuple) and idx and all(
                isinstance(i, slice) and i == slice(None) or i is Ellipsis
                for i in idx[1:]) and len(idx) <= nd:
            idx = idx[0]
        if type(idx) is not int:
            raise refuse("an index of a stack other than one integer along its first "
                         "dim")
        return entry(idx)
    if m == "select" or f is torch.select:
        if ctx._dim(_arg(args, kw, 1, "dim"), nd, name) != 0:
            raise refuse("selects along a dim other than the stacked one")
        return entry(_arg(args, kw, 2, "index"))
    if m == "unbind" or f is torch.unbind:
        if ctx._dim(_arg(args, kw, 1, "dim", 0), nd, name) != 0:
            raise refuse("unbinds a dim other than the stacked one")
        items = [entry(i) for i in range(k)]
        if any(isinstance(e, (_Bool, _Int)) for e in items):
            raise refuse("pieces of a boolean or integer stack")
        return _Tuple(tuple(e if isinstance(e, _Split) else int(e) for e in items))
    binary = len(args) >= 2 and ctx.is_tensor_like(args[1]) and "dim" not in kw
    kind = _REDUCE_FUNCS.get(f) if f is not None else m if m in _REDUCE_METHODS else None
    if kind is not None and not (kind in ("max", "min") and binary):
        dim = _arg(args, kw, 2 if kind in ("norm", "vector_norm") else 1, "dim")
        named = dim if isinstance(dim, (tuple, list)) else [dim]
        if dim is None or 0 not in [ctx._dim(x, nd, name) for x in named]:
            raise refuse("a reduction of a stack that keeps the stacked dim (dim 0)")
        saved = ctx.env[a0]
        ctx.env[a0] = sp
        try:
            r = reductions.reduction(ctx, kind, args, kw, name, to_inner)
        finally:
            ctx.env[a0] = saved
        ind = isinstance(r, _Tuple)
        res = r.items[0] if ind else r
        if isinstance(res, _Split):
            rv, rd, rk = res.v, res.dims, res.kind
        else:
            rk = "b" if isinstance(res, _Bool) else "i" if isinstance(res, _Int) else "f"
            rv = res.v if isinstance(res, (_Bool, _Int)) else int(res)
            rd = ctx.dims(rv)
        if len(rd) == len(sp.dims):   # keepdim: torch has the 1 first
            res = ctx._mk(ctx.b.view(rv, splits.flat_dims(rd)),
                           (1,) + rd[:p] + rd[p + 1:], rk)
        if ind:
            return _Tuple((res if isinstance(res, _Split) else int(res), _Indices()))
        return res
    if ctx._elementwise(node, args, kw) and all(
            isinstance(ctx.env.get(a), _Const) for a in others):
        saved = ctx.env[a0]
        ctx.env[a0] = sp
        try:
            r = ctx.split_call(node)
        finally:
            ctx.env[a0] = saved
        if isinstance(r, _Split):
            return _Stacked(r, p, ())
        rk = "b" if isinstance(r, _Bool) else "i" if isinstance(r, _Int) else "f"
        rv = r.v if isinstance(r, (_Bool, _Int)) else int(r)
        return _Stacked(_Split(ctx.b.view(rv, splits.flat_dims(sp.dims)), sp.dims, rk),
                        p, ())
    raise refuse()


# --- spellings ---------------------------------------------------------------------------
@lowering.function(torch.cat, torch.concat, torch.concatenate)
def _cat_fn(ctx, node, args, kw, name):
    seq = _arg(args, kw, 0, "tensors")
    pieces = ctx.env.get(seq) if isinstance(seq, torch.fx.Node) else None
    if isinstance(pieces, _Tuple):   # torch.cat(h.chunk(2, 1)[::-1], 1)
        if any(isinstance(i, _Indices) for i in pieces.items):
            raise ctx.refuse(name, "the indices of max/min are not fused")
        return ctx.b.cat([int(i) for i in pieces.items], _arg(args, kw, 1, "dim", 0), name)
    if not isinstance(seq, (tuple, list)):
        raise ctx.refuse(name, "a sequence of tensors built at run time")
    return ctx.b.cat([ctx.val(t, name) for t in seq], _arg(args, kw, 1, "dim", 0), name)


@lowering.function(torch.stack)
def _stack_fn(ctx, node, args, kw, name):
    return stack(ctx, _arg(args, kw, 0, "tensors"), _arg(args, kw, 1, "dim", 0), kw, name)


@lowering.function(torch.chunk)
def _chunk_fn(ctx, node, args, kw, name):
    return chunk(ctx, args[0], _arg(args, kw, 1, "chunks"), _arg(args, kw, 2, "dim", 0), name)


@lowering.function(torch.split)
def _split_fn(ctx, node, args, kw, name):
    return split(ctx, args[0], _arg(args, kw, 1, "split_size_or_sections"),
                 _arg(args, kw, 2, "dim", 0), name)


@lowering.method("chunk")
def _chunk_method(ctx, node, self_, args, kw, name):
    return chunk(ctx, self_, _arg(args, kw, 1, "chunks"), _arg(args, kw, 2, "dim", 0), name)


@lowering.method("split")
def _split_method(ctx, node, self_, args, kw, name):
    return split(ctx, self_, _arg(args, kw, 1, "split_size"), _arg(args, kw, 2, "dim", 0), name)
