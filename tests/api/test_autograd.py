"""Gradients through fused calls (cupyfuse/autograd.py), on the CPU.

Property tests draw whole "Linear + tail" models (tests/gen/tails.py: every op of the
vocabulary the generator knows, BatchNorm in training mode, NaN/inf rows) and compare the
gradients of every float input and every parameter, after ``(out * g).sum().backward()``
with a random ``g``, against float64 autograd of a deep copy of the original model
(``gen.tails.assert_grad_matches``: within 1e-4 of the gradient's scale, non-finite
placement, the float32 fallback of ``assert_matches``). Then: tail functions of ``fused_linear``, frozen
parameters, derived weights, several outputs, running statistics updated once, double
backward refused, ``no_grad``/``inference_mode`` untouched, in-place edits before
backward, CuPy-free NumPy callers.
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
import torch.utils.checkpoint
from hypothesis import given, note

from cupyfuse import config
from cupyfuse.api import from_model, fused_class, fused_linear
from gen.tails import (Case, assert_grad_matches, assert_running_stats, cases, flat_outputs,
                       fused_side, grads_of, seeded_case)
from helpers import property_settings


@pytest.fixture(autouse=True)
def _backward_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU calls take the backward program where the program has one (cupyfuse.ir.derivative;
    the rest, and test_seeded_models_gradients' "none", torch's autograd of the recompute)."""
    monkeypatch.setattr(config, "BACKWARD_PROGRAM", "cpu")


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def _seeds(out: list[torch.Tensor], seed: int) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64) if o.is_floating_point()
            else None for o in out]


def check_case(case: Case, device: str = "cpu") -> None:
    """The case's model fused (from_model or fused_class) on ``device``: outputs and
    gradients against float64 autograd of the original on the CPU, running statistics
    after the call."""
    spec = case.spec
    model = spec.make_model(case.model_seed)
    m64 = copy.deepcopy(model).double()
    m32 = copy.deepcopy(model)
    side, fused = fused_side(case, model, device)
    inputs = spec.make_inputs(case.batch, case.dist, case.data_seed, case.n_special)
    with torch.no_grad():
        probe = flat_outputs(copy.deepcopy(m32)(*inputs))
    gs = _seeds(probe, case.data_seed + 1)
    outs: list = []

    def call(*a: torch.Tensor) -> Any:
        outs.extend(flat_outputs(fused(*a)))
        return outs

    got = grads_of(side, call, [t.to(device) for t in inputs],
                   [None if g is None else g.to(device) for g in gs], torch.float32)
    ref64 = grads_of(m64, m64, inputs, gs, torch.float64)
    ref32 = grads_of(m32, m32, inputs, gs, torch.float32)
    assert all(o.grad_fn is not None for o in outs if o.is_floating_point())
    names = [f"input {i}" for i, t in enumerate(inputs) if t.is_floating_point()] + \
        [n for n, p in side.named_parameters() if p.requires_grad]
    assert len(got) == len(ref64) == len(names)
    for name, g, r, r32 in zip(names, got, ref64, ref32):
        assert_grad_matches(g.cpu(), r, r32, f"grad of {name}")
    assert_running_stats(side, m64, "after a grad-mode call")


@given(cases(calls=(1,)))
@property_settings(60)
def test_drawn_models_gradients(case: Case) -> None:
    note(repr(case))
    check_case(case)


@pytest.mark.parametrize("mode", ["cpu", "none"])
@pytest.mark.parametrize("seed", range(12))
def test_seeded_models_gradients(seed: int, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both backwards: the backward program ("cpu": where the program has one) and
    torch's autograd of the recompute ("none": the default)."""
    monkeypatch.setattr(config, "BACKWARD_PROGRAM", mode)
    case = seeded_case(seed)
    case.calls = 1
    check_case(case)


# ---------------------------------------------------------------------------------
# hand-written cases
class Head(nn.Module):
    def __init__(self, k: int = 12, n: int = 10) -> None:
        super().__init__()
        self.lin = nn.Linear(k, n)
        self.norm = nn.LayerNorm(n)
        self.scale = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(F.gelu(self.lin(x))) * self.scale
        return torch.logsumexp(h, dim=-1) + h.max(dim=-1).values


def _ref_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    m = copy.deepcopy(model).double()
    xd = x.detach().double().requires_grad_(True)
    m(xd).sum().backward()
    return [xd.grad] + [p.grad for p in m.parameters()]


def test_module_result_carries_grad_fn_and_matches_float64() -> None:
    torch.manual_seed(0)
    model = Head()
    fm = from_model(model)
    x = torch.randn(7, 12, requires_grad=True)
    out = fm(x)
    assert out.grad_fn is not None and out.requires_grad
    out.sum().backward()
    ref = _ref_grads(model, x)
    for got, r in zip([x.grad] + [p.grad for p in model.parameters()], ref):
        torch.testing.assert_close(got.double(), r, atol=1e-4, rtol=1e-4)


def test_forward_value_is_the_no_grad_value() -> None:
    torch.manual_seed(1)
    model = Head()
    fm = from_model(model)
    x = torch.randn(5, 12)
    with torch.no_grad():
        a = fm(x)
    b = fm(x)
    assert b.grad_fn is not None and torch.equal(a, b.detach())


def test_frozen_parameters_get_no_gradient() -> None:
    torch.manual_seed(2)
    model = Head()
    model.lin.weight.requires_grad_(False)
    fm = from_model(model)
    x = torch.randn(4, 12)
    fm(x).sum().backward()
    assert model.lin.weight.grad is None
    assert model.lin.bias.grad is not None and model.scale.grad is not None
    # nothing requires grad: no graph at all
    for p in model.parameters():
        p.requires_grad_(False)
    out = fm(x)
    assert out.grad_fn is None and not out.requires_grad


def test_only_the_input_requires_grad() -> None:
    torch.manual_seed(3)
    model = Head()
    for p in model.parameters():
        p.requires_grad_(False)
    fm = from_model(model)
    x = torch.randn(6, 12, requires_grad=True)
    fm(x).sum().backward()
    ref = _ref_grads(model, x)[0]
    torch.testing.assert_close(x.grad.double(), ref, atol=1e-4, rtol=1e-4)


def test_no_grad_and_inference_mode_have_no_graph() -> None:
    fm = from_model(Head())
    x = torch.randn(3, 12, requires_grad=True)
    with torch.no_grad():
        assert fm(x).grad_fn is None
    with torch.inference_mode():
        assert fm(x).grad_fn is None


def test_double_backward_is_refused() -> None:
    fm = from_model(Head())
    x = torch.randn(3, 12, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(fm(x).sum(), x, create_graph=True)


def test_in_place_edit_before_backward_raises() -> None:
    model = Head()
    fm = from_model(model)
    out = fm(torch.randn(3, 12))
    with torch.no_grad():
        model.lin.weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_training_loop_matches_eager() -> None:
    """A few SGD steps through the fused module give the parameters eager's steps give."""
    torch.manual_seed(4)
    a = Head()
    b = copy.deepcopy(a)
    fa = from_model(a)
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(8, 12)
        for m, opt in ((fa, oa), (b, ob)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)


class BNHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(9, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(F.relu(self.bn(self.lin(x))), dim=1)


def test_batchnorm_training_updates_once_and_differentiates() -> None:
    torch.manual_seed(5)
    model = BNHead()
    ref = copy.deepcopy(model).double()
    fm = from_model(model)
    x = torch.randn(16, 9, requires_grad=True)
    g = torch.randn(16, 8)
    (fm(x) * g).sum().backward()
    xd = x.detach().double().requires_grad_(True)
    (ref(xd) * g.double()).sum().backward()
    assert int(model.bn.num_batches_tracked) == 1
    torch.testing.assert_close(model.bn.running_mean.double(), ref.bn.running_mean,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), xd.grad, atol=1e-4, rtol=1e-4)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.double(), q.grad, atol=1e-4, rtol=1e-4)


class TwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        return {"probs": torch.softmax(h, -1), "best": h.argmax(-1), "score": h.sum(-1)}


def test_several_outputs_and_an_index_output() -> None:
    torch.manual_seed(6)
    model = TwoOut()
    fm = from_model(model)
    x = torch.randn(4, 6, requires_grad=True)
    out = fm(x)
    assert isinstance(out, dict) and list(out) == ["probs", "best", "score"]
    assert out["best"].dtype == torch.int64 and not out["best"].requires_grad
    (out["probs"][:, 1].sum() + out["score"].sum()).backward()
    xd = x.detach().double().requires_grad_(True)
    r = copy.deepcopy(model).double()(xd)
    (r["probs"][:, 1].sum() + r["score"].sum()).backward()
    torch.testing.assert_close(x.grad.double(), xd.grad, atol=1e-4, rtol=1e-4)


class Scaled(nn.Module):
    """A weight computed from parameters in the forward (a derived source)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(7, 5))
        self.g = nn.Parameter(torch.rand(7, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w * self.g / self.w.norm(dim=1, keepdim=True)
        return torch.tanh(F.linear(x, w)).sum(-1)


def test_derived_weight_leaves_get_gradients() -> None:
    torch.manual_seed(7)
    model = Scaled()
    fm = from_model(model)
    x = torch.randn(5, 5)
    fm(x).sum().backward()
    ref = _ref_grads(model, x)[1:]
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad.double(), r, atol=1e-4, rtol=1e-4)


def test_fused_linear_tail_function_gradients() -> None:
    torch.manual_seed(8)
    x = torch.randn(6, 10, requires_grad=True)
    w = torch.randn(9, 10, requires_grad=True)
    b = torch.randn(9, requires_grad=True)
    gamma = torch.randn(9, requires_grad=True)
    y = torch.randn(6, 9, requires_grad=True)

    def tail(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(F.silu(h) * gamma + y, dim=-1)

    g = torch.randn(6, 9)
    out = fused_linear(x, w, b, tail, y)
    assert out.grad_fn is not None
    (out * g).sum().backward()
    got = [t.grad for t in (x, w, b, gamma, y)]
    leaves = [t.detach().double().requires_grad_(True) for t in (x, w, b, gamma, y)]
    xd, wd, bd, gd, yd = leaves
    r = F.log_softmax(F.silu(F.linear(xd, wd, bd)) * gd + yd, dim=-1)
    (r * g.double()).sum().backward()
    for a, l in zip(got, leaves):
        torch.testing.assert_close(a.double(), l.grad, atol=1e-4, rtol=1e-4)
    # a second call (same tail, same shapes) is differentiated too, not a fast-path hit
    out2 = fused_linear(x, w, b, tail, y)
    assert out2.grad_fn is not None and torch.equal(out2.detach(), out.detach())
    with torch.no_grad():
        assert fused_linear(x, w, b, tail, y).grad_fn is None


def test_numpy_caller_gets_arrays() -> None:
    """A NumPy caller's result is an array (no autograd), even with parameters requiring
    grad in grad mode."""
    model = Head()
    fm = from_model(model)
    out = fm(np.random.rand(3, 12).astype(np.float32))
    assert isinstance(out, np.ndarray) and out.shape == (3,)


def test_inside_torch_utils_checkpoint() -> None:
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(8, 6), nn.GELU(), nn.LayerNorm(6))
    ref = copy.deepcopy(model)
    fm = from_model(model)
    x = torch.randn(5, 8)
    torch.utils.checkpoint.checkpoint(fm, x, use_reentrant=False).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_fifty_steps_follow_the_original_loss_curve(opt: str) -> None:
    """50 steps from the same init on the same batches: the fused model's loss curve is
    the original's (BatchNorm in training mode included)."""
    torch.manual_seed(10)
    # (no bias before the BatchNorm: its gradient is rounding noise, which Adam would
    # turn into full steps that move the running mean and nothing else)
    a = nn.Sequential(nn.Linear(12, 16, bias=False), nn.BatchNorm1d(16), nn.GELU(),
                      nn.LayerNorm(16))
    b = copy.deepcopy(a)
    fa = from_model(a)
    make = (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)) if opt == "sgd" else \
        (lambda p: torch.optim.Adam(p, lr=1e-2))
    oa, ob = make(a.parameters()), make(b.parameters())
    g = torch.Generator().manual_seed(11)
    target = torch.randn(16, generator=g)
    curves: tuple[list, list] = ([], [])
    for step in range(50):
        x = torch.randn(32, 12, generator=g)
        for m, o, c in ((fa, oa, curves[0]), (b, ob, curves[1])):
            o.zero_grad()
            loss = (m(x) - target).pow(2).mean()
            loss.backward()
            o.step()
            c.append(float(loss))
    torch.testing.assert_close(torch.tensor(curves[0]), torch.tensor(curves[1]),
                               atol=1e-4, rtol=1e-4)
    assert curves[1][-1] < curves[1][0]
    torch.testing.assert_close(a[1].running_mean, b[1].running_mean, atol=1e-5, rtol=1e-5)


def test_accumulation_retain_graph_and_an_output_used_twice() -> None:
    torch.manual_seed(12)
    model = Head()
    ref = copy.deepcopy(model)
    fm = from_model(model)
    x1, x2 = torch.randn(4, 12), torch.randn(6, 12)
    for m in (fm, ref):
        out = m(x1)
        (out * out.detach() + out.exp()).sum().backward(retain_graph=True)   # used twice
        out.sum().backward()                                              # retained graph
        m(x2).mean().backward()                                           # accumulated
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4)


def test_float64_gradcheck_of_the_recompute() -> None:
    """torch.autograd.gradcheck of a fused function in float64: the CPU path runs the same
    program in the operands' dtype where it can, so the check runs through the Function."""
    from cupyfuse.autograd import apply

    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return apply(lambda: torch.logsumexp(torch.tanh(x @ w.t()), -1),
                     lambda req: torch.logsumexp(torch.tanh(req[0] @ req[1].t()), -1), [x, w])

    assert torch.autograd.gradcheck(f, (x, w))


@pytest.mark.parametrize("transposed", (False, True))
def test_float64_gradcheck_of_the_recompute_gemm(transposed: bool) -> None:
    """The recompute's GEMM node (autograd.gemm_for: a @ W.T, or a @ W for a weight stored
    (K, N)) and its hand-written backward, checked by gradcheck in float64."""
    from cupyfuse.autograd import gemm_for

    torch.manual_seed(int(transposed))
    a = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(*((5, 3) if transposed else (3, 5)), dtype=torch.float64,
                    requires_grad=True)
    gemm = gemm_for({}, None)
    assert torch.autograd.gradcheck(lambda a, w: torch.sin(gemm(a, w, transposed)), (a, w))
    only_a = gemm(a, w.detach(), transposed)      # a frozen weight: no gradient asked of it
    only_a.sum().backward()
    assert a.grad is not None
