"""The public API: :func:`fused_linear`, :func:`from_model`, :func:`fused_class`,
:class:`CudaTail`, :func:`prepare_weight`.

* :func:`fused_linear` -- ``tail(x @ weight.T + bias)`` for a tail written as a Python
  function of torch ops (traced with torch.fx) or as CUDA C fragments (:class:`CudaTail`);
* :func:`from_model` -- a fused module computing what a Linear + tail model computes,
  sharing its parameters and buffers, with the original's state_dict keys;
* :func:`fused_class` -- a drop-in subclass of a model class: same ``__init__``, RNG use,
  parameters, buffers and state_dict keys, with a fused forward.

Arguments are checked here; each call is handed to the runner (:mod:`cupyfuse.runner`).
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse.frontend import trace as tracing
from cupyfuse.interop import Call, describe, warn_forward_only
from cupyfuse.backend.cpu import empty_batch, own_tensors, run_cpu
from cupyfuse.ir.program import Program, TailError
from cupyfuse import autograd, runner, tracking
from cupyfuse.backend import execute
from cupyfuse.interop import PreparedWeight  # noqa: F401 (fused_linear's docs name it)


# ---------------------------------------------------------------------------------
# user tails as CUDA C fragments
@dataclass(frozen=True)
class CudaTail:
    """A tail written as CUDA C fragments, in the manner of CuPy's ReductionKernel.

    ``map``: a float expression of ``h`` (the Linear output incl. bias, one element;
    computed in float32 -- only the accumulation follows ``acc``),
    ``col`` (its feature index) and ``N`` (the width). Without ``reduce`` the tail is
    elementwise and returns (batch, N). With ``reduce`` (a combine expression of ``a``
    and ``b``) and ``identity``, the mapped values of each row are combined in a fixed
    order and ``post`` (an expression of ``r``, default ``r``) gives (batch, 1).
    ``reference`` is an optional torch function of h for the CPU path and for checks.
    ``acc`` is the accumulator type ("float" or "double").
    """

    map: str
    reduce: str | None = None
    identity: str = "0"
    post: str = "r"
    acc: str = "float"
    reference: Callable[[torch.Tensor], torch.Tensor] | None = None
    name: str = "cuda_tail"

    def source(self, n: int, threads: int = 256) -> tuple[str, str]:
        body = [f"    const int N = {n};",
                "    const long long row = blockIdx.x;",
                "    if (row >= batch) return;",
                "    auto mapf = [&](float h, int col) -> float { (void)col; (void)N; "
                f"return ({self.map}); }};"]
        if self.reduce is None:
            body.append("    for (int col = threadIdx.x; col < N; col += blockDim.x) "
                        "out[row * N + col] = mapf(z[row * N + col] + (bias ? bias[col] : 0.0f), col);")
        else:
            acc = self.acc
            body += [f"    __shared__ {acc} scr[32];",
                     f"    auto comb = []({acc} a, {acc} b) -> {acc} {{ return ({self.reduce}); }};",
                     f"    {acc} acc = ({acc})({self.identity});",
                     "    for (int col = threadIdx.x; col < N; col += blockDim.x) "
                     f"acc = comb(acc, ({acc})mapf(z[row * N + col] + (bias ? bias[col] : 0.0f), col));",
                     f"    acc = cf_block_combine<{acc}>(acc, ({acc})({self.identity}), comb, scr);",
                     f"    if (threadIdx.x == 0) {{ const {acc} r = acc; out[row] = (float)({self.post}); }}"]
        text = "\n".join(body)
        digest = hashlib.sha1((text + str(threads)).encode()).hexdigest()[:12]
        name = f"cf_user_{digest}"
        src = (f"extern \"C\" __global__ void __launch_bounds__({threads}) {name}(\n"
               "    long long batch, const float* __restrict__ z, const float* __restrict__ bias,\n"
               "    float* __restrict__ out) {\n" + text + "\n}\n")
        return name, src


def fused_linear(x: Any, weight: Any, bias: Any = None, tail: Callable | CudaTail | None = None,
                 *extra: Any, precision: str | None = None) -> Any:
    """``tail(x @ weight.T + bias, *extra)`` fused; x (batch, K) or (batch, seq..., K)
    (the leading dims are rows: the tail works along the last dim, ``extra`` inputs have
    x's leading dims), weight (N, K), bias (N,).

    ``tail`` is a Python function of torch ops (any op of the vocabulary; traced once
    with torch.fx per function and shapes), a :class:`CudaTail`, or None (the Linear
    alone). An ``extra`` that is a Python number is a constant of the tail's program (one
    program per value, and prepared launches per value). ``weight`` may be a
    :class:`PreparedWeight` (see :func:`prepare_weight`): the way to keep a CuPy weight's
    derived copies between calls. Operands: torch tensors, CuPy arrays, NumPy arrays or
    any ``__dlpack__`` producer, all float32 on one device; the result comes back in x's
    type, computed on the caller's current stream (torch's for torch, CuPy's for CuPy).
    torch operands under autocast, or in bf16/fp16, run ``tail(F.linear(x, weight,
    bias), *extra)`` with torch's own ops (a warning once: the fused kernels are float32
    only).
    """
    if type(x) is torch.Tensor and (runner._autocast_on(x.device.type) or
                                    x.dtype in runner.HALF or
                                    getattr(weight, "dtype", None) in runner.HALF):
        return _torch_linear(x, weight, bias, tail, extra)
    if not isinstance(tail, CudaTail):
        hit = runner._fused_linear_fast(x, weight, bias, tail if tail is not None else runner._identity, extra,
                                 precision)
        if hit is not None:
            return hit
    if tail is not None and not isinstance(tail, CudaTail) and not callable(tail):
        raise TypeError(f"fused_linear: tail must be a function of torch ops, a CudaTail or "
                        f"None, got {type(tail).__name__} ({tail!r})")
    op = "fused_linear"
    xt, kind = runner._as_operand(x, "x", op)
    prepared = weight if isinstance(weight, PreparedWeight) else None
    if prepared is not None:
        weight = prepared.tensor
    wt, _ = runner._as_operand(weight, "weight", op)
    bt = runner._as_operand(bias, "bias", op)[0] if bias is not None else None
    # Python numbers among the extras: constants of the program (the tail's argument i + 1)
    numbers = runner._numbers((x,) + extra)
    epos = [i for i in range(len(extra)) if i + 1 not in dict(numbers)]
    for i in epos:
        runner._zero_d_array(extra[i], f"extra[{i}]", op)
    ex = [runner._as_operand(extra[i], f"extra[{i}]", op)[0] for i in epos]
    if xt.dim() < 2 or (xt.dim() > 2 and isinstance(tail, CudaTail)):
        raise ValueError(f"{op}: x must be (batch, K) float32" +
                         (" for a CudaTail (pass x.reshape(-1, K))" if xt.dim() > 2 else
                          " or (batch, seq..., K)") + f", got {describe(x)}")
    K = xt.shape[-1]
    if wt.dim() != 2 or wt.shape[1] != K or wt.shape[0] < 1:
        raise ValueError(f"{op}: weight must be (out_features, {K}) float32 on {xt.device}, "
                         f"got {describe(weight)}")
    N = wt.shape[0]
    if bt is not None and tuple(bt.shape) != (N,):
        raise ValueError(f"{op}: bias must be ({N},) float32 on {xt.device}, got {describe(bias)}")
    for name, t, orig in [("weight", wt, weight), ("bias", bt, bias)] + \
            [(f"extra[{i}]", e, extra[i]) for i, e in zip(epos, ex)]:
        if t is not None and t.device != xt.device:
            raise ValueError(f"{op}: {name} must be on {xt.device} like x, got {describe(orig)}")
    if not xt.is_contiguous():
        xt = xt.contiguous()
    # derived copies of the weight are cached on a torch parameter/tensor (its version
    # counter tracks in-place changes) or on a PreparedWeight's view (until refresh())
    owner = weight if isinstance(weight, torch.Tensor) else None
    call = Call(op=op, kind=kind, device=xt.device, x=xt)
    grad = torch.is_grad_enabled() and kind in ("torch-cuda", "torch-cpu")
    if isinstance(tail, CudaTail):
        if grad and any(getattr(t, "requires_grad", False) for t in (x, weight, bias) + extra):
            warn_forward_only(f"{op} with a CudaTail (it has no derivative: write the tail as "
                              "a function of torch ops for gradients)")
        if xt.device.type == "cpu":
            if tail.reference is None:
                raise TailError(f"{op}: a CudaTail runs on CUDA devices; give it a `reference` "
                                "torch function to run it on the CPU")
            h = xt @ wt.t() + (bt if bt is not None else 0)
            # (a strided view of h, h[:, 2:5], copied: results are contiguous)
            return call.result(own_tensors([tail.reference(h).float()], [xt])[0])
        with call:
            return call.result(execute._run_cuda_tail(tail, xt, wt, bt, precision, owner))
    fn = tail if tail is not None else runner._identity
    prog = runner._function_program(fn, xt, N, bt is not None, ex, numbers)
    prog.check_lead_batches([xt.shape] + [e.shape for e in ex], getattr(fn, "__name__", "tail"),
                            ["x"] + [f"input {i + 1}" for i in epos])
    # the weight and bias, then the tensors the tail function closes over
    sources = [wt] + ([bt] if bt is not None else []) + list(prog.sources[1 + (bt is not None):])
    for s in sources:
        if isinstance(s, torch.Tensor) and s.device != xt.device:
            raise ValueError(f"{op}: a tensor the tail uses must be on {xt.device} like x, got "
                             f"{describe(s)}")

    def rows(xt: torch.Tensor, ex: list[torch.Tensor]) -> list[torch.Tensor]:
        inputs = [xt] + ex
        if not prog.lead and ex:
            inputs = runner._broadcast_rows(inputs, prog, op)
        if prog.lead:   # (batch, seq..., K): batch * seq rows, as the program runs them
            inputs = runner._lead_rows(inputs)
        if xt.dim() > 2:
            inputs[0] = xt.reshape(-1, K)
        return inputs

    inputs = rows(xt, ex)
    # an x of one row against a batch of extras is copied (its rows are the batch's)
    in_place = bool(prog.lead) or not ex or (inputs[0].data_ptr() == xt.data_ptr() and
                                             inputs[0].shape == xt.shape)
    if prog.lead and inputs[0].shape[0] == 0:   # a leading dim of 0 (or an empty batch)
        prog.check_rows(0)
        return runner._results(call, empty_batch(prog, xt.device, xt.shape[0]))
    if prog.lead:
        # an extra that is no view of its rows is copied: never read through prepared
        # launches (they take the caller's address)
        in_place = all(a.data_ptr() == t.data_ptr() for a, t in zip(inputs[1:], ex))
    # owners: what keys derived weights (the weight's split, a GEMV's or a fold's
    # coefficients, which may read the bias and the tail's tensors too): the caller's own
    # tensors, not the fresh detached views (whose identity changes every call)
    nb = 1 + (bt is not None)
    owners = [owner] + ([bias if isinstance(bias, torch.Tensor) else bt] if nb == 2 else []) \
        + sources[nb:]
    for t in owners:   # (.data writes of a parameter are seen: cupyfuse.tracking)
        if type(t) is nn.Parameter:
            tracking.track_tensor(t)
    runner.fn_held(fn if tail is None else tail, sources[nb:])

    def forward() -> Any:
        if xt.device.type == "cpu":
            with torch.no_grad():
                return call.result(run_cpu(prog, inputs, sources, owners=owners))
        xm = runner._meta(x)
        if xm is not None and xm[0] == xt.data_ptr() and in_place:
            # x is used in place (no copy): prepare the launches, and run this very call
            # through them too (the first call computes exactly what the next ones will)
            runner._remember_fast_fn(fn if tail is None else tail, x, weight, bias, extra, prog,
                                     inputs, sources)
            with torch.no_grad():
                hit = runner._fused_linear_fast(x, weight, bias, fn if tail is None else tail,
                                                extra, precision)
            if hit is not None:
                return hit
        with call, torch.no_grad():
            return call.result(execute.run_gpu(prog, inputs, sources, precision, owners=owners))

    # what a grad-mode call differentiates: x, the weight, the bias, the extras and the
    # tensors the tail holds that require grad (their slots: "x", ("e", i), ("s", k))
    leaves: list[torch.Tensor] = []
    slots: list[Any] = []
    if grad:
        cands = [("x", x)] + [(("e", i), extra[j]) for i, j in enumerate(epos)] + \
            [(("s", k), t) for k, t in enumerate(owners)]
        for slot, t in cands:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                slots.append(slot)
                leaves.append(t)
    if not leaves:
        return forward()

    def operands(req: Any) -> tuple[list, list]:
        by = dict(zip(slots, req))
        ins = rows(by.get("x", xt), [by.get(("e", i), e) for i, e in enumerate(ex)])
        return ins, [by.get(("s", k), t) for k, t in enumerate(sources)]

    def recompute(req: Any) -> Any:
        ins, rs = operands(req)
        p = prog.unrewritten if prog.unrewritten is not None else prog
        return run_cpu(p, ins, rs, training_updates=False, gemm=autograd.gemm_for(
            runner.weight_owners(rs, owners), precision))

    # (the slots as program inputs and sources: x is input 0, extra i input 1 + i)
    named = [("in", 0) if s == "x" else ("in", 1 + s[1]) if s[0] == "e" else ("src", s[1])
             for s in slots]
    return autograd.apply(forward, recompute, leaves, autograd.program_backward(
        prog, named, operands, xt.device, precision))


def _torch_linear(x: torch.Tensor, weight: Any, bias: Any, tail: Any, extra: tuple) -> Any:
    """fused_linear with torch's own ops (under autocast, or 16-bit operands)."""
    if isinstance(tail, CudaTail):
        raise TypeError("fused_linear: a CudaTail runs float32 only: call it outside "
                        "autocast with float32 operands")
    why = "autocast" if runner._autocast_on(x.device.type) else "16-bit operands"
    if why not in runner._warned_torch:
        runner._warned_torch.add(why)
        import warnings

        warnings.warn(f"cupyfuse: fused_linear runs with torch ops ({why}: the fused "
                      "kernels are float32 only)", stacklevel=3)
    w = weight.tensor if isinstance(weight, PreparedWeight) else weight
    h = F.linear(x, w, bias)
    return h if tail is None else tail(h, *extra)


def from_model(model: nn.Module, precision: str | None = None) -> nn.Module:
    """Fuse any module whose forward is Linear + tail (or a chain of such stages).

    Returns a fused **view** of ``model``: an instance of ``fused_class(type(model))``
    that is the same module in every other respect -- the same parameters, buffers,
    submodules, attributes, hooks and train/eval flag, not copies (an optimizer step,
    ``load_state_dict``, ``model.eval()`` or an attribute set on either is seen by both;
    fuse ``copy.deepcopy(model)`` for an independent module). Its state_dict is the
    model's. Calling ``model`` still runs the eager forward.

    The forward is traced now (a forward fx cannot trace, or one without a Linear, raises
    :class:`TailError` at once); it is mapped onto the vocabulary at the first call, when
    the input shapes are known: an op outside the vocabulary raises :class:`TailError`
    then, naming the op and its source line. A Python number passed to the forward after
    x (``fm(x, 0.5)``) is a constant of the program: each value gets a program of its own.
    ``precision`` picks the GEMM precision (None follows torch's setting).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"from_model: expected an nn.Module, got {type(model).__name__}")
    cls = type(model)
    target = cls if getattr(cls, "_cupyfuse_base", None) is not None else fused_class(cls)
    orig = target._cupyfuse_base
    view = target.__new__(target)
    object.__setattr__(view, "__dict__", model.__dict__)
    if precision is not None:
        view.__dict__["cupyfuse_precision"] = precision
    rn = runner._Runner(_original_trace(orig), view, mode=runner._mode_key(view),
                        forward=orig.forward)
    rn.root_called = True
    view.__dict__["_cupyfuse_runner"] = rn
    return view


def program(module: nn.Module, *example_inputs: Any) -> Program:
    """The tail program a fused module (from :func:`from_model` or :func:`fused_class`)
    runs for inputs like these (for inspection: ``print(program(m, x).describe())``)."""
    rn = module.__dict__.get("_cupyfuse_runner")
    if rn is None:
        base = getattr(type(module), "_cupyfuse_base", None)
        if base is None:
            raise TypeError(f"program: {type(module).__name__} is not a fused module "
                            "(make one with cupyfuse.from_model or cupyfuse.fused_class)")
        rn = runner._Runner(_original_trace(base), forward=base.forward)
        rn.root_called = True
        module.__dict__["_cupyfuse_runner"] = rn
    numbers = runner._numbers(example_inputs)
    left = rn.left_at(example_inputs)
    skip = dict(numbers + left)
    kinds = [(i, getattr(a, "dtype", None)) for i, a in enumerate(example_inputs)
             if i and i not in skip]
    return rn.program(module, [a for i, a in enumerate(example_inputs) if i not in skip],
                      tuple(i for i, d in kinds if d == torch.bool), numbers, left,
                      tuple(i for i, d in kinds if d in (torch.int64, torch.int32)))


_class_cache: dict[tuple, type] = {}
_trace_lock = threading.RLock()


def fused_class(cls: type, precision: str | None = None) -> type:
    """A drop-in subclass of ``cls`` whose forward is fused.

    Same ``__init__`` (so the same seed gives the same parameters), parameters,
    buffers, state_dict keys and train/eval behaviour; ``ModelNew = fused_class(Model)``
    is a complete KernelBench submission. The forward is traced at the first call.
    ``precision`` picks the GEMM precision (None follows torch's setting); an instance's
    ``cupyfuse_precision`` attribute, where set, overrides it.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"fused_class: expected an nn.Module subclass, got {cls!r}")
    key = (cls, precision)
    hit = _class_cache.get(key)  # type: ignore[arg-type]
    if hit is not None:
        return hit
    orig_forward = cls.forward
    import inspect

    sig = inspect.signature(orig_forward)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():   # traced by dynamo: one custom op
            from cupyfuse import compiled

            return compiled.call(self, args, kwargs)
        if kwargs:  # keyword inputs, in the original forward's parameter order
            bound = sig.bind(self, *args, **kwargs)
            args = runner._bound_inputs(bound, type(self).__name__)[1:]
        rn = self.__dict__.get("_cupyfuse_runner")
        if rn is None:
            rn = runner._Runner(_original_trace(cls), forward=orig_forward)
            rn.root_called = True
            self.__dict__["_cupyfuse_runner"] = rn
        return runner._run_module(self, rn, args, precision_of(self))

    def precision_of(self: nn.Module) -> str | None:
        # (a missing attribute through nn.Module.__getattr__ costs an exception per call)
        prec = self.__dict__.get("cupyfuse_precision", runner._MISSING)
        return getattr(type(self), "cupyfuse_precision", precision) if prec is runner._MISSING \
            else prec

    def __reduce_ex__(self: nn.Module, protocol: int) -> tuple:
        # the generated class is no attribute of cls's module: pickle the recipe instead
        # (a subclass defined in a module, like cupyfuse.kernelbench's named classes, by name)
        state = {k: v for k, v in self.__dict__.items() if k != "_cupyfuse_runner"}
        if type(self) is not new:
            return (_blank_instance, (type(self),), state)
        return (_new_fused_instance, (cls, precision), state)

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # a repeated call torch would hand straight to forward: its specialised call (which
        # checks that itself), else its prepared launch, here
        if not kwargs and not torch.compiler.is_compiling():
            rn = self.__dict__.get("_cupyfuse_runner")
            if rn is not None:
                spec = rn._spec
                if spec is not None:
                    hit = spec(self, args)
                    if hit is not None:
                        return hit
                if type(self).forward is forward and runner._direct_call(self):
                    hit = rn.fast_call(self, args, precision_of(self))
                    if hit is not None:
                        return hit
        return nn.Module.__call__(self, *args, **kwargs)

    # (what a specialised call of an instance reads its precision with: fastpath.build)
    forward._cupyfuse_precision_of = precision_of   # type: ignore[attr-defined]

    # (a class with a __call__ of its own keeps it: the shortcut only stands in for torch's)
    def __new__(klass: type, *args: Any, **kwargs: Any) -> nn.Module:
        # every instance known by id to torch.compile's custom op (cupyfuse.compiled: dynamo
        # hands the op's handle function constants only)
        base_new = cls.__new__
        obj = base_new(klass) if base_new is object.__new__ else base_new(klass, *args, **kwargs)
        from cupyfuse import compiled

        compiled.register(obj)
        return obj

    extra = {"__call__": __call__} if cls.__call__ is nn.Module.__call__ else {}
    new = type(f"{cls.__name__}Fused", (cls,), {**extra, "forward": forward, "__new__": __new__,
                                                "__module__": cls.__module__,
                                                "__reduce_ex__": __reduce_ex__,
                                                "_cupyfuse_base": cls,
                                                "__doc__": f"{cls.__name__} with a fused forward "
                                                           "(cupyfuse.fused_class)."})
    _class_cache[key] = new  # type: ignore[index]
    return new


def _trace_original(self: nn.Module, cls: type, concrete: dict | None = None
                    ) -> tracing.Traced:
    """Trace ``cls.forward`` (the original's) over a :func:`fused_class` instance
    (``concrete``: see :func:`tracing.trace`)."""
    # torch.fx traces type(root).forward: point it at the original for the trace
    with _trace_lock:
        new_cls = type(self)
        had = "forward" in new_cls.__dict__
        fused_forward = new_cls.__dict__.get("forward")
        new_cls.forward = cls.forward  # type: ignore[method-assign]
        try:
            return tracing.trace(self, cls.__name__, concrete)
        finally:
            if had:
                new_cls.forward = fused_forward  # type: ignore[method-assign]
            else:
                del new_cls.forward


def _original_trace(cls: type) -> Callable[[nn.Module, dict | None], tracing.Traced]:
    """The trace function of a fused_class instance's runner: ``cls``'s forward over the
    module called (the runner holds no module: it lives in the module's own dict)."""
    def trace(module: nn.Module, concrete: dict | None) -> tracing.Traced:
        return _trace_original(module, cls, concrete)
    return trace


def _new_fused_instance(cls: type, precision: str | None) -> nn.Module:
    """Unpickling helper of :func:`fused_class` instances (state is set afterwards)."""
    new = fused_class(cls, precision)
    return new.__new__(new)


def _blank_instance(cls: type) -> nn.Module:
    """Unpickling helper of subclasses of :func:`fused_class` classes (state set after)."""
    return cls.__new__(cls)
