"""Backward programs (cupyfuse/ir/derivative.py) on the GPU path, without a GPU.

A drawn model's program is differentiated for every float input and parameter; its
backward program then runs twice on the same CPU tensors:

* the CPU path (``run_cpu``: torch ops, what a CPU call's backward runs);
* ``execute.run_gpu`` with its launches emulated and each level's *generated kernel*
  compiled as C++ (tests/emu/gpu.py, tests/emu/cuda.py): what a CUDA call's backward
  runs under ``config.BACKWARD_PROGRAM = "all"``, its plan, buffers, strides and the
  kernels' index arithmetic included.

The two agree within float32 rounding (the emulated GEMMs are float64 products) and in
NaN/inf placement, on rows with NaN and infinities too. The gradients these programs
give against float64 autograd are tests/api/test_autograd.py's and
tests/corpus/test_corpus_gradients.py's (they take this path on the CPU).
Then: which programs have a backward program and which decline (and say why).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse.backend.cpu import run_cpu
from cupyfuse.ir.derivative import NoDerivative, derivative
from emu import cuda as _cuda_emu
from emu.gpu import model_program, run_program_emulated
from gen.tails import seeded

#: (name, generate() keywords, seed): drawn tails of the families the derivative covers
DRAWN = [(f"any{s}", {}, s) for s in (1, 3, 4, 6, 9, 11, 13, 17, 20, 25, 31, 36)] + [
    ("softmax", dict(force=("softmax", "layernorm")), 201),
    ("groupnorm", dict(force=("groupnorm",)), 202),
    ("second_input", dict(has_y=True, force=("y", "layernorm")), 203),
    ("x_added", dict(K=24, N=24, force=("x",)), 204),
    ("reduce_stage", dict(force=("reduce", "stage")), 205),
    ("normalize_residual", dict(force=("normalize", "residual")), 206),
]


class _Glu(nn.Module):
    """A gated unit (chunk) after the Linear, a second Linear, then log_softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 32)
        self.out = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fc(x).chunk(2, -1)
        return F.log_softmax(self.out(a * torch.sigmoid(b)), -1)


class _Heads(nn.Module):
    """Split features: a per-head softmax (split max and sum, their values read back by
    each head's features), a max over the heads, average and max pooling over windows
    (the last window short of the row for the max), cumulative sums over the row and
    over the heads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 24)

    def forward(self, x: torch.Tensor) -> tuple:
        h = self.fc(x)
        s = h.view(-1, 4, 6).softmax(-1)
        p = F.avg_pool1d(h.unsqueeze(1), 4).squeeze(1)
        q = F.max_pool1d(torch.relu(h).unsqueeze(1), 5).squeeze(1)
        return s.reshape(-1, 24) * h, s.amax(1), p, q, torch.cumsum(h, -1), \
            torch.cumsum(h.view(-1, 4, 6), 1).reshape(-1, 24)


class _Tokens(nn.Module):
    """(batch, seq, features) rows: a parameter read per seq row and per batch element, a
    mean, a max and one position (h[:, 0]) over the sequence, a Linear of a per-batch
    value; a per-batch result beside a per-row one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.head = nn.Linear(8, 4)
        self.p = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> tuple:
        h = torch.tanh(self.fc(x) + self.p)
        z = self.head(h.mean(1) + h[:, 0] * h.amax(1)) * self.p[4]
        return F.log_softmax(z, -1), h


class _BnHead(nn.Module):
    """BatchNorm with batch statistics between two Linears (its backward's batch means)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.out(F.gelu(self.bn(self.fc(x)))), -1)


def _cases() -> list:
    out = []
    for name, kw, seed in DRAWN:
        spec = seeded(seed, **kw)
        model = spec.make_model(seed)
        out.append((name, model, spec.make_inputs(7, "randn3", seed, n_special=3)))
    torch.manual_seed(0)
    out.append(("glu_chain", _Glu(), [torch.randn(7, 12)]))
    torch.manual_seed(1)
    x = torch.randn(7, 10)
    x[2, 3] = float("nan")
    out.append(("heads_pools", _Heads(), [x]))
    torch.manual_seed(3)
    out.append(("bn_head", _BnHead().train(), [torch.randn(9, 6)]))
    torch.manual_seed(2)
    t = torch.randn(5, 3, 6)
    t[1, 2, 0] = float("inf")
    out.append(("tokens", _Tokens(), [t]))
    return out


CASES = _cases()


def _backward_of(model: nn.Module, inputs: list) -> tuple:
    prog, tens, sources = model_program(model, inputs)
    p = prog.unrewritten if prog.unrewritten is not None else prog
    want_in = frozenset(j for j, t in enumerate(tens) if t.is_floating_point())
    want_src = frozenset(k for k, s in enumerate(sources)
                         if isinstance(s, torch.Tensor) and s.is_floating_point())
    bw = derivative(p, want_in, want_src)
    g = torch.Generator().manual_seed(5)
    rows = tens[0].shape[0]
    shapes = p.result_shapes(rows)
    ups = [torch.randn(s, generator=g) if k in bw.grads else None
           for k, s in enumerate(shapes)]
    return bw, list(tens) + bw.grad_inputs(rows, ups, "cpu"), sources


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> dict:
    progs = []
    for _, model, inputs in CASES:
        try:
            progs.append(_backward_of(model, inputs)[0].prog)
        except NoDerivative:
            pass
    return _cuda_emu.build_or_skip(progs, tmp_path_factory.mktemp("bwemu"), exact=True)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_backward_program_generated_kernels_match_the_cpu_path(
        case: int, kernels: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    name, model, inputs = CASES[case]
    bw, vals, sources = _backward_of(model, inputs)
    with torch.no_grad():
        ref = run_cpu(bw.prog, vals, sources, training_updates=False)
    got = run_program_emulated(bw.prog, vals, sources, monkeypatch, kernels)
    assert len(got) == len(ref) == len(bw.outs)
    for what, o, r in zip(bw.outs, got, ref):
        assert o.shape == r.shape, f"{name} {what}"
        for f in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(f(o), f(r)), f"{name} {what}: {f.__name__} placement"
        fin = torch.isfinite(r)
        scale = float(r[fin].abs().max()) if fin.any() else 1.0
        torch.testing.assert_close(o[fin], r[fin], atol=1e-5 * max(scale, 1.0), rtol=1e-4,
                                   msg=lambda m: f"{name} {what}: {m}")


def test_every_case_has_a_backward_program() -> None:
    """The cases above are all of families the derivative covers (none silently declines)."""
    for name, model, inputs in CASES:
        bw = _backward_of(model, inputs)[0]
        kinds = {o[0] for o in bw.outs}
        assert "dh" in kinds, f"{name}: no weight gradient"


class _ChanPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool1d(self.fc(x).view(-1, 4, 6), 3, 2, padding=1).flatten(1)


class _Pool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool1d(self.fc(x).unsqueeze(1), 3, 1).squeeze(1)   # (windows overlap)


@pytest.mark.parametrize("model,why", [(_ChanPool(), "'wpool'"), (_Pool(), "overlap")])
def test_unsupported_nodes_decline_with_their_name(model: nn.Module, why: str) -> None:
    with pytest.raises(NoDerivative, match=why):
        _backward_of(model, [torch.randn(5, 6)])


def test_the_backward_of_a_chain_holds_the_inner_gemm_gradient() -> None:
    """Two Linears: the inner one's input gradient is a GEMM node of the backward
    program (dA = dH W), its weight gradient a product of two results."""
    bw = _backward_of(_Glu(), [torch.randn(3, 12)])[0]
    gemms = [n for n in bw.prog.nodes if n.kind == "gemm"]
    assert len(gemms) == 4   # the two forward products and the two dA = dH W
    assert sum(1 for o in bw.outs if o[0] == "dh") == 2
    assert ("a", next(g[0] for g in bw.gemms if g[3][0] == "a")) in bw.outs


def test_split_features_and_pools_match_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split reductions', broadcasts' and pools' adjoints, through a fused module's
    backward (its backward program), against float64 autograd (a NaN in one row)."""
    import copy

    from cupyfuse import config, from_model

    monkeypatch.setattr(config, "BACKWARD_PROGRAM", "cpu")
    from gen.tails import assert_grad_matches

    torch.manual_seed(1)
    model = _Heads()
    x = torch.randn(7, 10)
    x[2, 3] = float("nan")
    got = []
    for m, dt in ((model, torch.float32), (copy.deepcopy(model).double(), torch.float64),
                  (copy.deepcopy(model), torch.float32)):
        call = from_model(m) if m is model else m
        xr = x.detach().to(dt).requires_grad_(True)
        outs = call(xr)
        g = torch.Generator().manual_seed(3)
        sum((o * torch.randn(o.shape, generator=g, dtype=dt)).sum() for o in outs).backward()
        got.append([xr.grad] + [p.grad for p in m.parameters()])
    assert _backward_of(model, [x])[0].gemms   # (this model has a backward program)
    for name, a, r, r32 in zip(["x", "weight", "bias"], *got):
        assert_grad_matches(a, r, r32, f"grad of {name}")


def test_which_backward_a_call_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """autograd.backward_kind (bench --train's column): the recompute by default, the
    backward program where BACKWARD_PROGRAM names the device, and why."""
    from cupyfuse import autograd, config
    from helpers import program_of

    prog = program_of(_Glu(), torch.randn(3, 12))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert autograd.backward_kind(prog, cpu) == \
        "recompute (BACKWARD_PROGRAM='none'; backward program: has one)"
    monkeypatch.setattr(config, "BACKWARD_PROGRAM", "cpu")
    assert autograd.backward_kind(prog, cpu) == "backward program"
    assert autograd.backward_kind(prog, cuda) == \
        "recompute (BACKWARD_PROGRAM='cpu'; backward program: has one)"
    monkeypatch.setattr(config, "BACKWARD_PROGRAM", "all")
    assert autograd.backward_kind(prog, cuda) == "backward program"
    monkeypatch.setattr(config, "BACKWARD_MAX_EVALUATIONS", 5)
    assert "evaluations per element" in autograd.backward_kind(prog, cuda)
    assert autograd.backward_kind(prog, cpu) == "backward program"
    cp = program_of(_ChanPool(), torch.randn(4, 6))
    monkeypatch.setattr(config, "BACKWARD_PROGRAM", "cpu")
    assert autograd.backward_kind(cp, cpu) == "recompute (a 'wpool' node)"
    monkeypatch.setattr(config, "BACKWARD_PROGRAM", "none")
    assert autograd.backward_kind(cp, cpu) == \
        "recompute (BACKWARD_PROGRAM='none'; backward program: none: a 'wpool' node)"


class _Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.p = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc(x) * self.p + y, -1)


class _Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc(x.view(-1, 12)), -1)


@pytest.mark.parametrize("make,shapes", [
    (_Seq, [(3, 4, 6), (3, 4, 5)]),   # (batch, seq, features): batch * seq rows
    (_Tokens, [(5, 3, 6)]),           # reductions over the sequence
    (_BnHead, [(9, 6)]),              # batch statistics
    (_Seq, [(7, 6), (1, 5)]),         # a one-row input broadcast over the batch
    (_Flat, [(5, 3, 4)]),             # an input the forward flattens
], ids=["sequence", "tokens", "batchnorm", "one_row", "flattened"])
def test_row_layouts_reach_the_callers_tensors(make: type, shapes: list,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward program's gradients go back through the program's row layout (views,
    the one-row input's broadcast summed) to the caller's own tensors."""
    import copy

    from cupyfuse import autograd, config, from_model
    from cupyfuse.api import program

    monkeypatch.setattr(config, "BACKWARD_PROGRAM", "cpu")
    torch.manual_seed(2)
    model = make()
    ins = [torch.randn(s) for s in shapes]
    fused = from_model(model)
    assert autograd.backward_kind(program(fused, *ins), torch.device("cpu")) == \
        "backward program"
    a = [t.clone().requires_grad_(True) for t in ins]
    out = fused(*a)
    outs = out if isinstance(out, tuple) else (out,)
    g = [torch.randn(o.shape) for o in outs]
    torch.autograd.backward(list(outs), g)
    m64 = copy.deepcopy(model).double()
    b = [t.double().requires_grad_(True) for t in ins]
    ref = m64(*b)
    torch.autograd.backward(list(ref if isinstance(ref, tuple) else (ref,)),
                            [x.double() for x in g])
    for x, y in list(zip(a, b)) + [(p, q) for p, q in zip(model.parameters(), m64.parameters())]:
        assert x.grad.shape == y.grad.shape
        torch.testing.assert_close(x.grad.double(), y.grad, atol=1e-5, rtol=1e-4)
