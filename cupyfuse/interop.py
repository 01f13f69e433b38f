"""Interop: accept torch tensors, CuPy arrays, NumPy arrays and ``__dlpack__`` producers.

What every op does with its operands (decided here, once):

* **torch CUDA tensors** -- used in place (zero copies); kernels run on
  ``torch.cuda.current_stream(device)``; the result is a torch tensor allocated by
  torch's caching allocator on that stream.
* **CuPy arrays** -- used in place; kernels run on CuPy's current stream; the result
  is a CuPy array.
* **other ``__dlpack__`` producers on a CUDA device** (JAX, ...) -- imported with
  ``cupy.from_dlpack`` (zero copies, the producer syncs to CuPy's current stream);
  treated like CuPy arrays and the result is a CuPy array.
* **CPU inputs** (torch CPU tensors, NumPy arrays) -- the same plan runs with torch
  ops on the CPU; NumPy in gives NumPy out.
* **dtype** -- float32 only (the models are float32); anything else is a ``TypeError``.
* **non-contiguous** ``x`` -- copied once to a contiguous buffer (the only copy an op
  ever makes of an input); weights may be non-contiguous: the plan's derived weights
  are contiguous anyway, and the direct weight of model 56 is cached contiguous.
* **zero-size batch** -- returns an empty result of the right shape, no launch.
* **autograd** -- ``fused_linear`` with a tail function, fused modules and the named ops
  55, 56 and 98 are differentiable (:mod:`cupyfuse.autograd`) for torch callers;
  ``gemm_scale_batchnorm`` and a ``CudaTail`` are forward-only: their results carry no
  autograd history, and in grad mode with an operand requiring grad a ``UserWarning`` says
  so once per op.
* **mixed devices** -- every operand must live on the same device as ``x``, else
  ``ValueError`` naming the operand.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

__all__ = ["Call", "describe", "is_cupy_array", "cupy_view", "cupy_available"]

_warned_grad: set[str] = set()

#: Debug switch for tests: when True, every buffer an op allocates (its result and its
#: temporaries) starts filled with NaN (float) or -1 (int), so an element a kernel
#: forgets to write can never pass a check by holding a stale value.
poison_outputs = False


def cupy_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:  # pragma: no cover - depends on the machine
        return False


def is_cupy_array(obj: Any) -> bool:
    mod = type(obj).__module__
    if not mod.startswith("cupy"):
        return False
    import cupy

    return isinstance(obj, cupy.ndarray)


def describe(obj: Any) -> str:
    """``(128, 100) float64 on cpu``-style description of an operand."""
    if obj is None:
        return "None"
    if isinstance(obj, torch.Tensor):
        return f"{tuple(obj.shape)} {str(obj.dtype).replace('torch.', '')} on {obj.device}"
    if isinstance(obj, np.ndarray):
        return f"{obj.shape} {obj.dtype} numpy array on cpu"
    if is_cupy_array(obj):
        return f"{obj.shape} {obj.dtype} cupy array on cuda:{obj.device.id}"
    if isinstance(obj, (int, float)):
        return f"{type(obj).__name__} {obj!r}"
    return type(obj).__name__


def cupy_view(t: torch.Tensor) -> Any:
    """A CuPy array sharing ``t``'s memory (zero copies); keeps ``t`` alive."""
    import cupy

    if t.numel() == 0:
        return cupy.empty(tuple(t.shape), dtype=_np_dtype(t.dtype))
    itemsize = t.element_size()
    # Span of memory the view may touch, from its first element.
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), span * itemsize, t, t.device.index)
    ptr = cupy.cuda.MemoryPointer(mem, 0)
    return cupy.ndarray(tuple(t.shape), dtype=_np_dtype(t.dtype), memptr=ptr,
                        strides=tuple(st * itemsize for st in t.stride()))


def _np_dtype(dt: torch.dtype) -> np.dtype:
    return {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
            torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
            torch.float16: np.dtype(np.float16), torch.uint8: np.dtype(np.uint8),
            torch.bool: np.dtype(np.bool_)}[dt]


_streams: dict[tuple[int, int], Any] = {}


def _external_stream(ptr: int, device_id: int) -> Any:
    """A CuPy stream object for a raw stream pointer (cached per pointer and device)."""
    s = _streams.get((ptr, device_id))
    if s is None:
        import cupy

        with warnings.catch_warnings():
            # CuPy >= 14 deprecates ExternalStream in favour of Stream.from_external, which
            # older CuPy (the cuda12x wheels users have) lacks; both wrap the same pointer.
            warnings.simplefilter("ignore", DeprecationWarning)
            s = cupy.cuda.ExternalStream(ptr, device_id)
        _streams[(ptr, device_id)] = s
    return s


def _as_torch(obj: Any, name: str) -> tuple[torch.Tensor, str]:
    """Zero-copy torch view of an operand and the caller kind it implies."""
    if isinstance(obj, torch.Tensor):
        return obj, ("torch-cuda" if obj.is_cuda else "torch-cpu")
    if isinstance(obj, np.ndarray):
        if any(st < 0 for st in obj.strides):  # torch.from_numpy refuses negative strides
            obj = np.ascontiguousarray(obj)
        return torch.from_numpy(obj), "numpy"
    if is_cupy_array(obj):
        return torch.from_dlpack(obj), "cupy"
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        dev_type, _ = obj.__dlpack_device__()
        if int(dev_type) == 1:  # kDLCPU
            return torch.from_dlpack(obj), "numpy"
        import cupy

        return torch.from_dlpack(cupy.from_dlpack(obj)), "dlpack"
    raise TypeError(
        f"{name} must be a torch tensor, a CuPy array, a NumPy array or an object with "
        f"__dlpack__/__dlpack_device__, got {type(obj).__name__}")


def warn_forward_only(what: str, stacklevel: int | None = None) -> None:
    """The once-per-op warning that a result has no autograd history (``stacklevel``
    None: pointing at the first frame outside cupyfuse and torch)."""
    if what in _warned_grad:
        return
    _warned_grad.add(what)
    if stacklevel is None:
        import sys

        pkg = __file__.rsplit("/", 1)[0] + "/"
        f, stacklevel = sys._getframe(1), 2
        while f is not None and (f.f_code.co_filename.startswith(pkg) or
                                 "/torch/" in f.f_code.co_filename):
            f, stacklevel = f.f_back, stacklevel + 1
    warnings.warn(f"{what} is forward-only: its result has no autograd history and gradients "
                  "will not flow through it (run it under torch.no_grad() or "
                  "torch.inference_mode() to silence this).", UserWarning, stacklevel=stacklevel)


@dataclass
class Call:
    """One op invocation: validated torch views of the operands, the stream, the caller kind.

    ``with call:`` makes the operands' device and the caller's stream current for CuPy
    (and for torch, when the caller is CuPy), so every launch and every allocation in
    the block is ordered with the caller's own work.
    """

    op: str
    kind: str  # "torch-cuda", "torch-cpu", "numpy", "cupy", "dlpack"
    device: torch.device
    x: torch.Tensor
    params: dict[str, torch.Tensor | None] = field(default_factory=dict)
    _ctx: list = field(default_factory=list)

    @classmethod
    def begin(cls, op: str, x: Any, params: dict[str, Any], *, x_shape_msg: str,
              in_features: int | None = None, stacklevel: int = 4,
              forward_only: bool = True) -> "Call":
        """Validate operands. ``in_features`` is the required width of ``x``;
        ``stacklevel``: the frames from the grad-mode warning up to the user's line;
        ``forward_only``: the op's result has no autograd history (warn once in grad
        mode where an operand requires grad)."""
        xt, kind = _as_torch(x, "x")
        if xt.dtype != torch.float32:
            raise TypeError(f"{op}: x must be {x_shape_msg} float32, got {describe(x)}")
        if xt.dim() != 2 or (in_features is not None and xt.shape[1] != in_features):
            raise ValueError(f"{op}: x must be {x_shape_msg} float32 on {xt.device}, "
                             f"got {describe(x)}")
        tparams: dict[str, torch.Tensor | None] = {}
        for name, val in params.items():
            if val is None:
                tparams[name] = None
                continue
            t, _ = _as_torch(val, name)
            if t.dtype != torch.float32:
                raise TypeError(f"{op}: {name} must be float32 on {xt.device}, "
                                f"got {describe(val)}")
            if t.device != xt.device:
                raise ValueError(f"{op}: {name} must be on {xt.device} like x, "
                                 f"got {describe(val)}")
            tparams[name] = t
        if forward_only and torch.is_grad_enabled() and op not in _warned_grad and (
                xt.requires_grad or any(t is not None and t.requires_grad for t in tparams.values())):
            warn_forward_only(f"cupyfuse.{op}", stacklevel + 1)  # user -> op -> _begin -> here
        if not xt.is_contiguous():
            xt = xt.contiguous()
        return cls(op=op, kind=kind, device=xt.device, x=xt.detach(),
                   params={k: (v.detach() if v is not None else None) for k, v in tparams.items()})

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    # --- stream / device context -------------------------------------------------
    def __enter__(self) -> "Call":
        if self.on_cpu:
            return self
        import cupy

        dev = self.device.index
        dctx = cupy.cuda.Device(dev)
        dctx.__enter__()
        self._ctx.append(dctx)
        if self.kind == "torch-cuda":
            ptr = torch.cuda.current_stream(self.device).cuda_stream
            sctx = _external_stream(ptr, dev)
            sctx.__enter__()
            self._ctx.append(sctx)
        else:
            # CuPy (or DLPack) caller: torch allocations and ops follow CuPy's stream.
            ptr = cupy.cuda.get_current_stream().ptr
            tctx = torch.cuda.stream(torch.cuda.ExternalStream(ptr, device=self.device))
            tctx.__enter__()
            self._ctx.append(tctx)
        return self

    def __exit__(self, *exc: Any) -> None:
        while self._ctx:
            self._ctx.pop().__exit__(*exc)

    # --- allocation and results ---------------------------------------------------
    def empty(self, shape: Iterable[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if poison_outputs:
            fill = float("nan") if dtype.is_floating_point else -1
            return torch.full(tuple(shape), fill, dtype=dtype, device=self.device)
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def zeros(self, shape: Iterable[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=dtype, device=self.device)

    def result(self, t: torch.Tensor) -> Any:
        """Hand ``t`` back in the caller's own type."""
        if self.kind in ("torch-cuda", "torch-cpu"):
            return t
        if self.kind == "numpy":
            return t.numpy()
        import cupy

        return cupy.from_dlpack(t)


class PreparedWeight:
    """A weight whose derived copies (the GEMM engine's split, folded rows) are cached.

    torch parameters are cached automatically (PyTorch's version counter says when they
    change); CuPy, NumPy and other DLPack weights have no such counter, so by default
    their derived copies are rebuilt on every call. Wrap such a weight once with
    :func:`prepare_weight` and pass the handle to :func:`fused_linear`: its derived
    copies are made once and reused until you call :meth:`refresh` -- do so after any
    in-place change of the array (the handle cannot see it).
    """

    def __init__(self, weight: Any) -> None:
        self.source = weight
        self.tensor, self.kind = _as_torch(weight, "weight")

    def refresh(self) -> "PreparedWeight":
        """Forget the derived copies (call after changing the weight in place)."""
        self.tensor, self.kind = _as_torch(self.source, "weight")
        return self


def prepare_weight(weight: Any) -> PreparedWeight:
    """A :class:`PreparedWeight` handle for a (N, K) float32 weight of any array type."""
    return PreparedWeight(weight)
