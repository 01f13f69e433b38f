"""GPU tests of certified row maxima (cupyfuse/ir/certify.py,
cupyfuse/backend/certified.py, kernels_cu/tail_certify.cuh): a GEMM (folded: average
pooling after the Linear; or plain) read only through the row max/min of an elementwise
chain runs one TF32 pass whose candidates are recomputed in fp32. Drawn chains
(hypothesis) and hand-made hard cases -- every column a candidate, NaN/inf/huge rows,
KernelBench 98's and 80's sizes -- against a float64 reference (atol = rtol = 1e-4),
through the general path (which records the candidates per row) and, for folded GEMMs,
prepared launches. Marked ``gpu``; Hopper only (the sm90 engine)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from cupyfuse.backend import execute
from cupyfuse import config
import cupyfuse
from cupyfuse.ir import certify
from cupyfuse.kernelbench import models
from cupyfuse.backend import prepared
from cupyfuse.interop import cupy_available
from helpers import quiet
from cupyfuse.backend import certified
from helpers import examples

pytestmark = [
    pytest.mark.usefixtures("fp32_matmul"),
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and cupy_available()
                            and torch.cuda.get_device_capability() == (9, 0)),
                       reason="certification runs on the sm90 engine (a Hopper GPU with CuPy)"),
]

#: chain ops: (name, fn of the value and the model's per-feature vector p)
OPS = {
    "gelu": lambda v, p: F.gelu(v),
    "silu": lambda v, p: F.silu(v),
    "mish": lambda v, p: F.mish(v),
    "tanh": lambda v, p: torch.tanh(v),
    "sigmoid": lambda v, p: torch.sigmoid(v),
    "relu": lambda v, p: torch.relu(v),
    "abs": lambda v, p: v.abs(),
    "square": lambda v, p: torch.square(v),
    "hardswish": lambda v, p: F.hardswish(v),
    "leaky": lambda v, p: F.leaky_relu(v, -0.3),
    "elu": lambda v, p: F.elu(v, 0.7),
    "softplus": lambda v, p: F.softplus(v, 2.0, 5.0),
    "clamp": lambda v, p: torch.clamp(v, -0.5, 0.8),
    "scale": lambda v, p: v * -1.7,
    "addp": lambda v, p: v + p,
    "mulp": lambda v, p: v * p,
    "rsub": lambda v, p: 0.25 - v,
    "divc": lambda v, p: v / 3.0,
    "exp": lambda v, p: torch.exp(v),
    "atan": lambda v, p: torch.atan(v),
}


class PoolChain(nn.Module):
    def __init__(self, K: int, N: int, k: int, ops: tuple[str, ...], red: str) -> None:
        super().__init__()
        self.lin = nn.Linear(K, N)
        self.pool = nn.AvgPool1d(k)
        self.p = nn.Parameter(torch.randn(N // k))
        self.ops, self.red = ops, red

    def forward(self, x):
        v = self.pool(self.lin(x).unsqueeze(1)).squeeze(1)
        for o in self.ops:
            v = OPS[o](v, self.p)
        return v.max(dim=1).values if self.red == "max" else v.min(dim=1).values


def _check(model: nn.Module, x: torch.Tensor, *, general: bool, monkeypatch) -> torch.Tensor:
    """The fused output against float64 (NaN where the reference has NaN); the candidate
    counts of the general path (None where certification did not run)."""
    if general:
        monkeypatch.setattr(config, "ENGINE_MAX_M", 0)
        monkeypatch.setattr(config, "ENGINE_MAX_MK", 0)
        monkeypatch.setattr(config, "ENGINE_MAX_MNK", 0)
    monkeypatch.setattr(config, "CERTIFY_RECORD", True)
    monkeypatch.setattr(certified, "last_counts", None)
    f = cupyfuse.from_model(model)
    for _ in range(2):   # the second call: prepared launches where they apply
        got = quiet(f, x)
    want = quiet(copy.deepcopy(model).double(), x.double())
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4, equal_nan=True)
    return certified.last_counts


@settings(max_examples=examples(12), deadline=None)
@given(ops=st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=4),
       red=st.sampled_from(["max", "min"]),
       shape=st.sampled_from([(300, 1000, 1040, 16), (257, 2048, 512, 4), (640, 512, 2048, 8),
                              (129, 4096, 1024, 2)]),
       dist=st.sampled_from(["rand", "randn", "offset"]),
       general=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_drawn_chains_match_float64(ops, red, shape, dist, general, seed):
    B, K, N, k = shape
    torch.manual_seed(seed)
    model = PoolChain(K, N, k, tuple(ops), red).cuda()
    x = torch.rand(B, K, device="cuda") if dist == "rand" else torch.randn(B, K, device="cuda")
    if dist == "offset":   # a large common part: every row's values close together
        x += 3.0
    with pytest.MonkeyPatch.context() as mp:   # undone after each example
        counts = _check(model, x, general=general, monkeypatch=mp)
    if general:
        assert counts is not None, "the general path did not certify"
        assert int(counts.min()) >= 1


@pytest.mark.parametrize("general", [True, False])
def test_every_column_a_candidate(general, monkeypatch):
    """Pooled columns equal up to 1e-7: every column's range reaches the row max, so every
    one is recomputed (counts = width) and the answer is still the float64 one."""
    torch.manual_seed(1)
    model = PoolChain(2048, 2048, 16, ("gelu", "scale"), "max").cuda()
    with torch.no_grad():
        model.lin.weight.copy_(model.lin.weight[:1] + 1e-7 * torch.randn_like(model.lin.weight))
        model.p.zero_()
    x = torch.randn(300, 2048, device="cuda")
    counts = _check(model, x, general=general, monkeypatch=monkeypatch)
    if general:
        assert int(counts.min()) == 2048 // 16


@pytest.mark.parametrize("general", [True, False])
def test_nonfinite_and_huge_rows(general, monkeypatch):
    """Rows the fold's guard recomputes (NaN, inf, |x| past the overflow bound) are left to
    it (count -1); the others are certified, a row of 1e30s among them."""
    torch.manual_seed(2)
    model = PoolChain(1024, 2048, 8, ("silu", "addp"), "max").cuda()
    x = torch.randn(200, 1024, device="cuda")
    x[3, 5] = float("nan")
    x[7, 0] = float("inf")
    x[11] *= 1e36   # K max|x| max|W| ~1e38, past 1e37: the guard's direct path
    x[13, 2] = -float("inf")
    x[17] *= 1e30   # large but under the guard's bound: certified
    x[19] *= 1e-30  # its squares underflow float: a loose bound, the same answer
    counts = _check(model, x, general=general, monkeypatch=monkeypatch)
    if general:
        assert sorted(int(i) for i in (counts < 0).nonzero().flatten()) == [3, 7, 11, 13]
        assert int(counts[counts >= 0].min()) >= 1
        # row 17's float sums of squares overflow: redone in double, a bound as tight as
        # any row's (an infinite norm would make every column a candidate)
        assert int(counts[17]) < 2048 // 8, int(counts[17])


def _agree_with_3xtf32(model: nn.Module, x: torch.Tensor, monkeypatch) -> torch.Tensor:
    """Certified (the general path: it records its candidate counts, returned) and the
    3xTF32 engine give the same result to float32 rounding, both within 1e-4 of float64."""
    monkeypatch.setattr(config, "CERTIFY_RECORD", True)
    monkeypatch.setattr(certified, "last_counts", None)
    got = quiet(cupyfuse.from_model(model), x)
    counts = certified.last_counts
    assert counts is not None, "not certified"
    monkeypatch.setattr(config, "CERTIFY", False)
    cupyfuse.clear_cache()
    plain = quiet(cupyfuse.from_model(model), x)
    want = quiet(copy.deepcopy(model).double(), x.double())
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)
    return counts


def test_certified_and_3xtf32_agree_on_98(monkeypatch):
    """KernelBench 98 at its size: certified (few candidates per row) and the 3xTF32
    engine agree."""
    torch.manual_seed(0)
    model = models.make_model("98", device="cuda")
    x = models.get_inputs("98", device="cuda")[0]
    monkeypatch.setattr(config, "ENGINE_MAX_MNK", 0)   # the general path records counts
    counts = _agree_with_3xtf32(model, x, monkeypatch)
    assert float(counts.float().mean()) < 8


class PlainChain(nn.Module):
    """A Linear read only through the row max/min of a chain (no pooling: a plain GEMM,
    whose guard rows the certification recomputes itself); ``after``: 80's tail after
    the max (max - mean of the max, GELU)."""

    def __init__(self, K: int, N: int, ops: tuple[str, ...], red: str, after: bool = False):
        super().__init__()
        self.lin = nn.Linear(K, N)
        self.p = nn.Parameter(torch.randn(N))
        self.ops, self.red, self.after = ops, red, after

    def forward(self, x):
        v = self.lin(x)
        for o in self.ops:
            v = OPS[o](v, self.p)
        v = v.max(dim=1, keepdim=True).values if self.red == "max" else \
            v.min(dim=1, keepdim=True).values
        if self.after:
            v = F.gelu(v - v.mean(dim=1, keepdim=True))
        return v


@settings(max_examples=examples(10), deadline=None)
@given(ops=st.lists(st.sampled_from(sorted(OPS)), min_size=0, max_size=3),
       red=st.sampled_from(["max", "min"]), after=st.booleans(),
       shape=st.sampled_from([(257, 1024, 2048), (300, 2048, 1000), (129, 512, 4096)]),
       dist=st.sampled_from(["rand", "randn", "offset"]), seed=st.integers(0, 2 ** 16))
def test_plain_gemm_chains_match_float64(ops, red, after, shape, dist, seed):
    B, K, N = shape
    torch.manual_seed(seed)
    model = PlainChain(K, N, tuple(ops), red, after).cuda()
    x = torch.rand(B, K, device="cuda") if dist == "rand" else torch.randn(B, K, device="cuda")
    if dist == "offset":
        x += 3.0
    with pytest.MonkeyPatch.context() as mp:
        counts = _check(model, x, general=True, monkeypatch=mp)
    assert counts is not None, "the plain GEMM was not certified"
    assert int(counts.min()) >= 1


def test_plain_gemm_guard_rows_recomputed_in_full(monkeypatch):
    """A plain GEMM has no fold_rows: rows with NaN, inf or |x| past the overflow bound get
    every column recomputed by the certification (count = width), NaN/inf where float64
    puts them."""
    torch.manual_seed(3)
    model = PlainChain(1024, 1536, ("addp", "gelu"), "max").cuda()
    x = torch.randn(100, 1024, device="cuda")
    x[3, 5] = float("nan")
    x[7, 0] = float("inf")
    x[11] *= 1e36
    x[17] *= 1e30
    counts = _check(model, x, general=True, monkeypatch=monkeypatch)
    assert [int(counts[i]) for i in (3, 7, 11)] == [1536] * 3
    assert int(counts[17]) < 1536 and int(counts[0]) >= 1


def test_certified_and_3xtf32_agree_on_80(monkeypatch):
    """KernelBench 80 (Gemm_Max_Subtract_GELU) at its size: certified and 3xTF32 agree."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "corpus" / "kernelbench_l2" / "l2_80_Gemm_Max_Subtract_GELU.py"
    spec = importlib.util.spec_from_file_location("kb80", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    model = mod.Model(*mod.get_init_inputs()).cuda()
    x = mod.get_inputs()[0].cuda()
    _agree_with_3xtf32(model, x, monkeypatch)


class _PoolRed(nn.Module):
    """98's shape of tail: pool, chain, a row max/min (keepdim or not), optionally
    something after it (then the tail's own kernel has work left)."""

    def __init__(self, red: str, keepdim: bool, after: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(1024, 2048)
        self.red, self.keepdim, self.after = red, keepdim, after

    def forward(self, x):
        v = F.avg_pool1d(self.lin(x).unsqueeze(1), 8).squeeze(1)
        v = F.gelu(v) * 1.5
        r = v.amax(dim=1, keepdim=self.keepdim) if self.red == "max" else \
            v.amin(dim=1, keepdim=self.keepdim)
        return torch.tanh(r) - 0.5 if self.after else r


@pytest.mark.parametrize("general", [True, False])
@pytest.mark.parametrize("red,keepdim,after", [("max", False, False), ("min", True, False),
                                                ("max", True, True)])
def test_row_reduction_written_by_the_certification(general, red, keepdim, after, monkeypatch):
    """Where the tail's kernel would compute nothing but the certified row max/min, the
    certification kernel writes it and no tail kernel runs (general path and prepared
    launches); with work after the reduction the tail kernel still runs. NaN and
    guard rows (recomputed directly) included; the values against float64."""
    torch.manual_seed(4)
    model = _PoolRed(red, keepdim, after).cuda()
    x = torch.randn(300, 1024, device="cuda")
    x[5, 3] = float("nan")
    x[9] *= 1e36   # the guard's direct path
    _check(model, x, general=general, monkeypatch=monkeypatch)   # (twice: prepared too)
    f = cupyfuse.from_model(model)
    quiet(f, x)
    calls = []
    real = execute.run_gpu
    monkeypatch.setattr(execute, "run_gpu", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        quiet(f, x)
        torch.cuda.synchronize()
    assert bool(calls) == general, "prepared launches expected" if calls else "general path"
    names = [e.name for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any(n.startswith("cf_cert_") for n in names), names
    assert any(n.startswith("cf_tail") for n in names) == after, names


@pytest.mark.parametrize("general", [False, True])
def test_dependent_launch_waits_for_the_gemm(general, monkeypatch):
    """The certification kernel is a programmatic dependent launch of the GEMM before it
    (runtime.launch_dependent): it may start while the GEMM runs, reading x, and waits for
    the GEMM before it reads its values. Six calls queued back to back on new inputs (no
    synchronisation between them), then the same call captured in a CUDA graph and
    replayed on new contents: each result matches float64, so no certification read a
    GEMM's output early (or a previous call's)."""
    if general:
        for knob in ("ENGINE_MAX_M", "ENGINE_MAX_MK", "ENGINE_MAX_MNK"):
            monkeypatch.setattr(config, knob, 0)
    torch.manual_seed(5)
    model = PoolChain(4096, 2048, 16, ("gelu", "scale"), "max").cuda()
    f = cupyfuse.from_model(model)
    xs = [torch.randn(512, 4096, device="cuda") * (1 + i) for i in range(6)]
    quiet(f, xs[0])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        quiet(f, xs[0])
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any(n.startswith("cf_cert") for n in names), names   # certified
    outs = [quiet(f, x) for x in xs]   # queued
    ref = copy.deepcopy(model).double()
    want = [quiet(ref, x.double()) for x in xs]
    for got, w in zip(outs, want):
        torch.testing.assert_close(got.double(), w, atol=1e-4, rtol=1e-4)
    if general:
        return
    x = xs[0].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        quiet(f, x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = quiet(f, x)
    for i in (1, 2, 3):
        x.copy_(xs[i])
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static.double(), want[i], atol=1e-4, rtol=1e-4)
