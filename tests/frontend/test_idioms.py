"""Idioms of models written outside the team (seen in 103 such models): dtype and
device plumbing (LLaMA's RMSNorm ``self._norm(x.float()).type_as(x)``, ``.to(h.dtype)``,
``torch.tensor(c, device=h.device)``) and the dropout family in eval mode (SELU heads'
AlphaDropout). Each against a float64 copy of the eager model, on the CPU and (marked
``gpu``) on the GPU; the forms torch refuses are refused.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse import from_model
from cupyfuse.ir.program import TailError
from helpers import DEVICES
from helpers import runner_of



class LlamaRMSNorm(nn.Module):
    def __init__(self, k=24, d=40, eps=1e-6):
        super().__init__()
        self.fc = nn.Linear(k, d)
        self.eps = eps
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        h = self.fc(x)
        return self._norm(h.float()).type_as(h) * self.weight


class DtypeDevice(nn.Module):
    def __init__(self, k=24, d=40):
        super().__init__()
        self.fc = nn.Linear(k, d)

    def forward(self, x):
        h = self.fc(x)
        gate = (h > 0).to(h.dtype)
        half = torch.tensor(0.5, device=h.device)
        return (h * gate + half * (h > 1).type_as(h)).to(x.device) + torch.tensor(2)


class SeluHead(nn.Module):
    def __init__(self, k=24, d=40):
        super().__init__()
        self.fc = nn.Linear(k, d)
        self.drop = nn.AlphaDropout(0.2)
        self.drop1 = nn.Dropout1d(0.3)

    def forward(self, x):
        h = self.drop1(self.drop(F.selu(self.fc(x))))
        return F.alpha_dropout(h, 0.5) + F.feature_alpha_dropout(h, 0.1, training=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [LlamaRMSNorm, DtypeDevice, SeluHead])
@pytest.mark.parametrize("batch", [1, 9])
def test_idioms_match_float64(device, cls, batch):
    torch.manual_seed(batch)
    m = cls().eval().to(device)
    x = torch.randn(batch, 24, device=device) * 3
    x[0, 0] = float("nan") if batch > 1 else x[0, 0]
    fm = from_model(m)
    with torch.no_grad():
        ref = copy.deepcopy(m).cpu().double()(x.cpu().double())
        for _ in range(3):   # (the prepared launches after the first call on the GPU)
            out = fm(x).cpu()
            torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4, equal_nan=True)


class TypeAsMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 40)

    def forward(self, x):
        h = self.fc(x)
        return h.type_as(h > 0)


class TensorRequiresGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 40)

    def forward(self, x):
        h = self.fc(x)
        return h * torch.tensor(2.0, device=h.device, requires_grad=True)


def test_idiom_refusals():
    x = torch.randn(3, 24)
    with pytest.raises(TailError, match=r"type_as.*other than a float32 tensor"):
        from_model(TypeAsMask())(x)
    with pytest.raises(TailError, match="requires grad"):
        from_model(TensorRequiresGrad())(x)
    m = SeluHead().train()
    with pytest.raises(TailError, match="active dropout"):
        from_model(m)(x)


G_SCALE = torch.tensor(2.0)


class ScalarTensors(nn.Module):
    """0-d tensors made in the forward (numbers of the program) and a module-level one
    (read per version: an in-place change is seen)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 40)

    def forward(self, x):
        h = self.fc(x)
        return h * torch.tensor(3) + torch.tensor(0.25) + h * G_SCALE.exp()


@pytest.mark.parametrize("device", DEVICES)
def test_scalar_tensor_constants(device):
    torch.manual_seed(5)
    m = ScalarTensors().to(device)
    x = torch.randn(9, 24, device=device)
    fm = from_model(m)
    for step in range(2):
        with torch.no_grad():
            ref = copy.deepcopy(m).cpu().double()(x.cpu().double())
            for _ in range(3):
                torch.testing.assert_close(fm(x).cpu().double(), ref, atol=1e-4, rtol=1e-4)
        G_SCALE.add_(0.5)


class Maxout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 24)

    def forward(self, x):
        h = self.fc(x)
        return h.view(*h.shape[:-1], 8, 3).max(-1)[0]


class RowLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 24)

    def forward(self, x):
        h = self.fc(x)
        return torch.stack([r * 2 for r in h])


def test_trace_failure_names_the_line():
    """torch.fx failing to trace (here: a loop over a Proxy) names the forward's line."""
    with pytest.raises(TailError, match=r"could not trace(.|\n)*test_idioms\.py:\d+ in forward: "
                                        r"return torch\.stack\(\[r \* 2 for r in h\]\)"):
        from_model(RowLoop())


@pytest.mark.parametrize("device", DEVICES)
def test_maxout_with_an_unpacked_shape(device):
    """``h.view(*h.shape[:-1], 8, 3)``: a shape unpacked with * traces (as one node the
    translator splices) and the split view's max over its last dim fuses."""
    torch.manual_seed(0)
    m = Maxout().to(device)
    x = torch.randn(5, 24, device=device)
    with torch.no_grad():
        want = copy.deepcopy(m).double()(x.double())
        got = from_model(m)(x)
    assert got.shape == want.shape == (5, 8)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


class FlattenFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 10)

    def forward(self, x):
        return torch.relu(self.fc(torch.flatten(x, 1)))


class ViewFirst(FlattenFirst):
    def forward(self, x):
        return torch.relu(self.fc(x.view(x.size(0), -1)))


class FeatureVectorInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 10)

    def forward(self, x, v):
        return self.fc(x) + v


def test_input_layout_messages():
    """A (batch, C, L) input flattened before the Linear computes (read as (batch, C * L)
    rows: tests/frontend/test_common_forms.py); a 1-D per-feature input is refused saying
    what to pass instead, and the suggested form computes."""
    x3 = torch.randn(5, 4, 6)
    for cls in (FlattenFirst, ViewFirst):
        m = cls()
        with torch.no_grad():
            torch.testing.assert_close(from_model(m)(x3).double(),
                                       copy.deepcopy(m).double()(x3.double()),
                                       atol=1e-4, rtol=1e-4)
    m = FeatureVectorInput()
    x, v = torch.randn(5, 24), torch.randn(10)
    with pytest.raises(TailError, match=r"a per-feature vector goes in as \(1, 10\)"):
        from_model(m)(x, v)
    with torch.no_grad():
        torch.testing.assert_close(from_model(m)(x, v[None]), m(x, v), atol=1e-5, rtol=1e-5)


class _TensorConstPow(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x):
        return torch.tensor(2.0) ** self.fc(x)


def test_method_of_a_tensor_constant_refused_with_the_number():
    """torch.tensor(2.0) ** h: the 0-d tensor is a number of the program; the refusal
    says so (not "a tensor method of a Python number (torch raises)", which is false:
    torch computes it)."""
    with pytest.raises(TailError, match=r"a method of a 0-d tensor made in the forward "
                                        r"\(torch.tensor\(2.0\)\)"):
        from_model(_TensorConstPow())(torch.randn(3, 8))


class _Flags(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 10)

    def forward(self, x, return_probs: bool = False, mask=None, double: bool = False):
        h = self.fc(x)
        if mask is not None:
            h = h.masked_fill(mask, -1e4)
        if double:
            h = h * 2
        return h.softmax(-1) if return_probs else h


@pytest.mark.parametrize("device", DEVICES)
def test_bool_arguments_passed_specialise_the_trace(device):
    """``fm(x, True)`` / ``fm(x, return_probs=False)``: each pattern of bools and Nones
    passed is a trace of its own (not refused with "make it an attribute"); alternating
    patterns, positional and keyword, none reusing another's program or prepared launch."""
    torch.manual_seed(4)
    m = _Flags().to(device)
    fm = from_model(m)
    x = torch.randn(7, 12, device=device)
    mask = torch.rand(7, 10, device=device) > 0.7
    calls = [((), {}), ((True,), {}), ((False,), {}), ((), {"return_probs": True}),
             ((True, mask), {}), ((True, None, True), {}), ((False, mask, True), {}),
             ((True,), {"double": True})]
    with torch.no_grad():
        for rep in range(3):   # the GPU's prepared launches from the second round on
            for args, kw in calls:
                torch.testing.assert_close(fm(x, *args, **kw), m(x, *args, **kw), atol=1e-4,
                                           rtol=1e-4, msg=f"{args} {kw} round {rep}")
    if device == "cuda":
        assert sum(e is not None for e in runner_of(fm).fast.values()) >= 4
