"""Backward programs on the GPU (``config.BACKWARD_PROGRAM = "all"``): the backward
program as generated kernels on the general path, weight gradients as engine products.

Against float64 autograd of the original model (tests/api/test_autograd.py's
check_case): seeded drawn models at small and engine batches, the hand-written heads,
repeated calls (general path, then prepared forward launches), and the KernelBench
models the derivative covers. Then: a program past ``BACKWARD_MAX_EVALUATIONS`` takes the
recompute, and both backwards give the same gradients within float32 rounding."""
from __future__ import annotations

import copy

import pytest
import torch

import cupyfuse
from cupyfuse import config
from gen.tails import seeded_case

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from test_autograd import Head, check_case   # noqa: E402


@pytest.fixture(autouse=True)
def _all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "BACKWARD_PROGRAM", "all")


@pytest.mark.parametrize("batch", (3, 64, 600))
@pytest.mark.parametrize("seed", range(16))
def test_seeded_models_gradients_on_cuda(seed: int, batch: int) -> None:
    case = seeded_case(seed)
    case.batch = batch
    case.calls = 1
    check_case(case, "cuda")


@pytest.mark.parametrize("batch", (4, 700))
def test_repeated_calls_take_the_backward_program(batch: int, monkeypatch: pytest.MonkeyPatch
                                                  ) -> None:
    from cupyfuse import autograd

    used = []
    orig = autograd.program_backward

    def spy(*a, **k):
        r = orig(*a, **k)
        used.append(r is not None)
        return r
    monkeypatch.setattr(autograd, "program_backward", spy)
    torch.manual_seed(batch)
    model = Head().cuda()
    ref = copy.deepcopy(model).double()
    fm = cupyfuse.from_model(model)
    x = torch.randn(batch, model.lin.in_features, device="cuda")
    g = torch.randn(batch, device="cuda")
    xd = x.double().requires_grad_(True)
    (ref(xd) * g.double()).sum().backward()
    want = [xd.grad] + [p.grad for p in ref.parameters()]
    for _ in range(3):
        model.zero_grad()
        xr = x.clone().requires_grad_(True)
        (fm(xr) * g).sum().backward()
        got = [xr.grad] + [p.grad for p in model.parameters()]
        for a, b in zip(got, want):
            scale = float(b.abs().max())
            torch.testing.assert_close(a.double(), b, atol=1e-4 * max(scale, 1.0), rtol=1e-4)
    assert used and all(used)


def test_both_backwards_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = Head(256, 512).cuda()
    fm = cupyfuse.from_model(model)
    x = torch.randn(96, 256, device="cuda")
    res = []
    for mode in ("all", "none"):
        monkeypatch.setattr(config, "BACKWARD_PROGRAM", mode)
        model.zero_grad()
        xr = x.clone().requires_grad_(True)
        fm(xr).sum().backward()
        res.append([xr.grad.clone()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, atol=1e-5 * max(float(b.abs().max()), 1.0), rtol=1e-4)


@pytest.mark.parametrize("name", ["glu_chain", "heads_pools", "tokens", "bn_head"])
def test_hand_written_backward_programs_on_cuda(name: str) -> None:
    """tests/ir/test_derivative.py's models (a chain, split features and pools, sequence
    reductions, batch statistics) on CUDA against float64 autograd on the CPU."""
    from test_derivative import CASES
    from gen.tails import assert_grad_matches

    _, model, inputs = next(c for c in CASES if c[0] == name)
    m64 = copy.deepcopy(model).double()
    m32 = copy.deepcopy(model)
    fused = cupyfuse.from_model(copy.deepcopy(model).cuda())
    res = []
    for m, dev, dt in ((fused, "cuda", torch.float32), (m64, "cpu", torch.float64),
                       (m32, "cpu", torch.float32)):
        xs = [t.detach().to(dev, dt).requires_grad_(True) for t in inputs]
        outs = m(*xs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        g = torch.Generator().manual_seed(7)
        gs = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(dev, dt) for o in outs]
        torch.autograd.backward(list(outs), gs)
        params = fused.parameters() if m is fused else m.parameters()
        res.append([x.grad.cpu() for x in xs] + [p.grad.cpu() for p in params])
    for k, (a, r, r32) in enumerate(zip(*res)):
        assert_grad_matches(a, r, r32, f"{name}: gradient {k}")
