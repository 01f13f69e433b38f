"""Adversarial forms of two features, each checked for wrong answers:

1. Sequence reductions inside level kernels (codegen._inline_seqreds, _Emitter._seq_loop):
   more forms people write (pooling then LayerNorm / softmax / a head, several poolings of
   one value, a pooled value used twice, two heads, max+mean concat, attention with masks
   and with a value projection, keepdim forms, width-1 values other than attention
   scores, results that are reductions or views of them, two results, (batch, 1, seq, F)
   inputs, seq lengths 1 ... 300) run through execute.run_gpu on CPU tensors with the
   generated kernels compiled as C++ (tests/emu/cuda.py), with the inlining on and off:
   float64 torch's values and the same bits. The prepared launches emulated
   (tests/emu/prepared.py) on and off, the same bits. The plan rules checked on the plans
   themselves (a moved reduction is read by nothing else: no other level, GEMM, result or
   buffer; the loads bound), for these forms, test_sequence_reductions' forms and drawn ones.
2. Fused modules' own ``__call__`` (runner._direct_call): with ``_Runner.fast_call``
   replaced by a stand-in that returns a sentinel (no GPU here), every observable of a
   call -- the result, the hooks and overrides that ran, what fast_call got -- is the same
   as with the shortcut off (torch's Module.__call__ every time), in each case: hooks of
   every kind, forward or ``_call_impl`` replaced on the instance / class / a subclass,
   ``__call__`` overridden, compile, jit.trace, fx tracing a model around the module,
   deepcopy, pickling, DataParallel, keyword arguments, precision attributes; and the
   sentinel comes back without entering torch's __call__ exactly in the plain case.
   A ``_call_impl`` of the class, of a subclass or of the instance runs (torch's __call__
   calls ``self._call_impl``): _direct_call must not skip it.
"""
from __future__ import annotations

import copy
import io
import pickle
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from cupyfuse.backend import execute
from cupyfuse import runner
from cupyfuse import config
import cupyfuse
from cupyfuse.backend import codegen
from helpers import GPU
from gen.tails import HypDraw, assert_matches
from test_sequence_reductions import (FORMS, Drawn, Pool, _drawn_inputs, _model, _x, draw_spec,
                                 references)
from helpers import program_of
from helpers import examples

K, D = 8, 12


# =========================================================================================
# 1. sequence reductions inside level kernels
# =========================================================================================
def _att(m: nn.Module, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    s = m.score(h)
    if mask is not None:
        s = s.masked_fill(mask == 0, float("-inf"))
    return (torch.softmax(s, dim=1) * h).sum(1)


def _swish(p: torch.Tensor) -> torch.Tensor:
    return p * torch.sigmoid(p)


def _chunk_gate(c: tuple) -> torch.Tensor:
    return c[0] * torch.sigmoid(c[1])


#: forms over a (batch, seq, K) input x and a (batch, seq, 1) 0/1 mask y
HFORMS: dict[str, Callable[[nn.Module, torch.Tensor, torch.Tensor], Any]] = {
    # pooling then LayerNorm / softmax / a head
    "mean_ln": lambda m, x, y: m.ln(m.fc(x).mean(1)),
    "mean_softmax_head": lambda m, x, y: m.head(torch.softmax(m.fc(x).mean(1), -1)),
    "max_head": lambda m, x, y: m.head(m.fc(x).amax(1)),
    "logsumexp_head": lambda m, x, y: m.head(torch.logsumexp(m.fc(x), 1)),
    # several poolings of one value
    "three_pools": lambda m, x, y: m.fc(x).mean(1) + m.fc(x).amax(1) - m.fc(x).amin(1),
    "three_pools_h": lambda m, x, y: (lambda h: h.mean(1) * 2 + h.amax(1) - h.amin(1))(
        torch.tanh(m.fc(x))),
    "minmax_ratio": lambda m, x, y: (lambda h: (h.amax(1) - h.amin(1)) / (h.amax(1) + 1e-3))(
        m.fc(x)),
    # a pooled value used twice
    "swish_pool": lambda m, x, y: _swish(m.fc(x).mean(1)),
    "swish_pool_head": lambda m, x, y: m.head(_swish(m.fc(x).mean(1))),
    "leaky_where": lambda m, x, y: (lambda p: torch.where(p > 0, p, 0.1 * p))(m.fc(x).sum(1)),
    # pooled values feeding two heads
    "two_heads_sum": lambda m, x, y: (lambda p: m.head(p) + m.head2(torch.relu(p)))(
        m.fc(x).mean(1)),
    "two_heads_tuple": lambda m, x, y: (lambda p: (m.head(p), m.head2(torch.tanh(p))))(
        m.fc(x).amax(1)),
    "pool_head_pool": lambda m, x, y: (lambda p: m.head(p) * p.amax(-1, keepdim=True))(
        m.fc(x).mean(1)),
    # max + mean concat
    "mean_max_cat": lambda m, x, y: torch.cat([m.fc(x).mean(1), m.fc(x).amax(1)], -1),
    "mean_max_cat_head": lambda m, x, y: m.head_cat(
        torch.cat([m.fc(x).mean(1), m.fc(x).amax(1)], -1)),
    "mean_max_cat_relu": lambda m, x, y: torch.relu(
        torch.cat([m.fc(x).mean(1), m.fc(x).amax(1)], -1)),
    "cat_same": lambda m, x, y: (lambda p: torch.cat([p, p * 2], -1))(m.fc(x).sum(1)),
    "pool_slice": lambda m, x, y: torch.tanh(m.fc(x).mean(1)[:, 2:7]),
    "pool_chunk_gate": lambda m, x, y: _chunk_gate(m.fc(x).amax(1).chunk(2, -1)),
    # attention: plain, masked, an additive mask, (context, weights), a value projection
    "att_head": lambda m, x, y: m.head(torch.relu(_att(m, m.fc(x)))),
    "att_plain": lambda m, x, y: _att(m, torch.tanh(m.fc(x))),
    "att_masked": lambda m, x, y: m.head(_att(m, m.fc(x), y)),
    "att_additive_mask": lambda m, x, y: (lambda h: (
        torch.softmax(m.score(h) + (1 - y) * -1e4, 1) * h).sum(1))(m.fc(x)),
    "att_two_results": lambda m, x, y: (lambda h, a: ((a * h).sum(1), a.squeeze(-1)))(
        m.fc(x), torch.softmax(m.score(m.fc(x)), 1)),
    "att_vproj": lambda m, x, y: (lambda h: (torch.softmax(h.sum(-1, keepdim=True) / 12.0, 1)
                                             * m.val(torch.relu(h))).sum(1))(m.fc(x)),
    "att_vproj_head": lambda m, x, y: (lambda h: m.head(torch.tanh((torch.softmax(
        h.amax(-1, keepdim=True), 1) * m.val(torch.relu(h))).sum(1))))(m.fc(x)),
    "gated_vproj_max": lambda m, x, y: (lambda h: (torch.sigmoid(h[:, :1, :1])
                                                   * m.val(torch.relu(h))).amax(1))(m.fc(x)),
    "vproj_lastscore": lambda m, x, y: (lambda h: (m.val(torch.relu(h))
                                                   * h.sum(-1, keepdim=True)[:, -1:]).mean(1))(
        m.fc(x)),
    # keepdim forms
    "keep_mean_mul": lambda m, x, y: m.fc(x).mean(1, keepdim=True) * 2.0,
    "keep_tanh_max": lambda m, x, y: torch.tanh(m.fc(x).amax(1, keepdim=True)),
    "keep_center": lambda m, x, y: (lambda h: h - h.mean(1, keepdim=True))(m.fc(x)),
    "keep_squeeze": lambda m, x, y: torch.relu(m.fc(x).sum(1, keepdim=True).squeeze(1)),
    "keep_scale_rows": lambda m, x, y: (lambda h: h / h.amax(1, keepdim=True).clamp(min=1.0))(
        m.fc(x)),
    "center_then_max": lambda m, x, y: (m.fc(x) - m.fc(x).mean(1, keepdim=True)).amax(1),
    # width-1 values other than attention scores
    "w1_score_sum": lambda m, x, y: torch.tanh(m.score(m.fc(x)).sum(1)),
    "w1_rowsum_max": lambda m, x, y: m.fc(x).sum(-1, keepdim=True).amax(1) * m.fc(x).mean(1),
    "w1_rowmean_head": lambda m, x, y: m.head(
        m.fc(x).mean(-1, keepdim=True).mean(1) * m.fc(x).amax(1)),
    "w1_scale_seq_rows": lambda m, x, y: (lambda h: (h * m.score(h).amax(1, keepdim=True)).sum(
        1))(m.fc(x)),
    "w1_norm_rows": lambda m, x, y: (lambda h: (
        h / h.norm(dim=-1, keepdim=True).amax(1, keepdim=True)).mean(1))(m.fc(x)),
    "w1_no_features": lambda m, x, y: m.fc(x).sum(-1).amax(1, keepdim=True) + m.fc(x).mean(1),
    "w1_no_features_result": lambda m, x, y: torch.tanh(m.fc(x).sum(-1)).sum(1),
    "w1_first_last": lambda m, x, y: m.score(m.fc(x))[:, 0] - m.score(m.fc(x))[:, -1]
    + m.fc(x).mean(1),
    # results that are reductions or views of them; two results
    "result_pool": lambda m, x, y: m.fc(x).mean(1),
    "result_pool_and_tanh": lambda m, x, y: (lambda p: (p, torch.tanh(p)))(m.fc(x).sum(1)),
    "result_unsqueeze": lambda m, x, y: m.fc(x).amax(1).unsqueeze(1),
    "result_view": lambda m, x, y: m.fc(x).mean(1).view(x.shape[0], 3, 4),
    "result_view_softmax": lambda m, x, y: torch.softmax(
        m.fc(x).mean(1).view(x.shape[0], 3, 4), -1),
    "two_results": lambda m, x, y: (torch.tanh(m.fc(x).mean(1)), m.fc(x).amax(1)),
    "head_and_pool": lambda m, x, y: (lambda p: (m.head(p), p))(torch.relu(m.fc(x)).mean(1)),
    # first/last tokens, a second input, reductions of the input itself
    "last_first_diff": lambda m, x, y: torch.relu(m.fc(x)[:, -1] - m.fc(x)[:, 0]),
    "pool_y": lambda m, x, y: (m.fc(x) * y).sum(1) / y.sum(1).clamp(min=1),
    "input_pool_head": lambda m, x, y: m.fc(torch.relu(x.mean(1))),
    "input_max_plus": lambda m, x, y: m.fc(x.amax(1) + x.mean(1)),
}
#: forms pooling dim -2: a (batch, 1, seq, K) input pools its seq
H4: dict[str, Callable[[nn.Module, torch.Tensor, torch.Tensor], Any]] = {
    "d2_mean_head": lambda m, x, y: m.head(torch.relu(m.fc(x).mean(-2))),
    "d2_max_tanh": lambda m, x, y: torch.tanh(m.fc(x).amax(-2)),
    "d2_att": lambda m, x, y: (lambda h: (torch.softmax(m.score(h), -2) * h).sum(-2))(m.fc(x)),
    "d2_mean_max": lambda m, x, y: (lambda h: h.mean(-2) * h.amax(-2))(m.fc(x)),
}
ALL_FORMS = {**HFORMS, **H4}


class PoolingHead(nn.Module):
    """Linear(K, D), then one of ALL_FORMS; a scoring Linear(D, 1), heads, a value
    projection and a LayerNorm for the forms to use."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(K, D)
        self.score = nn.Linear(D, 1)
        self.head = nn.Linear(D, 3)
        self.head2 = nn.Linear(D, 3)
        self.head_cat = nn.Linear(2 * D, 5)
        self.val = nn.Linear(D, D)
        self.ln = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        return ALL_FORMS[self.form](self, x, y)


def _inputs(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """x with NaN / inf rows (tests/frontend/test_sequence_reductions._x) and a 0/1 mask,
    the first position of the first sequence kept."""
    x = _x(shape, seed)
    g = torch.Generator().manual_seed(seed + 1)
    y = (torch.rand(shape[:-1] + (1,), generator=g) > 0.3).float()
    y.view(-1, 1)[0] = 1.0
    return [x, y]


def _hunt(form: str, shape: tuple[int, ...], seed: int) -> tuple[str, nn.Module, list]:
    torch.manual_seed(seed)
    return (f"{form}-{'x'.join(map(str, shape))}", PoolingHead(form).eval(), _inputs(shape, seed))


def _short_cases() -> list[tuple[str, nn.Module, list]]:
    cases = []
    for j, form in enumerate(ALL_FORMS):
        shapes = [(1, 5, K), (3, 2, K)] + ([(2, 1, 5, K)] if form in H4 else [])
        if j % 3 == 0:
            shapes.append((2, 1, K))   # (a sequence of one: no reduction at all)
        for shape in shapes:
            cases.append(_hunt(form, shape, len(cases)))
    return cases


#: long sequences around SEQ_INLINE_LOADS (128): moved at 127 / 128, launched past it
LONG = [("att_head", (1, 128, K)), ("w1_scale_seq_rows", (1, 129, K)),
        ("mean_max_cat_head", (1, 127, K)), ("keep_mean_mul", (1, 300, K))]


def _long_cases() -> list[tuple[str, nn.Module, list]]:
    return [_hunt(form, shape, 50 + i) for i, (form, shape) in enumerate(LONG)]


def _plan_of(model: nn.Module, args: list) -> codegen.Plan:
    return codegen.plan(program_of(cupyfuse.from_model(model), *args))


def _inside(pl: codegen.Plan) -> list[int]:
    return [r for lv in pl.levels for r in lv.seq_inline]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same float32 bits, every NaN counted as one."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(
        a.masked_fill(nan, 0.0).view(torch.int32), b.masked_fill(nan, 0.0).view(torch.int32))


def _listed(r: Any) -> list:
    return [r] if isinstance(r, torch.Tensor) else list(r)


def plan_problems(pl: codegen.Plan) -> list[str]:
    """What breaks the rules of codegen._inline_seqreds in a finished plan: each sequence
    reduction launched or inside exactly one kernel; one inside a kernel is no result, no
    buffer, read by no GEMM / BatchNorm / other reduction, by no other level's kernel or
    epilogue, only by values that kernel computes; its loads within SEQ_INLINE_LOADS; a
    wider one's lambda called once in its kernel's source. Every buffer a kernel reads
    is written by an earlier step."""
    prog, nodes, lvl = pl.prog, pl.prog.nodes, pl.level_of
    users = prog.users()
    results = {prog.out, *prog.more_outs}
    bad = []
    inside = {r: lv for lv in pl.levels for r in lv.seq_inline}
    launched = {r: lv for lv in pl.levels for r in lv.seqreds}
    for i, n in enumerate(nodes):
        if n.kind == "seqred" and (i in inside) == (i in launched):
            bad.append(f"seqred {i}: inside {i in inside}, launched {i in launched}")
    for r, lv in inside.items():
        n = nodes[r]
        if r in results or r in pl.materialized:
            bad.append(f"{r} moved but a result or a buffer")
        need = codegen._needed(prog, lv.targets, lv.index, lvl, pl.materialized)
        for u in users[r]:
            if lvl[u] != lv.index or u not in need:
                bad.append(f"{r} moved into L{lv.index}, its user {u} at L{lvl[u]}")
            if nodes[u].kind in ("gemm", "gemv", "bn", "seqred"):
                bad.append(f"{r} moved but read by {nodes[u].kind} {u}")
        for other in pl.levels:
            for kind, what in other.args:
                if what == r and (other is not lv or not kind.startswith("seq_")):
                    bad.append(f"{r} moved into L{lv.index}: L{other.index} reads it ({kind})")
            if other.epi is not None and any(w == r for _, w in other.epi.args):
                bad.append(f"{r} moved but an epilogue reads it")
        s_len, width = n.attrs[1], nodes[n.args[0]].width
        if width == 1:
            if lv.index not in (lvl[r], lvl[r] + 1) or s_len > config.SEQ_INLINE_LOADS:
                bad.append(f"{r}: a row scalar at L{lv.index} (its level {lvl[r]}), seq {s_len}")
        else:
            if lv.index != lvl[r]:
                bad.append(f"{r} of {width} features moved to L{lv.index}, not {lvl[r]}")
            if s_len * -(-width // lv.threads) > config.SEQ_INLINE_LOADS:
                bad.append(f"{r}: {s_len} x ceil({width} / {lv.threads}) loads past the bound")
            if lv.kernel.count(f"v{r}(") > 1:
                bad.append(f"{r}: its lambda called {lv.kernel.count(f'v{r}(')} times")
    written: dict[int, int] = {}
    for lv in pl.levels:
        for i in lv.gemms + lv.seqreds:
            written[i] = lv.index
        for t in lv.targets:
            written.setdefault(t, lv.index)
    for lv in pl.levels:
        for kind, what in lv.args:
            if kind == "buf":
                src = nodes[what].args[0] if nodes[what].kind == "bn" else what
                at = written.get(src)
                if at is None or at > lv.index or (at == lv.index and nodes[src].kind != "seqred"):
                    bad.append(f"L{lv.index} reads buffer {what}, written at {at}")
            elif kind == "gemm" and what not in written:
                bad.append(f"L{lv.index} reads GEMM {what}, never run")
        for g in lv.gemms:
            a = nodes[g].args[0]
            while nodes[a].kind == "view" and a not in written:
                a = nodes[a].args[0]
            if nodes[a].kind != "input" and a not in written:
                bad.append(f"GEMM {g} reads {a}, which no step writes")
    return bad


# --- the plan rules -----------------------------------------------------------------------
@pytest.mark.parametrize("seq", [1, 2, 5, 127, 128, 129, 300])
def test_plan_rules_hold_for_the_hunt_forms(seq):
    moved = 0
    for form in ALL_FORMS:
        for shape in [(2, seq, K)] + ([(1, 1, seq, K)] if form in H4 else []):
            pl = _plan_of(PoolingHead(form).eval(), _inputs(shape, 0))
            assert plan_problems(pl) == [], (form, shape)
            moved += len(_inside(pl))
    if seq == 1:
        assert moved == 0   # (a sequence of one position is no reduction)
    elif seq <= 128:
        assert moved >= 40, moved


def test_plan_rules_hold_for_the_pooling_forms():
    for form in sorted(FORMS):
        if form == "train_bn":
            continue
        for s in (2, 5, 128, 129):
            pl = _plan_of(_model(Pool, form), [_x((2, s, K), 1)])
            assert plan_problems(pl) == [], (form, s)


@settings(max_examples=examples(120), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(hst.data(), hst.sampled_from([2, 3, 64, 128, 129]))
def test_plan_rules_hold_for_drawn_forms(data, seq):
    spec = draw_spec(HypDraw(data.draw))
    spec["s"] = seq
    model = Drawn(spec).eval()
    pl = _plan_of(model, _drawn_inputs(spec, 0))
    assert plan_problems(pl) == [], spec


def test_which_hunt_forms_move():
    """A few decisions pinned: an attention with a value projection computes its softmax
    statistics in the next (batch * seq) kernel, a value used twice per element or read
    by LayerNorm keeps its launch, a pooled result keeps its launch, a (batch, 1, seq, F)
    input's pooling moves as a (batch, seq, F) one's does."""
    def ops(form, shape=(3, 5, K)):
        pl = _plan_of(PoolingHead(form).eval(), _inputs(shape, 0))
        return sorted(pl.prog.nodes[r].op for r in _inside(pl)), \
            sorted(pl.prog.nodes[r].op for lv in pl.levels for r in lv.seqreds)

    assert ops("att_vproj") == (["max", "sum", "sum"], [])
    assert ops("swish_pool") == ([], ["sum"])
    assert ops("mean_ln") == ([], ["sum"])
    assert ops("result_pool_and_tanh") == ([], ["sum"])
    assert ops("mean_max_cat_head") == (["max", "sum"], [])
    assert ops("d2_mean_head", (2, 1, 5, K)) == ops("d2_mean_head", (2, 5, K))


# --- the generated kernels run as C++: inlining on and off --------------------------------
def _emulated(cases: list, tmp: Any) -> dict[str, Any]:
    from emu import cuda as _cuda_emu
    from emu.gpu import model_program, run_program_emulated

    progs = {name: model_program(model, args) for name, model, args in cases}
    kernels = _cuda_emu.build([p for p, _, _ in progs.values()], tmp, exact=True)
    outs = {}
    with pytest.MonkeyPatch.context() as mp:
        for name, (prog, tens, srcs) in progs.items():
            with mp.context() as m:
                outs[name] = run_program_emulated(prog, tens, srcs, m, kernels)
    return outs


@pytest.fixture(scope="module")
def emulated_runs(tmp_path_factory):
    """The cases, and their results with the kernels compiled as C++ with the inlining on
    and off (each set of kernels built once)."""
    from emu import cuda as _cuda_emu

    if _cuda_emu.CXX is None:
        pytest.skip("no C++ compiler")
    cases = _short_cases() + _long_cases()
    codegen._plans.clear()
    try:
        on = _emulated(cases, tmp_path_factory.mktemp("on"))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(config, "SEQ_INLINE", False)
            codegen._plans.clear()
            off = _emulated(cases, tmp_path_factory.mktemp("off"))
    finally:
        codegen._plans.clear()
    return cases, on, off


def test_inside_kernels_match_float64_and_the_launch_bitwise(emulated_runs):
    cases, on, off = emulated_runs
    moved = 0
    for name, model, args in cases:
        moved += bool(_inside(_plan_of(model, args)))
        ref64, _, ref32 = references(model, args)
        got, base = _listed(on[name]), _listed(off[name])
        r64, r32 = _listed(ref64), _listed(ref32)
        assert len(got) == len(base) == len(r64), name
        for g, b, a, c in zip(got, base, r64, r32):
            assert tuple(g.shape) == tuple(a.shape), name
            assert_matches(g, a, c, what=name)
            assert _same_bits(g, b), name
    assert moved >= 80, moved


def test_long_sequences_moved_where_the_bound_allows():
    """At the bound's edge: the 128-position attention's statistics and weighted sum and
    the 127-position poolings move; 129 and 300 positions of 12 features keep their
    launches (64 threads a row: one feature each)."""
    got = {}
    for name, model, args in _long_cases():
        pl = _plan_of(model, args)
        got[name.split("-")[0]] = len(_inside(pl))
    assert got == {"att_head": 3, "w1_scale_seq_rows": 0, "mean_max_cat_head": 2,
                   "keep_mean_mul": 0}


# --- prepared launches emulated: inlining on and off --------------------------------------
def _prepared_outs(model: nn.Module, args: list, inline: bool) -> list:
    from test_prepared_sequences import _check_emulated

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config, "SEQ_INLINE", inline)
        codegen._plans.clear()
        try:
            return _check_emulated(model, args, mp, f"inline={inline}", ready=None)
        finally:
            codegen._plans.clear()


@pytest.mark.parametrize("shape", [(1, 5, K), (3, 2, K), (2, 16, K), (1, 1, 6, K)],
                         ids=lambda s: "x".join(map(str, s)))
def test_prepared_launches_on_and_off_same_bits(shape):
    """Each form's prepared launches (full path and ready plan) against the emulated
    general path and float64 torch (test_prepared_sequences._check_emulated), with the
    inlining on and off: the same bits."""
    forms = ALL_FORMS if len(shape) == 3 else H4
    for j, form in enumerate(forms):
        _, model, args = _hunt(form, shape, j)
        a = _prepared_outs(model, args, True)
        b = _prepared_outs(model, args, False)
        for x, y in zip(a, b):
            for u, v in zip(_listed(x), _listed(y)):
                assert _same_bits(u, v), (form, shape)


# --- on the GPU ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dev", [GPU])
@pytest.mark.parametrize("seq,batch", [(5, 3), (1, 2), (128, 2), (129, 1), (300, 4)])
@pytest.mark.parametrize("form", sorted(ALL_FORMS))
def test_gpu_hunt_forms_same_bits_as_the_launch(form, seq, batch, dev, monkeypatch):
    """The general path, then prepared launches (three calls), with the inlining on and
    off: float64 torch's values and one set of bits."""
    shape = (batch, 1, seq, K) if form in H4 and seq % 2 else (batch, seq, K)
    _, model, args = _hunt(form, shape, 7)
    ref64, _, ref32 = references(model, args)
    model = model.to(dev)
    gargs = [a.to(dev) for a in args]
    outs = []
    for inline in (True, False):
        with monkeypatch.context() as mp:
            mp.setattr(config, "SEQ_INLINE", inline)
            codegen._plans.clear()
            fm = cupyfuse.from_model(model)
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                outs += [_listed(fm(*gargs)) for _ in range(3)]
    codegen._plans.clear()
    for o in outs:
        for g, first, a, c in zip(o, outs[0], _listed(ref64), _listed(ref32)):
            assert_matches(g.cpu(), a, c, what=form)
            assert _same_bits(g.cpu(), first.cpu()), form


# =========================================================================================
# 2. fused modules' own __call__
# =========================================================================================
SENTINEL = 12345.0


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(F.gelu(self.fc(x)), -1)


class HeadWithCallImpl(Head):
    """A class that replaces torch's _call_impl (Module.__call__ calls self._call_impl)."""

    def _call_impl(self, *args: Any, **kwargs: Any) -> Any:
        _LOG.append("class _call_impl")
        return nn.Module._call_impl(self, *args, **kwargs)


_LOG: list = []


@pytest.fixture
def stand_in(monkeypatch):
    """fast_call replaced: a sentinel (plus the sum of x, so a pre-hook's change shows) for
    plain tensor arguments, as the real one's key would take them; each hit logged with
    what it got."""
    def fast_call(self, module, args, precision=None):
        if args and all(type(a) is torch.Tensor for a in args):
            _LOG.append(("fast", type(module).__name__, tuple(a.tolist() for a in args),
                         precision))
            return torch.full((1,), SENTINEL) + float(args[0].sum())
        return None

    monkeypatch.setattr(runner._Runner, "fast_call", fast_call)
    _LOG.clear()
    yield _LOG
    _LOG.clear()


X = torch.arange(8.0).reshape(2, 4)


def _fused(cls: type = Head) -> nn.Module:
    torch.manual_seed(0)
    return cupyfuse.fused_class(cls)()


def _fresh_class() -> type:
    """A class of its own (fused_class caches by class: a test changing its fused class
    must not leak)."""
    return type("Fresh", (Head,), {"__module__": __name__})


def _sc_plain():
    m = _fused()
    return [m(X) for _ in range(2)]


def _sc_from_model():
    torch.manual_seed(0)
    m = cupyfuse.from_model(Head())
    return [m(X) for _ in range(2)]


def _sc_forward_hook():
    m = _fused()
    m(X)
    m.register_forward_hook(lambda mod, a, o: (_LOG.append("hook"), o * 2)[1])
    return m(X)


def _sc_forward_hook_kwargs():
    m = _fused()
    m(X)
    m.register_forward_hook(lambda mod, a, k, o: (_LOG.append(("hookk", k)), o - 1)[1],
                            with_kwargs=True)
    return m(X)


def _sc_pre_hook():
    m = _fused()
    m(X)
    m.register_forward_pre_hook(lambda mod, a: (_LOG.append("pre"), (a[0] + 1,))[1])
    return m(X)


def _sc_pre_hook_kwargs():
    m = _fused()
    m(X)
    m.register_forward_pre_hook(lambda mod, a, k: (_LOG.append(("prek", k)),
                                                   ((a[0] + 1,), k))[1], with_kwargs=True)
    return m(X)


def _sc_prepend_hooks():
    m = _fused()
    m(X)
    m.register_forward_hook(lambda mod, a, o: _LOG.append("second"))
    m.register_forward_hook(lambda mod, a, o: _LOG.append("first"), prepend=True)
    return m(X)


def _sc_always_call():
    m = _fused()
    m(X)
    m.register_forward_hook(lambda mod, a, o: _LOG.append("always"), always_call=True)
    return m(X)


def _sc_global_hook():
    m = _fused()
    m(X)
    h = nn.modules.module.register_module_forward_hook(
        lambda mod, a, o: _LOG.append(("global", type(mod).__name__)))
    try:
        return m(X)
    finally:
        h.remove()


def _sc_backward_hook():
    m = _fused()
    m(X)
    m.register_full_backward_hook(lambda mod, gi, go: _LOG.append("bw"))
    out = m(X.clone().requires_grad_())
    return out.detach(), out.requires_grad


def _sc_backward_pre_hook():
    m = _fused()
    m(X)
    m.register_full_backward_pre_hook(lambda mod, go: _LOG.append("bwpre"))
    return m(X).detach()


def _sc_hook_removed():
    m = _fused()
    m(X)
    h = m.register_forward_hook(lambda mod, a, o: _LOG.append("hook"))
    m(X)
    h.remove()
    return m(X)


def _sc_instance_forward():
    m = _fused()
    m(X)
    m.forward = lambda t: (_LOG.append("instance forward"), t * 3)[1]
    return m(X)


def _sc_class_forward():
    C = cupyfuse.fused_class(_fresh_class())
    m = C()
    m(X)
    C.forward = lambda self, t: (_LOG.append("class forward"), t * 7)[1]
    return m(X)


def _sc_subclass_forward():
    class Sub(cupyfuse.fused_class(Head)):
        def forward(self, t):
            _LOG.append("subclass forward")
            return super().forward(t) * 3

    torch.manual_seed(0)
    m = Sub()
    m(X)
    return m(X)


def _sc_subclass_call():
    class Sub(cupyfuse.fused_class(Head)):
        def __call__(self, *a, **k):
            _LOG.append("subclass __call__")
            return super().__call__(*a, **k)

    torch.manual_seed(0)
    m = Sub()
    m(X)
    return m(X)


def _sc_class_call_impl():
    m = _fused(HeadWithCallImpl)
    m(X)
    return m(X)


def _sc_subclass_call_impl():
    class Sub(cupyfuse.fused_class(Head)):
        def _call_impl(self, *a, **k):
            _LOG.append("subclass _call_impl")
            return super()._call_impl(*a, **k)

    torch.manual_seed(0)
    m = Sub()
    m(X)
    return m(X)


def _sc_instance_call_impl():
    m = _fused()
    m(X)
    m._call_impl = lambda *a, **k: (_LOG.append("instance _call_impl"),
                                    nn.Module._call_impl(m, *a, **k))[1]
    return m(X)


def _sc_keywords():
    m = _fused()
    m(X)
    return m(x=X)


def _sc_precision():
    torch.manual_seed(0)
    m = cupyfuse.fused_class(Head, precision="tf32")()
    m(X)
    m.cupyfuse_precision = "fp32"
    return m(X)


def _sc_deepcopy():
    m = _fused()
    m(X)
    m2 = copy.deepcopy(m)
    return m2(X), m2(X)


def _sc_pickle():
    m = _fused()
    m(X)
    m2 = pickle.loads(pickle.dumps(m))
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    m3 = torch.load(buf, weights_only=False)
    return m2(X), m2(X), m3(X)


def _sc_data_parallel():
    m = _fused()
    m(X)
    return nn.DataParallel(m)(X)


def _sc_jit_trace():
    m = _fused()
    m(X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = torch.jit.trace(m, (X,), check_trace=False)
    return t(X + 1)


def _sc_module_compile():
    m = _fused()
    m(X)
    m.compile(backend="eager")
    return m(X)


def _sc_torch_compile():
    m = _fused()
    m(X)
    return torch.compile(m, backend="eager")(X)


def _sc_fx_leaf():
    m = _fused()
    m(X)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = m

        def forward(self, t):
            return self.inner(t) + 1

    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, mod, qualname):
            return mod is m or super().is_leaf_module(mod, qualname)

    outer = Outer()
    gm = torch.fx.GraphModule(outer, Tracer().trace(outer))
    return gm(X), str(gm.graph)


def _sc_fx_through():
    m = _fused()
    m(X)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = m

        def forward(self, t):
            return self.inner(t) + 1

    try:
        gm = torch.fx.symbolic_trace(Outer())
    except Exception as exc:   # (fx cannot trace through the fused forward: either way)
        return type(exc).__name__
    return gm(X)


SCENARIOS = {name[4:]: fn for name, fn in dict(globals()).items() if name.startswith("_sc_")}
#: where torch's __call__ would call forward straight away: the shortcut's own hit
DIRECT = {"plain", "from_model", "hook_removed", "precision", "deepcopy", "pickle",
          "data_parallel", "subclass_call"}


def _observe(fn: Callable[[], Any], direct: bool) -> tuple[str, list, list]:
    """(repr of the result, the log, the modules that entered torch's __call__)."""
    entered: list = []
    orig = nn.Module.__call__

    def counting(self, *a, **k):
        entered.append(type(self).__name__)
        return orig(self, *a, **k)

    _LOG.clear()
    with pytest.MonkeyPatch.context() as mp:
        if not direct:
            mp.setattr(runner, "_direct_call", lambda m: False)
        mp.setattr(nn.Module, "__call__", counting)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                out = fn()
            except Exception as exc:
                out = (type(exc).__name__, str(exc)[:200])
    return repr(out), list(_LOG), entered


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_shortcut_is_torchs_call_in_every_observable(name, stand_in):
    """The result, the hooks and overrides that ran (and in which order), what fast_call
    got: the same with the shortcut as with torch's __call__ each time."""
    fn = SCENARIOS[name]
    got = _observe(fn, True)
    want = _observe(fn, False)
    assert got[:2] == want[:2], name
    if name in DIRECT:
        # a repeated plain call never entered torch's Module.__call__
        assert len(got[2]) < len(want[2]), (name, got[2], want[2])


def test_plain_repeated_call_skips_torchs_call(stand_in):
    m = _fused()
    first = m(X)
    entered: list = []
    orig = nn.Module.__call__

    def counting(self, *a, **k):
        entered.append(type(self).__name__)
        return orig(self, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nn.Module, "__call__", counting)
        for _ in range(3):
            assert torch.equal(m(X), first)
    assert entered == [] and first.item() == SENTINEL + float(X.sum())


@pytest.mark.parametrize("how", ["class", "subclass", "instance"])
def test_a_replaced_call_impl_runs(how, stand_in):
    """torch's Module.__call__ calls ``self._call_impl``: one of the class (before or
    after fused_class) or of the instance runs at every call (_direct_call looks for it
    and leaves such a call to torch's)."""
    if how == "class":
        m = _fused(HeadWithCallImpl)
    elif how == "subclass":
        class Sub(cupyfuse.fused_class(Head)):
            def _call_impl(self, *a, **k):
                _LOG.append("class _call_impl")
                return super()._call_impl(*a, **k)

        torch.manual_seed(0)
        m = Sub()
    else:
        m = _fused()
        m._call_impl = lambda *a, **k: (_LOG.append("class _call_impl"),
                                        nn.Module._call_impl(m, *a, **k))[1]
    assert not runner._direct_call(m)
    for _ in range(3):
        m(X)
    assert _LOG.count("class _call_impl") == 3


def test_direct_call_after_call_impl_restored(stand_in):
    m = _fused()
    assert runner._direct_call(m)
    m._call_impl = lambda *a, **k: None
    assert not runner._direct_call(m)
    del m._call_impl
    assert runner._direct_call(m)


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [GPU])
def test_gpu_replaced_call_impl_runs_every_call(dev):
    """On the GPU (prepared launches after the first call): a class's _call_impl runs at
    every call, and the result is the plain class's."""
    torch.manual_seed(0)
    m = cupyfuse.fused_class(HeadWithCallImpl)().to(dev)
    torch.manual_seed(0)
    plain = cupyfuse.fused_class(Head)().to(dev)
    x = torch.randn(7, 4, device=dev)
    _LOG.clear()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        outs = [m(x) for _ in range(3)]
        ref = plain(x)
    assert _LOG.count("class _call_impl") == 3
    for o in outs:
        assert torch.equal(o, ref)
    _LOG.clear()

