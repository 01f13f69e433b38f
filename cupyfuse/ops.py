"""Public fused ops: one function per model of PROBLEMS.md.

Each op validates its operands (:mod:`cupyfuse.interop`), builds or reuses the plan
(:mod:`cupyfuse.plans`), runs the GEMM (:mod:`cupyfuse.gemm`) and the fused tail from
``kernels_cu`` on the caller's stream, and returns the result in the caller's type.
CPU operands run the same plan with torch ops. All ops are forward-only.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from . import gemm, plans
from .interop import Call, describe
from .runtime import get_function, launch

__all__ = [
    "matmul_maxpool_sum_scale",
    "matmul_sigmoid_sum",
    "matmul_avgpool_gelu_scale_max",
    "gemm_scale_batchnorm",
]

_NULL = np.uint64(0)
_THREADS = 256


def _ptr(t: torch.Tensor | None) -> np.uint64:
    """Device pointer of ``t`` as a kernel argument (NULL for None).

    Kernels take raw pointers of the very same memory the CuPy views would hold: a
    view costs microseconds of Python per operand, a pointer almost nothing.
    """
    return _NULL if t is None else np.uint64(t.data_ptr())


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
    b = call.params["bias"]
    K = call.x.shape[1]
    if W.dim() != 2 or W.shape[1] != K or W.shape[0] < 1:
        raise ValueError(f"{op}: weight must be (out_features, {K}) float32 on {call.device}, "
                         f"got {describe(weight)}")
    if b is not None and tuple(b.shape) != (W.shape[0],):
        raise ValueError(f"{op}: bias must be ({W.shape[0]},) float32 on {call.device}, "
                         f"got {describe(bias)}")
    return W, b


def _owner(obj: Any) -> torch.Tensor | None:
    """The user's parameter object when it can be cached on (torch tensors only)."""
    return obj if isinstance(obj, torch.Tensor) else None


def _begin(op: str, x: Any, weight: Any, bias: Any, extra: dict[str, Any] | None = None) -> Call:
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
    return Call.begin(op, x, params, x_shape_msg=msg, in_features=K)


# ---------------------------------------------------------------------------------
# Launch helpers shared by the row tails
# ---------------------------------------------------------------------------------
_sm_counts: dict[int, int] = {}


def _sm_count(call: Call) -> int:
    n = _sm_counts.get(call.device.index)
    if n is None:
        n = torch.cuda.get_device_properties(call.device).multi_processor_count
        _sm_counts[call.device.index] = n
    return n


def _row_tail(call: Call, partial_fn: str, finalize_fn: str, red: str, z: torch.Tensor, ldz: int,
              bias: torch.Tensor | None, nwin: int, k: int, act_param: float, out: torch.Tensor,
              nslots: int, *, extra_col: int = -1, extra_bias: torch.Tensor | None = None,
              add: float = 0.0, mul: float = 1.0, row_index: torch.Tensor | None = None,
              row_count: torch.Tensor | None = None) -> None:
    """Pool/activate/reduce each row of ``z`` (row_tail.cu) into ``out[row]``."""
    dev = call.device.index
    target = 4 * _sm_count(call)
    nchunks = max(1, min(math.ceil(nwin / _THREADS), math.ceil(target / max(1, nslots))))
    wpb = math.ceil(nwin / nchunks)
    nchunks = math.ceil(nwin / wpb)
    partial = call.empty((nslots, nchunks), torch.float64 if red == "sum" else torch.float32)
    launch(get_function("row_tail.cu", partial_fn, dev), nslots * nchunks, _THREADS,
           (_ptr(z), np.int64(ldz), _ptr(bias), np.int32(nwin), np.int32(k),
            np.float32(act_param), np.int32(wpb), np.int32(nchunks), _ptr(row_count),
            _ptr(partial)))
    launch(get_function("row_tail.cu", finalize_fn, dev), math.ceil(nslots / 128), 128,
           (_ptr(partial), np.int32(nchunks), np.int32(nslots), _ptr(row_index),
            _ptr(row_count), _ptr(z), np.int64(ldz), np.int32(extra_col), _ptr(extra_bias),
            np.float64(add), np.float64(mul), _ptr(out)))


def _guard(call: Call, x: torch.Tensor, bounds: torch.Tensor, limit: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flag the rows a shortcut may not take (row_guard.cu): (row_index, device count).

    Launched before the GEMM, while ``x`` is likely still in L2 from its producer.
    """
    M, K = x.shape
    count = call.zeros((1,), torch.int32)
    idx = call.empty((M,), torch.int32)
    launch(get_function("row_guard.cu", "row_guard", call.device.index), M, _THREADS,
           (_ptr(x), np.int64(K), np.int32(K), _ptr(bounds), np.float32(limit), _ptr(idx),
            _ptr(count)))
    return idx, count


def _recompute_rows(call: Call, x: torch.Tensor, guard: tuple[torch.Tensor, torch.Tensor],
                    W: torch.Tensor, b: torch.Tensor, partial_fn: str, finalize_fn: str, red: str,
                    k: int, nwin: int, act_param: float, mul: float, out: torch.Tensor) -> None:
    """Overwrite ``out`` for the flagged rows with the direct computation from (W, b).

    No host synchronisation: the count stays on the device and idle blocks return.
    Must run after the shortcut's own tail has written ``out``.
    """
    idx, count = guard
    M, K = x.shape
    N = W.shape[0]
    y = call.empty((M, N))
    grid_y = max(1, min(math.ceil(M / 32), 4))
    launch(get_function("gemm_rows_simt.cu", "gemm_rows_simt", call.device.index),
           (math.ceil(N / 64), grid_y), _THREADS,
           (_ptr(x), np.int64(K), _ptr(W), np.int64(K), np.int32(N), np.int32(K), _ptr(idx),
            _ptr(count), _ptr(y), np.int64(N)))
    _row_tail(call, partial_fn, finalize_fn, red, y, N, b, nwin, k, act_param, out, M, mul=mul,
              row_index=idx, row_count=count)


# ---------------------------------------------------------------------------------
# 55
# ---------------------------------------------------------------------------------
def matmul_maxpool_sum_scale(x: Any, weight: Any, bias: Any, kernel_size: int,
                             scale_factor: float) -> Any:
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
    op = "matmul_maxpool_sum_scale"
    call = _begin(op, x, weight, bias)
    W, b = _check_linear(op, call, weight, bias)
    scale = _scalar(op, "scale_factor", scale_factor)
    with call:
        plan = plans.maxpool_sum_plan(W, b, kernel_size, scale, owner=_owner(weight),
                                      deps=(weight, bias))
        M = call.x.shape[0]
        if call.on_cpu or M == 0:
            out = plans.run_maxpool_sum_cpu(call.x, plan) if M else call.empty((0,))
            return call.result(out)
        out = call.empty((M,))
        x_ = call.x
        if plan.mode == "pairdiff":
            h = plan.nwin
            width = plan.gemm_weight.shape[0]
            guard = _guard(call, x_, plan.bounds, plan.limit)
            z = call.empty((M, width))
            gemm.linear_nobias(x_, plan.gemm_weight, z)
            _row_tail(call, "row_tail_abs_sum_partial", "row_tail_finalize_sum", "sum", z, width,
                      plan.tail_bias, h, 1, 0.0, out, M, extra_col=h,
                      extra_bias=plan.tail_bias[h:], mul=0.5 * plan.scale)
            _recompute_rows(call, x_, guard, plan.direct_weight, plan.direct_bias,
                            "row_tail_maxpool_sum_partial", "row_tail_finalize_sum", "sum", 2, h,
                            0.0, plan.scale, out)
        else:
            N = plan.gemm_weight.shape[0]
            z = call.empty((M, N))
            gemm.linear_nobias(x_, plan.gemm_weight, z)
            _row_tail(call, "row_tail_maxpool_sum_partial", "row_tail_finalize_sum", "sum", z, N,
                      plan.tail_bias, plan.nwin, plan.k, 0.0, out, M, mul=plan.scale)
        return call.result(out)


# ---------------------------------------------------------------------------------
# 56
# ---------------------------------------------------------------------------------
def matmul_sigmoid_sum(x: Any, weight: Any, bias: Any) -> Any:
    """Model 56: ``sigmoid(x @ weight.T + bias).sum(dim=1, keepdim=True)``.

    x (batch, in) float32, weight (hidden, in), bias (hidden,) or None -> (batch, 1).
    """
    op = "matmul_sigmoid_sum"
    call = _begin(op, x, weight, bias)
    W, b = _check_linear(op, call, weight, bias)
    with call:
        plan = plans.sigmoid_sum_plan(W, b, owner=_owner(weight), deps=(weight, bias))
        M = call.x.shape[0]
        if call.on_cpu or M == 0:
            out = plans.run_sigmoid_sum_cpu(call.x, plan) if M else call.empty((0, 1))
            return call.result(out)
        N = plan.gemm_weight.shape[0]
        z = call.empty((M, N))
        gemm.linear_nobias(call.x, plan.gemm_weight, z)
        out = call.empty((M, 1))
        _row_tail(call, "row_tail_sigmoid_sum_partial", "row_tail_finalize_sum", "sum", z, N,
                  plan.tail_bias, N, 1, 0.0, out, M)
        return call.result(out)


# ---------------------------------------------------------------------------------
# 98
# ---------------------------------------------------------------------------------
def matmul_avgpool_gelu_scale_max(x: Any, weight: Any, bias: Any, pool_kernel_size: int,
                                  scale_factor: float) -> Any:
    """Model 98: ``max(gelu(AvgPool1d(k)(x @ weight.T + bias)) * scale_factor, dim=1)``.

    x (batch, in) float32, weight (out, in), bias (out,) or None -> (batch,).
    GELU is the exact erf form; NaN propagates through the max like ``torch.max``.
    """
    op = "matmul_avgpool_gelu_scale_max"
    call = _begin(op, x, weight, bias)
    W, b = _check_linear(op, call, weight, bias)
    scale = _scalar(op, "scale_factor", scale_factor)
    with call:
        plan = plans.avgpool_gelu_max_plan(W, b, pool_kernel_size, scale, owner=_owner(weight),
                                           deps=(weight, bias))
        M = call.x.shape[0]
        if call.on_cpu or M == 0:
            out = plans.run_avgpool_gelu_max_cpu(call.x, plan) if M else call.empty((0,))
            return call.result(out)
        nwin = plan.nwin
        guard = _guard(call, call.x, plan.bounds, plan.limit)
        z = call.empty((M, nwin))
        gemm.linear_nobias(call.x, plan.gemm_weight, z)
        out = call.empty((M,))
        _row_tail(call, "row_tail_avgpool_gelu_max_partial", "row_tail_finalize_max", "max", z,
                  nwin, plan.tail_bias, nwin, 1, plan.scale, out, M)
        _recompute_rows(call, call.x, guard, plan.direct_weight, plan.direct_bias,
                        "row_tail_avgpool_gelu_max_partial", "row_tail_finalize_max", "max",
                        plan.k, nwin, plan.scale, 1.0, out)
        return call.result(out)


# ---------------------------------------------------------------------------------
# 39
# ---------------------------------------------------------------------------------
def gemm_scale_batchnorm(x: Any, weight: Any, bias: Any, scale: Any, running_mean: Any,
                         running_var: Any, bn_weight: Any = None, bn_bias: Any = None,
                         training: bool = True, momentum: float = 0.1,
                         eps: float = 1e-5) -> Any:
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
        if t.numel() != N or (name != "scale" and t.dim() != 1):
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
    with call:
        plan = plans.batchnorm_plan(W, b, p["scale"], owner=_owner(weight),
                                    deps=(weight, bias, scale))
        if call.on_cpu or M == 0:
            if M == 0:
                return call.result(call.empty((0, N)))
            out = plans.run_batchnorm_cpu(call.x, plan, p["running_mean"], p["running_var"],
                                          p["bn_weight"], p["bn_bias"], use_batch_stats,
                                          momentum, eps)
            return call.result(out)
        dev = call.device.index
        out = call.empty((M, N))
        gemm.linear_nobias(call.x, plan.gemm_weight, out)  # z, normalised in place below
        mean = call.empty((N,))
        a = call.empty((N,))
        ncb = math.ceil(N / 32)
        nchunks = 1
        if use_batch_stats:
            nchunks = max(1, min(math.ceil(8 * _sm_count(call) / ncb), math.ceil(M / 64)))
            rows_per_chunk = math.ceil(M / nchunks)
            nchunks = math.ceil(M / rows_per_chunk)
            psum = call.empty((nchunks, N), torch.float64)
            psq = call.empty((nchunks, N), torch.float64)
            launch(get_function("batchnorm.cu", "bn_stats_partial", dev), (ncb, nchunks), _THREADS,
                   (_ptr(out), np.int64(N), np.int32(M), np.int32(N), _ptr(plan.p),
                    _ptr(plan.q), np.int32(rows_per_chunk), _ptr(psum), _ptr(psq)))
        else:
            psum = psq = None
        launch(get_function("batchnorm.cu", "bn_finalize", dev), math.ceil(N / 128), 128,
               (_ptr(psum), _ptr(psq), np.int32(nchunks), _ptr(out), np.int32(M), np.int32(N),
                _ptr(plan.p), _ptr(plan.q), _ptr(p["bn_weight"]), np.float32(eps),
                np.int32(1 if use_batch_stats else 0), np.float32(momentum),
                _ptr(p["running_mean"]), _ptr(p["running_var"]), _ptr(mean), _ptr(a)))
        total4 = max(1, (M * N) // 4)
        grid = max(1, min(math.ceil(total4 / _THREADS), 16 * _sm_count(call)))
        launch(get_function("batchnorm.cu", "bn_apply", dev), grid, _THREADS,
               (_ptr(out), np.int64(N), np.int32(M), np.int32(N), _ptr(plan.p),
                _ptr(plan.q), _ptr(mean), _ptr(a), _ptr(p["bn_bias"]),
                _ptr(out), np.int64(N)))
        return call.result(out)
