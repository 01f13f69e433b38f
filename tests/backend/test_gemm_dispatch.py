"""The GEMM engines' launch plans, pure Python (no GPU): the skinny kernel's row tiles and
K splits (engine.skinny_plan) and the tensor-core engine's K splits (engine.hybrid_splits).
What the kernels assume of them: every row, column and K element covered once, K spans
that are multiples of the kernel's 128-element step, the grid the counters are sized for."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cupyfuse import config
from cupyfuse.backend import engine
from helpers import examples


@settings(max_examples=examples(300), deadline=None, derandomize=True, database=None)
@given(M=st.integers(1, 80), N=st.integers(1, 40000), K=st.integers(1, 70000),
       sm=st.sampled_from([1, 16, 78, 132]))
def test_skinny_plan_covers_every_element_once(M: int, N: int, K: int, sm: int) -> None:
    p = engine.skinny_plan(M, N, K, sm)
    assert p.mt in engine._SKINNY_MT
    threads = 32 * engine._SKINNY_WARPS
    if p.mt == 16:   # the wgmma tile: its own block, 64 columns per warpgroup
        threads = 128 * engine._SKINNY_WG
        assert p.fn == "gemm_skinny_16wg"
        cols = 64 * engine._SKINNY_WG
    else:
        assert p.fn == engine._SKINNY_FN[p.mt]
        cols = engine._SKINNY_COLS
    assert p.rtiles == math.ceil(M / p.mt) and p.ctiles == math.ceil(N / cols)
    assert p.grid == (p.ctiles * p.rtiles, p.splits)
    assert p.kspan % 128 == 0 and p.kspan > 0
    # the splits partition K: every split starts inside it, together they reach its end
    assert (p.splits - 1) * p.kspan < K <= p.splits * p.kspan
    assert 1 <= p.splits <= 64
    assert p.threads == threads


@pytest.mark.parametrize("M,mt,rtiles", [(1, 1, 1), (2, 2, 1), (3, 4, 1), (4, 4, 1), (5, 4, 2),
                                         (8, 4, 2), (9, 16, 1), (12, 16, 1), (13, 16, 1),
                                         (16, 16, 1), (17, 16, 2), (64, 16, 4)])
def test_skinny_row_tiles_follow_the_measured_policy(M: int, mt: int, rtiles: int) -> None:
    """4-row tiles side by side up to SKINNY_ROW_TILES of them (5-8 rows), one 16-row tile
    from 9 rows (docs/engine.md)."""
    p = engine.skinny_plan(M, 16384, 16384, 132)
    assert (p.mt, p.rtiles) == (mt, rtiles)


@pytest.mark.parametrize("M", [1, 3, 5, 12, 13, 16, 17, 33, 64])
@pytest.mark.parametrize("N,K", [(512, 512), (1024, 1024), (2048, 2048), (4096, 1024),
                                 (4096, 2048), (1000, 4200)])
def test_skinny_row_tiles_of_l2_resident_weights(M: int, N: int, K: int) -> None:
    """A weight of at most SKINNY_L2_W elements (re-read from L2 by every row tile): 4-row
    tiles side by side up to 64 rows (SKINNY_L2_ROW_TILES of them); one row tile below 4
    rows; a larger weight takes the 16-row tile from 9 rows."""
    p = engine.skinny_plan(M, N, K, 132)
    if N * K <= config.SKINNY_L2_W:
        assert (p.mt, p.rtiles) == (min(4, 1 << (M - 1).bit_length()), math.ceil(M / 4)) \
            if M <= 4 else (p.mt, p.rtiles) == (4, math.ceil(M / 4))
    else:   # the policy of test_skinny_row_tiles_follow_the_measured_policy
        q = engine.skinny_plan(M, 16384, 16384, 132)
        assert (p.mt, p.rtiles) == (q.mt, q.rtiles)


def test_skinny_plan_tuning_variant_block() -> None:
    """A variant's block (columns, threads) sets the column tiles and the launch; 16-row
    tiles (the wgmma form) keep their own block whatever ``cols`` says."""
    p = engine.skinny_plan(4, 1000, 4096, 132, cols=64, threads=256)
    assert p.ctiles == math.ceil(1000 / 64) and p.threads == 256
    q = engine.skinny_plan(16, 16384, 16384, 132, cols=64, threads=128)
    assert q.fn == "gemm_skinny_16wg" and q.threads == 256 and q.ctiles == 16384 // 128


@settings(max_examples=examples(200), deadline=None, derandomize=True, database=None)
@given(M=st.integers(1, 20000), N=st.integers(1, 40000), K=st.integers(1, 40000),
       sm=st.sampled_from([78, 132]))
def test_engine_splits_only_where_tiles_leave_sms_idle(M: int, N: int, K: int, sm: int) -> None:
    tiles = math.ceil(M / engine._BM) * math.ceil(N / engine._BN)
    s = engine.hybrid_splits(M, N, K, sm)
    assert 1 <= s <= 16
    if tiles >= sm:
        assert s == 1
    else:
        assert tiles * s <= max(sm, tiles)   # no more work items than SMs
        assert s == 1 or math.ceil(K / engine._BK) // s >= 4   # >= 4 K blocks a split


@settings(max_examples=examples(300), deadline=None, derandomize=True, database=None)
@given(tiles=st.integers(1, 5000), smax=st.integers(1, 64), resident=st.integers(1, 600))
def test_whole_waves_takes_the_fewest_waves_per_split(tiles: int, smax: int,
                                                      resident: int) -> None:
    """engine._whole_waves against the plain search over every split count: the least
    ceil(tiles * s / resident) / s, ties to the fewest splits (within the wave counts it
    looks at: the first 64)."""
    s = engine._whole_waves(tiles, smax, resident)
    assert 1 <= s <= smax
    cost = {k: math.ceil(tiles * k / resident) / k for k in range(1, smax + 1)
            if math.ceil(tiles * k / resident) <= math.ceil(tiles / resident) + 63}
    best = min(cost.values())
    assert math.isclose(cost[s], best, rel_tol=1e-12), (s, cost[s], best)
    assert s == min(k for k, c in cost.items() if math.isclose(c, best, rel_tol=1e-12))


@pytest.mark.parametrize("N,K", [(16384, 16384), (12288, 12288), (4096, 4096), (32768, 8192),
                                 (8192, 8192), (16384, 1024)])
def test_tensor_core_tiles_fill_whole_waves(N: int, K: int) -> None:
    """The measured cases of _whole_waves' docstring (132 SMs, 2 blocks of 8 warps each):
    the split is the least waves per split over every count K allows (worked out here
    from its definition, not from the code), and the last wave is at least 90% full."""
    p = engine.skinny_plan(16, N, K, 132)
    tiles = -(-N // 128)                      # 8 warps x 16 columns per block
    smax = min(K // 512, 64)
    cost = [(math.ceil(tiles * s / 264) / s, s) for s in range(1, smax + 1)]
    want = min(cost)[1]                        # least cost, then fewest splits
    assert p.mt == 16 and p.splits == want, (p.splits, want)
    blocks = p.ctiles * p.splits
    assert blocks / (264 * math.ceil(blocks / 264)) >= 0.9


@settings(max_examples=examples(300), deadline=None, derandomize=True, database=None)
@given(M=st.integers(1, 40000), N=st.integers(1, 40000), K=st.integers(4, 70000),
       sm=st.sampled_from([1, 2, 16, 78, 132]))
def test_wide_grid_has_a_work_item_per_cta(M: int, N: int, K: int, sm: int) -> None:
    """The wide kernel's persistent grid (engine.wide_grid): at most one CTA per SM and no
    CTA without a work item (128 x 256 tile, K split); K split only where the tiles leave
    SMs idle, at most 16 ways (config.CERTIFY_MAX_SPLITS)."""
    splits = engine.wide_splits(M, N, K, sm)
    grid = engine.wide_grid(M, N, splits, sm)
    items = math.ceil(M / 128) * math.ceil(N / 256) * splits
    assert 0 < grid <= sm and grid <= items
    assert grid == sm or grid == items
    assert 1 <= splits <= 16
    assert splits == 1 or math.ceil(M / 128) * math.ceil(N / 256) < sm


# --- a weight nothing keeps a derived copy of: cuBLAS at "highest", not a split per call

@pytest.fixture
def tf32_flag():
    """Sets torch's TF32 matmul switch for the test, the old value back after it."""
    old = torch.backends.cuda.matmul.allow_tf32

    def set_(v: bool) -> None:
        torch.backends.cuda.matmul.allow_tf32 = v

    yield set_
    torch.backends.cuda.matmul.allow_tf32 = old


def test_uncached_weights_are_those_without_a_kept_split(tf32_flag):
    """No owner (a plain CuPy/NumPy weight) or an inference tensor (no version counter):
    uncached; a torch weight (parameter or plain tensor) keeps its split; with torch's TF32
    on, "highest" was asked for explicitly, so the split is made even per call."""
    from cupyfuse.backend.gemm import uncached

    tf32_flag(False)
    w = torch.randn(8, 4)
    assert uncached(w, None)
    assert not uncached(w, w)
    assert not uncached(w, torch.nn.Parameter(w.clone()))
    with torch.inference_mode():
        wi = torch.randn(8, 4)
    assert uncached(wi, wi)
    assert uncached(w, w, (w, wi))   # a dependency without a version counter
    tf32_flag(True)
    assert not uncached(w, None) and not uncached(wi, wi)


def test_uncached_weight_takes_cublas_at_highest(monkeypatch, tf32_flag):
    """linear_nobias at "highest" past the skinny batches: an uncached weight runs torch.mm
    (cuBLAS) and never builds the split; a kept one builds it (the engine stubbed: no GPU
    here)."""
    from cupyfuse.backend import gemm

    tf32_flag(False)
    built = []
    monkeypatch.setattr(gemm, "engine_for", lambda x, w: "sm90")
    monkeypatch.setattr(gemm, "skinny_for", lambda M, N, K: False)
    monkeypatch.setattr(gemm, "_hybrid_operands", lambda *a, **k: built.append(1) or (None,) * 6)
    monkeypatch.setattr(gemm.engine, "gemm_hybrid", lambda *a, **k: None)

    class Cuda(torch.Tensor):   # x.is_cuda for the dispatch; the math stays on the CPU
        @property
        def is_cuda(self):
            return True

    x, w = torch.randn(64, 16).as_subclass(Cuda), torch.randn(32, 16)
    out = torch.empty(64, 32)
    assert gemm.linear_nobias(x, w, out, precision="highest", owner=None) == "cublas"
    assert not built
    torch.testing.assert_close(out, (x.as_subclass(torch.Tensor) @ w.t()))
    gemm.linear_nobias(x, w, out, precision="highest", owner=w)
    assert built == [1]
    assert not gemm.epilogue_ok(x, w, "highest", owner=None)
