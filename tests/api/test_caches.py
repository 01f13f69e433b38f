"""Derived weights are a cache of the parameters: they must never go stale.

After a conversion and a first call, the parameters of the fused module are changed
in every way a user changes them (in place under no_grad, by assigning new
Parameters, by load_state_dict, by an optimizer step, by changing scale_factor); the
next result must be the float64 reference of the equally modified original model.
The cache must also forget a module once it is gone.
"""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn

import cupyfuse
import cupyfuse.kernelbench.modules as cfnn
from cupyfuse import caches
from conftest import assert_close_to_ref, make_input, make_original, reference, run_fused
from helpers import fused_copy

pytestmark = pytest.mark.usefixtures("nan_filled_outputs")

CASES = {
    # name: (key, batch, init, linear attribute, mode)
    "55-pairdiff": ("55", 7, (40, 27, 2, 0.5), "matmul", "train"),
    "55-k3": ("55", 7, (40, 27, 3, 0.5), "matmul", "train"),
    "56": ("56", 7, (40, 27), "linear", "train"),
    "98": ("98", 7, (40, 27, 4, 2.0), "matmul", "train"),
    "39-train": ("39", 7, (40, 27, (27,)), "gemm", "train"),
    "39-eval": ("39", 7, (40, 27, (27,)), "gemm", "eval"),
}


def _setup(name: str, seed: int = 0) -> tuple[str, nn.Module, nn.Module, torch.Tensor, str]:
    key, batch, init, lin, mode = CASES[name]
    model = make_original(key, init, seed)
    if key == "39":
        with torch.no_grad():
            model.bn.running_mean.uniform_(-1, 1)
            model.bn.running_var.uniform_(0.5, 2)
            model.bn.bias.uniform_(-1, 1)
    getattr(model, mode)()
    fused = fused_copy(model)
    x = make_input("randn3", batch, init[0], seed)
    return key, model, fused, x, lin


def _check(model: nn.Module, fused: nn.Module, x: torch.Tensor, what: str,
           previous: torch.Tensor | None = None) -> torch.Tensor:
    ref = reference(model, x)
    if model.training and any(isinstance(m, nn.BatchNorm1d) for m in model.modules()):
        with torch.no_grad():
            model(x)  # keep the original's running statistics in step with the fused one
    out = run_fused(fused, x)
    assert_close_to_ref(out, ref, what=what)
    if previous is not None:
        assert not torch.allclose(out, previous, atol=1e-3), f"{what}: the change had no effect"
    return out


NAMES = list(CASES)


@pytest.mark.parametrize("name", NAMES)
def test_in_place_weight_change(name: str) -> None:
    key, model, fused, x, lin = _setup(name)
    first = _check(model, fused, x, "first call")
    with torch.no_grad():
        getattr(fused, lin).weight.mul_(2)
        getattr(model, lin).weight.mul_(2)
    second = _check(model, fused, x, "after weight.mul_(2)", first)
    with torch.no_grad():
        getattr(fused, lin).weight[1].neg_()     # in place through a view
        getattr(model, lin).weight[1].neg_()
    _check(model, fused, x, "after weight[1].neg_()", second)


@pytest.mark.parametrize("name", NAMES)
def test_in_place_bias_change(name: str) -> None:
    key, model, fused, x, lin = _setup(name)
    first = _check(model, fused, x, "first call")
    g = torch.Generator().manual_seed(1)
    delta = torch.randn(getattr(model, lin).bias.shape, generator=g) * 3
    with torch.no_grad():
        getattr(fused, lin).bias.add_(delta)
        getattr(model, lin).bias.add_(delta)
    if key == "39" and model.training:
        # the Linear bias cancels out of training-mode outputs, not out of running_mean
        _check(model, fused, x, "after bias.add_")
        assert torch.allclose(fused.bn.running_mean, model.bn.running_mean, atol=1e-5)
    else:
        _check(model, fused, x, "after bias.add_", first)


@pytest.mark.parametrize("name", NAMES)
def test_assign_new_parameters(name: str) -> None:
    key, model, fused, x, lin = _setup(name)
    prev = _check(model, fused, x, "first call")
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        w = torch.randn(getattr(model, lin).weight.shape, generator=g) * 0.2
        b = torch.randn(getattr(model, lin).bias.shape, generator=g)
        getattr(fused, lin).weight = nn.Parameter(w.clone())
        getattr(model, lin).weight = nn.Parameter(w.clone())
        prev = _check(model, fused, x, f"step {step}: new weight", prev)
        getattr(fused, lin).bias = nn.Parameter(b.clone())
        getattr(model, lin).bias = nn.Parameter(b.clone())
        _check(model, fused, x, f"step {step}: new bias")


@pytest.mark.parametrize("name", NAMES)
def test_load_state_dict_from_another_model(name: str) -> None:
    key, model, fused, x, lin = _setup(name, seed=0)
    first = _check(model, fused, x, "first call")
    other = _setup(name, seed=1)[1]
    fused.load_state_dict(other.state_dict())
    other.train(model.training)
    _check(other, fused, x, "after load_state_dict", first)


@pytest.mark.parametrize("name", ("39-train", "39-eval"))
def test_39_scale_and_batchnorm_parameters(name: str) -> None:
    key, model, fused, x, lin = _setup(name)
    prev = _check(model, fused, x, "first call")
    with torch.no_grad():
        for m in (model, fused):
            m.scale[::2].mul_(-3.0)
    prev = _check(model, fused, x, "after scale[::2].mul_(-3)", prev)
    fused.scale = nn.Parameter(torch.linspace(-2, 2, fused.scale.numel()))
    model.scale = nn.Parameter(torch.linspace(-2, 2, model.scale.numel()))
    prev = _check(model, fused, x, "after new scale Parameter", prev)
    with torch.no_grad():
        for m in (model, fused):
            m.bn.weight.mul_(0.5)
            m.bn.bias.add_(1.0)
    _check(model, fused, x, "after bn affine change", prev)


@pytest.mark.parametrize("name", ("55-pairdiff", "55-k3", "98"))
def test_scale_factor_change(name: str) -> None:
    key, model, fused, x, lin = _setup(name)
    prev = _check(model, fused, x, "first call")
    fused.scale_factor = -1.75
    model.scale_factor = -1.75
    _check(model, fused, x, "after scale_factor change", prev)


@pytest.mark.parametrize("foreach", (False, True))
@pytest.mark.parametrize("name", NAMES)
def test_optimizer_step(name: str, foreach: bool) -> None:
    """An optimizer updates parameters in place (foreach kernels included)."""
    key, model, fused, x, lin = _setup(name)
    prev = _check(model, fused, x, "first call")
    for m in (model, fused):
        opt = torch.optim.SGD(m.parameters(), lr=0.5, foreach=foreach)
        for i, p in enumerate(m.parameters()):
            g = torch.Generator().manual_seed(30 + i)
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    _check(model, fused, x, "after SGD step", prev)


def test_56_non_contiguous_weight_updates() -> None:
    """A non-contiguous weight is cached as a contiguous copy: an in-place change of the
    weight or of the tensor it is a view of must reach the next result."""
    model = make_original("56", (40, 27), 3)
    base = torch.randn(40, 27) * 0.2
    model.linear.weight = nn.Parameter(base.clone().t())
    fused = fused_copy(model)
    fused.linear.weight = nn.Parameter(base.clone().t())
    assert not fused.linear.weight.is_contiguous()
    x = make_input("randn3", 5, 40, 3)
    prev = _check(model, fused, x, "first call")
    with torch.no_grad():
        fused.linear.weight.mul_(-1.5)
        model.linear.weight.mul_(-1.5)
    _check(model, fused, x, "after mul_", prev)


def test_writes_through_data_need_clear_cache() -> None:
    """Documented: writes through ``.data`` bypass the version counter; after
    cupyfuse.clear_cache() the next call sees them."""
    key, model, fused, x, lin = _setup("55-pairdiff")
    prev = _check(model, fused, x, "first call")
    fused.matmul.weight.data.mul_(2)
    model.matmul.weight.data.mul_(2)
    cupyfuse.clear_cache()
    _check(model, fused, x, "after .data write and clear_cache()", prev)


# ---------------------------------------------------------------------------------
# Cache size
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ("55-pairdiff", "55-k3", "98", "39-train", "39-eval"))
def test_cache_entry_freed_with_module(name: str, clean_plan_cache: None) -> None:
    key, model, fused, x, lin = _setup(name)
    n0 = caches.cache_size()
    run_fused(fused, x)
    n1 = caches.cache_size()
    if name in ("55-k3", "39-train", "39-eval"):
        # max pooling over windows of 3, or BatchNorm: no rewrite, hence no derived weight
        # on the CPU (the GPU engine's weight split is cached: tests/backend/test_prepared_gpu.py)
        assert n1 == n0, f"{name} cached a derived weight on the CPU"
        return
    assert n1 > n0, "no plan was cached"
    for _ in range(3):
        run_fused(fused, x)
    assert caches.cache_size() == n1, "repeated calls grew the cache"
    with torch.no_grad():
        getattr(fused, lin).weight.mul_(1.5)
    run_fused(fused, x)
    assert caches.cache_size() == n1, "a rebuild must replace the stale entry, not add one"
    getattr(fused, lin).weight = nn.Parameter(getattr(fused, lin).weight.detach() * 2)
    run_fused(fused, x)
    gc.collect()
    assert caches.cache_size() == n1, "the entry of the replaced weight was not freed"
    del fused
    gc.collect()
    assert caches.cache_size() == n0, "deleting the module did not free its cached plan"


def test_cache_holds_no_reference_to_the_module() -> None:
    import weakref

    key, model, fused, x, lin = _setup("98")
    run_fused(fused, x)
    ref = weakref.ref(fused)
    wref = weakref.ref(fused.matmul.weight)
    del fused
    gc.collect()
    assert ref() is None and wref() is None


# ---------------------------------------------------------------------------------
# Fresh operand tensors through the functional API
# ---------------------------------------------------------------------------------
def test_39_functional_fresh_bias_every_call() -> None:
    """A common loop: a new bias tensor each call, the previous one freed. CPython and the
    allocator reuse the freed object's id and memory, so a key of (id, data_ptr, _version)
    cannot tell the new tensor from the old one (such a key serves 39's q = bias * scale
    stale in ~10-80% of such calls)."""
    torch.manual_seed(0)
    stale = []
    for n in (259, 1024, 4096):
        k = 16
        w = torch.randn(n, k) / 4
        s = torch.randn(n)
        rm, rv = torch.zeros(n), torch.ones(n)
        x = torch.rand(3, k)
        for i in range(40):
            b = torch.full((n,), float(i))
            out = cupyfuse.kernelbench.gemm_scale_batchnorm(x, w, b, s, rm, rv, training=False)
            ref = ((x.double() @ w.double().T + b.double()) * s.double()) / (1 + 1e-5) ** 0.5
            if not torch.allclose(out.double(), ref, atol=1e-4, rtol=1e-4):
                stale.append((n, i))
            del b, out
    assert not stale, f"{len(stale)} of 120 calls used a stale bias, e.g. {stale[:5]}"


@pytest.mark.parametrize("key", ("55", "56", "98"))
def test_functional_fresh_operands_every_call(key: str) -> None:
    """The same loop for the other ops (their plans happen to keep the operands alive)."""
    torch.manual_seed(1)
    n, k = 1024, 16
    w = torch.randn(n, k) / 4
    x = torch.rand(3, k)
    for i in range(20):
        b = torch.full((n,), float(i % 7) - 3.0)
        if key == "55":
            out = cupyfuse.kernelbench.matmul_maxpool_sum_scale(x, w, b, 2, 0.5)
            y = x.double() @ w.double().T + b.double()
            ref = y.reshape(3, -1, 2).amax(2).sum(1) * 0.5
        elif key == "56":
            out = cupyfuse.kernelbench.matmul_sigmoid_sum(x, w, b)
            ref = torch.sigmoid(x.double() @ w.double().T + b.double()).sum(1, keepdim=True)
        else:
            out = cupyfuse.kernelbench.matmul_avgpool_gelu_scale_max(x, w, b, 4, 2.0)
            y = (x.double() @ w.double().T + b.double()).reshape(3, -1, 4).mean(2)
            ref = (torch.nn.functional.gelu(y) * 2.0).amax(1)
        assert_close_to_ref(out, ref, what=f"{key} call {i}")
        del b, out
