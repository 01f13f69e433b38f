"""A fused model follows its model's state between calls, as eager does (each of these,
if missed, gives a silently stale answer):

* submodules swapped (an activation, a Sequential entry), a bias added to a
  ``Linear(bias=False)``, a function attribute rebound: the next call retraces;
* expressions of buffers alone (``self.var + eps``, ``self.log_scale.exp()``) read the
  buffers per call (fx proxies buffers), so ``load_state_dict`` reaches them; an in-place
  update of a buffer in the forward (model state) is refused;
* outside tensors a tail computes with (``h * s.exp()``) are keyed by their version;
* forward hooks and pre-hooks (``torch.nn.utils.prune``) are refused, where the fused
  forward would not run them; a ``fused_class`` instance's own hooks run (torch calls them).

Every case runs on the CPU, and on the GPU (marked ``gpu``) with several calls per state so
that the prepared launches' key is what is tested.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.prune as prune

from cupyfuse import fused_class, fused_linear, from_model
from cupyfuse.ir.program import TailError
from helpers import DEVICES



def _check(fm, m, x, what, calls=3):
    """``calls`` calls of the fused model against a float64 copy of the eager one."""
    with torch.no_grad():
        ref = copy.deepcopy(m).cpu().double()(x.cpu().double())
        for c in range(calls):
            out = fm(x).cpu()
            torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4,
                                       msg=lambda s: f"{what}, call {c}: {s}")


class Swap(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 10, bias=False)
        self.act = nn.ReLU()
        self.seq = nn.Sequential(nn.Tanh())
        self.fn = torch.tanh

    def forward(self, x):
        return self.fn(self.seq(self.act(self.fc(x))) * 3.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["from_model", "fused_class"])
def test_submodule_swaps_retrace(device, how):
    torch.manual_seed(0)
    m = Swap().to(device)
    if how == "from_model":
        fm = from_model(m)
        target = m
    else:
        fm = fused_class(Swap)().to(device)
        fm.load_state_dict(m.state_dict())
        target = fm
    x = torch.randn(9, 12, device=device)
    _check(fm, m, x, "initial")
    for name, edit in [
            ("act = SiLU", lambda t: setattr(t, "act", nn.SiLU())),
            ("seq[0] = Identity", lambda t: t.seq.__setitem__(0, nn.Identity())),
            ("fn = sigmoid", lambda t: setattr(t, "fn", torch.sigmoid)),
            ("act = Hardswish", lambda t: setattr(t, "act", nn.Hardswish()))]:
        edit(m)
        if target is not m:
            edit(target)
        _check(fm, m, x, name)
    bias = torch.randn(10, device=device)
    for t in {id(m): m, id(target): target}.values():
        t.fc.bias = nn.Parameter(bias.clone())
    _check(fm, m, x, "fc.bias added")
    for t in {id(m): m, id(target): target}.values():
        t.fc.bias = None
    _check(fm, m, x, "fc.bias removed")


class BufferNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 10)
        self.register_buffer("mean", torch.zeros(10))
        self.register_buffer("var", torch.ones(10))
        self.register_buffer("log_scale", torch.zeros(10))

    def forward(self, x):
        h = (self.fc(x) - self.mean) * torch.rsqrt(self.var + 1e-5)
        return h * self.log_scale.exp()


@pytest.mark.parametrize("device", DEVICES)
def test_buffer_expressions_follow_load_state_dict(device):
    torch.manual_seed(1)
    m = BufferNorm().to(device)
    fm = from_model(m)
    x = torch.randn(9, 12, device=device)
    _check(fm, m, x, "initial")
    sd = m.state_dict()
    sd["var"] = torch.rand(10) * 4 + 0.5
    sd["mean"] = torch.randn(10)
    sd["log_scale"] = torch.randn(10)
    m.load_state_dict(sd)
    _check(fm, m, x, "after load_state_dict")
    with torch.no_grad():
        m.log_scale.add_(0.5)
    _check(fm, m, x, "after an in-place edit")


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 10)
        self.register_buffer("t", torch.ones(10))

    def forward(self, x):
        return self.fc(x) * self.t.add_(1.0)


def test_inplace_buffer_update_refused():
    m = Counter()
    before = m.t.clone()
    with pytest.raises(TailError, match=r"in-place update of the module's tensor `t`"):
        from_model(m)(torch.randn(3, 12))
    assert torch.equal(m.t, before), "converting ran the forward's in-place update"


@pytest.mark.parametrize("device", DEVICES)
def test_tail_outside_tensor_expression_follows_edits(device):
    torch.manual_seed(2)
    x = torch.randn(9, 12, device=device)
    w = torch.randn(10, 12, device=device)
    b = torch.randn(10, device=device)
    s = torch.rand(10, device=device)

    def tail(h):
        return h * s.exp()

    for step in range(3):
        ref = (x.double() @ w.double().t() + b.double()) * s.double().exp()
        for _ in range(2):
            out = fused_linear(x, w, b, tail=tail)
            torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
        s.add_(0.7)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 10)

    def forward(self, x):
        return torch.tanh(self.fc(x))


@pytest.mark.parametrize("device", DEVICES)
def test_hooks_refused(device):
    torch.manual_seed(3)
    m = Plain().to(device)
    fm = from_model(m)
    x = torch.randn(9, 12, device=device)
    _check(fm, m, x, "no hook")   # (the prepared launches exist now on the GPU)
    h = m.fc.register_forward_hook(lambda mod, args, out: out * 2)
    with pytest.raises(TailError, match=r"submodule `fc` \(Linear\) has a forward hook"):
        fm(x)
    h.remove()
    _check(fm, m, x, "hook removed")
    # the model's own hooks are the fused view's: torch's __call__ runs them around the
    # fused forward, as around the eager one
    h = m.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    _check(fm, m, x, "the model's own pre-hook")
    h.remove()
    h = nn.modules.module.register_module_forward_hook(lambda mod, args, out: out)
    try:
        with pytest.raises(TailError, match="global forward hook"):
            fm(x)
    finally:
        h.remove()
    _check(fm, m, x, "hooks removed")
    prune.l1_unstructured(m.fc, "weight", amount=0.5)
    with pytest.raises(TailError, match="prune"):
        fm(x)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_class_own_hooks_run(device):
    """torch's __call__ runs the instance's own hooks around the fused forward."""
    torch.manual_seed(4)
    f = fused_class(Plain)().to(device)
    x = torch.randn(9, 12, device=device)
    with torch.no_grad():
        plain = f(x).clone()
        f.register_forward_hook(lambda mod, args, out: out * 2)
        for _ in range(3):
            torch.testing.assert_close(f(x), plain * 2)
        f.fc.register_forward_pre_hook(lambda mod, args: None)
        with pytest.raises(TailError, match=r"submodule `fc`"):
            f(x)


class Later(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 10)
        self.pool = nn.AvgPool1d(2)
        self.act = nn.LeakyReLU(0.1)

    def forward(self, x):
        h = self.act(self.fc(x))
        if hasattr(self, "z"):
            h = h * self.z
        return self.pool(h.unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("device", DEVICES)
def test_later_state_changes(device):
    """A buffer registered after the first call, a tuple attribute of a torch module
    (AvgPool1d's kernel_size) changed, a forward set on an instance (refused)."""
    torch.manual_seed(6)
    m = Later().to(device)
    fm = from_model(m)
    x = torch.randn(9, 12, device=device)
    _check(fm, m, x, "initial")
    m.register_buffer("z", torch.rand(10, device=device) * 3)
    _check(fm, m, x, "buffer registered")
    m.pool.kernel_size = (3,)
    m.pool.stride = (1,)
    _check(fm, m, x, "pool kernel_size and stride")
    m.act.forward = torch.tanh
    with pytest.raises(TailError, match=r"submodule `act` \(LeakyReLU\) has a `forward` set on "
                                        "the instance"):
        fm(x)


class Rebound(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 6)
        self.register_buffer("s", torch.rand(6) + 0.5)

    def forward(self, x):
        return self.fc(x) * self.s


def test_buffer_rebound_to_another_shape():
    """(6,) rebound as (6, 1): torch broadcasts differently; a new program (refused here:
    it would vary along the batch), never the old one read with the old dims."""
    m = Rebound()
    fm = from_model(m)
    x = torch.randn(6, 12)
    _check(fm, m, x, "initial")
    m.s = torch.arange(1.0, 7.0).reshape(6, 1)
    with pytest.raises(TailError, match="broadcasts the batch dimension"):
        fm(x)
