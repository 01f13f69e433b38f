"""Prepared launches: a tail program at one batch size, as a list of kernel launches built once.

A repeated call with the same shapes then costs a key lookup, the pointer reads of its
operands, one allocation per buffer and the launches themselves (argument buffers
packed from templates with only the addresses patched) -- no tracing, no planning, no
CuPy/torch stream contexts. Used by :func:`cupyfuse.fused_linear` and by fused modules
for programs whose GEMMs run the skinny kernel (small batches, see
:func:`cupyfuse.backend.gemm.skinny_for`) or the tensor-core engine (``engine_batch_ok``),
which is where a call's cost is host time, and for GEMV rewrites at any batch
(``kernels_cu/tail_rewrite.cu``: its guard needs no host synchronisation). A folded GEMM
(average pooling folded into the weight, or pair differences) runs the smaller GEMM with
the cached folded weight, then ``tail_rewrite.cu``'s fold_rows or pairdiff_rows (bias or
row sum, guard and direct rows on the device). A program with a sequence reduction runs
each level on its own rows and each reduction as a step of its own (see :func:`usable`).

What is fixed in a prepared call, and checked on every call: the operands' shapes,
strides, dtype (float32) and device, the parameters' shapes and strides. Anything else
(a transposed weight source, BatchNorm statistics with CuPy operands, a non-sm90 GPU)
is not prepared and runs the general path.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

import contextlib
import math
import ctypes
import threading
import weakref

from cupyfuse import config
from cupyfuse.ir import certify, rewrite
from cupyfuse.backend import codegen, engine, gemm
from cupyfuse import caches, interop, tracking
from cupyfuse.backend import runtime as _runtime
from cupyfuse.ir.program import BATCH, Node, Program, TailError, shape_of
from cupyfuse.backend.runtime import Kernel, get_function
from cupyfuse.backend import certified

_addressof = ctypes.addressof
_memmove = ctypes.memmove
_get_ident = threading.get_ident
_skinny_ws = engine._skinny_ws
_encode_map = engine.encode_map
_launch_dependent = _runtime.launch_dependent
_F32 = torch.float32
_I64 = torch.int64


def _launch_kernel(*args: Any) -> None:
    from cupy.cuda import driver

    global _launch_kernel
    _launch_kernel = driver.launchKernel
    driver.launchKernel(*args)

__all__ = ["Prepared", "prepare", "usable", "torch_stream", "current_device"]

# pointer tables of a call
IN, SRC, BUF = 0, 1, 2


def _bind_context(dev: int) -> None:
    """Make ``dev``'s primary context the calling thread's current one where the thread
    has none yet (cudaSetDevice of the device torch has current: the runtime binds its
    context to the thread). A thread with a context already is left as it is: where
    torch and CuPy load runtimes of their own, CuPy's current device is not moved."""
    from cupy.cuda import driver, runtime

    if driver.ctxGetCurrent() == 0:
        runtime.setDevice(dev)


def torch_stream(dev: int) -> int:
    """The raw pointer of torch's current stream on a device (cheap form)."""
    return torch._C._cuda_getCurrentRawStream(dev)


def current_device() -> int:
    return torch._C._cuda_getDevice()


class _Step:
    """One launch: kernel, geometry, a parameter template and the slots to patch."""

    __slots__ = ("fn", "grid", "block", "fmt", "template", "patch", "smem", "skinny",
                 "fptr", "eng", "gemv", "fold", "cert", "dep")

    def __init__(self, fn: Kernel, grid: Any, block: int, template: list,
                 patch: list[tuple[int, int, int]], smem: int = 0,
                 skinny: tuple | None = None,
                 eng: tuple | None = None, gemv: tuple | None = None,
                 fold: tuple | None = None, cert: tuple | None = None) -> None:
        self.fn, self.fmt = fn, fn.fmt   # the kernel's signature, read from its source
        if len(template) != len(_runtime._layout(fn.fmt)[0]):
            raise AssertionError(f"prepared step for {fn.name}: {len(template)} arguments, "
                                 f"the kernel takes {fn.fmt!r}")
        self.grid = (grid, 1, 1) if isinstance(grid, int) else tuple(grid) + (1,) * (3 - len(grid))
        self.block = block
        self.template, self.patch, self.smem = template, tuple(patch), smem
        # skinny GEMM: (x slot, w slot, partial-sum floats, tiles, float4 path possible,
        # tail fused in); its parameters 10, 11 (workspace), 12 (float4 path) and, fused,
        # 13 (grid counters) are set per call
        self.skinny = skinny
        # the 3xTF32 engine's GEMM: (x big, x small, bf16 x buffers, weight source index),
        # plus (x slot, rows, K, row stride) when the big halves are the fp32 operands
        # themselves (batches past config.ROUNDED_BIG_MAX_M; x big is -1); its tensor maps
        # (parameters 0-4) are set per call: x's from the workspace (x's own, encoded from
        # its address, when truncated), the weight's from its cached split (caches.cached:
        # rebuilt when the weight changes)
        self.eng = eng
        # a GEMV rewrite (tail_rewrite.cu): (program, node, weight source index, x slot, float4
        # path possible); its coefficients (parameters 3, 4, 5, 10, 11) come per call from
        # the derived-weight cache (rebuilt when a parameter involved changes)
        self.gemv = gemv
        # a folded GEMM's step (rewrite.py's average-pooling fold or pair differences):
        # (program, node, weight source index, role); role "gemm": the engine's or the
        # skinny kernel's weight is the folded W' from the derived-weight cache; "rows":
        # tail_rewrite.cu's fold_rows or pairdiff_rows, whose parameters 3 (guard bound),
        # 7, 8 (a, c), the folded bias (its position in place 6) and 15 (float4 path, from
        # the x slot in place 4) come per call
        self.fold = fold
        # a certified folded GEMM (cupyfuse/certify.py), with ``fold`` set too:
        # ("gemm", x slot, rows, K, row stride): the one-pass TF32 kernel, whose tensor maps
        # (parameters 0, 1) are x's, from its address, and the folded weight's, cached;
        # ("rows", x slot, float4 path possible): the certification kernel, which finishes
        # the fold (its parameters 20-26: fold_rows's direct rows); parameters 3 (float4
        # path), 4 (W'), 6, 7 (its norms), 9 (guard bound), 10 (folded bias), 23, 24 (a, c)
        # come per call
        self.cert = cert
        # a programmatic dependent launch (runtime.launch_dependent): the certification
        # kernel, which reads x before it waits for the GEMM before it
        self.dep = cert is not None and cert[0] == "rows"
        self.fptr = fn.ptr
        if smem > fn.max_dynamic_smem:
            fn.raw.max_dynamic_shared_size_bytes = smem
            fn.max_dynamic_smem = smem


class _Launch:
    """One launch of a ready plan, its parameters packed once: a C buffer per thread
    holding every parameter in place, where a call writes only the operands' and the
    results' addresses (and the float4 flag, an engine x's map) before launching. Per
    thread, because a launch reads the buffer when it is made (cuLaunchKernel copies
    the parameters before it returns) and two threads may call the same plan."""

    __slots__ = ("fptr", "g0", "g1", "g2", "block", "smem", "image", "offs", "patch",
                 "vec", "xmap", "tb", "dep")

    def __init__(self, fptr: int, g: tuple, block: int, smem: int, fmt: str, a: list,
                 patch: tuple, vec: Any, xmap: Any, dep: bool = False) -> None:
        self.fptr, (self.g0, self.g1, self.g2), self.block, self.smem = fptr, g, block, smem
        items, total = _runtime._layout(fmt)
        pk = _runtime._Packer(fmt)
        pk.st.pack_into(pk.buf, pk.off, *a)
        self.image = pk.buf.raw[pk.off:pk.off + total]
        self.offs = [off for _, off in items]
        if any(items[pos][0] != "P" for pos, _, _ in patch) or \
                (vec and items[vec[0]][0] != "i") or (xmap and items[0][0] != "128s"):
            raise AssertionError(f"ready launch: patched slots {patch} of {fmt!r}")
        self.patch = patch    # (slot, table, index): BUF i is result i
        self.vec = vec        # (position, slots): that int parameter 1 where every slot's
                              # address is 16-byte aligned (the float4 path), else 0
        self.xmap = xmap      # (x slot, rows, K, row stride): parameter 0 from x's address
        self.dep = dep        # a programmatic dependent launch (a tail after a skinny GEMM)
        self.tb: dict[int, tuple] = {}

    def buffers(self, tid: int, dev: int) -> tuple:
        """This thread's parameter buffer: (the kernelParams address, a cell per patched
        slot, the float4 flag's cell or None, the map's address or 0, the C objects).
        Made at a thread's first launch of this plan, which also makes ``dev``'s primary
        context current for the thread: one that has not used CUDA through the runtime
        yet has none, and cuLaunchKernel needs one (it failed with
        CUDA_ERROR_INVALID_CONTEXT in a fresh thread)."""
        _bind_context(dev)
        n = len(self.image)
        buf = ctypes.create_string_buffer(n + 128)
        base = (ctypes.addressof(buf) + 127) & ~127
        ctypes.memmove(base, self.image, n)
        ptrs = (ctypes.c_void_p * len(self.offs))(*[base + off for off in self.offs])
        cells = tuple([(ctypes.c_uint64.from_address(base + self.offs[pos]), t, i)
                       for pos, t, i in self.patch])
        vcell = ctypes.c_int32.from_address(base + self.offs[self.vec[0]]) if self.vec \
            else None
        b = (ctypes.addressof(ptrs), cells, vcell, base + self.offs[0] if self.xmap else 0,
             (buf, ptrs))
        if len(self.tb) > 64:   # threads come and go: forget them
            self.tb.clear()
        self.tb[tid] = b
        return b


class Prepared:
    """The launches of one program at one batch size on one device (see module doc)."""

    __slots__ = ("steps", "bufs", "out_buf", "out_shape", "more", "outs_type", "res_bufs",
                 "dev", "_ws", "_wsb", "bf16", "zeroed", "i64", "res_long",
                 "aligned", "highest", "all_sources", "simple", "_ready", "__weakref__")

    def __init__(self) -> None:
        self.steps: list[_Step] = []
        self.bufs: list[tuple[int, ...]] = []     # shape of each buffer a call needs
        self.out_buf = -1
        self.out_shape: tuple[int, ...] = ()
        # a forward returning several results (Program.more_outs): (buffer, shape) of each
        # result after the first, and the container (tuple/list) they come back in; the
        # outs_type of a one-element container too
        self.more: tuple[tuple[int, tuple[int, ...]], ...] = ()
        self.outs_type: type | None = None
        self.res_bufs: frozenset[int] = frozenset()   # every result's buffer
        self.dev = 0
        # per (stream, caller kind): the buffers other than the result, kept between calls
        # (stream order makes reuse safe)
        self._ws: dict[tuple[int, bool], tuple[list, list[int], dict]] = {}
        self._wsb: dict[tuple[int, bool], int] = {}   # bytes of each kept workspace
        self.bf16: set[int] = set()      # buffers holding bfloat16 (the engine's bf16 x)
        # buffers holding int64 (argmax/argmin: codegen writes index values so), and for
        # ``out`` then each of ``more``: whether that result is one (torch's int64)
        self.i64: set[int] = set()
        self.res_long: tuple[bool, ...] = (False,)
        # int32 buffers allocated as zeros, which the steps leave as zeros (x's row maxima:
        # the split's atomicMax, reset by fold_rows / pairdiff_rows)
        self.zeroed: set[int] = set()
        self.aligned: list[tuple[int, int]] = []   # slots whose address must be 16-byte aligned
        self.highest = False             # an engine step: runs only at precision "highest"
        self.all_sources = False         # a GEMV step: needs every source object per call
        # a call's arguments are fixed per stream but for the operands' and the result's
        # addresses (and x's tensor map or float4 flag where x is an operand), while the
        # engine's weights and the sources of the derived weights are the same tensors at
        # the same version; so each kept workspace gets a ready plan (_ready: per (stream,
        # caller kind): the skinny workspace it was built with, per step its launch with
        # every other argument in place, the weights and sources it read with their
        # versions and addresses, and the cached splits and derived weights, held);
        # ``simple`` False: none (A/B checks of the ready plan against the full path)
        self.simple = True
        self._ready: dict[tuple[int, bool], tuple] = {}

    def _workspace(self, stream: int, is_cupy: bool) -> tuple[list, list[int], dict]:
        """The buffers other than the result, kept per (stream, caller kind): torch
        tensors allocated on that stream, and the tensor maps of the engine's x copies."""
        key = (stream, is_cupy)
        ws = self._ws.get(key)
        if ws is None:
            d = _torch_device(self.dev)
            ctx = contextlib.nullcontext() if stream == torch_stream(self.dev) else \
                torch.cuda.stream(torch.cuda.ExternalStream(stream, device=d))
            with ctx:   # allocated on the stream that uses them
                bufs = [None if k in self.res_bufs else
                        torch.zeros(shape, device=d, dtype=torch.int32) if k in self.zeroed else
                        torch.empty(shape, device=d,
                                    dtype=torch.bfloat16 if k in self.bf16 else
                                    torch.int64 if k in self.i64 else torch.float32)
                        for k, shape in enumerate(self.bufs)]
            maps = {}
            for i, st in enumerate(self.steps):
                if st.eng is not None:
                    xb, xs, xh = (None if j < 0 else bufs[j] for j in st.eng[:3])
                    K = st.template[8]
                    maps[i] = (None if xb is None else engine.encode_tensor_map(xb),
                               engine.encode_tensor_map(xs),
                               engine.encode_tensor_map(xh[:, :K], engine._BM, 64))
            ws = (bufs, [0 if b is None else b.data_ptr() for b in bufs], maps)
            if engine.capturing(is_cupy):
                return ws   # memory of the caller's graph: not kept for eager calls
            size = sum(b.numel() * b.element_size() for b in bufs if b is not None)
            if len(self._ws) >= 8:
                self._drop(next(iter(self._ws)))
            if size > config.WS_KEEP_BYTES or _kept_bytes[0] + size > config.WS_KEEP_TOTAL:
                return ws   # large: back to torch's caching allocator after the call
            self._ws[key] = ws
            self._wsb[key] = size
            _kept_bytes[0] += size
            _kept.add(self)
        return ws

    def _drop(self, key: tuple[int, bool]) -> None:
        self._ws.pop(key, None)
        self._ready.pop(key, None)
        _kept_bytes[0] -= self._wsb.pop(key, 0)

    def release(self) -> None:
        """Give the kept workspaces back (torch's caching allocator holds them after)."""
        for key in list(self._ws):
            self._drop(key)

    def __del__(self) -> None:
        try:
            _kept_bytes[0] -= sum(self._wsb.values())
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def __call__(self, in_ptrs: Sequence[int], src_ptrs: Sequence[int], stream: int,
                 is_cupy: bool, sources: Sequence[Any] = (), precision: str | None = None
                 ) -> Any:
        """Allocate the result, launch every step on ``stream``, return the result; None
        (nothing launched) where this call does not suit the prepared launches: an
        unaligned operand for the engine, another precision than "highest" for it, a
        weight whose cached split cannot be kept (no torch owner), or a GEMV whose sources
        are not all here as torch tensors or whose weight has a non-finite element."""
        tables0 = (in_ptrs, src_ptrs)
        for t, i in self.aligned:
            if tables0[t][i] & 15:
                return None
        ready = self._ready.get((stream, is_cupy))
        if ready is not None and (ready[0] is not _skinny_ws.get((self.dev, stream)) or
                                  interop.poison_outputs):
            ready = None
        if ready is not None and ready[2]:
            # the engine's weights and the sources a derived weight was made from, unchanged
            for si, ref, version, wptr in ready[2]:
                w = sources[si] if len(sources) > si else None
                if w is None or w is not ref() or w._version != version or \
                        w.data_ptr() != wptr:
                    # changed: the full path below rebuilds the split and the plan (the
                    # old split freed first)
                    del self._ready[(stream, is_cupy)]
                    ready = None
                    break
        if ready is not None and self.highest and gemm.resolve_precision(precision) != "highest":
            return None
        if ready is not None:
            longs = self.res_long
            out = _new(self.out_shape, self.dev, is_cupy, False, longs[0])
            optrs = (out.data.ptr if is_cupy else out.data_ptr(),)
            if self.more:   # the other results (in the ready plan, BUF i is result i)
                outs = [out] + [_new(shape, self.dev, is_cupy, False, lg)
                                for (_, shape), lg in zip(self.more, longs[1:])]
                optrs = tuple([_ptr(o, is_cupy) for o in outs])
            tables = (in_ptrs, src_ptrs, optrs)
            tid = _get_ident()
            for r in ready[4]:
                b = r.tb.get(tid)
                if b is None:
                    b = r.buffers(tid, self.dev)
                for c, t, i in b[1]:
                    c.value = tables[t][i]
                if b[2] is not None:
                    b[2].value = not any(tables[t][i] & 15 for t, i in r.vec[1])
                if b[3]:   # the engine reads x itself: its map from its address
                    xs = r.xmap[0]
                    _memmove(b[3], _encode_map(tables[xs[0]][xs[1]], r.xmap[1], r.xmap[2],
                                               r.xmap[3], _F32), 128)
                (_launch_dependent if r.dep else _launch_kernel)(
                    r.fptr, r.g0, r.g1, r.g2, r.block, 1, 1, r.smem, stream, b[0], 0)
            if self.outs_type is not None:
                return self.outs_type(outs if self.more else [out])
            return out
        if self.highest and gemm.resolve_precision(precision) != "highest":
            return None
        wmaps = {}
        splits: dict[int, tuple] = {}   # engine step -> (its weight, the cached split)
        folds: dict[int, tuple] = {}
        held: list = []   # the derived weights this call's arguments point into
        for i, st in enumerate(self.steps):
            if st.fold is not None:
                prog, g, si = st.fold[:3]
                co = folds.get(g)
                if co is None:
                    w = sources[si] if len(sources) > si else None
                    if not isinstance(w, torch.Tensor) or len(sources) < len(prog.sources):
                        return None
                    try:
                        co = folds[g] = rewrite.fold_coefficients(prog, g, w, sources, w,
                                                                  sources)
                    except rewrite.NotExact:
                        return None   # the general path runs the unrewritten program
                    if not co[4] < float("inf"):
                        return None   # the general path takes torch's route
                    held.append(co)
                if st.cert is not None:
                    wmaps[i] = (co, certified.weight_data(co[0]))
                    held.append(wmaps[i][1])
                    continue
                if st.fold[3] == "rows":
                    wmaps[i] = (co[4], co[2].data_ptr(), co[3].data_ptr(), co[1].data_ptr())
                    continue
                if st.eng is None:   # the skinny kernel's weight
                    wmaps[i] = co[0].data_ptr()
                    continue
            if st.eng is not None:
                w = folds[st.fold[1]][0] if st.fold is not None else \
                    (sources[st.eng[3]] if len(sources) > st.eng[3] else None)
                if not isinstance(w, torch.Tensor):
                    return None
                if len(st.eng) > 4:   # truncated big halves: W itself, its bf16 small half
                    split = caches.cached("tf32x3ht_split", w, (w,), (),
                                         lambda w=w: gemm._split_weight_trunc(w.detach()))
                    wmaps[i] = (engine.encode_tensor_map(w), split[1])
                else:
                    split = caches.cached("tf32x3h_split", w, (w,), (),
                                         lambda w=w: gemm._split_weight_hybrid(w.detach()))
                    wmaps[i] = split[2]
                splits[i] = (w, split)
            elif st.gemv is not None:
                prog, g, si = st.gemv[:3]
                w = sources[si] if len(sources) > si else None
                if not isinstance(w, torch.Tensor) or len(sources) < len(prog.sources):
                    return None
                try:
                    u, C, av, cv, wmax = rewrite.gemv_coefficients(prog, g, w, sources, w,
                                                                   sources)
                except rewrite.NotExact:
                    return None   # the general path runs the unrewritten program
                if not wmax < float("inf"):
                    return None   # the general path computes it directly
                wmaps[i] = (u.data_ptr(), C, wmax, av.data_ptr(), cv.data_ptr())
                held.append((u, av, cv))
        out = _new(self.out_shape, self.dev, is_cupy, interop.poison_outputs, self.res_long[0])
        wbufs, wptrs, amaps = self._workspace(stream, is_cupy)
        if interop.poison_outputs:
            for b in wbufs:
                if b is not None and b.dtype == torch.float32:
                    b.fill_(float("nan"))
        bptrs = list(wptrs)
        bptrs[self.out_buf] = _ptr(out, is_cupy)
        outs = [out]
        for (k, shape), lg in zip(self.more, self.res_long[1:]):
            outs.append(_new(shape, self.dev, is_cupy, interop.poison_outputs, lg))
            bptrs[k] = _ptr(outs[-1], is_cupy)
        tables = (in_ptrs, src_ptrs, bptrs)
        tls = _packers()
        used = []
        try:
            for k, st in enumerate(self.steps):
                a = list(st.template)
                for pos, t, i in st.patch:
                    a[pos] = tables[t][i]
                sk = st.skinny
                if st.cert is not None:
                    co, (wn, wu, wmap, _) = wmaps[k]
                    xs = st.cert[1]
                    if st.cert[0] == "gemm":
                        a[0] = _encode_map(tables[xs[0]][xs[1]], *st.cert[2:5], _F32)
                        a[1] = wmap
                    else:
                        a[3] = int(st.cert[2] and tables[xs[0]][xs[1]] & 15 == 0)
                        a[4], a[6], a[7] = co[0].data_ptr(), wn.data_ptr(), wu.data_ptr()
                        a[9], a[10] = co[4], co[1].data_ptr()
                        a[23], a[24] = co[2].data_ptr(), co[3].data_ptr()
                elif st.fold is not None and st.eng is None:
                    if sk is not None:
                        a[2] = wmaps[k]
                    else:   # fold_rows / pairdiff_rows
                        a[3], a[7], a[8], a[st.fold[6]] = wmaps[k]
                        xs = st.fold[4]
                        a[15] = int(st.fold[5] and tables[xs[0]][xs[1]] & 15 == 0)
                if sk is not None:
                    xs, ws, parts, tiles, vec_ok, fused = sk
                    a[12] = int(vec_ok and ((tables[xs[0]][xs[1]] | tables[ws[0]][ws[1]]) & 15) == 0)
                    if fused:   # tile counters, then the two grid counters
                        a[10], a[11] = engine._skinny_workspace(self.dev, stream, parts, tiles + 2)
                        a[13] = a[11] + 4 * tiles
                    elif parts:
                        a[10], a[11] = engine._skinny_workspace(self.dev, stream, parts, tiles)
                if st.eng is not None:
                    am, bm = amaps[k], wmaps[k]
                    e = st.eng
                    xmap = am[0] if len(e) == 4 else _encode_map(
                        tables[e[4][0]][e[4][1]], e[5], e[6], e[7], _F32)
                    a[0], a[1], a[2], a[3], a[4] = xmap, bm[0], am[1], bm[1], am[2]
                elif st.gemv is not None:
                    a[3], a[4], a[5], a[10], a[11] = wmaps[k]
                    xs = st.gemv[3]
                    a[14] = int(st.gemv[4] and tables[xs[0]][xs[1]] & 15 == 0)
                pk = tls.get(st.fmt)
                if pk is None:
                    pk = _runtime._packer(st.fmt)
                pk.st.pack_into(pk.buf, pk.off, *a)
                g = st.grid
                (_launch_dependent if st.dep else _launch_kernel)(
                    st.fptr, g[0], g[1], g[2], st.block, 1, 1, st.smem, stream,
                    _addressof(pk.ptrs), 0)
                used.append(a)
        except BaseException:
            # (a launch refused, or an interrupt between launches: the kept workspace may
            # hold a step's half-done state, e.g. row maxima not reset: allocated anew)
            if self.zeroed:
                self._drop((stream, is_cupy))
            raise
        if self.simple and (stream, is_cupy) in self._ws:
            self._make_ready(stream, is_cupy, used, splits, held, sources)
        if self.outs_type is not None:
            return self.outs_type(outs)
        return out

    def _make_ready(self, stream: int, is_cupy: bool, used: list[list],
                    splits: dict[int, tuple], held: list, sources: Sequence[Any]) -> None:
        """The ready plan of a kept workspace from this call's arguments ``used``: the
        workspace buffers', the skinny workspace's, the engine weights' maps and the
        derived weights' addresses in place, the operands' and the result's addresses
        (x's tensor map, float4 flags from x's alignment) set per call. Valid while the
        skinny workspace of (device, stream) is the same object (it is replaced when a
        launch needs a bigger one), the engine's weights (``splits``: step -> (weight,
        its cached split)) are the same tensors at the same version and address, and,
        where a step read derived weights (``held``: folds, GEMV coefficients, a
        certification's weight bounds, made from the sources), so is every tensor source;
        the plan holds the splits and the derived weights its arguments point into."""
        self._ready.pop((stream, is_cupy), None)
        weights = []
        for k, (w, split) in splits.items():
            if w.is_inference():
                return   # no version counter: the split is rebuilt per call, never planned
            if self.steps[k].fold is None:   # (a folded W' is checked through its sources)
                weights.append((self.steps[k].eng[3], weakref.ref(w), w._version,
                                w.data_ptr()))
        if held:
            # rewrite.fold_coefficients / gemv_coefficients depend on every tensor source
            engine_w = {w[0] for w in weights}
            for si, t in enumerate(sources):
                if t is None or si in engine_w:
                    continue
                if type(t) not in tracking.TENSOR_TYPES or t.is_inference():
                    return   # (a value without a version counter: per call, never planned)
                weights.append((si, weakref.ref(t), t._version, t.data_ptr()))
        for st in self.steps:   # grow the skinny workspace to what every step needs first
            if st.skinny is not None and (st.skinny[5] or st.skinny[2]):
                parts, tiles = st.skinny[2], st.skinny[3]
                engine._skinny_workspace(self.dev, stream, parts,
                                         tiles + 2 if st.skinny[5] else tiles)
        sws = _skinny_ws.get((self.dev, stream))
        plan = []
        for st, args in zip(self.steps, used):
            a = list(args)   # workspace addresses and the engine weights' maps as they were
            # the results' addresses per call: BUF i becomes result i
            res = [self.out_buf] + [k for k, _ in self.more]
            patch = tuple((pos, t, res.index(i) if t == BUF else i) for pos, t, i in st.patch
                          if t != BUF or i in self.res_bufs)
            vec = xmap = None
            e = st.eng
            if e is not None and len(e) > 4:   # x's own map, from its address per call
                if e[4][0] == BUF and e[4][1] in self.res_bufs:
                    return
                if e[4][0] != BUF:
                    xmap = (e[4], e[5], e[6], e[7])
            # x's own map (a certified GEMM's) or float4 flag (a fold's rows, a GEMV, the
            # certification kernel) from its address per call; fixed in the workspace
            xv = st.cert or (st.fold if st.fold is not None and st.fold[3] == "rows" else None)
            xv = (xv[1] if st.cert else xv[4]) if xv is not None else \
                (st.gemv[3] if st.gemv is not None else None)
            if xv is not None and xv[0] == BUF and xv[1] in self.res_bufs:
                return   # (a result read again: its address comes per call; rare)
            if xv is not None and xv[0] != BUF:
                if st.cert is not None and st.cert[0] == "gemm":
                    xmap = (xv, *st.cert[2:5])
                elif st.cert is not None:
                    vec = (3, (xv,)) if st.cert[2] else None
                elif st.gemv is not None:
                    vec = (14, (xv,)) if st.gemv[4] else None
                else:
                    vec = (15, (xv,)) if st.fold[5] else None
            sk = st.skinny
            if sk is not None:
                xs, ws, parts, tiles, vec_ok, fused = sk
                if vec_ok:
                    # the float4 path needs both operands 16-byte aligned: one in the kept
                    # workspace (x the output of an earlier level: a Linear after a tail
                    # or a pooling) has its address fixed, known now (parameters 0 and 2
                    # as this call passed them); one passed per call (an input, a
                    # parameter) is checked per call
                    if any(s[0] == BUF and s[1] in self.res_bufs for s in (xs, ws)):
                        return   # a result read by a GEMM: its address comes per call (rare)
                    free = [s for s in (xs, ws) if s[0] != BUF]
                    if any(a[pos] & 15 for s, pos in ((xs, 0), (ws, 2)) if s[0] == BUF):
                        a[12] = 0
                    elif free:
                        vec = (12, tuple(free))
                    # (both in the workspace: a[12] as this call set it)
                else:
                    a[12] = 0
                if fused:
                    a[10], a[11] = engine._skinny_workspace(self.dev, stream, parts, tiles + 2)
                    a[13] = a[11] + 4 * tiles
                elif parts:
                    a[10], a[11] = engine._skinny_workspace(self.dev, stream, parts, tiles)
            plan.append((st.fptr, st.grid, st.block, st.smem, st.fmt, a, patch, vec, xmap,
                         st.dep))
        if _skinny_ws.get((self.dev, stream)) is sws:
            self._ready[(stream, is_cupy)] = (
                sws, plan, tuple(weights), [split for _, split in splits.values()] + held,
                [_Launch(*step[:6], tuple((pos, t, i) for pos, t, i in step[6]), *step[7:])
                 for step in plan])


def _packers() -> dict:
    cache = getattr(_runtime._tls, "packers", None)
    if cache is None:
        cache = _runtime._tls.packers = {}
    return cache


def _new(shape: tuple[int, ...], dev: int, is_cupy: bool, poison: bool,
         long: bool = False) -> Any:
    """A result buffer: float32, or int64 where ``long`` (argmax/argmin); ``poison``: NaN
    (-1 for int64, no position) in every element."""
    if is_cupy:
        import cupy

        if poison:
            return cupy.full(shape, -1 if long else cupy.nan,
                             dtype=cupy.int64 if long else cupy.float32)
        return cupy.empty(shape, dtype=cupy.int64 if long else cupy.float32)
    d = _devices.get(dev)
    if d is None:
        d = _devices[dev] = _torch_device(dev)
    if poison:
        return torch.full(shape, -1, dtype=_I64, device=d) if long else \
            torch.full(shape, float("nan"), device=d)
    if long:
        return _empty(*shape, dtype=_I64, device=d) if shape else \
            _empty(shape, dtype=_I64, device=d)
    if shape:
        # the sizes as arguments: ~2 us, against ~4-5.5 us for torch.empty(a tuple, ...)
        # (H100 host, torch 2.11)
        return _empty(*shape, device=d)
    return _empty(shape, device=d)


def _ptr(b: Any, is_cupy: bool) -> int:
    return b.data.ptr if is_cupy else b.data_ptr()


_devices: dict[int, torch.device] = {}
_empty = torch.empty


def _torch_device(dev: int) -> torch.device:
    """The torch device of CUDA device ``dev``, where a call's buffers are allocated (the
    one place: tests/emu/prepared.py runs prepared launches on CPU buffers through it)."""
    return torch.device("cuda", dev)



_kept_bytes = [0]
_kept: "weakref.WeakSet[Prepared]" = caches.register(
    "kept workspaces", weakref.WeakSet(), lambda kept: release_workspaces())


def release_workspaces() -> None:
    """Give back every prepared launch's kept workspace (cupyfuse.clear_cache)."""
    for p in list(_kept):
        p.release()
    _kept.clear()


def engine_batch_ok(batch: int, K: int, N: int | None = None) -> bool:
    """Whether a batch of ``batch`` rows of ``K`` features (into ``N`` outputs, where
    known) gets prepared engine launches."""
    return batch <= config.ENGINE_MAX_M or batch * K <= config.ENGINE_MAX_MK or (
        N is not None and batch * K * N <= config.ENGINE_MAX_MNK)


_header: list[str] = []


def _skinny_header() -> str:
    if not _header:
        _header.append(_runtime.expand_source("gemm_skinny.cuh"))
    return _header[0]


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    st = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        st[i] = st[i + 1] * max(shape[i + 1], 1)
    return tuple(st)


def _bf(dims: Sequence[int], strides: Sequence[int]) -> tuple[int, int]:
    """(batch stride, feature stride) of a value with these dims stored with these strides."""
    sb = sf = 0
    for d, s in zip(dims, strides):
        if d == BATCH:
            sb = s
        elif d > 1:
            sf = s
    return sb, sf


def param_sf(dims: Sequence[int], shape: Sequence[int], strides: Sequence[int]) -> int:
    """The feature stride of a parameter with these dims held in a tensor of this shape
    and strides: its elements in the tensor's row-major order, which may run over several
    dims (an (H, D) parameter read as H * D per-feature values of a value split into
    heads) where they are evenly spaced; a copy made contiguous is needed otherwise."""
    held = [(n, x) for n, x in zip(shape, strides) if n != 1]
    for (_, x0), (n1, x1) in zip(held, held[1:]):
        if x0 != n1 * x1:
            raise TailError(f"a parameter of shape {tuple(shape)} with strides "
                            f"{tuple(strides)} is read as {math.prod(shape)} per-feature "
                            "values of a value split into several dims: its elements must be "
                            "evenly spaced in memory (make it contiguous: .contiguous())")
    return held[-1][1] if held else 0


def _ksum_into_tails(pr: Prepared, ksums: list[tuple[int, int, int, int, int]],
                     tails: dict[int, codegen.Level], dev: int) -> None:
    """Drop each splitk_sum launch whose sum (buffer h) only one generated tail kernel
    reads, and only as its GEMM value (CF_LDH): that tail reads the partial products
    instead, summed in the same order (bitwise the same value). A skinny GEMM split along
    K (step j itself) so read leaves its partial sums in a buffer of their own (``part``
    -1: made here; no counters: its last blocks add nothing, gemm_skinny.cuh's
    skinny_finish) -- the sum moves from the end of the GEMM into the tail's loads."""
    drop = []
    for j, part, h, splits, stride in ksums:
        if h in pr.res_bufs:
            continue
        sk = pr.steps[j].skinny
        if sk is not None and sk[5]:
            continue   # the tail runs in the GEMM's launch
        readers = [k for k, st in enumerate(pr.steps)
                   if k != j and any(t == BUF and i == h for _, t, i in st.patch)]
        if len(readers) != 1 or readers[0] not in tails:
            continue
        t = readers[0]
        st, lv = pr.steps[t], tails[t]
        gemm_pos = {pos for pos, (kind, _) in enumerate(lv.args) if kind == "gemm"}
        if len(gemm_pos) != 1:
            # ksum_source's CF_LDH reads every GEMM value of the kernel as partial
            # products of one stride: a level reading two GEMMs keeps its splitk_sum
            # launches (it read both as the first's partials: wrong values, found with a
            # mixture head's two Linears at 128-300 rows)
            continue
        if any(t2 == BUF and i == h and pos not in gemm_pos for pos, t2, i in st.patch):
            continue   # read as a plain buffer too (a view of the GEMM's value)
        if part < 0:   # a skinny GEMM's partials: a buffer of their own, made now
            pr.bufs.append((splits, *pr.bufs[h]))
            part = len(pr.bufs) - 1
        name, text = codegen.ksum_source(lv, splits, stride)
        if st.fn.name.endswith("_cl"):   # (ksum_source renamed the `_cl` entry too)
            name += "_cl"
        fn = _runtime.generated_kernel(name, text, dev)
        patch = [(pos, t2, part if (t2 == BUF and i == h) else i) for pos, t2, i in st.patch]
        dep = st.dep
        pr.steps[t] = _Step(fn, st.grid, st.block, list(st.template), patch, st.smem)
        pr.steps[t].dep = dep
        if sk is None:
            drop.append(j)
            continue
        g = pr.steps[j]   # parameters 10, 11: the partials' buffer, no counters
        template = list(g.template)
        template[11] = 0
        pr.steps[j] = _Step(g.fn, g.grid, g.block, template, list(g.patch) + [(10, BUF, part)],
                            g.smem, skinny=sk[:2] + (0,) + sk[3:], fold=g.fold)
    for j in sorted(drop, reverse=True):
        del pr.steps[j]


#: node kinds whose results depend on the order a block combines a row's elements in
#: (the kernels' fixed order for their thread count)
_ORDERED = ("rred", "sred", "pool", "wpool", "scan", "bn", "seqred")

#: tail_seqred.cu's seq_reduce: the op code of each "seqred" node's op
SEQ_OPS = {"sum": 0, "max": 1, "min": 2, "take": 3}


def _sm_count(dev: int) -> int:
    """The device's multiprocessor count (cached by engine._device)."""
    return engine._device(torch.empty(0, device=f"cuda:{dev}"))[1]


def usable(prog: Program) -> tuple[Program, bool] | None:
    """The program to prepare and whether it is the unrewritten form, or None: where a
    GEMM reads its weight transposed (the general path caches a contiguous copy) in
    both the program and its unrewritten form.

    A program with a sequence reduction ("seqred": values of two row counts) is prepared
    like any other: :func:`prepare` sizes each level by its rows (batch * seq, or the
    batch's for ``Level.per_batch``), runs each reduction as a step of its own
    (``kernels_cu/tail_seqred.cu``'s seq_reduce, its result in the kept workspace) after
    its level's GEMMs and statistics and before the level's kernel, as ``run_gpu`` does,
    and never runs a tail inside the skinny GEMM's launch (that combines a row's sums in
    another order): the same launches and arguments as the general path, so the same
    bits -- where the general path's GEMMs run the sm90 engine too (for K not a multiple
    of 4, or unaligned operands, it calls torch.mm, which prepared launches never do:
    the skinny kernel's scalar path, close but not bitwise; as for every program). What :func:`prepare` leaves to the general path there (it returns None): a
    reduction's operand that is a view of an input whose strides are not a plain
    reshape's (as for a GEMM's operand), and what it refuses for any program (engine
    batches past ``engine_batch_ok``, a transposed weight, another precision than
    "highest" for the engine, a batch of one row where torch raises)."""
    for p in (prog, prog.unrewritten):
        if p is not None and all(not (n.kind in ("gemm", "gemv") and n.attrs[1])
                                 for n in p.nodes):
            return p, p is not prog
    return None


def prepare(prog: Program, batch: int, dev: int, in_meta: Sequence[tuple], src_meta: Sequence[Any],
            allow_bn: bool = True, small_weights_only: bool = False) -> Prepared | None:
    """Build the launches of ``prog`` for this batch, or None where it does not apply.

    ``in_meta``/``src_meta``: (shape, strides) of each input / source tensor (None for a
    source that is not a tensor). Every GEMM must run the skinny kernel.
    ``small_weights_only``: ``prog`` is an unrewritten program, whose rewrites would have
    shrunk or removed a GEMM: taken only where every weight is small (launch-bound; a
    large one is faster through the rewrite and the general path)."""

    if batch < 1 or torch.cuda.get_device_capability(dev) != (9, 0):
        return None
    if gemm._engine_setting() == "cublas":
        return None
    pl = codegen.compile_program(prog)
    # a program with a sequence reduction: ``batch`` counts the batch * seq rows; its
    # per-batch levels run on batch // seq rows (Level.per_batch, as run_gpu)
    seq = pl.seq
    if seq and batch % seq:   # pragma: no cover - the inputs are (batch, seq, ...) views
        return None
    if (batch // seq if seq else batch) == 1 and prog.one_row_error is not None:
        return None   # (torch raises at one row there: the general path does too)
    nodes = prog.nodes
    index = prog.index_values()
    pr = Prepared()
    pr.dev = dev
    loc: dict[int, tuple[int, int]] = {}   # value -> (table, index) of its pointer
    strides: dict[int, tuple[int, ...]] = {}
    sm = _sm_count(dev)
    stats: dict[int, tuple[int, int]] = {}
    ksums: list[tuple[int, int, int, int, int]] = []   # (splitk_sum step, part, h, splits, stride)
    # x's split per (x slot, row stride, K, truncated): a second engine GEMM of the same x
    # (two Linears of one input) reads the first one's halves
    xsplits: dict[tuple, tuple[int, int, int]] = {}
    tails: dict[int, codegen.Level] = {}   # a generated tail kernel's step -> its level

    def new_buf(shape: tuple[int, ...]) -> int:
        pr.bufs.append(tuple(shape))
        return len(pr.bufs) - 1

    def fold_rows(fold: tuple, aslot: tuple[int, int], ldx: int, K: int,
                  wst: Sequence[int], n: Node, k: int, out: int, rows: int,
                  rowmax: int = -1) -> None:
        """After a folded GEMM into buffer k: tail_rewrite.cu's fold_rows (average pooling:
        folded bias, guard, direct rows, in place) or pairdiff_rows (pair differences: each
        row's sum into buffer ``out``, guard, direct rows); ``rowmax``: the buffer of x's
        row maxima the engine's split left (the guard reads them, not x), or -1."""
        kind, kwin, st = n.attrs[2][:3]
        rm = [(16, BUF, rowmax)] if rowmax >= 0 else []
        pr.all_sources = True
        vec = K % 4 == 0 and ldx % 4 == 0
        if kind == "pairdiff":
            h = n.attrs[2][5] // 2
            ldz = pr.bufs[k][1]
            pr.steps.append(_Step(
                get_function("tail_rewrite.cu", "pairdiff_rows", dev), rows, 256, [0, ldx, K, 0.0, 0, wst[0], wst[1], 0, 0, h, 0, 0, ldz, 0, 1, 0, 0],
                [(0, *aslot), (4, SRC, n.attrs[0]), (11, BUF, k), (13, BUF, out)] + rm,
                fold=fold[:3] + ("rows", aslot, vec, 10)))
            return
        pr.steps.append(_Step(
            get_function("tail_rewrite.cu", "fold_rows", dev), rows, 256, [0, ldx, K, 0.0, 0, wst[0], wst[1], 0, 0, kwin, st, n.width, 0, 0, n.width, 0, 0],
            [(0, *aslot), (4, SRC, n.attrs[0]), (13, BUF, k)] + rm,
            fold=fold[:3] + ("rows", aslot, vec, 12)))

    def certified_fold(chain: certify.Chain, fold: tuple, aslot: tuple[int, int], ldx: int,
                  K: int, N: int, k: int, rows: int, wst: Sequence[int], n: Node,
                  lv: Any) -> bool:
        """A certified folded GEMM (average pooling) into buffer k (certify.py): the
        one-pass TF32 GEMM, then the certification kernel, which finishes the fold as
        fold_rows would (folded bias, guard rows directly from the original weight) and,
        where level ``lv`` computes nothing but the chain's row reduction, writes that
        too (the level's kernel is then not run); False where a param operand is not a
        tensor here or K splits too many ways."""
        fn, params = certified._kernel(prog, chain, dev)
        pargs, ppatch = [], []
        for i in params:
            meta = src_meta[nodes[i].attrs[0]]
            if meta is None:
                return False
            ppatch.append((28 + len(pargs), SRC, nodes[i].attrs[0]))
            pargs += [0, param_sf(nodes[i].dims, *meta) if nodes[i].width > 1 else 0]
        splits = engine.wide_splits(rows, N, K, sm)
        if splits > config.CERTIFY_MAX_SPLITS:
            return False
        red_only = certify.red_only(prog, chain, lv.targets, bool(lv.kernel))
        nbytes, staged = certified.smem(K, N, red_only)
        kwin, st = n.attrs[2][1:3]
        pr.all_sources = True
        target, sstride = (new_buf((splits, rows, N)), rows * N) if splits > 1 else (k, 0)
        pr.steps.append(_Step(
            get_function("gemm_sm90_wide.cu", "gemm_sm90_wide_tf32", dev),
            engine.wide_grid(rows, N, splits, sm), 384, [b"", b"", 0, rows, N, K, N, splits, sstride],
            [(2, BUF, target)], smem=engine.WIDE_SMEM_BYTES, fold=fold,
            cert=("gemm", aslot, rows, K, ldx)))
        red = []
        if red_only:
            # one value per row: the reduction and the level's targets (its views) share
            # one buffer, in the targets' shape (a result's buffer has its shape)
            kr = new_buf(shape_of(nodes[lv.targets[0]].dims, rows))
            for t in (chain.red, *lv.targets):
                loc[t] = (BUF, kr)
                strides[t] = _contiguous_strides(shape_of(nodes[t].dims, rows))
            cert_reds.add(chain.red)
            red = [(27, BUF, kr)]
        pr.steps.append(_Step(
            fn, rows, certified.THREADS, [0, ldx, K, 0, 0, K, 0, 0, certified.gamma(K, splits), 0.0, 0,
                            0, splits, sstride, N, 0, N, N, 0, staged, 0, wst[0], wst[1], 0, 0,
                            kwin, st, 0] + pargs,
            [(0, *aslot), (11, BUF, target), (15, BUF, k), (20, SRC, n.attrs[0])] + red + ppatch,
            smem=nbytes, fold=fold[:3] + ("cert",),
            cert=("rows", aslot, K % 4 == 0 and ldx % 4 == 0)))
        return True

    def where(i: int) -> tuple[tuple[int, int], tuple[int, ...]] | None:
        """Pointer slot and strides of a materialised value (through views)."""
        n = nodes[i]
        if i in loc:
            return loc[i], strides[i]
        if n.kind == "input":
            shape, st = in_meta[n.attrs[0]]
            return (IN, n.attrs[0]), tuple(st)
        if n.kind == "view":
            w = where(n.args[0])
            if w is None:
                return None
            slot, st = w
            a = n.args[0]
            if st != _contiguous_strides(shape_of(nodes[a].dims, pl.rows(a, batch))):
                return None   # a view of a strided input: not a plain reshape
            return slot, _contiguous_strides(shape_of(n.dims, pl.rows(i, batch)))
        return None

    cert_reds: set[int] = set()   # row reductions a certification kernel writes
    for lv in pl.levels:
        rows = batch // seq if lv.per_batch else batch   # this level's values' rows
        gemm_steps: dict[int, tuple[int, int]] = {}   # this level's GEMM -> (step, rows/tile)
        for g in lv.gemms:
            n = nodes[g]
            w_meta = src_meta[n.attrs[0]]
            a = where(n.args[0])
            if a is None or w_meta is None:
                return None
            aslot, ast = a
            K = nodes[n.args[0]].width
            N = n.width
            if n.kind == "gemv":
                N = n.attrs[4]
                wshape, wst = w_meta
                if len(ast) != 2 or ast[1] != 1 or tuple(wshape) != (N, K):
                    return None
                shape = shape_of(n.dims, rows)
                k = new_buf(shape)
                loc[g], strides[g] = (BUF, k), _contiguous_strides(shape)
                pr.all_sources = True
                pr.steps.append(_Step(
                    get_function("tail_rewrite.cu", "gemv_rows", dev), rows, 256, [0, ast[0], K, 0, 0.0, 0.0, 0, wst[0], wst[1], N, 0, 0, 0, 1, 0],
                    [(0, *aslot), (6, SRC, n.attrs[0]), (12, BUF, k)],
                    gemv=(prog, g, n.attrs[0], aslot, K % 4 == 0 and ast[0] % 4 == 0)))
                continue
            # x: (batch, K) rows with unit stride along K; W: (N, K) likewise
            wshape, wst = w_meta
            fold = (prog, g, n.attrs[0], "gemm") if len(n.attrs) > 2 else None
            if fold is not None:   # the GEMM runs the folded W' (N, K), contiguous
                if len(ast) != 2 or ast[1] != 1 or ast[0] < K or len(wshape) != 2 \
                        or wshape[1] != K or wst[1] != 1:
                    return None
                ldx, ldw = ast[0], K
                wslot = aslot   # W' is torch's allocation (aligned): only x's alignment counts
            else:
                if len(ast) != 2 or ast[1] != 1 or ast[0] < K or tuple(wshape) != (N, K) \
                        or wst[1] != 1:
                    return None
                ldx, ldw = ast[0], wst[0]
                wslot = (SRC, n.attrs[0])
            out_k = -1
            if fold is not None and n.attrs[2][0] == "pairdiff":
                # the GEMM on the pair differences (h + 1 rows, padded to 4) into a buffer of
                # its own; pairdiff_rows writes the node's value (one number per row)
                N = -(-(n.attrs[2][5] // 2 + 1) // 4) * 4
                shape = shape_of(n.dims, rows)
                out_k = new_buf(shape)
                loc[g], strides[g] = (BUF, out_k), _contiguous_strides(shape)
                k = new_buf((rows, N))
            else:
                k = new_buf((rows, N))
                loc[g], strides[g] = (BUF, k), (N, 1)
                out_k = k
            if not gemm.skinny_for(rows, N, K):
                # the tensor-core engine, for batches that engine_batch_ok (host-bound sizes);
                # an unrewritten program's large GEMM is faster through its rewrite
                if (small_weights_only and N * K > config.SKINNY_SMALL_W) \
                        or not engine_batch_ok(rows, K, N) \
                        or K % 4 or ldx % 4 or ldw % 4:
                    return None
                pr.highest = True
                pr.aligned += [sl for sl in (aslot, wslot) if sl[0] != BUF]
                chain = certify.chain_of(prog, g) if fold is not None \
                    and n.attrs[2][0] == "avgpool" and config.CERTIFY \
                    and 2 <= N <= config.CERTIFY_MAX_WIDTH else None
                if chain is not None:
                    if not certified_fold(chain, fold, aslot, ldx, K, N, k, rows, wst, n, lv):
                        return None
                    continue
                ld_h = -(-K // 8) * 8
                # as gemm.linear_nobias: past ROUNDED_BIG_MAX_M rows the big halves are the
                # fp32 operands themselves (x's tensor map encoded per call, memoised on
                # its address), so the split writes only x's small halves
                trunc = config.TRUNC_BIG and rows > config.ROUNDED_BIG_MAX_M
                skey = (aslot, ldx, K, trunc)
                rowmax = -1
                if fold is None and skey in xsplits:
                    xb, xsm, xh = xsplits[skey]
                else:
                    xb = -1 if trunc else new_buf((rows, K))
                    xsm = new_buf((rows, K))
                    xh = new_buf((rows, ld_h))
                    pr.bf16.add(xh)
                    if fold is not None:   # the split leaves x's row maxima for the fold's guard
                        rowmax = new_buf((rows,))
                        pr.zeroed.add(rowmax)
                    else:
                        xsplits[skey] = (xb, xsm, xh)
                    total = rows * ld_h // 4
                    pr.steps.append(_Step(
                        get_function("gemm_sm90.cu", "split_hybrid", dev),
                        max(1, min(-(-total // 256), 16 * sm)), 256, [0, rows, K, ldx, 0, 0, 0, 0, ld_h, int(trunc), 0],
                        [(0, *aslot), (5, BUF, xsm), (7, BUF, xh)]
                        + ([] if trunc else [(4, BUF, xb)])
                        + ([(10, BUF, rowmax)] if rowmax >= 0 else [])))
                tiles = -(-rows // engine._BM) * -(-N // engine._BN)
                splits = engine._splits_for(tiles, -(-K // engine._BK), sm)
                if splits > 1:
                    part = new_buf((splits, rows, N))
                    target, sstride = part, rows * N
                else:
                    target, sstride = k, 0
                pr.steps.append(_Step(
                    get_function("gemm_sm90.cu", "gemm_sm90_tf32x3h", dev),
                    min(sm, tiles * splits), 384, [b"", b"", b"", b"", b"", 0, rows, N, K, N, splits, sstride],
                    [(5, BUF, target)], smem=engine.SMEM_BYTES["3h"],
                    eng=(xb, xsm, xh, n.attrs[0], aslot, rows, K, ldx) if trunc
                    else (xb, xsm, xh, n.attrs[0]), fold=fold))
                if splits > 1:
                    pr.steps.append(_Step(
                        get_function("gemm_sm90.cu", "splitk_sum", dev),
                        max(1, min(-(-rows * N // 256), 16 * sm)), 256, [0, splits, rows * N, rows, N, N, 0, N],
                        [(0, BUF, part), (6, BUF, k)]))
                    if fold is None:
                        ksums.append((len(pr.steps) - 1, part, k, splits, rows * N))
                if fold is not None:
                    fold_rows(fold, aslot, ldx, K, wst, n, k, out_k, rows, rowmax)
                continue
            if small_weights_only and N * K > config.SKINNY_SMALL_W:
                return None
            sp = engine.skinny_plan(rows, N, K, sm)
            parts = sp.splits * rows * N if sp.splits > 1 else 0
            vec_ok = K % 4 == 0 and ldx % 4 == 0 and ldw % 4 == 0
            fn = get_function("gemm_skinny.cu", sp.fn, dev)
            template = [0, ldx, 0, ldw, rows, N, K, sp.kspan, 0, N, 0, 0, 0]
            patch = [(0, *aslot), (8, BUF, k)] + ([] if fold else [(2, *wslot)])
            pr.steps.append(_Step(fn, sp.grid, sp.threads, template, patch,
                                  skinny=(aslot, wslot, parts, sp.ctiles * sp.rtiles, vec_ok,
                                          False),
                                  fold=fold))
            if fold is not None:
                fold_rows(fold, aslot, ldx, K, wst, n, k, out_k, rows)   # not fusable with the tail
            else:
                gemm_steps[g] = (len(pr.steps) - 1, sp)
                if parts and config.SKINNY_KSUM:   # its partial sums, should a tail read them itself
                    # (their buffer made only if one does: -1)
                    ksums.append((len(pr.steps) - 1, -1, k, sp.splits, rows * N))
        for b in lv.bns:
            if not allow_bn:
                return None
            n = nodes[b]
            z = where(n.args[0])
            if z is None or z[0][0] != BUF:
                return None
            eps, momentum, srcs = n.attrs[:3]
            W = nodes[n.args[0]].width
            if rows <= 1:
                return None   # the general path raises torch's error
            mean, invstd = new_buf((2 * W,)), new_buf((2 * W,))   # float64 in float32 buffers
            stats[b] = (mean, invstd)
            chunk_rows = max(64, -(-rows // 64))
            chunks = -(-rows // chunk_rows)
            psum = new_buf((chunks, 2 * W))   # float64 partial sums in float32 buffers
            psq = new_buf((chunks, 2 * W))
            rm = rv = nbt = None
            if srcs:
                rm, rv, nbt = srcs   # nbt: one int64 (fused._try_prepare checks)
            # colstat_partial also counts the batch (num_batches_tracked += 1, on the device)
            pr.steps.append(_Step(get_function("tail_colstat.cu", "colstat_partial", dev),
                                  (-(-W // 32), chunks), 256, [0, rows, W, chunk_rows, 0, 0, 0],
                                  [(0, *z[0]), (4, BUF, psum), (5, BUF, psq)]
                                  + ([(6, SRC, nbt)] if nbt is not None else [])))
            patch = [(0, *z[0]), (1, BUF, psum), (2, BUF, psq), (8, BUF, mean), (9, BUF, invstd)]
            for pos, s in ((10, rm), (11, rv), (12, nbt)):
                if s is not None:
                    patch.append((pos, SRC, s))
            pr.steps.append(_Step(get_function("tail_colstat.cu", "colstat_finalize", dev),
                                  -(-W // 256), 256, [0, 0, 0, chunks, rows, W, float(eps),
                                   -1.0 if momentum is None else float(momentum), 0, 0, 0, 0, 0],
                                  patch))
        for r in lv.seqreds:
            # tail_seqred.cu's seq_reduce, as fused._seq_reduce launches it: its operand
            # read in place (any strides), its value a new contiguous (rows, width) buffer
            n = nodes[r]
            src = n.args[0]
            z = where(src)
            if z is None:
                return None
            _, s_len, k_pos = n.attrs
            if s_len != seq:   # pragma: no cover - one leading dim (Builder._seq_len)
                return None
            sb, sf = _bf(nodes[src].dims, z[1])
            width = nodes[src].width
            shape = shape_of(n.dims, rows)
            k = new_buf(shape)
            loc[r], strides[r] = (BUF, k), _contiguous_strides(shape)
            total = rows * width
            pr.steps.append(_Step(get_function("tail_seqred.cu", "seq_reduce", dev),
                                  max(1, min(-(-total // 256), 65535)), 256,
                                  [0, sb, sf, seq, width, rows, SEQ_OPS[n.op], k_pos, 0],
                                  [(0, *z[0]), (8, BUF, k)]))
        if not lv.kernel:
            continue
        if cert_reds and all(prog.under_views(t) in cert_reds for t in lv.targets):
            continue   # a certification kernel writes the level's only value
        for t in lv.targets:
            tn = nodes[t]
            shape = shape_of(tn.dims, rows)
            k = new_buf(shape)
            loc[t], strides[t] = (BUF, k), _contiguous_strides(shape)
            if t in index:   # argmax/argmin: written as int64
                pr.i64.add(k)
        template: list[Any] = []
        patch: list[tuple[int, int, int]] = []
        for kind, what in lv.args:
            pos = len(template)
            if kind == "i64":
                template.append(rows)
                continue
            n = nodes[what]
            if kind in ("buf", "gemm", "out"):
                w = where(what)
                if w is None:
                    return None
                template.append(0)
                patch.append((pos, *w[0]))
            elif kind in ("bn_mean", "bn_invstd"):
                template.append(0)
                patch.append((pos, BUF, stats[what][0 if kind == "bn_mean" else 1]))
            elif kind == "input":
                template.append(0)
                patch.append((pos, IN, n.attrs[0]))
            elif kind in ("in_sb", "in_sf"):
                sb, sf = _bf(n.dims, in_meta[n.attrs[0]][1])
                template.append(sb if kind == "in_sb" else sf)
            elif kind == "param":
                template.append(0)
                patch.append((pos, SRC, n.attrs[0]))
            elif kind == "param_sf":
                meta = src_meta[n.attrs[0]]
                if meta is None:
                    return None
                template.append(param_sf(n.dims, meta[0], meta[1]))
            elif kind in ("out_sb", "out_sf"):
                sb, sf = _bf(n.dims, strides[what])
                template.append(sb if kind == "out_sb" else sf)
            elif kind in ("seq_src", "seq_sb", "seq_sf"):
                # a sequence reduction inside the kernel (Level.seq_inline): its operand
                # in place, through its strides (as the seq_reduce step reads it)
                z = where(n.args[0])
                if z is None:
                    return None
                if kind == "seq_src":
                    template.append(0)
                    patch.append((pos, *z[0]))
                else:
                    sb, sf = _bf(nodes[n.args[0]].dims, z[1])
                    template.append(sb if kind == "seq_sb" else sf)
            else:  # pragma: no cover
                raise AssertionError(kind)
        entry, blocks = lv.launch(rows)   # a wide row at a small batch: over a cluster
        tail = _Step(_runtime.generated_kernel(entry, lv.kernel, dev), blocks, lv.block(entry),
                     template, patch)
        g0 = lv.gemms[0] if len(lv.gemms) == 1 else -1
        # (in a program with a sequence reduction only an elementwise level: the tail
        # rows in the skinny kernel's blocks of SK_WARPS * 32 threads combine a row's
        # reductions in another order than the level kernel of lv.threads, which the
        # general path launches -- those programs have no epilogues -- and the prepared
        # launches give its bits)
        fusable = (config.FUSE_TAIL and not lv.bns and g0 in gemm_steps
                   and gemm_steps[g0][0] == len(pr.steps) - 1
                   and (not seq or not any(pl.level_of[i] == lv.index and
                                           nodes[i].kind in _ORDERED for i in
                                           range(len(nodes)))))
        if fusable:
            k, sp = gemm_steps[g0]
            gst = pr.steps[k]
            tiles = gst.grid[0]   # column tiles x row tiles (gemm_skinny.cuh)
            ntail = min(rows, tiles, config.FUSE_MAX_TAIL_BLOCKS)
            fusable = ((ntail == rows or rows <= config.FUSE_MAX_ROWS_PER_BLOCK)
                       and lv.width_max <= config.FUSE_MAX_WIDTH)
        if fusable:
            # the GEMM and this tail in one launch: the tail in the last blocks to finish
            name, text = codegen.fused_skinny_source(lv, sp.mt, _skinny_header())
            fn = _runtime.generated_kernel(name, text, dev)
            sk = gst.skinny
            pr.steps[k] = _Step(fn, gst.grid, gst.block, list(gst.template) + [0, ntail] + template,
                                list(gst.patch) + [(pos + 15, t, i) for pos, t, i in patch],
                                skinny=sk[:5] + (True,))
        else:
            tails[len(pr.steps)] = lv
            if config.PDL_TAIL and pr.steps and pr.steps[-1].skinny is not None:
                tail.dep = True   # (its kernel waits first: codegen's entries)
            pr.steps.append(tail)
    # every result a buffer of its own, allocated per call (Prepared.__call__), contiguous:
    # a result that is an input or the same value as another result was given a node of
    # its own (Program.own_results: a kernel writes it to its buffer); a program built
    # without it is left to the general path (fused.run_gpu copies such results)
    res = []
    for o in (pl.out,) + prog.more_outs:
        w = where(o)
        if w is None or w[0][0] != BUF:
            return None   # the result is an input itself: general path
        k = w[0][1]
        want = shape_of(nodes[o].dims, pl.rows(o, batch))
        if w[1] != _contiguous_strides(want) or pr.bufs[k] != tuple(want):
            return None   # the result is a view of a buffer of another shape: general path
        if any(k == r for r, _ in res):
            return None   # two results in one buffer (the same value twice): general path
        res.append((k, tuple(want)))
    # (the kernels write by address: each result takes torch's shape, as run_gpu gives
    # it: prog.result_shapes)
    shapes = prog.result_shapes(batch)
    pr.out_buf, pr.out_shape = res[0][0], tuple(shapes[0])
    pr.more = tuple((k, tuple(s)) for (k, _), s in zip(res[1:], shapes[1:]))
    pr.outs_type = prog.outs_type
    pr.res_bufs = frozenset(k for k, _ in res)
    pr.res_long = tuple(k in pr.i64 for k, _ in res)
    if config.KSUM_IN_TAIL:
        _ksum_into_tails(pr, ksums, tails, dev)
    return pr
