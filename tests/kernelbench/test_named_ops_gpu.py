"""GPU tests: every op and wrapper against the float64 reference, interop, streams.

Marked ``gpu``; skipped cleanly (with the reason) when CuPy sees no CUDA device.
KernelBench-size checks are also marked ``slow`` (GBs of weights; run on the device).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from cupyfuse import config
import cupyfuse
from cupyfuse import interop
from cupyfuse.kernelbench import models
from cupyfuse.kernelbench import modules as cnn
from cupyfuse.interop import cupy_available
from helpers import fused_copy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and cupy_available()),
                       reason="needs a CUDA GPU visible to both torch and CuPy"),
]

ATOL = RTOL = 1e-4


@pytest.fixture(autouse=True)
def _poison():
    """Every buffer the ops allocate starts as NaN: unwritten elements cannot pass."""
    interop.poison_outputs = True
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    interop.poison_outputs = False


def _reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        return ref(x.double())


def _assert_close(out: torch.Tensor, ref: torch.Tensor, eager32: torch.Tensor | None = None) -> None:
    """allclose(atol=rtol=1e-4) against float64.

    When the inputs are ill-conditioned for float32 itself (a large offset in x feeding
    BatchNorm, say), PyTorch's own float32 model misses 1e-4 too; then ``eager32`` (that
    model's output) sets the bar: no element may be off by more than the allclose
    tolerance or 4x PyTorch's own largest error, whichever is larger (two float32
    implementations of an ill-conditioned problem differ by small factors; a missing
    variance shift, say, is off by orders of magnitude and still fails).
    """
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "unexpected non-finite output (unwritten element?)"
    err = (out.double() - ref).abs()
    rel = (err / ref.abs().clamp_min(1e-3)).max().item()
    allowed = ATOL + RTOL * ref.abs()
    if eager32 is not None:
        allowed = torch.clamp_min(allowed, 4.0 * (eager32.double() - ref).abs().max().item())
    bad = err > allowed
    assert not bad.any(), (f"{int(bad.sum())} elements off: max abs err {err.max().item():.3e}, "
                           f"max rel err {rel:.3e}")


def _same_nonfinite(out: torch.Tensor, ref32: torch.Tensor) -> None:
    """NaN/inf placement equal to the float32 PyTorch model, finite parts close."""
    assert torch.equal(torch.isnan(out), torch.isnan(ref32)), (out, ref32)
    assert torch.equal(torch.isinf(out), torch.isinf(ref32)), (out, ref32)
    inf = torch.isinf(ref32)
    assert torch.equal(out[inf], ref32[inf])
    fin = torch.isfinite(ref32)
    assert torch.allclose(out[fin], ref32[fin], atol=1e-3, rtol=1e-3)


# (problem, init args, batch): small sizes incl. shapes that are no multiple of any tile
SMALL_CASES = [
    ("55", (300, 258, 2, 0.5), 37),
    ("55", (257, 131, 2, -1.5), 5),      # odd out_features: last column dropped
    ("55", (200, 97, 3, 0.5), 33),       # general kernel size: direct path
    ("55", (64, 100, 7, 2.0), 1),
    ("56", (300, 259), 37),
    ("56", (33, 1000), 130),
    ("98", (300, 264, 16, 2.0), 37),
    ("98", (129, 100, 7, -0.75), 65),    # tail window dropped, negative scale
    ("98", (70, 64, 1, 2.0), 3),
    ("39", (300, 259, (259,)), 37),
    ("39", (129, 67, (67,)), 2),
]


def _inputs(kind: str, batch: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "rand":
        return torch.rand(batch, k, device="cuda", generator=g)
    if kind == "spread":
        return torch.randn(batch, k, device="cuda", generator=g) * 3.0
    if kind == "offset":
        return torch.rand(batch, k, device="cuda", generator=g) + 100.0
    if kind == "negative":
        return -torch.rand(batch, k, device="cuda", generator=g)
    raise ValueError(kind)


@pytest.mark.parametrize("problem,init,batch", SMALL_CASES)
@pytest.mark.parametrize("dist", ["rand", "spread", "offset", "negative"])
@pytest.mark.parametrize("seed", [0, 1])
def test_wrapper_matches_float64_reference(problem, init, batch, dist, seed):
    torch.manual_seed(seed)
    model = models.PROBLEMS[problem].model(*init).cuda()
    if dist == "spread":  # Linear outputs over several units: sigmoid saturates, GELU tails
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(8.0)
    fused = fused_copy(model)
    x = _inputs(dist, batch, init[0], seed)
    ref = _reference(model, x)
    eager = None
    if dist == "offset":  # float32 itself is ill-conditioned here: PyTorch's error sets the bar
        with torch.no_grad():
            eager = copy.deepcopy(model)(x)
    with torch.no_grad():
        out = fused(x)
    _assert_close(out, ref, eager)
    if problem == "39":  # running stats updated like nn.BatchNorm1d
        refm = copy.deepcopy(model)
        with torch.no_grad():
            refm(x)
        torch.testing.assert_close(fused.bn.running_mean, refm.bn.running_mean, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(fused.bn.running_var, refm.bn.running_var, atol=1e-5, rtol=1e-4)
        assert int(fused.bn.num_batches_tracked) == int(refm.bn.num_batches_tracked)


def _round_to(v: torch.Tensor, precision: str) -> torch.Tensor:
    """v as the one-pass tensor-core GEMM reads it: bf16 ("medium") or tf32 ("high",
    rounded to nearest)."""
    if precision == "medium":
        return v.bfloat16().float()
    return ((v.contiguous().view(torch.int32) + 4096) & -8192).view(torch.float32)


@pytest.mark.parametrize("problem,init,batch", [("55", (300, 258, 2, 0.5), 37),
                                                ("56", (300, 259), 37),
                                                ("98", (300, 264, 16, 2.0), 37),
                                                ("39", (300, 259, (259,)), 37)])
@pytest.mark.parametrize("precision", ["high", "medium"])
@pytest.mark.parametrize("dist", ["rand", "spread"])
def test_lower_precisions_cost_about_what_operand_rounding_costs(problem, init, batch, precision,
                                                                 dist, monkeypatch):
    """precision="high"/"medium": the op's error vs float64 is of the size that rounding
    x and the Linear weight to tf32/bf16 causes in the exact model (within 4x: the exact
    algebra rounds derived weights, the hardware may truncate), and clearly above the
    float32 error. Every output written (buffers are NaN-poisoned). The tensor-core
    paths are what is checked: small batches' skinny kernel (fp32 at every precision)
    is switched off."""
    from cupyfuse.backend import gemm
    from cupyfuse.kernelbench import ops

    monkeypatch.setattr(config, "GENERIC_SMALL_BATCHES", False)
    monkeypatch.setattr(config, "SKINNY_MAX_M", 0)
    monkeypatch.setattr(config, "SKINNY_SMALL_MAX_M", 0)
    torch.manual_seed(3)
    model = models.PROBLEMS[problem].model(*init).cuda()
    fused = fused_copy(model)
    fused.cupyfuse_precision = precision
    x = _inputs(dist, batch, init[0], 3)
    ref = _reference(model, x)
    rounded = copy.deepcopy(model)
    lin = next(m for m in rounded.modules() if isinstance(m, nn.Linear))
    with torch.no_grad():
        lin.weight.copy_(_round_to(lin.weight, precision))
    budget = (_reference(rounded, _round_to(x, precision)) - ref).abs().max().item()
    with torch.no_grad():
        out = fused(x)
    assert torch.isfinite(out).all(), "unwritten or non-finite outputs"
    err = (out.double() - ref).abs().max().item()
    assert err <= 4.0 * budget + 1e-6, (err, budget)
    fused.cupyfuse_precision = "highest"
    with torch.no_grad():
        err_highest = (fused(x).double() - ref).abs().max().item()
    assert err_highest < err, (err_highest, err)


def test_batchnorm_eval_mode_and_momentum_none():
    torch.manual_seed(3)
    model = models.GemmScaleBatchNorm(90, 70, (70,), momentum=None).cuda()
    fused = fused_copy(model)
    for step in range(3):
        x = _inputs("spread", 16, 90, step)
        with torch.no_grad():
            model(x)
            fused(x)
    torch.testing.assert_close(fused.bn.running_var, model.bn.running_var, atol=1e-5, rtol=1e-4)
    model.eval()
    fused.eval()
    x = _inputs("offset", 9, 90, 7)
    _assert_close(fused(x), _reference(model, x))


def test_nan_and_inf_rows_match_pytorch_placement():
    """NaN/inf inside x: the guarded rows are recomputed directly, placement as PyTorch."""
    torch.manual_seed(0)
    for problem, init in [("55", (64, 40, 2, 0.5)), ("98", (64, 48, 4, 2.0)),
                          ("56", (64, 40)), ("39", (64, 40, (40,)))]:
        model = models.PROBLEMS[problem].model(*init).cuda()
        fused = fused_copy(model)
        x = torch.rand(12, init[0], device="cuda")
        x[1, 3] = float("nan")
        x[2, 5] = float("inf")
        x[3, 7] = -float("inf")
        x[4] = 1e37  # Linear outputs overflow in float32
        ref = copy.deepcopy(model)
        with torch.no_grad():
            ref32 = ref(x)
            out = fused(x)
        _same_nonfinite(out, ref32)


def test_deterministic_run_to_run():
    torch.manual_seed(0)
    for problem, init, batch in SMALL_CASES[:1] + SMALL_CASES[4:5] + SMALL_CASES[6:7]:
        fused = fused_copy(models.PROBLEMS[problem].model(*init).cuda())
        x = _inputs("rand", batch, init[0], 0)
        with torch.no_grad():
            a, b = fused(x), fused(x)
        assert torch.equal(a, b)


def test_zero_copy_views():
    t = torch.rand(5, 7, device="cuda")
    v = interop.cupy_view(t)
    assert v.data.ptr == t.data_ptr()
    tt = t.t()
    assert interop.cupy_view(tt).data.ptr == tt.data_ptr()
    import cupy

    c = cupy.random.rand(4, 6, dtype=cupy.float32)
    call = interop.Call.begin("t", c, {}, x_shape_msg="(batch, 6)", in_features=6)
    assert call.x.data_ptr() == c.data.ptr and call.kind == "cupy"


def test_cupy_inputs_return_cupy_on_cupy_stream():
    import cupy

    torch.manual_seed(0)
    model = models.MatmulAvgPoolGeluScaleMax(96, 64, 4, 2.0).cuda()
    x = torch.rand(10, 96, device="cuda")
    want = _reference(model, x)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        xc = cupy.asarray(x.cpu().numpy())
        wc = cupy.asarray(model.matmul.weight.detach().cpu().numpy())
        bc = cupy.asarray(model.matmul.bias.detach().cpu().numpy())
        out = cupyfuse.kernelbench.matmul_avgpool_gelu_scale_max(xc, wc, bc, 4, 2.0)
    assert isinstance(out, cupy.ndarray)
    s.synchronize()
    _assert_close(torch.from_dlpack(out), want)


def test_runs_on_callers_nondefault_torch_stream():
    """x is written on a side stream after a long sleep; the op must see the new data."""
    torch.manual_seed(0)
    model = models.MatmulSigmoidSum(128, 96).cuda()
    fused = fused_copy(model)
    x_real = torch.randn(64, 128, device="cuda") * 2
    want = _reference(model, x_real)
    buf = torch.zeros_like(x_real)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~tens of ms on the side stream
        buf.copy_(x_real)
        with torch.no_grad():
            out = fused(buf)
    side.synchronize()
    _assert_close(out, want)


def test_cuda_graph_capture_and_replay():
    torch.manual_seed(0)
    model = models.MatmulMaxPoolSumScale(80, 60, 2, 0.5).cuda()
    fused = fused_copy(model)
    x = torch.rand(20, 80, device="cuda")
    interop.poison_outputs = False
    with torch.no_grad():
        fused(x)  # build plan and compile kernels outside the capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fused(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fused(x)
    for seed in range(3):
        x.copy_(torch.rand(20, 80, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)) * 3 - 1)
        g.replay()
        torch.cuda.synchronize()
        _assert_close(out, _reference(model, x))


def test_stale_weights_rebuild_on_gpu():
    torch.manual_seed(0)
    model = models.MatmulMaxPoolSumScale(64, 50, 2, 0.5).cuda()
    fused = fused_copy(model)
    x = torch.rand(8, 64, device="cuda")
    with torch.no_grad():
        fused(x)
        fused.matmul.weight.mul_(-2.0)
        model.matmul.weight.mul_(-2.0)
    _assert_close(fused(x), _reference(model, x))


# ---------------------------------------------------------------------------------
# KernelBench sizes (slow: GBs of weights)
# ---------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("problem,size", [("55", "kernelbench"), ("56", "kernelbench"),
                                          ("98", "kernelbench"), ("39", "kernelbench"),
                                          ("39", "seed")])
def test_kernelbench_sizes(problem, size):
    torch.manual_seed(0)
    model = models.make_model(problem, size, device="cuda")
    fused = fused_copy(model)
    for seed in (0, 1):
        x = models.get_inputs(problem, size, device="cuda",
                              generator=torch.Generator("cuda").manual_seed(seed))[0]
        ref = _reference(model, x)
        with torch.no_grad():
            out = fused(x)
            if problem == "39":
                model(x)  # keep the reference's running stats in step with the fused module
        _assert_close(out, ref)
        del ref, out
    del model, fused
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------
# Robustness: threads, memory, cache lifetime
# ---------------------------------------------------------------------------------
def _small_fused(problem: str, seed: int = 0):
    torch.manual_seed(seed)
    init = {"55": (96, 70, 2, 0.5), "56": (96, 70), "98": (96, 64, 4, 2.0), "39": (96, 70, (70,))}[problem]
    model = models.PROBLEMS[problem].model(*init).cuda()
    return model, fused_copy(model), init


@pytest.mark.parametrize("small", [True, False], ids=["prepared", "engine"])
def test_two_threads_concurrently_get_correct_results(small, monkeypatch):
    """Four threads on their own streams, first calls included (kernels compiled and
    loaded while other threads launch: see runtime.load_lock)."""
    import threading

    from cupyfuse.backend import gemm

    if not small:   # the general path on the tensor-core engine
        from cupyfuse.kernelbench import ops

        monkeypatch.setattr(config, "GENERIC_SMALL_BATCHES", False)
        monkeypatch.setattr(config, "SKINNY_MAX_M", 0)
        monkeypatch.setattr(config, "SKINNY_SMALL_MAX_M", 0)
    interop.poison_outputs = False
    cupyfuse.clear_cache()
    pairs = [_small_fused(p, i) for i, p in enumerate(["55", "98", "56", "55"])]
    xs = [torch.rand(16, 96, device="cuda") * (i + 1) for i in range(len(pairs))]
    wants = [_reference(m, x) for (m, _, _), x in zip(pairs, xs)]
    errors: list = []

    def work(i: int) -> None:
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s), torch.no_grad():
                for _ in range(50):
                    out = pairs[i][1](xs[i])
            s.synchronize()
            _assert_close(out, wants[i])
        except Exception as exc:  # collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(pairs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_ten_thousand_calls_leave_memory_where_it_was():
    """With Python's cyclic GC off during the calls (so a reference cycle holding buffers
    would show as growth) and earlier tests' garbage collected first (its release during
    the loop would show as a 100 KB drop)."""
    import gc

    interop.poison_outputs = False
    for problem in ["55", "56", "98", "39"]:
        model, fused, init = _small_fused(problem)
        x = torch.rand(32, init[0], device="cuda")
        with torch.no_grad():
            for _ in range(3):   # the first call prepares the launches (kept workspaces)
                fused(x)
            torch.cuda.synchronize()
            gc.collect()
            before = torch.cuda.memory_allocated()
            gc.disable()
            try:
                for _ in range(10_000):
                    fused(x)
                torch.cuda.synchronize()
                after = torch.cuda.memory_allocated()
            finally:
                gc.enable()
        assert after == before, (problem, before, after)


def test_derived_weights_freed_with_module(monkeypatch):
    import gc

    from cupyfuse.backend import gemm

    # the named op's own plan and kernels (a small batch would run the generic program)
    from cupyfuse.kernelbench import ops

    monkeypatch.setattr(config, "GENERIC_SMALL_BATCHES", False)
    monkeypatch.setattr(config, "SKINNY_MAX_M", 0)
    monkeypatch.setattr(config, "SKINNY_SMALL_MAX_M", 0)

    interop.poison_outputs = False
    cupyfuse.clear_cache()
    gc.collect()
    torch.cuda.synchronize()
    base_mem = torch.cuda.memory_allocated()
    model, fused, init = _small_fused("55")
    del model
    x = torch.rand(4, init[0], device="cuda")
    with torch.no_grad():
        for _ in range(3):
            fused(x)
    del x
    # the plan (pair-difference rows) and, on the sm90 engine, their big/small split
    assert cupyfuse.caches.cache_size() >= 1
    del fused
    gc.collect()
    assert cupyfuse.caches.cache_size() == 0
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base_mem
