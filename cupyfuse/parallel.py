"""Tensor parallelism by output features: a Linear whose weight is sharded by rows over a
torch.distributed group, followed by a tail over the whole row of features -- softmax,
log_softmax, logsumexp or layer_norm. Each rank computes its columns; the per-row
partials ((max, sum of exponentials), or (count, mean, M2) for the norm) are
all-gathered and folded in rank order, so every rank holds the same row statistics, the
same bits run to run. Backward: the row sums the derivative
needs (of g * p, or of g) gathered and summed in rank order; each rank's dW and db; dx
summed over the group in float32.

The LM-head form (a cross entropy over a sharded vocabulary) is
``cupyfuse.linear_cross_entropy(..., process_group=)``. On a GPU the GEMMs and the
elementwise work here are torch's (cuBLAS and its kernels).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["sharded_linear"]

TAILS = ("softmax", "log_softmax", "logsumexp", "layer_norm")


def sharded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   tail: str = "softmax", process_group: Any = None,
                   eps: float = 1e-5) -> torch.Tensor:
    """``tail(F.linear(x, W, b), dim=-1)`` for W and b sharded by rows (output features)
    over ``process_group`` (default: the world): ``weight`` and ``bias`` are this rank's
    rows, the ranks' shards in rank order making the whole. softmax, log_softmax and
    layer_norm (``F.layer_norm`` over the whole row, no affine: apply a sharded affine to
    the result; ``eps`` as torch's) return this rank's columns (..., rows of weight);
    logsumexp returns the whole rows' (...,), the same on every rank. Differentiable in
    x, weight and bias."""
    import torch.distributed as dist

    if tail not in TAILS:
        raise ValueError(f"sharded_linear: tail must be one of {TAILS}, got {tail!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sharded_linear: torch.distributed is not initialised "
                           "(dist.init_process_group first)")
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or \
            weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError("sharded_linear: x (..., hidden) and weight (rows, hidden) torch "
                         f"tensors, got {getattr(x, 'shape', x)} and {getattr(weight, 'shape', weight)}")
    group = process_group if process_group is not None else dist.group.WORLD
    lead = x.shape[:-1]
    out = _Sharded.apply(x.reshape(-1, x.shape[-1]), weight, bias, tail, group, float(eps))
    return out.reshape(*lead) if tail == "logsumexp" else out.reshape(*lead, weight.shape[0])


def _gather(v: torch.Tensor, group: Any) -> list[torch.Tensor]:
    import torch.distributed as dist

    parts = [torch.empty_like(v) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, v.contiguous(), group=group)
    return parts


def _exp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """exp(a - b), 1 where a == b (equal infinities)."""
    return torch.where(a == b, 1.0, torch.exp(a - b))


def _row_lse(h: torch.Tensor, group: Any) -> torch.Tensor:
    """logsumexp over the whole row: local (max, sum of exp) per row, gathered and folded
    in rank order."""
    hf = h.float()
    m = torch.where(torch.isnan(hf), -torch.inf, hf).amax(1) if hf.shape[1] else \
        torch.full(hf.shape[:1], -torch.inf, device=hf.device)
    s = _exp_diff(hf, m[:, None]).sum(1)
    parts = _gather(torch.stack([m, s]), group)
    M, S = parts[0][0].clone(), parts[0][1].clone()
    for p in parts[1:]:
        mn = torch.maximum(M, p[0])
        S = S * _exp_diff(M, mn) + p[1] * _exp_diff(p[0], mn)
        M = mn
    return M + torch.log(S)


def _row_moments(h: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, M2) over the whole row: local moments per row, gathered and merged in
    rank order (Chan et al.'s pairwise update: no cancellation of a sum of squares)."""
    hf = h.float()
    n = torch.full(hf.shape[:1], float(hf.shape[1]), device=hf.device)
    mean = hf.mean(1) if hf.shape[1] else torch.zeros_like(n)
    m2 = ((hf - mean[:, None]) ** 2).sum(1)
    parts = _gather(torch.stack([n, mean, m2]), group)
    N, M, Q = (t.clone() for t in parts[0])
    for p in parts[1:]:
        tot = N + p[0]
        d = p[1] - M
        frac = torch.where(tot > 0, p[0] / tot, 0.0)
        M = M + d * frac
        Q = Q + p[2] + d * d * N * frac
        N = tot
    return N, M, Q


def _row_sum(v: torch.Tensor, group: Any) -> torch.Tensor:
    parts = _gather(v, group)
    total = parts[0].clone()
    for p in parts[1:]:
        total = total + p
    return total


class _Sharded(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Any, tail: str,
                group: Any, eps: float) -> torch.Tensor:
        h = F.linear(x, weight, bias)
        ctx.tail, ctx.group, ctx.has_bias = tail, group, bias is not None
        if tail == "layer_norm":
            n, mean, m2 = _row_moments(h, group)
            rstd = torch.rsqrt(m2 / n + eps)
            xhat = (h.float() - mean[:, None]) * rstd[:, None]
            ctx.n = n
            ctx.save_for_backward(x, weight, xhat, rstd)
            return xhat.to(h.dtype)
        lse = _row_lse(h, group)
        if tail == "softmax":
            out = torch.exp(h.float() - lse[:, None]).to(h.dtype)
        elif tail == "log_softmax":
            out = (h.float() - lse[:, None]).to(h.dtype)
        else:
            out = lse.to(h.dtype)
        ctx.save_for_backward(x, weight, h, lse)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        gf = g.float()
        if ctx.tail == "layer_norm":
            x, weight, xhat, rstd = ctx.saved_tensors
            sg = _row_sum(gf.sum(1), ctx.group) / ctx.n
            sgx = _row_sum((gf * xhat).sum(1), ctx.group) / ctx.n
            dh = rstd[:, None] * (gf - sg[:, None] - xhat * sgx[:, None])
            return _Sharded._products(ctx, dh, x, weight)
        x, weight, h, lse = ctx.saved_tensors
        p = torch.exp(h.float() - lse[:, None])
        if ctx.tail == "softmax":
            dh = p * (gf - _row_sum((gf * p).sum(1), ctx.group)[:, None])
        elif ctx.tail == "log_softmax":
            dh = gf - p * _row_sum(gf.sum(1), ctx.group)[:, None]
        else:
            dh = gf[:, None] * p
        return _Sharded._products(ctx, dh, x, weight)

    @staticmethod
    def _products(ctx: Any, dh: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple:
        import torch.distributed as dist

        need = ctx.needs_input_grad
        dx = None
        if need[0]:
            dx = dh @ weight.float()
            dist.all_reduce(dx, group=ctx.group)
            dx = dx.to(x.dtype)
        dw = (dh.t() @ x.float()).to(weight.dtype) if need[1] else None
        db = dh.sum(0).to(weight.dtype) if ctx.has_bias and need[2] else None
        return dx, dw, db, None, None, None
