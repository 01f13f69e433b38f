"""Public fused ops: one function per model of PROBLEMS.md.

Each op validates its operands (:mod:`cupyfuse.interop`), builds or reuses the plan
(:mod:`cupyfuse.plans`), runs the GEMM (:mod:`cupyfuse.gemm`) and the fused tail from
``kernels_cu`` on the caller's stream, and returns the result in the caller's type.
CPU operands run the same plan with torch ops. All ops are forward-only.

Small and mid-size calls (see ``_small``: host-bound sizes) of 56, 55 and 98 (and of
39's module, see :class:`cupyfuse.nn.FusedGemmScaleBatchNorm`) run the generic tail program of the same math (:func:`cupyfuse.fused_linear`) through
prepared launches (:mod:`cupyfuse.prepared`): tens of microseconds of host time instead
of hundreds; there a call's cost is mostly host time.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

import torch.nn.functional as F

from . import fused, gemm, interop, plans
from .interop import Call, describe
from .runtime import get_function, launch

__all__ = [
    "matmul_maxpool_sum_scale",
    "matmul_sigmoid_sum",
    "matmul_avgpool_gelu_scale_max",
    "gemm_scale_batchnorm",
]

_THREADS = 256


def _addr(t: torch.Tensor | None) -> int:
    """Device address of ``t`` as a kernel argument (0 = NULL for None).

    Kernels take raw addresses of the very memory a CuPy view would hold: building a
    view costs microseconds of Python per operand, an address almost nothing.
    """
    return 0 if t is None else t.data_ptr()


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
    return weight.tensor if isinstance(weight, fused.PreparedWeight) else weight


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
# Small batches: the same math as a generic tail (prepared launches after the first call)
# ---------------------------------------------------------------------------------
_small_tails: dict[tuple, Any] = {}
#: False: every batch runs the op's own kernels (tests of those kernels switch this off)
GENERIC_SMALL_BATCHES = True
#: the largest weight (elements) for which a tensor-core-sized batch runs the generic program
GENERIC_ENGINE_MAX_W = 1 << 24


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


def _small(op: str, call: Call, W: torch.Tensor) -> bool:
    """Whether this call runs as the generic program (prepared launches), where a call's
    cost is mostly host time: skinny batches (55/98 only with small weights: a large one
    is faster through the op's pooled or differenced weight), and batches that
    ``prepared.engine_batch_ok`` accepts, with weights up to GENERIC_ENGINE_MAX_W elements."""
    if not GENERIC_SMALL_BATCHES or call.on_cpu or interop.poison_outputs:
        return False
    M, K = call.x.shape
    N = W.shape[0]
    if M == 0:
        return False
    if op != "56" and N * K > gemm.SKINNY_SMALL_W:
        return False
    return generic_size(M, N, K)


def generic_size(M: int, N: int, K: int) -> bool:
    """Whether a (M, K) x (N, K)^T Linear is host-bound: skinny batches, or batches that
    ``prepared.engine_batch_ok`` accepts, with weights up to GENERIC_ENGINE_MAX_W elements (the
    tensor-core engine; above, the ops' own kernels are measured and tuned)."""
    from . import prepared

    if gemm.skinny_for(M, N, K):
        return True
    return prepared.engine_batch_ok(M, K) and N * K <= GENERIC_ENGINE_MAX_W


def small_batch_call(op: str, x: Any, weight: Any, bias: Any, k: Any = 0,
                     scale: Any = 1.0, precision: str | None = None) -> Any:
    """The op through its prepared generic launches, when a call like this one made them
    (see the module doc); else None. The fused modules call it before their graphs."""
    if not GENERIC_SMALL_BATCHES or (op != "56" and (not isinstance(k, int) or isinstance(k, bool))):
        return None
    return fused.fused_linear_prepared(x, weight, bias, _small_tail(op, k, scale), precision)


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


_ALIGN = 256


class _Workspace:
    """Every temporary of one call in a single allocation (one allocator call, not six).

    ``add(nbytes, zero=...)`` reserves a 256-byte aligned slice and returns its index;
    ``alloc()`` allocates (0xFF-filled, i.e. NaN, in poison mode, see interop), zeroes the
    slices asked for with one fill (they are laid out first), and ``ptr(i)``/
    ``tensor(i, shape)`` (float32) address the slices.
    """

    def __init__(self, call: Call) -> None:
        self.call = call
        self.sizes: list[int] = []
        self.zero: list[bool] = []

    def add(self, nbytes: int, zero: bool = False) -> int:
        self.sizes.append(max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN))
        self.zero.append(zero)
        return len(self.sizes) - 1

    def alloc(self) -> None:
        order = sorted(range(len(self.sizes)), key=lambda i: not self.zero[i])
        self.offsets = [0] * len(self.sizes)
        off = 0
        zbytes = 0
        for i in order:
            self.offsets[i] = off
            off += self.sizes[i]
            if self.zero[i]:
                zbytes = off
        self.buf = self.call.empty((off,), torch.uint8)
        self.base = self.buf.data_ptr()
        if zbytes:
            self.buf[:zbytes].zero_()

    def ptr(self, i: int) -> int:
        """Device address of slice ``i`` (0, i.e. NULL, for -1: a slice not needed)."""
        return 0 if i < 0 else self.base + self.offsets[i]

    def tensor(self, i: int, shape: tuple) -> torch.Tensor:
        """Slice ``i`` as a float32 tensor of ``shape``."""
        n = math.prod(shape) * 4
        return self.buf[self.offsets[i]: self.offsets[i] + n].view(torch.float32).view(shape)


class _RowTail:
    """Sizes and launch of one row_tail.cu kernel over ``nrows`` rows of ``nwin`` windows.

    ``guard=True`` also sizes the fused row guard (the norm of each row of x).
    """

    def __init__(self, call: Call, ws: _Workspace, red: str, nwin: int, nrows: int,
                 guard: bool = False) -> None:
        target = 4 * _sm_count(call)
        nchunks = max(1, min(math.ceil(nwin / _THREADS), math.ceil(target / max(1, nrows))))
        self.wpb = math.ceil(nwin / nchunks)
        self.nchunks = math.ceil(nwin / self.wpb)
        self.nrows = nrows
        self.nwin = nwin
        self.partial = self.done = self.partial_l1 = -1
        if self.nchunks > 1:
            self.partial = ws.add(nrows * self.nchunks * (8 if red == "sum" else 4))
            self.done = ws.add(nrows * 4, zero=True)
            if guard:
                self.partial_l1 = ws.add(nrows * self.nchunks * 8)
        self.ws = ws
        self.call = call

    def launch(self, fn: str, z: int, ldz: int, bias: torch.Tensor | None, k: int,
               act_param: float, out: torch.Tensor, *, extra_col: int = -1,
               extra_bias: int = 0, add: float = 0.0, mul: float = 1.0, row_flags: int = 0,
               x: torch.Tensor | None = None, bounds: torch.Tensor | None = None,
               bounds_ptr: int = 0, limit: float = 0.0, flags: int = 0) -> None:
        ws = self.ws
        K = x.shape[1] if x is not None else 0
        launch(get_function("row_tail.cu", fn, self.call.device.index),
               self.nrows * self.nchunks, _THREADS, (z, ldz, _addr(bias), self.nwin, k, act_param, self.wpb, self.nchunks, row_flags,
                ws.ptr(self.partial), ws.ptr(self.done), extra_col, extra_bias, add, mul,
                out.data_ptr(), _addr(x), K, K, bounds_ptr or _addr(bounds), limit, flags,
                ws.ptr(self.partial_l1)))


class _Guard:
    """The direct recomputation of the rows the fused guard flags (no host sync).

    The main tail (``_RowTail.launch(..., x=..., flags=guard.flags_ptr)``) sets a flag
    per row; ``launch_recompute`` then overwrites the flagged rows of ``out`` with the
    direct result of (W, b): a SIMT GEMM into a (rows, N) buffer and the direct tail,
    whose blocks for unflagged rows return at once.
    """

    def __init__(self, call: Call, ws: _Workspace, x: torch.Tensor, W: torch.Tensor,
                 red: str, nwin: int) -> None:
        M = x.shape[0]
        self.flags = ws.add(M * 4)
        self.y = ws.add(M * W.shape[0] * 4)
        self.tail = _RowTail(call, ws, red, nwin, M)
        self.call, self.ws, self.x, self.W = call, ws, x, W

    @property
    def flags_ptr(self) -> int:
        return self.ws.ptr(self.flags)

    def launch_recompute(self, b: torch.Tensor, fn: str, k: int, act_param: float, mul: float,
                         out: torch.Tensor) -> None:
        x, W, ws = self.x, self.W, self.ws
        M, K = x.shape
        N = W.shape[0]
        launch(get_function("gemm_rows_simt.cu", "gemm_rows_simt", self.call.device.index),
               (math.ceil(N / 64), math.ceil(M / 32)), _THREADS, (x.data_ptr(), K, W.data_ptr(), K, M, N, K, self.flags_ptr, ws.ptr(self.y), N))
        self.tail.launch(fn, ws.ptr(self.y), N, b, k, act_param, out, mul=mul,
                         row_flags=self.flags_ptr)


# ---------------------------------------------------------------------------------
# 55
# ---------------------------------------------------------------------------------
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
    op = "matmul_maxpool_sum_scale"
    hit = small_batch_call("55", x, weight, bias, kernel_size, scale_factor, precision)
    if hit is not None:
        return hit
    handle, weight = weight, _unwrap(weight)
    call = _begin(op, x, weight, bias)
    W, b = _check_linear(op, call, weight, bias)
    scale = _scalar(op, "scale_factor", scale_factor)
    if _small("55", call, W):
        k = plans.pool_size(op, kernel_size)
        plans._check_pool(op, W.shape[0], k)
        return fused.fused_linear(x, handle, bias, _small_tail("55", k, scale),
                                  precision=precision)
    with call:
        plan = plans.maxpool_sum_plan(W, b, kernel_size, scale, owner=_owner(weight),
                                      deps=(weight, bias))
        M = call.x.shape[0]
        if call.on_cpu or M == 0:
            out = plans.run_maxpool_sum_cpu(call.x, plan) if M else call.empty((0,))
            return call.result(out)
        x_ = call.x
        out = call.empty((M,))
        ws = _Workspace(call)
        if plan.mode == "pairdiff":
            h = plan.nwin
            width = plan.gemm_weight.shape[0]
            zi = ws.add(M * width * 4)
            tail = _RowTail(call, ws, "sum", h, M, guard=True)
            guard = _Guard(call, ws, x_, plan.direct_weight, "sum", h)
            ws.alloc()
            z = ws.tensor(zi, (M, width))
            gemm.linear_nobias(x_, plan.gemm_weight, z, precision=precision,
                               owner=plan.gemm_weight)
            tail.launch("row_tail_abs_sum", z.data_ptr(), width, plan.tail_bias, 1, 0.0, out,
                        extra_col=h, extra_bias=plan.tail_bias.data_ptr() + 4 * h,
                        mul=0.5 * plan.scale, x=x_, bounds=plan.bounds, limit=plan.limit,
                        flags=guard.flags_ptr)
            guard.launch_recompute(plan.direct_bias, "row_tail_maxpool_sum", 2, 0.0, plan.scale,
                                   out)
        else:
            N = plan.gemm_weight.shape[0]
            zi = ws.add(M * N * 4)
            tail = _RowTail(call, ws, "sum", plan.nwin, M)
            ws.alloc()
            z = ws.tensor(zi, (M, N))
            gemm.linear_nobias(x_, plan.gemm_weight, z, precision=precision,
                               owner=_owner(weight), deps=(weight,))
            tail.launch("row_tail_maxpool_sum", z.data_ptr(), N, plan.tail_bias, plan.k, 0.0, out,
                        mul=plan.scale)
        return call.result(out)


# ---------------------------------------------------------------------------------
# 56
# ---------------------------------------------------------------------------------
def matmul_sigmoid_sum(x: Any, weight: Any, bias: Any, *, precision: str | None = None) -> Any:
    """Model 56: ``sigmoid(x @ weight.T + bias).sum(dim=1, keepdim=True)``.

    x (batch, in) float32, weight (hidden, in), bias (hidden,) or None -> (batch, 1).
    """
    op = "matmul_sigmoid_sum"
    hit = small_batch_call("56", x, weight, bias, precision=precision)
    if hit is not None:
        return hit
    handle, weight = weight, _unwrap(weight)
    call = _begin(op, x, weight, bias)
    W, b = _check_linear(op, call, weight, bias)
    if _small("56", call, W):
        return fused.fused_linear(x, handle, bias, _small_tail("56"), precision=precision)
    with call:
        plan = plans.sigmoid_sum_plan(W, b, owner=_owner(weight), deps=(weight, bias))
        M = call.x.shape[0]
        if call.on_cpu or M == 0:
            out = plans.run_sigmoid_sum_cpu(call.x, plan) if M else call.empty((0, 1))
            return call.result(out)
        N = plan.gemm_weight.shape[0]
        out = call.empty((M, 1))
        ws = _Workspace(call)
        zi = ws.add(M * N * 4)
        # Guard with bounds (0, 0) and limit inf: flags exactly the rows of x holding
        # NaN/inf (0 * inf = NaN fails the test), which 3xTF32's operand split would turn
        # into NaN where PyTorch may give a number (sigmoid(-inf) = 0).
        zero_bounds = ws.add(8, zero=True)
        tail = _RowTail(call, ws, "sum", N, M, guard=True)
        guard = _Guard(call, ws, call.x, plan.gemm_weight, "sum", N)
        ws.alloc()
        z = ws.tensor(zi, (M, N))
        gemm.linear_nobias(call.x, plan.gemm_weight, z, precision=precision,
                           owner=_owner(weight), deps=(weight,))
        tail.launch("row_tail_sigmoid_sum", z.data_ptr(), N, plan.tail_bias, 1, 0.0, out,
                    x=call.x, bounds_ptr=ws.ptr(zero_bounds), limit=float("inf"),
                    flags=guard.flags_ptr)
        guard.launch_recompute(plan.tail_bias, "row_tail_sigmoid_sum", 1, 0.0, 1.0, out)
        return call.result(out)


# ---------------------------------------------------------------------------------
# 98
# ---------------------------------------------------------------------------------
def matmul_avgpool_gelu_scale_max(x: Any, weight: Any, bias: Any, pool_kernel_size: int,
                                  scale_factor: float, *, precision: str | None = None) -> Any:
    """Model 98: ``max(gelu(AvgPool1d(k)(x @ weight.T + bias)) * scale_factor, dim=1)``.

    x (batch, in) float32, weight (out, in), bias (out,) or None -> (batch,).
    GELU is the exact erf form; NaN propagates through the max like ``torch.max``.
    """
    op = "matmul_avgpool_gelu_scale_max"
    hit = small_batch_call("98", x, weight, bias, pool_kernel_size, scale_factor, precision)
    if hit is not None:
        return hit
    handle, weight = weight, _unwrap(weight)
    call = _begin(op, x, weight, bias)
    W, b = _check_linear(op, call, weight, bias)
    scale = _scalar(op, "scale_factor", scale_factor)
    if _small("98", call, W):
        k = plans.pool_size(op, pool_kernel_size)
        plans._check_pool(op, W.shape[0], k)
        return fused.fused_linear(x, handle, bias, _small_tail("98", k, scale),
                                  precision=precision)
    with call:
        plan = plans.avgpool_gelu_max_plan(W, b, pool_kernel_size, scale, owner=_owner(weight),
                                           deps=(weight, bias))
        M = call.x.shape[0]
        if call.on_cpu or M == 0:
            out = plans.run_avgpool_gelu_max_cpu(call.x, plan) if M else call.empty((0,))
            return call.result(out)
        nwin = plan.nwin
        out = call.empty((M,))
        ws = _Workspace(call)
        zi = ws.add(M * nwin * 4)
        tail = _RowTail(call, ws, "max", nwin, M, guard=True)
        guard = _Guard(call, ws, call.x, plan.direct_weight, "max", nwin)
        ws.alloc()
        z = ws.tensor(zi, (M, nwin))
        gemm.linear_nobias(call.x, plan.gemm_weight, z, precision=precision,
                           owner=plan.gemm_weight)
        tail.launch("row_tail_avgpool_gelu_max", z.data_ptr(), nwin, plan.tail_bias, 1,
                    plan.scale, out, x=call.x, bounds=plan.bounds, limit=plan.limit,
                    flags=guard.flags_ptr)
        guard.launch_recompute(plan.direct_bias, "row_tail_avgpool_gelu_max", plan.k, plan.scale,
                               1.0, out)
        return call.result(out)


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
        ws = _Workspace(call)
        mean_i = ws.add(N * 4)
        a_i = ws.add(N * 4)
        ncb = math.ceil(N / 32)
        nchunks = 1
        if use_batch_stats:
            nchunks = max(1, min(math.ceil(8 * _sm_count(call) / ncb), math.ceil(M / 64)))
            rows_per_chunk = math.ceil(M / nchunks)
            nchunks = math.ceil(M / rows_per_chunk)
            psum_i = ws.add(nchunks * N * 8)
            psq_i = ws.add(nchunks * N * 8)
        ws.alloc()
        # z, normalised in place below
        gemm.linear_nobias(call.x, plan.gemm_weight, out, precision=precision,
                           owner=_owner(weight), deps=(weight,))
        psum = psq = 0
        if use_batch_stats:
            psum, psq = ws.ptr(psum_i), ws.ptr(psq_i)
            launch(get_function("batchnorm.cu", "bn_stats_partial", dev), (ncb, nchunks), _THREADS,
                   (out.data_ptr(), N, M, N, plan.p.data_ptr(), plan.q.data_ptr(),
                                 rows_per_chunk, psum, psq))
        launch(get_function("batchnorm.cu", "bn_finalize", dev), math.ceil(N / 128), 128,
               (psum, psq, nchunks, out.data_ptr(), M, N, plan.p.data_ptr(), plan.q.data_ptr(),
                _addr(p["bn_weight"]), eps, 1 if use_batch_stats else 0, momentum,
                _addr(p["running_mean"]), _addr(p["running_var"]), ws.ptr(mean_i), ws.ptr(a_i)))
        total4 = max(1, (M * N) // 4)
        grid = max(1, min(math.ceil(total4 / _THREADS), 16 * _sm_count(call)))
        launch(get_function("batchnorm.cu", "bn_apply", dev), grid, _THREADS, (out.data_ptr(), N, M, N, plan.p.data_ptr(), plan.q.data_ptr(), ws.ptr(mean_i),
                ws.ptr(a_i), _addr(p["bn_bias"]), out.data_ptr(), N))
        return call.result(out)
