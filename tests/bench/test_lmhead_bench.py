"""bench --lm-head on the CPU: it says it needs a GPU (exit 1), its arguments are checked,
and its table reads every row (an error row included)."""
from __future__ import annotations

import pytest
import torch

from cupyfuse.__main__ import main
from cupyfuse.bench import lmhead as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour")
def test_without_a_gpu_it_says_so(capsys):
    assert main(["bench", "--lm-head", "--tokens", "8", "--vocab", "16", "--hidden", "8"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bad_sizes_are_an_argument_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--lm-head", "--tokens", "4k"])
    assert e.value.code == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_the_table_reads_every_row():
    common = dict(tokens=4096, hidden=4096, vocab=128256, dtype="bfloat16")
    rows = [dict(variant="three GEMMs", forward_ms=6.0, step_ms=18.0, forward_gib=1.0, step_gib=2.0, **common),
            dict(variant="cupyfuse", forward_ms=7.0, step_ms=19.8, forward_gib=0.1, step_gib=1.0,
                 loss_err=1e-3, dx_err=1e-7, dw_err=1e-6, **common),
            dict(variant="liger", error="ImportError: no", **common)]
    text = bench.format_rows(rows)
    assert "| 4096 x 4096 -> 128256 (bfloat16) | cupyfuse | 7.00 | 19.80 | 1.100x | 1.00 | 0.10 |" in text
    assert "ImportError: no" in text and text.count("\n") == len(rows) + 1


def test_the_reference_is_cross_entropy_in_float64():
    g = torch.Generator().manual_seed(0)
    x, W = torch.randn(10, 6, generator=g), torch.randn(13, 6, generator=g)
    y = torch.randint(0, 13, (10,), generator=g)
    loss, dx, dW = bench._reference(x, W, y, chunk=3)
    xr, Wr = x.double().requires_grad_(), W.double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xr @ Wr.t(), y)
    gx, gW = torch.autograd.grad(ref, (xr, Wr))
    assert torch.allclose(loss, ref) and torch.allclose(dx, gx) and torch.allclose(dW, gW)
