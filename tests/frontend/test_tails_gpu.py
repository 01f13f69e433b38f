"""Open fusion on CUDA: the property tests of tests/frontend/test_tails.py with CUDA tensors.

Marked ``gpu``; skipped without a GPU seen by torch and CuPy. Every whole random
model of tests/gen/tails.py (same generator, same strategies) runs fused on the GPU --
GEMM engine, generated row kernels compiled by NVRTC, column statistics for
BatchNorm in training -- and is compared with a float64 deep copy of itself on the
CPU (``atol=rtol=1e-4``, NaN/+inf/-inf placement, running statistics after each
call). Full-float32 GEMMs (TF32 off) for every test.

Also: fixed-seed cases, wide tails (block sizes and group-sum strategies the drawn
sizes miss), fused_linear with CuPy operands (a CuPy result; operands used in place,
not copied), a non-default torch stream (every launch and GEMM on it; a sleeping stream
proves the ordering), and a fused model re-created over the same weights with another
constant (GEMV coefficient cache).
"""
from __future__ import annotations

import copy
import gc
import math
import os
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, note, settings

from cupyfuse.backend import execute
from cupyfuse import config
from cupyfuse import interop
from cupyfuse.api import from_model, fused_linear
from cupyfuse.interop import prepare_weight
from cupyfuse.interop import cupy_available
from gen.tails import (AffineCoeff, Case, check_nonfinite_coefficients, MaxPairsSum, assert_matches, assert_running_stats, cases,
                      guard_rows, pairdiff_nodes, references, run_case, seeded_case)
from test_tails import (AFFINE_POOL, AFFINE_SUM, FORMS, MAX_PAIRS, _tail_functions,
                            _x_residual_cases, forms_case, run_tail_function)
from helpers import runner_of
from helpers import examples

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and cupy_available()),
                       reason="needs a CUDA GPU visible to both torch and CuPy"),
]


def _settings(n: int) -> settings:
    """Derandomized; no shrinking unless TAILS_SHRINK=1 (each shrink step compiles new
    kernels: minutes), the failing model's source is printed either way."""
    phases = list(Phase) if os.environ.get("TAILS_SHRINK") == "1" else \
        [Phase.explicit, Phase.reuse, Phase.generate]
    return settings(max_examples=examples(n), deadline=None, derandomize=True, database=None,
                    phases=phases, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much,
                                           HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def _poison_fp32_quiet() -> Any:
    """NaN-filled op buffers and full-float32 GEMMs for every test, restored afterwards."""
    old_poison = interop.poison_outputs
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    interop.poison_outputs = True
    torch.backends.cuda.matmul.allow_tf32 = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
    interop.poison_outputs = old_poison
    torch.backends.cuda.matmul.allow_tf32 = old_tf32


def _run(case: Case) -> None:
    note(repr(case))
    run_case(case, "cuda", min_calls=2)
    torch.cuda.synchronize()


# =================================================================================
# 1. Property tests on CUDA (the generator and strategies of test_tails.py)
# =================================================================================
@_settings(25)
@given(cases())
def test_gpu_random_tails(case: Case) -> None:
    _run(case)


@_settings(15)
@given(cases(specials=(1, 2, 3, 5)))
def test_gpu_random_tails_nonfinite_rows(case: Case) -> None:
    _run(case)


@_settings(15)
@given(cases(mode="train", force=("batchnorm",), calls=(1, 2)))
def test_gpu_random_tails_batchnorm_training(case: Case) -> None:
    _run(case)


@_settings(10)
@given(cases(force=("stage",), n_ops=3))
def test_gpu_random_tails_multistage(case: Case) -> None:
    _run(case)


@_settings(8)
@given(cases(has_y=True, force=("y",)))
def test_gpu_random_tails_second_input(case: Case) -> None:
    _run(case)


@_settings(8)
@given(_x_residual_cases())
def test_gpu_random_tails_gemm_input_added_back(case: Case) -> None:
    _run(case)


@_settings(15)
@given(cases(specials=(0, 0, 1, 5), **AFFINE_SUM))
def test_gpu_random_tails_affine_then_feature_sum(case: Case) -> None:
    _run(case)


@_settings(15)
@given(cases(specials=(0, 0, 1, 5), **AFFINE_POOL))
def test_gpu_random_tails_affine_then_pooling(case: Case) -> None:
    _run(case)


@_settings(15)
@given(cases(specials=(0, 0, 1, 5), **MAX_PAIRS))
def test_gpu_random_tails_max_pairs(case: Case) -> None:
    _run(case)


@_settings(10)
@given(cases(force=("groupnorm",), allow=("groupnorm", "const", "unary", "param", "residual",
                                          "layernorm", "softmax", "pool")))
def test_gpu_random_tails_norms(case: Case) -> None:
    _run(case)


@_settings(12)
@given(_tail_functions())
def test_gpu_random_tail_functions_fused_linear(args: tuple) -> None:
    note(repr(args[0]))
    run_tail_function(*args, device="cuda")
    torch.cuda.synchronize()


@pytest.mark.parametrize("seed", range(12))
def test_gpu_seeded_tails(seed: int) -> None:
    """Fixed seeds of the same generator (random.Random): reproducible by test id."""
    case = seeded_case(seed)
    run_case(case, "cuda")


@pytest.mark.parametrize("seed", [37, 52, 56, 62, 71, 88])
def test_gpu_seeded_tails_with_derived_params(seed: int) -> None:
    """Seeds whose drawn model has a per-feature tensor computed from a matrix alone
    (test_tails.derived_param_seeds; the derived sources the tail reads), 4 calls:
    the general path, the prepared launches, the specialised call."""
    case = seeded_case(seed)
    assert "param.derived" in case.spec.ops, "the generator's draws moved: update the seeds"
    run_case(case, "cuda", min_calls=4)


LARGE = [(1000 + s, m) for s in range(2) for m in ("train", "eval")]


@pytest.mark.parametrize("seed,mode", LARGE)
def test_gpu_seeded_tails_large_batch(seed: int, mode: str) -> None:
    """Batches of hundreds of rows (BatchNorm's statistics in several chunks)."""
    case = seeded_case(seed, force=("batchnorm",), mode=mode)
    case.batch = 300 + 97 * (seed % 7)
    run_case(case, "cuda")


# =================================================================================
# 2. Wide tails
# =================================================================================
class _Wide(nn.Module):
    def __init__(self, k: int, n: int, groups: int) -> None:
        super().__init__()
        self.fc = nn.Linear(k, n)
        self.gn = nn.GroupNorm(groups, n)
        self.p = nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * self.p
        h = self.gn(h)
        h = torch.softmax(h, dim=1) + h.amax(dim=1, keepdim=True) - h.mean(dim=1, keepdim=True)
        h = F.max_pool1d(h.unsqueeze(1), 3, 2).squeeze(1)
        return torch.logsumexp(h, dim=1, keepdim=True) + F.gelu(h)


@pytest.mark.parametrize("n,groups,batch", [(4096, 2, 17), (4096, 1024, 9), (20000, 10000, 5),
                                            (1000, 250, 64), (300, 3, 129), (2047, 23, 3)])
def test_gpu_wide_tails(n: int, groups: int, batch: int) -> None:
    torch.manual_seed(n)
    m = _Wide(96, n, groups).eval()
    g = torch.Generator().manual_seed(groups)
    x = torch.randn(batch, 96, generator=g) * 3
    x[batch // 2, 7] = float("nan")
    ref64, _, ref32 = references(m, [x])
    out = from_model(m.cuda())(x.cuda())
    assert_matches(out, ref64, ref32, f"n={n} groups={groups}")


# =================================================================================
# 3. CuPy operands, streams
# =================================================================================
def _tail_for_cupy(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(h, (45,)) * torch.sigmoid(y) + h.sum(dim=1, keepdim=True) * 0.01


def test_gpu_fused_linear_cupy_operands_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """CuPy x, weight, bias and extra operand: the result is a CuPy array on the same
    device, and run_gpu reads the caller's own buffers (same device pointers: no copy)."""
    import cupy


    from cupyfuse.backend import prepared

    seen: dict[str, list[int]] = {}
    real = execute.run_gpu
    real_prepared = prepared.Prepared.__call__

    def recording(prog: Any, inputs: Any, sources: Any, *a: Any, **k: Any) -> Any:
        seen["inputs"] = [t.data_ptr() for t in inputs]
        seen["sources"] = [t.data_ptr() for t in sources if isinstance(t, torch.Tensor)]
        return real(prog, inputs, sources, *a, **k)

    def recording_prepared(self: Any, in_ptrs: Any, src_ptrs: Any, *a: Any, **k: Any) -> Any:
        # the prepared launches (this small batch's path): the addresses they patch in
        seen["inputs"], seen["sources"] = list(in_ptrs), list(src_ptrs)
        return real_prepared(self, in_ptrs, src_ptrs, *a, **k)

    monkeypatch.setattr(execute, "run_gpu", recording)
    monkeypatch.setattr(prepared.Prepared, "__call__", recording_prepared)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 30, generator=g)
    w = torch.randn(45, 30, generator=g) / math.sqrt(30)
    b = torch.randn(45, generator=g)
    y = torch.randn(13, 45, generator=g)
    xc, wc, bc, yc = (cupy.asarray(t.numpy()) for t in (x, w, b, y))
    out = fused_linear(xc, wc, bc, _tail_for_cupy, yc)
    assert isinstance(out, cupy.ndarray) and out.dtype == cupy.float32 and out.shape == (13, 45)
    assert out.device.id == xc.device.id
    assert seen["inputs"] == [xc.data.ptr, yc.data.ptr], (seen, xc.data.ptr, yc.data.ptr)
    assert seen["sources"][:2] == [wc.data.ptr, bc.data.ptr], seen
    with torch.no_grad():
        ref64 = _tail_for_cupy(x.double() @ w.double().t() + b.double(), y.double())
        ref32 = _tail_for_cupy(x @ w.t() + b, y)
    assert_matches(torch.from_numpy(cupy.asnumpy(out)), ref64, ref32, "cupy")
    # the same operands as torch CUDA tensors give a torch tensor, same values
    out_t = fused_linear(*(torch.as_tensor(a, device="cuda") for a in (xc, wc, bc)),
                         _tail_for_cupy, torch.as_tensor(yc, device="cuda"))
    assert isinstance(out_t, torch.Tensor) and out_t.is_cuda
    assert torch.equal(out_t.cpu(), torch.from_numpy(cupy.asnumpy(out)))


class _StreamModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 80)
        self.bn = nn.BatchNorm1d(80)
        self.fc2 = nn.Linear(80, 33)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.bn(self.fc1(x)))
        h = self.fc2(h)
        return torch.log_softmax(h, dim=1) + h.sum(dim=1, keepdim=True) * 0.1


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_gpu_non_default_torch_stream(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``torch.cuda.stream(s)``: every kernel launch and GEMM is on s; with s kept
    busy by a sleep and x written on s after it, work on any other stream would read
    the stale x."""
    import cupy

    from cupyfuse.backend import gemm, prepared, runtime

    launched: list[int] = []
    gemms: list[int] = []
    real_launch, real_gemm = runtime.launch, gemm.linear_nobias
    real_prepared = prepared.Prepared.__call__

    def rec_launch(*a: Any, **k: Any) -> Any:
        launched.append(k.get("stream") or cupy.cuda.get_current_stream().ptr)
        return real_launch(*a, **k)

    def rec_gemm(*a: Any, **k: Any) -> Any:
        gemms.append(torch.cuda.current_stream().cuda_stream)
        return real_gemm(*a, **k)

    def rec_prepared(self: Any, in_ptrs: Any, src_ptrs: Any, stream: int, *a: Any) -> Any:
        # prepared launches (skinny GEMM and tail) go to the stream they are given
        launched.append(stream)
        gemms.append(stream)
        return real_prepared(self, in_ptrs, src_ptrs, stream, *a)

    monkeypatch.setattr(runtime, "launch", rec_launch)
    monkeypatch.setattr(gemm, "linear_nobias", rec_gemm)
    monkeypatch.setattr(prepared.Prepared, "__call__", rec_prepared)
    torch.manual_seed(0)
    m = _StreamModel().train(mode == "train")
    x_real = torch.randn(50, 64) * 2
    ref64, m64, ref32 = references(m, [x_real])
    # compile the kernels first, through a twin (same shapes: the same kernels)
    warm = _StreamModel().train(mode == "train").cuda()
    from_model(warm)(torch.randn(50, 64, device="cuda"))
    torch.cuda.synchronize()
    launched.clear()
    gemms.clear()
    fm = from_model(m.cuda())
    x_src = x_real.cuda()
    xs = torch.zeros(50, 64, device="cuda")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        xs.copy_(x_src)
        out = fm(xs)
    assert launched and all(p == s.cuda_stream for p in launched), (s.cuda_stream, launched)
    assert gemms and all(p == s.cuda_stream for p in gemms), (s.cuda_stream, gemms)
    s.synchronize()
    assert_matches(out, ref64, ref32, f"stream {mode}")
    assert_running_stats(m, m64, f"stream {mode}")


class _ScaleSum(nn.Module):
    """A Python float baked into the program; its feature sum becomes a cached GEMV."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh((self.fc(x) * self.scale + 1.0).sum(dim=1, keepdim=True) * 0.05)


def test_gpu_new_fused_model_over_same_weights_new_constant() -> None:
    """from_model re-created over the same module after a Python constant changed: each
    new fused model must use its own constant (nothing cached from the old program)."""
    torch.manual_seed(0)
    m = _ScaleSum()
    x = torch.randn(7, 16)
    m.cuda()
    for scale in (2.0, 3.0, -1.0, 0.5, 7.0, 2.0):
        m.scale = scale
        with torch.no_grad():
            m64 = _ScaleSum()
            m64.load_state_dict(m.state_dict())
            m64.scale = scale
            m64 = m64.double().cpu()
            ref64 = m64(x.double())
            ref32 = m64.float()(x)
        fm = from_model(m)
        out = fm(x.cuda())
        assert_matches(out, ref64, ref32, f"scale {scale}")
        del fm, out
        gc.collect()


def test_gpu_fused_class_module_moved_to_cuda() -> None:
    case = seeded_case(77, force=("layernorm", "reduce"))
    case.api = "fused_class"
    run_case(case, "cuda")


# =================================================================================
# 4. Regression tests: each names the failure it guards against
# =================================================================================
def _check_on_cuda(m: nn.Module, *inputs: torch.Tensor) -> None:
    ref64, _, ref32 = references(m, list(inputs))
    out = from_model(m.cuda())(*[t.cuda() for t in inputs])
    torch.cuda.synchronize()
    assert_matches(out, ref64, ref32)


class _BiasFreeChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(19, 64, bias=False)
        self.fc2 = nn.Linear(64, 52)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc2(self.fc1(x)))


# A GEMM (or GEMV) output that a tail kernel must write (the input of the next Linear, or
# the program's output) keeps the buffer the GEMM wrote: codegen.plan/run_gpu must not give
# it a fresh torch.empty buffer after the GEMM (uninitialised memory). (These three tests.)
def test_regression_gpu_bias_free_linear_into_linear() -> None:
    torch.manual_seed(0)
    _check_on_cuda(_BiasFreeChain(), torch.randn(16, 19) * 3)


def test_regression_gpu_fused_linear_without_bias_or_tail() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 24, generator=g), torch.randn(40, 24, generator=g)
    out = fused_linear(x.cuda(), w.cuda(), None, None)
    torch.cuda.synchronize()
    assert torch.allclose(out.cpu().double(), x.double() @ w.double().t(), atol=1e-4, rtol=1e-4)


class _SumOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * 2.0 + 1.0).sum(dim=1, keepdim=True)


def test_regression_gpu_feature_sum_is_the_output() -> None:
    torch.manual_seed(0)
    _check_on_cuda(_SumOut(), torch.randn(7, 16))


class _PoolToOneBroadcast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(14, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return F.avg_pool1d(h.unsqueeze(1), 4).squeeze(1) - h


# A width-1 pooling or BatchNorm1d(1) value broadcast against a wider value is evaluated at
# feature index 0, not at the broadcast index f (pool reading v(f*s+j), bn mean[f]/invstd[f]
# would read past the row / the statistics). (These two tests.)
def test_regression_gpu_width_one_pool_broadcast() -> None:
    torch.manual_seed(0)
    _check_on_cuda(_PoolToOneBroadcast(), torch.randn(32, 14))


class _BatchNormOneBroadcast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(28, 13)
        self.bn = nn.BatchNorm1d(1)
        self.p = nn.Parameter(torch.randn(13))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.minimum(self.bn(h.amax(dim=1, keepdim=True)), self.p)


def test_regression_gpu_batchnorm_one_feature_broadcast() -> None:
    """BatchNorm1d(1) on batch statistics (training), broadcast against 13 features."""
    torch.manual_seed(0)
    _check_on_cuda(_BatchNormOneBroadcast().train(), torch.randn(300, 28) * 50 + 100)


_CLOSURE_ON_CPU = r"""
import torch
from cupyfuse.api import fused_linear
P = torch.randn(8)
def tail(h):
    return h * P
x, w = torch.randn(4, 5, device="cuda"), torch.randn(8, 5, device="cuda")
try:
    fused_linear(x, w, None, tail)
    torch.cuda.synchronize()
    print("RESULT")
except (ValueError, TypeError) as exc:
    print("CLEAN", type(exc).__name__, exc)
except Exception as exc:
    print("OTHER", type(exc).__name__, str(exc).splitlines()[0])
"""


# fused_linear checks a tensor the tail function closes over against x's device: a CPU
# tensor with CUDA operands raises ValueError like the module path (read through a host
# pointer, it would be cudaErrorIllegalAddress, the process's CUDA context lost).
def test_regression_gpu_tail_function_closure_on_other_device() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", _CLOSURE_ON_CPU], capture_output=True, text=True,
                       timeout=300, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert r.stdout.startswith("CLEAN"), (r.stdout + r.stderr)[-2000:]


# =================================================================================
# 5. The GEMV rewrite's kernel (kernels_cu/tail_rewrite.cu): guard and direct rows on the GPU
# =================================================================================
class _AffineSum(nn.Module):
    """sum_f (a_f h_f + c_f): a GEMV with colsum(a * W) after the rewrite; the weight held
    as W (a Linear) or as W.T (x @ P, the transposed source)."""

    def __init__(self, k: int, n: int, transposed: bool) -> None:
        super().__init__()
        self.transposed = transposed
        self.w = nn.Parameter(torch.randn(k, n) if transposed else torch.randn(n, k))
        self.a = nn.Parameter(torch.rand(n) + 0.5)
        self.c = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w if self.transposed else F.linear(x, self.w)
        return (h * self.a + self.c).sum(dim=1, keepdim=True)


@pytest.mark.parametrize("batch,k,n,transposed", [
    (1, 64, 129, False), (6, 7, 33, False), (6, 64, 129, True), (37, 1000, 65, False),
    (300, 96, 40, True), (700, 256, 512, False)])
def test_gpu_gemv_rewrite_guard_and_direct_rows(batch: int, k: int, n: int,
                                                transposed: bool) -> None:
    torch.manual_seed(batch + k)
    m = _AffineSum(k, n, transposed)
    x = guard_rows(batch, k, seed=k + n)
    ref64, _, ref32 = references(m, [x])
    fm = from_model(m.cuda())
    xc = x.cuda()
    for call in range(3):   # the general path, then the prepared launches
        out = fm(xc)
        torch.cuda.synchronize()
        assert_matches(out, ref64, ref32, f"call {call}")
    progs = list(runner_of(fm).programs.values())
    assert any(nd.kind == "gemv" for nd in progs[0].nodes), "the rewrite did not apply"


def test_gpu_gemv_rewrite_follows_the_bias_and_parameter_edits() -> None:
    """The coefficients are cached on the weight but read the bias (and a, c): a new bias
    object or an in-place edit must be seen, by the general path and the prepared one."""
    torch.manual_seed(3)
    W = torch.randn(48, 40, device="cuda")
    x = torch.randn(9, 40, device="cuda")

    def tail(h: torch.Tensor) -> torch.Tensor:
        return (h * 0.5 - 1.0).sum(dim=1)

    for step in range(4):
        b = torch.randn(48, device="cuda")
        for call in range(2):
            out = fused_linear(x, W, b, tail)
            ref = ((x.double() @ W.double().t() + b.double()) * 0.5 - 1.0).sum(1)
            assert torch.allclose(out.double(), ref, atol=1e-4, rtol=1e-4), (step, call)
    m = _AffineSum(40, 48, False).cuda()
    fm = from_model(m)
    for step in range(3):
        with torch.no_grad():
            m.c.add_(1.0)
            m.a.mul_(1.5)
            m.w.add_(0.25)
        ref64, _, ref32 = references(copy.deepcopy(m).cpu(), [x.cpu()])
        out = fm(x)
        assert_matches(out, ref64, ref32, f"edit {step}")


def test_gpu_gemv_rewrite_weight_with_inf() -> None:
    """A weight with an infinite element: every row fails the guard; torch's GEMM path."""
    torch.manual_seed(5)
    m = _AffineSum(32, 20, False)
    with torch.no_grad():
        m.w[3, 4] = float("inf")
    x = torch.randn(10, 32)
    x[2, 4] = 0.0   # 0 * inf: NaN in that row
    ref64, _, ref32 = references(m, [x])
    fm = from_model(m.cuda())
    for call in range(2):
        assert_matches(fm(x.cuda()), ref64, ref32, f"call {call}")


@pytest.mark.parametrize("form", FORMS)
def test_gpu_written_forms_match_float64(form: str) -> None:
    """test_tails.py's hand-written forms (addmm, einsum, h.shape[1:], PReLU per channel,
    Softmin, adaptive pooling, RReLU in eval, composite activations, selects, cat) on CUDA."""
    m, x, ref64, ref32 = forms_case(form)
    fm = from_model(m.cuda())
    for call in range(2):
        assert_matches(fm(x.cuda()), ref64, ref32, f"{form}, call {call}")


def _edits_then_general_or_prepared(m: nn.Module, x: torch.Tensor, general_after: bool) -> Any:
    """from_model(m) on CUDA (sharing m's parameters, which have ``a`` and ``c``), called
    three times, then three more after an in-place edit of a and c: every result matches
    float64, and each call after the first (and every call after the edit) takes the
    general path exactly when ``general_after``. Returns the fused module."""

    fm = from_model(m.cuda())
    xc = x.cuda()
    general = []
    real = execute.run_gpu

    def counting(*a, **kw):
        general.append(1)
        return real(*a, **kw)

    for edit in (False, True):
        if edit:
            with torch.no_grad():
                m.a.mul_(-0.5)
                m.c.add_(1.0)
        ref64, _, ref32 = references(copy.deepcopy(m).cpu(), [x])
        for call in range(3):
            general.clear()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(execute, "run_gpu", counting)
                out = fm(xc)
            torch.cuda.synchronize()
            assert_matches(out, ref64, ref32, f"edit {edit}, call {call}")
            if call > 0 or edit:
                assert bool(general) == general_after, \
                    f"edit {edit}, call {call}: general path {bool(general)}"
    return fm


class _AffinePool(nn.Module):
    """avg_pool1d(a * h + c) (window k, stride k) then a row max, as 98: a GEMM with the
    window-averaged weight after the rewrite."""

    def __init__(self, k_in: int, n: int, win: int, transposed: bool) -> None:
        super().__init__()
        self.transposed, self.win = transposed, win
        self.w = nn.Parameter(torch.randn(k_in, n) if transposed else torch.randn(n, k_in))
        self.a = nn.Parameter(torch.rand(n) + 0.5)
        self.c = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w if self.transposed else F.linear(x, self.w)
        p = F.avg_pool1d((h * self.a + self.c).unsqueeze(1), self.win).squeeze(1)
        return F.gelu(p).amax(dim=1)


@pytest.mark.parametrize("batch,k,n,win,transposed", [
    (1, 64, 128, 4, False), (6, 7, 33, 2, False), (6, 64, 130, 16, True),
    (37, 1000, 64, 8, False), (700, 256, 512, 16, False), (2048, 4096, 1024, 16, False)])
def test_gpu_fold_rewrite_guard_and_direct_rows(batch: int, k: int, n: int, win: int,
                                                transposed: bool) -> None:
    """The folded GEMM and fold_rows: the general path on the first call, prepared launches
    after it (skinny kernel, engine, and the engine past ENGINE_MAX_MK for a narrow folded
    GEMM) -- except for a transposed weight source, which stays on the general path --
    and a parameter edited in place is seen by both."""
    torch.manual_seed(batch + k + win)
    m = _AffinePool(k, n, win, transposed)
    x = guard_rows(batch, k, seed=k + n + win)
    fm = _edits_then_general_or_prepared(m, x, transposed)
    progs = list(runner_of(fm).programs.values())
    assert any(nd.kind == "gemm" and len(nd.attrs) > 2 for nd in progs[0].nodes), \
        "the fold did not apply"


@pytest.mark.parametrize("batch,k,n,kw,general_after", [
    (1, 64, 128, {}, False), (6, 7, 33, {}, False), (6, 64, 130, {"transposed": True}, True),
    (37, 1000, 64, {"keepdim": True}, False), (300, 256, 511, {"mean": True}, False),
    (700, 256, 512, {}, False), (1024, 4096, 1024, {"negative": False}, False),
    (2048, 4096, 1024, {}, True)])
def test_gpu_pairdiff_rewrite_guard_and_direct_rows(batch: int, k: int, n: int, kw: dict,
                                                    general_after: bool) -> None:
    """The GEMM on the pair differences and pairdiff_rows: the general path on the first
    call, prepared launches after it (skinny kernel, engine) -- except for a transposed
    weight source, and past the prepared engine's sizes (2048 x 4096 x 516 multiply-adds
    > 2^32), which stay on the general path -- matching float64 on normal, NaN, +-inf and
    guard-flagged rows; a parameter edited in place is seen by both."""
    torch.manual_seed(batch + k + n)
    m = MaxPairsSum(k, n, **kw)
    x = guard_rows(batch, k, seed=k + n)
    fm = _edits_then_general_or_prepared(m, x, general_after)
    assert pairdiff_nodes(fm) == 1, "the pair-difference rewrite did not apply"


@pytest.mark.parametrize("form,batch,k,n", [
    ("pool", 700, 256, 512), ("pool", 1024, 2048, 1024), ("pool", 2048, 4096, 1024),
    ("pairs", 700, 256, 512), ("pairs", 2048, 4096, 1024)])
def test_gpu_fold_guard_row_maxima_reset(form: str, batch: int, k: int, n: int) -> None:
    """The engine's x split leaves each row's max |x| for the fold guards, which set it
    back to zero: a NaN, inf or guard-flagged row in one call must leave no trace in the
    next call's same rows (prepared engine launches with a kept workspace, and the
    general path past their sizes), and the other way round."""
    torch.manual_seed(batch + k)
    m = _AffinePool(k, n, 16, False) if form == "pool" else MaxPairsSum(k, n)
    mc = copy.deepcopy(m)
    fm = from_model(m.cuda())
    g = torch.Generator().manual_seed(k)
    xs = [guard_rows(batch, k, seed=n), torch.randn(batch, k, generator=g) * 3,
          guard_rows(batch, k, seed=n + 1), torch.rand(batch, k, generator=g)]
    for call, x in enumerate(xs + xs):
        ref64, _, ref32 = references(mc, [x])
        with torch.no_grad():
            out = fm(x.cuda())
        assert_matches(out, ref64, ref32, f"{form} call {call}")


def test_gpu_pairdiff_rewrite_weight_with_inf() -> None:
    """An infinite weight element: every row takes the direct route (torch's), NaN and
    infinities placed as PyTorch places them."""
    torch.manual_seed(3)
    m = MaxPairsSum(32, 20)
    with torch.no_grad():
        m.w[3, 4] = float("inf")
    x = torch.randn(10, 32)
    x[2, 4] = 0.0   # 0 * inf: NaN in that row
    ref64, _, ref32 = references(m, [x])
    fm = from_model(m.cuda())
    for call in range(2):
        assert_matches(fm(x.cuda()), ref64, ref32, f"call {call}")
    assert pairdiff_nodes(fm) == 1


@pytest.mark.parametrize("kind", ["pairdiff", "avgpool", "gemv"])
def test_gpu_fused_linear_keeps_derived_weights_of_parameters(kind: str) -> None:
    """fused_linear with parameters (requiring grad) past the prepared sizes: the
    rewrites' derived weights are built once and reused (not rebuilt every call, as a key
    on the detached bias view, a new object each call, would do), rebuilt after an in-place
    edit of the bias, and the result follows the edit."""
    from cupyfuse.ir import rewrite

    torch.manual_seed(5)
    batch, k, n = 2048, 4096, (4096 if kind == "avgpool" else 1024)
    w = nn.Parameter((torch.rand(n, k, device="cuda") * 2 - 1) / k ** 0.5)
    b = nn.Parameter(torch.rand(n, device="cuda") - 0.5)
    x = torch.rand(batch, k, device="cuda")
    tails = {"pairdiff": lambda h: F.max_pool1d(h.unsqueeze(1), 2).squeeze(1).sum(1),
             "avgpool": lambda h: F.avg_pool1d(h.unsqueeze(1), 2).squeeze(1).amax(1),
             "gemv": lambda h: (h * 0.5).sum(1)}
    tail = tails[kind]
    builds = []
    name = "_coefficients" if kind == "gemv" else None
    with pytest.MonkeyPatch.context() as mp:
        if name is not None:
            real = rewrite._coefficients
            mp.setattr(rewrite, "_coefficients", lambda *a: builds.append(1) or real(*a))
        else:
            real = rewrite._FOLDS[kind]
            mp.setitem(rewrite._FOLDS, kind, lambda *a: builds.append(1) or real(*a))
        for call in range(3):
            fused_linear(x, w, b, tail)
        torch.cuda.synchronize()
        assert len(builds) == 1, f"{kind}: derived weights built {len(builds)} times in 3 calls"
        with torch.no_grad():
            b.add_(0.25)
        out = fused_linear(x, w, b, tail)
        assert len(builds) == 2, f"{kind}: not rebuilt after the bias edit ({len(builds)})"
    with torch.no_grad():
        h64 = x.double().cpu() @ w.double().cpu().t() + b.double().cpu()
        ref64 = tail(h64)
        ref32 = tail(x @ w.t() + b).cpu()
    assert_matches(out, ref64, ref32, kind)


# =================================================================================
# 6. Tails inside the GEMM: the sm90 engine's generated epilogues (codegen.Epilogue)
# =================================================================================
@pytest.fixture
def epilogue_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    """Counts the GEMMs that ran with a tail as their epilogue (gemm.linear_epilogue)."""
    from cupyfuse.backend import gemm

    calls: list = []
    real = gemm.linear_epilogue

    def counted(*a: Any, **kw: Any) -> None:
        calls.append(a[4])   # its row reductions
        return real(*a, **kw)

    monkeypatch.setattr(gemm, "linear_epilogue", counted)
    return calls


@pytest.fixture
def engine_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every GEMM on the 3xTF32 engine's general path, K never split: no skinny kernel, no
    prepared launches, no certified row maxima (ir/certify.py: a max/min tail would run
    after a TF32 pass instead) -- so the drawn small models run their tails as epilogues
    (grids of fewer tiles than SMs: slow, and the same results)."""
    from cupyfuse.backend import engine

    monkeypatch.setattr(config, "CERTIFY", False)
    for name in ("SKINNY_MAX_M", "SKINNY_SMALL_MAX_M", "ENGINE_MAX_M", "ENGINE_MAX_MK",
                 "ENGINE_MAX_MNK"):
        monkeypatch.setattr(config, name, 0)
    monkeypatch.setattr(engine, "_splits_for", lambda tiles, kblocks, sm: 1)


@_settings(30)
@given(case=cases(specials=(0, 0, 1, 3)))
def test_gpu_random_tails_as_gemm_epilogues(engine_everywhere: None, epilogue_calls: list,
                                            case: Case) -> None:
    """The drawn models (any op, NaN/inf rows, odd widths) with every eligible level
    inside the GEMM: float64 reference at 1e-4 as everywhere."""
    _run(case)


def test_gpu_epilogues_run_for_elementwise_and_reduction_tails(
        engine_everywhere: None, epilogue_calls: list) -> None:
    """Drawn tails of elementwise ops and row reductions (fixed seeds): every one matches
    float64, and epilogues with and without row reductions did run among them (the
    property test above would pass with none)."""
    for seed in range(16):
        allow = ("const", "param", "unary", "residual", "reduce", "y")
        case = seeded_case(300 + seed, allow=allow, force=("reduce",) if seed % 2 else ("unary",),
                           reduce_kinds=("sum", "max", "min", "mean"))
        case.batch = 37
        run_case(case, "cuda", min_calls=2)
    torch.cuda.synchronize()
    assert any(n == 0 for n in epilogue_calls), "no elementwise epilogue ran"
    assert any(n > 0 for n in epilogue_calls), "no epilogue with a row reduction ran"


class _EpiRows(nn.Module):
    """T2: row reductions of different kinds of an elementwise chain (a residual of h and
    a per-feature parameter)."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.fc = nn.Linear(k, n)
        self.p = nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        g = F.gelu(h * self.p) - 0.25 * h
        return torch.sigmoid(g).sum(dim=1, keepdim=True) * 0.5 + g.amax(dim=1, keepdim=True)


class _EpiMin(nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.fc = nn.Linear(k, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.hardswish(self.fc(x)).amin(dim=1) * 2.0


class _EpiElem(nn.Module):
    """T0: the (batch, N) output written by the epilogue itself."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.fc = nn.Linear(k, n)
        self.p = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return F.silu(h * self.p) - 0.25 * h


# past the prepared launches' sizes (batch > 512, batch x K > 4M, batch x K x N > 2^32)
@pytest.mark.parametrize("cls,batch,k,n", [(_EpiRows, 2048, 2304, 1157), (_EpiMin, 2600, 2304, 1290),
                                           (_EpiRows, 4099, 1280, 1031), (_EpiElem, 2200, 2048, 1155)])
def test_gpu_epilogue_at_engine_sizes(cls: type, batch: int, k: int, n: int,
                                      epilogue_calls: list,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizes the engine's general path takes unpatched (many row blocks and column tiles,
    K unsplit): the epilogue runs, matches float64 with NaN/inf rows, and gives the same
    bits on every call. (Certified row maxima off: _EpiMin's min tail would run after a
    TF32 pass there, tests/backend/test_certified_gpu.py.)"""
    from cupyfuse.ir import certify

    monkeypatch.setattr(config, "CERTIFY", False)
    torch.manual_seed(k)
    m = cls(k, n)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(batch, k, generator=g)
    x[3, 5] = float("nan")
    x[batch - 1, 0] = float("inf")
    ref64, _, ref32 = references(m, [x])
    fm = from_model(m.cuda())
    xc = x.cuda()
    out = fm(xc)
    assert epilogue_calls, "the epilogue did not run at an engine size"
    assert_matches(out, ref64, ref32, f"{cls.__name__} {batch}x{k}x{n}")
    again = fm(xc)
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(again)) and \
        torch.equal(out.isnan(), again.isnan()), "two calls gave different bits"


def test_gpu_epilogue_with_cupy_operands(epilogue_calls: list) -> None:
    """fused_linear with CuPy operands and a tail function: the epilogue path on CuPy's
    stream, a CuPy result."""
    import cupy

    g = torch.Generator().manual_seed(7)
    x = torch.randn(2048, 2304, generator=g)
    w = torch.randn(1100, 2304, generator=g) / 48
    b = torch.randn(1100, generator=g)

    def tail(h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h).sum(dim=1, keepdim=True) + h.amax(dim=1, keepdim=True)

    ref = tail(torch.nn.functional.linear(x.double(), w.double(), b.double()))
    wc = cupy.asarray(w.numpy())
    # a prepared CuPy weight keeps the engine's split: the tail runs in its epilogue; a
    # plain one keeps none, so its GEMM is cuBLAS's (gemm.uncached), the tail after it
    for weight, epilogue in ((prepare_weight(wc), True), (wc, False)):
        epilogue_calls.clear()
        with cupy.cuda.Stream():
            out = fused_linear(cupy.asarray(x.numpy()), weight, cupy.asarray(b.numpy()), tail)
            cupy.cuda.get_current_stream().synchronize()
        assert isinstance(out, cupy.ndarray)
        assert bool(epilogue_calls) == epilogue
        torch.testing.assert_close(torch.from_numpy(cupy.asnumpy(out)).double(), ref,
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("batch", [1, 2])
def test_group_norm_one_value_per_group_at_one_row_raises_every_call(batch):
    """torch's error at one row (GroupNorm with one value per group), on every call: the
    one-row program is never prepared; other batches run (and prepare) as usual."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.GroupNorm(8, 8)).cuda()
    fused = from_model(model)
    x = torch.randn(batch, 64, device="cuda")
    for _ in range(3):
        with torch.no_grad():
            if batch == 1:
                with pytest.raises(ValueError, match=r"more than 1 value per channel .*\[1, 8\]"):
                    fused(x)
            else:
                torch.testing.assert_close(fused(x), model(x), atol=1e-4, rtol=1e-4)


def test_gpu_seeded_tails_split_k_prepared(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawn tails at the prepared engine's batches with K deep enough to split (K = 1024):
    the second and third calls run the ready plan, where a split GEMM's only tail kernel
    sums the partial products itself (config.KSUM_IN_TAIL); such kernels did run."""
    from cupyfuse.backend import runtime

    names: list[str] = []
    real = runtime.generated_kernel

    def recorded(name: str, source: str, device_id: int) -> Any:
        names.append(name)
        return real(name, source, device_id)

    monkeypatch.setattr(runtime, "generated_kernel", recorded)
    for seed in range(12):
        case = seeded_case(700 + seed, K=1024)
        case.batch = (40, 97, 200, 333)[seed % 4]
        try:
            run_case(case, "cuda", min_calls=3)
        except AssertionError as exc:
            raise AssertionError(f"seed {700 + seed}: {case!r}") from exc
    torch.cuda.synchronize()
    assert sum("_ks" in n for n in names) >= 3, "too few tails read split-K partial products"


@pytest.mark.parametrize("form", AffineCoeff.FORMS)
@pytest.mark.parametrize("batch", [1, 8, 300])
def test_gpu_rewrite_nonfinite_coefficient_runs_unrewritten(form: str, batch: int) -> None:
    """As the CPU test: three calls per parameter version (the prepared launches after
    the first), the GEMV / fold kernels and their prepared steps stepping aside for the
    unrewritten program while a coefficient is not finite."""
    check_nonfinite_coefficients(form, batch, "cuda", calls=3)
