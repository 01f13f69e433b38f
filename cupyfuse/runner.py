"""The runner: how a call of a fused module or of ``fused_linear`` reaches its program and
its launches.

A call goes, first to last: the specialised call of its module or tail
(:mod:`cupyfuse.fastpath`), the prepared launches found by its key (input shapes and
strides, the module's watched attributes and structure, the dispatch settings), else the
general path: the program for these input shapes (traced and translated once per mode
and shapes), run on the CPU with torch ops or on CUDA by :func:`cupyfuse.backend.execute.run_gpu`,
after which the launches for the next call like it are prepared.
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
import sys
import types
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.fx
import torch.nn as nn
import torch.nn.modules.module as _tmod

from cupyfuse import caches
from cupyfuse import config
from cupyfuse.frontend import trace as tracing, translate as translation
from cupyfuse.ir import rewrite
from cupyfuse.backend import gemm
from cupyfuse.backend import prepared as _prep
from cupyfuse import fastpath as _fastpath
from cupyfuse.interop import Call, _as_torch, describe
from cupyfuse.backend.cpu import empty_batch, run_cpu
from cupyfuse.ir.derived import Derived
from cupyfuse.ops import registry
from cupyfuse.ir.program import BATCH, BatchStats, Program, TailError, count_batch
from cupyfuse.backend import execute
from cupyfuse import autograd, tracking
from cupyfuse.interop import PreparedWeight


# ---------------------------------------------------------------------------------
# prepared launches (cupyfuse.backend.prepared): repeated small-batch calls
def _meta(a: Any) -> tuple | None:
    """(address, shape, strides in elements, device index, is_cupy) of a float32 CUDA
    operand; None for anything else (which takes the general path)."""
    if isinstance(a, torch.Tensor):
        if a.dtype is not torch.float32 or not a.is_cuda:
            return None
        return a.data_ptr(), a.shape, a.stride(), a.get_device(), False
    tp = type(a)
    if tp.__module__.startswith("cupy") and tp is _cupy_ndarray():
        if a.dtype.char != "f":
            return None
        mem = a.data
        return mem.ptr, a.shape, tuple([s >> 2 for s in a.strides]), mem.device_id, True
    return None


_CUPY_ND: list = []


def _cupy_ndarray() -> Any:
    """cupy.ndarray, or a class nothing is an instance of when CuPy is not installed."""
    if not _CUPY_ND:
        try:
            import cupy

            _CUPY_ND.append(cupy.ndarray)
        except Exception:  # pragma: no cover - depends on the install
            _CUPY_ND.append(type("NoCupy", (), {}))
    return _CUPY_ND[0]


def _src_meta(t: Any) -> tuple | None:
    return (tuple(t.shape), tuple(t.stride())) if isinstance(t, torch.Tensor) else None


def _stream_for(dev: int, is_cupy: bool) -> int | None:
    """The caller's stream on ``dev``, or None when ``dev`` is not the current device."""
    if is_cupy:
        import cupy

        if cupy.cuda.runtime.getDevice() != dev:
            return None
        return cupy.cuda.get_current_stream().ptr
    if _prep.current_device() != dev:
        return None
    return _prep.torch_stream(dev)


def _attr(obj: Any, name: str) -> Any:
    """getattr for module paths, without nn.Module.__getattr__'s slow fallback chain."""
    d = obj.__dict__
    v = d.get(name, _MISSING)
    if v is not _MISSING:
        return v
    for store in ("_parameters", "_buffers", "_modules"):
        sd = d.get(store)
        if sd is not None and name in sd:
            return sd[name]
    return getattr(obj, name)


_MISSING = object()
_F32 = torch.float32
_grad_enabled = torch.is_grad_enabled
_autocast_on = torch.is_autocast_enabled
#: 16-bit floats: a call reading them (or under autocast) runs torch's own ops
HALF = (torch.bfloat16, torch.float16)
_warned_torch: set = set()


def torch_forward(module: nn.Module, args: tuple, why: str) -> Any:
    """A fused module's call with torch's own ops -- its original forward -- where the
    fused kernels would not compute what torch does: under autocast (torch's dtypes per
    op) or with 16-bit operands (the 16-bit engine is not built yet); warns once per
    class and reason."""
    plain = [a.value if isinstance(a, _Default) else a for a in args]
    head = _lm_head(module)
    if head is not None:   # a Linear head and its cross entropy: cupyfuse.lmhead's path
        hit = head(module, plain)
        if hit is not None:
            return hit
    key = (type(module), why)
    if key not in _warned_torch:
        _warned_torch.add(key)
        import warnings

        warnings.warn(f"cupyfuse: {type(module).__name__} runs its original forward with "
                      f"torch ops ({why}: the fused kernels are float32 only)", stacklevel=3)
    base = type(module)._cupyfuse_base
    return base.forward(module, *plain)


def _scalars(module: nn.Module) -> tuple:
    """The Python numbers, strings and bools of a module and its submodules (what a trace
    bakes in as constants when the forward reads them)."""
    return tuple((n, k, v) for n, m in module.named_modules() for k, v in m.__dict__.items()
                 if type(v) in (int, float, str, bool) and not k.startswith("_"))


def _lm_head(module: nn.Module) -> Any:
    """The module's forward as a cupyfuse.lmhead head (a Linear and its cross entropy),
    or None; traced once, again when a number, string or bool attribute changes."""
    snap = _scalars(module)
    got = module.__dict__.get("_cupyfuse_lm_head")
    if got is not None and got[0] == snap:
        return got[1]
    head = None
    try:
        from cupyfuse import api, lmhead

        traced = api._trace_original(module, type(module)._cupyfuse_base)
        head = lmhead.head_of(traced.graph, module)
    except Exception:   # (an untraceable forward runs its original: no head)
        head = None
    module.__dict__["_cupyfuse_lm_head"] = (snap, head)
    return head


def _sixteen_bit(module: nn.Module) -> Any:
    for t in itertools.chain(module.parameters(), module.buffers()):
        if t.dtype in HALF:
            return t.dtype
    return None


def _nothing(d: dict) -> tuple:
    return ()


def _getter(module: nn.Module, source: Any) -> Callable[[nn.Module], Any]:
    """module -> what a program source names now: a dotted attribute path walked with the
    dict lookups that found it in ``module`` (the general walk where the structure has
    changed since), or the tensor the program holds."""
    if isinstance(source, Derived):
        return source.value   # evaluated, or its cached tensor while the leaves are unchanged
    if not isinstance(source, str):
        return lambda m, t=source: t
    path = tuple(source.split("."))
    steps = []
    obj: Any = module
    for name in path:
        d = getattr(obj, "__dict__", {})
        store = None if name in d else next(
            (s for s in ("_parameters", "_buffers", "_modules") if name in d.get(s, ())), "")
        steps.append((store, name))
        obj = _attr(obj, name)
    steps_t = tuple(steps)

    def walk(m: nn.Module) -> Any:
        for part in path:
            m = _attr(m, part)
        return m

    if any(st == "" for st, _ in steps_t):
        return walk

    def get(m: nn.Module) -> Any:
        t: Any = m
        try:
            for store, name in steps_t:
                d = t.__dict__
                t = d[name] if store is None else d[store][name]
            return t
        except (KeyError, AttributeError, TypeError):
            return walk(m)
    get.steps = steps_t   # (fastpath.py writes the same walk into its specialised calls)
    return get


def _try_prepare(prog: Program, batch: int, dev: int, in_meta: list, sources: Sequence[Any],
                 allow_bn: bool) -> Any:
    u = _prep.usable(prog)
    if u is None:
        return None
    for n in u[0].nodes:   # a BatchNorm's counter is bumped by a kernel: one int64
        if n.kind == "bn" and n.attrs[2]:
            nbt = sources[n.attrs[2][2]] if n.attrs[2][2] is not None else None
            if nbt is not None and not (isinstance(nbt, torch.Tensor) and
                                        nbt.dtype == torch.int64 and nbt.numel() == 1):
                return None   # the general path raises its error
    return _prep.prepare(u[0], batch, dev, in_meta, [_src_meta(t) for t in sources],
                         allow_bn=allow_bn, small_weights_only=u[1])


_fast_fn: dict[tuple, Any] = caches.register("function prepared launches", {})


_TORCH_TYPES = tracking.TENSOR_TYPES


def _fast_operands(x: Any, weight: Any, bias: Any, extra: tuple) -> tuple | None:
    """(key, x's address, device, is_cupy, operand addresses [x, extras...], source
    addresses [weight, bias?], weight owner) of a fused_linear call's operands for its
    prepared launches, or None when they do not qualify. One function for the lookup and
    for the store, so both build the same key: per operand (shape, strides, device), then
    the extras' numbers, the dispatch key."""
    if not extra and type(x) is torch.Tensor and type(weight) in _TORCH_TYPES and \
            (bias is None or type(bias) in _TORCH_TYPES):
        # torch tensors, no extras (the common call): the same key, read inline (~1 us
        # less than the general form below)
        if x.dtype is not _F32 or weight.dtype is not _F32 or not x.is_cuda:
            return None
        dev = x.get_device()
        if bias is None:
            bk = None
            sptrs = [weight.data_ptr()]
        else:
            if bias.dtype is not _F32:
                return None
            bk = (bias.shape, bias.stride(), bias.get_device())
            sptrs = [weight.data_ptr(), bias.data_ptr()]
        key = (x.shape, x.stride(), dev, False, weight.shape, weight.stride(),
               weight.get_device(), bk, (), (), gemm.dispatch_key())
        return key, dev, False, [x.data_ptr()], sptrs, weight
    xm = _meta(x)
    if xm is None:
        return None
    if isinstance(weight, PreparedWeight):
        w, owner = weight.source, weight.tensor
    else:
        w, owner = weight, (weight if isinstance(weight, torch.Tensor) else None)
    wm = _meta(w)
    if wm is None:
        return None
    bm = _meta(bias) if bias is not None else None
    if bias is not None and bm is None:
        return None
    em = []
    nums = []   # a Python number among the extras: a constant of the program, keyed by value
    for e in extra:
        if type(e) is float or type(e) is int:
            nums.append((type(e), repr(e)))
            continue
        m = _meta(e)
        if m is None:
            return None
        em.append(m)
        nums.append(None)
    key = (xm[1], xm[2], xm[3], xm[4], wm[1], wm[2], wm[3],
           None if bm is None else (bm[1], bm[2], bm[3]), tuple([(m[1], m[2], m[3]) for m in em]),
           tuple(nums), gemm.dispatch_key())
    sptrs = [wm[0]] + ([bm[0]] if bm is not None else [])
    return key, xm[3], xm[4], [xm[0]] + [m[0] for m in em], sptrs, owner


def _fused_linear_fast(x: Any, weight: Any, bias: Any, tail: Any, extra: tuple,
                       precision: str | None = None) -> Any:
    """fused_linear through a prepared launch; None when none applies (general path,
    which a grad-mode call differentiating something takes: cupyfuse.autograd)."""
    if _grad_enabled() and fn_wants_grad(x, weight, bias, extra, tail):
        return None
    if not extra:
        spec = _fn_specs.get(tail)
        if spec is not None:   # this call's decisions, made before (fastpath.py)
            hit = spec(x, weight, bias, precision)
            if hit is not None:
                return hit
    ops = _fast_operands(x, weight, bias, extra)
    if ops is None:
        return None
    key, dev, is_cupy, in_ptrs, sptrs, owner = ops
    key = (tail,) + key + (tracing.global_values(tracing.global_reads(tail)),)
    ent = _fast_fn.get(key)
    if ent is None:
        return None
    pr, fixed = ent
    stream = _stream_for(dev, is_cupy)
    if stream is None:
        return None
    if fixed:
        sptrs += fixed
    # the weight's owner keys its cached split (the engine's GEMM; a CuPy weight has one
    # only through a PreparedWeight); a GEMV's coefficients also read the bias and the
    # tensors the tail holds (their versions key the cache)
    objs: tuple = (owner,)
    if pr.all_sources:
        if bias is not None and not isinstance(bias, torch.Tensor):
            return None
        objs = (owner,) + ((bias,) if bias is not None else ()) + tuple(_fast_holds[key])
    hit = pr(in_ptrs, sptrs, stream, is_cupy, objs, precision)
    if hit is not None and not extra and not is_cupy and config.FASTPATH:
        _specialise_fn(tail, key, ent, x, weight, bias, dev, stream, precision)
    return hit


def _specialise_fn(tail: Any, key: tuple, ent: tuple, x: Any, weight: Any, bias: Any,
                   dev: int, stream: int, precision: str | None) -> None:
    """After a hit of fused_linear's entry ``key``: the tail's second hit in a row of the
    same entry builds its specialised call (one per tail object, the latest entry's; once
    per ready plan, as _Runner._specialise). "In a row" per tail: a forward calling two
    fused tails in turn gets both."""
    if _fn_last.get(tail) != key:
        if len(_fn_last) >= 4 * _MAX_FN_TRACES:
            _fn_last.clear()
        _fn_last[tail] = key
        return
    rd = ent[0]._ready.get((stream, False))
    st = _fn_spec_state.get(tail)
    if rd is None or (st is not None and st[0] == key and st[1] is rd[4]):
        return
    if tail not in _fn_specs and len(_fn_specs) >= _MAX_FN_TRACES:
        oldest = next(iter(_fn_specs))
        del _fn_specs[oldest]
        _fn_spec_state.pop(oldest, None)
    _fn_spec_state[tail] = (key, rd[4])
    _fn_specs[tail] = _fastpath.build_function(tail, x, weight, bias, ent, dev, stream,
                                               precision)


# the specialised calls of fused_linear per tail object (fastpath.build_function), the
# entry key and ready plan each was built for, and each tail's last entry hit
_fn_specs: dict[Any, Any] = caches.register("function specialised calls", {})
_fn_spec_state: dict[Any, tuple] = caches.register("function specialised states", {})
_fn_last: dict[Any, tuple] = caches.register("function last entries", {})


def _remember_fast_fn(tail: Any, x: Any, weight: Any, bias: Any, extra: tuple, prog: Program,
                      inputs: Sequence[torch.Tensor], sources: Sequence[Any]) -> None:
    """After a general-path call: prepare the launches for the next call like it."""
    ops = _fast_operands(x, weight, bias, extra)
    if ops is None:
        return
    key = (tail,) + ops[0] + (tracing.global_values(tracing.global_reads(tail)),)
    if key in _fast_fn:
        return
    if len(_fast_fn) >= 4 * _MAX_FN_TRACES:
        oldest = next(iter(_fast_fn))
        del _fast_fn[oldest]
        _fast_holds.pop(oldest, None)
    in_meta = [(tuple(t.shape), tuple(t.stride())) for t in inputs]
    pr = _try_prepare(prog, inputs[0].shape[0], ops[1], in_meta, sources, allow_bn=False)
    nfixed = 1 + (bias is not None)
    if pr is not None and any(not isinstance(t, torch.Tensor) for t in sources[nfixed:]):
        pr = None
    fixed = [t.data_ptr() for t in sources[nfixed:]] if pr is not None else []
    _fast_fn[key] = (pr, fixed) if pr is not None else None
    if pr is not None:
        _fast_holds[key] = list(sources[nfixed:])  # the fixed tensors stay alive
        owner = ops[5]
        if owner is not None:
            # the entry is keyed on shapes, not on the weight: its kept workspace goes back
            # when the weight that made it dies (a later call allocates it again)
            weakref.finalize(owner, _release_prepared, weakref.ref(pr))


_fast_holds: dict[tuple, list] = caches.register("function held tensors", {})


#: the tensors each tail function's program reads besides the weight and bias (the last
#: call's): whether a later grad-mode call differentiates one (fn_wants_grad)
_fn_tensors: dict[Any, tuple] = caches.register("function tail tensors", {})


def fn_held(tail: Any, tensors: Sequence[Any]) -> None:
    """Record the tensors ``tail``'s program reads besides the weight and bias."""
    held = tuple(t for t in tensors if isinstance(t, torch.Tensor))
    if held or tail in _fn_tensors:
        if tail not in _fn_tensors and len(_fn_tensors) >= 4 * _MAX_FN_TRACES:
            _fn_tensors.pop(next(iter(_fn_tensors)))
        _fn_tensors[tail] = held


def fn_wants_grad(x: Any, weight: Any, bias: Any, extra: tuple, tail: Any) -> bool:
    """Whether a grad-mode fused_linear call differentiates something (then it takes the
    general path, cupyfuse.autograd): an operand, or a tensor the tail holds, requiring
    grad."""
    if isinstance(weight, PreparedWeight):
        weight = weight.tensor
    if any(getattr(t, "requires_grad", False) for t in (x, weight, bias) + tuple(extra)):
        return True
    return any(t.requires_grad for t in _fn_tensors.get(tail, ()))


def _release_prepared(ref: Any) -> None:
    pr = ref()
    if pr is not None:
        pr.release()


def fused_linear_prepared(x: Any, weight: Any, bias: Any, tail: Callable,
                          precision: str | None = None) -> Any:
    """``fused_linear(x, weight, bias, tail)`` when a prepared launch exists for a call like
    this one (same tail object, shapes, strides, device, operand kinds); else None."""
    return _fused_linear_fast(x, weight, bias, tail, (), precision)


# functional API
_fn_traces: dict[Any, Any] = caches.register("function programs", {})
#: traced tail functions kept (oldest dropped first); define a tail function once and
#: reuse it: a fresh lambda per call is traced again each time
_MAX_FN_TRACES = 64


def _as_operand(obj: Any, name: str, op: str) -> tuple[torch.Tensor, str]:
    if isinstance(obj, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} is a bool ({obj!r}): {op} takes tensors and arrays, "
                        "and Python numbers after the weight and bias as constants of the "
                        "tail; pass a flag as a number (`1.0 if flag else 0.0`) or close "
                        "the tail function over it")
    try:
        t, kind = _as_torch(obj, name)
    except TypeError as e:
        raise TypeError(f"{op}: {e}") from None
    if t.dtype != torch.float32:
        raise TypeError(f"{op}: {name} must be float32, got {describe(obj)}")
    return t.detach(), kind


def _lead_rows(tens: list[torch.Tensor]) -> list[torch.Tensor]:
    """(batch, seq..., features) inputs as the batch * seq rows a program with leading
    dims runs (views where they can be); an input without the features ((batch, seq...),
    a mask: translation._input_dims) as one number per row."""
    nd = tens[0].dim()
    return [t.reshape((-1,) + (1,) * (t.dim() - 2) + (t.shape[-1],)) if t.dim() == nd
            else t.reshape((-1,) + (1,) * (t.dim() - 1)) for t in tens]


def _broadcast_rows(tens: list[torch.Tensor], prog: Program, name: str) -> list[torch.Tensor]:
    """Inputs of one row against a batch (torch broadcasts a (1, N) input): the batch's
    rows, a stride-0 view (x itself copied: the GEMM reads its rows); the kernels index
    every input by the batch's rows. A result computed from one-row inputs only is one
    row in torch: refused (it would come back with the batch's rows)."""
    B = max(t.shape[0] for t in tens)
    if B <= 1 or all(t.shape[0] == B for t in tens):
        return tens
    one = {i for i, t in enumerate(tens) if t.shape[0] == 1}
    for k, deps in enumerate(prog.result_inputs()):
        if deps <= one:
            raise TailError(f"{name}: {'result ' + str(k) if prog.outs_type else 'the result'} "
                            "is computed from one-row inputs only (torch gives it one row) "
                            f"while other inputs have {B} rows: pass inputs with the batch's "
                            "rows")
    out = []
    for i, t in enumerate(tens):
        if t.dim() >= 1 and t.shape[0] == 1:
            t = t.expand((B,) + tuple(t.shape[1:]))
            if i == 0:
                t = t.contiguous()
        out.append(t)
    return out


def _identity(h: torch.Tensor) -> torch.Tensor:
    return h


def _function_program(fn: Callable, x: torch.Tensor, n: int, has_bias: bool,
                      extra: Sequence[torch.Tensor],
                      numbers: tuple[tuple[int, int | float], ...] = ()) -> Program:
    # (the module-level numbers the function reads: fx bakes them in)
    key = (fn, tuple(x.shape[1:]), n, has_bias, tuple(tuple(e.shape[1:]) for e in extra),
           tuple([(i, tracing._value_key(v)) for i, v in numbers]),
           tracing.global_values(tracing.global_reads(fn)), registry.generation())
    prog = _fn_traces.get(key)
    if prog is not None:
        return prog
    if len(_fn_traces) >= _MAX_FN_TRACES:  # a new lambda per call must not grow memory
        _fn_traces.pop(next(iter(_fn_traces)))
    traced = tracing.trace(fn, getattr(fn, "__name__", "tail"))
    from cupyfuse.ir.program import Builder

    b = Builder(Program(n_inputs=1 + len(extra)))
    b.p.sources.append("__weight__")
    xin = b.input(0, (BATCH, x.shape[-1]))   # leading dims (batch, seq, K): rows
    h = b.gemm(xin, "__weight__", n, False)
    if has_bias:
        h = b.map("add", h, b.param("__bias__", (n,)))
    # translate the tail with h as its first input: splice by translating a program
    # whose input 0 is h, then remapping
    sub = translation.translate(traced, traced.root, [tuple(x.shape[:-1]) + (n,)] +
                            [tuple(e.shape) for e in extra], allow_no_gemm=True,
                            numbers=numbers)
    remap: dict[int, int] = {}
    for i, node in enumerate(sub.nodes):
        if node.kind == "input":
            k = node.attrs[0]
            if k == 0:
                remap[i] = b.view(h, node.dims)
            else:
                remap[i] = b.input(k, node.dims)
            continue
        if node.kind == "param":
            src = sub.sources[node.attrs[0]]
            if isinstance(src, str):  # a tensor the function closes over (fx made it an attr)
                # (the tensor itself: a grad-mode call differentiates it where it requires
                # grad; every forward runs under no_grad)
                src = _resolve(traced.root, src)
            remap[i] = b.param(src, node.dims)
            continue
        if node.kind == "gemm":
            raise TailError(f"{traced.name}: a tail function may not contain another Linear")
        args = tuple(remap[a] for a in node.args)
        from cupyfuse.ir.program import Node

        attrs = node.attrs
        if node.kind == "bn" and node.attrs[2]:
            raise TailError(f"{traced.name}: BatchNorm updating running stats inside a tail function")
        remap[i] = b.add(Node(node.kind, node.op, args, attrs, node.dims))
    if isinstance(sub.outs_type, BatchStats):
        raise TailError(f"{traced.name}: a tail function returns a value of the batch rows; "
                        "a sum or mean over the whole batch (a loss's reduction) is fused in "
                        "modules (cupyfuse.from_model): return the per-row values here")
    if sub.outs_type is not None:
        raise TailError(f"{traced.name}: a tail function returns one tensor (it returns "
                        f"{len(sub.more_outs) + 1}); fuse a module that returns several with "
                        "cupyfuse.from_model")
    b.p.out = remap[sub.out]
    b.p.squeezes_batch = sub.squeezes_batch
    b.p.one_row_error = sub.one_row_error
    b.p.lead, b.p.lead_out = sub.lead, sub.lead_out
    prog = rewrite.rewrite(b.p.own_results())
    _fn_traces[key] = prog
    return prog


# ---------------------------------------------------------------------------------
# modules
def _resolve(module: nn.Module, path: str) -> Any:
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


_SCALARS = (bool, int, float, str, type(None))
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType,
              types.BuiltinMethodType, functools.partial)


def _hooks_error(module: nn.Module, root_called: bool,
                 traced: Callable[[], "tracing.Traced | None"] | None = None
                 ) -> TailError | None:
    """A forward hook or pre-hook that the eager model would run and the fused call would
    not (on a submodule, or on the model itself where torch does not call it: from_model's
    wrapped model; global hooks): refused, naming where. ``torch.nn.utils.prune`` and
    the old ``weight_norm`` work through pre-hooks (their parametrize forms need none).
    ``traced``: gives the forward's trace (or None), for the line that calls the hooked
    module."""
    if _tmod._global_forward_hooks or _tmod._global_forward_pre_hooks:
        return TailError(f"{type(module).__name__}: a global forward hook is registered "
                         "(nn.modules.module.register_module_forward_hook / _pre_hook); the "
                         "fused forward would not run it for each submodule as eager does: "
                         "remove it, or call the eager model")
    for name, m in module.named_modules():
        if "forward" in m.__dict__:
            what = f"submodule `{name}`" if name else "the model"
            return TailError(
                f"{type(module).__name__}: {what} ({type(m).__name__}) has a `forward` set on "
                "the instance, which torch calls and cupyfuse would not (it fuses the class's "
                "forward): set it on a subclass, or call the eager model")
        if (m._forward_hooks or m._forward_pre_hooks) and (name or not root_called):
            what = f"submodule `{name}`" if name else "the model"
            return TailError(
                f"{type(module).__name__}: {what} ({type(m).__name__}) has a forward hook or "
                "pre-hook, which the fused forward would not run (torch.nn.utils.prune and "
                "the old nn.utils.weight_norm work through one: use prune.remove or "
                "nn.utils.parametrizations.weight_norm, or remove the hook)"
                + _call_line(traced() if traced is not None else None, name))
    return None


def _call_line(traced: "tracing.Traced | None", name: str) -> str:
    """``\n  at FILE:LINE in forward: code`` of the forward's first call of submodule
    ``name`` (of a module inside it, where fx traces through it), or of the forward's
    ``def`` for the model itself; "" where none is found."""
    if traced is None:
        return ""
    import inspect

    if not name:
        line = tracing._def_line(traced.forward)
        return f"\n  at {line}" if line else ""
    try:
        own = inspect.getsourcefile(traced.forward)
    except (TypeError, AttributeError):
        own = None
    for n in traced.graph.nodes:
        if n.op == "call_module" and (n.target == name or str(n.target).startswith(name + ".")):
            w = tracing.where(n, own)
            if w:
                return f"\n  at {w}"
    return ""


def _embedding_error(module: nn.Module, runner: "_Runner", args: tuple) -> TailError | None:
    """An integer x (token ids) that the forward looks up in an embedding (nn.Embedding,
    nn.EmbeddingBag, F.embedding): refused naming the lookup and its line (any other
    integer x is a TypeError: a Linear of it raises in torch)."""
    traced = _trace_of(module, runner, args)
    if traced is None:
        return None
    x = next((n for n in traced.graph.nodes if n.op == "placeholder"), None)
    root = traced.root
    for u in (x.users if x is not None else ()):
        emb = u.op == "call_function" and u.target in (torch.nn.functional.embedding,
                                                      torch.nn.functional.embedding_bag)
        if u.op == "call_module" and root is not None:
            try:
                emb = isinstance(root.get_submodule(u.target), (nn.Embedding, nn.EmbeddingBag))
            except AttributeError:
                emb = False
        if emb:
            try:
                own = __import__("inspect").getsourcefile(traced.forward)
            except (TypeError, AttributeError):
                own = None
            line = tracing.where(u, own)
            what = f"{u.target} ({type(root.get_submodule(u.target)).__name__})" \
                if u.op == "call_module" else u.target.__name__
            return TailError(f"{traced.name}: cannot fuse `{what}`: token ids (the integer input "
                             "x) looked up in an embedding: not fused (cupyfuse fuses Linear + "
                             "tail models); run the embedding outside and pass its output"
                             + (f"\n  at {line}" if line else ""))
    return None


def _trace_of(module: nn.Module, runner: "_Runner", args: tuple) -> "tracing.Traced | None":
    """The trace of the module's forward for a call with these arguments (its None / bool
    ones specialised), for a refusal's line: the one made already, else one made now (None
    where tracing fails)."""
    left = runner.left_at(args)
    if left in runner.traces:
        return runner.traces[left]
    try:
        return runner.trace_fn(module, runner.concrete(left))
    except Exception:   # noqa: BLE001 - the refusal goes out without a line then
        return None


def _structure_parts(mods: Sequence[nn.Module], root_called: bool) -> tuple[list, list, list]:
    """What :func:`_structure` reads of the watched modules, gathered once: their hook
    dicts (the root's left out where torch calls it), the live views of their
    children, parameters and buffers, and their attribute dicts (whose sizes tell an
    attribute added since: a ``forward`` set on an instance)."""
    hooks = [h for i, m in enumerate(mods) if i or not root_called
             for h in (m._forward_hooks, m._forward_pre_hooks)]
    views = [v for m in mods for v in (m._modules.values(), m._parameters.values(),
                                       m._buffers.values())]
    # (the root's own dict is read from the module each call: the runner holds none of
    # the root, see _Runner.remember)
    return hooks, views, [m.__dict__ for m in mods[1:]]


def _structure(parts: tuple[list, list, list], root: dict) -> tuple | None:
    """The identities of the watched modules' children, parameters and buffers (None
    slots included) and the sizes of their attribute dicts (``root``: the root module's
    ``__dict__``; the others' in ``parts``), for the prepared launches' key: a submodule
    swapped, a bias added, a parameter replaced or an attribute added (an instance
    ``forward``) misses it (the general path retraces or refuses). None where a forward
    hook is registered (the general path refuses). ~1 us for a small model."""
    if _tmod._global_forward_hooks or _tmod._global_forward_pre_hooks or any(parts[0]):
        return None
    return (tuple(map(id, itertools.chain.from_iterable(parts[1]))) + (len(root),)
            + tuple(map(len, parts[2])))


def _watched(v: Any) -> bool:
    """Whether a module attribute is a value fx bakes into a trace that the mode key and
    the prepared launches' snapshot follow by value (numbers, strings, None) or by
    identity (functions: ``self.act = torch.tanh`` rebound to torch.sigmoid)."""
    return isinstance(v, _SCALARS) or isinstance(v, _FUNCTIONS) or (
        type(v) is tuple and len(v) <= 8 and all(isinstance(x, _SCALARS) for x in v))


def _mode_key(module: nn.Module) -> tuple:
    """What the traced program depends on besides tensors: every submodule's type, its
    train/eval flag, which of its parameter and buffer slots are None (a Linear's bias
    added later) and its plain Python attributes (a scale factor, an eps, a pool size...,
    functions by identity), so that changing ``model.scale = 3.0`` or swapping
    ``model.act = nn.SiLU()`` after a call retraces instead of using the old program."""
    key = []
    for m in module.modules():
        # (values by type and repr: 0.0 and -0.0, 1 and 1.0 make different programs)
        attrs = tuple(sorted((k, tracing._value_key(v)) for k, v in m.__dict__.items()
                             if _watched(v) and not k.startswith("_")))
        d = m.__dict__
        # the parameters' and buffers' names and shapes (None slots included: a bias added,
        # a buffer registered, a (6,) buffer rebound as (6, 1) make another program)
        slots = tuple((k, None if v is None else tuple(v.shape))
                      for k, v in itertools.chain(d["_parameters"].items(),
                                                  d["_buffers"].items()))
        key.append((type(m), type(m).forward, tuple(d["_modules"]), m.training, attrs, slots))
    # and the module-level values its forwards read, and containers and plain objects
    # among its attributes (fx bakes them in too)
    key.append(tracing.global_values(tracing.global_reads(module)
                                     + tracing.attribute_reads(module)))
    return tuple(key)


#: the argument types a prepared launch's key holds (tensors by shape and strides, the
#: others by value)
_KEYED_ARGS = (bool, int, float, torch.Tensor)


class _Default:
    """A forward argument a keyword call leaves at its None or bool default before an
    argument it passes (``fm(x, y=t)`` of ``forward(self, x, flag=False, y=None)``)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _forward_params(forward: Any) -> list[tuple[str, Any]]:
    """(name, default) of a forward's arguments after self, in order, up to any *args or
    **kwargs (fx's placeholders, one per argument); the default is ``_NO_DEFAULT`` where
    there is none."""
    import inspect

    out = []
    for i, p in enumerate(inspect.signature(forward).parameters.values()):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            break
        if i:
            out.append((p.name, _NO_DEFAULT if p.default is p.empty else p.default))
    return out


_NO_DEFAULT = object()


class _Runner:
    """Per-module state: how to trace it, and its programs per (mode, input shapes).

    ``trace_fn(module, concrete)`` traces the forward over ``module`` specialised on
    ``concrete`` (argument name ->
    the None or bool a call leaves it at: torch.fx's concrete_args, so that a forward's
    ``if y is not None:`` or ``if flag:`` follows the call); ``forward`` is the function
    traced, whose signature says which arguments a call leaves at such a default."""

    def __init__(self, trace_fn: Callable[..., tracing.Traced], module: nn.Module | None = None,
                 mode: tuple | None = None, forward: Any = None) -> None:
        eager = module is not None   # (traced now: the module's forward at the call after)
        self.trace_fn = trace_fn
        self.forward = forward
        self._params: list[tuple[str, Any]] | None = None
        # the traces per specialisation (a tuple of (argument, value)), all of one mode
        self.traces: dict[tuple, tracing.Traced] = {}
        if eager:
            # the trace of a call with x alone (the None/bool defaults specialised); where
            # that fails (a forward that needs an argument it leaves at None), the general
            # one: only such calls raise then, at their first call
            left = self.left_at((None,))
            try:
                self.traces[left] = trace_fn(module, self.concrete(left))
            except TailError:
                if not left:
                    raise
                first = sys.exc_info()[1]
                try:
                    self.traces[()] = trace_fn(module, {})
                except TailError:
                    raise first from None
            tracing.check_has_linear(next(iter(self.traces.values())))
        # the module's _mode_key when it was traced: a new program for the same mode
        # (other input shapes) reuses the trace
        self.traced_mode = mode if eager else None
        self.programs: dict[tuple, Program] = {}
        # prepared launches: (input shapes/strides, device, mode snapshot) -> entry
        self.fast: dict[tuple, Any] = {}
        # fast key -> (snapshot index, index in a module's tuple or -1, negative)
        self.zero_signs: dict[tuple, tuple] = {}
        # fast key -> the entry's program (a grad-mode hit's recompute: cupyfuse.autograd)
        self.fast_prog: dict[tuple, Program] = {}
        self.watch: list[tuple[nn.Module, tuple[str, ...]]] = []
        # the outside values the module's trace read (tracing.global_reads and
        # attribute_reads; set by remember)
        self._globals: tuple = ()
        self._snap: list[tuple[dict, Callable[[dict], Any]]] = []
        # torch's __call__ runs the root module's own hooks (fused_class instances): only
        # its submodules' are refused (from_model's wrapped model: its own too)
        self.root_called = False
        self._parts: tuple[list, list, list] = ([], [], [])
        # the specialised call of the last entry hit twice in a row (fastpath.py), the
        # entry's key and ready plan it was built for, and the last entry hit
        self._spec: Callable[..., Any] | None = None
        # a FusedModel's runner: a weak reference to the FusedModel (the specialised call
        # checks its __call__'s conditions; a fused_class runner's module is its own)
        self.outer: Any = None
        self._spec_key: tuple | None = None
        self._spec_launches: Any = None
        self._hit_key: tuple | None = None

    def __deepcopy__(self, memo: dict) -> None:
        return None   # (a copy of the module it serves makes a runner of its own)

    def __reduce__(self) -> tuple:
        return (type(None), ())

    def snapshot(self, module: nn.Module) -> tuple | None:
        """The cheap form of _mode_key of ``module`` (the root of the watch lists): the
        values of the scalar attributes (the train flag among them) of each submodule,
        then the keys of the outside values the trace read (``_globals``); None when an
        attribute is gone."""
        root = module.__dict__
        try:
            snap = tuple([get(root if d is None else d) for d, get in self._snap])
        except KeyError:
            return None
        st = _structure(self._parts, root)
        if st is None:
            return None
        snap += (st,)
        if self._globals:
            return snap + tracing.global_values(self._globals)
        return snap

    def fast_call(self, module: nn.Module, args: tuple, precision: str | None = None) -> Any:
        """The forward through a prepared launch; None when none applies. (The module's
        ``__call__`` tries the specialised call, ``self._spec``, before this.)"""
        fast = self.fast
        if not fast or _autocast_on("cuda"):
            return None
        shapes = []
        tens = []
        for a in args:
            if type(a) is torch.Tensor:
                if a.dtype is not _F32 or not a.is_cuda:
                    return None
                shapes.append((a.shape, a.stride()))
                tens.append(a)
            elif a is None or type(a) is bool:
                shapes.append(a)   # (the trace is specialised on it: part of the key)
            elif type(a) is float or type(a) is int:
                # a constant of the program: its value in the key, by type and repr
                # (1 and 1.0, 0.0 and -0.0 apart; a NaN never finds its entry)
                shapes.append((type(a), repr(a)))
            else:
                return None
        if not tens or tens[0] is not args[0]:
            return None
        dev = args[0].get_device()
        snap = self.snapshot(module)
        if snap is None:
            return None
        key = (tuple(shapes), dev, snap, gemm.dispatch_key())
        ent = fast.get(key)
        if ent is None:
            return None
        zs = self.zero_signs.get(key) if self.zero_signs else None
        if zs is not None:   # a float attribute that was a zero: the same sign of zero
            for i, j, neg in zs:
                v = snap[i] if j < 0 else snap[i][j]
                if (math.copysign(1.0, v) < 0) != neg:
                    return None
        pr, paths = ent
        srcs: list[Any] = []
        sptrs: list[int] = []
        for get, meta in paths:
            t = get(module)
            if meta is not None:   # (shape, strides, dtype) when prepared
                if not isinstance(t, torch.Tensor) or t.dtype is not meta[2] or \
                        t.get_device() != dev or t.shape != meta[0] or t.stride() != meta[1]:
                    return None
                sptrs.append(t.data_ptr())
            else:
                sptrs.append(0)
            srcs.append(t)
        grad = _grad_enabled() and wants_grad(module, tens, srcs, paths)
        stream = _stream_for(dev, False)
        if stream is None:
            return None
        hit = pr([a.data_ptr() for a in tens], sptrs, stream, False, srcs, precision)
        if grad:
            # the fused result, differentiated through the entry's program
            prog = self.fast_prog.get(key)
            if hit is None or prog is None:
                return None
            pos = [i for i, a in enumerate(args) if type(a) is torch.Tensor]
            leaves, slots, dleaves = _grad_leaves(module, args, pos, srcs, prog.sources)
            return _differentiated(
                prog, lambda: hit, [a.detach() for a in tens], type(module).__name__, pos,
                leaves, slots, [t.detach() if isinstance(t, torch.Tensor) else t for t in srcs],
                dleaves, srcs, precision)
        if hit is not None and config.FASTPATH:
            self._specialise(module, args, key, ent, dev, stream, precision)
        return hit

    def _specialise(self, module: nn.Module, args: tuple, key: tuple, ent: tuple, dev: int,
                    stream: int, precision: str | None) -> None:
        """After a hit of entry ``key``: the second hit in a row of the same entry on a
        ready plan builds its specialised call (fastpath.py), once per ready plan (one
        that declines or stops matching -- another thread, say -- is not rebuilt until
        the plan is)."""
        if key != self._hit_key:
            self._hit_key = key
            return
        rd = ent[0]._ready.get((stream, False))
        if rd is None or (key == self._spec_key and rd[4] is self._spec_launches):
            return
        outer = module if self.root_called else (self.outer() if self.outer else None)
        if outer is None:
            return
        self._spec_key, self._spec_launches = key, rd[4]
        self._spec = _fastpath.build(self, outer, module, args, ent, dev, stream, precision,
                                     _structure)

    def remember(self, module: nn.Module, prog: Program, args: tuple,
                 tens: Sequence[torch.Tensor], srcs: Sequence[Any]) -> None:
        """After a general-path GPU call: prepare the launches for the next call like it
        (tensor inputs used as they are, and None/bool arguments: see fast_call)."""
        targs = [a for a in args if type(a) is torch.Tensor]
        if len(targs) != len(tens) or any(a is not None and type(a) not in _KEYED_ARGS
                                          for a in args) \
                or any(a.data_ptr() != t.data_ptr() for a, t in zip(targs, tens)):
            return
        if _prep.usable(prog) is None:
            return   # (before the watch lists below: ~100 us a call of a large module)
        # (again each time: a submodule swapped since brings its own attributes). The
        # root is the module each call passes (None in the lists): a fused_class instance
        # holds its runner, and a runner holding the instance or its __dict__ would make
        # a cycle that only Python's cyclic collector frees, with the GPU memory of every
        # parameter (the submodules hold no runner: held as they are)
        mods = list(module.modules())
        self.watch = [(None if i == 0 else m,
                       tuple(sorted(k for k, v in m.__dict__.items()
                                    if _watched(v) and not k.startswith("_"))))
                      for i, m in enumerate(mods)]
        # (each module's attribute dict, read through the same dict object every call)
        self._snap = [(None if m is None else m.__dict__,
                       operator.itemgetter(*names) if names else _nothing)
                      for m, names in self.watch]
        self._parts = _structure_parts(mods, self.root_called)
        # (again each time: a plain object attribute rebound brings other attributes)
        self._globals = tracing.global_reads(module) + tracing.attribute_reads(module)
        dev = tens[0].get_device()
        snap = self.snapshot(module)
        if snap is None:
            return
        key = (tuple([(a.shape, a.stride()) if type(a) is torch.Tensor else
                      (type(a), repr(a)) if type(a) is float or type(a) is int else a
                      for a in args]),
               dev, snap, gemm.dispatch_key())
        if key in self.fast:
            return
        if len(self.fast) >= 16:
            oldest = next(iter(self.fast))
            del self.fast[oldest]
            self.zero_signs.pop(oldest, None)
            self.fast_prog.pop(oldest, None)
        in_meta = [(tuple(t.shape), tuple(t.stride())) for t in tens]
        pr = _try_prepare(prog, tens[0].shape[0], dev, in_meta, srcs, allow_bn=True)
        if pr is None:
            self.fast[key] = None
            return
        # dtype too: float32 parameters, and BatchNorm's int64 num_batches_tracked
        paths = [(_getter(module, s),
                  _src_meta(t) + (t.dtype,) if isinstance(t, torch.Tensor) else None)
                 for s, t in zip(prog.sources, srcs)]
        self.fast[key] = (pr, paths)
        self.fast_prog[key] = prog
        # the snapshot's values compare by ==: 0.0 and -0.0 find the same entry, so the
        # sign of a float zero is checked apart (rare; 1 and 1.0 are not told apart here)
        zs = tuple((i, j, math.copysign(1.0, v) < 0) for i, part in enumerate(snap)
                   for j, v in (enumerate(part) if type(part) is tuple else [(-1, part)])
                   if type(v) is float and v == 0.0)
        if zs:
            self.zero_signs[key] = zs

    def left_at(self, args: Sequence[Any]) -> tuple[tuple[int, Any], ...]:
        """(argument, value) of the forward's arguments a call with these inputs leaves at
        None or a bool, or passes as a bool: a None or a bool passed (a NumPy bool as the
        Python bool), a keyword call's ``_Default`` and the None/bool defaults after the
        last input (the trace is specialised on each: one trace and program per
        pattern, e.g. ``forward(x, return_probs=False)`` called both ways)."""
        if self._params is None:
            self._params = _forward_params(self.forward) if self.forward is not None else []
        out = [(i, a if a is None or type(a) is bool else
                bool(a) if isinstance(a, np.bool_) else a.value)
               for i, a in enumerate(args)
               if i and (a is None or type(a) in (bool, _Default) or isinstance(a, np.bool_))]
        out += [(i, d) for i, (_, d) in enumerate(self._params)
                if i >= len(args) and (d is None or type(d) is bool)]
        return tuple(out)

    def concrete(self, left: tuple[tuple[int, Any], ...]) -> dict[str, Any]:
        """``left`` by argument name: the trace's concrete_args."""
        params = self._params or []
        return {params[i][0]: v for i, v in left if i < len(params)}

    def program(self, module: nn.Module, inputs: Sequence[torch.Tensor],
                bools: tuple[int, ...] = (), numbers: tuple[tuple[int, Any], ...] = (),
                left: tuple[tuple[int, Any], ...] = (), ints: tuple[int, ...] = ()) -> Program:
        """The program for inputs of these shapes (``bools``: the inputs that are bool
        masks, passed as 0.0 / 1.0; ``ints``: the integer ones, passed as float32;
        ``numbers``: (argument, value) of the Python numbers passed, constants of the
        program: one program per value; ``left``: (argument, value) of the arguments left
        at None or a bool, see ``left_at``)."""
        mode = _mode_key(module)
        # (numbers by type and repr: 1 and 1.0, or 0.0 and -0.0, get programs of their
        # own; a NaN finds its program again)
        key = (mode, tuple(tuple(t.shape[1:]) for t in inputs), bools,
               tuple([(i, tracing._value_key(v)) for i, v in numbers]), left, ints,
               registry.generation())   # (an op added to or removed from the table)
        p = self.programs.get(key)
        if p is None:
            if len(self.programs) >= _MAX_PROGRAMS:   # a number that changes every call
                self.programs.pop(next(iter(self.programs)))
            if any(t.dim() == 0 for t in inputs):
                raise TailError(f"{type(module).__name__}: inputs must have a batch dimension")
            if self.traced_mode != mode:
                # the flags and plain attributes changed since the trace (fx bakes Python
                # scalars into the graph; the mode decides dropout/BatchNorm): retrace
                self.traces.clear()
                self.traced_mode = mode
            traced = self.traces.get(left)
            if traced is None:
                traced = self.traces[left] = self.trace_fn(module, self.concrete(left))
            p = translation.translate(traced, module, [tuple(t.shape) for t in inputs],
                                  bool_inputs=bools, numbers=numbers, specialized=left,
                                  int_inputs=ints)
            p = rewrite.rewrite(p.own_results())
            self.programs[key] = p
        return p


#: programs kept per fused module (oldest dropped first): a number passed to the forward
#: makes one per value
_MAX_PROGRAMS = 64


def _numbers(args: Sequence[Any]) -> tuple[tuple[int, int | float], ...]:
    """(argument, value) of the Python numbers (not bools) among inputs after x: each is a
    constant of the program (translated, and on the GPU compiled, per value). A NumPy
    scalar (np.float32(2.0), np.int64(3)) counts as the Python number of its value, as
    torch reads it (its own arithmetic in the forward then runs in Python's: a NumPy
    integer divided by zero or overflowing is refused where NumPy gives inf or wraps)."""
    return tuple([(i, int(a) if isinstance(a, (int, np.integer)) else float(a))
                  for i, a in enumerate(args) if i and isinstance(a, _NUMBER_TYPES)
                  and not isinstance(a, bool)])


#: what a forward input may be as a number (np.float64 is a float already; np.bool_ is
#: neither: a bool input is refused)
_NUMBER_TYPES = (int, float, np.integer, np.floating)


def _zero_d_array(a: Any, what: str, op: str) -> None:
    """Refuse a 0-d NumPy array input clearly (torch reads one as a 0-d tensor; cupyfuse's
    inputs have a batch dimension)."""
    if isinstance(a, np.ndarray) and a.ndim == 0:
        raise TypeError(f"{op}: {what} is a 0-d NumPy array ({describe(a)}), which cupyfuse "
                        "does not take: pass a Python number (`float(a)` or `a.item()`: a "
                        "constant of the program) or a tensor with a batch dimension")


#: torch's global module hooks (dicts torch fills and empties in place, never rebinds)
_GLOBAL_HOOKS = (_tmod._global_forward_hooks, _tmod._global_forward_pre_hooks,
                 _tmod._global_backward_hooks, _tmod._global_backward_pre_hooks)
_tracing_state = torch._C._get_tracing_state
#: torch's own _call_impl (Module.__call__ calls ``self._call_impl``: a class or instance
#: that replaces it is called through torch's __call__)
_TORCH_CALL_IMPL = nn.Module._call_impl


def _direct_call(m: nn.Module) -> bool:
    """Whether torch's ``Module.__call__`` would call ``m.forward`` straight away: no
    forward or backward hooks of ``m`` or global ones, no ``m.compile()``, no JIT trace, no
    ``forward`` set on the instance, torch's own ``_call_impl`` (not one of the class or
    the instance). Then a fused module's ``__call__`` runs its prepared launch itself
    (torch's two call frames and its forward's cost ~1.5 us a call)."""
    d = m.__dict__
    g = _GLOBAL_HOOKS
    return not (d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"]
                or d["_backward_pre_hooks"] or g[0] or g[1] or g[2] or g[3]
                or d.get("_compiled_call_impl") is not None or "forward" in d
                or "_call_impl" in d or type(m)._call_impl is not _TORCH_CALL_IMPL
                or _tracing_state())


def _run_module(module: nn.Module, runner: _Runner, args: tuple, precision: str | None) -> Any:
    x0 = args[0] if args else None
    if isinstance(x0, torch.Tensor) and _autocast_on(x0.device.type):
        return torch_forward(module, args, f"autocast on {x0.device.type}")
    hit = runner.fast_call(module, args, precision)
    if hit is not None:
        return hit
    err = _hooks_error(module, runner.root_called, lambda: _trace_of(module, runner, args))
    if err is not None:
        raise err
    name = type(module).__name__
    if not args:
        raise TypeError(f"{name}: forward needs at least one input")
    if any(isinstance(a, torch.fx.Proxy) for a in args):
        raise TailError(f"{name}: torch.fx traces through the fused forward, which runs "
                        "CUDA kernels, not torch ops: trace the original model, or make the "
                        "tracer keep this module a leaf (Tracer.is_leaf_module)")
    tens = []
    pos: list[int] = []   # the argument of each tensor in tens
    bools: list[int] = []
    ints: list[int] = []
    numbers = _numbers(args)
    left = runner.left_at(args)
    skip = dict(numbers + left)
    kind0 = None
    for i, a in enumerate(args):
        if i in skip:
            continue
        if i:
            _zero_d_array(a, f"input {i}", name)
        pos.append(i)
        t, kind = _as_torch(a, "x" if i == 0 else f"input {i}")
        if kind0 is None:
            kind0 = kind
        if t.dtype == torch.bool and i > 0:
            # a mask input: read as 0.0 / 1.0, where torch reads a bool (masked_fill,
            # where, arithmetic with a float tensor); a copy per call, never prepared
            bools.append(i)
            t = t.float()
        elif t.dtype in (torch.int64, torch.int32) and i > 0:
            # an integer input (an attention mask, labels): read as float32 where its uses
            # are exact whatever its values (translation._RawInt); a copy per call, never prepared
            ints.append(i)
            t = t.float()
        elif t.dtype in HALF:
            return torch_forward(module, args, f"a {t.dtype} input")
        elif t.dtype != torch.float32:
            if i == 0 and not t.is_floating_point() and t.dtype != torch.bool:
                err = _embedding_error(module, runner, args)
                if err is not None:
                    raise err
            raise TypeError(f"{name}: input {i} must be float32"
                            + (" (or bool, after x)" if i > 0 else "") + f", got {describe(a)}")
        tens.append(t.detach())
    dev = tens[0].device
    for i, t in zip(pos[1:], tens[1:]):
        if t.device != dev:
            raise ValueError(f"{name}: input {i} must be on {dev} like x, got {describe(args[i])}")
    if tens[0].dim() < 1:
        raise ValueError(f"{name}: x must have a batch dimension, got {describe(args[0])}")
    half = _sixteen_bit(module)
    if half is not None:
        return torch_forward(module, args, f"{half} parameters or buffers")
    prog = runner.program(module, tens, tuple(bools), numbers, left, tuple(ints))
    tracking.track(module)   # (.data writes of its tensors are seen: cupyfuse.tracking)
    raw = list(tens)   # (the operands before the program's row layout: a recompute's)
    tens, b0 = _program_rows(prog, tens, name, pos)
    srcs = []
    for s in prog.sources:
        # (a derived weight: the same tensor object while the tensors it reads are unchanged)
        t = _resolve(module, s) if isinstance(s, str) else \
            s.value(module) if isinstance(s, Derived) else s
        if isinstance(t, torch.Tensor):
            what = s if isinstance(s, (str, Derived)) else "a tensor"
            if t.is_floating_point() and t.dtype != torch.float32:
                raise TypeError(f"{name}: {what} must be float32, got {describe(t)}")
            if t.device != dev:
                raise ValueError(f"{name}: {what} must be on {dev} like x, got {describe(t)}")
        srcs.append(t)
    owners = list(srcs)
    leaves: list[torch.Tensor] = []
    if torch.is_grad_enabled() and kind0 in ("torch-cuda", "torch-cpu"):
        # (a CuPy or NumPy caller's result is no tensor: it carries no autograd history)
        leaves, slots, dleaves = _grad_leaves(module, args, pos, owners, prog.sources)
    srcs = [t.detach() if isinstance(t, torch.Tensor) else t for t in srcs]
    call = Call(op=name, kind=kind0, device=dev, x=tens[0])

    def forward() -> Any:
        if tens[0].shape[0] == 0:
            for n in prog.nodes:
                if n.kind == "bn":
                    count_batch(n, srcs)
            prog.check_rows(0)
            if prog.outs_type is not None:
                return _results(call, empty_batch(prog, dev, b0 if prog.lead else None))
            return call.result(empty_batch(prog, dev, b0))
        if dev.type == "cpu":
            with torch.no_grad():
                return _results(call, run_cpu(prog, tens, srcs, owners=owners))
        # prepare the launches, and run this very call through them too (the first call
        # computes exactly what the next ones will); Python numbers passed are constants of
        # the program and in the prepared key by value (NumPy scalars: the general path)
        runner.remember(module, prog, args, tens, srcs)
        with torch.no_grad():
            hit = runner.fast_call(module, args, precision)
        if hit is not None:
            return hit
        with call, torch.no_grad():
            return _results(call, execute.run_gpu(prog, tens, srcs, precision, owners=owners))

    if not leaves:
        return forward()

    return _differentiated(prog, forward, raw, name, pos, leaves, slots, srcs, dleaves,
                           owners, precision)


def _operands(prog: Program, raw: Sequence[torch.Tensor], name: str, pos: Sequence[int],
              slots: Sequence[tuple], srcs: Sequence[Any], dleaves: dict
              ) -> Callable[[Sequence[torch.Tensor]], tuple[list, list]]:
    """For a differentiated call: the function giving the program's inputs (row layout)
    and sources from the tensors standing for the differentiated ones (``slots``, see
    _grad_leaves): the operands ``raw`` (before the row layout) and sources ``srcs`` with
    those replaced, derived sources evaluated from their leaves -- with autograd history
    where grad mode is on."""
    def operands(req: Sequence[torch.Tensor]) -> tuple[list, list]:
        by = dict(zip(slots, req))
        ins, _ = _program_rows(prog, [by.get(("in", j), t) for j, t in enumerate(raw)],
                               name, pos)
        rs = []
        for k, (s, t) in enumerate(zip(prog.sources, srcs)):
            if ("src", k) in by:
                t = by[("src", k)]
            elif k in dleaves:
                t = s.evaluate([by.get(("leaf", k, m), leaf)
                                for m, leaf in enumerate(dleaves[k])], grad=True)
            rs.append(t)
        return ins, rs
    return operands


def _differentiated(prog: Program, forward: Callable[[], Any], raw: Sequence[torch.Tensor],
                    name: str, pos: Sequence[int], leaves: Sequence[torch.Tensor],
                    slots: Sequence[tuple], srcs: Sequence[Any], dleaves: dict,
                    owners: Sequence[Any], precision: str | None) -> Any:
    """``forward()``'s result with autograd history (cupyfuse.autograd): the backward
    program where the program has one (``autograd.program_backward``), else torch's
    autograd of the recompute (:func:`_recompute`)."""
    operands = _operands(prog, raw, name, pos, slots, srcs, dleaves)
    dev = raw[0].device
    return autograd.apply(forward, _recompute(prog, operands, owners, precision), leaves,
                          autograd.program_backward(prog, slots, operands, dev, precision))


def _recompute(prog: Program, operands: Callable[[Sequence[torch.Tensor]], tuple[list, list]],
               owners: Sequence[Any], precision: str | None
               ) -> Callable[[Sequence[torch.Tensor]], Any]:
    """A differentiated call's recompute (cupyfuse.autograd): the program before its
    rewrites, with torch ops, from ``operands(req)`` (see :func:`_operands`); a
    BatchNorm's running statistics left alone. Its GEMMs run on the engine at
    ``precision`` (:func:`cupyfuse.autograd.gemm_for`; ``owners``: the caller's own
    tensors behind the sources, whose cached weight splits the products reuse)."""
    def recompute(req: Sequence[torch.Tensor]) -> Any:
        ins, rs = operands(req)
        p = prog.unrewritten if prog.unrewritten is not None else prog
        return run_cpu(p, ins, rs, training_updates=False,
                       gemm=autograd.gemm_for(weight_owners(rs, owners), precision))
    return recompute


def weight_owners(values: Sequence[Any], owners: Sequence[Any]) -> dict[int, torch.Tensor]:
    """``id`` of each tensor of ``values`` that holds the data of the tensor beside it in
    ``owners`` (the same storage, shape and strides) -> that tensor."""
    out = {}
    for v, o in zip(values, owners):
        if isinstance(v, torch.Tensor) and isinstance(o, torch.Tensor) and \
                v.data_ptr() == o.data_ptr() and v.shape == o.shape and \
                v.stride() == o.stride() and v.dtype == o.dtype:
            out[id(v)] = o
    return out


def _program_rows(prog: Program, tens: list[torch.Tensor], name: str,
                  pos: Sequence[int]) -> tuple[list[torch.Tensor], int]:
    """The operands in the program's row layout (inputs it flattens whole as (batch, P)
    rows, one-row inputs broadcast, (batch, seq, ...) inputs as batch * seq rows), and
    the batch itself."""
    tens = prog.flat_rows(tens)
    prog.check_lead_batches([t.shape for t in tens], name, [f"input {i}" for i in pos])
    if not prog.lead:
        tens = _broadcast_rows(tens, prog, name)
    b0 = tens[0].shape[0]   # the batch itself (rows differ with leading dims)
    if prog.lead:   # (batch, seq, features) inputs: batch * seq rows (a view where it can),
        tens = _lead_rows(tens)
    return tens, b0


def _grad_leaves(module: nn.Module, args: tuple, pos: Sequence[int], owners: Sequence[Any],
                 sources: Sequence[Any]) -> tuple[list[torch.Tensor], list[tuple], dict]:
    """The tensors a grad-mode call differentiates: each tensor argument, source (a
    parameter, buffer or tensor the forward holds) and leaf of a derived source that
    requires grad; their slots (("in", j): the j-th operand, ("src", k): source k,
    ("leaf", k, m): leaf m of derived source k) and each such derived source's leaves."""
    leaves: list[torch.Tensor] = []
    slots: list[tuple] = []
    dleaves: dict[int, list] = {}
    for j, i in enumerate(pos):
        a = args[i]
        if isinstance(a, torch.Tensor) and a.requires_grad:
            leaves.append(a)
            slots.append(("in", j))
    for k, (s, t) in enumerate(zip(sources, owners)):
        if isinstance(s, Derived):
            ls = s.leaves(module)
            grad = [m for m, leaf in enumerate(ls)
                    if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
            if grad:
                dleaves[k] = ls
                for m in grad:
                    leaves.append(ls[m])
                    slots.append(("leaf", k, m))
        elif isinstance(t, torch.Tensor) and t.requires_grad:
            leaves.append(t)
            slots.append(("src", k))
    return leaves, slots, dleaves


def wants_grad(module: nn.Module, tens: Sequence[Any], srcs: Sequence[Any],
               paths: Sequence[tuple]) -> bool:
    """Whether a fast-path call (grad mode on) must take the differentiated general path:
    a tensor argument or source, or a leaf of a derived source, requires grad."""
    if any(getattr(a, "requires_grad", False) for a in tens) or \
            any(getattr(t, "requires_grad", False) for t in srcs):
        return True
    for get, _ in paths:
        d = getattr(get, "__self__", None)
        if isinstance(d, Derived) and d.requires_grad(module):
            return True
    return False


def _results(call: Any, r: Any) -> Any:
    """A program's result (one tensor, or a forward's tuple/list/dict of them) in the
    caller's own type."""
    if isinstance(r, dict):
        return type(r)((k, call.result(t)) for k, t in r.items())
    if isinstance(r, (tuple, list)):
        return type(r)(call.result(t) for t in r)
    return call.result(r)


def _bound_inputs(bound: Any, name: str) -> tuple:
    """A keyword call's inputs in the forward's parameter order, as a positional call
    would pass them: defaults filled in only before the last argument passed (those after
    it are left to the trace, like a positional call's); a None or bool default before it
    goes in as a ``_Default`` (the trace is specialised on it, see ``_Runner.left_at``)."""
    import inspect

    params = list(bound.signature.parameters)
    last = max(params.index(p) for p in bound.arguments)
    passed = set(bound.arguments)
    bound.apply_defaults()
    out = []
    for p in params[:last + 1]:
        if p not in bound.arguments:
            continue
        d = bound.arguments[p]
        kind = bound.signature.parameters[p].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:   # *rest: as a positional call passes
            out.extend(d)
            continue
        if kind is inspect.Parameter.VAR_KEYWORD:
            if d:
                raise TailError(f"{name}: the call passes {', '.join(map(repr, d))} through "
                                f"the forward's `**{p}`: cupyfuse passes a forward's named "
                                "arguments (name them in the forward)")
            continue
        out.append(_Default(d) if p not in passed and (d is None or isinstance(d, bool)) else d)
    return tuple(out)


