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


class _PermMixin:
    """Transposes and transposed values: methods of the translator
    (:class:`cupyfuse.frontend.translate._Translator` inherits them and holds the state they use)."""

    # --- transpose, permute, movedim -----------------------------------------------------
    def transpose(self, a: Any, d0: int, d1: int, name: str) -> int:
        v = self.val(a, name)
        n = len(self.dims(v))
        perm = list(range(n))
        d0, d1 = self._dim(d0, n, name), self._dim(d1, n, name)
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return self.permute(a, perm, name)

    def _perm(self, d: Sequence[int], perm: list, name: str) -> tuple[list[int], bool]:
        """A permutation of a value of dims ``d`` with its dims made non-negative, and
        whether it keeps the order of the dims that are not size 1 (a view); torch's
        errors for a bad permutation refused."""
        if len(perm) != len(d):
            raise self.refuse(name, f"a permutation of {len(perm)} dims of a {len(d)}-dim "
                                    "value (torch raises)")
        perm = [self._dim(p, len(d), name) for p in perm]
        if len(set(perm)) != len(perm):
            raise self.refuse(name, f"a permutation {perm} that repeats a dim (torch raises)")
        moved = [p for p in perm if d[p] != 1]
        return perm, moved == sorted(moved)

    def permute(self, a: Any, perm: list, name: str) -> Any:
        v = self.val(a, name)
        d = self.dims(v)
        perm, in_order = self._perm(d, perm, name)
        if not in_order:
            out = [d[p] for p in perm]
            if BATCH not in d or next(x for x in out if x != 1) != BATCH:
                # a value is stored row by row: a transpose that moves the batch dim after
                # another (h.t() of a (batch, n) value) is data movement across rows
                raise self.refuse(name, f"moves the batch dim: {_fmt_dims(d)} to "
                                  f"{_fmt_dims(out)}; cupyfuse computes each row of the batch "
                                  "on its own, so an op across the batch's rows after it (a "
                                  "product `a @ b.t()` of two values, a similarity matrix) is "
                                  "not fused (dims after the batch may be reordered)")
            # dims after the batch reordered ((batch, seq, C) as (batch, C, seq)): a
            # relabelling of the same storage (_Perm)
            return self._perm_mk(v, perm, self._kind_of(a))
        return self.b.view(v, [d[p] for p in perm])

    def _reorder(self, node: torch.fx.Node, args: tuple, kw: dict, n: int,
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
            d0, d1 = self._dim(a0, n, name), self._dim(a1, n, name)
            perm[d0], perm[d1] = perm[d1], perm[d0]
            return perm
        if m == "permute":
            perm = args[1:] if not (len(args) == 2 and isinstance(args[1], (tuple, list))) \
                else args[1]
            perm = kw.get("dims", perm)
            return list(perm)
        if m == "t":
            if n > 2:
                raise self.refuse(name, f"t() of a {n}-dim value (torch raises: it takes "
                                        "at most 2 dims)")
            return list(range(n))[::-1]
        if m in ("movedim", "moveaxis"):
            return self._movedim_perm(n, _arg(args, kw, 1, "source"),
                                      _arg(args, kw, 2, "destination"), name)
        if m == "T":
            return list(range(n))[::-1]
        if m == "mT":
            if n < 2:
                raise self.refuse(name, "mT of a value of fewer than 2 dims (torch raises)")
            return list(range(n - 2)) + [n - 1, n - 2]
        raise self.refuse(name)   # pragma: no cover - the callers pass these only

    def _movedim_perm(self, n: int, src: Any, dst: Any, name: str) -> list[int]:
        """torch.movedim's permutation of an ``n``-dim value."""
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        if len(src) != len(dst):
            raise self.refuse(name, "source and destination of different lengths (torch "
                                    "raises)")
        src = [self._dim(x, n, name) for x in src]
        dst = [self._dim(x, n, name) for x in dst]
        if len(set(src)) != len(src) or len(set(dst)) != len(dst):
            raise self.refuse(name, "repeats a dim in source or destination (torch raises)")
        order: list[Any] = [None] * n
        for s_, t_ in zip(src, dst):
            order[t_] = s_
        rest = iter(i for i in range(n) if i not in src)
        return [x if x is not None else next(rest) for x in order]

    # --- values with their dims after the batch reordered (_Perm) -----------------------
    def _perm_dims(self, P: "_Perm") -> tuple[int, ...]:
        """torch's dims of a ``_Perm`` value."""
        d = self.dims(P.v)
        return tuple(d[p] for p in P.perm)

    def _perm_mk(self, v: int, perm: Sequence[int], kind: str = "f") -> Any:
        """Program value ``v`` seen with its dims in the order ``perm``: a ``_Perm``, or
        a plain view where the dims other than 1 keep their order."""
        d = self.dims(v)
        perm = tuple(perm)
        moved = [p for p in perm if d[p] != 1]
        if moved == sorted(moved):
            return self._wrap(kind, self.b.view(v, [d[p] for p in perm]))
        return _Perm(v, perm, kind)

    def _perm_sizes(self, P: "_Perm") -> tuple[_Size, ...]:
        """``.shape`` of a ``_Perm`` value: torch's order, each leading dim still the
        input's k-th."""
        d = self.dims(P.v)
        return tuple(_Size(d[p], i, d[:p].count(LEAD) if d[p] == LEAD else None)
                     for i, p in enumerate(P.perm))

    # --- ops reading a transposed value (_Perm) ------------------------------------------
    def _perm_call(self, node: torch.fx.Node) -> Any:
        """An op reading a value whose dims after the batch torch sees reordered
        (``_Perm``: ``h.transpose(1, 2)`` of a (batch, seq, C) value): its shape, more
        reorders (back to the program's order: the value again), elementwise ops (other
        operands laid out in the value's own order), reductions, softmax and normalize
        along a dim (mapped to the value's), BatchNorm over the channels of (batch, C,
        seq...), pooling over a whole sequence, ``h.transpose(1, 2) @ w`` with weights
        (batch, seq, 1); anything else refused saying why."""
        op, t, args, kw, mod, name = self._call_parts(node)
        m = t if op == "call_method" else None
        f = t if op == "call_function" else None
        a0 = args[0] if args else None
        P = self.env.get(a0) if isinstance(a0, torch.fx.Node) else None
        P = P if isinstance(P, _Perm) else None
        first = next(self.env[a] for a in node.all_input_nodes
                     if isinstance(self.env.get(a), _Perm))
        T = self._perm_dims(first)
        n = len(T)
        shown = _fmt_dims(T)

        def refuse(why: str = "") -> TailError:
            return self.refuse(name, (why or f"an op on a transposed value {shown} (its dims "
                                      "after the batch reordered)") + ": cupyfuse fuses "
                               "elementwise ops, reductions, softmax and normalize along a "
                               "dim, BatchNorm over the channels (dim 1) and pooling over "
                               "a whole sequence of such a value, and a transpose back to "
                               "the order it came in")

        # --- its shape, and reorders
        if P is not None and f is getattr:
            attr = args[1]
            if attr == "shape":
                return self._perm_sizes(P)
            if attr == "dtype":
                return {"b": torch.bool, "i": torch.int64}.get(P.kind, torch.float32)
            if attr == "device":
                return _DEVICE
            if attr in ("T", "mT"):
                return self._perm_reorder(P, self._reorder(node, args, kw, n, f".{attr}"),
                                          f".{attr}")
            raise refuse(f"`.{attr}` of a transposed value {shown}")
        if P is not None and m == "size":
            dd = _arg(args, kw, 1, "dim")
            sz = self._perm_sizes(P)
            return sz if dd is None else sz[self._dim(dd, n, name)]
        if P is not None and m in ("dim", "ndimension"):
            return _Const(n)
        if P is not None and (m in _REORDER_METHODS or f in _REORDER_FUNCS):
            return self._perm_reorder(P, self._reorder(node, args, kw, n, name), name)
        if P is not None and (m == "unsqueeze" or f is torch.unsqueeze):
            dim = self._dim(_arg(args, kw, 1, "dim"), n + 1, name)
            d = self.dims(P.v)
            v = self.b.view(P.v, d + (1,))   # the new dim last in storage: a size-1 dim
            perm = list(P.perm)
            perm.insert(dim, len(d))
            return self._perm_mk(v, perm, P.kind)
        if P is not None and (m == "squeeze" or f is torch.squeeze) and \
                _arg(args, kw, 1, "dim") is not None:
            dim = _arg(args, kw, 1, "dim")
            dl = list(dim) if isinstance(dim, (list, tuple)) else [dim]
            gone = {P.perm[self._dim(x, n, name)] for x in dl}
            return self._perm_drop(P.v, P.perm, {p for p in gone if self.dims(P.v)[p] == 1},
                                   P.kind)
        # --- what may read it
        for x in node.all_input_nodes:
            e = self.env.get(x)
            if isinstance(e, _Perm) and e.perm != first.perm:
                raise refuse(f"an op between values transposed differently ({shown} and "
                             f"{_fmt_dims(self._perm_dims(e))})")
            if isinstance(e, (_Rows, _Split, _RawInt, _Tuple)):
                raise refuse("an op between a transposed value and a (batch * seq, F) view, "
                             "a split value, an integer input or a tuple")
        linear = isinstance(mod, nn.Linear) or f in (F.linear, torch.mm, torch.addmm,
                                                     torch.einsum) or \
            f in (torch.matmul, operator.matmul, torch.bmm) or \
            m in ("matmul", "mm", "bmm", "__matmul__")
        if linear:
            return self._perm_matmul(node, mod, f, m, args, kw, name, T)
        if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d)) or f in (
                F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d):
            raise refuse(f"a convolution of a transposed value {shown}: it mixes positions "
                         "along the sequence (the rows of the program), which cupyfuse does "
                         "not fuse (it fuses ops along the features, row by row, and "
                         "reductions over a whole sequence)")
        if type(mod) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d) or f is F.batch_norm:
            return self._perm_batch_norm(node, mod, f, args, kw, name, P, T)
        if isinstance(mod, (nn.MaxPool1d, nn.AvgPool1d, nn.AdaptiveAvgPool1d,
                            nn.AdaptiveMaxPool1d)) or f in (
                F.max_pool1d, F.avg_pool1d, F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d,
                F.adaptive_max_pool1d, torch.avg_pool1d, torch.max_pool1d):
            return self._perm_pool(mod, f, args, kw, name, P, T)
        # --- ops along a dim: the dim mapped to the value's own
        red = _REDUCE_FUNCS.get(f) if f is not None else m if m in _REDUCE_METHODS else None
        binary = len(args) >= 2 and self.is_tensor_like(args[1]) and "dim" not in kw
        if red is not None and not (red in ("max", "min") and binary) and P is not None:
            return self._perm_reduce(red, args, kw, name, P)
        soft = None
        if isinstance(mod, (nn.Softmax, nn.LogSoftmax, nn.Softmin)):
            soft = (mod.dim, isinstance(mod, nn.LogSoftmax), isinstance(mod, nn.Softmin))
        elif f in (torch.softmax, F.softmax, torch.log_softmax, F.log_softmax, F.softmin) or \
                m in ("softmax", "log_softmax"):
            self._float32_only(kw, name, args)
            soft = (_arg(args, kw, 1, "dim"), f in (torch.log_softmax, F.log_softmax) or
                    m == "log_softmax", f is F.softmin)
            if soft[0] is None and f in (torch.softmax, torch.log_softmax):
                raise self.refuse(name, "softmax without an explicit dim (torch raises)")
        if soft is not None and P is not None:
            self._no_bool_operand(a0, name)
            dim, log, neg = soft
            if dim is None:   # torch's legacy dim (the same place in either order)
                dim = self._implicit_softmax_dim(a0, name, "softmin" if neg else "softmax")
            v = self.b.map("neg", P.v) if neg else P.v
            return self._perm_mk(self.b.softmax(v, P.perm[self._dim(dim, n, name)], log=log),
                                 P.perm)
        if f is F.normalize and P is not None:
            p_, dim = _arg(args, kw, 1, "p", 2.0), _arg(args, kw, 2, "dim", 1)
            eps = _arg(args, kw, 3, "eps", 1e-12)
            self._no_bool_operand(a0, name)
            nrm = self.b.norm(P.v, P.perm[self._dim(dim, n, name)], float(p_), True)
            return self._perm_mk(self.b.map("div", P.v, self.b.map("clamp", nrm,
                                                                   attrs=(eps, math.inf))),
                                 P.perm)
        if not self._elementwise(node, args, kw):
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
        return self._perm_elementwise(node, args, kw, name, first.perm, n, refuse)

    def _perm_reorder(self, P: "_Perm", perm: list, name: str) -> Any:
        """A transpose/permute of a ``_Perm`` value: the composed order (the plain value
        where it is the program's again)."""
        d = self._perm_dims(P)
        perm, _ = self._perm(d, perm, name)
        out = [d[p] for p in perm]
        if next(x for x in out if x != 1) != BATCH:
            raise self.refuse(name, f"moves the batch dim: {_fmt_dims(d)} to "
                              f"{_fmt_dims(out)}; cupyfuse computes each row of the batch on "
                              "its own (dims after the batch may be reordered)")
        return self._perm_mk(P.v, [P.perm[p] for p in perm], P.kind)

    def _perm_drop(self, v: int, perm: Sequence[int], gone: set, kind: str = "f") -> Any:
        """``v`` (dims in torch's order ``perm``) with its size-1 dims ``gone`` (positions
        in ``v``'s dims) dropped."""
        d = self.dims(v)
        r = self.b.view(v, [x for i, x in enumerate(d) if i not in gone])
        left = [p - sum(1 for g in gone if g < p) for p in perm if p not in gone]
        return self._perm_mk(r, left, kind)

    def _perm_reduce(self, kind: str, args: tuple, kw: dict, name: str, P: "_Perm") -> Any:
        """sum/mean/max/... of a ``_Perm`` value over torch dims: over the value's own
        (positions -- argmax/argmin, max/min's indices -- refused)."""
        n = len(P.perm)
        if kind in ("argmax", "argmin"):
            raise self.refuse(name, f"{kind} of a transposed value "
                              f"{_fmt_dims(self._perm_dims(P))}: positions along the "
                              "features of a value in its own order are fused; take them "
                              "before the transpose")
        di = 2 if kind in ("norm", "vector_norm") else 1
        dim = _arg(args, kw, di, "dim")
        if dim is None or isinstance(dim, (tuple, list)) and not dim:
            return self.reduction(kind, args, kw, name)   # (refuses: no dim)
        dl = list(dim) if isinstance(dim, (tuple, list)) else [dim]
        tdims = [self._dim(x, n, name) for x in dl]
        mapped = [P.perm[x] for x in tdims]
        new_dim: Any = tuple(mapped) if isinstance(dim, (tuple, list)) else mapped[0]
        if len(args) > di:
            new_args, new_kw = args[:di] + (new_dim,) + args[di + 1:], kw
        else:
            new_args, new_kw = args, {**kw, "dim": new_dim}
        a0 = args[0]
        saved = self.env[a0]
        try:
            self.env[a0] = self._wrap(P.kind, P.v)
            r = self.reduction(kind, new_args, new_kw, name)
        finally:
            self.env[a0] = saved
        out = r.items[0] if isinstance(r, _Tuple) else r
        kind_ = "i" if isinstance(out, _Int) else "f"
        v = out.v if isinstance(out, _Int) else int(out)
        rd = self.dims(v)
        if len(rd) == n:   # keepdim
            res = self._perm_mk(v, P.perm, kind_)
        else:   # the reduced dims gone: put them back as size 1 to reorder, then drop
            full = list(rd)
            for p in sorted(set(mapped)):
                full.insert(p, 1)
            w = self.b.view(v, full)
            res = self._perm_drop(w, P.perm, set(mapped), kind_)
        # (the indices, in the value's own order, would be positions along another dim)
        return _Tuple((res, _Indices(None, r.items[1].op))) if isinstance(r, _Tuple) else res

    def _perm_batch_norm(self, node: torch.fx.Node, mod: Any, f: Any, args: tuple, kw: dict,
                         name: str, P: "_Perm | None", T: tuple[int, ...]) -> Any:
        """BatchNorm of a transposed (batch, C, seq...) value whose channels are the
        program value's features and whose other dims are the sequence: statistics of
        each feature over all (batch, seq) rows, a BatchNorm of the program value's rows
        as they are."""
        if P is None:
            raise self.refuse(name, "BatchNorm with a transposed tensor as its weight, bias "
                                    "or running statistics")
        self._no_bool_operand(args[0], name)
        d = self.dims(P.v)
        nd = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}.get(
            type(mod), (len(T),))
        if len(T) not in nd:
            raise self.refuse(name, f"a {len(T)}-dim input {_fmt_dims(T)} (torch raises: "
                                    f"expected {' or '.join(map(str, nd))}D input)")
        if P.perm[1] != len(d) - 1 or any(x not in (LEAD, 1) for x in T[2:]):
            raise self.refuse(name, f"BatchNorm of a transposed value {_fmt_dims(T)} whose "
                                    "channels (dim 1) are not its features, or whose other "
                                    "dims are not the sequence: statistics across features "
                                    "of a row")
        saved = self.env[args[0]]
        try:
            self.env[args[0]] = Val(P.v)
            if mod is not None:
                r = self.batch_norm(args[0], node.target, mod, name, rows=True)
            else:
                r = self.batch_norm_fn(args, kw, name, rows=True)
        finally:
            self.env[args[0]] = saved
        return self._perm_mk(r, P.perm)

    def _perm_pool(self, mod: Any, f: Any, args: tuple, kw: dict, name: str,
                   P: "_Perm | None", T: tuple[int, ...]) -> Any:
        """1-D pooling of a transposed (batch, C, seq) value: over the sequence. Windows
        covering the whole sequence (kernel its length; adaptive output 1) are a
        reduction over it; other windows would mix positions (rows): refused."""
        if P is None or len(T) != 3 or T[2] != LEAD:
            raise self.refuse(name, f"pooling of a transposed value {_fmt_dims(T)} over a "
                                    "dim that is not the sequence")
        self._no_bool_operand(args[0], name)
        ax = P.perm[2]
        L = self.b.size(P.v, ax, name)
        adaptive = isinstance(mod, (nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d)) or f in (
            F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d, F.adaptive_max_pool1d)
        mx = isinstance(mod, (nn.MaxPool1d, nn.AdaptiveMaxPool1d)) or f in (
            F.max_pool1d, F.adaptive_max_pool1d, torch.max_pool1d)

        def length(x: Any) -> Any:
            e = self.env.get(x) if isinstance(x, torch.fx.Node) else x
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
                raise self.refuse(name, "pooling with indices (return_indices=True): the "
                                        "indices are not fused")
            if out == L:
                return P
            if out != 1:
                raise self.refuse(name, f"adaptive pooling of a sequence of {L} to {out}: "
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
                raise self.refuse(name, "pooling with padding, ceil_mode, dilation or indices")
            if k is None or s_ is None or k < 1 or s_ < 1:
                raise self.refuse(name, "a pooling window or stride that is not a positive "
                                        "int")
            if k > L:
                raise self.refuse(name, f"a window of {k} over a sequence of {L} (torch "
                                        "raises)")
            if k != L:
                raise self.refuse(name, f"pooling windows of {k} positions of a sequence of "
                                        f"{L} (a transposed (batch, C, seq) value): they mix "
                                        "rows of the program; cupyfuse pools a whole sequence "
                                        "(kernel_size = its length, h.size(2)) or features "
                                        "within a row")
        v = self.b.reduce("max", P.v, ax, True) if mx else self.b.mean(P.v, ax, True)
        return self._perm_mk(v, P.perm)

    def _perm_matmul(self, node: torch.fx.Node, mod: Any, f: Any, m: Any, args: tuple,
                     kw: dict, name: str, T: tuple[int, ...]) -> Any:
        """A matmul or Linear with a transposed operand: ``h.transpose(1, 2) @ w`` of
        weights w (batch, seq, 1) is a sum over the sequence of ``h * w``; a Linear of a
        transposed value whose last dim is still its features runs on it as it is;
        anything else works across rows (a Linear over the sequence, a product of two
        values): refused saying so."""
        a0 = args[0] if args else None
        ea = self.env.get(a0) if isinstance(a0, torch.fx.Node) else None
        b1 = args[1] if len(args) > 1 else None
        eb = self.env.get(b1) if isinstance(b1, torch.fx.Node) else None
        mm = f in (torch.matmul, operator.matmul, torch.bmm) or \
            m in ("matmul", "bmm", "__matmul__")
        if mm and isinstance(ea, _Perm) and isinstance(eb, Val):
            d, db = self.dims(ea.v), self.dims(int(eb))
            if T[1:] and len(T) == 3 and T[2] == LEAD and ea.kind == "f" and \
                    db == (BATCH, LEAD, 1) and d == (BATCH, LEAD, T[1]):
                # (batch, n, seq) @ (batch, seq, 1): sum over the sequence of h * w
                r = self.b.reduce("sum", self.b.map("mul", ea.v, int(eb)), 1, True)
                return self._perm_mk(r, ea.perm)
        if mm and (isinstance(ea, (Val, _Perm)) and isinstance(eb, (Val, _Perm))):
            shown = [_fmt_dims(self._perm_dims(e) if isinstance(e, _Perm) else
                               self.dims(int(e))) for e in (ea, eb)]
            raise self.refuse(name, f"a product of two values of the batch ({shown[0]} @ "
                                    f"{shown[1]}, e.g. attention scores q @ k.transpose(-2, "
                                    "-1)): it pairs positions of the sequence (rows of the "
                                    "program) with each other, which cupyfuse does not "
                                    "fuse; it fuses a Linear with a weight parameter, and "
                                    "attention pooling (weights (batch, 1, seq) @ values)")
        P = ea if isinstance(ea, _Perm) else None
        if P is not None and P.perm[-1] == len(P.perm) - 1 and P.kind == "f":
            # the features still last (leading dims reordered): a Linear row by row
            saved = self.env[a0]
            try:
                self.env[a0] = Val(P.v)
                r = getattr(self, node.op)(node)
            finally:
                self.env[a0] = saved
            if type(r) in (int, Val) and len(self.dims(int(r))) == len(P.perm):
                return self._perm_mk(int(r), P.perm)
        Tn = _fmt_dims(T)
        raise self.refuse(name, f"a Linear or matmul over the last dim of a transposed "
                                f"value {Tn}, which is not its features (a GEMM along the "
                                "sequence, across rows of the program: token mixing), or "
                                "with a transposed weight operand: not fused (cupyfuse "
                                "fuses Linear layers along the features)")

    def _perm_elementwise(self, node: torch.fx.Node, args: tuple, kw: dict, name: str,
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
                e = self.env.get(x)
                if isinstance(e, _Perm):
                    saved[x] = e
                    self.env[x] = self._wrap(e.kind, e.v)
                    continue
                if isinstance(e, (Val, _Bool, _Int)):
                    td = self.dims(int(e) if isinstance(e, Val) else e.v)
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
                    self.env[x] = Val(self.b.param(e.source, tuple(ud)))
                elif isinstance(e, torch.Tensor):
                    if e.is_floating_point() and e.dtype != torch.float32:
                        raise self.refuse(name, f"a {e.dtype} tensor (cupyfuse runs float32)")
                    self.env[x] = Val(self.b.param(e.detach().float().reshape(ud), tuple(ud)))
                else:
                    v0 = int(e) if isinstance(e, Val) else e.v
                    self.env[x] = self._wrap(self._kind_of(x), self.b.view(v0, ud))
            r = getattr(self, node.op)(node)
        finally:
            self.env.update(saved)
        kind = "b" if isinstance(r, _Bool) else "i" if isinstance(r, _Int) else "f"
        v = r.v if isinstance(r, (_Bool, _Int)) else r
        if type(v) not in (int, Val) or len(self.dims(int(v))) != n:
            raise refuse()
        return self._perm_mk(int(v), perm, kind)
