"""CPU tests of certified row maxima (cupyfuse/ir/certify.py, cupyfuse/backend/certified.py,
kernels_cu/tail_certify.cuh).

The certification is only as sound as its parts, each checked here without a GPU:

* every range rule of the op table (:func:`cupyfuse.ops.registry.range_rules`) names an
  operand the op has, with sorted finite turning points;
* each rule is true: for drawn intervals, other operands and attributes, the op's values
  on a dense float64 grid of the interval lie within the min/max of its values at the
  endpoints and the rule's turning points inside (NaN where the rule says "unknown");
* the numerical turning points (GELU, SiLU, Mish, hardswish minima) are where the
  functions turn;
* :func:`certify.find` accepts the chains it should (KernelBench 98's pool -> gelu -> * 2
  -> max, min, per-feature parameters) and refuses the others (a second use, sin, pow,
  a sum, softplus with beta <= 0);
* :func:`certified.source` compiles with nvcc for sm_90a without spills, over chains that
  between them use every (op, position) of RULES (skipped without nvcc);
* :func:`certified.weight_bounds` covers the tf32 rounding of every weight (truncation and
  round-to-nearest) and rounds its norms up; :func:`certified.gamma`, :func:`certified.smem`.
"""
from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cupyfuse import config
import cupyfuse
from cupyfuse.ir import certify, rewrite
from cupyfuse.backend import runtime
from cupyfuse.ops import registry
from cupyfuse.ops.ranges import Rule
from cupyfuse.ops.registry import MAPS
from helpers import program_of
from cupyfuse.backend import certified
from helpers import examples


def _settings(n: int) -> settings:
    return settings(max_examples=examples(n), deadline=None, derandomize=True, database=None)


# ---------------------------------------------------------------------------------
# A. the op table's range rules are well formed
# ---------------------------------------------------------------------------------
RULES = registry.range_rules()


def test_range_rules_are_well_formed() -> None:
    assert set(registry.unbounded()) == {op for op in MAPS if not MAPS[op].ranges}
    for (op, pos), rule in RULES.items():
        assert op in MAPS, f"a rule names {op!r}, not a vocabulary op"
        assert 0 <= pos < MAPS[op].arity, f"rule ({op!r}, {pos}): {op} has {MAPS[op].arity} operands"
        assert isinstance(rule, Rule)
        assert all(math.isfinite(t) for t in rule.turns), (op, pos, rule.turns)
        assert list(rule.turns) == sorted(set(rule.turns)), (op, pos, rule.turns)
        if rule.nonzero:
            assert rule.finite, f"rule ({op!r}, {pos}): nonzero without finite"


# ---------------------------------------------------------------------------------
# B. every rule bounds its op's range over an interval
# ---------------------------------------------------------------------------------
_GRID = 2001
_BIG = 3.0e38


def _attr_strategy(op: str) -> st.SearchStrategy:
    if op in ("leaky_relu", "elu"):
        return st.tuples(st.floats(-2.0, 2.0))
    if op == "softplus":
        return st.tuples(st.floats(0.1, 3.0, exclude_min=True), st.floats(1.0, 20.0))
    if op == "clamp":
        bound = st.one_of(st.floats(-8.0, 8.0), st.sampled_from([-math.inf, math.inf, 0.0]))
        return st.tuples(bound, bound)   # min > max too (torch: every value becomes max)
    if op == "hardtanh":   # (min_val > max_val is refused, as torch raises)
        bound = st.one_of(st.floats(-8.0, 8.0), st.sampled_from([0.0, -1.0, 1.0]))
        return st.tuples(bound, bound).map(lambda t: tuple(sorted(t)))
    assert not MAPS[op].attrs, f"{op}: attributes {MAPS[op].attrs} this test does not draw"
    return st.just(())


def _specials(op: str, rule: Rule, attrs: tuple, other: float | None) -> list[float]:
    """Points where an interval is most likely to break a rule: the turns, 0, the
    kinks and switches of the op (softplus' linear branch, clamp's bounds, the
    hard* ops' corners) and the other operand."""
    pts = [0.0, *rule.turns, -3.0, 3.0, 6.0, -1.5]
    if op == "softplus":
        pts.append(attrs[1] / attrs[0])
    if op in ("clamp", "hardtanh"):
        pts += [a for a in attrs if math.isfinite(a)]
    if other is not None and math.isfinite(other):
        pts += [other, -other]
    return pts


@st.composite
def _interval(draw: st.DrawFn, specials: list[float]) -> tuple[float, float]:
    kind = draw(st.sampled_from(["wide", "narrow", "around", "endpoint", "point"]))
    if kind == "wide":
        a, b = draw(st.floats(-8.0, 8.0)), draw(st.floats(-8.0, 8.0))
        return min(a, b), max(a, b)
    if kind == "narrow":
        c = draw(st.one_of(st.floats(-8.0, 8.0), st.sampled_from(specials)))
        w = draw(st.sampled_from([1e-12, 1e-9, 1e-6, 1e-4, 1e-3, 1e-2]))
        return c - w * draw(st.floats(0.0, 1.0)), c + w * draw(st.floats(0.0, 1.0))
    p = draw(st.sampled_from(specials))
    if kind == "point":
        return p, p
    d1 = draw(st.one_of(st.floats(1e-9, 2.0), st.sampled_from([1e-6, 1e-3, 0.1, 1.0])))
    d2 = draw(st.one_of(st.floats(1e-9, 2.0), st.sampled_from([1e-6, 1e-3, 0.1, 1.0])))
    if kind == "around":
        return p - d1, p + d2
    return (p, p + d1) if draw(st.booleans()) else (p - d1, p)


_OTHER = st.one_of(st.sampled_from([0.0, -0.0]), st.sampled_from([1.0, -1.0, 0.5, -2.0, 3.0]),
                   st.floats(-8.0, 8.0), st.floats(-1e6, 1e6),
                   st.sampled_from([1e-30, -1e-30, 1e30, -1e30]))


def _eval(op: str, pos: int, v: torch.Tensor, other: float | None, attrs: tuple) -> torch.Tensor:
    """The op in float64 over the chain operand values ``v`` (the other operand fixed)."""
    fn = MAPS[op].torch_fn
    if MAPS[op].arity == 1:
        return fn(v, *attrs)
    o = torch.full_like(v, other)
    return fn(*((v, o) if pos == 0 else (o, v)), *attrs).to(torch.float64)


def _tol(x: float, op: str = "") -> float:
    """How far a true value may pass the claimed bound: the turning points' numerical
    error; for softplus, whose switch point is taken just left of the jump (2^-20 of it),
    2^-16 relative -- well inside the kernel's 2^-12 margin (tail_certify.cuh step 3)."""
    if not math.isfinite(x):
        return 0.0
    return (2.0 ** -16 if op == "softplus" else 1e-9) * abs(x) + 1e-12


@pytest.mark.parametrize("key", sorted(RULES), ids=lambda k: f"{k[0]}-{k[1]}")
@_settings(150)
@given(data=st.data())
def test_rule_bounds_the_range(key: tuple[str, int], data: st.DataObject) -> None:
    op, pos = key
    rule = RULES[key]
    attrs = data.draw(_attr_strategy(op), label="attrs")
    # a rule without ``finite`` must hold for infinite and NaN other operands too
    others = _OTHER if rule.finite else st.one_of(
        _OTHER, st.sampled_from([math.inf, -math.inf, math.nan]))
    other = data.draw(others, label="other") if MAPS[op].arity == 2 else None
    lo, hi = data.draw(_interval(_specials(op, rule, attrs, other)), label="interval")
    assume(lo <= hi)
    if rule.pole and lo <= 0.0 <= hi:
        return   # the kernel: range unknown, a candidate
    if rule.nonzero and other == 0.0:
        return
    if rule.finite:
        assert other is not None and math.isfinite(other)   # what _OTHER draws

    pts = [lo, hi] + [t for t in rule.points(attrs) if lo < t < hi]
    claimed = _eval(op, pos, torch.tensor(pts, dtype=torch.float64), other, attrs)
    # the true range: a dense grid, the endpoints, and the specials inside with their
    # float64 neighbours (a jump or corner is sampled at its edge)
    sp = [s for s in _specials(op, rule, attrs, other) if lo <= s <= hi]
    near = [x for s in sp for x in (math.nextafter(s, -math.inf), s, math.nextafter(s, math.inf))
            if lo <= x <= hi]
    grid = torch.cat([torch.linspace(lo, hi, _GRID, dtype=torch.float64),
                      torch.tensor([lo, hi, *near], dtype=torch.float64)]).clamp(lo, hi)
    true = _eval(op, pos, grid, other, attrs)
    where = (f"{op}[pos {pos}] over [{lo!r}, {hi!r}], other={other!r}, attrs={attrs!r}, "
             f"turns inside={pts[2:]}")
    if torch.isnan(true).any():
        # the kernel takes a NaN at an endpoint (or a turn) as "range unknown"
        assert torch.isnan(claimed).any(), (
            f"{where}: f is NaN at {grid[torch.isnan(true)][:3].tolist()} inside the interval, "
            f"but not at the endpoints/turns ({claimed.tolist()})")
        return
    assert not torch.isnan(claimed).any(), f"{where}: NaN bound {claimed.tolist()}"
    c_lo, c_hi = float(claimed.min()), float(claimed.max())
    t_lo, t_hi = float(true.min()), float(true.max())
    i_lo, i_hi = int(true.argmin()), int(true.argmax())
    assert t_hi <= c_hi + _tol(c_hi, op), (
        f"{where}: f({float(grid[i_hi])!r}) = {t_hi!r} above the claimed max {c_hi!r} "
        f"(endpoint/turn values {claimed.tolist()})")
    assert t_lo >= c_lo - _tol(c_lo, op), (
        f"{where}: f({float(grid[i_lo])!r}) = {t_lo!r} below the claimed min {c_lo!r} "
        f"(endpoint/turn values {claimed.tolist()})")


def test_softplus_rule_at_its_linear_switch() -> None:
    """A fixed instance of the property above where softplus' switch to the linear branch
    (v * beta > threshold) lies inside the interval: torch (and cf_softplus) drop there by
    log1p(exp(-threshold)) / beta, so softplus is not monotone for small thresholds."""
    rule = RULES[("softplus", 0)]
    beta, threshold = 1.0, 1.0
    lo, hi = 0.9, 1.1
    pts = [lo, hi] + [t for t in rule.points((beta, threshold)) if lo < t < hi]
    claimed = _eval("softplus", 0, torch.tensor(pts, dtype=torch.float64), None, (beta, threshold))
    grid = torch.linspace(lo, hi, _GRID, dtype=torch.float64)
    true = _eval("softplus", 0, grid, None, (beta, threshold))
    assert float(true.max()) <= float(claimed.max()) + _tol(float(claimed.max()), "softplus"), (
        f"softplus(beta={beta}, threshold={threshold}) over [{lo}, {hi}]: max "
        f"{float(true.max())!r} at {float(grid[true.argmax()])!r}, the rule claims "
        f"<= {float(claimed.max())!r}")


# ---------------------------------------------------------------------------------
# C. the numerical turning points are minima
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["gelu", "gelu_tanh", "silu", "mish", "hardswish"])
def test_turning_point_is_the_minimum(op: str) -> None:
    (t,) = RULES[(op, 0)].turns
    fn = MAPS[op].torch_fn

    def f(v: float) -> float:
        return float(fn(torch.tensor(v, dtype=torch.float64)))

    def deriv(v: float, h: float = 1e-6) -> float:
        return (f(v + h) - f(v - h)) / (2 * h)

    for d in (1e-3, 1e-2, 0.1):
        assert deriv(t - d) < 0.0 < deriv(t + d), (op, t, d, deriv(t - d), deriv(t + d))
    assert f(t) < f(t - 1e-3) and f(t) < f(t + 1e-3), (op, t)
    # the only turn: decreasing on [-8, t], increasing on [t, 8] (float64 noise aside)
    grid = torch.linspace(-8.0, 8.0, 16001, dtype=torch.float64)
    vals = fn(grid)
    left, right = vals[grid <= t], vals[grid >= t]
    assert float(left.diff().max()) <= 1e-15, (op, "not decreasing left of the turn")
    assert float(right.diff().min()) >= -1e-15, (op, "not increasing right of the turn")
    assert f(t) <= float(vals.min()) + 1e-15, (op, t, f(t), float(vals.min()))


# ---------------------------------------------------------------------------------
# D. certify.find on captured programs
# ---------------------------------------------------------------------------------
K_IN, N_OUT, POOL = 32, 64, 4


class PoolChain(nn.Module):
    """Linear -> AvgPool1d(POOL) -> ``fn(h, self)`` (KernelBench 98's shape); ``fn``
    returns the model's result. Per-feature parameters p (positive), q, a PReLU."""

    def __init__(self, fn, N: int = N_OUT, K: int = K_IN) -> None:
        super().__init__()
        self.lin = nn.Linear(K, N)
        self.pool = nn.AvgPool1d(POOL)
        self.p = nn.Parameter(torch.rand(N // POOL) + 0.5)
        self.q = nn.Parameter(torch.randn(N // POOL))
        self.prelu = nn.PReLU(N // POOL)
        self.fn = fn

    def forward(self, x: torch.Tensor):
        self.x = x   # for tails that read the input too
        h = self.pool(self.lin(x).unsqueeze(1)).squeeze(1)
        return self.fn(h, self)


def _program(fn, seed: int = 0):
    torch.manual_seed(seed)
    model = PoolChain(fn)
    prog = rewrite.rewrite(program_of(cupyfuse.from_model(model), torch.randn(4, K_IN)))
    gemms = [i for i, n in enumerate(prog.nodes) if n.kind == "gemm"]
    assert len(gemms) == 1, prog
    return prog, gemms[0]


def _param(prog, name: str) -> int:
    hits = [i for i, n in enumerate(prog.nodes)
            if n.kind == "param" and prog.sources[n.attrs[0]] == name]
    assert len(hits) == 1, (name, hits)
    return hits[0]


def _steps(prog, chain) -> list[tuple[str, int]]:
    return [(prog.nodes[u].op, pos) for u, pos in chain.steps]


def _kb98(h, s):
    return (F.gelu(h) * 2.0).max(dim=1).values


def test_find_kernelbench_98() -> None:
    prog, g = _program(_kb98)
    ga = prog.nodes[g].attrs
    assert len(ga) > 2 and ga[2][0] == "avgpool", ("rewrite did not fold the pool", ga)
    chain = certify.find(prog, g)
    assert chain is not None
    assert chain.gemm == g and chain.is_min is False
    assert _steps(prog, chain) == [("gelu", 0), ("mul", 0)]
    assert prog.nodes[chain.red].kind == "rred" and prog.nodes[chain.red].op == "max"
    name, src, params = certified.source(prog, chain)
    assert params == [] and name in src and "cf_gelu(" in src
    # the GELU minimum is written as a float32 literal
    assert repr(float(np.float32(RULES[("gelu", 0)].turns[0]))) + "f" in src


def test_find_min_reduction() -> None:
    prog, g = _program(lambda h, s: (F.gelu(h) * 2.0).min(dim=1).values)
    chain = certify.find(prog, g)
    assert chain is not None and chain.is_min is True
    assert _steps(prog, chain) == [("gelu", 0), ("mul", 0)]
    assert "lo = -hi; hi = -t;" in certified.source(prog, chain)[1]


def test_find_with_a_parameter_operand() -> None:
    prog, g = _program(lambda h, s: (F.gelu(h) + s.p).max(dim=1).values)
    chain = certify.find(prog, g)
    assert chain is not None and _steps(prog, chain) == [("gelu", 0), ("add", 0)]
    _, src, params = certified.source(prog, chain)
    p = _param(prog, "p")
    assert params == [p], (params, p)
    assert f"const float* __restrict__ p{p}, long long p{p}_sf" in src


def test_find_with_two_parameters_in_both_positions() -> None:
    prog, g = _program(lambda h, s: (s.q / (torch.reciprocal(h) * s.p) - s.q).amax(dim=1))
    chain = certify.find(prog, g)
    assert chain is not None
    assert _steps(prog, chain) == [("reciprocal", 0), ("mul", 0), ("div", 1), ("sub", 0)]
    _, src, params = certified.source(prog, chain)
    assert sorted(params) == sorted([_param(prog, "p"), _param(prog, "q")])
    assert src.count("!(lo > 0.0f || hi < 0.0f)") == 2   # reciprocal's and q / v's poles


@pytest.mark.parametrize("case", [
    "linear_out_returned", "pooled_returned", "sin", "pow3", "pow25", "h_times_h", "sum",
    "softplus_negative_beta", "softplus_zero_beta", "second_use_later", "batch_operand",
    "grouped_max"])
def test_find_refuses(case: str) -> None:
    def fn(h, s):
        if case == "pooled_returned":
            return F.gelu(h).max(1).values, h
        if case == "sin":
            return torch.sin(h).max(1).values
        if case == "pow3":
            return torch.pow(h, 3.0).max(1).values
        if case == "pow25":
            return (h ** 2.5).max(1).values
        if case == "h_times_h":
            return (h * h).max(1).values
        if case == "sum":
            return F.gelu(h).sum(1)
        if case == "softplus_negative_beta":
            return (F.softplus(h, beta=-1.0) * 2.0).max(1).values
        if case == "softplus_zero_beta":
            return F.softplus(h, beta=0.0).max(1).values
        if case == "second_use_later":
            g = F.gelu(h)
            return (g * 2.0).max(1).values + g.sum(1)
        if case == "batch_operand":   # an operand that varies by row: not batch-free
            return (h + s.x.sum(1, keepdim=True)).max(1).values
        if case == "grouped_max":   # a max over groups of the features, not the row
            return F.gelu(h).view(-1, 4, N_OUT // POOL // 4).max(-1).values
        raise AssertionError(case)

    if case == "linear_out_returned":
        class Both(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(K_IN, N_OUT)
                self.pool = nn.AvgPool1d(POOL)

            def forward(self, x):
                y = self.lin(x)
                h = self.pool(y.unsqueeze(1)).squeeze(1)
                return F.gelu(h).max(1).values, y

        torch.manual_seed(0)
        prog = rewrite.rewrite(program_of(cupyfuse.from_model(Both()), torch.randn(4, K_IN)))
        gemms = [i for i, n in enumerate(prog.nodes) if n.kind == "gemm"]
    else:
        prog, g = _program(fn)
        gemms = [g]
    assert gemms
    for g in gemms:
        assert certify.find(prog, g) is None, (case, prog.nodes)


# ---------------------------------------------------------------------------------
# E. generated sources compile without spills
# ---------------------------------------------------------------------------------
NVCC = shutil.which("nvcc")
_PROPS_RE = re.compile(r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, "
                       r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_ENTRY_RE = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")


def _chain(*fns, red: str = "max"):
    def fn(h, s):
        for f in fns:
            h = f(h, s)
        return h.max(dim=1).values if red == "max" else h.min(dim=1).values
    return fn


#: (case, model tail): between them every (op, position) of RULES
COMPILE_CASES = {
    "kb98": _kb98,
    "min": _chain(lambda h, s: F.silu(h), lambda h, s: h - 1.0, lambda h, s: -h, red="min"),
    "param": _chain(lambda h, s: F.gelu(h), lambda h, s: h + s.p, lambda h, s: h * s.q,
                    lambda h, s: s.q * h, lambda h, s: s.p + h),
    "pole": _chain(lambda h, s: torch.reciprocal(h), lambda h, s: h / s.p,
                   lambda h, s: s.q / h),
    "attrs": _chain(lambda h, s: F.leaky_relu(h, -0.3), lambda h, s: F.elu(h, 0.7),
                    lambda h, s: F.softplus(h, 2.0, 5.0), lambda h, s: torch.clamp(h, -0.5, 0.8),
                    lambda h, s: F.hardtanh(h, -0.7, 0.9), lambda h, s: h.detach(),
                    lambda h, s: s.prelu(h)),
    "long": _chain(lambda h, s: F.gelu(h, approximate="tanh"), lambda h, s: F.mish(h),
                   lambda h, s: F.hardswish(h), lambda h, s: torch.tanh(h),
                   lambda h, s: torch.sigmoid(h), lambda h, s: h.abs(),
                   lambda h, s: torch.square(h), lambda h, s: torch.cosh(h)),
    "transcendental": _chain(lambda h, s: torch.exp(h), lambda h, s: torch.log(h),
                             lambda h, s: torch.log1p(h), lambda h, s: torch.sqrt(h),
                             lambda h, s: torch.rsqrt(h), lambda h, s: F.hardsigmoid(h),
                             lambda h, s: F.relu6(h), lambda h, s: torch.erf(h),
                             lambda h, s: torch.expm1(h), red="min"),
    "monotone": _chain(lambda h, s: torch.log2(h), lambda h, s: torch.atan(h),
                       lambda h, s: torch.sinh(h), lambda h, s: torch.asinh(h),
                       lambda h, s: torch.relu(h), lambda h, s: 0.25 - h,
                       lambda h, s: torch.maximum(h, s.q), lambda h, s: torch.maximum(s.q, h),
                       lambda h, s: torch.minimum(h, s.q), lambda h, s: torch.minimum(s.q, h)),
    "binary": _chain(lambda h, s: torch.logaddexp(h, s.q), lambda h, s: torch.logaddexp(s.q, h),
                     lambda h, s: torch.hypot(h, s.q), lambda h, s: torch.hypot(s.q, h),
                     lambda h, s: (h > s.q).float(), lambda h, s: (s.q > h).float(),
                     lambda h, s: (h < s.q).float(), lambda h, s: (s.q < h).float()),
    "compare": _chain(lambda h, s: F.silu(h), lambda h, s: (h >= s.q).float(),
                      lambda h, s: (s.q >= h).float(), lambda h, s: (h <= 0.5).float(),
                      lambda h, s: (s.q <= h).float(), red="min"),
}


@pytest.fixture(scope="module")
def certify_sources() -> dict[str, tuple]:
    """case -> (program, chain, kernel name, source, params)."""
    out = {}
    for case, fn in COMPILE_CASES.items():
        prog, g = _program(fn)
        chain = certify.find(prog, g)
        assert chain is not None, f"{case}: find refused the chain"
        out[case] = (prog, chain, *certified.source(prog, chain))
    return out


def test_compile_cases_cover_every_rule(certify_sources) -> None:
    seen = {k for prog, chain, *_ in certify_sources.values() for k in _steps(prog, chain)}
    assert seen == set(RULES), sorted(set(RULES) - seen)
    assert any(chain.is_min for _, chain, *_ in certify_sources.values())
    names = [v[2] for v in certify_sources.values()]
    assert len(set(names)) == len(names), "two chains share a kernel name"


@pytest.fixture(scope="module")
def compiled(certify_sources, tmp_path_factory) -> dict:
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    tmp = tmp_path_factory.mktemp("certify_cu")
    cases = sorted(certify_sources)
    files = 2   # two cores
    procs = []
    for i in range(files):
        chunk = cases[i::files]
        text = "\n".join(certify_sources[c][3] for c in chunk)   # headers expanded once
        src = tmp / f"certify_{i}.cu"
        src.write_text(runtime.expand_text(text))
        cmd = [NVCC, "-cubin", "-o", str(tmp / f"certify_{i}.cubin"), "-std=c++17",
               "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", str(src)]
        procs.append((src.name, subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, text=True)))
    logs, rcs = {}, {}
    for name, p in procs:
        logs[name], _ = p.communicate(timeout=600)
        rcs[name] = p.returncode
    text = "\n".join(logs.values())
    props = {m.group(1): tuple(int(m.group(i)) for i in (2, 3, 4))
             for m in _PROPS_RE.finditer(text)}
    entries = {m.group(1) for m in _ENTRY_RE.finditer(text)}
    return {"logs": logs, "rc": rcs, "props": props, "entries": entries}


def test_nvcc_succeeds(compiled) -> None:
    for name, rc in compiled["rc"].items():
        assert rc == 0, f"nvcc failed on {name}:\n{compiled['logs'][name][-6000:]}"


@pytest.mark.parametrize("case", sorted(COMPILE_CASES))
def test_certify_kernel_compiles_without_spills(certify_sources, compiled, case: str) -> None:
    name = certify_sources[case][2]
    log = "\n".join(compiled["logs"].values())[-6000:]
    assert name in compiled["entries"], f"{case}: ptxas did not compile {name}:\n{log}"
    assert name in compiled["props"], f"{case}: no properties for {name}:\n{log}"
    stack, stores, loads = compiled["props"][name]
    assert stores == 0, (f"{case}: {name} spills {stores} bytes (loads {loads}, stack frame "
                         f"{stack} bytes)")


# ---------------------------------------------------------------------------------
# F. weight_bounds
# ---------------------------------------------------------------------------------
def _ulp13(v: np.ndarray) -> np.ndarray:
    """The tf32 spacing at each float32 v, from its bits, in float64."""
    bits = v.astype(np.float32).view(np.uint32)
    e = ((bits >> 23) & 0xFF).astype(np.int64)
    return np.where(e == 0, np.abs(v.astype(np.float64)), np.ldexp(1.0, e - 127 - 10))


def _tf32_trunc(v: np.ndarray) -> np.ndarray:
    bits = v.astype(np.float32).view(np.uint32)
    return (bits & np.uint32(0xFFFFE000)).view(np.float32)


def _tf32_rne(v: np.ndarray) -> np.ndarray:
    bits = v.astype(np.float32).view(np.uint32)
    sign, mag = bits & np.uint32(0x80000000), bits & np.uint32(0x7FFFFFFF)
    mag = (mag + np.uint32(0xFFF) + ((mag >> 13) & np.uint32(1))) & np.uint32(0x7FFFE000)
    return (sign | mag).view(np.float32)


_SPECIAL_VALUES = [0.0, -0.0, 1e-40, -1e-40, 1e-45, 2.0 ** -149, 2.0 ** -127, 2.0 ** -126,
                   -(2.0 ** -126), 1.0, -1.0, 2.0, 0.5, 1.0 + 2.0 ** -10, 1.0 + 2.0 ** -11,
                   2.0 - 2.0 ** -23, 2.0 ** 20 - 1.0, 2.0 ** 100, -(2.0 ** -100)]


@st.composite
def _weight_value(draw: st.DrawFn, lo_exp: int, hi_exp: int) -> float:
    kind = draw(st.sampled_from(["normal", "special", "pow2", "near_pow2", "subnormal"]))
    sign = draw(st.sampled_from([1.0, -1.0]))
    if kind == "normal":
        e = draw(st.integers(max(lo_exp, -126), hi_exp))
        # (the mantissa at most float32's largest: at e = 127 a float64 mantissa nearer 2
        # would round to inf as a float32)
        return sign * math.ldexp(draw(st.floats(1.0, 2.0 - 2.0 ** -23)), e)
    if kind == "special":
        return draw(st.sampled_from(_SPECIAL_VALUES))
    e = draw(st.integers(max(lo_exp, -126), hi_exp))
    if kind == "pow2":
        return sign * math.ldexp(1.0, e)
    if kind == "near_pow2":   # a few float32 ulps either side of 2^e
        k = draw(st.integers(-4097, 4097))
        v = np.float32(math.ldexp(1.0, e)).view(np.uint32).astype(np.int64) + k
        return sign * float(np.array([v], dtype=np.uint32).view(np.float32)[0])
    return sign * float(np.array([draw(st.integers(1, 0x7FFFFF))], dtype=np.uint32)
                        .view(np.float32)[0])


def _matrix(lo_exp: int = -149, hi_exp: int = 120) -> st.SearchStrategy:
    return st.integers(1, 4).flatmap(lambda rows: st.integers(1, 9).flatmap(
        lambda cols: st.lists(st.lists(_weight_value(lo_exp, hi_exp), min_size=cols,
                                       max_size=cols), min_size=rows, max_size=rows)))


@_settings(200)
@given(m=_matrix(hi_exp=127))
def test_ulp13_covers_tf32_rounding(m) -> None:
    """The definition the bound rests on: truncating to tf32, or rounding to nearest
    even, moves a finite float32 v by at most ulp13(v) (a flush to zero: |v|)."""
    v = np.array(m, dtype=np.float32)
    u = _ulp13(v)
    v64 = v.astype(np.float64)
    for how, r in (("truncation", _tf32_trunc(v)), ("round-to-nearest", _tf32_rne(v))):
        r64 = r.astype(np.float64)
        ok = np.isfinite(r64)   # RNE of |v| within half a tf32 ulp of FLT_MAX overflows
        if how == "truncation":
            assert ok.all()
        err = np.abs(r64 - v64)
        bad = ok & (err > u)
        assert not bad.any(), (how, v[bad], r[bad], u[bad])
        normal = np.abs(v64) >= 2.0 ** -126
        assert (u[normal] <= np.abs(v64[normal]) * 2.0 ** -10).all()
    assert (u[(np.abs(v64) >= 2.0 ** -126)] > 0).all()


def _check_norms(m) -> None:
    w = torch.tensor(m, dtype=torch.float32)
    wn, wu = certified.weight_bounds(w)
    assert wn.dtype == torch.float32 and wu.dtype == torch.float32
    assert wn.shape == wu.shape == (w.shape[0],)
    v = w.numpy()
    ref_n = np.sqrt((v.astype(np.float64) ** 2).sum(axis=1))
    ref_u = np.sqrt((_ulp13(v) ** 2).sum(axis=1))
    for what, got, ref in (("||W_n||", wn.double().numpy(), ref_n),
                           ("||ulp13(W_n)||", wu.double().numpy(), ref_u)):
        low = got < ref
        assert not low.any(), (f"{what} rounded down: got {got[low].tolist()} < float64 "
                               f"{ref[low].tolist()} for rows {np.asarray(m)[low].tolist()}")
        over = ref * (1.0 + 1e-5) > 3.4028234663852886e38   # may round up to inf
        far = ~over & (got > ref * (1.0 + 1e-5) + 2.0 ** -149)
        assert not far.any(), (what, got[far].tolist(), ref[far].tolist())


@_settings(200)
@given(m=_matrix(lo_exp=-100))
def test_weight_bounds_cover_the_norms(m) -> None:
    """Rows with a normal-range value (their norms are normal floats): both norms are
    rounded up, and tight (1e-5)."""
    assume(all(any(abs(x) >= 2.0 ** -100 for x in row) for row in m))
    _check_norms(m)


@_settings(150)
@given(m=_matrix(lo_exp=-149, hi_exp=-110))
def test_weight_bounds_round_up_tiny_rows(m) -> None:
    """Rows of tiny values (subnormals, and normals whose tf32 spacing is subnormal): the
    norms must still be rounded up, not to nearest, where they fall below 2^-126."""
    _check_norms(m)


def test_weight_bounds_subnormal_row_example() -> None:
    """Two entries of one subnormal unit: ||W_n|| = sqrt(2) 2^-149, which float32 cannot
    hold; rounded up it is 2 * 2^-149 (rounded to nearest, 2^-149: too small)."""
    _check_norms([[2.0 ** -149, 2.0 ** -149], [1.0, 1e-40]])


# ---------------------------------------------------------------------------------
# G. gamma and smem
# ---------------------------------------------------------------------------------
@_settings(300)
@given(k1=st.integers(1, 1 << 20), k2=st.integers(1, 1 << 20), splits=st.integers(1, 16))
def test_gamma_positive_and_growing_with_k(k1: int, k2: int, splits: int) -> None:
    a, b = sorted((k1, k2))
    ga, gb = certified.gamma(a, splits), certified.gamma(b, splits)
    assert ga > 0.0 and gb > 0.0
    assert ga <= gb, (a, b, splits, ga, gb)
    # at least 10 float32 units (2^-23) per k8 step of a split's chain
    assert gb >= 10 * 2.0 ** -23 * (b / splits) / 8, (b, splits, gb)


def test_gamma_steps() -> None:
    for s in (1, 2, 4, 8, 16):
        assert certified.gamma(64, s) < certified.gamma(4096, s) < certified.gamma(65536, s)
    g = [certified.gamma(8192, s) for s in range(1, config.CERTIFY_MAX_SPLITS + 1)]
    assert all(b <= a for a, b in zip(g, g[1:])), g
    assert certified.gamma(8192, 8) < certified.gamma(8192, 1)
    assert certified.gamma(8192, 16) < certified.gamma(8192, 2)


def test_smem_staging_threshold() -> None:
    """x's row is staged up to XS_MAX_BYTES (flag 1), the row's TF32 values up to
    ZS_MAX_BYTES (flag 2)."""
    assert certified.XS_MAX_BYTES == 40 * 1024 and certified.ZS_MAX_BYTES == 16 * 1024
    n8, f8 = certified.smem(8192, 1000)
    n16, f16 = certified.smem(16384, 1000)
    assert f8 == 3 and f16 == 2
    assert n8 >= 4 * 8192 + 4 * 1000 + 4 * ((1000 + 31) // 32)
    assert n16 >= 4 * 1000 + 4 * ((1000 + 31) // 32)
    last = certified.XS_MAX_BYTES // 4
    assert certified.smem(last, 64)[1] & 1 and not certified.smem(last + 1, 64)[1] & 1
    zlast = certified.ZS_MAX_BYTES // 4
    assert certified.smem(64, zlast)[1] & 2 and not certified.smem(64, zlast + 1)[1] & 2
    # flag 4 (h not written): only where the kernel writes the row reduction and keeps
    # the TF32 values in shared memory (its comparisons read them there); the bytes alike
    assert certified.smem(8192, 1000, True) == (n8, 7)
    assert certified.smem(8192, 1000, False) == (n8, 3)
    assert certified.smem(64, zlast + 1, True)[1] & 4 == 0


@_settings(300)
@given(K=st.integers(1, 1 << 16), N=st.integers(2, config.CERTIFY_MAX_WIDTH))
def test_smem_covers_the_mask_and_the_staged_row(K: int, N: int) -> None:
    """The bytes cover tail_certify.cuh's layout: x (K rounded up to 4 floats: 16-byte
    stores) where flag 1, zhat (N rounded up to 4) where flag 2, then the mask."""
    nbytes, flags = certified.smem(K, N)
    assert flags in (0, 1, 2, 3)
    words = (N + 31) // 32
    xf, zf = (K + 3) & ~3, (N + 3) & ~3
    assert nbytes == 4 * words + (4 * xf if flags & 1 else 0) + (4 * zf if flags & 2 else 0)
    assert bool(flags & 1) == (4 * xf <= certified.XS_MAX_BYTES)
    assert bool(flags & 2) == (4 * zf <= certified.ZS_MAX_BYTES)


class _Plain(nn.Module):
    """A plain Linear (no pooling) -> ``fn(h, self)``; per-feature parameter b."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.lin = nn.Linear(K_IN, N_OUT)
        self.b = nn.Parameter(torch.randn(N_OUT))
        self.fn = fn

    def forward(self, x: torch.Tensor):
        return self.fn(self.lin(x), self)


def _plain_program(fn):
    torch.manual_seed(0)
    prog = rewrite.rewrite(program_of(cupyfuse.from_model(_Plain(fn)), torch.randn(4, K_IN)))
    gemms = [i for i, n in enumerate(prog.nodes) if n.kind == "gemm"]
    assert len(gemms) == 1, prog
    return prog, gemms[0]


def test_find_plain_gemm_kernelbench_80() -> None:
    """KernelBench 80's tail, max(h + bias) then (max - mean of it) and GELU: the plain
    GEMM's chain is the Linear's bias add and the add of b (param operands), a max; what
    follows the max is free."""
    def kb80(h, m):
        v = (h + m.b).max(dim=1, keepdim=True).values
        return F.gelu(v - v.mean(dim=1, keepdim=True))

    prog, g = _plain_program(kb80)
    assert len(prog.nodes[g].attrs) <= 2, "a plain GEMM (not folded)"
    chain = certify.find(prog, g)
    assert chain is not None and chain.is_min is False
    assert _steps(prog, chain) == [("add", 0), ("add", 0)]
    assert certify.chain_of(prog, g) == chain and certify.chain_of(prog, g) is certify.chain_of(prog, g)
    _, src, params = certified.source(prog, chain)
    assert len(params) == 2 and all(f"p{i}[" in src for i in params)


@pytest.mark.parametrize("fn", [
    lambda h, m: (h.amax(dim=1), h.sum(dim=1)),            # a second use of h
    lambda h, m: (h * torch.sigmoid(h)).amax(dim=1),      # h read twice by the chain
    lambda h, m: torch.softmax(h, dim=1).amax(dim=1),     # a row statistic in the chain
    lambda h, m: (h + m.b).amax(dim=1) + h[:, 0],         # a feature slice of h
], ids=["sum_too", "swish_by_hand", "softmax", "slice"])
def test_find_plain_gemm_refuses(fn) -> None:
    prog, g = _plain_program(fn)
    assert certify.find(prog, g) is None


# ---------------------------------------------------------------------------------
# H. the rounding part of the error bound (tail_certify.cuh step 2) holds
# ---------------------------------------------------------------------------------
def _tf32(v: np.ndarray, mode: str) -> np.ndarray:
    """float32 values rounded to tf32 (10 explicit mantissa bits) by truncation (what the
    tensor cores do to fp32 operands) or to nearest, ties to even."""
    b = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    if mode == "nearest":
        b = b + 0xFFF + ((b >> 13) & 1)
    return (b & 0xFFFFE000).astype(np.uint32).view(np.float32)


def _ulp13(v: np.ndarray) -> np.ndarray:
    e = (v.astype(np.float32).view(np.uint32) >> 23) & 0xFF
    return np.where(e == 0, np.abs(v.astype(np.float64)),
                    np.ldexp(1.0, e.astype(np.int64) - 127 - 10))


def _draw(rng: np.random.Generator, shape: tuple, dist: str) -> np.ndarray:
    if dist == "pos_maxmant":   # all positive, mantissas just under 2: truncation errors
        m = 1.999 + 0.0009 * rng.random(shape)   # coherent and as large as they get
        return (m * np.ldexp(1.0, rng.integers(-3, 3, shape))).astype(np.float32)
    if dist == "scales":        # magnitudes over 40 binades, both signs
        return (rng.standard_normal(shape) * np.ldexp(1.0, rng.integers(-20, 20, shape))
                ).astype(np.float32)
    if dist == "tiny":          # subnormals and near-subnormals
        return (rng.standard_normal(shape) * 1e-39).astype(np.float32)
    return rng.standard_normal(shape).astype(np.float32)


@_settings(120)
@given(K=st.integers(1, 1536), dist=st.sampled_from(["pos_maxmant", "scales", "tiny", "randn"]),
       seed=st.integers(0, 2 ** 31 - 1))
def test_error_bound_covers_tf32_rounding(K: int, dist: str, seed: int) -> None:
    """|x~ . W~_n - x . W_n| <= 1.01 (DX (Wn + DW) + X DW) for the tf32 roundings x~, W~ of
    either mode, with X = ||x||, DX = ||ulp13(x)|| (as the kernel sums them) and Wn, DW from
    certified.weight_bounds -- the kernel's bound without its accumulation term (the products
    and sums here are exact in float64 to ~K 2^-53)."""
    rng = np.random.default_rng(seed)
    x = _draw(rng, (K,), dist)
    w = _draw(rng, (6, K), dist if dist != "pos_maxmant" else "pos_maxmant")
    z = w.astype(np.float64) @ x.astype(np.float64)
    X = math.sqrt(float(np.sum(x.astype(np.float64) ** 2)))
    DX = math.sqrt(float(np.sum(_ulp13(x) ** 2)))
    wn, wu = (t.double().numpy() for t in certified.weight_bounds(torch.from_numpy(w)))
    e = 1.01 * (DX * (wn + wu) + X * wu)
    for mode in ("trunc", "nearest"):
        zhat = _tf32(w, mode).astype(np.float64) @ _tf32(x, mode).astype(np.float64)
        err = np.abs(zhat - z)
        slack = K * 2.0 ** -52 * (np.abs(w.astype(np.float64)) @ np.abs(x.astype(np.float64)))
        assert np.all(err <= e + slack), (mode, dist, K, err.tolist(), e.tolist())


@pytest.mark.parametrize("case,only", [
    ("max", True), ("max_keepdim", True), ("min", True),
    ("after", False), ("two_results", True), ("plus_input_mean", False)])
def test_red_only_decides_when_the_tail_kernel_is_skipped(case: str, only: bool) -> None:
    """certify.red_only: the level holding the certified chain computes nothing but its row
    max/min (or a view of it) -- then the certification kernel writes it and the level's
    kernel is not run (a second result computed by another level does not matter); work
    after the reduction, or another value combined with it in the level, keeps the
    kernel. Checked on the compiled program's real levels."""
    from cupyfuse.backend.codegen import compile_program

    def fn(h, s):
        v = F.gelu(h) * 2.0
        if case == "max":
            return v.max(dim=1).values
        if case == "max_keepdim":
            return v.amax(dim=1, keepdim=True)
        if case == "min":
            return v.min(dim=1).values
        if case == "after":
            return torch.tanh(v.amax(dim=1)) - 0.5
        if case == "two_results":
            return v.amax(dim=1), s.x.mean(dim=1)
        return v.amax(dim=1, keepdim=True) + s.x.mean(dim=1, keepdim=True)

    prog, g = _program(fn)
    chain = certify.find(prog, g)
    assert chain is not None
    pl = compile_program(prog)
    lv = next(lv for lv in pl.levels if g in lv.gemms)
    assert certify.red_only(prog, chain, lv.targets, bool(lv.kernel)) is only, \
        (case, lv.targets, [prog.nodes[t].kind for t in lv.targets])
    # no kernel, or no targets: nothing to skip
    assert not certify.red_only(prog, chain, lv.targets, False)
    assert not certify.red_only(prog, chain, [], True)


def test_source_evaluates_the_chain_at_a_point() -> None:
    """The generated kernel carries the chain's ops at a point (``value``: the tail's values
    for the row reduction it writes) with the same operands as its interval code, in
    order, and passes the reduction's direction."""
    prog, g = _program(lambda h, s: (F.gelu(h) + s.p).amin(dim=1))
    chain = certify.find(prog, g)
    _, src, params = certified.source(prog, chain)
    value = src[src.index("auto value = [&](int n, float t) -> float {"):]
    value = value[:value.index("};")]
    p = _param(prog, "p")
    lines = [ln.strip() for ln in value.splitlines()[1:] if ln.strip()]
    assert lines[0].startswith("t = cf_gelu(t);"), lines
    assert lines[1] == f"const float o1_{chain.steps[1][0]} = p{p}[(long long)n * p{p}_sf];", lines
    assert lines[2].startswith(f"t = (t + o1_{chain.steps[1][0]});"), lines
    assert lines[3] == "return t;", lines
    assert "red_out,\n              1, chain, value);" in src   # 1: a min
    assert "float* __restrict__ red_out" in src


def test_dependent_launch_structs_match_cuda_h(tmp_path) -> None:
    """runtime.launch_dependent hands cuLaunchKernelEx ctypes mirrors of CUlaunchConfig and
    CUlaunchAttribute: their sizes and field offsets, and the attribute's id, as the CUDA
    toolkit's cuda.h lays them out (a C program compiled here prints them)."""
    import ctypes
    import shutil
    import subprocess

    from cupyfuse.backend import runtime

    nvcc, cc = shutil.which("nvcc"), shutil.which("cc") or shutil.which("gcc")
    if nvcc is None or cc is None:
        pytest.skip("no CUDA toolkit (nvcc) or C compiler here")
    inc = Path(nvcc).resolve().parent.parent / "include"
    if not (inc / "cuda.h").exists():
        inc = Path("/usr/local/cuda/include")
    if not (inc / "cuda.h").exists():
        pytest.skip("no cuda.h")
    src = tmp_path / "layout.c"
    src.write_text(
        '#include <stddef.h>\n#include <stdio.h>\n#include <cuda.h>\n'
        'int main(void) { printf("%zu %zu %zu %zu %zu %zu %zu %zu %d\\n", '
        'sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, blockDimX), '
        'offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream), '
        'offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs), '
        'sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value), '
        '(int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION); return 0; }\n')
    exe = tmp_path / "layout"
    subprocess.run([cc, f"-I{inc}", str(src), "-o", str(exe)], check=True)
    want = [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True,
                                           check=True).stdout.split()]
    C, A = runtime._LaunchConfig, runtime._LaunchAttr
    got = [ctypes.sizeof(C), C.block.offset, C.smem.offset, C.stream.offset, C.attrs.offset,
           C.nattrs.offset, ctypes.sizeof(A), A.value.offset, runtime._PDL_ATTR]
    assert got == want


# --- x's norms summed in float (tail_certify.cuh, cf_cert_row's step 1) -----------------
def _kernel_norm_bounds(x: np.ndarray, vec: bool, threads: int, ftz: bool) -> tuple:
    """The kernel's (bounded sum of squares, of ulp13 squares) of one row, as its threads
    compute them: thread i takes float4 i, i + threads, ... (vec) or elements i, i +
    threads, ...; each sums v^2 and ulp13(v)^2 in float32 with one rounding per term
    (fmaf; emulated here as the float64 sum rounded to float32, subnormals flushed where
    ``ftz``), bounds it by (s + t 2^-126)(1 + 2 t 2^-24) with the kernel's t, and the
    block adds the threads' bounds in float64. An overflowed thread sum is redone in
    float64 (the kernel's fallback). None where the row is a guard row (NaN, inf)."""
    K = x.size
    if not np.isfinite(x).all():
        return None
    t = 4.0 * ((K >> 2) // threads + 1) + 4.0 if vec else float(K // threads + 1)
    idx = np.arange(K)
    owner = (idx >> 2) % threads if vec else idx % threads
    e = (x.view(np.uint32) & np.uint32(0x7F800000))
    ulp = np.where(e == 0, np.abs(x), (e.astype(np.uint32)).view(np.float32) * np.float32(2.0 ** -10))

    def fsum32(vals: np.ndarray) -> np.float32:
        s = np.float32(0.0)
        with np.errstate(over="ignore"):
            for v in vals:
                s = np.float32(float(s) + float(v) * float(v))
                if ftz and 0 < abs(s) < 2.0 ** -126:
                    s = np.float32(0.0)
        return s

    S2 = U2 = 0.0
    for i in range(threads):
        mine = owner == i
        if vec:
            mine &= idx < (K >> 2) * 4
        s, u = fsum32(x[mine]), fsum32(ulp[mine])
        if np.isfinite(s) and np.isfinite(u):
            S2 += (float(s) + t * 2.0 ** -126) * (1.0 + 2.0 * t * 2.0 ** -24)
            U2 += (float(u) + t * 2.0 ** -126) * (1.0 + 2.0 * t * 2.0 ** -24)
        else:   # the kernel's fallback: a float64 sum, one rounding per term
            for v, u in zip(x[mine], ulp[mine]):
                S2 += float(v) ** 2
                U2 += float(u) ** 2
    return S2, U2


@_settings(60)
@given(K=st.integers(1, 700), vec=st.booleans(), scale=st.integers(-140, 70),
       dist=st.sampled_from(["rand", "randn", "spread", "one"]), ftz=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_float_norm_sums_bound_the_exact_norms(K, vec, scale, dist, ftz, seed):
    """The kernel's float32 sums of x^2 and ulp13(x)^2, each bounded above per thread,
    are at least the exact sums for rows from tiny (squares underflow, subnormals flushed
    or not) to huge (squares overflow: the float64 fallback), at any K (the float4
    layout's t included); 32 threads stand in for 256 (the bound's t is per thread)."""
    if vec:
        K = max(4, K - K % 4)
    g = torch.Generator().manual_seed(seed)
    base = {"rand": torch.rand(K, generator=g), "randn": torch.randn(K, generator=g),
            "spread": torch.randn(K, generator=g) * torch.exp2(torch.randint(-20, 20, (K,),
                                                                             generator=g)),
            "one": torch.zeros(K).index_fill_(0, torch.tensor([K // 2]), 1.0)}[dist]
    x = (base.double() * 2.0 ** scale).float().numpy()
    got = _kernel_norm_bounds(x, vec, 32, ftz)
    assume(got is not None)
    xd = x.astype(np.float64)
    e = (x.view(np.uint32) & np.uint32(0x7F800000))
    ulp = np.where(e == 0, np.abs(xd), e.view(np.float32).astype(np.float64) * 2.0 ** -10)
    S2, U2 = math.fsum(xd * xd), math.fsum(ulp * ulp)
    # float64 sums round to nearest (the overflow fallback and the block's sum of the
    # threads' bounds): at most (K + 64) 2^-53 below the exact sums, far inside the 1.01
    # factor of the kernel's error bound e (tail_certify.cuh), which X and DX enter
    low = 1.0 - (K + 64) * 2.0 ** -53
    assert got[0] >= S2 * low and got[1] >= U2 * low, (got, S2, U2)
    assert got[0] * 1.01 ** 2 >= S2 and got[1] * 1.01 ** 2 >= U2
