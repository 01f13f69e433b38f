"""The op table (cupyfuse/ops/registry.py): every record, end to end on the CPU.

For each record, each of its torch spellings (function, method, in-place method,
module) is fused in a Linear + tail model and checked against the float64 eager model:

* on the CPU path (the record's ``torch_fn``);
* through its generated CUDA kernel (the record's fragment, inside the code generator's
  level kernel), compiled as C++ and run on the CPU (``tests/emu/cuda.py``; skipped
  without g++).

Records without a spelling of their own (emitted by other lowerings: ``where``,
``prelu``, ``clamp``, ...) are reached through a form listed in ``INTERNAL``; a record
that is neither spelled nor listed there fails ``test_every_record_is_reached``.

``test_an_op_is_one_record`` adds ``torch.tan`` to the vocabulary with one
:func:`registry.register` call and runs it end to end (refused before, fused after,
CPU path and generated kernel against float64, the kernel compiled by nvcc for sm_90a
where nvcc is installed, gradients through its derivative against float64), then
removes it again.
"""
from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cupyfuse
from cupyfuse import TailError
from cupyfuse.backend import codegen, runtime
from cupyfuse.ops import registry
from cupyfuse.ops.registry import OPS, Op

from emu import cuda as _cuda_emu
from helpers import program_of

ATOL = RTOL = 1e-4


class Tail(nn.Module):
    """Linear(8, 12) then ``fn(h, other)`` (``other``: a second operand of h's shape,
    positive and away from h, for binary ops); ``mod``: a module ``fn`` may call."""

    def __init__(self, fn: Callable[..., Any], mod: nn.Module | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 12)
        self.fn = fn
        self.mod = mod if mod is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.fn(self, h, h * 0.5 + 1.25)


def _forms(op: Op) -> list[tuple[str, Callable[..., Any], nn.Module | None]]:
    """(label, fn(model, h, other), module) for each spelling of ``op``."""
    out: list[tuple[str, Callable[..., Any], nn.Module | None]] = []
    binary = op.arity == 2
    if op.kind == "compare":   # (a boolean result is refused: its float32 value)
        return [(f"{getattr(f, '__module__', '')}.{getattr(f, '__name__', f)}",
                 lambda m, h, o, f=f: f(h, o).float(), None) for f in op.functions] + \
            [(f".{n}()", lambda m, h, o, n=n: getattr(h, n)(o).float(), None)
             for n in op.methods]
    for f in op.functions:
        label = f"{getattr(f, '__module__', '')}.{getattr(f, '__name__', f)}"
        if binary:
            out.append((label, lambda m, h, o, f=f: f(h, o), None))
        else:
            out.append((label, lambda m, h, o, f=f: f(h), None))
    for name in op.methods:
        if binary:
            out.append((f".{name}()", lambda m, h, o, n=name: getattr(h, n)(o), None))
        else:
            out.append((f".{name}()", lambda m, h, o, n=name: getattr(h, n)(), None))
            if op.kind == "unary" and not name.endswith("_"):
                out.append((f".{name}_()", lambda m, h, o, n=name: getattr(h * 1.0, n + "_")(),
                            None))
    for cls in op.modules:
        out.append((cls.__name__, lambda m, h, o: m.mod(h), cls()))
    return out


#: forms that reach the records other lowerings emit (no spelling of their own)
INTERNAL: dict[str, tuple[Callable[..., Any], nn.Module | None]] = {
    "gelu": (lambda m, h, o: F.gelu(h), None),
    "gelu_tanh": (lambda m, h, o: F.gelu(h, approximate="tanh"), None),
    "clamp": (lambda m, h, o: h.clamp(-0.3, 0.4) + h.clamp(min=0.1), None),
    "hardtanh": (lambda m, h, o: F.hardtanh(h * 2.0) + F.hardtanh(h, -0.5, 0.7), None),
    "detach": (lambda m, h, o: h * h.detach() + torch.detach(o), None),
    "where": (lambda m, h, o: torch.where(h > 0, h, o), None),
    "prelu": (lambda m, h, o: m.mod(h), nn.PReLU(12, init=0.2)),
    "finite_or_zero": (lambda m, h, o: torch.logsumexp(h, 1), None),
}


def _cases() -> list[tuple[str, str]]:
    cases = []
    for name in sorted(OPS):
        for label, _, _ in _forms(OPS[name]):
            cases.append((name, label))
        if name in INTERNAL:
            cases.append((name, "internal"))
    return cases


def _model(name: str, label: str) -> Tail:
    torch.manual_seed(0)
    if label == "internal":
        fn, mod = INTERNAL[name]
    else:
        fn, mod = next((f, m) for lab, f, m in _forms(OPS[name]) if lab == label)
    return Tail(fn, mod)


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=g) * 1.5
    x[4, 3] = float("nan")   # a NaN row: propagated where torch propagates it
    return x


def _sources(prog: Any, fused: nn.Module) -> list:
    """The program's sources as tensors (a name is a parameter of the fused module)."""
    root = getattr(fused, "model", fused)
    return [root.get_parameter(s) if isinstance(s, str) else s for s in prog.sources]


def _check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.dtype == torch.float32, what
    torch.testing.assert_close(out.double(), ref.double(), atol=ATOL, rtol=RTOL, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], dict]:
    """Every case's generated kernels compiled in one C++ library (skips without g++)."""
    built: dict = {}

    def get() -> dict:
        if _cuda_emu.CXX is None:
            pytest.skip("g++ is not on PATH: the generated kernels are not emulated")
        if not built:
            progs = [program_of(cupyfuse.from_model(_model(n, lab)), _inputs())
                     for n, lab in _cases()]
            built.update(_cuda_emu.build_or_skip(progs, tmp_path_factory.mktemp("emu")))
        return built
    return get


@pytest.mark.parametrize("name,label", _cases(), ids=[f"{n}-{l}" for n, l in _cases()])
def test_record_matches_float64(name: str, label: str, emulated: Callable[[], dict]) -> None:
    model = _model(name, label)
    x = _inputs()
    with torch.no_grad():
        ref = model.double()(x.double())
        model.float()
        fused = cupyfuse.from_model(model)
        out = fused(x)
    _check(out, ref, f"{name} as {label}, CPU path")
    prog = program_of(fused, x)
    if OPS[name].primitive:
        assert any(n.kind == "map" and n.op == name for n in prog.nodes), \
            f"{label} is not fused as {name}:\n{prog.describe()}"
    kernels = emulated()
    emu = _cuda_emu.run_program(prog, [x], _sources(prog, fused), kernels)
    _check(emu.reshape(ref.shape), ref, f"{name} as {label}, generated kernel")


def test_every_record_is_reached() -> None:
    """A record no spelling reaches needs a form in INTERNAL (else nothing tests it)."""
    unreached = [n for n, op in OPS.items() if not _forms(op) and n not in INTERNAL]
    assert not unreached, f"records without a spelling or an INTERNAL form: {unreached}"
    for name, (fn, mod) in INTERNAL.items():
        prog = program_of(cupyfuse.from_model(Tail(fn, mod)), torch.zeros(2, 8))
        assert any(n.kind == "map" and n.op == name for n in prog.nodes), name


def test_spellings_are_unique_and_derived() -> None:
    """Each spelling names one record, and the front end's lookups are the records'."""
    seen: dict[Any, str] = {}
    for op in OPS.values():
        for s in op.functions + op.methods + op.modules:
            assert s not in seen, f"{s!r} spells both {seen[s]} and {op.name}"
            seen[s] = op.name
    sp = registry.spellings()
    assert {f: o.name for f, o in sp["functions"].items()} == \
        {f: seen[f] for op in OPS.values() for f in op.functions}
    for op in OPS.values():
        for m in op.methods:
            assert sp["methods"][m] is op


def _tan_record() -> Op:
    # (its derivative, torch's: grad * (1 + result^2))
    return Op("tan", 1, torch.tan, "tanf({0})", cost=1, kind="unary",
              functions=(torch.tan,), methods=("tan",), on_bool="float",
              derivative=lambda d: (d.g * (1.0 + d.y * d.y),))


def test_an_op_is_one_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "tan" not in OPS
    model = Tail(lambda m, h, o: torch.tan(h * 0.5) + (h * 0.25).tan())
    x = _inputs()
    with pytest.raises(TailError, match="tan"):
        cupyfuse.from_model(model)(x)
    registry.register(_tan_record())
    try:
        with torch.no_grad():
            ref = model.double()(x.double())
            model.float()
            fused = cupyfuse.from_model(model)
            out = fused(x)
        _check(out, ref, "tan, CPU path")
        prog = program_of(fused, x)
        assert sum(n.kind == "map" and n.op == "tan" for n in prog.nodes) == 2
        pl = codegen.plan(prog)
        src = codegen.kernel_source(pl)
        assert "tanf(" in src
        if _cuda_emu.CXX is not None:
            kernels = _cuda_emu.build_or_skip([prog], tmp_path)
            emu = _cuda_emu.run_program(prog, [x], _sources(prog, fused), kernels)
            _check(emu.reshape(ref.shape), ref, "tan, generated kernel")
        nvcc = shutil.which("nvcc")
        if nvcc is not None:
            cu = tmp_path / "tan.cu"
            cu.write_text(runtime.expand_source("tail_ops.cuh") + "\n"
                          + src.split("\n", 1)[1])
            r = subprocess.run([nvcc, "-cubin", "-o", str(tmp_path / "tan.cubin"),
                                "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                                str(cu)], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr[-3000:]
        # its gradients, through the backward program (the record's derivative)
        from cupyfuse import autograd, config

        monkeypatch.setattr(config, "BACKWARD_PROGRAM", "cpu")

        xg = x.clone().requires_grad_(True)
        fused(xg).sum().backward()
        x64 = x.double().requires_grad_(True)
        m64 = copy.deepcopy(model).double()
        m64(x64).sum().backward()
        assert autograd.backward_kind(prog, x.device) == "backward program"
        _check(xg.grad, x64.grad, "tan, gradient of x")
        _check(model.fc.weight.grad, m64.fc.weight.grad, "tan, gradient of the weight")
    finally:
        registry.unregister("tan")
    with pytest.raises(TailError, match="tan"):
        cupyfuse.from_model(model)(x)


def test_table_and_lowerings_do_not_overlap() -> None:
    """A spelling is either an op-table record's or a registered lowering's, never both
    (the translator looks the lowerings up first: a record would be shadowed)."""
    from cupyfuse.frontend import lower, translate  # noqa: F401 (registers the lowerings)

    sp = registry.spellings()
    assert not set(sp["functions"]) & set(lower.FUNCTIONS)
    assert not set(sp["methods"]) & set(lower.METHODS)
    assert not set(sp["modules"]) & set(lower.MODULES)
