"""The results of a fused call are tensors of their own, as torch's are: minimal models of
results that could share memory with each other or with the caller's input, or come back
in another layout than torch's. Each runs on the CPU and, marked ``gpu`` (``DEVICES``),
on CUDA tensors, three calls (the general path, then the prepared launches). The drawn
forms, the emulated GPU paths and fused_linear are in tests/frontend/test_own_results.py.

Memory shared where torch's results share none (an in-place write to one result would
change another result or the caller's input):
1. ``return h, h.clone()`` (also ``torch.relu(h), F.relu(h)`` and ``h, h[:, :2].clone()``):
   torch gives two tensors; after ``a.add_(1)`` the fused ``b`` must be unchanged.
2. ``return self.fc(x), x.clone()`` (also a mask input's ``m.clone()``): the second result
   must not be a view of the caller's ``x``; zeroing it leaves ``x`` alone.

torch's result layout (no exception where torch works):
3. ``return self.fc(x)[:, 2:5].contiguous()`` (or ``.clone()``): the result is contiguous,
   not a strided view into the (batch, 8) buffer; ``out.view(-1)`` works as on torch's.

How: every result a call returns is its own contiguous tensor (Program.own_results
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
    # torch: after a.add_(1), b keeps fc(x) (two tensors); a fused b that were (a view
    # of) a would have fc(x) + 1 in its columns
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
    # torch: zeroing the returned clone leaves x alone; so must the fused clone
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
    # torch: (4, 3) contiguous, .view(-1) works; a strided (8, 1) view of the GEMM's
    # buffer would raise there
    torch.manual_seed(0)
    model = SliceContiguous(how)
    x = torch.randn(4, 3)
    with torch.no_grad():
        ref = model(x).view(-1)
    for out in _calls(model, device, x):
        assert out.is_contiguous()
        torch.testing.assert_close(out.view(-1).cpu(), ref, atol=1e-4, rtol=1e-4)
