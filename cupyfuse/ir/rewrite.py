"""Exact rewrites of tail programs, applied wherever their conditions hold.

* **sum straight after the Linear** -- a feature sum of a value that is affine in a GEMM
  output, ``sum_f (a_f h_f + c_f)`` with ``h = x W^T`` and batch-free a, c, equals
  ``x . u + C`` with ``u = sum_f a_f W_f`` and ``C = sum_f c_f``: a matrix-vector product
  instead of the GEMM. ``u`` and ``C`` are computed in float64 and cached on the weight
  (rebuilt when any parameter involved changes), and the product runs in float64, so the
  result is closer to the float64 reference than the direct float32 path. Rows where the
  identity is not exact in floating point (x not finite, or a GEMM output that could
  overflow float32) are recomputed directly: on the GPU inside the GEMV kernel
  (``kernels_cu/tail_rewrite.cu``), without a host synchronisation.
* **average pooling straight after the Linear** -- ``avg_pool(a * h + c)`` over windows of
  k features with stride s is a Linear with the window-averaged rows
  ``W'_o = mean_j a_{os+j} W_{os+j}`` and bias ``mean_j c_{os+j}`` (made in float64, cached):
  a GEMM k/s times smaller. Rows with non-finite x or possible float32 overflow are
  recomputed directly, as for the GEMV (on the GPU in ``kernels_cu/tail_rewrite.cu``).
* **sum of max-pooled pairs of the Linear's output** -- with window 2 and stride 2,
  ``max(u, v) = ((u + v) + |u - v|) / 2``, so the sum over the pairs of ``v = a * h + c``
  is ``((x . s + S) + sum_j |x . d_j + e_j|) / 2`` with ``d_j = a_2j W_2j - a_2j+1 W_2j+1``,
  ``e_j = c_2j - c_2j+1`` and the summed row ``s``: one GEMM on half the rows (``s``
  rides along as one more row), then a row pass (``kernels_cu/tail_rewrite.cu``'s
  pairdiff_rows) that also guards and recomputes directly, as above.
* dead-code elimination after the rewrites (a GEMM no longer read is not run). Each rewrite
  is kept only if it makes its GEMM dead: a GEMV or a folded GEMM beside the full GEMM
  would only add work (measured: 28's InstanceNorm mean as a GEMV took 2.7 ms, 1.1 without).
"""
from __future__ import annotations

import dataclasses

import math
from typing import Any, Sequence

import torch

from cupyfuse.ir.program import (BATCH, LEAD, Builder, Node, Program, iota_values, remap_values,
                      sred_values)
from cupyfuse.ops.registry import MAPS

__all__ = ["rewrite", "gemv_value", "gemv_coefficients", "fold_value", "fold_coefficients",
           "static_value", "NotExact"]


class NotExact(Exception):
    """A rewrite's per-feature coefficient is not finite (``h / p`` with a zero in p,
    ``h * p`` with an inf): the form ``a * h + c`` is not the original order of operations
    there (``b * inf + (xW) * inf`` of opposite signs is NaN where ``(xW + b) * inf`` is
    +-inf). Raised before the rewritten node runs (what ran before wrote only the call's
    own buffers: rewrites are not applied next to running-statistics updates);
    ``fused.run_gpu`` and ``cpu.run_cpu`` then run the unrewritten program, and prepared
    launches step aside for them."""


def _finite(*vs: torch.Tensor) -> bool:
    """Whether every coefficient is finite in float32 (the kernels' type)."""
    return all(bool(torch.isfinite(v.float()).all()) for v in vs)


def _exact(co: tuple, name: str) -> tuple:
    """A cached coefficient tuple without its trailing exactness flag; NotExact if unset."""
    if not co[-1]:
        raise NotExact(f"{name}: a coefficient of the rewritten form is not finite")
    return co[:-1]


def _coefficient_as(b: Builder, v: int | None, dims: tuple[int, ...]) -> int | None:
    """A batch-free coefficient of a value, in the dims of a view of that value (its
    batch and leading dims 1): so it meets the view's other operands as the value does
    (a (C,) bias and a (C, 1) parameter of a (batch, C, 1) view made an outer product)."""
    if v is None:
        return None
    d = b.dims(v)
    fd = tuple(1 if x in (BATCH, LEAD) else x for x in dims)
    if not d or d == fd:
        return v
    if math.prod(x for x in d if x > 1) == 1:
        return b.view(v, (1,) * len(fd))
    return b.view(v, fd)


def _linear_form(b: Builder, v: int) -> tuple[int, int | None, int | None] | None:
    """(gemm node, a, c) with value(v) = a * h + c per feature (a, c batch-free node ids;
    None: a = 1, c = 0), or None if v is not of that form."""
    nodes = b.p.nodes
    n = nodes[v]
    if n.kind == "gemm":
        return v, None, None
    if n.kind == "view":
        lf = _linear_form(b, n.args[0])
        if lf is None:
            return None
        g, a, c = lf
        return g, _coefficient_as(b, a, n.dims), _coefficient_as(b, c, n.dims)
    if n.kind != "map" or n.op not in ("add", "sub", "mul", "div", "neg"):
        return None
    if n.op == "neg":
        lf = _linear_form(b, n.args[0])
        if lf is None:
            return None
        g, a, c = lf
        a = b.map("neg", a) if a is not None else b.const(-1.0)
        return g, a, (b.map("neg", c) if c is not None else None)
    x, y = n.args
    free = [not nodes[x].has_batch, not nodes[y].has_batch]
    if free[0] == free[1]:
        return None
    lin, other = (y, x) if free[0] else (x, y)
    lf = _linear_form(b, lin)
    if lf is None:
        return None
    g, a, c = lf
    if n.op == "add":
        return g, a, (b.map("add", c, other) if c is not None else other)
    if n.op == "sub":
        if lin == x:  # h - other
            return g, a, (b.map("sub", c, other) if c is not None else b.map("neg", other))
        na = b.map("neg", a) if a is not None else b.const(-1.0)  # other - h
        return g, na, (b.map("sub", other, c) if c is not None else other)
    if n.op == "mul":
        return g, (b.map("mul", a, other) if a is not None else other), \
            (b.map("mul", c, other) if c is not None else None)
    if n.op == "div" and lin == x:
        inv = b.map("reciprocal", other)
        return g, (b.map("mul", a, inv) if a is not None else inv), \
            (b.map("div", c, other) if c is not None else None)
    return None


def _affine(p: Program, b: Builder, n: Node, v: int) -> tuple[int, Node, int | None,
                                                                 int | None] | None:
    """(gemm id, gemm node, a, c) where value v (n's source, over n's axis) is
    ``a * h + c`` of a whole GEMM output h, or None."""
    src = p.nodes[v]
    if src.feature_axis() != n.attrs[0]:
        return None
    lf = _linear_form(b, v)
    if lf is None:
        return None
    g, a, c = lf
    gn = p.nodes[g]
    if src.width != gn.width or len(gn.attrs) > 2:
        return None
    return g, gn, a, c


def _sum_as_gemv(p: Program, b: Builder, n: Node) -> tuple[Node, int] | None:
    """rred sum over an affine GEMM output -> a GEMV with colsum(a * W)."""
    if n.kind != "rred" or n.op != "sum":
        return None
    af = _affine(p, b, n, n.args[0])
    if af is None:
        return None
    g, gn, a, c = af
    return Node("gemv", args=(gn.args[0],),
                attrs=(gn.attrs[0], gn.attrs[1], -1 if a is None else a,
                       -1 if c is None else c, gn.width), dims=n.dims), g


def _folded_gemm(kind: str, k: int, st: int, af: tuple, dims: tuple) -> tuple[Node, int]:
    """A ``gemm`` node on a derived weight (attrs[2] = (kind, window, stride, a, c,
    width)) replacing the GEMM of ``af`` (:func:`_affine`), and that GEMM's id."""
    g, gn, a, c = af
    return Node("gemm", args=(gn.args[0],),
                attrs=(gn.attrs[0], gn.attrs[1],
                       (kind, k, st, -1 if a is None else a, -1 if c is None else c,
                        gn.width)), dims=dims), g


def _avgpool_as_gemm(p: Program, b: Builder, n: Node) -> tuple[Node, int] | None:
    """avg pool over an affine GEMM output -> a GEMM with window-averaged rows."""
    if n.kind != "pool" or n.op != "avg":
        return None
    af = _affine(p, b, n, n.args[0])
    if af is None:
        return None
    _, k, st = n.attrs
    return _folded_gemm("avgpool", k, st, af, n.dims)


def _maxpool_pairs_sum(p: Program, b: Builder, n: Node) -> tuple[Node, int] | None:
    """sum over max-pooled pairs (window 2, stride 2) of an affine GEMM output -> a GEMM
    on the pair differences: ``max(u, v) = ((u + v) + |u - v|) / 2``."""
    if n.kind != "rred" or n.op != "sum":
        return None
    v = n.args[0]
    if p.nodes[v].feature_axis() != n.attrs[0]:
        return None
    while p.nodes[v].kind == "view":   # unsqueeze/squeeze around the pooling
        v = p.nodes[v].args[0]
    pn = p.nodes[v]
    if pn.kind != "pool" or pn.op != "max" or pn.attrs[1:] != (2, 2) \
            or pn.width != p.nodes[n.args[0]].width or pn.width < 2:
        return None
    af = _affine(p, b, pn, pn.args[0])
    if af is None:
        return None
    return _folded_gemm("pairdiff", 2, 2, af, n.dims)


#: the rewrite rules, tried in order on every node: each returns the node's replacement
#: and the GEMM it reads instead, or None
RULES = (_sum_as_gemv, _avgpool_as_gemm, _maxpool_pairs_sum)


def rewrite(prog: Program) -> Program:
    """The program with the exact rewrites applied, dead code removed.

    Not where a BatchNorm updates running statistics: a rewrite found not exact at run
    time (:class:`NotExact`) reruns the call unrewritten, which must have no side effects
    to repeat."""
    if any(n.kind == "bn" and n.attrs[2] for n in prog.nodes):
        return prog
    # every field carried over (squeezes_batch, leading dims ...), the nodes copied
    p = dataclasses.replace(prog, nodes=list(prog.nodes), unrewritten=None)
    b = Builder(p)
    b._memo = {}
    for rule in RULES:
        for i in range(len(prog.nodes)):
            n = p.nodes[i]
            if n.kind not in ("rred", "pool"):
                continue
            r = rule(p, b, n)
            if r is None:
                continue
            p.nodes[i] = r[0]
            if r[1] in _live(p):  # the GEMM is still needed: the rewrite would only add work
                p.nodes[i] = n
    out = _dce(p)
    out.unrewritten = prog
    return out


def _live(p: Program) -> set[int]:
    live: set[int] = set()
    stack = [p.out, *p.more_outs]
    while stack:
        i = stack.pop()
        if i in live:
            continue
        live.add(i)
        n = p.nodes[i]
        stack.extend(n.args)
        if n.kind == "gemv":
            stack.extend(x for x in n.attrs[2:4] if x >= 0)
        if n.kind == "gemm" and len(n.attrs) > 2:
            stack.extend(x for x in n.attrs[2][3:5] if x >= 0)
    return live


def _dce(p: Program) -> Program:
    live = _live(p)
    order = sorted(live)
    remap = {old: new for new, old in enumerate(order)}
    nodes = []
    for old in order:
        n = p.nodes[old]
        attrs = n.attrs
        if n.kind == "gemv":
            attrs = attrs[:2] + tuple(remap[x] if x >= 0 else -1 for x in attrs[2:4]) + attrs[4:]
        if n.kind == "gemm" and len(attrs) > 2:
            d = attrs[2]
            attrs = attrs[:2] + (d[:3] + tuple(remap[x] if x >= 0 else -1 for x in d[3:5])
                                 + d[5:],)
        nodes.append(Node(n.kind, n.op, tuple(remap[a] for a in n.args), attrs, n.dims))
    return dataclasses.replace(p, nodes=nodes, out=remap[p.out], unrewritten=None,
                               more_outs=tuple(remap[o] for o in p.more_outs))


def static_value(p: Program, i: int, sources: Sequence[Any]) -> Any:
    """A batch-free value, in float64 (a float or a tensor)."""
    n = p.nodes[i]
    if n.kind == "const":
        return n.attrs[0]
    if n.kind == "iota":
        return iota_values(n).double()
    if n.kind == "param":
        t = sources[n.attrs[0]].double()
        # (an (H, D) parameter read as H * D per-feature values, a (C,) one as (C, 1))
        return t.reshape(n.dims) if tuple(t.shape) != n.dims else t
    if n.kind == "view":
        v = static_value(p, n.args[0], sources)
        return v.reshape(n.dims) if isinstance(v, torch.Tensor) else v
    if n.kind == "map":
        ops = [static_value(p, a, sources) for a in n.args]
        if all(not isinstance(o, torch.Tensor) for o in ops):
            ops[0] = torch.tensor(ops[0], dtype=torch.float64)
        return MAPS[n.op].torch_fn(*ops, *n.attrs)
    if n.kind in ("slice", "remap", "sred", "rred", "cat"):   # (batch-free ones: parameters')
        ops = [static_value(p, a, sources) for a in n.args]
        if not all(isinstance(o, torch.Tensor) for o in ops):
            raise ValueError(f"node %{i} ({n.kind}) of a number")
        if n.kind == "slice":
            return ops[0].narrow(*n.attrs)
        if n.kind == "remap":
            return remap_values(ops[0], n)
        if n.kind == "sred":
            return sred_values(ops[0], n)
        if n.kind == "cat":
            return torch.cat(ops, n.attrs[0])
        ax = n.attrs[0]
        if n.op in ("argmax", "argmin"):   # (a position of a parameter's values: float32's)
            f = torch.argmax if n.op == "argmax" else torch.argmin
            return f(ops[0].float(), ax, keepdim=True).double()
        return ops[0].sum(ax, keepdim=True) if n.op == "sum" else \
            torch.amax(ops[0], ax, keepdim=True) if n.op == "max" else \
            torch.amin(ops[0], ax, keepdim=True)
    raise ValueError(f"node %{i} ({n.kind}) is not batch-free")


def _fingerprint(p: Program) -> int:
    """A key of the program's structure and constants (derived weights depend on both;
    an id() could be reused by a later program)."""
    fp = getattr(p, "_fingerprint", None)
    if fp is None:
        fp = hash(tuple(p.nodes))
        p._fingerprint = fp  # type: ignore[attr-defined]
    return fp


def _vector(v: Any, width: int, device: torch.device) -> torch.Tensor:
    if not isinstance(v, torch.Tensor):
        return torch.full((width,), float(v), dtype=torch.float64, device=device)
    return v.reshape(-1).to(device=device, dtype=torch.float64).expand(width) if v.numel() == 1 \
        else v.reshape(-1).to(device=device, dtype=torch.float64)


def _no_grad(fn: Any, *args: Any) -> Any:
    """A builder of derived weights, run without autograd (parameters that require grad
    would otherwise record a graph holding float64 copies of the weight)."""
    def build() -> Any:
        with torch.no_grad():
            return fn(*args)
    return build


def _coefficients(p: Program, n: Node, w: torch.Tensor, sources: Sequence[Any]) -> tuple:
    """(u float64, C as a Python float, a and c float32 of the GEMM's width, max|W|,
    whether a and c are finite)."""
    a_id, c_id, width = n.attrs[2], n.attrs[3], n.attrs[4]
    w = w.detach()
    dev = w.device
    a = _vector(1.0 if a_id < 0 else static_value(p, a_id, sources), width, dev)
    c = _vector(0.0 if c_id < 0 else static_value(p, c_id, sources), width, dev)
    u = torch.zeros(w.shape[1], dtype=torch.float64, device=dev)
    step = max(1, (1 << 23) // max(w.shape[1], 1))
    for r0 in range(0, w.shape[0], step):
        u += a[r0:r0 + step] @ w[r0:r0 + step].double()
    wmax = float(w.abs().max()) if w.numel() else 0.0
    return u, float(c.sum()), a.float().contiguous(), c.float().contiguous(), wmax, \
        _finite(a, c)


def gemv_coefficients(p: Program, i: int, weight: torch.Tensor, sources: Sequence[Any],
                      owner: Any = None, deps: Sequence[Any] | None = None) -> tuple:
    """The coefficients of ``gemv`` node i: (u, C, a, c, max|W|) (see
    :func:`_coefficients`). ``owner`` (the weight parameter) and ``deps`` (the parameters
    themselves, whose versions key the cache) make them a cached derived weight; without
    an owner they are recomputed each call."""
    from cupyfuse import caches

    if deps is None:
        deps = [weight] + [s for s in sources if isinstance(s, torch.Tensor)]
    deps = [d for d in deps if isinstance(d, torch.Tensor)]
    return _exact(caches.cached(f"tail_gemv_{i}", owner, deps, (_fingerprint(p),),
                               _no_grad(_coefficients, p, p.nodes[i], weight, sources)),
                  "feature sum as a GEMV")


def gemv_value(p: Program, i: int, x: torch.Tensor, weight: torch.Tensor,
               sources: Sequence[Any], owner: Any = None,
               deps: Sequence[Any] | None = None) -> torch.Tensor:
    """The value of a ``gemv`` node with torch ops (the CPU path, and the GPU's for a
    weight with a non-finite element): (batch,) float32 reshaped to its dims. On the GPU
    ``fused.run_gpu`` runs ``kernels_cu/tail_rewrite.cu`` instead (the same algebra and
    guard, without a host synchronisation)."""
    from cupyfuse.ir.program import shape_of

    n = p.nodes[i]
    u, C, a, c, wmax = gemv_coefficients(p, i, weight, sources, owner, deps)
    xd = x.double()
    r = xd @ u + C
    # rows where the identity is not exact in float: non-finite x, or outputs that could
    # overflow float32 on the direct path (|h| <= ||x||_1 max|W|)
    bound = xd.abs().sum(1) * wmax
    bad = ~(torch.isfinite(bound) & (bound < 1e37))
    if bool(bad.any()):
        rows = bad.nonzero().flatten()
        h = x[rows] @ weight.t()
        v = h * a + c
        r[rows] = v.double().sum(1)
    return r.float().reshape(shape_of(n.dims, x.shape[0]))


def _fold(p: Program, n: Node, w: torch.Tensor, sources: Sequence[Any]) -> tuple:
    _, k, st, a_id, c_id, width = n.attrs[2]
    w = w.detach()
    dev = w.device
    a = _vector(1.0 if a_id < 0 else static_value(p, a_id, sources), width, dev)
    c = _vector(0.0 if c_id < 0 else static_value(p, c_id, sources), width, dev)
    wo = (width - k) // st + 1
    idx = (torch.arange(wo, device=dev)[:, None] * st + torch.arange(k, device=dev)[None, :])
    wf = torch.zeros((wo, w.shape[1]), dtype=torch.float64, device=dev)
    for j in range(k):  # one window offset at a time: float64 copies of N/k rows only
        rows = idx[:, j]
        wf += a[rows, None] * w[rows].double()
    wf /= k
    bf = c[idx].sum(1) / k
    wmax = float(w.abs().max()) if w.numel() else 0.0
    return wf.float().contiguous(), bf.float().contiguous(), a.float().contiguous(), \
        c.float().contiguous(), wmax, _finite(a, c)


def fold_coefficients(p: Program, i: int, weight: torch.Tensor, sources: Sequence[Any],
                      owner: Any = None, deps: Sequence[Any] | None = None) -> tuple:
    """The folded weight of ``gemm`` node i and its companions: (W', b', a, c, max|W|),
    cached like :func:`gemv_coefficients`."""
    from cupyfuse import caches

    if deps is None:
        deps = [weight] + [s for s in sources if isinstance(s, torch.Tensor)]
    deps = [d for d in deps if isinstance(d, torch.Tensor)]
    return _exact(caches.cached(f"tail_fold_{i}", owner, deps, (_fingerprint(p),),
                               _no_grad(_FOLDS[p.nodes[i].attrs[2][0]], p, p.nodes[i], weight,
                                        sources)),
                  f"{p.nodes[i].attrs[2][0]} fold")


def _pairdiff(p: Program, n: Node, w: torch.Tensor, sources: Sequence[Any]) -> tuple:
    """Pair differences of ``v = a * (x W^T) + c`` (width N, h = N // 2 pairs):
    W' = [d_0 .. d_{h-1}; s; zero rows up to a multiple of 4] with
    ``d_j = a_2j W_2j - a_2j+1 W_2j+1`` and ``s = sum_{n < 2h} a_n W_n``,
    b' = [e_0 .. e_{h-1}; S] with ``e_j = c_2j - c_2j+1`` and ``S = sum c`` (float64, then
    float32). The guard's weight bound is ``max(max|W|, N max|a W|)``, +inf where the
    shortcut cannot be used for any row (a non-finite or huge W, a or c): every
    intermediate of both paths stays finite while ``||x_r||_1 * bound < PAIR_LIMIT``."""
    _, _, _, a_id, c_id, width = n.attrs[2]
    w = w.detach()
    dev = w.device
    a = _vector(1.0 if a_id < 0 else static_value(p, a_id, sources), width, dev)
    c = _vector(0.0 if c_id < 0 else static_value(p, c_id, sources), width, dev)
    h = width // 2
    K = w.shape[1]
    wf = torch.zeros((-(-(h + 1) // 4) * 4, K), dtype=torch.float32, device=dev)
    s = torch.zeros(K, dtype=torch.float64, device=dev)
    wmax = awmax = 0.0
    step = max(1, (1 << 22) // max(K, 1))   # pairs per chunk: float64 copies of a few rows
    for j0 in range(0, h, step):
        j1 = min(h, j0 + step)
        wev, wod = w[2 * j0:2 * j1:2].double(), w[2 * j0 + 1:2 * j1:2].double()
        ev, od = a[2 * j0:2 * j1:2, None] * wev, a[2 * j0 + 1:2 * j1:2, None] * wod
        wf[j0:j1] = (ev - od).float()
        s += ev.sum(0) + od.sum(0)
        if K:
            wmax = max(wmax, float(wev.abs().max()), float(wod.abs().max()))
            awmax = max(awmax, float(ev.abs().max()), float(od.abs().max()))
    wf[h] = s.float()
    c2 = c[:2 * h]
    e = c2[0::2] - c2[1::2]
    bf = torch.cat([e, c2.sum().reshape(1)]).float().contiguous()
    cmax = float(c2.abs().max()) if h else 0.0
    bound = max(wmax, width * awmax)
    if not (math.isfinite(bound) and bound < PAIR_LIMIT and width * cmax < PAIR_LIMIT):
        bound = math.inf   # NaN/inf or huge parameters: every row takes the direct path
    return wf, bf, a.float().contiguous(), c.float().contiguous(), bound, _finite(a, c)


#: pair differences: a row takes the shortcut while ||x_r||_1 * bound < PAIR_LIMIT (and
#: N max|c| < PAIR_LIMIT): the sums of up to N terms of 2 (||x_r||_1 max|a W| + max|c|)
#: stay under float32's 3.4e38
PAIR_LIMIT = 5e36

#: derived weights of a folded ``gemm`` node, by its kind
_FOLDS = {"avgpool": _fold, "pairdiff": _pairdiff}


def pairdiff_value(p: Program, i: int, x: torch.Tensor, weight: torch.Tensor,
                   sources: Sequence[Any], gemm: Any, owner: Any = None,
                   deps: Sequence[Any] | None = None) -> torch.Tensor:
    """The value of a pair-difference ``gemm`` node (a sum of max-pooled pairs of an affine
    GEMM output) with torch ops: ``sum_j max(v_2j, v_2j+1) = ((x . s + S) +
    sum_j |x . d_j + e_j|) / 2`` from the smaller GEMM ``gemm(x, W', out)``; rows where that
    is not exact in float (non-finite x, possible overflow) computed directly, NaN placed as
    torch's max pooling places it. ``kernels_cu/tail_rewrite.cu``'s pairdiff_rows is the
    GPU's version."""
    from cupyfuse.ir.program import shape_of

    n = p.nodes[i]
    width = n.attrs[2][5]
    h = width // 2
    wf, bf, a, c, bound = fold_coefficients(p, i, weight, sources, owner, deps)
    batch = x.shape[0]
    r = torch.empty(batch, dtype=torch.float64, device=x.device)
    if math.isfinite(bound):
        z = torch.empty((batch, wf.shape[0]), dtype=torch.float32, device=x.device)
        gemm(x, wf, z)
        r = z[:, h].double() + float(bf[h]) + (z[:, :h] + bf[:h]).abs().double().sum(1)
        r *= 0.5
        rb = x.abs().sum(1, dtype=torch.float64) * bound
        bad = ~(torch.isfinite(rb) & (rb < PAIR_LIMIT))
    else:
        bad = torch.ones(batch, dtype=torch.bool, device=x.device)
    if bool(bad.any()):
        rows = bad.nonzero().flatten()
        v = (x[rows] @ weight.t()) * a + c
        pooled = torch.nn.functional.max_pool1d(v.unsqueeze(1), 2, 2).squeeze(1)
        r[rows] = pooled.double().sum(1)
    return r.float().reshape(shape_of(n.dims, batch))


def fold_value(p: Program, i: int, x: torch.Tensor, weight: torch.Tensor,
               sources: Sequence[Any], gemm: Any, owner: Any = None,
               deps: Sequence[Any] | None = None) -> torch.Tensor:
    """The value of a folded ``gemm`` node (average pooling of an affine GEMM output) with
    torch ops for the guard (the CPU path, and the GPU's for a weight with a non-finite
    element; ``fused.run_gpu`` runs ``kernels_cu/tail_rewrite.cu`` instead):
    ``gemm(x, W', out)`` runs the smaller GEMM; (batch, wo) float32 in the node's dims."""
    from cupyfuse.ir.program import shape_of

    n = p.nodes[i]
    if n.attrs[2][0] == "pairdiff":
        return pairdiff_value(p, i, x, weight, sources, gemm, owner, deps)
    _, k, st, _, _, width = n.attrs[2]
    wf, bf, a, c, wmax = fold_coefficients(p, i, weight, sources, owner, deps)
    batch = x.shape[0]
    h = torch.empty((batch, wf.shape[0]), dtype=torch.float32, device=x.device)
    gemm(x, wf, h)
    h += bf
    bound = x.abs().sum(1, dtype=torch.float64) * wmax  # no float64 copy of x
    bad = ~(torch.isfinite(bound) & (bound < 1e37))
    if bool(bad.any()):
        rows = bad.nonzero().flatten()
        hd = (x[rows] @ weight.t()) * a + c
        pooled = torch.nn.functional.avg_pool1d(hd.unsqueeze(1), k, st).squeeze(1)
        h[rows] = pooled
    return h.reshape(shape_of(n.dims, batch))
