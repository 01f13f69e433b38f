"""Module-level numbers read by a forward or a tail, through the prepared launches: a
change reaches the fast path's key (tests/frontend/test_globals.py has the CPU side)."""
from __future__ import annotations

import warnings

import pytest
import torch

import cupyfuse
import test_globals as g
from cupyfuse.interop import cupy_available

pytestmark = [
    pytest.mark.usefixtures("fp32_matmul"),
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and cupy_available()),
                       reason="needs a CUDA GPU visible to both torch and CuPy"),
]


@pytest.mark.parametrize("batch", [3, 40])
@pytest.mark.parametrize("name,value", [("SCALE", 2.0), ("FLAG", False)])
def test_a_changed_global_reaches_the_prepared_launches(batch, name, value):
    torch.manual_seed(0)
    m = g.Net().cuda()
    fm = cupyfuse.from_model(m)
    x = torch.randn(batch, 8, device="cuda")
    saved = getattr(g, name)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            for v in (saved, value, saved):
                setattr(g, name, v)
                for _ in range(3):   # the first call prepares, the next ones run prepared
                    torch.testing.assert_close(fm(x), m(x), atol=1e-4, rtol=1e-4)
    finally:
        setattr(g, name, saved)


def test_fused_linear_tail_global_on_the_gpu():
    torch.manual_seed(1)
    x, w, b = (torch.randn(6, 8, device="cuda"), torch.randn(16, 8, device="cuda"),
               torch.randn(16, device="cuda"))
    try:
        for v in (0.5, 2.0, 0.5):
            g.s_glob = v
            want = torch.tanh((x.double() @ w.double().t() + b.double()) * v)
            for _ in range(3):
                torch.testing.assert_close(cupyfuse.fused_linear(x, w, b, g._tail).double(),
                                           want, atol=1e-4, rtol=1e-4)
    finally:
        g.s_glob = 0.5


@pytest.mark.parametrize("form", g.FORMS)
def test_outside_values_reach_the_prepared_launches(form):
    """The forms of tests/frontend/test_globals.py, changed between prepared calls."""
    saved = (g.ZERO, g.ACT, g.TUP, list(g.LST), dict(g.DCT), g.Forms.C, g._globals_mod.K,
             g._globals_mod.cfg.scale, g.OFFSET, g.BIAS)
    torch.manual_seed(3)
    m = g.Forms(form).cuda()
    fm = cupyfuse.from_model(m)
    x = torch.randn(5, 8, device="cuda")
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            for _ in range(3):
                torch.testing.assert_close(fm(x), m(x), atol=1e-4, rtol=1e-4)
            g._change(form)
            for _ in range(3):
                got, want = fm(x), m(x)
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
                assert torch.equal(torch.signbit(got), torch.signbit(want))
    finally:
        g.ZERO, g.ACT, g.TUP = saved[:3]
        g.LST[:] = saved[3]
        g.DCT.clear()
        g.DCT.update(saved[4])
        (g.Forms.C, g._globals_mod.K, g._globals_mod.cfg.scale, g.OFFSET,
         g.BIAS) = saved[5:]


def test_module_attribute_zero_sign_on_the_prepared_path():
    torch.manual_seed(5)
    m = g._ZeroScale().cuda()
    fm = cupyfuse.from_model(m)
    x = torch.randn(3, 8, device="cuda")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for z in (0.0, -0.0, 0.0):
            m.z = z
            for _ in range(3):
                got, want = fm(x), m(x)
                assert torch.equal(torch.signbit(got), torch.signbit(want)), z
                assert torch.isinf(got).all()


@pytest.mark.parametrize("what", g.ATTR_FORMS)
def test_container_and_object_attributes_on_the_prepared_path(what):
    torch.manual_seed(6)
    m = g._Attrs().cuda()
    fm = cupyfuse.from_model(m)
    x = torch.randn(4, 8, device="cuda")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for step in range(3):
            if step == 1:
                g._mutate(m, what)
            if step == 2 and what == "object_rebound":
                m.cfg.s = 0.25
            for _ in range(3):
                torch.testing.assert_close(fm(x), m(x), atol=1e-4, rtol=1e-4)
