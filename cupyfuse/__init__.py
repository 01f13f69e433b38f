"""cupyfuse: fused CUDA kernels (CuPy RawModule / NVRTC) for "Linear + cheap tail" models.

Public API:
    fused_linear(x, weight, bias, tail)  -- tail(x @ W.T + b) fused, tail a torch function
                              or a CudaTail of CUDA C fragments
    from_model(model), fused_class(Model) -- any Linear + tail model, fused
    matmul_maxpool_sum_scale, matmul_sigmoid_sum, matmul_avgpool_gelu_scale_max,
    gemm_scale_batchnorm      -- the fused ops (torch, CuPy, NumPy or DLPack operands)
    cupyfuse.kernelbench.modules               -- fused nn.Modules and ``from_model`` converters
    cupyfuse.kernelbench.models           -- the four original reference models
    info()                    -- which engine runs, on which device
    clear_cache()             -- forget derived weights, kept workspaces and compiled kernels
"""
from __future__ import annotations

from typing import Any

from cupyfuse.kernelbench import models, modules as nn
from cupyfuse import caches
from cupyfuse.kernelbench.ops import (gemm_scale_batchnorm, matmul_avgpool_gelu_scale_max, matmul_maxpool_sum_scale,
                  matmul_sigmoid_sum)
from cupyfuse.backend.runtime import KernelCompileError
from cupyfuse.api import CudaTail, PreparedWeight, fused_class, fused_linear, from_model, prepare_weight
from cupyfuse.ir.program import TailError

__version__ = "0.1.0"

__all__ = [
    "matmul_maxpool_sum_scale", "matmul_sigmoid_sum", "matmul_avgpool_gelu_scale_max",
    "gemm_scale_batchnorm", "info", "clear_cache", "KernelCompileError", "models", "plans",
    "fused_linear", "from_model", "fused_class", "CudaTail", "TailError", "prepare_weight",
    "PreparedWeight", "__version__",
]


def clear_cache() -> None:
    """Drop every cache (:mod:`cupyfuse.caches`): derived weights, programs, compiled
    kernels, prepared launches and their kept workspaces, specialised calls."""
    caches.clear_cache()


def info() -> dict[str, Any]:
    """What would run here: versions, device, GEMM engine, kernel directory."""
    import torch

    from cupyfuse.backend import gemm, runtime
    from cupyfuse.interop import cupy_available

    out: dict[str, Any] = {"cupyfuse": __version__, "torch": torch.__version__}
    try:
        import cupy

        out["cupy"] = cupy.__version__
    except Exception as exc:  # pragma: no cover - depends on the install
        out["cupy"] = f"not importable ({exc.__class__.__name__})"
    out["kernels_cu"] = str(runtime.kernel_dir())
    if cupy_available():
        import cupy

        dev = cupy.cuda.Device()
        out["device"] = torch.cuda.get_device_name(dev.id) if torch.cuda.is_available() else f"cuda:{dev.id}"
        out["compute_capability"] = dev.compute_capability
        out["nvrtc_arch"] = runtime.arch_for_device(dev.id)
        out.update(gemm.engine_info())
    else:
        out["device"] = "none (no CUDA device visible to CuPy): ops run their CPU path"
        out["gemm_engine"] = "torch on CPU"
    return out
