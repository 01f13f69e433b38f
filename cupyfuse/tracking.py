"""Writes that a tensor's version counter cannot see: ``.data`` of a fused module's tensors.

PyTorch bumps a tensor's version counter on every in-place op (an optimizer step,
``load_state_dict``, ``w.mul_(2)`` under ``no_grad``): that is what the caches of
derived weights (:func:`cupyfuse.caches.cached`) and the prepared launches key on. A
write through ``.data`` (EMA updates and older init helpers: ``p.data.mul_(0.9)``,
``p.data.copy_(w)``, ``p.data = w``) goes through a tensor with a counter of its own.

So the parameters and buffers a fused module reads are given a class that counts each
use of ``.data`` -- a read or a write: the access is all that can be seen -- in the
tensor (``_cupyfuse_writes``, part of every derived weight's key) and bumps the cache
generation (:data:`cupyfuse.caches.GENERATION`, part of every prepared launch's key), so
the next call derives again what read the tensor. The classes are subclasses of
``nn.Parameter`` and ``torch.Tensor`` that change nothing else (``isinstance`` holds,
torch functions return plain tensors, state dicts hold plain tensors, pickles and deep
copies keep working). A tensor taken with ``.data`` and kept, then written much later,
is counted at the ``.data``, not at the write: call :func:`cupyfuse.clear_cache` after
such a write.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.nn as nn

from cupyfuse import caches

__all__ = ["TrackedParameter", "TrackedBuffer", "TENSOR_TYPES", "track", "track_tensor", "writes"]

_DATA = torch._C.TensorBase.data   # the C getter/setter of Tensor.data


def _count(t: torch.Tensor) -> None:
    d = t.__dict__
    d["_cupyfuse_writes"] = d.get("_cupyfuse_writes", 0) + 1
    caches.GENERATION[0] += 1


def _get(self: torch.Tensor) -> torch.Tensor:
    _count(self)
    return _DATA.__get__(self)


def _set(self: torch.Tensor, value: torch.Tensor) -> None:
    _count(self)
    _DATA.__set__(self, value)


class TrackedParameter(nn.Parameter):
    """An ``nn.Parameter`` whose ``.data`` accesses are counted (see the module doc)."""

    data = property(_get, _set)   # type: ignore[assignment]

    # a deep copy or a pickle reads the tensor: no access counted; the copy is a plain
    # nn.Parameter (tracked again where a fused module reads it)
    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        hit = memo.get(id(self))
        if hit is None:
            hit = memo[id(self)] = nn.Parameter(
                _DATA.__get__(self).clone(memory_format=torch.preserve_format),
                self.requires_grad)
        return hit

    def __reduce_ex__(self, protocol: int) -> Any:
        state = {k: v for k, v in self.__dict__.items() if k != "_cupyfuse_writes"}
        data = _DATA.__get__(self)
        if not state:
            return (torch._utils._rebuild_parameter, (data, self.requires_grad, OrderedDict()))
        return (torch._utils._rebuild_parameter_with_state,
                (data, self.requires_grad, OrderedDict(), state))


class TrackedBuffer(torch.Tensor):
    """A buffer (plain tensor) whose ``.data`` accesses are counted."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    data = property(_get, _set)   # type: ignore[assignment]

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        # a copy is a plain tensor (tracked again where a fused module reads it)
        hit = memo.get(id(self))
        if hit is None:
            hit = memo[id(self)] = _DATA.__get__(self).clone()
        return hit

    def __reduce_ex__(self, protocol: int) -> Any:
        return _DATA.__get__(self).__reduce_ex__(protocol)


#: the exact tensor types the fast paths take as plain tensors: torch's own, and these
TENSOR_TYPES = (torch.Tensor, nn.Parameter, TrackedParameter, TrackedBuffer)


def writes(t: Any) -> int:
    """How many ``.data`` accesses of ``t`` were counted (0 for an untracked tensor)."""
    return t.__dict__.get("_cupyfuse_writes", 0) if isinstance(t, torch.Tensor) else 0


def track_tensor(t: Any) -> None:
    """Count ``t``'s ``.data`` accesses from now on (an ``nn.Parameter`` or a plain
    tensor; other types, already tracked tensors and tensor subclasses are left alone)."""
    tp = type(t)
    if tp is nn.Parameter:
        t.__class__ = TrackedParameter
    elif tp is torch.Tensor:
        t.__class__ = TrackedBuffer


def track(module: nn.Module) -> None:
    """Track every parameter and buffer of ``module`` and its submodules."""
    for p in module.parameters():
        track_tensor(p)
    for b in module.buffers():
        track_tensor(b)
