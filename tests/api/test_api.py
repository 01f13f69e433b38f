"""The public faces of open fusion on the CPU: fused_linear's validation and types,
PreparedWeight, CudaTail's CPU rules, FusedModel.program, and ``bench --model``."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import cupyfuse
from cupyfuse.ir.program import TailError
from helpers import program_of

REPO = Path(__file__).resolve().parents[2]


def test_fused_linear_matches_torch_and_keeps_the_type() -> None:
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 7), torch.randn(9, 7), torch.randn(9)
    out = cupyfuse.fused_linear(x, w, b, lambda h: torch.softmax(h * 2.0, dim=1))
    ref = torch.softmax((x.double() @ w.double().t() + b.double()) * 2.0, dim=1)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)
    xn, wn = x.numpy(), w.numpy()
    outn = cupyfuse.fused_linear(xn, wn, None, lambda h: h.amax(dim=1))
    assert isinstance(outn, np.ndarray) and outn.shape == (5,)
    assert np.allclose(outn, (xn @ wn.T).max(1), atol=1e-5)
    assert torch.equal(cupyfuse.fused_linear(x, w, b), torch.addmm(b, x, w.t())) or \
        torch.allclose(cupyfuse.fused_linear(x, w, b), torch.addmm(b, x, w.t()), atol=1e-6)


@pytest.mark.parametrize("bad,exc,msg", [
    (dict(x=torch.randn(5, 7, dtype=torch.float64)), TypeError, "x must be float32"),
    (dict(w=torch.randn(9, 6)), ValueError, r"weight must be \(out_features, 7\)"),
    (dict(b=torch.randn(8)), ValueError, r"bias must be \(9,\)"),
    (dict(x=torch.randn(7)), ValueError, r"x must be \(batch, K\)"),
])
def test_fused_linear_errors(bad: dict, exc: type, msg: str) -> None:
    args = dict(x=torch.randn(5, 7), w=torch.randn(9, 7), b=torch.randn(9))
    args.update(bad)
    with pytest.raises(exc, match=msg):
        cupyfuse.fused_linear(args["x"], args["w"], args["b"], lambda h: h.relu())


def test_tail_function_refusal_names_the_line() -> None:
    def tail(h):
        return torch.cumprod(h, dim=1)
    with pytest.raises(TailError, match=r"torch\.cumprod.*\n.*test_api\.py:\d+ in tail"):
        cupyfuse.fused_linear(torch.randn(2, 3), torch.randn(4, 3), None, tail)


def test_prepared_weight_reuses_until_refresh() -> None:
    w = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    x = np.ones((2, 4), np.float32)
    wp = cupyfuse.prepare_weight(w)
    first = cupyfuse.fused_linear(x, wp, None, lambda h: h.sum(1))
    assert np.allclose(first, (x @ w.T).sum(1), atol=1e-5)
    w *= 2
    wp.refresh()
    again = cupyfuse.fused_linear(x, wp, None, lambda h: h.sum(1))
    assert np.allclose(again, 2 * first, atol=1e-4)


def test_cuda_tail_on_cpu_needs_a_reference() -> None:
    x, w = torch.randn(3, 5), torch.randn(4, 5)
    t = cupyfuse.CudaTail(map="h * h", reduce="a + b", identity="0", acc="double")
    with pytest.raises(TailError, match="reference"):
        cupyfuse.fused_linear(x, w, None, t)
    t2 = cupyfuse.CudaTail(map="h * h", reduce="a + b", identity="0", acc="double",
                           reference=lambda h: (h * h).sum(1, keepdim=True))
    out = cupyfuse.fused_linear(x, w, None, t2)
    assert torch.allclose(out, ((x @ w.t()) ** 2).sum(1, keepdim=True), atol=1e-5)


def test_cuda_tail_source_compiles_shape() -> None:
    name, src = cupyfuse.CudaTail(map="fmaxf(h, 0.0f)").source(100)
    assert name in src and "extern \"C\" __global__" in src and "N = 100" in src


def test_program_shows_the_rewrites() -> None:
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 12)
            self.pool = torch.nn.AvgPool1d(4)

        def forward(self, x):
            h = self.pool(self.fc(x).unsqueeze(1)).squeeze(1)
            return torch.nn.functional.gelu(h).sum(dim=1)

    prog = program_of(cupyfuse.from_model(M()), torch.rand(2, 8))
    text = prog.describe()
    assert "avgpool" in text          # AvgPool folded into the weight
    assert text.count("gemm(") == 1   # and the full GEMM removed


def test_bench_model_cli_on_cpu(tmp_path: Path) -> None:
    f = tmp_path / "tiny.py"
    f.write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        class Model(nn.Module):
            def __init__(self, i, o):
                super().__init__()
                self.fc = nn.Linear(i, o)
                self.bn = nn.BatchNorm1d(o)
            def forward(self, x):
                return torch.softmax(self.bn(self.fc(x)), dim=1)
        def get_inputs():
            return [torch.rand(16, 24)]
        def get_init_inputs():
            return [24, 40]
    """))
    r = subprocess.run([sys.executable, "-m", "cupyfuse", "bench", "--model", str(f),
                        "--seeds", "0,1"], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| tiny | pass |" in r.stdout


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc is not on PATH")
def test_cuda_tail_kernels_compile_with_nvcc(tmp_path: Path) -> None:
    """The kernels a CudaTail generates (elementwise, and a reduction in float and in
    double) compile for sm_90a without spills, as NVRTC will compile them on the GPU."""
    from cupyfuse.backend import runtime

    tails = [cupyfuse.CudaTail(map="fmaxf(h, 0.0f) * (float)col / N"),
             cupyfuse.CudaTail(map="h * h", reduce="a + b", identity="0", post="sqrt(r)",
                               acc="double"),
             cupyfuse.CudaTail(map="h", reduce="fmaxf(a, b)", identity="-INFINITY",
                               post="r * 2.0f")]
    names, parts = [], [runtime.expand_source("tail_ops.cuh")]
    for t in tails:
        name, src = t.source(1000)
        names.append(name)
        parts.append(src)
    cu = tmp_path / "cuda_tails.cu"
    cu.write_text("\n".join(parts))
    r = subprocess.run(["nvcc", "-cubin", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                        "-Xptxas", "-v", str(cu), "-o", str(tmp_path / "t.cubin")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in names:
        assert f"Compiling entry function '{name}'" in r.stdout + r.stderr
    assert "bytes spill stores" in r.stderr + r.stdout
    assert all(int(n) == 0 for n in __import__("re").findall(r"(\d+) bytes spill stores",
                                                          r.stdout + r.stderr))


def test_sweep_plumbing_on_a_tiny_cpu_grid(tmp_path: Path) -> None:
    """bench --sweep's grid, table, JSON and heat map, on the CPU at tiny sizes (the real
    grid needs a GPU: without one the command says so and returns 2)."""
    import io
    import json

    from cupyfuse.bench.sweep import run_sweep

    buf = io.StringIO()
    if not torch.cuda.is_available():  # the real grid is GPU only: refused here
        assert run_sweep(stdout=buf) == 2
        assert "needs a CUDA GPU" in buf.getvalue()
    buf = io.StringIO()
    js, png = tmp_path / "s.json", tmp_path / "s.png"
    rc = run_sweep(problems=("56", "39"), batches=(2, 5), features=(16,),
                   modes=("module_nograd", "module_grad", "function_torch"), reps=2,
                   json_path=str(js), plot_path=str(png), allow_cpu=True, stdout=buf)
    assert rc == 0, buf.getvalue()
    data = json.loads(js.read_text())
    assert len(data["cells"]) == 2 * 2 * 2 + 2
    assert all(c["cupyfuse_ms"] > 0 and c["speedup"] > 0 for c in data["cells"])
    assert {"module_nograd", "module_grad", "function_torch"} <= set(data["host_us"])
    assert png.stat().st_size > 1000
    assert "cells where cupyfuse is slower than its baseline" in buf.getvalue()


def test_sweep_timer_interleaves_the_two_sides() -> None:
    """Baseline and cupyfuse calls alternate call by call, the first side alternating,
    so host noise lands on both (the GPU timer has the same loop with events)."""
    from cupyfuse.bench.sweep import _timer

    order: list[str] = []
    timer = _timer(torch.device("cpu"))
    a, b = timer(lambda: order.append("a"), lambda: order.append("b"), 4)
    assert order == ["a", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert a >= 0 and b >= 0

    def slow() -> None:
        time.sleep(0.002)

    a, b = timer(slow, lambda: None, 5)
    assert a > 1.5 and b < 1.0   # each median is its own side's


@pytest.mark.parametrize("call", [
    lambda h: h.var(1, False, True),               # legacy positional unbiased, keepdim
    lambda h: torch.var(h, 1, True),
    lambda h: h.std(dim=1, unbiased=False),
    lambda h: torch.var(h, dim=1, correction=0, keepdim=True),
    lambda h: h.std(1, keepdim=True) * 2.0,
])
def test_var_std_arguments_follow_torch(call) -> None:
    """var/std's argument forms (positional unbiased/keepdim, correction) mean what torch
    says (a positional unbiased=False is not read as the default True)."""
    torch.manual_seed(1)
    x, w = torch.randn(6, 5), torch.randn(9, 5)
    out = cupyfuse.fused_linear(x, w, None, call)
    ref = call(x.double() @ w.double().t())
    assert out.shape == ref.shape
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_named_ops_take_a_prepared_weight():
    """The named ops accept a PreparedWeight handle like fused_linear (same results)."""
    import numpy as np

    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 12, generator=g)
    w = torch.randn(10, 12, generator=g)
    b = torch.randn(10, generator=g)
    pw = cupyfuse.prepare_weight(w.numpy())
    for fn, args in [(cupyfuse.kernelbench.matmul_sigmoid_sum, ()), (cupyfuse.kernelbench.matmul_maxpool_sum_scale, (2, 0.5)),
                     (cupyfuse.kernelbench.matmul_avgpool_gelu_scale_max, (5, 2.0))]:
        want = fn(x.numpy(), w.numpy(), b.numpy(), *args)
        got = fn(x.numpy(), pw, b.numpy(), *args)
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, want)


def test_module_calls_in_other_threads_while_a_forward_is_traced() -> None:
    """torch.fx patches nn.Module.__call__ process-wide while it traces: a module called
    from another thread meanwhile must run as usual (not enter the tracer and fail with
    "module is not installed as a submodule"), and the trace must not change."""
    import threading

    from cupyfuse.frontend import trace as tracing

    inside, release = threading.Event(), threading.Event()

    def pause() -> None:   # plain Python: runs while fx executes the forward
        inside.set()
        assert release.wait(10)

    class Slow(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 6)

        def forward(self, x):
            h = self.fc(x)
            pause()
            return torch.sigmoid(h).sum(dim=1)

    torch.manual_seed(0)
    m = Slow()
    other = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU())
    x5 = torch.randn(4, 5)
    want = torch.relu(x5 @ other[0].weight.t() + other[0].bias)
    got: list = []
    errors: list = []

    def trace() -> None:
        try:
            got.append(tracing.trace(m))
        except Exception as exc:  # re-raised below
            errors.append(exc)

    fm = cupyfuse.from_model(other)   # traced here, before: its first call needs no trace
    t = threading.Thread(target=trace)
    t.start()
    assert inside.wait(10)
    try:
        with torch.no_grad():
            out = other(x5)            # while Module.__call__ is patched by the trace
            out2 = fm(x5)
    finally:
        release.set()
        t.join()
    assert not errors, errors
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(out2, want, atol=1e-5, rtol=1e-5)
    ops = [n.op for n in got[0].graph.nodes]
    assert ops.count("call_module") == 1, ops   # the trace saw its own fc only


def test_dispatch_key_follows_the_engine_setting(monkeypatch):
    """Prepared launches are keyed on CUPYFUSE_ENGINE (read from os.environ's store)."""
    from cupyfuse.backend import gemm

    monkeypatch.delenv("CUPYFUSE_ENGINE", raising=False)
    base = gemm.dispatch_key()
    monkeypatch.setenv("CUPYFUSE_ENGINE", "cublas")
    cub = gemm.dispatch_key()
    monkeypatch.setenv("CUPYFUSE_ENGINE", "sm90")
    sm = gemm.dispatch_key()
    monkeypatch.delenv("CUPYFUSE_ENGINE")
    assert len({base, cub, sm}) == 3 and gemm.dispatch_key() == base
