"""Certified row maxima: a row max (or min) over a GEMM's features, from one TF32 pass.

A tail that reads the GEMM output ``z = x W^T`` only through ``max_n f(z_rn)`` (``f`` a
chain of elementwise ops with batch-free operands, e.g. model 98's ``gelu(.) * 2`` after
its average pooling) needs ``z`` to float32 accuracy only where the row's maximum can be. Such a GEMM
runs one TF32 pass on the fp32 operands (a third of the 3xTF32 engine's tensor-core work,
and no x split); ``kernels_cu/tail_certify.cuh`` then bounds every element's error,
finds the columns whose range can reach the row's maximum and recomputes those with fp32
FMAs (summed in double), written over the TF32 values. The tail runs unchanged on the patched
output, and its maximum is the one a float32 GEMM gives (fp32 products of the candidates):
a column that was not recomputed is provably below it. The header explains the bound.

Each op's record (:mod:`cupyfuse.ops.registry`) says, per operand position, how a range
maps through it (:class:`cupyfuse.ops.ranges.Rule`): monotone in its chain operand,
monotone between turning points (GELU's minimum, |v|'s 0 ...), a pole at 0, or not
bounded (sin, pow, where ...: such tails keep the 3xTF32 engine).

Used for GEMMs whose value reaches the program only through such a chain, on the sm90
engine at precision "highest" (the result is fp32-accurate), outside skinny batches:
folded GEMMs (average pooling straight after the Linear, rewrite.py; general path and
prepared launches) and plain ones (KernelBench 80's ``max(h + b)``; the general path,
past the prepared launches' sizes). ``backend.execute._certified`` decides. This module
finds the chains; :mod:`cupyfuse.backend.certified` generates and runs their kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


from cupyfuse import caches
from cupyfuse.ir.program import Program
from cupyfuse.ops.registry import MAPS

__all__ = ["Chain", "find", "chain_of", "red_only"]


@dataclass(frozen=True)
class Chain:
    """A certifiable use of GEMM node ``gemm``: the map nodes ``steps`` (each with the
    position of the chain operand in its args), then row reduction ``red`` (max/min)."""

    gemm: int
    steps: tuple[tuple[int, int], ...]
    red: int
    is_min: bool


def _leaf(prog: Program, i: int) -> int | None:
    """A batch-free param/const/iota under views, or None."""
    nodes = prog.nodes
    while nodes[i].kind == "view":
        i = nodes[i].args[0]
    n = nodes[i]
    return i if n.kind in ("param", "const", "iota") and not n.has_batch else None


def find(prog: Program, g: int) -> Chain | None:
    """The chain by which GEMM node ``g``'s value reaches the program, where it is only
    a row max/min of an elementwise chain with batch-free operands; else None."""
    nodes = prog.nodes
    users = prog.users()
    outs = {prog.out, *prog.more_outs}
    width = nodes[g].width
    if width < 2 or nodes[g].feature_axis() is None:
        return None
    cur, steps = g, []
    while True:
        if cur in outs or len(users[cur]) != 1:
            return None
        u = users[cur][0]
        n = nodes[u]
        if n.kind == "rred" and n.op in ("max", "min"):
            return Chain(g, tuple(steps), u, n.op == "min")
        if not n.has_batch or n.width != width:
            return None
        if n.kind == "view":
            cur = u
            continue
        if n.kind != "map":
            return None
        pos = [j for j, a in enumerate(n.args) if a == cur]
        if len(pos) != 1 or pos[0] not in MAPS[n.op].ranges:
            return None
        if any(_leaf(prog, a) is None for j, a in enumerate(n.args) if j != pos[0]):
            return None
        if n.op == "softplus" and not n.attrs[0] > 0:   # beta <= 0: not monotone
            return None
        for j, a in enumerate(n.args):
            if j != pos[0]:
                leaf = nodes[_leaf(prog, a)]
                if leaf.width not in (1, width):
                    return None
        steps.append((u, pos[0]))
        cur = u


def chain_of(prog: Program, g: int) -> Chain | None:
    """:func:`find`, cached per program (programs are not changed after they are built)."""
    import weakref

    key = (id(prog), g)
    hit = _chains.get(key)
    if hit is not None and hit[0]() is prog:
        return hit[1]
    chain = find(prog, g)
    _chains[key] = (weakref.ref(prog), chain)
    return chain


_chains: dict = caches.register("certified chains", {})


def red_only(prog: Program, chain: Chain, targets: Sequence[int], kernel: bool) -> bool:
    """Whether a level's kernel (``kernel``: it has one; ``targets``: the values it writes)
    computes nothing but ``chain``'s row reduction (or views of it): then the
    certification kernel writes that reduction itself and the level's kernel is not run."""
    return kernel and bool(targets) and all(prog.under_views(t) == chain.red for t in targets)


