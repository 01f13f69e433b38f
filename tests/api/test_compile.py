"""Fused modules inside torch.compile (cupyfuse.compiled): one custom op per call in the
graph (fullgraph=True: no graph break), the fused call's value, and gradients of every
input and parameter against float64 autograd of the original; the "aot_eager" backend
(dynamo + AOTAutograd with fake tensors, no C++ compiler needed)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cupyfuse


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.scale = 0.5

    def forward(self, x: torch.Tensor, t: float = 1.0) -> tuple:
        h = self.fc(x)
        return torch.logsumexp(F.gelu(h) * self.scale / t, 1), h.argmax(1)


class Outer(nn.Module):
    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, i = self.head(torch.tanh(self.pre(x)), 2.0)
        return (a * a).sum() + i.float().mean()


def _graphs() -> tuple[dict, object]:
    """A backend recording AOTAutograd's forward and backward graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen: dict = {"fw": [], "bw": []}

    def record(kind: str) -> object:
        def compiler(gm: torch.fx.GraphModule, _: object) -> object:
            seen[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    return seen, aot_autograd(fw_compiler=record("fw"), bw_compiler=record("bw"))


def _ops(gms: list) -> list:
    return [n.target for gm in gms for n in gm.graph.nodes if n.op == "call_function"]


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ("cpu", _CUDA))
@pytest.mark.parametrize("make", ("from_model", "fused_class"))
def test_compiled_model_trains_through_one_custom_op(make: str, device: str) -> None:
    torch.manual_seed(0)
    plain = Outer(Head()).to(device)
    ref = copy.deepcopy(plain).double()
    model = copy.deepcopy(plain)
    if make == "from_model":
        model.head = cupyfuse.from_model(model.head)
    else:
        fused = cupyfuse.fused_class(Head)().to(device)
        fused.load_state_dict(model.head.state_dict())
        model.head = fused
    gms, backend = _graphs()
    c = torch.compile(model, backend=backend, fullgraph=True)
    for step in range(3):
        x = torch.randn(5, 8, device=device)
        xs = x.clone().requires_grad_(True)
        xd = x.double().requires_grad_(True)
        model.zero_grad()
        ref.zero_grad()
        c(xs).backward()
        ref(xd).backward()
        torch.testing.assert_close(xs.grad.double(), xd.grad, atol=1e-4, rtol=1e-4)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.double(), q.grad, atol=1e-4, rtol=1e-4)
    # one forward graph: the head is the custom op (the only product traced is pre's)
    assert len(gms["fw"]) == 1
    ops = _ops(gms["fw"])
    assert ops.count(torch.ops.cupyfuse.module_call.default) == 1
    assert ops.count(torch.ops.aten.addmm.default) == 1


def test_compiled_forward_is_the_fused_call() -> None:
    torch.manual_seed(1)
    fm = cupyfuse.from_model(Head())
    x = torch.randn(7, 8)
    with torch.no_grad():
        want = fm(x, 2.0)
    c = torch.compile(fm, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        got = c(x, 2.0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[1].dtype == torch.int64


def test_compiled_training_loop_follows_eager() -> None:
    torch.manual_seed(2)
    plain = Outer(Head())
    model = copy.deepcopy(plain)
    model.head = cupyfuse.from_model(model.head)
    c = torch.compile(model, backend="aot_eager", fullgraph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, model)]
    data = [torch.randn(6, 8) for _ in range(10)]
    for x in data:
        for m, o in zip((plain, c), opts):
            o.zero_grad()
            m(x).backward()
            o.step()
    for p, q in zip(plain.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-4)


def test_batchnorm_training_runs_the_original_under_compile() -> None:
    class BN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 6)
            self.bn = nn.BatchNorm1d(6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sigmoid(self.bn(self.fc(x)))

    torch.manual_seed(3)
    plain = BN()
    fm = cupyfuse.from_model(copy.deepcopy(plain))
    c = torch.compile(fm, backend="aot_eager", fullgraph=True)
    x = torch.randn(9, 8)
    with pytest.warns(UserWarning, match="BatchNorm running statistics"):
        got = c(x)
    torch.testing.assert_close(got, plain(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fm.bn.running_mean, plain.bn.running_mean)


def test_keyword_inputs_under_compile_are_refused_clearly() -> None:
    fm = cupyfuse.from_model(Head())
    c = torch.compile(fm, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception, match="inputs positionally"):
            c(torch.randn(3, 8), t=2.0)


def test_autocast_under_compile_traces_the_original() -> None:
    torch.manual_seed(4)
    plain = Head()
    fm = cupyfuse.from_model(copy.deepcopy(plain))
    c = torch.compile(fm, backend="aot_eager", fullgraph=True)
    x = torch.randn(5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = c(x, 2.0), plain(x, 2.0)
    assert got[0].dtype == want[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0])
