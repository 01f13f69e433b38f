"""The derived-weight cache, and the plan of model 39's hand-built op.

Derived weights (the GEMM engine's split of a weight, the rewrites' folded weights and
coefficients in :mod:`cupyfuse.rewrite`, 39's scale) are a cache of the parameters: they
are keyed on each parameter's identity, storage pointer and autograd version counter, so
any in-place edit (``with torch.no_grad(): w.mul_(2)``), assignment or
``load_state_dict`` rebuilds them, and they are freed with the parameter. Writes
through ``param.data`` bypass PyTorch's version counter: call :func:`clear_cache` after
those. Parameters given as CuPy arrays have no version counter: their derived weights
are rebuilt on every call (a :class:`cupyfuse.PreparedWeight` keeps them).

Model 39 (Linear -> * scale -> BatchNorm1d) as a function, :func:`cupyfuse.gemm_scale_batchnorm`:

* **Scale** -- ``(x W^T + b) * s`` is applied to the GEMM output ``z = x W^T`` per
  column as ``(z + q) * p`` with ``q = b``, ``p = s`` -- PyTorch's own order, so that
  infinities and overflow come out as in PyTorch (folding it as ``z * s + b * s`` was
  exact in real arithmetic but not at ``s = inf`` or when ``b * s`` overflows) -- in
  the same pass as BatchNorm. A one-element scale broadcasts.
* **BatchNorm** -- eval mode is a per-column affine ``(y - running_mean) * a + beta``
  with ``a = gamma / sqrt(running_var + eps)``. Training mode uses the batch mean and
  biased variance of ``y`` (computed in double with a per-column shift, so large offsets
  keep their precision); running_mean/running_var are updated with ``momentum`` and the
  unbiased variance.

Models 55, 56 and 98 run the generic tail programs (:mod:`cupyfuse.fused`); their exact
algebra (pair differences, the average-pooling fold) lives in :mod:`cupyfuse.rewrite`.
"""
from __future__ import annotations

import contextlib
import operator
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

__all__ = ["BatchNormPlan", "batchnorm_plan", "run_batchnorm_cpu", "pool_size", "cached",
           "clear_cache", "cache_size"]

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
# Plans
# ---------------------------------------------------------------------------------
def _bias_or_zeros(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is None:
        return torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
    return bias.contiguous()


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
