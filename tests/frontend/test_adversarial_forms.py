"""Adversarial forms of integer and boolean values, flattens, variadic forwards and
values-only max/min (CPU only). Each test is a minimal model of one form; forms 1-4 would
give wrong answers if computed in float32, so they are refused, and their tests check the
refusal; forms 5-7 are valid models that convert, and their tests check the result
against float64.

Refused (computed in float32 they would be silently wrong):
1. An integer input compared with an integer buffer (`ids == self.pad_id`): in float32,
   integers past 2**24 compare equal where torch's int64 comparison does not.
2. Integer arithmetic of an integer input with an integer buffer (`ids - self.off`): in
   float32 it loses the low bits (`ids - 1` is refused as integer arithmetic too).
3. `torch.full_like` / `ones_like` / `zeros_like` of an integer input: torch makes an int64
   tensor (0.5 truncated to 0; comparisons with it exact in int64), not a float value of
   the fill number.
4. `torch.full_like` / `ones_like` of a boolean tensor (a comparison, or a bool mask input):
   torch makes a bool tensor (True for any nonzero fill; `mask + ones_like(mask)` is a
   logical or), not a float value of the fill number.

Valid models that convert (no misleading refusal):
5. A whole flatten of an input spelled `x.flatten(1, 2)` / `x.flatten(-2)` (3-D x) or
   `x.view(*x.shape[:1], -1)` flattens all of its dims, like `x.flatten(1, -1)`: read as
   (batch, P) rows, not refused as "flattening some of an input's dims".
6. A forward `forward(self, x, *rest)` called with x alone: an empty `*rest` / `**kwargs`
   that the trace does not read is nothing (not "takes more tensor arguments than the 1
   given"); arguments passed through them are refused saying so.
7. `h.view(-1, F).max(1)[0]` (values only, along F): the values are a (batch * seq, ) view
   of rows, not "a boolean or integer result, or max/min indices".
8. `fused_linear(x, w, b, tail, True)` raises a TypeError naming `fused_linear` and the
   argument (a bool extra, a bool tail, a non-tensor operand).
"""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import cupyfuse
from cupyfuse import TailError
from hypothesis import assume, given, settings, strategies as st
from gen.tails import assert_matches
from helpers import program_of
from helpers import examples


def _run(model: nn.Module, *inputs: torch.Tensor) -> None:
    """The fused model against a float64 copy (integer and bool inputs stay as they are)."""
    m64 = copy.deepcopy(model).double()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        ref64 = m64(*[t.double() if t.is_floating_point() else t for t in inputs])
        ref32 = copy.deepcopy(model)(*inputs)
        out = cupyfuse.from_model(model)(*inputs)
    assert_matches(out, ref64, ref32, what=type(model).__name__)


def _refused(model: nn.Module, *inputs: torch.Tensor, match: str) -> None:
    """Refused (torch computes in int64 / bool there): a TailError naming why."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        with pytest.raises(TailError, match=match):
            cupyfuse.from_model(model)(*inputs)


# ======================================================================================
# 1-2. an integer input with an integer buffer
# ======================================================================================
class IntBufCompare(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("pad_id", torch.tensor(16777217))   # int64, 2**24 + 1

    def forward(self, x, ids):
        return self.fc(x) * (ids == self.pad_id).float()


def test_int_input_compared_with_int_buffer():
    # torch: row 1 (16777216 != 16777217) is zeroed; in float32: 16777216.0 ==
    # float32(16777217) (= 16777216.0), so row 1 would keep fc(x)[1]
    torch.manual_seed(0)
    _refused(IntBufCompare(), torch.randn(2, 3), torch.tensor([[16777217], [16777216]]), match='int64 tensor `pad_id`')


class IntBufSub(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.register_buffer("off", torch.tensor(16777216))   # int64, 2**24

    def forward(self, x, ids):
        return self.fc(x) + (ids - self.off).float()


def test_int_input_arithmetic_with_int_buffer():
    # torch: 16777217 - 16777216 = 1 (int64) -> row 0 is fc(x)[0] + 1; in float32: + 0
    torch.manual_seed(0)
    _refused(IntBufSub(), torch.randn(2, 3), torch.tensor([[16777217], [16777216]]), match='int64 tensor `off`')


# ======================================================================================
# 3. *_like of an integer input
# ======================================================================================
class IntFullLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x, ids):
        return self.fc(x) * torch.full_like(ids, 0.5)   # int64 zeros in torch


def test_full_like_of_int_input():
    # torch: full_like(int64, 0.5) is 0 -> all zeros; a float fill: 0.5 * fc(x)
    torch.manual_seed(0)
    _refused(IntFullLike(), torch.randn(2, 3), torch.tensor([[1], [0]]), match='of an integer tensor: torch makes an int64')


class IntFullLikeCompare(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x, ids):
        return self.fc(x) * (ids == torch.full_like(ids, 16777217)).float()


def test_int_input_compared_with_its_full_like():
    # torch: row 1 (16777216) is zeroed; float32 would keep it (both round to 16777216.0)
    torch.manual_seed(0)
    _refused(IntFullLikeCompare(), torch.randn(2, 3), torch.tensor([[16777217], [16777216]]), match='of an integer tensor')


# ======================================================================================
# 4. *_like of a boolean tensor
# ======================================================================================
class BoolFullLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        h = self.fc(x)
        return h * torch.full_like(h > 0, 3)   # a bool tensor of True in torch


def test_full_like_of_bool_tensor():
    # torch: h * True = h; a float fill: 3 * h
    torch.manual_seed(0)
    _refused(BoolFullLike(), torch.randn(3, 3), match='of a boolean tensor: torch makes a bool')


class BoolOnesLikeAdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x, mask):
        return self.fc(x) + (mask + torch.ones_like(mask)).float()   # bool + bool: or


def test_bool_mask_plus_its_ones_like():
    # torch: True + True = True -> + 1 everywhere; a float fill: + 2 where the mask is True
    torch.manual_seed(0)
    _refused(BoolOnesLikeAdd(), torch.randn(3, 3), torch.tensor([[True, False], [False, True],
                                                             [True, True]]), match='of a boolean tensor')


# ======================================================================================
# 5-7. valid models that convert (no misleading refusal)
# ======================================================================================
class WholeFlatten(nn.Module):
    def __init__(self, form: str, k: int = 12):
        super().__init__()
        self.form = form
        self.fc = nn.Linear(k, 5)
        self.flat = nn.Flatten(1, 2) if form == "module_1_2" else nn.Flatten(-2, -1)

    def forward(self, x):
        if self.form == "flatten_1_2":
            x = x.flatten(1, 2)
        elif self.form == "flatten_m2":
            x = x.flatten(-2)
        elif self.form == "view_star_shape":
            x = x.view(*x.shape[:1], -1)
        elif self.form == "reshape_star_shape":
            x = x.contiguous().reshape(*x.shape[0:1], -1)
        elif self.form == "torch_flatten_m2_2":
            x = torch.flatten(x, -2, 2)
        else:
            x = self.flat(x)
        return self.fc(x).log_softmax(1)


_FLAT_FORMS = ["flatten_1_2", "flatten_m2", "view_star_shape", "reshape_star_shape",
               "torch_flatten_m2_2", "module_1_2", "module_m2"]


@pytest.mark.parametrize("form", _FLAT_FORMS)
@pytest.mark.parametrize("batch", [1, 3])
def test_whole_flatten_spellings(form, batch):
    # each flattens every dim after the batch of a (batch, 3, 4) input, like x.flatten(1)
    # (not "flattening some of an input's dims into its features")
    torch.manual_seed(0)
    x = torch.randn(batch, 3, 4)
    x[0, 1, 2] = float("nan") if batch > 1 else x[0, 1, 2]
    _run(WholeFlatten(form), x)
    fm = cupyfuse.from_model(WholeFlatten(form))
    with torch.no_grad():
        assert program_of(fm, torch.randn(batch, 3, 4)).flat_inputs, form


@settings(max_examples=examples(60), deadline=None)
@given(dims=st.lists(st.integers(1, 5), min_size=2, max_size=3), batch=st.integers(1, 4),
       seed=st.integers(0, 2 ** 16), nan=st.booleans(),
       form=st.sampled_from(["flatten_1_2", "flatten_m2", "view_star_shape",
                             "reshape_star_shape", "torch_flatten_m2_2"]))
def test_whole_flatten_drawn(dims, batch, seed, nan, form):
    """flatten(1, 2), flatten(-2) and flatten(-2, 2) of a 3-dim input are whole flattens
    (read as (batch, prod(dims)) rows); of a 4-dim one they are not (they keep dim 1):
    those run on a (batch, seq..., features) input or are refused naming a line; every
    converted one matches float64."""
    # (a 4-dim input with a trailing 1 reads as (batch, seq, seq, 1 feature): not here)
    assume(len(dims) == 2 or dims[-1] > 1)
    torch.manual_seed(seed)
    x = torch.randn(batch, *dims) * 3
    if nan:
        x.view(batch, -1)[batch - 1, 0] = float("inf")
    whole = form not in ("flatten_1_2", "flatten_m2", "torch_flatten_m2_2") or len(dims) == 2
    k = {"flatten_1_2": lambda t: t.flatten(1, 2), "flatten_m2": lambda t: t.flatten(-2),
         "torch_flatten_m2_2": lambda t: torch.flatten(t, -2, 2)}.get(
             form, lambda t: t.reshape(t.shape[0], -1))(x).shape[-1]
    m = WholeFlatten(form, k)
    if whole:
        _run(m, x)
        return
    try:
        _run(m, x)
    except TailError as e:   # (several leading dims: refused where an op needs one)
        assert "\n  at " in str(e) and "test_adversarial_forms.py" in str(e), str(e)


class PartialThenWhole(nn.Module):
    """One use flattens x whole, another keeps its dims: no flat reading (x is a
    (batch, seq, features) input), so flatten(1, 2) is refused as a partial flatten."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 4)
        self.g = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x.flatten(1, 2)).sum(1, keepdim=True) + self.g(x).mean((1, 2)).unsqueeze(1)


def test_whole_flatten_with_another_use_stays_refused():
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        with pytest.raises(TailError, match="flattening"):
            cupyfuse.from_model(PartialThenWhole())(torch.randn(2, 3, 4))


class VarArgs(nn.Module):
    def __init__(self, reads: bool = False):
        super().__init__()
        self.reads = reads
        self.fc = nn.Linear(4, 3)

    def forward(self, x, *rest, **kwargs):
        h = torch.relu(self.fc(x))
        return h + rest[0] if self.reads else h


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_forward_with_varargs_called_with_x_alone(batch):
    # not refused as "the forward takes more tensor arguments than the 1 given"
    torch.manual_seed(0)
    x = torch.randn(batch, 4)
    x[-1, 0] = float("nan")
    _run(VarArgs(), x)
    m = VarArgs()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        ref = m(x)
        torch.testing.assert_close(cupyfuse.from_model(m)(x=x), ref, equal_nan=True)
        cls = cupyfuse.fused_class(VarArgs)
        torch.manual_seed(1)
        a = VarArgs()
        torch.manual_seed(1)
        b = cls()
        torch.testing.assert_close(b(x), a(x), equal_nan=True)


def test_forward_with_varargs_refusals():
    """Arguments passed through *rest / **kwargs, or *rest read by the trace: refused
    saying so (torch.fx traced each as one input)."""
    x = torch.randn(2, 4)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        fm = cupyfuse.from_model(VarArgs())
        for args, kw in [((x, torch.randn(2, 3)), {}), ((x, 0.5), {}), ((x, None), {})]:
            with pytest.raises(TailError, match="passes arguments through the forward's `\\*rest`"):
                fm(*args, **kw)
        with pytest.raises(TailError, match="passes 'scale' through the forward's `\\*\\*kwargs`"):
            fm(x, scale=torch.randn(2, 3))
        with pytest.raises(TailError, match="reads `rest`"):
            cupyfuse.from_model(VarArgs(reads=True))(x)


class RowsMaxValues(nn.Module):
    def __init__(self, form: str = "getitem"):
        super().__init__()
        self.form = form
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        r = self.fc(x).view(-1, 4)
        if self.form == "getitem":
            return r.max(1)[0]
        if self.form == "values":
            return torch.min(r, dim=-1).values * 2
        if self.form == "unpack":
            v, _ = r.max(dim=1, keepdim=True)
            return torch.tanh(v)
        if self.form == "view_back":
            return r.max(1)[0].view(x.shape[0], x.shape[1])
        v, i = r.max(1)
        return v + i


@pytest.mark.parametrize("form", ["getitem", "values", "unpack", "view_back"])
@pytest.mark.parametrize("shape", [(3, 2, 6), (1, 1, 6), (1, 5, 6), (4, 3, 6)])
def test_max_values_of_rows_view(form, shape):
    # not refused as "a boolean or integer result, or max/min indices, of a (batch *
    # seq..., F) view": the indices are not read and the max is along F
    torch.manual_seed(0)
    x = torch.randn(shape)
    if shape[0] * shape[1] > 2:
        x[0, -1, 2] = float("nan")
        x[-1, 0, 1] = float("inf")
    _run(RowsMaxValues(form), x)


def test_max_indices_of_rows_view_refused():
    # (the indices convert, tests/frontend/test_argmax.py; arithmetic on them does not)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        with pytest.raises(TailError, match="uses the positions argmax/argmin"):
            cupyfuse.from_model(RowsMaxValues("indices"))(torch.randn(2, 3, 6))


# ======================================================================================
# 8. fused_linear with a bool or another non-tensor: a TypeError naming the op
# ======================================================================================
def test_fused_linear_bool_arguments_name_the_op():
    x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    with pytest.raises(TypeError, match="^fused_linear: tail must be a function"):
        cupyfuse.fused_linear(x, w, b, True)
    with pytest.raises(TypeError, match="^fused_linear: extra\\[0\\] is a bool \\(True\\)"):
        cupyfuse.fused_linear(x, w, b, lambda h, f: h * f, True)
    with pytest.raises(TypeError, match="^fused_linear: extra\\[1\\] is a bool"):
        cupyfuse.fused_linear(x, w, b, lambda h, a, f: h * a * f, 2.0, np.bool_(False))
    with pytest.raises(TypeError, match="^fused_linear: bias is a bool"):
        cupyfuse.fused_linear(x, w, True)
    with pytest.raises(TypeError, match="^fused_linear: extra\\[0\\] must be a torch tensor"):
        cupyfuse.fused_linear(x, w, b, lambda h, f: h * f, "a")
