"""Every result a fused call returns is its own contiguous tensor (the minimal models are
in tests/api/test_state_between_calls.py): it shares memory with no input and no other
result, so an in-place write to one result changes nothing else the caller holds, and
``.view(-1)`` works on it.

How (``Program.own_results``, ``cpu.own_tensors``): a result that is a forward input
(``x.clone()``, read by the translator as ``x``) or the same value as an earlier result (``h,
h.clone()``; ``relu(h), F.relu(h)``) gets a program node of its own, which the plan
materialises: on the GPU a kernel writes it to a buffer of its own (general path and
prepared launches alike); the CPU path (and the GPU's general path, as a second line)
copies a result that is strided or shares a storage with an input or an earlier result.
A one-result program of a Linear is unchanged: nothing is copied there.

Drawn here: several-result forwards mixing duplicates, clones, slices (strided views in
torch), views, a bias-free GEMM's output, the inputs themselves and their clones, in a
tuple, a list or a dict; and fused_linear tails returning h, a slice of it or an extra
input. Each through the CPU path (from_model, fused_class, fused_linear), the GPU's
general path (execute.run_gpu, its launches emulated on the CPU: tests/emu/gpu.py) and the
prepared launches (full path, then the ready plan, emulated: tests/emu/prepared.py), checked
against float64 torch (atol = rtol = 1e-4; NaN/inf rows placed as torch places them), for
contiguity, and by writing into each result in turn: no other result and no input may
change. Marked ``gpu``: the same on a GPU (the general path, then prepared launches).
"""
from __future__ import annotations

import copy
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from cupyfuse.backend import execute
from cupyfuse import runner
import cupyfuse
from cupyfuse.frontend import trace as tracing, translate as translation
from cupyfuse.backend.cpu import own_tensors
from cupyfuse.interop import cupy_available

from emu import gpu as _gpuemu
from emu import prepared as _prepemu
from gen.tails import HypDraw, RandDraw, assert_matches
from helpers import examples

gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and cupy_available()),
                               reason="needs a CUDA GPU visible to both torch and CuPy")


# ======================================================================================
# the drawn forms
# ======================================================================================
#: one result each: h = fc(x) (with bias), g = a bias-free Linear's output (the GEMM's
#: own buffer on the GPU), x and m the forward's inputs
FORMS = ("h", "h.clone", "h.detach", "h.contiguous", "relu", "F.relu", "slice",
         "slice.clone", "slice.contiguous", "unsqueeze", "sum", "g", "g.clone", "g.slice",
         "x", "x.clone", "x.float", "x.unsqueeze", "m", "m.clone", "hm")
#: the forms that run no Linear
INPUT_FORMS = frozenset({"x", "x.clone", "x.float", "x.unsqueeze", "m", "m.clone"})


def _form(mod: nn.Module, f: str, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    a, b = mod.lo, mod.hi
    if f == "x":
        return x
    if f == "x.clone":
        return x.clone()
    if f == "x.float":
        return x.float()
    if f == "x.unsqueeze":
        return x.unsqueeze(1)
    if f == "m":
        return m
    if f == "m.clone":
        return m.clone()
    if f.startswith("g"):
        g = mod.g(x)
        return g if f == "g" else g.clone() if f == "g.clone" else g[:, a:b]
    h = mod.fc(x)
    return {"h": lambda: h, "h.clone": lambda: h.clone(), "h.detach": lambda: h.detach(),
            "h.contiguous": lambda: h.contiguous(), "relu": lambda: torch.relu(h),
            "F.relu": lambda: F.relu(h), "slice": lambda: h[:, a:b],
            "slice.clone": lambda: h[:, a:b].clone(),
            "slice.contiguous": lambda: h[:, a:b].contiguous(),
            "unsqueeze": lambda: h.unsqueeze(1), "sum": lambda: h.sum(1, keepdim=True),
            "hm": lambda: h[:, :1] * m}[f]()


class Several(nn.Module):
    """Linear(k, n) (and a bias-free Linear(k, n)); the forward returns ``spec["forms"]``
    in a tuple, a list or a dict (or, for one form, the tensor itself)."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.spec = spec
        self.fc = nn.Linear(spec["k"], spec["n"])
        self.g = nn.Linear(spec["k"], spec["n"], bias=False)
        self.lo, self.hi = spec["lo"], spec["hi"]

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> Any:
        res = [_form(self, f, x, m) for f in self.spec["forms"]]
        c = self.spec["container"]
        if c == "tensor":
            return res[0]
        if c == "dict":
            return {f"r{i}": r for i, r in enumerate(res)}
        return tuple(res) if c == "tuple" else list(res)


def draw_spec(d: Any) -> dict:
    n = d.int(2, 9)
    lo = d.int(0, n - 2)
    hi = d.int(lo + 1, n)   # ([0:n]: h itself, a repeated value when h is returned too)
    forms = [d.choice(FORMS) for _ in range(d.int(1, 4))]
    if d.bool(0.3):   # a duplicate on purpose
        forms.append(d.choice(forms))
    if all(f in INPUT_FORMS for f in forms):   # (a forward with no Linear is refused)
        forms.insert(d.int(0, len(forms)), d.choice(("h", "g", "sum")))
    c = d.choice(("tuple", "list", "dict") + (("tensor",) if len(forms) == 1 else ()))
    return {"k": d.int(1, 6), "n": n, "lo": lo, "hi": hi, "mw": d.int(1, 5),
            "forms": tuple(forms), "container": c, "batch": d.int(1, 5),
            "nan_row": d.bool(0.3)}


def _inputs(spec: dict, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(spec["batch"], spec["k"], generator=g)
    if spec["nan_row"]:
        x[-1, 0] = float("nan")
    return [x, torch.rand(spec["batch"], spec["mw"], generator=g)]


def _model(spec: dict, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Several(spec).eval()


# ======================================================================================
# the checks
# ======================================================================================
def _flat(r: Any) -> list[torch.Tensor]:
    if isinstance(r, dict):
        return list(r.values())
    return list(r) if isinstance(r, (tuple, list)) else [r]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.int32).numpy().copy()


def check_own(results: Any, inputs: list[torch.Tensor], what: str) -> None:
    """Each result contiguous (``.view(-1)`` works), and writing into each result in turn
    changes no other result and no input."""
    outs = _flat(results)
    for i, o in enumerate(outs):
        assert o.is_contiguous(), f"{what}: result {i} strided {tuple(o.stride())}"
        o.view(-1)
    expect = [_bits(o) for o in outs]
    keep = [_bits(t) for t in inputs]
    for i, o in enumerate(outs):
        o.fill_(1234.5 + i)
        expect[i] = _bits(o)
        for j, p in enumerate(outs):
            assert np.array_equal(_bits(p), expect[j]), \
                f"{what}: writing result {i} changed result {j}"
        for j, t in enumerate(inputs):
            assert np.array_equal(_bits(t), keep[j]), \
                f"{what}: writing result {i} changed input {j}"


def check_values(results: Any, ref64: Any, ref32: Any, what: str) -> None:
    assert type(results) is type(ref64), f"{what}: {type(results)} vs {type(ref64)}"
    if isinstance(ref64, dict):
        assert list(results) == list(ref64), what
    outs, r64, r32 = _flat(results), _flat(ref64), _flat(ref32)
    assert len(outs) == len(r64), what
    for i, (o, a, b) in enumerate(zip(outs, r64, r32)):
        assert_matches(o.detach().cpu(), a, b, what=f"{what}: result {i}")


def references(model: nn.Module, inputs: list[torch.Tensor]) -> tuple[Any, Any]:
    with torch.no_grad():
        ref64 = copy.deepcopy(model).double()(*[t.double() for t in inputs])
        ref32 = copy.deepcopy(model)(*[t.clone() for t in inputs])
    return ref64, ref32


def _quiet(fn: Any, *args: Any) -> Any:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return fn(*args)


def _emulated(prog: Any, tens: list, srcs: list, monkeypatch: Any, calls: int = 3
              ) -> tuple[Any, list]:
    """(the general path's result, ``calls`` prepared results): execute.run_gpu and the
    prepared launches (full path, then the ready plan), emulated on the CPU."""
    _prepemu.install(monkeypatch)
    prog = _prepemu.runnable(prog)   # (GEMV rewrites: their kernels are not emulated)
    general = _gpuemu.run_program_emulated(prog, tens, srcs, monkeypatch)
    pr = _prepemu.prepare(prog, tens, srcs)
    assert pr is not None, "not prepared"
    outs = []
    for i in range(calls):
        outs.append(_prepemu.call(pr, tens, srcs))
        if i == 0:
            assert pr._ready, "no ready plan after the first call"
    return general, outs


def check_model(spec: dict, seed: int, monkeypatch: Any) -> None:
    """A drawn model through the CPU path (from_model, fused_class), the emulated
    general GPU path and the emulated prepared launches."""
    what = str(spec)
    model = _model(spec, seed)
    inputs = _inputs(spec, seed)
    ref64, ref32 = references(model, inputs)
    out = _quiet(cupyfuse.from_model(model), *inputs)
    check_values(out, ref64, ref32, what + " from_model")
    check_own(out, inputs, what + " from_model")
    cls = cupyfuse.fused_class(Several)
    torch.manual_seed(seed)
    twin = cls(spec).eval()
    twin.load_state_dict(model.state_dict())
    out = _quiet(twin, *inputs)
    check_values(out, ref64, ref32, what + " fused_class")
    check_own(out, inputs, what + " fused_class")
    prog, tens, srcs = _gpuemu.model_program(model, inputs)
    general, outs = _emulated(prog, tens, srcs, monkeypatch)
    for k, o in enumerate([general] + outs):
        name = what + (" general" if k == 0 else f" prepared call {k}")
        assert _prepemu.same_bits(_flat(o), _flat(general)), name
        check_values(o, ref64, ref32, name)
    # (the checks write into the results: after every call has run, prepared results of
    # several calls included -- each call's buffers are its own)
    for k, o in enumerate([general] + outs):
        check_own(o, tens, what + (" general" if k == 0 else f" prepared call {k}"))


# ======================================================================================
# from_model / fused_class: drawn forms
# ======================================================================================
@settings(max_examples=examples(120), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(hst.data(), hst.integers(0, 10 ** 6))
def test_several_results_own_their_memory_hypothesis(data, seed):
    with pytest.MonkeyPatch.context() as mp:
        check_model(draw_spec(HypDraw(data.draw)), seed, mp)


@pytest.mark.parametrize("forms", [
    ("h", "h"), ("h", "h.clone"), ("relu", "F.relu"), ("h", "slice.clone"),
    ("slice.contiguous",), ("slice",), ("h", "x.clone"), ("hm", "m.clone"), ("x", "h"),
    ("x.clone", "x", "x.float", "relu"), ("g", "g.clone", "g"), ("g.slice", "g"),
    ("h", "unsqueeze", "h.detach"), ("x.unsqueeze", "x", "g"), ("m", "m", "sum")],
    ids=lambda f: "+".join(f))
@pytest.mark.parametrize("container", ["tuple", "dict"])
def test_several_results_own_their_memory(forms, container, monkeypatch):
    spec = {"k": 3, "n": 5, "lo": 1, "hi": 4, "mw": 2, "forms": forms,
            "container": container, "batch": 3, "nan_row": True}
    check_model(spec, 0, monkeypatch)
    spec = dict(spec, batch=1, nan_row=False)
    check_model(spec, 1, monkeypatch)


def test_one_result_programs_are_unchanged():
    """A program whose results are distinct computed values (no input, none repeated:
    every one-result forward of a Linear returning a computed value) gains no node:
    nothing is copied there on the GPU; nor by cpu.own_tensors for a fresh result."""
    for forms in [("h",), ("relu",), ("slice",), ("g",), ("h", "relu"), ("g", "slice")]:
        spec = {"k": 3, "n": 5, "lo": 1, "hi": 4, "mw": 2, "forms": forms,
                "container": "tuple", "batch": 3, "nan_row": False}
        model = _model(spec, 0)
        traced = tracing.trace(model, "Several")
        p = translation.translate(traced, model, [(3, 3), (3, 2)])
        before = (list(p.nodes), p.out, p.more_outs)
        p.own_results()
        assert (list(p.nodes), p.out, p.more_outs) == before, forms
    t, x = torch.randn(3, 4), torch.randn(3, 2)
    assert own_tensors([t], [x])[0] is t   # a fresh contiguous result: returned as it is


@pytest.mark.parametrize("forms", [("h", "h"), ("h", "x"), ("slice", "h")],
                         ids=lambda f: "+".join(f))
def test_general_path_copies_without_own_results(forms, monkeypatch):
    """A program built without Program.own_results (two results one value, a result
    that is the input): the prepared launches leave it to the general path, and
    execute.run_gpu copies the aliasing result (cpu.own_tensors)."""
    spec = {"k": 3, "n": 5, "lo": 1, "hi": 4, "mw": 2, "forms": forms,
            "container": "tuple", "batch": 3, "nan_row": False}
    model = _model(spec, 0)
    inputs = _inputs(spec, 0)
    traced = tracing.trace(model, "Several")
    prog = translation.translate(traced, model, [tuple(t.shape) for t in inputs])
    srcs = [runner._resolve(model, s).detach() for s in prog.sources]
    _prepemu.install(monkeypatch)
    if forms != ("slice", "h"):
        assert _prepemu.prepare(prog, inputs, srcs) is None
    out = _gpuemu.run_program_emulated(prog, inputs, srcs, monkeypatch)
    ref64, ref32 = references(model, inputs)
    check_values(out, ref64, ref32, str(forms))
    check_own(out, inputs, str(forms))


def test_generated_kernels_write_each_result(tmp_path_factory, monkeypatch):
    """The generated level kernels themselves (compiled as C++ by tests/emu/cuda.py, in
    place of the node-by-node emulation) under execute.run_gpu: each result's copy written
    by its kernel to a buffer of its own."""
    from emu import cuda as _cuda_emu

    cases = []
    for forms in [("h", "h.clone", "relu", "F.relu"), ("hm", "x.clone", "m.clone"),
                  ("g", "g.clone", "g.slice", "x.unsqueeze"), ("x", "sum", "x")]:
        spec = {"k": 3, "n": 7, "lo": 2, "hi": 6, "mw": 4, "forms": forms,
                "container": "tuple", "batch": 5, "nan_row": True}
        model = _model(spec, 3)
        inputs = _inputs(spec, 3)
        prog, tens, srcs = _gpuemu.model_program(model, inputs)
        cases.append((spec, model, inputs, _prepemu.runnable(prog), tens, srcs))
    kernels = _cuda_emu.build_or_skip([c[3] for c in cases], tmp_path_factory.mktemp("emu"),
                                      exact=True)
    for spec, model, inputs, prog, tens, srcs in cases:
        out = _gpuemu.run_program_emulated(prog, tens, srcs, monkeypatch, kernels)
        ref64, ref32 = references(model, inputs)
        check_values(out, ref64, ref32, str(spec["forms"]))
        check_own(out, tens, str(spec["forms"]))


# ======================================================================================
# fused_linear: a tail returning h, a slice of it, or an extra input
# ======================================================================================
TAILS = {
    "h": lambda h, e: h,
    "h.clone": lambda h, e: h.clone(),
    "slice": lambda h, e: h[:, 2:5],
    "slice.contiguous": lambda h, e: h[:, 2:5].contiguous(),
    "slice.clone": lambda h, e: h[:, 2:5].clone(),
    "relu.slice": lambda h, e: torch.relu(h)[:, 1:3].contiguous(),
    "e": lambda h, e: e,
    "e.clone": lambda h, e: e.clone(),
    "e.float": lambda h, e: e.float(),
}


def _linear_case(name: str, batch: int, bias: bool, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, generator=g)
    x[0, 1] = float("inf")
    w, b = torch.randn(8, 4, generator=g), torch.randn(8, generator=g)
    e = torch.randn(batch, 8, generator=g)
    return TAILS[name], x, w, b if bias else None, e


def _linear_refs(tail: Any, x: torch.Tensor, w: torch.Tensor, b: Any, e: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    h64 = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    h32 = x @ w.t() + (b if b is not None else 0)
    return tail(h64, e.double()), tail(h32, e.clone()).clone()


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", sorted(TAILS))
def test_fused_linear_results_own_their_memory(name, batch, bias, monkeypatch):
    tail, x, w, b, e = _linear_case(name, batch, bias, batch)
    ref64, ref32 = _linear_refs(tail, x, w, b, e)
    operands = [x, w, e] + ([b] if b is not None else [])
    out = cupyfuse.fused_linear(x, w, b, tail, e)
    check_values(out, ref64, ref32, f"{name} cpu")
    check_own(out, operands, f"{name} cpu")
    prog = runner._function_program(tail, x, 8, b is not None, [e])
    srcs = [w] + ([b] if b is not None else []) + list(prog.sources[1 + (b is not None):])
    general, outs = _emulated(prog, [x, e], srcs, monkeypatch)
    for k, o in enumerate([general] + outs):
        assert _prepemu.same_bits(o, general), f"{name} call {k}"
        check_values(o, ref64, ref32, f"{name} call {k}")
    for k, o in enumerate([general] + outs):
        check_own(o, operands, f"{name} call {k}")


@pytest.mark.parametrize("name", ["slice", "slice.contiguous"])
def test_cuda_tail_reference_result_is_contiguous(name):
    """A CudaTail's CPU reference returning a slice of h: a contiguous copy."""
    x, w = torch.randn(3, 4), torch.randn(8, 4)
    t = cupyfuse.CudaTail(map="h", reference=lambda h: TAILS[name](h, None))
    out = cupyfuse.fused_linear(x, w, None, t)
    assert out.is_contiguous() and out.shape == (3, 3)
    torch.testing.assert_close(out.double(), (x.double() @ w.double().t())[:, 2:5],
                               atol=1e-4, rtol=1e-4)


# ======================================================================================
# GPU: the general path, then prepared launches
# ======================================================================================
def _gpu_model(spec: dict, seed: int) -> None:
    what = str(spec)
    model = _model(spec, seed)
    inputs = _inputs(spec, seed)
    ref64, ref32 = references(model, inputs)
    model = model.cuda()
    cin = [t.cuda() for t in inputs]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "_try_prepare", lambda *a, **k: None)
        general = _quiet(cupyfuse.from_model(model), *cin)
    fm = cupyfuse.from_model(model)
    ran = []
    real = execute.run_gpu

    def counting(*a: Any, **k: Any) -> Any:
        ran.append(1)
        return real(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(execute, "run_gpu", counting)
        outs = [_quiet(fm, *cin) for _ in range(3)]
    assert not ran, f"{what}: a call ran the general path (not prepared)"
    torch.cuda.synchronize()
    for k, o in enumerate([general] + outs):
        check_values(o, ref64, ref32, f"{what} call {k}")
    for k, o in enumerate([general] + outs):
        check_own(o, cin, f"{what} call {k}")
    cls = cupyfuse.fused_class(Several)
    torch.manual_seed(seed)
    twin = cls(spec).eval().cuda()
    twin.load_state_dict(model.state_dict())
    outs = [_quiet(twin, *cin) for _ in range(3)]
    for k, o in enumerate(outs):
        check_values(o, ref64, ref32, f"{what} fused_class call {k}")
    for k, o in enumerate(outs):
        check_own(o, cin, f"{what} fused_class call {k}")


@pytest.mark.parametrize("forms", [
    ("h", "h"), ("h", "h.clone"), ("relu", "F.relu"), ("h", "slice.clone"),
    ("slice.contiguous",), ("h", "x.clone"), ("hm", "m.clone"), ("x", "g"),
    ("g", "g.clone", "g"), ("x.unsqueeze", "x", "h"), ("m", "m", "sum")],
    ids=lambda f: "+".join(f))
@pytest.mark.parametrize("batch", [1, 3, 40])
@gpu
@needs_gpu
def test_gpu_several_results_own_their_memory(forms, batch):
    spec = {"k": 4, "n": 8, "lo": 2, "hi": 5, "mw": 3, "forms": forms,
            "container": "tuple", "batch": batch, "nan_row": batch > 1}
    _gpu_model(spec, batch)


@pytest.mark.parametrize("seed", range(30))
@gpu
@needs_gpu
def test_gpu_several_results_drawn(seed):
    _gpu_model(draw_spec(RandDraw(seed)), seed)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("batch", [1, 3, 40])
@pytest.mark.parametrize("name", sorted(TAILS))
@gpu
@needs_gpu
def test_gpu_fused_linear_results_own_their_memory(name, batch, bias):
    tail, x, w, b, e = _linear_case(name, batch, bias, batch)
    ref64, ref32 = _linear_refs(tail, x, w, b, e)
    x, w, e = x.cuda(), w.cuda(), e.cuda()
    b = b.cuda() if b is not None else None
    operands = [x, w, e] + ([b] if b is not None else [])
    outs = [cupyfuse.fused_linear(x, w, b, tail, e) for _ in range(3)]
    keys = [k for k in runner._fast_fn if k[0] is tail]
    assert keys and runner._fast_fn[keys[-1]] is not None, "no prepared launch was made"
    torch.cuda.synchronize()
    for k, o in enumerate(outs):
        check_values(o, ref64, ref32, f"{name} call {k}")
    for k, o in enumerate(outs):
        check_own(o, operands, f"{name} call {k}")
