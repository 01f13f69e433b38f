"""Views and reshapes in a traced forward (:mod:`cupyfuse.frontend.translate`): unsqueeze, squeeze,
flatten, unflatten, view / reshape (of plain values, with leading (sequence) dims, or
splitting the features into several dims), expand / expand_as / broadcast_to (a
broadcast, kept lazy where it adds the batch or a leading dim), and the (batch * seq, F)
rows view of a (batch, seq, F) value (``h.view(-1, F)``: ``_Rows``) with the ops that
read it.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Sequence

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse.ir import splits
from cupyfuse.frontend.tables import (_FLATTEN_INPUT_WHY, _REDUCE_FUNCS, _REDUCE_METHODS, _arg,
                             _node_name)
from cupyfuse.frontend.values import (Val, _Bool, _Const, _DEVICE, _Index, _Indices, _Int, _MergedRows,
                             _RawInt, _Rows, _Size, _Split, _Tuple, _Weight)
from cupyfuse.ir.program import BATCH, LEAD, LEAD_WHY, TailError, _check_dims, _fmt_dims, broadcast
from cupyfuse.frontend.lower import reductions
from cupyfuse.frontend import lower as lowering


# --- views -----------------------------------------------------------------------
def unsqueeze(ctx, a: Any, dim: int, name: str) -> int:
    v = ctx.val(a, name)
    d = list(ctx.dims(v))
    dim = ctx._dim(dim, len(d) + 1, name)
    d.insert(dim, 1)
    return ctx.b.view(v, d)


def squeeze(ctx, a: Any, dim: Any, name: str) -> int:
    v = ctx.val(a, name)
    d = list(ctx.dims(v))
    if dim is None:
        r = ctx.b.view(v, [x for x in d if x != 1])
        idx = set(range(len(d)))
    else:
        dl = list(dim) if isinstance(dim, (list, tuple)) else [dim]
        idx = {ctx._dim(x, len(d), name) for x in dl}
        r = ctx.b.view(v, [x for i, x in enumerate(d) if not (i in idx and x == 1)])
    if BATCH in d and d.index(BATCH) in idx:
        # at batch size 1 torch drops the batch dim here too: fine as the result
        # (Program.squeezes_batch), not before more ops (checked at the output)
        ctx.batch_squeezes.append((r, ctx.cur))
    return r


def flatten(ctx, a: Any, start: int, end: int, name: str) -> int:
    v = ctx.val(a, name)
    d = list(ctx.dims(v))
    n = len(d)
    s, e = ctx._dim(start, n, name), ctx._dim(end, n, name)
    group = d[s:e + 1]
    non1 = [x for x in group if x != 1]
    if LEAD in group and s == 0 and e == n - 2 and ctx._kind_of(a) == "f" and \
            all(x in (BATCH, LEAD, 1) for x in d[:-1]):
        return _Rows(v)   # h.flatten(0, -2): the batch and leading dims as rows
    if LEAD in group and len(non1) > 1:
        if isinstance(a, torch.fx.Node) and a.op == "placeholder":
            raise ctx.refuse(name, _FLATTEN_INPUT_WHY)
        raise ctx.refuse(name, "flattening a leading (sequence) dim into another: " +
                          LEAD_WHY)
    if len(non1) > 1:
        raise ctx.refuse(name, "flattening the batch and feature dims together")
    merged = non1[0] if non1 else 1
    return ctx.b.view(v, d[:s] + [merged] + d[e + 1:])


def unflatten(ctx, a: Any, dim: Any, sizes: Any, name: str) -> Any:
    """``unflatten(dim, sizes)``: a feature dim split into several (-1 for one)."""
    v, d, kind = ctx._sv(a, name)
    ax = ctx._dim(dim, len(d), name)
    if d[ax] == BATCH:
        raise ctx.refuse(name, "unflattens the batch dimension (the rows stay rows: "
                                "unflatten a feature dim, e.g. `.unflatten(-1, (H, D))`)")
    if d[ax] == LEAD:
        raise ctx.refuse(name, "unflattens a leading (sequence) dim: " + LEAD_WHY)
    sizes = list(ctx.ints(sizes, name))
    if not sizes or sizes.count(-1) > 1 or any(x < -1 for x in sizes):
        raise ctx.refuse(name, f"sizes {tuple(sizes)} (torch raises)")
    known = math.prod(x for x in sizes if x != -1)
    if -1 in sizes:
        if known == 0 or d[ax] % known:
            raise ctx.refuse(name, f"sizes {tuple(sizes)} do not split {d[ax]} (torch "
                                    "raises)")
        sizes = [d[ax] // known if x == -1 else x for x in sizes]
    elif known != d[ax]:
        raise ctx.refuse(name, f"sizes {tuple(sizes)} don't multiply up to the size of "
                                f"dim {dim} ({d[ax]}) (torch raises)")
    return ctx._mk(v, d[:ax] + tuple(sizes) + d[ax + 1:], kind)



def reshape(ctx, a: Any, shape: Any, name: str) -> Any:
    v = ctx.val(a, name)
    d = ctx.dims(v)
    shape = ctx._shape_arg(shape, name)
    split = ctx._split_target(d, shape, name)
    if split is not None:   # h.view(B, H, D): the features split into several dims
        return ctx._mk(ctx.b.view(v, splits.flat_dims(d)), split, ctx._kind_of(a))
    if LEAD in d and ctx._kind_of(a) == "f" and _merges_rows(ctx, d, shape):
        return _Rows(v)   # h.view(-1, F): the batch and leading dims as rows
    if LEAD in d:
        out = _lead_view(ctx, d, shape, name)
        if out is None:   # (a -1 standing for a last dim of 1: (batch, seq, 1))
            out = ctx._split_target(d, shape, name, plain_ok=True)
        if out is not None:
            return ctx.b.view(v, out)
        if isinstance(a, torch.fx.Node) and a.op == "placeholder":
            raise ctx.refuse(name, _FLATTEN_INPUT_WHY)
    sizes: list[Any] = []
    for s in shape:
        x = ctx.env[s] if isinstance(s, torch.fx.Node) else s
        if isinstance(x, _Size):
            if x.v == LEAD:
                raise ctx.refuse(name, "a reshape to a leading (sequence) dim's size: " +
                                  LEAD_WHY)
            sizes.append("B" if x.v == BATCH else x.v)  # "B": the batch size itself
        elif isinstance(x, int) and not isinstance(x, Val):   # Val: a computed size
            sizes.append(x)
        else:
            raise ctx.refuse(name, "a reshape to a computed size")
    non1_in = [x for x in d if x != 1]
    if sizes.count(-1) > 1:
        raise ctx.refuse(name, "a reshape with several -1")
    if sizes.count("B") > 1:
        raise ctx.refuse(name, "a reshape that uses the batch size twice")
    if "B" in sizes:
        width = max([x for x in d if x > 1], default=1)
        known = 1
        for x in sizes:
            if x not in ("B", -1):
                known *= x
        fill = width // known if known and width % known == 0 else -2
        out = [BATCH if x == "B" else (fill if x == -1 else x) for x in sizes]
        if sorted(x for x in out if x != 1) != sorted(non1_in):
            raise ctx.refuse(name, _reshape_why(d, out))
        if -1 in sizes:   # with an empty batch the -1 could be any size: torch raises
            shown = ", ".join("0" if x == "B" else str(x) for x in sizes)
            ctx.b.p.zero_rows_error = (
                f"cannot reshape tensor of 0 elements into shape [{shown}] because the "
                "unspecified dimension size -1 can be any value and is ambiguous")
        return ctx.b.view(v, out)
    known = [x for x in sizes if x not in (-1,)]
    out = []
    if BATCH in d and BATCH not in known:
        # the batch dim must be where a -1 is, or it is merged: refuse merges
        filled = False
        for x in sizes:
            if x == -1 and not filled:
                # -1 is the batch if the feature width is spelled out elsewhere
                rest = [y for y in non1_in if y != BATCH]
                if all(y in known for y in rest) or not rest:
                    out.append(BATCH)
                    filled = True
                    continue
                if LEAD not in d and sizes and sizes[0] == -1 and \
                        math.prod(known) == math.prod(rest):
                    # view(-1, 3, n) of (batch, 3n): the -1 is the batch, the features split
                    raise ctx.refuse(name, _reshape_why(
                        d, [BATCH] + [x for x in sizes[1:]]))
                raise ctx.refuse(name, "a reshape that merges the batch dimension")
            out.append(x)
        if not filled:
            raise ctx.refuse(name, "a reshape to fixed sizes only: the batch size is not "
                                    "fixed (write -1 or x.shape[0] for it)")
    else:
        width = max([x for x in d if x > 1], default=1)
        for x in sizes:
            out.append(width if x == -1 else x)
    if sorted(x for x in out if x != 1) != sorted(non1_in):
        raise ctx.refuse(name, _reshape_why(d, out, sizes))
    return ctx.b.view(v, out)


def _reshape_why(d: tuple, out: Sequence[Any], sizes: Sequence[Any] | None = None) -> str:
    """Why a reshape from dims ``d`` to ``out`` is refused: the features split into
    several dims or several merged (a program value has one feature axis), or data
    moved between rows and features."""
    feats_in = [x for x in d if x not in (BATCH, LEAD, 1)]
    feats_out = [x for x in out if x not in (BATCH, LEAD, 1) and isinstance(x, int)
                 and x > 0]
    same_rows = (BATCH in d) == (BATCH in out) and d.count(LEAD) == list(out).count(LEAD)
    if same_rows and feats_in and feats_out and \
            math.prod(feats_in) == math.prod(feats_out) and len(feats_out) != len(feats_in):
        shown = _fmt_dims(tuple(out))
        # (a split that keeps the batch and leading dims first is a split view: this
        # one puts a feature dim before them)
        return (f"a reshape from {_fmt_dims(d)} to {shown} that "
                f"{'splits the features into several dims' if len(feats_out) > len(feats_in) else 'merges feature dims'}"
                " and puts one of them before the batch or a leading dim (a value is "
                "stored row by row: write the batch and leading dims first, e.g. "
                "`h.view(x.shape[0], H, D)`)")
    return (f"a reshape from {_fmt_dims(d)}"
            + (f" to {tuple(sizes)}" if sizes is not None else "")
            + " that moves data between rows or features")


def _lead_view(ctx, d: tuple[int, ...], shape: Sequence[Any], name: str) -> list | None:
    """The dims of a reshape of a value with leading dims (``d``) that keeps its dims
    other than 1 in order: ``h.view(b, s, n)`` of a (batch, seq, n) value (a no-op),
    or one adding or dropping size-1 dims. ``shape`` names the batch (``x.shape[0]``,
    or -1), each leading dim (its size read from a shape, or its number) and the
    features (-1 for one of them); None when it is no such reshape (``reshape``
    refuses it then)."""
    leads = [x for x in ctx.lead if x != 1]   # the sizes of the LEAD dims, in order
    want: list[Any] = []   # "B", ("L", k): the k-th leading dim, an int, or -1
    for s in shape:
        x = ctx.env[s] if isinstance(s, torch.fx.Node) else s
        if isinstance(x, _Size):
            x = "B" if x.v == BATCH else ("L", x.lead) if x.v == LEAD else x.v
        elif isinstance(x, _Const) and type(x.v) is int:
            x = x.v
        elif type(x) is not int:   # Val (a computed size), bool, float...
            return None
        want.append(x)
    have: list[Any] = []
    for x in d:
        if x == LEAD:
            have.append(("L", sum(1 for y in have if isinstance(y, tuple))))
        elif x != 1:
            have.append("B" if x == BATCH else x)
    tgt = [x for x in want if x != 1]
    if len(tgt) != len(have) or tgt.count(-1) > 1:
        return None
    for t, h in zip(tgt, have):
        if t != -1 and t != h and not (isinstance(h, tuple) and t == leads[h[1]]):
            return None   # a leading dim's number is its size (programs are per shape)
    if -1 in tgt and any(isinstance(h, tuple) and leads[h[1]] == 0
                         for t, h in zip(tgt, have) if t != -1):
        raise ctx.refuse(name, "a reshape with -1 of a value with a leading dim of size "
                                "0 (torch raises: the -1 could be any size)")
    if -1 in tgt and "B" in tgt:   # the same with an empty batch (known per call)
        shown = ", ".join("0" if x == "B" else str(leads[x[1]]) if isinstance(x, tuple)
                          else str(x) for x in want)
        ctx.b.p.zero_rows_error = (
            f"cannot reshape tensor of 0 elements into shape [{shown}] because the "
            "unspecified dimension size -1 can be any value and is ambiguous")
    it = iter(BATCH if h == "B" else LEAD if isinstance(h, tuple) else h for h in have)
    return [1 if x == 1 else next(it) for x in want]

# --- expand: a broadcast ---------------------------------------------------------------
def expand(ctx, a: Any, sizes: Any, like: Any, name: str) -> Any:
    """``t.expand(*sizes)``, ``t.expand_as(other)``, ``torch.broadcast_to(t, shape)``:
    torch's view of ``t`` repeated along its size-1 dims. Repeated along feature dims
    it is that value (a gather of stride 0: ``remap``; the same program value where the
    features do not change); repeated over the batch or a leading dim it lacks (a
    parameter expanded to (batch, n)) it stays unexpanded, and only elementwise ops
    that broadcast it anyway may read it (``lazy``)."""
    if ctx._is_bool(a) or ctx._is_int(a) or ctx.is_tensor_like(a):
        v, d, kind = ctx._sv(a, name)
    else:
        raise ctx.refuse(name, "an expand of something other than a tensor")
    if like is not None:
        e = ctx.env.get(like) if isinstance(like, torch.fx.Node) else like
        if not isinstance(e, (Val, _Bool, _Int, _Split, _Weight, torch.Tensor)):
            raise ctx.refuse(name, "expand_as of something other than a tensor")
        shape: Any = tuple("B" if x == BATCH else "L" if x == LEAD else x
                           for x in ctx._operand_dims(e, name))
    else:
        shape = ctx._shape_arg(sizes if isinstance(sizes, (tuple, list)) else (sizes,),
                                name)
    T = _expand_dims(ctx, d, shape, name)
    if splits.marks(T) != splits.marks(d):   # over the batch or a leading dim
        if ctx.cur is not None:
            ctx.lazy[ctx.cur] = T
        return ctx.env[a] if isinstance(a, torch.fx.Node) else ctx._wrap(kind, v)
    try:
        _check_dims(T, name, split=True)
    except TailError as exc:
        raise ctx.refuse(name, str(exc).split(": ", 1)[-1]) from None
    W, w = splits.width(T), splits.width(d)
    if W == w:
        return ctx._mk(v, T, kind)
    if w == 1:
        return ctx._mk(ctx.b.spread(v, W), T, kind)
    return ctx._mk(splits.layout(ctx.b, v, d, T), T, kind)


def _expand_dims(ctx, d: tuple[int, ...], shape: Sequence[Any], name: str
                 ) -> tuple[int, ...]:
    """torch's dims of an expand of a value with dims ``d`` to ``shape`` (entries: ints,
    -1 to keep a dim, sizes read from shapes; torch's dims for expand_as), refusing
    what torch raises on and sizes the program cannot follow (a fixed batch size)."""
    want: list[Any] = []   # ints, -1 (keep), "B" (the batch), "L" (a leading dim)
    for s in shape:
        x = ctx.env[s] if isinstance(s, torch.fx.Node) else s
        if isinstance(x, str):   # (expand_as: the other's dims)
            pass
        elif isinstance(x, _Size):   # (x.size(0) is the batch: not the -1 it is coded as)
            x = "B" if x.v == BATCH else "L" if x.v == LEAD else x.v
        elif isinstance(x, _Const) and type(x.v) is int:
            x = x.v
        if type(x) is not int and x not in ("B", "L"):
            raise ctx.refuse(name, "an expand to a computed size")
        want.append(x)
    if len(want) < len(d):
        raise ctx.refuse(name, f"an expand of a {len(d)}-dim value to {len(want)} dims "
                                "(torch raises)")
    src = (None,) * (len(want) - len(d)) + tuple(d)
    leads = [x for x in ctx.lead if x != 1]
    out: list[int] = []
    for k, (e, s) in enumerate(zip(want, src)):
        if e == -1:
            if s is None:
                raise ctx.refuse(name, "-1 for a new dim of an expand (torch raises)")
            out.append(s)
        elif e in ("B", "L"):
            mark = BATCH if e == "B" else LEAD
            if s not in (mark, 1, None):
                raise ctx.refuse(name, f"an expand of a dim of size {_fmt_dims((s,))[1:-1]} "
                                        f"to the {'batch' if e == 'B' else 'sequence'} "
                                        "(torch raises where they differ)")
            out.append(mark)
        elif e < 0:
            raise ctx.refuse(name, f"an expand to size {e} (torch raises)")
        elif s == BATCH:
            raise ctx.refuse(name, f"an expand of the batch dim to a fixed size {e} (the "
                                    "batch varies: write -1 or x.size(0) there)")
        elif s == LEAD:
            j = src[:k].count(LEAD)
            if j >= len(leads) or e != leads[j]:
                raise ctx.refuse(name, f"an expand of a sequence dim to size {e} "
                                        "(torch raises)")
            out.append(LEAD)
        elif s in (1, None) or s == e:
            out.append(e)
        else:
            raise ctx.refuse(name, f"an expand of a dim of size {s} to {e} (torch raises)")
    return tuple(out)

# --- values expanded over the batch or a leading dim (lazy) --------------------------
def _lazy_why(ctx, T: tuple[int, ...]) -> str:
    return (f"reads a value expanded to {_fmt_dims(T)} over the batch or a leading dim "
            "(an expand of a value without them, e.g. a parameter): cupyfuse fuses such "
            "an expand only where an elementwise op broadcasts it anyway (drop the "
            "expand: broadcasting does it)")


def _lazy_before(ctx, node: torch.fx.Node) -> None:
    """Before translating ``node``: where it reads a value expanded over the batch or
    a leading dim (``lazy``, kept unexpanded), it must be an elementwise op."""
    hits = [ctx.lazy[a] for a in node.all_input_nodes if a in ctx.lazy]
    if hits and not ctx._elementwise(node, tuple(ctx._plain(x) for x in node.args),
                                      {k: ctx._plain(x) for k, x in node.kwargs.items()}):
        raise ctx.refuse(_node_name(node), _lazy_why(ctx, hits[0]))


def _lazy_after(ctx, node: torch.fx.Node, r: Any) -> None:
    """After translating an elementwise ``node`` that reads values expanded over the
    batch or a leading dim (``lazy``): its result is torch's where its other operands
    bring those dims, else it is such a value in turn."""
    hits = [ctx.lazy[a] for a in node.all_input_nodes if a in ctx.lazy]
    if not hits:
        return
    name = _node_name(node)
    why = _lazy_why(ctx, hits[0])
    r = Val(r) if type(r) is int else r
    if not isinstance(r, (Val, _Bool, _Int, _Split)):   # pragma: no cover
        raise ctx.refuse(name, why)
    R = r.dims if isinstance(r, _Split) else ctx.dims(int(r) if isinstance(r, Val)
                                                      else r.v)
    full = tuple(R)
    try:
        for T in hits:
            full = broadcast(full, T, name, split=True)
    except TailError:
        raise ctx.refuse(name, why) from None
    if full != tuple(R):
        ctx.lazy[node] = full

# --- (batch * seq, F) views of (batch, seq, F) values ---------------------------------
def _merges_rows(ctx, d: tuple[int, ...], shape: Sequence[Any]) -> bool:
    """Whether a reshape of a value with leading dims (dims ``d``: the batch and
    leading dims, then its features in the last dim) to ``shape`` merges the batch and
    every leading dim into one dim of rows: ``h.view(-1, F)``, ``h.reshape(-1,
    h.size(-1))``."""
    if BATCH not in d or not all(x in (BATCH, LEAD, 1) for x in d[:-1]) or \
            not isinstance(shape, (tuple, list)) or len(shape) != 2:
        return False
    ent = [ctx.env[s] if isinstance(s, torch.fx.Node) else s for s in shape]
    ent = [e.v if isinstance(e, (_Const, _Size)) and type(e.v) is int and e.v >= 0
           else e for e in ent]
    return type(ent[0]) is int and ent[0] == -1 and type(ent[1]) is int and \
        ent[1] == max(d[-1], 1) and d[-1] not in (BATCH, LEAD)


def _rows_call(ctx, node: torch.fx.Node) -> Any:
    """An op reading a (batch * seq, F) view of a (batch, seq, F) value (``_Rows``):
    its shape, a view back to (batch, seq..., F) (or split heads of it), Linear layers
    (nn.Linear, F.linear, addmm, matmul with a weight), elementwise ops with numbers,
    per-feature parameters and other such views, and softmax, reductions, norms and
    LayerNorm along F; anything else refused, saying to view it back first."""
    op, t, args, kw, mod, name = ctx._call_parts(node)
    a0 = args[0] if args else None
    R = ctx.env.get(a0) if isinstance(a0, torch.fx.Node) else None
    R = R if isinstance(R, _Rows) else None
    rows = next(ctx.env[a] for a in node.all_input_nodes
                if isinstance(ctx.env.get(a), _Rows))
    d = ctx.dims(rows.v)
    F_ = max(d[-1], 1)

    def refuse(why: str = "") -> TailError:
        return ctx.refuse(name, (why or "an op on a (batch * seq..., F) view of a (batch, "
                                  "seq..., F) value (h.view(-1, F))") + ": cupyfuse fuses "
                           "Linear layers, elementwise ops and ops along F on such a "
                           "view; view it back first, e.g. `h.view(x.shape[0], "
                           "x.shape[1], -1)`")

    # --- its shape
    def sizes() -> tuple:
        return (_MergedRows(),) + ((_Size(F_, 1),) if rows.nd == 2 else ())
    if op == "call_function" and t is getattr and R is not None:
        if args[1] == "shape":
            return sizes()
        if args[1] == "dtype":
            return torch.float32
        if args[1] == "device":
            return _DEVICE
        raise refuse(f"`.{args[1]}` of a (batch * seq..., F) view")
    if op == "call_method" and R is not None and t == "size":
        dd = _arg(args, kw, 1, "dim")
        return sizes() if dd is None else sizes()[ctx._dim(dd, rows.nd, name)]
    if op == "call_method" and R is not None and t in ("dim", "ndimension"):
        return _Const(rows.nd)
    # --- views
    shape = None
    if R is not None and op == "call_method" and t in ("view", "reshape"):
        shape = args[1:] if not (len(args) == 2 and isinstance(args[1], (tuple, list))) \
            else args[1]
        shape = kw.get("size", kw.get("shape", shape))
    elif R is not None and t is torch.reshape:
        shape = _arg(args, kw, 1, "shape")
    if shape is not None:
        shape = ctx._shape_arg(shape, name)
        back = _lead_view(ctx, d, shape, name)
        if back is not None:   # (batch, seq..., F) again
            return Val(ctx.b.view(rows.v, back))
        split = ctx._split_target(d, shape, name)
        if split is not None:   # (batch, seq..., H, D)
            return ctx._mk(ctx.b.view(rows.v, splits.flat_dims(d)), split)
        if rows.nd == 2 and _merges_rows(ctx, d, shape):
            return rows
        raise refuse("a reshape of a (batch * seq..., F) view to " + ctx._shown(shape))
    # --- what runs on it
    linear = (isinstance(mod, nn.Linear) or t in (F.linear, torch.matmul, operator.matmul,
                                                  torch.mm)
              or op == "call_method" and t in ("matmul", "mm", "__matmul__")) and \
        R is not None or t is torch.addmm and len(args) > 1 and \
        isinstance(ctx.env.get(args[1]), _Rows)
    along = _rows_along(ctx, node, mod, args, kw)
    if linear or along is not None:
        if rows.nd != 2:
            raise refuse()
    elif not ctx._elementwise(node, args, kw):
        raise refuse()
    for x in node.all_input_nodes:
        e = ctx.env.get(x)
        if isinstance(e, (Val, _Bool, _Int, _RawInt, _Split)):
            dx = e.dims if isinstance(e, _Split) else ctx.dims(
                int(e) if isinstance(e, Val) else e.v)
            if BATCH in dx:
                raise refuse(f"an op between a (batch * seq..., F) view (h.view(-1, F)) "
                             f"and a value of {_fmt_dims(dx)}")
    saved = {x: ctx.env[x] for x in node.all_input_nodes if isinstance(ctx.env[x], _Rows)}
    try:
        for x, e in saved.items():
            ctx.env[x] = Val(e.v)
        ctx._rows_ctx = True
        if along is not None:
            r = along()
        else:
            r = getattr(ctx, op)(node)
    finally:
        ctx._rows_ctx = False
        ctx.env.update(saved)
    r = Val(r) if type(r) is int else r
    if isinstance(r, _Tuple) and len(r.items) == 2 and isinstance(r.items[1], _Indices):
        # max/min along F with a dim: the values a view of rows too, and so the indices
        # where read (positions along F: argmax/argmin of the (batch, seq..., F) value)
        v0 = int(r.items[0])
        ind = r.items[1]

        def rows_index() -> Any:
            ix = reductions._indices(ctx, ind, name)
            return _Index(_Rows(int(ix.inner),
                                _rows_nd(rows, ctx.dims(int(ix.inner)), d)))
        return _Tuple((_Rows(v0, _rows_nd(rows, ctx.dims(v0), d)),
                       _Indices(rows_index if ind.make is not None else None, ind.op)))
    if isinstance(r, _Index) and isinstance(r.inner, Val):
        # argmax/argmin along F: positions of the rows (an int64 (batch * seq...) result)
        return _Index(_Rows(int(r.inner), _rows_nd(rows, ctx.dims(int(r.inner)), d)))
    if not isinstance(r, Val):
        raise refuse("a boolean or integer result of a (batch * seq..., F) view (torch "
                     "gives bool or int64 there)")
    rd = ctx.dims(int(r))
    if not (BATCH in rd and all(x in (BATCH, LEAD, 1) for x in rd[:-1])) or \
            [x for x in rd if x in (BATCH, LEAD)] != [x for x in d if x in (BATCH, LEAD)]:
        raise refuse()   # pragma: no cover - the ops above keep the rows
    return _Rows(int(r), _rows_nd(rows, rd, d))


def _rows_nd(rows: "_Rows", rd: tuple[int, ...], d: tuple[int, ...]) -> int:
    """torch's dims of an op's result on a ``_Rows`` value (underlying dims ``d``, the
    result's ``rd``): 1 where its features went (a reduction without keepdim)."""
    return 1 if len(rd) < len(d) or rows.nd == 1 and len(rd) == len(d) else 2


def _rows_along(ctx, node: torch.fx.Node, mod: Any, args: tuple, kw: dict) -> Any:
    """For an op along F of a (batch * seq, F) view (softmax and co., a reduction,
    F.normalize, LayerNorm): a function translating it on the (batch, seq..., F) value
    (F is its last dim); None for other ops. A dim other than F's is refused."""
    op, t = node.op, node.target
    name = _node_name(node)
    a0 = args[0] if args else None

    def last(dim: Any) -> int:
        dims = list(dim) if isinstance(dim, (tuple, list)) else [dim]
        if len(dims) != 1 or type(dims[0]) is not int or dims[0] not in (1, -1):
            raise ctx.refuse(name, f"dim {dim!r} of a (batch * seq, F) view (its rows: "
                                    "view it back first; F is dim 1 or -1)")
        return -1

    if isinstance(mod, (nn.Softmax, nn.LogSoftmax, nn.Softmin)):
        neg, log = isinstance(mod, nn.Softmin), isinstance(mod, nn.LogSoftmax)
        dim = 1 if mod.dim is None else mod.dim   # (legacy: dim 1 of a 2-dim value)
        return lambda: ctx.b.softmax(ctx.b.map("neg", ctx.val(a0, name)) if neg else
                                      ctx.val(a0, name), last(dim), log=log)
    if isinstance(mod, nn.LayerNorm) or t is F.layer_norm:
        return lambda: getattr(ctx, op)(node)   # (over the last dims: F)
    if t in (torch.softmax, F.softmax, torch.log_softmax, F.log_softmax, F.softmin) or \
            op == "call_method" and t in ("softmax", "log_softmax"):
        ctx._float32_only(kw, name, args)
        dim = _arg(args, kw, 1, "dim")
        if dim is None and (t in (F.softmax, F.log_softmax, F.softmin)):
            dim = 1   # (torch's legacy dim of a 2-dim value)
        log = t in (torch.log_softmax, F.log_softmax) or t == "log_softmax"
        neg = t is F.softmin
        return lambda: ctx.b.softmax(ctx.b.map("neg", ctx.val(a0, name)) if neg else
                                      ctx.val(a0, name), last(dim), log=log)
    if t is F.normalize:
        p, dim = _arg(args, kw, 1, "p", 2.0), _arg(args, kw, 2, "dim", 1)
        eps = _arg(args, kw, 3, "eps", 1e-12)

        def normalize() -> int:
            v = ctx.val(a0, name)
            n = ctx.b.norm(v, last(dim), float(p), True)
            return ctx.b.map("div", v, ctx.b.map("clamp", n, attrs=(eps, math.inf)))
        return normalize
    kind = _REDUCE_FUNCS.get(t) if op == "call_function" else \
        t if op == "call_method" and t in _REDUCE_METHODS else None
    if kind is not None and not (kind in ("max", "min") and len(args) >= 2 and
                                 ctx.is_tensor_like(args[1])):
        di = 2 if kind in ("norm", "vector_norm") else 1
        dim = _arg(args, kw, di, "dim")
        if dim is None:
            return lambda: reductions.reduction(ctx, kind, args, kw, name)   # (refuses: no dim)
        new = list(args) + [None] * max(0, di + 1 - len(args))
        if len(args) > di:
            new[di] = last(dim)
            return lambda: reductions.reduction(ctx, kind, tuple(new[:len(args)]), kw, name)
        return lambda: reductions.reduction(ctx, kind, args, {**kw, "dim": last(dim)}, name)
    return None


# --- spellings ---------------------------------------------------------------------------
@lowering.function(torch.flatten)
def _flatten_fn(ctx, node, args, kw, name):
    return flatten(ctx, args[0], _arg(args, kw, 1, "start_dim", 0), _arg(args, kw, 2, "end_dim", -1),
                   name)


@lowering.function(torch.unsqueeze)
def _unsqueeze_fn(ctx, node, args, kw, name):
    return unsqueeze(ctx, args[0], _arg(args, kw, 1, "dim"), name)


@lowering.function(torch.squeeze)
def _squeeze_fn(ctx, node, args, kw, name):
    return squeeze(ctx, args[0], _arg(args, kw, 1, "dim"), name)


@lowering.function(torch.reshape)
def _reshape_fn(ctx, node, args, kw, name):
    return reshape(ctx, args[0], args[1], name)


@lowering.function(torch.unflatten)
def _unflatten_fn(ctx, node, args, kw, name):
    return unflatten(ctx, args[0], _arg(args, kw, 1, "dim"), _arg(args, kw, 2, "sizes"), name)


@lowering.function(torch.broadcast_to)
def _broadcast_to_fn(ctx, node, args, kw, name):
    return expand(ctx, args[0], _arg(args, kw, 1, "size"), None, name)


@lowering.function(torch.clone, torch.detach)
def _clone_fn(ctx, node, args, kw, name):
    v = ctx.env[args[0]]
    if node.target is torch.detach and isinstance(v, Val):
        return Val(ctx.b.map("detach", ctx.val(args[0], name)))   # (no gradient)
    return v


@lowering.method("unsqueeze")
def _unsqueeze_method(ctx, node, self_, args, kw, name):
    return unsqueeze(ctx, self_, _arg(args, kw, 1, "dim"), name)


@lowering.method("squeeze")
def _squeeze_method(ctx, node, self_, args, kw, name):
    return squeeze(ctx, self_, _arg(args, kw, 1, "dim"), name)


@lowering.method("view", "reshape")
def _view_method(ctx, node, self_, args, kw, name):
    shape = args[1:] if not (len(args) == 2 and isinstance(args[1], (tuple, list))) else args[1]
    if "size" in kw or "shape" in kw:
        shape = kw.get("size", kw.get("shape"))
    return reshape(ctx, self_, shape, name)


@lowering.method("flatten")
def _flatten_method(ctx, node, self_, args, kw, name):
    return flatten(ctx, self_, _arg(args, kw, 1, "start_dim", 0), _arg(args, kw, 2, "end_dim", -1),
                   name)


@lowering.method("unflatten")
def _unflatten_method(ctx, node, self_, args, kw, name):
    return unflatten(ctx, self_, _arg(args, kw, 1, "dim"), _arg(args, kw, 2, "sizes"), name)


@lowering.method("expand")
def _expand_method(ctx, node, self_, args, kw, name):
    sizes = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    return expand(ctx, self_, kw.get("size", sizes), None, name)


@lowering.method("expand_as")
def _expand_as_method(ctx, node, self_, args, kw, name):
    return expand(ctx, self_, None, _arg(args, kw, 1, "other"), name)


@lowering.module(nn.Identity)
def _identity_module(ctx, node, mod, a, name):
    return ctx.env[a]


@lowering.module(nn.Unflatten)
def _unflatten_module(ctx, node, mod, a, name):
    return unflatten(ctx, a, mod.dim, mod.unflattened_size, name)


@lowering.module(nn.Flatten)
def _flatten_module(ctx, node, mod, a, name):
    return flatten(ctx, a, mod.start_dim, mod.end_dim, name)
