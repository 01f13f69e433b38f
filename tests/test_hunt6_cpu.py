"""Findings of the hunt for silent wrong answers in the survey-fix features (branch hunt6,
CPU only). Each test is the minimal model of one finding, as a strict xfail: it fails
today (a refusal with a misleading message) and passes once fixed; findings 1-4 (wrong
answers) are fixed by refusing, and their tests check the refusal.

Wrong answers (the key findings):
1. An integer input compared with an integer buffer (`ids == self.pad_id`) is compared in
   float32: integers past 2**24 compare equal where torch's int64 comparison does not.
2. Integer arithmetic of an integer input with an integer buffer (`ids - self.off`) is done
   in float32 instead of being refused (`ids - 1` is refused as integer arithmetic).
3. `torch.full_like` / `ones_like` / `zeros_like` of an integer input make a float value
   of the fill number: torch makes an int64 tensor (0.5 truncated to 0; comparisons with
   it exact in int64).
4. `torch.full_like` / `ones_like` of a boolean tensor (a comparison, or a bool mask input)
   make a float value of the fill number: torch makes a bool tensor (True for any nonzero
   fill; `mask + ones_like(mask)` is a logical or). Older than today's features (the
   *_like ops of 2026-11-23), found here.

Refusals with a misleading message (valid models):
5. A whole flatten of an input spelled `x.flatten(1, 2)` / `x.flatten(-2)` (3-D x) or
   `x.view(*x.shape[:1], -1)` is refused as "flattening some of an input's dims" (it
   flattens all of them; `x.flatten(1, -1)` converts).
6. A forward `forward(self, x, *rest)` called with x alone is refused as "takes more
   tensor arguments than the 1 given".
7. `h.view(-1, F).max(1)[0]` (values only, along F) is refused as "a boolean or integer
   result, or max/min indices".
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import cupyfuse
from cupyfuse import TailError
from _tailgen import assert_matches


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
    """Fixed by refusing (torch computes in int64 / bool there): a TailError naming why."""
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
    # torch: row 1 (16777216 != 16777217) is zeroed; fused: 16777216.0 == float32(16777217)
    # (= 16777216.0), so row 1 keeps fc(x)[1]
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
    # torch: 16777217 - 16777216 = 1 (int64) -> row 0 is fc(x)[0] + 1; fused: + 0
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
    # torch: full_like(int64, 0.5) is 0 -> all zeros; fused: 0.5 * fc(x)
    torch.manual_seed(0)
    _refused(IntFullLike(), torch.randn(2, 3), torch.tensor([[1], [0]]), match='of an integer tensor: torch makes an int64')


class IntFullLikeCompare(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x, ids):
        return self.fc(x) * (ids == torch.full_like(ids, 16777217)).float()


def test_int_input_compared_with_its_full_like():
    # torch: row 1 (16777216) is zeroed; fused keeps it (both round to 16777216.0)
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
    # torch: h * True = h; fused: 3 * h
    torch.manual_seed(0)
    _refused(BoolFullLike(), torch.randn(3, 3), match='of a boolean tensor: torch makes a bool')


class BoolOnesLikeAdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x, mask):
        return self.fc(x) + (mask + torch.ones_like(mask)).float()   # bool + bool: or


def test_bool_mask_plus_its_ones_like():
    # torch: True + True = True -> + 1 everywhere; fused: + 2 where the mask is True
    torch.manual_seed(0)
    _refused(BoolOnesLikeAdd(), torch.randn(3, 3), torch.tensor([[True, False], [False, True],
                                                             [True, True]]), match='of a boolean tensor')


# ======================================================================================
# 5-7. refusals of valid models with a misleading message
# ======================================================================================
class WholeFlatten(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.fc = nn.Linear(12, 5)

    def forward(self, x):
        if self.form == "flatten_1_2":
            x = x.flatten(1, 2)
        elif self.form == "flatten_m2":
            x = x.flatten(-2)
        else:
            x = x.view(*x.shape[:1], -1)
        return self.fc(x).log_softmax(1)


@pytest.mark.xfail(strict=True, reason="hunt6 #5: whole flattens refused as partial ones")
@pytest.mark.parametrize("form", ["flatten_1_2", "flatten_m2", "view_star_shape"])
def test_whole_flatten_spellings(form):
    # each flattens every dim after the batch of a (batch, 3, 4) input, like x.flatten(1)
    # (which converts); refused: "flattening some of an input's dims into its features"
    torch.manual_seed(0)
    _run(WholeFlatten(form), torch.randn(3, 3, 4))


class VarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, *rest):
        return torch.relu(self.fc(x))


@pytest.mark.xfail(strict=True, reason="hunt6 #6: *args forward refused as needing more inputs")
def test_forward_with_varargs_called_with_x_alone():
    # refused: "the forward takes more tensor arguments than the 1 given"
    torch.manual_seed(0)
    _run(VarArgs(), torch.randn(2, 4))


class RowsMaxValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        return self.fc(x).view(-1, 4).max(1)[0]


@pytest.mark.xfail(strict=True, reason="hunt6 #7: max values of a rows view refused as indices")
def test_max_values_of_rows_view():
    # refused: "a boolean or integer result, or max/min indices, of a (batch * seq..., F)
    # view"; the indices are not read and the max is along F
    torch.manual_seed(0)
    try:
        _run(RowsMaxValues(), torch.randn(3, 2, 6))
    except TailError as e:
        assert "indices" not in str(e), str(e)
        raise
