"""The CPU path: a tail program evaluated with torch ops.

float32 values as torch computes them; sums accumulate in float64 like the generated
kernels; the rewrites' nodes (GEMV, folded GEMM) run the same algebra as on the GPU
(:mod:`cupyfuse.ir.rewrite`), so the CPU tests check what the kernels implement.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from cupyfuse.ir.program import (BATCH, Program, check_batchnorm, iota_values, remap_values,
                      scan_values, shape_of, sred_values, wpool_values)
from cupyfuse.ir.rewrite import NotExact, fold_value, gemv_value
from cupyfuse.ops.registry import MAPS

__all__ = ["run_cpu", "own_tensors"]


def own_tensors(outs: Sequence[torch.Tensor], inputs: Sequence[Any]) -> list[torch.Tensor]:
    """The results of a call, each a contiguous tensor sharing memory with no input and
    no other result: a result that is strided (a slice's narrow view, an expand) or
    shares a storage with an input or an earlier result (a reshape of an input, a
    value returned twice) is copied; the others are returned as they are (the one
    result of a program, a fresh buffer: no copy). Storage-level: a result that shares
    a storage with another without overlapping it is copied too (never wrong)."""
    taken = {t.untyped_storage().data_ptr() for t in inputs
             if isinstance(t, torch.Tensor) and t.numel()}
    res = []
    for t in outs:
        if t.numel():
            p = t.untyped_storage().data_ptr()
            if p in taken or not t.is_contiguous():
                t = t.clone(memory_format=torch.contiguous_format)
                p = t.untyped_storage().data_ptr()
            taken.add(p)
        res.append(t)
    return res


def _pool_cpu(op: str, v: torch.Tensor, k: int, s: int) -> torch.Tensor:
    lead = v.shape[:-1]
    t = v.reshape(-1, 1, v.shape[-1])
    t = F.max_pool1d(t, k, s) if op == "max" else F.avg_pool1d(t, k, s)
    return t.reshape(*lead, t.shape[-1])


def seq_reduce_cpu(op: str, v: torch.Tensor, seq: int, width: int, k: int,
                   shape: Callable[[int], tuple[int, ...]]) -> torch.Tensor:
    """A "seqred" node with torch ops: ``v`` holds batch * seq rows of ``width`` features
    (its other dims of size 1: the rows outermost); its (batch, seq, width) view reduced
    over the sequence (sums in float64, like the kernels), ``shape(batch)`` the
    result's shape."""
    t = v.reshape(-1, seq, width)
    if op == "sum":
        r = t.double().sum(1).float()
    elif op == "max":
        r = torch.amax(t, 1)
    elif op == "min":
        r = torch.amin(t, 1)
    else:   # "take": one position of each sequence
        r = t[:, k]
    return r.reshape(shape(t.shape[0]))


def _per_seq(v: Any, dims: tuple[int, ...], seq: int) -> Any:
    """A per-batch value (one row per batch element) read where the (batch, seq) rows run:
    each row repeated for the seq rows of its batch element."""
    if not isinstance(v, torch.Tensor) or BATCH not in dims or v.dim() != len(dims):
        return v
    return v.repeat_interleave(seq, dim=dims.index(BATCH))


def _owner(owners: Sequence[Any] | None, i: int) -> tuple[Any, Any]:
    """(owner, deps) for the derived weights of a GEMM reading source i."""
    if owners is None or not isinstance(owners[i], torch.Tensor):
        return None, None
    return owners[i], owners


def _rows(prog: Program, i: int, v: torch.Tensor, batch: int) -> int:
    """The rows of value ``i`` (computed as ``v``): the batch, or 1 for a value of a
    one-row input that torch broadcasts against the batch (a (1, N) extra input)."""
    d = prog.nodes[i].dims
    if BATCH in d and v.dim() == len(d):
        return int(v.shape[d.index(BATCH)])
    return batch


def empty_batch(prog: Program, device: torch.device,
                lead_batch: int | None = None) -> torch.Tensor:
    """The result of a program for a batch of 0 rows: torch's empty result (``lead_batch``:
    the batch itself, where a leading dim of 0 makes 0 rows). (A training BatchNorm's
    running statistics and counter are left as they are; torch bumps the counter for an
    empty batch.)"""
    shapes = prog.result_shapes(0, lead_batch)
    outs = [torch.empty(s, dtype=torch.int64 if k else torch.float32, device=device)
            for s, k in zip(shapes, prog.index_results())]
    return prog.outs_type(outs) if prog.outs_type is not None else outs[0]


def run_cpu(prog: Program, inputs: Sequence[torch.Tensor], sources: Sequence[torch.Tensor],
            training_updates: bool = True,
            gemm: Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor] | None = None,
            owners: Sequence[Any] | None = None) -> torch.Tensor:
    """Evaluate a program with torch ops (float32; sums accumulate in float64, like the
    generated kernels). ``sources`` are the tensors of ``prog.sources`` resolved;
    ``owners`` the caller's own tensors behind them (parameters): where given, the
    rewrites' derived weights are cached on them as on the GPU (:func:`plans.cached`).
    A rewrite whose coefficients are not finite runs unrewritten (:class:`NotExact`)."""
    try:
        return _run_cpu(prog, inputs, sources, training_updates, gemm, owners)
    except NotExact:
        return _run_cpu(prog.unrewritten, inputs, sources, training_updates, gemm, owners)


def _run_cpu(prog: Program, inputs: Sequence[torch.Tensor], sources: Sequence[torch.Tensor],
             training_updates: bool, gemm: Callable | None,
             owners: Sequence[Any] | None) -> torch.Tensor:
    batch = inputs[0].shape[0]
    seq = prog.seq_group()   # > 0: a sequence reduction; its values have batch // seq rows
    prog.check_rows(batch // seq if seq else batch)
    if batch == 0:
        return empty_batch(prog, inputs[0].device)
    vals: list[Any] = []
    per = prog.per_batch() if seq else None
    for idx, n in enumerate(prog.nodes):
        k = n.kind
        operands = [vals[a] for a in n.args]
        if per is not None and not per[idx] and any(per[a] for a in n.args):
            # per-batch operands of a (batch, seq) value (a map or cat mixing the two):
            # broadcast along the sequence
            operands = [_per_seq(o, prog.nodes[a].dims, seq) if per[a] else o
                        for a, o in zip(n.args, operands)]
        if k == "input":
            r = inputs[n.attrs[0]]
        elif k == "param":
            r = sources[n.attrs[0]]
            if isinstance(r, torch.Tensor) and tuple(r.shape) != tuple(n.dims) \
                    and r.numel() == math.prod(n.dims):
                r = r.reshape(n.dims)   # a (C,) weight read as (C, 1): GroupNorm of (B, C, 1)
        elif k == "const":
            r = n.attrs[0]
        elif k == "iota":
            r = iota_values(n, inputs[0].device)
        elif k == "gemm":
            a = vals[n.args[0]]
            a = a.reshape(_rows(prog, n.args[0], a, batch), -1)
            w = sources[n.attrs[0]]
            if len(n.attrs) > 2:  # a folded average pool (rewrite.py)
                def mm(xa: torch.Tensor, wf: torch.Tensor, out: torch.Tensor) -> None:
                    torch.mm(xa, wf.t(), out=out)

                r = fold_value(prog, idx, a, w.t() if n.attrs[1] else w, sources, mm,
                               *_owner(owners, n.attrs[0]))
            elif gemm is not None:
                r = gemm(a, w, n.attrs[1])
            else:
                r = a @ (w if n.attrs[1] else w.t())
        elif k == "gemv":
            a = vals[n.args[0]]
            a = a.reshape(_rows(prog, n.args[0], a, batch), -1)
            w = sources[n.attrs[0]]
            r = gemv_value(prog, idx, a, w.t() if n.attrs[1] else w, sources,
                           *_owner(owners, n.attrs[0]))
        elif k == "map":
            # constants as 0-d float32 tensors (as torch treats Python numbers with a
            # float32 tensor; maximum/minimum/where need tensors)
            ops = [o if isinstance(o, torch.Tensor) else torch.tensor(o, dtype=torch.float32)
                   for o in operands]
            r = MAPS[n.op].torch_fn(*ops, *n.attrs)
        elif k == "rred":
            v = vals[n.args[0]]
            ax = n.attrs[0]
            if n.op == "sum":
                r = v.double().sum(ax, keepdim=True).float()
            elif n.op in ("argmax", "argmin"):   # (a position, as a float32 number)
                r = (torch.argmax if n.op == "argmax" else torch.argmin)(
                    v, ax, keepdim=True).float()
            elif len(n.attrs) > 1 and n.attrs[1] == "index":   # torch.max(h, dim)'s
                r = (torch.max if n.op == "max" else torch.min)(v, ax, keepdim=True).values
            elif len(n.attrs) > 1 and n.attrs[1] == "norm" and \
                    prog.nodes[n.args[0]].op == "abs":   # (the same value, torch's gradient)
                u = vals[prog.nodes[n.args[0]].args[0]]
                r = torch.linalg.vector_norm(u, math.inf if n.op == "max" else -math.inf,
                                             dim=ax, keepdim=True)
            elif n.op == "max":
                r = torch.amax(v, ax, keepdim=True)
            else:
                r = torch.amin(v, ax, keepdim=True)
        elif k == "gred":
            v = vals[n.args[0]]
            ax, g = n.attrs
            t = v.movedim(ax, -1)
            sh = t.shape
            s = t.double().reshape(*sh[:-1], sh[-1] // g, g).sum(-1, keepdim=True)
            r = s.expand(*sh[:-1], sh[-1] // g, g).reshape(sh).float().movedim(-1, ax)
        elif k == "sred":
            r = sred_values(vals[n.args[0]], n)
        elif k == "remap":
            r = remap_values(vals[n.args[0]], n)
        elif k == "pool":
            r = _pool_cpu(n.op, vals[n.args[0]], n.attrs[1], n.attrs[2])
        elif k == "wpool":
            r = wpool_values(vals[n.args[0]], n)
        elif k == "scan":
            r = scan_values(vals[n.args[0]], n)
        elif k == "bn":
            v = vals[n.args[0]]
            eps, momentum, srcs = n.attrs[:3]
            bax = n.dims.index(BATCH)
            check_batchnorm(n, sources if training_updates else (), tuple(v.shape))
            vd = v.double()
            mean = vd.mean(bax, keepdim=True)
            var = ((vd - mean) ** 2).mean(bax, keepdim=True)
            if len(n.attrs) > 3:   # "mean": the batch's mean itself (a backward program's)
                r = mean.float().expand(v.shape)
            else:
                r = ((vd - mean) / torch.sqrt(var + eps)).float()
            if srcs and training_updates:
                rm, rv, nbt = (sources[j] for j in srcs)
                nb = v.shape[bax]
                with torch.no_grad():
                    if nbt is not None:   # None: a caller's buffers without a counter
                        nbt.add_(1)
                    f = (1.0 / float(nbt.item())) if momentum is None else momentum
                    rm.mul_(1 - f).add_(mean.reshape(rm.shape).float(), alpha=f)
                    unb = (var * nb / (nb - 1)).reshape(rv.shape).float()
                    rv.mul_(1 - f).add_(unb, alpha=f)
        elif k == "cat":
            r = torch.cat(operands, n.attrs[0])
        elif k == "seqred":
            r = seq_reduce_cpu(n.op, vals[n.args[0]], n.attrs[1], prog.nodes[n.args[0]].width,
                               n.attrs[2], lambda b, d=n.dims: shape_of(d, b))
        elif k == "slice":
            r = vals[n.args[0]].narrow(n.attrs[0], n.attrs[1], n.attrs[2])
        elif k == "view":
            v = vals[n.args[0]]
            r = v.reshape(shape_of(n.dims, _rows(prog, n.args[0], v, batch))) \
                if isinstance(v, torch.Tensor) else v
        else:  # pragma: no cover - the builder makes no other kinds
            raise AssertionError(k)
        vals.append(r)
    # every result its own contiguous tensor (a narrow, a reshape of an input or of
    # another result, a value returned twice: copied); positions (argmax/argmin) as
    # torch's int64
    longs = prog.index_results()
    if prog.more_outs:   # (each in torch's shape: leading dims, split features)
        return prog.outs_type(own_tensors(
            [vals[o].reshape(s).long() if k else vals[o].reshape(s)
             for o, s, k in zip((prog.out,) + prog.more_outs, prog.result_shapes(batch),
                                longs)], inputs))
    out = vals[prog.out]
    if not isinstance(out, torch.Tensor):
        out = torch.tensor(out, dtype=torch.float32)
    if longs[0]:
        out = out.long()
    out = out.reshape(prog.out_shape(batch)) if prog.squeezes_batch or prog.lead or \
        prog.lead_out else out
    out = own_tensors([out], inputs)[0]
    return out if prog.outs_type is None else prog.outs_type([out])
