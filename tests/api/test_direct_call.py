"""A fused module's own ``__call__`` (runner._direct_call): where torch's Module.__call__
would call forward straight away, a repeated call runs its prepared launch without torch's
call frames; anything torch's call does besides (forward hooks and pre-hooks of the module
or global ones, backward hooks, ``compile()``, a ``forward`` set on the instance) goes
through torch's ``__call__`` as usual. A class with a ``__call__`` of its own keeps it."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse import runner
import cupyfuse
from helpers import DEVICES, GPU


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(F.gelu(self.fc(x)), -1)


class OwnCall(Head):
    calls = 0

    def __call__(self, *args, **kwargs):
        OwnCall.calls += 1
        return super().__call__(*args, **kwargs)


def _quiet(m, *args):
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return m(*args)


def test_shortcut_only_where_torchs_call_is_the_class_call():
    assert "__call__" in vars(cupyfuse.fused_class(Head))
    new = cupyfuse.fused_class(OwnCall)
    assert "__call__" not in vars(new)
    torch.manual_seed(0)
    m = new()
    before = OwnCall.calls
    _quiet(m, torch.randn(3, 16))
    assert OwnCall.calls == before + 1   # the class's own __call__ ran


def test_direct_call_reads_every_hook_kind():
    torch.manual_seed(0)
    m = cupyfuse.fused_class(Head)()
    assert runner._direct_call(m)
    glob = nn.modules.module
    for register in (lambda: m.register_forward_hook(lambda mod, a, out: None),
                     lambda: m.register_forward_pre_hook(lambda mod, a: None),
                     lambda: m.register_full_backward_hook(lambda mod, gi, go: None),
                     lambda: m.register_full_backward_pre_hook(lambda mod, go: None),
                     lambda: glob.register_module_forward_hook(lambda mod, a, out: None),
                     lambda: glob.register_module_forward_pre_hook(lambda mod, a: None),
                     lambda: glob.register_module_full_backward_hook(lambda mod, gi, go: None),
                     lambda: glob.register_module_full_backward_pre_hook(lambda mod, go: None)):
        reg = register()
        assert not runner._direct_call(m)
        reg.remove()
        assert runner._direct_call(m)
    m.forward = lambda x: x
    assert not runner._direct_call(m)
    del m.forward
    assert runner._direct_call(m)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["fused_class", "from_model"])
def test_hooks_and_instance_forward_after_repeated_calls(device, how):
    """Repeated calls (prepared launches on the GPU), then a root forward hook, a global
    forward pre-hook and a forward set on the instance: each runs as torch runs it; once
    removed, the calls give the same bits as before."""
    torch.manual_seed(0)
    if how == "fused_class":
        m = cupyfuse.fused_class(Head)().to(device)
    else:
        m = cupyfuse.from_model(Head().to(device))
    x = torch.randn(5, 16, device=device)
    first = [_quiet(m, x) for _ in range(3)]
    assert all(torch.equal(o, first[0]) for o in first)
    h = m.register_forward_hook(lambda mod, a, out: out * 2.0)
    assert torch.equal(_quiet(m, x), first[0] * 2.0)
    h.remove()
    # a global forward pre-hook: refused (it would not run for each submodule)
    g = nn.modules.module.register_module_forward_pre_hook(lambda mod, a: None)
    try:
        with pytest.raises(cupyfuse.TailError, match="global forward hook"):
            _quiet(m, x)
    finally:
        g.remove()
    m.forward = lambda inp: inp + 1.0   # torch calls an instance's forward attribute
    assert torch.equal(_quiet(m, x), x + 1.0)
    del m.forward
    assert torch.equal(_quiet(m, x), first[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [GPU])
@pytest.mark.parametrize("how", ["fused_class", "from_model"])
def test_repeated_gpu_calls_skip_torchs_call(how, dev, monkeypatch):
    """After the first call prepared its launch, a plain call never enters torch's
    Module.__call__ (counted); a call with a hook does, and runs the hook."""
    torch.manual_seed(0)
    if how == "fused_class":
        m = cupyfuse.fused_class(Head)().to(dev)
    else:
        m = cupyfuse.from_model(Head().to(dev))
    x = torch.randn(7, 16, device=dev)
    ref = _quiet(m, x)
    entered = []
    orig = nn.Module.__call__

    def counting(self, *a, **k):
        entered.append(type(self).__name__)
        return orig(self, *a, **k)

    monkeypatch.setattr(nn.Module, "__call__", counting)
    for _ in range(3):
        assert torch.equal(_quiet(m, x), ref)
    assert entered == []
    h = m.register_forward_hook(lambda mod, a, out: out + 1.0)
    assert torch.equal(_quiet(m, x), ref + 1.0)
    h.remove()
    assert entered == [type(m).__name__]
    # in grad mode with parameters requiring grad (KernelBench's conditions) too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = m(x)
    assert torch.equal(out, ref) and entered == [type(m).__name__]


def test_fx_tracing_through_a_fused_module_says_what_to_do():
    """torch.fx tracing a model around a fused module: through it, a TailError naming the
    way out (not a TypeError from deep in the operand checks); as a leaf module, the
    traced model calls it as usual."""
    torch.manual_seed(0)
    inner = cupyfuse.fused_class(Head)()

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, t):
            return self.inner(t) * 2.0

    class Through(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return False

    with pytest.raises(cupyfuse.TailError, match="is_leaf_module"):
        Through().trace(Outer())

    class Leaf(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return m is inner or super().is_leaf_module(m, qualname)

    outer = Outer()
    gm = torch.fx.GraphModule(outer, Leaf().trace(outer))
    x = torch.randn(3, 16)
    assert torch.equal(_quiet(gm, x), _quiet(outer, x))
