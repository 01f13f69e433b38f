"""The split-K sum read by the tail kernel (config.KSUM_IN_TAIL, codegen.ksum_source):
only where the tail reads one GEMM value. Its CF_LDH macro reads every GEMM value of the
kernel as partial products of one stride, so a level reading two GEMMs (a mixture head's
`softmax(pi(x)), fc(x)` at 128-300 rows) keeps its splitk_sum launches: read with the
first's stride, the second GEMM's partials give wrong values (up to 2.9 off at 300 rows
on the H200, in test_several_outputs' large mdn case). Two engine GEMMs
of the same x read one split of it (prepared.prepare's xsplits)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse import config
import cupyfuse

from emu import gpu as _gpuemu
from emu import prepared as _prepemu


class TwoHeads(nn.Module):
    """Two Linears of x read by one tail level (both results), or one (``one``)."""

    def __init__(self, form: str, k: int = 256, n: int = 612, m: int = 12) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(k, n)
        self.pi = nn.Linear(k, m)

    def forward(self, x):
        z = self.fc(x)
        if self.form == "two":
            return F.softmax(self.pi(x), dim=1), z
        if self.form == "two_mixed":
            return torch.tanh(z) + 0.5, self.pi(x).amax(1, keepdim=True) * z
        return torch.exp(z), z


@pytest.mark.parametrize("form", ["two", "two_mixed"])
def test_two_gemm_level_keeps_its_splitk_sums(form, monkeypatch):
    _prepemu.install(monkeypatch)
    m = TwoHeads(form).eval()
    prog, tens, srcs = _gpuemu.model_program(m, [torch.randn(128, 256)])
    pr = _prepemu.prepare(prog, tens, srcs)
    names = [s.fn.name for s in pr.steps]
    engines = names.count("gemm_sm90_tf32x3h")
    assert engines == 2, names
    assert names.count("splitk_sum") == 2, f"a split-K sum dropped for a two-GEMM tail: {names}"
    assert not any("_ks" in n for n in names), names
    # the two GEMMs read one split of x (one split_hybrid launch, not one per GEMM)
    assert names.count("split_hybrid") == 1, names


def test_one_gemm_level_reads_the_partials(monkeypatch):
    _prepemu.install(monkeypatch)
    m = TwoHeads("one").eval()
    prog, tens, srcs = _gpuemu.model_program(m, [torch.randn(128, 256)])
    pr = _prepemu.prepare(prog, tens, srcs)
    names = [s.fn.name for s in pr.steps]
    assert "splitk_sum" not in names and any("_ks" in n for n in names), names


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", ["two", "two_mixed", "one"])
@pytest.mark.parametrize("batch", [64, 128, 300])
def test_two_gemm_level_values_gpu(form, batch):
    torch.manual_seed(batch)
    m = TwoHeads(form).eval()
    x = torch.randn(batch, 256)
    with torch.no_grad():
        ref = copy.deepcopy(m).double()(x.double())
        fm = cupyfuse.from_model(copy.deepcopy(m).cuda())
        for _ in range(3):   # the prepared launches from the first call on
            out = fm(x.cuda())
            for o, r in zip(out, ref):
                torch.testing.assert_close(o.cpu().double(), r, atol=1e-4, rtol=1e-4)
