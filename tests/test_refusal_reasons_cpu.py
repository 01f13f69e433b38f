"""Refusals by reason: each model below runs in torch, and cupyfuse refuses it with a
TailError that names the op, says why (the reason text of its refusal site in
cupyfuse/capture.py) and quotes the forward's line. (test_tails_cpu.py's REFUSALS pins the
op names and lines of more; this file pins the reasons.)"""
from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse import fused_class
from cupyfuse.fused import from_model
from cupyfuse.program import TailError

THIS = Path(__file__).name


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)


class SoftmaxNoDim(_Base):
    def forward(self, x):
        h = self.fc(x)
        return F.softmax(h)


class DivRounding(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.div(h, 2.0, rounding_mode="floor")


class NumberPower(_Base):
    def forward(self, x):
        h = self.fc(x)
        return 2.0 ** h


class WholeMean(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h - h.mean()


class Expand(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.unsqueeze(1).expand(-1, 3, -1).sum(1)


class PoolPadding(_Base):
    def forward(self, x):
        h = self.fc(x)
        return F.max_pool1d(h.unsqueeze(1), 2, padding=1).squeeze(1)


class FlattenAll(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h.reshape(-1)


class BatchSlice(_Base):
    def forward(self, x):
        h = self.fc(x)
        return h[1:, :]


class BoolCompare(_Base):
    def forward(self, x):
        h = self.fc(x)
        return ((h > 0) == (h < 1)).float()


class WhereIndices(_Base):
    def forward(self, x):
        h = self.fc(x)
        return torch.where(h > 0)[0]


CASES = [
    # (model, op named, reason fragment, code of the line quoted)
    (SoftmaxNoDim, "softmax", "without an explicit dim", "F.softmax(h)"),
    (DivRounding, "div", "rounding_mode='floor'", 'torch.div(h, 2.0, rounding_mode="floor")'),
    (NumberPower, "pow", "a number raised to a tensor power", "2.0 ** h"),
    (WholeMean, "mean", "no dim", "h - h.mean()"),
    (Expand, "expand", "expand is not fused", "h.unsqueeze(1).expand(-1, 3, -1).sum(1)"),
    (PoolPadding, "max_pool1d", "padding", "F.max_pool1d(h.unsqueeze(1), 2, padding=1)"),
    (FlattenAll, "reshape", "batch", "h.reshape(-1)"),
    (BatchSlice, "slicing", "slices the batch dimension", "h[1:, :]"),
    (BoolCompare, "eq", "a comparison of boolean tensors", "((h > 0) == (h < 1)).float()"),
    (WhereIndices, "where", "indices", "torch.where(h > 0)[0]"),
]


def _line_of(cls: type, code: str) -> int:
    lines, start = inspect.getsourcelines(cls.forward)
    hits = [start + i for i, ln in enumerate(lines) if code in ln]
    assert len(hits) == 1, (cls.__name__, code, hits)
    return hits[0]


@pytest.mark.parametrize("cls,op,why,code", CASES, ids=[c[0].__name__ for c in CASES])
def test_refusal_says_why(cls: type, op: str, why: str, code: str) -> None:
    torch.manual_seed(0)
    m = cls()
    x = torch.randn(4, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")   # F.softmax without dim warns in torch
        m(x)                              # torch runs it
    with pytest.raises(TailError) as ei:
        with torch.no_grad():
            from_model(m)(x)
    msg = str(ei.value)
    assert op.lower() in msg.lower(), msg
    assert why in msg, msg
    assert f"{THIS}:{_line_of(cls, code)} in forward" in msg, msg
    assert code in msg, msg
    # the drop-in class refuses the same way at its first call
    fm = fused_class(cls)()
    with pytest.raises(TailError) as ei:
        with torch.no_grad():
            fm(x)
    assert why in str(ei.value), str(ei.value)
