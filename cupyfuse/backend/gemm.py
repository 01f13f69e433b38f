"""The GEMM every op starts with: ``z = x @ W.T`` in float32 (no bias: tails add it).

Two engines:

* **sm90** (:mod:`cupyfuse.backend.engine`, ``kernels_cu/gemm_sm90*.cu``): our wgmma/TMA
  kernels, used on compute capability 9.0 when the operands suit TMA (K a multiple of 4,
  16-byte aligned rows).

  Precision ``"highest"`` is 3xTF32 (float32-class accuracy): the big halves are tf32,
  big(x) * small(W) runs in bf16 and the weight streams 6 bytes per element; its split is
  a cached derived weight. Above ``config.ROUNDED_BIG_MAX_M`` rows the big
  half is the fp32 weight itself (read as truncated tf32) and only its bf16 small half is
  cached (0.5x its memory); for smaller batches a round-to-nearest tf32 copy is cached
  too (1.5x; measured faster there). Variants that measured slower (the all-tf32 3xTF32
  kernel, the weight split or its small half made in shared memory, both cross products
  in bf16, 64 x 256 tiles, the 128 x 128 one-pass kernel) were removed: see
  docs/engine.md.

  ``"high"`` is one TF32 pass (operands rounded to the nearest tf32: x per call, the
  weight's rounded copy cached) and ``"medium"`` one BF16 pass (x converted per call, the
  weight's bf16 copy cached), both in the wide-tile one-pass kernel
  (``kernels_cu/gemm_sm90_wide.cu``) with fp32 accumulation.
* **cuBLAS** through ``torch.mm`` everywhere else (other GPUs, awkward shapes, or
  ``CUPYFUSE_ENGINE=cublas``). It follows PyTorch's own TF32 switch, as PyTorch eager
  does: with the default settings it is full float32 SGEMM.

Precision: each op takes ``precision=None | "highest" | "high" | "medium"``; None
follows ``torch.get_float32_matmul_precision()`` (default "highest"). Where cuBLAS runs,
it computes what PyTorch would (float32, or TF32 if torch allows it) whatever the precision.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from cupyfuse import config
from cupyfuse.backend import engine
from cupyfuse import caches

__all__ = ["linear_nobias", "matmul_nt", "engine_info", "resolve_precision", "engine_for",
           "skinny_for", "PRECISIONS"]

PRECISIONS = ("highest", "high", "medium")



#: bumped by cupyfuse.clear_cache(): prepared launches made before are not reused


def dispatch_key() -> tuple:
    """What decides which kernel a shape gets (prepared launches are only reused while it
    stays the same): the skinny thresholds, ``CUPYFUSE_ENGINE``, certified row maxima
    (:data:`cupyfuse.config.CERTIFY`) and the cache generation."""
    return (config.SKINNY_MAX_M, config.SKINNY_SMALL_MAX_M, config.SKINNY_SMALL_W, _env_engine(), caches.GENERATION[0],
            config.CERTIFY)


# os.environ's own store, read without its per-call key encoding (POSIX CPython keeps
# encoded keys there; elsewhere the plain lookup)
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY: Any = None
if isinstance(_ENV_DATA, dict) and callable(getattr(os.environ, "encodekey", None)):
    _ENV_KEY = os.environ.encodekey("CUPYFUSE_ENGINE")


def _env_engine() -> Any:
    """``CUPYFUSE_ENGINE`` as os.environ holds it (read per call: a prepared launch's key)."""
    if _ENV_KEY is not None:
        return _ENV_DATA.get(_ENV_KEY)
    return os.environ.get("CUPYFUSE_ENGINE")


def skinny_for(M: int, N: int, K: int) -> bool:
    """Whether :func:`linear_nobias` runs the skinny kernel for this shape (sm90 engine)."""
    return M <= config.SKINNY_MAX_M or (M <= config.SKINNY_SMALL_MAX_M and N * K <= config.SKINNY_SMALL_W)


def resolve_precision(precision: str | None) -> str:
    p = torch.get_float32_matmul_precision() if precision is None else precision
    if p not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} or None, got {precision!r}")
    return p


def _engine_setting() -> str:
    v = os.environ.get("CUPYFUSE_ENGINE", "auto").lower()
    if v not in ("auto", "sm90", "cublas"):
        raise ValueError(f"CUPYFUSE_ENGINE must be auto, sm90 or cublas, got {v!r}")
    return v


def engine_for(x: torch.Tensor, weight: torch.Tensor) -> str:
    """Which engine :func:`linear_nobias` picks for these operands: "sm90" or "cublas"."""
    setting = _engine_setting()
    if setting == "cublas" or not x.is_cuda:
        return "cublas"
    if engine.supported(x, weight):
        return "sm90"
    if setting == "sm90":
        raise ValueError("CUPYFUSE_ENGINE=sm90 but the operands don't suit it (needs compute "
                         "capability 9.0, K a multiple of 4, 16-byte aligned contiguous rows)")
    return "cublas"


def engine_info(device: Any = None) -> dict[str, Any]:
    cc = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None
    sm90 = cc == (9, 0) and _engine_setting() != "cublas"
    return {
        "gemm_engine": ("sm90 wgmma/TMA (3xTF32 at 'highest', TF32 at 'high', BF16 at "
                        "'medium'); cuBLAS for shapes it does not take" if sm90 else
                        "cuBLAS via torch.mm (float32; TF32 only if torch allows it)"),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "engine_setting": _engine_setting(),
    }


def _tf32_weight(w: torch.Tensor) -> tuple[torch.Tensor, tuple[bytes, bytes]]:
    wr = engine.split_hybrid(w, small=False, small_h=False, half=False)[0]
    return wr, engine.wide_b_map(wr)


def _bf16_weight(w: torch.Tensor) -> tuple[torch.Tensor, tuple[bytes, bytes]]:
    wh = engine.to_bf16(w)
    return wh, engine.wide_b_map(wh)


def _split_weight_hybrid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[bytes, bytes]]:
    big, _, small_h, _ = engine.split_hybrid(w, small=False, small_h=True, half=False)
    return big, small_h, engine.hybrid_b_maps(big, small_h)


def _split_weight_trunc(w: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    # Holds no reference to w itself (w may be the cache's owner).
    _, _, small_h, _ = engine.split_hybrid(w, small=False, small_h=True, half=False, trunc=True)
    return small_h, engine.hybrid_b_maps(w, small_h)[1]


def _hybrid_operands(x: torch.Tensor, weight: torch.Tensor, owner: torch.Tensor | None,
                     deps: Sequence[torch.Tensor | None],
                     rowmax: torch.Tensor | None = None) -> tuple:
    """The 3xTF32 engine's operands for ``x @ weight.T``: (x big, x small, bf16 x, weight
    big, weight's bf16 small half, the weight's two tensor maps); x's split is made now,
    the weight's comes from the cache (keyed on ``owner``/``deps``)."""
    if config.TRUNC_BIG and x.shape[0] > config.ROUNDED_BIG_MAX_M:
        # big = the operands as they are (the tensor cores truncate them to tf32): only
        # the small halves are stored -- the weight's as bf16, 0.5x its memory.
        _, xs, _, xh = engine.split_hybrid(x, small=True, small_h=False, half=True, trunc=True,
                                           rowmax=rowmax)
        wsh, smap = caches.cached("tf32x3ht_split", owner, deps or (weight,), (),
                                 lambda: _split_weight_trunc(weight))
        return x, xs, xh, weight, wsh, (engine.encode_tensor_map(weight), smap)
    xb, xs, _, xh = engine.split_hybrid(x, small=True, small_h=False, half=True, rowmax=rowmax)
    wb, wsh, hmaps = caches.cached("tf32x3h_split", owner, deps or (weight,), (),
                                  lambda: _split_weight_hybrid(weight))
    return xb, xs, xh, wb, wsh, hmaps


def uncached(weight: torch.Tensor, owner: torch.Tensor | None,
             deps: Sequence[torch.Tensor | None] = ()) -> bool:
    """Whether nothing keeps the engine's derived copy of ``weight`` between calls: no
    owner (a CuPy or NumPy weight not wrapped by :func:`cupyfuse.prepare_weight`) or one
    without a version counter (an inference tensor). Such a weight's 3xTF32 split would be
    made again on every call, three passes over the weight; cuBLAS's float32 GEMM reads it
    once and is as accurate, so "highest" runs there (TF32 off in torch: else the split)."""
    return (owner is None or caches.signature(deps or (weight,)) is None) and \
        not torch.backends.cuda.matmul.allow_tf32


def epilogue_ok(x: torch.Tensor, weight: torch.Tensor, precision: str | None,
                owner: torch.Tensor | None = None,
                deps: Sequence[torch.Tensor | None] = ()) -> bool:
    """Whether ``x @ weight.T`` runs on the 3xTF32 engine with a tail as its epilogue
    (:func:`linear_epilogue`): the engine takes these operands at precision "highest",
    the batch is past the skinny kernel's, the weight's split is kept between calls
    (:func:`uncached`), and the grid does not split K (tiles >= SMs)."""
    M, K = x.shape
    N = weight.shape[0]
    if M == 0 or N == 0 or K == 0 or resolve_precision(precision) != "highest":
        return False
    if engine_for(x, weight) != "sm90" or skinny_for(M, N, K) or uncached(weight, owner, deps):
        return False
    return engine.hybrid_splits(M, N, K, engine._device(x)[1]) == 1


def linear_epilogue(x: torch.Tensor, weight: torch.Tensor, fn: Any, args: tuple, nred: int, *,
                    owner: torch.Tensor | None = None,
                    deps: Sequence[torch.Tensor | None] = ()) -> None:
    """``x @ weight.T`` on the 3xTF32 engine with a generated epilogue (``fn``: the kernel
    of a :class:`cupyfuse.backend.codegen.Epilogue`, ``args`` its own parameters' values, ``nred``
    its row reductions) in one launch; where :func:`epilogue_ok`."""
    ops = _hybrid_operands(x, weight, owner, deps)
    engine.gemm_hybrid_epilogue(*ops[:3], ops[5], weight.shape[0], fn, args, nred)


def linear_nobias(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *,
                  precision: str | None = None, owner: torch.Tensor | None = None,
                  deps: Sequence[torch.Tensor | None] = (),
                  rowmax: torch.Tensor | None = None, split_each_call: bool = False) -> str:
    """``out[:] = x @ weight.T``; x (M, K), weight (N, K), out (M, N), contiguous fp32.

    Runs on the current stream (interop made it the caller's). ``owner``/``deps``
    key the cached split (or rounded copy) of ``weight`` (see :func:`caches.cached`);
    at "highest" a weight nothing keeps a split of runs on cuBLAS (:func:`uncached`),
    at "high"/"medium" its rounded copy is made each call. Returns the engine that ran.
    ``rowmax`` (int32 zeros, one per row): filled with x's row maxima of |x| by the
    3xTF32 engine's x split (engines "sm90-3xtf32h*"), left as it is by the others.
    ``split_each_call``: at "highest", a weight nothing keeps a split of is split for this
    call (a backward's operands) where the batch is large enough to pay for the split
    (:data:`cupyfuse.config.SPLIT_EACH_CALL_MIN_M` rows), instead of running on cuBLAS.
    """
    M, K = x.shape
    N = weight.shape[0]
    if M == 0 or N == 0:
        return "none"
    if K == 0:
        out.zero_()
        return "none"
    prec = resolve_precision(precision)
    if not x.is_cuda or engine_for(x, weight) == "cublas":
        torch.mm(x, weight.t(), out=out)
        return "cublas"
    if skinny_for(M, N, K):
        engine.gemm_skinny(x, weight, out)
        return "sm90-skinny-3xtf32" if engine.skinny_tile_rows(M, N, K) == 16 else "sm90-skinny-fp32"
    if prec == "highest":
        if uncached(weight, owner, deps) and not (
                split_each_call and M >= config.SPLIT_EACH_CALL_MIN_M):
            torch.mm(x, weight.t(), out=out)
            return "cublas"
        ops = _hybrid_operands(x, weight, owner, deps, rowmax)
        engine.gemm_hybrid(*ops[:5], out, b_maps=ops[5])
        return "sm90-3xtf32ht" if ops[0] is x else "sm90-3xtf32h"
    if prec == "medium":
        xh = engine.to_bf16(x)
        wh, wmap = caches.cached("bf16", owner, deps or (weight,), (), lambda: _bf16_weight(weight))
        engine.gemm_wide(xh, wh, out, b_map=wmap)
        return "sm90-bf16"
    # TF32 with operands rounded to nearest (as cuBLAS does): the tensor cores would
    # truncate fp32 bits, a bias that adds up over all-positive inputs and sums.
    xr = engine.split_hybrid(x, small=False, small_h=False, half=False)[0]
    wr, wmap = caches.cached("tf32_round", owner, deps or (weight,), (), lambda: _tf32_weight(weight))
    engine.gemm_wide(xr, wr, out, b_map=wmap)
    return "sm90-tf32"


def matmul_nt(a: torch.Tensor, b: torch.Tensor, *, precision: str | None = None,
              owner: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b.T`` as a new tensor, for operands made by the call (a backward's): float32
    CUDA operands on the engine (:func:`linear_nobias` with ``split_each_call``; ``owner``:
    a tensor whose cached split ``b``'s data is), anything else with torch."""
    if a.dtype != torch.float32 or b.dtype != torch.float32 or not a.is_cuda:
        return a @ b.t()
    a = a if a.is_contiguous() else a.contiguous()
    b = b if b.is_contiguous() else b.contiguous()
    out = torch.empty((a.shape[0], b.shape[0]), dtype=torch.float32, device=a.device)
    linear_nobias(a, b, out, precision=precision, owner=owner,
                  deps=(owner,) if owner is not None else (), split_each_call=True)
    return out
