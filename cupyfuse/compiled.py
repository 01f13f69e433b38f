"""Fused modules inside ``torch.compile``.

Traced by dynamo, a fused module's call is one custom op, ``cupyfuse::module_call``, not a
graph break: its real implementation is the fused call itself (the module's own kernels,
under ``no_grad``); its fake implementation runs the *original* forward on the fake
tensors (so shapes, dtypes and devices are torch's own); its derivative
(``register_autograd``) is the vector-Jacobian product of the original forward
(``torch.func.vjp``), which the compiler traces into the backward graph like the rest of
the model. So a model holding fused modules compiles with ``fullgraph=True`` and trains.

The op takes the call's tensor arguments and the module's parameters and buffers (by
name, as ``named_parameters``/``named_buffers`` list them when the module is first
compiled); under autocast or with a 16-bit x the original forward is traced instead
(torch's dtypes); the other arguments (Python numbers, None, bools) are constants of the handle
the op is given (:func:`handle`), one per (module, constants). A module that updates its
buffers (BatchNorm in training mode with running statistics) would make the op mutate its
inputs: such a call runs the original forward instead (compiled by torch), with a
warning once.
"""
from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from typing import Any, Sequence

import torch
import torch.nn as nn
from torch.func import functional_call

__all__ = ["call", "handle"]


class _Entry:
    __slots__ = ("module", "base", "template", "names", "kind")

    def __init__(self, module: nn.Module, base: Any, template: tuple, names: list[str]) -> None:
        self.module = weakref.ref(module)
        self.base = base            # the original forward (unbound)
        self.template = template    # the call's arguments, tensors as None
        self.names = names          # the module's parameters then buffers
        self.kind: Any = None       # how the result is rebuilt from the op's list


# (not a cache: compiled graphs hold these handles; an entry goes with its module)
_entries: dict[int, _Entry] = {}
_counter = itertools.count(1)
_lock = threading.Lock()


_instances: dict[int, Any] = {}


def register(module: nn.Module) -> None:
    """Know a fused module by its id (every instance, from its class's ``__new__``)."""
    i = id(module)
    _instances[i] = weakref.ref(module, lambda _, i=i: _instances.pop(i, None))


@torch._dynamo.assume_constant_result
def handle(module_id: int, template: tuple) -> int:
    """The op's handle of the fused module ``module_id`` (:func:`register`) called with
    these constant arguments (runs once per trace: dynamo keeps the result as a constant)."""
    from cupyfuse import tracking

    ref = _instances.get(module_id)
    module = ref() if ref is not None else None
    if module is None:
        raise RuntimeError("cupyfuse: a fused module unknown to torch.compile's op (made "
                           "without its class's __new__?): build it with from_model or "
                           "fused_class")

    # (the fused call tracks .data writes by giving parameters a subclass: done now, before
    # dynamo guards on their types, so the first real call does not force a recompile)
    tracking.track(module)
    base = getattr(type(module), "_cupyfuse_base").forward
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    with _lock:
        for h, e in _entries.items():
            if e.module() is module and e.template == template and e.names == names:
                return h
        h = next(_counter)
        _entries[h] = _Entry(module, base, template, names)
    weakref.finalize(module, _entries.pop, h, None)
    return h


class _Original(nn.Module):
    """The original forward over a fused module (for ``functional_call``)."""

    def __init__(self, inner: nn.Module, base: Any) -> None:
        super().__init__()
        self.inner = inner
        self._base = base

    def forward(self, *args: Any) -> Any:
        return self._base(self.inner, *args)


def _args(e: _Entry, ts: Sequence[torch.Tensor]) -> tuple:
    it = iter(ts)
    return tuple(next(it) if v is None else v for v in e.template)


def _flat(r: Any) -> list[torch.Tensor]:
    return [r] if isinstance(r, torch.Tensor) else list(r)


def _entry(h: int) -> tuple[_Entry, nn.Module]:
    e = _entries.get(h)
    m = e.module() if e is not None else None
    if m is None:
        raise RuntimeError("cupyfuse: a compiled graph calls a fused module that no longer "
                           "exists; compile the model again")
    return e, m


def _original(h: int, nin: int, ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    e, m = _entry(h)
    params = {"inner." + n: t for n, t in zip(e.names, ts[nin:])}
    r = functional_call(_Original(m, e.base), params, _args(e, ts[:nin]))
    if e.kind is None:
        e.kind = "tensor" if isinstance(r, torch.Tensor) else type(r)
    return _flat(r)


@torch.library.custom_op("cupyfuse::module_call", mutates_args=())
def module_call(h: int, nin: int, ts: list[torch.Tensor]) -> list[torch.Tensor]:
    e, m = _entry(h)
    own = dict(m.named_parameters())
    own.update(m.named_buffers())
    args = _args(e, ts[:nin])
    with torch.no_grad():
        if all(own.get(n) is t for n, t in zip(e.names, ts[nin:])):
            r = m(*args)
        else:
            r = functional_call(m, dict(zip(e.names, ts[nin:])), args)
    outs = _flat(r)
    ptrs = {t.data_ptr() for t in ts}
    # (an op's results may not alias its inputs)
    return [o.clone() if o.data_ptr() in ptrs else o for o in outs]


@module_call.register_fake
def _(h: int, nin: int, ts: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [o.clone() for o in _original(h, nin, ts)]


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    h, nin, ts = inputs
    ctx.h, ctx.nin = h, nin
    ctx.save_for_backward(*ts)


def _backward(ctx: Any, grads: Sequence[torch.Tensor]) -> tuple:
    ts = list(ctx.saved_tensors)
    fl = [i for i, t in enumerate(ts) if t.is_floating_point()]

    def f(*diff: torch.Tensor) -> tuple:
        full = list(ts)
        for i, t in zip(fl, diff):
            full[i] = t
        return tuple(o for o in _original(ctx.h, ctx.nin, full) if o.is_floating_point())

    outs, vjp = torch.func.vjp(f, *[ts[i] for i in fl])
    fg = [g for g, o in zip(grads, _float_mask(ctx.h, ctx.nin, ts)) if o]
    fg = [torch.zeros_like(o) if g is None else g for g, o in zip(fg, outs)]
    got = vjp(tuple(fg))
    res: list[Any] = [None] * len(ts)
    for i, g in zip(fl, got):
        res[i] = g
    return None, None, res


def _float_mask(h: int, nin: int, ts: Sequence[torch.Tensor]) -> list[bool]:
    with torch.no_grad():
        return [o.is_floating_point() for o in _original(h, nin, ts)]


module_call.register_autograd(_backward, setup_context=_setup)

_warned: set = set()


@torch._dynamo.assume_constant_result
def _warn_original(name: str) -> int:
    # (run by dynamo at trace time, once per trace: a warning in traced code would break
    # the graph)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"cupyfuse: {name} updates BatchNorm running statistics (training "
                      "mode): under torch.compile it runs its original forward")
    return 0


def _updates_buffers(module: nn.Module) -> bool:
    return module.training and any(
        isinstance(s, nn.modules.batchnorm._BatchNorm) and s.track_running_stats
        for s in module.modules())


def call(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """A fused module's call while dynamo traces it (see the module docstring)."""
    if kwargs:
        raise TypeError(f"cupyfuse: under torch.compile, pass the fused "
                        f"{type(module)._cupyfuse_base.__name__}'s "
                        f"inputs positionally (got {', '.join(kwargs)} by name)")
    base = type(module)._cupyfuse_base.forward
    x0 = args[0] if args else None
    if isinstance(x0, torch.Tensor) and (torch.is_autocast_enabled(x0.device.type) or
                                         x0.dtype in (torch.bfloat16, torch.float16)):
        return base(module, *args)   # (torch's dtypes: the original forward, compiled)
    if _updates_buffers(module):
        _warn_original(type(module).__name__)
        return base(module, *args)
    template = tuple(None if isinstance(a, torch.Tensor) else a for a in args)
    tens = [a for a in args if isinstance(a, torch.Tensor)]
    h = handle(id(module), template)
    state = [t for _, t in module.named_parameters()] + [t for _, t in module.named_buffers()]
    outs = module_call(h, len(tens), tens + state)
    kind = _entries[h].kind
    if kind == "tensor":
        return outs[0]
    return kind(outs)
