"""Module-level numbers read by a forward or a tail: torch.fx bakes their values into a
trace, so a change must make a new program (the old value kept would be a silent
wrong answer). CPU here; tests/frontend/test_globals_gpu.py runs the prepared launches."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import cupyfuse
from cupyfuse.frontend import trace as tracing

SCALE = 0.5
OFFSET = 1.0
BIAS = 0.0
FLAG = True


def act(h):
    return h * OFFSET


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def helper(self, h):
        return h + BIAS

    def forward(self, x):
        h = self.helper(act(self.fc(x))) * SCALE
        return torch.relu(h) if FLAG else torch.sigmoid(h)


def _set(name, value):
    globals()[name] = value


@pytest.fixture(autouse=True)
def _restore():
    saved = {k: globals()[k] for k in ("SCALE", "OFFSET", "BIAS", "FLAG")}
    yield
    globals().update(saved)


def test_global_reads_follow_functions_methods_and_subclasses():
    names = {n for _, n in tracing.global_reads(Net())}
    assert {"SCALE", "OFFSET", "BIAS", "FLAG"} <= names
    names = {n for _, n in tracing.global_reads(cupyfuse.fused_class(Net)())}
    assert {"SCALE", "OFFSET", "BIAS", "FLAG"} <= names
    assert not tracing.global_reads(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


@pytest.mark.parametrize("how", ["from_model", "fused_class"])
@pytest.mark.parametrize("name,value", [("SCALE", 2.0), ("OFFSET", -3.0), ("BIAS", 1.5),
                                        ("FLAG", False)])
def test_a_changed_global_makes_a_new_program(how, name, value):
    torch.manual_seed(0)
    m = Net()
    if how == "from_model":
        fm = cupyfuse.from_model(m)
    else:
        fm = cupyfuse.fused_class(Net)()
        fm.load_state_dict(m.state_dict())
    x = torch.randn(5, 8)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(fm(x), m(x), atol=1e-5, rtol=1e-5)
        _set(name, value)
        torch.testing.assert_close(fm(x), m(x), atol=1e-5, rtol=1e-5)
        _set(name, {"SCALE": 0.5, "OFFSET": 1.0, "BIAS": 0.0, "FLAG": True}[name])
        torch.testing.assert_close(fm(x), m(x), atol=1e-5, rtol=1e-5)


s_glob = 0.5


def _tail(h):
    return torch.tanh(h * s_glob)


def test_fused_linear_tail_reading_a_changed_global():
    global s_glob
    torch.manual_seed(1)
    x, w, b = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)
    try:
        for v in (0.5, 2.0, 0.5):
            s_glob = v
            want = torch.tanh((x.double() @ w.double().t() + b.double()) * v)
            torch.testing.assert_close(cupyfuse.fused_linear(x, w, b, _tail).double(), want,
                                       atol=1e-5, rtol=1e-5)
    finally:
        s_glob = 0.5


def test_closure_variable_rebound_between_calls():
    torch.manual_seed(2)
    x, w, b = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)
    k = 0.5

    def tail(h):
        return torch.sigmoid(h) * k

    for v in (0.5, 3.0, 0.5):
        k = v
        want = torch.sigmoid(x.double() @ w.double().t() + b.double()) * v
        torch.testing.assert_close(cupyfuse.fused_linear(x, w, b, tail).double(), want,
                                   atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------
# the other ways a forward reads a value outside its module (each changed after a call)
import functools  # noqa: E402

import globals_mod as _globals_mod  # noqa: E402

ZERO = 0.0
LST = [1.0, 2.0]
TUP = (1.0,)
DCT = {"s": 1.0}


def _act(h):
    return torch.relu(h)


ACT = torch.relu


def _deco(f):
    @functools.wraps(f)
    def inner(h):
        return f(h)
    return inner


@_deco
def _decorated(h):
    return h * OFFSET


def _scaled(h, s):
    return h * s * OFFSET


_partial = functools.partial(_scaled, s=2.0)


class _Sub(nn.Module):
    def helper(self, h):
        return h - BIAS


class Forms(nn.Module):
    C = 1.5

    def __init__(self, form):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.sub = _Sub()
        self.form = form

    def forward(self, x):
        h = self.fc(x)
        f = self.form
        if f == "class_attr":
            return h * self.C
        if f == "other_module":
            return h * _globals_mod.K
        if f == "getattr_module":
            return h * getattr(_globals_mod, "K")
        if f == "object_attr":
            return h * _globals_mod.cfg.scale
        if f == "negzero":
            return 1.0 / ((h.abs() + 1.0) * ZERO)
        if f == "function_rebound":
            return ACT(h)
        if f == "decorated":
            return _decorated(h)
        if f == "partial":
            return _partial(h)
        if f == "list":
            return h * LST[1]
        if f == "tuple":
            return h * TUP[0]
        if f == "dict":
            return h * DCT["s"]
        if f == "submodule_method":
            return self.sub.helper(h)
        raise AssertionError(f)


def _change(form):
    global ZERO, ACT, TUP, OFFSET, BIAS
    if form == "class_attr":
        Forms.C = 4.0
    elif form in ("other_module", "getattr_module"):
        _globals_mod.K = 5.0
    elif form == "object_attr":
        _globals_mod.cfg.scale = -2.0
    elif form == "negzero":
        ZERO = -0.0
    elif form == "function_rebound":
        ACT = torch.sigmoid
    elif form in ("decorated", "partial"):
        OFFSET = 3.0
    elif form == "list":
        LST[1] = 7.0
    elif form == "tuple":
        TUP = (9.0,)
    elif form == "dict":
        DCT["s"] = -1.0
    elif form == "submodule_method":
        BIAS = 2.5


FORMS = ["class_attr", "other_module", "getattr_module", "object_attr", "negzero",
         "function_rebound", "decorated", "partial", "list", "tuple", "dict",
         "submodule_method"]


@pytest.mark.parametrize("form", FORMS)
def test_every_form_of_outside_value_is_followed(form):
    """Each form, kept stale, gives a silent wrong answer: torch's value after the change."""
    global ZERO, ACT, TUP
    saved = (ZERO, ACT, TUP, list(LST), dict(DCT), Forms.C, _globals_mod.K,
             _globals_mod.cfg.scale)
    torch.manual_seed(3)
    m = Forms(form)
    fm = cupyfuse.from_model(m)
    x = torch.randn(5, 8)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(fm(x), m(x), atol=1e-5, rtol=1e-5)
            _change(form)
            want = m(x)
            got = fm(x)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert torch.equal(torch.signbit(got), torch.signbit(want))   # -inf vs +inf
    finally:
        ZERO, ACT, TUP = saved[:3]
        LST[:] = saved[3]
        DCT.clear()
        DCT.update(saved[4])
        Forms.C, _globals_mod.K, _globals_mod.cfg.scale = saved[5:]


def test_tail_defaults_reassigned():
    torch.manual_seed(4)
    x, w, b = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)

    def tail(h, s=2.0):
        return h * s

    torch.testing.assert_close(cupyfuse.fused_linear(x, w, b, tail), (x @ w.t() + b) * 2.0)
    tail.__defaults__ = (3.0,)
    torch.testing.assert_close(cupyfuse.fused_linear(x, w, b, tail), (x @ w.t() + b) * 3.0)


class _ZeroScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.z = 0.0

    def forward(self, x):
        return 1.0 / ((self.fc(x).abs() + 1.0) * self.z)


def test_module_attribute_zero_sign_makes_a_new_program():
    """A module attribute changed from 0.0 to -0.0 (== in Python): torch's -inf."""
    torch.manual_seed(5)
    m = _ZeroScale()
    fm = cupyfuse.from_model(m)
    x = torch.randn(3, 8)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for z in (0.0, -0.0, 0.0):
            m.z = z
            got, want = fm(x), m(x)
            assert torch.equal(got, want), (z, got[0, :3], want[0, :3])


class _Cfg:
    pass


class _Attrs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.lst, self.d, self.t = [1.0, 2.0], {"a": 1.0}, (1.0,)
        self.cfg = _Cfg()
        self.cfg.s = 1.0

    def forward(self, x):
        return self.fc(x) * self.lst[1] * self.cfg.s * self.d["a"] * self.t[0]


def _mutate(m, what):
    if what == "list":
        m.lst[1] = 5.0
    elif what == "object":
        m.cfg.s = 3.0
    elif what == "object_rebound":
        m.cfg = _Cfg()
        m.cfg.s = -2.0
    elif what == "dict":
        m.d["a"] = -1.0
    elif what == "tuple":
        m.t = (7.0,)


ATTR_FORMS = ["list", "object", "object_rebound", "dict", "tuple"]


@pytest.mark.parametrize("what", ATTR_FORMS)
def test_container_and_object_attributes_are_followed(what):
    torch.manual_seed(6)
    m = _Attrs()
    fm = cupyfuse.from_model(m)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(fm(x), m(x), atol=1e-5, rtol=1e-5)
        _mutate(m, what)
        torch.testing.assert_close(fm(x), m(x), atol=1e-5, rtol=1e-5)
        if what == "object_rebound":   # the new object's attribute is watched too
            m.cfg.s = 0.25
            torch.testing.assert_close(fm(x), m(x), atol=1e-5, rtol=1e-5)
