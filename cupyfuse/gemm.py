"""The GEMM every op starts with: ``z = x @ W.T`` in float32 (no bias: tails add it).

Today's engine is cuBLAS SGEMM through CuPy's cuBLAS binding (``cublasSgemm`` on CuPy's
per-device handle, called with raw pointers: the ``cupy.cublas.gemm`` wrapper costs tens
of microseconds of Python per call), full float32:
cuBLAS's default math mode never uses TF32 (the environment variable
``NVIDIA_TF32_OVERRIDE=1`` would change that; :func:`engine_info` reports it).
The call runs on CuPy's current stream, which :class:`cupyfuse.interop.Call` sets to
the caller's stream.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

__all__ = ["linear_nobias", "engine_info", "ENGINE"]

ENGINE = "cuBLAS SGEMM via CuPy (float32, TF32 off)"


def engine_info() -> dict[str, Any]:
    return {
        "gemm_engine": ENGINE,
        "tf32_override_env": os.environ.get("NVIDIA_TF32_OVERRIDE"),
    }


_ONE = np.ones(1, dtype=np.float32)
_ZERO = np.zeros(1, dtype=np.float32)


def linear_nobias(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[:] = x @ weight.T``; x (M, K), weight (N, K), out (M, N), all contiguous CUDA fp32.

    Runs on CuPy's current stream and device (set by :class:`cupyfuse.interop.Call`).
    Row-major ``out = x W^T`` is column-major ``out^T = W^T x^T``: cuBLAS sees W as a
    K x N column-major matrix (op T) and x as K x M (op N).
    """
    M, K = x.shape
    N = weight.shape[0]
    if M == 0 or N == 0:
        return out
    if K == 0:
        out.zero_()
        return out
    import cupy
    from cupy.cuda import device
    from cupy_backends.cuda.libs import cublas

    handle = device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    cublas.sgemm(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, N, M, K, _ONE.ctypes.data,
                 weight.data_ptr(), weight.stride(0), x.data_ptr(), x.stride(0),
                 _ZERO.ctypes.data, out.data_ptr(), out.stride(0))
    return out
