"""Gradients through fused calls on the GPU: the general path's first call, the prepared
launches of the next ones (their forward under autograd: runner.fast_call) and every
calling mode after them give float64 autograd's gradients; no_grad keeps its specialised
call. Drawn models (tests/gen/tails.py) at small and engine batches."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cupyfuse
from gen.tails import seeded_case
from helpers import runner_of

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from test_autograd import Head, BNHead, check_case   # noqa: E402


def _grads_of(model: nn.Module, fm: nn.Module, x: torch.Tensor, g: torch.Tensor) -> list:
    model.zero_grad()
    xr = x.detach().clone().requires_grad_(True)
    out = fm(xr)
    assert out.grad_fn is not None
    (out * g).sum().backward()
    return [xr.grad] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("batch", (4, 64, 700))
@pytest.mark.parametrize("cls", (Head, BNHead))
def test_repeated_grad_calls_match_float64(cls: type, batch: int) -> None:
    torch.manual_seed(batch)
    model = cls().cuda()
    k = model.lin.in_features
    ref = copy.deepcopy(model).double()
    fm = cupyfuse.from_model(model)
    x = torch.randn(batch, k, device="cuda")
    g = torch.randn(fm(x.clone()).shape, device="cuda")   # (a first call: BN counts it)
    xd = x.double().requires_grad_(True)
    ref.zero_grad()
    (ref(xd) * g.double()).sum().backward()
    want = [xd.grad] + [p.grad for p in ref.parameters()]
    for call in range(4):   # general path, prepared, then the fast path each time
        got = _grads_of(model, fm, x, g)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4)
    if cls is BNHead:
        assert int(model.bn.num_batches_tracked) == 1 + 4


def test_no_grad_keeps_the_specialised_call() -> None:
    model = Head().cuda()
    fm = cupyfuse.from_model(model)
    x = torch.randn(8, 12, device="cuda")
    with torch.no_grad():
        for _ in range(4):
            want = fm(x)
        assert runner_of(fm)._spec is not None
    out = fm(x)   # grad mode: differentiated, the same values
    assert out.grad_fn is not None and torch.equal(out.detach(), want)
    with torch.no_grad():
        assert torch.equal(fm(x), want) and fm(x).grad_fn is None


def test_fused_linear_grad_calls_on_gpu() -> None:
    torch.manual_seed(3)
    x = torch.randn(16, 32, device="cuda", requires_grad=True)
    w = torch.randn(24, 32, device="cuda", requires_grad=True)
    b = torch.randn(24, device="cuda", requires_grad=True)

    def tail(h: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(F.gelu(h), dim=-1)

    leaves = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    tail(F.linear(*leaves)).sum().backward()
    for _ in range(3):
        for t in (x, w, b):
            t.grad = None
        cupyfuse.fused_linear(x, w, b, tail).sum().backward()
        for t, r in zip((x, w, b), leaves):
            torch.testing.assert_close(t.grad.double(), r.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(16))
def test_seeded_models_gradients_on_gpu(seed: int) -> None:
    case = seeded_case(seed)
    case.calls, case.n_special = 1, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        check_case(case, "cuda")


@pytest.mark.parametrize("shape", [(300, 200, 132), (1024, 512, 256), (257, 130, 68),
                                   (512, 96, 30)])
def test_backward_products_match_float64_and_repeat_bitwise(shape: tuple) -> None:
    """The backward's products (gemm.matmul_nt: operands made by the call, split in the
    call on the engine where M >= config.SPLIT_EACH_CALL_MIN_M): float64's values within
    1e-4 of their scale, the same bits each time (no split-K atomics). K = 30 is no
    multiple of 4: cuBLAS."""
    from cupyfuse.backend.gemm import matmul_nt

    M, N, K = shape
    torch.manual_seed(M)
    a = torch.randn(M, K, device="cuda")
    b = torch.randn(K, N, device="cuda").t()      # a transposed view, as the backward has
    want = a.double() @ b.double().t()
    got = matmul_nt(a, b)
    scale = float(want.abs().max())
    torch.testing.assert_close(got.double(), want, atol=1e-4 * scale, rtol=1e-4)
    assert torch.equal(matmul_nt(a, b), got)


@pytest.mark.parametrize("transposed", (False, True))
def test_engine_batch_training_gradients_match_float64(transposed: bool) -> None:
    """A head at engine sizes (every product of the step on the 3xTF32 engine): the
    gradients of x, the weight (stored (N, K), or (K, N) and used as x @ W) and the bias."""
    class H(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            shape = (256, 384) if transposed else (384, 256)
            self.w = nn.Parameter(torch.randn(*shape) / 16)
            self.b = nn.Parameter(torch.randn(384))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = (x @ self.w if transposed else F.linear(x, self.w)) + self.b
            return torch.logsumexp(F.gelu(h), dim=-1, keepdim=True) * torch.sigmoid(h)

    torch.manual_seed(5)
    model = H().cuda()
    ref = copy.deepcopy(model).double()
    fm = cupyfuse.from_model(model)
    x = torch.randn(640, 256, device="cuda")
    g = torch.randn(640, 384, device="cuda")
    xd = x.double().requires_grad_(True)
    (ref(xd) * g.double()).sum().backward()
    want = [xd.grad] + [p.grad for p in ref.parameters()]
    for _ in range(3):
        got = _grads_of(model, fm, x, g)
        for a, b in zip(got, want):
            scale = float(b.abs().max())
            torch.testing.assert_close(a.double(), b, atol=1e-4 * scale, rtol=1e-4)
