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
from cupyfuse.frontend.values import (Val, _Bool, _Const, _DEVICE, _Indices, _Int, _Size, _Split,
                             _Tuple, _Weight, _sizes)
from cupyfuse.ir.program import BATCH, LEAD, LEAD_WHY, TailError


class _SplitMixin:
    """Ops on split values: methods of the translator (:class:`cupyfuse.frontend.translate._Translator`
    inherits them and holds the state they use)."""

    # --- refusals, and what reads a split value ------------------------------------------
    @staticmethod
    def _first_feature(d: Sequence[int]) -> int:
        """The position of a split value's first feature dim (``.flatten(it)`` joins them)."""
        return max((i for i, x in enumerate(d) if x in splits.ROW), default=-1) + 1

    def _split_refusal(self, name: str, sp: "_Split", why: str = "",
                       hint: str = "") -> TailError:
        return self.refuse(name, (why or f"an op on a value whose features are split into "
                                  f"several dims {splits.fmt(sp.dims)}") +
                           "; cupyfuse fuses elementwise ops, reductions, softmax and norms "
                           "along those dims, indexing and reshapes of such a value: " +
                           (hint or f"reshape it back to its {splits.width(sp.dims)} features "
                            f"first (`.flatten({self._first_feature(sp.dims)})`)"))

    @staticmethod
    def _split_bn_why(sp: "_Split") -> str:
        d = sp.dims
        return (f"BatchNorm of a value whose features are split into several dims "
                f"{splits.fmt(d)}: torch normalises each channel (dim 1) over the batch and "
                "the positions after it, statistics across rows; cupyfuse fuses BatchNorm1d "
                "of a (batch, features) value, and GroupNorm, InstanceNorm and LayerNorm "
                "of split values (statistics within each row)")

    def _touches_split(self, node: torch.fx.Node) -> bool:
        def hit(a: Any) -> bool:
            if isinstance(a, torch.fx.Node):
                e = self.env.get(a)
                return isinstance(e, _Split) or isinstance(e, _Tuple) and any(
                    isinstance(i, _Split) for i in e.items)
            if isinstance(a, (tuple, list)):
                return any(hit(x) for x in a)
            return False
        return any(hit(a) for a in node.args) or any(hit(a) for a in node.kwargs.values())

    def _any_split(self, node: torch.fx.Node) -> "_Split":
        """The first split value among a node's operands (in tuples of pieces too)."""
        def find(a: Any) -> Any:
            if isinstance(a, (tuple, list)):
                return next((r for r in map(find, a) if r is not None), None)
            e = self.env.get(a) if isinstance(a, torch.fx.Node) else None
            if isinstance(e, _Tuple):
                return next((i for i in e.items if isinstance(i, _Split)), None)
            return e if isinstance(e, _Split) else None
        return find(list(node.args) + list(node.kwargs.values()))

    def _split_target(self, d: tuple[int, ...], shape: Any, name: str,
                      plain_ok: bool = False) -> list | None:
        """The torch dims of a reshape of a value with dims ``d`` to ``shape`` where it
        keeps the batch and leading dims first (named by their sizes read from a shape,
        a leading dim also by its number, or -1) and regroups the features after them (in
        any number of dims, -1 for one of them); None where it is no such reshape, or
        (unless ``plain_ok``) where the result's features are in one dim (the plain
        reshape decides those)."""
        want: list[Any] = []
        for s in shape if isinstance(shape, (tuple, list)) else ():
            x = self.env[s] if isinstance(s, torch.fx.Node) else s
            if isinstance(x, _Size):
                x = "B" if x.v == BATCH else ("L", x.lead) if x.v == LEAD else x.v
            elif isinstance(x, _Const) and type(x.v) is int:
                x = x.v
            elif type(x) is not int:
                return None
            want.append(x)
        leads = [x for x in self.lead if x != 1]   # the sizes of the LEAD dims, in order
        mk = [x for x in d if x in splits.ROW]
        non1 = [w for w in want if w != 1]
        if len(non1) < len(mk) or non1.count(-1) > 1:
            return None
        rows, feats = non1[:len(mk)], non1[len(mk):]
        k = 0
        for w, m in zip(rows, mk):
            if m == BATCH:
                ok = w in ("B", -1)
            else:
                ok = w == -1 or w == ("L", k) or type(w) is int and w == leads[k]
                k += 1
            if not ok:
                return None
        if not all(type(w) is int and (w > 0 or w == -1) for w in feats):
            return None
        W = splits.width(d)
        known = math.prod(w for w in feats if w != -1)
        if (W % known if -1 in feats else known != W):
            return None
        out, cnt = [], 0
        for w in want:
            if w == 1:
                out.append(1)
                continue
            out.append(mk[cnt] if cnt < len(mk) else W // known if w == -1 else w)
            cnt += 1
        if not plain_ok and not splits.is_split(out):
            return None
        if -1 in want and BATCH in mk and rows[0] != -1:
            # the -1 is not the batch: with an empty batch torch cannot tell its size
            if any(x == 0 for x in leads):
                raise self.refuse(name, "a reshape with -1 of a value with a leading dim of "
                                        "size 0 (torch raises: the -1 could be any size)")
            shown = ", ".join("0" if w == "B" else str(leads[w[1]]) if isinstance(w, tuple)
                              else str(w) for w in want)
            self.b.p.zero_rows_error = (
                f"cannot reshape tensor of 0 elements into shape [{shown}] because the "
                "unspecified dimension size -1 can be any value and is ambiguous")
        return out

    # --- ops reading a split value -------------------------------------------------------
    def _split_call(self, node: torch.fx.Node) -> Any:
        """An op with a split value among its operands (``_Split``): shape ops,
        reductions, softmax and norms along the split dims, elementwise ops (with
        operands broadcast to one layout); anything else refused, saying how to go on."""
        op, t = node.op, node.target
        args = tuple(self._plain(a) for a in node.args)
        kw = {k: self._plain(v) for k, v in node.kwargs.items()}
        a0 = args[0] if args else None
        sp = self._split_of(a0)
        if op == "call_module":
            mod = self._get_attr(t)
            return self._split_module(node, mod, args, kw, f"{t} ({type(mod).__name__})", sp)
        name = f".{t}()" if op == "call_method" else getattr(t, "__name__", str(t))
        m = t if op == "call_method" else None
        f = t if op == "call_function" else None
        tup = self.env.get(a0) if isinstance(a0, torch.fx.Node) else None
        if isinstance(tup, _Tuple) and (f is operator.getitem or f is getattr):
            if f is getattr:
                if args[1] == "indices" and len(tup.items) == 2 and \
                        isinstance(tup.items[1], _Indices):
                    return self._indices(tup.items[1], ".indices")
                if args[1] != "values":
                    raise self.refuse(f".{args[1]}")
                item = tup.items[0]
                return item if isinstance(item, _Split) else Val(item)
            if isinstance(args[1], slice):
                return _Tuple(tup.items[args[1]])
            if not isinstance(args[1], int) or isinstance(args[1], bool):
                raise self.refuse(name, "an index of a tuple of tensors that is not a number")
            item = tup.items[args[1]]
            if isinstance(item, _Indices):
                return self._unused_indices(item, name)
            return item if isinstance(item, _Split) else Val(item)
        if f in (torch.cat, torch.concat, torch.concatenate):
            return self._split_cat(_arg(args, kw, 0, "tensors"), _arg(args, kw, 1, "dim", 0),
                                   name)
        if f is torch.stack:
            return self.stack(_arg(args, kw, 0, "tensors"), _arg(args, kw, 1, "dim", 0), kw,
                              name)
        if f in (torch.cosine_similarity, torch.pairwise_distance, torch.cumsum):
            return self.call_function(node)   # (one translation for plain and split values)
        if m == "cumsum" and sp is not None:
            return self.cumsum(a0, _arg(args, kw, 1, "dim"), kw, name)
        if sp is None:   # a split among the other operands: elementwise, or refused
            if self._elementwise(node, args, kw):
                return self._split_elementwise(node, name)
            raise self._split_refusal(name, self._any_split(node))
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
                return self._split_permute(sp, perm, f".{attr}")
            raise self.refuse(f".{attr}")
        if m == "size":
            dd = _arg(args, kw, 1, "dim")
            return _sizes(d, sp.v) if dd is None else \
                _sizes(d, sp.v)[self._dim(dd, len(d), name)]
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
            shape = self._shape_arg(shape, name)
            out = self._split_target(d, shape, name, plain_ok=True)
            if out is None:
                raise self.refuse(name, f"a reshape of a {splits.fmt(d)} value to "
                                  f"{self._shown(shape)}: the batch and leading dims stay "
                                  "first (x.shape[0] or -1 for the batch) and only the "
                                  f"{splits.width(d)} features after them may be regrouped, "
                                  f"e.g. `.flatten({self._first_feature(d)})`")
            return self._mk(sp.v, out, sp.kind)
        if m == "flatten" or f is torch.flatten:
            return self._split_flatten(sp, _arg(args, kw, 1, "start_dim", 0),
                                       _arg(args, kw, 2, "end_dim", -1), name)
        if m == "unflatten" or f is torch.unflatten:
            return self.unflatten(a0, _arg(args, kw, 1, "dim"), _arg(args, kw, 2, "sizes"), name)
        if m == "unsqueeze" or f is torch.unsqueeze:
            dim = self._dim(_arg(args, kw, 1, "dim"), len(d) + 1, name)
            return self._mk(sp.v, d[:dim] + (1,) + d[dim:], sp.kind)
        if m == "squeeze" or f is torch.squeeze:
            return self._split_squeeze(sp, _arg(args, kw, 1, "dim"), name)
        if m in ("transpose", "swapaxes", "swapdims") or f in (
                torch.transpose, torch.swapaxes, torch.swapdims):
            n = len(d)
            perm = list(range(n))
            i, j = (self._dim(x, n, name) for x in (args[1], args[2]))
            perm[i], perm[j] = perm[j], perm[i]
            return self._split_permute(sp, perm, name)
        if m == "permute" or f is torch.permute:
            perm = args[1:] if not (len(args) == 2 and isinstance(args[1], (tuple, list))) \
                else args[1]
            if f is torch.permute:
                perm = _arg(args, kw, 1, "dims")
            return self._split_permute(sp, list(perm), name)
        if m == "t" or f is torch.t:
            return self._split_permute(sp, list(range(len(d)))[::-1], name)
        if m == "movedim" or f is torch.movedim:
            return self._split_movedim(sp, _arg(args, kw, 1, "source"),
                                       _arg(args, kw, 2, "destination"), name)
        if m == "__getitem__" or f is operator.getitem:
            return self._index_sv(a0, args[1])
        if m == "select" or f is torch.select:
            return self.select(a0, _arg(args, kw, 1, "dim"), _arg(args, kw, 2, "index"), name)
        if m == "unbind" or f is torch.unbind:
            return self.unbind(a0, _arg(args, kw, 1, "dim", 0), name)
        if m == "narrow" or f is torch.narrow:
            return self._narrow_sv(a0, _arg(args, kw, 1, "dim"), _arg(args, kw, 2, "start"),
                                   _arg(args, kw, 3, "length"), name)
        if m == "chunk" or f is torch.chunk:
            return self._chunk_sv(a0, _arg(args, kw, 1, "chunks"), _arg(args, kw, 2, "dim", 0),
                                  name)
        if m == "split" or f is torch.split:
            return self._split_sv(a0, _arg(args, kw, 1, "split_size" if m else
                                           "split_size_or_sections"),
                                  _arg(args, kw, 2, "dim", 0), name)
        if m == "type_as":
            other = self.env.get(args[1]) if isinstance(args[1], torch.fx.Node) else args[1]
            if not (isinstance(other, (_Weight, Val)) or isinstance(other, _Split)
                    and other.kind == "f"):
                raise self.refuse(name, "converts to the dtype of something other than a "
                                        "float32 tensor")
            return _Split(sp.v, d, "f")
        # --- reductions, softmax, norms along the split dims
        binary = len(args) >= 2 and self.is_tensor_like(args[1]) and "dim" not in kw
        if (f in _REDUCE_FUNCS or m in _REDUCE_METHODS) and not (
                (f in (torch.max, torch.min) or m in ("max", "min")) and binary):
            return self.reduction(_REDUCE_FUNCS[f] if f is not None else m, args, kw, name)
        if f in (torch.softmax, F.softmax, torch.log_softmax, F.log_softmax) or \
                m in ("softmax", "log_softmax"):
            self._float32_only(kw, name, args)
            dim = _arg(args, kw, 1, "dim")
            if dim is None and f in (F.softmax, F.log_softmax):
                dim = self._implicit_softmax_dim(a0, name)
            return self._split_softmax(a0, dim, f in (torch.log_softmax, F.log_softmax) or
                                       m == "log_softmax", False, name)
        if f is F.softmin:
            dim = _arg(args, kw, 1, "dim")
            return self._split_softmax(a0, dim if dim is not None else
                                       self._implicit_softmax_dim(a0, name, "softmin"), False,
                                       True, name)
        if f is F.normalize:
            return self._split_normalize(a0, _arg(args, kw, 1, "p", 2.0),
                                         _arg(args, kw, 2, "dim", 1), _arg(args, kw, 3, "eps",
                                                                          1e-12), name)
        if f is F.layer_norm:
            return self._split_layer_norm(a0, self.ints(_arg(args, kw, 1, "normalized_shape"),
                                                        name),
                                          self._src(_arg(args, kw, 2, "weight")),
                                          self._src(_arg(args, kw, 3, "bias")),
                                          _arg(args, kw, 4, "eps", 1e-5), name)
        if f is F.glu:
            return self._split_glu(a0, _arg(args, kw, 1, "dim", -1), name)
        if f in _CHANNEL_FUNCS:   # (the same translation as a plain value's)
            return self.call_function(node)
        if f is F.batch_norm:
            raise self.refuse(name, self._split_bn_why(sp))
        if self._elementwise(node, args, kw):
            return self._split_elementwise(node, name)
        if f in (torch.matmul, operator.matmul, torch.mm, F.linear, torch.addmm, torch.einsum) \
                or m in ("matmul", "mm", "__matmul__"):
            raise self._split_refusal(name, sp, "a matmul of a value whose features are "
                                      f"split into several dims {splits.fmt(d)} (per head: "
                                      "its heads would be rows of the GEMM)", _PER_HEAD_HINT)
        raise self._split_refusal(name, sp)

    def _split_module(self, node: torch.fx.Node, mod: nn.Module, args: tuple, kw: dict,
                      name: str, sp: "_Split | None") -> Any:
        """An nn.Module applied to a split value (see _split_call)."""
        a = args[0] if args else None
        if sp is None:
            sp = self._any_split(node)
        if isinstance(mod, (nn.Softmax, nn.LogSoftmax, nn.Softmin)):
            dim = mod.dim if mod.dim is not None else self._implicit_softmax_dim(
                a, name, "softmin" if isinstance(mod, nn.Softmin) else "softmax")
            return self._split_softmax(a, dim, isinstance(mod, nn.LogSoftmax),
                                       isinstance(mod, nn.Softmin), name)
        if isinstance(mod, nn.LayerNorm):
            return self._split_layer_norm(a, tuple(mod.normalized_shape),
                                          f"{node.target}.weight" if mod.weight is not None
                                          else None,
                                          f"{node.target}.bias" if mod.bias is not None
                                          else None, mod.eps, name)
        if isinstance(mod, nn.GLU):
            return self._split_glu(a, mod.dim, name)
        if isinstance(mod, nn.Flatten):
            return self._split_flatten(sp, mod.start_dim, mod.end_dim, name)
        if isinstance(mod, nn.Unflatten):
            return self.unflatten(a, mod.dim, mod.unflattened_size, name)
        if isinstance(mod, _CHANNEL_MODULES) and sp is self._split_of(a) or \
                isinstance(mod, (nn.CosineSimilarity, nn.PairwiseDistance)):
            return self.call_module(node)   # (the same translation as a plain value's)
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            raise self.refuse(name, self._split_bn_why(sp))
        if self._elementwise(node, args, kw):
            return self._split_elementwise(node, name)
        if isinstance(mod, nn.Linear):
            raise self._split_refusal(name, sp, "a Linear of a value whose features are "
                                      f"split into several dims {splits.fmt(sp.dims)} (per "
                                      "head: its heads would be rows of the GEMM)",
                                      _PER_HEAD_HINT)
        raise self._split_refusal(name, sp)

    # --- elementwise ops with split operands ---------------------------------------------
    def _operand_dims(self, e: Any, name: str) -> tuple[int, ...]:
        if isinstance(e, _Split):
            return e.dims
        if isinstance(e, (Val, _Bool, _Int)):
            return self.dims(int(e) if isinstance(e, Val) else e.v)
        if isinstance(e, _Weight):
            if e.transposed and len(splits.feat_sizes(e.shape)) > 1:
                raise self.refuse(name, "uses a transposed matrix parameter outside a matmul")
            return tuple(e.shape)
        return tuple(e.shape)   # a tensor

    def _flat_operand(self, a: torch.fx.Node, name: str) -> tuple[int, str]:
        """(flat program value, kind) of an elementwise op's tensor operand."""
        e = self.env[a]
        if isinstance(e, _Split):
            return e.v, e.kind
        if isinstance(e, (_Weight, torch.Tensor)) and len(splits.feat_sizes(
                e.shape if isinstance(e, _Weight) else tuple(e.shape))) > 1:
            # an (H, D) parameter: its H * D elements in order, per feature
            shape = tuple(e.shape)
            if isinstance(e, torch.Tensor):
                if e.is_floating_point() and e.dtype != torch.float32:
                    raise self.refuse(name, f"a {e.dtype} tensor (cupyfuse runs float32)")
                return self.b.param(e.detach().float().contiguous(), (math.prod(shape),)), "f"
            return self.b.param(e.source, (math.prod(shape),)), "f"
        v = self.val(a, name)
        d = self.dims(v)
        if not splits.marks(d) and splits.width(d) == 1:   # (a number, a 0-d tensor)
            return v, self._kind_of(a)
        return self.b.view(v, splits.flat_dims(d)), self._kind_of(a)

    def _split_elementwise(self, node: torch.fx.Node, name: str) -> Any:
        """An elementwise op with split operands: torch's broadcast of every tensor
        operand's dims, each operand laid out for it (``splits.layout``), then the op's
        own translation on those program values."""
        ops: list[torch.fx.Node] = []

        def visit(x: Any) -> None:
            if isinstance(x, (tuple, list)):
                for y in x:
                    visit(y)
            elif isinstance(x, torch.fx.Node) and x not in ops and isinstance(
                    self.env.get(x), (_Split, Val, _Bool, _Int, _Weight, torch.Tensor)):
                ops.append(x)
        for x in list(node.args) + list(node.kwargs.values()):
            visit(x)
        dims = [self._operand_dims(self.env[x], name) for x in ops]
        try:
            out = splits.broadcast_all(dims, name)
        except TailError as exc:
            raise self.err(str(exc)) from None
        saved = {x: self.env[x] for x in ops}
        try:
            for x, d in zip(ops, dims):
                flat, kind = self._flat_operand(x, name)
                self.env[x] = self._wrap(kind, splits.layout(self.b, flat, d, out))
            r = getattr(self, node.op)(node)
        finally:
            self.env.update(saved)
        kind = "b" if isinstance(r, _Bool) else "i" if isinstance(r, _Int) else "f"
        v = r.v if isinstance(r, (_Bool, _Int)) else r
        if type(v) not in (int, Val):   # pragma: no cover - elementwise ops give values
            raise self.refuse(name, "an op on split values that gives no tensor")
        flat = splits.flat_dims(out)
        if [x for x in self.dims(v) if x != 1] != [x for x in flat if x != 1]:  # pragma: no cover
            raise AssertionError(f"{name}: {self.dims(v)} is no layout of {out}")
        return self._mk(self.b.view(int(v), flat), out, kind)

    # --- softmax, normalize, LayerNorm, GLU along the split dims -------------------------
    def _feature_dim(self, d: tuple[int, ...], dim: Any, name: str, what: str,
                     seq: bool = False) -> int:
        """A dim argument that must name a feature dim of a value with dims ``d`` (or,
        where ``seq``, the leading (sequence) dim: a sequence reduction)."""
        ax = self._dim(dim, len(d), name)
        if d[ax] == BATCH:
            raise self.refuse(name, f"{what} the batch dimension (dim {dim})")
        if d[ax] == LEAD and not seq:
            raise self.refuse(name, f"{what} a leading (sequence) dim: " + LEAD_WHY)
        return ax

    def _split_softmax(self, a: Any, dim: Any, log: bool, neg: bool, name: str) -> Any:
        self._no_bool_operand(a, name)
        if dim is None:
            raise self.refuse(name, "softmax without an explicit dim")
        v, d, _ = self._sv(a, name)
        ax = self._dim(dim, len(d), name)
        if d[ax] == BATCH:
            raise self.refuse(name, f"normalises over the batch dimension (dim {dim}); only "
                                    "BatchNorm may use statistics over the batch")
        if neg:
            v = self.b.map("neg", v)
        return self._mk(splits.softmax(self.b, v, d, ax, log), d)

    def _split_normalize(self, a: Any, p: Any, dim: Any, eps: Any, name: str) -> Any:
        self._no_bool_operand(a, name)
        v, d, _ = self._sv(a, name)
        ax = self._feature_dim(d, dim, name, "normalises along", seq=True)
        p = self._norm_order(p, name)
        return self._mk(splits.normalize(self.b, v, d, ax, float(p), float(eps)), d)

    def _split_layer_norm(self, a: Any, shape: tuple, w_src: Any, b_src: Any, eps: float,
                          name: str) -> Any:
        """LayerNorm over the last dims of a split value (``normalized_shape`` (D,): per
        head; (H, D): over the whole row), with its (D,) or (H, D) weight and bias."""
        self._no_bool_operand(a, name)
        v, d, _ = self._sv(a, name)
        shape = tuple(int(x) for x in shape)
        if not shape or tuple(d[len(d) - len(shape):]) != shape or len(shape) > len(d):
            raise self.refuse(name, f"normalized_shape {shape} does not match the value's "
                                    f"last dims {splits.fmt(d)}")
        axes = list(range(len(d) - len(shape), len(d)))
        b = self.b
        r = splits.layer_norm(b, v, d, axes, float(eps))
        for src, op in ((w_src, "mul"), (b_src, "add")):
            if src is None:
                continue
            flat = b.param(src, (math.prod(shape),))
            r = b.map(op, r, splits.layout(b, flat, shape, d))
        if b_src is None:   # torch adds the bias, or 0 without one: -0.0 gives +0.0
            r = b.map("add", r, b.const(0.0))
        return self._mk(r, d)

    def _split_glu(self, a: Any, dim: Any, name: str) -> Any:
        """F.glu along a split dim: first half * sigmoid(second half)."""
        self._no_bool_operand(a, name)
        v, d, _ = self._sv(a, name)
        ax = self._feature_dim(d, dim, name, "halves")
        if d[ax] % 2:
            raise self.err(f"{name}: halving an odd dimension of {d[ax]} features")
        h = d[ax] // 2
        first, out = splits.narrow(self.b, v, d, ax, 0, h)
        second, _ = splits.narrow(self.b, v, d, ax, h, h)
        return self._mk(self.b.map("mul", first, self.b.map("sigmoid", second)), out)

    # --- flatten, squeeze, permute of split values ---------------------------------------
    def _split_flatten(self, sp: "_Split", start: Any, end: Any, name: str) -> Any:
        d = sp.dims
        s, e = self._dim(start, len(d), name), self._dim(end, len(d), name)
        group = d[s:e + 1]
        non1 = [x for x in group if x != 1]
        if any(x in splits.ROW for x in group) and len(non1) > 1:
            raise self.refuse(name, "flattening the batch or a leading dim together with "
                                    f"feature dims of a {splits.fmt(d)} value (write "
                                    f"`.flatten({self._first_feature(d)})` to join the "
                                    "features)")
        merged = next((x for x in non1 if x in splits.ROW), math.prod(non1))
        return self._mk(sp.v, d[:s] + (merged,) + d[e + 1:], sp.kind)

    @staticmethod
    def _shown(shape: Any) -> str:
        return "(" + ", ".join("batch" if isinstance(s, _Size) and s.v == BATCH else
                               "seq" if isinstance(s, _Size) and s.v == LEAD else
                               str(s.v) if isinstance(s, _Size) else
                               str(s) if not isinstance(s, torch.fx.Node) else s.name
                               for s in shape) + ")"

    def _split_squeeze(self, sp: "_Split", dim: Any, name: str) -> Any:
        d = sp.dims
        if dim is None:
            if BATCH in d:
                raise self.refuse(name, f"squeeze() with no dim of a {splits.fmt(d)} value "
                                        "(torch drops the batch dim at batch size 1): give it "
                                        "the dims to drop")
            return self._mk(sp.v, tuple(x for x in d if x != 1), sp.kind)
        dl = list(dim) if isinstance(dim, (list, tuple)) else [dim]
        idx = {self._dim(x, len(d), name) for x in dl}
        return self._mk(sp.v, tuple(x for i, x in enumerate(d) if not (i in idx and x == 1)),
                        sp.kind)

    def _split_permute(self, sp: "_Split", perm: list, name: str) -> Any:
        d = sp.dims
        perm, in_order = self._perm(d, perm, name)
        if not in_order:
            out = [d[x] for x in perm]
            if next(x for x in out if x != 1) != BATCH:
                raise self.refuse(name, f"moves the batch dim: {splits.fmt(d)} to "
                                  f"{splits.fmt(out)}; cupyfuse computes each row of the "
                                  "batch on its own")
            # (a feature dim before a leading one)
            seen_feature = False
            lead_moved = False
            for x in out:
                seen_feature = seen_feature or (x not in splits.ROW and x != 1)
                lead_moved = lead_moved or (x == LEAD and seen_feature)
            if lead_moved:
                raise self.refuse(name, f"moves a leading (sequence) dim among the split "
                                  f"feature dims of a {splits.fmt(d)} value ({splits.fmt(out)}: "
                                  "attention heads' (batch, heads, seq, d) layout): cupyfuse "
                                  "keeps the sequence in the program's rows and each row's "
                                  "features in their order; reduce, index or normalise the "
                                  "dims where they are (softmax or a mean over the sequence "
                                  "is `dim=1` of (batch, seq, H, D))")
            raise self.refuse(name, f"reorders the dims of a {splits.fmt(d)} value, which "
                                    "moves data within each row (cupyfuse keeps a value's "
                                    "features in their order): index, reduce or normalise the "
                                    "dims where they are, e.g. `.sum(1)` rather than "
                                    "`.transpose(1, 2).sum(-1)`, `[:, :, j]` rather than "
                                    "`.transpose(1, 2)[:, j]`")
        return self._mk(sp.v, tuple(d[x] for x in perm), sp.kind)

    def _split_movedim(self, sp: "_Split", src: Any, dst: Any, name: str) -> Any:
        return self._split_permute(sp, self._movedim_perm(len(sp.dims), src, dst, name),
                                   name)
