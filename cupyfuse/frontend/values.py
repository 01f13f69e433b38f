"""The values the translator (:mod:`cupyfuse.frontend.translate`) carries for fx nodes besides
program values: numbers and sizes of the forward, parameters used as GEMM operands,
boolean and integer tensors, and the views torch sees in another shape than the program
stores them in (features split into several dims, dims after the batch reordered, (batch *
seq, F) rows, stacks before the batch). Every ``capture_*`` module reads them; this module
imports none of those.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from cupyfuse.ir.program import LEAD


# ---------------------------------------------------------------------------------
# values the translation carries besides program values (ints)
class Val(int):
    """A program value id (plain ints in the forward are numbers, not values)."""


class _Device:
    """A value's ``.device`` in a trace: where the program runs (an argument of ``.to``
    and of tensor factories, which the program ignores)."""


_DEVICE = _Device()


@dataclass(frozen=True)
class _Const:
    v: float | int   # an int where the forward computed one (h.dim(), sizes)


class _TensorConst(_Const):
    """A 0-d tensor the forward makes (``torch.tensor(2.0)``): a number of the program."""


@dataclass(frozen=True)
class _Weight:
    """A parameter used as a GEMM operand: ``source`` holds (N, K) if not transposed."""

    source: Any
    shape: tuple[int, ...]
    transposed: bool = False


@dataclass(frozen=True)
class _Size:
    v: int
    dim: int | None
    lead: int | None = None   # a leading dim's (v == LEAD) place among the value's leading
                              # dims (they keep their order: the k-th is the input's k-th)
    #: the program value whose shape it is read from (a tensor made in the forward with
    #: the batch size, ``torch.zeros(h.size(0), 1)``, gets that value's rows)
    of: Any = field(default=None, compare=False)


def _sizes(dims: Sequence[int], of: Any = None) -> tuple[_Size, ...]:
    """A value's ``.shape`` / ``.size()`` (``of``: that value's program value)."""
    return tuple(_Size(x, i, tuple(dims[:i]).count(LEAD) if x == LEAD else None, of)
                 for i, x in enumerate(dims))


@dataclass(frozen=True)
class _Tuple:
    items: tuple


@dataclass(frozen=True)
class _Split:
    """A value torch sees with its features split into several dims (``h.view(B, H,
    D)``): program value ``v`` holds them flat in row-major order (dims
    ``splits.flat_dims(dims)``); ``dims`` are torch's (BATCH and LEAD marks first, then
    the feature sizes, 1s anywhere); ``kind`` "f" float, "b" boolean, "i" integer (as
    :class:`_Bool` / :class:`_Int` are for plain values). See :mod:`cupyfuse.ir.splits`."""

    v: int
    dims: tuple[int, ...]
    kind: str = "f"


@dataclass(frozen=True)
class _Star:
    """A shape unpacked with ``*`` into a call's arguments or a list (``_star``): its
    entries, spliced into the shape it is part of."""

    items: tuple


@dataclass(frozen=True)
class _Bool:
    """A boolean tensor (a comparison): program value ``v`` holding 0.0 / 1.0. Usable
    where torch promotes it to float (arithmetic with a float tensor, ``.float()``) and
    as ``torch.where``'s condition; reductions and results of it are refused (torch
    gives bool or int64 there)."""

    v: int


@dataclass(frozen=True)
class _Rows:
    """A (batch, seq..., F) value viewed as (batch * seq..., F) rows (``h.view(-1, F)``,
    ``h.flatten(0, -2)``; HF's Conv1D does it around its addmm): program value ``v``
    keeps its (batch, seq..., F) dims (the program's rows are batch * seq already); torch
    sees ``nd`` dims (2, or 1 after a reduction over F). Linear layers, elementwise ops
    and ops along F run on it (:meth:`Translator._rows_call`); a view back to (batch,
    seq..., F) gives the value again."""

    v: int
    nd: int = 2


class _MergedRows:
    """Dim 0's size of a ``_Rows`` value (batch * seq): no number of the program."""


@dataclass(frozen=True)
class _Perm:
    """A value torch sees with its dims after the batch reordered (``h.transpose(1, 2)``
    of a (batch, seq, C) value: (batch, C, seq)): program value ``v`` keeps its own dims
    (the batch, the leading dims, the features: the program's storage, row by row), and
    torch's dim ``i`` is its dim ``perm[i]``; ``kind`` "f" float, "b" boolean, "i"
    integer. Ops that read it in place run on ``v`` with their dims mapped
    (:meth:`Translator._perm_call`): elementwise ops, reductions, softmax and
    normalize along a dim, BatchNorm over the channels of a (batch, C, seq...) value,
    pooling over a whole sequence, a transpose back; anything that would move data
    (a Linear or a convolution over the sequence, a reshape, returning it) is refused.
    The batch never moves (a value is stored row by row)."""

    v: int
    perm: tuple[int, ...]
    kind: str = "f"


@dataclass(frozen=True)
class _Stacked:
    """``torch.stack`` of k values along a dim before the batch (dim 0: an ensemble's or
    multi-sample dropout's outputs, reduced by ``.mean(0)``): torch's dims are ``(k,) +
    dims``. The program holds the k values as one split value ``sp`` with the stacked dim
    right after the row marks (at ``ax``: their flat features one after the other), so a
    reduction over torch's dim 0 is one over ``sp``'s dim ``ax``; ``items`` are the values
    themselves (for indexing: ``s[i]``, ``unbind(0)``). Other ops on it are refused
    (:meth:`Translator._stacked_call`)."""

    sp: _Split
    ax: int
    items: tuple


@dataclass(frozen=True)
class _BatchStat:
    """A number computed over the whole batch: a sum or mean over every row (``loss.mean()``,
    a cross entropy's default reduction), and arithmetic of such numbers with numbers.
    ``expr`` is a tree of ("sum", value) -- the sum over every row and feature of a program
    value --, ("count",) -- the batch's rows --, ("const", c) and (op, a[, b]) for op in
    add/sub/mul/div/neg; evaluated after the fused call from the program's results
    (:class:`cupyfuse.ir.program.BatchStats`). Only arithmetic and returning it are fused."""

    expr: tuple


@dataclass(frozen=True)
class _RawInt:
    """An integer input of the forward (int64 / int32: an attention mask, labels),
    read as float32 (program value ``v``; the caller converts it, a copy per call).
    float32 holds its values exactly only up to 2**24, so only uses that are exact
    whatever the values are translated (:meth:`Translator._raw_int_call`): views, casts
    to float32, arithmetic with float tensors or numbers (torch converts the integers to
    float32 there too), comparisons with numbers, ``.bool()``; anything else is refused,
    naming the input (``label``)."""

    v: int
    label: str
    #: cast to int64 in the forward (``.long()``): what torch's scatter takes as an index
    int64: bool = False


@dataclass(frozen=True)
class _Int:
    """An integer tensor made from booleans (``(h > 0) * 3``, ``torch.where(m, 1, 0)``, a
    sum of a mask): program value ``v`` holding its (integral) values as float32. torch's
    dtype there is int64: promoted to float where torch promotes it (with a float tensor
    or number, ``.float()``, division, float-valued functions); a result of it, and ops
    torch raises on for it (mean, norms, softmax, activations...), are refused."""

    v: int


@dataclass(frozen=True)
class _Indices:
    """The indices of max/min along a dim (``values, idx = torch.max(h, -1)``,
    ``h.max(-1).indices``): ``make`` builds them (an :class:`_Index`) where an op reads
    them, or raises the TailError saying why they are not fused (None: refused with the
    general message); nothing is computed where nothing reads them. ``op``: "max" or
    "min" (torch returns the pair as ``torch.return_types.<op>``)."""

    make: Any = field(default=None, compare=False)
    op: str = "max"


@dataclass(frozen=True)
class _Index:
    """Positions along the features (``h.argmax(-1)``, ``h.argmin(1, keepdim=True)``, the
    indices of ``h.max(-1)``): ``inner`` is the value holding them as float32 numbers (a
    ``Val``, a ``_Split`` for positions within split features, a ``_Rows`` for those of a
    (batch * seq, F) view), an index value of the program (``Program.index_values``).
    torch's dtype there is int64: a result of it is int64 on every path; views,
    ``.long()``, ``.detach()``, ``.clone()`` keep it (``Translator._index_call``),
    ``.float()`` is a float32 value of it; any other use is refused."""

    inner: Any
