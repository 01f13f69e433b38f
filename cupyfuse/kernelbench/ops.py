"""Public fused ops: one function per model of PROBLEMS.md.

55, 56 and 98 are one-line instances of :func:`cupyfuse.fused_linear`: the op validates
its operands (:mod:`cupyfuse.interop`; the messages name the op) and runs the model's tail
as a generic tail program, whose exact algebra (pair differences for 55's window of 2,
the average-pooling fold for 98) comes from :mod:`cupyfuse.ir.rewrite`, with prepared
launches (:mod:`cupyfuse.backend.prepared`) for repeated calls. Their hand-built kernels
(``row_tail.cu``, ``gemm_rows_simt.cu``) measured no faster and left the tree (H100,
2026-11-23: 55 1.197 vs 1.199 ms, 56 2.333 vs 2.345, 98 0.156 vs 0.156 at KernelBench
sizes; the generic 0.88-0.97x the hand-built time at 4096-16384 rows; docs/engine.md).

39 (:func:`gemm_scale_batchnorm`, BatchNorm updating the running statistics the caller
passes) is a program built with the same steps as the capture of ``nn.BatchNorm1d``
(:func:`_bn_program`), run like every other tail program; its module
(:class:`cupyfuse.kernelbench.modules.FusedGemmScaleBatchNorm`) runs the generic program of the original's
forward. CPU operands run the same programs with torch ops. 55, 56 and 98 are differentiable
(fused_linear's autograd, :mod:`cupyfuse.autograd`); 39 is forward-only.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import operator

import torch

import torch.nn.functional as F

from cupyfuse.backend import execute
from cupyfuse import runner
from cupyfuse import config
from cupyfuse import api as fused, caches
from cupyfuse.interop import PreparedWeight, Call, describe

__all__ = [
    "matmul_maxpool_sum_scale",
    "matmul_sigmoid_sum",
    "matmul_avgpool_gelu_scale_max",
    "gemm_scale_batchnorm",
]

def _scalar(op: str, name: str, v: Any) -> float:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(f"{op}: {name} must be a number, got {describe(v)}")
        return float(v.item())
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
        raise TypeError(f"{op}: {name} must be a number, got {type(v).__name__}")
    return float(v)


def _check_linear(op: str, call: Call, weight: Any, bias: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    W = call.params["weight"]
    if W is None:
        raise TypeError(f"{op}: weight must be a (out_features, {call.x.shape[1]}) float32 "
                        f"tensor or array, got None")
    b = call.params["bias"]
    K = call.x.shape[1]
    if W.dim() != 2 or W.shape[1] != K or W.shape[0] < 1:
        raise ValueError(f"{op}: weight must be (out_features, {K}) float32 on {call.device}, "
                         f"got {describe(weight)}")
    if b is not None and tuple(b.shape) != (W.shape[0],):
        raise ValueError(f"{op}: bias must be ({W.shape[0]},) float32 on {call.device}, "
                         f"got {describe(bias)}")
    return W, b


def _unwrap(weight: Any) -> Any:
    """A :class:`cupyfuse.PreparedWeight` as its torch view: a stable object, so the op's
    derived weights are cached on it until ``refresh()``."""
    return weight.tensor if isinstance(weight, PreparedWeight) else weight


def _owner(obj: Any) -> torch.Tensor | None:
    """The user's parameter object when it can be cached on (torch tensors only)."""
    return obj if isinstance(obj, torch.Tensor) else None


def _begin(op: str, x: Any, weight: Any, bias: Any, extra: dict[str, Any] | None = None,
           depth: int = 0, forward_only: bool = True) -> Call:
    """Validate the operands (``depth``: frames between the op and this call;
    ``forward_only``: see Call.begin)."""
    W = weight
    K = None
    if isinstance(W, torch.Tensor) and W.dim() == 2:
        K = W.shape[1]
    elif hasattr(W, "shape") and len(W.shape) == 2:
        K = int(W.shape[1])
    params = {"weight": weight, "bias": bias}
    if extra:
        params.update(extra)
    msg = f"(batch, {K})" if K is not None else "(batch, in_features)"
    return Call.begin(op, x, params, x_shape_msg=msg, in_features=K, stacklevel=4 + depth,
                      forward_only=forward_only)


# ---------------------------------------------------------------------------------
# Small batches: the same math as a generic tail (prepared launches after the first call)
# ---------------------------------------------------------------------------------
_small_tails: dict[tuple, Any] = caches.register("named ops' tails", {})


def _small_tail(op: str, k: int = 0, scale: float = 1.0) -> Any:
    """The op's math as a tail function of h = x @ W.T + b (one object per (op, k, scale),
    so the traced program and the prepared launches are found again)."""
    key = (op, k, scale)
    fn = _small_tails.get(key)
    if fn is None:
        if op == "56":
            def fn(h: torch.Tensor) -> torch.Tensor:
                return torch.sigmoid(h).sum(dim=1, keepdim=True)
        elif op == "55":
            def fn(h: torch.Tensor) -> torch.Tensor:
                return F.max_pool1d(h.unsqueeze(1), k).squeeze(1).sum(dim=1) * scale
        else:
            def fn(h: torch.Tensor) -> torch.Tensor:
                return (F.gelu(F.avg_pool1d(h.unsqueeze(1), k).squeeze(1)) * scale).max(dim=1)[0]
        if len(_small_tails) >= 64:   # many distinct scale factors: keep the newest
            _small_tails.pop(next(iter(_small_tails)))
        _small_tails[key] = fn
    return fn


def small_batch_call(op: str, x: Any, weight: Any, bias: Any, k: Any = 0,
                     scale: Any = 1.0, precision: str | None = None) -> Any:
    """The op through its prepared generic launches, when a call like this one made them
    (see the module doc); else None."""
    if not config.GENERIC_SMALL_BATCHES or (op != "56" and (not isinstance(k, int) or isinstance(k, bool))):
        return None
    return runner.fused_linear_prepared(x, weight, bias, _small_tail(op, k, scale), precision)


# ---------------------------------------------------------------------------------
# 55, 56, 98: the generic program of the model's tail (cupyfuse.fused_linear)
# ---------------------------------------------------------------------------------
def _generic(op: str, key: str, x: Any, weight: Any, bias: Any, k: Any, scale: Any,
             precision: str | None) -> Any:
    """Validate like the op, then run ``fused_linear`` with the op's tail (one function
    object per (op, k, scale): its traced program and prepared launches are found again).
    The rewrites of :mod:`cupyfuse.ir.rewrite` give the exact algebra: pair differences (55,
    window 2), the average-pooling fold (98), each with its guard on the device."""
    handle, w = weight, _unwrap(weight)
    call = _begin(op, x, w, bias, depth=1, forward_only=False)   # (fused_linear's autograd)
    W, _ = _check_linear(op, call, w, bias)
    if key != "56":
        k = pool_size(op, k)
        _check_pool(op, W.shape[0], k)
        scale = _scalar(op, "scale_factor", scale)
    return fused.fused_linear(x, handle, bias, _small_tail(key, k, scale), precision=precision)


def matmul_maxpool_sum_scale(x: Any, weight: Any, bias: Any, kernel_size: int,
                             scale_factor: float, *, precision: str | None = None) -> Any:
    """Model 55: ``sum(MaxPool1d(kernel_size)(x @ weight.T + bias)) * scale_factor``.

    Args:
        x: (batch, in_features) float32.
        weight: (out_features, in_features) float32; bias: (out_features,) float32 or None.
        kernel_size: pooling window (stride = kernel_size; a tail shorter than a window
            is dropped, like ``nn.MaxPool1d``).
        scale_factor: number multiplied into the result.
    Returns:
        (batch,) float32 in the caller's type (torch, CuPy or NumPy).
    """
    hit = small_batch_call("55", x, weight, bias, kernel_size, scale_factor, precision)
    if hit is not None:
        return hit
    return _generic("matmul_maxpool_sum_scale", "55", x, weight, bias, kernel_size,
                    scale_factor, precision)


def matmul_sigmoid_sum(x: Any, weight: Any, bias: Any, *, precision: str | None = None) -> Any:
    """Model 56: ``sigmoid(x @ weight.T + bias).sum(dim=1, keepdim=True)``.

    x (batch, in) float32, weight (hidden, in), bias (hidden,) or None -> (batch, 1).
    """
    hit = small_batch_call("56", x, weight, bias, precision=precision)
    if hit is not None:
        return hit
    return _generic("matmul_sigmoid_sum", "56", x, weight, bias, 0, 1.0, precision)


def matmul_avgpool_gelu_scale_max(x: Any, weight: Any, bias: Any, pool_kernel_size: int,
                                  scale_factor: float, *, precision: str | None = None) -> Any:
    """Model 98: ``max(gelu(AvgPool1d(k)(x @ weight.T + bias)) * scale_factor, dim=1)``.

    x (batch, in) float32, weight (out, in), bias (out,) or None -> (batch,).
    GELU is the exact erf form; NaN propagates through the max like ``torch.max``.
    """
    hit = small_batch_call("98", x, weight, bias, pool_kernel_size, scale_factor, precision)
    if hit is not None:
        return hit
    return _generic("matmul_avgpool_gelu_scale_max", "98", x, weight, bias, pool_kernel_size,
                    scale_factor, precision)


# ---------------------------------------------------------------------------------
# 39
# ---------------------------------------------------------------------------------
def gemm_scale_batchnorm(x: Any, weight: Any, bias: Any, scale: Any, running_mean: Any,
                         running_var: Any, bn_weight: Any = None, bn_bias: Any = None,
                         training: bool = True, momentum: float = 0.1,
                         eps: float = 1e-5, *, precision: str | None = None) -> Any:
    """Model 39: ``batch_norm((x @ weight.T + bias) * scale, ...)`` like ``F.batch_norm``.

    Args:
        x: (batch, in) float32; weight (out, in); bias (out,) or None; scale (out,).
        running_mean, running_var: (out,) float32 buffers or None. In training mode they
            are updated in place (momentum, unbiased variance) when given.
        bn_weight, bn_bias: BatchNorm affine parameters (out,) or None.
        training: batch statistics (True) or running statistics (False; needs the buffers).
    Returns:
        (batch, out) float32 in the caller's type.
    """
    op = "gemm_scale_batchnorm"
    weight = _unwrap(weight)   # a PreparedWeight: its stable torch view keys the split
    extra = {"scale": scale, "running_mean": running_mean, "running_var": running_var,
             "bn_weight": bn_weight, "bn_bias": bn_bias}
    call = _begin(op, x, weight, bias, extra)
    W, b = _check_linear(op, call, weight, bias)
    N = W.shape[0]
    p = call.params
    for name in ("scale", "running_mean", "running_var", "bn_weight", "bn_bias"):
        t = p[name]
        if t is None:
            continue
        if (t.numel() not in ((1, N) if name == "scale" else (N,))
                or (name != "scale" and t.dim() != 1)):
            raise ValueError(f"{op}: {name} must be ({N},) float32 on {call.device}, "
                             f"got {describe(extra[name])}")
    if p["scale"] is None:
        raise ValueError(f"{op}: scale must be ({N},) float32 on {call.device}, got None")
    if (p["running_mean"] is None) != (p["running_var"] is None):
        raise ValueError(f"{op}: give both running_mean and running_var, or neither")
    for name in ("running_mean", "running_var"):
        t = p[name]
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (it is updated in place)")
    use_batch_stats = bool(training) or p["running_mean"] is None
    M = call.x.shape[0]
    if use_batch_stats and M == 1:
        raise ValueError("Expected more than 1 value per channel when training, "
                         f"got input size {torch.Size([1, N])}")
    momentum = _scalar(op, "momentum", momentum)
    eps = _scalar(op, "eps", eps)
    # PyTorch's own checks and messages (torch >= 2.12); older torch accepted these eps
    # and produced NaN/inf.
    if use_batch_stats and not eps > 0:
        raise ValueError(f"batch_norm eps must be positive during training, but got {eps}")
    if not eps >= 0:
        raise ValueError(f"batch_norm eps must be non-negative, but got {eps}")
    scale_t = p["scale"].reshape(-1)
    running = p["running_mean"] is not None
    prog = _bn_program(call.x.shape[1], N, b is not None, scale_t.numel() == 1,
                       p["bn_weight"] is not None, p["bn_bias"] is not None, use_batch_stats,
                       running, momentum, eps)
    given = {"__weight__": W, "__bias__": b, "scale": scale_t if scale_t.numel() == N
             else scale_t.reshape(()), "running_mean": p["running_mean"],
             "running_var": p["running_var"], "bn_weight": p["bn_weight"],
             "bn_bias": p["bn_bias"], None: None}
    sources = [given[s] for s in prog.sources]
    # the caller's own objects key the derived weights (the engine's split of the weight)
    mine = {"__weight__": _owner(weight)}
    owners = [mine.get(s, t) for s, t in zip(prog.sources, sources)]
    with call:
        if M == 0:
            return call.result(call.empty((0, N)))
        if call.on_cpu:
            with torch.no_grad():
                return call.result(runner.run_cpu(prog, [call.x], sources, owners=owners))
        return call.result(execute.run_gpu(prog, [call.x], sources, precision, owners=owners))


_bn_programs: dict[tuple, Any] = caches.register("named ops' programs", {})


def _bn_program(K: int, N: int, has_bias: bool, scalar_scale: bool, has_w: bool, has_b: bool,
                batch_stats: bool, running: bool, momentum: float, eps: float) -> Any:
    """39's tail as a program, built with the same Builder steps the capture of
    ``nn.BatchNorm1d`` uses: ``(x W^T + b) * scale``, then BatchNorm with batch statistics
    (updating the running buffers the caller gives) or running statistics, then the
    affine. Sources are placeholder names the call resolves (one program per structure)."""
    from cupyfuse.ir.program import BATCH, Builder, Program
    from cupyfuse.ir import rewrite

    key = (K, N, has_bias, scalar_scale, has_w, has_b, batch_stats, running, momentum, eps)
    prog = _bn_programs.get(key)
    if prog is not None:
        return prog
    bld = Builder(Program(n_inputs=1))
    h = bld.gemm(bld.input(0, (BATCH, K)), "__weight__", N, False)
    if has_bias:
        h = bld.map("add", h, bld.param("__bias__", (N,)))
    h = bld.map("mul", h, bld.param("scale", () if scalar_scale else (N,)))
    if batch_stats:
        h = bld.batchnorm_train(h, eps, momentum,
                                ("running_mean", "running_var", None) if running else None)
    else:
        h = bld.batchnorm_eval(h, "running_mean", "running_var", eps)
    bld.p.out = bld.affine(h, "bn_weight" if has_w else None, "bn_bias" if has_b else None, N)
    prog = rewrite.rewrite(bld.p)
    if len(_bn_programs) >= 64:   # many distinct eps/momentum values: keep the newest
        _bn_programs.pop(next(iter(_bn_programs)))
    _bn_programs[key] = prog
    return prog


def pool_size(op: str, k: Any) -> int:
    """``k`` as a plain int: accepts ints, NumPy ints and 1-tuples like the pool modules."""
    if isinstance(k, (tuple, list)) and len(k) == 1:
        k = k[0]
    try:
        if isinstance(k, bool):
            raise TypeError
        k = operator.index(k)
    except TypeError:
        raise ValueError(f"{op}: kernel_size must be a positive int, got {k!r}") from None
    if k < 1:
        raise ValueError(f"{op}: kernel_size must be a positive int, got {k!r}")
    return k


def _check_pool(op: str, out_features: int, k: int) -> int:
    if out_features < k:
        raise ValueError(f"{op}: kernel_size {k} is larger than out_features {out_features}: "
                         f"the pooled output would be empty (PyTorch raises here too)")
    return out_features // k
