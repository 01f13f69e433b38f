"""Tensors and numbers a traced forward makes (:mod:`cupyfuse.frontend.translate`): torch.zeros /
ones / full and ``new_zeros`` / ``new_ones`` / ``new_full`` (a constant of the program,
or a fill of a value's rows where the shape reads its batch size), torch.arange and
tensors fx made at trace time from numbers alone (a number or an ``iota``), their dtype
rules, and functions of Python's math module of the forward's numbers.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx

from cupyfuse.ir import splits
from cupyfuse.frontend.values import Val, _Const, _MergedRows, _Size
from cupyfuse.ir.program import BATCH, LEAD, LEAD_WHY, TailError, _check_dims
from cupyfuse.frontend import lower as lowering
from cupyfuse.frontend.tables import _arg
from cupyfuse.frontend.values import _Bool, _Int, _RawInt


# --- tensors the forward makes: torch.zeros / ones / full / arange, new_* -------------
def _factory_dtype(ctx, kw: dict, default: str, name: str) -> str:
    """The kind ("f", "i", "b") of a tensor made with ``dtype`` (``default`` without
    one); dtypes other than float32, int64/int32 and bool refused."""
    dt = kw.get("dtype")
    if kw.get("requires_grad"):
        raise ctx.refuse(name, "a tensor that requires grad")
    if dt is None:
        if default == "f" and torch.get_default_dtype() is not torch.float32:
            raise ctx.refuse(name, f"the default dtype {torch.get_default_dtype()} "
                                    "(cupyfuse runs float32)")
        return default
    if dt is torch.float32:
        return "f"
    if dt in (torch.int64, torch.int32):
        return "i"
    if dt is torch.bool:
        return "b"
    raise ctx.refuse(name, f"dtype={dt} (cupyfuse computes and returns float32)")


def _fill_kind(ctx, value: Any, name: str) -> tuple[float, str]:
    """A fill value as a float and the kind torch infers from it (torch.full)."""
    if isinstance(value, torch.fx.Node):
        e = ctx.env.get(value)
        value = e.v if isinstance(e, _Const) else e
    if isinstance(value, bool):
        return float(value), "b"
    if isinstance(value, int) and not isinstance(value, Val):
        return float(value), "i"
    if isinstance(value, float):
        return value, "f"
    raise ctx.refuse(name, "a fill value that is not a number")


def _sizes_arg(ctx, args: tuple) -> Any:
    """The sizes of ``torch.zeros(*size)``: one sequence (a tuple, or a value's
    ``.shape`` / ``.size()``), or the arguments themselves."""
    if len(args) == 1 and (isinstance(args[0], (tuple, list)) or isinstance(
            args[0], torch.fx.Node) and isinstance(ctx.env.get(args[0]), tuple)):
        return args[0]
    return args


def factory(ctx, value: float, shape: Any, kind: str, name: str) -> Any:
    """A tensor of ``shape`` filled with ``value`` (torch.zeros/ones/full, new_zeros/
    new_ones/new_full). A shape of numbers alone is a constant of the program (a
    number, or an ``iota`` of one value along its one dim > 1); a shape read from a
    value's (``torch.zeros(h.size(0), 1)``, ``torch.zeros(cosine.size())``) is that
    value's rows: ``value`` wherever a one-feature slice of it (spread over the
    features asked for) is, a select that reads nothing of it."""
    shape = ctx._shape_arg(shape, name)
    entries: list[Any] = []
    for s in shape if isinstance(shape, (tuple, list)) else [shape]:
        e = ctx.env.get(s) if isinstance(s, torch.fx.Node) else s
        if isinstance(e, _Const) and type(e.v) is int:
            e = e.v
        if isinstance(e, _Size) and e.v >= 0:
            e = e.v
        if isinstance(e, _MergedRows):
            raise ctx.refuse(name, "a shape built from the row count of a (batch * seq, "
                                    "F) view: view it back first")
        if not (isinstance(e, _Size) or type(e) is int):
            raise ctx.refuse(name, "a shape that is not a tuple of sizes (ints, or sizes "
                                    "read from a value's shape)")
        if type(e) is int and e < 0:
            raise ctx.refuse(name, f"a negative size {e} (torch raises)")
        entries.append(e)
    if kind == "i" and abs(value) >= 2 ** 24:
        raise ctx.refuse(name, f"an integer tensor of {int(value)} (int64 in torch; "
                                "float32 holds integers exactly up to 2**24 only)")
    rows = [e for e in entries if isinstance(e, _Size)]
    if not rows:
        return _fixed_constant(ctx, torch.full(tuple(entries), value, dtype=torch.float64),
                                    kind, name)
    dims = tuple(e.v if isinstance(e, _Size) else e for e in entries)
    of = next((e.of for e in rows if e.v == BATCH), None)
    if of is None:
        raise ctx.refuse(name, "a shape with a leading (sequence) dim's size but not the "
                                "batch size: " + LEAD_WHY)
    like = ctx.dims(of)
    leads = [e.lead for e in rows if e.v == LEAD]
    if [x for x in dims if x in splits.ROW] != [x for x in like if x in splits.ROW] or \
            leads != list(range(len(leads))):
        raise ctx.refuse(name, f"a tensor of shape {splits.fmt(dims)} made from the sizes "
                                f"of a {splits.fmt(like)} value: its batch and leading "
                                "dims must be that value's, in order")
    try:
        _check_dims(dims, name, split=True)
    except TailError as exc:
        raise ctx.refuse(name, str(exc).split(": ", 1)[-1]) from None
    base = ctx.b.view(of, splits.flat_dims(like))
    ax = len(splits.flat_dims(like)) - 1
    if splits.width(like) > 1:
        base = ctx.b.slice(base, ax, 0, 1, name)
    W = splits.width(dims)
    if W > 1:
        base = ctx.b.spread(base, W)
    r = ctx.b.map("where", ctx.b.const(1.0), ctx.b.const(value), base)
    return ctx._mk(r, dims, kind)


def _evenly(flat: torch.Tensor) -> tuple[float, float] | None:
    """(start, step) where the float64 values ``flat`` are start + i * step as float32
    (one value repeated: step 0; all NaN: start NaN), else None. (On the CPU: fx may
    have made the tensor on the GPU, from a CUDA tensor the forward reads.)"""
    flat = flat.detach().cpu()
    start = float(flat[0])
    if bool((flat == flat[0]).all()) or bool(torch.isnan(flat).all()):
        return start, 0.0
    step = float(flat[1] - flat[0])
    probe = (torch.arange(flat.numel(), dtype=torch.float64) * step + start).float()
    return (start, step) if torch.equal(probe, flat.float()) else None


def _made_constant(ctx, t: torch.Tensor, what: str) -> Any:
    """A tensor fx made of numbers alone as a constant of the program (a number or an
    ``iota`` along its one dim > 1), or None where it is none (a matrix, values not
    evenly spaced, another dtype, integers of 2**24 or more)."""
    kind = {torch.float32: "f", torch.int64: "i", torch.int32: "i",
            torch.bool: "b"}.get(t.dtype)
    if kind is None or t.numel() == 0 or sum(1 for x in t.shape if x > 1) > 1:
        return None
    flat = t.detach().reshape(-1).double()
    if kind != "f" and bool((flat.abs() >= 2 ** 24).any()):
        return None
    if t.numel() > 1 and _evenly(flat) is None:
        return None
    return _fixed_constant(ctx, t.detach().double(), kind, what)


def _fixed_constant(ctx, t: torch.Tensor, kind: str, name: str) -> Any:
    """A tensor made from numbers alone (``t``, float64 values): a number (one element),
    or an ``iota`` where its elements along its one dim > 1 are start + i * step as
    float32 (constant fills, torch.arange); refused otherwise."""
    dims = tuple(int(x) for x in t.shape)
    if sum(1 for x in dims if x > 1) > 1:
        raise ctx.refuse(name, f"a constant tensor of shape {dims}, varying along two "
                                "dims (a matrix: a tail varies along the features)")
    if t.numel() == 0:
        raise ctx.refuse(name, f"an empty tensor of shape {dims}")
    flat = t.reshape(-1)
    n = flat.numel()
    if kind != "f" and bool((flat.abs() >= 2 ** 24).any()):
        raise ctx.refuse(name, "an integer tensor with values of 2**24 or more (int64 in "
                                "torch; float32 holds integers exactly up to 2**24 only)")
    if n == 1:
        r = ctx.b.view(ctx.b.const(float(flat[0])), dims)
    else:
        ss = _evenly(flat)
        if ss is None:
            raise ctx.refuse(name, "a constant tensor whose elements are not evenly "
                                    "spaced (cupyfuse makes constants along the features "
                                    "as start + i * step)")
        r = ctx.b.view(ctx.b.iota(n, *ss), dims)
    return ctx._wrap(kind, r)


def arange(ctx, args: tuple, kw: dict, name: str) -> Any:
    """torch.arange of numbers (not of the batch size): a constant ``iota``."""
    nums = [a for a in args] + [kw[k] for k in ("start", "end", "step") if k in kw]
    vals = []
    for a in nums:
        e = ctx.env.get(a) if isinstance(a, torch.fx.Node) else a
        if isinstance(e, _Const):
            e = e.v
        if isinstance(e, _Size):
            raise ctx.refuse(name, "a range of the batch size or a leading dim's size "
                                    "(a tensor of as many elements as rows)")
        if isinstance(e, bool) or not isinstance(e, (int, float)) or isinstance(e, Val):
            raise ctx.refuse(name, "a range of something other than numbers")
        vals.append(e)
    pos = list(vals[:len(args)])
    start, end, step = 0, None, 1
    if len(pos) == 1:
        end = pos[0]
    elif len(pos) >= 2:
        start, end = pos[0], pos[1]
        step = pos[2] if len(pos) > 2 else 1
    start = kw.get("start", start) if not isinstance(kw.get("start"), torch.fx.Node) else start
    end = kw.get("end", end) if not isinstance(kw.get("end"), torch.fx.Node) else end
    step = kw.get("step", step) if not isinstance(kw.get("step"), torch.fx.Node) else step
    if end is None:
        raise ctx.refuse(name, "torch.arange without an end (torch raises)")
    ints = all(isinstance(x, int) for x in (start, end, step))
    kind = _factory_dtype(ctx, kw, "i" if ints else "f", name)
    try:
        t = torch.arange(start, end, step, dtype=torch.float64)
    except RuntimeError as exc:
        raise ctx.refuse(name, f"torch raises: {str(exc).splitlines()[0]}") from None
    if kind == "f":   # (float32's own arange, as torch makes it)
        t32 = torch.arange(start, end, step, dtype=torch.float32)
        if t32.shape != t.shape:
            raise ctx.refuse(name, "a range whose length differs in float32 and float64")
    return _fixed_constant(ctx, t, kind, name)

# --- Python's math module on the forward's numbers -----------------------------------
def math_fn(ctx, f: Any, args: tuple, kw: dict, name: str) -> Any:
    """A function of Python's math module of numbers (``math.log(h.shape[1])``,
    ``math.sqrt(d_k)``): computed here, a number of the program (torch meets it with
    float32 tensors as eager does)."""
    vals = []
    for a in list(args) + list(kw.values()):
        e = ctx.env.get(a) if isinstance(a, torch.fx.Node) else a
        if isinstance(e, _Const):
            e = e.v
        if isinstance(e, _Size):
            if e.v == BATCH:
                ctx._refuse_batch_size(f"math.{name}")
            raise ctx.refuse(f"math.{name}", "uses a leading (sequence) dim's size as a "
                                              "number")
        if not isinstance(e, (int, float)) or isinstance(e, Val):
            raise ctx.refuse(f"math.{name}", "a function of Python's math module of a "
                              "tensor (torch raises for tensors of more than one element): "
                              "use the torch function")
        vals.append(e)
    try:
        r = f(*vals[:len(args)], **dict(zip(kw, vals[len(args):])))
    except (ValueError, OverflowError, TypeError, ZeroDivisionError) as exc:
        raise ctx.refuse(f"math.{name}", f"Python raises {type(exc).__name__} on these "
                          f"numbers ({', '.join(map(repr, vals))})") from exc
    if not isinstance(r, (int, float)) or isinstance(r, bool):
        raise ctx.refuse(f"math.{name}", f"a result of type {type(r).__name__}")
    return _Const(r)


# --- spellings ---------------------------------------------------------------------------
@lowering.function(torch.tensor, torch.as_tensor)
def _tensor_fn(ctx, node, args, kw, name):
    if not (args and type(args[0]) in (int, float) and kw.get("dtype") in (None, torch.float32)
            and len(args) == 1):
        raise ctx.refuse_function(node.target, name)
    # torch.tensor(0.5, device=h.device): a 0-d tensor of a number, which meets the
    # program's float32 values as that number (an int: int64, the same there)
    if kw.get("requires_grad"):
        raise ctx.refuse(name, "a tensor that requires grad")
    return _Const(float(args[0]) if kw.get("dtype") is torch.float32 else args[0])


@lowering.function(torch.zeros, torch.ones)
def _zeros_fn(ctx, node, args, kw, name):
    shape = kw.get("size", _sizes_arg(ctx, args))
    return factory(ctx, 0.0 if node.target is torch.zeros else 1.0, shape,
                   _factory_dtype(ctx, kw, "f", name), name)


@lowering.function(torch.full)
def _full_fn(ctx, node, args, kw, name):
    value, kind = _fill_kind(ctx, _arg(args, kw, 1, "fill_value"), name)
    return factory(ctx, value, _arg(args, kw, 0, "size"), _factory_dtype(ctx, kw, kind, name), name)


@lowering.function(torch.arange)
def _arange_fn(ctx, node, args, kw, name):
    return arange(ctx, args, kw, name)


@lowering.function(torch.empty, torch.empty_like)
def _empty_fn(ctx, node, args, kw, name):
    raise ctx.refuse(name, "an uninitialised tensor (its values are whatever the memory held): "
                           "make it with torch.zeros / torch.full")


@lowering.function(torch.zeros_like, torch.ones_like, torch.full_like)
def _like_fn(ctx, node, args, kw, name):
    f = node.target
    if kw.get("dtype") not in (None, torch.float32):
        raise ctx.refuse(name, "another dtype")
    base = ctx.env.get(args[0]) if isinstance(args[0], torch.fx.Node) else None
    if kw.get("dtype") is None and isinstance(base, (_Bool, _Int, _RawInt)):
        kind = "a boolean" if isinstance(base, _Bool) else "an integer"
        raise ctx.refuse(name, f"of {kind} tensor: torch makes "
                               f"{'a bool' if kind == 'a boolean' else 'an int64'} tensor (its "
                               "fill value converted), not a float32 one; pass "
                               "`dtype=torch.float32` or fill like a float tensor")
    like = ctx.val(args[0], name)
    v = 0.0 if f is torch.zeros_like else 1.0 if f is torch.ones_like else \
        ctx.number(_arg(args, kw, 1, "fill_value"), name)
    # v with the argument's shape (a select, so a NaN in it does not leak in)
    return Val(ctx.b.map("where", ctx.b.const(1.0), ctx.b.const(v), like))


@lowering.method("new_zeros", "new_ones", "new_full")
def _new_method(ctx, node, self_, args, kw, name):
    m = node.target
    base = ctx.env.get(self_)
    # the dtype of the tensor it is a method of, unless given
    own = "b" if isinstance(base, _Bool) else "i" if isinstance(base, _Int) else "f"
    if m == "new_full":
        value, _ = _fill_kind(ctx, _arg(args, kw, 2, "fill_value"), name)
        shape = _arg(args, kw, 1, "size")
    else:
        value = 0.0 if m == "new_zeros" else 1.0
        shape = kw.get("size", _sizes_arg(ctx, args[1:]))
    return factory(ctx, value, shape, _factory_dtype(ctx, kw, own, name), name)


@lowering.method("new_empty", "new_tensor")
def _new_empty_method(ctx, node, self_, args, kw, name):
    raise ctx.refuse(name, "an uninitialised tensor (its values are whatever the memory held): "
                           "make it with new_zeros / new_full" if node.target == "new_empty"
                     else "a tensor of data given in the forward")
