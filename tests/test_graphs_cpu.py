"""CPU-side checks of the CUDA-graph cache (cupyfuse/graphs.py): switches, copies and
pickling of modules that carry one, and that CPU calls never take the graph path."""
from __future__ import annotations

import copy
import io

import pytest
import torch

from cupyfuse import graphs, models
from cupyfuse import nn as cnn


@pytest.mark.parametrize("value,expected", [("1", True), ("", True), ("0", False), ("off", False),
                                            ("False", False), ("no", False), ("yes", True)])
def test_env_switch(monkeypatch, value, expected):
    monkeypatch.setenv("CUPYFUSE_GRAPHS", value)
    assert graphs.enabled() is expected


def _fused(problem="56"):
    init = {"55": (30, 20, 2, 0.5), "56": (30, 20), "98": (30, 24, 4, 2.0)}[problem]
    torch.manual_seed(0)
    return models.PROBLEMS[problem].model(*init), cnn.from_model(
        models.PROBLEMS[problem].model(*init)), init


@pytest.mark.parametrize("problem", ["55", "56", "98"])
def test_cpu_calls_stay_eager_and_match_the_model(problem):
    model, fused, init = _fused(problem)
    fused.load_state_dict(model.state_dict())
    x = torch.rand(6, init[0])
    with torch.no_grad():
        outs = [fused(x) for _ in range(3)]
        want = model(x)
    assert len(fused._graphs) == 0
    for o in outs:
        torch.testing.assert_close(o, want.reshape(o.shape), atol=1e-5, rtol=1e-5)


def test_copies_and_pickles_start_with_no_graphs():
    _, fused, _ = _fused("98")
    fake = object()
    fused._graphs._entries[("k",)] = fake   # stand-in for a captured graph
    assert len(fused._graphs) == 1
    twin = copy.deepcopy(fused)
    assert isinstance(twin._graphs, graphs.GraphCache) and len(twin._graphs) == 0
    buf = io.BytesIO()
    torch.save(fused, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert len(loaded._graphs) == 0 and loaded.cuda_graphs
    graphs.clear_all()
    assert len(fused._graphs) == 0
    assert set(fused.state_dict()) == {"matmul.weight", "matmul.bias"}
