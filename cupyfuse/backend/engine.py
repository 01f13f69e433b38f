"""Our Hopper GEMM engine (kernels_cu/gemm_sm90.cu): host side.

``C = A @ B.T`` for float32 A (M, K) and B (N, K), both row-major (K-major), on the
tensor cores with wgmma; operands arrive through TMA tensor maps encoded here with
the driver's ``cuTensorMapEncodeTiled`` (ctypes on libcuda) and passed by value.

Precisions:
* ``"highest"`` -- 3xTF32: operands split into big = tf32(v) and small = tf32(v - big),
  big*big accumulated apart from the small cross terms; float32-class accuracy. The
  kernel (``gemm_hybrid``) keeps the weight's small half in bf16 and multiplies it by a
  bf16 copy of A (``split_hybrid``; a weight's split is a cached derived weight): 6 bytes
  of weight per element instead of 8.
* ``"high"`` -- one TF32 pass on the operands as given (``gemm_wide``: the one-pass
  kernel of ``kernels_cu/gemm_sm90_wide.cu``, 128 x 256 tiles).
* ``"medium"`` -- one BF16 pass (``gemm_wide`` on bf16 copies made by :func:`to_bf16`;
  a weight's copy is a cached derived weight), fp32 accumulation.

Requirements (else :func:`supported` is False and callers use cuBLAS): compute
capability 9.0, K a multiple of 4 (TMA row strides are multiples of 16 bytes),
16-byte aligned, contiguous operands.
"""
from __future__ import annotations

import ctypes
import math
import threading
from typing import Any, NamedTuple

import torch

from cupyfuse import caches
from cupyfuse import config
from cupyfuse.backend.runtime import get_function, launch

__all__ = ["supported", "gemm_wide", "gemm_hybrid", "split_hybrid", "hybrid_b_maps", "to_bf16",
           "encode_tensor_map", "SMEM_BYTES", "WIDE_SMEM_BYTES"]

_BM = _BN = 128
_BK = 32
_TILE = _BM * _BK * 4
SMEM_BYTES = {"3h": 3 * 4 * _TILE + 1024}   # 3 ring slots of 4 boxes, 1 KB alignment
# The one-pass kernel (gemm_sm90_wide.cu): 128 x 256 tiles, K blocks of 128 bytes, a ring
# of 4 slots of (16 + 32) KB.
_WBM, _WBN = 128, 256
WIDE_SMEM_BYTES = 4 * (16 + 32) * 1024 + 1024
# operand dtype -> the wide kernel
_WFN = {torch.float32: "gemm_sm90_wide_tf32", torch.bfloat16: "gemm_sm90_wide_bf16"}
# The 3xTF32 variants that measured slower (B split in shared memory, both cross products
# in bf16, B's small half made in shared memory, 64 x 256 tiles; the all-tf32 3xTF32 and
# the 128 x 128 one-pass kernels) were removed: docs/engine.md has their numbers,
# git tags engine-variants-v13 and engine-variants-v14 their code.

_lock = threading.Lock()
_encode = None


def _encoder() -> Any:
    global _encode
    if _encode is None:
        with _lock:
            if _encode is None:
                lib = ctypes.CDLL("libcuda.so.1")
                fn = lib.cuTensorMapEncodeTiled
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                               ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                               ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                               ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
                _encode = fn
    return _encode


_SWIZZLE = {128: 3, 64: 2}  # CUtensorMapSwizzle by box row bytes
_L2_256B = 3
# CUtensorMapDataType codes and element sizes.
_DTYPES = {torch.float32: (7, 4), torch.bfloat16: (9, 2)}


_maps: dict[tuple[int, int, int, int, int, int, Any], bytes] = caches.register(
    "tensor maps", {})


def encode_tensor_map(t: torch.Tensor, box_rows: int = _BM, box_bytes: int = 128) -> bytes:
    """128-byte CUtensorMap of a row-major fp32 or bf16 matrix: boxes of ``box_rows`` rows
    x ``box_bytes`` bytes (128: 32 floats or 64 bf16, 128-byte swizzle; 64: 32 bf16,
    64-byte swizzle).

    A map only describes (address, shape, row stride, box, type), so encodings are
    memoised on exactly that (the caching allocator hands the same buffers back call
    after call).
    """
    rows, cols = t.shape
    return encode_map(t.data_ptr(), rows, cols, t.stride(0), t.dtype, box_rows, box_bytes)


def encode_map(ptr: int, rows: int, cols: int, ld: int, dtype: torch.dtype,
               box_rows: int = _BM, box_bytes: int = 128) -> bytes:
    """:func:`encode_tensor_map` from a raw address (row stride ``ld`` elements)."""
    key = (ptr, rows, cols, ld, box_rows, box_bytes, dtype)
    hit = _maps.get(key)
    if hit is not None:
        return hit
    code, size = _DTYPES[dtype]
    buf = ctypes.create_string_buffer(128 + 128)
    addr = (ctypes.addressof(buf) + 127) & ~127
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(ld * size)
    box = (ctypes.c_uint32 * 2)(box_bytes // size, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    rc = _encoder()(addr, code, 2, ptr, dims, strides, box, elem, 0, _SWIZZLE[box_bytes],
                    _L2_256B, 0)
    if rc != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {rc} for a "
                           f"({rows}, {cols}) {dtype} matrix (row stride {ld} elements)")
    out = ctypes.string_at(addr, 128)
    if len(_maps) > 4096:
        _maps.clear()
    _maps[key] = out
    return out


_props: dict[int, tuple[tuple[int, int], int]] = {}


def _device(t: torch.Tensor) -> tuple[tuple[int, int], int]:
    """(compute capability, SM count) of a tensor's device, cached (queries cost ~10 us)."""
    idx = t.device.index
    p = _props.get(idx)
    if p is None:
        props = torch.cuda.get_device_properties(t.device)
        p = ((props.major, props.minor), props.multi_processor_count)
        _props[idx] = p
    return p


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not x.is_cuda or _device(x)[0] != (9, 0):
        return False
    K = x.shape[1]
    return (K % 4 == 0 and K > 0 and x.stride(1) == 1 and w.stride(1) == 1
            and x.stride(0) % 4 == 0 and w.stride(0) % 4 == 0
            and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)


def to_bf16(v: torch.Tensor) -> torch.Tensor:
    """A bf16 copy of a row-major fp32 matrix (round to nearest even; finite values stay
    finite), as a (rows, cols) view of a buffer whose rows are padded to a multiple of 8
    elements (16 bytes, as TMA needs); the padding is zero."""
    rows, cols = v.shape
    if v.stride(1) != 1:
        raise ValueError("to_bf16 needs rows of contiguous elements (stride(1) == 1)")
    ld = -(-cols // 8) * 8
    buf = torch.empty((rows, ld), dtype=torch.bfloat16, device=v.device)
    total = rows * ld // 4
    if total:
        sm = _device(v)[1]
        vec4 = int(cols % 4 == 0 and v.stride(0) % 4 == 0 and v.data_ptr() % 16 == 0)
        launch(get_function("gemm_sm90_wide.cu", "to_bf16", v.device.index),
               max(1, min(math.ceil(total / 256), 16 * sm)), 256, (v.data_ptr(), rows, cols, v.stride(0), buf.data_ptr(), ld, vec4))
    return buf[:, :cols]


def split_hybrid(v: torch.Tensor, *, small: bool, small_h: bool, half: bool, trunc: bool = False,
                 rowmax: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The operand copies of the hybrid 3xTF32 kernel for a row-major fp32 matrix v
    (rows, cols), cols a multiple of 4: ``(big, small, small_h, half)`` -- big = tf32(v)
    and small = tf32(v - big) as contiguous fp32; small_h = bf16(v - big) and
    half = bf16(v) as (rows, cols) views of row-padded bf16 buffers. The ones not asked
    for are None.

    ``trunc=True``: big is tf32 by truncation, which is how the tensor cores read an fp32
    operand anyway -- so no big copy is made and ``v`` itself is returned as big.

    ``rowmax``: an int32 tensor of ``rows`` zeros that gets each row's max |v| as float
    bits (NaN bits for a row holding a NaN), for the fold guards of tail_rewrite.cu."""
    rows, cols = v.shape
    if cols % 4 or v.stride(1) != 1 or v.stride(0) % 4 or v.data_ptr() % 16:
        raise ValueError("split_hybrid needs 16-byte aligned rows of a multiple of 4 floats")
    ld_h = -(-cols // 8) * 8
    dev = v.device
    big = v if trunc else torch.empty((rows, cols), dtype=torch.float32, device=dev)
    sm_f = torch.empty((rows, cols), dtype=torch.float32, device=dev) if small else None
    sm_h = torch.empty((rows, ld_h), dtype=torch.bfloat16, device=dev) if small_h else None
    hf = torch.empty((rows, ld_h), dtype=torch.bfloat16, device=dev) if half else None
    total = rows * ld_h // 4
    if total:
        nsm = _device(v)[1]
        launch(get_function("gemm_sm90.cu", "split_hybrid", dev.index),
               max(1, min(math.ceil(total / 256), 16 * nsm)), 256, (v.data_ptr(), rows, cols, v.stride(0), 0 if trunc else big.data_ptr(),
                0 if sm_f is None else sm_f.data_ptr(), 0 if sm_h is None else sm_h.data_ptr(),
                0 if hf is None else hf.data_ptr(), ld_h, int(trunc),
                0 if rowmax is None else rowmax.data_ptr()))
    return (big, sm_f, None if sm_h is None else sm_h[:, :cols],
            None if hf is None else hf[:, :cols])


def hybrid_b_maps(b_big: torch.Tensor, b_small_h: torch.Tensor) -> tuple[bytes, bytes]:
    """Tensor maps of a weight's hybrid split, for :func:`gemm_hybrid`'s ``b_maps``."""
    return (encode_tensor_map(b_big), encode_tensor_map(b_small_h, _BN, 64))


def gemm_hybrid(a: torch.Tensor, a_small: torch.Tensor, a_half: torch.Tensor, b: torch.Tensor,
                b_small_h: torch.Tensor, out: torch.Tensor, *,
                b_maps: tuple[bytes, bytes] | None = None, splits: int | None = None,
                partial: torch.Tensor | None = None) -> torch.Tensor:
    """``out = A @ B.T`` at float32-class accuracy: 3xTF32 with big(A) * small(B) in bf16
    (kernel gemm_sm90_tf32x3h), on the copies :func:`split_hybrid` makes.

    ``a``, ``a_small`` = A's tf32 big and small halves (fp32), ``a_half`` = bf16(A);
    ``b`` = B's tf32 big half, ``b_small_h`` = bf16(B - big). big(A)*small(B) runs in
    bf16, the rest in tf32. The big halves may be the fp32 operands themselves (the
    tensor cores truncate them to tf32) with the small halves of ``split_hybrid(...,
    trunc=True)``. ``b_maps`` may carry :func:`hybrid_b_maps` of B, cached.

    Split K (``splits > 1``, by default chosen for grids with fewer tiles than SMs) needs
    ``partial``, a (splits, M, N) float32 buffer, or allocates one; the partial products
    are summed into ``out`` in a fixed order."""
    M, K = a.shape
    N = b.shape[0]
    dev = a.device.index
    sm = _device(a)[1]
    tiles = math.ceil(M / _BM) * math.ceil(N / _BN)
    if splits is None:
        splits = hybrid_splits(M, N, K, sm)
    target, ldc, sstride = _splitk_target(out, splits, partial, M, N)
    grid = min(sm, tiles * splits)
    m = _hybrid_maps(a, a_small, a_half, b_maps or hybrid_b_maps(b, b_small_h))
    launch(get_function("gemm_sm90.cu", "gemm_sm90_tf32x3h", dev), grid, 384,
           (m[0], m[1], m[2], m[3], m[4], target.data_ptr(), M, N, K, ldc, splits, sstride),
           shared_mem=SMEM_BYTES["3h"])
    if splits > 1:
        _splitk_sum(target, splits, M, N, out, dev, sm)
    return out


def _hybrid_maps(a: torch.Tensor, a_small: torch.Tensor, a_half: torch.Tensor,
                 b_maps: tuple[bytes, bytes]) -> tuple[bytes, ...]:
    """The 3xTF32 kernels' tensor maps in their parameter order: A, B, A small, B small
    (bf16), bf16(A)."""
    return (encode_tensor_map(a), b_maps[0], encode_tensor_map(a_small), b_maps[1],
            encode_tensor_map(a_half, _BM, 64))


def hybrid_splits(M: int, N: int, K: int, sm: int) -> int:
    """The K splits :func:`gemm_hybrid` uses for an M x N x K product on ``sm`` SMs."""
    return _splits_for(math.ceil(M / _BM) * math.ceil(N / _BN), math.ceil(K / _BK), sm)


def gemm_hybrid_epilogue(a: torch.Tensor, a_small: torch.Tensor, a_half: torch.Tensor,
                         b_maps: tuple[bytes, bytes], N: int, epilogue_fn: Any, args: tuple,
                         nred: int) -> None:
    """The 3xTF32 GEMM ``A @ B.T`` (A's copies as for :func:`gemm_hybrid`, B by its
    :func:`hybrid_b_maps`) with a generated epilogue kernel ``epilogue_fn`` (codegen's
    Epilogue: gemm_sm90.cuh's mainloop and a tail) in one launch, K unsplit. ``args``:
    the epilogue's own parameter values; ``nred`` row reductions get their per-tile parts
    and row-block counters from the kept workspace (counters re-armed by the kernel)."""
    import cupy

    M, K = a.shape
    dev = a.device.index
    sm = _device(a)[1]
    tiles_m, tiles_n = math.ceil(M / _BM), math.ceil(N / _BN)
    part = cnt = 0
    if nred:
        part, cnt = _skinny_workspace(dev, cupy.cuda.get_current_stream().ptr,
                                      2 * nred * M * tiles_n, tiles_m)
    launch(epilogue_fn, min(sm, tiles_m * tiles_n), 384,
           _hybrid_maps(a, a_small, a_half, b_maps) + (M, N, K, cnt, part) + tuple(args),
           shared_mem=SMEM_BYTES["3h"])


def _splits_for(tiles: int, kblocks: int, sm: int) -> int:
    """Split K only when the tiles leave SMs idle, keeping >= 4 K blocks per split."""
    if tiles >= sm:
        return 1
    return max(1, min(sm // tiles, kblocks // 4, 16))


def _splitk_target(out: torch.Tensor, splits: int, partial: torch.Tensor | None, M: int,
                   N: int) -> tuple[torch.Tensor, int, int]:
    """Where the kernel writes: ``out`` itself, or with split K a (splits, M, N) buffer of
    partial products -- (target, its row stride, the stride between splits)."""
    if splits > 1:
        if partial is None:
            partial = torch.empty((splits, M, N), dtype=torch.float32, device=out.device)
        return partial, N, M * N
    return out, out.stride(0), 0


def _splitk_sum(partial: torch.Tensor, splits: int, M: int, N: int, out: torch.Tensor, dev: int,
                sm: int) -> None:
    """out = the fixed-order sum of the split-K partial products."""
    total = M * N
    launch(get_function("gemm_sm90.cu", "splitk_sum", dev),
           max(1, min(math.ceil(total / 256), 16 * sm)), 256, (partial.data_ptr(), splits, M * N, M, N, N, out.data_ptr(), out.stride(0)))


def gemm_wide(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *,
              b_map: bytes | None = None, splits: int | None = None,
              partial: torch.Tensor | None = None) -> torch.Tensor:
    """``out = a @ b.T`` in one tensor-core pass: TF32 for float32 ``a``/``b`` (the fp32
    bits as given), BF16 for bfloat16 ones (from :func:`to_bf16`); fp32 accumulation and
    output. ``b_map`` may carry b's cached tensor map (:func:`wide_b_map`).
    Split K as in :func:`gemm_hybrid`."""
    target, splits, sstride, _ = gemm_wide_parts(a, b, out, b_map=b_map, splits=splits,
                                                 partial=partial)
    if splits > 1:
        _splitk_sum(target, splits, a.shape[0], b.shape[0], out, a.device.index,
                    _device(a)[1])
    return out


def wide_splits(M: int, N: int, K: int, sm: int, elem: int = 4) -> int:
    """The K splits :func:`gemm_wide` takes for this shape."""
    return _splits_for(math.ceil(M / _WBM) * math.ceil(N / _WBN), math.ceil(K * elem / 128), sm)


def wide_grid(M: int, N: int, splits: int, sm: int) -> int:
    """The wide kernel's persistent grid: at most one CTA per SM, none without a work item
    (tile, K split). (Clusters of two CTAs along M sharing the weight box by multicast
    measured no faster, and slower on small shapes and 98's GEMM: docs/engine.md
    v28; the code is at tag wide-c2-v27.)"""
    return min(sm, math.ceil(M / _WBM) * math.ceil(N / _WBN) * splits)


def wide_b_map(b: torch.Tensor) -> bytes:
    """b's tensor map for the wide kernel (boxes of 256 rows), for ``b_map``."""
    return encode_tensor_map(b, _WBN)


def gemm_wide_parts(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *,
                    b_map: bytes | None = None, splits: int | None = None,
                    partial: torch.Tensor | None = None) -> tuple[torch.Tensor, int, int, int]:
    """:func:`gemm_wide` without the split-K sum: (where it wrote, splits, split stride,
    row stride) -- ``out`` itself when K is not split."""
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"gemm_wide takes two float32 or two bfloat16 matrices, got {a.dtype} "
                        f"and {b.dtype}")
    M, K = a.shape
    N = b.shape[0]
    dev = a.device.index
    sm = _device(a)[1]
    if splits is None:
        splits = wide_splits(M, N, K, sm, a.element_size())
    ta = encode_tensor_map(a, _WBM)
    tb = b_map or wide_b_map(b)
    target, ldc, sstride = _splitk_target(out, splits, partial, M, N)
    launch(get_function("gemm_sm90_wide.cu", _WFN[a.dtype], dev), wide_grid(M, N, splits, sm),
           384, (ta, tb, target.data_ptr(), M, N, K, ldc, splits, sstride),
           shared_mem=WIDE_SMEM_BYTES)
    return target, splits, sstride, ldc


# ---------------------------------------------------------------------------------
# skinny batches (kernels_cu/gemm_skinny.cu): each weight element read once; plain fp32 in
# tiles of up to 8 rows, 3xTF32 on wgmma in tiles of 16 (gemm_skinny_16wg)
_SKINNY_FN = {1: "gemm_skinny_1", 2: "gemm_skinny_2", 4: "gemm_skinny_4", 8: "gemm_skinny_8",
              16: "gemm_skinny_16wg"}  # by rows per tile
_SKINNY_MT = tuple(_SKINNY_FN)
_SKINNY_WARPS, _SKINNY_CPW = 4, 4  # the kernel's SK_WARPS, SK_CPW defaults
_SKINNY_COLS = _SKINNY_WARPS * _SKINNY_CPW  # columns per block (FMA tiles)
# 16-row tiles (kernels_cu/gemm_skinny.cuh's SKW_ knobs): warpgroups per block (64 columns
# each), blocks resident per SM (their launch bounds)
_SKINNY_WG, _SKINNY_WG_BLOCKS = 2, 2
_skinny_ws: dict[tuple[int, int], list] = caches.register("skinny workspaces", {})


def _skinny_workspace(dev: int, stream: int, parts: int, tiles: int) -> tuple[int, int]:
    """(partial-sum buffer, tile counters) kept per device and stream, grown on demand:
    the skinny kernel's K-split parts, and the epilogue kernels' row parts (as doubles).

    The counters start at zero and the kernel re-arms them, so they are zeroed once."""
    ws = _skinny_ws.get((dev, stream))
    if ws is None or ws[0].numel() < parts or ws[1].numel() < tiles:
        if capturing(False):
            # a CUDA graph being captured: its own buffers (the zeroing is captured too),
            # not kept for eager calls
            d = torch.device("cuda", dev)
            tmp = (torch.empty(parts, dtype=torch.float32, device=d),
                   torch.zeros(tiles, dtype=torch.int32, device=d))
            _capture_holds.append(tmp)
            del _capture_holds[:-64]
            return tmp[0].data_ptr(), tmp[1].data_ptr()
        with _lock:
            old = _skinny_ws.get((dev, stream))
            np_ = max(parts, old[0].numel() if old else 0, 1 << 16)
            nt = max(tiles, old[1].numel() if old else 0, 1024)
            d = torch.device("cuda", dev)
            ws = [torch.empty(np_, dtype=torch.float32, device=d),
                  torch.zeros(nt, dtype=torch.int32, device=d)]
            if old is not None:  # the old buffers may still be in use by queued launches
                torch.cuda.current_stream(d).synchronize()
            _skinny_ws[(dev, stream)] = ws
    return ws[0].data_ptr(), ws[1].data_ptr()


_capture_holds: list = []


def capturing(is_cupy: bool) -> bool:
    """Whether the caller's current stream is being captured into a CUDA graph."""
    if is_cupy:
        import cupy

        return cupy.cuda.get_current_stream().is_capturing()
    return torch.cuda.is_current_stream_capturing()




class SkinnyPlan(NamedTuple):
    """One skinny launch: entry point, rows per tile, column and row tiles, K splits, K
    per split, threads per block (grid: ``grid``)."""
    fn: str
    mt: int
    ctiles: int
    rtiles: int
    splits: int
    kspan: int
    threads: int

    @property
    def grid(self) -> tuple[int, int]:
        return (self.ctiles * self.rtiles, self.splits)




def skinny_tile_rows(M: int, N: int, K: int) -> int:
    """Rows per tile of the skinny launch for x (M, K) @ w (N, K).T: 1-8 run plain fp32
    FMAs, 16 runs 3xTF32 on the tensor cores (9-16 rows of a large weight)."""
    tiles = config.SKINNY_L2_ROW_TILES if N * K <= config.SKINNY_L2_W else config.SKINNY_ROW_TILES
    rows = config.SKINNY_TILE_ROWS if M <= tiles * config.SKINNY_TILE_ROWS else M
    return next((t for t in _SKINNY_MT if t >= min(M, rows)), _SKINNY_MT[-1])


def _whole_waves(tiles: int, smax: int, resident: int) -> int:
    """K splits (1 .. smax) for ``tiles`` blocks each, ``resident`` blocks at a time: the
    fewest waves per split, ceil(tiles * s / resident) / s, ties to the fewest splits (a
    last wave half full costs about as much as a full one). H100, 16 rows, ratio to the
    fp32-weight floor, 4-warp blocks of 4 per SM aimed at / 8-warp blocks in whole waves
    (2026-11-26): 12288^2 1.54 -> 1.30, 16384^2 1.21
    -> 1.17, 32768 x 8192 1.32 -> 1.15, 16384 x 1024 2.46 -> 1.97; 8-warp blocks aimed at
    4 per SM -> whole waves: 8192^2 1.41 -> 1.36, 4096^2 1.93 -> 1.94."""
    best_s, best_w = 1, -(-tiles // resident)
    w = best_w
    for _ in range(64):   # each wave count's most splits; beyond these splitting buys little
        s = min(w * resident // tiles, smax)
        if s >= 1 and w * best_s < best_w * s:
            best_s, best_w = s, w
        if s >= smax:
            break
        w += 1
    return best_s


def skinny_plan(M: int, N: int, K: int, sm: int, cols: int | None = None,
                threads: int = 32 * _SKINNY_WARPS) -> SkinnyPlan:
    """The gemm_skinny launch for x (M, K) @ w (N, K).T (``cols``, ``threads``: the block
    of a tuning variant of the FMA tiles; 16-row tiles have their own block and split K
    into whole waves of resident blocks)."""
    mt = skinny_tile_rows(M, N, K)
    fn = _SKINNY_FN[mt]
    if mt == 16:
        threads, cols = 128 * _SKINNY_WG, 64 * _SKINNY_WG
    elif cols is None:
        cols = _SKINNY_COLS
    ctiles, rtiles = -(-N // cols), -(-M // mt)
    smax = max(1, min(K // config.SKINNY_MIN_KSPAN, 64))
    if mt == 16:
        splits = _whole_waves(ctiles * rtiles, smax, _SKINNY_WG_BLOCKS * sm)
    else:
        splits = max(1, min(-(-4 * sm // (ctiles * rtiles)), smax))
    kspan = -(-K // splits)
    kspan = -(-kspan // 128) * 128
    splits = -(-K // kspan)
    return SkinnyPlan(fn, mt, ctiles, rtiles, splits, kspan, threads)


def gemm_skinny(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *,
                variant: tuple[int, ...] | None = None) -> torch.Tensor:
    """``out = x @ w.T`` for few rows (any M works; meant for M <= 16, where the GEMM
    streams the weight), plain fp32 in row tiles of up to 8 rows, 3xTF32 in tiles of 16
    (:func:`skinny_plan`'s ``mt``): one launch, deterministic (K splits are added in a
    fixed order by the last block of each tile). x (M, K), w (N, K), out (M, N), fp32,
    unit stride along K and N. ``variant`` = (warps, columns per warp, unroll, min
    blocks) compiles the kernel with other tuning knobs (for measurements)."""
    import cupy

    M, K = x.shape
    N = w.shape[0]
    if x.stride(1) != 1 or w.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("gemm_skinny needs unit stride along K (x, w) and N (out)")
    dev = x.device.index
    sm = _device(x)[1]
    opts: tuple[str, ...] = ()
    warps = _SKINNY_WARPS
    if variant is not None:
        warps = variant[0]
        opts = tuple(f"-D{k}={v}" for k, v in zip(("SK_WARPS", "SK_CPW", "SK_UNROLL", "SK_MINB"),
                                                   variant))
    cols = warps * (variant[1] if variant else _SKINNY_CPW)
    pl = skinny_plan(M, N, K, sm, cols, 32 * warps)
    part = cnt = 0
    if pl.splits > 1:
        part, cnt = _skinny_workspace(dev, cupy.cuda.get_current_stream().ptr,
                                      pl.splits * M * N, pl.ctiles * pl.rtiles)
    vec = int(K % 4 == 0 and x.stride(0) % 4 == 0 and w.stride(0) % 4 == 0
              and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0)
    launch(get_function("gemm_skinny.cu", pl.fn, dev, opts), pl.grid,
           pl.threads, (x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), M, N, K, pl.kspan,
            out.data_ptr(), out.stride(0), part, cnt, vec))
    return out
