"""Specialised calls: a fused module's (or a fused_linear tail's) repeated call as one
generated Python function.

A repeated call of a fused module goes through ``_Runner.fast_call``: it builds a key
from the inputs' shapes and strides, the module's watched attributes and structure, the
device and the dispatch settings, looks up the prepared launches, reads the parameters,
then ``Prepared.__call__`` checks the ready plan and launches. Each step is a loop over
lists or a function call made for any module: ~8 us of Python a call on an H100 host.

When the same prepared entry is hit twice in a row on its ready plan, :func:`build`
writes one straight-line function for exactly that call: every check of the two layers
above as a comparison against the values this call had (shapes, strides, attribute
values, structure, dispatch key, device, stream, thread, the ready plan's identity and
its engine weights' versions), then the same allocation, the same parameter-cell writes
and the same launches. Any check that fails returns None *before* anything is allocated
or launched, and the caller takes the general fast path (which rebuilds the function
when its new entry is hit twice in a row). Nothing is decided here that the general
path does not decide: this is a cache of its decisions, keyed by equality.

A module's function (:func:`build`) is called first by the module's own ``__call__`` and
also checks what that call's shortcut checks (no hooks of any kind, torch's call
machinery untouched, the class's fused forward); ``fused_linear``'s (:func:`build_function`,
torch operands without extras) is looked up by the tail object.

The function holds the ready plan's launches (small ctypes buffers), the parameter
getters, the watched modules' attribute dicts (which the runner holds anyway) and weak
references to the prepared object and the engine weights; the weight splits and
workspaces stay owned by the prepared object (a dropped ready plan is seen by identity and
never launched).
"""
from __future__ import annotations

import math
import threading
import weakref
from typing import Any, Callable

import torch
import torch.nn.modules.module as tmod

from cupyfuse.frontend import trace as tracing
from cupyfuse.backend import gemm, prepared
from cupyfuse import interop, tracking
from cupyfuse import runner as runner_mod

__all__ = ["build", "build_function"]





def _lit(v: Any) -> str:
    """A literal for an int, or raise (only ints are written into the source)."""
    if type(v) is not int:
        raise TypeError(f"not an int: {v!r}")
    return repr(v)


class _Writer:
    """The source of one specialised function and the names it reads (its globals)."""

    def __init__(self) -> None:
        self.ns: dict[str, Any] = {"Tensor": torch.Tensor, "F32": torch.float32,
                                   "isinstance": isinstance, "len": len, "type": type,
                                   "repr": repr, "id": id, "copysign": math.copysign}
        self.lines: list[str] = []

    def emit(self, line: str) -> None:
        self.lines.append(line)

    def const(self, name: str, v: Any) -> str:
        self.ns[name] = v
        return name

    def tensor_check(self, var: str, t: torch.Tensor, dev: int, tag: str, types: str) -> None:
        """``var`` is a float32 tensor of one of ``types`` with t's shape and strides on dev."""
        self.emit(f"if {types} or {var}.dtype is not F32 or "
                  f"{var}.shape != {self.const(f'S{tag}', t.shape)} or "
                  f"{var}.stride() != {self.const(f'T{tag}', t.stride())} or "
                  f"{var}.get_device() != {_lit(dev)}: return None")

    def finish(self, signature: str, title: str) -> Callable[..., Any]:
        src = f"def specialised({signature}):\n" + "".join("    " + ln + "\n"
                                                            for ln in self.lines)
        exec(compile(src, f"<cupyfuse specialised call of {title}>", "exec"), self.ns)
        # (out of its own globals: a function in them is a reference cycle, which would
        # keep the watched modules' parameters until Python's cyclic collector)
        fn = self.ns.pop("specialised")
        fn.source = src
        return fn


def _device_and_ready(w: _Writer, pr: Any, ready: tuple, dev: int, stream: int, tid: int,
                      tables: tuple, srcs: list, svars: list, precision: Any,
                      prec_of: Any = None) -> bool:
    """Sections 4-5: the device, stream and thread, then Prepared.__call__'s checks of its
    ready plan (``tables``: the names of the IN and SRC pointers; ``srcs``/``svars``: the
    sources this call passed and their names; ``prec_of``: the module's precision from
    ``outer``, else the function's ``precision`` argument). False where the plan does not
    qualify."""
    # (torch's own functions behind prepared.current_device / torch_stream)
    w.ns["CURDEV"], w.ns["TSTREAM"], w.ns["GET_IDENT"] = (torch._C._cuda_getDevice,
                                                          torch._C._cuda_getCurrentRawStream,
                                                          threading.get_ident)
    if prepared.current_device() != dev or prepared.torch_stream(dev) != stream:
        return False
    w.emit(f"if CURDEV() != {_lit(dev)} or TSTREAM({_lit(dev)}) != {_lit(stream)} or "
           f"GET_IDENT() != {_lit(tid)}: return None")
    for t, i in pr.aligned:
        w.emit(f"if {tables[t][i]} & 15: return None")
    w.emit(f"pr = {w.const('PR', weakref.ref(pr))}()")
    w.emit("if pr is None: return None")
    w.emit(f"rd = pr._ready.get(({_lit(stream)}, False))")
    w.ns["SKWS"], w.ns["INTEROP"] = prepared._skinny_ws, interop
    w.emit(f"if rd is None or rd[4] is not {w.const('LAUNCHES', ready[4])} or "
           f"rd[0] is not SKWS.get(({_lit(dev)}, {_lit(stream)})) or INTEROP.poison_outputs: "
           "return None")
    if ready[0] is not prepared._skinny_ws.get((dev, stream)) or interop.poison_outputs:
        return False
    for n, (si, wref, version, wptr) in enumerate(ready[2]):
        if si >= len(svars) or svars[si] is None:
            return False
        t = wref()
        if t is None or srcs[si] is not t or t._version != version or t.data_ptr() != wptr:
            return False
        w.emit(f"if {svars[si]} is not {w.const(f'WR{n}', wref)}() or "
               f"{svars[si]}._version != {_lit(version)} or "
               f"{tables[1][si]} != {_lit(wptr)}: return None")
    if pr.highest:
        if gemm.resolve_precision(precision) != "highest":
            return False
        w.ns["RESOLVE"] = gemm.resolve_precision
        w.emit(f"if RESOLVE({'precision' if prec_of is None else 'PRECISION_OF(outer)'}) "
               "!= 'highest': return None")
        if prec_of is not None:
            w.ns["PRECISION_OF"] = prec_of
    return True


def _launch(w: _Writer, pr: Any, ready: tuple, dev: int, stream: int, tid: int,
            tables: tuple) -> None:
    """Section 6, the call itself: results, cells, launches (nothing before allocated or
    launched)."""
    w.ns["EMPTY"], w.ns["DEVICE"], w.ns["I64"] = (torch.empty, prepared._torch_device(dev),
                                                  torch.int64)
    shapes = [pr.out_shape] + [shape for _, shape in pr.more]
    for r, shape in enumerate(shapes):
        size = ", ".join(_lit(int(s)) for s in shape)
        # (argmax/argmin results: int64, as Prepared.__call__ allocates them)
        dt = ", dtype=I64" if pr.res_long[r] else ""
        w.emit(f"o{r} = EMPTY({size}, device=DEVICE{dt})" if shape else
               f"o{r} = EMPTY((), device=DEVICE{dt})")
        w.emit(f"b{r} = o{r}.data_ptr()")
    names = (tables[0], tables[1], {r: f"b{r}" for r in range(len(shapes))})
    w.ns["LAUNCH"], w.ns["MEMMOVE"], w.ns["ENCODE_MAP"] = (prepared._launch_kernel,
                                                           prepared._memmove,
                                                           prepared._encode_map)
    w.ns["LAUNCH_DEP"] = prepared._launch_dependent
    for n, r in enumerate(ready[4]):
        b = r.tb.get(tid)
        if b is None:
            b = r.buffers(tid, dev)
        w.const(f"KEEP{n}", b)   # the buffer and its cells stay alive with the function
        for c, (cell, t, i) in enumerate(b[1]):
            w.emit(f"{w.const(f'C{n}_{c}', cell)}.value = {names[t][i]}")
        if b[2] is not None:
            w.emit(f"{w.const(f'VC{n}', b[2])}.value = (("
                   + " | ".join(names[t][i] for t, i in r.vec[1]) + ") & 15) == 0")
        if b[3]:
            xs = r.xmap[0]
            w.emit(f"MEMMOVE({_lit(b[3])}, ENCODE_MAP({names[xs[0]][xs[1]]}, "
                   f"{_lit(r.xmap[1])}, {_lit(r.xmap[2])}, {_lit(r.xmap[3])}, F32), 128)")
        w.emit(f"{'LAUNCH_DEP' if r.dep else 'LAUNCH'}({_lit(r.fptr)}, {_lit(r.g0)}, "
               f"{_lit(r.g1)}, {_lit(r.g2)}, "
               f"{_lit(r.block)}, 1, 1, {_lit(r.smem)}, {_lit(stream)}, {_lit(b[0])}, 0)")
    if pr.outs_type is not None:
        w.emit(f"return {w.const('OUTS_TYPE', pr.outs_type)}(["
               + "".join(f"o{r}, " for r in range(len(shapes))) + "])")
    else:
        w.emit("return o0")


def build(runner: Any, outer: Any, module: Any, args: tuple, entry: tuple, dev: int,
          stream: int, precision: Any, structure: Callable[[tuple], Any]
          ) -> Callable[[Any, tuple], Any] | None:
    """The specialised call ``f(outer, args)`` of a fused module ``outer`` (a fused_class
    instance: ``module`` itself) for this call's entry
    (``runner.fast[key]``) on its ready plan; None where the plan is not ready (its next
    call would take the full prepared path) or the call has a form this does not cover.
    Its first checks are those of the module's ``__call__`` shortcut (fused._direct_call:
    torch's ``Module.__call__`` would call the fused forward straight away), so the
    ``__call__`` runs it first."""
    pr, paths = entry
    ready = pr._ready.get((stream, False))
    fwd = getattr(type(outer), "forward", None)
    prec_of = getattr(fwd, "_cupyfuse_precision_of", None)
    if ready is None or prec_of is None:
        return None   # (not a fused forward: its __call__ never calls this)
    tid = threading.get_ident()
    w = _Writer()
    emit, const, ns = w.emit, w.const, w.ns

    # 0. the __call__ shortcut's conditions (fused._direct_call, and the class's forward
    # the fused one), then the module the forward runs
    cls = type(outer)
    od = outer.__dict__
    ns["TRACING"], ns["TCI"] = torch._C._get_tracing_state, torch.nn.Module._call_impl
    # (the module by a weak reference, its __dict__ read from it: the module holds its
    # runner, which holds this function; see _Runner.remember)
    emit(f"if outer is not {const('OUTER', weakref.ref(outer))}() or "
         f"type(outer) is not {const('CLS', cls)} or "
         f"CLS.forward is not {const('FWD', fwd)} or CLS._call_impl is not TCI: return None")
    emit("od = outer.__dict__")
    emit("if " + " or ".join(
        [f"od[{k!r}]" for k in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                "_backward_pre_hooks")]
        + [const(f"GB{j}", h) for j, h in enumerate(
            (tmod._global_forward_hooks, tmod._global_forward_pre_hooks,
             tmod._global_backward_hooks, tmod._global_backward_pre_hooks))]) + ": return None")
    emit("if od.get('_compiled_call_impl') is not None or 'forward' in od or "
         "'_call_impl' in od or TRACING() is not None: return None")
    if module is outer:
        emit("module = outer")
    else:
        if od.get("_modules", {}).get("model") is not module:
            return None
        emit("module = od['_modules']['model']")
        emit(f"if module is not {const('MODEL', module)}: return None")

    # 1. the arguments, as fast_call keys them
    emit(f"if len(args) != {_lit(len(args))}: return None")
    tens = []
    for i, a in enumerate(args):
        emit(f"a{i} = args[{i}]")
        if type(a) is torch.Tensor:
            if a.dtype is not torch.float32 or a.get_device() != dev:
                return None
            w.tensor_check(f"a{i}", a, dev, str(i), f"type(a{i}) is not Tensor")
            tens.append(i)
        elif a is None or type(a) is bool:
            emit(f"if a{i} is not {const(f'V{i}', a)}: return None")
        elif type(a) is float or type(a) is int:
            emit(f"if type(a{i}) is not {const(f'Y{i}', type(a))} or "
                 f"repr(a{i}) != {const(f'R{i}', repr(a))}: return None")
        else:
            return None
    if not tens or tens[0] != 0:
        return None
    # 2. the snapshot: watched attribute values, structure, outside values, dispatch key
    snap = runner.snapshot(module)
    if snap is None:
        return None
    # the watched modules, the root (None in the runner's lists) the module this call ran
    mods = [module if m is None else m for m, _ in runner.watch]
    if not mods or runner.watch[0][0] is not None:
        return None
    emit("D0 = module.__dict__")
    vals = []
    for k, (m, (_, names)) in enumerate(zip(mods, runner.watch)):
        d = f"D{k}" if k == 0 else const(f"D{k}", m.__dict__)
        if (runner._snap[k][0] or module.__dict__) is not m.__dict__:
            return None
        if len(names) == 1:
            vals.append(f"{d}[{names[0]!r}]")
        else:
            vals.append("(" + "".join(f"{d}[{n!r}], " for n in names) + ")")
    nmod = len(vals)
    emit("try:")
    emit("    sv = (" + "".join(v + ", " for v in vals) + ")")
    emit("except KeyError: return None")
    emit(f"if sv != {const('SNAPV', snap[:nmod])}: return None")
    for i, part in enumerate(snap[:nmod]):   # a float zero: the same sign (see fast_call)
        for j, v in (enumerate(part) if type(part) is tuple else [(-1, part)]):
            if type(v) is float and v == 0.0:
                ref = f"sv[{i}]" if j < 0 else f"sv[{i}][{j}]"
                emit(f"if (copysign(1.0, {ref}) < 0) != {math.copysign(1.0, v) < 0}: "
                     "return None")
    # the structure (fused._structure, written out): no forward hooks, the same children,
    # parameters and buffers (None slots included) by identity, no attribute added
    hooks, views, dicts = runner._parts
    # (the global forward hooks: in section 0)
    if hooks:
        emit("if " + " or ".join(const(f"H{j}", h) for j, h in enumerate(hooks))
             + ": return None")
    stores = [(k, name, m.__dict__[name]) for k, m in enumerate(mods)
              for name in ("_modules", "_parameters", "_buffers")]
    if [id(v) for view in views for v in view] != [id(v) for _, _, sd in stores
                                                   for v in sd.values()]:
        return None   # (a store replaced since the watch lists were made)
    checks = []
    for n, (k, name, sd) in enumerate(stores):
        checks.append(f"len({const(f'SD{k}{name}', sd)}) != {_lit(len(sd))}")
        checks += [f"id(SD{k}{name}[{key!r}]) != {_lit(id(v))}" for key, v in sd.items()
                   if type(key) is str]
        if any(type(key) is not str for key in sd):
            return None
    checks += [f"len(D{k}) != {_lit(len(m.__dict__))}" for k, m in enumerate(mods)]
    emit("try:")
    emit("    if " + " or ".join(checks) + ": return None")
    emit("except KeyError: return None")
    if structure(runner._parts, module.__dict__) != snap[nmod] or \
            [m.__dict__ for m in mods[1:]] != dicts:
        return None
    if runner._globals:
        ns["GLOBAL_VALUES"] = tracing.global_values
        emit(f"if GLOBAL_VALUES({const('GLOBALS', runner._globals)}) != "
             f"{const('GV', snap[nmod + 1:])}: return None")
    ns["DISPATCH_KEY"] = gemm.dispatch_key
    emit(f"if DISPATCH_KEY() != {const('DK', gemm.dispatch_key())}: return None")
    # 3. the parameters and other sources, read now as fast_call reads them
    srcs = []
    for k, (get, meta) in enumerate(paths):
        t = get(module)
        srcs.append(t)
        steps = getattr(get, "steps", None)
        if steps:   # the dict walk the getter takes, written out (the getter on a miss)
            walk = "module" + "".join(f".__dict__[{name!r}]" if store is None else
                                      f".__dict__[{store!r}][{name!r}]" for store, name in steps)
            emit("try:")
            emit(f"    s{k} = {walk}")
            emit(f"except (KeyError, AttributeError, TypeError): s{k} = "
                 f"{const(f'G{k}', get)}(module)")
        else:
            emit(f"s{k} = {const(f'G{k}', get)}(module)")
        if meta is not None:
            emit(f"if not isinstance(s{k}, Tensor) or s{k}.dtype is not "
                 f"{const(f'DT{k}', meta[2])} or s{k}.get_device() != {_lit(dev)} or "
                 f"s{k}.shape != {const(f'SS{k}', meta[0])} or "
                 f"s{k}.stride() != {const(f'ST{k}', meta[1])}: return None")
            emit(f"q{k} = s{k}.data_ptr()")
        else:
            emit(f"q{k} = 0")
    # the pointer tables' names: IN j is the j-th tensor argument, SRC k the k-th source
    tables = ({j: f"p{i}" for j, i in enumerate(tens)}, {k: f"q{k}" for k in range(len(paths))})
    for i in tens:
        emit(f"p{i} = a{i}.data_ptr()")
    svars = [f"s{k}" if meta is not None else None for k, (_, meta) in enumerate(paths)]
    # grad mode with something to differentiate: the general path (cupyfuse.autograd)
    ns["GRAD_ON"], ns["WANTS_GRAD"] = torch.is_grad_enabled, runner_mod.wants_grad
    ns["AUTOCAST"] = torch.is_autocast_enabled   # (autocast: torch's ops, the general path)
    emit("if AUTOCAST('cuda'): return None")
    emit(f"if GRAD_ON() and WANTS_GRAD(module, ({''.join(f'a{i}, ' for i in tens)}), "
         f"({''.join(f's{k}, ' for k in range(len(paths)))}), {const('PATHS', paths)}): "
         "return None")
    if not _device_and_ready(w, pr, ready, dev, stream, tid, tables, srcs, svars, precision,
                             prec_of):
        return None
    _launch(w, pr, ready, dev, stream, tid, tables)
    return w.finish("outer, args", type(module).__name__)


def build_function(tail: Any, x: Any, weight: Any, bias: Any, entry: tuple, dev: int,
                   stream: int, precision: Any) -> Callable[..., Any] | None:
    """The specialised call of ``fused_linear(x, weight, bias, tail)`` (torch tensors, no
    extras) for its prepared entry ``(pr, fixed)`` on its ready plan: the checks of
    fused._fast_operands' key and of Prepared.__call__, then the launch. None where the
    call or the plan does not qualify."""
    pr, fixed = entry
    ready = pr._ready.get((stream, False))
    if ready is None or pr.all_sources or type(x) is not torch.Tensor:
        return None
    ttypes = tracking.TENSOR_TYPES
    if type(weight) not in ttypes or (bias is not None and type(bias) not in ttypes):
        return None
    tid = threading.get_ident()
    w = _Writer()
    w.ns["TT"] = ttypes
    w.tensor_check("x", x, dev, "x", "type(x) is not Tensor")
    w.tensor_check("weight", weight, dev, "w", "type(weight) not in TT")
    if bias is None:
        w.emit("if bias is not None: return None")
    else:
        w.tensor_check("bias", bias, dev, "b", "type(bias) not in TT")
    reads = tracing.global_reads(tail)
    if reads:
        w.ns["GLOBAL_VALUES"] = tracing.global_values
        w.emit(f"if GLOBAL_VALUES({w.const('READS', reads)}) != "
               f"{w.const('GV', tracing.global_values(reads))}: return None")
    w.ns["DISPATCH_KEY"] = gemm.dispatch_key
    w.emit(f"if DISPATCH_KEY() != {w.const('DK', gemm.dispatch_key())}: return None")
    w.emit("px = x.data_ptr()")
    w.emit("qw = weight.data_ptr()")
    src_names = {0: "qw"}
    if bias is not None:
        w.emit("qb = bias.data_ptr()")
        src_names[1] = "qb"
    for ptr in fixed:   # the tensors the tail's program holds: fixed addresses
        src_names[len(src_names)] = _lit(ptr)
    tables = ({0: "px"}, src_names)
    # (Prepared.__call__'s sources: the weight alone, which keys the engine's split)
    if not _device_and_ready(w, pr, ready, dev, stream, tid, tables, [weight], ["weight"],
                             precision):
        return None
    _launch(w, pr, ready, dev, stream, tid, tables)
    return w.finish("x, weight, bias, precision", getattr(tail, "__name__", "a tail"))
