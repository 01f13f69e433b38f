"""Tail programs: what a Linear + tail model computes, as a small SSA graph.

A program is a list of :class:`Node` s. Every value has ``dims``: a tuple of ints, one
per tensor dimension, where ``-1`` is the batch dimension and any size > 1 is the
*feature* dimension (at most one of each: a value is a function of (row, feature)).
Node kinds:

=========  ==========================================================================
gemm       ``a @ W.T`` (no bias: the bias is an ``add`` after it); attrs (weight source,
           weight transposed?)
input      the forward's i-th tensor argument (0 is x); dims from its shape
param      a parameter/buffer/tensor (attrs: source index)
const      a Python number
iota       a constant along the features: feature f is ``start + f * step`` (attrs (start,
           step); computed in double, rounded to float32 as torch.arange does): tensors
           the forward makes from numbers (``torch.arange(n)``, ``torch.ones(n)``)
map        an elementwise op of :data:`cupyfuse.ops.registry.MAPS` (attrs: its float attributes)
rred       a reduction (sum/max/min) over the feature axis, kept as a size-1 dim; or the
           position of the row's maximum/minimum (op argmax/argmin: torch's first index,
           a NaN counting as the extreme), an *index* value (:meth:`Program.index_values`)
gred       a per-group sum over the feature axis (groups of g), broadcast back
sred       a reduction (sum/max/min, or argmax/argmin: the position within the group)
           over one dim of features split into several dims (``h.view(B, H, D).sum(-1)``):
           groups of g features ``s`` apart, one result per group (attrs: axis, g, s; see
           :func:`sred_values`)
scan       a cumulative sum (torch.cumsum) over groups of g features s apart (attrs: axis,
           g, s; a plain value's row is one group): feature p of a group is the sum of its
           features 0..p, in double, in a fixed order (:func:`scan_values`: chunks of
           SCAN_CHUNK in order, each chunk's running sum plus the sum of the chunks before)
remap      features gathered by index (attrs: axis, shape, strides, offset): the
           broadcast of a value of split features to a wider shape (a (D,) parameter
           over H heads, a per-head statistic over its D features) or a strided pick
           (``h.view(B, H, D)[:, :, j]``); see :func:`remap_index`
pool       1-D max/avg pooling over the feature axis (kernel k, stride s)
wpool      1-D pooling of C channels of L positions each (the feature axis holds them
           channel after channel) by torch's window rules: padding, ceil_mode, dilation,
           count_include_pad, or the adaptive windows; attrs (axis, C, L, Lo, k, s, pad,
           dil, ceil_mode, count_include_pad, adaptive), Lo windows per channel
           (:func:`wpool_values`)
bn         batch normalisation over the batch with batch statistics:
           (v - mean) / sqrt(var + eps); updates running stats if it has them; with a
           fourth attribute "mean" (backward programs), the batch's mean itself
seqred       a reduction over the sequence of a (batch, seq, features) value: sum/max/min
           over each batch element's seq consecutive rows, or one of them ("take":
           h[:, k]); attrs (axis, seq, k). Its value has one row per batch element
           (:meth:`Program.per_batch`), the axis kept as a size-1 dim
view       the same values with other size-1 dims (unsqueeze, squeeze, view ...)
=========  ==========================================================================

An *index* value (argmax/argmin, and views of one) holds positions as float32 numbers
(exact: a reduction is refused over more than :data:`MAX_INDEX_WIDTH` features); only views
and results read one, and a result that is one comes back as torch's int64
(:meth:`Program.index_results`): the generated kernels write it as int64, the CPU path
converts it.

A value torch sees with its features split into several dims (``h.view(B, H, D)``) is
one program value of ``H * D`` features in row-major order; the translator keeps its
torch dims beside it (:mod:`cupyfuse.ir.splits`), and ops along the split dims become
``sred``/``remap`` nodes.

Composite torch ops (softmax, logsumexp, LayerNorm, GroupNorm, normalize, mean ...)
are *lowered* by :class:`Builder` into these primitives, so the CPU path
(:func:`cupyfuse.backend.cpu.run_cpu`) and the generated CUDA (:mod:`cupyfuse.backend.codegen`) implement exactly
the same algebra.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from cupyfuse.ops.registry import MAPS

__all__ = ["Node", "Program", "Builder", "TailError", "shape_of", "BATCH"]

BATCH = -1
#: a leading dim after the batch (the sequence of a (batch, seq, features) input): its
#: rows are folded into the batch rows. Only in the translator's dims (torch's frame);
#: Program.lower_leads replaces it by 1 before anything runs.
LEAD = -2
#: in ``Program.lead_out`` only: the batch and every leading dim merged into one (a result
#: viewed as (batch * seq, features), ``h.view(-1, n)``)
ROWS = -3


class TailError(ValueError):
    """A model or tail cupyfuse cannot fuse: the message names the op and where it is."""


#: the generated kernels' split reductions (``sred``): with more groups than fit in shared
#: memory, groups at most this long are re-read where used (the measured cost of
#: re-reading: 62/88/94 at 5-10x slower than staging); the most group sums one block
#: stages in shared memory (codegen.py)
INLINE_GROUP = 32
MAX_GROUPS = 8192
#: a cumulative sum ("scan") adds its features in chunks of this many: each feature is
#: the running sum within its chunk plus the running sum of the chunks before (all in
#: double), the same order in the generated kernels and on the CPU
SCAN_CHUNK = 32
#: argmax/argmin (the "arg" ops of rred and sred nodes): a position is held as a float32
#: number inside a program, exact up to 2**24; a reduction over more features is refused
ARG_OPS = ("argmax", "argmin")
MAX_INDEX_WIDTH = 1 << 24


def _stat_leaves(expr: tuple, out: list) -> list:
    """The program values a batch statistic's expression sums, in order of appearance."""
    if expr[0] == "sum":
        if expr[1] not in out:
            out.append(expr[1])
    elif expr[0] not in ("count", "const"):
        for e in expr[1:]:
            _stat_leaves(e, out)
    return out


def _stat_map(expr: tuple, pos: dict) -> tuple:
    """``expr`` with each summed value replaced by its result position ``pos[value]``."""
    if expr[0] == "sum":
        return ("sum", pos[expr[1]])
    if expr[0] in ("count", "const"):
        return expr
    return (expr[0],) + tuple(_stat_map(e, pos) for e in expr[1:])


class BatchStats:
    """The results of a forward that returns numbers over the whole batch (a loss's mean or
    sum): the program computes per-row values (its results: first the forward's plain
    results, then the values the statistics sum), and this -- the program's ``outs_type``,
    applied by every path that builds results -- sums them over the rows in float64 (a
    fixed-order torch/CuPy reduction: the same bits run to run), does the arithmetic in
    float64 and returns float32 0-d tensors in the forward's own container.

    ``items``: for each result of the forward, ("out", k) -- the program's k-th result -- or
    ("stat", expr) with positions for values (see :func:`_stat_map`); ``kind``: None (one
    result), tuple, list or a :class:`DictResult`."""

    __slots__ = ("items", "kind")

    def __init__(self, items: Sequence[tuple], kind: Any) -> None:
        self.items, self.kind = tuple(items), kind

    @staticmethod
    def _eval(e: tuple, outs: Sequence[Any]) -> Any:
        op = e[0]
        if op == "sum":
            v = outs[e[1]]
            return v.double().sum() if hasattr(v, "double") else v.astype("float64").sum()
        if op == "count":
            return float(outs[0].shape[0])
        if op == "const":
            return e[1]
        a = BatchStats._eval(e[1], outs)
        if op == "neg":
            return -a
        b = BatchStats._eval(e[2], outs)
        return a + b if op == "add" else a - b if op == "sub" else a * b if op == "mul" \
            else a / b

    def __call__(self, outs: Sequence[Any]) -> Any:
        res = []
        like = outs[0]
        for item in self.items:
            if item[0] == "out":
                res.append(outs[item[1]])
                continue
            v = self._eval(item[1], outs)
            if isinstance(v, float):   # (no value summed: a statistic of numbers alone)
                v = like.new_tensor(v, dtype=torch.float64) if hasattr(like, "new_tensor") \
                    else like.dtype.type(v)
            res.append(v.float() if hasattr(v, "float") else v.astype("float32"))
        if self.kind is None:
            return res[0]
        return self.kind(res)

    def __eq__(self, other: Any) -> bool:
        return type(other) is BatchStats and other.items == self.items and \
            other.kind == self.kind

    def __hash__(self) -> int:
        return hash((self.items, repr(self.kind)))


class DictResult:
    """The container of a forward returning a dict of tensors (``{"logits": h, "probs":
    p}``): called with the results in the dict's order, it builds the dict."""

    __slots__ = ("keys",)

    def __init__(self, keys: Sequence[Any]) -> None:
        self.keys = tuple(keys)

    def __call__(self, values: Any) -> dict:
        return dict(zip(self.keys, values))

    def __eq__(self, other: Any) -> bool:
        return type(other) is DictResult and other.keys == self.keys

    def __hash__(self) -> int:
        return hash(self.keys)

    def __repr__(self) -> str:
        return f"DictResult({list(self.keys)!r})"


@dataclass(frozen=True)
class Node:
    kind: str
    op: str = ""
    args: tuple[int, ...] = ()
    attrs: tuple = ()
    dims: tuple[int, ...] = ()

    @property
    def has_batch(self) -> bool:
        return BATCH in self.dims

    @property
    def width(self) -> int:
        """The feature width (1 when the value does not vary along features)."""
        return max([d for d in self.dims if d > 1], default=1)

    def feature_axis(self) -> int | None:
        for i, d in enumerate(self.dims):
            if d > 1:
                return i
        return None


@dataclass
class Program:
    """A tail program. ``sources`` hold what ``param`` nodes read: a module attribute
    path (str) or a tensor; ``n_inputs`` counts the forward's tensor arguments."""

    nodes: list[Node] = field(default_factory=list)
    out: int = -1
    sources: list[Any] = field(default_factory=list)
    n_inputs: int = 1
    #: the program before rewrite.rewrite (same sources): small batches run it where the
    #: rewrites would need host-side guards (cupyfuse.backend.prepared)
    unrewritten: "Program | None" = field(default=None, repr=False, compare=False)
    #: the result came from squeeze() (or squeeze of the batch dim): at batch size 1 torch
    #: drops the batch dim too, so the output does (out_shape)
    squeezes_batch: bool = False
    #: a forward returning several tensors (a tuple, list or dict): the values after
    #: ``out`` and the container's type (None: one tensor; a :class:`DictResult` for a
    #: dict), called with the results in order. Not with squeezes of the batch.
    more_outs: tuple[int, ...] = ()
    outs_type: "type | DictResult | None" = None
    #: for each of ``more_outs``: its dims in torch's frame where they differ from the
    #: value's (as ``lead_out`` for ``out``: LEAD where a leading dim is, its features
    #: split into several dims, ROWS for a (batch * seq, F) view); () where the value's
    #: own dims give its shape (:meth:`result_shapes`)
    more_lead_out: tuple[tuple[int, ...], ...] = ()
    #: the sizes of the inputs' leading dims after the batch ((batch, seq, features)
    #: inputs: (seq,)): the program runs on batch * seq rows, and ``lead_out`` are the
    #: result's dims in torch's frame (LEAD where a leading dim is); ``lead_out`` also
    #: where the result's features are split into several dims (a (batch, H, D) result of
    #: a (batch, H * D) value)
    lead: tuple[int, ...] = ()
    lead_out: tuple[int, ...] = ()
    #: torch's error for a batch of one row, where it raises one (GroupNorm with one
    #: element per group: "Expected more than 1 value per channel ..."); None elsewhere
    one_row_error: str | None = None
    #: torch's error for an empty batch, where it raises one (a reshape whose -1 sits
    #: next to the batch size: ambiguous with 0 elements); None elsewhere
    zero_rows_error: str | None = None
    #: the inputs the forward flattens whole before any other use (``x.view(-1, 784)``,
    #: ``x.flatten(1)`` of a (batch, 1, 28, 28) input), as (place among the tensor inputs,
    #: flattened by ``.view``): the program reads them as (batch, prod(other dims)) rows,
    #: and the caller passes them so (:meth:`flat_rows`)
    flat_inputs: tuple[tuple[int, bool], ...] = ()

    def check_rows(self, batch: int) -> None:
        """Raise torch's own error where torch refuses a batch of this many rows."""
        if batch == 1 and self.one_row_error is not None:
            raise ValueError(self.one_row_error)
        if batch == 0 and self.zero_rows_error is not None:
            raise RuntimeError(self.zero_rows_error)

    def flat_rows(self, tens: list) -> list:
        """The tensor inputs with those of ``flat_inputs`` as (batch, prod(other dims)): a
        view where one is possible, else a copy; where the forward flattens with
        ``.view``, torch's own error where its view would raise (a transposed input)."""
        if not self.flat_inputs:
            return tens
        tens = list(tens)
        for j, by_view in self.flat_inputs:
            t = tens[j]
            shape = (t.shape[0], math.prod(t.shape[1:]))
            tens[j] = t.view(shape) if by_view else t.reshape(shape)
        return tens

    def check_lead_batches(self, shapes: Sequence[Sequence[int]], label: str,
                           names: Sequence[str]) -> None:
        """With leading dims (``lead``) the rows are batch * seq: every input must have
        x's batch size too (a program is made per shape after the batch, so this is
        checked at every call). torch broadcasts a (1, seq, N) input against a (batch,
        seq, N) value; cupyfuse refuses it, as it refuses a (seq, N) one. Without leading
        dims: torch.cat's operands must have the same rows (``check_cat_rows``)."""
        if not self.lead:
            self.check_cat_rows([int(shp[0]) for shp in shapes])
            return
        b = int(shapes[0][0])
        for shp, name in zip(shapes[1:], names[1:]):
            if int(shp[0]) != b:
                raise TailError(
                    f"{label}: {name} has shape {tuple(int(x) for x in shp)}; with a (batch, "
                    f"{', '.join(map(str, self.lead))}, features) input every input must have "
                    f"x's batch size ({b}) and those leading dims (each row of the batch and "
                    "sequence is one row of the fused op)")

    def check_cat_rows(self, rows: Sequence[int]) -> None:
        """torch.cat does not broadcast: operands whose rows differ (a value of a (1, N)
        input joined to one of the batch) raise torch's error. (Elsewhere a one-row input
        broadcasts against the batch, and the caller expands it to the batch's rows before
        the program runs, so this is checked first, at every call.) ``rows``: each input's."""
        if len(set(rows)) <= 1 or not any(n.kind == "cat" for n in self.nodes):
            return
        deps: list[frozenset] = []
        for n in self.nodes:
            if n.kind == "input":
                d = frozenset((n.attrs[0],))
            else:
                d = frozenset().union(*(deps[a] for a in n.args))
            deps.append(d)
            if n.kind != "cat":
                continue
            got = [max(rows[i] for i in deps[a]) if deps[a] else None for a in n.args]
            first = next((r for r in got if r is not None), None)
            for j, r in enumerate(got):
                if r is not None and r != first:
                    raise RuntimeError(
                        f"Sizes of tensors must match except in dimension {n.attrs[0]}. "
                        f"Expected size {first} but got size {r} for tensor number {j} in "
                        "the list.")

    def seq_group(self) -> int:
        """The rows a sequence reduction ("seqred") combines into one: the length of the
        (one) leading dim of a program that has such a reduction; 0 for any other
        program (every value then has the program's rows)."""
        if not any(n.kind == "seqred" for n in self.nodes):
            return 0
        return math.prod(self.lead)

    def per_batch(self) -> list[bool]:
        """For each node: whether its value has one row per batch element (computed from
        a sequence reduction) rather than one per (batch, seq) row. Read off the graph,
        so rewrites and splices keep it: inputs have the (batch, seq) rows, a "seqred"
        has the batch's, and any other value the (batch, seq) rows where one of its
        operands has them (a per-batch operand is broadcast along the sequence there),
        else the batch's where one of its operands has those."""
        seq: list[bool] = []
        per: list[bool] = []
        for n in self.nodes:
            if n.kind == "input":
                s, b = True, False
            elif n.kind == "seqred":
                s, b = False, True
            else:
                s = any(seq[a] for a in n.args)
                b = not s and any(per[a] for a in n.args)
            seq.append(s)
            per.append(b)
        return per

    def rows(self, batch: int) -> int:
        """Rows the program runs on for a batch of ``batch`` (batch * seq with leads)."""
        return batch * math.prod(self.lead)

    def _frame_shape(self, dims: Sequence[int], batch: int,
                     lead_batch: int | None) -> tuple[int, ...]:
        """The shape of a result whose torch-frame dims are ``dims`` (``lead_out``)."""
        n = math.prod(self.lead)
        b = lead_batch if lead_batch is not None else (batch // n if n else 0)
        it = iter(self.lead)
        return tuple(b if d == BATCH else next(it) if d == LEAD else b * n if d == ROWS
                     else d for d in dims)

    def result_shapes(self, batch: int, lead_batch: int | None = None
                      ) -> list[tuple[int, ...]]:
        """The shapes of ``out`` and then each of ``more_outs`` for ``batch`` rows (as
        :meth:`out_shape`)."""
        shapes = [self.out_shape(batch, lead_batch)]
        for k, o in enumerate(self.more_outs):
            fr = self.more_lead_out[k] if k < len(self.more_lead_out) else ()
            shapes.append(self._frame_shape(fr, batch, lead_batch) if fr else
                          shape_of(self.nodes[o].dims, batch))
        return shapes

    def out_shape(self, batch: int, lead_batch: int | None = None) -> tuple[int, ...]:
        """The result's shape for ``batch`` rows (as torch gives it; with leading dims,
        ``batch`` counts rows: batch * seq, and ``lead_batch``, where given, is the
        batch itself: needed when a leading dim is 0)."""
        if self.lead or self.lead_out:
            return self._frame_shape(self.lead_out, batch, lead_batch)
        shape = shape_of(self.nodes[self.out].dims, batch)
        if self.squeezes_batch and batch == 1:
            return tuple(x for i, x in enumerate(shape)
                         if i != self.nodes[self.out].dims.index(BATCH))
        return shape

    def lower_leads(self, lead: tuple[int, ...]) -> None:
        """Fold the leading dims into the rows: LEAD becomes 1 in every node (their axes
        keep their places), the results' torch-frame dims kept in ``lead_out`` and
        ``more_lead_out``."""
        if not lead:
            return
        self.lead = tuple(lead)
        self.lead_out = self.nodes[self.out].dims
        fr = tuple(self.more_lead_out) + ((),) * (len(self.more_outs) - len(self.more_lead_out))
        self.more_lead_out = tuple(f or self.nodes[o].dims for f, o in zip(fr, self.more_outs))
        self.nodes = [Node(n.kind, n.op, n.args, n.attrs, tuple(1 if d == LEAD else d
                                                                 for d in n.dims))
                      if LEAD in n.dims else n for n in self.nodes]

    def own_results(self) -> "Program":
        """Give every result a value of its own (in place; returns the program): a result
        that is a forward input (``x.clone()``: capture reads clone/detach/contiguous as
        the value itself) or the same value as an earlier result (``h, h.clone()``;
        ``relu(h), F.relu(h)``, one value after the Builder's memo) becomes a new
        ``view`` node of it with the same dims. The plan materialises every result that
        is not an input, so on the GPU (general path and prepared launches) each result
        gets a buffer of its own, written by a kernel -- never the caller's input, never
        another result's buffer. (The CPU path copies where its torch ops alias:
        :func:`cupyfuse.backend.cpu.own_tensors`.) A program whose results are distinct values,
        none of them an input (a one-result forward returning a computed value: the
        common case), is unchanged: nothing is copied there."""
        res = [self.out, *self.more_outs]
        seen: set[int] = set()
        for k, o in enumerate(res):
            if o in seen or self.nodes[o].kind == "input":
                self.nodes.append(Node("view", args=(o,), dims=self.nodes[o].dims))
                res[k] = len(self.nodes) - 1
            seen.add(res[k])
        self.out, self.more_outs = res[0], tuple(res[1:])
        self.__dict__.pop("_result_inputs", None)   # (result_inputs' memo)
        return self

    def describe(self) -> str:
        lines = []
        for i, n in enumerate(self.nodes):
            a = ", ".join(f"%{j}" for j in n.args)
            at = "" if not n.attrs else f" {n.attrs}"
            lines.append(f"%{i} = {n.kind}{'.' + n.op if n.op else ''}({a}){at}  dims={n.dims}")
        lines.append("return " + ", ".join(f"%{o}" for o in (self.out,) + self.more_outs))
        return "\n".join(lines)

    def result_inputs(self) -> list[frozenset[int]]:
        """For each result (``out``, then ``more_outs``): the forward inputs it is computed
        from (memoised)."""
        hit = getattr(self, "_result_inputs", None)
        if hit is not None:
            return hit
        deps: list[frozenset[int]] = []
        for n in self.nodes:
            s: set[int] = set()
            if n.kind == "input":
                s.add(n.attrs[0])
            for a in n.args:
                s |= deps[a]
            for x in (n.attrs[2:4] if n.kind == "gemv" else ()):
                if isinstance(x, int) and 0 <= x < len(deps):
                    s |= deps[x]
            deps.append(frozenset(s))
        out = [deps[o] for o in (self.out,) + self.more_outs]
        self._result_inputs = out
        return out

    def under_views(self, i: int) -> int:
        """The node whose value node ``i`` shows: ``i`` itself, or what its views view."""
        while self.nodes[i].kind == "view":
            i = self.nodes[i].args[0]
        return i

    def index_values(self) -> frozenset[int]:
        """The nodes whose values are positions (argmax/argmin of a row or of groups, views
        of those, a cat of them and a ``where`` choosing between two): float32 numbers
        inside the program, int64 where returned."""
        out: set[int] = set()
        for i, n in enumerate(self.nodes):
            if (n.kind in ("rred", "sred") and n.op in ARG_OPS) or \
                    (n.kind == "view" and n.args[0] in out) or \
                    (n.kind == "cat" and all(a in out for a in n.args)) or \
                    (n.kind == "map" and n.op == "where" and n.args[1] in out and
                     n.args[2] in out):   # (topk's positions: a cat of them, a choice)
                out.add(i)
        return frozenset(out)

    def index_results(self) -> tuple[bool, ...]:
        """For ``out`` and then each of ``more_outs``: whether it is an index value (torch
        gives int64 there; every path returns it so)."""
        idx = self.index_values()
        return tuple(o in idx for o in (self.out,) + tuple(self.more_outs))

    def users(self) -> list[list[int]]:
        u: list[list[int]] = [[] for _ in self.nodes]
        for i, n in enumerate(self.nodes):
            for a in n.args:
                u[a].append(i)
        return u


LEAD_WHY = ("works along a leading dim (the sequence of a (batch, seq, features) input); on "
            "such inputs cupyfuse fuses ops along the last dim, row by row")


def _fmt_dims(d: Sequence[int]) -> str:
    return "(" + ", ".join("batch" if x == BATCH else "seq" if x == LEAD else str(x)
                           for x in d) + ")"


def _marks(d: Sequence[int]) -> list[int]:
    return [x for x in d if x in (BATCH, LEAD)]


def lead_view_ok(old: Sequence[int], new: Sequence[int]) -> bool:
    """A view of a value with leading dims keeps them: the batch then the leading dims,
    in order, before every feature dim (size-1 dims anywhere)."""
    if LEAD not in old and LEAD not in new:
        return True
    seq = [x for x in new if x != 1]
    k = len(_marks(old))
    return _marks(old) == _marks(new) and seq[:k] == _marks(old) and \
        all(x > 1 for x in seq[k:])


def broadcast(a: Sequence[int], b: Sequence[int], what: str,
              split: bool = False) -> tuple[int, ...]:
    """torch's broadcasting on dims (batch = -1), refusing what a row program can't hold.
    ``split``: torch's dims of values whose features may be split into several dims
    (:mod:`cupyfuse.ir.splits`): those must follow the batch and leading dims."""
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + tuple(a)
    b = (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        elif BATCH in (x, y):
            other = y if x == BATCH else x
            raise TailError(f"{what}: broadcasts the batch dimension against "
                            + ("a leading (sequence) dim" if other == LEAD else
                               f"a dimension of size {other}")
                            + f" (shapes {_fmt_dims(a)} and {_fmt_dims(b)})")
        elif LEAD in (x, y):
            raise TailError(f"{what}: broadcasts a leading (sequence) dim against a dimension "
                            f"of size {max(x, y)} (shapes {_fmt_dims(a)} and {_fmt_dims(b)}); "
                            "a value read with it must vary along the last dim only")
        else:
            raise TailError(f"{what}: shapes {_fmt_dims(a)} and {_fmt_dims(b)} do not broadcast")
    if out.count(LEAD) > max(a.count(LEAD), b.count(LEAD)):
        raise TailError(f"{what}: shapes {_fmt_dims(a)} and {_fmt_dims(b)} make an outer "
                        "product over the leading (sequence) dims: " + LEAD_WHY)
    _check_dims(tuple(out), what, split)
    return tuple(out)


def _check_dims(dims: tuple[int, ...], what: str, split: bool = False) -> None:
    if split:
        first = next((i for i, d in enumerate(dims) if d > 1), len(dims))
        if any(d in (BATCH, LEAD) for d in dims[first:]):
            raise TailError(f"{what}: makes a value of shape {_fmt_dims(dims)} whose batch or "
                            "leading dim comes after a feature dim (a value is stored row by "
                            "row: the batch and leading dims come first)")
    elif sum(1 for d in dims if d > 1) > 1:
        raise TailError(f"{what}: makes a value of shape {_fmt_dims(dims)} with two feature "
                        "dimensions (an outer product); a tail may vary along one feature axis")
    if sum(1 for d in dims if d == BATCH) > 1:
        raise TailError(f"{what}: makes a value with two batch dimensions {_fmt_dims(dims)}")


class Builder:
    """Appends nodes to a program, computing dims; composite ops lowered to primitives.

    ``where`` is a callable giving the current source location for error messages,
    ``label`` the model's (or tail function's) name they start with.
    """

    def __init__(self, prog: Program | None = None, where: Callable[[], str] = lambda: "",
                 label: str = "") -> None:
        self.p = prog if prog is not None else Program()
        self.where = where
        self.label = label
        self._memo: dict[Node, int] = {}
        #: the sizes of the inputs' leading dims marked LEAD, in order (the translator's
        #: Program.lead before lowering): what a reduction over one of them spans
        self.leads: tuple[int, ...] = ()

    # --- primitives -------------------------------------------------------------
    def add(self, node: Node) -> int:
        hit = self._memo.get(node)
        if hit is not None and node.kind not in ("bn",):
            return hit
        self.p.nodes.append(node)
        i = len(self.p.nodes) - 1
        self._memo[node] = i
        return i

    def dims(self, v: int) -> tuple[int, ...]:
        return self.p.nodes[v].dims

    def err(self, msg: str) -> TailError:
        w = self.where()
        if self.label and not msg.startswith(f"{self.label}: "):
            msg = f"{self.label}: {msg}"
        return TailError(msg + (f"\n  at {w}" if w else ""))

    def input(self, i: int, dims: tuple[int, ...]) -> int:
        return self.add(Node("input", attrs=(i,), dims=tuple(dims)))

    def param(self, source: Any, shape: Sequence[int]) -> int:
        for j, s in enumerate(self.p.sources):
            if s is source or (isinstance(s, str) and s == source):
                break
        else:
            self.p.sources.append(source)
            j = len(self.p.sources) - 1
        dims = tuple(int(s) for s in shape)
        try:
            _check_dims(dims, "parameter")
        except TailError as e:
            raise self.err(str(e)) from None   # with the line that uses it
        return self.add(Node("param", attrs=(j,), dims=dims))

    def const(self, value: float) -> int:
        # the sign is part of the key: -0.0 == 0.0 would merge them (1/-0.0 is -inf)
        v = float(value)
        return self.add(Node("const", attrs=(v, math.copysign(1.0, v)), dims=()))

    def iota(self, n: int, start: float, step: float) -> int:
        """A batch-free value of ``n`` features, feature f being ``start + f * step`` (in
        double, then float32); one feature is the number ``start`` (a size-1 dim)."""
        if n < 1:
            raise AssertionError(f"iota of {n} features")
        if n == 1:
            return self.view(self.const(start), (1,))
        start, step = float(start), float(step)
        return self.add(Node("iota", attrs=(start, math.copysign(1.0, start), step),
                             dims=(int(n),)))

    def gemm(self, a: int, weight_source: Any, n: int, transposed: bool) -> int:
        da = self.dims(a)
        if len([d for d in da if d != 1]) > 2 or BATCH not in da or LEAD in da:
            raise self.err(f"Linear: its input must be a (batch, in_features) value, got "
                           f"{_fmt_dims(da)}")
        j = self.param(weight_source, ())  # registers the source
        src = self.p.nodes[j].attrs[0]
        self.p.nodes.pop()
        self._memo = {k: v for k, v in self._memo.items() if v < len(self.p.nodes)}
        return self.add(Node("gemm", args=(a,), attrs=(src, transposed), dims=(BATCH, n)))

    def map(self, op: str, *args: int, attrs: Sequence[float] = ()) -> int:
        entry = MAPS[op]
        if len(args) != entry.arity:
            raise self.err(f"{op}: takes {entry.arity} operands, got {len(args)}")
        dims = self.dims(args[0])
        for a in args[1:]:
            try:
                dims = broadcast(dims, self.dims(a), op)
            except TailError as e:
                raise self.err(str(e)) from None
        return self.add(Node("map", op, tuple(args), tuple(float(x) for x in attrs), dims))

    def view(self, v: int, dims: Sequence[int], rows: bool = False) -> int:
        """``v`` with other dims, same storage. ``rows``: a leading dim folds into the
        batch rows here (the Linear's input), else leading dims must stay."""
        dims = tuple(dims)
        if dims == self.dims(v):
            return v
        if not rows and not lead_view_ok(self.dims(v), dims):
            raise self.err(f"view: from {_fmt_dims(self.dims(v))} to {_fmt_dims(dims)} moves "
                           f"a leading dim: {LEAD_WHY}")
        return self.add(Node("view", args=(v,), dims=dims))

    def slice(self, v: int, axis: int, start: int, length: int, what: str = "slice") -> int:
        """Features [start, start + length) along the feature axis (chunk, split, h[:, a:b])."""
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, length)):
            raise self.err(f"{what}: start {start!r} and length {length!r} must be ints "
                           "(torch raises)")
        ax = self._axis(v, axis, what, seq=True)
        d = self.dims(v)
        if d[ax] == BATCH:
            raise self.err(f"{what}: slices the batch dimension")
        if d[ax] == LEAD:
            return self.seq_take(v, ax, start, length, what)
        if length < 1:
            raise self.err(f"{what}: an empty slice (features [{start}, {start + length}))")
        if not (0 <= start and start + length <= d[ax]):
            raise self.err(f"{what}: features [{start}, {start + length}) of {d[ax]}")
        if start == 0 and length == d[ax]:
            return v
        return self.add(Node("slice", args=(v,), attrs=(ax, start, length),
                             dims=d[:ax] + (length,) + d[ax + 1:]))

    def cat(self, vals: Sequence[int], axis: int, what: str = "cat") -> int:
        """Values joined along the feature axis (the other dims alike, batch included)."""
        if len(vals) == 1:
            return vals[0]
        ax = self._axis(vals[0], axis, what)
        d0 = self.dims(vals[0])
        if d0[ax] == BATCH:
            raise self.err(f"{what}: joins along the batch dimension")
        sizes = []
        for v in vals:
            d = self.dims(v)
            if len(d) != len(d0) or any(x != y for i, (x, y) in enumerate(zip(d, d0)) if i != ax):
                raise self.err(f"{what}: values of shapes {_fmt_dims(d0)} and {_fmt_dims(d)} "
                               "differ outside the joined dimension")
            sizes.append(d[ax])
        if BATCH not in d0:
            raise self.err(f"{what}: joins values without a batch dimension")
        if any(x > 1 for i, x in enumerate(d0) if i != ax):
            raise self.err(f"{what}: joining along one dimension of values that vary along "
                           "another")
        return self.add(Node("cat", args=tuple(vals), attrs=(ax,) + tuple(sizes),
                             dims=d0[:ax] + (sum(sizes),) + d0[ax + 1:]))

    def _axis(self, v: int, axis: int, what: str, seq: bool = False) -> int:
        """``axis`` of value ``v`` in [0, ndim); a leading (sequence) dim refused unless
        ``seq`` (the op reduces over it: :meth:`seq_reduce`)."""
        if not isinstance(axis, int) or isinstance(axis, bool):
            raise self.err(f"{what}: dim {axis!r} is not an int (torch raises)")
        d = self.dims(v)
        if not -len(d) <= axis < len(d):
            raise self.err(f"{what}: dim {axis} out of range for a value of {len(d)} dims")
        if d[axis % len(d)] == LEAD and not seq:
            raise self.lead_err(what)
        return axis % len(d)

    def size(self, v: int, ax: int, what: str) -> int:
        """The size of axis ``ax`` of ``v`` as torch has it (a leading dim's length)."""
        n = self.dims(v)[ax]
        return self._seq_len(v, ax, what) if n == LEAD else n

    def _seq_len(self, v: int, ax: int, what: str) -> int:
        """The length of the leading dim at ``ax`` of ``v``, where cupyfuse reduces over
        it: the program's only leading dim, after the batch, before the features."""
        d = self.dims(v)
        if d.count(LEAD) != 1 or len(self.leads) != 1:
            raise self.err(f"{what}: works along one of several leading dims of a value of "
                           f"shape {_fmt_dims(d)}; cupyfuse reduces over the sequence of a "
                           "(batch, seq, features) input, one leading dim (reshape the input "
                           "to (batch, seq, features) first)")
        if BATCH not in d[:ax] or any(x not in (BATCH, 1) for x in d[:ax]):
            raise self.err(f"{what}: a sequence dim that is not between the batch and the "
                           f"features (shape {_fmt_dims(d)})")
        s = self.leads[0]
        if s == 0:
            raise self.err(f"{what}: over a sequence of length 0 (an empty leading dim): "
                           "cupyfuse reduces sequences of one position or more")
        return s

    def seq_reduce(self, op: str, v: int, ax: int, keepdim: bool = True, what: str = "",
                   k: int = 0) -> int:
        """sum/max/min over the sequence dim ``ax`` of ``v`` (each batch element's seq
        rows), or its position ``k`` ("take"): a value of the batch's rows."""
        what = what or op
        s = self._seq_len(v, ax, what)
        d = self.dims(v)
        r = self.add(Node("seqred", op, (v,), (ax, s, k), d[:ax] + (1,) + d[ax + 1:]))
        if not keepdim:
            r = self.view(r, d[:ax] + d[ax + 1:])
        return r

    def seq_take(self, v: int, ax: int, start: int, length: int, what: str) -> int:
        """A slice of the sequence dim: one position of it (h[:, k:k + 1]), the dim kept."""
        s = self._seq_len(v, ax, what)
        if length != 1 or not 0 <= start < s:
            raise self.err(f"{what}: positions [{start}, {start + length}) of a sequence of "
                           f"{s}: cupyfuse takes one position of a leading (sequence) dim "
                           "(h[:, k] or h[:, k:k + 1]), not a range of them")
        return self.seq_reduce("take", v, ax, True, what, start)

    def lead_err(self, what: str) -> TailError:
        return self.err(f"{what}: {LEAD_WHY}")

    def no_leads(self, v: int, what: str) -> None:
        """Refuse an op whose meaning on a (batch, seq, ...) value is not row by row
        (channels at dim 1, statistics over the batch)."""
        if LEAD in self.dims(v):
            raise self.lead_err(what)

    def reduce(self, op: str, v: int, axis: int, keepdim: bool = True,
               rule: str = "") -> int:
        """sum/max/min over one axis: the feature axis, a size-1 axis (identity), or
        the sequence dim (:meth:`seq_reduce`). ``rule`` (a max/min's second attribute):
        the derivative torch gives the form written -- "index": ``torch.max(h, dim)``'s,
        to the one position it returns; "norm": a vector norm of order +-inf of the
        operand's abs, ties split and a NaN row's gradient 0; "" ``amax``'s, ties split."""
        ax = self._axis(v, axis, op, seq=True)
        d = self.dims(v)
        if d[ax] == BATCH:
            raise self.err(f"{op}: reduces over the batch dimension (dim {axis}); only "
                           "BatchNorm may use statistics over the batch")
        if d[ax] == LEAD:
            return self.seq_reduce(op, v, ax, keepdim)
        if d[ax] == 1:
            # the element itself; a sum starts from 0 as torch's does (-0.0 gives +0.0)
            r = self.map("add", v, self.const(0.0)) if op == "sum" else v
        else:
            attrs = (ax, rule) if rule and op in ("max", "min") else (ax,)
            r = self.add(Node("rred", op, (v,), attrs, d[:ax] + (1,) + d[ax + 1:]))
        if not keepdim:
            r = self.view(r, d[:ax] + d[ax + 1:])
        return r

    def argreduce(self, op: str, v: int, axis: int, keepdim: bool = False) -> int:
        """argmax/argmin over the feature axis (an index value: the position of the first
        maximum/minimum, a NaN counting as the extreme, as torch's); over a size-1 dim of a
        value without features, position 0 of each row. Over the batch, a leading
        (sequence) dim or a size-1 dim beside the features: refused."""
        ax = self._axis(v, axis, op, seq=True)
        d = self.dims(v)
        if d[ax] == BATCH:
            raise self.err(f"{op}: over the batch dimension (dim {axis}); cupyfuse computes "
                           "positions along the features of each row")
        if d[ax] == LEAD:
            raise self.err(f"{op}: over a leading (sequence) dim (dim {axis}); cupyfuse "
                           "computes positions along the features (the last dim) of each "
                           "row")
        fa = next((i for i, x in enumerate(d) if x > 1), None)
        if fa is not None and ax != fa:
            raise self.err(f"{op}: over dim {axis} of size 1 of a value of shape "
                           f"{_fmt_dims(d)} (positions along its features, dim {fa}, are "
                           "fused)")
        if d[ax] > MAX_INDEX_WIDTH:
            raise self.err(f"{op}: over {d[ax]} features; cupyfuse holds a position as a "
                           f"float32 number, exact up to {MAX_INDEX_WIDTH} features")
        r = self.add(Node("rred", op, (v,), (ax,), d[:ax] + (1,) + d[ax + 1:]))
        if not keepdim:
            r = self.view(r, d[:ax] + d[ax + 1:])
        return r

    def pool(self, op: str, v: int, k: int, s: int) -> int:
        d = self.dims(v)
        ax = len(d) - 1
        if d[ax] == BATCH:
            raise self.err(f"{op}_pool1d: pools over the batch dimension")
        if d[ax] == LEAD:
            raise self.lead_err(f"{op}_pool1d")
        w = d[ax]
        if k < 1 or s < 1:
            raise self.err(f"{op}_pool1d: kernel_size and stride must be >= 1, got {k}, {s}")
        if w < k:
            raise self.err(f"{op}_pool1d: window {k} is longer than the {w} features")
        wo = (w - k) // s + 1
        if k == 1 and (s == 1 or w == 1):
            # each element itself (an average adds it to 0: -0.0 -> +0.0); over a size-1
            # dim (a (batch, C, 1) value) whatever the stride: the kernels read a pool's
            # operand along its feature axis, which is not that dim
            return self.map("add", v, self.const(0.0)) if op == "avg" else v
        return self.add(Node("pool", op, (v,), (ax, k, s), d[:ax] + (wo,)))

    def wpool(self, op: str, v: int, c: int, length: int, lo: int, k: int, s: int, pad: int,
              dil: int, ceil: bool, incl: bool, adaptive: bool) -> int:
        """max/avg pooling of ``c`` channels of ``length`` positions along the last dim of
        ``v`` into ``lo`` windows each, by torch's rules (see the ``wpool`` kind); the
        caller checked the arguments and ``lo`` against torch."""
        d = self.dims(v)
        ax = len(d) - 1
        if not d or d[ax] in (BATCH, LEAD):
            raise self.err(f"{op}_pool1d: pools over the batch or a leading dimension")
        if max(d[ax], 1) != c * length or lo < 1:   # pragma: no cover - the caller's shapes
            raise AssertionError(f"wpool: {c} x {length} -> {lo} of {d}")
        return self.add(Node("wpool", op, (v,), (ax, int(c), int(length), int(lo), int(k),
                                                 int(s), int(pad), int(dil), bool(ceil),
                                                 bool(incl), bool(adaptive)),
                             d[:ax] + (c * lo,)))

    def sred(self, op: str, v: int, g: int, s: int) -> int:
        """sum/max/min over groups of ``g`` features ``s`` apart, one result per group
        (:func:`sred_values`): a reduction over one dim of features split into several
        dims (``g`` its size, ``s`` the size of the dims after it). A group of the whole
        row is a row reduction (kept as a size-1 dim); groups of one feature are the
        features themselves (a sum adds them to 0: -0.0 gives +0.0, as torch's)."""
        d = self.dims(v)
        ax = len(d) - 1
        w = d[ax] if d else 1
        if g < 1 or s < 1 or w in (BATCH, LEAD) or w % (g * s):
            raise AssertionError(f"sred: groups of {g} features {s} apart of {d}")
        if op in ARG_OPS:   # (groups of one feature: position 0 each, as torch's)
            if g == w:
                return self.argreduce(op, v, ax, True)
            if g > MAX_INDEX_WIDTH:
                raise self.err(f"{op}: over {g} features; cupyfuse holds a position as a "
                               f"float32 number, exact up to {MAX_INDEX_WIDTH} features")
        elif g == 1:
            return self.map("add", v, self.const(0.0)) if op == "sum" else v
        elif g == w:
            return self.reduce(op, v, ax, True)
        if w // g > MAX_GROUPS and g > INLINE_GROUP:
            raise self.err(f"{op}: {w // g} groups of {g} features is more than the "
                           f"{MAX_GROUPS} group results one block holds")
        return self.add(Node("sred", op, (v,), (ax, g, s), d[:ax] + (w // g,)))

    def scan(self, v: int, g: int, s: int) -> int:
        """The cumulative sum within groups of ``g`` features ``s`` apart along the last
        dim of ``v`` (a cumsum along one dim of features split into several: ``g`` its
        size, ``s`` the size of the dims after it); groups of one feature are the features
        themselves (added to 0: -0.0 gives +0.0, as torch's)."""
        d = self.dims(v)
        ax = len(d) - 1
        w = d[ax] if d else 1
        if g < 1 or s < 1 or w in (BATCH, LEAD) or max(w, 1) % (g * s):
            raise AssertionError(f"scan: groups of {g} features {s} apart of {d}")
        if g == 1:
            return self.map("add", v, self.const(0.0))
        return self.add(Node("scan", "sum", (v,), (ax, g, s), d))

    def remap(self, v: int, shape: Sequence[int], strides: Sequence[int],
              offset: int = 0) -> int:
        """Features gathered by index (:func:`remap_index`): feature ``f`` of the result,
        read as the row-major index ``(i_0, ..., i_k)`` into ``shape``, is feature
        ``offset + sum_j i_j * strides[j]`` of ``v`` (along its last dim). Size-1 entries
        are dropped and adjacent entries that read contiguously merged; an identity
        gather is ``v`` itself."""
        d = self.dims(v)
        ax = len(d) - 1
        shp, st = [], []
        for n, x in zip(shape, strides):
            if n == 1:
                continue
            if shp and st[-1] == x * n:   # (i, j) reads i * n * x + j * x: one dim of n_i * n
                shp[-1] *= n
                st[-1] = x
                continue
            shp.append(int(n))
            st.append(int(x))
        w = math.prod(shp)
        top = offset + sum((n - 1) * x for n, x in zip(shp, st))
        if not d or d[ax] in (BATCH, LEAD) or d[ax] < 2 or offset < 0 or top >= d[ax]:
            raise AssertionError(f"remap: {shape} {strides} +{offset} of {d}")
        if offset == 0 and shp == [d[ax]] and st == [1]:
            return v
        return self.add(Node("remap", args=(v,), attrs=(ax, tuple(shp), tuple(st), offset),
                             dims=d[:ax] + (w,)))

    def spread(self, v: int, width: int) -> int:
        """A value of one feature (a row statistic, a mask's number per row) repeated over
        ``width`` features along its last dim (an expand): a ``remap`` reading feature 0
        for each."""
        d = self.dims(v)
        if not d or d[-1] != 1 or width < 2:
            raise AssertionError(f"spread: {d} to {width}")
        return self.add(Node("remap", args=(v,), attrs=(len(d) - 1, (int(width),), (0,), 0),
                             dims=d[:-1] + (int(width),)))

    # --- composites ---------------------------------------------------------------
    def mean(self, v: int, axis: int, keepdim: bool = True) -> int:
        ax = self._axis(v, axis, "mean", seq=True)
        n = self.dims(v)[ax]
        if n == BATCH:
            raise self.err("mean: reduces over the batch dimension")
        n = self.size(v, ax, "mean")
        s = self.reduce("sum", v, ax, keepdim)
        return s if n == 1 else self.map("div", s, self.const(n))

    def var(self, v: int, axis: int, correction: int = 0, keepdim: bool = True) -> int:
        ax = self._axis(v, axis, "var", seq=True)
        n = self.size(v, ax, "var")
        m = self.mean(v, ax, True)
        d = self.map("sub", v, m)
        s = self.reduce("sum", self.map("square", d), ax, keepdim)
        return self.map("div", s, self.const(max(n - correction, 0) if n > 0 else 0))

    def logsumexp(self, v: int, axis: int, keepdim: bool = True) -> int:
        ax = self._axis(v, axis, "logsumexp", seq=True)
        self.size(v, ax, "logsumexp")   # (a sequence dim checked under this op's name)
        m = self.map("finite_or_zero", self.reduce("max", v, ax, True))
        s = self.reduce("sum", self.map("exp", self.map("sub", v, m)), ax, True)
        r = self.map("add", self.map("log", s), m)
        if not keepdim:
            d = self.dims(r)
            r = self.view(r, d[:ax] + d[ax + 1:])
        return r

    def softmax(self, v: int, axis: int, log: bool = False) -> int:
        what = "log_softmax" if log else "softmax"
        ax = self._axis(v, axis, what, seq=True)
        if self.dims(v)[ax] == BATCH:
            raise self.err(f"{what}: normalises over the batch dimension (dim {axis}); only "
                           "BatchNorm may use statistics over the batch")
        self.size(v, ax, what)
        m = self.reduce("max", v, ax, True)
        d = self.map("sub", v, m)
        s = self.reduce("sum", self.map("exp", d), ax, True)
        if log:
            return self.map("sub", d, self.map("log", s))
        return self.map("div", self.map("exp", d), s)

    def norm(self, v: int, axis: int, p: float = 2.0, keepdim: bool = True) -> int:
        ax = self._axis(v, axis, "norm", seq=True)
        self.size(v, ax, "norm")
        if p == 2.0:
            return self.map("sqrt", self.reduce("sum", self.map("square", v), ax, keepdim))
        if p == 1.0:
            return self.reduce("sum", self.map("abs", v), ax, keepdim)
        if p == math.inf:
            return self.reduce("max", self.map("abs", v), ax, keepdim, "norm")
        if p == -math.inf:
            return self.reduce("min", self.map("abs", v), ax, keepdim, "norm")
        if p == 0.0:   # torch's count of the nonzero elements (NaN among them)
            return self.reduce("sum", self.map("ne", v, self.const(0.0)), ax, keepdim)
        if math.isnan(p):
            raise self.err("norm: p=nan")
        # torch's general p: (sum |v|^p)^(1/p), negative p too
        s = self.reduce("sum", self.map("pow", self.map("abs", v), self.const(p)), ax, keepdim)
        return self.map("pow", s, self.const(1.0 / p))

    def normalize_rows(self, v: int, axis: int, eps: float) -> int:
        """(v - mean) / sqrt(var + eps) over one axis (LayerNorm/InstanceNorm without affine)."""
        m = self.mean(v, axis, True)
        d = self.map("sub", v, m)
        var = self.mean(self.map("square", d), axis, True)
        return self.map("mul", d, self.map("rsqrt", self.map("add", var, self.const(eps))))

    def group_normalize(self, v: int, groups: int, eps: float) -> int:
        """GroupNorm's normalisation over groups of consecutive features (no affine)."""
        self.no_leads(v, "group_norm")
        d = self.dims(v)
        ax = next((i for i, x in enumerate(d) if x > 1), None)
        w = 1 if ax is None else d[ax]
        if w % groups:
            raise self.err(f"group_norm: {w} features do not split into {groups} groups")
        g = w // groups
        if g == w and ax is not None:
            return self.normalize_rows(v, ax, eps)
        if g == 1:
            # torch checks the (batch * channels / groups, groups, spatial...) size it
            # normalises: one value per group at batch 1 raises there (F.group_norm)
            spatial = [x for x in d[2:]] if len(d) > 2 else []
            self.p.one_row_error = ("Expected more than 1 value per channel when training, "
                                    f"got input size {[1, groups] + spatial}")
            # each group is one element: v - v = 0 (NaN/inf give NaN), var 0
            z = self.map("sub", v, v)
            return self.map("mul", z, self.map("rsqrt", self.map("add", self.map("square", z),
                                                                  self.const(eps))))
        inv = self.const(g)
        m = self.map("div", self.add(Node("gred", "sum", (v,), (ax, g), d)), inv)
        dd = self.map("sub", v, m)
        var = self.map("div", self.add(Node("gred", "sum", (self.map("square", dd),), (ax, g), d)),
                       inv)
        return self.map("mul", dd, self.map("rsqrt", self.map("add", var, self.const(eps))))

    def affine(self, v: int, w_src: Any, b_src: Any, c: int, rows: bool = False) -> int:
        """``v * w + b`` per channel (dim 1, the ``c`` channels; either source may be None).
        ``rows``: the channels are the last dim of a (batch, seq..., c) value (a
        BatchNorm of every row, see :meth:`batchnorm_train`)."""
        if rows:
            shape: tuple[int, ...] = (c,)
        else:
            self.no_leads(v, "a per-channel affine")
            shape = (c,) + (1,) * (len(self.dims(v)) - 2)
        if w_src is not None:
            v = self.map("mul", v, self.param(w_src, shape))
        if b_src is not None:
            v = self.map("add", v, self.param(b_src, shape))
        return v

    def batchnorm_eval(self, v: int, rm_src: Any, rv_src: Any, eps: float,
                       rows: bool = False) -> int:
        """``(v - running_mean) * rsqrt(running_var + eps)`` over the channels of a
        (batch, channels) value (BatchNorm with running statistics, no affine); ``rows``:
        the channels are the last dim of a (batch, seq..., channels) value."""
        check_batchnorm_eps(eps, False)
        if not rows:
            self.no_leads(v, "batch_norm")
        c = max(self.dims(v)[-1 if rows else 1], 1)
        return self.map("mul", self.map("sub", v, self.param(rm_src, (c,))),
                        self.map("rsqrt", self.map("add", self.param(rv_src, (c,)),
                                                   self.const(eps))))

    def batchnorm_train(self, v: int, eps: float, momentum: float | None,
                        running: tuple[Any, Any, Any] | None, rows: bool = False) -> int:
        """Batch statistics over the batch axis; ``running`` = (mean, var, num_batches)
        sources to update, or None. ``rows``: over every row of a (batch, seq...,
        channels) value (its leading dims fold into the rows: the statistics of each
        channel over batch * seq values, as torch's BatchNorm of the (batch, channels,
        seq...) transpose)."""
        d = self.dims(v)
        if BATCH not in d:
            raise self.err("batch_norm: its input has no batch dimension")
        if not rows:
            self.no_leads(v, "batch_norm")
        srcs: tuple = ()
        if running is not None:
            ids = []
            for s in running:
                self.param(s, ())
                ids.append(self.p.nodes.pop().attrs[0])
            self._memo = {k: x for k, x in self._memo.items() if x < len(self.p.nodes)}
            srcs = tuple(ids)
        return self.add(Node("bn", args=(v,), attrs=(float(eps), momentum, srcs), dims=d))


def count_batch(n: Node, sources: Sequence[Any]) -> None:
    """nn.BatchNorm1d counts a batch (num_batches_tracked += 1) before it checks it, and
    counts an empty batch (which leaves the statistics alone): so does a "bn" node that
    updates running statistics (``sources`` empty: nothing to count)."""
    srcs = n.attrs[2]
    nbt = sources[srcs[2]] if srcs and sources else None
    if nbt is not None and hasattr(nbt, "add_"):
        import torch

        with torch.no_grad():
            nbt.add_(1)


def check_batchnorm(n: Node, sources: Sequence[Any], shape: tuple[int, ...]) -> None:
    """torch's own checks of a batch-statistics BatchNorm at run time (``shape``: its
    input's), the batch counted first as torch does: one row per channel, and eps."""
    eps = n.attrs[0]
    if shape[0] > 1 and eps > 0:
        return
    count_batch(n, sources)
    if shape[0] <= 1:
        import torch

        raise ValueError("Expected more than 1 value per channel when training, got "
                         f"input size {torch.Size(shape)}")
    check_batchnorm_eps(eps, True)


def check_batchnorm_eps(eps: float, training: bool) -> None:
    """Raise the installed torch's own error for an eps its batch_norm refuses (torch
    >= 2.12: eps <= 0 in training, eps < 0 with running statistics); older torch
    computes with it (NaN/inf), and so do we."""
    if (eps > 0) if training else (eps >= 0):
        return
    import torch
    import torch.nn.functional as F

    try:
        F.batch_norm(torch.ones(2, 1), torch.zeros(1), torch.ones(1), training=training,
                     momentum=0.0, eps=eps)
    except ValueError as exc:
        raise ValueError(str(exc)) from None


def remap_index(shape: Sequence[int], strides: Sequence[int], offset: int,
                device: Any = None) -> Any:
    """The feature each feature of a ``remap`` reads (an int64 tensor): for the row-major
    index ``(i_0, ..., i_k)`` of ``f`` into ``shape``, ``offset + sum_j i_j * strides[j]``."""
    import torch

    f = torch.arange(math.prod(shape), device=device)
    idx = torch.full_like(f, offset)
    inner = 1
    for n, x in reversed(list(zip(shape, strides))):
        idx += (f // inner % n) * x
        inner *= n
    return idx


def remap_values(t: Any, n: Node) -> Any:
    """A ``remap`` node's value from its operand's tensor ``t``."""
    ax, shape, strides, offset = n.attrs
    return t.index_select(ax, remap_index(shape, strides, offset, t.device))


def sred_values(t: Any, n: Node) -> Any:
    """A ``sred`` node's value from its operand's tensor ``t``: along axis ``ax`` (W
    features), feature ``a * s + c`` of the result (W / g of them) reduces features
    ``a * g * s + j * s + c``, j < g (sums in float64, the result in ``t``'s dtype;
    argmax/argmin: the position j, torch's, as a number of ``t``'s dtype)."""
    import torch

    ax, g, s = n.attrs
    u = t.movedim(ax, -1)
    sh = u.shape
    u = u.reshape(*sh[:-1], sh[-1] // (g * s), g, s)
    if n.op == "sum":
        r = u.double().sum(-2).to(t.dtype)
    elif n.op in ARG_OPS:   # (positions as float32 numbers: an index value)
        r = (torch.argmax(u, -2) if n.op == "argmax" else torch.argmin(u, -2)).to(t.dtype)
    else:
        r = torch.amax(u, -2) if n.op == "max" else torch.amin(u, -2)
    return r.reshape(*sh[:-1], sh[-1] // g).movedim(-1, ax)


def scan_values(t: Any, n: Node) -> Any:
    """A ``scan`` node's value from its operand's tensor ``t``: along axis ``ax``, feature
    ``a * g * s + p * s + c`` is the sum of features ``a * g * s + j * s + c``, j <= p, in
    double: chunks of SCAN_CHUNK positions, each one's running sum (torch's cumsum of
    doubles adds in order) plus the running sum of the totals of the chunks before it."""
    import torch

    ax, g, s = n.attrs
    u = t.movedim(ax, -1)
    sh = u.shape
    u = u.double().reshape(*sh[:-1], sh[-1] // (g * s), g, s).transpose(-1, -2)
    q = -(-g // SCAN_CHUNK)
    pad = q * SCAN_CHUNK - g
    if pad:
        u = torch.cat([u, u.new_zeros(*u.shape[:-1], pad)], -1)
    u = u.reshape(*u.shape[:-1], q, SCAN_CHUNK)
    within = torch.cumsum(u, -1)
    tot = within[..., -1]
    off = torch.cat([torch.zeros_like(tot[..., :1]), torch.cumsum(tot, -1)[..., :-1]], -1)
    r = (within + off[..., None]).reshape(*u.shape[:-2], q * SCAN_CHUNK)[..., :g]
    return r.transpose(-1, -2).reshape(sh).float().movedim(-1, ax)


def wpool_values(t: Any, n: Node) -> Any:
    """A ``wpool`` node's value from its operand's tensor ``t`` (its pooled axis last),
    with torch's own pooling functions on the (rows, C, L) view."""
    import torch.nn.functional as F

    _, c, length, lo, k, s, pad, dil, ceil, incl, adaptive = n.attrs
    lead = t.shape[:-1]
    u = t.reshape(-1, c, length)
    if adaptive:
        r = F.adaptive_max_pool1d(u, lo) if n.op == "max" else F.adaptive_avg_pool1d(u, lo)
    elif n.op == "max":
        r = F.max_pool1d(u, k, s, pad, dil, ceil_mode=ceil)
    else:
        r = F.avg_pool1d(u, k, s, pad, ceil_mode=ceil, count_include_pad=incl)
    return r.reshape(*lead, c * lo)


def iota_values(n: Node, device: Any = None) -> Any:
    """An ``iota`` node's values (a float32 tensor of its dims): start + f * step, in double
    (torch.arange's float32 values on the CPU)."""
    import torch

    start, _, step = n.attrs
    w = n.width
    f = torch.arange(w, dtype=torch.float64, device=device)
    v = torch.full((w,), start, dtype=torch.float64, device=device) if step == 0.0 else \
        f * step + start
    return v.float().reshape(n.dims)


def shape_of(dims: Sequence[int], batch: int) -> tuple[int, ...]:
    return tuple(batch if d == BATCH else d for d in dims)
