"""Findings of the hunt for silent wrong answers in prepared launches, state changes
between calls, input strides, grad mode and copies of fused modules (branch hunt7, CPU
only), now fixed (branch results): each test is the minimal model of one finding, on the
CPU and, marked ``gpu`` (``DEVICES``), on CUDA tensors, three calls (the general path,
then the prepared launches). The drawn forms, the emulated GPU paths and fused_linear are
in tests/frontend/test_own_results.py.

Were wrong answers (results that shared memory where torch's do not: an in-place write
to one result changed another result or the caller's input):
1. ``return h, h.clone()`` (also ``torch.relu(h), F.relu(h)`` and ``h, h[:, :2].clone()``):
   the two results were one tensor (a view of it). torch gives two tensors; after
   ``a.add_(1)`` the fused ``b`` had changed too.
2. ``return self.fc(x), x.clone()`` (also a mask input's ``m.clone()``): the second result
   was a view of the caller's ``x``; zeroing it zeroed ``x``.

Was not torch's result layout (an exception where torch works):
3. ``return self.fc(x)[:, 2:5].contiguous()`` (or ``.clone()``): the result was a strided
   view into the (batch, 8) buffer, not contiguous; ``out.view(-1)`` raised RuntimeError
   where torch's contiguous result views fine.

The fix: every result a call returns is its own contiguous tensor (Program.own_results
gives a result that is an input or repeats another result a node of its own, which the
GPU writes to a buffer of its own; cpu.own_tensors copies a strided or aliasing result).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cupyfuse
from helpers import DEVICES


def _calls(model: nn.Module, device: str, *inputs: torch.Tensor, n: int = 3) -> list:
    """The fused model's results of ``n`` calls (on CUDA: the general path, then the
    prepared launches), under no_grad."""
    fm = cupyfuse.from_model(model.to(device))
    inputs = tuple(t.to(device) for t in inputs)
    outs = []
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        for _ in range(n if device != "cpu" else 1):
            outs.append(fm(*inputs))
    return outs




# ======================================================================================
# 1. two results that are one tensor
# ======================================================================================
class CloneResult(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        h = self.fc(x)
        return h, h.clone()


class SameOpTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        h = self.fc(x)
        return torch.relu(h), F.relu(h)


class SliceClone(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x):
        h = self.fc(x)
        return h, h[:, :2].clone()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [CloneResult, SameOpTwice, SliceClone])
def test_results_do_not_share_memory(cls, device):
    # torch: after a.add_(1), b keeps fc(x) (two tensors); fused (was): b a (view of) a,
    # so b had fc(x) + 1 in its columns
    torch.manual_seed(0)
    model = cls()
    x = torch.randn(2, 3)
    for a, b in _calls(model, device, x):
        expected = b.clone()
        a.add_(1.0)
        assert torch.equal(b, expected), f"{cls.__name__}: writing result 0 changed result 1"


# ======================================================================================
# 2. a result that is a view of the caller's input
# ======================================================================================
class InputClone(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x), x.clone()


class MaskClone(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x, m):
        return self.fc(x) * m, m.clone()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [InputClone, MaskClone])
def test_clone_of_an_input_is_not_the_input(cls, device):
    # torch: zeroing the returned clone leaves x alone; fused (was): x zeroed
    torch.manual_seed(0)
    x = torch.randn(2, 3, device=device)
    inputs = (x,) if cls is InputClone else (x, torch.rand(2, 2, device=x.device))
    keep = [t.clone() for t in inputs]
    for outs in _calls(cls(), device, *inputs):
        outs[1].zero_()
        for t, k in zip(inputs, keep):
            assert torch.equal(t, k), f"{cls.__name__}: zeroing the clone changed the input"


# ======================================================================================
# 3. a .contiguous() / .clone() result that is a strided view
# ======================================================================================
class SliceContiguous(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc = nn.Linear(3, 8)
        self.how = how

    def forward(self, x):
        h = self.fc(x)[:, 2:5]
        return h.contiguous() if self.how == "contiguous" else h.clone()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["contiguous", "clone"])
def test_contiguous_result_views_like_torch(how, device):
    # torch: (4, 3) contiguous, .view(-1) works; fused (was): strides (8, 1), .view(-1)
    # raised
    torch.manual_seed(0)
    model = SliceContiguous(how)
    x = torch.randn(4, 3)
    with torch.no_grad():
        ref = model(x).view(-1)
    for out in _calls(model, device, x):
        assert out.is_contiguous()
        torch.testing.assert_close(out.view(-1).cpu(), ref, atol=1e-4, rtol=1e-4)
