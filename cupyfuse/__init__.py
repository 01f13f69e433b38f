"""cupyfuse: fused CUDA kernels for "Linear + tail" models, compiled at run time by CuPy.

The public names:

* :func:`from_model` -- a fused module computing what a Linear + tail model computes
  (sharing its parameters and buffers; the original's state_dict keys);
* :func:`fused_class` -- a drop-in subclass of a model class with a fused forward;
* :func:`fused_linear` -- ``tail(x @ weight.T + bias)`` for a tail function or a
  :class:`CudaTail` of CUDA C fragments, on torch, CuPy, NumPy or DLPack operands;
* :func:`linear_cross_entropy` / :class:`LinearCrossEntropyLoss` -- a Linear head and
  its cross entropy with the logits stored at most once (an LM head at vocabulary scale);
* :func:`prepare_weight` -- a handle that keeps a non-torch weight's derived copies;
* :class:`TailError` -- what a model outside the vocabulary raises (the op and its line);
* :func:`program` -- the tail program a fused module runs for given inputs (inspection);
* :func:`info` -- what would run here; :func:`clear_cache` -- drop every cache.

The four KernelBench models, their fused classes and named ops are examples in
:mod:`cupyfuse.kernelbench`.
"""
from __future__ import annotations

from typing import Any

from cupyfuse import caches
from cupyfuse.api import CudaTail, fused_class, fused_linear, from_model, program
from cupyfuse.backend.runtime import KernelCompileError
from cupyfuse.interop import PreparedWeight, prepare_weight
from cupyfuse.lmhead import LinearCrossEntropyLoss, linear_cross_entropy
from cupyfuse.ir.program import TailError

__version__ = "0.1.0"

__all__ = ["from_model", "fused_class", "fused_linear", "CudaTail", "prepare_weight", "program",
           "PreparedWeight", "TailError", "linear_cross_entropy", "LinearCrossEntropyLoss", "KernelCompileError", "info", "clear_cache",
           "__version__"]


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
