"""Plans: the exact algebra behind each fused model, and its CPU execution.

A plan turns a model's parameters into what the kernels consume ("derived weights")
plus the scalars of the tail. Every rule here is an identity of real arithmetic that
holds for *every* input, not only for ``torch.rand``; where float32 could break it
(NaN, infinities, overflow) the plan keeps a guard and a direct path:

* **AvgPool fold (98)** -- AvgPool(k) after a Linear is a Linear whose weight rows and
  bias are averaged in groups of k (the tail shorter than k is dropped, like
  ``AvgPool1d``). The GEMM shrinks k-fold.
* **Pair-difference (55, kernel_size 2)** -- ``max(a, b) = ((a + b) + |a - b|) / 2``, so
  ``sum_j max(y_2j, y_2j+1) = (x . s + sum(b) + sum_j |x . d_j + e_j|) / 2`` with
  ``d_j = W_2j - W_2j+1``, ``e_j = b_2j - b_2j+1`` and ``s`` the sum of the paired rows:
  one GEMM on half the rows (``s`` rides along as one extra row). Other kernel sizes
  take the direct path (full GEMM, then max over each window).
* **Row guard (55, 98)** -- both shortcuts are exact up to rounding only while nothing
  overflows and ``x`` holds no NaN/inf. ``|y_n| <= ||x_r||_1 max|W| + max|b|`` bounds
  every Linear output of row r; rows whose bound exceeds a limit (chosen so every
  intermediate of either path stays finite), or is NaN/inf, are recomputed directly
  from the original weights. NaN placement then matches PyTorch row by row. On the GPU
  this is decided on the device (no synchronisation, CUDA-graph capturable).
* **Scale (39)** -- ``(x W^T + b) * s`` is applied to the GEMM output ``z = x W^T`` per
  column as ``(z + q) * p`` with ``q = b``, ``p = s`` -- PyTorch's own order, so that
  infinities and overflow come out as in PyTorch (folding it as ``z * s + b * s`` was
  exact in real arithmetic but not at ``s = inf`` or when ``b * s`` overflows) -- in
  the same pass as BatchNorm. A one-element scale broadcasts.
* **BatchNorm (39)** -- eval mode is a per-column affine ``(y - running_mean) * a + beta``
  with ``a = gamma / sqrt(running_var + eps)``: together with the scale fold, one affine
  of the GEMM output (the Linear and BatchNorm folded together). Training mode uses
  the batch mean and biased variance of ``y`` (computed in double with a per-column
  shift, so large offsets keep their precision); running_mean/running_var are updated
  with ``momentum`` and the unbiased variance.

Derived weights are a cache of the parameters: they are keyed on each parameter's
identity, storage pointer and autograd version counter, so any in-place edit
(``with torch.no_grad(): w.mul_(2)``), assignment or ``load_state_dict`` rebuilds them,
and they are freed with the parameter. Writes through ``param.data`` bypass PyTorch's
version counter: call :func:`clear_cache` after those. Parameters given as CuPy arrays
have no version counter, so their derived weights are rebuilt on every call.

Extra memory a plan holds (float32): 55 with kernel_size 2: ``(N/2 + 1) x K`` (about
2 GiB at 32768^2); 98: ``(N/k) x K`` (16 MiB at 8192^2, k=16); 56 and 39: nothing
(a non-contiguous weight is cached contiguous).
"""
from __future__ import annotations

import contextlib
import math
import operator
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

__all__ = [
    "MaxPoolSumPlan", "AvgPoolGeluMaxPlan", "SigmoidSumPlan", "BatchNormPlan",
    "maxpool_sum_plan", "avgpool_gelu_max_plan", "sigmoid_sum_plan", "batchnorm_plan",
    "guard_limit", "clear_cache", "cache_size",
    "run_maxpool_sum_cpu", "run_sigmoid_sum_cpu", "run_avgpool_gelu_max_cpu", "run_batchnorm_cpu",
    "GUARD_HEADROOM",
]

# ---------------------------------------------------------------------------------
# Derived-weight cache
# ---------------------------------------------------------------------------------
_lock = threading.RLock()
_cache: dict[int, dict[str, tuple[tuple, Any]]] = {}


def clear_cache() -> None:
    """Drop every cached derived weight (needed only after writes through ``.data``)."""
    with _lock:
        _cache.clear()


def cache_size() -> int:
    """Number of cached plans (for tests and memory accounting)."""
    with _lock:
        return sum(len(v) for v in _cache.values())


def _signature(deps: Sequence[torch.Tensor | None]) -> tuple | None:
    """What must be unchanged for a cached plan to stay valid; None: not cacheable.

    Each parameter's version counter (bumped by every in-place op), storage pointer,
    shape and strides. Identity is checked apart, through weak references, so a new
    tensor that happens to reuse a freed one's id() and memory never hits its plan.
    Inference tensors have no version counter: never cached.
    """
    sig = []
    for d in deps:
        if d is None:
            sig.append(None)
            continue
        if not isinstance(d, torch.Tensor) or d.is_inference():
            return None
        sig.append((d._version, d.data_ptr(), tuple(d.shape), tuple(d.stride()), str(d.device)))
    return tuple(sig)


def _drop_owner(key: int) -> None:
    with _lock:
        _cache.pop(key, None)


_recording = threading.local()


@contextlib.contextmanager
def record_cached() -> Iterator[list]:
    """Collect every value :func:`cached` returns on this thread inside the block (graph
    capture holds them, so the memory a graph uses outlives cache evictions)."""
    prev = getattr(_recording, "held", None)
    held: list = []
    _recording.held = held
    try:
        yield held
    finally:
        _recording.held = prev
        if prev is not None:
            prev.extend(held)


def cached(name: str, owner: torch.Tensor | None, deps: Sequence[torch.Tensor | None],
           hyper: tuple, build: Callable[[], Any]) -> Any:
    """Return ``build()``, cached on ``owner`` until any of ``deps`` or ``hyper`` changes.

    ``owner`` is the user's own parameter object (None: not cacheable, build each time).
    One entry per (owner, name): a rebuild replaces and frees the previous one, and the
    entry dies with ``owner``.
    """
    value = _cached(name, owner, deps, hyper, build)
    held = getattr(_recording, "held", None)
    if held is not None:
        held.append(value)
    return value


def _cached(name: str, owner: torch.Tensor | None, deps: Sequence[torch.Tensor | None],
            hyper: tuple, build: Callable[[], Any]) -> Any:
    """The cache itself (see :func:`cached`)."""
    if owner is None:
        return build()
    dep_sig = _signature(deps)
    if dep_sig is None:
        return build()
    sig = (dep_sig, hyper)
    key = id(owner)
    with _lock:
        slot = _cache.get(key)
        if slot is not None:
            hit = slot.get(name)
            if (hit is not None and hit[0] == sig and hit[1]() is owner
                    and all((r is None and d is None) or (r is not None and r() is d)
                            for r, d in zip(hit[2], deps))):
                return hit[3]
    value = build()
    refs = tuple(None if d is None else weakref.ref(d) for d in deps)
    with _lock:
        slot = _cache.get(key)
        if slot is None or not any(h[1]() is owner for h in slot.values()):
            slot = {}
            _cache[key] = slot
            weakref.finalize(owner, _drop_owner, key)
        slot[name] = (sig, weakref.ref(owner), refs, value)
    return value


# ---------------------------------------------------------------------------------
# Guard
# ---------------------------------------------------------------------------------
GUARD_HEADROOM = 1.0e37  # well under float32's 3.4e38


def guard_limit(out_features: int, scale: float) -> float:
    """Largest allowed bound on |Linear output| for a row to take a shortcut.

    The pooled sums of 55 and the pair-difference terms are at most
    ``out_features * bound * |scale|``; keeping that under ``GUARD_HEADROOM`` keeps every
    intermediate of the shortcut and of the direct path finite. NaN scale -> NaN limit,
    which flags every row (the direct path then yields PyTorch's NaNs).
    """
    s = abs(float(scale))
    if math.isnan(s):
        return float("nan")
    return GUARD_HEADROOM / (max(1, out_features) * max(1.0, s))


def _bounds(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Device tensor (max|W|, max|b|): no host synchronisation.

    NaN (which flags every row for the direct path) when W or b holds NaN, or when
    ``out_features * max|W|`` reaches ``GUARD_HEADROOM``: then the derived weights
    themselves (pair differences, the summed row) could overflow float32.
    """
    wabs = weight.abs().amax() if weight.numel() else weight.new_zeros(())
    # amax ignores nothing: NaN in W gives NaN here, which flags every row.
    if bias is None or bias.numel() == 0:
        babs = weight.new_zeros(())
    else:
        babs = bias.abs().amax()
    has_nan = torch.isnan(weight).any() | (torch.isnan(bias).any() if bias is not None else False)
    has_nan = has_nan | ~(wabs.double() * max(1, weight.shape[0]) < GUARD_HEADROOM)
    out = torch.stack([wabs, babs]).to(torch.float32)
    return torch.where(has_nan, torch.full_like(out, float("nan")), out).contiguous()


def _bias_or_zeros(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is None:
        return torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
    return bias.contiguous()


# ---------------------------------------------------------------------------------
# 55: Linear -> MaxPool1d(k) -> sum -> * scale
# ---------------------------------------------------------------------------------
@dataclass
class MaxPoolSumPlan:
    mode: str                      # "pairdiff" (k == 2) or "direct"
    k: int
    nwin: int                      # number of pooling windows (out_features // k)
    scale: float
    gemm_weight: torch.Tensor      # pairdiff: (round4(nwin + 1), K) = [d_0..d_{nwin-1}; s; 0...]; direct: (N, K)
    tail_bias: torch.Tensor        # pairdiff: (nwin + 1,) = [e_0..e_{nwin-1}; sum b]; direct: (N,)
    direct_weight: torch.Tensor    # (N, K) contiguous, for guarded rows
    direct_bias: torch.Tensor      # (N,)
    bounds: torch.Tensor | None    # (2,) device tensor for the row guard (pairdiff only)
    limit: float


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


def maxpool_sum_plan(weight: torch.Tensor, bias: torch.Tensor | None, kernel_size: int,
                     scale_factor: float, *, owner: Any = None, deps: Sequence = ()) -> MaxPoolSumPlan:
    """Plan for model 55. ``owner``/``deps``: the user's parameter objects, for caching."""
    N = weight.shape[0]
    kernel_size = pool_size("matmul_maxpool_sum_scale", kernel_size)
    nwin = _check_pool("matmul_maxpool_sum_scale", N, kernel_size)
    scale = float(scale_factor)

    def build() -> MaxPoolSumPlan:
        W = weight.contiguous()
        b = _bias_or_zeros(weight, bias)
        if kernel_size == 2:
            h = nwin
            # Rows: the h differences, the column sum s, then zero rows up to a multiple
            # of 4 so the GEMM output rows stay 16-byte aligned.
            gw = torch.zeros(((h + 1 + 3) // 4) * 4, W.shape[1], dtype=torch.float32,
                             device=W.device)
            torch.sub(W[0:2 * h:2], W[1:2 * h:2], out=gw[:h])
            gw[h] = W[: 2 * h].sum(0, dtype=torch.float64).to(torch.float32)
            e = b[0:2 * h:2] - b[1:2 * h:2]
            sb = b[: 2 * h].sum(dtype=torch.float64).to(torch.float32)
            tb = torch.cat([e, sb.reshape(1)]).contiguous()
            return MaxPoolSumPlan("pairdiff", 2, h, scale, gw, tb, W, b, _bounds(W, b),
                                  guard_limit(N, scale))
        return MaxPoolSumPlan("direct", kernel_size, nwin, scale, W, b, W, b, None, 0.0)

    return cached("maxpool_sum", owner, deps, (kernel_size, scale), build)


# ---------------------------------------------------------------------------------
# 98: Linear -> AvgPool1d(k) -> GELU -> * scale -> max
# ---------------------------------------------------------------------------------
@dataclass
class AvgPoolGeluMaxPlan:
    k: int
    nwin: int
    scale: float
    gemm_weight: torch.Tensor      # (nwin, K) averaged rows
    tail_bias: torch.Tensor        # (nwin,) averaged bias
    direct_weight: torch.Tensor    # (N, K)
    direct_bias: torch.Tensor      # (N,)
    bounds: torch.Tensor
    limit: float


def avgpool_gelu_max_plan(weight: torch.Tensor, bias: torch.Tensor | None, pool_kernel_size: int,
                          scale_factor: float, *, owner: Any = None,
                          deps: Sequence = ()) -> AvgPoolGeluMaxPlan:
    """Plan for model 98: weights and bias averaged in groups of ``pool_kernel_size``."""
    N, K = weight.shape
    k = pool_size("matmul_avgpool_gelu_scale_max", pool_kernel_size)
    nwin = _check_pool("matmul_avgpool_gelu_scale_max", N, k)
    scale = float(scale_factor)

    def build() -> AvgPoolGeluMaxPlan:
        W = weight.contiguous()
        b = _bias_or_zeros(weight, bias)
        if k == 1:
            gw, gb = W, b
        else:
            gw = W[: nwin * k].reshape(nwin, k, K).sum(1, dtype=torch.float64).div_(k)
            gw = gw.to(torch.float32).contiguous()
            gb = (b[: nwin * k].reshape(nwin, k).sum(1, dtype=torch.float64) / k).to(torch.float32)
        return AvgPoolGeluMaxPlan(k, nwin, scale, gw, gb.contiguous(), W, b, _bounds(W, b),
                                  guard_limit(N, scale))

    return cached("avgpool_gelu_max", owner, deps, (k, scale), build)


# ---------------------------------------------------------------------------------
# 56: Linear -> sigmoid -> sum(dim=1, keepdim=True)
# ---------------------------------------------------------------------------------
@dataclass
class SigmoidSumPlan:
    gemm_weight: torch.Tensor      # (N, K) contiguous (the weight itself when it already is)
    tail_bias: torch.Tensor        # (N,)


def sigmoid_sum_plan(weight: torch.Tensor, bias: torch.Tensor | None, *, owner: Any = None,
                     deps: Sequence = ()) -> SigmoidSumPlan:
    if weight.is_contiguous() and (bias is None or bias.is_contiguous()) and bias is not None:
        return SigmoidSumPlan(weight, bias)
    return cached("sigmoid_sum", owner, deps, (),
                  lambda: SigmoidSumPlan(weight.contiguous(), _bias_or_zeros(weight, bias)))


# ---------------------------------------------------------------------------------
# 39: Linear -> * scale -> BatchNorm1d
# ---------------------------------------------------------------------------------
@dataclass
class BatchNormPlan:
    gemm_weight: torch.Tensor      # (N, K) contiguous
    p: torch.Tensor                # (N,) per-column multiplier (= scale)
    q: torch.Tensor                # (N,) per-column offset (= Linear bias): y = (z + q) * p


def batchnorm_plan(weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor, *,
                   owner: Any = None, deps: Sequence = ()) -> BatchNormPlan:
    N = weight.shape[0]

    def build() -> BatchNormPlan:
        # A one-element scale broadcasts over the columns, as x * scale does.
        s = scale.reshape(-1).to(torch.float32).expand(N).contiguous()
        return BatchNormPlan(weight.contiguous(), s, _bias_or_zeros(weight, bias))

    return cached("batchnorm", owner, deps, (), build)


# ---------------------------------------------------------------------------------
# CPU execution of the plans (same algebra, torch ops). Also the readable spec of
# what the CUDA kernels compute.
# ---------------------------------------------------------------------------------
def _row_flags(x: torch.Tensor, bounds: torch.Tensor, limit: float) -> torch.Tensor:
    l1 = x.abs().sum(1, dtype=torch.float64)
    bound = l1 * 1.0001 * bounds[0].double() + bounds[1].double()
    return ~(bound <= limit)


def _maxpool_sum_direct(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor, k: int, nwin: int,
                        scale: float) -> torch.Tensor:
    y = x @ W.T + b
    win = y[:, : nwin * k].reshape(x.shape[0], nwin, k)
    m = win.amax(2)
    # amax propagates NaN like MaxPool1d.
    return (m.sum(1, dtype=torch.float64) * scale).to(torch.float32)


def run_maxpool_sum_cpu(x: torch.Tensor, plan: MaxPoolSumPlan) -> torch.Tensor:
    if plan.mode == "direct":
        return _maxpool_sum_direct(x, plan.direct_weight, plan.direct_bias, plan.k, plan.nwin,
                                   plan.scale)
    h = plan.nwin
    z = x @ plan.gemm_weight.T
    acc = (z[:, :h] + plan.tail_bias[:h]).abs().sum(1, dtype=torch.float64)
    out = ((acc + z[:, h].double() + plan.tail_bias[h].double()) * (0.5 * plan.scale)).to(torch.float32)
    flags = _row_flags(x, plan.bounds, plan.limit)
    if bool(flags.any()):
        out[flags] = _maxpool_sum_direct(x[flags], plan.direct_weight, plan.direct_bias, 2, h,
                                         plan.scale)
    return out


def run_sigmoid_sum_cpu(x: torch.Tensor, plan: SigmoidSumPlan) -> torch.Tensor:
    z = x @ plan.gemm_weight.T + plan.tail_bias
    return torch.sigmoid(z).sum(1, keepdim=True, dtype=torch.float64).to(torch.float32)


def _gelu_scale_max(v: torch.Tensor, scale: float) -> torch.Tensor:
    g = torch.nn.functional.gelu(v) * torch.tensor(scale, dtype=v.dtype)
    return g.amax(1)


def run_avgpool_gelu_max_cpu(x: torch.Tensor, plan: AvgPoolGeluMaxPlan) -> torch.Tensor:
    z = x @ plan.gemm_weight.T + plan.tail_bias
    out = _gelu_scale_max(z, plan.scale)
    flags = _row_flags(x, plan.bounds, plan.limit)
    if bool(flags.any()):
        y = x[flags] @ plan.direct_weight.T + plan.direct_bias
        k, nwin = plan.k, plan.nwin
        pooled = y[:, : nwin * k].reshape(-1, nwin, k).mean(2)
        out[flags] = _gelu_scale_max(pooled, plan.scale)
    return out


def run_batchnorm_cpu(x: torch.Tensor, plan: BatchNormPlan, running_mean: torch.Tensor | None,
                      running_var: torch.Tensor | None, gamma: torch.Tensor | None,
                      beta: torch.Tensor | None, training: bool, momentum: float,
                      eps: float) -> torch.Tensor:
    z = x @ plan.gemm_weight.T
    y = (z + plan.q) * plan.p  # PyTorch's order: (Linear + bias) * scale
    M = x.shape[0]
    if training:
        yd = y.double()
        shift = torch.where(torch.isfinite(yd[0]), yd[0], torch.zeros_like(yd[0]))
        d = yd - shift
        md = d.sum(0) / M
        var = (d * d).sum(0) / M - md * md
        var = torch.where(torch.isnan(var), var, var.clamp_min(0.0))
        mean = shift + md
        if running_mean is not None:
            unbiased = var * M / (M - 1) if M > 1 else var
            running_mean.copy_(((1.0 - momentum) * running_mean.double() + momentum * mean).float())
            running_var.copy_(((1.0 - momentum) * running_var.double() + momentum * unbiased).float())
    else:
        mean = running_mean.double()
        var = running_var.double()
    g = gamma.double() if gamma is not None else torch.ones_like(var)
    a = (g / torch.sqrt(var + eps)).float()
    # (y - mean) * a + beta in double, like bn_apply: no overflow in the subtraction
    out = (y.double() - mean.float().double()) * a.double()
    if beta is not None:
        out = out + beta.double()
    return out.float()
