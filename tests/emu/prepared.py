"""Prepared launches (cupyfuse/backend/prepared.py) on CPU tensors, their launches emulated.

``prepared.prepare`` builds a program's steps as it would for an H100 (compute
capability 9.0, 132 multiprocessors); ``Prepared.__call__`` then packs each step's
arguments into its C-layout parameter buffer and hands ``cuLaunchKernel`` a pointer to
each parameter. Here that launch is decoded from those pointers with the kernel's own
signature (``runtime.kernel_formats`` of its CUDA source: what the driver reads) and run
by an emulation of the kernel: tests/emu/gpu.py's for the generated level kernels
(``codegen._Emitter``'s addressing) and tail_seqred.cu's seq_reduce; the skinny GEMM
(gemm_skinny.cu: y[m * ldy + n] = sum_k x[m * ldx + k] w[n * ldw + k]) as
tests/emu/gpu.py's GEMMs are, in float64; the skinny kernel with a level's tail in its
last blocks (codegen.fused_skinny_source) as the two. Buffers are CPU tensors
(``prepared._torch_device``), addresses host addresses, so a wrong template position,
patch slot, row count, stride or buffer shows as a wrong result or a check failing here.
The full path (the first call of a workspace) and the ready plan (later calls) both run.

The GEMV and fold rewrites' kernels (tail_rewrite.cu's gemv_rows, fold_rows,
pairdiff_rows) are emulated too (their guards included; the derived weights they read,
made by rewrite.py's caches during a call, count as the call's memory).

Not emulated (NotImplementedError): the tensor-core engine's launches (batches past the
skinny kernel's: use few rows), the certification and BatchNorm's column statistics;
:func:`runnable` gives a program's unrewritten form where it has rewrites.
"""
from __future__ import annotations

import ctypes
import re
import types
from typing import Any, Sequence

import numpy as np
import torch

from cupyfuse import config
from cupyfuse.backend import codegen, engine, prepared, runtime
from cupyfuse.ir import rewrite
from cupyfuse.ir.program import Program

from emu import gpu as _gpuemu
from emu.gpu import _level, _seq_reduce

SM = 132
STREAM = 0x5EED   # the stream handle a call passes (any int: nothing runs on it)

_CTYPES = {"P": ctypes.c_uint64, "q": ctypes.c_int64, "Q": ctypes.c_uint64,
           "i": ctypes.c_int32, "I": ctypes.c_uint32, "f": ctypes.c_float,
           "d": ctypes.c_double}


class Launch:
    """One decoded launch: kernel name, grid, block, the parameter values and whether it
    was a programmatic dependent launch (runtime.launch_dependent)."""

    def __init__(self, name: str, grid: tuple, block: int, vals: tuple,
                 dep: bool = False) -> None:
        self.name, self.grid, self.block, self.vals = name, grid, block, vals
        self.dep = dep

    def __repr__(self) -> str:
        return f"Launch({self.name}, grid={self.grid}, block={self.block})"


def decode(fmt: str, params: int) -> tuple:
    """The parameter values of a launch: ``params`` is the address of the array of
    pointers ``cuLaunchKernel`` gets (one per parameter, in signature order), each read
    with its struct code; each parameter's offset from the first must be aligned for its
    type (C layout)."""
    items = re.findall(r"(\d*)([a-zA-Z])", fmt)
    ptrs = (ctypes.c_void_p * len(items)).from_address(params)
    vals = []
    base = ptrs[0] if items else 0
    for (count, code), p in zip(items, ptrs):
        if code == "s":
            size = int(count)
            assert (p - base) % (128 if size == 128 else 1) == 0, (fmt, p - base)
            vals.append(ctypes.string_at(p, size))
            continue
        ct = _CTYPES[code]
        assert (p - base) % ctypes.sizeof(ct) == 0, f"{fmt}: parameter misaligned"
        vals.append(ct.from_address(p).value)
    return tuple(vals)


def _skinny(vals: tuple, block: int) -> None:
    x, ldx, w, ldw, M, N, K, kspan, y, ldy, part, counters, vec = vals[:13]
    assert block in (engine._SKINNY_WARPS * 32, engine._SKINNY_WG * 128)   # FMA / wgmma tiles
    assert M >= 1 and N >= 1 and K >= 1 and ldx >= K and ldw >= K and ldy >= N
    assert kspan >= 1 and (kspan >= K or part), "K split without a workspace"
    if vec:   # the float4 path: 16-byte aligned rows
        assert x % 16 == 0 and w % 16 == 0 and K % 4 == 0 and ldx % 4 == 0 and ldw % 4 == 0
    xi = torch.arange(M)[:, None] * ldx + torch.arange(K)[None, :]
    wi = torch.arange(N)[:, None] * ldw + torch.arange(K)[None, :]
    X = torch.from_numpy(_gpuemu._mem(x, int(xi.max()) + 1).copy())[xi]
    W = torch.from_numpy(_gpuemu._mem(w, int(wi.max()) + 1).copy())[wi]
    if kspan < K and not counters:
        # the partial sums left for the tail (gemm_skinny.cuh: no counters): split 0 holds
        # the product, the others zeros (their fixed-order sum is the product, bit for bit)
        splits = -(-K // kspan)
        pi = torch.arange(M)[:, None] * N + torch.arange(N)[None, :]
        P = _gpuemu._mem(part, splits * M * N)
        P[:] = 0.0
        P[pi.numpy()] = (X.double() @ W.double().t()).float().numpy()
        return
    yi = torch.arange(M)[:, None] * ldy + torch.arange(N)[None, :]
    Y = _gpuemu._mem(y, int(yi.max()) + 1)
    Y[yi.numpy()] = (X.double() @ W.double().t()).float().numpy()


def _row_bound(xr: np.ndarray, K: int, rowmax: int, r: int) -> float:
    """tail_rewrite.cu's rw_row_bound: K max|x_r| from the row maxima where given (the
    entry reset to 0), else sum |x_r| in double."""
    if rowmax:
        m = _gpuemu._mem(rowmax, r + 1)
        b = float(K) * float(m[r:r + 1].view(np.float32)[0])
        m[r:r + 1].view(np.uint32)[0] = 0
        return b
    return float(np.abs(xr.astype(np.float64)).sum())


def _direct(xr: np.ndarray, K: int, w: int, ldwn: int, ldwk: int, a: np.ndarray,
            c: np.ndarray, n: int) -> np.float32:
    """rewrite_rows.cuh's rw_direct: fl(fl(h_n a_n) + c_n), h_n the float32 dot product
    (here rounded from float64)."""
    wn = _gpuemu._mem(w + 4 * n * ldwn, (K - 1) * ldwk + 1)[::ldwk][:K]
    h = np.float32(float(xr.astype(np.float64) @ wn.astype(np.float64)))
    return np.float32(np.float32(h * a[n]) + c[n])


def _rows_vec(vec: int, x: int, ldx: int, K: int) -> None:
    if vec:   # the float4 path: 16-byte aligned rows
        assert x % 16 == 0 and K % 4 == 0 and ldx % 4 == 0, "float4 path on a misaligned x"


def _fold_rows(vals: tuple, rows: int) -> None:
    x, ldx, K, wmax, w, ldwn, ldwk, a, c, k, st, wo, bf, h, ldh, vec, rowmax = vals
    _rows_vec(vec, x, ldx, K)
    N = (wo - 1) * st + k
    av, cv, bv = _gpuemu._mem(a, N), _gpuemu._mem(c, N), _gpuemu._mem(bf, wo)
    for r in range(rows):
        xr = _gpuemu._mem(x + 4 * r * ldx, K)
        hr = _gpuemu._mem(h + 4 * r * ldh, wo)
        asum = _row_bound(xr, K, rowmax, r)
        if asum * wmax < 1e37:
            hr[:] = hr + bv
        elif asum != asum:
            hr[:] = np.float32("nan")
        else:
            for o in range(wo):
                s = np.float32(0.0)
                for j in range(k):
                    s = np.float32(s + _direct(xr, K, w, ldwn, ldwk, av, cv, o * st + j))
                hr[o] = np.float32(s / np.float32(k))


def _pairdiff_rows(vals: tuple, rows: int) -> None:
    x, ldx, K, wmax, w, ldwn, ldwk, a, c, hp, e, z, ldz, out, ldo, vec, rowmax = vals
    _rows_vec(vec, x, ldx, K)
    av, cv, ev = _gpuemu._mem(a, 2 * hp), _gpuemu._mem(c, 2 * hp), _gpuemu._mem(e, hp + 1)
    for r in range(rows):
        xr = _gpuemu._mem(x + 4 * r * ldx, K)
        zr = _gpuemu._mem(z + 4 * r * ldz, hp + 1)
        o = _gpuemu._mem(out + 4 * r * ldo, 1)
        asum = _row_bound(xr, K, rowmax, r)
        if asum != asum:
            o[0] = np.float32("nan")
        elif asum * wmax < 5e36:
            s = float(np.abs((zr[:hp] + ev[:hp]).astype(np.float64)).sum())
            o[0] = np.float32((float(zr[hp]) + float(ev[hp]) + s) * 0.5)
        else:
            s = 0.0
            for j in range(hp):
                u = _direct(xr, K, w, ldwn, ldwk, av, cv, 2 * j)
                v = _direct(xr, K, w, ldwn, ldwk, av, cv, 2 * j + 1)
                s += float(u if (u > v or u != u) else v)
            o[0] = np.float32(s)


def _gemv_rows(vals: tuple, rows: int) -> None:
    x, ldx, K, u, C, wmax, w, ldwn, ldwk, N, a, c, out, ldo, vec = vals
    _rows_vec(vec, x, ldx, K)
    uv = _gpuemu._mem(u, 2 * K).view(np.float64)[:K]
    av, cv = _gpuemu._mem(a, N), _gpuemu._mem(c, N)
    for r in range(rows):
        xr = _gpuemu._mem(x + 4 * r * ldx, K).astype(np.float64)
        o = _gpuemu._mem(out + 4 * r * ldo, 1)
        asum = float(np.abs(xr).sum())
        if asum != asum:
            o[0] = np.float32("nan")
        elif asum * wmax < 1e37:
            o[0] = np.float32(float(xr @ uv) + C)
        else:
            o[0] = np.float32(sum(float(_direct(xr.astype(np.float32), K, w, ldwn, ldwk, av, cv,
                                                n)) for n in range(N)))


#: the derived weights (rewrite.py's folds and GEMV coefficients) made during emulated
#: calls: memory every later call may read too (a ready plan points into them)
_derived: list = []

#: during a prepared call (:func:`call`): the memory it may touch, {start: end} -- its
#: inputs and sources, the workspace, the results, the skinny workspace; every emulated
#: access is checked against it before it happens (None: no checks)
_regions: dict[int, int] | None = None


def _register(t: Any) -> None:
    if _regions is not None and isinstance(t, torch.Tensor) and t.numel():
        st = t.untyped_storage()
        _regions[st.data_ptr()] = st.data_ptr() + st.nbytes()


def _checked_mem(ptr: int, n: int) -> np.ndarray:
    """emu.gpu._mem, refusing an access outside the memory the call was given."""
    if _regions is not None:
        end = ptr + 4 * max(n, 1)
        assert any(a <= ptr and end <= b for a, b in _regions.items()), \
            f"an access of {n} floats at {ptr:#x} outside every buffer of the call"
    return _plain_mem(ptr, n)


_plain_mem = _gpuemu._mem
_plain_lmem = _gpuemu._lmem


def _checked_lmem(ptr: int, n: int) -> np.ndarray:
    """emu.gpu._lmem (int64), checked as :func:`_checked_mem`."""
    if _regions is not None:
        end = ptr + 8 * max(n, 1)
        assert any(a <= ptr and end <= b for a, b in _regions.items()), \
            f"an access of {n} int64 values at {ptr:#x} outside every buffer of the call"
    return _plain_lmem(ptr, n)


def _level_of(name: str) -> tuple[codegen.Plan, codegen.Level]:
    for pl in list(codegen._plans.values()):
        for lv in pl.levels:
            if lv.kernel and (name in (lv.name, lv.name + "_cl") or name.startswith(lv.name + "_sk")
                              or name.startswith(lv.name + "_ks")):
                return pl, lv
    raise NotImplementedError(f"emulating the generated kernel {name}")


def install(monkeypatch: Any) -> list[Launch]:
    """Patch prepared.py (and what it calls) so prepared launches run on CPU tensors,
    emulated; returns the list every launch is appended to (decoded)."""
    kernels: dict[int, Any] = {}
    by_key: dict[tuple, Any] = {}
    log: list[Launch] = []
    _derived.clear()

    def register(key: tuple, name: str, fmt: str) -> Any:
        k = by_key.get(key)
        if k is None:
            k = types.SimpleNamespace(raw=types.SimpleNamespace(), ptr=0x1000 + len(kernels),
                                      name=name, fmt=fmt, max_dynamic_smem=48 * 1024, key=key)
            kernels[k.ptr] = by_key[key] = k
        return k

    def get_function(source: str, name: str, dev: int, extra: Sequence[str] = ()) -> Any:
        fmts = runtime.kernel_formats(runtime.expand_source(source))
        return register(("fixed", source, name), name, fmts[name])

    def generated_kernel(name: str, source: str, dev: int) -> Any:
        return register(("generated", name), name, runtime.kernel_formats(source)[name])

    def launch(fptr: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, smem: int,
               stream: int, params: int, extra: int, dep: bool = False) -> None:
        k = kernels[fptr]
        assert stream == STREAM and by == bz == 1 and extra == 0
        assert gx >= 1 and gy >= 1 and gz >= 1, (k.name, gx, gy, gz)
        vals = decode(k.fmt, params)
        log.append(Launch(k.name, (gx, gy, gz), bx, vals, dep))
        if k.key == ("fixed", "tail_seqred.cu", "seq_reduce"):
            assert bx == 256 and gx <= 65535 and gy == gz == 1
            _seq_reduce(vals)
        elif k.key[:2] == ("fixed", "gemm_skinny.cu"):
            _skinny(vals, bx)
        elif k.key[:2] == ("fixed", "tail_rewrite.cu"):
            assert bx == 256 and gy == gz == 1
            {"fold_rows": _fold_rows, "pairdiff_rows": _pairdiff_rows,
             "gemv_rows": _gemv_rows}[k.key[2]](vals, gx)
        elif k.key[0] == "generated":
            pl, lv = _level_of(k.name)
            # (a tail reading split-K partial sums, codegen.ksum_source: its GEMM value
            # is the emulated skinny kernel's split 0, the others zeros)
            name = re.sub(r"_ks\d+_\d+", "", k.name)
            if name == lv.name:   # one block per row
                assert bx == lv.threads and gy == gz == 1
                _level(pl, lv, gx, vals)
            elif name == lv.name + "_cl":   # each row over a cluster of lv.split blocks
                assert bx == lv.split_threads and gy == gz == 1 and lv.split > 1
                assert gx % lv.split == 0 and gx // lv.split <= config.SPLIT_MAX_ROWS
                _level(pl, lv, gx // lv.split, vals)
            else:   # the skinny GEMM, then the tail rows in its last blocks
                _skinny(vals[:13], bx)
                ntail, tail = vals[14], vals[15:]
                assert 1 <= ntail <= gx
                _level(pl, lv, tail[0], tail)
        else:
            raise NotImplementedError(f"emulating {k.key}")

    ws: dict[tuple[int, int], list] = {}
    orig_workspace, orig_new = prepared.Prepared._workspace, prepared._new

    def workspace(self: prepared.Prepared, stream: int, is_cupy: bool) -> tuple:
        got = orig_workspace(self, stream, is_cupy)
        for b in got[0]:
            _register(b)
        return got

    def new(*a: Any) -> Any:
        t = orig_new(*a)
        _register(t)
        return t

    def skinny_workspace(dev: int, stream: int, parts: int, tiles: int) -> tuple[int, int]:
        w = ws.get((dev, stream))
        if w is None or w[0].numel() < parts or w[1].numel() < tiles:   # grown: a new object
            w = ws[(dev, stream)] = [torch.empty(max(parts, 1 << 16)),
                                     torch.zeros(max(tiles, 1024), dtype=torch.int32)]
        for t in w:
            _register(t)
        return w[0].data_ptr(), w[1].data_ptr()

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setattr(prepared, "_sm_count", lambda dev: SM)
    monkeypatch.setattr(prepared, "get_function", get_function)
    monkeypatch.setattr(runtime, "generated_kernel", generated_kernel)
    monkeypatch.setattr(prepared, "_launch_kernel", launch)
    monkeypatch.setattr(prepared, "_launch_dependent",
                        lambda *a: launch(*a, dep=True))
    monkeypatch.setattr(prepared, "torch_stream", lambda dev: STREAM)
    monkeypatch.setattr(prepared, "_bind_context", lambda dev: None)
    monkeypatch.setattr(prepared, "_torch_device", lambda dev: torch.device("cpu"))
    monkeypatch.setattr(prepared, "_devices", {})
    monkeypatch.setattr(prepared, "_skinny_ws", ws)
    monkeypatch.setattr(engine, "_skinny_ws", ws)
    monkeypatch.setattr(engine, "_skinny_workspace", skinny_workspace)
    monkeypatch.setattr(engine, "capturing", lambda is_cupy: False)
    def derived(fn: Any) -> Any:
        def made(*a: Any, **kw: Any) -> Any:
            out = fn(*a, **kw)
            for t in out:
                if isinstance(t, torch.Tensor):
                    _derived.append(t)
                    _register(t)
            return out
        return made

    monkeypatch.setattr(rewrite, "fold_coefficients", derived(rewrite.fold_coefficients))
    monkeypatch.setattr(rewrite, "gemv_coefficients", derived(rewrite.gemv_coefficients))
    monkeypatch.setattr(prepared.Prepared, "_workspace", workspace)
    monkeypatch.setattr(prepared, "_new", new)
    monkeypatch.setattr(_gpuemu, "_mem", _checked_mem)
    monkeypatch.setattr(_gpuemu, "_lmem", _checked_lmem)
    return log


def runnable(prog: Program) -> Program:
    """The program, or its unrewritten form where it has GEMV/fold rewrites: the emulated
    general path (tests/emu/gpu.py) runs a rewrite in its torch form, whose bits the emulated
    tail_rewrite.cu kernels need not match (tests comparing the two paths bit for bit)."""
    if any(n.kind == "gemv" or n.kind == "gemm" and len(n.attrs) > 2 for n in prog.nodes):
        prog = prog.unrewritten
    if prog is None or any(n.kind == "bn" for n in prog.nodes):
        raise NotImplementedError("BatchNorm programs are not emulated")
    return prog


def prepare(prog: Program, tens: Sequence[torch.Tensor], sources: Sequence[Any]
            ) -> prepared.Prepared | None:
    """prepared.prepare for these inputs (rows first, as the runner passes them) and sources,
    through prepared.usable as runner._try_prepare does."""
    u = prepared.usable(prog)
    if u is None:
        return None
    in_meta = [(tuple(t.shape), tuple(t.stride())) for t in tens]
    src_meta = [(tuple(t.shape), tuple(t.stride())) if isinstance(t, torch.Tensor) else None
                for t in sources]
    return prepared.prepare(u[0], tens[0].shape[0], 0, in_meta, src_meta, allow_bn=True,
                            small_weights_only=u[1])


def call(pr: prepared.Prepared, tens: Sequence[torch.Tensor], sources: Sequence[Any]) -> Any:
    """One prepared call (as the runner's fast paths make it), every emulated memory access
    checked to fall in the call's operands, workspace and results."""
    global _regions
    _regions = {}
    try:
        for t in list(tens) + list(sources):
            _register(t)
        for w in engine._skinny_ws.values():
            for t in w:
                _register(t)
        for ws in pr._ws.values():   # a kept workspace (the ready plan's)
            for b in ws[0]:
                _register(b)
        for t in _derived:
            _register(t)
        return pr([t.data_ptr() for t in tens],
                  [t.data_ptr() if isinstance(t, torch.Tensor) else 0 for t in sources],
                  STREAM, False, sources)
    finally:
        _regions = None


def same_bits(a: Any, b: Any) -> bool:
    """Bitwise equality of two results (tensors, or tuples/lists of them)."""
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(
            same_bits(x, y) for x, y in zip(a, b))
    # (flattened: a 0-d int64 result has no int32 view)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
        a.contiguous().reshape(-1).view(torch.int32).numpy(),
        b.contiguous().reshape(-1).view(torch.int32).numpy())
