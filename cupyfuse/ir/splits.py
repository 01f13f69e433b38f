"""Split views: a value torch sees with its features in several dims.

``h.view(B, H, D)`` of a (batch, H * D) value is the same program value: its features in
row-major order, one feature axis. The translator (:mod:`cupyfuse.frontend.translate`) keeps torch's
dims beside it (``dims``: BATCH and LEAD marks first, then the feature sizes, 1s
anywhere); the functions here lower torch's ops on such a value onto the program:

* a reduction over one or several of the split dims is a ``sred`` (groups of ``g``
  features ``s`` apart: the dim's size and the size of the dims after it; over the last
  dim, consecutive groups; over the heads of (B, H, D), strided ones), or a row
  reduction where every feature dim is reduced; over the sequence dim of a (batch, seq,
  H, D) value, a sequence reduction (``seqred``) after those (statistics, softmax and
  normalisations along the sequence are the same formulas);
* a value broadcast against a wider one (a per-head statistic against its D features, a
  (D,) parameter over H heads, a (C,) weight over a channel's L positions) is a
  ``remap`` (a gather with stride 0 along the broadcast dims), so elementwise ops run on
  operands of one layout (a value of the batch's rows against (batch, seq) rows gets a
  size-1 dim for the sequence);
* indexing a split dim (``select``, ``unbind``, ``h[:, i]``, ``narrow``, ``chunk``) is a
  feature slice where the dim is the outermost one, a strided ``remap`` otherwise;
* a reshape that keeps the rows first is a relabelling (the storage is the same).

Anything that would move data between positions of a row (a transpose of the split
dims) is refused by the translator.
"""
from __future__ import annotations

import math
from typing import Sequence

from cupyfuse.ir.program import BATCH, LEAD, Builder, broadcast

__all__ = ["ROW", "feat_sizes", "width", "flat_dims", "is_split", "layout", "reduce",
           "mean", "var", "logsumexp", "softmax", "norm", "normalize", "layer_norm",
           "narrow", "fmt"]

#: the row marks: the batch and leading (sequence) dims
ROW = (BATCH, LEAD)


def fmt(dims: Sequence[int]) -> str:
    return "(" + ", ".join("batch" if x == BATCH else "seq" if x == LEAD else str(x)
                           for x in dims) + ")"


def marks(dims: Sequence[int]) -> tuple[int, ...]:
    return tuple(x for x in dims if x in ROW)


def feat_sizes(dims: Sequence[int]) -> tuple[int, ...]:
    """The sizes of the feature dims other than 1, in order."""
    return tuple(x for x in dims if x not in ROW and x != 1)


def width(dims: Sequence[int]) -> int:
    return math.prod(feat_sizes(dims))


def flat_dims(dims: Sequence[int]) -> tuple[int, ...]:
    """The program value's dims: the row marks, then every feature in one dim."""
    return marks(dims) + (width(dims),)


def is_split(dims: Sequence[int]) -> bool:
    """Whether a value with these dims has its features in more than one dim."""
    return len(feat_sizes(dims)) > 1


def _positions(dims: Sequence[int]) -> list[int]:
    """The positions of the feature dims other than 1."""
    return [i for i, x in enumerate(dims) if x not in ROW and x != 1]


def _strides(sizes: Sequence[int]) -> list[int]:
    out, st = [], 1
    for n in reversed(sizes):
        out.append(st)
        st *= n
    return out[::-1]


def broadcast_all(all_dims: Sequence[Sequence[int]], what: str) -> tuple[int, ...]:
    """torch's broadcast of several operands' dims (features split or not)."""
    out: tuple[int, ...] = tuple(all_dims[0])
    for d in all_dims[1:]:
        out = broadcast(out, d, what, split=True)
    return out


def _rows_as(b: Builder, v: int, out: Sequence[int]) -> int:
    """Program value ``v`` (its row marks, then its features) with size-1 dims where the
    result ``out`` has a leading (sequence) dim that ``v`` lacks: a value of the batch's
    rows (reduced over the sequence) against one of the (batch, seq) rows, broadcast
    along the sequence as the program broadcasts it."""
    d = b.dims(v)
    have = marks(d)
    if LEAD not in out or LEAD in have or BATCH not in have:
        return v
    want = tuple(x if x in have else 1 for x in out if x in ROW)
    last = max(i for i, x in enumerate(d) if x in ROW)
    return b.view(v, want + tuple(d[last + 1:]))


def layout(b: Builder, v: int, dims: Sequence[int], out: Sequence[int]) -> int:
    """Value ``v`` (the program value of a value with torch dims ``dims``) laid out as a
    value of dims ``out`` (``dims`` broadcast to ``out``, aligned right): a gather
    repeating it along the dims it lacks. A value without features (a row statistic,
    a number) stays as it is: the program broadcasts it (a value of the batch's rows
    against (batch, seq) rows gets a size-1 dim for the sequence)."""
    v = _rows_as(b, v, out)
    a = (1,) * (len(out) - len(dims)) + tuple(dims)
    pos = _positions(out)
    have = [a[p] for p in pos]
    if all(x == 1 for x in have) or have == [out[p] for p in pos]:
        return v
    st = _strides([x for x in have])
    return b.remap(v, [out[p] for p in pos], [0 if x == 1 else s for x, s in zip(have, st)])


def _out_dims(dims: Sequence[int], axes: Sequence[int], keepdim: bool) -> tuple[int, ...]:
    return tuple(1 if i in axes else x for i, x in enumerate(dims)
                 if keepdim or i not in axes)


def _seq_axis(dims: Sequence[int], p: int) -> int:
    """The axis of the program value (row marks, then the features) that holds the row
    mark at position ``p`` of torch's ``dims``."""
    return sum(1 for x in dims[:p] if x in ROW)


def reduce(b: Builder, op: str, v: int, dims: Sequence[int], axes: Sequence[int],
           keepdim: bool) -> tuple[int, tuple[int, ...]]:
    """sum / max / min over the dims ``axes`` (positions in ``dims``: feature dims, and
    the leading (sequence) dim of a (batch, seq, ...) input; the caller refuses the
    batch): (program value, torch dims). Each run of adjacent feature dims is one
    ``sred``; every feature dim at once is a row reduction; the sequence dim is then a
    sequence reduction (``seqred``: a value of the batch's rows)."""
    out = _out_dims(dims, axes, keepdim)
    seq = [p for p in axes if dims[p] == LEAD]
    v = _reduce_features(b, op, v, dims, [p for p in axes if dims[p] != LEAD],
                         bool(seq))
    if not seq:
        return v, out
    for p in seq:   # (one leading dim: Builder.seq_reduce refuses several)
        v = b.seq_reduce(op, v, _seq_axis(dims, p), True)
    return b.view(v, flat_dims(out)), out


def _reduce_features(b: Builder, op: str, v: int, dims: Sequence[int], axes: Sequence[int],
                     more: bool) -> int:
    """``reduce`` over feature dims only (``more``: a sequence reduction follows, which
    starts its sums from 0 itself)."""
    pos = _positions(dims)
    red = [p for p in pos if p in axes]
    if not red:   # size-1 dims only: each element itself (a sum adds it to 0, as torch's)
        return b.map("add", v, b.const(0.0)) if op == "sum" and not more else v
    if red == pos:
        return b.reduce(op, v, len(b.dims(v)) - 1, True)
    # runs of adjacent dims, from the last one (the ones before keep their places)
    runs: list[list[int]] = []
    for k, p in enumerate(pos):
        if p not in axes:
            continue
        if runs and pos.index(runs[-1][-1]) == k - 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    sizes = {p: dims[p] for p in pos}
    left = list(pos)
    for run in reversed(runs):
        g = math.prod(sizes[p] for p in run)
        s = math.prod(sizes[p] for p in left[left.index(run[-1]) + 1:])
        v = b.sred(op, v, g, s)
        left = [p for p in left if p not in run]
    return v


def _count(b: Builder, v: int, dims: Sequence[int], axes: Sequence[int]) -> int:
    """The number of elements a statistic over ``axes`` takes (a sequence dim's length
    from the builder: the input's)."""
    return math.prod(b.size(v, _seq_axis(dims, p), "mean") if dims[p] == LEAD else dims[p]
                     for p in axes)


def mean(b: Builder, v: int, dims: Sequence[int], axes: Sequence[int],
         keepdim: bool) -> tuple[int, tuple[int, ...]]:
    n = _count(b, v, dims, axes)
    r, out = reduce(b, "sum", v, dims, axes, keepdim)
    return (r if n == 1 else b.map("div", r, b.const(n))), out


def _back(b: Builder, r: int, rdims: Sequence[int], dims: Sequence[int]) -> int:
    """A keepdim statistic laid out back over the value it was taken of."""
    return layout(b, r, rdims, dims)


def var(b: Builder, v: int, dims: Sequence[int], axes: Sequence[int], correction: float,
        keepdim: bool) -> tuple[int, tuple[int, ...]]:
    """The variance over ``axes`` (all their elements at once), as Builder.var."""
    n = _count(b, v, dims, axes)
    m, mdims = mean(b, v, dims, axes, True)
    d = b.map("sub", v, _back(b, m, mdims, dims))
    s, out = reduce(b, "sum", b.map("square", d), dims, axes, keepdim)
    return b.map("div", s, b.const(max(n - correction, 0) if n > 0 else 0)), out


def logsumexp(b: Builder, v: int, dims: Sequence[int], axes: Sequence[int],
              keepdim: bool) -> tuple[int, tuple[int, ...]]:
    m, mdims = reduce(b, "max", v, dims, axes, True)
    m = b.map("finite_or_zero", m)
    s, _ = reduce(b, "sum", b.map("exp", b.map("sub", v, _back(b, m, mdims, dims))), dims,
                  axes, True)
    return b.map("add", b.map("log", s), m), _out_dims(dims, axes, keepdim)


def softmax(b: Builder, v: int, dims: Sequence[int], axis: int, log: bool) -> int:
    m, mdims = reduce(b, "max", v, dims, [axis], True)
    d = b.map("sub", v, _back(b, m, mdims, dims))
    s, _ = reduce(b, "sum", b.map("exp", d), dims, [axis], True)
    if log:
        return b.map("sub", d, _back(b, b.map("log", s), mdims, dims))
    return b.map("div", b.map("exp", d), _back(b, s, mdims, dims))


def norm(b: Builder, v: int, dims: Sequence[int], axes: Sequence[int], p: float,
         keepdim: bool) -> tuple[int, tuple[int, ...]]:
    """The p-norm over ``axes``, as Builder.norm: 1, 2, +-inf, 0 (the count of nonzero
    elements) and torch's general (sum |v|^p)^(1/p)."""
    if p == 2.0:
        s, out = reduce(b, "sum", b.map("square", v), dims, axes, keepdim)
        return b.map("sqrt", s), out
    if p == 1.0:
        return reduce(b, "sum", b.map("abs", v), dims, axes, keepdim)
    if p in (math.inf, -math.inf):
        return reduce(b, "max" if p > 0 else "min", b.map("abs", v), dims, axes, keepdim)
    if p == 0.0:
        return reduce(b, "sum", b.map("ne", v, b.const(0.0)), dims, axes, keepdim)
    s, out = reduce(b, "sum", b.map("pow", b.map("abs", v), b.const(p)), dims, axes, keepdim)
    return b.map("pow", s, b.const(1.0 / p)), out


def normalize(b: Builder, v: int, dims: Sequence[int], axis: int, p: float,
              eps: float) -> int:
    """F.normalize: v / max(||v||_p, eps) along ``axis``."""
    n, ndims = norm(b, v, dims, [axis], p, True)
    return b.map("div", v, _back(b, b.map("clamp", n, attrs=(eps, math.inf)), ndims, dims))


def layer_norm(b: Builder, v: int, dims: Sequence[int], axes: Sequence[int],
               eps: float) -> int:
    """(v - mean) * rsqrt(var + eps) over ``axes`` (LayerNorm without affine)."""
    m, mdims = mean(b, v, dims, axes, True)
    d = b.map("sub", v, _back(b, m, mdims, dims))
    var_, _ = mean(b, b.map("square", d), dims, axes, True)
    return b.map("mul", d, _back(b, b.map("rsqrt", b.map("add", var_, b.const(eps))), mdims,
                                 dims))


def narrow(b: Builder, v: int, dims: Sequence[int], axis: int, start: int,
           length: int) -> tuple[int, tuple[int, ...]]:
    """Entries [start, start + length) of feature dim ``axis``: a feature slice where it is
    the outermost feature dim, a strided gather otherwise."""
    out = tuple(length if i == axis else x for i, x in enumerate(dims))
    if dims[axis] == 1 or (start == 0 and length == dims[axis]):
        return v, out
    pos = _positions(dims)
    sizes = [dims[p] for p in pos]
    st = _strides(sizes)
    k = pos.index(axis)
    if k == 0:
        return b.slice(v, len(b.dims(v)) - 1, start * st[0], length * st[0], "slice"), out
    shape = [length if i == k else n for i, n in enumerate(sizes)]
    return b.remap(v, shape, st, start * st[k]), out
