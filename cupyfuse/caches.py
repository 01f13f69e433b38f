"""The derived-weight cache, and the pooling-window checks of the named ops.

Derived weights (the GEMM engine's split of a weight, the rewrites' folded weights and
coefficients in :mod:`cupyfuse.ir.rewrite`) are a cache of the parameters: they
are keyed on each parameter's identity, storage pointer and autograd version counter, so
any in-place edit (``with torch.no_grad(): w.mul_(2)``), assignment or
``load_state_dict`` rebuilds them, and they are freed with the parameter. Writes
through ``param.data`` bypass PyTorch's version counter: call :func:`clear_cache` after
those. Parameters given as CuPy arrays have no version counter: their derived weights
are rebuilt on every call (a :class:`cupyfuse.PreparedWeight` keeps them).

The four models' ops are generic tail programs (:mod:`cupyfuse.kernelbench.ops`); their exact
algebra (pair differences, the average-pooling fold) lives in :mod:`cupyfuse.ir.rewrite`.
"""
from __future__ import annotations

import operator
import threading
import weakref
from typing import Any, Callable, Sequence

import torch

__all__ = ["pool_size", "cached", "clear_cache", "cache_size"]

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


def cached(name: str, owner: torch.Tensor | None, deps: Sequence[torch.Tensor | None],
           hyper: tuple, build: Callable[[], Any]) -> Any:
    """Return ``build()``, cached on ``owner`` until any of ``deps`` or ``hyper`` changes.

    ``owner`` is the user's own parameter object (None: not cacheable, build each time).
    One entry per (owner, name): a rebuild replaces and frees the previous one, and the
    entry dies with ``owner``.
    """
    return _cached(name, owner, deps, hyper, build)


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
