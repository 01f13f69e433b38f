"""The backward of a tail program, as a tail program.

:func:`derivative` turns a program (before rewrites) into its *backward program*: the
forward's nodes, then one input per floating result -- the upstream gradient, with that
result's dims -- then the adjoint of every value on a path from a differentiated tensor
to a result (reverse mode, contributions summed in a fixed order). Each op's adjoint is
its record's ``derivative`` (:mod:`cupyfuse.ops.derivatives`); the other node kinds
have theirs here (a view's is the gradient itself):

=========  =========================================================================
rred sum   the gradient broadcast back over the features
rred max   amax's: split evenly over the ties (``g / count * (v == max)``: a NaN row
/ min      gets NaN); rule "index" (``torch.max(h, dim)``): all of it to the position
           ``argmax`` gives; rule "norm" (a vector norm of order +-inf): split over the
           ties, 0 in a row whose norm is NaN
gred       a group sum of the gradient (the group sum is its own adjoint)
remap      a broadcast (a spread, a per-group value read back by its group, a value
           tiled): the gradient summed over the copies (split sums)
cat        each operand's slice of the gradient
slice      the gradient between zeros (a ``cat``)
sred       split reductions: a sum's gradient read back by each group's features (a
           ``remap``); max/min amax's rule per group
scan       a cumulative sum's: the sum of the gradient from each feature to its group's
           end (the group's total, less the cumulative sum, plus the feature's own)
seqred     a sequence reduction (one row per batch element): a sum's gradient to every
           seq row, a take's to its row, max/min amax's rule; a per-batch adjoint read by
           seq rows is summed over them (``Program.per_batch``)
pool       windows that do not overlap (stride = window): an average's gradient / k
           read back by its window, a max's to the position ``argmax`` gives in each
           window; features past the last window get 0
bn         batch statistics (BatchNorm in training mode): ``invstd * (g - mean(g) - y *
           mean(g * y))``, the batch means as ``bn`` nodes of their own ("mean": the
           column statistics' kernels of the forward's BatchNorm)
gemm       the gradient of its output (``dH``) is a result; where its operand is
           differentiated too, ``dA = dH @ W`` is a GEMM node of the backward program
=========  =========================================================================

A value without a batch dim (a parameter, an expression of parameters) gets its
adjoint *per row* (dims ``(batch,) + dims``): the caller sums the rows (in float64) to
the parameter's gradient, and each GEMM's weight gradient ``dH^T A`` is a product the
caller makes from the results. So the backward program is row-wise like every tail
program: the CPU path runs it with torch ops, the GPU path as generated kernels.

Programs with nodes outside this table (overlapping pooling windows, channel pooling, remaps other than broadcasts, rewritten nodes), a
value with its features before the batch, batch statistics as results, or an op
without a formula for a differentiated operand raise :class:`NoDerivative`; those
calls differentiate with torch's autograd of the recomputed program instead
(:mod:`cupyfuse.autograd`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cupyfuse.ir.program import (BATCH, ROWS, Builder, DictResult, Node, Program, TailError,
                                 broadcast)
from cupyfuse.ops.derivatives import UNDEFINED, Grad
from cupyfuse.ops.registry import MAPS

__all__ = ["Backward", "NoDerivative", "derivative"]

#: the node kinds :func:`derivative` differentiates
KINDS = frozenset(("input", "param", "const", "iota", "gemm", "map", "rred", "gred", "view",
                   "remap", "cat", "slice", "sred", "pool", "scan", "seqred", "bn"))


class NoDerivative(Exception):
    """The program has something :func:`derivative` does not differentiate (the message
    says what)."""


@dataclass(frozen=True)
class Backward:
    """A backward program and what its results are.

    ``prog`` reads the forward's inputs (in the program's row layout) and then, for each
    of ``grads`` (positions among the forward's results), that result's upstream
    gradient; ``outs`` says, for each of its results in order: ``("in", j)`` the
    gradient of input j; ``("src", k)`` the per-row gradient of source k (sum the rows);
    ``("dh", node)`` the gradient of GEMM ``node``'s output; ``("a", node)`` that GEMM's
    operand (where it is not an input). ``gemms``: (node, source, transposed, operand)
    for each GEMM whose weight is differentiated, the operand an input position
    ``("in", j)`` or ``("a", node)``."""

    prog: Program
    grads: tuple[int, ...]
    outs: tuple[tuple, ...]
    gemms: tuple[tuple, ...]
    #: the results (of ``grads``) with one row per batch element: their gradients are
    #: passed repeated over each element's seq rows
    per_batch: tuple[int, ...] = ()
    #: the program reads, after the gradients, each row's place in its sequence
    #: ((rows, 1): 0 .. seq - 1)
    position: bool = False
    #: the dims of each of ``grads``' results
    grad_dims: tuple[tuple[int, ...], ...] = ()

    def grad_inputs(self, rows: int, grads: Any, device: Any) -> list:
        """The inputs ``prog`` reads after the forward's: each of ``grads`` (the upstream
        gradients of the forward's results, None for zeros) in its result's rows -- one
        per batch element repeated over its seq rows where ``per_batch`` -- then, where
        ``position``, each row's place in its sequence. ``rows``: the program's rows."""
        import math

        import torch

        from cupyfuse.ir.program import shape_of

        p = self.prog
        seq = math.prod(p.lead) if self.per_batch or self.position else 1
        out = []
        for m, k in enumerate(self.grads):
            dims = self.grad_dims[m]
            per = k in self.per_batch
            shape = shape_of(dims, rows // seq if per else rows)
            g = grads[k]
            g = torch.zeros(shape, dtype=torch.float32, device=device) if g is None \
                else g.detach().reshape(shape)
            if per:
                g = g.repeat_interleave(seq, dim=dims.index(BATCH))
            out.append(g.contiguous())
        if self.position:
            out.append(torch.arange(seq, device=device, dtype=torch.float32)
                       .repeat(rows // seq).reshape(rows, 1))
        return out

    def evaluations(self) -> int:
        """About how many times the generated kernels evaluate a value per element: each
        use of an elementwise value evaluates it again (codegen's values are functions of
        the feature index, not stored), so a program whose values are shared by many
        adjoints costs paths, not nodes -- a tail of every op of the table and its
        chunks and joins reached 10^5-10^6, past what nvcc compiles. Row and group
        reductions, GEMM outputs and loads end a path."""
        nodes = self.prog.nodes
        c = [0] * len(nodes)
        for o in (self.prog.out,) + tuple(self.prog.more_outs):
            c[o] += 1
        for n in nodes:
            if n.kind in ("rred", "gred", "remap"):
                for a in n.args:
                    c[a] += 1
        for i in range(len(nodes) - 1, -1, -1):
            if nodes[i].kind in ("map", "view", "slice", "cat"):
                for a in nodes[i].args:
                    c[a] += c[i]
        return sum(c)


def _width(dims: tuple[int, ...]) -> int:
    return max([d for d in dims if d > 1], default=1)


def _axis(dims: tuple[int, ...]) -> int | None:
    return next((i for i, d in enumerate(dims) if d > 1), None)


class _Adjoints:
    """The reverse sweep's state: the builder of the backward program, each value's
    gradient contributions (in the order they arrive)."""

    def __init__(self, prog: Program, n_grads: int) -> None:
        p = Program(nodes=list(prog.nodes), sources=list(prog.sources),
                    n_inputs=prog.n_inputs + n_grads)
        self.fwd = prog.nodes
        self.b = Builder(p)
        self.b._memo = {n: i for i, n in enumerate(p.nodes) if n.kind != "bn"}
        self.contrib: dict[int, list[int]] = {}
        #: a program with a sequence reduction: its seq length (values have batch * seq
        #: rows, or the batch's after the reduction: Program.per_batch); else 0
        self.seq = prog.seq_group()
        self.n_inputs = prog.n_inputs + n_grads
        self.pos: int | None = None   # the input holding each row's place in its sequence
        self._seq_rows: list[bool] = []
        self._batch_rows: list[bool] = []

    def rows(self, v: int) -> str:
        """"seq" (batch * seq rows), "batch" (one per batch element) or "" (no rows: a
        parameter's expression), as Program.per_batch reads the graph."""
        nodes = self.b.p.nodes
        for n in nodes[len(self._seq_rows):]:
            if n.kind == "input":
                sq, bt = True, False
            elif n.kind == "seqred":
                sq, bt = False, True
            else:
                sq = any(self._seq_rows[a] for a in n.args)
                bt = not sq and any(self._batch_rows[a] for a in n.args)
            self._seq_rows.append(sq)
            self._batch_rows.append(bt)
        return "seq" if self._seq_rows[v] else "batch" if self._batch_rows[v] else ""

    def per_seq(self, op: str, v: int, k: int = 0) -> int:
        """A sequence reduction ("sum" or "take" position k) of ``v`` (batch * seq rows,
        a batch dim first): one row per batch element, ``v``'s dims."""
        b, d = self.b, self.dims(v)
        lifted = d if len(d) > 2 else d[:1] + (1,) + d[1:]
        r = b.add(Node("seqred", op, (b.view(v, lifted),), (1, self.seq, k), lifted))
        return b.view(r, d)

    def seq_rows(self, v: int) -> int:
        """A value of one row per batch element as batch * seq rows (each repeated)."""
        b = self.b
        if not self.seq or self.rows(v) != "batch":
            return v
        x = next(i for i, n in enumerate(self.fwd) if n.kind == "input")
        zero = b.add(Node("rred", "sum", (b.map("where", x, b.const(0.0), b.const(0.0)),),
                          (_axis(self.fwd[x].dims) or 0,),
                          tuple(1 if d > 1 else d for d in self.fwd[x].dims)))
        zero = b.view(zero, tuple(BATCH if d == BATCH else 1 for d in self.dims(v)))
        return b.map("add", v, zero)

    def position(self) -> int:
        """Each row's place in its sequence (an input the caller passes: 0 .. seq - 1)."""
        if self.pos is None:
            self.pos = self.b.input(self.n_inputs, (BATCH, 1))
        return self.pos

    def dims(self, v: int) -> tuple[int, ...]:
        return self.b.p.nodes[v].dims

    def full(self, v: int, dims: tuple[int, ...]) -> int:
        """``v`` (a value with the batch) as a value of ``dims`` (with the batch): a view
        where the widths agree, else ``v``'s one feature spread over ``dims``' width."""
        b, w = self.b, _width(dims)
        if BATCH not in self.dims(v):
            raise AssertionError("an adjoint without the batch")
        if _width(self.dims(v)) != w:
            if _width(self.dims(v)) != 1:
                raise AssertionError(f"adjoint {self.dims(v)} for {dims}")
            v = b.spread(b.view(v, (BATCH, 1)), w)
        return b.view(v, dims)

    def target(self, t: int) -> tuple[int, ...]:
        """The dims of value ``t``'s adjoint: its own, with the batch in front where it
        has none (a parameter's adjoint is per row)."""
        d = self.fwd[t].dims
        return d if BATCH in d else (BATCH,) + d

    def add(self, t: int, c: int) -> None:
        """Contribution ``c`` (dims of the node that used ``t``) to ``t``'s adjoint: summed
        over the features ``t`` was broadcast along, then in ``t``'s adjoint dims."""
        b = self.b
        td = self.target(t)
        cd = self.dims(c)
        if _width(td) == 1 and _width(cd) > 1:
            c = b.add(Node("rred", "sum", (c,), (_axis(cd),),
                           tuple(1 if d > 1 else d for d in cd)))
            cd = self.dims(c)
        if _width(cd) == _width(td):
            c = b.view(c, td)
        else:
            try:
                ok = broadcast(cd, td, "adjoint") == td
            except TailError:
                ok = False
            if not ok:
                c = self.full(c, td)
        if self.seq and self.rows(t) == "batch" and self.rows(c) == "seq":
            c = self.per_seq("sum", c)   # (a per-batch value read by every seq row)
        self.contrib.setdefault(t, []).append(c)

    def pad(self, v: int, ax: int, before: int, after: int) -> int:
        """``v`` (with the batch) with ``before`` and ``after`` zero features around it
        along ``ax`` (a ``cat``)."""
        b = self.b
        parts = [v]
        col = b.slice(v, ax, 0, 1, "a gradient's padding") if _width(self.dims(v)) > 1 else v
        for first, size in ((True, before), (False, after)):
            if size:
                d = self.dims(col)
                ramp = b.view(b.iota(size, 0.0, 0.0) if size > 1 else b.const(0.0),
                              tuple(size if k == ax else 1 for k in range(len(d))))
                z = b.map("where", b.map("add", col, ramp), b.const(0.0), b.const(0.0))
                parts.insert(0 if first else len(parts), z)
        return b.cat(parts, ax, "a gradient's padding") if len(parts) > 1 else v

    def back(self, v: int, groups: int, g: int, s: int) -> int:
        """Value ``v`` of ``groups * s`` features (one per group of a split reduction or
        window) read back by each of the ``g`` features of its group: feature
        ``a * g * s + j * s + c`` reads ``a * s + c``."""
        b = self.b
        if _width(self.dims(v)) == 1:
            return b.spread(b.view(v, (BATCH, 1)), g)
        return b.remap(v, (groups, g, s), (s, 0, 1))

    def totals(self, t: int) -> list[int]:
        """``t``'s adjoint: the sum of its contributions -- for a value without rows (a
        parameter's expression) one sum per row count among them (per batch element,
        per seq row), each summed over its own rows by the caller."""
        groups: dict[str, list[int]] = {}
        for c in self.contrib.get(t, []):
            kind = self.rows(c) if self.seq and not self.rows(t) else ""
            groups.setdefault(kind, []).append(c)
        out = []
        for cs in groups.values():
            acc = cs[0]
            for c in cs[1:]:
                acc = self.b.map("add", acc, c)
            out.append(acc)
        return out


def _broadcast_dims(n: Node, src: Node) -> list[tuple[int, int]] | None:
    """For a ``remap`` that broadcasts (each feature of its operand read by every index
    of its zero-stride dims, its other dims reading the operand in order): the (g, s) of
    the split sums that take its gradient back, in order; None for any other remap."""
    _, shape, strides, offset = n.attrs
    shape, strides = list(shape), list(strides)
    sums = []
    while 0 in strides:
        i = strides.index(0)
        q = 1
        for x in shape[i + 1:]:
            q *= x
        sums.append((shape[i], q))
        del shape[i], strides[i]
    inner = 1
    for x, st in zip(reversed(shape), reversed(strides)):
        if st != inner:
            return None
        inner *= x
    return sums if offset == 0 and inner == max(src.width, 1) else None


def _check(prog: Program) -> None:
    ot = prog.outs_type
    if ot is not None and ot not in (tuple, list) and not isinstance(ot, DictResult):
        raise NoDerivative("results that are statistics over the batch")
    for n in prog.nodes:
        if BATCH in n.dims and any(d > 1 for d in n.dims[:n.dims.index(BATCH)]):
            # (its rows and features are not the (row, feature) layout views assume)
            raise NoDerivative("a value with its features before the batch dimension")
        if n.kind not in KINDS:
            raise NoDerivative(f"a {n.kind!r} node")
        if n.kind == "gemm" and len(n.attrs) != 2:
            raise NoDerivative("a rewritten GEMM")
        if n.kind == "remap" and _broadcast_dims(n, prog.nodes[n.args[0]]) is None:
            raise NoDerivative("a remap that is not a broadcast")
        if n.kind == "pool" and n.attrs[1] != n.attrs[2]:
            raise NoDerivative("pooling windows that overlap or leave gaps")
        if n.kind == "map" and MAPS.get(n.op) is None:
            raise NoDerivative(f"op {n.op!r} is no longer in the table")


def derivative(prog: Program, want_in: frozenset[int], want_src: frozenset[int]) -> Backward:
    """The backward program of ``prog`` (before rewrites) for gradients of the inputs
    ``want_in`` (positions) and the sources ``want_src`` (indices of ``prog.sources``);
    see the module docstring."""
    try:
        return _derivative(prog, want_in, want_src)
    except TailError as e:   # (an adjoint the builder refuses: more groups than fit)
        raise NoDerivative(str(e)) from None


def _derivative(prog: Program, want_in: frozenset[int], want_src: frozenset[int]) -> Backward:
    _check(prog)
    nodes = prog.nodes
    results = (prog.out,) + tuple(prog.more_outs)
    index = prog.index_values()
    grads = tuple(k for k, o in enumerate(results) if o not in index)
    for k in grads:
        if BATCH not in nodes[results[k]].dims:
            raise NoDerivative("a result without the batch dimension")

    live: list[bool] = []   # depends on a differentiated tensor
    for n in nodes:
        if n.kind == "input":
            on = n.attrs[0] in want_in
        elif n.kind == "param":
            on = n.attrs[0] in want_src
        elif n.kind == "gemm":
            on = n.attrs[0] in want_src or live[n.args[0]]
        elif n.kind == "rred" and n.op in ("argmax", "argmin"):
            on = False
        else:
            on = any(live[a] for a in n.args)
        live.append(on)

    st = _Adjoints(prog, len(grads))
    b = st.b
    per = prog.per_batch() if st.seq else [False] * len(nodes)
    for m, k in enumerate(grads):
        o = results[k]
        g = b.input(prog.n_inputs + m, nodes[o].dims)
        if per[o]:   # (passed repeated over each batch element's seq rows)
            g = st.per_seq("take", g)
        st.contrib.setdefault(o, []).append(g)

    dh: dict[int, int] = {}
    for i in range(len(nodes) - 1, -1, -1):
        n = nodes[i]
        if not live[i] or i not in st.contrib or n.kind in ("input", "param"):
            continue
        # (a value without the batch has per-row adjoints: a batch dim in front, so its
        # axes move up by one there)
        sh = 0 if BATCH in n.dims else 1
        for g in st.totals(i):
            args = n.args
            if n.kind == "map":
                got = MAPS[n.op].derivative(Grad(b, g, i, args, n.attrs))
                for a, e in zip(args, got):
                    if not live[a] or e is None:
                        continue
                    if e is UNDEFINED:
                        raise NoDerivative(f"op {n.op!r} has no derivative for operand "
                                           f"{args.index(a)}")
                    st.add(a, e.v)
            elif n.kind == "gemm":
                gh = st.full(g, n.dims)
                if st.rows(i) == "seq":
                    gh = st.seq_rows(gh)
                dh[i] = gh
                a = args[0]
                if live[a]:
                    k_in = _width(nodes[a].dims)
                    st.add(a, b.add(Node("gemm", args=(gh,), attrs=(n.attrs[0], not n.attrs[1]),
                                         dims=(BATCH, k_in))))
            elif n.kind == "rred":
                a = args[0]
                if n.op == "sum":
                    st.add(a, g)
                    continue
                v = a
                rule = n.attrs[1] if len(n.attrs) > 1 else ""
                vd = nodes[v].dims
                ax = n.attrs[0]
                if rule == "index":
                    arg = "argmax" if n.op == "max" else "argmin"
                    pos = b.add(Node("rred", arg, (v,), (ax,), n.dims))
                    ramp = b.view(b.iota(vd[ax], 0.0, 1.0),
                                  tuple(1 if d == BATCH else d for d in vd))
                    st.add(a, b.map("where", b.map("eq", ramp, pos), g, b.const(0.0)))
                    continue
                mask = b.map("eq", v, i)
                cnt = b.add(Node("rred", "sum", (mask,), (ax,), n.dims))
                share = b.map("div", g, cnt)
                if rule == "norm":
                    share = b.map("where", b.map("gt", cnt, b.const(0.0)), share, b.const(0.0))
                st.add(a, b.map("mul", share, mask))
            elif n.kind == "gred":
                ax, gs = n.attrs
                td = st.target(i)
                st.add(args[0], b.add(Node("gred", "sum", (st.full(g, td),), (ax + sh, gs),
                                           td)))
            elif n.kind == "view":
                st.add(args[0], g)
            elif n.kind == "remap":   # a broadcast: its gradient summed over the copies
                v = st.full(g, st.target(i))
                for gs, ss in _broadcast_dims(n, nodes[args[0]]):
                    v = b.sred("sum", v, gs, ss)
                st.add(args[0], v)
            elif n.kind == "cat":
                ax = n.attrs[0]
                gf = st.full(g, st.target(i))
                off = 0
                for a in args:
                    ln = nodes[a].dims[ax]
                    if live[a]:
                        st.add(a, b.slice(gf, ax + sh, off, ln, "cat's gradient"))
                    off += ln
            elif n.kind == "slice":   # the gradient between zeros
                ax, start, ln = n.attrs
                gf = st.full(g, st.target(i))
                total = nodes[args[0]].dims[ax]
                st.add(args[0], st.pad(gf, ax + sh, start, total - start - ln))
            elif n.kind == "sred":
                a = args[0]
                if n.op in ("argmax", "argmin"):
                    continue
                ax, gs, ss = n.attrs
                groups = nodes[a].dims[ax] // (gs * ss)
                gf = st.full(g, st.target(i))
                if n.op == "sum":
                    st.add(a, st.back(gf, groups, gs, ss))
                    continue
                mask = b.map("eq", a, st.back(i, groups, gs, ss))
                cnt = b.add(Node("sred", "sum", (mask,), (ax, gs, ss), n.dims))
                st.add(a, b.map("mul", st.back(b.map("div", gf, cnt), groups, gs, ss), mask))
            elif n.kind == "scan":   # features p..end of each group: total - cumsum + own
                ax, gs, ss = n.attrs
                a = args[0]
                gf = st.full(g, st.target(i))
                groups = nodes[a].dims[ax] // (gs * ss)
                total = st.back(b.sred("sum", gf, gs, ss), groups, gs, ss)
                cum = b.add(Node("scan", "sum", (gf,), (ax + sh, gs, ss), st.dims(gf)))
                st.add(a, b.map("add", b.map("sub", total, cum), gf))
            elif n.kind == "pool":   # windows of k, stride k
                a = args[0]
                ax, k, _ = n.attrs
                w, wo = nodes[a].dims[ax], n.dims[ax]
                gf = st.full(g, st.target(i))
                if n.op == "avg":
                    adj = b.map("div", st.back(gf, wo, k, 1), b.const(float(k)))
                else:
                    v = b.slice(a, ax, 0, wo * k, "max_pool's gradient")
                    pos = b.sred("argmax", v, k, 1)
                    shape = tuple(1 if d == BATCH else d for d in st.dims(pos))
                    first = b.view(b.iota(wo, 0.0, float(k)) if wo > 1 else b.const(0.0), shape)
                    at = st.back(b.map("add", pos, first), wo, k, 1)
                    ramp = b.view(b.iota(wo * k, 0.0, 1.0),
                                  tuple(1 if d == BATCH else d for d in st.dims(at)))
                    adj = b.map("where", b.map("eq", ramp, at), st.back(gf, wo, k, 1), b.const(0.0))
                st.add(a, st.pad(adj, ax + sh, 0, w - wo * k))
            elif n.kind == "seqred":   # per batch element -> its seq rows
                a = args[0]
                gf = st.full(g, st.target(i))
                if n.op == "sum":
                    st.add(a, gf)
                elif n.op == "take":   # the one row it takes
                    pos = b.view(st.position(),
                                 tuple(BATCH if d == BATCH else 1 for d in st.dims(gf)))
                    at = b.map("eq", pos, b.const(float(n.attrs[2])))
                    st.add(a, b.map("where", at, gf, b.const(0.0)))
                else:   # amax's rule over the sequence: ties split, a NaN spreads
                    mask = b.map("eq", a, i)
                    cnt = st.per_seq("sum", mask)
                    st.add(a, b.map("mul", b.map("div", gf, cnt), mask))
            elif n.kind == "bn":   # batch statistics: torch's batch_norm backward
                if st.seq:
                    raise NoDerivative("BatchNorm in a program with a sequence reduction")
                v = args[0]
                gy = st.full(g, st.target(i))

                def mean(u: int) -> int:   # the batch's mean of u, on every row
                    return b.add(Node("bn", args=(u,), attrs=(1.0, None, (), "mean"),
                                      dims=st.dims(u)))
                d = b.map("sub", v, mean(v))
                inv = b.map("rsqrt", b.map("add", mean(b.map("mul", d, d)),
                                           b.const(n.attrs[0])))
                part = b.map("sub", b.map("sub", gy, mean(gy)),
                             b.map("mul", i, mean(b.map("mul", gy, i))))
                st.add(v, b.map("mul", inv, part))
            # const / iota: nothing flows further

    outs: list[tuple] = []
    vals: list[int] = []
    for i, n in enumerate(nodes):
        if n.kind == "input" and n.attrs[0] in want_in and i in st.contrib:
            vals.append(st.seq_rows(st.full(st.totals(i)[0], n.dims)))
            outs.append(("in", n.attrs[0]))
        elif n.kind == "param" and n.attrs[0] in want_src and i in st.contrib:
            for tot in st.totals(i):   # (per row count: each summed over its rows)
                vals.append(st.full(tot, st.target(i)))
                outs.append(("src", n.attrs[0]))
    gemms: list[tuple] = []
    for i, n in enumerate(nodes):
        if n.kind != "gemm" or n.attrs[0] not in want_src or i not in dh:
            continue
        vals.append(dh[i])
        outs.append(("dh", i))
        a = prog.under_views(n.args[0])
        if nodes[a].kind == "input":
            operand: tuple = ("in", nodes[a].attrs[0])
        else:
            vals.append(b.view(n.args[0], (BATCH, _width(nodes[n.args[0]].dims))))
            outs.append(("a", i))
            operand = ("a", i)
        gemms.append((i, n.attrs[0], n.attrs[1], operand))

    p = b.p
    if not vals:
        raise NoDerivative("no gradient reaches a differentiated tensor")
    p.out, p.more_outs = vals[0], tuple(vals[1:])
    p.outs_type = tuple
    p.own_results()
    if st.seq:   # (results of batch * seq rows, or one per batch element)
        p.lead = prog.lead
        frames = [tuple(ROWS if d == BATCH and st.rows(o) == "seq" else d
                        for d in p.nodes[o].dims) for o in (p.out,) + p.more_outs]
        p.lead_out, p.more_lead_out = frames[0], tuple(frames[1:])
    p.n_inputs = st.n_inputs + (st.pos is not None)
    return Backward(p, grads, tuple(outs), tuple(gemms),
                    tuple(k for k in grads if per[results[k]]), st.pos is not None,
                    tuple(nodes[results[k]].dims for k in grads))
