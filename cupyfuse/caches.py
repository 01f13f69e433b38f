"""Every cache of cupyfuse, registered once; :func:`clear_cache` clears them all.

Kinds of cached state, each registered here by the module that owns it
(:func:`register`):

* **derived weights** -- the GEMM engine's split of a weight, the rewrites' folded
  weights and coefficients, transposed copies, weights a forward computes from its
  parameters: a cache of the parameters, kept by :func:`cached` on the parameter object
  and keyed on each tensor it reads (identity, storage address, shape, strides and
  autograd version counter; a write through ``.data`` of a fused module's parameter is
  counted too: :mod:`cupyfuse.tracking`), so an in-place edit, an optimizer step, an
  assignment or ``load_state_dict`` rebuilds them, and they are freed with the
  parameter;
* **programs and traces** -- a tail function's translated programs;
* **plans and compiled kernels** -- code generator plans, NVRTC modules and functions;
* **prepared launches** -- the launches of repeated calls, their kept workspaces and
  specialised calls, and the engine's tensor maps.

Registries that are not caches stay: the classes :func:`cupyfuse.fused_class` made
(a class's identity must not change) and the op table.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Sequence, TypeVar

import torch

__all__ = ["register", "clear_cache", "registered", "cached", "cache_size", "generation"]

T = TypeVar("T")

_registry: list[tuple[str, Any, Callable[[Any], None]]] = []


def register(name: str, obj: T, clear: Callable[[T], None] | None = None) -> T:
    """Declare ``obj`` (a dict, list, set or any object with ``clear()``) a cache named
    ``name``; :func:`clear_cache` empties it (with ``clear(obj)`` where given). Returns
    ``obj``."""
    if any(n == name for n, _, _ in _registry):
        raise ValueError(f"cache {name!r} is registered twice")
    _registry.append((name, obj, clear if clear is not None else type(obj).clear))
    return obj


def registered() -> list[tuple[str, int | None]]:
    """(name, number of entries where it has a length) of every registered cache."""
    out = []
    for name, obj, _ in _registry:
        try:
            out.append((name, len(obj)))
        except TypeError:
            out.append((name, None))
    return out


#: bumped by :func:`clear_cache` and by a tracked write (:mod:`cupyfuse.tracking`): part
#: of every prepared launch's key, so none made before is reused
GENERATION = [0]


def generation() -> int:
    return GENERATION[0]


def clear_cache() -> None:
    """Clear every registered cache: derived weights, programs, plans, compiled kernels,
    prepared launches and their workspaces, specialised calls."""
    with _lock:
        for _, obj, clear in _registry:
            clear(obj)
        GENERATION[0] += 1


# ---------------------------------------------------------------------------------
# Derived weights
# ---------------------------------------------------------------------------------
_lock = threading.RLock()
_cache: dict[int, dict[str, tuple[tuple, Any]]] = register("derived weights", {})


def cache_size() -> int:
    """Number of cached derived weights (for tests and memory accounting)."""
    with _lock:
        return sum(len(v) for v in _cache.values())


def signature(deps: Sequence[torch.Tensor | None]) -> tuple | None:
    """What must be unchanged for a cached value to stay valid; None: not cacheable.

    Each tensor's version counter (bumped by every in-place op), tracked ``.data``
    writes, storage pointer, shape and strides. Identity is checked apart, through weak
    references, so a new tensor that happens to reuse a freed one's id() and memory never
    hits its entry. Inference tensors have no version counter: never cached.
    """
    sig = []
    for d in deps:
        if d is None:
            sig.append(None)
            continue
        if not isinstance(d, torch.Tensor) or d.is_inference():
            return None
        sig.append((d._version, d.__dict__.get("_cupyfuse_writes", 0), d.data_ptr(),
                    tuple(d.shape), tuple(d.stride()), str(d.device)))
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
    if owner is None:
        return build()
    dep_sig = signature(deps)
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
