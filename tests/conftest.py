"""Shared fixtures and helpers of the CPU test suite.

The reference for every numeric check is the *original* model of ``cupyfuse.kernelbench.models``
run in float64 on the same weights and inputs (PROBLEMS.md, "Correctness protocol").
NaN/inf placement is compared with the float32 original, element for element.

Markers: ``gpu`` and ``slow`` are declared in setup.cfg; nothing is registered here.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `pytest` run without `python -m`
    sys.path.insert(0, str(REPO_ROOT))
TESTS_DIR = Path(__file__).resolve().parent
# the shared helpers (helpers.py, emu/, gen/, corpus/) and the test modules other test
# modules read from, importable from every folder
for _d in [TESTS_DIR] + sorted(d for d in TESTS_DIR.iterdir()
                               if d.is_dir() and d.name in ("api", "backend", "bench", "frontend",
                                                            "ir", "kernelbench", "ops")):
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

import cupyfuse  # noqa: E402
import helpers  # noqa: E402
from hypothesis import settings as _hsettings  # noqa: E402
from cupyfuse import interop  # noqa: E402
from cupyfuse.kernelbench.models import PROBLEMS  # noqa: E402

PROBLEM_KEYS = ("55", "56", "98", "39")

# hypothesis profiles (HYPOTHESIS_PROFILE, see helpers.examples): every property test names
# its own example count, which helpers.examples scales under "thorough"
_hsettings.register_profile("ci", deadline=None)
_hsettings.register_profile("thorough", deadline=None)
_hsettings.load_profile(helpers.PROFILE)


@pytest.fixture
def fp32_matmul():
    """torch's own matmuls in plain fp32 for the test (the float32 references of the GPU
    tests), the previous setting back after it."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old
ATOL = 1e-4
RTOL = 1e-4


# ---------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------
def reference_with_model(model: torch.nn.Module, x: Any) -> tuple[torch.Tensor, torch.nn.Module]:
    """Run a float64 deep copy of ``model`` on ``x.double()``.

    Returns the output and the float64 copy: in training mode model 39's copy has its
    running statistics and num_batches_tracked updated, for the caller to compare. The
    original ``model`` is never modified.
    """
    m64 = copy.deepcopy(model).double()
    xt = torch.as_tensor(x).detach().double()
    with torch.no_grad():
        out = m64(xt)
    return out, m64


def reference(model: torch.nn.Module, x: Any) -> torch.Tensor:
    """The original model in float64 (on a deep copy) applied to ``x.double()``."""
    return reference_with_model(model, x)[0]


def float32_original(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The original model as is (float32) on a deep copy: PyTorch's own NaN/inf placement."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        return m(x)


def run_fused(fused: torch.nn.Module, x: Any) -> Any:
    with torch.no_grad():
        return fused(x)


# ---------------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------------
def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Normwise relative error ``max |out - ref| / max |ref|`` over elements finite in both
    (elementwise relative error is meaningless for outputs near zero, e.g. BatchNorm's)."""
    out = torch.as_tensor(out).double()
    ref = torch.as_tensor(ref).double()
    fin = torch.isfinite(ref) & torch.isfinite(out)
    if not bool(fin.any()):
        return 0.0
    d = (out[fin] - ref[fin]).abs().max()
    return float(d / ref[fin].abs().max().clamp_min(1e-30))


def max_scaled_err(out: torch.Tensor, ref: torch.Tensor, atol: float = ATOL,
                   rtol: float = RTOL) -> float:
    """max |out - ref| / (atol + rtol |ref|): <= 1 is what torch.allclose accepts."""
    out = torch.as_tensor(out).double()
    ref = torch.as_tensor(ref).double()
    fin = torch.isfinite(ref) & torch.isfinite(out)
    if not bool(fin.any()):
        return 0.0
    return float(((out[fin] - ref[fin]).abs() / (atol + rtol * ref[fin].abs())).max())


def assert_close_to_ref(out: Any, ref: torch.Tensor, *, atol: float = ATOL, rtol: float = RTOL,
                        what: str = "") -> float:
    """``torch.allclose(out.double(), ref, atol, rtol)``; returns the max relative error."""
    out = torch.as_tensor(out)
    assert out.dtype == torch.float32, f"{what}: result dtype {out.dtype}, expected float32"
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert bool(torch.isfinite(out).all()), (
        f"{what}: {int((~torch.isfinite(out)).sum())} non-finite elements where the float64 "
        f"reference is finite")
    ok = torch.allclose(out.double(), ref, atol=atol, rtol=rtol)
    rel = max_rel_err(out, ref)
    assert ok, (f"{what}: not allclose(atol={atol}, rtol={rtol}): max |diff| "
                f"{float((out.double() - ref).abs().max()):.3e}, max rel err {rel:.3e}, "
                f"max scaled err {max_scaled_err(out, ref, atol, rtol):.3f}")
    return rel


def assert_same_nonfinite(out: Any, expected32: torch.Tensor, ref: torch.Tensor | None = None,
                          *, atol: float = ATOL, rtol: float = RTOL, what: str = "") -> None:
    """NaN, +inf and -inf placement equal to ``expected32`` (PyTorch float32) element for
    element; elements finite in both are close to ``ref`` (float64) or to ``expected32``."""
    out = torch.as_tensor(out)
    assert tuple(out.shape) == tuple(expected32.shape), what
    for name, fn in (("NaN", torch.isnan), ("+inf", lambda t: torch.isposinf(t)),
                     ("-inf", lambda t: torch.isneginf(t))):
        got, exp = fn(out), fn(expected32)
        if not torch.equal(got, exp):
            bad = (got != exp).nonzero().tolist()[:8]
            raise AssertionError(
                f"{what}: {name} placement differs from PyTorch's float32 model at "
                f"{int((got != exp).sum())} elements, e.g. {bad}: fused "
                f"{[out[tuple(i)].item() for i in bad]} vs torch "
                f"{[expected32[tuple(i)].item() for i in bad]}")
    fin = torch.isfinite(out) & torch.isfinite(expected32)
    if ref is not None:
        fin &= torch.isfinite(ref)
        target = ref
    else:
        target = expected32.double()
    if bool(fin.any()):
        o, t = out[fin].double(), target[fin].double()
        assert torch.allclose(o, t, atol=atol, rtol=rtol), (
            f"{what}: finite elements differ: max |diff| {float((o - t).abs().max()):.3e}, "
            f"max rel {max_rel_err(o, t):.3e}")


# ---------------------------------------------------------------------------------
# Models and inputs
# ---------------------------------------------------------------------------------
def make_original(key: str, init: tuple | list, seed: int = 0, **kwargs: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    return PROBLEMS[key].model(*init, **kwargs)


def small(key: str) -> tuple[int, tuple]:
    batch, init = PROBLEMS[key].sizes["small"]
    return batch, tuple(init)


DISTRIBUTIONS: dict[str, Callable[[int, int, torch.Generator], torch.Tensor]] = {
    # the benchmark's torch.rand
    "rand": lambda b, k, g: torch.rand(b, k, generator=g),
    # Linear outputs spread over several units: sigmoid saturates, maxima move around
    "randn3": lambda b, k, g: torch.randn(b, k, generator=g) * 3,
    # large common offset of every input
    "offset": lambda b, k, g: torch.rand(b, k, generator=g) + 1000.0,
    # large scale
    "x100": lambda b, k, g: torch.rand(b, k, generator=g) * 100.0,
    # all negative
    "neg": lambda b, k, g: -torch.rand(b, k, generator=g),
}


def make_input(dist: str, batch: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + seed)
    return DISTRIBUTIONS[dist](batch, k, g).contiguous()


# ---------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------
@pytest.fixture
def nan_filled_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer an op allocates through ``Call.empty`` starts as NaN (floats) or -1
    (ints, 0xFF bytes), so an element no code path writes can never pass by holding a
    stale or lucky value. The CPU test modules use it for every test
    (``pytestmark = pytest.mark.usefixtures("nan_filled_outputs")``)."""
    orig_empty = interop.Call.empty

    def poisoned_empty(self: Any, shape: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = orig_empty(self, shape, dtype)
        t.fill_(float("nan") if t.dtype.is_floating_point else -1)
        return t

    monkeypatch.setattr(interop.Call, "empty", poisoned_empty)
    if hasattr(interop, "poison_outputs"):
        monkeypatch.setattr(interop, "poison_outputs", True)


@pytest.fixture
def fresh_grad_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget which ops already warned about autograd (the warning is once per op)."""
    monkeypatch.setattr(interop, "_warned_grad", set())


@pytest.fixture
def clean_plan_cache() -> Any:
    cupyfuse.caches.clear_cache()
    yield
    cupyfuse.caches.clear_cache()


# ---------------------------------------------------------------------------------
# Error report: max relative errors per problem/case, printed at the end of the run
# ---------------------------------------------------------------------------------
_ERRORS: dict[str, float] = {}


def record_error(problem: str, case: str, rel: float) -> None:
    key = f"{problem} {case}"
    _ERRORS[key] = max(rel, _ERRORS.get(key, 0.0))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _ERRORS:
        return
    per_problem: dict[str, float] = {}
    for key, val in _ERRORS.items():
        p = key.split()[0]
        per_problem[p] = max(val, per_problem.get(p, 0.0))
    terminalreporter.section("cupyfuse max relative error vs float64 reference (CPU path)")
    for p in sorted(per_problem):
        worst = max((v, k) for k, v in _ERRORS.items() if k.split()[0] == p)
        terminalreporter.write_line(f"  {p}: max rel err {per_problem[p]:.3e}  (worst: {worst[1]})")
