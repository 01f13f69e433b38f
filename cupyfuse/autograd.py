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

__all__ = ["apply", "flatten", "gemm_for"]


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

    __slots__ = ("forward", "recompute", "rebuild")

    def __init__(self, forward: Callable[[], Any],
                 recompute: Callable[[Sequence[torch.Tensor]], Any]) -> None:
        self.forward, self.recompute, self.rebuild = forward, recompute, None


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
          leaves: Sequence[torch.Tensor]) -> Any:
    """The result of ``forward()`` with autograd history: gradients flow to ``leaves``
    through ``recompute`` (see the module docstring)."""
    step = _Step(forward, recompute)
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
