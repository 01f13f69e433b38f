"""The 37 KernelBench level-2 Linear-family models (tests/corpus/kernelbench_l2/, written from
KernelBench's definitions): each converts with ``fused_class`` and, on the CPU at reduced
sizes, matches a float64 copy of the original at atol = rtol = 1e-4, with the same
parameters (same seed) and the same BatchNorm running statistics afterwards.

Reduced sizes: every int >= 64 in the init arguments (features, groups, shapes) is
divided by 64, inputs are the first 8 rows of get_inputs() cut to match. 66 applies
active dropout in training mode and must be refused.
"""
from __future__ import annotations

import copy

import pytest
import torch

import cupyfuse
from cupyfuse.ir.program import TailError
from tests.corpus.kernelbench_l2.index import PROBLEMS, load


def _shrink(v):
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        return v // 64 if v >= 64 else v
    if isinstance(v, (tuple, list)):
        return type(v)(_shrink(x) for x in v)
    return v


def _small_inputs(mod, batch: int = 8):
    torch.manual_seed(5)
    out = []
    for t in mod.get_inputs():
        idx = [slice(0, batch)] + [slice(0, d // 64 if d >= 64 else d) for d in t.shape[1:]]
        out.append(t[tuple(idx)].contiguous())
    return out


# 28's InstanceNorm2d(out) sees 1 channel: torch warns about its own reference model
@pytest.mark.filterwarnings("ignore:input's size at dim=1 does not match num_features")
@pytest.mark.parametrize("num,fname", PROBLEMS, ids=[f"L2_{n}" for n, _ in PROBLEMS])
@pytest.mark.parametrize("dist", ["rand", "randn3"])
def test_kernelbench_model_cpu(num: int, fname: str, dist: str) -> None:
    mod = load(fname)
    init = _shrink(list(mod.get_init_inputs()))
    torch.manual_seed(0)
    orig = mod.Model(*init)
    New = cupyfuse.fused_class(mod.Model)
    torch.manual_seed(0)
    fused = New(*init)
    assert list(orig.state_dict()) == list(fused.state_dict())
    for a, b in zip(orig.state_dict().values(), fused.state_dict().values()):
        assert torch.equal(a, b)
    inputs = _small_inputs(mod)
    if dist == "randn3":
        inputs = [t.normal_() * 3 for t in inputs]
    if num == 66:
        with pytest.raises(TailError, match="dropout"):
            fused(*inputs)
        return
    ref_model = copy.deepcopy(orig).double()
    with torch.no_grad():
        ref = ref_model(*[t.double() for t in inputs])
    out = fused(*inputs)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.allclose(out.double(), ref, atol=1e-4, rtol=1e-4, equal_nan=True), \
        float((out.double() - ref).abs().max())
    for (k, a), b in zip(ref_model.state_dict().items(), fused.state_dict().values()):
        if a.is_floating_point():
            assert torch.allclose(a, b.double(), atol=1e-5, rtol=1e-5), k
        else:
            assert torch.equal(a, b), k
