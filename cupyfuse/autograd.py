"""Gradients through fused calls.

A fused call whose result needs a gradient (grad mode on, and an input, a parameter the
program reads, or a leaf of a tensor computed from parameters requiring grad) runs as one
``torch.autograd.Function``: its forward is the fused call itself (the same kernels, the
same bits as under ``no_grad``), and its backward *recomputes* the program from the
saved inputs and parameters with torch ops -- each op's torch semantics in the op table
(:func:`cupyfuse.backend.cpu.run_cpu` on the program before rewrites) -- and hands that
to ``torch.autograd.grad``. So every program that converts is differentiable, on the CPU
and on CUDA, with torch's own derivatives of the ops it is made of.

What is saved: the tensors differentiated (inputs and parameters: references, no copy;
an in-place change of one before ``backward`` raises torch's version error, as in
eager), and references to the other sources. Nothing of the forward's intermediates is
kept; the backward holds the recomputed forward's intermediates while it runs (as
``torch.utils.checkpoint`` does). A BatchNorm in training mode updates its running
statistics once, in the fused forward (the recompute uses the batch's statistics and
leaves the buffers alone). Frozen parameters (``requires_grad=False``) are neither saved
nor differentiated. Double backward (``create_graph=True``) is refused.

The recompute's GEMMs (:func:`gemm_for`) are differentiated by the engine too: the
forward product ``a @ W.T`` (reusing the weight's cached split where the weight is a
parameter), ``dA = dZ @ W`` and ``dW = dZ.T @ a`` run as 3xTF32 products on the sm90
engine (their operands transposed into fresh row-major copies and split in the call,
:func:`cupyfuse.backend.gemm.matmul_nt`) -- about 2.5x cuBLAS's float32 GEMMs, as
accurate -- and anywhere else as torch's.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch.autograd.function import once_differentiable

__all__ = ["apply", "backward_kind", "flatten", "gemm_for", "program_backward"]


def flatten(r: Any) -> tuple[list[torch.Tensor], Callable[[Sequence[torch.Tensor]], Any]]:
    """A call's result as a flat list of tensors, and the function that rebuilds the
    result (its own type: one tensor, a tuple or list, a dict) from such a list."""
    if isinstance(r, torch.Tensor):
        return [r], lambda ts: ts[0]
    if isinstance(r, dict):
        keys = list(r)
        kind = type(r)
        return [r[k] for k in keys], lambda ts: kind(zip(keys, ts))
    kind = type(r)
    return list(r), lambda ts: kind(list(ts))


class _Step:
    """One differentiated call: ``forward()`` gives the fused result, ``recompute(leaves)``
    the same result with torch ops from ``leaves`` (fresh tensors requiring grad, in the
    order of the call's differentiated tensors)."""

    __slots__ = ("forward", "recompute", "backward", "rebuild")

    def __init__(self, forward: Callable[[], Any],
                 recompute: Callable[[Sequence[torch.Tensor]], Any],
                 backward: Callable | None = None) -> None:
        self.forward, self.recompute, self.rebuild = forward, recompute, None
        self.backward = backward


class _FusedCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, step: _Step, *leaves: torch.Tensor) -> Any:   # type: ignore[override]
        with torch.no_grad():
            flat, step.rebuild = flatten(step.forward())
        step.forward = None   # (what it held -- the call's operands, its result -- let go)
        ctx.step = step
        ctx.save_for_backward(*leaves)
        ints = [t for t in flat if not t.is_floating_point()]
        if ints:
            ctx.mark_non_differentiable(*ints)
        return tuple(flat)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:   # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError(
                "cupyfuse: double backward (create_graph=True, or a gradient of a gradient) "
                "through a fused call is not supported; differentiate the original model "
                "for that")
        leaves = ctx.saved_tensors
        if ctx.step.backward is not None:
            req = [t.detach().requires_grad_(True) for t in leaves]
            return (None, *ctx.step.backward(req, grads))
        with torch.enable_grad():
            req = [t.detach().requires_grad_(True) for t in leaves]
            flat, _ = flatten(ctx.step.recompute(req))
            outs, gs = [], []
            for o, g in zip(flat, grads):
                if g is not None and o.requires_grad:
                    outs.append(o)
                    gs.append(g)
            if not outs:
                return (None,) * (1 + len(leaves))
            got = torch.autograd.grad(outs, req, gs, allow_unused=True)
        return (None, *got)


def apply(forward: Callable[[], Any], recompute: Callable[[Sequence[torch.Tensor]], Any],
          leaves: Sequence[torch.Tensor], backward: Callable | None = None) -> Any:
    """The result of ``forward()`` with autograd history: gradients flow to ``leaves``
    through ``backward(leaves, grads)`` where given (:func:`program_backward`), else
    through ``recompute`` (see the module docstring)."""
    step = _Step(forward, recompute, backward)
    flat = _FusedCall.apply(step, *leaves)
    return step.rebuild(list(flat))


class _EngineMatmul(torch.autograd.Function):
    """``a @ W.T`` (``transposed``: ``a @ W``, W stored (K, N)) with both products of its
    backward on the engine."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, w: torch.Tensor, transposed: bool,   # type: ignore[override]
                precision: str | None, owner: torch.Tensor | None) -> torch.Tensor:
        from cupyfuse.backend.gemm import matmul_nt

        ctx.transposed, ctx.precision = transposed, precision
        ctx.save_for_backward(a, w)
        return matmul_nt(a, w.t() if transposed else w, precision=precision,
                         owner=None if transposed else owner)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> Any:   # type: ignore[override]
        from cupyfuse.backend.gemm import matmul_nt

        a, w = ctx.saved_tensors
        wnk = w.t() if ctx.transposed else w     # (N, K)
        ga = gw = None
        if ctx.needs_input_grad[0]:
            ga = matmul_nt(g, wnk.t(), precision=ctx.precision)            # (M, N) @ (N, K)
        if ctx.needs_input_grad[1]:
            gnk = matmul_nt(g.t(), a.t(), precision=ctx.precision)         # (N, M) @ (M, K)
            gw = gnk.t() if ctx.transposed else gnk
        return ga, gw, None, None, None


def gemm_for(owners: Mapping[int, torch.Tensor], precision: str | None
             ) -> Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]:
    """The recompute's GEMM (``run_cpu``'s ``gemm``): :class:`_EngineMatmul` where grad
    mode is on; ``owners`` maps ``id`` of a weight the recompute reads to the parameter
    whose data it is (its cached split is used for the forward product)."""
    def gemm(a: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
        return _EngineMatmul.apply(a, w, transposed, precision, owners.get(id(w)))
    return gemm


def _backward_of(prog: Any, want_in: frozenset, want_src: frozenset) -> Any:
    """``prog``'s backward program for these gradients (memoised on the program), or
    why :func:`cupyfuse.ir.derivative.derivative` declines it (a string)."""
    from cupyfuse.ir.derivative import NoDerivative, derivative

    memo = prog.__dict__.setdefault("_backwards", {})
    key = (want_in, want_src)
    if key not in memo:
        try:
            memo[key] = derivative(prog, want_in, want_src)
        except NoDerivative as e:
            memo[key] = str(e)
    return memo[key]


def _declines(bw: Any, device: torch.device) -> str | None:
    """Why a call on ``device`` takes the recompute with this backward program (or the
    reason it has none), or None where it takes the backward program."""
    from cupyfuse import config

    mode = config.BACKWARD_PROGRAM
    if mode == "none" or (mode == "cpu" and device.type != "cpu"):
        return f"BACKWARD_PROGRAM={mode!r}"
    if isinstance(bw, str):
        return bw
    if device.type != "cpu" and bw.evaluations() > config.BACKWARD_MAX_EVALUATIONS:
        return f"{bw.evaluations()} evaluations per element"
    return None


def backward_kind(prog: Any, device: torch.device) -> str:
    """Which backward a call of ``prog`` on ``device`` differentiating every input and
    source takes: "backward program", or "recompute (why)" (for reports: bench --train)."""
    p = prog.unrewritten if prog.unrewritten is not None else prog
    bw = _backward_of(p, frozenset(range(p.n_inputs)), frozenset(range(len(p.sources))))
    why = _declines(bw, device)
    if why is None:
        return "backward program"
    if why.startswith("BACKWARD_PROGRAM"):
        has = "has one" if not isinstance(bw, str) else f"none: {bw}"
        return f"recompute ({why}; backward program: {has})"
    return f"recompute ({why})"


def program_backward(prog: Any, slots: Sequence[tuple],
                     operands: Callable[[Sequence[torch.Tensor]], tuple[list, list]],
                     device: torch.device, precision: str | None) -> Callable | None:
    """A differentiated call's backward through its backward program
    (:mod:`cupyfuse.ir.derivative`), or None where the program has none or
    ``config.BACKWARD_PROGRAM`` keeps this device on the recompute, or (CUDA) its kernels
    would evaluate values more than ``config.BACKWARD_MAX_EVALUATIONS`` times per element
    (``Backward.evaluations``).

    ``slots`` name the differentiated tensors (("in", j), ("src", k), ("leaf", k, m): see
    ``runner._grad_leaves``); ``operands(req)`` gives the program's inputs (row layout)
    and sources from the tensors ``req`` standing for them, with autograd history from
    ``req`` (reshapes, one-row broadcasts, derived weights). The backward: the backward
    program (CPU path or general GPU path) gives the inputs' gradients, each source's
    per-row gradient and each GEMM's output gradient ``dH``; the rows are summed in
    float64, weight gradients are ``dH^T A`` (the engine's 3xTF32 products on CUDA);
    then torch's autograd takes them through ``operands`` to ``req``."""
    from cupyfuse import config

    mode = config.BACKWARD_PROGRAM
    if mode == "none" or (mode == "cpu" and device.type != "cpu"):
        return None
    p = prog.unrewritten if prog.unrewritten is not None else prog
    want_in = frozenset(s[1] for s in slots if s[0] == "in")
    want_src = frozenset(s[1] for s in slots if s[0] in ("src", "leaf"))
    bw = _backward_of(p, want_in, want_src)
    if _declines(bw, device) is not None:
        return None

    def backward(req: Sequence[torch.Tensor], grads: Sequence[Any]) -> tuple:
        from cupyfuse.backend.cpu import run_cpu
        from cupyfuse.backend.gemm import matmul_nt

        with torch.enable_grad():
            ins, rs = operands(req)
        rows = ins[0].shape[0]
        if rows == 0:
            return tuple(torch.zeros_like(t) for t in req)
        gs = bw.grad_inputs(rows, grads, ins[0].device)
        with torch.no_grad():
            vals = [t.detach() for t in ins] + gs
            srcs = [t.detach() if isinstance(t, torch.Tensor) else t for t in rs]
            if ins[0].device.type == "cpu":
                outs = run_cpu(bw.prog, vals, srcs, training_updates=False)
            else:
                from cupyfuse.backend.execute import run_gpu

                outs = run_gpu(bw.prog, vals, srcs, precision)
            d_in: list[Any] = [None] * len(ins)
            d_src: list[Any] = [None] * len(rs)

            def acc(to: list, k: int, v: torch.Tensor) -> None:
                to[k] = v if to[k] is None else to[k] + v

            dh, av = {}, {}
            for (kind, ref), v in zip(bw.outs, outs):
                if kind == "in":
                    acc(d_in, ref, v.reshape(ins[ref].shape))
                elif kind == "src":
                    acc(d_src, ref, v.double().sum(0).reshape(rs[ref].shape).float())
                elif kind == "dh":
                    dh[ref] = v
                else:
                    av[ref] = v
            for node, src, transposed, operand in bw.gemms:
                a = ins[operand[1]].detach().reshape(rows, -1) if operand[0] == "in" \
                    else av[node]
                h = dh[node]
                if transposed:   # W stored (K, N): dW = A^T dH
                    dw = matmul_nt(a.t(), h.t(), precision=precision)
                else:            # W stored (N, K): dW = dH^T A
                    dw = matmul_nt(h.t(), a.t(), precision=precision)
                acc(d_src, src, dw.reshape(rs[src].shape))
        outs_t, gouts = [], []
        for t, d in zip(list(ins) + list(rs), d_in + d_src):
            if d is not None and isinstance(t, torch.Tensor) and t.requires_grad:
                outs_t.append(t)
                gouts.append(d)
        if not outs_t:
            return (None,) * len(req)
        return torch.autograd.grad(outs_t, list(req), gouts, allow_unused=True)

    return backward
