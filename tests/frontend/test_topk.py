"""torch.topk along the features (a router's gate, cupyfuse/frontend/lower/reductions.py):
values and int64 positions against torch's, drawn rows with ties, NaN and -inf (where
torch's order among equal values is unspecified: the positions are then checked to be
distinct, in range and to hold the values), gradients against float64, the generated
kernels emulated on the CPU and compiled by nvcc, refusals."""
from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, strategies as st

import cupyfuse
from gen.tails import assert_grad_matches, assert_matches, grads_of
from helpers import program_of, property_settings, refs


class Router(nn.Module):
    """A Mixtral-style gate: top-k logits, softmax over them, and the experts chosen."""

    def __init__(self, k_in: int, n: int, k: int, mask: float | None = None) -> None:
        super().__init__()
        self.gate = nn.Linear(k_in, n, bias=False)
        self.k, self.mask = k, mask

    def forward(self, x: torch.Tensor) -> tuple:
        h = self.gate(x)
        if self.mask is not None:   # (experts masked out with -inf, or ties made)
            h = torch.where(h > self.mask, h, torch.full_like(h, float("-inf")))
        w, chosen = torch.topk(h, self.k, dim=-1)
        return F.softmax(w, dim=-1), chosen, h.topk(self.k).values


def _check_positions(vals: torch.Tensor, idx: torch.Tensor, h: torch.Tensor,
                     want_vals: torch.Tensor, tol: float = 0.0) -> None:
    """Positions distinct, in range, holding the values; values torch's (``tol``: where
    ``h`` is eager's product, not the one the fused values come from)."""
    assert idx.dtype == torch.int64 and idx.shape == want_vals.shape
    assert bool(((idx >= 0) & (idx < h.shape[1])).all())
    for r in range(idx.shape[0]):
        assert len(set(idx[r].tolist())) == idx.shape[1], idx[r]
    torch.testing.assert_close(vals, want_vals, atol=tol, rtol=tol, equal_nan=True)
    torch.testing.assert_close(h.gather(1, idx), want_vals, atol=tol, rtol=tol,
                               equal_nan=True)


@property_settings(40)
@given(batch=st.integers(1, 7), n=st.integers(1, 20), k=st.integers(1, 6),
       kind=st.sampled_from(["plain", "ties", "nan", "neginf"]), seed=st.integers(0, 2 ** 16))
def test_drawn_rows_match_torch(batch: int, n: int, k: int, kind: str, seed: int) -> None:
    k = min(k, n)
    torch.manual_seed(seed)
    h = torch.randn(batch, n)
    if kind == "ties":
        h = (h * 2).round() / 2
    elif kind == "nan":
        h[torch.rand(batch, n) < 0.2] = float("nan")
    elif kind == "neginf":
        h[torch.rand(batch, n) < 0.75] = float("-inf")   # (often fewer finite than k)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(n, n, bias=False)
            with torch.no_grad():
                self.fc.weight.copy_(torch.eye(n))

        def forward(self, x: torch.Tensor, extra: torch.Tensor) -> tuple:
            z = self.fc(x) + extra   # (NaN / -inf come in after the Linear: 0 * NaN)
            return torch.topk(z, k, dim=-1)

    finite = torch.nan_to_num(h, nan=0.0, neginf=0.0)
    extra = h - finite   # NaN / -inf where h has them, else 0
    m = M()
    fm = cupyfuse.from_model(m)
    with torch.no_grad():
        got = fm(finite, extra)
        want = torch.topk(h, k, dim=-1)   # (the identity Linear is exact)
    assert type(got) is torch.return_types.topk
    if kind == "plain":
        assert torch.equal(got.values, want.values) and torch.equal(got.indices, want.indices)
    else:
        _check_positions(got.values, got.indices, h, want.values)


@pytest.mark.parametrize("k", (1, 2, 4))
@pytest.mark.parametrize("seed", range(3))
def test_router_forward_and_gradients(k: int, seed: int) -> None:
    torch.manual_seed(seed)
    model = Router(12, 8, k)
    x = torch.randn(6, 12)
    fm = cupyfuse.from_model(copy.deepcopy(model))
    ref64, ref32 = refs(model, (x,))
    with torch.no_grad():
        got = fm(x)
    assert_matches(got[0], ref64[0], ref32[0], "weights")
    assert torch.equal(got[1], ref32[1])
    assert_matches(got[2], ref64[2], ref32[2], "values")
    gs = [torch.randn(got[0].shape), None, torch.randn(got[2].shape)]
    m64 = copy.deepcopy(model).double()
    want = grads_of(m64, m64, [x], gs, torch.float64)
    mf = copy.deepcopy(model)
    have = grads_of(mf, cupyfuse.from_model(mf), [x], gs, torch.float32)
    m32 = copy.deepcopy(model)
    eager = grads_of(m32, m32, [x], gs, torch.float32)
    for i, (a, b, c) in enumerate(zip(have, want, eager)):
        assert_grad_matches(a, b, c, f"gradient {i}")


@pytest.mark.parametrize("forward,match", [
    (lambda s, x: torch.topk(s.fc(x), 2, dim=0), "dim=-1"),
    (lambda s, x: torch.topk(s.fc(x), 2, largest=False), "largest=False"),
    (lambda s, x: torch.topk(s.fc(x), 9), "k=9"),
    (lambda s, x: torch.topk(s.fc(x), 2)[1] * 2, "positions"),
])
def test_refusals(forward, match: str) -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return forward(self, x)

    with pytest.raises(cupyfuse.TailError, match=match):
        cupyfuse.from_model(M())(torch.randn(4, 8))


def _kernel_cases() -> list:
    torch.manual_seed(7)
    return [("router", Router(12, 8, 2), torch.randn(6, 12)),
            ("masked", Router(12, 9, 4, 0.2), torch.randn(6, 12))]


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not on PATH")
def test_generated_kernels_emulated_on_the_cpu(tmp_path_factory, monkeypatch) -> None:
    from emu import cuda as _cuda_emu
    from emu.gpu import run_gpu_emulated

    cases = _kernel_cases()
    kernels = _cuda_emu.build_or_skip([program_of(m, x) for _, m, x in cases],
                                      tmp_path_factory.mktemp("emu"), exact=True)
    for name, model, x in cases:
        with torch.no_grad(), monkeypatch.context() as mp:
            got = run_gpu_emulated(model, [x], mp, kernels)
            h = model.gate(x)
            if model.mask is not None:
                h = torch.where(h > model.mask, h, torch.full_like(h, float("-inf")))
            want = torch.topk(h, model.k, dim=-1)
        _check_positions(got[2], got[1], h, want.values, 1e-5)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_generated_kernels_compile_with_nvcc(tmp_path) -> None:
    import re
    import subprocess

    from cupyfuse.backend import codegen, runtime

    bodies: dict[str, str] = {}
    for _, model, x in _kernel_cases():
        for lv in codegen.plan(program_of(model, x)).levels:
            if lv.kernel:
                bodies.setdefault(lv.name, lv.kernel.split("\n", 1)[1])
    assert bodies
    src = tmp_path / "topk.cu"
    src.write_text(runtime.expand_source("tail_ops.cuh") + "\n" + "\n".join(bodies.values()))
    r = subprocess.run(["nvcc", "-cubin", "-o", str(tmp_path / "topk.cubin"), "-std=c++17",
                        "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", str(src)],
                       capture_output=True, text=True, timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert set(bodies) <= set(re.findall(r"Compiling entry function '(\w+)'", log))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", (3, 700))
def test_router_on_the_gpu(batch: int) -> None:
    torch.manual_seed(batch)
    for model in (Router(64, 64, 2), Router(64, 8, 4, 0.5)):
        model = model.cuda()
        x = torch.randn(batch, 64, device="cuda")
        fm = cupyfuse.from_model(copy.deepcopy(model))
        for _ in range(3):   # general path, then prepared launches
            with torch.no_grad():
                got = fm(x)
                h = model.gate(x)
                if model.mask is not None:
                    h = torch.where(h > model.mask, h, torch.full_like(h, float("-inf")))
                want = torch.topk(h, model.k, dim=-1)
            _check_positions(got[2].cpu(), got[1].cpu(), h.cpu(), want.values.cpu(), 1e-4)
