"""Ready plans of programs whose steps read derived weights (prepared.Prepared._make_ready),
emulated on the CPU (tests/emu/prepared.py): an average-pooling fold (the skinny kernel's W',
then fold_rows), pair differences (55's max-pool-then-sum form: pairdiff_rows), a GEMV (a
Linear's row sum: gemv_rows), and 98's form at a skinny batch (a fold, then the tail).
The first call runs the full path and makes the ready plan, the second runs the plan:
the same bits, float64 at 1e-4; then an x 4 bytes off a 16-byte boundary (the float4
flags per call: the emulated kernels refuse the float4 path on it), a weight and a bias
changed in place (the plan's version checks: derived weights rebuilt), a new weight
tensor. The same models run on the GPU in tests/backend/test_ready_plans_gpu.py."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse.backend import prepared

K = N = 1024


class PoolMax(nn.Module):
    """98's form: average pooling, GELU, scale, row max (certified at engine batches)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(K, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.avg_pool1d(self.fc(x).unsqueeze(1), 16).squeeze(1)
        return (F.gelu(h) * 2.0).max(1).values


class PoolSigmoid(PoolMax):
    """Average pooling, then a tail the certification does not take (fold_rows)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.avg_pool1d(self.fc(x).unsqueeze(1), 4).squeeze(1)
        return torch.sigmoid(h).sum(1)


class MaxPoolSum(PoolMax):
    """55's form: max pooling of pairs, then the row sum (pair differences)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool1d(self.fc(x).unsqueeze(1), 2).squeeze(1)
        return h.sum(1) * 0.5


class LinearSum(PoolMax):
    """A Linear's scaled row sum (a GEMV with the summed weight)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * 0.5).sum(1)


MODELS = [PoolMax, PoolSigmoid, MaxPoolSum, LinearSum]


def kinds(pr: prepared.Prepared) -> set[str]:
    """The derived-weight steps of a plan, by form."""
    out = set()
    for st in pr.steps:
        if st.cert is not None:
            out.add("cert-" + st.cert[0])
        elif st.gemv is not None:
            out.add("gemv")
        elif st.fold is not None:
            out.add(("skinny-" if st.skinny is not None else "engine-" if st.eng is not None
                     else "") + st.fold[3])
    return out


# the derived-weight steps each form has at 8 rows (the skinny kernel's batches)
SKINNY_KINDS = {"PoolMax": {"skinny-gemm", "rows"}, "PoolSigmoid": {"skinny-gemm", "rows"},
                "MaxPoolSum": {"skinny-gemm", "rows"}, "LinearSum": {"gemv"}}


def _ref(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return copy.deepcopy(model).double()(x.double())


def _close(got: torch.Tensor, model: nn.Module, x: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.double(), _ref(model, x), atol=1e-4, rtol=1e-4,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_ready_plan_follows_the_sources_emulated(cls, monkeypatch):
    from emu import gpu as _gpuemu
    from emu import prepared as _prepemu

    torch.manual_seed(3)
    model = cls().eval()
    with torch.no_grad():
        model.fc.weight.mul_(3.0)   # a spread of pooled values
    x = torch.rand(8, K)
    _prepemu.install(monkeypatch)
    prog, tens, srcs = _gpuemu.model_program(model, [x])
    pr = _prepemu.prepare(prog, tens, srcs)
    assert pr is not None and kinds(pr) == SKINNY_KINDS[cls.__name__], kinds(pr)
    first = _prepemu.call(pr, tens, srcs)            # the full path, then the ready plan
    assert pr._ready, "no ready plan"
    (ready,) = pr._ready.values()
    assert {(e[0], e[2]) for e in ready[2]} == {(0, srcs[0]._version), (1, srcs[1]._version)}
    again = _prepemu.call(pr, tens, srcs)            # the ready plan
    assert _prepemu.same_bits(again, first), "the ready plan's bits differ from the full path's"
    _close(first, model, x, "first call")
    # an x 4 bytes past a 16-byte boundary: the float4 flags must follow it per call
    buf = torch.empty(8 * K + 1)
    xm = buf[1:].view(8, K)
    xm.copy_(x)
    assert xm.data_ptr() % 16
    assert _prepemu.same_bits(_prepemu.call(pr, [xm], srcs), first)
    assert pr._ready, "the ready plan was dropped for a misaligned x"
    # (srcs are detached views of the parameters: one version counter)
    with torch.no_grad():
        model.fc.weight.mul_(0.5)
    assert srcs[0]._version != ready[2][0][2] or srcs[0]._version != ready[2][1][2]
    _close(_prepemu.call(pr, tens, srcs), model, x, "weight changed in place")
    (ready,) = pr._ready.values()
    assert (0, srcs[0]._version) in {(e[0], e[2]) for e in ready[2]}
    _close(_prepemu.call(pr, tens, srcs), model, x, "weight changed, the new ready plan")
    with torch.no_grad():
        model.fc.bias.add_(0.25)
    _close(_prepemu.call(pr, tens, srcs), model, x, "bias changed in place")
    _close(_prepemu.call(pr, tens, srcs), model, x, "bias changed, the new ready plan")
    model.fc.weight = nn.Parameter(torch.randn(N, K) * 0.1)
    new = [model.fc.weight.detach(), srcs[1]]
    _close(_prepemu.call(pr, tens, new), model, x, "a new weight tensor")
    _close(_prepemu.call(pr, tens, new), model, x, "a new weight tensor, the new ready plan")


def test_no_ready_plan_for_an_inference_source(monkeypatch):
    """A derived weight made from a tensor without a version counter (an inference
    tensor) is rebuilt by every call: no ready plan, and each call still correct."""
    from emu import gpu as _gpuemu
    from emu import prepared as _prepemu

    torch.manual_seed(4)
    model = PoolSigmoid().eval()
    x = torch.rand(8, K)
    _prepemu.install(monkeypatch)
    prog, tens, srcs = _gpuemu.model_program(model, [x])
    with torch.inference_mode():
        srcs = [s.clone() for s in srcs]
    assert srcs[0].is_inference()
    pr = _prepemu.prepare(prog, tens, srcs)
    for _ in range(2):
        _close(_prepemu.call(pr, tens, srcs), model, x, "inference sources")
        assert not pr._ready
