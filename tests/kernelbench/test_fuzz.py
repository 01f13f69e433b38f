"""Fuzz tests of the CPU path: seeded random shapes, value ranges, bad inputs.

* **Shape fuzz** -- per op, ~100 seeded cases: batch 0/1/2/3/5/17/64/random,
  in_features and out_features in 1..300 (mostly no multiple of 4), every pool size
  from 1 to out_features (tails dropped), kernel sizes larger than out_features (must
  raise like PyTorch), BatchNorm in train and eval mode with random eps/momentum,
  batch 1 in training (PyTorch's ValueError), non-contiguous and NumPy operands,
  bias=None. Both the functional op and the ``cupyfuse.kernelbench.modules`` wrapper are compared to
  the ORIGINAL model (``cupyfuse.kernelbench.models``) run in float64 on a deep copy:
  ``torch.allclose(atol=1e-4, rtol=1e-4)``; model 39's running statistics too.
* **Value ranges** -- NaN/+inf/-inf inside x, the weight and the bias (placement equal
  to the float32 original element for element, finite parts close to float64);
  magnitudes near float32 overflow (rows scaled to 1e30..1e37, huge weights, huge
  biases: every element's class and value equal to the float64 reference);
  saturated sigmoids (Linear outputs of +-50) and outputs that differ a lot between
  rows (an op returning a near-constant cannot pass).
* **Errors** -- one test per row of README.md's "Errors: what bad input gets" table.
* **Overflow regressions** -- constructions near float32's limits, each naming the
  failure it guards against.

Every case is generated from a fixed seed: a failure reproduces by its test id.
The helpers without a ``test_`` prefix are shared with tests/kernelbench/test_fuzz_gpu.py.
"""
from __future__ import annotations

import copy
import math
import random
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn

import cupyfuse
import cupyfuse.kernelbench.modules as cfnn
from cupyfuse import interop
from cupyfuse.kernelbench.models import PROBLEMS
from conftest import (assert_close_to_ref, assert_same_nonfinite, reference, reference_with_model,
                      run_fused)
from helpers import fused_copy

pytestmark = pytest.mark.usefixtures("nan_filled_outputs")

KEYS = ("55", "56", "98", "39")
OP_NAMES = {"55": "matmul_maxpool_sum_scale", "56": "matmul_sigmoid_sum",
            "98": "matmul_avgpool_gelu_scale_max", "39": "gemm_scale_batchnorm"}
FLT_MAX = float(torch.finfo(torch.float32).max)
ATOL = RTOL = 1e-4
BATCHES = (1, 2, 3, 5, 17, 64)


# =================================================================================
# Case generation (shared with test_fuzz_gpu.py)
# =================================================================================
@dataclass(frozen=True)
class Case:
    """One fuzz case: everything needed to rebuild the model and its input."""

    key: str
    idx: int
    seed: int
    batch: int
    K: int
    N: int
    k: int = 0             # pool / kernel size (55, 98)
    scale: float = 1.0     # scale_factor (55, 98)
    eps: float = 1e-5      # 39
    momentum: float | None = 0.1  # 39
    mode: str = "train"    # 39: "train" or "eval"
    dist: str = "rand"
    wscale: float = 1.0    # factor on the Linear weight
    boffset: float = 0.0   # added to the Linear bias
    layout: str = "contiguous"  # how x (and, for "numpy"/"cupy", every operand) is passed
    bias_none: bool = False     # functional op gets bias=None (the model's bias is zeroed)

    @property
    def init(self) -> tuple:
        if self.key in ("55", "98"):
            return (self.K, self.N, self.k, self.scale)
        if self.key == "56":
            return (self.K, self.N)
        return (self.K, self.N, (self.N,), self.eps, self.momentum)

    @property
    def pool_too_large(self) -> bool:
        return self.key in ("55", "98") and self.k > self.N

    @property
    def bn_batch_of_one(self) -> bool:
        return self.key == "39" and self.mode == "train" and self.batch == 1

    @property
    def id(self) -> str:
        extra = ""
        if self.key in ("55", "98"):
            extra = f"-k{self.k}-s{self.scale:g}"
        elif self.key == "39":
            extra = f"-{self.mode}-m{self.momentum}"
        return (f"{self.key}-{self.idx}-b{self.batch}-K{self.K}-N{self.N}{extra}-{self.dist}"
                f"-{self.layout}{'-nobias' if self.bias_none else ''}")


def odd_size(rng: random.Random, lo: int, hi: int) -> int:
    """A size in [lo, hi], three times in four not a multiple of 4 (no tile fits)."""
    n = rng.randint(lo, hi)
    if n % 4 == 0 and rng.random() < 0.75:
        n = n + 1 if n < hi else n - 1
    return max(lo, n)


def pick_pool(rng: random.Random, key: str, N: int) -> int:
    """Kernel size for 55 / pool size for 98: the fast path, 1, N, > N, and random."""
    r = rng.random()
    if key == "55" and r < 0.45 and N >= 2:
        return 2                      # pair-difference path
    if key == "98" and r < 0.25:
        common = [k for k in (2, 4, 16) if k <= N]
        if common:
            return rng.choice(common)
    if r < 0.55:
        return 1
    if r < 0.65:
        return N                      # one window covering everything
    if r < 0.73:
        return N + rng.randint(1, 4)  # larger than out_features: must raise
    return rng.randint(1, max(1, min(N, 40)))


def make_cases(key: str, count: int, salt: str, *, max_k: int = 300, max_n: int = 300,
               layouts: tuple[tuple[str, float], ...] = (("contiguous", 6), ("transposed", 1.5),
                                                         ("strided", 1.5), ("numpy", 1)),
               zero_batch_at: tuple[int, ...] = (3, 40), one_batch_at: tuple[int, ...] = (5, 60),
               max_batch: int = 100) -> list[Case]:
    """``count`` seeded shape-fuzz cases of ``key`` (deterministic for a given salt)."""
    rng = random.Random(f"cupyfuse-fuzz-{salt}-{key}")
    names = [n for n, _ in layouts]
    weights = [w for _, w in layouts]
    cases = []
    for i in range(count):
        if i in zero_batch_at:
            batch = 0
        elif i in one_batch_at:
            batch = 1
        elif rng.random() < 0.6:
            batch = rng.choice(BATCHES)
        else:
            batch = rng.randint(1, max_batch)
        K = odd_size(rng, 1, max_k)
        N = odd_size(rng, 1, max_n)
        fields: dict[str, Any] = {}
        if key in ("55", "98"):
            k = pick_pool(rng, key, N)
            fields.update(k=k, scale=rng.choice([0.5, 2.0, -1.5, 1.0, round(rng.uniform(-3, 3), 3)]))
            if rng.random() < 0.03:
                fields["scale"] = 0.0
        if key == "39":
            fields.update(eps=rng.choice([1e-5, 1e-5, 1e-3]),
                          momentum=rng.choice([0.1, 0.1, 0.5, None]),
                          mode="train" if (i in one_batch_at or rng.random() < 0.7) else "eval")
        cases.append(Case(
            key=key, idx=i, seed=rng.randint(0, 2**31 - 1), batch=batch, K=K, N=N,
            dist=rng.choice(["rand", "rand", "randn", "randn3", "neg", "offset"]),
            wscale=2.0 ** rng.uniform(-2, 2),
            boffset=rng.uniform(-2, 2) if rng.random() < 0.3 else 0.0,
            layout=rng.choices(names, weights)[0],
            bias_none=rng.random() < 0.1, **fields))
    return cases


# =================================================================================
# Models, inputs, calls (shared with test_fuzz_gpu.py)
# =================================================================================
def linear_of(model: nn.Module) -> nn.Linear:
    return next(m for m in model.modules() if isinstance(m, nn.Linear))


def build_model(case: Case, device: Any = "cpu") -> nn.Module:
    """The original model of ``case`` (seeded default init, then the case's tweaks)."""
    torch.manual_seed(case.seed % (2**31))
    model = PROBLEMS[case.key].model(*case.init)
    lin = linear_of(model)
    g = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():
        lin.weight.mul_(case.wscale)
        lin.bias.add_(case.boffset)
        if case.bias_none:
            lin.bias.zero_()
        if case.key == "39":
            bn = model.bn
            bn.weight.uniform_(0.5, 2.0, generator=g)
            bn.bias.uniform_(-1.0, 1.0, generator=g)
            bn.running_mean.uniform_(-1.0, 1.0, generator=g)
            bn.running_var.uniform_(0.5, 2.0, generator=g)
            bn.num_batches_tracked.fill_(3)
    model.train(case.mode == "train")
    return model.to(device)


def make_x(case: Case, device: Any = "cpu") -> torch.Tensor:
    """A contiguous float32 input of the case's distribution (generated on the CPU)."""
    g = torch.Generator().manual_seed(case.seed + 1)
    shape = (case.batch, case.K)
    if case.dist == "rand":
        x = torch.rand(shape, generator=g)
    elif case.dist == "randn":
        x = torch.randn(shape, generator=g)
    elif case.dist == "randn3":
        x = torch.randn(shape, generator=g) * 3.0
    elif case.dist == "neg":
        x = -torch.rand(shape, generator=g)
    elif case.dist == "offset":
        x = torch.rand(shape, generator=g) + random.Random(case.seed).uniform(-4.0, 4.0)
    else:
        raise AssertionError(case.dist)
    return x.contiguous().to(device)


def lay_out(x: torch.Tensor, layout: str) -> Any:
    """``x`` as the case passes it: same values, another layout or another array type."""
    if layout == "contiguous":
        return x
    if layout == "transposed":      # column-major
        return x.t().contiguous().t()
    if layout == "strided":         # every other column of a wider buffer (NaN between)
        wide = torch.full((x.shape[0], 2 * x.shape[1]), float("nan"), device=x.device)
        wide[:, ::2] = x
        return wide[:, ::2]
    if layout == "numpy":
        return x.numpy().copy()
    if layout == "cupy":
        import cupy

        return cupy.asarray(x.detach().cpu().numpy())
    raise AssertionError(layout)


def _convert(t: torch.Tensor | None, layout: str) -> Any:
    """A parameter as the functional op gets it (NumPy / CuPy when x is one)."""
    if t is None:
        return None
    t = t.detach()
    if layout == "numpy":
        return t.numpy().copy()
    if layout == "cupy":
        import cupy

        return cupy.asarray(t.cpu().numpy())
    return t


def as_torch(out: Any) -> torch.Tensor:
    """Any op result (torch, NumPy, CuPy) as a torch tensor on the CPU."""
    if isinstance(out, torch.Tensor):
        return out.detach().cpu()
    if isinstance(out, np.ndarray):
        return torch.from_numpy(out)
    if interop.is_cupy_array(out):
        import cupy

        return torch.from_numpy(cupy.asnumpy(out))
    raise AssertionError(type(out))


def call_functional(case: Case, model: nn.Module, xin: Any) -> tuple[Any, tuple[Any, Any] | None]:
    """Run the functional op on the model's parameters; returns (out, updated running stats).

    Model 39's running statistics are clones (in the case's layout), updated in place by
    the op in training mode; the model itself is never modified.
    """
    layout = case.layout if case.layout in ("numpy", "cupy") else "torch"
    lin = linear_of(model)
    w = _convert(lin.weight, layout)
    b = None if case.bias_none else _convert(lin.bias, layout)
    with torch.no_grad():
        if case.key == "55":
            return cupyfuse.kernelbench.matmul_maxpool_sum_scale(xin, w, b, case.k, case.scale), None
        if case.key == "56":
            return cupyfuse.kernelbench.matmul_sigmoid_sum(xin, w, b), None
        if case.key == "98":
            return cupyfuse.kernelbench.matmul_avgpool_gelu_scale_max(xin, w, b, case.k, case.scale), None
        bn = model.bn
        rm = _convert(bn.running_mean.clone(), layout)
        rv = _convert(bn.running_var.clone(), layout)
        factor = bn.momentum if bn.momentum is not None else 1.0 / (int(bn.num_batches_tracked) + 1)
        out = cupyfuse.kernelbench.gemm_scale_batchnorm(
            xin, w, b, _convert(model.scale, layout), rm, rv, _convert(bn.weight, layout),
            _convert(bn.bias, layout), training=bn.training, momentum=factor, eps=bn.eps)
        return out, (rm, rv)


def check_running_stats(got: tuple[Any, Any], bn_ref: nn.BatchNorm1d, what: str,
                        atol: float = 1e-5, rtol: float = 1e-4) -> None:
    for name, t in zip(("running_mean", "running_var"), got):
        t = as_torch(t).double()
        exp = getattr(bn_ref, name).detach().cpu().double()
        assert torch.allclose(t, exp, atol=atol, rtol=rtol), (
            f"{what}: {name} max |diff| {float((t - exp).abs().max()):.3e}")


def check_module_stats(fused: nn.Module, m64: nn.Module, what: str) -> None:
    assert int(fused.bn.num_batches_tracked) == int(m64.bn.num_batches_tracked), what
    check_running_stats((fused.bn.running_mean, fused.bn.running_var), m64.bn, what)


# =================================================================================
# Value-class comparisons (shared with test_fuzz_gpu.py)
# =================================================================================
def value_class(t: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +inf, 3 -inf, elementwise."""
    c = torch.zeros(t.shape, dtype=torch.int8, device=t.device)
    c[torch.isnan(t)] = 1
    c[torch.isposinf(t)] = 2
    c[torch.isneginf(t)] = 3
    return c


def assert_matches_float64(out: Any, ref64: torch.Tensor, what: str, *, atol: float = ATOL,
                           rtol: float = RTOL) -> int:
    """Every element of ``out`` has the class (finite / NaN / +-inf) of the float64 reference
    rounded to float32, and finite elements are allclose to it. Elements whose reference
    lies within a factor 2 of float32's largest value are skipped (either class is a
    correct rounding there). Returns the number of elements checked."""
    out = as_torch(out)
    ref64 = ref64.detach().cpu().double()
    assert out.dtype == torch.float32, f"{what}: dtype {out.dtype}"
    assert tuple(out.shape) == tuple(ref64.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    boundary = torch.isfinite(ref64) & (ref64.abs() >= FLT_MAX / 2) & (ref64.abs() <= 2 * FLT_MAX)
    c_out, c_ref = value_class(out), value_class(ref64.to(torch.float32))
    bad = (c_out != c_ref) & ~boundary
    if bool(bad.any()):
        idx = bad.nonzero().tolist()[:6]
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements of another class than the float64 reference, "
            f"e.g. at {idx}: fused {[out[tuple(i)].item() for i in idx]} vs float64 "
            f"{[ref64[tuple(i)].item() for i in idx]}")
    fin = (c_out == 0) & (c_ref == 0) & ~boundary
    o, r = out[fin].double(), ref64[fin]
    tol = atol + rtol * r.abs()
    ok = (o - r).abs() <= tol
    if not bool(ok.all()):
        worst = int(((o - r).abs() / tol).argmax())
        raise AssertionError(f"{what}: {int((~ok).sum())} finite elements not close to float64, "
                             f"worst fused {o[worst].item():.9g} vs {r[worst].item():.9g}")
    return int((~boundary).sum())


def assert_no_worse_than_float32(out: Any, t32: torch.Tensor, ref64: torch.Tensor, what: str,
                                 *, atol: float = ATOL, rtol: float = RTOL) -> None:
    """The contract where float32 itself overflows in intermediates: each element either
    matches the float64 reference (class, and value within tolerance) or has exactly the
    class of PyTorch's float32 model (and, when finite, is no farther from float64 than
    twice PyTorch's own error plus the tolerance)."""
    out = as_torch(out)
    t32 = as_torch(t32)
    ref64 = ref64.detach().cpu().double()
    c_out, c_ref, c_t = value_class(out), value_class(ref64.to(torch.float32)), value_class(t32)
    err = (out.double() - ref64).abs()
    tol = atol + rtol * ref64.abs()
    ok_ref = (c_out == c_ref) & ((c_out != 0) | (err <= tol))
    t_err = (t32.double() - ref64).abs()
    ok_t = (c_out == c_t) & ((c_out != 0) | (err <= 2 * torch.nan_to_num(t_err, nan=0.0) + tol)
                              | ~torch.isfinite(ref64))
    bad = ~(ok_ref | ok_t)
    if bool(bad.any()):
        idx = bad.nonzero().tolist()[:6]
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements worse than PyTorch's float32 model, e.g. at "
            f"{idx}: fused {[out[tuple(i)].item() for i in idx]}, float32 torch "
            f"{[t32[tuple(i)].item() for i in idx]}, float64 {[ref64[tuple(i)].item() for i in idx]}")


# =================================================================================
# 1. Shape fuzz
# =================================================================================
CPU_COUNTS = {"55": 110, "56": 90, "98": 110, "39": 110}
SHAPE_CASES = [c for key in KEYS for c in make_cases(key, CPU_COUNTS[key], "cpu-shape")]


def run_shape_case(case: Case, device: Any = "cpu") -> None:
    """The whole shape-fuzz check of one case (also used by test_fuzz_gpu.py)."""
    model = build_model(case, device)
    x = make_x(case, device)
    xin = lay_out(x, case.layout)
    fused = fused_copy(model)

    if case.pool_too_large:
        with pytest.raises(RuntimeError):   # what PyTorch's own model does
            with torch.no_grad():
                copy.deepcopy(model)(x)
        msg = f"{OP_NAMES[case.key]}: kernel_size {case.k} is larger than out_features {case.N}"
        with pytest.raises(ValueError, match=msg):
            call_functional(case, model, xin)
        # the module runs the generic program of the original's forward: its refusal
        # names the pooling op and quotes the forward's line
        with pytest.raises(ValueError, match=rf"_pool1d: window {case.k} is longer than the "
                                             rf"{case.N} features\n  at .*models.py:\d+ in forward"):
            run_fused(fused, xin)
        return

    if case.bn_batch_of_one:
        m32 = copy.deepcopy(model)
        with pytest.raises(ValueError) as torch_err:
            with torch.no_grad():
                m32(x)
        with pytest.raises(ValueError) as mod_err:
            run_fused(fused, xin)
        with pytest.raises(ValueError) as fn_err:
            call_functional(case, model, xin)
        assert str(mod_err.value) == str(torch_err.value)
        assert str(fn_err.value) == str(torch_err.value)
        assert str(torch_err.value).startswith("Expected more than 1 value per channel when training")
        # BatchNorm1d counts the batch before it refuses it; so does the fused module.
        assert int(fused.bn.num_batches_tracked) == int(m32.bn.num_batches_tracked)
        return

    ref, m64 = reference_with_model(model, x)
    out_mod = run_fused(fused, xin)
    out_fn, stats = call_functional(case, model, xin)
    for what, out in (("module", out_mod), ("functional", out_fn)):
        if case.layout == "numpy":
            assert isinstance(out, np.ndarray), f"{case.id} {what}: NumPy in, {type(out)} out"
        elif case.layout == "cupy":
            assert interop.is_cupy_array(out), f"{case.id} {what}: CuPy in, {type(out)} out"
        else:
            assert isinstance(out, torch.Tensor) and out.device == x.device, (case.id, what)
            assert out.grad_fn is None   # (no_grad calls)
        assert_close_to_ref(as_torch(out), ref.cpu(), what=f"{case.id} {what}")
    if case.key == "39":
        if case.mode == "train":
            check_module_stats(fused, m64, f"{case.id} module")
            check_running_stats(stats, m64.bn, f"{case.id} functional")
        else:   # eval: running statistics untouched
            check_running_stats(stats, model.bn, f"{case.id} functional eval", atol=0, rtol=0)
            check_running_stats((fused.bn.running_mean, fused.bn.running_var), model.bn,
                                f"{case.id} module eval", atol=0, rtol=0)


@pytest.mark.parametrize("case", SHAPE_CASES, ids=[c.id for c in SHAPE_CASES])
def test_shape_fuzz(case: Case) -> None:
    run_shape_case(case)


def test_shape_fuzz_covers_what_it_claims() -> None:
    """The generator really produces the corner cases the fuzz is meant to cover."""
    for key in KEYS:
        cs = [c for c in SHAPE_CASES if c.key == key]
        assert any(c.batch == 0 for c in cs) and any(c.batch == 1 for c in cs), key
        assert any(c.K % 4 and c.N % 4 for c in cs), key
        assert sum(c.K % 4 != 0 for c in cs) > len(cs) // 2, key
        assert any(c.layout != "contiguous" for c in cs), key
        assert any(c.bias_none for c in cs), key
        if key in ("55", "98"):
            assert any(c.pool_too_large for c in cs), key
            assert any(c.k == 1 for c in cs) and any(c.k == c.N and c.N > 1 for c in cs), key
            assert any(c.k > 2 and c.N % c.k for c in cs), f"{key}: no pool with a dropped tail"
        if key == "55":
            assert sum(c.k == 2 and not c.pool_too_large for c in cs) >= 30
        if key == "39":
            assert any(c.bn_batch_of_one for c in cs)
            assert any(c.mode == "eval" for c in cs)
            assert any(c.momentum is None and c.mode == "train" for c in cs)


# =================================================================================
# 2a. NaN and infinities inside x, W, b: placement equal to PyTorch's float32 model
# =================================================================================
@dataclass(frozen=True)
class NFCase:
    key: str
    idx: int
    seed: int
    batch: int
    K: int
    N: int
    k: int
    scale: float
    mode: str
    targets: tuple[str, ...]

    @property
    def init(self) -> tuple:
        return Case(key=self.key, idx=0, seed=0, batch=0, K=self.K, N=self.N, k=self.k,
                    scale=self.scale).init

    @property
    def id(self) -> str:
        return (f"{self.key}-{self.idx}-b{self.batch}-K{self.K}-N{self.N}-k{self.k}-{self.mode}-"
                f"{'+'.join(self.targets)}")


def make_nonfinite_cases(key: str, count: int, salt: str, max_batch: int = 12,
                         max_size: int = 48) -> list[NFCase]:
    rng = random.Random(f"cupyfuse-nonfinite-{salt}-{key}")
    out = []
    for i in range(count):
        K, N = rng.randint(1, max_size), rng.randint(1, max_size)
        if rng.random() < 0.4:   # few windows: an infinite row decides the result alone
            N = rng.randint(1, 6)
        k = 0
        if key == "55":
            N = max(N, 2)
            k = 2 if rng.random() < 0.6 else rng.randint(1, min(N, 6))
        elif key == "98":
            k = rng.randint(1, min(N, 8))
        targets = tuple(t for t in ("x", "weight", "bias") if rng.random() < 0.5) or (
            rng.choice(["x", "weight", "bias"]),)
        out.append(NFCase(key, i, rng.randint(0, 2**31 - 1), rng.randint(2, max_batch), K, N, k,
                          rng.choice([0.5, 2.0, -1.5, 1.0, 0.0]) if key in ("55", "98") else 1.0,
                          rng.choice(["train", "eval"]) if key == "39" else "train", targets))
    return out


def build_nonfinite(case: NFCase, device: Any = "cpu") -> tuple[nn.Module, torch.Tensor]:
    """Model and input with NaN/+inf/-inf injected where the case says (seeded)."""
    rng = random.Random(case.seed)
    torch.manual_seed(case.seed)
    model = PROBLEMS[case.key].model(*case.init)
    g = torch.Generator().manual_seed(case.seed)
    lin = linear_of(model)
    x = torch.randn(case.batch, case.K, generator=g) * 2.0
    x[torch.rand(x.shape, generator=g) < 0.15] = 0.0      # 0 * inf = NaN in the Linear
    if rng.random() < 0.3:
        x[rng.randrange(case.batch)] = 0.0
    vals = (float("nan"), float("inf"), -float("inf"))
    with torch.no_grad():
        if case.key == "39":
            model.bn.weight.uniform_(0.5, 2.0, generator=g)
            model.bn.bias.uniform_(-1.0, 1.0, generator=g)
            model.bn.running_mean.uniform_(-1.0, 1.0, generator=g)
            model.bn.running_var.uniform_(0.5, 2.0, generator=g)
        for target in case.targets:
            for _ in range(rng.randint(1, 3)):
                v = rng.choice(vals)
                pattern = rng.choice(["entry", "entry", "row", "column"])
                if target == "x":
                    r, c = rng.randrange(case.batch), rng.randrange(case.K)
                    if pattern == "row":
                        x[r] = v
                    elif pattern == "column":
                        x[:, c] = v
                    else:
                        x[r, c] = v
                elif target == "weight":
                    n, c = rng.randrange(case.N), rng.randrange(case.K)
                    if pattern == "row":
                        lin.weight[n] = v
                    elif pattern == "column":
                        lin.weight[:, c] = v
                    else:
                        lin.weight[n, c] = v
                else:
                    lin.bias[rng.randrange(case.N)] = v
    model.train(case.mode == "train")
    return model.to(device), x.to(device)


def cpu_references(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, nn.Module, torch.Tensor]:
    """PyTorch's float32 original and the float64 reference, both run on CPU copies.

    The float32 placement reference is the CPU model on every device: PyTorch's CUDA
    BatchNorm accumulates its statistics with Welford's update, where one +inf turns the
    mean into inf - inf = NaN; the CPU model (and float64) keep mean = +inf.
    Returns (float32 output, the float32 model after the call, float64 output).
    """
    xc = x.detach().cpu()
    ref = reference(copy.deepcopy(model).cpu(), xc)   # before mc's call changes its stats
    mc = copy.deepcopy(model).cpu()
    with torch.no_grad():
        t32 = mc(xc)
    return t32, mc, ref


def run_nonfinite_case(case: NFCase, device: Any = "cpu") -> None:
    """NaN/inf placement must be PyTorch's. PyTorch itself differs between devices here
    (e.g. AvgPool over +inf bias columns: NaN on the CPU, +inf on CUDA), so on a GPU an
    output may match either PyTorch's CPU model or PyTorch's model on the same device."""
    model, x = build_nonfinite(case, device)
    t32, m32, ref = cpu_references(model, x)
    t32_dev = None
    if str(device) != "cpu":
        with torch.no_grad():
            t32_dev = copy.deepcopy(model)(x).cpu()
    fused = fused_copy(model)
    out_mod = run_fused(fused, x)
    fcase = Case(key=case.key, idx=case.idx, seed=case.seed, batch=case.batch, K=case.K,
                 N=case.N, k=case.k, scale=case.scale, mode=case.mode)
    out_fn, stats = call_functional(fcase, model, x)
    for what, out in (("module", out_mod), ("functional", out_fn)):
        try:
            assert_same_nonfinite(as_torch(out), t32, ref, what=f"{case.id} {what}")
        except AssertionError:
            if t32_dev is None:
                raise
            assert_same_nonfinite(as_torch(out), t32_dev, ref,
                                  what=f"{case.id} {what} (vs PyTorch on {device} too)")
    if case.key == "39" and case.mode == "train":
        for name, got_fn, got_mod in zip(("running_mean", "running_var"), stats,
                                         (fused.bn.running_mean, fused.bn.running_var)):
            exp = getattr(m32.bn, name)
            assert_same_nonfinite(as_torch(got_fn), exp, what=f"{case.id} functional {name}", atol=1e-5)
            assert_same_nonfinite(as_torch(got_mod), exp, what=f"{case.id} module {name}", atol=1e-5)


NF_CASES = [c for key in KEYS for c in make_nonfinite_cases(key, 40, "cpu")]


@pytest.mark.parametrize("case", NF_CASES, ids=[c.id for c in NF_CASES])
def test_nonfinite_fuzz(case: NFCase) -> None:
    run_nonfinite_case(case)


# =================================================================================
# 2b. Magnitudes near float32 overflow
# =================================================================================
HUGE_VARIANTS = ("x_rows", "weights", "bias", "mixed")


def _row_bound(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """max_n sum_k |x_rk W_nk| per row, in float64: no partial sum of the Linear can exceed it."""
    return (x.double().abs() @ W.double().abs().T).amax(1)


def build_huge(key: str, variant: str, seed: int, device: Any = "cpu"
               ) -> tuple[nn.Module, torch.Tensor, Case]:
    """A model and input whose Linear outputs reach 1e30..1e37 (safe by construction).

    Safe means: no float32 intermediate of the original model's Linear or pooling can
    overflow in any summation order, and no dot product cancels (weights >= 0, each row
    of x of one sign; a huge bias swamps moderate rows and stays 1e-3 below huge ones),
    so every correct float32 implementation is within rtol of the float64 reference,
    while the guard of 55/98 sees rows far beyond its limit. The caps also keep clear of
    the 55/39 overflow constructions (section 4 below), which need N * max|W| or
    |bias * scale| near float32's largest value.
    """
    rng = random.Random(f"huge-{key}-{variant}-{seed}")
    K, N = rng.randint(3, 120), rng.randint(4, 120)
    batch = rng.randint(6, 24)
    k = 0
    if key == "55":
        k = 2 if rng.random() < 0.7 else rng.randint(1, min(N, 5))
    elif key == "98":
        k = rng.randint(1, min(N, 8))
    case = Case(key=key, idx=seed, seed=rng.randint(0, 2**31 - 1), batch=batch, K=K, N=N, k=k,
                scale=rng.choice([0.5, 2.0, -1.5, 1.0]), mode=rng.choice(["train", "eval"]))
    torch.manual_seed(case.seed)
    model = PROBLEMS[key].model(*case.init)
    lin = linear_of(model)
    g = torch.Generator().manual_seed(case.seed)
    smax = float(model.scale.detach().abs().max()) if key == "39" else 1.0
    cap = {"55": 8e37, "56": 1e37, "98": min(1e37, FLT_MAX / (4 * max(k, 1))),
           "39": min(1e36, FLT_MAX / (16 * smax))}[key]
    sign = torch.where(torch.rand(batch, 1, generator=g) < 0.5, -1.0, 1.0)
    x = sign * torch.randn(batch, K, generator=g).abs()
    with torch.no_grad():
        lin.weight.abs_()
        if key == "39":
            model.bn.weight.uniform_(0.5, 2.0, generator=g)
            model.bn.bias.uniform_(-1.0, 1.0, generator=g)
        if variant == "weights":
            c = 10.0 ** rng.uniform(20, 30)
            c = min(c, FLT_MAX / (16 * N * float(lin.weight.abs().max())))
            lin.weight.mul_(c)
        if variant == "bias":
            lin.bias.mul_(10.0 ** rng.uniform(20, 36))
        if variant == "mixed":
            lin.bias.mul_(10.0 ** rng.uniform(20, 27))
        if variant in ("x_rows", "weights", "mixed"):
            bound = _row_bound(x, lin.weight)
            for r in range(batch):
                if r > 0 and rng.random() < 0.3:
                    continue                      # a moderate row among huge ones
                target = cap if r == 0 else 10.0 ** rng.uniform(30, math.log10(cap))
                if float(bound[r]) > 0:
                    x[r] *= target / float(bound[r])
    model.train(case.mode == "train")
    return model.to(device), x.to(device), case


# 39 gets no pure "bias" variant: a column that is one huge constant is ill-posed for
# BatchNorm (float64's own mean is an ulp off, and the ulp is 1e19 there).
HUGE_CASES = [(key, v, s) for key in KEYS for v in HUGE_VARIANTS for s in range(4)
              if not (key == "39" and v == "bias")]


def run_huge_case(key: str, variant: str, seed: int, device: Any = "cpu") -> None:
    model, x, case = build_huge(key, variant, seed, device)
    ref, m64 = reference_with_model(model, x)
    fused = fused_copy(model)
    what = f"{key} {variant} seed {seed} ({case.id})"
    out = run_fused(fused, x)
    out_fn, stats = call_functional(case, model, x)
    assert assert_matches_float64(out, ref, f"{what} module") > 0
    assert_matches_float64(out_fn, ref, f"{what} functional")
    if key == "39" and case.mode == "train":
        for name, got in zip(("running_mean", "running_var"), stats):
            assert_matches_float64(got, getattr(m64.bn, name), f"{what} {name}", atol=1e-5)
    if key in ("55", "98") and variant in ("x_rows", "mixed") and (key == "98" or case.k == 2):
        # The guard of the shortcut (cupyfuse.ir.rewrite: pair differences for 55, the
        # average-pooling fold for 98) really had rows to recompute.
        from cupyfuse.ir import rewrite

        lin = linear_of(model)
        wmax = float(lin.weight.detach().abs().max())
        l1 = x.double().abs().sum(1)
        if key == "55":
            bound, limit = l1 * (case.N * wmax), rewrite.PAIR_LIMIT
        else:
            bound, limit = l1 * wmax, 1e37
        assert bool((~(bound < limit)).any()), f"{what}: no row beyond the guard's limit"


@pytest.mark.parametrize("key,variant,seed", HUGE_CASES,
                         ids=[f"{k}-{v}-{s}" for k, v, s in HUGE_CASES])
def test_huge_magnitudes(key: str, variant: str, seed: int) -> None:
    run_huge_case(key, variant, seed)


@pytest.mark.parametrize("key", KEYS)
def test_huge_rows_no_worse_than_float32(key: str) -> None:
    """Rows scaled to float32's edge, where PyTorch's float32 tails overflow (55's sum of
    window maxima, 39's variance): every element is the float64 value or has exactly the
    class PyTorch's float32 model gives it. The Linear outputs themselves stay below
    float32's largest value in any summation order (asserted), so the verdict does not
    depend on a BLAS's order of additions."""
    torch.manual_seed(7)
    init = {"55": (33, 31, 2, 0.5), "56": (33, 31), "98": (33, 31, 3, 2.0), "39": (33, 31, (31,))}[key]
    factors = {"55": (1e37, 3e37, -1e37, 5e37, 1.0, 1e36), "56": (1e37, 3e37, -1e37, 5e37, 1.0, 1e36),
               "98": (1e37, 2e37, -1e37, 2e37, 1.0, 1e36),
               "39": (1e35, 3e35, -1e35, 1e36, 1.0, 1e34)}[key]   # 39: y - mean kept finite
    model = PROBLEMS[key].model(*init)
    g = torch.Generator().manual_seed(7)
    x = torch.rand(9, 33, generator=g)
    for r, f in enumerate(factors):
        x[r] *= f
    lin = linear_of(model)
    bound = _row_bound(x, lin.weight.detach()) + float(lin.bias.detach().abs().max())
    assert float(bound.max()) * (3 if key == "98" else 1) < FLT_MAX
    m32 = copy.deepcopy(model)
    with torch.no_grad():
        t32 = m32(x)
    ref = reference(model, x)
    out = run_fused(fused_copy(model), x)
    assert_no_worse_than_float32(out, t32, ref, f"{key} rows to 1e38")


EXTREME_SCALES = (1e30, -1e30, 1e38, -3e38, 1e-30, 1e-38, 0.0)


def run_extreme_scale_case(key: str, k: int, scale: float, device: Any = "cpu") -> None:
    """scale_factor far from 1 moves 55's guard limit (1e37 / (N |scale|)) and overflows
    the result itself: every element is the float64 value rounded to float32 (class
    included), on whichever path the guard picks."""
    torch.manual_seed(11)
    model = PROBLEMS[key].model(40, 26, k, scale).to(device)
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(9, 40, generator=g) * 3).to(device)
    x[4] *= 1e30                              # one row beyond the guard's limit
    ref = reference(model, x)
    out = run_fused(fused_copy(model), x)
    assert_matches_float64(out, ref, f"{key} k={k} scale={scale:g}")
    t32, _, ref_cpu = cpu_references(model, x)
    assert_no_worse_than_float32(out, t32, ref_cpu, f"{key} k={k} scale={scale:g}")


@pytest.mark.parametrize("scale", EXTREME_SCALES)
@pytest.mark.parametrize("key,k", [("55", 2), ("55", 3), ("98", 4)])
def test_extreme_scale_factors(key: str, k: int, scale: float) -> None:
    run_extreme_scale_case(key, k, scale)


# =================================================================================
# 2c. Saturated sigmoids and outputs far from any constant
# =================================================================================
@pytest.mark.parametrize("K,N", [(5, 7), (33, 64), (300, 259), (1, 130)])
def test_56_saturated_sigmoid_rows_differ(K: int, N: int) -> None:
    """Linear outputs of exactly +-50 (+-1%): sigmoid is 1 - 2e-22 or 2e-22. Rows with
    s_r = +1 sum to the number of positive columns, rows with s_r = -1 to the rest."""
    g = torch.Generator().manual_seed(K * 1000 + N)
    model = PROBLEMS["56"].model(K, N)
    a = torch.where(torch.rand(N, generator=g) < 0.8, 1.0, -1.0)   # 80% positive columns
    with torch.no_grad():
        model.linear.weight.copy_(a[:, None] * (50.0 / K) * (1 + 0.01 * torch.rand(N, K, generator=g)))
        model.linear.bias.zero_()
    s = torch.tensor([1.0, -1.0] * 6)
    x = s[:, None] * (1 + 0.01 * torch.rand(12, K, generator=g))
    with torch.no_grad():
        y = model.linear(x)
    assert bool((y.abs() > 49).all() and (y.abs() < 52).all())
    ref = reference(model, x)
    fused = fused_copy(model)
    out = run_fused(fused, x)
    assert_close_to_ref(out, ref, what="56 +-50")
    out_fn = cupyfuse.kernelbench.matmul_sigmoid_sum(x, model.linear.weight.detach(), model.linear.bias.detach())
    assert_close_to_ref(out_fn, ref, what="56 +-50 functional")
    npos = float((a > 0).sum())
    assert torch.allclose(out[0::2].double(), torch.full((6, 1), npos, dtype=torch.float64), atol=1e-4)
    assert torch.allclose(out[1::2].double(), torch.full((6, 1), N - npos, dtype=torch.float64), atol=1e-4)
    if N > 10:
        assert float(out.max() - out.min()) > 0.4 * N


def _bimodal(key: str, K: int, N: int, seed: int) -> tuple[nn.Module, torch.Tensor]:
    """Half the rows strongly positive, half strongly negative, through non-negative weights:
    Linear outputs of about +-(5..50), so the per-row results differ by a lot."""
    torch.manual_seed(seed)
    init = {"55": (K, N, 2, 0.5), "56": (K, N), "98": (K, N, 3, 2.0), "39": (K, N, (N,))}[key]
    model = PROBLEMS[key].model(*init)
    g = torch.Generator().manual_seed(seed)
    lin = linear_of(model)
    with torch.no_grad():
        lin.weight.copy_(torch.rand(N, K, generator=g) * (10.0 / K))
        lin.bias.uniform_(-1.0, 1.0, generator=g)
    M = 16
    sign = torch.tensor([1.0 if r % 2 == 0 else -1.0 for r in range(M)])
    x = sign[:, None] * (torch.rand(M, K, generator=g) * 4.0 + 1.0)
    return model, x


@pytest.mark.parametrize("K,N", [(40, 30), (129, 67), (7, 300)])
@pytest.mark.parametrize("key", KEYS)
def test_outputs_far_from_constant(key: str, K: int, N: int) -> None:
    model, x = _bimodal(key, K, N, seed=K + N)
    with torch.no_grad():
        y = linear_of(model)(x)
    assert float(y[0::2].min()) > 1.0 and float(y[1::2].max()) < -1.0
    assert float(y.abs().mean()) > 5.0
    ref = reference(model, x)
    out = as_torch(run_fused(fused_copy(model), x))
    assert_close_to_ref(out, ref, what=f"{key} bimodal")
    spread_ref = (ref.amax(0) - ref.amin(0)).min().item()       # over rows, per output column
    spread_out = (out.double().amax(0) - out.double().amin(0)).min().item()
    assert float(out.double().std(0).min()) > 0.25 * spread_ref   # not one outlier row
    need = {"55": float(N), "56": 0.8 * N, "98": 5.0, "39": 1.5}[key]
    assert spread_ref > need, f"{key}: the inputs do not spread the reference ({spread_ref:.3g})"
    assert abs(spread_out - spread_ref) <= 1e-4 * (1 + spread_ref), (spread_out, spread_ref)
    # positive rows and negative rows land on clearly different sides
    pos, neg = out[0::2].double(), out[1::2].double()
    if key == "39":   # per column; the sign of model.scale decides which side is which
        assert bool(((pos.mean(0) - neg.mean(0)).abs() > 1.0).all())
    else:
        assert float(pos.min()) > float(neg.max()) + 0.5 * need


# =================================================================================
# 3. README "Errors: what bad input gets" -- one test per row
# =================================================================================
KE, NE, BE = 12, 10, 5


def _ops(key: str, batch: int = BE, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    d: dict[str, Any] = {"x": torch.randn(batch, KE, generator=g),
                         "weight": torch.randn(NE, KE, generator=g) * 0.3,
                         "bias": torch.randn(NE, generator=g)}
    if key == "39":
        d.update(scale=torch.randn(NE, generator=g), running_mean=torch.zeros(NE),
                 running_var=torch.ones(NE), bn_weight=torch.rand(NE, generator=g) + 0.5,
                 bn_bias=torch.randn(NE, generator=g))
    return d


def _call(key: str, d: dict[str, Any], *, k: Any = 2, scale_factor: Any = 0.5,
          training: bool = True) -> Any:
    if key == "55":
        return cupyfuse.kernelbench.matmul_maxpool_sum_scale(d["x"], d["weight"], d["bias"], k, scale_factor)
    if key == "56":
        return cupyfuse.kernelbench.matmul_sigmoid_sum(d["x"], d["weight"], d["bias"])
    if key == "98":
        return cupyfuse.kernelbench.matmul_avgpool_gelu_scale_max(d["x"], d["weight"], d["bias"], k,
                                                      scale_factor)
    return cupyfuse.kernelbench.gemm_scale_batchnorm(d["x"], d["weight"], d["bias"], d["scale"],
                                         d["running_mean"], d["running_var"], d["bn_weight"],
                                         d["bn_bias"], training=training)


def _raises(key: str, d: dict[str, Any], exc: type, start: str, **kw: Any) -> str:
    with pytest.raises(exc) as ei:
        with torch.no_grad():
            _call(key, d, **kw)
    msg = str(ei.value)
    assert msg.startswith(start), f"{msg!r} does not start with {start!r}"
    return msg


@pytest.mark.parametrize("dtype", (torch.float64, torch.float16, torch.int32))
@pytest.mark.parametrize("key", KEYS)
def test_error_table_x_dtype(key: str, dtype: torch.dtype) -> None:
    d = _ops(key)
    d["x"] = d["x"].to(dtype)
    dt = str(dtype).replace("torch.", "")
    _raises(key, d, TypeError, f"{OP_NAMES[key]}: x must be (batch, {KE}) float32, got ({BE}, {KE}) {dt} on cpu")
    d["x"] = d["x"].numpy()
    _raises(key, d, TypeError, f"{OP_NAMES[key]}: x must be (batch, {KE}) float32, got ({BE}, {KE}) {dt} numpy")


_DTYPE_OPERANDS = [(key, name) for key in KEYS
                   for name in (("weight", "bias", "scale", "running_var") if key == "39" else ("weight", "bias"))]


@pytest.mark.parametrize("key,name", _DTYPE_OPERANDS, ids=[f"{k}-{n}" for k, n in _DTYPE_OPERANDS])
def test_error_table_operand_dtype(key: str, name: str) -> None:
    d = _ops(key)
    d[name] = d[name].double()
    _raises(key, d, TypeError, f"{OP_NAMES[key]}: {name} must be float32 on cpu, got ")


@pytest.mark.parametrize("shape", ((BE, KE + 1), (KE,), (1, BE, KE)))
@pytest.mark.parametrize("key", KEYS)
def test_error_table_x_shape(key: str, shape: tuple) -> None:
    d = _ops(key)
    d["x"] = torch.rand(shape)
    _raises(key, d, ValueError, f"{OP_NAMES[key]}: x must be (batch, {KE}) float32 on cpu, got {shape}")


@pytest.mark.parametrize("key", KEYS)
def test_error_table_weight_shape(key: str) -> None:
    d = _ops(key)
    for bad in (torch.rand(NE), torch.rand(0, KE), torch.rand(NE, KE, 1)):
        d["weight"] = bad
        _raises(key, d, ValueError, f"{OP_NAMES[key]}: weight must be (out_features, {KE}) float32 "
                                    f"on cpu, got {tuple(bad.shape)}")
    d["weight"] = torch.rand(NE, KE + 3)   # width differs from x: x is named
    _raises(key, d, ValueError, f"{OP_NAMES[key]}: x must be (batch, {KE + 3}) float32 on cpu, "
                                f"got ({BE}, {KE})")


@pytest.mark.parametrize("key", KEYS)
def test_error_table_bias_and_vector_shapes(key: str) -> None:
    names = ("bias", "scale", "running_mean", "running_var", "bn_weight", "bn_bias") if key == "39" else ("bias",)
    for name in names:
        d = _ops(key)
        d[name] = torch.rand(NE + 1)
        _raises(key, d, ValueError, f"{OP_NAMES[key]}: {name} must be ({NE},) float32 on cpu, got ({NE + 1},)")
    if key == "39":
        d = _ops(key)
        d["running_var"] = None
        _raises(key, d, ValueError, "gemm_scale_batchnorm: give both running_mean and running_var, or neither")


@pytest.mark.parametrize("key", KEYS)
def test_error_table_device_mix(key: str) -> None:
    d = _ops(key)
    d["bias"] = d["bias"].to("meta")
    _raises(key, d, ValueError, f"{OP_NAMES[key]}: bias must be on cpu like x, got ({NE},) float32 on meta")
    d = _ops(key)
    d["x"] = d["x"].to("meta")
    _raises(key, d, ValueError, f"{OP_NAMES[key]}: weight must be on meta like x, got ")


@pytest.mark.parametrize("bad", ([[1.0] * KE] * BE, "x", None, 3.0), ids=("list", "str", "None", "float"))
@pytest.mark.parametrize("key", KEYS)
def test_error_table_non_tensor(key: str, bad: Any) -> None:
    d = _ops(key)
    d["x"] = bad
    _raises(key, d, TypeError, "x must be a torch tensor, a CuPy array, a NumPy array or an object "
                               "with __dlpack__/__dlpack_device__, got ")
    if bad is not None:   # weight=None: see test_weight_none_is_type_error
        d = _ops(key)
        d["weight"] = bad
        _raises(key, d, TypeError, "weight must be a torch tensor, a CuPy array")


@pytest.mark.parametrize("key", KEYS)
def test_weight_none_is_type_error(key: str) -> None:
    d = _ops(key)
    d["weight"] = None
    _raises(key, d, TypeError, f"{OP_NAMES[key]}: weight must be")


def test_error_table_batch_of_one_in_training() -> None:
    msg = f"Expected more than 1 value per channel when training, got input size torch.Size([1, {NE}])"
    _raises("39", _ops("39", batch=1), ValueError, msg)
    assert _call("39", _ops("39", batch=1), training=False).shape == (1, NE)   # eval: fine


@pytest.mark.parametrize("key", ("55", "98"))
def test_error_table_pool_sizes(key: str) -> None:
    _raises(key, _ops(key), ValueError,
            f"{OP_NAMES[key]}: kernel_size {NE + 1} is larger than out_features {NE}", k=NE + 1)
    for bad in (0, -2, True, 2.0, None, "2"):
        _raises(key, _ops(key), ValueError, f"{OP_NAMES[key]}: kernel_size must be a positive int, got ", k=bad)
    with torch.no_grad():
        want = _call(key, _ops(key), k=2)
        for same in ((2,), [2], np.int64(2), np.int32(2)):   # accepted like nn.MaxPool1d
            assert torch.equal(_call(key, _ops(key), k=same), want), repr(same)
    _raises(key, _ops(key), TypeError, f"{OP_NAMES[key]}: scale_factor must be a number, got str",
            scale_factor="0.5")
    _raises(key, _ops(key), ValueError, f"{OP_NAMES[key]}: scale_factor must be a number, got (2,)",
            scale_factor=torch.tensor([0.5, 1.0]))


@pytest.mark.parametrize("key", KEYS)
def test_error_table_zero_size_batch(key: str) -> None:
    d = _ops(key, batch=0)
    before = {n: v.clone() for n, v in d.items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        out = _call(key, d)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert tuple(out.shape) == {"55": (0,), "56": (0, 1), "98": (0,), "39": (0, NE)}[key]
    for n, v in before.items():
        assert torch.equal(d[n], v), f"{n} changed by an empty batch"


@pytest.mark.parametrize("key", KEYS)
def test_error_table_non_contiguous_x(key: str) -> None:
    d = _ops(key)
    with torch.no_grad():
        base = _call(key, {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in d.items()})
    for xv in (d["x"].t().contiguous().t(), torch.cat([d["x"], d["x"]], 1)[:, :KE],
               np.asfortranarray(d["x"].numpy())):
        dd = {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in d.items()}
        dd["x"] = xv
        with torch.no_grad():
            got = _call(key, dd)
        assert torch.equal(as_torch(got), base)


@pytest.mark.parametrize("key", KEYS)
def test_numpy_negative_strides_are_copied(key: str) -> None:
    d = _ops(key)
    nd = {n: (v.numpy().copy() if isinstance(v, torch.Tensor) else v) for n, v in d.items()}
    with torch.no_grad():
        want = as_torch(_call(key, dict(nd, x=nd["x"].copy())))
    rev = np.ascontiguousarray(nd["x"][::-1])[::-1]      # same values, row stride negative
    assert rev.strides[0] < 0 and np.array_equal(rev, nd["x"])
    with torch.no_grad():
        got = as_torch(_call(key, dict(nd, x=rev)))
    assert torch.equal(got, want)


@pytest.mark.parametrize("key", KEYS)
def test_error_table_requires_grad(key: str, fresh_grad_warning: None) -> None:
    """55, 56 and 98 differentiate (fused_linear's autograd) without a warning; 39 is
    forward-only: one warning, a detached result."""
    d = _ops(key)
    d["x"].requires_grad_(True)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = _call(key, d)
        _call(key, d)
    msgs = [str(w.message) for w in rec if issubclass(w.category, UserWarning)]
    if key == "39":
        assert len(msgs) == 1 and msgs[0].startswith(
            f"cupyfuse.{OP_NAMES[key]} is forward-only: "), msgs
        assert out.grad_fn is None and not out.requires_grad
    else:
        assert not msgs, msgs
        assert out.grad_fn is not None
        out.sum().backward()
        assert d["x"].grad is not None and torch.isfinite(d["x"].grad).all()


@pytest.mark.parametrize("key", KEYS)
def test_error_table_numpy_weights_edited_in_place(key: str) -> None:
    """NumPy (on the GPU: CuPy) parameters have no version counter: derived weights are
    rebuilt on every call, so an in-place edit shows in the next result."""
    d = {n: (v.numpy().copy() if isinstance(v, torch.Tensor) else v) for n, v in _ops(key).items()}
    first = as_torch(_call(key, d, training=False))
    d["weight"] *= -1.5
    d["bias"] += 1.0
    second = as_torch(_call(key, d, training=False))
    td = {n: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for n, v in d.items()}
    want = as_torch(_call(key, {n: (v.clone() if isinstance(v, torch.Tensor) else v)
                                for n, v in td.items()}, training=False))
    assert torch.equal(second, want)
    assert not torch.allclose(first, second, atol=1e-3)


@pytest.mark.parametrize("key,k", [("55", 2), ("55", 3), ("56", 0), ("98", 4), ("98", 1), ("39", 0)])
def test_error_table_data_writes_after_clear_cache(key: str, k: int) -> None:
    """Writes through ``param.data`` bypass the version counter; after
    ``cupyfuse.clear_cache()`` every op sees them."""
    init = {"55": (KE, NE, k, 0.5), "56": (KE, NE), "98": (KE, NE, k, 2.0), "39": (KE, NE, (NE,))}[key]
    torch.manual_seed(1)
    model = PROBLEMS[key].model(*init).eval()
    fused = fused_copy(model)
    x = torch.randn(6, KE)
    run_fused(fused, x)                      # builds and caches the plan
    for m in (model, fused):
        lin = linear_of(m)
        lin.weight.data.mul_(-2.0)
        lin.bias.data.add_(1.5)
        if key == "39":
            m.scale.data.mul_(-0.5)
    cupyfuse.clear_cache()
    assert_close_to_ref(run_fused(fused, x), reference(model, x), what=f"{key} after .data + clear_cache")


def test_error_table_float64_module() -> None:
    fused = fused_copy(PROBLEMS["56"].model(KE, NE)).double()
    with pytest.raises(TypeError, match="MatmulSigmoidSumFused: input 0 must be float32, got .* float64"):
        run_fused(fused, torch.rand(3, KE).double())
    with pytest.raises(TypeError, match="MatmulSigmoidSumFused: linear.weight must be float32, got"):
        run_fused(fused, torch.rand(3, KE))


@pytest.mark.parametrize("scale_shape", [(1,), ()], ids=["(1,)", "()"])
def test_39_broadcast_scale_shape(scale_shape: tuple) -> None:
    torch.manual_seed(2)
    model = PROBLEMS["39"].model(KE, NE, scale_shape)
    x = torch.randn(7, KE)
    ref, m64 = reference_with_model(model, x)
    fused = fused_copy(model)
    assert_close_to_ref(run_fused(fused, x), ref, what=f"39 scale_shape={scale_shape}")


# =================================================================================
# 4. Overflow regression tests (the same constructions run on the GPU)
# =================================================================================
def scale_fold_nonfinite_case(device: Any = "cpu") -> tuple[nn.Module, torch.Tensor]:
    """39 with scale = +inf on two columns whose Linear outputs never change sign but whose
    x . W part does: PyTorch computes (z + b) * s = +-inf; the fold z * s + b * s gives
    inf - inf = NaN on the rows where z and b differ in sign."""
    model = PROBLEMS["39"].model(2, 3, (3,))
    with torch.no_grad():
        model.gemm.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]))
        model.gemm.bias.copy_(torch.tensor([5.0, -5.0, 0.25]))
        model.scale.copy_(torch.tensor([float("inf"), float("inf"), 1.5]))
    x = torch.tensor([[0.5, -0.5], [-0.5, 0.5], [0.25, 0.75], [-0.75, -0.25]])
    return model.to(device), x.to(device)


def scale_fold_overflow_case(device: Any = "cpu") -> tuple[nn.Module, torch.Tensor]:
    """39 with bias -2e38 and scale 2: (z + b) * s is finite (+2e38 ... -2.5e38), but the
    folded q = b * s = -4e38 overflows to -inf in float32."""
    model = PROBLEMS["39"].model(1, 1, (1,))
    with torch.no_grad():
        model.gemm.weight.fill_(3e38)
        model.gemm.bias.fill_(-2e38)
        model.scale.fill_(2.0)
    x = torch.tensor([[1.0], [0.5], [0.25]])
    return model.to(device), x.to(device)


def normalise_overflow_case(device: Any = "cpu") -> tuple[nn.Module, torch.Tensor]:
    """39 in training mode, one column of Linear outputs (3e38, -3e38, -3e38): mean -1e38,
    so y - mean = 4e38 overflows float32 in the normalisation; float64 gives 1.414."""
    model = PROBLEMS["39"].model(1, 1, (1,))
    with torch.no_grad():
        model.gemm.weight.fill_(3e38)
        model.gemm.bias.zero_()
        model.scale.fill_(1.0)
    x = torch.tensor([[1.0], [-1.0], [-1.0]])
    return model.to(device), x.to(device)


def pairdiff_overflow_case(which: str, device: Any = "cpu") -> tuple[nn.Module, torch.Tensor]:
    """55 (kernel_size 2) with weights whose pair differences (``d``) or column sum (``s``)
    overflow float32 while every Linear output of the tiny x is ~1e8: the guard bounds
    ||x||_1 max|W| (small), but the shortcut multiplies x by the overflowed derived rows."""
    if which == "difference":
        model = PROBLEMS["55"].model(3, 4, 2, 0.5)
        with torch.no_grad():
            model.matmul.weight.copy_(torch.tensor([[2e38, 0, 0], [-2e38, 0, 0], [1.0, 1, 1], [2.0, 2, 2]]))
            model.matmul.bias.zero_()
        x = torch.tensor([[1e-30, 1e-31, 0.0], [0.0, 1e-30, 2e-30]])
    else:
        model = PROBLEMS["55"].model(3, 300, 2, 0.5)
        with torch.no_grad():
            model.matmul.weight.fill_(1e37)
            model.matmul.weight[::2] *= 1.5
            model.matmul.bias.zero_()
        x = torch.tensor([[1e-30, 2e-30, 0.0], [1e-31, 0.0, 3e-31]])
    return model.to(device), x.to(device)


def run_bug_case(model: nn.Module, x: torch.Tensor, *, placement: bool) -> None:
    """The check shared by the overflow regression tests: fused (on x's device) vs
    PyTorch's float32 model and the float64 reference, both on the CPU (see
    cpu_references)."""
    t32, m32, ref = cpu_references(model, x)
    fused = fused_copy(model)
    out = run_fused(fused, x)
    if placement:   # NaN/inf inputs: PyTorch's float32 placement, element for element
        assert_same_nonfinite(as_torch(out), t32, ref, what="output")
        if model.training:
            for name in ("running_mean", "running_var"):
                assert_same_nonfinite(as_torch(getattr(fused.bn, name)), getattr(m32.bn, name),
                                      what=f"bn.{name}", atol=1e-5)
    else:           # overflow inside the fused algebra only: never worse than float32
        assert_no_worse_than_float32(out, t32, ref, "output")


_FOLD_BUG = ("BUG: plans.batchnorm_plan (plans.py:318) folds the Linear bias into the scale, "
             "q = bias * scale, and the kernels compute y = z * scale + q (plans.py:385, "
             "batchnorm.cu fmaf(z, p, q) at lines 41-54, 90, 122-132) instead of PyTorch's "
             "(z + bias) * scale: ")


@pytest.mark.parametrize("mode", ("eval", "train"))
def test_39_scale_fold_with_infinite_scale(mode: str) -> None:
    model, x = scale_fold_nonfinite_case()
    model.train(mode == "train")
    run_bug_case(model, x, placement=True)


def test_39_scale_fold_overflow() -> None:
    model, x = scale_fold_overflow_case()
    model.eval()
    run_bug_case(model, x, placement=False)


def test_39_normalise_overflow() -> None:
    model, x = normalise_overflow_case()
    run_bug_case(model, x, placement=False)


@pytest.mark.parametrize("which", ("difference", "column_sum"))
def test_55_pairdiff_derived_weight_overflow(which: str) -> None:
    model, x = pairdiff_overflow_case(which)
    run_bug_case(model, x, placement=False)
