"""GPU tests of the sm90 GEMM engine (kernels_cu/gemm_sm90.cu, gemm_sm90_wide.cu): the
three precisions, odd shapes, NaN propagation, split K, fallbacks. Marked ``gpu``; the sm90 cases skip off compute capability 9.0."""
from __future__ import annotations

import pytest
import torch

from cupyfuse import config
from cupyfuse.backend import engine, gemm
from cupyfuse import interop
from cupyfuse.interop import cupy_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and cupy_available()),
                       reason="needs a CUDA GPU visible to both torch and CuPy"),
]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _hopper(), reason="the sm90 engine needs compute capability 9.0")


@pytest.fixture(autouse=True)
def _on_torch_stream(monkeypatch):
    """The engine launches on CuPy's current stream: make it torch's, as the ops do.
    The tensor-core kernels are what these tests check: the skinny fp32 kernel that
    small batches get (tests/backend/test_skinny_gpu.py) is switched off."""
    monkeypatch.setattr(config, "SKINNY_MAX_M", 0)
    monkeypatch.setattr(config, "SKINNY_SMALL_MAX_M", 0)
    torch.backends.cuda.matmul.allow_tf32 = False
    call = interop.Call.begin("test", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg="")
    with call:
        yield


def _run(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    out = torch.full((a.shape[0], b.shape[0]), float("nan"), device="cuda")
    # (b keys its cached split: a weight nothing keeps a split of runs on cuBLAS)
    used = gemm.linear_nobias(a, b, out, precision=precision, owner=b)
    assert used.startswith("sm90") or not _hopper() or not engine.supported(a, b), used
    return out


def _max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@needs_sm90
@pytest.mark.parametrize("M,N,K", [(64, 64, 32), (77, 131, 260), (200, 136, 100), (1, 5, 4),
                                   (129, 257, 36), (300, 520, 1000), (1000, 1000, 1000)])
def test_highest_is_float32_class_on_odd_shapes(M, N, K):
    g = torch.Generator(device="cuda").manual_seed(M * 7 + N * 3 + K)
    a = torch.randn(M, K, device="cuda", generator=g)
    b = torch.randn(N, K, device="cuda", generator=g)
    ref = a.double() @ b.double().T
    out = _run(a, b, "highest")
    assert not torch.isnan(out).any(), "unwritten outputs"
    sgemm = _max_rel(a @ b.T, ref)
    ours = _max_rel(out, ref)
    # the hybrid kernel's bf16 big(A)*small(B) term costs up to ~2^-18.5 of each product
    # (truncated big halves: small halves up to 2^-10 of the operand, bf16's 2^-9 on both
    # factors): at tiny K (no accumulation error to hide it) that is the floor, not SGEMM's
    assert ours <= max(2.0 * sgemm, 2.0 ** -17), (ours, sgemm)


@needs_sm90
@pytest.mark.parametrize("M,N,K", [(256, 384, 8192), (128, 256, 32768)])
def test_highest_error_within_2x_sgemm_at_large_k(M, N, K):
    """The accuracy bar: max relative error vs float64 no worse than 2x cuBLAS SGEMM's."""
    g = torch.Generator(device="cuda").manual_seed(K)
    for dist in ("randn", "rand"):
        if dist == "randn":
            a = torch.randn(M, K, device="cuda", generator=g)
            b = torch.randn(N, K, device="cuda", generator=g)
        else:
            a = torch.rand(M, K, device="cuda", generator=g)
            b = torch.rand(N, K, device="cuda", generator=g) - 0.5
        ref = a.double() @ b.double().T
        sgemm = _max_rel(a @ b.T, ref)
        ours = _max_rel(_run(a, b, "highest"), ref)
        assert ours <= 2.0 * sgemm, (dist, ours, sgemm)


@needs_sm90
def test_high_is_one_tf32_pass_on_rounded_operands():
    g = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(300, 1024, device="cuda", generator=g)
    b = torch.randn(200, 1024, device="cuda", generator=g)
    ref = a.double() @ b.double().T
    hi = _max_rel(_run(a, b, "high"), ref)
    best = _max_rel(_run(a, b, "highest"), ref)
    assert 1e-5 < hi < 5e-3, hi          # TF32 (10-bit mantissa) class
    assert best < hi / 50, (best, hi)    # 3xTF32 recovers float32-class accuracy


@needs_sm90
@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_nan_and_inf_propagate(precision):
    a = torch.rand(70, 64, device="cuda")
    b = torch.rand(90, 64, device="cuda")
    a[3, 5] = float("nan")
    b[7, 9] = float("nan")
    a[10, :] = 0.0
    a[10, 2] = float("inf")  # row 10 = inf * positive weights = +inf
    out = _run(a, b, precision)
    ref = a @ b.T
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(torch.isinf(out), torch.isinf(ref))


@needs_sm90
def test_split_k_is_deterministic_and_correct():
    g = torch.Generator(device="cuda").manual_seed(9)
    a = torch.randn(100, 4096, device="cuda", generator=g)
    b = torch.randn(90, 4096, device="cuda", generator=g)   # one tile: split K kicks in
    ref = a.double() @ b.double().T
    outs = [_run(a, b, "highest") for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert _max_rel(outs[0], ref) <= max(2.0 * _max_rel(a @ b.T, ref), 2.0 ** -17)


def test_awkward_k_falls_back_to_cublas():
    a = torch.randn(33, 7, device="cuda")   # K % 4 != 0: no TMA row stride
    b = torch.randn(20, 7, device="cuda")
    out = torch.empty(33, 20, device="cuda")
    assert gemm.engine_for(a, b) == "cublas"
    assert gemm.linear_nobias(a, b, out, precision="highest") == "cublas"
    torch.testing.assert_close(out, a @ b.T)


def test_precision_validation():
    with pytest.raises(ValueError, match="precision must be one of"):
        gemm.resolve_precision("fp64")
    assert gemm.resolve_precision(None) == torch.get_float32_matmul_precision()


# ---------------------------------------------------------------------------------
# One-pass precisions ("high" = TF32, "medium" = BF16): gemm_sm90_wide.cu
# ---------------------------------------------------------------------------------
def _tf32_trunc(v: torch.Tensor) -> torch.Tensor:
    """v with its low 13 mantissa bits cleared: the tf32 value the tensor core reads."""
    return (v.contiguous().view(torch.int32) & -8192).view(torch.float32)


def _tf32_rna(v: torch.Tensor) -> torch.Tensor:
    """v rounded to the nearest tf32, ties away from zero (cvt.rna.tf32.f32)."""
    bits = v.contiguous().view(torch.int32)
    return ((bits + 4096) & -8192).view(torch.float32)


def _rounded_ref(a: torch.Tensor, b: torch.Tensor, precision: str) -> list[torch.Tensor]:
    """float64 products of the operands as the tensor cores see them (for "high" both
    readings of an fp32 bit pattern as tf32 are given: truncation and rounding)."""
    if precision == "medium":
        return [a.bfloat16().double() @ b.bfloat16().double().T]
    return [f(a).double() @ f(b).double().T for f in (_tf32_trunc, _tf32_rna)]


WIDE_SHAPES = [(64, 64, 32), (77, 131, 260), (1, 5, 4), (129, 257, 36), (300, 520, 1000),
               (200, 300, 12), (2048, 4096, 256), (1000, 1000, 1000)]


@needs_sm90
@pytest.mark.parametrize("precision", ["high", "medium"])
@pytest.mark.parametrize("M,N,K", WIDE_SHAPES)
def test_one_pass_equals_rounded_operand_product(precision, M, N, K):
    """The one-pass kernels compute exactly the product of the rounded operands, up to
    fp32 accumulation error: a wrong tile, K block, swizzle or padding would be off by
    the size of whole products. Odd shapes: M, N, K tails, K % 8 != 0 (bf16 padding),
    more tiles than SMs (persistent loop), split K."""
    g = torch.Generator(device="cuda").manual_seed(M + 3 * N + 7 * K)
    for dist in ("randn", "rand"):
        if dist == "randn":
            a = torch.randn(M, K, device="cuda", generator=g)
            b = torch.randn(N, K, device="cuda", generator=g)
        else:
            a = torch.rand(M, K, device="cuda", generator=g) + 1.0
            b = torch.rand(N, K, device="cuda", generator=g) - 0.25
        out = _run(a, b, precision)
        assert not torch.isnan(out).any(), "unwritten outputs"
        exact = a.double() @ b.double().T
        # "high" rounds x and W to the nearest tf32 first (the last reference)
        errs = [_max_rel(out, r) for r in _rounded_ref(a, b, precision)][-1:]
        # fp32 accumulation error only (the tensor core's adds are not round-to-nearest:
        # it grows with K); one whole product missing or doubled is ~1/K >= 2.4e-4 here
        assert min(errs) < 1e-5 * max(1.0, K / 1024), (dist, errs)
        # and the rounding itself is visible: not secretly the fp32 (or 3xTF32) path
        if K >= 32 and dist == "randn":
            assert _max_rel(out, exact) > 5 * min(errs), (dist, _max_rel(out, exact), errs)


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(256, 256, 64), (300, 520, 1000), (129, 257, 36),
                                   (1024, 512, 8192), (2048, 4096, 256), (3000, 700, 96)])
def test_one_pass_writes_every_tile_the_same_each_time(dtype, M, N, K):
    """Every tile of the persistent grid (work items walked by stride, K split where the
    tiles leave SMs idle; odd tile rows 3 and 24 leave a partial last tile) is written --
    NaN-filled outputs catch one left out -- accurately and the same bits on a second
    run (the split-K sum in a fixed order)."""
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    a = torch.randn(M, K, device="cuda", generator=g)
    b = torch.randn(N, K, device="cuda", generator=g)
    if dtype == torch.bfloat16:
        a, b = engine.to_bf16(a), engine.to_bf16(b)
    outs = []
    for _ in range(2):
        out = torch.full((M, N), float("nan"), device="cuda")
        engine.gemm_wide(a, b, out)
        torch.cuda.synchronize()
        outs.append(out)
    assert not torch.isnan(outs[0]).any()
    assert torch.equal(outs[0], outs[1])
    ref = a.float().double() @ b.float().double().T
    assert float(((outs[1].double() - ref).abs() / (ref.abs() + K ** 0.5)).max()) < 1e-2


@needs_sm90
@pytest.mark.parametrize("precision", ["high", "medium"])
def test_one_pass_split_k_is_deterministic(precision):
    g = torch.Generator(device="cuda").manual_seed(21)
    a = torch.randn(100, 4096, device="cuda", generator=g)
    b = torch.randn(90, 4096, device="cuda", generator=g)   # one tile: 16 K splits
    outs = [_run(a, b, precision) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    errs = [_max_rel(outs[0], r) for r in _rounded_ref(a, b, precision)]
    assert min(errs) < 4e-5, errs


@needs_sm90
def test_one_pass_writes_into_strided_output():
    """ldc != N and an odd row stride (no float2 stores): columns outside stay untouched."""
    g = torch.Generator(device="cuda").manual_seed(4)
    a = torch.randn(130, 64, device="cuda", generator=g)
    b = torch.randn(270, 64, device="cuda", generator=g)
    big = torch.full((130, 273), -7.0, device="cuda")
    view = big[:, 1:271]
    engine.gemm_wide(a, b, view)
    errs = [_max_rel(view, r) for r in _rounded_ref(a, b, "high")]
    assert min(errs) < 1e-5, errs
    assert (big[:, 0] == -7.0).all() and (big[:, 271:] == -7.0).all()


@needs_sm90
def test_to_bf16_rounds_like_torch_and_keeps_finite_values_finite():
    g = torch.Generator(device="cuda").manual_seed(8)
    v = torch.randn(37, 19, device="cuda", generator=g) * torch.logspace(
        -40, 38, 19, device="cuda")
    v[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45])
    v[1, :2] = torch.tensor([3.4e38, -3.4028e38])          # would round up to +-inf
    h = engine.to_bf16(v)
    assert h.dtype == torch.bfloat16 and h.shape == v.shape and h.stride(0) == 24
    pad = torch.as_strided(h, (37, 24), (24, 1))[:, 19:]
    assert (pad.float() == 0).all(), "padding must be zero"
    want = v.bfloat16()
    fin = torch.isfinite(want)
    assert torch.equal(h[fin].view(torch.int16), want[fin].view(torch.int16))
    assert torch.isnan(h[0, 0]) and h[0, 1] == float("inf") and h[0, 2] == -float("inf")
    assert torch.isfinite(h[1, :2]).all(), h[1, :2]
    assert h[1, 0] > 3.3e38 and h[1, 1] < -3.3e38


@needs_sm90
def test_medium_caches_the_bf16_weight_per_owner():
    from cupyfuse import caches

    g = torch.Generator(device="cuda").manual_seed(2)
    w = torch.randn(300, 512, device="cuda", generator=g)
    x = torch.randn(64, 512, device="cuda", generator=g)
    out1 = torch.empty(64, 300, device="cuda")
    out2 = torch.empty(64, 300, device="cuda")
    gemm.linear_nobias(x, w, out1, precision="medium", owner=w)
    first = caches.cached("bf16", w, (w,), (), lambda: pytest.fail("cache miss"))
    gemm.linear_nobias(x, w, out2, precision="medium", owner=w)
    assert caches.cached("bf16", w, (w,), (), lambda: pytest.fail("cache miss")) is first
    assert torch.equal(out1, out2)
    with torch.no_grad():
        w.mul_(2.0)   # in-place change bumps the version: the copy is rebuilt
    gemm.linear_nobias(x, w, out2, precision="medium", owner=w)
    assert torch.equal(out2, 2.0 * out1)


# ---------------------------------------------------------------------------------
# "highest" = the hybrid 3xTF32 kernel (small half of the weight in bf16)
# ---------------------------------------------------------------------------------
@needs_sm90
def test_split_hybrid_copies():
    g = torch.Generator(device="cuda").manual_seed(12)
    v = torch.randn(33, 20, device="cuda", generator=g) * 1e3
    v[0, :4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4028e38])
    big, small, small_h, half = engine.split_hybrid(v, small=True, small_h=True, half=True)
    assert small_h.stride(0) == 24 and half.stride(0) == 24
    assert torch.equal(big[1:], _tf32_rna(v[1:]))                 # no overflow there
    diff = torch.where(torch.isfinite(big), v - big, torch.zeros_like(v))
    assert torch.equal(small, torch.where(torch.isfinite(big), _tf32_rna(diff), diff))
    assert torch.equal(small_h.float(), diff.bfloat16().float())
    fin = torch.isfinite(v.bfloat16())   # torch rounds 3.4028e38 up to inf, we do not
    assert torch.equal(half[fin].float(), v[fin].bfloat16().float())
    assert torch.isfinite(half[0, 3])
    assert torch.isinf(half[0, :2]).all() and torch.isnan(half[0, 2])
    assert torch.isfinite(big[0, 3]) and torch.isfinite(small[0, 3])
    assert abs((big[0, 3].double() + small[0, 3].double() - v[0, 3].double()).item()) <= 1e-6 * 3.4e38
    for buf in (small_h, half):
        pad = torch.as_strided(buf, (33, 24), (24, 1))[:, 20:]
        assert (pad.float() == 0).all()
    b2, s2, sh2, h2 = engine.split_hybrid(v, small=False, small_h=True, half=False)
    assert s2 is None and h2 is None
    assert torch.equal(b2.view(torch.int32), big.view(torch.int32))   # NaN-safe: bits
    assert torch.equal(sh2.view(torch.int16), small_h.view(torch.int16))
    bt, st, sht, _ = engine.split_hybrid(v, small=True, small_h=True, half=False, trunc=True)
    assert bt is v
    d_t = v[1:] - _tf32_trunc(v[1:])
    assert torch.equal(st[1:], _tf32_rna(d_t)) and torch.equal(sht[1:].float(), d_t.bfloat16().float())
    with pytest.raises(ValueError, match="multiple of 4"):
        engine.split_hybrid(torch.zeros(3, 6, device="cuda"), small=True, small_h=True, half=True)


@needs_sm90
@pytest.mark.parametrize("M,N,K", [(77, 131, 260), (300, 520, 1000), (1, 5, 4), (129, 257, 36),
                                   (2048, 1100, 512)])
def test_hybrid_3xtf32_is_float32_class(M, N, K):
    """3xTF32 with the big(A)*small(B) product in bf16, round-to-nearest and truncated big
    halves: within 2x SGEMM's error of float64 (or 2^-18 / 2^-17 where SGEMM is exact to
    a few ulps). (An all-tf32 3xTF32 kernel measures slower on every shape:
    docs/engine.md.)"""
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    a = torch.randn(M, K, device="cuda", generator=g)
    b = torch.randn(N, K, device="cuda", generator=g)
    ref = a.double() @ b.double().T
    xb, xs, _, xh = engine.split_hybrid(a, small=True, small_h=False, half=True)
    wb, _, wsh, _ = engine.split_hybrid(b, small=False, small_h=True, half=False)
    hyb = torch.full((M, N), float("nan"), device="cuda")
    engine.gemm_hybrid(xb, xs, xh, wb, wsh, hyb)
    assert not torch.isnan(hyb).any()
    sgemm = _max_rel(a @ b.T, ref)
    assert _max_rel(hyb, ref) <= max(2.0 * sgemm, 2.0 ** -18), (_max_rel(hyb, ref), sgemm)
    # big halves by truncation: A and B themselves are the big operands (the tensor cores
    # read fp32 as truncated tf32); only an exact truncation makes this accurate
    _, xst, _, xht = engine.split_hybrid(a, small=True, small_h=False, half=True, trunc=True)
    bt, _, wsht, _ = engine.split_hybrid(b, small=False, small_h=True, half=False, trunc=True)
    assert bt is b
    hybt = torch.full((M, N), float("nan"), device="cuda")
    engine.gemm_hybrid(a, xst, xht, b, wsht, hybt)
    assert not torch.isnan(hybt).any()
    assert _max_rel(hybt, ref) <= max(2.0 * sgemm, 2.0 ** -17), (_max_rel(hybt, ref), sgemm)
    # the small terms matter: one TF32 pass on the truncated operands is TF32-class
    one = torch.full((M, N), float("nan"), device="cuda")
    engine.gemm_wide(a, b, one)
    if K >= 32:
        assert _max_rel(one, ref) > 20 * _max_rel(hyb, ref)


@needs_sm90
def test_highest_uses_the_hybrid_kernel_and_caches_its_weight_split(monkeypatch):
    from cupyfuse import caches

    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(200, 256, device="cuda", generator=g)
    x = torch.randn(50, 256, device="cuda", generator=g)
    out = torch.empty(50, 200, device="cuda")
    caches.clear_cache()
    ref = x.double() @ w.double().T
    # default for 50 rows: round-to-nearest big copies of the weight, cached
    assert gemm.linear_nobias(x, w, out, precision="highest", owner=w) == "sm90-3xtf32h"
    hit = caches.cached("tf32x3h_split", w, (w,), (), lambda: pytest.fail("cache miss"))
    assert hit[0].dtype == torch.float32 and hit[1].dtype == torch.bfloat16
    assert _max_rel(out, ref) <= max(2.0 * _max_rel(x @ w.T, ref), 2.0 ** -17)
    monkeypatch.setattr(config, "ROUNDED_BIG_MAX_M", 0)   # the large-batch form: truncated big
    assert gemm.linear_nobias(x, w, out, precision="highest", owner=w) == "sm90-3xtf32ht"
    hit = caches.cached("tf32x3ht_split", w, (w,), (), lambda: pytest.fail("cache miss"))
    assert hit[0].dtype == torch.bfloat16      # only the weight's small half is stored
    assert not any(t is w for t in hit if isinstance(t, torch.Tensor))
    assert _max_rel(out, ref) <= max(2.0 * _max_rel(x @ w.T, ref), 2.0 ** -17)
    # the round-to-nearest big halves (TRUNC_BIG off) still work when switched on
    monkeypatch.setattr(config, "TRUNC_BIG", False)
    out2 = torch.empty(50, 200, device="cuda")
    assert gemm.linear_nobias(x, w, out2, precision="highest", owner=w) == "sm90-3xtf32h"
    assert _max_rel(out2, ref) <= max(2.0 * _max_rel(x @ w.T, ref), 2.0 ** -18)
