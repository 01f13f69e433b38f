"""No silent staleness: a weight edited by any means is seen by the next call.

The derived weights (the rewrites' coefficients and folded weights, weights a forward
computes from its parameters) are cached on the parameters. Each edit below changes a
parameter after a first call; the second call must equal the float64 eager model as it
now is. The CPU path caches the same derived weights as the GPU path (the rewrites'
coefficients), so these run anywhere. ``test_the_checks_can_fail`` shows that, without
the ``.data`` tracking, a ``.data`` write is indeed missed (the cache is real).
"""
from __future__ import annotations

import copy
import io
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cupyfuse
from cupyfuse import caches, tracking

ATOL = RTOL = 1e-4


class GemvSum(nn.Module):
    """A feature sum of a Linear: the rewrite's GEMV with colsum(W) (cached)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).sum(1, keepdim=True) * 0.5


class AvgPoolFold(nn.Module):
    """Average pooling after the Linear: the folded weight (cached)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 16)
        self.pool = nn.AvgPool1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(self.fc(x).unsqueeze(1)).squeeze(1)
        return F.gelu(h) * 2.0


class PairDiffs(nn.Module):
    """MaxPool(2) then a sum: the pair-difference rewrite (cached weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 16)
        self.pool = nn.MaxPool1d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.fc(x).unsqueeze(1)).squeeze(1).sum(1)


class DerivedWeight(nn.Module):
    """A weight computed from two parameters in the forward (cached derived source)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(10, 12) / 4)
        self.s = nn.Parameter(torch.rand(10, 1) + 0.5)
        self.b = nn.Parameter(torch.randn(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(F.linear(x, self.w * self.s, self.b), 1)


MODELS = {"gemv": GemvSum, "fold": AvgPoolFold, "pairdiff": PairDiffs, "derived": DerivedWeight}


def _first(m: nn.Module) -> nn.Parameter:
    return next(p for p in m.parameters() if p.dim() == 2)


def _scale(m: nn.Module) -> nn.Parameter:
    """The parameter the edits change: the derived weight's scale, else the weight."""
    return m.s if isinstance(m, DerivedWeight) else _first(m)


EDITS: dict[str, Callable[[nn.Module], Any]] = {
    "no_grad in-place": lambda m: _no_grad(lambda: _scale(m).mul_(1.7)),
    ".data.mul_": lambda m: _scale(m).data.mul_(-1.3),
    ".data = new": lambda m: setattr(_scale(m), "data", _scale(m).detach() * 0.25 + 0.1),
    ".data.copy_": lambda m: _scale(m).data.copy_(torch.randn_like(_scale(m))),
    "init helper on .data": lambda m: nn.init.normal_(_scale(m).data),
    "element through .data": lambda m: _scale(m).data.__setitem__((0, 0), 3.0),
    "optimizer step": lambda m: _step(m),
    "load_state_dict": lambda m: m.load_state_dict(
        {k: v * 1.5 for k, v in m.state_dict().items()}),
    "parameter replaced": lambda m: _replace(m),
}


def _no_grad(fn: Callable[[], Any]) -> None:
    with torch.no_grad():
        fn()


def _step(m: nn.Module) -> None:
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    opt.step()


def _replace(m: nn.Module) -> None:
    if isinstance(m, DerivedWeight):
        m.s = nn.Parameter(torch.rand(10, 1) + 2.0)
    else:
        m.fc.weight = nn.Parameter(torch.randn_like(m.fc.weight))


def _check(fused: nn.Module, model: nn.Module, x: torch.Tensor, what: str) -> None:
    with torch.no_grad():
        out = fused(x)
        ref = copy.deepcopy(model).double()(x.double())
    torch.testing.assert_close(out.double(), ref, atol=ATOL, rtol=RTOL,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("how", ["from_model", "fused_class"])
def test_edit_is_seen_by_the_next_call(kind: str, edit: str, how: str) -> None:
    torch.manual_seed(3)
    cls = MODELS[kind]
    if how == "from_model":
        model = cls()
        fused = cupyfuse.from_model(model)
        target = model          # the fused module shares the model's parameters
    else:
        fused = cupyfuse.fused_class(cls)()
        model = target = fused  # (the reference is the instance itself, as eager)
    x = torch.randn(5, 12)

    def reference() -> nn.Module:
        return model if how == "from_model" else _eager(fused, cls)

    _check(fused, reference(), x, f"{kind}, first call")
    assert caches.cache_size() > 0, "no derived weight is cached: the test would prove nothing"
    EDITS[edit](target)
    _check(fused, reference(), x, f"{kind} after {edit} ({how})")


def _eager(fused: nn.Module, cls: type) -> nn.Module:
    """An eager model of ``cls`` with ``fused``'s current state."""
    m = cls()
    m.load_state_dict(fused.state_dict())
    return m


def test_fused_linear_sees_data_writes_of_a_parameter() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(20, 12) / 3)
    b = nn.Parameter(torch.randn(20))
    x = torch.randn(4, 12)

    def tail(h: torch.Tensor) -> torch.Tensor:
        return h.sum(1, keepdim=True)

    with torch.no_grad():
        first = cupyfuse.fused_linear(x, w, b, tail)
        torch.testing.assert_close(first, tail(x @ w.t() + b), atol=ATOL, rtol=RTOL)
        w.data.mul_(-2.0)
        again = cupyfuse.fused_linear(x, w, b, tail)
        torch.testing.assert_close(again.double(), tail(x.double() @ w.double().t() + b.double()),
                                   atol=ATOL, rtol=RTOL)


def test_the_checks_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without tracking, a ``.data`` write leaves the cached GEMV coefficients stale: the
    tests above would fail (the cache they check is real)."""
    monkeypatch.setattr(tracking, "track", lambda module: None)
    torch.manual_seed(3)
    model = GemvSum()
    fused = cupyfuse.from_model(model)
    x = torch.randn(5, 12)
    _check(fused, model, x, "first call")
    model.fc.weight.data.mul_(-1.3)
    with pytest.raises(AssertionError):
        _check(fused, model, x, "stale")
    cupyfuse.clear_cache()
    _check(fused, model, x, "after clear_cache")


def test_tracked_tensors_behave_as_before(tmp_path: Any) -> None:
    """Tracking changes nothing users see: isinstance, state_dict (plain tensors),
    torch.save / load, deepcopy, optimizers, autograd of the eager original, .to()."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU())
    fused = cupyfuse.from_model(model)
    x = torch.randn(4, 6)
    with torch.no_grad():
        fused(x)
    w = model[0].weight
    assert type(w) is tracking.TrackedParameter and isinstance(w, nn.Parameter)
    assert type(model[1].running_mean) is tracking.TrackedBuffer
    sd = fused.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())
    assert list(sd) == list(model.state_dict())
    buf = io.BytesIO()
    torch.save(fused.state_dict(), buf)
    buf.seek(0)
    model.load_state_dict(torch.load(buf))
    c = copy.deepcopy(model)
    assert isinstance(c[0].weight, nn.Parameter)
    loss = model(x).sum()
    loss.backward()
    assert w.grad is not None and w.grad.shape == w.shape
    torch.optim.Adam(model.parameters()).step()
    assert type(w + 1) is torch.Tensor
    model.double()
    assert w.dtype == torch.float64 and tracking.writes(w) > 0   # .to() went through .data
