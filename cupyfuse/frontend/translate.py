"""Translation: a traced forward becomes a :class:`~cupyfuse.ir.program.Program`.

:func:`translate` maps each node of a trace (:mod:`cupyfuse.frontend.trace`) onto the
vocabulary for given input shapes and module state (train/eval). The translator
(:class:`Translator`) is the fx node loop and its environment: what each node's value
is (a program value, a number, a weight, a boolean or integer tensor, a view torch sees
in another shape: :mod:`cupyfuse.frontend.values`), the program builder, and refusals
naming the op and the forward's source line. Each call node is lowered by the function
its op family registered for its spelling (:mod:`cupyfuse.frontend.lower`), or from the
op table's record (:mod:`cupyfuse.ops.registry`). Anything outside the vocabulary is
refused with a :class:`~cupyfuse.ir.program.TailError`.
"""
from __future__ import annotations

import inspect
import math
import operator
import sys
from typing import Any, Sequence

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse.ir import splits
from cupyfuse.frontend import lower as lowering
from cupyfuse.frontend.trace import (_FRAME_RE, Traced, _def_line, _is_augmented, _star,
                                     global_reads, where)
# (importing the families registers their lowerings)
from cupyfuse.frontend.lower import (batch, elementwise, factories, indexing, joins,  # noqa: F401
                                     linear, norms, reductions, split_features, transposes,
                                     views)
from cupyfuse.frontend.lower.linear import _IN_DERIVED
from cupyfuse.frontend.tables import (_AUGMENTED, _BOOL_OK_MODULES,
                                      _FACTORY_FUNCS, _FACTORY_METHODS,
                                      _NUMBER_OPS, _arg, _is_expand, _is_view_node,
                                      _node_name, elementwise_function, elementwise_method,
                                      elementwise_module, no_bool_function, op_of_function,
                                      op_of_method, op_of_module)
from cupyfuse.frontend.values import (Val, _BatchStat, _Bool, _Const, _DEVICE, _Device, _Index, _Indices, _Int,
                             _MergedRows, _Perm, _RawInt, _Rows, _Size, _Split, _Stacked,
                             _Star, _TensorConst, _Tuple, _Weight, _sizes)
from cupyfuse.ir.program import (BATCH, LEAD, LEAD_WHY, ROWS, Builder, DictResult, Program, TailError,
                      _fmt_dims)

__all__ = ["translate", "Translator"]


class Translator:
    """Translates one traced forward for given input shapes (:meth:`run`). This class
    holds the node loop, the dispatch of module, function and method calls, the values'
    bookkeeping and the refusals; the op families are the mixins it inherits, one module
    each (see this module's docstring)."""

    def __init__(self, traced: Traced, module: nn.Module | None, input_shapes: Sequence[tuple],
                 allow_no_gemm: bool = False) -> None:
        self.allow_no_gemm = allow_no_gemm
        self.bool_inputs: frozenset[int] = frozenset()
        self.int_inputs: frozenset[int] = frozenset()
        self.numbers: dict[int, int | float] = {}   # forward argument -> a number passed
        # forward argument -> the None or bool it is left at (the trace is specialised on
        # it: torch.fx's concrete_args), and the guard nodes fx adds for those
        self.specialized: dict[int, Any] = {}
        self.guards: set[torch.fx.Node] = set()
        self.loose_leads = False
        self.t = traced
        self.m = module
        self.shapes = list(input_shapes)
        self.cur: torch.fx.Node | None = None
        self.b = Builder(Program(n_inputs=len(input_shapes)), where=self._where,
                         label=traced.name)
        self.env: dict[torch.fx.Node, Any] = {}
        self.batch_squeezes: list[tuple[int, Any]] = []   # (value, its fx node)
        self.n_placeholders = 0
        # derived weights (cupyfuse.ir.derived): the nodes whose values are a GEMM operand
        # computed from the module's tensors alone, and the nodes only they read
        self.derived_roots: set[torch.fx.Node] = set()
        self.derived_weights: set[torch.fx.Node] = set()
        self.derived_skip: set[torch.fx.Node] = set()
        self.derived_numbers: dict[torch.fx.Node, int | float] = {}
        # values torch sees expanded over the batch or a leading dim they lack (an expand
        # of a parameter to (batch, n)): fx node -> torch's dims; the program keeps the
        # value unexpanded, read only by elementwise ops (see _lazy_after)
        self.lazy: dict[torch.fx.Node, tuple[int, ...]] = {}
        # flattens of an input read as (batch, prod(dims)) rows (_flat_reads) spelled with
        # other dims than (1, -1): the input itself
        self.whole_flattens: set[torch.fx.Node] = set()
        # the torch-frame dims of each result after the first (Program.more_lead_out)
        self.more_frames: list[tuple[int, ...]] = []
        # in-place ops on a tensor the forward made (``one_hot.scatter_(...)``), read by
        # nothing before them: op node -> the made tensor's node, whose value the op's is
        # from then on (_check_inplace)
        self.rebind: dict[torch.fx.Node, torch.fx.Node] = {}
        # tensors fx made at trace time (torch.ones(5) of numbers alone), by their attribute
        # name: as an operand of the tail, a constant of the program (val)
        self.made_consts: dict[str, torch.Tensor] = {}

    def _result_value(self, res: Any) -> int:
        """One of several results of the forward: a float32 value of the batch rows (its
        torch-frame dims, where they are not the value's own, in ``self.more_frames``:
        a value whose features are split into several dims, a (batch * seq, F) view)."""
        if isinstance(res, torch.fx.Node):
            v = self.env.get(res)
            ok = self.is_value(res)
        else:   # a piece of a chunk/split result (a value id)
            v = res
            ok = type(v) in (int, Val)
        if isinstance(v, _Index):   # positions (argmax/argmin): int64 results
            v = v.inner
            ok = isinstance(v, Val)
        if isinstance(res, (tuple, list, dict)):
            raise self.err("the forward returns a container inside its result (nested "
                           "tuples, lists or dicts): cupyfuse returns one tuple, list or "
                           "dict of tensors; flatten it, e.g. `return h, a, b`")
        if isinstance(v, _Split) and v.kind == "f" and BATCH in v.dims:
            self.more_frames.append(tuple(v.dims))   # (batch, H, D): torch's shape kept
            return v.v
        if isinstance(v, _Rows):   # (batch * seq, F)
            self.more_frames.append((ROWS,) + self.dims(v.v)[-1:] * (v.nd - 1))
            return v.v
        if isinstance(v, (_Bool, _Int, _Tuple, _Split)) or not ok:
            self.cur = res if isinstance(res, torch.fx.Node) else self.cur
            raise self.err("the forward returns several values, one of which is not a "
                           "float32 tensor of the batch rows (a fused model returns float32 "
                           "tensors computed from its input)")
        if BATCH not in self.dims(v):
            raise self.err("the forward returns several values, one of which does not "
                           "depend on the batch rows")
        self.more_frames.append(())
        return int(v)

    def _fresh_scalar(self, target: str, obj: torch.Tensor) -> bool:
        """A 0-d float32/int64/int32 tensor constant fx made while tracing (not a tensor
        the model or the traced code holds, whose value could change between calls)."""
        if obj.dim() != 0 or obj.dtype not in (torch.float32, torch.int64, torch.int32):
            return False
        return self._fresh(target, obj)

    def _fresh(self, target: str, obj: torch.Tensor) -> bool:
        """A tensor constant fx made while tracing (``torch.ones(5)``, ``torch.arange(4)``
        of numbers alone: made once, at trace time), not one the model or the traced code
        holds."""
        if not str(target).split(".")[-1].startswith("_tensor_constant"):
            return False
        held = getattr(self, "_held", None)
        if held is None:
            held = set()
            if self.m is not None:
                for m in self.m.modules():
                    held.update(id(v) for k, v in m.__dict__.items()
                                if isinstance(v, torch.Tensor)
                                and not k.startswith("_tensor_constant"))
            for obj_ in (self.t.forward, self.m):
                if obj_ is None:
                    continue
                for ns, name in global_reads(obj_):
                    v = ns.get(name, None)
                    if isinstance(v, torch.Tensor):
                        held.add(id(v))
            self._held = held
        return id(obj) not in held

    def _where(self) -> str:
        if self.cur is None:
            return ""
        if self.cur.op not in ("placeholder", "output"):
            try:
                own = inspect.getsourcefile(self.t.forward)
            except (TypeError, AttributeError):
                own = None
            if self._in_forward(self.cur):
                return where(self.cur, own)
            # fx gave it the stack of the call that traced the model (an attribute of a
            # result, `.indices`): the line of the value it reads
            src = next((a for a in self.cur.args if isinstance(a, torch.fx.Node)), None)
            if src is not None and self._in_forward(src):
                return where(src, own)
        # placeholders and the output have no line of their own: the forward's `def`
        return _def_line(self.t.forward)

    def _in_forward(self, node: torch.fx.Node) -> bool:
        """Whether ``node``'s recorded stack runs through the traced forward (or tail
        function); True when that cannot be told (no forward source)."""
        fwd = self.t.forward
        try:
            path, name = inspect.getsourcefile(fwd), fwd.__name__
        except (TypeError, AttributeError):
            return True
        if not path:
            return True
        st = node.stack_trace or node.meta.get("stack_trace") or ""
        return any(m.group(1) == path and m.group(3) == name for m in _FRAME_RE.finditer(st))

    def err(self, msg: str) -> TailError:
        return self.b.err(f"{self.t.name}: {msg}")

    def refuse(self, what: str, why: str = "") -> TailError:
        tail = f": {why}" if why else ": not in cupyfuse's tail vocabulary"
        return self.err(f"cannot fuse `{what}`{tail}")

    # --- helpers -------------------------------------------------------------------
    def val(self, a: Any, what: str) -> int:
        """A program value for an fx argument (numbers become constants)."""
        if isinstance(a, torch.fx.Node):
            v = self.env[a]
        else:
            v = a
        if isinstance(v, Val):
            return int(v)
        if isinstance(v, (_Bool, _Int)):   # promoted to float, as torch does
            return v.v
        if isinstance(v, _Split):   # (ops on split values are translated by _split_call)
            raise self._split_refusal(what, v)
        if isinstance(v, bool):
            raise self.refuse(what, "a boolean operand")
        if isinstance(v, int) and not -2 ** 63 <= v < 2 ** 63:
            raise self.refuse(what, f"the number {v} does not fit int64 (torch raises)")
        if isinstance(v, (int, float)):
            return self.b.const(float(v))
        if isinstance(v, _Const):
            return self.b.const(v.v)
        if isinstance(v, _Weight) and isinstance(v.source, str) and \
                v.source in self.made_consts and not v.transposed:
            made = factories._made_constant(self, self.made_consts[v.source], what)
            if made is not None:   # (a number or an iota: made on the device it runs on)
                return made.v if isinstance(made, (_Bool, _Int)) else int(made)
        if isinstance(v, _Weight):
            if v.transposed or len(v.shape) > 1 and v.shape[0] > 1 and v.shape[1] > 1:
                raise self.refuse(what, "uses a matrix parameter outside a matmul (the tail "
                                  "computes on the batch rows; math on a module's matrices "
                                  "alone is fused only as a Linear's weight or bias, e.g. "
                                  "`F.linear(h, self.w * s)`)")
            return self.b.param(v.source, v.shape)
        if isinstance(v, _Size):
            if v.v == LEAD:
                raise self.refuse(what, "uses a leading (sequence) dim's size as a number")
            return self.b.const(float(v.v)) if v.v != BATCH else self._refuse_batch_size(what)
        if isinstance(v, torch.Tensor):
            return self._tensor_const(v, what)
        if isinstance(v, _MergedRows):
            raise self.refuse(what, "uses the row count of a (batch * seq, F) view (batch * "
                                    "seq) as a number")
        if isinstance(v, _Rows):   # (ops reading a _Rows are translated by _rows_call)
            raise self.refuse(what, "an op on a (batch * seq, F) view")
        raise self.refuse(what, f"an operand of type {type(v).__name__}")

    def _refuse_batch_size(self, what: str) -> int:
        raise self.refuse(what, "uses the batch size as a number")

    def _tensor_const(self, t: torch.Tensor, what: str) -> int:
        if t.dtype not in (torch.float32,) and t.is_floating_point():
            raise self.refuse(what, f"a {t.dtype} tensor (cupyfuse runs float32)")
        if t.numel() == 1 and t.dim() == 0 and not t.requires_grad and not isinstance(t, nn.Parameter):
            return self.b.const(float(t))
        return self.b.param(t.detach().float(), tuple(t.shape))

    def is_value(self, a: Any) -> bool:
        return isinstance(a, torch.fx.Node) and isinstance(self.env.get(a), Val)

    def is_tensor_like(self, a: Any) -> bool:
        """A value, a parameter/buffer or a tensor (not a Python number)."""
        v = self.env.get(a) if isinstance(a, torch.fx.Node) else a
        return isinstance(v, (Val, _Weight, torch.Tensor)) or \
            isinstance(v, _Split) and v.kind == "f"

    def ints(self, seq: Any, what: str) -> tuple:
        """A shape argument as ints (sizes read from a value's shape resolved)."""
        out = []
        if isinstance(seq, torch.fx.Node) and isinstance(self.env.get(seq), tuple):
            seq = self.env[seq]   # a slice of a value's shape: h.shape[1:]
        for s in (seq if isinstance(seq, (tuple, list)) else [seq]):
            x = self.env[s] if isinstance(s, torch.fx.Node) else s
            if isinstance(x, _Size):
                if x.v == BATCH:
                    raise self.refuse(what, "a shape built from the batch size")
                if x.v == LEAD:
                    raise self.refuse(what, "a shape built from a leading (sequence) dim: " +
                                      LEAD_WHY)
                x = x.v
            if isinstance(x, _Const):
                x = int(x.v)
            if isinstance(x, Val):   # a program value (a size computed in the forward)
                raise self.refuse(what, "a shape computed from sizes (h.shape[1] * 2): "
                                        "write the number")
            if not isinstance(x, int):
                raise self.refuse(what, "a shape that is not a tuple of ints")
            out.append(x)
        return tuple(out)

    def _shape_tuple(self, a: Any) -> tuple | None:
        """A shape argument as a tuple of its entries (ints, sizes read from a value's
        shape): a value's ``.shape`` or a slice of it, or a tuple/list of such entries;
        None for anything else."""
        if isinstance(a, torch.fx.Node):
            e = self.env.get(a)
            return e if isinstance(e, tuple) else None
        if not isinstance(a, (tuple, list)):
            return None
        out = []
        for x in a:
            e = self.env.get(x) if isinstance(x, torch.fx.Node) else x
            if isinstance(e, _Const) and type(e.v) is int:
                e = e.v
            if not (isinstance(e, _Size) or type(e) is int):
                return None
            out.append(e)
        return tuple(out)

    def _spliced(self, shape: Any) -> Any:
        """A shape argument with ``*``-unpacked shapes (``_Star``) spliced in."""
        if not isinstance(shape, (tuple, list)):
            return shape
        out: list = []
        for s in shape:
            e = self.env.get(s) if isinstance(s, torch.fx.Node) else None
            out.extend(e.items if isinstance(e, _Star) else [s])
        return type(shape)(out) if isinstance(shape, tuple) else out

    def number(self, a: Any, what: str) -> float:
        v = self.env[a] if isinstance(a, torch.fx.Node) else a
        if isinstance(v, _Const):
            return v.v
        if isinstance(v, (int, float)) and not isinstance(v, (bool, Val)):
            return float(v)
        if isinstance(v, _Size):
            if v.v == BATCH:
                self._refuse_batch_size(what)
            if v.v == LEAD:
                raise self.refuse(what, "uses a leading (sequence) dim's size as a number")
            return float(v.v)
        raise self.refuse(what, "needs a number here")

    def dims(self, v: int) -> tuple[int, ...]:
        return self.b.dims(v)

    def feature_axis(self, v: int) -> int | None:
        return self.b.p.nodes[v].feature_axis()

    def _get_attr(self, target: str) -> Any:
        obj: Any = self.m
        for part in target.split("."):
            obj = getattr(obj, part)
        return obj

    def _leads_of(self) -> tuple[int, ...]:
        """The leading dims of the inputs: those between the batch and the last dim of an
        input that varies along two or more dims after the batch, as a (batch, seq,
        features) input does, or has an empty one; () when no input does. With
        ``loose_leads`` also an input whose only dim > 1 before the last is followed by a
        last dim of 1: (batch, seq, 1), which is otherwise read as (batch, features, 1)
        (``translate`` tries that reading second)."""
        for shp in self.shapes:
            if shp is not None and _has_leads(shp, self.loose_leads):
                return tuple(int(x) for x in shp[1:-1])
        return ()

    def _input_dims(self, i: int, shp: tuple[int, ...]) -> tuple[int, ...]:
        """Input ``i``'s dims: (batch, features...), or with leading dims (batch, seq...,
        features), the leading dims marked LEAD; every input must then have them. An
        input after x may also be (batch, seq...) without features: one number per
        (batch, seq) row (an attention mask, ``mask.unsqueeze(-1)`` in the forward)."""
        lead = self.lead
        if i and len(shp) == 1 and self.shapes and self.shapes[0] and \
                shp[0] != self.shapes[0][0]:
            raise self.err(f"input {i} has shape {tuple(shp)}: cupyfuse reads every input as "
                           f"batch-first, one number per row here ({shp[0]} rows against x's "
                           f"{self.shapes[0][0]}); a per-feature vector goes in as (1, "
                           f"{shp[0]}) or as a parameter or buffer of the module")
        if not lead:
            dims = (BATCH,) + shp[1:]
            if sum(1 for x in dims if x > 1) > 1:   # pragma: no cover - lead mode takes it
                raise self.err(f"input {i} has shape {_fmt_dims(dims)}, two feature "
                               "dimensions; a tail varies along one feature axis")
            return dims
        if i and tuple(shp[1:]) == lead:   # (batch, seq): one number per row
            return (BATCH,) + tuple(LEAD if x != 1 else 1 for x in lead)
        if len(shp) != len(lead) + 2 or shp[1:-1] != lead:
            raise self.err(f"input {i} has shape {tuple(shp)}; with a (batch, "
                           f"{', '.join(map(str, lead))}, features) input every input must "
                           "have those leading dims (each row of the batch and sequence is "
                           "one row of the fused op)")
        return (BATCH,) + tuple(LEAD if x != 1 else 1 for x in lead) + (shp[-1],)

    def _var_args(self, node: torch.fx.Node, i: int) -> Any:
        """The forward's ``*rest`` or ``**kwargs`` (fx's placeholder ``node``, the forward's
        argument ``i``): empty where the call passes nothing through it and the trace
        does not read it; refused otherwise (cupyfuse passes the arguments the forward
        names)."""
        name = str(node.target)
        star = name.lstrip("*")
        j = i - sum(1 for k in self.numbers if k < i) \
            - sum(1 for k in self.specialized if k < i)
        passed = not name.startswith("**") and (
            j < len(self.shapes) or any(k >= i for k in self.numbers)
            or any(k >= i for k in self.specialized))
        if passed:
            raise self.err(f"the call passes arguments through the forward's `{name}`: "
                           "cupyfuse passes a forward's named arguments (name them in the "
                           f"forward, e.g. `def forward(self, x, mask)`, or fuse a forward "
                           f"without `{name}`)")
        if node.users:
            raise self.err(f"the forward reads `{star}` (its `{name}`), which this call "
                           "leaves empty, but torch.fx traced it as one input: pass the "
                           "forward's inputs as named arguments, or drop the use")
        return {} if name.startswith("**") else ()

    def _left_at_default(self, node: torch.fx.Node, default: Any) -> Any:
        """A forward argument not passed whose default is None or a bool: a constant of
        the trace where the trace cannot depend on it (no node reads it and the forward's
        code never names it), else refused naming it. (torch.fx traced it as an input, a
        proxy: ``y is None`` was False then and ``if verbose:`` cannot trace.)"""
        name = str(node.target)
        if not node.users and not _names_argument(self.t.forward, name):
            return default
        how = ("its traced ops read it" if node.users else
               "its code names it (a `... is None` test followed the traced input, not the "
               "default)")
        raise self.err(f"the forward's argument `{name}` is left at its default {default!r}, "
                       f"but the forward was traced with an input for it and {how}: pass "
                       f"`{name}` (cupyfuse takes tensors and numbers), or drop it from the "
                       "forward")

    def _float32_only(self, kw: dict, name: str, args: tuple = ()) -> None:
        """A ``dtype`` argument other than float32 (torch computes and returns that type)."""
        for dt in [kw.get("dtype")] + [a for a in args if isinstance(a, torch.dtype)]:
            if dt is not None and dt is not torch.float32:
                raise self.refuse(name, f"dtype={dt} (cupyfuse computes and returns float32)")

    # --- a value's kind and flat form: plain, boolean ("b"), integer ("i"), split --------
    def _split_of(self, a: Any) -> "_Split | None":
        e = self.env.get(a) if isinstance(a, torch.fx.Node) else a
        return e if isinstance(e, _Split) else None

    def _kind_of(self, a: Any) -> str:
        e = self.env.get(a) if isinstance(a, torch.fx.Node) else a
        return e.kind if isinstance(e, _Split) else "b" if isinstance(e, _Bool) else \
            "i" if isinstance(e, _Int) else "f"

    @staticmethod
    def _wrap(kind: str, v: int) -> Any:
        return _Bool(v) if kind == "b" else _Int(v) if kind == "i" else Val(v)

    def _mk(self, v: int, dims: Sequence[int], kind: str = "f") -> Any:
        """The value of program value ``v`` (flat) with torch dims ``dims``: a ``_Split``
        where the features are in several dims, else the plain value (a view of ``v``)."""
        dims = tuple(dims)
        if splits.is_split(dims):
            return _Split(v, dims, kind)
        return self._wrap(kind, self.b.view(v, dims))

    def _sv(self, a: Any, name: str) -> tuple[int, tuple[int, ...], str]:
        """(flat program value, torch dims, kind) of a split value or a plain one."""
        sp = self._split_of(a)
        if sp is not None:
            return sp.v, sp.dims, sp.kind
        v = self.val(a, name)
        d = self.dims(v)
        return self.b.view(v, splits.flat_dims(d)), d, self._kind_of(a)

    # --- inputs flattened whole before any other use -----------------------------------
    def _flat_reads(self) -> None:
        """Inputs of three or more dims whose every use flattens all their dims after the
        batch into one (``x.view(-1, 784)`` where 784 is their product, ``x.view(x.size(0),
        -1)``, ``x.reshape(x.shape[0], -1)``, ``x.flatten(1)``, ``nn.Flatten()``; through
        ``.contiguous()`` too) or reads the batch size (``x.size(0)``): the program reads
        them as (batch, prod(other dims)) rows (``Program.flat_inputs``; the caller passes
        them reshaped so), not as a (batch, seq..., features) input. A view that keeps
        other dims (``x.view(-1, 7)`` of a (batch, 7, 7) input merges the batch into the
        rows) does not qualify. Not for tail functions (their input 0 is the Linear's
        output)."""
        if self.allow_no_gemm:
            return
        flat = []
        k = 0
        for node in self.t.graph.nodes:
            if node.op != "placeholder":
                continue
            i, k = k, k + 1
            if i in self.numbers or i in self.specialized:
                continue
            j = i - sum(1 for q in self.numbers if q < i) \
                - sum(1 for q in self.specialized if q < i)
            if j >= len(self.shapes) or self.shapes[j] is None or len(self.shapes[j]) < 3:
                continue
            shp = tuple(int(s) for s in self.shapes[j])
            P = math.prod(shp[1:])
            whole: set[torch.fx.Node] = set()
            uses = [_flat_use(u, node, P, self.m, len(shp), whole) for u in node.users]
            if P > 0 and ("flat" in uses or "view" in uses) and all(uses):
                self.shapes[j] = (shp[0], P)
                flat.append((j, "view" in uses))
                self.whole_flattens |= whole
        self.b.p.flat_inputs = tuple(flat)

    # --- the walk --------------------------------------------------------------------
    def run(self) -> Program:
        self._flat_reads()
        self.lead = self._leads_of()
        linear._plan_derived(self)
        self.b.leads = tuple(x for x in self.lead if x != 1)   # the sizes of the LEAD dims
        out = None
        split_out = None   # the result's torch dims where its features are split
        for node in self.t.graph.nodes:
            self.cur = node
            if node in self.guards:
                self.env[node] = None
                continue
            if node in self.derived_skip:   # read only by a derived weight
                self.env[node] = _IN_DERIVED
                continue
            if node in self.derived_roots:
                self.env[node] = linear._derived(self, node)
                continue
            if node in self.whole_flattens:   # x.flatten(1, 2) of a flattened input
                self.env[node] = self.env[node.args[0]]
                continue
            if node.op == "placeholder":
                i = self.n_placeholders   # the forward's argument
                self.n_placeholders += 1
                if str(node.target).startswith("*"):   # the forward's *args or **kwargs
                    self.env[node] = self._var_args(node, i)
                    continue
                if i in self.numbers:   # a Python number passed for it: a constant here
                    self.env[node] = _Const(self.numbers[i])
                    continue
                if i in self.specialized:   # None or a bool: the trace is specialised on it
                    self.env[node] = self.specialized[i]
                    self.guards |= _guards_of(node)
                    continue
                # the tensor input
                j = i - sum(1 for k in self.numbers if k < i) \
                    - sum(1 for k in self.specialized if k < i)
                if j >= len(self.shapes):
                    if node.args and type(node.args[0]) in (int, float):
                        self.env[node] = _Const(node.args[0])   # a number's default value
                        continue
                    if node.args and (node.args[0] is None or type(node.args[0]) is bool):
                        self.env[node] = self._left_at_default(node, node.args[0])
                        continue
                    raise self.err(f"the forward takes more tensor arguments than the "
                                   f"{len(self.shapes)} given")
                shp = self.shapes[j]
                if shp is None:
                    self.env[node] = None
                    continue
                if len(shp) < 1:
                    raise self.err(f"input {i} is a 0-d tensor; inputs must have a batch dimension")
                dims = self._input_dims(i, tuple(int(s) for s in shp))
                v = self.b.input(j, dims)
                self.env[node] = _Bool(v) if i in self.bool_inputs else \
                    _RawInt(v, f"`{node.target}`") if i in self.int_inputs else Val(v)
            elif node.op == "get_attr":
                obj = self._get_attr(node.target)
                if isinstance(obj, torch.Tensor) and self._fresh_scalar(node.target, obj):
                    # torch.tensor(2) / torch.tensor(0.5) made in the forward: fx made it
                    # at trace time (the same every call); a number of the program (as a
                    # tensor it would stay on the CPU, where eager passes it as a scalar)
                    v = obj.item()
                    self.env[node] = _TensorConst(float(v) if obj.is_floating_point() else int(v))
                    continue
                if isinstance(obj, torch.Tensor) and obj.dim() >= 1 and \
                        self._fresh(node.target, obj):
                    # torch.ones(5), torch.arange(4) made in the forward of numbers alone:
                    # where it is an operand of the tail (val), a constant of the program
                    # where it is one along one dim (made on the device it runs on); as a
                    # GEMM operand, a norm's weight ... the tensor fx made (on the CPU)
                    self.made_consts.setdefault(node.target, obj)
                if isinstance(obj, torch.Tensor):
                    if obj.is_floating_point() and obj.dtype != torch.float32:
                        raise self.refuse(node.target, f"a {obj.dtype} tensor (cupyfuse runs float32)")
                    self.env[node] = _Weight(node.target, tuple(obj.shape))
                else:
                    self.env[node] = obj
            elif node.op in ("call_module", "call_function", "call_method"):
                if node.kwargs.get("out") is not None:
                    # torch.add(h, 1, out=h): the result written into an existing tensor
                    # (its readers see it); refused before any op's own handling
                    raise self.refuse(_node_name(node), "out= (a result written into an "
                                      "existing tensor); assign the result instead")
                if self.lazy:   # expands that add the batch or a leading dim
                    views._lazy_before(self, node)
                if any(isinstance(self.env.get(a), _Index) for a in node.all_input_nodes):
                    r = self._index_call(node)   # (positions read: argmax/argmin)
                else:
                    r = self._dispatch(node)
                if self.lazy:
                    views._lazy_after(self, node, r)
                if type(r) is int or type(r) is Val:
                    # a view of a boolean or integer tensor (or that tensor itself) keeps
                    # its dtype in torch
                    src = node.args[0] if node.args else None
                    base = self.env.get(src) if isinstance(src, torch.fx.Node) else None
                    if isinstance(base, (_Bool, _Int)) and (
                            _is_view_node(node) or node.op == "call_module" and
                            isinstance(self._get_attr(node.target), _BOOL_OK_MODULES)):
                        r = type(base)(int(r))
                self.env[node] = Val(r) if type(r) is int else r
                if node in self.rebind:   # (an in-place op on a tensor the forward made)
                    made = self.rebind[node]
                    self.env[node] = self._written(self.env[made], self.env[node],
                                                   _node_name(node))
                    for k in [made] + [k for k, t in self.rebind.items() if t is made]:
                        self.env[k] = self.env[node]
            elif node.op == "output":
                res = node.args[0]
                if batch.has_stats(self, res):   # numbers over the whole batch returned
                    out = batch.outputs(self, res)
                    continue
                raw = [a for a in node.all_input_nodes if isinstance(self.env.get(a), _RawInt)]
                if raw:
                    self.cur = raw[0]
                    raise self.refuse("an integer result", f"the forward returns the integer "
                                      f"input {self.env[raw[0]].label} (or a view of it); a "
                                      "fused model returns float32")
                perm = [a for a in node.all_input_nodes if isinstance(self.env.get(a), _Perm)]
                if perm:
                    self.cur = perm[0]
                    T = _fmt_dims(transposes._perm_dims(self, self.env[perm[0]]))
                    raise self.refuse(_node_name(perm[0]), f"returns a transposed value {T} "
                                      "(torch gives a view with its dims reordered; cupyfuse "
                                      "returns results in the order the value is computed "
                                      "in, row by row): return it before the transpose and "
                                      "transpose the result after the call")
                stk = [a for a in node.all_input_nodes if isinstance(self.env.get(a), _Stacked)]
                if stk:
                    self.cur = stk[0]
                    raise self.refuse("torch.stack", "returns a stack along dim 0, before "
                                      "the batch (a fused model returns values whose batch "
                                      "comes first): reduce or index that dim (`.mean(0)`, "
                                      "`s[0]`), or stack along dim 1")
                lazy = [a for a in node.all_input_nodes if a in self.lazy]
                if lazy:
                    self.cur = lazy[0]
                    raise self.refuse(_node_name(lazy[0]), "returns a value expanded to "
                                      f"{_fmt_dims(self.lazy[lazy[0]])} over the batch or "
                                      "a leading dim (an expand of a value without them): "
                                      "cupyfuse fuses such an expand only where an "
                                      "elementwise op broadcasts it anyway")
                if isinstance(res, dict):
                    # a dict of tensors (string keys): its values in order, rebuilt per call
                    if not res:
                        raise self.err("the forward returns an empty dict")
                    if not all(type(k) is str for k in res):
                        raise self.err("the forward returns a dict with keys that are not "
                                       "strings: cupyfuse returns dicts keyed by strings")
                    keys, res = list(res), list(res.values())
                    if len(res) > 1:
                        self.b.p.more_outs = tuple(self._result_value(r) for r in res[1:])
                    self.b.p.outs_type = DictResult(keys)
                    res = res[0]
                elif isinstance(res, (tuple, list)) and len(res) > 1:
                    # several tensors: each a value of the program (materialised)
                    self.b.p.more_outs = tuple(self._result_value(r) for r in res[1:])
                    # (fx records a list as its immutable_list)
                    self.b.p.outs_type = list if isinstance(res, list) else tuple
                    res = res[0]
                elif isinstance(res, (tuple, list)):
                    if len(res) != 1:
                        raise self.err("the forward returns an empty tuple")
                    self.b.p.outs_type = list if isinstance(res, list) else tuple
                    res = res[0]
                if isinstance(res, (tuple, list, dict)):
                    raise self.err("the forward returns a container inside its result "
                                   "(nested tuples, lists or dicts): cupyfuse returns one "
                                   "tuple, list or dict of tensors; flatten it, e.g. "
                                   "`return h, a, b`")
                sp = self.env.get(res) if isinstance(res, torch.fx.Node) else None
                if isinstance(sp, _Index):   # positions (argmax/argmin): an int64 result
                    sp = sp.inner
                    if isinstance(sp, Val):
                        out = int(sp)
                        continue
                if isinstance(sp, _Rows):   # (batch * seq, F): torch's shape kept
                    out, split_out = sp.v, (ROWS,) + self.dims(sp.v)[-1:] * (sp.nd - 1)
                    continue
                if isinstance(sp, _Split):
                    self.cur = res
                    if sp.kind != "f":
                        raise self.refuse("a boolean result" if sp.kind == "b" else
                                          "an integer result", "the forward returns a "
                                          f"{'boolean' if sp.kind == 'b' else 'integer'} "
                                          "tensor; a fused model returns float32")
                    if BATCH not in sp.dims:
                        raise self.err("the forward does not return a tensor computed from "
                                       "its input")
                    out, split_out = sp.v, sp.dims   # (batch, H, D): torch's shape kept
                    continue
                if isinstance(self.env.get(res) if isinstance(res, torch.fx.Node) else None, _Bool):
                    self.cur = res   # the line that made it (the output node has none)
                    raise self.refuse("a boolean result", "the forward returns a boolean "
                                      "tensor; a fused model returns float32")
                if isinstance(self.env.get(res) if isinstance(res, torch.fx.Node) else None,
                              _Int):
                    self.cur = res
                    raise self.refuse("an integer result", "the forward returns an integer "
                                      "tensor (int64 in torch: booleans with integer "
                                      "arithmetic); a fused model returns float32: make it "
                                      "float, e.g. `mask.float() * 3` or `.float()`")
                tup = self.env.get(res) if isinstance(res, torch.fx.Node) else None
                if isinstance(tup, _Tuple) and len(tup.items) == 2 and \
                        isinstance(tup.items[1], _Indices):
                    # max/min's (values, indices) returned as it is: both results, in
                    # torch's own pair type
                    self.cur = res
                    out = self._result_value(tup.items[0])
                    first = self.more_frames.pop()
                    self.b.p.more_outs = (self._result_value(
                        reductions._indices(self, tup.items[1], _node_name(res))),)
                    self.b.p.outs_type = getattr(torch.return_types, tup.items[1].op)
                    split_out = first or None
                    continue
                if isinstance(tup, _Tuple) and tup.items:
                    # a chunk/split result returned as it is: its pieces are the results
                    out = self._result_value(tup.items[0])
                    first = self.more_frames.pop()
                    self.b.p.more_outs = tuple(self._result_value(r) for r in tup.items[1:])
                    self.b.p.outs_type = tuple
                    split_out = first or None
                    continue
                if not self.is_value(res):
                    raise self.err("the forward does not return a tensor computed from its input")
                out = int(self.env[res])
        if out is None:
            raise TailError(f"{self.t.name}: the forward returns nothing")
        p = self.b.p
        p.out = out
        if self.lead and self.batch_squeezes:
            self.cur = self.batch_squeezes[0][1]
            raise self.refuse("squeeze", "squeeze() with no dim on a (batch, seq, features) "
                              "input (torch drops the batch or seq dim where it is 1): give "
                              "it the dims to drop")
        if self.lead and BATCH not in self.dims(out):
            raise self.err("the result has no batch dimension")
        p.more_lead_out = tuple(self.more_frames)
        p.lower_leads(tuple(x for x in self.lead if x != 1))   # the sizes of the LEAD dims
        if split_out is not None:
            p.lead_out = split_out
        for v, node in self.batch_squeezes:
            if v == out and not p.more_outs:
                p.squeezes_batch = True
            else:
                self.cur = node
                raise self.refuse("squeeze", "squeeze() of the batch dim (torch drops it at "
                                  "batch size 1) before more ops: give it the dims to drop, "
                                  "e.g. squeeze(1), or squeeze last")
        if not self.allow_no_gemm and not any(n.kind == "gemm" for n in p.nodes):
            raise TailError(f"{self.t.name}: no Linear layer (nn.Linear, F.linear or a matmul "
                            "with a weight parameter) in the forward: nothing to fuse")
        return p

    def _dispatch(self, node: torch.fx.Node) -> Any:
        """The translation of a call node, by the kind of value it reads: a transposed
        value, an integer input, a (batch * seq, F) view, a stack along dim 0, a value
        whose features are split into several dims (each its own translation), else the
        plain module, function or method call."""
        if any(isinstance(self.env.get(a), _BatchStat) for a in node.all_input_nodes):
            return batch.stat_call(self, node)   # (a number over the whole batch read)
        stat = batch.batch_reduce(self, node)
        if stat is not None:   # (a sum or mean over every row)
            return stat
        if any(isinstance(self.env.get(a), _Perm) for a in node.all_input_nodes):
            return transposes._perm_call(self, node)   # (a value with its dims reordered)
        if any(isinstance(self.env.get(a), _RawInt) for a in node.all_input_nodes):
            return elementwise._raw_int_call(self, node)   # (an integer input read)
        if any(isinstance(self.env.get(a), _Rows) for a in node.all_input_nodes):
            return views._rows_call(self, node)   # (a (batch * seq, F) view read)
        if any(isinstance(self.env.get(a), _Stacked) for a in node.all_input_nodes):
            return joins._stacked_call(self, node)   # (a stack along dim 0 read)
        if self._touches_split(node) and not _is_expand(node):
            return split_features._split_call(self, node)
        return getattr(self, node.op)(node)

    def split_call(self, node: torch.fx.Node) -> Any:
        """The translation of a call node reading a value whose features are split into
        several dims (:mod:`cupyfuse.frontend.lower.split_features`)."""
        return split_features._split_call(self, node)

    def _position_compare(self, node: torch.fx.Node, name: str) -> Any:
        """A comparison of positions (argmax/argmin, topk's) with class targets (an integer
        input), other positions or an integer below 2**24: a boolean mask (``(h.argmax(1)
        == t).float()``, an accuracy). Exact: both sides hold integers as float32. None
        where ``node`` is no such comparison."""
        rec = op_of_function(node.target) if node.op == "call_function" else \
            op_of_method(node.target) if node.op == "call_method" else None
        if getattr(rec, "kind", None) != "compare" or len(node.args) != 2 or node.kwargs:
            return None
        vals = []
        for a in node.args:
            e = self.env.get(a) if isinstance(a, torch.fx.Node) else a
            if isinstance(e, _Const):
                e = e.v
            if isinstance(e, _Index) and isinstance(e.inner, Val):
                vals.append(int(e.inner))
            elif isinstance(e, _RawInt):
                vals.append(e.v)
            elif type(e) is int and abs(e) < 2 ** 24:
                vals.append(self.b.const(float(e)))
            else:
                return None
        return _Bool(self.b.map(rec.name, *vals))

    def _index_call(self, node: torch.fx.Node) -> Any:
        """An op reading positions (``_Index``: argmax/argmin, the indices of max/min,
        int64 in torch). Views and no-op casts keep them positions (``.view``, ``.reshape``,
        ``.squeeze``, ``.unsqueeze``, ``.flatten``, ``.long()``, ``.detach()``,
        ``.clone()``, ``.contiguous()``, ``.to(torch.int64)`` or a device, their shape);
        ``.float()`` (``.to(torch.float32)``) makes a float32 value of them (exact: a
        position below 2**24 is a float32 number); anything else -- arithmetic,
        comparisons, indexing with them or of them, one_hot, gather, an embedding -- is
        refused."""
        op, t = node.op, node.target
        args = tuple(self._plain(a) for a in node.args)
        kw = {k: self._plain(v) for k, v in node.kwargs.items()}
        name = _node_name(node)
        hit = self._position_compare(node, name)
        if hit is not None:   # (pred == target: an accuracy mask)
            return hit
        a0 = node.args[0] if node.args else None
        idx = self.env.get(a0) if isinstance(a0, torch.fx.Node) else None
        # (other operands: sizes and numbers of a view's shape only)
        others = [a for a in node.all_input_nodes if a is not a0 and isinstance(
            self.env.get(a), (Val, _Split, _Rows, _Bool, _Int, _Weight, _Perm, _Stacked,
                              _RawInt, _Index, _Tuple, torch.Tensor))]
        why = ("uses the positions argmax/argmin (or max/min's indices) give, int64 in "
               "torch: cupyfuse returns them (alone or beside other results), views of them "
               "and `.float()` of them, and compares them with targets; arithmetic, other "
               "comparisons, indexing, one_hot, gather "
               "or an embedding with them are not fused")
        if not isinstance(idx, _Index) or others or op == "call_module":
            raise self.refuse(name, why)
        m = t if op == "call_method" else None
        rest = list(args[1:]) + list(kw.values())
        dts = [x for x in rest if isinstance(x, torch.dtype)]
        places = all(isinstance(x, (torch.dtype, str, torch.device, _Device)) for x in rest)
        if (m == "float" and not rest) or (m in ("to", "type") and dts == [torch.float32]
                                           and places):
            # a float32 value of its own (not positions): the position plus 0
            inner = idx.inner
            if isinstance(inner, _Split):
                return _Split(self.b.map("add", inner.v, self.b.const(0.0)), inner.dims)
            if isinstance(inner, _Rows):
                return _Rows(self.b.map("add", inner.v, self.b.const(0.0)), inner.nd)
            return Val(self.b.map("add", int(inner), self.b.const(0.0)))
        if (m in ("long", "detach", "clone", "contiguous") and not rest) or (
                m == "to" and dts in ([], [torch.int64]) and places) or (
                m == "type" and dts == [torch.int64] and len(rest) == 1):
            return idx   # (int64 already: the same positions)
        view_methods = ("view", "reshape", "squeeze", "unsqueeze", "flatten", "size", "dim",
                        "ndimension")
        fviews = (torch.reshape, torch.squeeze, torch.unsqueeze, torch.flatten)
        if not (m in view_methods or (op == "call_function" and (t in fviews or (
                t is getattr and args[1] in ("shape", "ndim"))))):
            raise self.refuse(name, why)
        saved = self.env[a0]
        self.env[a0] = idx.inner
        try:
            r = self._dispatch(node)
        finally:
            self.env[a0] = saved
        if m in ("size", "dim", "ndimension") or t is getattr:
            return r   # (its shape: numbers)
        r = Val(r) if type(r) is int else r
        if not isinstance(r, (Val, _Split, _Rows)):   # pragma: no cover - views give values
            raise self.refuse(name, why)
        return _Index(r)

    # --- nn.Modules ------------------------------------------------------------------
    def call_module(self, node: torch.fx.Node) -> Any:
        """A submodule call: an op of the table (nn.ReLU, nn.SiLU, nn.SELU, nn.ELU ...) or
        the lowering registered for its class (:mod:`cupyfuse.frontend.lower`)."""
        mod = self._get_attr(node.target)
        a = node.args[0] if node.args else None
        name = f"{node.target} ({type(mod).__name__})"
        self._check_inplace(node, getattr(mod, "inplace", False), name)
        if not isinstance(mod, _BOOL_OK_MODULES):
            self._no_bool_operand(a, name)
        rec = op_of_module(mod)
        if rec is not None:
            return elementwise.table_op(self, rec, a, tuple(getattr(mod, at) for at in rec.attrs),
                                        name)
        low = lowering.of_module(mod)
        if low is None:
            raise self.refuse(name)
        return low(self, node, mod, a, name)

    # --- functions -------------------------------------------------------------------
    def _dim(self, d: Any, nd: int, name: str) -> int:
        """A dim argument in [0, nd), refused where torch raises (out of range)."""
        if not isinstance(d, int) or isinstance(d, (bool, Val)):
            raise self.refuse(name, f"a dim that is not an int ({d!r})")
        if not -max(nd, 1) <= d < max(nd, 1):
            raise self.refuse(name, f"dim {d} out of range for a value of {nd} dims (torch "
                                    "raises IndexError)")
        return d % max(nd, 1)

    def _int(self, x: Any, what: str, name: str) -> int:
        """An argument torch takes as an int only: a float (a Python number passed to the
        forward, ``fm(x, 2.0)``) is refused where torch raises TypeError."""
        try:
            if isinstance(x, (Val, float, bool, torch.fx.Node, torch.Tensor)):
                raise TypeError
            return operator.index(x)   # an int, a NumPy integer (torch takes those too)
        except TypeError:
            raise self.refuse(name, f"{what} {x!r} is not an int (torch raises "
                                    "TypeError)") from None

    def _plain(self, a: Any) -> Any:
        """An argument with numbers computed in the forward (``h.dim() - 1``) as Python
        numbers (an integral one as an int), in lists and tuples too."""
        if isinstance(a, torch.fx.Node):
            v = self.env.get(a)
            if isinstance(v, _Const):
                return v.v   # an int where Python's arithmetic gave one (h.size(1) / 2 is not)
            if isinstance(v, _Size) and v.v >= 0:   # a feature size (not the batch/seq marker)
                return v.v
            if isinstance(v, (torch.dtype, _Device)):   # h.dtype, h.device
                return v
            return a
        if isinstance(a, slice):   # h[:, h.shape[1] // 2:]
            return slice(self._plain(a.start), self._plain(a.stop), self._plain(a.step))
        if isinstance(a, (list, tuple)) and any(isinstance(x, (torch.fx.Node, list, tuple, slice))
                                                for x in a):
            return type(a)(self._plain(x) for x in a)
        return a

    def call_function(self, node: torch.fx.Node) -> Any:
        f = node.target
        args = tuple(self._plain(a) for a in node.args)
        kw = {k: self._plain(v) for k, v in node.kwargs.items()}
        name = getattr(f, "__name__", str(f))
        if f in _NUMBER_OPS and len(args) == 2 and all(
                isinstance(a, (int, float)) and not isinstance(a, (bool, Val)) for a in args):
            # arithmetic on numbers of the forward (h.dim() - 1): done here, a number
            try:
                return _Const(_NUMBER_OPS[f](*args))
            except (ZeroDivisionError, OverflowError) as exc:
                # Python raises on these numbers in the eager forward too (a tensor
                # divided by a zero number is tensor arithmetic: not here)
                raise self.refuse(name, f"Python raises {type(exc).__name__} on these "
                                        f"numbers ({args[0]!r}, {args[1]!r})") from exc
        if getattr(f, "__module__", None) == "math" and callable(f):
            return factories.math_fn(self, f, args, kw, name)
        if f is operator.add and len(args) == 2:
            parts = [self._shape_tuple(a) for a in args]
            if all(p is not None for p in parts):   # h.shape[:-1] + (H, D): a shape
                return parts[0] + parts[1]
        if f is _star:   # h.view(*h.shape[:-1], H, D): the shape's entries, spliced
            shp = self._shape_tuple(args[0])
            if shp is None:
                raise self.refuse("*", "unpacks something other than a shape")
            return _Star(shp)
        if f is operator.neg and len(args) == 1 and isinstance(args[0], (int, float)) and \
                not isinstance(args[0], (bool, Val)):
            return _Const(-args[0])
        if f is operator.getitem:
            base = self.env[args[0]]
            if isinstance(base, _Tuple):
                if isinstance(args[1], slice):   # pieces[1:], pieces[::-1]: still pieces
                    return _Tuple(base.items[args[1]])
                if not isinstance(args[1], int) or isinstance(args[1], bool):
                    raise self.refuse(name, "an index of a tuple of tensors that is not a number")
                item = base.items[args[1]]
                if isinstance(item, _Indices):
                    return reductions._unused_indices(self, item, name)
                return item if isinstance(item, (_Rows, _Split, _Perm)) else Val(item)
            if isinstance(base, tuple) and isinstance(args[1], (int, slice)):  # x.shape[i], [1:]
                return base[args[1]]
            return indexing.getitem(self, args[0], args[1])
        if f is getattr:
            base = self.env[args[0]]
            if args[1] in ("T", "mT") and isinstance(base, _Weight):
                return _Weight(base.source, base.shape[::-1], not base.transposed)
            if args[1] == "values" and isinstance(base, _Tuple):
                item = base.items[0]
                return item if isinstance(item, (_Rows, _Split, _Perm)) else Val(item)
            if args[1] == "indices" and isinstance(base, _Tuple) and len(base.items) == 2 \
                    and isinstance(base.items[1], _Indices):
                return reductions._indices(self, base.items[1], ".indices")
            if args[1] == "shape" and self.is_value(args[0]):
                return _sizes(self.dims(self.env[args[0]]), int(self.env[args[0]]))
            if args[1] == "shape" and isinstance(base, _Weight):
                # a parameter's sizes (self.query.shape[0] ** 0.5): numbers of the trace, as
                # the Linear weights' shapes are
                return _sizes(tuple(base.shape))
            if args[1] == "dtype" and (self.is_value(args[0]) or isinstance(base, _Weight)):
                # (x.to(h.dtype), h.type_as, torch.zeros(..., dtype=h.dtype)): every value
                # of a program is float32; a comparison's is bool
                return torch.bool if isinstance(base, _Bool) else torch.float32
            if args[1] == "device" and (self.is_value(args[0]) or isinstance(base, _Weight)
                                        or isinstance(base, _Bool)):
                return _DEVICE   # (torch.tensor(0.5, device=h.device), .to(h.device))
            if args[1] in ("T", "mT") and self.is_value(args[0]):
                name = f".{args[1]}"
                return transposes.permute(self, args[0], transposes._reorder(self, node, args, kw, len(self.dims(
                    self.env[args[0]])), name), name)
            raise self.refuse(f".{args[1]}")
        self._check_inplace(node, kw.get("inplace", False) or f in _AUGMENTED
                            or self._augmented(node), name)
        if args and no_bool_function(f):
            self._no_bool_operand(args[0], name)
        low = lowering.FUNCTIONS.get(f)
        if low is not None:
            return low(self, node, args, kw, name)
        rec = op_of_function(f)
        if rec is not None:
            return elementwise.table_call(self, node, rec, args, kw, name)
        raise self.refuse_function(f, name)

    def refuse_function(self, f: Any, name: str) -> TailError:
        """The refusal of a function call outside the vocabulary (``torch.fmax``)."""
        return self.refuse(f"{getattr(f, '__module__', '') or ''}.{name}".lstrip("."))

    # --- methods ---------------------------------------------------------------------
    def call_method(self, node: torch.fx.Node) -> Any:
        m = node.target
        args = tuple(self._plain(a) for a in node.args)
        kw = {k: self._plain(v) for k, v in node.kwargs.items()}
        self_ = args[0]
        name = f".{m}()"
        base = self.env.get(self_)
        raw = self.env.get(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None
        if isinstance(raw, _TensorConst):   # torch.tensor(2.0).pow(h)
            raise self.refuse(name, f"a method of a 0-d tensor made in the forward "
                              f"(torch.tensor({raw.v!r})), which cupyfuse reads as the number "
                              f"{raw.v!r}: write the operation with the number or as a "
                              f"function of h (e.g. `{raw.v!r} * h`, `torch.exp(h * "
                              f"math.log({raw.v!r}))` for a power)")
        if type(self_) in (int, float) or isinstance(base, _Size):   # a.sigmoid(), x.size(0).exp()
            raise self.refuse(name, "a tensor method of a Python number (torch raises)")
        if m == "size":
            d = _arg(args, kw, 1, "dim")
            sv = self.val(self_, name)
            dims = self.dims(sv)
            if d is None:
                return _sizes(dims, sv)
            return _sizes(dims, sv)[d]
        if m in ("dim", "ndimension"):
            return _Const(len(self.dims(self.val(self_, name))))   # an int, as torch's
        self._check_inplace(node, m.endswith("_") and not m.endswith("__"), name)
        low = lowering.METHODS.get(m)
        if low is not None:
            return low(self, node, self_, args, kw, name)
        rec = op_of_method(m)
        if rec is not None:
            return elementwise.table_method(self, node, rec, self_, args, kw, name)
        raise self.refuse(name)

    # --- what the handlers of special values (transposed, rows, stacks...) share ---------
    def _call_parts(self, node: torch.fx.Node) -> tuple:
        """(op, target, plain args, plain kwargs, the module called or None, the op's name
        as messages give it) of a call node: what the handlers of special values
        (``_perm_call``, ``_rows_call``, ``_stacked_call``) start from."""
        op, t = node.op, node.target
        args = tuple(self._plain(a) for a in node.args)
        kw = {k: self._plain(v) for k, v in node.kwargs.items()}
        mod = self._get_attr(t) if op == "call_module" else None
        name = f"{t} ({type(mod).__name__})" if mod is not None else \
            f".{t}()" if op == "call_method" else getattr(t, "__name__", str(t))
        return op, t, args, kw, mod, name

    def _elementwise(self, node: torch.fx.Node, args: tuple, kw: dict) -> bool:
        """Whether the op is elementwise (so it runs on its operands laid out alike)."""
        t = node.target
        if node.op == "call_function":
            if t in (torch.max, torch.min):
                return len(args) >= 2 and self.is_tensor_like(args[1]) and "dim" not in kw
            return elementwise_function(t)
        if node.op == "call_method":
            if t in ("max", "min"):
                return len(args) >= 2 and self.is_tensor_like(args[1])
            return elementwise_method(t)
        mod = self._get_attr(t)
        if isinstance(mod, nn.PReLU):
            return mod.num_parameters == 1
        return elementwise_module(mod)

    # --- in-place ops: fused as their out-of-place twins ---------------------------------
    def _check_inplace(self, node: torch.fx.Node, inplace: bool, name: str) -> None:
        """An in-place op is fused as its out-of-place twin: refuse it if the value it
        overwrites, or anything sharing its memory (the tensor it is a view of, other views
        of that tensor), is read again later (it would read the old values)."""
        if not inplace or not node.args or not isinstance(node.args[0], torch.fx.Node):
            return
        src = node.args[0]
        order = {n: i for i, n in enumerate(self.t.graph.nodes)}
        made = self.rebind.get(src, src)   # (an earlier in-place op's result: that tensor)
        if made.op == "call_function" and made.target in _FACTORY_FUNCS or \
                made.op == "call_method" and made.target in _FACTORY_METHODS:
            same = {made} | {k for k, t in self.rebind.items() if t is made}
            if all(u is node or u in same or order[u] > order[node] or not self._aliases(u)
                   for k in same for u in k.users):
                # a tensor the forward made, with no view of it taken before this op: the
                # op's out-of-place value is that tensor from here on (run() rebinds it and
                # the earlier in-place ops' results on it; what read it before read the old
                # value, as eager did)
                self.rebind[node] = made
                return
        if made.op not in ("placeholder", "get_attr") and not self._aliases(made):
            same = {made} | {k for k, t in self.rebind.items() if t is made}
            if all(u is node or u in same or order[u] > order[node] or not self._aliases(u)
                   for k in same for u in k.users):
                # a value the forward computed (not an input, a parameter or a view of
                # another), no view of it taken before this op: as for a made tensor, the
                # op's value is that tensor's from here on (`out += x; out.clamp_(min=0);
                # return out`); what read it before read the old value, as eager did
                self.rebind[node] = made
                return
        for u in src.users:
            if u is not node and order[u] > order[node]:
                raise self.refuse(name, "an in-place op on a value that is read again later")
        root = src
        while self._aliases(root) and isinstance(root.args[0], torch.fx.Node):
            root = root.args[0]
        if root.op == "get_attr" and not str(root.target).split(".")[-1].startswith(
                "_tensor_constant"):
            # a parameter or buffer of the module: eager updates the model's state each
            # call (a counter, a running average); the fused program has no write-back
            raise self.refuse(name, f"an in-place update of the module's tensor "
                                    f"`{root.target}` (model state the fused forward "
                                    "would not write back)")
        seen, todo = set(), [root]
        while todo:   # the root and every view of it, however deep
            a = todo.pop()
            if a in seen:
                continue
            seen.add(a)
            for u in a.users:
                if u is node:
                    continue
                if self._aliases(u) and u.args and u.args[0] is a:
                    todo.append(u)
                elif order[u] > order[node]:
                    raise self.refuse(name, "an in-place op on a view of a value that is read "
                                            "again later, or on that value itself as "
                                            "nn.Identity, eval dropout or .float() return "
                                            "it (they share memory)")

    def _written(self, old: Any, new: Any, name: str) -> Any:
        """The value an in-place op leaves in a tensor the forward made (``old``: its
        value before, ``new``: the op's out-of-place value): of the tensor's shape and
        dtype, where torch raises if the result has another shape or a float result
        would go into an integer or boolean tensor."""
        def frame(e: Any) -> tuple[tuple[int, ...], str]:
            if isinstance(e, _Split):
                return e.dims, e.kind
            if isinstance(e, (_Bool, _Int)):
                return self.dims(e.v), "b" if isinstance(e, _Bool) else "i"
            if type(e) in (int, Val):
                return self.dims(int(e)), "f"
            raise self.refuse(name, "an in-place op whose result is not a tensor")
        (od, ok), (nd, nk) = frame(old), frame(new)
        if od != nd:
            raise self.refuse(name, f"an in-place op whose result {_fmt_dims(nd)} does not fit "
                                    f"the tensor it writes, {_fmt_dims(od)} (torch raises)")
        if ok != nk and nk == "f":
            raise self.refuse(name, "an in-place op writing floats into an integer or boolean "
                                    "tensor (torch raises)")
        if ok != nk:   # (integers or booleans written into a float tensor: floats)
            v = new.v if isinstance(new, (_Bool, _Int)) else new.v
            return _Split(v, nd, ok) if isinstance(new, _Split) else self._wrap(ok, v)
        return new

    def _augmented(self, n: torch.fx.Node) -> bool:
        """``_is_augmented`` with the forward's own file (memoised per node)."""
        memo = self.__dict__.setdefault("_aug_memo", {})
        hit = memo.get(n)
        if hit is None:
            try:
                own = inspect.getsourcefile(self.t.forward)
            except (TypeError, AttributeError):
                own = None
            hit = memo[n] = _is_augmented(n, own)
        return hit

    def _aliases(self, n: Any) -> bool:
        """Whether node ``n``'s result shares memory with its first argument: a view of it
        (``_is_view_node``) or, as eager torch returns it, that tensor itself: nn.Identity,
        dropout in eval mode or with p = 0 (module or F.dropout; active dropout is refused),
        nn.Flatten, and ``.float()`` / ``.to(torch.float32)`` / ``.type(torch.float32)`` /
        ``.type_as(a float32 tensor)`` of a float32 tensor (of a boolean one they copy)."""
        if _is_view_node(n):
            return True
        if not isinstance(n, torch.fx.Node) or not n.args or \
                not isinstance(n.args[0], torch.fx.Node):
            return False
        if n.op == "call_module":
            try:
                mod = self._get_attr(n.target)
            except AttributeError:
                return False
            return isinstance(mod, (nn.Identity, nn.Dropout, nn.Flatten))
        if n.op == "call_function":   # g += 1 gives g itself
            return n.target is F.dropout or self._augmented(n)
        if n.op == "call_method" and n.target in ("float", "to", "type", "type_as"):
            # (type_as too: h.type_as(x) of a float32 x is h itself: an in-place op on it
            # changes h)
            return not isinstance(self.env.get(n.args[0]), _Bool)
        return False

    # --- queries of the environment the lowerings share ---------------------------------
    def _channel_check(self, d: Sequence[int], c: int, name: str) -> None:
        if len(d) < 2 or d[1] != c:
            raise self.refuse(name, f"needs its {c} channels in dim 1, got a value of shape "
                              f"{_fmt_dims(d)}")

    # --- booleans and integers: torch's dtype rules --------------------------------------
    def _is_bool(self, a: Any) -> bool:
        e = self.env.get(a) if isinstance(a, torch.fx.Node) else None
        return isinstance(e, _Bool) or isinstance(e, _Split) and e.kind == "b"
    def _is_int(self, a: Any) -> bool:
        e = self.env.get(a) if isinstance(a, torch.fx.Node) else None
        return isinstance(e, _Int) or isinstance(e, _Split) and e.kind == "i"
    def _no_bool_operand(self, a: Any, name: str) -> None:
        """Refuse an op torch raises on for a boolean tensor (activations, norms, ...)."""
        if self._is_bool(a):
            raise self.refuse(name, "a boolean tensor operand (torch raises); apply it to "
                                    "`mask.float()`")
        if self._is_int(a):
            raise self.refuse(name, "an integer tensor operand (int64 in torch: it raises or "
                                    "keeps int64); apply it to a float tensor, e.g. "
                                    "`mask.float() * 3`")
    def _shape_arg(self, shape: Any, name: str) -> Any:
        """A reshape's shape argument as a sequence of entries (fx nodes of sizes, sizes,
        ints): ``h.view(h.shape)``, ``h.view((B, H, D))`` and ``*``-unpacked shapes too."""
        if isinstance(shape, (tuple, list)) and len(shape) == 1:
            if isinstance(shape[0], torch.fx.Node) and isinstance(self.env.get(shape[0]), tuple):
                shape = shape[0]
        if isinstance(shape, torch.fx.Node):   # h.view(h.shape), torch.reshape(h, x.shape)
            shape = self.env.get(shape)
            if not isinstance(shape, tuple):
                raise self.refuse(name, "a reshape to a computed size")
        return self._spliced(shape)
    def _sections(self, a: Any, dim: Any, name: str) -> tuple[int, int, int]:
        v = self.val(a, name)
        ax = self.b._axis(v, int(dim), name)
        w = self.dims(v)[ax]
        if w == BATCH:
            raise self.refuse(name, "splits the batch dimension")
        return v, ax, w
    def _split_refusal(self, name: str, sp: "_Split", why: str = "",
                       hint: str = "") -> TailError:
        return self.refuse(name, (why or f"an op on a value whose features are split into "
                                  f"several dims {splits.fmt(sp.dims)}") +
                           "; cupyfuse fuses elementwise ops, reductions, softmax and norms "
                           "along those dims, indexing and reshapes of such a value: " +
                           (hint or f"reshape it back to its {splits.width(sp.dims)} features "
                            f"first (`.flatten({split_features._first_feature(sp.dims)})`)"))
    def _touches_split(self, node: torch.fx.Node) -> bool:
        def hit(a: Any) -> bool:
            if isinstance(a, torch.fx.Node):
                e = self.env.get(a)
                return isinstance(e, _Split) or isinstance(e, _Tuple) and any(
                    isinstance(i, _Split) for i in e.items)
            if isinstance(a, (tuple, list)):
                return any(hit(x) for x in a)
            return False
        return any(hit(a) for a in node.args) or any(hit(a) for a in node.kwargs.values())
    def _split_target(self, d: tuple[int, ...], shape: Any, name: str,
                      plain_ok: bool = False) -> list | None:
        """The torch dims of a reshape of a value with dims ``d`` to ``shape`` where it
        keeps the batch and leading dims first (named by their sizes read from a shape,
        a leading dim also by its number, or -1) and regroups the features after them (in
        any number of dims, -1 for one of them); None where it is no such reshape, or
        (unless ``plain_ok``) where the result's features are in one dim (the plain
        reshape decides those)."""
        want: list[Any] = []
        for s in shape if isinstance(shape, (tuple, list)) else ():
            x = self.env[s] if isinstance(s, torch.fx.Node) else s
            if isinstance(x, _Size):
                x = "B" if x.v == BATCH else ("L", x.lead) if x.v == LEAD else x.v
            elif isinstance(x, _Const) and type(x.v) is int:
                x = x.v
            elif type(x) is not int:
                return None
            want.append(x)
        leads = [x for x in self.lead if x != 1]   # the sizes of the LEAD dims, in order
        mk = [x for x in d if x in splits.ROW]
        non1 = [w for w in want if w != 1]
        if len(non1) < len(mk) or non1.count(-1) > 1:
            return None
        rows, feats = non1[:len(mk)], non1[len(mk):]
        k = 0
        for w, m in zip(rows, mk):
            if m == BATCH:
                ok = w in ("B", -1)
            else:
                ok = w == -1 or w == ("L", k) or type(w) is int and w == leads[k]
                k += 1
            if not ok:
                return None
        if not all(type(w) is int and (w > 0 or w == -1) for w in feats):
            return None
        W = splits.width(d)
        known = math.prod(w for w in feats if w != -1)
        if (W % known if -1 in feats else known != W):
            return None
        out, cnt = [], 0
        for w in want:
            if w == 1:
                out.append(1)
                continue
            out.append(mk[cnt] if cnt < len(mk) else W // known if w == -1 else w)
            cnt += 1
        if not plain_ok and not splits.is_split(out):
            return None
        if -1 in want and BATCH in mk and rows[0] != -1:
            # the -1 is not the batch: with an empty batch torch cannot tell its size
            if any(x == 0 for x in leads):
                raise self.refuse(name, "a reshape with -1 of a value with a leading dim of "
                                        "size 0 (torch raises: the -1 could be any size)")
            shown = ", ".join("0" if w == "B" else str(leads[w[1]]) if isinstance(w, tuple)
                              else str(w) for w in want)
            self.b.p.zero_rows_error = (
                f"cannot reshape tensor of 0 elements into shape [{shown}] because the "
                "unspecified dimension size -1 can be any value and is ambiguous")
        return out

    # --- elementwise ops with split operands ---------------------------------------------
    def _operand_dims(self, e: Any, name: str) -> tuple[int, ...]:
        if isinstance(e, _Split):
            return e.dims
        if isinstance(e, (Val, _Bool, _Int)):
            return self.dims(int(e) if isinstance(e, Val) else e.v)
        if isinstance(e, _Weight):
            if e.transposed and len(splits.feat_sizes(e.shape)) > 1:
                raise self.refuse(name, "uses a transposed matrix parameter outside a matmul")
            return tuple(e.shape)
        return tuple(e.shape)   # a tensor

    # --- softmax, normalize, LayerNorm, GLU along the split dims -------------------------
    def _feature_dim(self, d: tuple[int, ...], dim: Any, name: str, what: str,
                     seq: bool = False) -> int:
        """A dim argument that must name a feature dim of a value with dims ``d`` (or,
        where ``seq``, the leading (sequence) dim: a sequence reduction)."""
        ax = self._dim(dim, len(d), name)
        if d[ax] == BATCH:
            raise self.refuse(name, f"{what} the batch dimension (dim {dim})")
        if d[ax] == LEAD and not seq:
            raise self.refuse(name, f"{what} a leading (sequence) dim: " + LEAD_WHY)
        return ax
    @staticmethod
    def _shown(shape: Any) -> str:
        return "(" + ", ".join("batch" if isinstance(s, _Size) and s.v == BATCH else
                               "seq" if isinstance(s, _Size) and s.v == LEAD else
                               str(s.v) if isinstance(s, _Size) else
                               str(s) if not isinstance(s, torch.fx.Node) else s.name
                               for s in shape) + ")"


def translate(traced: Traced, module: nn.Module | None, input_shapes: Sequence[tuple | None],
              allow_no_gemm: bool = False, bool_inputs: Sequence[int] = (),
              numbers: Sequence[tuple[int, int | float]] = (),
              specialized: Sequence[tuple[int, Any]] = (),
              int_inputs: Sequence[int] = ()) -> Program:
    """Map a traced forward onto the vocabulary for these input shapes (batch first);
    ``bool_inputs``: the inputs that are boolean masks (run as 0.0 / 1.0);
    ``int_inputs``: the integer ones (int64 / int32, run as float32: ``_RawInt``); ``numbers``:
    (argument, value) of the Python numbers passed to the forward, constants of the
    program (one program per value); ``specialized``: (argument, value) of the arguments
    left at None or a bool, which ``traced`` was specialised on (``trace``'s
    ``concrete``); ``input_shapes`` are the other arguments'."""
    def attempt(loose: bool) -> Program:
        tr = Translator(traced, module if module is not None else traced.root, input_shapes,
                         allow_no_gemm)
        tr.bool_inputs = frozenset(bool_inputs)
        tr.int_inputs = frozenset(int_inputs)
        tr.numbers = dict(numbers)
        tr.specialized = dict(specialized)
        tr.loose_leads = loose
        try:
            return tr.run()
        finally:
            # (its tables of bound methods make cycles: emptied, it holds the module and
            # the trace no longer; see trace)
            tr.__dict__.clear()

    try:
        return attempt(False)
    except TailError:
        # an input like (batch, n, 1) reads two ways: n features and a trailing 1 (first;
        # x.squeeze(-1) before the Linear), or n positions of one feature (Linear(1, N));
        # either translation is exact for its reading, so the second is tried too
        if not any(s is not None and _has_leads(s, True) and not _has_leads(s, False)
                   for s in input_shapes):
            raise
        first = sys.exc_info()[1]
        try:
            return attempt(True)
        except TailError:
            raise first from None


def _batch_size_read(e: Any, x: torch.fx.Node) -> bool:
    """Whether fx argument ``e`` is the batch size of ``x`` (or of what ``x`` is an
    identity of: ``x.contiguous()``'s input): ``x.size(0)``, ``x.shape[0]``,
    ``x.size()[0]``."""
    if not isinstance(e, torch.fx.Node):
        return False
    if e.op == "call_method" and e.target == "size" and e.args and _same_value(e.args[0], x):
        d = _arg(e.args, e.kwargs, 1, "dim")
        return type(d) is int and d == 0
    if e.op == "call_function" and e.target is operator.getitem and len(e.args) == 2 \
            and type(e.args[1]) is int and e.args[1] == 0:
        return _whole_shape(e.args[0], x)
    return False


def _same_value(a: Any, x: torch.fx.Node) -> bool:
    """Whether fx argument ``a`` is ``x`` or an input ``x`` is an identity of (through
    _FLAT_KEEP methods)."""
    while True:
        if a is x:
            return True
        if not (x.op == "call_method" and x.target in _FLAT_KEEP and x.args):
            return False
        x = x.args[0]


def _whole_shape(s: Any, x: torch.fx.Node) -> bool:
    """Whether fx argument ``s`` is ``x.shape`` or ``x.size()``."""
    return isinstance(s, torch.fx.Node) and s.args and _same_value(s.args[0], x) and (
        s.op == "call_function" and s.target is getattr and len(s.args) == 2
        and s.args[1] == "shape" or s.op == "call_method" and s.target == "size"
        and len(s.args) == 1 and not s.kwargs)


#: methods that keep a tensor's values and shape (followed by _flat_use)
_FLAT_KEEP = frozenset({"contiguous", "clone", "detach", "float"})


def _flat_use(u: torch.fx.Node, x: torch.fx.Node, P: int, root: Any, nd: int,
              whole: set[torch.fx.Node]) -> str | None:
    """How fx node ``u`` uses ``x``, an input of ``nd`` dims with ``P`` elements per batch
    element: "flat" where it flattens every dim after the batch into one ((batch, P)),
    "view" where it does so with ``.view`` (which raises on an input it cannot view),
    "size" where it reads the batch size only (``x.size(0)``, ``x.shape[:1]``), None for
    any other use. A flatten spelled with other dims than (1, -1) (``x.flatten(1, 2)``,
    ``x.flatten(-2)`` of a 3-dim input) joins ``whole``: the translator reads it as the
    (batch, P) input itself (on which its dims would mean something else)."""
    if any(a is x for a in list(u.args[1:]) + list(u.kwargs.values())) or not u.args \
            or u.args[0] is not x:
        return None
    if _batch_size_read(u, x):
        return "size"
    if _whole_shape(u, x):
        return "size" if u.users and all(_batch_size_read(w, x) or _batch_prefix(w)
                                         for w in u.users) else None
    if u.op == "call_method" and u.target in _FLAT_KEEP and len(u.args) == 1 and not u.kwargs:
        uses = [_flat_use(w, u, P, root, nd, whole) for w in u.users]
        if not (("flat" in uses or "view" in uses) and all(uses)):
            return None
        # (a view of x.contiguous() never raises; of x.float() or x.detach() it may)
        return "view" if "view" in uses and u.target != "contiguous" else "flat"
    kind = "view" if u.op == "call_method" and u.target == "view" else "flat"
    a, kw = u.args, u.kwargs
    start = end = None
    shape: Any = None
    if u.op == "call_method" and u.target in ("view", "reshape"):
        shape = a[1:] if not (len(a) == 2 and isinstance(a[1], (tuple, list))) else a[1]
        if "size" in kw or "shape" in kw:
            shape = kw.get("size", kw.get("shape"))
    elif u.op == "call_function" and u.target is torch.reshape:
        shape = _arg(a, kw, 1, "shape")
    elif (u.op == "call_method" and u.target == "flatten") or (
            u.op == "call_function" and u.target is torch.flatten):
        start, end = _arg(a, kw, 1, "start_dim", 0), _arg(a, kw, 2, "end_dim", -1)
    elif u.op == "call_module" and root is not None:
        try:
            mod = root.get_submodule(u.target)
        except AttributeError:
            return None
        if type(mod) is nn.Flatten and len(a) == 1 and not kw:
            start, end = mod.start_dim, mod.end_dim
    if start is not None:
        # every dim after the batch: start_dim 1 and end_dim the last, however spelled
        if type(start) is not int or type(end) is not int or not -nd <= start < nd or \
                not -nd <= end < nd or start % nd != 1 or end % nd != nd - 1:
            return None
        if (start, end) != (1, -1):   # (on the (batch, P) value it would read otherwise)
            whole.add(u)
        return "flat"
    if not isinstance(shape, (tuple, list)) or len(shape) != 2:
        return None
    b, f = shape
    batch = _batch_size_read(b, x) or _star_batch(b, x)
    if not batch and not (type(b) is int and b == -1):
        return None
    if type(f) is not int or not (f == P or (f == -1 and batch)):
        return None
    return kind


def _batch_prefix(w: torch.fx.Node) -> bool:
    """Whether fx node ``w`` (reading a value's whole shape) is ``shape[:1]``: the batch
    size alone, the same whichever way the value is read."""
    if not (w.op == "call_function" and w.target is operator.getitem and len(w.args) == 2
            and isinstance(w.args[1], slice)):
        return False
    sl = w.args[1]
    return sl.start in (None, 0) and type(sl.stop) is int and sl.stop == 1 and \
        sl.step in (None, 1)


def _star_batch(e: Any, x: torch.fx.Node) -> bool:
    """Whether fx argument ``e`` is ``*x.shape[:1]`` (``x.view(*x.shape[:1], -1)``)."""
    return isinstance(e, torch.fx.Node) and e.op == "call_function" and e.target is _star \
        and len(e.args) == 1 and isinstance(e.args[0], torch.fx.Node) and \
        _batch_prefix(e.args[0]) and _whole_shape(e.args[0].args[0], x)


def _guards_of(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The checks torch.fx adds for an argument its trace is specialised on (concrete_args):
    ``_assert_is_none(arg, msg)`` for None, ``torch._assert(arg == value, msg)`` for a bool.
    They check the value the caller passes, which cupyfuse has fixed already."""
    out: set[torch.fx.Node] = set()
    for u in node.users:
        if u.op != "call_function":
            continue
        if getattr(u.target, "__name__", "") == "_assert_is_none":
            out.add(u)
        elif u.target is operator.eq and u.users and \
                all(w.op == "call_function" and w.target is torch._assert for w in u.users):
            out.add(u)
            out.update(u.users)
    return out


def _names_argument(fn: Any, name: str) -> bool:
    """Whether the code of ``fn`` (a forward or a tail function) reads the name ``name``
    (True where its source cannot be read)."""
    import ast
    import textwrap

    try:
        src = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(src)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return True
    fdef = next((n for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))), None)
    if fdef is None:
        return True
    body = fdef.body if isinstance(fdef.body, list) else [fdef.body]
    return any(isinstance(n, ast.Name) and n.id == name
               for stmt in body for n in ast.walk(stmt))


def _has_leads(shp: tuple, loose: bool) -> bool:
    if len(shp) < 3:
        return False
    if loose:
        return any(x != 1 for x in shp[1:-1])
    return sum(1 for x in shp[1:] if x > 1) > 1 or any(x == 0 for x in shp[1:-1])
