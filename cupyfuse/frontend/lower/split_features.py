"""Values whose features torch sees in several dims, in a traced forward
(:mod:`cupyfuse.frontend.translate`): ``h.view(B, H, D)`` and the like keep the program's flat
features (a ``_Split``; layouts in :mod:`cupyfuse.ir.splits`), and ``_split_call``
translates the ops that read one: its shape, reshapes, flatten/squeeze/permute that keep
each row's features in order, elementwise ops with operands broadcast to one layout,
softmax, normalize, LayerNorm and GLU along the split dims (reductions, pooling, norms of
channels, indexing, chunks and joins in their own modules); anything else refused, saying
how to go on.
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
from cupyfuse.frontend.tables import (_CHANNEL_FUNCS, _CHANNEL_MODULES, _PER_HEAD_HINT, _REDUCE_FUNCS,
                             _REDUCE_METHODS, _arg)
from cupyfuse.frontend.values import (Val, _Bool, _Const, _DEVICE, _Indices, _Int, _Split,
                             _Tuple, _Weight, _sizes)
from cupyfuse.ir.program import BATCH, LEAD, TailError
from cupyfuse.frontend.lower import indexing, joins, norms, reductions, transposes, views


# --- refusals, and what reads a split value ------------------------------------------
def _first_feature(d: Sequence[int]) -> int:
    """The position of a split value's first feature dim (``.flatten(it)`` joins them)."""
    return max((i for i, x in enumerate(d) if x in splits.ROW), default=-1) + 1



def _split_bn_why(sp: "_Split") -> str:
    d = sp.dims
    return (f"BatchNorm of a value whose features are split into several dims "
            f"{splits.fmt(d)}: torch normalises each channel (dim 1) over the batch and "
            "the positions after it, statistics across rows; cupyfuse fuses BatchNorm1d "
            "of a (batch, features) value, and GroupNorm, InstanceNorm and LayerNorm "
            "of split values (statistics within each row)")



def _any_split(ctx, node: torch.fx.Node) -> "_Split":
    """The first split value among a node's operands (in tuples of pieces too)."""
    def find(a: Any) -> Any:
        if isinstance(a, (tuple, list)):
            return next((r for r in map(find, a) if r is not None), None)
        e = ctx.env.get(a) if isinstance(a, torch.fx.Node) else None
        if isinstance(e, _Tuple):
            return next((i for i in e.items if isinstance(i, _Split)), None)
        return e if isinstance(e, _Split) else None
    return find(list(node.args) + list(node.kwargs.values()))


# --- ops reading a split value -------------------------------------------------------
def _split_call(ctx, node: torch.fx.Node) -> Any:
    """An op with a split value among its operands (``_Split``): shape ops,
    reductions, softmax and norms along the split dims, elementwise ops (with
    operands broadcast to one layout); anything else refused, saying how to go on."""
    op, t = node.op, node.target
    args = tuple(ctx._plain(a) for a in node.args)
    kw = {k: ctx._plain(v) for k, v in node.kwargs.items()}
    a0 = args[0] if args else None
    sp = ctx._split_of(a0)
    if op == "call_module":
        mod = ctx._get_attr(t)
        return _split_module(ctx, node, mod, args, kw, f"{t} ({type(mod).__name__})", sp)
    name = f".{t}()" if op == "call_method" else getattr(t, "__name__", str(t))
    m = t if op == "call_method" else None
    f = t if op == "call_function" else None
    tup = ctx.env.get(a0) if isinstance(a0, torch.fx.Node) else None
    if isinstance(tup, _Tuple) and (f is operator.getitem or f is getattr):
        if f is getattr:
            if args[1] == "indices" and len(tup.items) == 2 and \
                    isinstance(tup.items[1], _Indices):
                return reductions._indices(ctx, tup.items[1], ".indices")
            if args[1] != "values":
                raise ctx.refuse(f".{args[1]}")
            item = tup.items[0]
            return item if isinstance(item, _Split) else Val(item)
        if isinstance(args[1], slice):
            return _Tuple(tup.items[args[1]])
        if not isinstance(args[1], int) or isinstance(args[1], bool):
            raise ctx.refuse(name, "an index of a tuple of tensors that is not a number")
        item = tup.items[args[1]]
        if isinstance(item, _Indices):
            return reductions._unused_indices(ctx, item, name)
        return item if isinstance(item, _Split) else Val(item)
    if f in (torch.cat, torch.concat, torch.concatenate):
        return joins._split_cat(ctx, _arg(args, kw, 0, "tensors"), _arg(args, kw, 1, "dim", 0),
                               name)
    if f is torch.stack:
        return joins.stack(ctx, _arg(args, kw, 0, "tensors"), _arg(args, kw, 1, "dim", 0), kw,
                          name)
    if f in (torch.cosine_similarity, torch.pairwise_distance, torch.cumsum):
        return ctx.call_function(node)   # (one translation for plain and split values)
    if m == "cumsum" and sp is not None:
        return reductions.cumsum(ctx, a0, _arg(args, kw, 1, "dim"), kw, name)
    if sp is None:   # a split among the other operands: elementwise, or refused
        if ctx._elementwise(node, args, kw):
            return _split_elementwise(ctx, node, name)
        raise ctx._split_refusal(name, _any_split(ctx, node))
    d = sp.dims
    # --- what torch knows of the shape
    if f is getattr:
        attr = args[1]
        if attr == "shape":
            return _sizes(d, sp.v)
        if attr == "dtype":
            return {"b": torch.bool, "i": torch.int64}.get(sp.kind, torch.float32)
        if attr == "device":
            return _DEVICE
        if attr in ("T", "mT"):
            n = len(d)
            perm = list(range(n))[::-1] if attr == "T" else \
                list(range(n - 2)) + [n - 1, n - 2]
            return _split_permute(ctx, sp, perm, f".{attr}")
        raise ctx.refuse(f".{attr}")
    if m == "size":
        dd = _arg(args, kw, 1, "dim")
        return _sizes(d, sp.v) if dd is None else \
            _sizes(d, sp.v)[ctx._dim(dd, len(d), name)]
    if m in ("dim", "ndimension"):
        return _Const(len(d))
    # --- shape ops
    if m in ("view", "reshape") or f is torch.reshape:
        if f is torch.reshape:
            shape = _arg(args, kw, 1, "shape")
        else:
            shape = args[1:] if not (len(args) == 2 and isinstance(args[1], (tuple, list))) \
                else args[1]
            if "size" in kw or "shape" in kw:
                shape = kw.get("size", kw.get("shape"))
        shape = ctx._shape_arg(shape, name)
        out = ctx._split_target(d, shape, name, plain_ok=True)
        if out is None:
            raise ctx.refuse(name, f"a reshape of a {splits.fmt(d)} value to "
                              f"{ctx._shown(shape)}: the batch and leading dims stay "
                              "first (x.shape[0] or -1 for the batch) and only the "
                              f"{splits.width(d)} features after them may be regrouped, "
                              f"e.g. `.flatten({_first_feature(d)})`")
        return ctx._mk(sp.v, out, sp.kind)
    if m == "flatten" or f is torch.flatten:
        return _split_flatten(ctx, sp, _arg(args, kw, 1, "start_dim", 0),
                                   _arg(args, kw, 2, "end_dim", -1), name)
    if m == "unflatten" or f is torch.unflatten:
        return views.unflatten(ctx, a0, _arg(args, kw, 1, "dim"), _arg(args, kw, 2, "sizes"), name)
    if m == "unsqueeze" or f is torch.unsqueeze:
        dim = ctx._dim(_arg(args, kw, 1, "dim"), len(d) + 1, name)
        return ctx._mk(sp.v, d[:dim] + (1,) + d[dim:], sp.kind)
    if m == "squeeze" or f is torch.squeeze:
        return _split_squeeze(ctx, sp, _arg(args, kw, 1, "dim"), name)
    if m in ("transpose", "swapaxes", "swapdims") or f in (
            torch.transpose, torch.swapaxes, torch.swapdims):
        n = len(d)
        perm = list(range(n))
        i, j = (ctx._dim(x, n, name) for x in (args[1], args[2]))
        perm[i], perm[j] = perm[j], perm[i]
        return _split_permute(ctx, sp, perm, name)
    if m == "permute" or f is torch.permute:
        perm = args[1:] if not (len(args) == 2 and isinstance(args[1], (tuple, list))) \
            else args[1]
        if f is torch.permute:
            perm = _arg(args, kw, 1, "dims")
        return _split_permute(ctx, sp, list(perm), name)
    if m == "t" or f is torch.t:
        return _split_permute(ctx, sp, list(range(len(d)))[::-1], name)
    if m == "movedim" or f is torch.movedim:
        return _split_movedim(ctx, sp, _arg(args, kw, 1, "source"),
                                   _arg(args, kw, 2, "destination"), name)
    if m == "__getitem__" or f is operator.getitem:
        return indexing._index_sv(ctx, a0, args[1])
    if m == "select" or f is torch.select:
        return indexing.select(ctx, a0, _arg(args, kw, 1, "dim"), _arg(args, kw, 2, "index"), name)
    if m == "unbind" or f is torch.unbind:
        return indexing.unbind(ctx, a0, _arg(args, kw, 1, "dim", 0), name)
    if m == "narrow" or f is torch.narrow:
        return indexing._narrow_sv(ctx, a0, _arg(args, kw, 1, "dim"), _arg(args, kw, 2, "start"),
                               _arg(args, kw, 3, "length"), name)
    if m == "chunk" or f is torch.chunk:
        return joins._chunk_sv(ctx, a0, _arg(args, kw, 1, "chunks"), _arg(args, kw, 2, "dim", 0),
                              name)
    if m == "split" or f is torch.split:
        return joins._split_sv(ctx, a0, _arg(args, kw, 1, "split_size" if m else
                                       "split_size_or_sections"),
                              _arg(args, kw, 2, "dim", 0), name)
    if m == "type_as":
        other = ctx.env.get(args[1]) if isinstance(args[1], torch.fx.Node) else args[1]
        if not (isinstance(other, (_Weight, Val)) or isinstance(other, _Split)
                and other.kind == "f"):
            raise ctx.refuse(name, "converts to the dtype of something other than a "
                                    "float32 tensor")
        return _Split(sp.v, d, "f")
    # --- reductions, softmax, norms along the split dims
    binary = len(args) >= 2 and ctx.is_tensor_like(args[1]) and "dim" not in kw
    if (f in _REDUCE_FUNCS or m in _REDUCE_METHODS) and not (
            (f in (torch.max, torch.min) or m in ("max", "min")) and binary):
        return reductions.reduction(ctx, _REDUCE_FUNCS[f] if f is not None else m, args, kw, name)
    if f in (torch.softmax, F.softmax, torch.log_softmax, F.log_softmax) or \
            m in ("softmax", "log_softmax"):
        ctx._float32_only(kw, name, args)
        dim = _arg(args, kw, 1, "dim")
        if dim is None and f in (F.softmax, F.log_softmax):
            dim = reductions._implicit_softmax_dim(ctx, a0, name)
        return _split_softmax(ctx, a0, dim, f in (torch.log_softmax, F.log_softmax) or
                                   m == "log_softmax", False, name)
    if f is F.softmin:
        dim = _arg(args, kw, 1, "dim")
        return _split_softmax(ctx, a0, dim if dim is not None else
                                   reductions._implicit_softmax_dim(ctx, a0, name, "softmin"), False,
                                   True, name)
    if f is F.normalize:
        return _split_normalize(ctx, a0, _arg(args, kw, 1, "p", 2.0),
                                     _arg(args, kw, 2, "dim", 1), _arg(args, kw, 3, "eps",
                                                                      1e-12), name)
    if f is F.layer_norm:
        return _split_layer_norm(ctx, a0, ctx.ints(_arg(args, kw, 1, "normalized_shape"),
                                                    name),
                                      norms._src(ctx, _arg(args, kw, 2, "weight")),
                                      norms._src(ctx, _arg(args, kw, 3, "bias")),
                                      _arg(args, kw, 4, "eps", 1e-5), name)
    if f is F.glu:
        return _split_glu(ctx, a0, _arg(args, kw, 1, "dim", -1), name)
    if f in _CHANNEL_FUNCS:   # (the same translation as a plain value's)
        return ctx.call_function(node)
    if f is F.batch_norm:
        raise ctx.refuse(name, _split_bn_why(sp))
    if ctx._elementwise(node, args, kw):
        return _split_elementwise(ctx, node, name)
    if f in (torch.matmul, operator.matmul, torch.mm, F.linear, torch.addmm, torch.einsum) \
            or m in ("matmul", "mm", "__matmul__"):
        raise ctx._split_refusal(name, sp, "a matmul of a value whose features are "
                                  f"split into several dims {splits.fmt(d)} (per head: "
                                  "its heads would be rows of the GEMM)", _PER_HEAD_HINT)
    raise ctx._split_refusal(name, sp)


def _split_module(ctx, node: torch.fx.Node, mod: nn.Module, args: tuple, kw: dict,
                  name: str, sp: "_Split | None") -> Any:
    """An nn.Module applied to a split value (see _split_call)."""
    a = args[0] if args else None
    if sp is None:
        sp = _any_split(ctx, node)
    if isinstance(mod, (nn.Softmax, nn.LogSoftmax, nn.Softmin)):
        dim = mod.dim if mod.dim is not None else reductions._implicit_softmax_dim(ctx,
            a, name, "softmin" if isinstance(mod, nn.Softmin) else "softmax")
        return _split_softmax(ctx, a, dim, isinstance(mod, nn.LogSoftmax),
                                   isinstance(mod, nn.Softmin), name)
    if isinstance(mod, nn.LayerNorm):
        return _split_layer_norm(ctx, a, tuple(mod.normalized_shape),
                                      f"{node.target}.weight" if mod.weight is not None
                                      else None,
                                      f"{node.target}.bias" if mod.bias is not None
                                      else None, mod.eps, name)
    if isinstance(mod, nn.GLU):
        return _split_glu(ctx, a, mod.dim, name)
    if isinstance(mod, nn.Flatten):
        return _split_flatten(ctx, sp, mod.start_dim, mod.end_dim, name)
    if isinstance(mod, nn.Unflatten):
        return views.unflatten(ctx, a, mod.dim, mod.unflattened_size, name)
    if isinstance(mod, _CHANNEL_MODULES) and sp is ctx._split_of(a) or \
            isinstance(mod, (nn.CosineSimilarity, nn.PairwiseDistance)):
        return ctx.call_module(node)   # (the same translation as a plain value's)
    if isinstance(mod, nn.modules.batchnorm._BatchNorm):
        raise ctx.refuse(name, _split_bn_why(sp))
    if ctx._elementwise(node, args, kw):
        return _split_elementwise(ctx, node, name)
    if isinstance(mod, nn.Linear):
        raise ctx._split_refusal(name, sp, "a Linear of a value whose features are "
                                  f"split into several dims {splits.fmt(sp.dims)} (per "
                                  "head: its heads would be rows of the GEMM)",
                                  _PER_HEAD_HINT)
    raise ctx._split_refusal(name, sp)

# --- elementwise ops with split operands ---------------------------------------------


def _flat_operand(ctx, a: torch.fx.Node, name: str) -> tuple[int, str]:
    """(flat program value, kind) of an elementwise op's tensor operand."""
    e = ctx.env[a]
    if isinstance(e, _Split):
        return e.v, e.kind
    if isinstance(e, (_Weight, torch.Tensor)) and len(splits.feat_sizes(
            e.shape if isinstance(e, _Weight) else tuple(e.shape))) > 1:
        # an (H, D) parameter: its H * D elements in order, per feature
        shape = tuple(e.shape)
        if isinstance(e, torch.Tensor):
            if e.is_floating_point() and e.dtype != torch.float32:
                raise ctx.refuse(name, f"a {e.dtype} tensor (cupyfuse runs float32)")
            return ctx.b.param(e.detach().float().contiguous(), (math.prod(shape),)), "f"
        return ctx.b.param(e.source, (math.prod(shape),)), "f"
    v = ctx.val(a, name)
    d = ctx.dims(v)
    if not splits.marks(d) and splits.width(d) == 1:   # (a number, a 0-d tensor)
        return v, ctx._kind_of(a)
    return ctx.b.view(v, splits.flat_dims(d)), ctx._kind_of(a)


def _split_elementwise(ctx, node: torch.fx.Node, name: str) -> Any:
    """An elementwise op with split operands: torch's broadcast of every tensor
    operand's dims, each operand laid out for it (``splits.layout``), then the op's
    own translation on those program values."""
    ops: list[torch.fx.Node] = []

    def visit(x: Any) -> None:
        if isinstance(x, (tuple, list)):
            for y in x:
                visit(y)
        elif isinstance(x, torch.fx.Node) and x not in ops and isinstance(
                ctx.env.get(x), (_Split, Val, _Bool, _Int, _Weight, torch.Tensor)):
            ops.append(x)
    for x in list(node.args) + list(node.kwargs.values()):
        visit(x)
    dims = [ctx._operand_dims(ctx.env[x], name) for x in ops]
    try:
        out = splits.broadcast_all(dims, name)
    except TailError as exc:
        raise ctx.err(str(exc)) from None
    saved = {x: ctx.env[x] for x in ops}
    try:
        for x, d in zip(ops, dims):
            flat, kind = _flat_operand(ctx, x, name)
            ctx.env[x] = ctx._wrap(kind, splits.layout(ctx.b, flat, d, out))
        r = getattr(ctx, node.op)(node)
    finally:
        ctx.env.update(saved)
    kind = "b" if isinstance(r, _Bool) else "i" if isinstance(r, _Int) else "f"
    v = r.v if isinstance(r, (_Bool, _Int)) else r
    if type(v) not in (int, Val):   # pragma: no cover - elementwise ops give values
        raise ctx.refuse(name, "an op on split values that gives no tensor")
    flat = splits.flat_dims(out)
    if [x for x in ctx.dims(v) if x != 1] != [x for x in flat if x != 1]:  # pragma: no cover
        raise AssertionError(f"{name}: {ctx.dims(v)} is no layout of {out}")
    return ctx._mk(ctx.b.view(int(v), flat), out, kind)

# --- softmax, normalize, LayerNorm, GLU along the split dims -------------------------


def _split_softmax(ctx, a: Any, dim: Any, log: bool, neg: bool, name: str) -> Any:
    ctx._no_bool_operand(a, name)
    if dim is None:
        raise ctx.refuse(name, "softmax without an explicit dim")
    v, d, _ = ctx._sv(a, name)
    ax = ctx._dim(dim, len(d), name)
    if d[ax] == BATCH:
        raise ctx.refuse(name, f"normalises over the batch dimension (dim {dim}); only "
                                "BatchNorm may use statistics over the batch")
    if neg:
        v = ctx.b.map("neg", v)
    return ctx._mk(splits.softmax(ctx.b, v, d, ax, log), d)


def _split_normalize(ctx, a: Any, p: Any, dim: Any, eps: Any, name: str) -> Any:
    ctx._no_bool_operand(a, name)
    v, d, _ = ctx._sv(a, name)
    ax = ctx._feature_dim(d, dim, name, "normalises along", seq=True)
    p = reductions._norm_order(ctx, p, name)
    return ctx._mk(splits.normalize(ctx.b, v, d, ax, float(p), float(eps)), d)


def _split_layer_norm(ctx, a: Any, shape: tuple, w_src: Any, b_src: Any, eps: float,
                      name: str) -> Any:
    """LayerNorm over the last dims of a split value (``normalized_shape`` (D,): per
    head; (H, D): over the whole row), with its (D,) or (H, D) weight and bias."""
    ctx._no_bool_operand(a, name)
    v, d, _ = ctx._sv(a, name)
    shape = tuple(int(x) for x in shape)
    if not shape or tuple(d[len(d) - len(shape):]) != shape or len(shape) > len(d):
        raise ctx.refuse(name, f"normalized_shape {shape} does not match the value's "
                                f"last dims {splits.fmt(d)}")
    axes = list(range(len(d) - len(shape), len(d)))
    b = ctx.b
    r = splits.layer_norm(b, v, d, axes, float(eps))
    for src, op in ((w_src, "mul"), (b_src, "add")):
        if src is None:
            continue
        flat = b.param(src, (math.prod(shape),))
        r = b.map(op, r, splits.layout(b, flat, shape, d))
    if b_src is None:   # torch adds the bias, or 0 without one: -0.0 gives +0.0
        r = b.map("add", r, b.const(0.0))
    return ctx._mk(r, d)


def _split_glu(ctx, a: Any, dim: Any, name: str) -> Any:
    """F.glu along a split dim: first half * sigmoid(second half)."""
    ctx._no_bool_operand(a, name)
    v, d, _ = ctx._sv(a, name)
    ax = ctx._feature_dim(d, dim, name, "halves")
    if d[ax] % 2:
        raise ctx.err(f"{name}: halving an odd dimension of {d[ax]} features")
    h = d[ax] // 2
    first, out = splits.narrow(ctx.b, v, d, ax, 0, h)
    second, _ = splits.narrow(ctx.b, v, d, ax, h, h)
    return ctx._mk(ctx.b.map("mul", first, ctx.b.map("sigmoid", second)), out)

# --- flatten, squeeze, permute of split values ---------------------------------------
def _split_flatten(ctx, sp: "_Split", start: Any, end: Any, name: str) -> Any:
    d = sp.dims
    s, e = ctx._dim(start, len(d), name), ctx._dim(end, len(d), name)
    group = d[s:e + 1]
    non1 = [x for x in group if x != 1]
    if any(x in splits.ROW for x in group) and len(non1) > 1:
        raise ctx.refuse(name, "flattening the batch or a leading dim together with "
                                f"feature dims of a {splits.fmt(d)} value (write "
                                f"`.flatten({_first_feature(d)})` to join the "
                                "features)")
    merged = next((x for x in non1 if x in splits.ROW), math.prod(non1))
    return ctx._mk(sp.v, d[:s] + (merged,) + d[e + 1:], sp.kind)



def _split_squeeze(ctx, sp: "_Split", dim: Any, name: str) -> Any:
    d = sp.dims
    if dim is None:
        if BATCH in d:
            raise ctx.refuse(name, f"squeeze() with no dim of a {splits.fmt(d)} value "
                                    "(torch drops the batch dim at batch size 1): give it "
                                    "the dims to drop")
        return ctx._mk(sp.v, tuple(x for x in d if x != 1), sp.kind)
    dl = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    idx = {ctx._dim(x, len(d), name) for x in dl}
    return ctx._mk(sp.v, tuple(x for i, x in enumerate(d) if not (i in idx and x == 1)),
                    sp.kind)


def _split_permute(ctx, sp: "_Split", perm: list, name: str) -> Any:
    d = sp.dims
    perm, in_order = transposes._perm(ctx, d, perm, name)
    if not in_order:
        out = [d[x] for x in perm]
        if next(x for x in out if x != 1) != BATCH:
            raise ctx.refuse(name, f"moves the batch dim: {splits.fmt(d)} to "
                              f"{splits.fmt(out)}; cupyfuse computes each row of the "
                              "batch on its own")
        # (a feature dim before a leading one)
        seen_feature = False
        lead_moved = False
        for x in out:
            seen_feature = seen_feature or (x not in splits.ROW and x != 1)
            lead_moved = lead_moved or (x == LEAD and seen_feature)
        if lead_moved:
            raise ctx.refuse(name, f"moves a leading (sequence) dim among the split "
                              f"feature dims of a {splits.fmt(d)} value ({splits.fmt(out)}: "
                              "attention heads' (batch, heads, seq, d) layout): cupyfuse "
                              "keeps the sequence in the program's rows and each row's "
                              "features in their order; reduce, index or normalise the "
                              "dims where they are (softmax or a mean over the sequence "
                              "is `dim=1` of (batch, seq, H, D))")
        raise ctx.refuse(name, f"reorders the dims of a {splits.fmt(d)} value, which "
                                "moves data within each row (cupyfuse keeps a value's "
                                "features in their order): index, reduce or normalise the "
                                "dims where they are, e.g. `.sum(1)` rather than "
                                "`.transpose(1, 2).sum(-1)`, `[:, :, j]` rather than "
                                "`.transpose(1, 2)[:, j]`")
    return ctx._mk(sp.v, tuple(d[x] for x in perm), sp.kind)


def _split_movedim(ctx, sp: "_Split", src: Any, dst: Any, name: str) -> Any:
    return _split_permute(ctx, sp, transposes._movedim_perm(ctx, len(sp.dims), src, dst, name),
                               name)
