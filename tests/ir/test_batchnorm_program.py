"""39's function, ``cupyfuse.kernelbench.gemm_scale_batchnorm``, as a tail program (ops._bn_program):
every combination of its options drawn by hypothesis and compared with ``F.batch_norm``
on float64 copies -- output and the running buffers it updates in place -- on the CPU
path (the same program the GPU runs). NaN rows as PyTorch places them.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupyfuse
from cupyfuse.kernelbench import ops
from helpers import examples

ATOL = RTOL = 1e-4


def _settings(n: int) -> settings:
    return settings(max_examples=examples(n), deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def bn_calls(draw: st.DrawFn) -> dict:
    k = draw(st.integers(1, 40))
    n = draw(st.integers(1, 37))
    batch = draw(st.integers(2, 19))
    seed = draw(st.integers(0, 2 ** 16))
    g = torch.Generator().manual_seed(seed)
    scale_n = draw(st.sampled_from([1, n]))
    c = {
        "x": torch.randn(batch, k, generator=g) * draw(st.sampled_from([0.1, 1.0, 30.0])),
        "weight": torch.randn(n, k, generator=g) / math.sqrt(k),
        "bias": torch.randn(n, generator=g) if draw(st.booleans()) else None,
        "scale": torch.randn(scale_n, generator=g) + 0.5,
        "running": draw(st.booleans()),
        "bn_weight": torch.rand(n, generator=g) + 0.5 if draw(st.booleans()) else None,
        "bn_bias": torch.randn(n, generator=g) if draw(st.booleans()) else None,
        "training": draw(st.booleans()),
        "momentum": draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
        "eps": draw(st.sampled_from([1e-5, 1e-3, 0.5])),
    }
    if draw(st.booleans()):   # a NaN row: NaN in every column's statistics
        c["x"][draw(st.integers(0, batch - 1)), 0] = float("nan")
    c["rm"] = torch.randn(n, generator=g) if c["running"] else None
    c["rv"] = torch.rand(n, generator=g) + 0.1 if c["running"] else None
    return c


def _reference(c: dict) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    d = lambda t: None if t is None else t.double()  # noqa: E731
    h = c["x"].double() @ c["weight"].double().T
    if c["bias"] is not None:
        h = h + c["bias"].double()
    h = h * c["scale"].double()
    rm, rv = d(c["rm"]), d(c["rv"])
    out = F.batch_norm(h, rm, rv, d(c["bn_weight"]), d(c["bn_bias"]),
                       training=c["training"] or rm is None, momentum=c["momentum"],
                       eps=c["eps"])
    return out, rm, rv


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    want = want.float().double()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN placement"
    fin = ~torch.isnan(want)
    assert torch.allclose(got.double()[fin], want[fin], atol=ATOL, rtol=RTOL), (
        f"{what}: max |diff| {float((got.double()[fin] - want[fin]).abs().max()):.3e}")


@_settings(80)
@given(c=bn_calls())
def test_function_matches_batch_norm_in_float64(c: dict) -> None:
    rm = None if c["rm"] is None else c["rm"].clone()
    rv = None if c["rv"] is None else c["rv"].clone()
    out = cupyfuse.kernelbench.gemm_scale_batchnorm(c["x"], c["weight"], c["bias"], c["scale"], rm, rv,
                                        c["bn_weight"], c["bn_bias"], training=c["training"],
                                        momentum=c["momentum"], eps=c["eps"])
    want, rm64, rv64 = _reference(c)
    assert out.dtype == torch.float32 and tuple(out.shape) == tuple(want.shape)
    _close(out, want, "output")
    if rm is not None:   # updated in place in training mode, untouched in eval mode
        _close(rm, rm64, "running_mean")
        _close(rv, rv64, "running_var")


def test_programs_are_built_once_per_structure() -> None:
    """Calls with the same structure (shapes, flags, momentum, eps) reuse one program; a
    different option builds another."""
    ops._bn_programs.clear()
    g = torch.Generator().manual_seed(0)
    x, w, s = torch.randn(6, 5, generator=g), torch.randn(4, 5, generator=g), torch.ones(4)
    for _ in range(3):
        cupyfuse.kernelbench.gemm_scale_batchnorm(x, w, None, s, None, None)
    assert len(ops._bn_programs) == 1
    cupyfuse.kernelbench.gemm_scale_batchnorm(x, w, None, s, None, None, eps=1e-3)
    assert len(ops._bn_programs) == 2


@pytest.mark.parametrize("training", [True, False])
def test_running_buffers_updated_only_in_training(training: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 7, generator=g), torch.randn(3, 7, generator=g)
    rm, rv = torch.zeros(3), torch.ones(3)
    cupyfuse.kernelbench.gemm_scale_batchnorm(x, w, None, torch.ones(3), rm, rv, training=training,
                                  momentum=0.25)
    h = (x.double() @ w.double().T)
    if training:
        assert torch.allclose(rm.double(), 0.25 * h.mean(0), atol=1e-6)
        assert torch.allclose(rv.double(), 0.75 + 0.25 * h.var(0, unbiased=True), atol=1e-5)
    else:
        assert torch.equal(rm, torch.zeros(3)) and torch.equal(rv, torch.ones(3))
