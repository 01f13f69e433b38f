"""Lowerings: how each torch spelling becomes program nodes, by op family.

Each module of this package is one op family (``elementwise``, ``reductions``,
``norms``, ``views``, ...): plain functions of the translation context ``ctx``
(:class:`cupyfuse.frontend.translate.Translator`: the fx environment, the program
builder, refusals with the source line), and the spellings they lower, registered with
the decorators below::

    @lowering.function(F.layer_norm)
    def _layer_norm_fn(ctx, node, args, kw, name):
        return layer_norm(ctx, args[0], ...)

A spelling is registered once (a second registration raises). The ops of the op table
(:mod:`cupyfuse.ops.registry`: unary, binary, comparisons, activations with
attributes, composites) need no registration here: the translator lowers them from
their records (:func:`cupyfuse.frontend.lower.elementwise.table_call`).

Handler signatures: a function's ``(ctx, node, args, kw, name)``; a method's ``(ctx,
node, self_, args, kw, name)`` (``self_``: the tensor it is a method of); a module's
``(ctx, node, mod, a, name)`` (``mod``: the submodule, ``a``: its first argument),
looked up along the module class's MRO (a subclass lowers as its base).
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["FUNCTIONS", "METHODS", "MODULES", "function", "method", "module", "of_module"]

FUNCTIONS: dict[Any, Callable[..., Any]] = {}
METHODS: dict[str, Callable[..., Any]] = {}
MODULES: dict[type, Callable[..., Any]] = {}


def _register(table: dict, keys: tuple, fn: Callable[..., Any]) -> Callable[..., Any]:
    for k in keys:
        if k in table and table[k] is not fn:
            raise ValueError(f"{k!r} is lowered twice: by {table[k].__qualname__} and "
                             f"{fn.__qualname__}")
        table[k] = fn
    return fn


def function(*targets: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated handler for these torch functions (or operators)."""
    return lambda fn: _register(FUNCTIONS, targets, fn)


def method(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated handler for these tensor methods."""
    return lambda fn: _register(METHODS, names, fn)


def module(*classes: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated handler for these nn.Module classes (and subclasses)."""
    return lambda fn: _register(MODULES, classes, fn)


def of_module(mod: Any) -> Callable[..., Any] | None:
    """The handler of a module instance: its class's or the nearest base class's."""
    for cls in type(mod).__mro__:
        fn = MODULES.get(cls)
        if fn is not None:
            return fn
    return None
