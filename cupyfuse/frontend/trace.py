"""Tracing: a module's (or a function's) forward recorded by torch.fx, with what the
translation needs around the graph.

:func:`trace` records the forward once (``torch.fx.Tracer`` with stack traces, so every
node knows its source line: :func:`where`), specialised on the arguments a call leaves
at None or a bool; :func:`global_reads` / :func:`attribute_reads` name the module-level
and attribute values the trace baked in (their values key the programs and the fast
paths); the checks here refuse what no translation can fuse (a forward fx cannot trace,
one without a Linear, an augmented assignment to an alias).
"""
from __future__ import annotations

import ast as _ast
import inspect
import operator
import re
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse import caches
from cupyfuse.frontend.tables import _AUG_ASSIGN_FUNCS
from cupyfuse.ir.program import TailError

__all__ = ["trace", "Traced", "global_reads", "attribute_reads", "global_values", "where",
           "keyword_prefix", "check_has_linear", "check_augmented_aliases"]


#: torch.fx patches nn.Module.__call__ and __getattr__ process-wide while it traces: one
#: trace at a time (two would restore each other's patches), and (_Tracer below) module
#: calls from other threads pass straight through the patched methods (they went into the
#: tracer and failed: "module is not installed as a submodule", seen on the GPU with four
#: threads making their first calls at once)
_TRACE_LOCK = threading.RLock()


class _Tracer(torch.fx.Tracer):
    def __init__(self) -> None:
        super().__init__()
        self.record_stack_traces = True
        # buffers as graph inputs, like parameters: without it fx runs ops on buffers
        # alone (``self.var + eps``, ``self.log_scale.exp()``) at trace time and bakes
        # their results in as constants, which later buffer values would not reach
        self.proxy_buffer_attributes = True
        self._thread = threading.get_ident()

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        if threading.get_ident() != self._thread:
            return forward(*args, **kwargs)   # another thread's module call: run it
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if threading.get_ident() != self._thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def _filter_traceback_frames(self, summary: Any) -> Any:
        # torch keeps only frames from a `forward` on; a tail *function* has none. Keep
        # them all: :func:`where` picks the innermost frame outside torch and cupyfuse.
        return summary

    def iter(self, obj: Any) -> Any:
        """A shape unpacked into a call's arguments or a list (``h.view(*h.shape[:-1], H,
        D)``): its length is not known while tracing, so it goes in as one ``_star``
        node, which the translator splices into the shape it is part of. Any other
        iteration of a proxy is refused as torch.fx refuses it."""
        frame = inspect.currentframe()
        user = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
        if user is not None and _shape_like(obj.node) and _unpacks_star(user):
            return iter([self.create_proxy("call_function", _star, (obj,), {})])
        return super().iter(obj)

    def proxy(self, node: torch.fx.Node) -> torch.fx.Proxy:
        return _Proxy(node, self)


class _Proxy(torch.fx.Proxy):
    def __len__(self) -> int:
        # a ``*`` unpacking into a list asks for a length hint after iter(): none here
        # (a TypeError there is no error), see _Tracer.iter
        frame = inspect.currentframe()
        user = frame.f_back if frame is not None else None
        if user is not None and _shape_like(self.node) and _unpacks_star(user):
            raise TypeError("a shape's length is not known while tracing")
        return super().__len__()


def _star(shape: Any) -> Any:
    """Marks a shape unpacked with ``*`` in a traced forward (see ``_Tracer.iter``)."""
    return shape


def _shape_like(n: Any) -> bool:
    """Whether fx node ``n`` is a value's shape, or a slice or concatenation of one."""
    if not isinstance(n, torch.fx.Node):
        return False
    if n.op == "call_function" and n.target is getattr:
        return len(n.args) > 1 and n.args[1] == "shape"
    if n.op == "call_method" and n.target == "size":
        return len(n.args) == 1 and not n.kwargs
    if n.op == "call_function" and n.target is operator.getitem:
        return isinstance(n.args[1], slice) and _shape_like(n.args[0])
    if n.op == "call_function" and n.target is operator.add:
        return any(_shape_like(a) for a in n.args)
    return False


def _unpacks_star(frame: Any) -> bool:
    """Whether ``frame`` is executing a ``*`` unpacking (into a call's arguments or a
    list display), as torch.fx's Proxy.__iter__ reads the instruction."""
    import dis

    insts = list(dis.get_instructions(frame.f_code))
    if sys.version_info >= (3, 11):
        from bisect import bisect_left

        k = bisect_left(insts, frame.f_lasti, key=lambda x: x.offset)
    else:   # pragma: no cover - older Pythons count instructions
        k = frame.f_lasti // 2
    return k < len(insts) and insts[k].opname in (
        "LIST_EXTEND", "CALL_FUNCTION_EX", "BUILD_LIST_UNPACK", "BUILD_TUPLE_UNPACK",
        "BUILD_TUPLE_UNPACK_WITH_CALL")


@dataclass
class Traced:
    graph: torch.fx.Graph
    #: the module traced, held by a weak reference (a fused module keeps its traces: a
    #: strong one would make a cycle through the module that only Python's cyclic
    #: collector frees, the GPU memory of its parameters with it), or the root fx made
    #: for a tail function (only the trace holds that one)
    held: Any
    name: str
    forward: Any = None   # the traced forward (or tail function): refusals of its inputs
                          # and result point at its `def` line

    @property
    def root(self) -> nn.Module | None:
        """The module (or tail function's root) traced; None once the module is gone."""
        h = self.held
        return h() if type(h) is weakref.ref else h


#: the Python values torch.fx bakes into a trace when code reads them as globals: a
#: change of one must make a new program (see global_reads)
_GLOBAL_SCALARS = (bool, int, float, complex, str, type(None))
_reads_cache: dict[Any, tuple] = caches.register("global reads", {})
#: modules whose attributes are not followed (their values do not change under a model)
_FIXED_MODULES = ("torch", "numpy", "math", "builtins", "functools", "operator", "cupyfuse",
                  "typing", "collections")


def global_reads(obj: nn.Module | Callable) -> tuple[tuple[Any, str], ...]:
    """(namespace, name) of each value outside the module's own attributes that the
    traced code can read, and that torch.fx would bake into a trace: module-level names
    (numbers, strings, containers, functions, objects), attributes of other modules and
    of global objects named in the code (``mymod.K``, ``cfg.scale``), class attributes
    (``self.SCALE``, ``cls.C``) and a function's closure variables. Their current values
    (``global_values``) belong in every key of a trace or a program. The code walked: a
    function (its nested code, the functions it calls by name, through decorators'
    ``__wrapped__``, closures and ``functools.partial``), or a module's forwards along
    the MRO of each of its (sub)module classes and the methods they name. Not followed:
    ``globals()[...]`` and other dynamic lookups."""
    if isinstance(obj, nn.Module):
        classes = tuple({type(m): None for m in obj.modules()})
        hit = _reads_cache.get(classes)
        if hit is None:
            reads: dict = {}
            for cls in classes:
                for c in cls.__mro__:
                    if c.__module__.split(".")[0] in ("torch", "cupyfuse", "builtins"):
                        continue
                    fwd = c.__dict__.get("forward")
                    if callable(fwd):
                        reads.update(_walk(fwd, classes))
            hit = _reads_cache[classes] = tuple(reads.values())
        return hit
    try:
        hit = _reads_cache.get(obj)
    except TypeError:   # unhashable callable
        return tuple(_walk(obj, ()).values())
    if hit is None:
        hit = tuple(_walk(obj, ()).values())
        if len(_reads_cache) > 4096:
            _reads_cache.clear()
        _reads_cache[obj] = hit
    return hit


def attribute_reads(module: nn.Module) -> tuple[tuple[Any, str], ...]:
    """(namespace, name) of the attributes of a module's user-defined (sub)modules that
    torch.fx bakes into a trace and that plain scalar attributes (fused._mode_key) do not
    cover: containers (``self.scales[1]``, ``self.opts["a"]``) and plain objects
    (``self.cfg.s``: the object's identity and its own attributes). For global_values."""
    import types

    out: list[tuple[Any, str]] = []
    for m in module.modules():
        if type(m).__module__.split(".")[0] in ("torch", "cupyfuse"):
            continue
        for k, v in m.__dict__.items():
            if k.startswith("_") or isinstance(v, _GLOBAL_SCALARS):
                continue
            if isinstance(v, (list, tuple, dict)):
                out.append((m.__dict__, k))
            elif isinstance(getattr(v, "__dict__", None), dict) and not isinstance(
                    v, (nn.Module, torch.Tensor, type, types.FunctionType, types.MethodType,
                        types.ModuleType)):
                out.append((m.__dict__, k))
                d = v.__dict__
                out += [(d, a) for a, b in d.items()
                        if isinstance(b, _GLOBAL_SCALARS + (list, tuple, dict))]
    return tuple(out)


def global_values(reads: tuple[tuple[Any, str], ...]) -> tuple:
    """The key of the current values of ``reads`` (global_reads): numbers by type and
    repr (0.0 and -0.0, 1 and 1.0 and True differ), strings and None as they are, small
    containers of those by content, anything else by identity."""
    return tuple([_value_key(ns.get(name, _MISSING_GLOBAL)) for ns, name in reads])


_MISSING_GLOBAL = object()
_NUMBER_TYPES = (bool, int, float, complex)


def _value_key(v: Any) -> Any:
    t = type(v)
    if t is str or v is None:
        return v
    if t in _NUMBER_TYPES:
        return (t, repr(v))
    if t in (tuple, list) and len(v) <= 64:
        return (t,) + tuple([_value_key(x) if type(x) in _NUMBER_TYPES or type(x) is str
                             or x is None else id(x) for x in v])
    if t is dict and len(v) <= 64:
        try:
            return (t,) + tuple([(k, _value_key(x) if type(x) in _NUMBER_TYPES or type(x) is str
                                  or x is None else id(x)) for k, x in v.items()])
        except TypeError:
            return id(v)
    if isinstance(v, torch.Tensor):
        # by identity and version counter: fx runs ops on an outside tensor alone
        # (``h * s.exp()``) at trace time and bakes the result in
        return (torch.Tensor, id(v), v._version)
    return (object, id(v))


class _Attrs:
    """An object's or a class's attributes read like a globals dict (``get``)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def get(self, name: str, default: Any) -> Any:
        v = self.obj.__dict__.get(name, _MISSING_GLOBAL)   # the common case, cheaply
        if v is not _MISSING_GLOBAL:
            return v
        return inspect.getattr_static(self.obj, name, default)


class _Cell:
    """A closure cell read like a globals dict (``get``), for global_values."""

    __slots__ = ("cell",)

    def __init__(self, cell: Any) -> None:
        self.cell = cell

    def get(self, name: str, default: Any) -> Any:
        try:
            return self.cell.cell_contents
        except ValueError:
            return default


class _Defaults:
    """A function's default values read like a globals dict (``get``)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def get(self, name: str, default: Any) -> Any:
        kw = self.fn.__kwdefaults__
        return (self.fn.__defaults__, tuple(sorted(kw.items())) if kw else None)


def _fixed_module(m: Any) -> bool:
    return getattr(m, "__name__", "").split(".")[0] in _FIXED_MODULES


def _walk(fn: Any, classes: tuple) -> dict:
    """global_reads of one function or method (``classes``: whose methods and class
    attributes a name may be)."""
    import functools
    import types

    out: dict[tuple[int, str], tuple[Any, str]] = {}
    seen: set[int] = set()

    def record(ns: Any, key_obj: Any, name: str) -> None:
        out[(id(key_obj), name)] = (ns, name)

    def callee(f: Any) -> None:
        """Walk a function reached from the code (and what it wraps)."""
        for _ in range(8):
            if isinstance(f, functools.partial):
                callee(f.func)
                return
            if isinstance(f, (staticmethod, classmethod)):
                f = f.__func__
                continue
            if isinstance(f, types.MethodType):
                f = f.__func__
                continue
            break
        if not isinstance(f, types.FunctionType) or id(f) in seen:
            return
        if f.__module__ and f.__module__.split(".")[0] in _FIXED_MODULES:
            return
        seen.add(id(f))
        if f.__defaults__ or f.__kwdefaults__:   # defaults fx reads as constants
            out[(id(f), "__defaults__")] = (_Defaults(f), "__defaults__")
        visit(f.__code__, f.__globals__)
        if f.__closure__:   # closure variables: values, and functions a decorator wraps
            for name, cell in zip(f.__code__.co_freevars, f.__closure__):
                try:
                    v = cell.cell_contents
                except ValueError:
                    continue
                out[(id(cell), name)] = (_Cell(cell), name)
                callee(v)
        wrapped = getattr(f, "__wrapped__", None)
        if wrapped is not None:
            callee(wrapped)

    def follow(obj: Any, names: tuple, depth: int) -> None:
        """Attributes of a module or an object named in the code (one level per depth)."""
        if depth > 3 or _fixed_module(obj) or isinstance(obj, (nn.Module, torch.Tensor)):
            return
        d = getattr(obj, "__dict__", None)
        if not isinstance(d, dict) and not isinstance(obj, type):
            return
        ns = obj.__dict__ if isinstance(obj, types.ModuleType) else _Attrs(obj)
        for n in names:
            v = ns.get(n, _MISSING_GLOBAL)
            if v is _MISSING_GLOBAL or n.startswith("__"):
                continue
            record(ns, obj, n)
            if isinstance(v, (types.FunctionType, functools.partial)):
                callee(v)
            elif not isinstance(v, _GLOBAL_SCALARS):
                follow(v, names, depth + 1)

    def visit(code: Any, g: dict) -> None:
        if id(code) in seen:
            return
        seen.add(id(code))
        # names read, and string constants (getattr(mod, "K"), globals()["K"])
        names = code.co_names + tuple(c for c in code.co_consts
                                      if type(c) is str and c.isidentifier())
        for name in names:
            if name in g:
                v = g[name]
                if isinstance(v, types.ModuleType):
                    follow(v, names, 1)   # mymod.K (the module itself is not rebound)
                else:
                    record(g, g, name)
                    if isinstance(v, (types.FunctionType, functools.partial)):
                        callee(v)
                    elif not isinstance(v, _GLOBAL_SCALARS + (type,)):
                        follow(v, names, 1)   # cfg.scale of a global object
            for cls in classes:   # self.SCALE, cls.C; self.helper(h), self.sub.helper(h)
                m = inspect.getattr_static(cls, name, _MISSING_GLOBAL)
                if m is _MISSING_GLOBAL:
                    continue
                if isinstance(m, (types.FunctionType, staticmethod, classmethod)):
                    callee(m)
                elif isinstance(m, _GLOBAL_SCALARS + (tuple, list, dict)):
                    record(_Attrs(cls), cls, name)
        for c in code.co_consts:   # lambdas, inner functions, comprehensions
            if isinstance(c, types.CodeType):
                visit(c, g)

    f = getattr(fn, "__func__", fn)
    if isinstance(f, (types.FunctionType, functools.partial)):
        callee(f)
    return out


def trace(fn: nn.Module | Callable, name: str | None = None,
          concrete: dict[str, Any] | None = None) -> Traced:
    """Trace a module's forward (or a plain function of tensors) with torch.fx;
    ``concrete``: forward arguments (by name) the trace is specialised on (torch.fx's
    concrete_args: the None or bool a call leaves them at, which the forward may test)."""
    tr = _Tracer()
    label = name or (type(fn).__name__ if isinstance(fn, nn.Module) else
                     getattr(fn, "__name__", "tail"))
    try:
        if isinstance(fn, nn.Module):
            fwd = type(fn).forward
            check_augmented_aliases(fwd, label)
            state = _module_state(fn)
            with _TRACE_LOCK:
                try:
                    g = tr.trace(fn, concrete_args=concrete or None)
                finally:
                    written = _restore_module_state(state)
            if written:
                raise TailError(f"{label}: cannot fuse the forward's assignment to the "
                                f"module's `{written[0]}` (a parameter, buffer or submodule "
                                "replaced in the forward, e.g. `self.count += 1`: model state "
                                "the fused forward would not write back); keep the state "
                                "outside the forward")
            root = fn
        else:
            fwd = fn
            check_augmented_aliases(fn, label)
            with _TRACE_LOCK:
                g = tr.trace(fn)
            root = tr.root
    except TailError:
        raise
    except NameError as exc:
        if "not installed as a submodule" not in str(exc):
            raise TailError(f"{label}: torch.fx could not trace the forward ({exc})") from exc
        # a tail function (or a forward) calling an nn.Module that is not its submodule
        raise TailError(f"{label}: calls an nn.Module that is not a submodule of the traced "
                        "model (one built inside the forward, `nn.ReLU()(h)`, or held "
                        "outside it; a tail function cannot hold modules): use the "
                        "functional form (F.relu, F.batch_norm, F.layer_norm, ...) with its "
                        "tensors, make it a submodule in __init__, or fuse a module that "
                        "owns it with cupyfuse.from_model" + _user_frame(exc)) from exc
    except Exception as exc:  # fx cannot trace data-dependent control flow etc.
        raise TailError(f"{label}: torch.fx could not trace the forward "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                        "cupyfuse fuses forwards made of tensor ops without data-dependent "
                        "Python control flow or Python values made from traced ones "
                        "(`torch.tensor(x.shape[0])`, `int(h.max())`: use the value itself, "
                        "e.g. `h * x.shape[0]`)" + _user_frame(exc)) from exc
    finally:
        # fx's trace leaves the tracer in a reference cycle of its own (its nested
        # functions' closures): emptied, it holds the module no longer (a cycle holding
        # the module keeps its parameters' GPU memory until Python's cyclic collector)
        tr.__dict__.clear()
    for node in g.nodes:
        if node.op == "call_function" and node.kwargs:
            node.args, node.kwargs = keyword_prefix(node.target, node.args, node.kwargs)
    return Traced(g, weakref.ref(root) if root is fn else root, label, fwd)


def _module_state(root: nn.Module) -> list[tuple[nn.Module, str, dict]]:
    """(module, its path, a shallow copy of its attribute dict and of its parameter,
    buffer and submodule dicts) of ``root`` and each submodule, before a trace."""
    out = []
    for path, m in root.named_modules():
        d = dict(m.__dict__)
        for k in ("_parameters", "_buffers", "_modules"):
            if k in d:
                d[k] = dict(d[k])
        out.append((m, path, d))
    return out


def _restore_module_state(state: list[tuple[nn.Module, str, dict]]) -> list[str]:
    """Put back every attribute a trace assigned (fx runs ``self.x = ...`` of a forward on
    the module itself: a Proxy would be left in the user's model); the names of the
    parameters, buffers and submodules written (model state: refused)."""
    written = []
    for m, path, d in state:
        for k in ("_parameters", "_buffers", "_modules"):
            now = m.__dict__.get(k)
            if isinstance(now, dict) and k in d:
                keep = {n: v for n, v in now.items() if n.startswith("_tensor_constant")}
                for name, v in list(now.items()):
                    if name not in keep and (name not in d[k] or d[k][name] is not v):
                        written.append(f"{path}.{name}" if path else name)
                now.clear()
                now.update(d[k])
                now.update(keep)
        # plain attributes the forward sets for itself (``self.x = x`` read later in the
        # same forward): put back too, not refused (the fused forward does not set them)
        for name in [n for n in m.__dict__ if n not in d]:
            if not name.startswith("_tensor_constant"):   # (fx's own constants stay)
                del m.__dict__[name]
        for name, v in d.items():
            if name not in ("_parameters", "_buffers", "_modules") and m.__dict__.get(name) is not v:
                m.__dict__[name] = v
    return written


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def keyword_prefix(f: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``f(*args, **kwargs)`` with the leading tensor operands passed by keyword moved into
    the positional arguments (``torch.sum(input=h, dim=1)`` -> ``torch.sum(h, dim=1)``), as
    far as every signature of ``f`` naming all the keywords agrees on their positions; the
    call is the same call. The translators read an op's operands as its positional
    arguments (they raised IndexError on ``torch.softmax(input=h, dim=-1)`` before) and
    its options by keyword or position (``F.relu(h, inplace=True)`` must keep its keyword:
    moving it made an in-place relu look out of place)."""
    try:
        sigs = torch.fx.operator_schemas.get_signature_for_torch_op(f) or \
            [inspect.signature(f)]
    except (TypeError, ValueError, RuntimeError):
        return args, kwargs
    lists = [list(sig.parameters.values()) for sig in sigs
             if all(k in sig.parameters for k in kwargs)]
    if not lists:
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    while kwargs:
        i = len(args)
        here = [ps[i] if len(ps) > i else None for ps in lists]
        if any(p is None or p.kind not in _POSITIONAL or p.name != here[0].name for p in here) \
                or not isinstance(kwargs.get(here[0].name), torch.fx.Node):
            break   # (options, `dim=1`, `inplace=True`, stay keywords: translators read them so)
        args.append(kwargs.pop(here[0].name))
    return tuple(args), kwargs


def _user_frame(exc: BaseException) -> str:
    """``\n  at FILE:LINE in FUNC: source`` of the innermost frame of ``exc``'s traceback
    outside torch and cupyfuse (the forward's line that failed to trace), or ''."""
    import linecache
    import traceback

    own = (str(Path(torch.__file__).parent), str(Path(__file__).parent))
    hit = None
    for fs in traceback.extract_tb(exc.__traceback__):
        if not fs.filename.startswith(own) and not fs.filename.startswith("<"):
            hit = fs
    if hit is None:
        return ""
    src = (hit.line or linecache.getline(hit.filename, hit.lineno)).strip()
    return f"\n  at {hit.filename}:{hit.lineno} in {hit.name}: {src}"


def check_augmented_aliases(fn: Any, label: str) -> None:
    """Refuse ``a += ...`` (and -=, *=, /=) on a name that is aliased (``a = b`` or
    ``b = a``) in the forward: on tensors these run in place and change the alias too, but
    torch.fx records them as out-of-place ops, so the traced graph would be wrong."""
    import ast
    import inspect
    import textwrap

    if getattr(fn, "__name__", None) == "<lambda>":
        # an expression: no assignments to check; and its source is the whole statement it
        # stands in (code around it checked as if it were the tail's) or, on a continuation
        # line, a fragment that does not parse
        return
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(src)
        first = inspect.getsourcelines(fn)[1]
        path = inspect.getsourcefile(fn) or "<forward>"
    except (OSError, TypeError, SyntaxError):
        return
    aliased: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            aliased.add(node.value.id)
            aliased.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if (isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name)
                and node.target.id in aliased):
            line = first + node.lineno - 1
            raise TailError(f"{label}: cannot fuse the augmented assignment to "
                            f"`{node.target.id}`: it runs in place on a tensor that another name "
                            f"also refers to, which torch.fx cannot see; write "
                            f"`{node.target.id} = {node.target.id} {_AUG_OPS.get(type(node.op), '+')} ...`"
                            f"\n  at {path}:{line}")



_AUG_OPS = {_ast.Add: "+", _ast.Sub: "-", _ast.Mult: "*", _ast.Div: "/"}


def check_has_linear(traced: Traced) -> None:
    """Refuse, before any shapes are known, a forward with no Linear in it."""
    root = traced.root
    for n in traced.graph.nodes:
        if n.op == "call_module" and root is not None:
            try:
                if isinstance(root.get_submodule(n.target), nn.Linear):
                    return
            except AttributeError:
                pass
        if n.op == "call_function" and n.target in (F.linear, torch.matmul, operator.matmul,
                                                    torch.mm, torch.addmm, torch.einsum):
            return
        if n.op == "call_method" and n.target in ("matmul", "mm", "__matmul__"):
            return
    raise TailError(f"{traced.name}: no Linear layer (nn.Linear, F.linear, or a matmul/addmm "
                    "with a weight parameter) in the forward: nothing to fuse")


# a frame's code line is missing where its source is (<stdin>, exec'd strings)
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n(?:[ \t]*(?!File ")(\S.*))?')


_PKG_DIR = __file__.rsplit("/", 1)[0] + "/"


def where(node: torch.fx.Node, forward_file: str | None = None) -> str:
    """``file:line in function: code`` (no code where the source is not at hand: <stdin>,
    exec'd strings) of the user's source line that made ``node``
    (the innermost frame outside torch and cupyfuse, ``forward_file`` excepted: the
    traced forward's own file, which may be cupyfuse's, as for cupyfuse.kernelbench.models)."""
    m = _user_match(node, forward_file)
    if m is None:
        return ""
    code = (m.group(4) or "").strip()
    return f'{m.group(1)}:{m.group(2)} in {m.group(3)}' + (f": {code}" if code else "")


def _user_match(node: torch.fx.Node, forward_file: str | None) -> Any:
    """The stack-trace match (path, line, function, code) of the innermost frame outside
    torch and cupyfuse (``forward_file`` excepted) that made ``node``, or None."""
    st = node.stack_trace or node.meta.get("stack_trace") or ""
    found = None
    for m in _FRAME_RE.finditer(st):
        path = m.group(1)
        if ("/torch/" in path or path.startswith(_PKG_DIR)) and path != forward_file:
            continue
        found = m
    return found


def _user_code(node: torch.fx.Node, forward_file: str | None = None) -> str:
    """The source line (stripped; "" if unknown) of the user's frame that made ``node``
    (the frame ``where`` names)."""
    m = _user_match(node, forward_file)
    return "" if m is None else (m.group(4) or "").strip()


def _is_augmented(node: torch.fx.Node, forward_file: str | None = None) -> bool:
    """Whether ``node`` is the operation of an augmented assignment (``g += rhs``,
    ``-=``, ``*=``, ``/=``, ``**=``), which runs in place on a tensor ``g`` although fx
    records it out of place: its line is such a statement of the node's operator, and the
    node is not part of the right-hand side (no node of the same line execution reads it
    but as the target of the same operator: a loop repeats the statement)."""
    if node.op != "call_function" or node.target not in _AUG_ASSIGN_FUNCS.values() \
            or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    code = _user_code(node, forward_file)
    if not code or "=" not in code:
        return False
    try:
        tree = _ast.parse(code)
    except SyntaxError:
        return False
    st = node.stack_trace or node.meta.get("stack_trace") or ""
    if not any(isinstance(t, _ast.AugAssign) and _AUG_ASSIGN_FUNCS.get(type(t.op)) is node.target
               for t in tree.body):   # (statements joined by `;` too)
        return False
    for u in node.users:
        if (u.stack_trace or u.meta.get("stack_trace") or "") == st and not (
                u.target is node.target and u.args and u.args[0] is node):
            return False
    return True


def _def_line(fwd: Any) -> str:
    """``file:line in name: def name(...)`` of a forward or tail function ("" if unknown)."""
    try:
        lines, start = inspect.getsourcelines(fwd)
        return f"{inspect.getsourcefile(fwd)}:{start} in {fwd.__name__}: {lines[0].strip()}"
    except (OSError, TypeError):
        return ""
