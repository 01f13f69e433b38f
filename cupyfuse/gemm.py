"""The GEMM every op starts with: ``z = x @ W.T`` in float32 (no bias: tails add it).

Today's engine is cuBLAS through ``torch.mm`` on the caller's stream (interop makes it
current, also for CuPy callers). Why torch and not CuPy's cuBLAS binding: CuPy refuses
cuBLAS calls during CUDA-graph stream capture, and ``torch.mm`` ran the same kernels at
the same speed in our probe (tools/gemm_probe.py, H100).

Precision follows PyTorch's own switch, as PyTorch eager does: with the default
``torch.backends.cuda.matmul.allow_tf32 = False`` (``get_float32_matmul_precision()``
== "highest") this is full float32 SGEMM; a user who opts into TF32 gets TF32 here too.
:func:`engine_info` reports the current setting.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["linear_nobias", "engine_info", "ENGINE"]

ENGINE = "cuBLAS via torch.mm (float32; TF32 only if torch allows it)"


def engine_info() -> dict[str, Any]:
    return {
        "gemm_engine": ENGINE,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "tf32_allowed": bool(torch.backends.cuda.matmul.allow_tf32),
    }


def linear_nobias(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:] = x @ weight.T``; x (M, K), weight (N, K), out (M, N), contiguous CUDA fp32.

    Runs on torch's current stream, which :class:`cupyfuse.interop.Call` has made the
    caller's stream.
    """
    M, K = x.shape
    N = weight.shape[0]
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.zero_()
        return out
    torch.mm(x, weight.t(), out=out)
    return out
