"""Derived weights: a GEMM operand computed from the module's own tensors alone.

A forward may compute a Linear's weight or bias from its parameters and buffers before
using it: ``F.linear(x, self.w * self.scale)``, a pruning mask ``self.weight *
self.mask``, a merged LoRA ``self.weight + (self.lora_B @ self.lora_A) * s``, a cosine
classifier's ``F.normalize(self.fc.weight, dim=1)``, weight standardisation. None of it
depends on the forward's inputs, so :mod:`cupyfuse.frontend.translate` lifts that part of the traced
graph out of the tail program into a :class:`Derived` source: at each call it is
evaluated with the very torch ops of the trace, on the tensors the module holds then
(under ``torch.no_grad``, where the tensors are: eager's own values), and cached on
those tensors (:func:`cupyfuse.caches.cached`: identity, version counter, address), so a
call whose parameters are unchanged gets the *same* tensor object back (the GEMM engine
caches its split of a weight on that object), and an in-place edit or
``load_state_dict`` is followed at the next call.

Only ops whose result is a function of their operands are evaluated (:data:`FUNCS`,
:data:`METHODS`); capture refuses random ops, in-place ops and module calls there.
"""
from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from cupyfuse import caches

__all__ = ["Derived", "Ref", "FUNCS", "METHODS", "RANDOM_FUNCS", "RANDOM_METHODS"]


class Ref:
    """A reference to an earlier value of a :class:`Derived` (a leaf or a step)."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __repr__(self) -> str:
        return f"%{self.i}"


#: functions evaluated in a derived weight: deterministic tensor math, reductions,
#: matmuls and views
FUNCS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.mod, operator.pow, operator.neg, operator.pos, operator.abs, operator.matmul,
    operator.getitem, operator.gt, operator.lt, operator.ge, operator.le, operator.eq,
    operator.ne, operator.and_, operator.or_, operator.xor, operator.invert, getattr,
    torch.add, torch.sub, torch.subtract, torch.mul, torch.multiply, torch.div,
    torch.divide, torch.true_divide, torch.pow, torch.neg, torch.negative, torch.abs,
    torch.exp, torch.expm1, torch.log, torch.log1p, torch.log2, torch.sqrt, torch.rsqrt,
    torch.square, torch.reciprocal, torch.sign, torch.sgn, torch.sigmoid, torch.tanh,
    torch.relu, torch.sin, torch.cos, torch.atan, torch.erf, torch.floor, torch.ceil,
    torch.round, torch.trunc, torch.clamp, torch.clip, torch.clamp_min, torch.clamp_max,
    torch.maximum, torch.minimum, torch.where, torch.lerp, torch.hypot, torch.atan2,
    torch.sum, torch.mean, torch.std, torch.var, torch.norm, torch.amax, torch.amin,
    torch.max, torch.min, torch.prod, torch.logsumexp, torch.softmax, torch.log_softmax,
    torch.linalg.vector_norm, torch.matmul, torch.mm, torch.mv, torch.outer, torch.einsum,
    torch.kron, torch.t, torch.transpose, torch.permute, torch.reshape, torch.flatten,
    torch.unsqueeze, torch.squeeze, torch.cat, torch.concat, torch.stack, torch.chunk,
    torch.split, torch.narrow, torch.flip, torch.roll, torch.tril, torch.triu, torch.diag,
    torch.diagonal, torch.diag_embed, torch.block_diag, torch.zeros_like, torch.ones_like,
    torch.full_like, torch.clone, torch.detach, torch.broadcast_to, torch.masked_fill,
    torch.renorm,
    F.normalize, F.linear, F.relu, F.gelu, F.silu, F.softplus, F.sigmoid, F.tanh,
    F.softmax, F.log_softmax, F.elu, F.leaky_relu, F.hardtanh, F.relu6, F.pad,
    F.layer_norm,
})

#: tensor methods evaluated in a derived weight (their in-place forms are refused)
METHODS = frozenset({
    "add", "sub", "subtract", "mul", "multiply", "div", "divide", "true_divide", "pow",
    "neg", "abs", "exp", "expm1", "log", "log1p", "log2", "sqrt", "rsqrt", "square",
    "reciprocal", "sign", "sigmoid", "tanh", "relu", "sin", "cos", "atan", "erf", "floor",
    "ceil", "round", "trunc", "clamp", "clip", "clamp_min", "clamp_max", "maximum",
    "minimum", "where", "masked_fill", "lerp", "gt", "lt", "ge", "le", "eq", "ne",
    "sum", "mean", "std", "var", "norm", "amax", "amin", "max", "min", "prod", "logsumexp",
    "softmax", "log_softmax", "matmul", "mm", "mv", "outer", "__matmul__", "__rmatmul__",
    "t", "transpose", "permute", "reshape", "reshape_as", "view", "view_as", "flatten",
    "unflatten", "unsqueeze", "squeeze", "contiguous", "clone", "detach", "float", "double",
    "to", "type_as", "expand", "expand_as", "repeat", "chunk", "split", "narrow", "flip",
    "roll", "tril", "triu", "diag", "diagonal", "renorm", "size", "dim", "numel",
    "__getitem__",
})

#: random ops: eager draws anew every call, a derived weight is evaluated once per change
#: (the dropout functions are evaluated where inactive: not training, or p = 0)
RANDOM_FUNCS = frozenset({
    torch.rand, torch.rand_like, torch.randn, torch.randn_like, torch.randint,
    torch.randint_like, torch.randperm, torch.bernoulli, torch.multinomial, torch.normal,
    torch.poisson, torch.dropout, F.dropout, F.dropout1d, F.dropout2d, F.dropout3d,
    F.alpha_dropout, F.feature_alpha_dropout, F.rrelu, F.gumbel_softmax,
})
RANDOM_METHODS = frozenset({
    "bernoulli", "multinomial", "uniform_", "normal_", "bernoulli_", "random_",
    "exponential_", "cauchy_", "log_normal_", "geometric_",
})


def fill(a: Any, vals: Sequence[Any]) -> Any:
    """``a`` (an fx node's arguments with :class:`Ref` s in place of nodes) with the
    values they refer to."""
    if isinstance(a, Ref):
        return vals[a.i]
    if isinstance(a, tuple):
        return tuple(fill(x, vals) for x in a)
    if isinstance(a, list):
        return [fill(x, vals) for x in a]
    if isinstance(a, dict):
        return {k: fill(x, vals) for k, x in a.items()}
    if isinstance(a, slice):
        return slice(fill(a.start, vals), fill(a.stop, vals), fill(a.step, vals))
    return a


def _canon(a: Any) -> Any:
    """A hashable key of an argument: numbers by type and repr (0.0 and -0.0, 1 and 1.0
    differ; a NaN equals itself), containers by content, anything else itself (functions,
    dtypes) or, if unhashable, its identity."""
    if isinstance(a, Ref):
        return ("ref", a.i)
    if type(a) in (bool, int, float, complex):
        return (type(a), repr(a))
    if isinstance(a, (tuple, list)):
        return (type(a).__name__,) + tuple(_canon(x) for x in a)
    if isinstance(a, dict):
        return ("dict",) + tuple((k, _canon(x)) for k, x in a.items())
    if isinstance(a, slice):
        return ("slice", _canon(a.start), _canon(a.stop), _canon(a.step))
    try:
        hash(a)
    except TypeError:
        return ("id", id(a))
    return a


class Derived:
    """A program source computed from the module's tensors: ``paths`` (attribute paths,
    as fx named them) are its leaves, ``steps`` the ops after them, each ``(op, target,
    args, kwargs)`` with fx's op kind (call_function or call_method) and :class:`Ref` s
    for earlier values (leaves first, then the steps); the last step is the result.
    ``shape`` is the result's when traced, ``label`` says where it is computed (the
    forward's line) for messages, ``site`` names its place in the forward (its cache
    slot). Sources compare equal when they compute the same."""

    __slots__ = ("paths", "_split", "steps", "shape", "label", "key", "_name", "_hash")

    def __init__(self, paths: Sequence[str], steps: Sequence[tuple], shape: Sequence[int],
                 label: str = "", site: str = "") -> None:
        self.paths = tuple(paths)
        self._split = tuple(tuple(p.split(".")) for p in self.paths)
        self.steps = tuple(steps)
        self.shape = tuple(int(s) for s in shape)
        self.label = label
        self.key = (self.paths, tuple((op, t, _canon(a), _canon(k))
                                      for op, t, a, k in self.steps))
        try:
            self._hash = hash(self.key)
        except TypeError:   # pragma: no cover - _canon makes everything hashable
            self._hash = id(self)
        # one cache slot per (first leaf, site: the fx node of the result): a value rebuilt
        # (new tensors, or a new trace with another constant) replaces the last one there
        self._name = f"derived:{site}:{','.join(self.paths)}"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Derived) and self.key == other.key

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"Derived({self.label or ', '.join(self.paths)})"

    def leaves(self, module: Any) -> list[Any]:
        """The tensors the module holds now at ``paths``."""
        out = []
        for parts in self._split:
            obj = module
            for p in parts:
                obj = getattr(obj, p)
            out.append(obj)
        return out

    def requires_grad(self, module: Any) -> bool:
        """Whether a leaf requires grad (eager would build an autograd graph through it)."""
        return any(isinstance(t, torch.Tensor) and t.requires_grad
                   for t in self.leaves(module))

    def evaluate(self, leaves: Sequence[Any], grad: bool = False) -> Any:
        """The steps run on ``leaves`` with torch's own ops (with autograd where ``grad``:
        a backward's recompute, cupyfuse.autograd); a tensor result made contiguous (the
        GEMM reads the weight's rows) and its own memory."""
        vals = list(leaves)
        # (a plain tensor even under a caller's inference_mode: its version counter keys
        # the caches built on it, the engine's split of the weight among them)
        with torch.inference_mode(False), torch.set_grad_enabled(grad):
            for op, target, args, kwargs in self.steps:
                a = fill(args, vals)
                kw = fill(kwargs, vals)
                if op == "call_function":
                    r = target(*a, **kw)
                else:
                    r = getattr(a[0], target)(*a[1:], **kw)
                vals.append(r)
        out = vals[-1]
        if isinstance(out, torch.Tensor):
            if out._base is not None or any(out is t for t in leaves):
                # a leaf itself or a view (``self.w.float()``, ``self.w[:, :8]``): a copy,
                # so that the cache (keyed on the first leaf) never holds its own key
                out = out.clone(memory_format=torch.contiguous_format)
            elif not out.is_contiguous():
                out = out.contiguous()
        return out

    def value(self, module: Any) -> torch.Tensor:
        """The weight for ``module`` now: the cached tensor while every leaf is the same
        tensor at the same version (the same object each call), else evaluated anew."""
        leaves = self.leaves(module)
        # (no leaf: made of numbers passed to the forward alone; evaluated every call)
        return caches.cached(self._name, leaves[0] if leaves else None, leaves, self.key,
                            lambda: self._checked(leaves))

    def _checked(self, leaves: Sequence[Any]) -> torch.Tensor:
        r = self.evaluate(leaves)
        if not isinstance(r, torch.Tensor) or tuple(r.shape) != self.shape:
            got = tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__
            # (parameters' and buffers' shapes key the program: a tensor held as a plain
            # attribute, or a shape that depends on values, w[mask], gets here)
            raise RuntimeError(f"a tensor computed from the module's tensors alone (a "
                               f"Linear's weight or bias, or one its tail reads) "
                               f"({', '.join(self.paths)}) is now {got}, {self.shape} "
                               "when traced: its shape must follow the shapes of the "
                               "parameters and buffers (a tensor held as a plain attribute "
                               "changed shape: register it as a buffer)"
                               + (f"\n  at {self.label}" if self.label else ""))
        return r
