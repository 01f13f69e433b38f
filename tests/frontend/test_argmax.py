"""argmax / argmin over the features, and the indices of max / min: int64 results.

Forms (``h`` a (batch, features) or (batch, seq, features) value): ``h.argmax(-1)``,
``torch.argmax(h, dim=-1)``, ``h.argmin(...)``, ``torch.argmin``, ``h.max(dim=-1).indices``,
``h.max(-1)[1]``, ``torch.max(h, -1)[1]``, ``values, idx = h.max(-1)`` (both used),
``return h.max(-1)`` (torch's ``return_types`` pair), the same for min, keepdim both
ways; over one dim of split features (``h.view(-1, H, D).argmax(-1)``, ``.argmin(1)``:
a ``sred``); views of the positions and ``.float()`` of them; several results (a tuple, a
list, a dict with the logits beside the positions). Refused, naming the op and the
line: no dim (the flat position), the batch dim, a sequence dim, a size-1 dim beside the
features, a transposed value, a stack along dim 0, and any use of the positions other
than views, ``.float()`` and returning them.

Semantics are torch's: the first position of the maximum (minimum) -- ties go to the
lowest position; a NaN counts as the maximum *and* the minimum (the first NaN wins);
+-inf are ordinary numbers; -0.0 equals +0.0. ``test_torch_*_semantics`` checks that
torch itself (CPU here, CUDA in the ``gpu`` twin) follows that rule, against a pure
Python reference: should a torch release change it, those tests say so first.

**The data.** A fused Linear is fp32-accurate, not bitwise equal to torch's: where two
logits are within rounding of each other, the fused argmax may legitimately differ from
eager's. So the drawn values sit on a coarse grid where every step is exact: x and W hold
small integers, the bias small integers, and the tail is ``h = fc(x) * s + m`` with ``s``
0 or 1 and ``m`` an extra input on a grid of halves (plus NaN, +-inf, signed zeros, rows
all equal): every value any path computes is exact, so near-ties occur only as exact
ties, and the positions must match eager's *exactly* (and float64 eager's too). ``s = 0``
makes a row of ``m`` the row itself (all-equal rows, all-NaN rows, all -inf rows...).

Paths: the CPU path (from_model, fused_class, fused_linear); the GPU's general path
(execute.run_gpu) and the prepared launches (first call, then the ready plan) with their
launches emulated on the CPU (tests/emu/gpu.py, tests/emu/prepared.py); the generated kernels
themselves compiled as C++ (tests/emu/cuda.py: the 64-bit-key block reduction of
tail_ops.cuh with real threads and warp exchanges); on a GPU (``gpu``): the general
path, the prepared launches and the specialised call of a module called 4 times, and
fused_linear likewise (tests at the end).
"""
from __future__ import annotations

import copy
import math
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from cupyfuse.backend import execute
from cupyfuse import runner
import cupyfuse
from cupyfuse import fastpath
from cupyfuse.backend import codegen, prepared
from cupyfuse.interop import cupy_available
from cupyfuse.ir.program import TailError

from emu import gpu as _gpuemu
from emu import prepared as _prepemu
from gen.tails import HypDraw, RandDraw
from helpers import program_of
from helpers import examples

gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and cupy_available()),
                               reason="needs a CUDA GPU visible to both torch and CuPy")
NAN, INF = float("nan"), float("inf")


# ======================================================================================
# torch's rule, written out
# ======================================================================================
def rule_arg(row: list[float], want_max: bool) -> int:
    """The first position of the maximum (``want_max``) or minimum of ``row``; a NaN beats
    every number (the first NaN wins); -0.0 == +0.0 (compared as numbers)."""
    best = 0
    for j, v in enumerate(row):
        b = row[best]
        if math.isnan(b):
            break
        if math.isnan(v) or (v > b if want_max else v < b):
            best = j
    return best


def rule_rows(t: torch.Tensor, want_max: bool) -> torch.Tensor:
    """:func:`rule_arg` of every row along the last dim (an int64 tensor of t's other dims)."""
    flat = t.reshape(-1, t.shape[-1]).tolist()
    return torch.tensor([rule_arg(r, want_max) for r in flat],
                        dtype=torch.int64).reshape(t.shape[:-1])


SEMANTIC_ROWS = [
    [1.0, 3.0, 3.0, 2.0],              # a tie: the first
    [1.0, NAN, 5.0, NAN],              # the first NaN, for max and min
    [NAN, NAN],
    [-INF, -INF, -INF],
    [INF, 1.0, INF],
    [-0.0, 0.0],                       # equal
    [0.0, -0.0, -1.0],
    [2.0],
    [-INF, NAN, INF],
    [INF, -INF, 0.0, -INF, INF],
]


def _semantic_cases(device: str) -> list[torch.Tensor]:
    cases = [torch.tensor([r] * 3, dtype=torch.float32, device=device) for r in SEMANTIC_ROWS]
    g = torch.Generator().manual_seed(7)
    for n in (33, 257, 1000, 4099):   # long rows: torch's vectorised and parallel paths
        t = torch.randint(-3, 4, (6, n), generator=g).float()
        t[1, n // 2] = t[1, n - 3] = NAN
        t[2, :] = 1.0
        t[3, n // 3] = INF
        t[3, n - 2] = INF
        t[4, :] = -INF
        t[5, 7] = NAN
        cases.append(t.to(device))
    return cases


def _check_torch_semantics(device: str) -> None:
    for t in _semantic_cases(device):
        for want_max in (True, False):
            want = rule_rows(t.cpu(), want_max)
            f = torch.argmax if want_max else torch.argmin
            r = torch.max if want_max else torch.min
            got = [f(t, -1), f(t, dim=1, keepdim=True).squeeze(1), r(t, -1)[1],
                   r(t, dim=1).indices]
            for g in got:
                assert torch.equal(g.cpu(), want), (device, want_max, t, g, want)


def test_torch_cpu_semantics():
    """torch's CPU argmax/argmin/max/min follow the rule the kernels implement."""
    _check_torch_semantics("cpu")


# ======================================================================================
# the models
# ======================================================================================
def _both(h: torch.Tensor, op: str) -> Any:
    values, idx = (h.max(-1) if op == "max" else h.min(-1))
    return values, idx


#: form -> (function of h (and the input x for the seq forms), returns one tensor?)
FORMS: dict[str, Any] = {
    "argmax": lambda h: h.argmax(-1),
    "argmax_dim1": lambda h: h.argmax(dim=1),
    "torch.argmax": lambda h: torch.argmax(h, dim=-1),
    "argmax_keep": lambda h: h.argmax(-1, keepdim=True),
    "torch.argmax_keep": lambda h: torch.argmax(h, 1, True),
    "argmin": lambda h: h.argmin(-1),
    "torch.argmin": lambda h: torch.argmin(h, dim=1),
    "argmin_keep": lambda h: h.argmin(dim=-1, keepdim=True),
    "max.indices": lambda h: h.max(dim=-1).indices,
    "max[1]": lambda h: h.max(-1)[1],
    "torch.max[1]": lambda h: torch.max(h, -1)[1],
    "torch.max_keep[1]": lambda h: torch.max(h, 1, keepdim=True)[1],
    "min.indices": lambda h: h.min(dim=1).indices,
    "min[1]": lambda h: h.min(-1)[1],
    "torch.min[1]": lambda h: torch.min(h, dim=-1)[1],
    "torch.min_keep.indices": lambda h: torch.min(h, -1, keepdim=True).indices,
    "max_both": lambda h: _both(h, "max"),
    "min_both": lambda h: _both(h, "min"),
    "max_pair": lambda h: h.max(-1),
    "min_pair": lambda h: torch.min(h, 1),
    "logits_pred": lambda h: (h, h.argmax(-1)),
    "pred_logits_low": lambda h: [h.argmax(-1), h * 2.0, h.argmin(-1, keepdim=True)],
    "dict": lambda h: {"logits": h, "pred": h.argmax(-1), "low": h.min(-1).indices},
    "unsqueeze": lambda h: h.argmax(-1).unsqueeze(1),
    "view": lambda h: h.argmin(-1).view(-1, 1),
    "squeeze_all": lambda h: h.argmax(-1, keepdim=True).squeeze(),   # (batch 1: 0-d)
    "long_detach_clone": lambda h: h.argmax(-1).long().detach().clone(),
    "to_long_device": lambda h: h.argmax(-1).to(torch.int64).to(h.device).contiguous(),
    "type_long_flatten": lambda h: torch.flatten(h.argmin(-1, True).type(torch.long)),
    "type_float": lambda h: h.argmin(-1).type(torch.float32) * 2.0,
    "same_thrice": lambda h: (h.argmax(-1), h.argmax(-1), h.max(-1)[1]),
    "float": lambda h: h.argmax(-1).float(),
    "float_arith": lambda h: (h.argmax(-1, keepdim=True).float() * 0.5
                              + h.amax(-1, keepdim=True)),
    "pos_and_float": lambda h: (h.argmin(-1), h.argmin(-1).to(torch.float32) + 1.0),
    "relu_argmax": lambda h: F.relu(h).argmax(-1),
    "cat_float": lambda h: torch.cat([h, h.max(-1, keepdim=True)[1].float()], 1),
    # along a size-1 dim beside the features: position 0 everywhere (NaN or not)
    "size1_last": lambda h: h.unsqueeze(-1).argmax(-1),
    "size1_first": lambda h: (h.unsqueeze(1).argmin(1), h.unsqueeze(1).max(1, True)[1]),
    "neg_argmin": lambda h: (-h).argmin(-1),
}
#: forms over split features: h's N features as (H, D) (N = H * D)
SPLIT_FORMS: dict[str, Any] = {
    "split_argmax": lambda h, H: h.view(-1, H, h.shape[-1] // H).argmax(-1),
    "split_argmin_heads": lambda h, H: h.view(-1, H, h.shape[-1] // H).argmin(1),
    "split_max[1]": lambda h, H: h.view(-1, H, h.shape[-1] // H).max(-1)[1],
    "split_min_keep": lambda h, H: torch.min(h.view(-1, H, h.shape[-1] // H), 1,
                                             keepdim=True).indices,
    "split_argmax_keep": lambda h, H: h.view(h.shape[0], H, -1).argmax(2, keepdim=True),
    "split_both": lambda h, H: h.view(-1, H, h.shape[-1] // H).max(2),
    "split_float": lambda h, H: h.view(-1, H, h.shape[-1] // H).argmax(-1).float(),
    "split_size1": lambda h, H: h.view(-1, H, 1, h.shape[-1] // H).argmin(2),
}
#: forms of (batch, seq, features) values (x of 3 dims)
SEQ_FORMS: dict[str, Any] = {
    "seq_argmax": lambda h: h.argmax(-1),
    "seq_argmin_keep": lambda h: h.argmin(2, keepdim=True),
    "seq_max_both": lambda h: h.max(-1),
    "seq_rows": lambda h: h.reshape(-1, h.shape[-1]).argmax(-1),
    "seq_rows_max[1]": lambda h: h.view(-1, h.shape[-1]).max(1)[1],
    "seq_rows_back": lambda h: h.view(-1, h.shape[-1]).argmin(-1).view(h.shape[0], -1),
    "seq_logits_pred": lambda h: (h, torch.argmax(h, dim=-1)),
    "seq_pooled": lambda h: h.mean(1).argmax(-1),
    "seq_pooled_and_rows": lambda h: (h.amax(1).argmin(-1), h.argmax(-1)),
}
ALL_FORMS = {**FORMS, **SPLIT_FORMS, **SEQ_FORMS}


class ArgModel(nn.Module):
    """``h = fc(x) * s + m``, then the form."""

    def __init__(self, form: str, k: int, n: int, s: float, heads: int = 1) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(k, n)
        self.s = s
        self.heads = heads

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> Any:
        h = self.fc(x) * self.s + m
        if self.form in SPLIT_FORMS:
            return SPLIT_FORMS[self.form](h, self.heads)
        return ALL_FORMS[self.form](h)


# ======================================================================================
# the data: exact on every path
# ======================================================================================
ROW_KINDS = ("grid", "grid", "grid", "const", "nan", "nans", "pinf", "ninf", "mixed",
             "allnan", "allninf", "allpinf", "zeros")


def _row(kind: str, n: int, g: torch.Generator) -> list[float]:
    grid = [v / 2 for v in torch.randint(-6, 7, (n,), generator=g).tolist()]

    def at(k: int) -> list[int]:
        return torch.randint(0, n, (k,), generator=g).tolist()
    if kind == "const":
        return [grid[0]] * n
    if kind in ("nan", "nans"):
        for j in at(1 if kind == "nan" else 3):
            grid[j] = NAN
    elif kind in ("pinf", "ninf"):
        for j in at(2):
            grid[j] = INF if kind == "pinf" else -INF
    elif kind == "mixed":
        a, b, c = at(3)
        grid[a], grid[b], grid[c] = INF, -INF, NAN
    elif kind == "allnan":
        return [NAN] * n
    elif kind == "allninf":
        return [-INF] * n
    elif kind == "allpinf":
        return [INF] * n
    elif kind == "zeros":
        return [(-0.0, 0.0, -0.5)[j] for j in torch.randint(0, 3, (n,), generator=g).tolist()]
    return grid


def make_case(spec: dict) -> tuple[nn.Module, list[torch.Tensor]]:
    """The model (exact integer weights) and its inputs (x, m) for a drawn spec."""
    g = torch.Generator().manual_seed(spec["seed"])
    k, n, b = spec["k"], spec["n"], spec["batch"]
    torch.manual_seed(spec["seed"])
    model = ArgModel(spec["form"], k, n, spec["s"], spec.get("heads", 1)).eval()
    with torch.no_grad():
        model.fc.weight.copy_(torch.randint(-2, 3, (n, k), generator=g).float())
        model.fc.bias.copy_(torch.randint(-2, 3, (n,), generator=g).float())
    lead = (spec["seq"],) if spec.get("seq") else ()
    x = torch.randint(-2, 3, (b,) + lead + (k,), generator=g).float()
    rows = [_row(kinds, n, g) for kinds in spec["rows"]]
    m = torch.tensor(rows, dtype=torch.float32).reshape((b,) + lead + (n,))
    return model, [x, m]


def draw_spec(d: Any, forms: tuple = tuple(FORMS) + tuple(SPLIT_FORMS) + tuple(SEQ_FORMS)
              ) -> dict:
    form = d.choice(forms)
    heads = 1
    if form in SPLIT_FORMS:
        heads = d.choice((2, 3, 5))
        n = heads * d.choice((1, 2, 3, 17, 40))
    else:
        n = d.choice((1, 2, 3, 17, 32, 33, 1000))
    seq = d.choice((1, 2, 5)) if form in SEQ_FORMS else 0
    batch = d.choice((1, 2, 3, 5, 7))
    rows = [d.choice(ROW_KINDS) for _ in range(batch * max(seq, 1))]
    return {"form": form, "k": d.int(1, 5), "n": n, "batch": batch, "seq": seq,
            "heads": heads, "s": d.choice((0.0, 1.0)), "rows": rows, "seed": d.int(0, 10 ** 6)}


# ======================================================================================
# the checks
# ======================================================================================
def _flat(r: Any) -> list[torch.Tensor]:
    if isinstance(r, dict):
        return list(r.values())
    return list(r) if isinstance(r, (tuple, list)) else [r]


def _quiet(fn: Any, *args: Any) -> Any:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return fn(*args)


def references(model: nn.Module, inputs: list[torch.Tensor]) -> tuple[Any, Any]:
    """(eager float64, eager float32) on copies."""
    ref64 = _quiet(copy.deepcopy(model).double(), *[t.double() for t in inputs])
    ref32 = _quiet(copy.deepcopy(model), *[t.clone() for t in inputs])
    return ref64, ref32


def check_result(got: Any, ref64: Any, ref32: Any, what: str) -> None:
    """The container torch's (type, dict keys); each position tensor int64 and *equal*
    to eager's (float32 and float64: exact data); each float result float32 and within
    1e-4 of float64 eager, NaN/inf where eager float32 has them."""
    assert type(got) is type(ref32), f"{what}: {type(got)} vs {type(ref32)}"
    if isinstance(ref32, dict):
        assert list(got) == list(ref32), what
    outs, r64, r32 = _flat(got), _flat(ref64), _flat(ref32)
    assert len(outs) == len(r32), what
    for i, (o, a, b) in enumerate(zip(outs, r64, r32)):
        o = o.detach().cpu()
        assert o.shape == b.shape, f"{what}: result {i} shape {tuple(o.shape)} vs {tuple(b.shape)}"
        assert o.dtype == b.dtype, f"{what}: result {i} dtype {o.dtype} vs {b.dtype}"
        assert o.is_contiguous(), f"{what}: result {i} strided"
        if b.dtype == torch.int64:
            assert torch.equal(o, b), f"{what}: result {i}\n{o}\nvs eager\n{b}"
            assert torch.equal(o, a), f"{what}: result {i} vs float64 eager"
            continue
        assert torch.equal(torch.isnan(o), torch.isnan(b)), f"{what}: result {i} NaN placement"
        fin = torch.isfinite(b)
        assert torch.equal(o[~fin & ~torch.isnan(b)], b[~fin & ~torch.isnan(b)]), \
            f"{what}: result {i} inf placement"
        torch.testing.assert_close(o[fin].double(), a[fin].double(), atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"{what}: result {i}: {m}")


def _emulated(prog: Any, tens: list, srcs: list, monkeypatch: Any, calls: int = 3
              ) -> tuple[Any, list]:
    """(the general path's result, ``calls`` prepared results), emulated on the CPU."""
    _prepemu.install(monkeypatch)
    prog = _prepemu.runnable(prog)
    general = _gpuemu.run_program_emulated(prog, tens, srcs, monkeypatch)
    pr = _prepemu.prepare(prog, tens, srcs)
    assert pr is not None, "not prepared"
    outs = []
    for i in range(calls):
        outs.append(_prepemu.call(pr, tens, srcs))
        if i == 0:
            assert pr._ready, "no ready plan after the first call"
    return general, outs


def check_model(spec: dict, monkeypatch: Any, gpu_emulation: bool = True) -> None:
    """A drawn model through the CPU path (from_model, fused_class) and, emulated, the
    GPU's general path and prepared launches: positions exactly eager's."""
    what = f"{spec['form']} {spec}"
    model, inputs = make_case(spec)
    ref64, ref32 = references(model, inputs)
    check_result(_quiet(cupyfuse.from_model(model), *inputs), ref64, ref32,
                 what + " from_model")
    cls = cupyfuse.fused_class(ArgModel)
    twin = cls(spec["form"], spec["k"], spec["n"], spec["s"], spec.get("heads", 1)).eval()
    twin.load_state_dict(model.state_dict())
    check_result(_quiet(twin, *inputs), ref64, ref32, what + " fused_class")
    if not gpu_emulation:
        return
    prog, tens, srcs = _gpuemu.model_program(model, inputs)
    general, outs = _emulated(prog, tens, srcs, monkeypatch)
    for k, o in enumerate([general] + outs):
        name = what + (" general (emulated)" if k == 0 else f" prepared call {k} (emulated)")
        assert _prepemu.same_bits(_flat(o), _flat(general)), name
        check_result(o, ref64, ref32, name)


# ======================================================================================
# CPU path and emulated GPU paths: every form, drawn data
# ======================================================================================
@settings(max_examples=examples(150), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(hst.data())
def test_positions_match_eager_hypothesis(data):
    with pytest.MonkeyPatch.context() as mp:
        check_model(draw_spec(HypDraw(data.draw)), mp)


def _fixed_spec(form: str, n: int, batch: int, s: float, seed: int) -> dict:
    heads = 3 if form in SPLIT_FORMS else 1
    n = n * heads if form in SPLIT_FORMS else n
    seq = 3 if form in SEQ_FORMS else 0
    kinds = [ROW_KINDS[(seed + 5 * i) % len(ROW_KINDS)] for i in range(batch * max(seq, 1))]
    return {"form": form, "k": 3, "n": n, "batch": batch, "seq": seq, "heads": heads,
            "s": s, "rows": kinds, "seed": seed}


@pytest.mark.parametrize("form", sorted(ALL_FORMS))
def test_every_form(form, monkeypatch):
    """Each form at odd sizes: 3 and 17 features (and 1000 for a few), batch 1 and an
    odd batch, every row kind."""
    for n, batch, s, seed in [(17, 7, 1.0, 0), (3, 1, 0.0, 1), (17, 5, 0.0, 2)]:
        check_model(_fixed_spec(form, n, batch, s, seed), monkeypatch)
    if form in ("argmax", "max_both", "min_pair", "dict", "split_argmin_heads",
                "seq_argmax", "seq_rows_back"):
        check_model(_fixed_spec(form, 1000 if form not in SPLIT_FORMS else 340, 3, 0.0, 3),
                    monkeypatch)


@pytest.mark.parametrize("form", ["argmax", "argmin_keep", "max_both", "dict", "float"])
def test_one_feature(form, monkeypatch):
    """A (batch, 1) value: position 0 in every row (NaN or not)."""
    for batch, s in [(1, 0.0), (5, 1.0), (4, 0.0)]:
        spec = {"form": form, "k": 2, "n": 1, "batch": batch, "seq": 0, "heads": 1,
                "s": s, "rows": ["grid", "allnan", "pinf", "zeros", "nan"][:batch],
                "seed": batch}
        check_model(spec, monkeypatch)


def test_row_kinds_all_hit_exactly():
    """Each row kind on its own at 1000 features, both ops: the CPU path equals the rule
    written out (not only eager)."""
    for kind in ROW_KINDS:
        for form, want_max in (("argmax", True), ("argmin", False)):
            spec = {"form": form, "k": 2, "n": 1000, "batch": 2, "seq": 0, "heads": 1,
                    "s": 0.0, "rows": [kind, kind], "seed": 11}
            model, inputs = make_case(spec)
            got = _quiet(cupyfuse.from_model(model), *inputs)
            assert torch.equal(got, rule_rows(inputs[1], want_max)), (kind, form)


# ======================================================================================
# the generated kernels themselves (compiled as C++, real threads)
# ======================================================================================
CPP_CASES = [
    ("argmax", 1000, 5, 0.0), ("argmin", 1000, 3, 1.0), ("max_both", 33, 7, 0.0),
    ("min_pair", 17, 3, 0.0), ("dict", 3, 2, 1.0), ("argmax_keep", 1, 3, 0.0),
    ("split_argmax", 17, 3, 0.0), ("split_argmin_heads", 40, 5, 0.0),
    ("split_both", 34, 2, 1.0), ("seq_argmax", 17, 2, 0.0), ("seq_rows_back", 33, 2, 0.0),
    ("seq_pooled_and_rows", 17, 3, 0.0), ("float_arith", 33, 3, 1.0),
    ("split_argmax", 340, 2, 0.0)]


def test_generated_kernels_give_the_positions(tmp_path_factory, monkeypatch):
    """The level kernels codegen writes (the 64-bit keys combined over a block: strided
    threads, warp shuffles, then warp 0; a split reduction per group) compiled as C++ by
    tests/emu/cuda.py and run under execute.run_gpu: the positions eager gives."""
    from emu import cuda as _cuda_emu

    cases = []
    for i, (form, n, batch, s) in enumerate(CPP_CASES):
        spec = _fixed_spec(form, n, batch, s, 20 + i)
        if form in SPLIT_FORMS:
            spec["n"] = n   # (n given as the whole width here)
            spec["heads"] = 2 if n % 2 == 0 else 1
        model, inputs = make_case(spec)
        prog, tens, srcs = _gpuemu.model_program(model, inputs)
        cases.append((spec, model, inputs, _prepemu.runnable(prog), tens, srcs))
    kernels = _cuda_emu.build_or_skip([c[3] for c in cases], tmp_path_factory.mktemp("emu"),
                                      exact=True)
    for spec, model, inputs, prog, tens, srcs in cases:
        out = _gpuemu.run_program_emulated(prog, tens, srcs, monkeypatch, kernels)
        ref64, ref32 = references(model, inputs)
        check_result(out, ref64, ref32, f"{spec['form']} {spec['n']} (C++ kernels)")


def test_block_reduction_order_independent(tmp_path_factory, monkeypatch):
    """The key combine is a max of integers: the kernel of one row reduction gives the same
    position at every thread count (32 .. 1024) and for rows where the answer sits in
    every warp."""
    from emu import cuda as _cuda_emu

    spec = {"form": "argmax", "k": 1, "n": 1000, "batch": 4, "seq": 0, "heads": 1,
            "s": 0.0, "rows": ["const", "grid", "nans", "allnan"], "seed": 5}
    model, inputs = make_case(spec)
    m = inputs[1]
    for j, p in enumerate((999, 31, 500)):   # a unique maximum at the end, in warp 0 ...
        m[1, :] = 0.0
        m[1, p] = 7.0
        prog, tens, srcs = _gpuemu.model_program(model, [inputs[0], m])
        kernels = _cuda_emu.build_or_skip([prog], tmp_path_factory.mktemp(f"emu{j}"), exact=True)
        lv = next(lv for lv in codegen.plan(prog).levels if lv.kernel)
        want = rule_rows(m, True)
        for threads in (32, 64, 256, 1024):
            real = lv.threads
            lv.threads = threads
            try:
                out = _gpuemu.run_program_emulated(prog, tens, srcs, monkeypatch, kernels)
            finally:
                lv.threads = real
            assert torch.equal(out, want), (p, threads, out, want)


# ======================================================================================
# fused_linear: a tail returning positions
# ======================================================================================
LINEAR_TAILS = {
    "argmax": lambda h, m: (h + m).argmax(-1),
    "argmin_keep": lambda h, m: torch.argmin(h + m, dim=1, keepdim=True),
    "max[1]": lambda h, m: (h * 0.0 + m).max(-1)[1],
    "min.indices": lambda h, m: torch.min(h + m, 1).indices,
    "split_argmax": lambda h, m: (h + m).view(-1, h.shape[1] // 3, 3).argmax(-1),
    "float": lambda h, m: (h + m).argmax(-1).float() + h.sum(-1),
}


def _linear_case(n: int, batch: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (batch, 4), generator=g).float()
    w = torch.randint(-2, 3, (n, 4), generator=g).float()
    b = torch.randint(-2, 3, (n,), generator=g).float()
    m = torch.tensor([_row(ROW_KINDS[(seed + i) % len(ROW_KINDS)], n, g)
                      for i in range(batch)], dtype=torch.float32)
    return x, w, b, m


@pytest.mark.parametrize("name", sorted(LINEAR_TAILS))
@pytest.mark.parametrize("n,batch", [(3, 1), (33, 5), (999, 3)])
def test_fused_linear_positions(name, n, batch, monkeypatch):
    tail = LINEAR_TAILS[name]
    x, w, b, m = _linear_case(n, batch, n + batch)
    ref32 = tail(x @ w.t() + b, m)
    ref64 = tail(x.double() @ w.double().t() + b.double(), m.double())
    check_result(cupyfuse.fused_linear(x, w, b, tail, m), ref64, ref32, f"{name} cpu")
    prog = runner._function_program(tail, x, n, True, [m])
    general, outs = _emulated(prog, [x, m], [w, b] + list(prog.sources[2:]), monkeypatch)
    for k, o in enumerate([general] + outs):
        assert _prepemu.same_bits(o, general), f"{name} call {k}"
        check_result(o, ref64, ref32, f"{name} emulated call {k}")


# ======================================================================================
# results: empty batches, the specialised call's allocation
# ======================================================================================
@pytest.mark.parametrize("form", ["argmax", "max_both", "dict", "seq_argmax", "split_argmax"])
def test_empty_batch(form):
    spec = _fixed_spec(form, 6, 1, 1.0, 0)
    model, inputs = make_case(spec)
    empty = [t[:0] for t in inputs]
    ref = _quiet(model, *empty)
    got = _quiet(cupyfuse.from_model(model), *empty)
    assert type(got) is type(ref)
    for o, r in zip(_flat(got), _flat(ref)):
        assert o.shape == r.shape and o.dtype == r.dtype, (form, o, r)


def test_empty_batch_fused_linear_seq():
    x, m = torch.zeros(0, 3, 4), torch.zeros(0, 3, 6)
    w, b = torch.ones(6, 4), torch.zeros(6)
    got = cupyfuse.fused_linear(x, w, b, lambda h, e: (h + e).argmax(-1), m)
    assert got.shape == (0, 3) and got.dtype == torch.int64


def test_specialised_call_allocates_int64_results(monkeypatch):
    """fastpath._launch (the specialised call's allocation) gives the int64 results
    int64 buffers, as Prepared.__call__ does (CPU: the device made the CPU, no launch)."""
    monkeypatch.setattr(prepared, "_torch_device", lambda dev: torch.device("cpu"))
    pr = SimpleNamespace(out_shape=(3,), more=((1, (3, 5)), (2, (3, 1))),
                         res_long=(True, False, True), outs_type=tuple)
    w = fastpath._Writer()
    fastpath._launch(w, pr, (None, None, None, None, []), 0, 0, 0, ({}, {}))
    out = w.finish("", "test")()
    assert [o.dtype for o in out] == [torch.int64, torch.float32, torch.int64]
    assert [tuple(o.shape) for o in out] == [(3,), (3, 5), (3, 1)]


def test_prepared_buffers_and_kernel_stores():
    """The plan: index results are int64 buffers of the prepared launches
    (``Prepared.res_long``), the kernels store them through ``long long*`` and convert;
    no GEMM epilogue computes positions."""
    spec = _fixed_spec("logits_pred", 17, 3, 1.0, 0)
    model, inputs = make_case(spec)
    prog, tens, srcs = _gpuemu.model_program(model, inputs)
    assert prog.index_results() == (False, True)
    pl = codegen.plan(prog)
    text = "\n".join(lv.kernel for lv in pl.levels if lv.kernel)
    assert "long long* __restrict__ out" in text and "= (long long)v" in text
    assert "cf_argmax_key" in text and "cf_block_combine<unsigned long long>" in text
    assert all(lv.epi is None for lv in pl.levels if any(
        t in prog.index_values() for t in lv.targets))
    with pytest.MonkeyPatch.context() as mp:
        _prepemu.install(mp)
        pr = _prepemu.prepare(_prepemu.runnable(prog), tens, srcs)
        assert pr is not None and pr.res_long == (False, True)


# ======================================================================================
# refusals: the op and its line
# ======================================================================================
class Refused(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(4, 6)
        self.emb = nn.Embedding(6, 3)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.fc(x)
        f = self.form
        if f == "flat":
            return h.argmax()
        if f == "torch_flat":
            return torch.argmin(h)
        if f == "batch":
            return h.argmax(0)
        if f == "batch_max":
            return torch.max(h, 0)[1]
        if f == "add":
            return h.argmax(-1) + 1
        if f == "mul_float":
            return h.argmax(-1) * 0.5
        if f == "compare":   # (with a number, a target or positions it fuses)
            return (h.argmax(-1, keepdim=True) == h).float()
        if f == "one_hot":
            return F.one_hot(h.argmax(-1), 6).float()
        if f == "gather":
            return h.gather(1, h.argmax(-1, keepdim=True))
        if f == "embedding":
            return self.emb(h.argmax(-1))
        if f == "take_along":
            return torch.take_along_dim(h, h.argmax(-1, keepdim=True), dim=1)
        if f == "index_of":
            return h.argmax(-1)[0]
        if f == "int32":
            return h.argmax(-1).int()
        if f == "double":
            return h.argmax(-1).double()
        if f == "transposed":   # (x of (batch, seq, 4): h.transpose(1, 2) is (batch, 6, seq))
            return h.transpose(1, 2).argmax(1)
        if f == "transposed_max":
            return h.transpose(1, 2).max(1)[1]
        if f == "stacked":
            return torch.stack([h, h * 2.0]).argmax(0)
        if f == "bool":
            return (h > 0).argmax(-1)
        if f == "dim_tuple":
            return h.argmax((0, 1))
        raise AssertionError(f)


REFUSED = {
    "flat": ("`.argmax()`", "without a dim"),
    "torch_flat": ("`argmin`", "without a dim"),
    "batch": ("`.argmax()`", "batch dimension"),
    "batch_max": ("max:", "batch dimension"),
    "add": ("`add`", "positions"),
    "mul_float": ("`mul`", "positions"),
    "compare": ("`eq`", "positions"),
    "one_hot": ("`one_hot`", "positions"),
    "gather": ("`.gather()`", "positions"),
    "embedding": ("`emb", "positions"),
    "take_along": ("`take_along_dim`", "positions"),
    "index_of": ("`getitem`", "positions"),
    "int32": ("`.int()`", "positions"),
    "double": ("`.double()`", "positions"),
    "transposed": ("`.argmax()`", "transposed"),
    "transposed_max": ("`getitem[1]`", "indices of max/min of this value"),
    "stacked": ("`.argmax()`", "stack"),
    "bool": ("`.argmax()`", "boolean"),
    "dim_tuple": ("`.argmax()`", "not an int"),
}


@pytest.mark.parametrize("form", sorted(REFUSED))
def test_refusals_name_the_op_and_line(form):
    model = Refused(form)
    op, why = REFUSED[form]
    x = torch.randn(2, 5, 4) if form.startswith("transposed") else torch.randn(3, 4)
    with pytest.raises(TailError) as ei:
        _quiet(cupyfuse.from_model(model), x)
    msg = str(ei.value)
    assert op in msg and why in msg, msg
    assert "test_argmax.py" in msg and "in forward" in msg, msg


def test_refused_over_the_sequence():
    class Seq(nn.Module):
        def __init__(self, form: str) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 5)
            self.form = form

        def forward(self, x: torch.Tensor) -> Any:
            h = self.fc(x)
            if self.form == "argmax":
                return h.argmax(1)
            v, i = torch.max(h, 1)
            return v, i

    for form, op in (("argmax", "`.argmax()`"), ("max", "`max`")):
        with pytest.raises(TailError, match="leading \\(sequence\\) dim") as ei:
            _quiet(cupyfuse.from_model(Seq(form)), torch.randn(2, 3, 4))
        assert op in str(ei.value) and "test_argmax.py" in str(ei.value)


def test_unused_indices_stay_uncomputed():
    """``values, _ = h.max(-1)``: the indices are not computed (no argmax node)."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            v, _ = self.fc(x).max(-1)
            return v

    prog = program_of(cupyfuse.from_model(M()), torch.randn(2, 4))
    assert not prog.index_values()
    assert not any(n.op in ("argmax", "argmin") for n in prog.nodes)


def test_wider_than_float_positions_refused():
    """Positions are float32 numbers inside a program: over more than 2**24 features the
    Builder refuses (checked on the Builder: such a Linear is out of reach of a test)."""
    from cupyfuse.ir.program import BATCH, Builder, MAX_INDEX_WIDTH

    b = Builder()
    v = b.input(0, (BATCH, MAX_INDEX_WIDTH + 1))
    with pytest.raises(TailError, match="exact up to"):
        b.argreduce("argmax", v, 1)
    v = b.input(1, (BATCH, MAX_INDEX_WIDTH))
    assert b.p.nodes[b.argreduce("argmin", v, 1)].dims == (BATCH,)


# ======================================================================================
# GPU (H100): the general path, prepared launches, the specialised call, functions
# ======================================================================================
def _runner(fm: Any) -> Any:
    d = fm.__dict__
    return d["_runner"] if "_runner" in d else d["_cupyfuse_runner"]


def _gpu_model(spec: dict) -> None:
    what = f"{spec['form']} {spec}"
    model, inputs = make_case(spec)
    ref64, ref32 = references(model, inputs)
    model = model.cuda()
    cin = [t.cuda() for t in inputs]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "_try_prepare", lambda *a, **k: None)
        general = _quiet(cupyfuse.from_model(model), *cin)
    check_result(general, ref64, ref32, what + " general path")
    fm = cupyfuse.from_model(model)
    ran = []
    real = execute.run_gpu

    def counting(*a: Any, **k: Any) -> Any:
        ran.append(1)
        return real(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(execute, "run_gpu", counting)
        outs = [_quiet(fm, *cin) for _ in range(4)]
    torch.cuda.synchronize()
    assert not ran, f"{what}: a call ran the general path (not prepared)"
    for k, o in enumerate(outs):
        assert all(t.is_cuda for t in _flat(o)), what
        check_result(o, ref64, ref32, f"{what} prepared call {k}")
    assert _runner(fm)._spec is not None, f"{what}: no specialised call after 4 calls"
    cls = cupyfuse.fused_class(ArgModel)
    twin = cls(spec["form"], spec["k"], spec["n"], spec["s"], spec.get("heads", 1))
    twin = twin.eval().cuda()
    twin.load_state_dict(model.state_dict())
    for k in range(4):
        check_result(_quiet(twin, *cin), ref64, ref32, f"{what} fused_class call {k}")


@gpu
@needs_gpu
def test_torch_cuda_semantics():
    """torch's CUDA argmax/argmin/max/min follow the same rule as its CPU ones (and the
    kernels)."""
    _check_torch_semantics("cuda")


@pytest.mark.parametrize("form", sorted(ALL_FORMS))
@pytest.mark.parametrize("n,batch", [(17, 1), (33, 7), (1000, 5), (3, 300)])
@gpu
@needs_gpu
def test_gpu_every_form(form, n, batch):
    """General path, prepared launches (skinny GEMM with the tail in its launch at small
    batches; the tensor-core engine at 300 rows), specialised call, fused_class."""
    spec = _fixed_spec(form, n if form not in SPLIT_FORMS else max(n // 3, 1), batch, 1.0,
                       n + batch)
    spec["rows"] = [ROW_KINDS[(n + i) % len(ROW_KINDS)] for i in range(len(spec["rows"]))]
    spec["k"] = 4   # (the engine's prepared launches need K % 4 == 0)
    _gpu_model(spec)


@pytest.mark.parametrize("seed", range(40))
@gpu
@needs_gpu
def test_gpu_drawn(seed):
    _gpu_model(draw_spec(RandDraw(seed)))


@pytest.mark.parametrize("name", sorted(LINEAR_TAILS))
@pytest.mark.parametrize("n,batch", [(3, 1), (33, 5), (999, 3), (96, 256)])
@gpu
@needs_gpu
def test_gpu_fused_linear(name, n, batch):
    """fused_linear with a tail returning positions: its prepared launch (and the
    specialised call built after repeated calls) on torch tensors; CuPy operands give a
    CuPy int64 array."""
    tail = LINEAR_TAILS[name]
    x, w, b, m = _linear_case(n, batch, n + batch)
    ref32 = tail(x @ w.t() + b, m)
    ref64 = tail(x.double() @ w.double().t() + b.double(), m.double())
    xc, wc, bc, mc = x.cuda(), w.cuda(), b.cuda(), m.cuda()
    outs = [cupyfuse.fused_linear(xc, wc, bc, tail, mc) for _ in range(4)]
    keys = [k for k in runner._fast_fn if k[0] is tail]
    assert keys and runner._fast_fn[keys[-1]] is not None, "no prepared launch was made"
    torch.cuda.synchronize()
    for k, o in enumerate(outs):
        check_result(o, ref64, ref32, f"{name} call {k}")
    import cupy

    got = cupyfuse.fused_linear(cupy.asarray(xc), cupy.asarray(wc), cupy.asarray(bc), tail,
                                cupy.asarray(mc))
    assert isinstance(got, cupy.ndarray)
    check_result(torch.as_tensor(got, device="cuda"), ref64, ref32, f"{name} cupy")


def _plain_argmax(h: torch.Tensor) -> torch.Tensor:
    return h.argmax(-1)


def _plain_max_indices(h: torch.Tensor) -> torch.Tensor:
    return torch.max(h, 1, keepdim=True)[1]


@pytest.mark.parametrize("tail", [_plain_argmax, _plain_max_indices])
@pytest.mark.parametrize("batch", [1, 7, 256])
@gpu
@needs_gpu
def test_gpu_fused_linear_specialised(tail, batch):
    """fused_linear(x, w, b, tail) without extras: prepared launch, then the specialised
    call (fastpath.build_function) built on the repeated call and used; positions equal
    eager's (integer data: exact ties)."""
    g = torch.Generator().manual_seed(batch)
    x = torch.randint(-2, 3, (batch, 64), generator=g).float()
    w = torch.randint(-2, 3, (48, 64), generator=g).float()
    b = torch.randint(-2, 3, (48,), generator=g).float()
    ref32 = tail(x @ w.t() + b)
    ref64 = tail(x.double() @ w.double().t() + b.double())
    xc, wc, bc = x.cuda(), w.cuda(), b.cuda()
    for k in range(4):
        check_result(cupyfuse.fused_linear(xc, wc, bc, tail), ref64, ref32, f"call {k}")
    spec = runner._fn_specs.get(tail)
    assert spec is not None, "no specialised call after repeated calls"
    assert "I64" in spec.source
    calls = []

    def counting(*a: Any) -> Any:
        r = spec(*a)
        calls.append(r is not None)
        return r

    runner._fn_specs[tail] = counting
    try:
        check_result(cupyfuse.fused_linear(xc, wc, bc, tail), ref64, ref32, "specialised")
    finally:
        runner._fn_specs[tail] = spec
    assert calls == [True]


@gpu
@needs_gpu
def test_gpu_poisoned_results_fully_written():
    """Every result element written: results start as NaN (float) / -1 (int64)."""
    from cupyfuse import interop

    old = interop.poison_outputs
    interop.poison_outputs = True
    try:
        for form in ("argmax", "dict", "max_pair", "split_both", "seq_rows_back"):
            for batch in (1, 6, 300):
                spec = _fixed_spec(form, 33, batch, 1.0, batch)
                spec["k"] = 4
                model, inputs = make_case(spec)
                ref64, ref32 = references(model, inputs)
                fm = cupyfuse.from_model(model.cuda())
                for k in range(3):
                    check_result(_quiet(fm, *[t.cuda() for t in inputs]), ref64, ref32,
                                 f"{form} {batch} poisoned call {k}")
    finally:
        interop.poison_outputs = old


@gpu
@needs_gpu
def test_gpu_specialised_call_used():
    """The specialised call (fastpath) of a module returning logits and positions runs
    (returns a result) on later calls."""
    spec = _fixed_spec("logits_pred", 33, 8, 1.0, 9)
    model, inputs = make_case(spec)
    ref64, ref32 = references(model, inputs)
    fm = cupyfuse.from_model(model.cuda())
    cin = [t.cuda() for t in inputs]
    for _ in range(4):
        _quiet(fm, *cin)
    spec_fn = _runner(fm)._spec
    assert spec_fn is not None and "I64" in spec_fn.source
    calls = []

    def counting(outer, args):
        r = spec_fn(outer, args)
        calls.append(r is not None)
        return r

    _runner(fm)._spec = counting
    for k in range(3):
        check_result(_quiet(fm, *cin), ref64, ref32, f"specialised call {k}")
    assert calls == [True, True, True]
