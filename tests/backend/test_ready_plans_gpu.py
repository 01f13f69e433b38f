"""Ready plans (prepared.Prepared._make_ready) of programs whose steps read derived
weights: an average-pooling fold (the skinny kernel's and the engine's W', fold_rows), a
certified fold (98's form: the one-pass GEMM and the certification kernel), pair
differences (55's max-pool-then-sum form) and a GEMV (a Linear's row sum). Such a plan is
valid while every tensor source is the same tensor at the same version and address;
each case checks, against a float64 reference at 1e-4 and bit for bit against the full
prepared path: repeated calls, another address of x, an x 4 bytes off a 16-byte boundary
(the float4 flags per call), a weight and a bias changed in place, a new Parameter."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import cupyfuse
from test_ready_plans import MODELS, SKINNY_KINDS, K, N, _close, kinds
from helpers import runner_of

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the prepared launches need an sm90 GPU", allow_module_level=True)

DEV = torch.device("cuda")

# the derived-weight steps each case must exercise (the plan's shape at these sizes)
EXPECT = {**{(c, 8): k for c, k in SKINNY_KINDS.items()},
          ("PoolMax", 256): {"cert-gemm", "cert-rows"},
          ("PoolSigmoid", 256): {"engine-gemm", "rows"},
          ("MaxPoolSum", 256): {"engine-gemm", "rows"},
          ("LinearSum", 256): {"gemv"}}


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("batch", [8, 256])
@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_ready_plan_follows_the_sources_of_derived_weights(cls, batch, grad):
    torch.manual_seed(batch + 7)
    model = cls().to(DEV)
    with torch.no_grad():
        model.fc.weight.mul_(3.0)   # a spread of row values (the certification's candidates)
    f = cupyfuse.from_model(model)
    x = torch.rand(batch, K, device=DEV)
    with torch.set_grad_enabled(grad), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = f(x)
        f(x)
        f(x)
        (pr, _), = [v for v in runner_of(f).fast.values() if v is not None]
        assert kinds(pr) == EXPECT[(cls.__name__, batch)], kinds(pr)
        assert pr._ready, "no ready plan after three calls"
        if grad:   # (differentiated calls: the ready plan under autograd, no specialised call)
            assert first.grad_fn is not None and runner_of(f)._spec is None
        else:
            assert runner_of(f)._spec is not None, "no specialised call after three calls"
        (ready,) = pr._ready.values()
        assert {e[0] for e in ready[2]} >= {0, 1}, "the plan does not check weight and bias"
        assert torch.equal(f(x), first)
        _close(first, model, x, "first call")
        # the full path (no ready plan): the same bits
        pr._ready.clear()
        pr.simple = False
        full = f(x)
        pr.simple = True
        assert torch.equal(full, first), "the ready plan's bits differ from the full path's"
        f(x)
        assert pr._ready
        assert torch.equal(f(x.clone()), first), "x at another address"
        # x 4 bytes past a 16-byte boundary, same shape and strides (the float4 paths
        # must see it per call; the engine's steps decline it)
        buf = torch.empty(batch * K + 1, device=DEV)
        xm = buf[1:].view(batch, K)
        xm.copy_(x)
        assert xm.data_ptr() % 16
        _close(f(xm), model, x, "misaligned x")
        assert torch.equal(f(x), first)
        # a weight changed in place: the plan's version check, then derived weights rebuilt
        with torch.no_grad():
            model.fc.weight.mul_(0.5)
        _close(f(x), model, x, "weight changed in place")
        (ready,) = pr._ready.values()
        assert any(e[0] == 0 and e[2] == model.fc.weight._version for e in ready[2])
        _close(f(x), model, x, "weight changed in place, second call")
        _close(f(x), model, x, "weight changed in place, third call")
        with torch.no_grad():
            model.fc.bias.add_(0.25)
        _close(f(x), model, x, "bias changed in place")
        _close(f(x), model, x, "bias changed in place, second call")
        model.fc.weight = nn.Parameter(torch.randn(N, K, device=DEV) * 0.1)
        _close(f(x), model, x, "a new weight Parameter")
        _close(f(x), model, x, "a new weight Parameter, second call")
        _close(f(x), model, x, "a new weight Parameter, third call")
