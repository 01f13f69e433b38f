"""GPU tests of the modules' CUDA-graph replay (cupyfuse/graphs.py): a replay must give what
the eager path gives, see new input contents and parameter edits, never hand out a buffer
the next call overwrites, and stand aside where it cannot be exact."""
from __future__ import annotations

import pytest
import torch

import cupyfuse
from cupyfuse import graphs, interop, models
from cupyfuse import nn as cnn
from cupyfuse.interop import cupy_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and cupy_available()),
                       reason="needs a CUDA GPU visible to both torch and CuPy"),
]

CASES = [("55", (300, 258, 2, 0.5), 37), ("55", (200, 97, 3, 0.5), 33), ("56", (300, 259), 37),
         ("98", (300, 264, 16, 2.0), 37)]


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """Graphs serve the named ops' own kernels: small and mid batches, which run prepared
    generic launches instead (tests/test_gpu_prepared.py), are switched off here."""
    from cupyfuse import ops

    monkeypatch.setattr(ops, "GENERIC_SMALL_BATCHES", False)
    interop.poison_outputs = False
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    cupyfuse.clear_cache()


def _make(problem, init):
    torch.manual_seed(0)
    model = models.PROBLEMS[problem].model(*init).cuda()
    return model, cnn.from_model(model)


def _eager(fused, x):
    with torch.no_grad():
        return fused._eager(x)


@pytest.mark.parametrize("problem,init,batch", CASES)
def test_replay_equals_eager_and_follows_new_contents(problem, init, batch):
    _, fused = _make(problem, init)
    x = torch.rand(batch, init[0], device="cuda")
    with torch.no_grad():
        outs = [fused(x) for _ in range(4)]
    assert len(fused._graphs) == 1, "the second call should have captured a graph"
    want = _eager(fused, x)
    for o in outs:
        assert torch.equal(o, want)
    assert outs[2].data_ptr() != outs[3].data_ptr(), "each call returns its own tensor"
    # new contents at the same address: the replay reads them
    first = outs[3].clone()
    x.copy_(torch.randn_like(x) * 3.0)
    with torch.no_grad():
        new = fused(x)
    assert len(fused._graphs) == 1
    assert torch.equal(new, _eager(fused, x))
    assert not torch.equal(new, first)
    assert torch.equal(outs[3], first), "an earlier result changed under a later call"


@pytest.mark.parametrize("problem,init,batch", CASES[:1] + CASES[2:])
def test_parameter_edits_reassignment_and_state_dict_are_seen(problem, init, batch):
    model, fused = _make(problem, init)
    lin = next(m for m in fused.modules() if isinstance(m, torch.nn.Linear))
    x = torch.rand(batch, init[0], device="cuda")
    with torch.no_grad():
        for _ in range(3):
            fused(x)
        lin.weight.mul_(-0.5)                      # in place: version counter
        assert torch.equal(fused(x), _eager(fused, x))
        assert torch.equal(fused(x), _eager(fused, x))
        lin.bias = torch.nn.Parameter(torch.randn_like(lin.bias))   # reassignment
        for _ in range(3):
            assert torch.equal(fused(x), _eager(fused, x))
        fused.load_state_dict(model.state_dict())  # back to the original's weights
        for _ in range(3):
            assert torch.equal(fused(x), _eager(fused, x))
    assert len(fused._graphs) <= graphs.MAX_GRAPHS
    # graphs of parameters the module no longer has were dropped
    assert len(fused._graphs) == 1


def test_streams_precisions_and_batches_get_their_own_graphs():
    _, fused = _make("56", (300, 259))
    xs = [torch.rand(b, 300, device="cuda") for b in (5, 37, 64)]
    s = torch.cuda.Stream()
    with torch.no_grad():
        for x in xs:
            for _ in range(3):
                assert torch.equal(fused(x), _eager(fused, x))
        with torch.cuda.stream(s):
            x = xs[1]
            for _ in range(3):
                o = fused(x)
            s.synchronize()
            assert torch.equal(o, _eager(fused, x))
        for prec in ("high", "medium", "highest"):
            fused.precision = prec
            for _ in range(3):
                o = fused(xs[0])
            assert torch.equal(o, _eager(fused, xs[0])), prec
    assert len(fused._graphs) == graphs.MAX_GRAPHS   # LRU-bounded


def test_graphs_stand_aside():
    _, fused = _make("98", (300, 264, 16, 2.0))
    x = torch.rand(37, 300, device="cuda")
    for _ in range(3):
        out = fused(x)                            # grad mode: graphs too (forward-only)
    assert len(fused._graphs) == 1 and not out.requires_grad
    fused._graphs.clear()
    with torch.inference_mode():
        for _ in range(3):
            fused(x)
    assert len(fused._graphs) == 0
    with torch.no_grad():
        fused.cuda_graphs = False
        for _ in range(3):
            fused(x)
        fused.cuda_graphs = True
        for _ in range(3):
            fused(x[:, :])                        # a view: same geometry, graphs allowed
        assert len(fused._graphs) == 1
        fused._graphs.clear()
        xt = torch.rand(300, 37, device="cuda").t()   # non-contiguous: eager
        for _ in range(3):
            o = fused(xt)
        assert torch.equal(o, _eager(fused, xt.contiguous()))
        assert len(fused._graphs) == 0
    import os
    os.environ["CUPYFUSE_GRAPHS"] = "0"
    try:
        with torch.no_grad():
            for _ in range(3):
                fused(x)
        assert len(fused._graphs) == 0
    finally:
        del os.environ["CUPYFUSE_GRAPHS"]


def test_clear_cache_drops_graphs_and_copies_start_empty():
    import copy

    _, fused = _make("55", (300, 258, 2, 0.5))
    x = torch.rand(8, 300, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            fused(x)
        assert len(fused._graphs) == 1
        twin = copy.deepcopy(fused)
        assert len(twin._graphs) == 0
        assert torch.equal(twin(x), fused(x))
        cupyfuse.clear_cache()
        assert len(fused._graphs) == 0
        assert torch.equal(fused(x), _eager(fused, x))


def test_replay_inside_a_callers_capture_is_not_attempted():
    """A caller capturing its own graph around the module gets plain launches captured."""
    _, fused = _make("56", (300, 259))
    x = torch.rand(16, 300, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            want = fused(x)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fused(x)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            static = fused(x)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, want)


def test_cublas_path_follows_torchs_tf32_switch(monkeypatch):
    """On the cuBLAS path the GEMM kernel depends on PyTorch's TF32 switch: flipping it
    must not replay a graph captured under the other setting."""
    monkeypatch.setenv("CUPYFUSE_ENGINE", "cublas")
    _, fused = _make("56", (300, 259))
    x = torch.rand(37, 300, device="cuda")
    try:
        with torch.no_grad():
            for tf32 in (False, True, False):
                torch.backends.cuda.matmul.allow_tf32 = tf32
                for _ in range(3):
                    o = fused(x)
                assert torch.equal(o, _eager(fused, x)), tf32
        assert len(fused._graphs) == 2
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
