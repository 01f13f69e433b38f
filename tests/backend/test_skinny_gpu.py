"""GPU tests of the skinny-batch kernel (kernels_cu/gemm_skinny.cu): fp32 accuracy against
float64 on odd shapes, K splits and their fixed-order sum (bitwise reproducible, counters
re-armed), NaN/inf as fp32 SGEMM places them, strided operands, and which shapes
``gemm.linear_nobias`` sends to it. Marked ``gpu``; skipped without a GPU."""
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


@pytest.fixture(autouse=True)
def _on_torch_stream():
    torch.backends.cuda.matmul.allow_tf32 = False
    call = interop.Call.begin("test", torch.zeros(1, 1, device="cuda"), {}, x_shape_msg="")
    with call:
        yield


def _skinny(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), device="cuda")
    engine.gemm_skinny(x, w, out)
    return out


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error relative to the row's scale (sum of |products|)."""
    return (out.double() - ref[0]).abs().div(ref[1].clamp_min(1e-300)).max().item()


def _ref(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.double() @ w.double().T, x.double().abs() @ w.double().abs().T


SHAPES = [(1, 1, 1), (1, 5, 3), (2, 33, 4), (3, 100, 517), (5, 257, 4096), (8, 1000, 1000),
          (13, 31, 20000), (16, 64, 128), (16, 2049, 8192), (17, 130, 777), (33, 513, 260),
          (64, 512, 512), (100, 40, 2048),
          # past SKINNY_L2_W: 16-row tiles on the tensor cores from 9 rows (odd K: the scalar
          # loads; K past one x chunk of 128 and not a multiple of 32)
          (13, 1000, 4200), (15, 333, 13001), (14, 4103, 1028), (16, 8200, 520), (13, 9001, 467),
          (9, 4100, 1030), (11, 2000, 2501), (12, 65, 70000)]


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("dist", ["randn", "rand", "mixed_scale"])
def test_fp32_accuracy_on_odd_shapes(M, N, K, dist):
    g = torch.Generator(device="cuda").manual_seed(M * 1009 + N * 31 + K)
    if dist == "randn":
        x = torch.randn(M, K, device="cuda", generator=g)
        w = torch.randn(N, K, device="cuda", generator=g)
    elif dist == "rand":  # all-positive: no cancellation hides an accumulation error
        x = torch.rand(M, K, device="cuda", generator=g)
        w = torch.rand(N, K, device="cuda", generator=g) / K ** 0.5
    else:
        x = torch.randn(M, K, device="cuda", generator=g) * torch.logspace(
            -3, 3, K, device="cuda")
        w = torch.randn(N, K, device="cuda", generator=g)
    out = _skinny(x, w)
    assert not torch.isnan(out).any(), "unwritten outputs"
    ref = _ref(x, w)
    # plain fp32 accumulation: a few K * 2^-24 of the row's scale at worst, like SGEMM
    assert _err(out, ref) <= max(4 * _err(x @ w.T, ref), 64 * 2.0 ** -24), (
        _err(out, ref), _err(x @ w.T, ref))


@pytest.mark.parametrize("M", [4, 12])   # one row tile; three side by side
def test_k_splits_are_bitwise_reproducible_and_rearm(M):
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(M, 30000, device="cuda", generator=g)
    w = torch.randn(96, 30000, device="cuda", generator=g)
    assert engine.skinny_plan(M, 96, 30000, 132).splits > 1, "shape meant to split K"
    first = _skinny(x, w)
    for _ in range(20):   # the tile counters must come back to zero after every launch
        assert torch.equal(_skinny(x, w), first)
    # another shape in between reuses the workspace and the counters
    x2 = torch.randn(16, 12345, device="cuda", generator=g)
    w2 = torch.randn(700, 12345, device="cuda", generator=g)
    o2 = _skinny(x2, w2)
    assert _err(o2, _ref(x2, w2)) <= 64 * 2.0 ** -24
    assert torch.equal(_skinny(x, w), first)


@pytest.mark.parametrize("M,N", [(6, 40), (11, 40), (11, 8300), (13, 1100), (16, 1100), (16, 8300)])
@pytest.mark.parametrize("K", [7, 4096])
def test_nan_and_inf_land_where_sgemm_puts_them(K, M, N):
    """(11, 13 and 16 rows of an 1100 or 8300 x 4096 weight: the wgmma tile, whose cross
    terms are dropped where the big products' sum is not finite.)"""
    g = torch.Generator(device="cuda").manual_seed(K)
    x = torch.randn(M, K, device="cuda", generator=g)
    w = torch.randn(N, K, device="cuda", generator=g)
    if K == 4096 and M >= 9 and N * K > config.SKINNY_L2_W:
        assert engine.skinny_plan(M, N, K, 132).fn == "gemm_skinny_16wg"
        w[20, 1] = 3e38
        x[5, 1] = 4.0              # 4 * 3e38 overflows: +inf at (5, 20)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3, :] = float("inf")         # +inf and -inf products: NaN
    w[5, 2] = float("-inf")
    w[7, :] = 0.0
    x[4, 1] = float("inf")         # inf * 0 in column 7: NaN there
    out = _skinny(x, w)
    want = x @ w.T
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(out), fin)
    assert torch.equal(torch.isinf(out) & (out > 0), torch.isinf(want) & (want > 0))


@pytest.mark.parametrize("M", [8, 10])
def test_strided_and_unaligned_operands(M):
    g = torch.Generator(device="cuda").manual_seed(9)
    big = torch.randn(M, 1030, device="cuda", generator=g)
    x = big[:, 1:1025]             # row stride 1030, misaligned: the scalar path
    w = torch.randn(300, 1024, device="cuda", generator=g)
    out = _skinny(x, w)
    assert _err(out, _ref(x, w)) <= 64 * 2.0 ** -24
    xc = x.contiguous()
    o2 = _skinny(xc, w)            # the float4 path: same sums in another order
    assert _err(o2, _ref(xc, w)) <= 64 * 2.0 ** -24


def test_linear_nobias_sends_small_batches_to_it():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 engine's dispatch")
    w = torch.randn(4096, 4096, device="cuda")
    for M, want in [(1, "sm90-skinny-fp32"), (8, "sm90-skinny-fp32"), (9, "sm90-skinny-3xtf32"),
                    (12, "sm90-skinny-3xtf32"), (13, "sm90-skinny-3xtf32"),
                    (16, "sm90-skinny-3xtf32"), (17, None), (512, None)]:
        x = torch.randn(M, 4096, device="cuda")
        out = torch.empty(M, 4096, device="cuda")
        used = gemm.linear_nobias(x, w, out, precision="highest", owner=w)
        assert used == want if want else not used.startswith("sm90-skinny"), (M, used)
        assert _err(out, _ref(x, w)) <= 2.0 ** -14
    ws = torch.randn(512, 512, device="cuda")
    xs = torch.randn(64, 512, device="cuda")
    assert gemm.linear_nobias(xs, ws, torch.empty(64, 512, device="cuda")) == "sm90-skinny-fp32"
    assert not gemm.skinny_for(65, 512, 512) and gemm.skinny_for(64, 512, 512)


@pytest.mark.parametrize("tile_rows", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("M,N,K", [(3, 100, 517), (13, 31, 20000), (16, 2049, 8192), (17, 130, 777)])
def test_row_tiles_side_by_side(monkeypatch, tile_rows, M, N, K):
    """Shorter row tiles (config.SKINNY_TILE_ROWS): several per column tile, interleaved in
    launch order; every row written once, fp32-accurate, K splits still repeatable."""
    monkeypatch.setattr(config, "SKINNY_TILE_ROWS", tile_rows)
    monkeypatch.setattr(config, "SKINNY_ROW_TILES", 16)
    mt = engine.skinny_plan(M, N, K, 132).mt
    assert mt in (tile_rows, 16) or mt >= M
    g = torch.Generator(device="cuda").manual_seed(M + N + K + tile_rows)
    x = torch.randn(M, K, device="cuda", generator=g)
    w = torch.randn(N, K, device="cuda", generator=g)
    x[M // 2, K // 3] = float("nan")
    out = _skinny(x, w)
    ref = _ref(x, w)
    assert torch.equal(torch.isnan(out), torch.isnan(ref[0]))
    fin = ~torch.isnan(ref[0])
    assert _err(out.where(fin, 0.0), (ref[0].where(fin, 0.0), ref[1].where(fin, 1.0))) <= 64 * 2.0 ** -24
    assert torch.equal(torch.isnan(_skinny(x, w)), torch.isnan(out))
    assert torch.equal(_skinny(x, w).nan_to_num(), out.nan_to_num())
