"""Linear layers in a traced forward (:mod:`cupyfuse.frontend.translate`): ``linear`` (the GEMM, or a
row sum for a Linear to one feature after an earlier one) for nn.Linear, F.linear and the
matmul / mm / addmm / einsum forms with a weight parameter; attention pooling written as
a batched matmul or an einsum (a sum over the sequence); and the weights and biases a
forward computes from its module's tensors alone (``self.w * 2``, a merged LoRA): one
:class:`~cupyfuse.ir.derived.Derived` source each, evaluated with torch at each call.
"""
from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from cupyfuse.frontend.tables import _AUGMENTED, _AUG_ASSIGN_FUNCS, _arg, _node_name
from cupyfuse.frontend.values import Val, _Weight
from cupyfuse.ir.derived import Derived, FUNCS, METHODS, RANDOM_FUNCS, RANDOM_METHODS, Ref
from cupyfuse.ir.program import BATCH, LEAD, _fmt_dims
from cupyfuse.frontend.lower import elementwise, reductions
import torch.nn as nn
from cupyfuse.frontend import lower as lowering


# --- derived weights (see Translator._plan_derived) -----------------------------------
#: env value of a node that only a derived weight reads (it is not translated)
_IN_DERIVED = object()
#: attributes a derived weight may read of a tensor
_DERIVED_ATTRS = frozenset({"T", "mT", "shape", "dtype", "device", "ndim", "data"})
#: dropout functions: (position of ``training``, its default); random where active
_DROPOUTS: dict[Any, tuple[int, bool]] = {
    F.dropout: (2, True), F.dropout1d: (2, True), F.dropout2d: (2, True),
    F.dropout3d: (2, True), F.alpha_dropout: (2, False), F.feature_alpha_dropout: (2, False),
    torch.dropout: (2, True), F.rrelu: (3, False),
}


def _dropout_active(f: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a dropout call (or F.rrelu) draws random numbers: training, and (dropout)
    p > 0. Arguments that are not plain values count as active."""
    pos, default = _DROPOUTS[f]
    training = _arg(args, kwargs, pos, "train" if f is torch.dropout else "training", default)
    if f is F.rrelu:
        return training is not False
    p = _arg(args, kwargs, 1, "p", 0.5)
    return training is not False and not (type(p) in (int, float) and p == 0)


def _gemm_operands(n: torch.fx.Node) -> list[Any]:
    """The arguments of ``n`` that a Linear reads as its weight or bias (matmul forms:
    the second operand; addmm: mat2 and the added input; einsum: the weight)."""
    a, kw = n.args, n.kwargs
    if n.op == "call_function":
        f = n.target
        if f is F.linear:
            return [_arg(a, kw, 1, "weight"), _arg(a, kw, 2, "bias")]
        if f in (torch.matmul, operator.matmul, torch.mm):
            return [_arg(a, kw, 1, "other" if f is torch.matmul else "mat2")]
        if f is torch.addmm:
            return [_arg(a, kw, 2, "mat2"), _arg(a, kw, 0, "input")]
        if f is torch.einsum and len(a) == 3:
            return [a[2]]
    if n.op == "call_method" and n.target in ("matmul", "mm", "__matmul__") and len(a) == 2:
        return [a[1]]
    return []


def _metadata_read(n: torch.fx.Node) -> bool:
    """``W.shape``, ``W.size(...)``, ``W.dtype``, ``W.ndim``...: not a tensor."""
    if n.op == "call_function" and n.target is getattr:
        return len(n.args) > 1 and n.args[1] in ("shape", "dtype", "device", "ndim")
    return n.op == "call_method" and n.target in ("size", "dim", "numel", "nelement",
                                                   "ndimension", "get_device")


def _weight_transpose(n: torch.fx.Node) -> bool:
    """``W.t()``, ``W.transpose(...)``, ``W.T``, ``W.mT``, ``torch.t(W)``,
    ``torch.transpose(W, 0, 1)`` and ``W.contiguous()`` (or ``.clone()``, ``.detach()``,
    ``.float()``): forms the translator reads as the weight itself or transposed (a GEMM
    flag, no data moved)."""
    if n.op == "call_method":
        return bool(n.args) and (n.target in ("t", "transpose") or (
            n.target in ("contiguous", "clone", "detach", "float") and len(n.args) == 1
            and not n.kwargs))
    if n.op != "call_function" or not n.args:
        return False
    a = n.args
    if n.target is torch.t:
        return len(a) == 1 and not n.kwargs
    if n.target is torch.transpose:   # (of a 2-D weight: dims 0 and 1, either sign)
        return len(a) == 3 and not n.kwargs and all(type(d) is int for d in a[1:]) and \
            {a[1] % 2, a[2] % 2} == {0, 1}
    return n.target is getattr and len(a) == 2 and a[1] in ("T", "mT")


# --- derived weights ---------------------------------------------------------------
def _plan_derived(ctx) -> None:
    """Find the GEMM operands (a Linear's weight or bias) computed from the module's
    tensors alone (``ctx.w * 2``, ``F.normalize(ctx.fc.weight, dim=1)``, a merged
    LoRA), and the tensors computed from a matrix of the module's alone that the
    batch's computation reads otherwise (``(ctx.centres ** 2).sum(1)`` added to a
    GEMM's output: the tail refuses a matrix outside a matmul): each becomes one
    :class:`~cupyfuse.ir.derived.Derived` source, evaluated with torch at each call
    (``derived_roots``); the nodes only those read are not translated
    (``derived_skip``). A Python number passed to the forward may take
    part (a constant of the program, ``derived_numbers``). A parameter itself, or its
    ``.t()``/``.T`` (which the GEMM reads transposed), stays an ordinary weight."""
    nodes = list(ctx.t.graph.nodes)
    # values of the module's tensors (and the numbers passed) alone
    fixed: set[torch.fx.Node] = set()
    # ... and of those, the tensors computed from a matrix parameter or buffer
    matrix: set[torch.fx.Node] = set()
    ctx.derived_numbers = {}
    k = 0
    for n in nodes:
        if n.op == "placeholder":   # (as run() reads them)
            j = k - sum(1 for i in ctx.numbers if i < k) \
                - sum(1 for i in ctx.specialized if i < k)
            if k in ctx.numbers:
                ctx.derived_numbers[n] = ctx.numbers[k]
            elif k not in ctx.specialized and j >= len(ctx.shapes) and n.args and \
                    type(n.args[0]) in (int, float):   # a number left at its default
                ctx.derived_numbers[n] = n.args[0]
            if n in ctx.derived_numbers:
                fixed.add(n)
            k += 1
        elif n.op == "get_attr":
            try:
                obj = ctx._get_attr(n.target)
            except AttributeError:
                continue
            if isinstance(obj, torch.Tensor):
                fixed.add(n)
                if obj.dim() >= 2 and sorted(obj.shape)[-2] > 1:
                    matrix.add(n)
        elif n.op in ("call_function", "call_method", "call_module"):
            ins = n.all_input_nodes
            if ins and all(i in fixed for i in ins):
                fixed.add(n)
                if any(i in matrix for i in ins) and not _metadata_read(n):
                    matrix.add(n)
    roots: set[torch.fx.Node] = set()
    for n in nodes:
        if n in fixed:   # (a matmul of two parameters is part of a derived weight)
            continue
        for a in _gemm_operands(n):
            if not isinstance(a, torch.fx.Node) or a not in fixed:
                continue
            while _weight_transpose(a) and a.args[0] in fixed:
                a = a.args[0]   # W.t() / W.T of a weight: the GEMM reads it transposed
            if a.op not in ("get_attr", "placeholder"):   # (a number passed: refused)
                roots.add(a)
    for n in nodes:   # a matrix's derived tensor read by the tail (not as a weight)
        if n in matrix and n.op != "get_attr" and not _weight_transpose(n) and any(
                u not in fixed and not any(a is n for a in _gemm_operands(u))
                for u in n.users):
            roots.add(n)
    skip: set[torch.fx.Node] = set()
    for n in reversed(nodes):
        if n in fixed and n.op not in ("get_attr", "placeholder") and n not in roots and \
                n.users and \
                all(u in skip or u in roots for u in n.users):
            skip.add(n)
    ctx.derived_roots, ctx.derived_skip = roots, skip
    # (what the refusals call a derived source: a GEMM's operand or a tail's tensor)
    ctx.derived_weights = {a for n in nodes for a in _gemm_operands(n) if a in roots}


def _derived(ctx, root: torch.fx.Node) -> _Weight:
    """The weight (or bias) ``root`` computes from the module's tensors, as a
    :class:`~cupyfuse.ir.derived.Derived` source: its ops checked (deterministic, not in
    place), then evaluated once now for its shape and dtype."""
    order = {n: i for i, n in enumerate(ctx.t.graph.nodes)}
    seen: set[torch.fx.Node] = set()
    todo = [root]
    nums = ctx.derived_numbers
    while todo:
        n = todo.pop()
        if n not in seen and n not in nums:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    anc = sorted(seen, key=order.__getitem__)
    leaves = [n for n in anc if n.op == "get_attr"]
    steps_n = [n for n in anc if n.op != "get_attr"]
    kind = _derived_kind(ctx, root)
    for n in steps_n:
        _derived_op_check(ctx, n, kind)
    for n in anc:
        _derived_users_check(ctx, n, seen, kind)
    ctx.cur = root
    index = {n: i for i, n in enumerate(leaves + steps_n)}

    def ref(a: torch.fx.Node) -> Any:   # (a number passed: this program's constant)
        return nums[a] if a in nums else Ref(index[a])

    steps = [(n.op, n.target, torch.fx.node.map_arg(n.args, ref),
              torch.fx.node.map_arg(n.kwargs, ref)) for n in steps_n]
    d = Derived([str(n.target) for n in leaves], steps, (), ctx._where(), root.name)
    what = _node_name(root)
    try:
        r = d.evaluate(d.leaves(ctx.m))
    except Exception as exc:
        raise ctx.refuse(what, f"computing {kind} from the module's "
                                f"tensors raised {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    if not isinstance(r, torch.Tensor):
        raise ctx.refuse(what, f"{kind} that is a "
                                f"{type(r).__name__}, not a tensor")
    if r.dtype != torch.float32:
        raise ctx.refuse(what, f"{kind} computed as {r.dtype} "
                                "(cupyfuse runs float32)")
    d.shape = tuple(int(x) for x in r.shape)
    return _Weight(d, d.shape)


def _derived_kind(ctx, root: torch.fx.Node) -> str:
    """What the refusals call the derived source ``root`` is."""
    return "a Linear's weight or bias" if root in ctx.derived_weights else \
        "a tensor the tail reads"


def _derived_op_check(ctx, n: torch.fx.Node, kind: str) -> None:
    """Refuse an op of a derived weight that is random, in place, a module call or
    outside :data:`cupyfuse.ir.derived.FUNCS` / ``METHODS`` (naming it and its line)."""
    ctx.cur = n
    name = _node_name(n)
    where = f"in {kind} computed from the module's tensors"
    if n.op == "call_module":
        raise ctx.refuse(f"{name} ({type(ctx._get_attr(n.target)).__name__})",
                          f"a module called {where} (cupyfuse evaluates torch functions "
                          "and tensor methods there)")
    f = n.target
    inplace = n.kwargs.get("inplace", False) is True or f in _AUGMENTED or (
        n.op == "call_method" and f.endswith("_") and not f.endswith("__"))
    if n.op == "call_function" and f in _DROPOUTS and not inplace:
        if not _dropout_active(f, n.args, n.kwargs):
            return   # the identity where torch's dropout is not training (or p = 0)
    if f in RANDOM_FUNCS or f in RANDOM_METHODS:
        raise ctx.refuse(name, f"random {where}: cupyfuse evaluates it once and reuses it "
                                "while the tensors are unchanged, eager draws anew every "
                                "call")
    if inplace:
        raise ctx.refuse(name, f"an in-place op {where}: write it out of place "
                                "(`w = w * s`, not `w.mul_(s)`)")
    if (n.op == "call_function" and f not in FUNCS) or \
            (n.op == "call_method" and f not in METHODS):
        raise ctx.refuse(name, f"not evaluated {where} (elementwise math, reductions, "
                                "matmuls, views, F.normalize and the like are)")
    if f is getattr and (len(n.args) < 2 or n.args[1] not in _DERIVED_ATTRS):
        raise ctx.refuse(f".{n.args[1] if len(n.args) > 1 else '?'}",
                          f"an attribute read {where} (.T, .mT, .shape, .dtype, .device, "
                          ".ndim and .data are)")
    if f in _AUG_ASSIGN_FUNCS.values() and ctx._augmented(n):
        # ``w *= s``: fx records it out of place; in place it must not touch the
        # module's tensors, nor a value read again
        ctx._check_inplace(n, True, name)


def _derived_users_check(ctx, n: torch.fx.Node, part: set[torch.fx.Node],
                         kind: str) -> None:
    """Refuse an in-place op on ``n`` (a value a derived weight reads), or on a view of
    it, anywhere in the forward: the weight would be computed without it."""
    seen: set[torch.fx.Node] = set()
    todo = [n]
    while todo:
        a = todo.pop()
        if a in seen:
            continue
        seen.add(a)
        for u in a.users:
            if not u.args or u.args[0] is not a:
                continue
            f = u.target
            if u.op == "call_method" and isinstance(f, str) and f.endswith("_") and \
                    not f.endswith("__") or u.kwargs.get("inplace", False) is True or \
                    (u.op == "call_function" and f in _AUGMENTED):
                ctx.cur = u
                raise ctx.refuse(_node_name(u), f"an in-place op on a value that {kind} "
                                  "computed from the module's tensors reads (it is "
                                  "computed out of place, without it): write it out of "
                                  "place")
            if u in part and u.op == "call_function" and f in _AUG_ASSIGN_FUNCS.values() \
                    and ctx._augmented(u):
                continue   # (checked as one of its ops)
            if ctx._aliases(u):
                todo.append(u)

# --- Linear layers (nn.Linear, F.linear, matmul/mm/addmm/einsum with a weight) ----
def linear(ctx, a: Any, w: _Weight, bias_src: Any, name: str) -> int:
    ctx._no_bool_operand(a, name)
    av = ctx.val(a, name)
    n, k = w.shape  # w is the (N, K) weight; w.transposed: its source holds (K, N)
    da = ctx.dims(av)
    if BATCH not in da:
        raise ctx.refuse(name, "a Linear of a value without the batch dimension (a "
                                "parameter or constant: fold it into the bias)")
    width = max([d for d in da if d > 1], default=1)
    if (width != k and not (width == 1 and k == 1)) or da[-1] != k:
        raise ctx.err(f"{name}: weight expects {k} input features in the last dim, its "
                       f"input has shape {_fmt_dims(da)}")
    flat = ctx.b.view(av, (BATCH, k), rows=True)
    root = flat
    while ctx.b.p.nodes[root].kind == "view":
        root = ctx.b.p.nodes[root].args[0]
    if n == 1 and k > 1 and not w.transposed and ctx.b.p.nodes[root].kind != "input" \
            and any(nd.kind == "gemm" for nd in ctx.b.p.nodes):
        # (after an earlier Linear: the program keeps a GEMM)
        # a Linear to one feature of a tail's value (an attention score, a value head):
        # its dot product with the weight's row as a row sum in the tail's kernel (fp32
        # products added in a fixed order) instead of a GEMM of one column, and the
        # launches around it (x's split, the GEMM, its own tail)
        h = ctx.b.reduce("sum", ctx.b.map("mul", flat, ctx.b.param(w.source, (1, k))),
                          1)
    else:
        h = ctx.b.gemm(flat, w.source, n, w.transposed)
    if bias_src is not None:
        h = ctx.b.map("add", h, ctx.b.param(bias_src, (n,)))
    if da[-1] == k and len(da) > 2:   # torch keeps the input's other dims: (batch, 1, n)
        h = ctx.b.view(h, da[:-1] + (n,), rows=True)
    return h


def matvec(ctx, a: Any, q: Any, w: _Weight, name: str) -> Any:
    """``h @ q`` with ``q`` a 1-D parameter or buffer (a learned query scoring each
    position): torch contracts h's last dim with q, dropping it -- the row sums of
    ``h * q`` over the features (a GEMV of one column; summed in double here, as every
    row reduction)."""
    if not ctx.is_value(a):
        raise ctx.refuse(name, "a matmul of two parameters")
    width = ctx.dims(ctx.val(a, name))[-1]
    if width != w.shape[0]:
        raise ctx.refuse(name, f"size mismatch: a last dim of {width} against a vector of "
                          f"{w.shape[0]} (torch raises)")
    prod = Val(elementwise.binary(ctx, "mul", a, q, None, name, None))
    return reductions.reduction(ctx, "sum", (prod, -1), {}, name)


def seq_matmul(ctx, a: Any, b: Any, name: str) -> int:
    """Attention pooling written as a batched matmul: ``w (batch, 1, seq) @ h (batch,
    seq, n)`` (torch.bmm, matmul, @) is the sum over the sequence of ``w * h``, a
    (batch, 1, n) value. Other products of two values are refused."""
    va, vb = ctx.val(a, name), ctx.val(b, name)
    da, db = ctx.dims(va), ctx.dims(vb)
    if len(da) == 3 and len(db) == 3 and da[0] == db[0] == BATCH and da[2] == 1 and \
            db[1] == 1 and (da[1] == 1 or db[2] == 1):
        # (batch, n, 1) @ (batch, 1, 1), or (batch, 1, 1) @ (batch, 1, k): one product
        # per element (a sequence of one position: h.transpose(1, 2) @ w)
        return ctx.b.map("mul", va, vb)
    # (a sequence of one position is no leading dim: one product per row there)
    if len(da) != 3 or len(db) != 3 or da[:2] != (BATCH, 1) or da[2] not in (LEAD, 1) \
            or db[:2] != (BATCH, da[2]):
        raise ctx.refuse(name, "a matmul whose second operand is not a 2-D parameter "
                          "(the weight), nor attention pooling over the sequence "
                          "(weights (batch, 1, seq) @ values (batch, seq, n)); shapes "
                          f"{_fmt_dims(da)} and {_fmt_dims(db)}")
    w = ctx.b.view(va, (BATCH, da[2], 1))
    return ctx.b.reduce("sum", ctx.b.map("mul", w, vb), 1, True)


def einsum(ctx, args: tuple, name: str) -> int:
    """torch.einsum as a Linear: 'bi,oi->bo' (or 'bi,io->bo', '...i,oi->...o'), the
    second operand the weight parameter; or attention pooling 'bs,bsd->bd' (weights
    (batch, seq), values (batch, seq, n), either order)."""
    if len(args) != 3 or not isinstance(args[0], str):
        raise ctx.refuse(name, "einsum other than x with one weight")
    eq = args[0].replace(" ", "")
    pool = re.fullmatch(r"([a-zA-Z])([a-zA-Z]),\1\2([a-zA-Z])->\1\3", eq)
    pool_r = re.fullmatch(r"([a-zA-Z])([a-zA-Z])([a-zA-Z]),\1\2->\1\3", eq)
    if (pool or pool_r) and ctx.is_value(args[1]) and ctx.is_value(args[2]):
        m = pool or pool_r
        if len(set(m.groups())) == 3:
            ws, hs = (args[1], args[2]) if pool else (args[2], args[1])
            vw, vh = ctx.val(ws, name), ctx.val(hs, name)
            dw = ctx.dims(vw)
            if len(dw) != 2 or dw[0] != BATCH or dw[1] not in (LEAD, 1) or \
                    ctx.dims(vh)[:2] != dw or len(ctx.dims(vh)) != 3:
                raise ctx.refuse(name, f"einsum {eq!r}: pools (batch, seq) weights "
                                  "and (batch, seq, n) values over the sequence; shapes "
                                  f"{_fmt_dims(ctx.dims(vw))} and "
                                  f"{_fmt_dims(ctx.dims(vh))}")
            w = ctx.b.view(vw, dw + (1,))
            return ctx.b.reduce("sum", ctx.b.map("mul", w, vh), 1, False)
    w = ctx.env.get(args[2]) if isinstance(args[2], torch.fx.Node) else None
    m = re.fullmatch(r"((?:\.\.\.)?[a-zA-Z]*)([a-zA-Z]),([a-zA-Z])([a-zA-Z])->"
                     r"((?:\.\.\.)?[a-zA-Z]*)([a-zA-Z])", eq)
    if m is None or not isinstance(w, _Weight) or len(w.shape) != 2:
        raise ctx.refuse(name, f"einsum {eq!r}: only x @ W forms with a 2-D weight "
                          "parameter are fused")
    pre, k, w0, w1, opre, n = m.groups()
    letters = pre.replace("...", "")
    if pre != opre or k == n or k in letters or n in letters or len(set(letters)) != len(letters) \
            or {w0, w1} != {k, n}:
        raise ctx.refuse(name, f"einsum {eq!r}: not a Linear")
    if "..." not in pre and ctx.is_value(args[1]) and \
            len(ctx.dims(ctx.env[args[1]])) != len(letters) + 1:
        raise ctx.refuse(name, f"einsum {eq!r} of a {len(ctx.dims(ctx.env[args[1]]))}-dim "
                                "operand (torch raises)")
    # W as the (N, K) weight: its source holds (N, K) when written 'nk'
    wt = w if (w0, w1) == (n, k) else _Weight(w.source, w.shape[::-1], not w.transposed)
    return linear(ctx, args[1], wt, None, name)


def _rank2(ctx, a: Any, name: str) -> None:
    if getattr(ctx, "_rows_ctx", False):   # (a (batch * seq, F) view: 2-dim in torch)
        return
    if ctx.is_value(a) and len(ctx.dims(ctx.env[a])) != 2:
        raise ctx.refuse(name, f"a {len(ctx.dims(ctx.env[a]))}-dim operand (it takes "
                                "matrices; torch raises)")


# --- spellings ---------------------------------------------------------------------------
@lowering.function(torch.matmul, operator.matmul, torch.mm, torch.bmm)
def _matmul_fn(ctx, node, args, kw, name):
    f = node.target
    if f is not torch.mm and len(args) == 2 and ctx.is_value(args[0]) and ctx.is_value(args[1]):
        return seq_matmul(ctx, args[0], args[1], name)   # attention pooling over the sequence
    if f is torch.bmm:
        raise ctx.refuse_function(f, name)
    w = ctx.env.get(args[1]) if isinstance(args[1], torch.fx.Node) else args[1]
    if f is not torch.mm and isinstance(w, _Weight) and len(w.shape) == 1:
        return matvec(ctx, args[0], args[1], w, name)
    if not isinstance(w, _Weight) or len(w.shape) != 2:
        raise ctx.refuse(f"{name}", "a matmul whose second operand is not a 2-D parameter "
                                    "(the weight)")
    if f is torch.mm:
        _rank2(ctx, args[0], name)   # torch.mm takes matrices only
    # x @ B with B (K, N): the Linear weight is B.T, (N, K)
    return linear(ctx, args[0], _Weight(w.source, w.shape[::-1], not w.transposed), None, name)


@lowering.function(torch.addmm)
def _addmm_fn(ctx, node, args, kw, name):
    # beta * input + alpha * (mat1 @ mat2), mat2 the weight
    w = ctx.env.get(args[2]) if isinstance(args[2], torch.fx.Node) else None
    if not isinstance(w, _Weight) or len(w.shape) != 2:
        raise ctx.refuse(name, "its second matrix is not a 2-D parameter (the weight)")
    _rank2(ctx, args[1], name)   # torch.addmm takes matrices only
    h = linear(ctx, args[1], _Weight(w.source, w.shape[::-1], not w.transposed), None, name)
    alpha, beta = kw.get("alpha", 1), kw.get("beta", 1)
    if alpha != 1:
        h = ctx.b.map("mul", h, ctx.b.const(float(alpha)))
    inp = ctx.val(args[0], name)
    if beta != 1:
        inp = ctx.b.map("mul", inp, ctx.b.const(float(beta)))
    return ctx.b.map("add", h, inp)


@lowering.function(F.linear)
def _linear_fn(ctx, node, args, kw, name):
    w = ctx.env.get(args[1]) if isinstance(args[1], torch.fx.Node) else None
    if not isinstance(w, _Weight) or len(w.shape) != 2:
        raise ctx.refuse("F.linear", "its weight is not a 2-D parameter (nor computed from the "
                                     "module's tensors alone)")
    bias = _arg(args, kw, 2, "bias")
    bsrc = None
    if bias is not None:
        bw = ctx.env.get(bias)
        if not isinstance(bw, _Weight):
            raise ctx.refuse("F.linear", "its bias is not a parameter (nor computed from the "
                                         "module's tensors alone)")
        bsrc = bw.source
    return linear(ctx, args[0], w, bsrc, name)


@lowering.function(torch.einsum)
def _einsum_fn(ctx, node, args, kw, name):
    return einsum(ctx, args, name)


@lowering.method("matmul", "mm", "bmm", "__matmul__")
def _matmul_method(ctx, node, self_, args, kw, name):
    m = node.target
    if m != "mm" and len(args) == 2 and ctx.is_value(self_) and ctx.is_value(args[1]):
        return seq_matmul(ctx, self_, args[1], name)
    if m == "bmm" or len(args) != 2:
        raise ctx.refuse(name)
    w = ctx.env.get(args[1]) if isinstance(args[1], torch.fx.Node) else args[1]   # x.matmul(W.t())
    if m != "mm" and isinstance(w, _Weight) and len(w.shape) == 1:
        return matvec(ctx, self_, args[1], w, name)
    if not isinstance(w, _Weight) or len(w.shape) != 2:
        raise ctx.refuse(name, "a matmul whose second operand is not a 2-D parameter (the "
                               "weight)")
    if m == "mm":
        _rank2(ctx, self_, name)   # Tensor.mm takes matrices only
    return linear(ctx, self_, _Weight(w.source, w.shape[::-1], not w.transposed), None, name)


@lowering.module(nn.Linear)
def _linear_module(ctx, node, mod, a, name):
    if mod.weight is None:
        raise ctx.refuse(name, "its weight is None (torch raises TypeError)")
    return linear(ctx, a, _Weight(f"{node.target}.weight", tuple(mod.weight.shape)),
                  f"{node.target}.bias" if mod.bias is not None else None, name)
