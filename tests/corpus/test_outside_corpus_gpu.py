"""The converting models of the outside-written corpus (tests/corpus/outside/) on CUDA.

Each model that the corpus records as converting, in each of its modes: built on the CPU,
moved to the GPU, fused with ``cupyfuse.from_model`` (and ``fused_class`` for one call),
run at larger batches (64 twice, with an optimizer-like in-place update of every
parameter and buffer in between, so the second call runs the prepared path on changed
weights, then 257), each result compared with the float64 model on the CPU at atol =
rtol = 1e-4; train mode compares the BatchNorm buffers too. NaN/+inf/-inf input rows are
placed as PyTorch's float32 model places them.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from cupyfuse.interop import cupy_available
from corpus.outside import CONVERTS, all_cases
from corpus.outside.harness import run_case, run_nonfinite

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and cupy_available()),
                       reason="needs a CUDA GPU visible to both torch and CuPy"),
    pytest.mark.usefixtures("fp32_matmul"),
]

CONVERTING = [(c, mode) for c in all_cases() for mode in c.modes
              if c.expected(mode) == CONVERTS and not c.xfail_reason(mode)]


def _ids(p):
    return f"{p[0].name}-{p[1]}"


@pytest.mark.parametrize("cm", CONVERTING, ids=_ids)
def test_outside_model_gpu(cm):
    c, mode = cm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = run_case(c, mode, "from_model", seeds=(0,), batches=(64, 64, 257), device="cuda")
    assert o.status == "match", f"{c.name} ({mode}) on CUDA: {o.status}\n{o.message}"


@pytest.mark.parametrize("cm", CONVERTING, ids=_ids)
def test_outside_fused_class_gpu(cm):
    c, mode = cm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = run_case(c, mode, "fused_class", seeds=(1,), batches=(130,), device="cuda")
    assert o.status == "match", f"{c.name} ({mode}) on CUDA: {o.status}\n{o.message}"


@pytest.mark.parametrize("c", list({c.name: c for c, _ in CONVERTING if c.nonfinite and
                                    "cuda" in c.nonfinite_devices}.values()),
                         ids=lambda c: c.name)
def test_outside_nonfinite_gpu(c):
    mode = "eval" if "eval" in c.modes else c.modes[0]
    if c.expected(mode) != CONVERTS:
        pytest.skip("refused in its first mode")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = run_nonfinite(c, device="cuda", batch=33)
    assert o.status == "match", f"{c.name} on CUDA: {o.status}\n{o.message}"
