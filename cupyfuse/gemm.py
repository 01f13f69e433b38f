"""The GEMM every op starts with: ``z = x @ W.T`` in float32 (no bias: tails add it).

Today's engine is cuBLAS SGEMM through CuPy (``cupy.cublas.gemm``), full float32:
cuBLAS's default math mode never uses TF32 (the environment variable
``NVIDIA_TF32_OVERRIDE=1`` would change that; :func:`engine_info` reports it).
The call runs on CuPy's current stream, which :class:`cupyfuse.interop.Call` sets to
the caller's stream.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from .interop import cupy_view

__all__ = ["linear_nobias", "engine_info", "ENGINE"]

ENGINE = "cuBLAS SGEMM via CuPy (float32, TF32 off)"


def engine_info() -> dict[str, Any]:
    return {
        "gemm_engine": ENGINE,
        "tf32_override_env": os.environ.get("NVIDIA_TF32_OVERRIDE"),
    }


def linear_nobias(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:] = x @ weight.T``; x (M, K), weight (N, K), out (M, N), all contiguous CUDA fp32."""
    import cupy.cublas

    M, K = x.shape
    N = weight.shape[0]
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.zero_()
        return out
    cupy.cublas.gemm("N", "T", cupy_view(x), cupy_view(weight), out=cupy_view(out))
    return out
