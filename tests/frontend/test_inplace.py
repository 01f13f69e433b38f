"""In-place ops on values the forward computed (Translator._check_inplace): where the value
is not an input, a parameter or a view of another, and no view of it was taken before the
op, the op's result is that tensor's value from then on -- later reads see it, earlier
reads kept the old value, as in eager (`out += x; out.clamp_(min=0); return out`, ResNet
style). In-place ops on an input, a parameter, a view read again or a value with an
earlier view stay refused. Against float64 torch on the CPU and (marked ``gpu``) the GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cupyfuse
from cupyfuse import TailError
from helpers import quiet, refs
from helpers import DEVICES
from gen.tails import assert_matches


class Forms(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc(x)
        f = self.form
        if f == "method":           # read before (s) and after (h)
            s = torch.sigmoid(h)
            h.relu_()
            return h + s
        if f == "functional":       # g is h
            g = F.relu(h, inplace=True)
            return g + h
        if f == "return":
            h.mul_(2.0)
            return h
        if f == "chain":            # several in-place ops, the result of one reassigned
            h.mul_(2.0)
            h = h.add_(1.0)
            h.clamp_(max=3.0)
            return torch.tanh(h) * h
        if f == "read_again":
            g = torch.sigmoid(h)
            g.mul_(2.0)
            return g + h.sigmoid() * g.sum(1, keepdim=True) + torch.sigmoid(h).add_(1) * h
        if f == "residual":         # torchvision's BasicBlock tail
            out = self.fc2(F.relu(h, inplace=True))
            out += x
            out.clamp_(min=0)
            return out
        if f == "view_after":       # a view taken after the op sees the new value
            h.mul_(3.0)
            return h.view(-1, 4, 4).sum(-1)
        # refused: eager would change the caller's x / an earlier view / the parameter
        if f == "input":
            x.mul_(2.0)
            return self.fc(x) + h
        if f == "view_before":
            v = h[:, :4]
            h.mul_(2.0)
            return v.sum(1, keepdim=True) + h
        if f == "param":
            self.fc.bias.data.mul_(1.0)
            return h
        if f == "type_as":          # h.type_as(x) is h itself: the op changes h
            r = h.type_as(x)
            r.mul_(2.0)
            return h
        if f == "alias_methods":    # views and self-returning methods, each then written
            a = h.float()
            a.add_(1.0)
            b = h.detach()
            b.mul_(0.5)
            return h
        raise AssertionError(f)


CONVERT = ["method", "functional", "return", "chain", "read_again", "residual", "view_after"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", CONVERT)
@pytest.mark.parametrize("batch", [1, 5, 33])
def test_inplace_forms_match_eager(form, batch, device):
    torch.manual_seed(0)
    m = Forms(form).eval()
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, 8, generator=g) * 2
    if batch > 2:
        x[1] = float("nan")
        x[2, 0] = float("inf")
    ref64, ref32 = refs(m, (x.clone(),))
    fm = cupyfuse.from_model(m.to(device))
    xd = x.to(device)
    for _ in range(2 if device != "cpu" else 1):
        out = quiet(fm, xd)
        assert_matches(out.cpu(), ref64, ref32, what=form)
    assert torch.equal(xd.cpu().nan_to_num(), x.nan_to_num())   # the input untouched


@pytest.mark.parametrize("form,match", [
    ("input", "in-place op on a value that is read again"),
    ("view_before", "in-place op on a value that is read again"), ("param", r"\.data"),
    ("type_as", "in-place op on a view of a value"),
    ("alias_methods", "in-place op on a view of a value")])
def test_inplace_forms_that_stay_refused(form, match):
    torch.manual_seed(0)
    with pytest.raises(TailError, match=match) as e:
        quiet(cupyfuse.from_model(Forms(form).eval()), torch.randn(3, 8))
    assert "test_inplace.py" in str(e.value)


class OutKw(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        h = self.fc(x)
        if self.form == "into_h":        # the result written into h: h read after
            torch.add(h, 1.0, out=h)
            return h
        if self.form == "into_new":
            y = torch.zeros_like(h)
            torch.mul(h, 2.0, out=y)
            return y + h
        if self.form == "stack":
            y = torch.stack([h, h], dim=1)
            torch.stack([h, h * 2.0], dim=1, out=y)
            return y.sum(1)
        raise AssertionError(self.form)


@pytest.mark.parametrize("form", ["into_h", "into_new", "stack"])
def test_out_keyword_is_refused(form):
    """`out=` writes a result into an existing tensor (whose readers see it): refused
    (translated as if absent, torch.add(h, 1, out=h); return h would give h, not h + 1)."""
    torch.manual_seed(0)
    with pytest.raises(TailError, match="out="):
        quiet(cupyfuse.from_model(OutKw(form).eval()), torch.randn(3, 8))
