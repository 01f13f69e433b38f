"""Torch functions called with their operands by keyword (``torch.sum(input=h, dim=1)``,
``torch.add(input=h, other=1.0)``): the trace's calls are normalised to positional
operands (trace.keyword_prefix), so each converts and matches eager (no IndexError
from the translators)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cupyfuse
from cupyfuse.frontend.trace import keyword_prefix
from helpers import quiet, refs

FORMS = {
    "sum": lambda h: torch.sum(input=h, dim=1),
    "softmax": lambda h: torch.softmax(input=h, dim=-1),
    "mean_keepdim": lambda h: torch.mean(input=h, dim=1, keepdim=True),
    "argmax": lambda h: torch.argmax(input=h, dim=1),
    "amax": lambda h: torch.amax(input=h, dim=-1),
    "sigmoid": lambda h: torch.sigmoid(input=h),
    "clamp": lambda h: torch.clamp(input=h, min=-0.5, max=0.5),
    "relu_F": lambda h: F.relu(input=h),
    "softmax_F": lambda h: F.softmax(input=h, dim=-1),
    "logsumexp": lambda h: torch.logsumexp(input=h, dim=1),
    "max_values": lambda h: torch.max(input=h, dim=1).values,
    "add_other": lambda h: torch.add(input=h, other=1.5),
    "mul_other": lambda h: torch.mul(input=h, other=h),
    "where_all_keywords": lambda h: torch.where(condition=h > 0, input=h, other=-h),
    "mixed": lambda h: torch.sum(h, dim=-1, keepdim=True) + torch.softmax(h, dim=1),
}


class Head(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 10)
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FORMS[self.form](self.fc(x))


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("seed", [0, 1])
def test_keyword_operand_forms_convert(form, seed):
    torch.manual_seed(seed)
    m = Head(form).eval()
    x = torch.randn(5, 12)
    fm = cupyfuse.from_model(m)
    got = quiet(fm, x)
    ref64, ref32 = refs(m, (x,))
    if ref32.dtype == torch.int64:   # positions: exactly eager's (no near-ties at this data)
        assert torch.equal(got, ref32)
    else:
        torch.testing.assert_close(got.double(), ref64, atol=1e-4, rtol=1e-4)


def test_keyword_prefix_rules():
    g = torch.fx.Graph()
    h, c, o = g.placeholder("h"), g.placeholder("c"), g.placeholder("o")
    # the operand moves, the options stay keywords
    assert keyword_prefix(torch.sum, (), {"input": h, "dim": 1}) == ((h,), {"dim": 1})
    assert keyword_prefix(F.relu, (h,), {"inplace": True}) == ((h,), {"inplace": True})
    assert keyword_prefix(F.relu, (), {"input": h, "inplace": True}) == \
        ((h,), {"inplace": True})
    assert keyword_prefix(torch.add, (), {"input": h, "other": o}) == ((h, o), {})
    assert keyword_prefix(torch.add, (), {"input": h, "other": 1.5}) == ((h,), {"other": 1.5})
    # where: condition comes first; only a prefix moves
    assert keyword_prefix(torch.where, (), {"input": h, "other": o}) == \
        ((), {"input": h, "other": o})
    assert keyword_prefix(torch.where, (), {"condition": c, "input": h, "other": o}) == \
        ((c, h, o), {})

    # a keyword-only parameter stays a keyword
    def f(a, b=1, *, c=2):
        return a

    assert keyword_prefix(f, (), {"a": h, "c": o}) == ((h,), {"c": o})
    assert keyword_prefix(f, (h,), {"c": o}) == ((h,), {"c": o})
    # a name no signature has: unchanged
    assert keyword_prefix(torch.sum, (), {"bogus": h}) == ((), {"bogus": h})


def test_inplace_keyword_is_kept():
    """F.relu(h, inplace=True) then h read: the in-place op's result (the keyword must
    stay a keyword: moved to a position, it gives a silent wrong answer)."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(12, 10)

        def forward(self, x):
            h = self.fc(x)
            g = F.relu(h, inplace=True)
            return g + h

    torch.manual_seed(0)
    m = M().eval()
    x = torch.randn(5, 12)
    ref64, _ = refs(m, (x,))
    torch.testing.assert_close(quiet(cupyfuse.from_model(m), x).double(), ref64, atol=1e-4,
                               rtol=1e-4)
