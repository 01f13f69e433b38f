"""Open fusion on the CPU: whole random "Linear + tail" models against float64 PyTorch.

Property tests (hypothesis, derandomized) draw WHOLE models with tests/gen/tails.py:
``Linear(K, N)`` (K 1..40, N 1..70, bias or not; nn.Linear, F.linear, ``x @ W.t()``
or a matmul with a (K, N) parameter) and 1..6 ops of the vocabulary -- constants
either side, per-feature and scalar parameters and buffers, residuals of earlier
values, every activation, row reductions with dim 1/-1 and keepdim either way,
softmax/log_softmax, LayerNorm, GroupNorm (every divisor of the width), BatchNorm1d
(train and eval, momentum None too), max/avg pooling, dropout (eval), F.normalize, a
second Linear, a second input y, the GEMM input x added back. Batch 1..33, inputs
rand / randn*3 / randn*50+100, rows with NaN/+inf/-inf. Each model runs through
from_model, fused_class or NumPy operands and is compared with a float64 deep copy of
itself (``torch.allclose(atol=rtol=1e-4, equal_nan=True)``, NaN/+inf/-inf placement
element for element, running statistics after each call; see
``gen.tails.assert_matches`` for the one fallback, ill-conditioned float32).

Then: fused_class semantics, NumPy operands, fused_linear with tail functions,
hand-written multi-stage / two-input / x-residual / broadcast-output models, and one
test per refused construct: the TailError names the op and quotes the forward's line
(``test_tails.py:<line> in forward: <code>``).
"""
from __future__ import annotations

import copy
import inspect
import math
import warnings
from pathlib import Path
from typing import Any

import re

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from cupyfuse.api import from_model, fused_class, fused_linear
from cupyfuse.ir.program import TailError
from gen.tails import (AffineCoeff, check_nonfinite_coefficients, DISTS, Case, HypDraw, MaxPairsSum, assert_matches, assert_running_stats,
                      assert_same_state, cases, generate, guard_rows, pairdiff_nodes,
                      references, run_case, seeded)
from helpers import program_of, runner_of
from helpers import examples

THIS = Path(__file__).name


def _settings(n: int) -> settings:
    return settings(max_examples=examples(n), deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    # torch warns about var/std with one degree of freedom; the references do too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def _run(case: Case) -> None:
    note(repr(case))
    run_case(case, "cpu")


def derived_param_seeds(n: int = 8) -> list[int]:
    """The first ``n`` seeds whose drawn model has a per-feature tensor computed from a
    matrix alone (``op_param``'s derived form: a derived source the tail reads)."""
    from gen.tails import seeded_case

    out = [s for s in range(600) if "param.derived" in seeded_case(s).spec.ops][:n]
    assert len(out) == n, "the generator no longer draws derived per-feature tensors"
    return out


@pytest.mark.parametrize("seed", derived_param_seeds())
def test_seeded_tails_with_derived_params(seed: int) -> None:
    """Drawn models with ``h + (self.m ** 2).sum(1)``-style tensors of a matrix (derived
    sources the tail reads) against float64, several calls (their
    training-mode BatchNorm statistics too)."""
    from gen.tails import seeded_case

    case = seeded_case(seed)
    case.calls = 2
    run_case(case, "cpu")


# =================================================================================
# 1. Property tests: whole random models
# =================================================================================
@_settings(60)
@given(cases())
def test_random_tails(case: Case) -> None:
    _run(case)


@_settings(40)
@given(cases(specials=(1, 2, 3, 5)))
def test_random_tails_nonfinite_rows(case: Case) -> None:
    """Rows with NaN, +inf, -inf (n_special >= 4: a whole row of x is +-inf too)."""
    _run(case)


@_settings(40)
@given(cases(mode="train", force=("batchnorm",), calls=(1, 2)))
def test_random_tails_batchnorm_training(case: Case) -> None:
    """BatchNorm1d on batch statistics, running stats (momentum 0.1/0.5/None) checked
    against the float64 twin after each of 1 or 2 calls."""
    assert case.spec.batch_stats
    _run(case)


@_settings(40)
@given(cases(force=("batchnorm",), mode="eval"))
def test_random_tails_batchnorm_eval(case: Case) -> None:
    _run(case)


@_settings(40)
@given(cases(force=("stage",), n_ops=3))
def test_random_tails_multistage(case: Case) -> None:
    """Linear -> tail -> Linear -> tail (up to three Linears)."""
    _run(case)


@_settings(30)
@given(cases(has_y=True, force=("y",)))
def test_random_tails_second_input(case: Case) -> None:
    """forward(self, x, y) with y (batch, N)."""
    _run(case)


@st.composite
def _x_residual_cases(draw: Any) -> Case:
    k = draw(st.integers(1, 40))
    spec = generate(HypDraw(draw), K=k, N=k, force=("x",))
    return Case(spec, draw(st.integers(2, 33)), draw(st.sampled_from(DISTS)),
                draw(st.integers(0, 2 ** 20)), draw(st.sampled_from([0, 0, 2])))


@_settings(30)
@given(_x_residual_cases())
def test_random_tails_gemm_input_added_back(case: Case) -> None:
    """N == K and the tail adds (or subtracts) x, the GEMM's own input."""
    _run(case)


@_settings(40)
@given(cases(force=("groupnorm",), allow=("groupnorm", "const", "unary", "param", "residual",
                                          "layernorm", "softmax", "pool")))
def test_random_tails_norms(case: Case) -> None:
    """GroupNorm (every divisor of the width, affine or not) among other normalisations."""
    assert any(op.startswith("groupnorm") for op in case.spec.ops)
    _run(case)


AFFINE_SUM = dict(allow=("const", "param", "y", "reduce"), force=("reduce",),
                  reduce_kinds=("sum", "mean"))


@_settings(40)
@given(cases(specials=(0, 0, 1, 5), **AFFINE_SUM))
def test_random_tails_affine_then_feature_sum(case: Case) -> None:
    """Sums / means of affine functions of the Linear output (constants, parameters):
    what cupyfuse.ir.rewrite turns into a float64 GEMV (non-finite rows recomputed)."""
    _run(case)


AFFINE_POOL = dict(allow=("const", "param", "pool", "unary", "softmax"), force=("pool",))


@_settings(40)
@given(cases(specials=(0, 0, 1, 5), **AFFINE_POOL))
def test_random_tails_affine_then_pooling(case: Case) -> None:
    """Pooling of affine functions of the Linear output (what cupyfuse.ir.rewrite may fold
    into the weight), followed by more ops."""
    _run(case)


MAX_PAIRS = dict(allow=("const", "param", "unary", "reduce", "stage"), force=("pool", "reduce"),
                 reduce_kinds=("sum", "mean", "max"), pools=(("max", 2, 2),))


@_settings(40)
@given(cases(specials=(0, 0, 1, 5), **MAX_PAIRS))
def test_random_tails_max_pairs(case: Case) -> None:
    """Max pooling over pairs among affine ops and row reductions: where a sum follows
    the pooling of an affine function of the Linear output, cupyfuse.ir.rewrite turns it into
    a GEMM on the pair differences (guarded, non-finite rows computed directly)."""
    _run(case)


@pytest.mark.parametrize("batch,k,n,kw", [
    (1, 16, 4, {}), (9, 64, 37, {}), (9, 64, 36, {"keepdim": True}),
    (7, 5, 11, {"transposed": True}), (12, 33, 64, {"negative": False, "mean": True})])
def test_max_pairs_sum_rewrite(batch: int, k: int, n: int, kw: dict) -> None:
    """The pair-difference rewrite applies (one GEMM on the differences, the full GEMM
    gone) and matches float64 on normal, NaN, +-inf and guard-flagged rows; a parameter
    edited in place is seen at the next call."""
    torch.manual_seed(batch + k + n)
    m = MaxPairsSum(k, n, **kw)
    x = guard_rows(batch, k, seed=k + n)
    fm = from_model(m)
    for edit in (False, True):
        if edit:
            with torch.no_grad():
                m.a.mul_(-0.5)
                m.c.add_(1.0)
                m.w.mul_(2.0)
        ref64, _, ref32 = references(m, [x])
        assert_matches(fm(x), ref64, ref32, f"edit {edit}")
    assert pairdiff_nodes(fm) == 1, "the pair-difference rewrite did not apply"
    prog = next(iter(runner_of(fm).programs.values()))
    assert sum(nd.kind == "gemm" for nd in prog.nodes) == 1, "the full GEMM is still there"


@pytest.mark.parametrize("form", AffineCoeff.FORMS)
@pytest.mark.parametrize("batch", [1, 7])
def test_rewrite_nonfinite_coefficient_runs_unrewritten(form: str, batch: int) -> None:
    """A zero divisor or an inf factor per feature: the rewritten form would give NaN where
    torch gives +-inf; the call runs the unrewritten program instead, and the rewrite is
    back once the parameter is finite again."""
    check_nonfinite_coefficients(form, batch, "cpu", calls=2)


def test_derived_weights_hold_no_autograd_graph() -> None:
    """The rewrites' derived weights (GEMV, average-pooling fold, pair differences) are
    built without autograd although the parameters require grad: a recorded graph would
    keep float64 copies of the weight alive with the cache."""
    from cupyfuse.ir import rewrite

    class Three(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lins = nn.ModuleList(nn.Linear(6, 8) for _ in range(3))
            self.a = nn.Parameter(torch.rand(8) + 0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            v = [lin(x) * self.a for lin in self.lins]
            pairs = F.max_pool1d(v[0].unsqueeze(1), 2).squeeze(1).sum(1)
            avg = F.avg_pool1d(v[1].unsqueeze(1), 4).squeeze(1).amax(1)
            return pairs + avg + v[2].sum(1)

    m = Three()
    x = torch.randn(3, 6)
    fm = from_model(m)
    ref64, _, ref32 = references(m, [x])
    assert_matches(fm(x), ref64, ref32)
    prog = next(iter(runner_of(fm).programs.values()))
    srcs = _resolved(m, prog)
    kinds = []
    for i, nd in enumerate(prog.nodes):
        if nd.kind == "gemv":
            out = rewrite.gemv_coefficients(prog, i, srcs[nd.attrs[0]], srcs)
        elif nd.kind == "gemm" and len(nd.attrs) > 2:
            out = rewrite.fold_coefficients(prog, i, srcs[nd.attrs[0]], srcs)
        else:
            continue
        kinds.append(nd.kind if nd.kind == "gemv" else nd.attrs[2][0])
        assert not any(isinstance(t, torch.Tensor) and t.requires_grad for t in out), kinds[-1]
    assert sorted(kinds) == ["avgpool", "gemv", "pairdiff"], kinds


def _resolved(m: nn.Module, prog: Any) -> list:
    """The tensors of a program's sources (module attribute paths or tensors)."""
    out = []
    for s in prog.sources:
        t: Any = m
        if isinstance(s, str):
            for part in s.split("."):
                t = getattr(t, part)
        else:
            t = s
        out.append(t)
    return out


def test_max_pairs_rewrite_only_where_the_gemm_dies() -> None:
    """The pooled values also feed a second output: the full GEMM stays, so the rewrite
    (which would only add a GEMM) is not applied; nor for another window or stride."""
    class Both(nn.Module):
        def __init__(self, win: int, stride: int) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 10)
            self.win, self.stride = win, stride

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            p = F.max_pool1d(self.lin(x).unsqueeze(1), self.win, self.stride).squeeze(1)
            return p.sum(1) + p.amax(1) if self.win == 2 and self.stride == 2 else p.sum(1)

    x = torch.randn(5, 8)
    for win, stride in ((2, 2), (2, 1), (3, 3)):
        m = Both(win, stride)
        fm = from_model(m)
        ref64, _, ref32 = references(m, [x])
        assert_matches(fm(x), ref64, ref32, f"window {win}, stride {stride}")
        assert pairdiff_nodes(fm) == 0, f"window {win}, stride {stride}: rewritten"


@_settings(20)
@given(cases(apis=("numpy",), mode="eval"))
def test_random_tails_numpy_operands(case: Case) -> None:
    """from_model called with NumPy arrays returns a NumPy array (no CuPy needed)."""
    _run(case)


@st.composite
def _tail_functions(draw: Any) -> tuple:
    spec = generate(HypDraw(draw), function=True)
    batch = draw(st.integers(2 if "groupnorm.g1" in spec.ops else 1, 33))
    return (spec, batch, draw(st.sampled_from(DISTS)), draw(st.integers(0, 2 ** 20)),
            draw(st.sampled_from([0, 0, 1, 3])), draw(st.booleans()))


def run_tail_function(spec: Any, batch: int, dist: str, seed: int, n_special: int, bias: bool,
                      device: Any = "cpu") -> None:
    """fused_linear(x, W, b, tail_fn, *extra) against tail_fn(x @ W.T + b) in float64."""
    fn = spec.tail_fn()
    g = torch.Generator().manual_seed(seed)
    K, N = spec.K, spec.N
    w = (torch.rand(N, K, generator=g) * 2 - 1) / math.sqrt(K)
    b = torch.rand(N, generator=g) * 2 - 1 if bias else None
    x, *extra = spec.make_inputs(batch, dist, seed, n_special)
    with torch.no_grad():
        h64 = x.double() @ w.double().t() + (b.double() if b is not None else 0)
        ref64 = fn(h64, *[e.double() for e in extra])
        ref32 = fn(x @ w.t() + (b if b is not None else 0), *extra)
    dev = torch.device(device)
    if dev.type != "cpu":
        # closure tensors must live where the operands do: rebuild the function with them
        ns = spec.namespace()
        for k, v in spec.closures.items():
            ns[k] = v.to(dev)
        fn = ns["tail_fn"]
    out = fused_linear(x.to(dev), w.to(dev), None if b is None else b.to(dev), fn,
                       *[e.to(dev) for e in extra])
    assert isinstance(out, torch.Tensor) and out.device.type == dev.type
    assert_matches(out, ref64, ref32, "fused_linear")


@_settings(50)
@given(_tail_functions())
def test_random_tail_functions_fused_linear(args: tuple) -> None:
    note(repr(args[0]))
    run_tail_function(*args)


# =================================================================================
# 2. fused_class / from_model semantics
# =================================================================================
def _bn_model_class() -> type:
    class BNTail(nn.Module):
        def __init__(self, K: int = 13, N: int = 37) -> None:
            super().__init__()
            self.fc = nn.Linear(K, N)
            self.scale = nn.Parameter(torch.randn(N))
            self.bn = nn.BatchNorm1d(N, momentum=0.3)
            self.drop = nn.Dropout(0.0)
            self.register_buffer("shift", torch.randn(N))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x) * self.scale
            h = self.bn(h) + self.shift
            return F.gelu(self.drop(h))

    return BNTail


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_fused_class_same_seed_same_state(seed: int) -> None:
    for cls in (_bn_model_class(), seeded(seed * 13 + 5).model_class(),
                seeded(seed * 13 + 6, force=("batchnorm", "layernorm")).model_class()):
        torch.manual_seed(seed)
        orig = cls()
        torch.manual_seed(seed)
        new = fused_class(cls)()
        assert isinstance(new, cls) and type(new) is not cls
        assert cls.__name__ in type(new).__name__
        assert fused_class(cls) is fused_class(cls)
        assert_same_state(new, orig, cls.__name__)
        # the RNG was used identically: the next draw agrees
        a = torch.rand(3)
        torch.manual_seed(seed)
        cls()
        assert torch.equal(torch.rand(3), a)


def test_fused_class_load_state_dict_round_trip() -> None:
    cls = _bn_model_class()
    Fused = fused_class(cls)
    torch.manual_seed(0)
    orig = cls()
    torch.manual_seed(1)
    new = Fused()
    # train the original a little so the running stats are not the defaults
    with torch.no_grad():
        orig(torch.randn(9, 13))
    new.load_state_dict(orig.state_dict())
    assert_same_state(new, orig)
    x = torch.randn(6, 13)
    orig.eval()
    new.eval()
    with torch.no_grad():
        assert torch.allclose(new(x), orig(x), atol=1e-5, rtol=1e-5)
    # and back: a state_dict saved from the fused class loads into the original
    torch.manual_seed(2)
    again = cls()
    again.load_state_dict(new.state_dict())
    assert_same_state(again, new)
    # from_model: the original's own keys; its state dict loads into a fresh original
    fm = from_model(orig)
    assert list(fm.state_dict()) == list(orig.state_dict())
    torch.manual_seed(5)
    fresh = cls()
    fresh.load_state_dict(fm.state_dict())
    assert_same_state(fresh, orig)


def test_fused_class_train_eval_switch() -> None:
    cls = _bn_model_class()
    torch.manual_seed(3)
    orig = cls()
    torch.manual_seed(3)
    new = fused_class(cls)()
    x = torch.randn(8, 13) * 3
    # training: batch statistics, running stats updated like the original's
    with torch.no_grad():
        o_train, n_train = orig(x), new(x)
    assert torch.allclose(n_train, o_train, atol=1e-4, rtol=1e-4)
    assert int(new.bn.num_batches_tracked) == 1
    assert torch.allclose(new.bn.running_mean, orig.bn.running_mean, atol=1e-5)
    assert torch.allclose(new.bn.running_var, orig.bn.running_var, atol=1e-5)
    # eval: running statistics, nothing updated
    orig.eval()
    new.eval()
    rm = new.bn.running_mean.clone()
    with torch.no_grad():
        o_eval, n_eval = orig(x), new(x)
    assert torch.allclose(n_eval, o_eval, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(n_eval, n_train, atol=1e-2)
    assert torch.equal(new.bn.running_mean, rm) and int(new.bn.num_batches_tracked) == 1
    # and back to training
    new.train()
    orig.train()
    with torch.no_grad():
        assert torch.allclose(new(x), orig(x), atol=1e-4, rtol=1e-4)
    assert int(new.bn.num_batches_tracked) == 2


def test_bn_training_batch_of_one_raises_like_torch() -> None:
    cls = _bn_model_class()
    torch.manual_seed(0)
    m = cls()
    x = torch.randn(1, 13)
    with pytest.raises(ValueError) as torch_err:
        copy.deepcopy(m)(x)
    for fused in (from_model(m), fused_class(cls)()):
        with pytest.raises(ValueError) as ours:
            with torch.no_grad():
                fused(x)
        assert "Expected more than 1 value per channel" in str(ours.value), str(ours.value)
    assert "more than 1 value" in str(torch_err.value)
    # eval mode runs batch 1 (running statistics)
    m.eval()
    out = from_model(m)(x)
    ref64, _, ref32 = references(m, [x])
    assert_matches(out, ref64, ref32)


@pytest.mark.parametrize("seed", range(4))
def test_random_bn_training_batch_of_one_raises(seed: int) -> None:
    spec = seeded(seed, mode="train", force=("batchnorm",))
    assert spec.batch_stats
    model = spec.make_model(0)
    inputs = spec.make_inputs(1, "randn3", seed)
    with pytest.raises(ValueError):
        copy.deepcopy(model)(*inputs)
    with pytest.raises(ValueError, match="more than 1 value"):
        from_model(model)(*inputs)


def test_from_model_numpy_in_numpy_out() -> None:
    cls = _bn_model_class()
    torch.manual_seed(0)
    m = cls().eval()
    x = np.random.default_rng(0).standard_normal((5, 13)).astype(np.float32)
    out = from_model(m)(x)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (5, 37)
    ref64, _, ref32 = references(m, [torch.from_numpy(x)])
    assert_matches(torch.from_numpy(out), ref64, ref32)
    # fused_linear with NumPy operands
    w = np.random.default_rng(1).standard_normal((7, 13)).astype(np.float32)
    b = np.random.default_rng(2).standard_normal(7).astype(np.float32)
    r = fused_linear(x, w, b, lambda h: torch.softmax(h, dim=1))
    assert isinstance(r, np.ndarray) and r.shape == (5, 7)
    exp = torch.softmax(torch.from_numpy(x).double() @ torch.from_numpy(w).double().t()
                        + torch.from_numpy(b).double(), dim=1)
    assert torch.allclose(torch.from_numpy(r).double(), exp, atol=1e-4, rtol=1e-4)


# =================================================================================
# 3. fused_linear with tail functions
# =================================================================================
def _tail_gelu_scale(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h) * 2.0 - 0.5


def _tail_logsumexp(h: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(h, dim=1, keepdim=True) - h.mean(dim=1, keepdim=True)


def _tail_layernorm_silu(h: torch.Tensor) -> torch.Tensor:
    return F.silu(F.layer_norm(h, (35,)))


def _tail_pool_sum(h: torch.Tensor) -> torch.Tensor:
    return F.max_pool1d(h.unsqueeze(1), 3, 2).squeeze(1).sum(dim=1) * 0.5


def _tail_extra(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(h) * y + F.normalize(h, dim=1)


def _tail_groupnorm(h: torch.Tensor) -> torch.Tensor:
    return F.group_norm(h, 5).clamp(-1.0, 1.0)


def _tail_new_axes(h: torch.Tensor) -> torch.Tensor:
    """None indices (new size-1 axes), with an ellipsis and a slice among them."""
    g = torch.softmax(h[:, None] * 2.0, dim=-1)[:, 0]
    return g[..., None, 2:30].amax(dim=-1) + h[None][0, :, :1]


def _tail_int_index(h: torch.Tensor) -> torch.Tensor:
    """Integer indices of features (negative too): one column each, its dim dropped."""
    return h[:, -1] * 2.0 + h[..., 2] - h.unsqueeze(1)[:, 0, 5]


@pytest.mark.parametrize("tail", [None, _tail_gelu_scale, _tail_logsumexp, _tail_layernorm_silu,
                                  _tail_pool_sum, _tail_extra, _tail_groupnorm, _tail_new_axes,
                                  _tail_int_index,
                                  lambda h: torch.softmax(h * 3.0, -1)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dist", ["rand", "offset"])
def test_fused_linear_tail_function(tail: Any, bias: bool, dist: str) -> None:
    g = torch.Generator().manual_seed(5)
    batch, K, N = 11, 19, 35
    x = torch.rand(batch, K, generator=g) if dist == "rand" else \
        torch.randn(batch, K, generator=g) * 50 + 100
    x[3, 4] = float("nan")
    w = (torch.rand(N, K, generator=g) * 2 - 1) / math.sqrt(K)
    b = torch.rand(N, generator=g) * 2 - 1 if bias else None
    extra = [torch.randn(batch, N, generator=g)] if tail is _tail_extra else []
    fn = tail if tail is not None else (lambda h: h)
    with torch.no_grad():
        ref64 = fn(x.double() @ w.double().t() + (b.double() if bias else 0),
                   *[e.double() for e in extra])
        ref32 = fn(x @ w.t() + (b if bias else 0), *extra)
    out = fused_linear(x, w, b, tail, *extra)
    assert_matches(out, ref64, ref32, getattr(tail, "__name__", "tail"))


# =================================================================================
# 4. Hand-written models: multi-stage, second input, x added back, broadcast output
# =================================================================================
class TwoStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(17, 45)
        self.ln = nn.LayerNorm(45)
        self.fc2 = nn.Linear(45, 23)
        self.bn = nn.BatchNorm1d(23)
        self.fc3 = nn.Linear(23, 9, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.ln(self.fc1(x)))
        h = torch.relu(self.bn(self.fc2(h))) + 0.25
        return torch.log_softmax(self.fc3(h), dim=1)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(21, 33)
        self.p = nn.Parameter(torch.randn(33))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        g = torch.sigmoid(h) * y + self.p
        return g - g.amax(dim=1, keepdim=True) + y.mean(dim=1, keepdim=True)


class XResidual(nn.Module):
    def __init__(self, k: int = 29) -> None:
        super().__init__()
        self.fc = nn.Linear(k, k)
        self.gn = nn.GroupNorm(1, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.gn(F.silu(h) + x) * 0.5 + x


class BroadcastOut(nn.Module):
    """KernelBench's pattern: a row minimum plus a (1, N, 1, 1) bias -> (1, N, batch, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 20)
        self.bias = nn.Parameter(torch.randn(1, 20, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = h.min(dim=1, keepdim=True)[0]
        return h + self.bias


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("batch", [2, 7, 33])
def test_two_stage_model(mode: str, batch: int) -> None:
    torch.manual_seed(batch)
    m = TwoStage().train(mode == "train")
    x = torch.randn(batch, 17) * 3
    ref64, m64, ref32 = references(m, [x])
    fm = from_model(m)
    out = fm(x)
    assert_matches(out, ref64, ref32, mode)
    assert_running_stats(m, m64)
    prog = program_of(fm, x)
    assert sum(n.kind == "gemm" for n in prog.nodes) == 3


@pytest.mark.parametrize("batch", [1, 4, 31])
def test_second_input_model(batch: int) -> None:
    torch.manual_seed(0)
    m = TwoInputs()
    x, y = torch.randn(batch, 21), torch.randn(batch, 33) * 2
    y[0, 3] = float("inf")
    ref64, _, ref32 = references(m, [x, y])
    assert_matches(from_model(m)(x, y), ref64, ref32)
    torch.manual_seed(0)
    fc = fused_class(TwoInputs)()
    assert_matches(fc(x, y), ref64, ref32)


@pytest.mark.parametrize("k", [1, 8, 29])
def test_gemm_input_added_back(k: int) -> None:
    torch.manual_seed(k)
    m = XResidual(k)
    x = torch.randn(9, k) * 50 + 100
    ref64, _, ref32 = references(m, [x])
    assert_matches(from_model(m)(x), ref64, ref32)


@pytest.mark.parametrize("batch", [1, 5, 16])
def test_broadcast_output_1_n_batch_1(batch: int) -> None:
    torch.manual_seed(0)
    m = BroadcastOut()
    x = torch.rand(batch, 12)
    ref64, _, ref32 = references(m, [x])
    out = from_model(m)(x)
    assert tuple(out.shape) == (1, 20, batch, 1)
    assert_matches(out, ref64, ref32)


def test_program_cached_per_mode_and_shape() -> None:
    """One program per (train/eval flags, feature shapes); a new batch size reuses it."""
    torch.manual_seed(0)
    m = TwoStage()
    fm = from_model(m)
    p1 = program_of(fm, torch.randn(4, 17))
    assert program_of(fm, torch.randn(9, 17)) is p1
    m.eval()
    p2 = program_of(fm, torch.randn(4, 17))
    assert p2 is not p1 and not any(n.kind == "bn" for n in p2.nodes)
    assert any(n.kind == "bn" for n in p1.nodes)


def test_parameters_edited_between_calls_are_seen() -> None:
    torch.manual_seed(0)
    m = TwoInputs()
    fm = from_model(m)
    x, y = torch.randn(3, 21), torch.randn(3, 33)
    fm(x, y)
    with torch.no_grad():
        m.fc.weight.mul_(-2.0)
        m.p.add_(1.0)
    m.fc.bias = nn.Parameter(torch.randn(33))  # a new tensor object under the same name
    ref64, _, ref32 = references(m, [x, y])
    assert_matches(fm(x, y), ref64, ref32)


def test_inplace_ops_not_reused_are_fused() -> None:
    class InplaceOk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 10)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.act(self.fc(x))
            h = h.mul_(2.0)
            return F.relu6(h, inplace=True)

    torch.manual_seed(0)
    m = InplaceOk()
    x = torch.randn(4, 6) * 4
    ref64, _, ref32 = references(m, [x])
    assert_matches(from_model(m)(x), ref64, ref32)


# =================================================================================
# 5. Refusals: TailError names the op and quotes the forward's line
# =================================================================================
class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.p = nn.Parameter(torch.randn(16))
        self.drop = nn.Dropout(0.3)


class RefTopk(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.topk(h, 3, dim=1, largest=False)[0]


class RefSort(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.sort(h, dim=1)[0] * 2.0


class RefSlice(_Base):
    def forward(self, x):
        h = torch.relu(self.fc(x))
        return h[:, ::2]


class RefDropoutModule(_Base):
    def forward(self, x):
        h = self.fc(x)
        return self.drop(h)


class RefDropoutFunctional(_Base):
    def forward(self, x):
        h = self.fc(x)
        return F.dropout(h, p=0.2, training=self.training)


class RefSumBatch(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h - h.sum(0)


class RefMeanBatch(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h / torch.mean(h, dim=0, keepdim=True)


class RefCumprod(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.cumprod(h, dim=1)


class RefCumprodMethod(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.cumprod(1)


class RefOuterSelf(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.unsqueeze(-1) * h.unsqueeze(-2)


class RefOuterParam(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.unsqueeze(2) * self.p.unsqueeze(0).unsqueeze(0)


class RefMaxIndices(_Base):   # (the indices themselves convert: int64)
    def forward(self, x):
        h = self.fc(x)
        return torch.max(h, 1)[1] + 1


class RefMaxIndicesMethod(_Base):   # (the indices of a stack's max along dim 0: refused)
    def forward(self, x):
        h = self.fc(x)
        return torch.stack([h, h * 2.0]).max(dim=0).indices


class RefRReLUTraining(_Base):
    def forward(self, x):
        h = self.fc(x)
        return F.rrelu(h, 0.1, 0.3, training=True)


class RefSoftminNoDim(_Base):
    def __init__(self):
        super().__init__()
        self.sm = nn.Softmin()

    def forward(self, x):
        h = self.fc(x)
        return self.sm(h.unsqueeze(1)).squeeze(1)   # (torch's legacy dim 0: the batch)


class RefBoolResult(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h > 0


class RefBoolSum(_Base):
    def forward(self, x):
        h = self.fc(x)
        return (h > 0).sum(1)


class RefBoolAdd(_Base):
    def forward(self, x):
        h = self.fc(x)
        return ((h > 0) + (h < 1)).float()


class RefCatBatch(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.cat([h, h], 0)


REFUSALS = [
    # (model, op named in the message, code of the line it must quote, train mode?)
    (RefCatBatch, "cat", "torch.cat([h, h], 0)", False),
    (RefBoolResult, "boolean", "return h > 0", False),
    (RefBoolSum, "sum", "(h > 0).sum(1)", False),
    (RefBoolAdd, "add", "((h > 0) + (h < 1)).float()", False),
    (RefRReLUTraining, "rrelu", "F.rrelu(h, 0.1, 0.3, training=True)", False),
    (RefSoftminNoDim, "softmin", "self.sm(h.unsqueeze(1)).squeeze(1)", False),
    (RefTopk, "topk", "torch.topk(h, 3, dim=1, largest=False)", False),
    (RefSort, "sort", "torch.sort(h, dim=1)", False),
    (RefSlice, "index", "h[:, ::2]", False),
    (RefDropoutModule, "dropout", "self.drop(h)", True),
    (RefDropoutFunctional, "dropout", "F.dropout(h, p=0.2, training=self.training)", True),
    (RefSumBatch, "sum", "h - h.sum(0)", False),
    (RefMeanBatch, "mean", "torch.mean(h, dim=0, keepdim=True)", False),
    (RefCumprod, "cumprod", "torch.cumprod(h, dim=1)", False),
    (RefCumprodMethod, "cumprod", "h.cumprod(1)", False),
    (RefOuterSelf, "outer product", "h.unsqueeze(-1) * h.unsqueeze(-2)", False),
    (RefOuterParam, "outer product", "h.unsqueeze(2) * self.p.unsqueeze(0).unsqueeze(0)", False),
    (RefMaxIndices, "add", "torch.max(h, 1)[1] + 1", False),
    # `.indices` is a getattr node that torch.fx records without a stack trace: its
    # refusal quotes the line of the value it reads (not the caller's line)
    (RefMaxIndicesMethod, "indices", "torch.stack([h, h * 2.0]).max(dim=0).indices", False),
]


def _line_of(cls: type, code: str) -> int:
    lines, start = inspect.getsourcelines(cls.forward)
    hits = [start + i for i, ln in enumerate(lines) if code in ln]
    assert len(hits) == 1, (cls.__name__, code, hits)
    return hits[0]


def _refusal(model: nn.Module, x: torch.Tensor) -> str:
    with pytest.raises(TailError) as ei:
        with torch.no_grad():
            from_model(model)(x)
    return str(ei.value)


@pytest.mark.parametrize("cls,op,code,train", REFUSALS,
                         ids=[(r.values if hasattr(r, "values") else r)[0].__name__ for r in REFUSALS])
def test_refusal_names_op_and_line(cls: type, op: str, code: str, train: bool) -> None:
    torch.manual_seed(0)
    m = cls().train(train)
    x = torch.randn(4, 8)
    with torch.no_grad():
        m(x)  # torch itself runs it
    msg = _refusal(m, x)
    line = _line_of(cls, code)
    assert op.lower() in msg.lower(), msg
    assert f"{THIS}:{line} in forward" in msg, msg
    assert code in msg, msg
    # fused_class refuses the same way, at the first call
    torch.manual_seed(0)
    fm = fused_class(cls)().train(train)
    with pytest.raises(TailError) as ei:
        with torch.no_grad():
            fm(x)
    assert f"{THIS}:{line} in forward" in str(ei.value), str(ei.value)
    assert op.lower() in str(ei.value).lower()


def test_refusal_dropout_only_in_training() -> None:
    torch.manual_seed(0)
    m = RefDropoutModule().eval()
    fm = from_model(m)
    x = torch.randn(4, 8)
    ref64, _, ref32 = references(m, [x])
    assert_matches(fm(x), ref64, ref32)
    m.train()
    with pytest.raises(TailError, match="dropout"):
        fm(x)
    m.drop.p = 0.0  # p = 0 in training is the identity
    fm = from_model(m)
    ref64, _, ref32 = references(m, [x])
    assert_matches(fm(x), ref64, ref32)


class RefNoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.relu(x * self.p) + 1.0


def test_refusal_forward_without_linear() -> None:
    msg = _refusal(RefNoLinear(), torch.randn(3, 8))
    assert "RefNoLinear" in msg and "Linear" in msg, msg


def test_refusal_tail_function_names_op() -> None:
    def tail(h):
        return torch.cumprod(h, 1) * 2.0

    with pytest.raises(TailError, match="cumprod"):
        fused_linear(torch.randn(3, 4), torch.randn(6, 4), None, tail)


def test_refusal_tail_function_with_topk() -> None:
    def tail(h):
        return torch.topk(h, 2, dim=1, largest=False)[0]

    line = _line_of_fn(tail, "torch.topk")
    with pytest.raises(TailError) as ei:
        fused_linear(torch.randn(3, 4), torch.randn(6, 4), None, tail)
    assert "topk" in str(ei.value) and f"{THIS}:{line}" in str(ei.value), str(ei.value)


def _line_of_fn(fn: Any, code: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return next(start + i for i, ln in enumerate(lines) if code in ln)


class RefControlFlow(_Base):
    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            return h
        return -h


def test_refusal_data_dependent_control_flow() -> None:
    with pytest.raises(TailError, match="torch.fx could not trace"):
        from_model(RefControlFlow())(torch.randn(2, 8))


# =================================================================================
# 6. Regression tests: each pins one form and names the failure it guards against (a
#    known open problem would be a strict xfail, which flips to a failure once fixed)
# =================================================================================
class ViewFlatten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 10)

    def forward(self, x):
        h = self.fc(x)
        h = h.view(h.size(0), -1)
        return torch.sigmoid(h)


# Regression (lower.views.reshape): h.view(h.size(0), -1) fuses, not refused as 'a reshape
# with several -1' (the batch size sentinel BATCH == -1 must not count as a
# second -1)
def test_regression_view_batch_size_minus_one() -> None:
    torch.manual_seed(0)
    m = ViewFlatten()
    x = torch.randn(5, 6)
    ref64, _, ref32 = references(m, [x])
    assert_matches(from_model(m)(x), ref64, ref32)


class GroupNormWidthOne(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 1)
        self.gn = nn.GroupNorm(1, 1)

    def forward(self, x):
        return self.gn(self.fc(x)) + 0.5


# Regression (Builder.group_normalize): GroupNorm(1, 1) on a (batch, 1) value fuses (not
# 'needs a feature dimension'); torch returns bias (x - x = 0)
def test_regression_groupnorm_one_channel() -> None:
    torch.manual_seed(0)
    m = GroupNormWidthOne()
    x = torch.randn(5, 6)
    ref64, _, ref32 = references(m, [x])
    assert_matches(from_model(m)(x), ref64, ref32)


def _tail_layernorm_shape_from_h(h: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(h, (h.shape[1],)) * 2.0


# Regression (lower.norms.layer_norm): a normalized_shape computed from the value's shape,
# F.layer_norm(h, (h.shape[1],)), fuses: the shape's values are compared with the dims,
# not its fx nodes
def test_regression_layer_norm_shape_from_h() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 6, generator=g), torch.randn(10, 6, generator=g)
    fn = _tail_layernorm_shape_from_h
    ref64 = fn(x.double() @ w.double().t())
    assert_matches(fused_linear(x, w, None, fn), ref64, fn(x @ w.t()))


class SignedZeros(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 10)

    def forward(self, x):
        h = self.fc(x).abs()
        return 1.0 / (h * 0.0) + 1.0 / (h * -0.0)


# Regression (the Builder's memo): const(0.0) and const(-0.0) compare equal, yet -0.0 must
# not be replaced by +0.0 (1/(h*-0.0) would give +inf, torch -inf)
def test_regression_negative_zero_constant() -> None:
    torch.manual_seed(0)
    m = SignedZeros()
    x = torch.randn(4, 6)
    ref64, _, ref32 = references(m, [x])
    assert_matches(from_model(m)(x), ref64, ref32)


class ClampTensorBound(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 10)
        self.lo = nn.Parameter(torch.randn(10))

    def forward(self, x):
        return torch.clamp(self.fc(x), min=self.lo)


# Regression (lower.elementwise.clamp): torch.clamp(h, min=<parameter>) fuses, like
# clamp(h, min=<parameter> - 1.0) (not refused with 'needs a number here')
def test_regression_clamp_with_parameter_bound() -> None:
    torch.manual_seed(0)
    m = ClampTensorBound()
    x = torch.randn(4, 6)
    ref64, _, ref32 = references(m, [x])
    assert_matches(from_model(m)(x), ref64, ref32)


class MaxMethodParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 10)
        self.p = nn.Parameter(torch.randn(10))

    def forward(self, x):
        return self.fc(x).max(self.p)


# Regression (Translator.call_method): h.max(<parameter>) (elementwise maximum) fuses
# (like torch.max(h, p)) or raises TailError, never a TypeError ('%' on an fx Node)
def test_regression_max_method_with_parameter() -> None:
    torch.manual_seed(0)
    m = MaxMethodParam()
    x = torch.randn(4, 6)
    ref64, _, ref32 = references(m, [x])
    try:
        out = from_model(m)(x)
    except TailError:
        return  # a clean refusal would be acceptable
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(f"{type(exc).__name__}: {exc}") from exc
    assert_matches(out, ref64, ref32)


class AugmentedAliased(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 10)

    def forward(self, x):
        h = self.fc(x)
        g = h
        g += 1.0
        return g + h


# Regression (the translator): an augmented assignment (g += 1.0, operator.iadd) on a
# tensor read again later must not be fused out of place: that would be silently wrong
# (torch: 2 * (h + 1), out of place: (h + 1) + h)
def test_regression_augmented_assignment_on_aliased_value() -> None:
    torch.manual_seed(0)
    m = AugmentedAliased()
    x = torch.randn(4, 6)
    ref64, _, ref32 = references(m, [x])
    try:
        out = from_model(m)(x)
    except TailError:
        return  # refusing (like h.add_(1.0) followed by a read of h) would be correct
    assert_matches(out, ref64, ref32)


# Regression (fused_class): the generated forward takes keyword arguments, so model(x=x),
# which the original accepts, works (no TypeError)
def test_regression_fused_class_keyword_input() -> None:
    torch.manual_seed(0)
    orig = TwoStage().eval()
    torch.manual_seed(0)
    m = fused_class(TwoStage)().eval()
    x = torch.randn(3, 17)
    ref64, _, ref32 = references(orig, [x])
    assert_matches(m(x=x), ref64, ref32)
    x2, y = torch.randn(4, 21), torch.randn(4, 33)
    torch.manual_seed(0)
    two = fused_class(TwoInputs)()
    torch.manual_seed(0)
    ref64, _, ref32 = references(TwoInputs(), [x2, y])
    assert_matches(two(x2, y=y), ref64, ref32)


# Regression (fused_class): an instance of the generated class (FusedX, __module__ of X,
# no attribute of that module) goes through torch.save / torch.load and pickle
def test_regression_fused_class_instance_pickles() -> None:
    import io
    import pickle

    torch.manual_seed(0)
    m = fused_class(TwoStage)().eval()
    x = torch.randn(3, 17)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert type(back) is type(m)
    assert torch.allclose(back(x), m(x))
    assert pickle.loads(pickle.dumps(m)) is not None


# ---------------------------------------------------------------------------------
# Forms people write that the generator does not draw: a hand-written Linear (addmm,
# x @ W.T + b), a norm over h.shape[1:], module forms of the composite activations
# ---------------------------------------------------------------------------------
class _Forms(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.w = nn.Parameter(torch.randn(16, 12) / 3)
        self.b = nn.Parameter(torch.randn(16))
        self.prelu = nn.PReLU(16)
        self.softmin = nn.Softmin(dim=1)
        self.apool = nn.AdaptiveMaxPool1d(4)
        self.rrelu = nn.RReLU(0.1, 0.3)
        self.celu = nn.CELU(0.6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "addmm":
            return torch.tanh(torch.addmm(self.b, x, self.w.t()))
        if self.form == "addmm_scaled":
            return torch.addmm(self.b, x, self.w.t(), beta=0.5, alpha=2.0).sum(1)
        if self.form == "einsum_cat":
            h = torch.einsum("bi,oi->bo", x, self.w) + self.b
            return torch.cat([torch.relu(h), x, torch.ones_like(h) * 2.0], dim=1).softmax(1)
        if self.form == "manual_linear_layer_norm":
            h = x @ self.w.T + self.b
            return F.layer_norm(h, h.shape[1:])
        h = F.linear(x, self.w, self.b)
        if self.form == "prelu_channels":
            return self.prelu(h)
        if self.form == "softmin":
            return self.softmin(h)
        if self.form == "adaptive_max":
            return self.apool(h.unsqueeze(1)).squeeze(1)
        if self.form == "rrelu_eval":
            return self.rrelu(h)
        if self.form == "selects":
            m = (h > -0.5) & ~(h > 2.0)
            return (torch.where(m, h, torch.tanh(h)) + h.masked_fill(h < -2.5, 1.0)
                    + F.hardshrink(h, 0.4) * (h != 0).float() + F.threshold(h, 0.3, -1.0))
        return self.celu(F.selu(h)) + F.logsigmoid(h) * F.softsign(h) - F.tanhshrink(h)


FORMS = ["addmm", "addmm_scaled", "manual_linear_layer_norm", "prelu_channels", "softmin",
         "adaptive_max", "rrelu_eval", "composites", "selects", "einsum_cat"]


def forms_case(form: str) -> tuple:
    """(model in eval mode, x with NaN/+inf/-inf entries, float64 and float32 references)."""
    torch.manual_seed(7)
    m = _Forms(form).eval()
    x = torch.randn(9, 12)
    x[3, 2] = float("nan")
    x[5, 0] = float("inf")
    x[6, 7] = -float("inf")
    ref64, _, ref32 = references(m, [x])
    return m, x, ref64, ref32


@pytest.mark.parametrize("form", FORMS)
def test_written_forms_match_float64(form: str) -> None:
    m, x, ref64, ref32 = forms_case(form)
    with torch.no_grad():
        assert_matches(from_model(m)(x), ref64, ref32, form)
        fc = fused_class(_Forms)(form).eval()
        fc.load_state_dict(m.state_dict())
        assert_matches(fc(x), ref64, ref32, f"{form} (fused_class)")


# =================================================================================
# Indexing: any mix of slices, integers, None and an ellipsis fuses like torch or is refused
# =================================================================================
def _index_part(draw: Any, ellipsis_ok: bool) -> Any:
    kind = draw(st.sampled_from(["slice", "int", "none", "full"] + (["ellipsis"] if ellipsis_ok else [])))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "none":
        return None
    if kind == "int":
        return draw(st.integers(-8, 8))
    if kind == "full":
        return slice(None)
    bound = st.one_of(st.none(), st.integers(-9, 9))
    return slice(draw(bound), draw(bound), draw(st.sampled_from([None, 1, 2])))


@st.composite
def _index_tuples(draw: st.DrawFn) -> tuple:
    parts: list[Any] = []
    for _ in range(draw(st.integers(1, 4))):
        parts.append(_index_part(draw, Ellipsis not in parts))
    if draw(st.booleans()):   # keep the batch dim whole first, as most forwards do
        parts.insert(0, slice(None))
    return tuple(parts)


def _index_outcome(idx: tuple, n: int) -> str:
    """'torch' (torch rejects it), 'refused' or 'fused' (checked equal to torch)."""
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(5, 6, generator=g), torch.randn(n, 6, generator=g)

    def tail(h: torch.Tensor) -> torch.Tensor:
        return h[idx] * 1.0

    try:
        want = tail(x.double() @ w.double().t())
    except (IndexError, RuntimeError, ValueError, TypeError):
        return "torch"
    try:
        out = fused_linear(x, w, None, tail)
    except TailError:
        return "refused"
    assert tuple(out.shape) == tuple(want.shape), (idx, tuple(out.shape), tuple(want.shape))
    assert torch.allclose(out.double(), want, atol=1e-5, rtol=1e-5), idx
    return "fused"


@_settings(200)
@given(idx=_index_tuples(), n=st.integers(1, 7))
def test_random_indexing_fuses_like_torch_or_is_refused(idx: tuple, n: int) -> None:
    note(repr(idx))
    _index_outcome(idx, n)


def test_random_indexing_mostly_fuses() -> None:
    """The property above would pass with every index refused: of a fixed sample of index
    tuples torch accepts with the batch dim kept whole, most fuse."""
    import random

    rng = random.Random(7)
    seen = {"torch": 0, "refused": 0, "fused": 0}
    for _ in range(200):
        parts: list[Any] = [slice(None)]
        for _ in range(rng.randint(1, 3)):
            parts.append(rng.choice([None, slice(None), slice(rng.randint(-6, 2), None),
                                     slice(None, rng.randint(1, 6)), rng.randint(-3, 3)]))
        seen[_index_outcome(tuple(parts), rng.randint(3, 7))] += 1
    assert seen["fused"] >= 0.6 * (seen["fused"] + seen["refused"]), seen


# =================================================================================
# Regression tests: forms where any reading but torch's would be silently wrong
# =================================================================================
def test_pow_half_is_sqrt_like_torch() -> None:
    """torch computes x ** 0.5 and x ** -0.5 as sqrt / rsqrt: -inf gives NaN there (the
    generic pow would give +inf and 0)."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(6, 5, generator=g), torch.randn(7, 5, generator=g)
    x[1, 0], x[2, 0] = float("-inf"), float("inf")

    def tail(h: torch.Tensor) -> torch.Tensor:
        return torch.pow(h, 0.5) + h ** -0.5 * 2.0

    out = fused_linear(x, w, None, tail)
    ref = tail(x @ w.t())
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.allclose(out.nan_to_num(), ref.nan_to_num(), atol=1e-5, rtol=1e-5)


class _Instance2d(nn.Module):
    """InstanceNorm1d of a 2-D value: torch reads it unbatched, each row normalised over
    its features (not per-channel zeros)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 9)
        self.norm = nn.InstanceNorm1d(9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


@pytest.mark.parametrize("batch", [1, 2, 9, 13])
def test_instance_norm_of_2d_value_like_torch(batch: int) -> None:
    torch.manual_seed(batch)
    m = _Instance2d()
    x = torch.randn(batch, 5)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = m(x)
        out = from_model(m)(x)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


class _SqueezeLast(nn.Module):
    """squeeze() as the last op: at batch size 1 torch drops the batch dim too (so does the
    fused result)."""

    def __init__(self, dim: Any) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.dim is None:
            return torch.sigmoid(h).sum(1, keepdim=True).squeeze()
        return h.squeeze(self.dim)


@pytest.mark.parametrize("dim", [None, 0])
def test_squeeze_of_the_batch_dim_like_torch_at_every_batch(dim: Any) -> None:
    torch.manual_seed(0)
    m = _SqueezeLast(dim)
    fm = from_model(m)
    for batch in (3, 1, 2, 1):    # one program for every batch size
        x = torch.randn(batch, 5)
        with torch.no_grad():
            ref, out = m(x), fm(x)
        assert tuple(out.shape) == tuple(ref.shape), (batch, tuple(out.shape), tuple(ref.shape))
        assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert tuple(fused_linear(torch.randn(1, 5), m.fc.weight.detach(), None,
                              lambda h: h.sum(1, keepdim=True).squeeze()).shape) == ()


class _ChunkPieces(nn.Module):
    """Slices of a chunk's tuple of pieces, and cat of such a slice (fused, no crash)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.cat(h.chunk(4, 1)[::-1], 1) * h.chunk(2, dim=1)[1:][0].sum(1, keepdim=True)


class _GroupNorm3d(nn.Module):
    """GroupNorm of a (batch, C, 1) value: its (C,) affine read as (C, 1) (on the CPU path
    too)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 8)
        self.gn = nn.GroupNorm(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gn(self.fc(x).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("cls", [_ChunkPieces, _GroupNorm3d])
@pytest.mark.parametrize("batch", [1, 6])
def test_second_audit_crashes_now_fuse(cls: type, batch: int) -> None:
    torch.manual_seed(batch)
    m = cls()
    with torch.no_grad():
        torch.nn.init.normal_(getattr(m, "gn", m.fc).weight)
    x = torch.randn(batch, 5)
    with torch.no_grad():
        ref, out = m(x), from_model(m)(x)
    assert tuple(out.shape) == tuple(ref.shape)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


class _InstanceOneElement(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 4)
        self.n = nn.InstanceNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.n(self.fc(x).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("batch", [1, 3])
def test_instance_norm_of_one_element_raises_like_torch(batch: int) -> None:
    """torch refuses instance statistics of one spatial element (so does the fused model:
    no zeros)."""
    m = _InstanceOneElement()
    x = torch.randn(batch, 5)
    with pytest.raises(ValueError) as want:
        m(x)
    with pytest.raises(ValueError) as got:
        from_model(m)(x)
    assert str(got.value) == str(want.value)


class _OnePerGroup(torch.nn.Module):
    def __init__(self, c: int, g: int, spatial: bool) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, c)
        self.gn = torch.nn.GroupNorm(g, c)
        self.spatial = spatial

    def forward(self, x):
        h = self.fc(x)
        return self.gn(h.unsqueeze(-1)).squeeze(-1) if self.spatial else self.gn(h)


@pytest.mark.parametrize("c,g,spatial", [(4, 4, False), (6, 6, True), (4, 2, False)])
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_group_norm_one_value_per_group_raises_like_torch_at_one_row(c, g, spatial, batch):
    """torch refuses GroupNorm with one value per group at batch 1 (its message; at any
    other batch it gives zeros): so do the fused module and fused_linear."""
    import cupyfuse

    torch.manual_seed(batch)
    model = _OnePerGroup(c, g, spatial)
    x = torch.randn(batch, 8)
    try:
        with torch.no_grad():
            want = model(x)
    except ValueError as e:
        want = e
    gw, gb = model.gn.weight.detach().clone(), model.gn.bias.detach().clone()

    def tail(h):
        if spatial:
            return torch.nn.functional.group_norm(h.unsqueeze(-1), g, gw, gb).squeeze(-1)
        return torch.nn.functional.group_norm(h, g, gw, gb)

    for fused in (cupyfuse.from_model(model),
                  lambda x: cupyfuse.fused_linear(x, model.fc.weight, model.fc.bias, tail)):
        if isinstance(want, ValueError):
            with pytest.raises(ValueError, match=re.escape(str(want))):
                with torch.no_grad():
                    fused(x)
        else:
            with torch.no_grad():
                torch.testing.assert_close(fused(x), want, atol=1e-4, rtol=1e-4)


# --- instance norm: torch's (N, C, *spatial) reading ---------------------------------------
class _InstanceNorm(nn.Module):
    """``norm`` (an nn.InstanceNormXd or F.instance_norm) of the Linear's (..., 6) value,
    viewed by ``view`` first."""

    def __init__(self, k: int, norm: Any, view: Any = None) -> None:
        super().__init__()
        self.fc = nn.Linear(k, 6)
        self.norm = norm if isinstance(norm, nn.Module) else None
        self.fn = None if isinstance(norm, nn.Module) else norm
        self.view = view

    def forward(self, x):
        h = self.fc(x)
        if self.view is not None:
            h = self.view(h)
        return self.norm(h) if self.norm is not None else self.fn(h)


def _affine(m: nn.Module) -> nn.Module:
    with torch.no_grad():
        nn.init.normal_(m.weight)
        nn.init.normal_(m.bias)
    return m


# (norm, input shape, view of the Linear's value): what torch computes row by row
INSTANCE_FUSED = [
    (lambda: F.instance_norm, (4, 3, 8), None),                    # (N, C, L): rows
    (lambda: nn.InstanceNorm1d(3), (4, 3, 8), None),
    (lambda: nn.InstanceNorm1d(6), (4, 8), None),                  # unbatched (C, L)
    (lambda: F.instance_norm, (4, 8), lambda h: h.unsqueeze(1)),   # (N, 1, L)
    (lambda: _affine(nn.InstanceNorm1d(1, affine=True)), (4, 8), lambda h: h.unsqueeze(1)),
    (lambda: nn.InstanceNorm2d(1), (4, 8), lambda h: h.unsqueeze(1)),   # unbatched (C, 1, W)
    (lambda: nn.InstanceNorm2d(1), (4, 8), lambda h: h[:, None, None]),  # (N, 1, 1, W)
    (lambda: _affine(nn.InstanceNorm2d(1, affine=True)), (4, 8), lambda h: h[:, None, None]),
    (lambda: nn.InstanceNorm3d(2), (4, 8), lambda h: h[:, None, None]),  # unbatched
]


@pytest.mark.parametrize("i", range(len(INSTANCE_FUSED)))
def test_instance_norm_row_wise_like_torch_float64(i: int) -> None:
    norm, shape, view = INSTANCE_FUSED[i]
    torch.manual_seed(i)
    m = _InstanceNorm(shape[-1], norm(), view)
    x = torch.randn(shape) * 3
    ref64, _, ref32 = references(m, [x])
    with torch.no_grad():
        out = from_model(m)(x)
    assert_matches(out, ref64, ref32, what=f"case {i}")


# torch normalises across rows of cupyfuse's program (over a leading dim, or each row a
# channel over the others): refused, naming the op and the forward's line
INSTANCE_ACROSS_ROWS = [
    (lambda: F.instance_norm, (2, 3, 4, 8), None, "instance_norm"),      # over 4 x 6
    (lambda: nn.InstanceNorm2d(3), (2, 3, 8), None, "InstanceNorm2d"),   # unbatched: over 3 x 6
    (lambda: nn.InstanceNorm2d(3), (2, 3, 4, 8), None, "InstanceNorm2d"),
    (lambda: nn.InstanceNorm3d(3), (2, 3, 4, 8), None, "InstanceNorm3d"),
    (lambda: nn.InstanceNorm1d(6), (4, 3, 8), lambda h: h.sum(-1), "InstanceNorm1d"),  # (N, S)
]


@pytest.mark.parametrize("i", range(len(INSTANCE_ACROSS_ROWS)))
def test_instance_norm_across_rows_is_refused(i: int) -> None:
    norm, shape, view, op = INSTANCE_ACROSS_ROWS[i]
    m = _InstanceNorm(shape[-1], norm(), view)
    x = torch.randn(shape)
    with torch.no_grad():
        m(x)   # torch runs it
    line = inspect.getsourcelines(_InstanceNorm.forward)[1] + 4
    for fused in (from_model(m), fused_class(_InstanceNorm)(shape[-1], norm(), view)):
        with pytest.raises(TailError) as ei, torch.no_grad():
            fused(x)
        msg = str(ei.value)
        assert op in msg and f"{THIS}:{line} in forward" in msg, msg


# torch raises: so does cupyfuse, with torch's message (the module's rank checks, F's
# spatial check)
INSTANCE_RAISES = [
    (lambda: nn.InstanceNorm2d(6), (4, 8), None),
    (lambda: nn.InstanceNorm3d(6), (4, 3, 8), None),
    (lambda: nn.InstanceNorm1d(6), (2, 3, 4, 8), None),
    (lambda: nn.InstanceNorm2d(6), (4, 8), lambda h: h[:, None, None, None]),
    (lambda: F.instance_norm, (4, 8), None),                        # (N, C): no spatial dim
    (lambda: _affine(nn.InstanceNorm1d(3, affine=True)), (4, 8), lambda h: h.unsqueeze(1)),
]


@pytest.mark.parametrize("i", range(len(INSTANCE_RAISES)))
def test_instance_norm_raises_like_torch(i: int) -> None:
    norm, shape, view = INSTANCE_RAISES[i]
    m = _InstanceNorm(shape[-1], norm(), view)
    x = torch.randn(shape)
    with pytest.raises(ValueError) as want:
        m(x)
    with pytest.raises(ValueError) as got, torch.no_grad():
        from_model(m)(x)
    assert str(got.value) == str(want.value)


# --- clamp with infinite bounds (and torch.clamp(v, None, None), which torch raises on) ----
class _ClampInf(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.form = form
        self.ht = nn.Hardtanh(-math.inf, math.inf)

    def forward(self, x, lo=0.0):
        h = self.fc(x)
        if self.form == "min_arg":
            return h.clamp(min=lo)
        if self.form == "min":
            return h.clamp(min=-math.inf)
        if self.form == "max":
            return torch.clamp(h, max=math.inf)
        if self.form == "both":
            return h.clip(-math.inf, math.inf)
        if self.form == "hardtanh":
            return F.hardtanh(h, -math.inf, math.inf)
        return self.ht(h)


@pytest.mark.parametrize("form", ["min_arg", "min", "max", "both", "hardtanh", "Hardtanh"])
def test_clamp_with_infinite_bounds_like_torch_float64(form: str) -> None:
    torch.manual_seed(0)
    m = _ClampInf(form)
    x = torch.randn(5, 8) * 3
    x[1, 0], x[2, 3], x[3, 1] = math.nan, math.inf, -math.inf   # NaN stays NaN
    args = [x] + ([-math.inf] if form == "min_arg" else [])
    with torch.no_grad():
        ref64 = copy.deepcopy(m).double()(x.double(), *args[1:])
        ref32 = m(*args)
        twin = fused_class(_ClampInf)(form)
        twin.load_state_dict(m.state_dict())
        for fused in (from_model(m), twin):
            assert_matches(fused(*args), ref64, ref32, what=form)
    w, b = m.fc.weight.detach(), m.fc.bias.detach()
    out = fused_linear(x, w, b, lambda h: h.clamp(-math.inf, math.inf) + h.clamp(max=math.inf))
    want = (x.double() @ w.double().t() + b.double()) * 2
    assert_matches(out, want, want.float(), what=form)


# --- one-row extra inputs broadcast against the batch --------------------------------------
class _OneRowInput(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.fc2 = nn.Linear(6, 6)
        self.form = form

    def forward(self, x, y):
        h = self.fc(x)
        if self.form == "sum":   # a masked mean with a (1, N) mask
            return h.sum(-1) / y.sum(-1)
        if self.form == "amax":
            return h.amax(-1) - y.amax(-1)
        if self.form == "unsqueeze":
            return h * y.sum(-1).unsqueeze(-1)
        if self.form == "linear":
            return h + self.fc2(y)
        return h + y.softmax(-1)


ONE_ROW_TAILS = {
    "sum": lambda h, y: h.sum(-1) / y.sum(-1),
    "amax": lambda h, y: h.amax(-1) - y.amax(-1),
    "unsqueeze": lambda h, y: h * y.sum(-1).unsqueeze(-1),
    "softmax": lambda h, y: h + y.softmax(-1),
}


@pytest.mark.parametrize("form", ["sum", "amax", "unsqueeze", "linear", "softmax"])
@pytest.mark.parametrize("xb,yb", [(4, 1), (1, 4), (3, 3)])
def test_one_row_input_reduced_and_broadcast_like_torch_float64(form: str, xb: int,
                                                                 yb: int) -> None:
    """A (1, N) input reduced over its features (or through a second Linear) and broadcast
    against the batch, as torch does; and x of one row against a batch of y (the CPU path
    must not reshape such values to x's batch: a RuntimeError)."""
    torch.manual_seed(xb * 10 + yb)
    m = _OneRowInput(form)
    x, y = torch.randn(xb, 8) * 3, torch.rand(yb, 6) + 0.5
    ref64, _, ref32 = references(m, [x, y])
    with torch.no_grad():
        out = from_model(m)(x, y)
    assert_matches(out, ref64, ref32, what=form)
    if form in ONE_ROW_TAILS:
        w, b = m.fc.weight.detach(), m.fc.bias.detach()
        fn = ONE_ROW_TAILS[form]
        want = fn(x.double() @ w.double().t() + b.double(), y.double())
        assert_matches(fused_linear(x, w, b, fn, y), want, want.float(), what=form)


# --- dim tuples, in-place aliases, norms' changed state, signed zeros, torch's errors ---
VAR_STD_MULTI = {
    "var (1, 2) of (B, 1, N)": lambda h: h.unsqueeze(1).var(dim=(1, 2)),
    "var (2, 1) keepdim": lambda h: h.unsqueeze(1).var(dim=(2, 1), keepdim=True),
    "std (1, 2) unbiased=False": lambda h: h.unsqueeze(1).std(dim=(1, 2), unbiased=False),
    "std (-1, -2) correction=0 keepdim": lambda h: torch.std(h.unsqueeze(1), dim=(-1, -2),
                                                             correction=0, keepdim=True),
    "var (1, 2) of (B, N, 1)": lambda h: h.unsqueeze(-1).var(dim=(1, 2)),
    "var (1, 3) of (B, 1, N, 1)": lambda h: h[:, None, :, None].var(dim=(1, 3)) + h,
    "var (1, 2, 3) of (B, 1, N, 1)": lambda h: h[:, None, :, None].var(dim=(1, 2, 3)),
    "std (1, 2) of (B, 1, 1)": lambda h: h.sum(-1, keepdim=True)[:, None].std(dim=(1, 2)),
    "var (1, 2) of (B, 1, 1) correction 0": lambda h: h.sum(-1, keepdim=True)[:, None].var(
        dim=(1, 2), correction=0),
}


class _Wrap(nn.Module):
    def __init__(self, fn: Any, k: int = 8, n: int = 6) -> None:
        super().__init__()
        self.fc = nn.Linear(k, n)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.fc(x))


@pytest.mark.parametrize("form", list(VAR_STD_MULTI))
def test_var_std_over_dims_with_size_one_dims_like_torch_float64(form: str) -> None:
    """var/std over a dim tuple holding size-1 dims besides the features is one statistic
    over all the elements (not reduced one dim at a time, which would give var over the
    size-1 dim of a variance: NaN with correction 1, 0 with correction 0)."""
    torch.manual_seed(3)
    m = _Wrap(VAR_STD_MULTI[form])
    x = torch.randn(5, 8) * 2
    ref64, _, ref32 = references(m, [x])
    with torch.no_grad():
        out = from_model(m)(x)
    assert_matches(out, ref64, ref32, what=form)
    w, b = m.fc.weight.detach(), m.fc.bias.detach()
    assert_matches(fused_linear(x, w, b, VAR_STD_MULTI[form]), ref64, ref32, what=form)


class _InplaceAlias(nn.Module):
    """An in-place op on what an op returned as its input itself (nn.Identity, dropout in
    eval mode or p = 0, .float()/.to/.type to float32 of a float32 tensor) or on a view
    made by a call, through a method or an augmented assignment."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.form = form
        self.drop = nn.Dropout(0.3)
        self.drop0 = nn.Dropout(0.0)
        self.id = nn.Identity()

    def forward(self, x):
        h = self.fc(x)
        f = self.form
        if f == "Dropout eval .relu_()":
            g = self.drop(h)
            g.relu_()
            return h - 1.0
        if f == "Identity .mul_()":
            self.id(h).mul_(2.0)
            return h + 1.0
        if f == "float .relu_()":
            g = h.float()
            g.relu_()
            return h.sum(1)
        if f == "to(float32) .clamp_()":
            g = h.to(torch.float32)
            g.clamp_(0.0, 1.0)
            return h * 2.0
        if f == "type(float32) .sigmoid_()":
            g = h.type(torch.float32)
            g.sigmoid_()
            return h
        if f == "F.dropout eval +=":
            g = F.dropout(h, 0.5, False)
            g += 1.0
            return h
        if f == "Dropout p=0 train *=":
            g = self.drop0(h)
            g *= 3.0
            return h + g
        if f == "view +=":
            g = h.view(-1, 6)
            g += 1.0
            return h
        if f == "unsqueeze -=":
            g = h.unsqueeze(1)
            g -= 2.0
            return h.sum(-1)
        if f == "Identity then view /=":
            g = self.id(h)[:, None]
            g /= 4.0
            return h
        # forms that fuse: nothing reads the old value afterwards
        if f == "ok: Dropout eval .relu_() returned":
            return self.drop(h).relu_()
        if f == "ok: += then read":
            h = h * 2.0
            h += 1.0
            return h.softmax(-1)
        if f == "ok: += right-hand side of the same operator":
            g = h.view(-1, 6)
            g += h.abs() + 1.0
            return g
        if f == "ok: loop of +=":
            g = h * 1.0
            for _ in range(3):
                g += 1.0
            return g
        if f == "ok: mask .float() .mul_()":
            return (h > 0).float().mul_(2.0) + h
        raise AssertionError(f)


INPLACE_ALIAS_REFUSED = ["Dropout eval .relu_()", "Identity .mul_()", "float .relu_()",
                         "to(float32) .clamp_()", "type(float32) .sigmoid_()",
                         "F.dropout eval +=", "Dropout p=0 train *=", "view +=",
                         "unsqueeze -=", "Identity then view /="]
INPLACE_ALIAS_FUSED = ["ok: Dropout eval .relu_() returned", "ok: += then read",
                       "ok: += right-hand side of the same operator", "ok: loop of +=",
                       "ok: mask .float() .mul_()"]


@pytest.mark.parametrize("form", INPLACE_ALIAS_REFUSED)
def test_inplace_op_on_the_same_tensor_or_a_view_read_later_is_refused(form: str) -> None:
    """In eager torch these ops change h too (the op returned h itself, or a view of it);
    fused out of place, h's later reader would read the old values (silently wrong).
    Refused, like any in-place op on a value read again later."""
    m = _InplaceAlias(form)
    m.eval()
    if form.startswith("Dropout p=0"):
        m.drop0.train()
    with pytest.raises(TailError, match="in-place op on a view of a value that is read again "
                                        "later, or on that value itself") as ei:
        from_model(m)(torch.randn(4, 8))
    assert f"{THIS}:" in str(ei.value)


@pytest.mark.parametrize("form", INPLACE_ALIAS_FUSED)
def test_inplace_op_with_no_later_reader_still_fuses(form: str) -> None:
    torch.manual_seed(1)
    m = _InplaceAlias(form).eval()
    x = torch.randn(5, 8)
    ref64, _, ref32 = references(m, [x])
    with torch.no_grad():
        out = from_model(m)(x)
    assert_matches(out, ref64, ref32, what=form)


class _BN(nn.Module):
    def __init__(self, track: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.bn = nn.BatchNorm1d(6, track_running_stats=track)

    def forward(self, x):
        return self.bn(self.fc(x))


def _bn_state(form: str) -> _BN:
    """BatchNorm1d whose track_running_stats flag or buffers were changed after
    construction (torch's _BatchNorm.forward: in eval the buffers decide, not the flag)."""
    torch.manual_seed(4)
    m = _BN(track=not form.startswith("built untracked"))
    with torch.no_grad():
        if m.bn.running_mean is not None:
            m.bn.running_mean.uniform_(-1, 1)
            m.bn.running_var.uniform_(0.5, 3)
        m.bn.weight.uniform_(0.5, 2)
        m.bn.bias.uniform_(-1, 1)
    if form.startswith("built untracked"):
        m.bn.track_running_stats = True
    elif "flag False" in form:
        m.bn.track_running_stats = False
    if "buffers None" in form:
        m.bn.running_mean = None
        m.bn.running_var = None
        m.bn.num_batches_tracked = None
    if "momentum None" in form:
        m.bn.momentum = None
    return m.train() if form.endswith("train") else m.eval()


BN_STATES = ["flag False, eval", "flag False, train", "built untracked, flag True, eval",
             "built untracked, flag True, train", "buffers None, eval", "buffers None, train",
             "flag False, momentum None, eval", "momentum None, train"]


@pytest.mark.parametrize("form", BN_STATES)
def test_batchnorm_flag_and_buffers_read_as_torch_does_float64(form: str) -> None:
    """In eval mode torch normalises with the running buffers whenever they exist (the
    track_running_stats flag set False afterwards does not switch to batch statistics,
    which would be silently wrong), with batch statistics where they are None; in
    training mode it updates them where the flag is set and they exist (a module built
    untracked with the flag set True later: no AttributeError/TypeError)."""
    m = _bn_state(form)
    fused = from_model(m)
    for call in range(2):
        x = torch.randn(7, 8) * 2
        ref64, m64, ref32 = references(m, [x])
        with torch.no_grad():
            out = fused(x)
        assert_matches(out, ref64, ref32, what=f"{form}, call {call}")
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            got, want = getattr(m.bn, name), getattr(m64.bn, name)
            assert (got is None) == (want is None), name
            if got is not None:
                assert torch.allclose(got.double(), want.double(), atol=1e-5, rtol=1e-5), name
        # the float64 twin stands for what torch did to the buffers: carry it over
        if m.bn.running_mean is not None:
            with torch.no_grad():
                m.bn.running_mean.copy_(m64.bn.running_mean)
                m.bn.running_var.copy_(m64.bn.running_var)


@pytest.mark.parametrize("form,why", [
    ("running_var None, eval", "running_var must be defined in evaluation mode"),
    ("running_mean None, train", "running_mean and running_var must either both be None"),
])
def test_batchnorm_with_one_running_buffer_raises_like_torch(form: str, why: str) -> None:
    m = _bn_state("eval" if form.endswith("eval") else "train")
    setattr(m.bn, form.split()[0], None)
    x = torch.randn(5, 8)
    with pytest.raises((RuntimeError, ValueError), match=why):
        m(x)
    with pytest.raises(TailError, match=why):
        from_model(m)(x)


class _Affines(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 12)
        self.ln = nn.LayerNorm(12)
        self.gn = nn.GroupNorm(3, 12)
        self.bn = nn.BatchNorm1d(12)
        self.fc2 = nn.Linear(12, 12)

    def forward(self, x):
        return self.fc2(self.bn(self.gn(self.ln(self.fc(x)))))


AFFINE_SLOTS = ["fc.bias", "ln.weight", "ln.bias", "gn.weight", "gn.bias", "bn.weight",
                "bn.bias", "fc2.bias"]


@pytest.mark.parametrize("slot", AFFINE_SLOTS)
@pytest.mark.parametrize("when", ["before conversion", "after a first call"])
def test_none_weight_or_bias_computed_like_torch_float64(slot: str, when: str) -> None:
    """A norm's weight or bias, or a Linear's bias, set to None after construction is no
    scale / no shift in torch (no TypeError "must be real number, not NoneType"); set
    after a first call, the next call builds a program without it (not the old program,
    reading None)."""
    torch.manual_seed(5)
    m = _Affines().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.5)
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2)
    owner, attr = slot.split(".")
    x = torch.randn(6, 8)
    if when == "before conversion":
        setattr(getattr(m, owner), attr, None)
    fused = from_model(m)
    twin = fused_class(_Affines)().eval()
    twin.load_state_dict(m.state_dict(), strict=False)
    if when == "before conversion":
        setattr(getattr(twin, owner), attr, None)
    with torch.no_grad():
        first = [fused(x), twin(x)]
    if when == "after a first call":
        ref64, _, ref32 = references(m, [x])
        for out in first:
            assert_matches(out, ref64, ref32, what=f"{slot} before")
        setattr(getattr(m, owner), attr, None)
        setattr(getattr(twin, owner), attr, None)
    ref64, _, ref32 = references(m, [x])
    with torch.no_grad():
        for out in (fused(x), twin(x)):
            assert_matches(out, ref64, ref32, what=f"{slot} {when}")


FN_BATCH_NORM_RAISES = {
    "eval, no running stats": (lambda h: F.batch_norm(h, None, None, training=False),
                               "running_mean must be defined in evaluation mode"),
    "eval, no running_var": (lambda h: F.batch_norm(h, torch.zeros(6), None, training=False),
                             "running_var must be defined in evaluation mode"),
    "train, one running buffer": (lambda h: F.batch_norm(h, None, torch.ones(6), training=True),
                                  "running_mean and running_var must either both be None"),
}


@pytest.mark.parametrize("form", list(FN_BATCH_NORM_RAISES))
def test_functional_batch_norm_without_running_stats_in_eval_raises_like_torch(form: str) -> None:
    """F.batch_norm(training=False) without running statistics raises in torch (and
    here: not computed with batch statistics)."""
    fn, why = FN_BATCH_NORM_RAISES[form]
    m = _Wrap(fn)
    x = torch.randn(4, 8)
    with pytest.raises((RuntimeError, ValueError), match=why):
        m(x)
    with pytest.raises(TailError, match=why):
        from_model(m)(x)
    with pytest.raises(TailError, match=why):
        fused_linear(x, m.fc.weight.detach(), m.fc.bias.detach(), fn)


SIGNED_ZERO_FORMS = {
    "F.layer_norm": lambda h: F.layer_norm(h, (6,)),
    "1 / F.layer_norm": lambda h: 1.0 / F.layer_norm(h, (6,)),
    "LayerNorm weight -1, no bias": "ln",
    "layer_norm over a size-1 dim": lambda h: F.layer_norm(h[..., None], (1,))[..., 0],
    "avg_pool1d k1": lambda h: F.avg_pool1d(h, 1),
    "adaptive_avg_pool1d to the length": lambda h: F.adaptive_avg_pool1d(h, 6),
    "max_pool1d k1": lambda h: F.max_pool1d(h, 1),
    "sum over a size-1 dim": lambda h: h[..., None].sum(-1),
    "mean over a size-1 dim": lambda h: h[:, None].mean(1),
    "amax over a size-1 dim": lambda h: h[:, None].amax(1),
    "instance_norm": lambda h: F.instance_norm(h[:, None])[:, 0],
    "F.batch_norm train": lambda h: F.batch_norm(h, None, None, training=True),
    "BatchNorm1d affine=False train": nn.BatchNorm1d(6, affine=False),
    "BatchNorm1d affine=False eval": "bn eval",
    "BatchNorm1d bias None eval": "bn bias None",
}


class _SignedZero(nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        if fn == "ln":
            fn = nn.LayerNorm(6, bias=False)
            nn.init.constant_(fn.weight, -1.0)
        elif fn == "bn eval":
            fn = nn.BatchNorm1d(6, affine=False).eval()
        elif fn == "bn bias None":
            fn = nn.BatchNorm1d(6).eval()
            fn.bias = None
        self.fn = fn
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.bias.zero_()   # h = e exactly, its zeros' signs kept

    def forward(self, x, e):
        return self.fn(e - self.fc(x))


@pytest.mark.parametrize("form", list(SIGNED_ZERO_FORMS))
def test_signed_zeros_like_torch(form: str) -> None:
    """The sign of a zero result as torch gives it (a following reciprocal or atan2 turns
    it into -inf/+inf): LayerNorm/InstanceNorm/BatchNorm without a bias add 0 as torch's
    CPU and CUDA kernels do, and so do an average or a sum of one element (-0.0 gives
    +0.0, not -0.0)."""
    m = _SignedZero(SIGNED_ZERO_FORMS[form])
    x = torch.zeros(3, 4)
    e = torch.tensor([[-0.0, -0.0, -0.0, -0.0, -0.0, -0.0],
                      [-0.0, 0.0, -0.3, 0.3, -0.0, 0.0],
                      [1.0, -0.0, -2.0, 0.0, -0.7, 0.25]])
    ref64, _, ref32 = references(m, [x, e])
    with torch.no_grad():
        out = from_model(m)(x, e)
    assert_matches(out, ref64, ref32, what=form)
    assert torch.equal(torch.signbit(out), torch.signbit(ref32)), (out, ref32)


class _Celu(nn.Module):
    def __init__(self, alpha: float, module: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.alpha = alpha
        self.act = nn.CELU(alpha) if module else None
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.bias.zero_()   # h = e exactly

    def forward(self, x, e):
        h = e - self.fc(x)
        return self.act(h) if self.act is not None else F.celu(h, alpha=self.alpha)


@pytest.mark.parametrize("alpha", [1e-3, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("module", [False, True])
def test_celu_of_large_positive_values_does_not_overflow(alpha: float, module: bool) -> None:
    """celu(v) is v for v > 0; lowered as alpha * elu(v / alpha), v / alpha would overflow
    to inf for alpha < 1 (celu(3e38, alpha=0.5) must not give inf)."""
    m = _Celu(alpha, module)
    x = torch.zeros(2, 4)
    e = torch.tensor([[1e36, 5e35, 3e38, -1.0, -3e38, 2.5],
                      [math.nan, math.inf, -math.inf, -0.0, 1e-30, -1e-30]])
    ref64, _, ref32 = references(m, [x, e])
    with torch.no_grad():
        out = from_model(m)(x, e)
    assert_matches(out, ref64, ref32, what=f"alpha {alpha}")
    assert_matches(out, ref32.double(), ref32, what=f"alpha {alpha} vs float32 torch")


class _TwoIn(nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.p1 = nn.Parameter(torch.tensor([0.5]))
        self.p0 = nn.Parameter(torch.tensor(0.25))
        self.fn = fn

    def forward(self, x, y):
        return self.fn(self, self.fc(x), y)


RAISES_LIKE_TORCH = {
    "clamp(min=tensor, max=number)": (lambda s, h, y: torch.clamp(h, min=h.mean(1, keepdim=True),
                                                                  max=0.3),
                                      TypeError, "one bound a tensor and the other a number"),
    "clamp(number, tensor)": (lambda s, h, y: torch.clamp(h, 0.1, y), TypeError,
                              "one bound a tensor and the other a number"),
    ".clip(tensor, number)": (lambda s, h, y: h.clip(y, 0.3), TypeError,
                              "one bound a tensor and the other a number"),
    ".clamp(param, number)": (lambda s, h, y: h.clamp(s.p0, 0.3), TypeError,
                              "one bound a tensor and the other a number"),
    "masked_fill with a (B, 1) value": (lambda s, h, y: h.masked_fill(h > 0, h.mean(1, keepdim=True)),
                                        RuntimeError, "only supports a 0-dimensional value tensor"),
    "masked_fill with a (1,) parameter": (lambda s, h, y: h.masked_fill(h > 0, s.p1),
                                          RuntimeError, "only supports a 0-dimensional value tensor"),
    "cat with a (1, N) input": (lambda s, h, y: torch.cat([h, y], 1), RuntimeError,
                                "Sizes of tensors must match except in dimension 1"),
    "cat with a value of a (1, N) input": (lambda s, h, y: torch.cat([h * 2, y.exp() + 1], -1),
                                           RuntimeError,
                                           "Sizes of tensors must match except in dimension 1"),
}


@pytest.mark.parametrize("form", list(RAISES_LIKE_TORCH))
def test_computes_only_where_torch_computes(form: str) -> None:
    """Forms torch raises on (no clamp overload mixes a tensor and a number bound;
    masked_fill takes a 0-d value tensor only; cat does not broadcast a (1, N) input
    against the batch) raise, never computed (torch's exception type for cat, a
    TailError naming the op and the line for the others)."""
    fn, exc, why = RAISES_LIKE_TORCH[form]
    m = _TwoIn(fn)
    x, y = torch.randn(4, 8), torch.randn(1, 6)
    with pytest.raises(exc):
        m(x, y)
    with pytest.raises(TailError if exc is not RuntimeError or "cat" not in form
                       else RuntimeError, match=why):
        from_model(m)(x, y)
    if form.startswith("cat"):   # the same with a batch of y computes
        y4 = torch.randn(4, 6)
        ref64, _, ref32 = references(m, [x, y4])
        with torch.no_grad():
            assert_matches(from_model(m)(x, y4), ref64, ref32, what=form)
        w, b = m.fc.weight.detach(), m.fc.bias.detach()
        with pytest.raises(RuntimeError, match=why):
            fused_linear(x, w, b, lambda h, yy: fn(m, h, yy), y)


STILL_COMPUTED = {
    "clamp(tensor, tensor)": lambda s, h, y: torch.clamp(h, y - 1.0, h.mean(1, keepdim=True)),
    "clamp(min=tensor)": lambda s, h, y: torch.clamp(h, min=y),
    "masked_fill 0-d parameter": lambda s, h, y: h.masked_fill(h > 0, s.p0),
    "masked_fill number": lambda s, h, y: h.masked_fill(h > 0, -2.0),
    "(1, N) input broadcast, then cat": lambda s, h, y: torch.cat([h, h + y], 1),
}


@pytest.mark.parametrize("form", list(STILL_COMPUTED))
def test_forms_torch_computes_still_fuse(form: str) -> None:
    torch.manual_seed(2)
    m = _TwoIn(STILL_COMPUTED[form])
    x, y = torch.randn(4, 8), torch.randn(1, 6)
    ref64, _, ref32 = references(m, [x, y])
    with torch.no_grad():
        assert_matches(from_model(m)(x, y), ref64, ref32, what=form)


INT_RESULTS = ["(h > 0) * 3", "((h > 0) * 3).sum(1)", "torch.where(h > 0, 1, 0)", "(h > 0) + 1",
               "torch.maximum((h > 0) * 3, (h < 1) * 2)", "((h > 0) * 3).unsqueeze(1)",
               "((h > 0) * 3).abs()", "-((h > 0) * 3)", "((h > 0) * 3).clamp(0, 2)",
               "((h > 0) * 3).masked_fill(h > 1, 7)", "((h > 0) * 3).amax(-1)",
               "(h > 0).unsqueeze(1)"]
INT_RAISES = {"((h > 0) * 3 + 1) ** -1": "negative integer power",
              "((h > 0) * 3).mean(1)": "mean of an integer tensor",
              "((h > 0) * 3).softmax(1)": "an integer tensor operand",
              "((h > 0) * 3).var(1)": "var of an integer tensor",
              "F.gelu((h > 0) * 3)": "an integer tensor operand"}
MASK_FLOAT_USES = ["(h > 0) * h", "(h > 0).float() * 3", "h.masked_fill(h > 0, 2)",
                   "torch.where(h > 0, h, 0)", "torch.where(h > 0, 1.0, 0)", "(h > 0) * 3.0",
                   "((h > 0) * 3).float()", "((h > 0) * 3) * h", "((h > 0) * 3) / 2",
                   "((h > 0) * 3).sum(1).float()", "((h > 0) * 3) ** 0.5",
                   "((h > 0) * 3).to(torch.float32)", "((h > 0) * 3 + 1).exp()",
                   "torch.where(h > 0, 1, h)", "((h > 0) * 3).clamp(0.0, 2.5)",
                   "h * ((h > 0) * 3).amax(1, keepdim=True)", "((h > 0) * 3).logsumexp(1)",
                   "torch.maximum((h > 0) * 3, h)", "(h > 0).unsqueeze(1).float() * h[:, None]",
                   "((h > 0) * 2 - 1) * h"]


def _tail_of(src: str) -> Any:
    return eval("lambda h: " + src)   # noqa: S307 - test forms


@pytest.mark.parametrize("form", INT_RESULTS)
def test_integer_or_boolean_result_is_refused(form: str) -> None:
    """torch gives int64 (or bool) here; cupyfuse refuses rather than return float32 values
    (the README says such results are refused)."""
    fn = _tail_of(form)
    m = _Wrap(fn)
    x = torch.randn(3, 8)
    assert m(x).dtype in (torch.int64, torch.bool)
    with pytest.raises(TailError, match="an integer result|a boolean result"):
        from_model(m)(x)
    with pytest.raises(TailError, match="an integer result|a boolean result"):
        fused_linear(x, m.fc.weight.detach(), m.fc.bias.detach(), fn)


@pytest.mark.parametrize("form", list(INT_RAISES))
def test_integer_ops_torch_raises_on_are_refused(form: str) -> None:
    fn = _tail_of(form)
    m = _Wrap(fn)
    x = torch.randn(3, 8)
    with pytest.raises((RuntimeError, NotImplementedError)):
        m(x)
    with pytest.raises(TailError, match=INT_RAISES[form]):
        from_model(m)(x)


@pytest.mark.parametrize("form", MASK_FLOAT_USES)
def test_float_uses_of_masks_and_integer_tensors_still_fuse(form: str) -> None:
    torch.manual_seed(6)
    m = _Wrap(_tail_of(form))
    x = torch.randn(5, 8)
    ref64, _, ref32 = references(m, [x])
    assert ref32.dtype == torch.float32
    with torch.no_grad():
        assert_matches(from_model(m)(x), ref64, ref32, what=form)
