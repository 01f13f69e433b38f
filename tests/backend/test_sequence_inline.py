"""Sequence reductions inside their level's kernel (codegen._inline_seqreds): a reduction
over the sequence read only by the next kernel of the batch's rows, where that kernel is
elementwise and reads it once per element, is computed there (its own loop over the seq
rows, in order) instead of by a seq_reduce launch of its own.

Checked here: which reductions move (mean pooling then a head, a pooled result after an
activation) and which keep their launch (read by a GEMM, by a row reduction or LayerNorm,
twice per element, a result); every pooling form and drawn forms with the generated kernels
run as C++ on the CPU (tests/emu/cuda.py) against float64 torch *and* bit for bit against
the same program with the inlining off (config.SEQ_INLINE); and, marked ``gpu``, the same
bits on the GPU, general path and prepared launches, with one launch fewer."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse import config
import cupyfuse
from cupyfuse.backend import codegen
from helpers import GPU
from gen.tails import RandDraw, assert_matches
from test_sequence_reductions import (FORMS, THREE_D, Drawn, MaskedMean, Pool, _drawn_inputs,
                                 _model, _x, draw_spec, references)
from helpers import program_of

K = 8


def _plan(model: nn.Module, *args: torch.Tensor) -> codegen.Plan:
    return codegen.plan(program_of(cupyfuse.from_model(model), *args))


def _inside(pl: codegen.Plan) -> list[str]:
    return [pl.prog.nodes[r].op for lv in pl.levels for r in lv.seq_inline]


def _launched(pl: codegen.Plan) -> list[str]:
    return [pl.prog.nodes[r].op for lv in pl.levels for r in lv.seqreds]


class Forms(nn.Module):
    """Forms whose reductions stay launches of their own, and a few that move."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(K, 12)
        self.head = nn.Linear(12, 3)
        self.ln = nn.LayerNorm(12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        f = self.form
        if f == "sum_head":      # read by a GEMM as it is
            return self.head(h.sum(1))
        if f == "twice":         # its lambda would run twice per element
            p = h.mean(1)
            return p * torch.sigmoid(p)
        if f == "ln":            # LayerNorm: phases over the row
            return self.ln(h.amax(1))
        if f == "softmax":
            return torch.softmax(h.mean(1), -1)
        if f == "kept":          # a result itself, and read by the next level
            p = h.sum(1)
            return p, torch.tanh(p)
        if f == "mean_head":
            return self.head(F.gelu(h).mean(1))
        if f == "tanh_max":
            return torch.tanh(h.amax(1))
        if f == "first_relu":
            return torch.relu(h[:, 0]) * 2.0
        raise AssertionError(f)


@pytest.mark.parametrize("form,inside,launched", [
    ("twice", [], ["sum"]), ("ln", [], ["max"]), ("softmax", [], ["sum"]),
    ("kept", [], ["sum"]),
    # (a GEMM reads the reduction through a view: that view's copy kernel reduces)
    ("sum_head", ["sum"], []),
    ("mean_head", ["sum"], []), ("tanh_max", ["max"], []), ("first_relu", ["take"], [])])
def test_which_reductions_run_inside(form, inside, launched):
    pl = _plan(Forms(form).eval(), torch.randn(3, 5, K))
    assert (_inside(pl), _launched(pl)) == (inside, launched)
    for lv in pl.levels:
        for r in lv.seq_inline:   # the kernel reads the operand itself: no buffer of r
            assert f"sq{r}" in lv.kernel and f"buf{r}" not in lv.kernel
            assert r not in pl.materialized


def test_long_sequences_keep_their_launch():
    """Past SEQ_INLINE_LOADS loads per thread and row (seq x the features each of the
    kernel's threads takes) the reduction keeps its launch, whose threads spread a small
    batch over the GPU: 12 features take one thread each in a kernel of 64 threads."""
    assert config.SEQ_INLINE_LOADS == 128
    for seq, moved in ((128, ["sum"]), (129, [])):
        pl = _plan(Forms("mean_head").eval(), torch.randn(2, seq, K))
        assert _inside(pl) == moved, seq
        assert _launched(pl) == ["sum"] * (1 - len(moved))


def test_switch_off_keeps_every_launch(monkeypatch):
    monkeypatch.setattr(config, "SEQ_INLINE", False)
    pl = _plan(Forms("mean_head").eval(), torch.randn(3, 5, K))
    assert _inside(pl) == [] and _launched(pl) == ["sum"]


def test_pooling_forms_move_where_they_may():
    """Across the pooling forms: the mean of a head, an attention pooling's weighted sum
    before its head's activation and a pooled value after an activation move; a pooled
    result, the softmax statistics and reductions read by row reductions do not."""
    moved = {}
    for form in sorted(FORMS):
        pl = _plan(_model(Pool, form), torch.randn(3, 5, K))
        moved[form] = _inside(pl)
    assert moved["head"] == ["sum"]
    # an attention pooling: the softmax's max and sum of the one-feature scores (row
    # scalars of the next kernel), the weighted sum before the head's activation
    assert moved["attention_head"] == ["max", "sum", "sum"]
    assert moved["mean"] == ["sum"]          # sum / seq: the division is the kernel
    # a pooled result: the copy kernel of its view reduces (with keepdim the reduction is
    # the result itself: its launch writes it)
    assert moved["sum"] == ["sum"] and moved["amax"] == ["max"]
    assert moved["max_keep"] == [] and moved["last_keep"] == []
    # LayerNorm, softmax over the seq (its statistics are read by the seq rows)
    # (a softmax over the seq of 12 features: its statistics are read at every seq row)
    assert moved["head_ln"] == [] and moved["seq_softmax"] == []
    assert sum(map(len, moved.values())) >= 8, moved


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same float32 bits, every NaN counted as one (its sign bit differs between the
    emulated seq_reduce's NumPy and the compiled loop)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(
        a.masked_fill(nan, 0.0).view(torch.int32), b.masked_fill(nan, 0.0).view(torch.int32))


# --- the generated kernels run as C++ (tests/emu/cuda.py) --------------------------------
def _cases() -> list[tuple[str, nn.Module, list[torch.Tensor]]]:
    cases = []
    for form in sorted(FORMS):
        if form == "train_bn":
            continue
        for shape in ((3, 5, K), (1, 7, K), (2, 1, 6, K)):
            if form in THREE_D and len(shape) > 3:
                continue
            cases.append((f"{form}-{shape}", _model(Pool, form), [_x(shape, 3)]))
    for form in ("mean_head", "tanh_max", "first_relu", "twice"):
        torch.manual_seed(1)
        cases.append((form, Forms(form).eval(), [_x((4, 3, K), 5)]))
    for how in ("mean", "masked_fill", "attention"):
        g = torch.Generator().manual_seed(2)
        mask = (torch.rand(3, 5, 1, generator=g) > 0.4).float()
        mask[:, 0] = 1.0
        cases.append((f"masked-{how}", _model(MaskedMean, how), [_x((3, 5, K), 4), mask]))
    for seed in range(8):
        spec = draw_spec(RandDraw(100 + seed))
        torch.manual_seed(seed)
        cases.append((f"drawn{seed}", Drawn(spec).eval(), _drawn_inputs(spec, seed)))
    return cases


def _emulated(cases, tmp, monkeypatch) -> dict[str, torch.Tensor]:
    from emu import cuda as _cuda_emu
    from emu.gpu import model_program, run_program_emulated

    progs = {name: model_program(model, args) for name, model, args in cases}
    kernels = _cuda_emu.build([p for p, _, _ in progs.values()], tmp, exact=True)
    outs = {}
    for name, (prog, tens, srcs) in progs.items():
        with monkeypatch.context() as mp:
            outs[name] = run_program_emulated(prog, tens, srcs, mp, kernels)
    return outs


def test_inside_kernels_emulated_match_torch_and_the_launch_bitwise(tmp_path_factory,
                                                                    monkeypatch):
    """Every case through execute.run_gpu on CPU tensors with each level's generated kernel
    compiled as C++ (threads for CUDA's): within the tolerance of float64 torch, and the
    same bits as the program whose reductions are seq_reduce launches (its loop emulated)."""
    from emu import cuda as _cuda_emu

    if _cuda_emu.CXX is None:
        pytest.skip("no C++ compiler")
    cases = _cases()
    codegen._plans.clear()
    on = _emulated(cases, tmp_path_factory.mktemp("on"), monkeypatch)
    with monkeypatch.context() as mp:
        mp.setattr(config, "SEQ_INLINE", False)
        codegen._plans.clear()
        off = _emulated(cases, tmp_path_factory.mktemp("off"), mp)
    codegen._plans.clear()
    moved = 0
    for name, model, args in cases:
        pl = codegen.plan(program_of(cupyfuse.from_model(model), *args))
        moved += bool(_inside(pl))
        ref64, _, ref32 = references(model, args)
        got, base = on[name], off[name]
        if isinstance(ref64, torch.Tensor):
            got, base, ref64, ref32 = [got], [base], [ref64], [ref32]
        for g, b, r64, r32 in zip(got, base, ref64, ref32):
            assert_matches(g, r64, r32, what=name)
            assert _same_bits(g, b), name
    assert moved >= 15, moved


# --- on the GPU ---------------------------------------------------------------------------
def _gpu_out(model: nn.Module, args: list[torch.Tensor], calls: int = 3) -> list:
    fm = cupyfuse.from_model(model)
    outs = []
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for _ in range(calls):   # the general path, then prepared launches
            outs.append(fm(*args))
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [GPU])
@pytest.mark.parametrize("seq,batch", [(16, 1), (5, 3), (1, 4), (16, 64), (7, 300)])
@pytest.mark.parametrize("form", ["mean_head", "tanh_max", "first_relu", "twice"])
def test_gpu_same_bits_as_the_launch(form, seq, batch, dev, monkeypatch):
    torch.manual_seed(0)
    model = Forms(form).eval()
    x = _x((batch, seq, K), 9)
    ref64, _, ref32 = references(model, [x])
    model = model.to(dev)
    xg = x.to(dev)
    codegen._plans.clear()
    on = _gpu_out(model, [xg])
    with monkeypatch.context() as mp:
        mp.setattr(config, "SEQ_INLINE", False)
        codegen._plans.clear()
        off = _gpu_out(model, [xg])   # (a new from_model: a new program and plan)
    codegen._plans.clear()
    for o in on + off:
        assert_matches(o.cpu(), ref64, ref32, what=form)
        assert _same_bits(o, on[0]), form


@pytest.mark.gpu
@pytest.mark.parametrize("dev", [GPU])
@pytest.mark.parametrize("form", sorted(set(FORMS) - {"train_bn"}))
def test_gpu_pooling_forms_same_bits_as_the_launch(form, dev, monkeypatch):
    model = _model(Pool, form).to(dev)
    x = _x((6, 9, K), 11).to(dev)
    codegen._plans.clear()
    on = _gpu_out(model, [x])
    with monkeypatch.context() as mp:
        mp.setattr(config, "SEQ_INLINE", False)
        codegen._plans.clear()
        off = _gpu_out(model, [x])
    codegen._plans.clear()
    ref64, _, ref32 = references(_model(Pool, form), [x.cpu()])
    for o in on + off:
        assert_matches(o.cpu(), ref64, ref32, what=form)
        assert _same_bits(o, on[0]), form
