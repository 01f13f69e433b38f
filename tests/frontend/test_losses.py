"""Integer targets (cupyfuse/frontend/lower/losses.py): cross entropy and NLL with class
indices (ignore_index, class weights, label smoothing; reduction="none"), gather /
take_along_dim along the features, one_hot -- forward and gradients against float64
torch on the CPU path, drawn by hypothesis (NaN/inf rows, ignored rows); the generated
kernels emulated on the CPU and compiled by nvcc; the refusals and what they advise."""
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


class CE(nn.Module):
    """A classifier head and its per-row cross entropy, the way training code writes it."""

    def __init__(self, k: int, n: int, smoothing: float = 0.0, weighted: bool = False,
                 ignore: int = -100, module: bool = False, reduction: str = "none") -> None:
        super().__init__()
        self.fc = nn.Linear(k, n)
        self.register_buffer("w", torch.rand(n) + 0.5 if weighted else None)
        self.smoothing, self.ignore, self.reduction = smoothing, ignore, reduction
        self.loss = nn.CrossEntropyLoss(weight=self.w, ignore_index=ignore, reduction=reduction,
                                        label_smoothing=smoothing) if module else None

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.loss is not None:
            return self.loss(h, t)
        return F.cross_entropy(h, t, weight=self.w, ignore_index=self.ignore,
                               reduction=self.reduction, label_smoothing=self.smoothing)


class NLL(nn.Module):
    def __init__(self, k: int, n: int, module: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(k, n)
        self.loss = nn.NLLLoss(reduction="none") if module else None

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        lp = F.log_softmax(self.fc(x) / 2.0, dim=-1)
        return self.loss(lp, t) if self.loss is not None else F.nll_loss(lp, t, reduction="none")


class Picks(nn.Module):
    """gather, take_along_dim and one_hot of the targets: a margin, a z-loss-like term."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.fc = nn.Linear(k, n)
        self.n = n

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> tuple:
        h = self.fc(x)
        picked = h.gather(1, t.unsqueeze(1))
        along = torch.take_along_dim(torch.tanh(h), t.view(-1, 1), dim=1)
        margin = h - 0.35 * F.one_hot(t, self.n).float()
        return picked - torch.logsumexp(h, 1, keepdim=True), along, margin.softmax(-1)


class Soft(nn.Module):
    """Cross entropy against class probabilities (distillation, mixup)."""

    def __init__(self, k: int, n: int, smoothing: float, weighted: bool, module: bool,
                 reduction: str = "none") -> None:
        super().__init__()
        self.fc = nn.Linear(k, n)
        self.register_buffer("w", torch.rand(n) + 0.5 if weighted else None)
        self.smoothing, self.reduction = smoothing, reduction
        self.loss = nn.CrossEntropyLoss(weight=self.w, reduction=reduction,
                                        label_smoothing=smoothing) if module else None

    def forward(self, x: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        p = F.softmax(teacher / 2.0, dim=-1)
        if self.loss is not None:
            return self.loss(h, p)
        return F.cross_entropy(h, p, weight=self.w, reduction=self.reduction,
                               label_smoothing=self.smoothing)


def _targets(n: int, batch: int, ignore: int | None, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, n, (batch,), generator=g)
    if ignore is not None and batch > 1:
        t[torch.rand(batch, generator=g) < 0.3] = ignore
    return t


def _check(model: nn.Module, x: torch.Tensor, t: torch.Tensor, grads: bool = True) -> None:
    fm = cupyfuse.from_model(copy.deepcopy(model))
    ref64, ref32 = refs(model, (x, t))
    with torch.no_grad():
        got = fm(x, t)
    outs = got if isinstance(got, tuple) else (got,)
    r64 = ref64 if isinstance(ref64, tuple) else (ref64,)
    r32 = ref32 if isinstance(ref32, tuple) else (ref32,)
    for i, (o, a, b) in enumerate(zip(outs, r64, r32)):
        assert_matches(o, a, b, f"result {i}")
    if not grads:
        return
    gs = [torch.randn(o.shape) for o in outs]
    m64 = copy.deepcopy(model).double()
    want = grads_of(m64, m64, [x, t], gs, torch.float64)
    fused_model = copy.deepcopy(model)
    got_g = grads_of(fused_model, cupyfuse.from_model(fused_model), [x, t], gs, torch.float32)
    m32 = copy.deepcopy(model)
    eager = grads_of(m32, m32, [x, t], gs, torch.float32)
    for i, (a, b, c) in enumerate(zip(got_g, want, eager)):
        assert_grad_matches(a, b, c, f"gradient {i}")


@property_settings(40)
@given(batch=st.integers(1, 9), n=st.integers(1, 40), k=st.sampled_from([4, 12]),
       smoothing=st.sampled_from([0.0, 0.1, 0.4]), weighted=st.booleans(),
       ignore=st.sampled_from([None, "default", "class"]), module=st.booleans(),
       scale=st.sampled_from([0.1, 1.0, 30.0]), bad_row=st.sampled_from([None, "nan", "inf"]),
       reduction=st.sampled_from(["none", "mean", "sum"]), seed=st.integers(0, 2 ** 16))
def test_drawn_cross_entropy_matches_float64(batch: int, n: int, k: int, smoothing: float,
                                             weighted: bool, ignore: str | None, module: bool,
                                             scale: float, bad_row: str | None,
                                             reduction: str, seed: int) -> None:
    torch.manual_seed(seed)
    ii = {"default": -100, "class": seed % n, None: -100}[ignore]
    model = CE(k, n, smoothing, weighted, ii, module, reduction)
    x = torch.randn(batch, k) * scale
    if bad_row is not None:
        x[seed % batch, seed % k] = math_value(bad_row)
    t = _targets(n, batch, None if ignore is None else ii, seed)
    _check(model, x, t)


def math_value(kind: str) -> float:
    return float("nan") if kind == "nan" else float("inf")


@pytest.mark.parametrize("reduction", ("none", "mean", "sum"))
@pytest.mark.parametrize("module", (False, True))
@pytest.mark.parametrize("smoothing,weighted", ((0.0, False), (0.2, True), (0.05, False)))
def test_probability_targets(module: bool, smoothing: float, weighted: bool,
                             reduction: str) -> None:
    """A (batch, N) float target: its gradient is checked too (it is a float input)."""
    torch.manual_seed(int(smoothing * 100) + module)
    model = Soft(12, 11, smoothing, weighted, module, reduction)
    x = torch.randn(8, 12) * 2
    x[3, 1] = float("inf")
    teacher = torch.randn(8, 11) * 3
    _check(model, x, teacher)


@pytest.mark.parametrize("module", (False, True))
@pytest.mark.parametrize("seed", range(3))
def test_nll_loss_of_log_softmax(module: bool, seed: int) -> None:
    torch.manual_seed(seed)
    model = NLL(12, 17, module)
    x = torch.randn(10, 12)
    _check(model, x, _targets(17, 10, -100, seed))


@pytest.mark.parametrize("seed", range(3))
def test_gather_take_along_dim_and_one_hot(seed: int) -> None:
    torch.manual_seed(seed)
    model = Picks(12, 9)
    x = torch.randn(7, 12) * 3
    x[1, 2] = float("nan")
    _check(model, x, _targets(9, 7, None, seed))


def test_int32_and_cast_targets() -> None:
    torch.manual_seed(4)
    model = CE(8, 5)
    x = torch.randn(6, 8)
    t = _targets(5, 6, None, 4)
    _check(model, x, t.int().long())
    fm = cupyfuse.from_model(copy.deepcopy(model))

    class Cast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = model.fc

        def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.fc(x), t.long(), reduction="none")

    with torch.no_grad():
        torch.testing.assert_close(cupyfuse.from_model(Cast())(x, t.int()), fm(x, t))


def test_target_out_of_range_gives_a_nan_row() -> None:
    """torch raises on such a target (a host sync on the GPU cupyfuse does not make):
    the row is NaN instead, the other rows are unchanged."""
    torch.manual_seed(5)
    model = CE(8, 5, ignore=2)
    fm = cupyfuse.from_model(model)
    x = torch.randn(4, 8)
    t = torch.tensor([0, 7, 2, -1])
    with torch.no_grad():
        got = fm(x, t)
        want = F.cross_entropy(model.fc(x), torch.tensor([0, 0, 2, 0]), ignore_index=2,
                               reduction="none")
    assert torch.isnan(got[1]) and torch.isnan(got[3])
    torch.testing.assert_close(got[[0, 2]], want[[0, 2]])
    assert got[2] == 0


class Stats(nn.Module):
    """Numbers over the whole batch beside per-row results: a loss with a z-loss term,
    sums and means of whole (batch, N) values."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.fc = nn.Linear(k, n)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> tuple:
        h = self.fc(x)
        ce = F.cross_entropy(h, t)
        z = torch.logsumexp(h, dim=-1).pow(2).mean()
        p = torch.sigmoid(h)
        return ce + 1e-2 * z, h, p.sum() / 4.0 - torch.mean(p) * 2, 1.0 - p.mean(), -ce.sum()


class Accuracy(nn.Module):
    """The loss, top-1 and top-3 accuracy and a mask of a class: positions compared with
    targets and numbers."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.fc = nn.Linear(k, n)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> tuple:
        h = self.fc(x)
        top1 = (h.argmax(-1) == t).float().mean()
        top3 = (torch.topk(h, 3, dim=-1).indices == t.unsqueeze(1)).float().sum(1)
        return F.cross_entropy(h, t), top1, top3, (h.argmin(1) != 2).float()


@pytest.mark.parametrize("seed", range(3))
def test_accuracy_from_positions_and_targets(seed: int) -> None:
    torch.manual_seed(seed)
    model = Accuracy(12, 9)
    x = torch.randn(30, 12)
    t = _targets(9, 30, None, seed)
    fm = cupyfuse.from_model(copy.deepcopy(model))
    with torch.no_grad():
        got, want = fm(x, t), model(x, t)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch", (1, 6, 0))
def test_numbers_over_the_batch_beside_per_row_results(batch: int) -> None:
    torch.manual_seed(batch)
    model = Stats(12, 9)
    x = torch.randn(batch, 12) * 2
    if batch:
        x[0, 3] = float("nan") if batch == 1 else 1e3
    t = torch.randint(0, 9, (batch,))
    fm = cupyfuse.from_model(copy.deepcopy(model))
    with torch.no_grad():
        got = fm(x, t)
    ref64, ref32 = refs(model, (x, t))
    assert [tuple(g.shape) for g in got] == [tuple(r.shape) for r in ref32]
    for i, (o, a, b) in enumerate(zip(got, ref64, ref32)):
        assert o.dtype == torch.float32
        assert_matches(o, a, b, f"result {i}")
    if batch:
        _check(model, x, t)


@pytest.mark.parametrize("forward,match", [
    (lambda s, x, t: s.fc(x) - s.fc(x).mean(), "over the whole batch"),
    (lambda s, x, t: s.fc(x).mean(0, keepdim=True), "keepdim"),
    (lambda s, x, t: torch.exp(F.cross_entropy(s.fc(x), t)), "over the whole batch"),
    (lambda s, x, t: F.cross_entropy(s.fc(x), t, reduction="avg"), "'none', 'mean'"),
    (lambda s, x, t: F.one_hot(t).float() * s.fc(x), "num_classes"),
    (lambda s, x, t: s.fc(x).gather(0, t.view(-1, 1)), "dim=1"),
    (lambda s, x, t: F.cross_entropy(s.fc(x), t.view(-1, 1), reduction="none"),
     "one class index per row"),
    (lambda s, x, t: F.cross_entropy(s.fc(x), t.float().view(-1, 1), reduction="none"),
     "probabilities a"),
    (lambda s, x, t: s.fc(x).sum(1) * F.cross_entropy(s.fc(x), t), "over the whole batch"),
])
def test_refusals_say_what_works(forward, match: str) -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 5)

        def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return forward(self, x, t)

    fm = cupyfuse.from_model(M())
    with pytest.raises(cupyfuse.TailError, match=match) as e:
        fm(torch.randn(4, 8), torch.tensor([0, 1, 2, 3]))
    assert "or cast it first" not in str(e.value)   # (the advice that breaks the code)


def _kernel_cases() -> list:
    torch.manual_seed(6)
    out = []
    for name, model, n in (("ce", CE(12, 40, 0.1, True, 3), 40), ("ce_module",
                           CE(12, 9, 0.0, False, -100, True), 9), ("nll", NLL(12, 17), 17),
                           ("picks", Picks(12, 9), 9)):
        x = torch.randn(6, 12)
        x[0, 0] = float("inf")
        ignore = None if name == "picks" else getattr(model, "ignore", -100)
        out.append((name, model, x, _targets(n, 6, ignore, 6)))
    out.append(("soft", Soft(12, 7, 0.1, True, True, "mean"), torch.randn(6, 12),
                torch.randn(6, 7)))
    out.append(("ce_mean", CE(12, 9, 0.1, True, 2, False, "mean"), torch.randn(6, 12),
                _targets(9, 6, 2, 7)))
    out.append(("stats", Stats(12, 9), torch.randn(6, 12), _targets(9, 6, None, 8)))
    out.append(("accuracy", Accuracy(12, 9), torch.randn(6, 12), _targets(9, 6, None, 9)))
    return out


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not on PATH")
def test_generated_kernels_emulated_on_the_cpu(tmp_path_factory, monkeypatch) -> None:
    """The GPU path (execute.run_gpu: levels, generated kernels compiled as C++ with
    threads for CUDA's, tests/emu) against float64."""
    from emu import cuda as _cuda_emu
    from emu.gpu import run_gpu_emulated

    cases = _kernel_cases()
    kernels = _cuda_emu.build_or_skip([program_of(m, x, t) for _, m, x, t in cases],
                                      tmp_path_factory.mktemp("emu"), exact=True)
    for name, model, x, t in cases:
        ref64, ref32 = refs(model, (x, t))
        with torch.no_grad(), monkeypatch.context() as mp:
            got = run_gpu_emulated(model, [x, t], mp, kernels)
        outs = got if isinstance(got, (tuple, list)) else (got,)
        r64 = ref64 if isinstance(ref64, tuple) else (ref64,)
        r32 = ref32 if isinstance(ref32, tuple) else (ref32,)
        for o, a, b in zip(outs, r64, r32):
            assert_matches(o, a, b, f"emulated {name}")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_generated_kernels_compile_with_nvcc(tmp_path) -> None:
    import re
    import subprocess

    from cupyfuse.backend import codegen, runtime

    bodies: dict[str, str] = {}
    for _, model, x, t in _kernel_cases():
        for lv in codegen.plan(program_of(model, x, t)).levels:
            if lv.kernel:
                bodies.setdefault(lv.name, lv.kernel.split("\n", 1)[1])
    assert bodies
    src = tmp_path / "losses.cu"
    src.write_text(runtime.expand_source("tail_ops.cuh") + "\n" + "\n".join(bodies.values()))
    r = subprocess.run(["nvcc", "-cubin", "-o", str(tmp_path / "losses.cubin"), "-std=c++17",
                        "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", str(src)],
                       capture_output=True, text=True, timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert set(bodies) <= set(re.findall(r"Compiling entry function '(\w+)'", log))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", (5, 300))
def test_losses_on_the_gpu(batch: int) -> None:
    torch.manual_seed(batch)
    for model in (CE(64, 1000, 0.1, True, 3), CE(64, 1000, 0.0, False, -100, True, "mean"),
                  NLL(64, 33, True), Picks(64, 40), Stats(64, 500)):
        model = model.cuda()
        n = model.fc.out_features
        x = torch.randn(batch, 64, device="cuda")
        t = _targets(n, batch, 3 if isinstance(model, CE) else None, batch).cuda()
        ref64, ref32 = refs(model, (x, t))
        fm = cupyfuse.from_model(copy.deepcopy(model))
        for _ in range(3):   # general path, then prepared launches
            with torch.no_grad():
                got = fm(x, t)
            outs = got if isinstance(got, tuple) else (got,)
            r64 = ref64 if isinstance(ref64, tuple) else (ref64,)
            r32 = ref32 if isinstance(ref32, tuple) else (ref32,)
            for o, a, b in zip(outs, r64, r32):
                assert_matches(o.cpu(), a.cpu(), b.cpu(), type(model).__name__)
