"""Module-level numbers read by a forward or a tail: torch.fx bakes their values into a
trace, so a change must make a new program (it used to keep the old value: a silent
wrong answer). CPU here; tests/test_globals_gpu.py runs the prepared launches."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import cupyfuse
from cupyfuse import capture

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
    names = {n for _, n in capture.global_reads(Net())}
    assert {"SCALE", "OFFSET", "BIAS", "FLAG"} <= names
    names = {n for _, n in capture.global_reads(cupyfuse.fused_class(Net)())}
    assert {"SCALE", "OFFSET", "BIAS", "FLAG"} <= names
    assert not capture.global_reads(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


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
