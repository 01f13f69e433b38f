"""Running tail programs: any Linear + tail model or function, on torch/CuPy/NumPy operands.

Public faces (re-exported by :mod:`cupyfuse` and :mod:`cupyfuse.kernelbench.modules`):

* :func:`fused_linear` -- ``tail(x @ weight.T + bias)`` for a tail written as a Python
  function of torch ops (traced with torch.fx) or as CUDA C fragments (:class:`CudaTail`);
* :func:`from_model` -- a fused copy of any module whose forward is Linear + tail (or a
  chain of such stages);
* :func:`fused_class` -- a drop-in subclass of a model class: same ``__init__``, RNG use,
  parameters, buffers and state_dict keys, with a fused forward.

On a CUDA device a program runs as: the GEMM engine (:mod:`cupyfuse.backend.gemm`) for each
Linear, then one generated kernel per level (:mod:`cupyfuse.backend.codegen`), compiled once by
NVRTC and cached (in memory, and on disk by CuPy); BatchNorm in training mode adds its
column statistics (``kernels_cu/tail_colstat.cu``). On the CPU the same program runs with
torch ops (:func:`cupyfuse.backend.cpu.run_cpu`).
"""
from __future__ import annotations

import copy
import functools
import hashlib
import itertools
import math
import operator
import sys
import threading
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.fx
import torch.nn as nn
import torch.nn.modules.module as _tmod

from cupyfuse import caches
from cupyfuse import config
from cupyfuse.frontend import trace as tracing, translate as translation
from cupyfuse.ir import certify, rewrite
from cupyfuse.backend import codegen, gemm
from cupyfuse.backend import prepared as _prep
from cupyfuse.backend import fastpath as _fastpath
from cupyfuse.interop import Call, _as_torch, describe, warn_forward_only
from cupyfuse.backend.cpu import empty_batch, own_tensors, run_cpu
from cupyfuse.ir.derived import Derived
from cupyfuse.ops import registry
from cupyfuse.ir.program import BATCH, Program, TailError, check_batchnorm, count_batch, shape_of

__all__ = ["fused_linear", "from_model", "fused_class", "FusedModel", "CudaTail", "TailError",
           "compile_program", "PreparedWeight", "prepare_weight"]


# ---------------------------------------------------------------------------------
# compiled kernels (runtime.generated_kernel; plans cached in codegen.compile_program)
from cupyfuse.backend.codegen import compile_program  # noqa: E402


def _kernel(level: codegen.Level | codegen.Epilogue, device_id: int) -> Any:
    """A generated kernel (a level's, or a level as its GEMM's epilogue), compiled once."""
    from cupyfuse.backend.runtime import generated_kernel

    return generated_kernel(level.name, level.kernel, device_id)


# ---------------------------------------------------------------------------------
# execution
def _fmt(t: torch.Tensor) -> str:
    return describe(t)


def _bf_strides(dims: Sequence[int], t: torch.Tensor) -> tuple[int, int]:
    """(batch stride, feature stride) of a tensor holding a value with these dims."""
    return _prep._bf(dims, t.stride())


def _gemv(prog: Program, g: int, x: torch.Tensor, w: torch.Tensor, sources: Sequence[Any],
          owner: torch.Tensor | None, deps: Sequence[Any] | None) -> torch.Tensor:
    """A ``gemv`` node on the GPU: ``kernels_cu/tail_rewrite.cu`` (one block per row, guard
    and direct recomputation of flagged rows in the kernel: no host synchronisation)."""
    from cupyfuse.backend.runtime import get_function, launch

    u, C, a, c, wmax = rewrite.gemv_coefficients(prog, g, w, sources, owner, deps)
    if not math.isfinite(wmax):
        # every row would take the kernel's slow direct branch: torch's GEMM instead
        return rewrite.gemv_value(prog, g, x, w, sources, owner, deps)
    batch, K = x.shape
    out = torch.empty(batch, device=x.device, dtype=torch.float32)
    vec = int(K % 4 == 0 and x.stride(0) % 4 == 0 and x.data_ptr() % 16 == 0)
    if batch:
        launch(get_function("tail_rewrite.cu", "gemv_rows", x.device.index), batch, 256,
               (x.data_ptr(), x.stride(0), K, u.data_ptr(), C, wmax, w.data_ptr(), w.stride(0),
                w.stride(1), w.shape[0], a.data_ptr(), c.data_ptr(), out.data_ptr(), 1, vec))
    return out.reshape(shape_of(prog.nodes[g].dims, batch))


def _param_values(prog: Program, sources: Sequence[Any]) -> Callable[[Sequence[int]], list]:
    """For certify.run: the (pointer, feature stride) launch values of param nodes."""
    def values(params: Sequence[int]) -> list:
        vals: list = []
        for i in params:
            n = prog.nodes[i]
            t = sources[n.attrs[0]]
            vals += [t.data_ptr(),
                     _prep.param_sf(n.dims, t.shape, t.stride()) if n.width > 1 else 0]
        return vals
    return values


def _certified(prog: Program, g: int, x: torch.Tensor, w: torch.Tensor,
               precision: str | None, plain: bool = False) -> Any:
    """The certify.Chain of GEMM node g where its row maxima run certified on these
    operands (sm90 engine, precision "highest", past the skinny batches), else None. A
    plain GEMM (``plain``) only past the prepared launches' sizes, which run it in 3xTF32
    (so both paths give the same bits at every size)."""
    chain = certify.chain_of(prog, g)
    if chain is None or not config.CERTIFY:
        return None
    M, K = x.shape
    N = w.shape[0]
    if not 2 <= N <= config.CERTIFY_MAX_WIDTH or gemm.resolve_precision(precision) != "highest" \
            or gemm.engine_for(x, w) != "sm90" or gemm.skinny_for(M, N, K) \
            or (plain and _prep.engine_batch_ok(M, K, N)):
        return None
    return chain


def _red_out(prog: Program, chain: Any, lv: Any, reds: dict | None, rows: int,
             device: torch.device) -> torch.Tensor | None:
    """The tensor for a certified chain's row reduction where its level computes nothing
    else (certify.red_only), recorded in ``reds``; else None."""
    if reds is None or lv is None or not certify.red_only(prog, chain, lv.targets,
                                                          bool(lv.kernel)):
        return None
    t = torch.empty(shape_of(prog.nodes[chain.red].dims, rows), device=device,
                    dtype=torch.float32)
    reds[chain.red] = t
    return t


def _fold(prog: Program, g: int, x: torch.Tensor, w: torch.Tensor, sources: Sequence[Any],
          owner: torch.Tensor | None, deps: Sequence[Any] | None,
          precision: str | None, lv: Any = None, reds: dict | None = None) -> torch.Tensor:
    """A folded ``gemm`` node on the GPU: the smaller GEMM, then
    ``kernels_cu/tail_rewrite.cu``'s fold_rows (average pooling: the folded bias) or
    pairdiff_rows (pair differences: the row's sum), each with its guard and the direct
    recomputation of flagged rows in the kernel: no host synchronisation. A certified
    GEMM (certify.py) finishes the fold in its certification kernel, and where its level
    ``lv`` computes nothing but the chain's row reduction, writes that too (into
    ``reds``: node -> tensor)."""
    from cupyfuse.backend.runtime import get_function, launch

    def run_gemm(xa: torch.Tensor, wf: torch.Tensor, out: torch.Tensor,
                 rowmax: torch.Tensor | None = None) -> str:
        return gemm.linear_nobias(xa, wf, out, precision=precision, owner=wf, rowmax=rowmax)

    wf, bf, a, c, wmax = rewrite.fold_coefficients(prog, g, w, sources, owner, deps)
    if not math.isfinite(wmax):
        # every row would take the kernel's slow direct branch: torch's GEMM instead
        return rewrite.fold_value(prog, g, x, w, sources, run_gemm, owner, deps)
    kind, k, st = prog.nodes[g].attrs[2][:3]
    batch, K = x.shape
    wo = wf.shape[0]
    h = torch.empty((batch, wo), device=x.device, dtype=torch.float32)
    # the 3xTF32 engine's x split leaves each row's max |x| for the guard (x read once
    # fewer: 98's 1024 x 8192 x is 32 MB); the other engines do not (0: the kernel sums)
    chain = _certified(prog, g, x, wf, precision) if kind == "avgpool" else None
    if chain is not None:
        # one TF32 pass, its row maxima's candidates recomputed in fp32 (certify.py), the
        # fold finished in the same kernel (bias, guard rows directly)
        red_out = _red_out(prog, chain, lv, reds, batch, x.device)
        if batch:
            certify.run(prog, chain, x, wf, h, _param_values(prog, sources), bias=bf,
                        wmax=wmax, fold=(w, a, c, k, st), red_out=red_out)
        return h.reshape(shape_of(prog.nodes[g].dims, batch))
    rowmax = torch.zeros(batch, device=x.device, dtype=torch.int32)
    eng = run_gemm(x, wf, h, rowmax)
    rm = rowmax.data_ptr() if eng.startswith("sm90-3xtf32h") else 0
    vec = int(K % 4 == 0 and x.stride(0) % 4 == 0 and x.data_ptr() % 16 == 0)
    if kind == "pairdiff":
        out = torch.empty(batch, device=x.device, dtype=torch.float32)
        if batch:
            launch(get_function("tail_rewrite.cu", "pairdiff_rows", x.device.index), batch, 256,
                   (x.data_ptr(), x.stride(0), K, wmax, w.data_ptr(), w.stride(0), w.stride(1),
                    a.data_ptr(), c.data_ptr(), bf.shape[0] - 1, bf.data_ptr(), h.data_ptr(),
                    wo, out.data_ptr(), 1, vec, rm))
        return out.reshape(shape_of(prog.nodes[g].dims, batch))
    if batch:
        launch(get_function("tail_rewrite.cu", "fold_rows", x.device.index), batch, 256,
               (x.data_ptr(), x.stride(0), K, wmax, w.data_ptr(), w.stride(0), w.stride(1),
                a.data_ptr(), c.data_ptr(), k, st, wo, bf.data_ptr(), h.data_ptr(), wo, vec, rm))
    return h.reshape(shape_of(prog.nodes[g].dims, batch))


def run_gpu(prog: Program, inputs: Sequence[torch.Tensor], sources: Sequence[torch.Tensor],
            precision: str | None = None, owners: Sequence[Any] | None = None) -> torch.Tensor:
    """Run a program on CUDA tensors (current torch stream; CuPy follows it); the
    unrewritten program where a rewrite's coefficients are not finite."""
    try:
        return _run_gpu(prog, inputs, sources, precision, owners)
    except rewrite.NotExact:
        return _run_gpu(prog.unrewritten, inputs, sources, precision, owners)


def _run_gpu(prog: Program, inputs: Sequence[torch.Tensor], sources: Sequence[torch.Tensor],
             precision: str | None, owners: Sequence[Any] | None) -> torch.Tensor:
    from cupyfuse.backend.runtime import get_function, launch

    batch = inputs[0].shape[0]
    pl = compile_program(prog)
    prog.check_rows(batch // pl.seq if pl.seq else batch)
    nodes = prog.nodes
    if batch == 0:
        return empty_batch(prog, inputs[0].device)
    dev = inputs[0].device
    dev_id = dev.index if dev.index is not None else torch.cuda.current_device()
    bufs: dict[int, torch.Tensor] = {}
    stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    out_t: torch.Tensor | None = None
    index = prog.index_values()   # argmax/argmin: the kernels write them as int64

    def value_tensor(i: int) -> torch.Tensor:
        # a loop, not recursion: a self-referencing closure is a reference cycle that held
        # every buffer of the call until Python's cyclic GC ran (27 KB a call at 32 x 70)
        j = i
        while j not in bufs and nodes[j].kind == "view":
            j = nodes[j].args[0]
        if j in bufs:
            t = bufs[j]
        elif nodes[j].kind == "input":
            t = inputs[nodes[j].attrs[0]]
        else:
            raise AssertionError(f"value %{j} ({nodes[j].kind}) is not materialised")
        return t if j == i else t.reshape(shape_of(nodes[i].dims, pl.rows(i, batch)))

    reds: dict[int, torch.Tensor] = {}   # row reductions written by certification kernels
    for lv in pl.levels:
        fused_level = False
        rows = batch // pl.seq if lv.per_batch else batch   # this level's values' rows
        for g in lv.gemms:
            n = nodes[g]
            a = value_tensor(n.args[0]).reshape(rows, -1)
            if not a.is_contiguous():
                a = a.contiguous()
            src = sources[n.attrs[0]]
            if n.kind == "gemv":
                owner = owners[n.attrs[0]] if owners is not None else None
                w = src.t() if n.attrs[1] else src
                bufs[g] = _gemv(prog, g, a, w, sources,
                                owner if isinstance(owner, torch.Tensor) else None, owners)
                continue
            owner = owners[n.attrs[0]] if owners is not None else None
            if isinstance(owner, torch.Tensor):
                # the parameter itself (not a fresh detached view): the engine caches its
                # derived weights keyed on this very object and its version
                src = owner
            if n.attrs[1]:  # the source holds W.T: cache a contiguous W
                from cupyfuse import caches

                w = caches.cached("tail_wT", owner, (src,), (), lambda s=src: s.t().contiguous())
                owner = w if owner is not None else None  # the cached copy keys its split
            else:
                w = src if src.is_contiguous() else src.contiguous()
            if len(n.attrs) > 2:  # average pooling folded into the weight (rewrite.py)
                bufs[g] = _fold(prog, g, a, w, sources,
                                owner if isinstance(owner, torch.Tensor) else None, owners,
                                precision, lv, reds)
                continue
            chain = _certified(prog, g, a, w, precision, plain=True)
            if chain is not None:
                # its row maxima certified: one TF32 pass, the candidates in fp32 (certify.py)
                h = torch.empty((rows, n.width), device=dev, dtype=torch.float32)
                certify.run(prog, chain, a, w, h, _param_values(prog, sources),
                            red_out=_red_out(prog, chain, lv, reds, rows, dev),
                            owner=owner if isinstance(owner, torch.Tensor) else None)
                bufs[g] = h
                continue
            epi = lv.epi
            if epi is not None and epi.gemm == g and gemm.epilogue_ok(a, w, precision):
                # the level inside the GEMM: one launch, the GEMM output never written
                for t in lv.targets:
                    bufs[t] = torch.empty(shape_of(nodes[t].dims, rows), device=dev,
                                          dtype=torch.int64 if t in index else torch.float32)
                gemm.linear_epilogue(a, w, _kernel(epi, dev_id),
                                     _values(epi.args, prog, rows, bufs, stats, inputs, sources),
                                     epi.nred, owner=owner)
                fused_level = True
                continue
            h = torch.empty((rows, n.width), device=dev, dtype=torch.float32)
            gemm.linear_nobias(a, w, h, precision=precision,
                               owner=owner if owner is not None else None)
            bufs[g] = h
        for b in lv.bns:
            n = nodes[b]
            z = bufs[n.args[0]]
            eps, momentum, srcs = n.attrs
            W = nodes[n.args[0]].width
            check_batchnorm(n, sources, (rows, W))
            mean = torch.empty(W, device=dev, dtype=torch.float64)
            invstd = torch.empty(W, device=dev, dtype=torch.float64)
            rm = rv = nbt = None
            if srcs:
                rm, rv, nbt = (sources[j] for j in srcs)
                if nbt is not None and (nbt.dtype != torch.int64 or nbt.numel() != 1):
                    raise TypeError("BatchNorm: num_batches_tracked must be one int64, got "
                                    f"{describe(nbt)}")
            chunk_rows = max(64, -(-rows // 64))
            chunks = -(-rows // chunk_rows)
            psum = torch.empty((chunks, W), device=dev, dtype=torch.float64)
            psq = torch.empty((chunks, W), device=dev, dtype=torch.float64)
            zc = z.reshape(rows, W)
            launch(get_function("tail_colstat.cu", "colstat_partial", dev_id),
                   (-(-W // 32), chunks), 256, (zc.data_ptr(), rows, W, chunk_rows, psum.data_ptr(), psq.data_ptr(),
                    0 if nbt is None else nbt.data_ptr()))   # counts the batch on the device
            launch(get_function("tail_colstat.cu", "colstat_finalize", dev_id),
                   -(-W // 256), 256, (zc.data_ptr(), psum.data_ptr(), psq.data_ptr(), chunks, rows, W, float(eps),
                    -1.0 if momentum is None else float(momentum), mean.data_ptr(),
                    invstd.data_ptr(), 0 if rm is None else rm.data_ptr(),
                    0 if rv is None else rv.data_ptr(), 0 if nbt is None else nbt.data_ptr()))
            stats[b] = (mean, invstd)
        for r in lv.seqreds:
            src = nodes[r].args[0]
            bufs[r] = _seq_reduce(nodes[r], value_tensor(src), nodes[src], rows, dev_id)
        if reds:   # a certification kernel wrote the level's only value: no tail pass
            bufs.update(reds)
            done = all(prog.under_views(t) in reds for t in lv.targets)
            reds.clear()
            if done:
                continue
        if not lv.kernel or fused_level:
            continue
        for t in lv.targets:
            bufs[t] = torch.empty(shape_of(nodes[t].dims, rows), device=dev,
                                  dtype=torch.int64 if t in index else torch.float32)
        # (sequence reductions inside the kernel read their operand in place)
        seqsrc = {r: value_tensor(nodes[r].args[0]) for r in lv.seq_inline}
        vals = _values(lv.args, prog, rows, bufs, stats, inputs, sources, seqsrc)
        launch(_kernel(lv, dev_id), rows, lv.threads, vals)
    # every result its own contiguous tensor: Program.own_results gave each a buffer of
    # its own; own_tensors copies any that still aliases an input or another result, or
    # is strided (a program built without own_results)
    if prog.more_outs:   # (each in torch's shape: leading dims, split features)
        return prog.outs_type(own_tensors(
            [value_tensor(o).reshape(s) for o, s in zip((prog.out,) + prog.more_outs,
                                                        prog.result_shapes(batch))], inputs))
    out_t = value_tensor(pl.out)
    out_t = out_t.reshape(prog.out_shape(batch)) if prog.squeezes_batch or prog.lead or \
        prog.lead_out else out_t
    out_t = own_tensors([out_t], inputs)[0]
    return out_t if prog.outs_type is None else prog.outs_type([out_t])


#: tail_seqred.cu's seq_reduce: the op codes of a "seqred" node (one table for both paths)
_SEQ_OPS = _prep.SEQ_OPS


def _seq_reduce(n: Any, v: torch.Tensor, src: Any, rows: int, dev_id: int) -> torch.Tensor:
    """A sequence reduction ("seqred" node ``n``) on the GPU: ``v`` holds its operand
    (``src``: that node) on batch * seq rows, any strides; the result is a new
    contiguous value of ``rows`` (the batch's) rows. ``kernels_cu/tail_seqred.cu``: one
    thread per (batch element, feature), the seq rows combined in order (sums in double):
    the same bits every run."""
    from cupyfuse.backend.runtime import get_function, launch

    _, seq, k = n.attrs
    out = torch.empty(shape_of(n.dims, rows), device=v.device, dtype=torch.float32)
    sb, sf = _bf_strides(src.dims, v)
    width = src.width
    total = rows * width
    if total:
        launch(get_function("tail_seqred.cu", "seq_reduce", dev_id),
               max(1, min(-(-total // 256), 65535)), 256,
               (v.data_ptr(), sb, sf, seq, width, rows, _SEQ_OPS[n.op], k, out.data_ptr()))
    return out


def _values(args: Sequence[tuple[str, Any]], prog: Program, batch: int, bufs: dict,
            stats: dict, inputs: Sequence[torch.Tensor], sources: Sequence[Any],
            seqsrc: dict | None = None) -> tuple:
    """The launch values of a generated kernel's parameters (``Level.args`` or
    ``Epilogue.args``: (kind, node) each) for one call; ``seqsrc``: the operand of each
    sequence reduction the kernel computes (``Level.seq_inline``), any strides."""
    nodes = prog.nodes
    vals: list[Any] = []
    for kind, what in args:
        if kind == "i64":
            vals.append(batch)
            continue
        n = nodes[what]
        if kind in ("buf", "gemm", "out"):
            vals.append(bufs[what].data_ptr())
        elif kind == "bn_mean":
            vals.append(stats[what][0].data_ptr())
        elif kind == "bn_invstd":
            vals.append(stats[what][1].data_ptr())
        elif kind == "input":
            vals.append(inputs[n.attrs[0]].data_ptr())
        elif kind in ("in_sb", "in_sf"):
            sb, sf = _bf_strides(n.dims, inputs[n.attrs[0]])
            vals.append(sb if kind == "in_sb" else sf)
        elif kind == "param":
            vals.append(sources[n.attrs[0]].data_ptr())
        elif kind == "param_sf":
            t = sources[n.attrs[0]]
            vals.append(_prep.param_sf(n.dims, t.shape, t.stride()))
        elif kind in ("out_sb", "out_sf"):
            sb, sf = _bf_strides(n.dims, bufs[what])
            vals.append(sb if kind == "out_sb" else sf)
        elif kind == "seq_src":
            vals.append(seqsrc[what].data_ptr())
        elif kind in ("seq_sb", "seq_sf"):
            sb, sf = _bf_strides(nodes[n.args[0]].dims, seqsrc[what])
            vals.append(sb if kind == "seq_sb" else sf)
        else:  # pragma: no cover
            raise AssertionError(kind)
    return tuple(vals)


# ---------------------------------------------------------------------------------
# user tails as CUDA C fragments
@dataclass(frozen=True)
class CudaTail:
    """A tail written as CUDA C fragments, in the manner of CuPy's ReductionKernel.

    ``map``: a float expression of ``h`` (the Linear output incl. bias, one element;
    computed in float32 -- only the accumulation follows ``acc``),
    ``col`` (its feature index) and ``N`` (the width). Without ``reduce`` the tail is
    elementwise and returns (batch, N). With ``reduce`` (a combine expression of ``a``
    and ``b``) and ``identity``, the mapped values of each row are combined in a fixed
    order and ``post`` (an expression of ``r``, default ``r``) gives (batch, 1).
    ``reference`` is an optional torch function of h for the CPU path and for checks.
    ``acc`` is the accumulator type ("float" or "double").
    """

    map: str
    reduce: str | None = None
    identity: str = "0"
    post: str = "r"
    acc: str = "float"
    reference: Callable[[torch.Tensor], torch.Tensor] | None = None
    name: str = "cuda_tail"

    def source(self, n: int, threads: int = 256) -> tuple[str, str]:
        body = [f"    const int N = {n};",
                "    const long long row = blockIdx.x;",
                "    if (row >= batch) return;",
                "    auto mapf = [&](float h, int col) -> float { (void)col; (void)N; "
                f"return ({self.map}); }};"]
        if self.reduce is None:
            body.append("    for (int col = threadIdx.x; col < N; col += blockDim.x) "
                        "out[row * N + col] = mapf(z[row * N + col] + (bias ? bias[col] : 0.0f), col);")
        else:
            acc = self.acc
            body += [f"    __shared__ {acc} scr[32];",
                     f"    auto comb = []({acc} a, {acc} b) -> {acc} {{ return ({self.reduce}); }};",
                     f"    {acc} acc = ({acc})({self.identity});",
                     "    for (int col = threadIdx.x; col < N; col += blockDim.x) "
                     f"acc = comb(acc, ({acc})mapf(z[row * N + col] + (bias ? bias[col] : 0.0f), col));",
                     f"    acc = cf_block_combine<{acc}>(acc, ({acc})({self.identity}), comb, scr);",
                     f"    if (threadIdx.x == 0) {{ const {acc} r = acc; out[row] = (float)({self.post}); }}"]
        text = "\n".join(body)
        digest = hashlib.sha1((text + str(threads)).encode()).hexdigest()[:12]
        name = f"cf_user_{digest}"
        src = (f"extern \"C\" __global__ void __launch_bounds__({threads}) {name}(\n"
               "    long long batch, const float* __restrict__ z, const float* __restrict__ bias,\n"
               "    float* __restrict__ out) {\n" + text + "\n}\n")
        return name, src


def _run_cuda_tail(tail: CudaTail, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                   precision: str | None, owner: Any) -> torch.Tensor:
    from cupyfuse.backend.runtime import launch

    batch, n = x.shape[0], w.shape[0]
    h = torch.empty((batch, n), device=x.device, dtype=torch.float32)
    gemm.linear_nobias(x, w, h, precision=precision, owner=owner)
    name, src = tail.source(n)
    lv = codegen.Level(-1, kernel="#include \"tail_ops.cuh\"\n" + src, name=name)
    dev_id = x.device.index if x.device.index is not None else torch.cuda.current_device()
    fn = _kernel(lv, dev_id)
    out = torch.empty((batch, n) if tail.reduce is None else (batch, 1), device=x.device,
                      dtype=torch.float32)
    launch(fn, batch, 256, (batch, h.data_ptr(), 0 if b is None else b.data_ptr(),
                                    out.data_ptr()))
    return out


# ---------------------------------------------------------------------------------
# prepared launches (cupyfuse.backend.prepared): repeated small-batch calls
def _meta(a: Any) -> tuple | None:
    """(address, shape, strides in elements, device index, is_cupy) of a float32 CUDA
    operand; None for anything else (which takes the general path)."""
    if isinstance(a, torch.Tensor):
        if a.dtype is not torch.float32 or not a.is_cuda:
            return None
        return a.data_ptr(), a.shape, a.stride(), a.get_device(), False
    tp = type(a)
    if tp.__module__.startswith("cupy") and tp is _cupy_ndarray():
        if a.dtype.char != "f":
            return None
        mem = a.data
        return mem.ptr, a.shape, tuple([s >> 2 for s in a.strides]), mem.device_id, True
    return None


_CUPY_ND: list = []


def _cupy_ndarray() -> Any:
    """cupy.ndarray, or a class nothing is an instance of when CuPy is not installed."""
    if not _CUPY_ND:
        try:
            import cupy

            _CUPY_ND.append(cupy.ndarray)
        except Exception:  # pragma: no cover - depends on the install
            _CUPY_ND.append(type("NoCupy", (), {}))
    return _CUPY_ND[0]


def _src_meta(t: Any) -> tuple | None:
    return (tuple(t.shape), tuple(t.stride())) if isinstance(t, torch.Tensor) else None


def _stream_for(dev: int, is_cupy: bool) -> int | None:
    """The caller's stream on ``dev``, or None when ``dev`` is not the current device."""
    if is_cupy:
        import cupy

        if cupy.cuda.runtime.getDevice() != dev:
            return None
        return cupy.cuda.get_current_stream().ptr
    if _prep.current_device() != dev:
        return None
    return _prep.torch_stream(dev)


def _attr(obj: Any, name: str) -> Any:
    """getattr for module paths, without nn.Module.__getattr__'s slow fallback chain."""
    d = obj.__dict__
    v = d.get(name, _MISSING)
    if v is not _MISSING:
        return v
    for store in ("_parameters", "_buffers", "_modules"):
        sd = d.get(store)
        if sd is not None and name in sd:
            return sd[name]
    return getattr(obj, name)


_MISSING = object()
_F32 = torch.float32


def _nothing(d: dict) -> tuple:
    return ()


def _getter(module: nn.Module, source: Any) -> Callable[[nn.Module], Any]:
    """module -> what a program source names now: a dotted attribute path walked with the
    dict lookups that found it in ``module`` (the general walk where the structure has
    changed since), or the tensor the program holds."""
    if isinstance(source, Derived):
        return source.value   # evaluated, or its cached tensor while the leaves are unchanged
    if not isinstance(source, str):
        return lambda m, t=source: t
    path = tuple(source.split("."))
    steps = []
    obj: Any = module
    for name in path:
        d = getattr(obj, "__dict__", {})
        store = None if name in d else next(
            (s for s in ("_parameters", "_buffers", "_modules") if name in d.get(s, ())), "")
        steps.append((store, name))
        obj = _attr(obj, name)
    steps_t = tuple(steps)

    def walk(m: nn.Module) -> Any:
        for part in path:
            m = _attr(m, part)
        return m

    if any(st == "" for st, _ in steps_t):
        return walk

    def get(m: nn.Module) -> Any:
        t: Any = m
        try:
            for store, name in steps_t:
                d = t.__dict__
                t = d[name] if store is None else d[store][name]
            return t
        except (KeyError, AttributeError, TypeError):
            return walk(m)
    get.steps = steps_t   # (fastpath.py writes the same walk into its specialised calls)
    return get


def _try_prepare(prog: Program, batch: int, dev: int, in_meta: list, sources: Sequence[Any],
                 allow_bn: bool) -> Any:
    u = _prep.usable(prog)
    if u is None:
        return None
    for n in u[0].nodes:   # a BatchNorm's counter is bumped by a kernel: one int64
        if n.kind == "bn" and n.attrs[2]:
            nbt = sources[n.attrs[2][2]] if n.attrs[2][2] is not None else None
            if nbt is not None and not (isinstance(nbt, torch.Tensor) and
                                        nbt.dtype == torch.int64 and nbt.numel() == 1):
                return None   # the general path raises its error
    return _prep.prepare(u[0], batch, dev, in_meta, [_src_meta(t) for t in sources],
                         allow_bn=allow_bn, small_weights_only=u[1])


_fast_fn: dict[tuple, Any] = caches.register("function prepared launches", {})


_TORCH_TYPES = (torch.Tensor, nn.Parameter)


def _fast_operands(x: Any, weight: Any, bias: Any, extra: tuple) -> tuple | None:
    """(key, x's address, device, is_cupy, operand addresses [x, extras...], source
    addresses [weight, bias?], weight owner) of a fused_linear call's operands for its
    prepared launches, or None when they do not qualify. One function for the lookup and
    for the store, so both build the same key: per operand (shape, strides, device), then
    the extras' numbers, the dispatch key."""
    if not extra and type(x) is torch.Tensor and type(weight) in _TORCH_TYPES and \
            (bias is None or type(bias) in _TORCH_TYPES):
        # torch tensors, no extras (the common call): the same key, read inline (~1 us
        # less than the general form below)
        if x.dtype is not _F32 or weight.dtype is not _F32 or not x.is_cuda:
            return None
        dev = x.get_device()
        if bias is None:
            bk = None
            sptrs = [weight.data_ptr()]
        else:
            if bias.dtype is not _F32:
                return None
            bk = (bias.shape, bias.stride(), bias.get_device())
            sptrs = [weight.data_ptr(), bias.data_ptr()]
        key = (x.shape, x.stride(), dev, False, weight.shape, weight.stride(),
               weight.get_device(), bk, (), (), gemm.dispatch_key())
        return key, dev, False, [x.data_ptr()], sptrs, weight
    xm = _meta(x)
    if xm is None:
        return None
    if isinstance(weight, PreparedWeight):
        w, owner = weight.source, weight.tensor
    else:
        w, owner = weight, (weight if isinstance(weight, torch.Tensor) else None)
    wm = _meta(w)
    if wm is None:
        return None
    bm = _meta(bias) if bias is not None else None
    if bias is not None and bm is None:
        return None
    em = []
    nums = []   # a Python number among the extras: a constant of the program, keyed by value
    for e in extra:
        if type(e) is float or type(e) is int:
            nums.append((type(e), repr(e)))
            continue
        m = _meta(e)
        if m is None:
            return None
        em.append(m)
        nums.append(None)
    key = (xm[1], xm[2], xm[3], xm[4], wm[1], wm[2], wm[3],
           None if bm is None else (bm[1], bm[2], bm[3]), tuple([(m[1], m[2], m[3]) for m in em]),
           tuple(nums), gemm.dispatch_key())
    sptrs = [wm[0]] + ([bm[0]] if bm is not None else [])
    return key, xm[3], xm[4], [xm[0]] + [m[0] for m in em], sptrs, owner


def _fused_linear_fast(x: Any, weight: Any, bias: Any, tail: Any, extra: tuple,
                       precision: str | None = None) -> Any:
    """fused_linear through a prepared launch; None when none applies (general path)."""
    if not extra:
        spec = _fn_specs.get(tail)
        if spec is not None:   # this call's decisions, made before (fastpath.py)
            hit = spec(x, weight, bias, precision)
            if hit is not None:
                return hit
    ops = _fast_operands(x, weight, bias, extra)
    if ops is None:
        return None
    key, dev, is_cupy, in_ptrs, sptrs, owner = ops
    key = (tail,) + key + (tracing.global_values(tracing.global_reads(tail)),)
    ent = _fast_fn.get(key)
    if ent is None:
        return None
    pr, fixed = ent
    stream = _stream_for(dev, is_cupy)
    if stream is None:
        return None
    if fixed:
        sptrs += fixed
    # the weight's owner keys its cached split (the engine's GEMM; a CuPy weight has one
    # only through a PreparedWeight); a GEMV's coefficients also read the bias and the
    # tensors the tail holds (their versions key the cache)
    objs: tuple = (owner,)
    if pr.all_sources:
        if bias is not None and not isinstance(bias, torch.Tensor):
            return None
        objs = (owner,) + ((bias,) if bias is not None else ()) + tuple(_fast_holds[key])
    hit = pr(in_ptrs, sptrs, stream, is_cupy, objs, precision)
    if hit is not None and not extra and not is_cupy and config.FASTPATH:
        _specialise_fn(tail, key, ent, x, weight, bias, dev, stream, precision)
    return hit


def _specialise_fn(tail: Any, key: tuple, ent: tuple, x: Any, weight: Any, bias: Any,
                   dev: int, stream: int, precision: str | None) -> None:
    """After a hit of fused_linear's entry ``key``: the tail's second hit in a row of the
    same entry builds its specialised call (one per tail object, the latest entry's; once
    per ready plan, as _Runner._specialise). "In a row" per tail: a forward calling two
    fused tails in turn gets both."""
    if _fn_last.get(tail) != key:
        if len(_fn_last) >= 4 * _MAX_FN_TRACES:
            _fn_last.clear()
        _fn_last[tail] = key
        return
    rd = ent[0]._ready.get((stream, False))
    st = _fn_spec_state.get(tail)
    if rd is None or (st is not None and st[0] == key and st[1] is rd[4]):
        return
    if tail not in _fn_specs and len(_fn_specs) >= _MAX_FN_TRACES:
        oldest = next(iter(_fn_specs))
        del _fn_specs[oldest]
        _fn_spec_state.pop(oldest, None)
    _fn_spec_state[tail] = (key, rd[4])
    _fn_specs[tail] = _fastpath.build_function(tail, x, weight, bias, ent, dev, stream,
                                               precision)


# the specialised calls of fused_linear per tail object (fastpath.build_function), the
# entry key and ready plan each was built for, and each tail's last entry hit
_fn_specs: dict[Any, Any] = caches.register("function specialised calls", {})
_fn_spec_state: dict[Any, tuple] = caches.register("function specialised states", {})
_fn_last: dict[Any, tuple] = caches.register("function last entries", {})


def _remember_fast_fn(tail: Any, x: Any, weight: Any, bias: Any, extra: tuple, prog: Program,
                      inputs: Sequence[torch.Tensor], sources: Sequence[Any]) -> None:
    """After a general-path call: prepare the launches for the next call like it."""
    ops = _fast_operands(x, weight, bias, extra)
    if ops is None:
        return
    key = (tail,) + ops[0] + (tracing.global_values(tracing.global_reads(tail)),)
    if key in _fast_fn:
        return
    if len(_fast_fn) >= 4 * _MAX_FN_TRACES:
        oldest = next(iter(_fast_fn))
        del _fast_fn[oldest]
        _fast_holds.pop(oldest, None)
    in_meta = [(tuple(t.shape), tuple(t.stride())) for t in inputs]
    pr = _try_prepare(prog, inputs[0].shape[0], ops[1], in_meta, sources, allow_bn=False)
    nfixed = 1 + (bias is not None)
    if pr is not None and any(not isinstance(t, torch.Tensor) for t in sources[nfixed:]):
        pr = None
    fixed = [t.data_ptr() for t in sources[nfixed:]] if pr is not None else []
    _fast_fn[key] = (pr, fixed) if pr is not None else None
    if pr is not None:
        _fast_holds[key] = list(sources[nfixed:])  # the fixed tensors stay alive
        owner = ops[5]
        if owner is not None:
            # the entry is keyed on shapes, not on the weight: its kept workspace goes back
            # when the weight that made it dies (a later call allocates it again)
            weakref.finalize(owner, _release_prepared, weakref.ref(pr))


_fast_holds: dict[tuple, list] = caches.register("function held tensors", {})


def _release_prepared(ref: Any) -> None:
    pr = ref()
    if pr is not None:
        pr.release()


def fused_linear_prepared(x: Any, weight: Any, bias: Any, tail: Callable,
                          precision: str | None = None) -> Any:
    """``fused_linear(x, weight, bias, tail)`` when a prepared launch exists for a call like
    this one (same tail object, shapes, strides, device, operand kinds); else None."""
    return _fused_linear_fast(x, weight, bias, tail, (), precision)


# ---------------------------------------------------------------------------------
# functional API
_fn_traces: dict[Any, Any] = caches.register("function programs", {})
#: traced tail functions kept (oldest dropped first); define a tail function once and
#: reuse it: a fresh lambda per call is traced again each time
_MAX_FN_TRACES = 64


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


def _as_operand(obj: Any, name: str, op: str) -> tuple[torch.Tensor, str]:
    if isinstance(obj, (bool, np.bool_)):
        raise TypeError(f"{op}: {name} is a bool ({obj!r}): {op} takes tensors and arrays, "
                        "and Python numbers after the weight and bias as constants of the "
                        "tail; pass a flag as a number (`1.0 if flag else 0.0`) or close "
                        "the tail function over it")
    try:
        t, kind = _as_torch(obj, name)
    except TypeError as e:
        raise TypeError(f"{op}: {e}") from None
    if t.dtype != torch.float32:
        raise TypeError(f"{op}: {name} must be float32, got {describe(obj)}")
    return t.detach(), kind


def fused_linear(x: Any, weight: Any, bias: Any = None, tail: Callable | CudaTail | None = None,
                 *extra: Any, precision: str | None = None) -> Any:
    """``tail(x @ weight.T + bias, *extra)`` fused; x (batch, K) or (batch, seq..., K)
    (the leading dims are rows: the tail works along the last dim, ``extra`` inputs have
    x's leading dims), weight (N, K), bias (N,).

    ``tail`` is a Python function of torch ops (any op of the vocabulary; traced once
    with torch.fx per function and shapes), a :class:`CudaTail`, or None (the Linear
    alone). An ``extra`` that is a Python number is a constant of the tail's program (one
    program per value, and prepared launches per value). ``weight`` may be a
    :class:`PreparedWeight` (see :func:`prepare_weight`): the way to keep a CuPy weight's
    derived copies between calls. Operands: torch tensors, CuPy arrays, NumPy arrays or
    any ``__dlpack__`` producer, all float32 on one device; the result comes back in x's
    type, computed on the caller's current stream (torch's for torch, CuPy's for CuPy).
    """
    if not isinstance(tail, CudaTail):
        hit = _fused_linear_fast(x, weight, bias, tail if tail is not None else _identity, extra,
                                 precision)
        if hit is not None:
            return hit
    if tail is not None and not isinstance(tail, CudaTail) and not callable(tail):
        raise TypeError(f"fused_linear: tail must be a function of torch ops, a CudaTail or "
                        f"None, got {type(tail).__name__} ({tail!r})")
    op = "fused_linear"
    xt, kind = _as_operand(x, "x", op)
    prepared = weight if isinstance(weight, PreparedWeight) else None
    if prepared is not None:
        weight = prepared.tensor
    wt, _ = _as_operand(weight, "weight", op)
    bt = _as_operand(bias, "bias", op)[0] if bias is not None else None
    # Python numbers among the extras: constants of the program (the tail's argument i + 1)
    numbers = _numbers((x,) + extra)
    epos = [i for i in range(len(extra)) if i + 1 not in dict(numbers)]
    for i in epos:
        _zero_d_array(extra[i], f"extra[{i}]", op)
    ex = [_as_operand(extra[i], f"extra[{i}]", op)[0] for i in epos]
    if xt.dim() < 2 or (xt.dim() > 2 and isinstance(tail, CudaTail)):
        raise ValueError(f"{op}: x must be (batch, K) float32" +
                         (" for a CudaTail (pass x.reshape(-1, K))" if xt.dim() > 2 else
                          " or (batch, seq..., K)") + f", got {describe(x)}")
    K = xt.shape[-1]
    if wt.dim() != 2 or wt.shape[1] != K or wt.shape[0] < 1:
        raise ValueError(f"{op}: weight must be (out_features, {K}) float32 on {xt.device}, "
                         f"got {describe(weight)}")
    N = wt.shape[0]
    if bt is not None and tuple(bt.shape) != (N,):
        raise ValueError(f"{op}: bias must be ({N},) float32 on {xt.device}, got {describe(bias)}")
    for name, t, orig in [("weight", wt, weight), ("bias", bt, bias)] + \
            [(f"extra[{i}]", e, extra[i]) for i, e in zip(epos, ex)]:
        if t is not None and t.device != xt.device:
            raise ValueError(f"{op}: {name} must be on {xt.device} like x, got {describe(orig)}")
    if not xt.is_contiguous():
        xt = xt.contiguous()
    # derived copies of the weight are cached on a torch parameter/tensor (its version
    # counter tracks in-place changes) or on a PreparedWeight's view (until refresh())
    owner = weight if isinstance(weight, torch.Tensor) else None
    call = Call(op=op, kind=kind, device=xt.device, x=xt)
    if isinstance(tail, CudaTail):
        if xt.device.type == "cpu":
            if tail.reference is None:
                raise TailError(f"{op}: a CudaTail runs on CUDA devices; give it a `reference` "
                                "torch function to run it on the CPU")
            h = xt @ wt.t() + (bt if bt is not None else 0)
            # (a strided view of h, h[:, 2:5], copied: results are contiguous)
            return call.result(own_tensors([tail.reference(h).float()], [xt])[0])
        with call:
            return call.result(_run_cuda_tail(tail, xt, wt, bt, precision, owner))
    fn = tail if tail is not None else _identity
    prog = _function_program(fn, xt, N, bt is not None, ex, numbers)
    prog.check_lead_batches([xt.shape] + [e.shape for e in ex], getattr(fn, "__name__", "tail"),
                            ["x"] + [f"input {i + 1}" for i in epos])
    # the weight and bias, then the tensors the tail function closes over
    sources = [wt] + ([bt] if bt is not None else []) + list(prog.sources[1 + (bt is not None):])
    for s in sources:
        if isinstance(s, torch.Tensor) and s.device != xt.device:
            raise ValueError(f"{op}: a tensor the tail uses must be on {xt.device} like x, got "
                             f"{describe(s)}")
    inputs = [xt] + ex
    in_place = True
    if not prog.lead and ex:
        inputs = _broadcast_rows(inputs, prog, op)
        # an x of one row against a batch of extras is copied (its rows are the batch's)
        in_place = inputs[0].data_ptr() == xt.data_ptr() and inputs[0].shape == xt.shape
    if prog.lead:   # (batch, seq..., K): batch * seq rows, as the program runs them
        inputs = _lead_rows(inputs)
    if xt.dim() > 2:
        inputs[0] = xt.reshape(-1, K)
    if prog.lead and inputs[0].shape[0] == 0:   # a leading dim of 0 (or an empty batch)
        prog.check_rows(0)
        return _results(call, empty_batch(prog, xt.device, xt.shape[0]))
    if prog.lead:
        # an extra that is no view of its rows is copied: never read through prepared
        # launches (they take the caller's address)
        in_place = all(a.data_ptr() == t.data_ptr() for a, t in zip(inputs[1:], ex))
    # owners: what keys derived weights (the weight's split, a GEMV's or a fold's
    # coefficients, which may read the bias and the tail's tensors too): the caller's own
    # tensors, not the fresh detached views (whose identity changes every call)
    nb = 1 + (bt is not None)
    owners = [owner] + ([bias if isinstance(bias, torch.Tensor) else bt] if nb == 2 else []) \
        + sources[nb:]
    if xt.device.type == "cpu":
        return call.result(run_cpu(prog, inputs, sources, owners=owners))
    xm = _meta(x)
    if xm is not None and xm[0] == xt.data_ptr() and in_place and not isinstance(tail, CudaTail):
        # x is used in place (no copy): prepare the launches, and run this very call
        # through them too (the first call computes exactly what the next ones will)
        _remember_fast_fn(fn if tail is None else tail, x, weight, bias, extra, prog, inputs,
                          sources)
        hit = _fused_linear_fast(x, weight, bias, fn if tail is None else tail, extra, precision)
        if hit is not None:
            return hit
    with call:
        return call.result(run_gpu(prog, inputs, sources, precision, owners=owners))


def _lead_rows(tens: list[torch.Tensor]) -> list[torch.Tensor]:
    """(batch, seq..., features) inputs as the batch * seq rows a program with leading
    dims runs (views where they can be); an input without the features ((batch, seq...),
    a mask: translation._input_dims) as one number per row."""
    nd = tens[0].dim()
    return [t.reshape((-1,) + (1,) * (t.dim() - 2) + (t.shape[-1],)) if t.dim() == nd
            else t.reshape((-1,) + (1,) * (t.dim() - 1)) for t in tens]


def _broadcast_rows(tens: list[torch.Tensor], prog: Program, name: str) -> list[torch.Tensor]:
    """Inputs of one row against a batch (torch broadcasts a (1, N) input): the batch's
    rows, a stride-0 view (x itself copied: the GEMM reads its rows); the kernels index
    every input by the batch's rows. A result computed from one-row inputs only is one
    row in torch: refused (it would come back with the batch's rows)."""
    B = max(t.shape[0] for t in tens)
    if B <= 1 or all(t.shape[0] == B for t in tens):
        return tens
    one = {i for i, t in enumerate(tens) if t.shape[0] == 1}
    for k, deps in enumerate(prog.result_inputs()):
        if deps <= one:
            raise TailError(f"{name}: {'result ' + str(k) if prog.outs_type else 'the result'} "
                            "is computed from one-row inputs only (torch gives it one row) "
                            f"while other inputs have {B} rows: pass inputs with the batch's "
                            "rows")
    out = []
    for i, t in enumerate(tens):
        if t.dim() >= 1 and t.shape[0] == 1:
            t = t.expand((B,) + tuple(t.shape[1:]))
            if i == 0:
                t = t.contiguous()
        out.append(t)
    return out


def _identity(h: torch.Tensor) -> torch.Tensor:
    return h


def _function_program(fn: Callable, x: torch.Tensor, n: int, has_bias: bool,
                      extra: Sequence[torch.Tensor],
                      numbers: tuple[tuple[int, int | float], ...] = ()) -> Program:
    # (the module-level numbers the function reads: fx bakes them in)
    key = (fn, tuple(x.shape[1:]), n, has_bias, tuple(tuple(e.shape[1:]) for e in extra),
           tuple([(i, tracing._value_key(v)) for i, v in numbers]),
           tracing.global_values(tracing.global_reads(fn)), registry.generation())
    prog = _fn_traces.get(key)
    if prog is not None:
        return prog
    if len(_fn_traces) >= _MAX_FN_TRACES:  # a new lambda per call must not grow memory
        _fn_traces.pop(next(iter(_fn_traces)))
    traced = tracing.trace(fn, getattr(fn, "__name__", "tail"))
    from cupyfuse.ir.program import Builder

    b = Builder(Program(n_inputs=1 + len(extra)))
    b.p.sources.append("__weight__")
    xin = b.input(0, (BATCH, x.shape[-1]))   # leading dims (batch, seq, K): rows
    h = b.gemm(xin, "__weight__", n, False)
    if has_bias:
        h = b.map("add", h, b.param("__bias__", (n,)))
    # translate the tail with h as its first input: splice by translating a program
    # whose input 0 is h, then remapping
    sub = translation.translate(traced, traced.root, [tuple(x.shape[:-1]) + (n,)] +
                            [tuple(e.shape) for e in extra], allow_no_gemm=True,
                            numbers=numbers)
    remap: dict[int, int] = {}
    for i, node in enumerate(sub.nodes):
        if node.kind == "input":
            k = node.attrs[0]
            if k == 0:
                remap[i] = b.view(h, node.dims)
            else:
                remap[i] = b.input(k, node.dims)
            continue
        if node.kind == "param":
            src = sub.sources[node.attrs[0]]
            if isinstance(src, str):  # a tensor the function closes over (fx made it an attr)
                src = _resolve(traced.root, src).detach()
            remap[i] = b.param(src, node.dims)
            continue
        if node.kind == "gemm":
            raise TailError(f"{traced.name}: a tail function may not contain another Linear")
        args = tuple(remap[a] for a in node.args)
        from cupyfuse.ir.program import Node

        attrs = node.attrs
        if node.kind == "bn" and node.attrs[2]:
            raise TailError(f"{traced.name}: BatchNorm updating running stats inside a tail function")
        remap[i] = b.add(Node(node.kind, node.op, args, attrs, node.dims))
    if sub.outs_type is not None:
        raise TailError(f"{traced.name}: a tail function returns one tensor (it returns "
                        f"{len(sub.more_outs) + 1}); fuse a module that returns several with "
                        "cupyfuse.from_model")
    b.p.out = remap[sub.out]
    b.p.squeezes_batch = sub.squeezes_batch
    b.p.one_row_error = sub.one_row_error
    b.p.lead, b.p.lead_out = sub.lead, sub.lead_out
    prog = rewrite.rewrite(b.p.own_results())
    _fn_traces[key] = prog
    return prog


# ---------------------------------------------------------------------------------
# modules
def _resolve(module: nn.Module, path: str) -> Any:
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


_SCALARS = (bool, int, float, str, type(None))
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType,
              types.BuiltinMethodType, functools.partial)


def _hooks_error(module: nn.Module, root_called: bool,
                 traced: Callable[[], "tracing.Traced | None"] | None = None
                 ) -> TailError | None:
    """A forward hook or pre-hook that the eager model would run and the fused call would
    not (on a submodule, or on the model itself where torch does not call it: from_model's
    wrapped model; global hooks): refused, naming where. ``torch.nn.utils.prune`` and
    the old ``weight_norm`` work through pre-hooks (their parametrize forms need none).
    ``traced``: gives the forward's trace (or None), for the line that calls the hooked
    module."""
    if _tmod._global_forward_hooks or _tmod._global_forward_pre_hooks:
        return TailError(f"{type(module).__name__}: a global forward hook is registered "
                         "(nn.modules.module.register_module_forward_hook / _pre_hook); the "
                         "fused forward would not run it for each submodule as eager does: "
                         "remove it, or call the eager model")
    for name, m in module.named_modules():
        if "forward" in m.__dict__:
            what = f"submodule `{name}`" if name else "the model"
            return TailError(
                f"{type(module).__name__}: {what} ({type(m).__name__}) has a `forward` set on "
                "the instance, which torch calls and cupyfuse would not (it fuses the class's "
                "forward): set it on a subclass, or call the eager model")
        if (m._forward_hooks or m._forward_pre_hooks) and (name or not root_called):
            what = f"submodule `{name}`" if name else "the model"
            return TailError(
                f"{type(module).__name__}: {what} ({type(m).__name__}) has a forward hook or "
                "pre-hook, which the fused forward would not run (torch.nn.utils.prune and "
                "the old nn.utils.weight_norm work through one: use prune.remove or "
                "nn.utils.parametrizations.weight_norm, or remove the hook)"
                + _call_line(traced() if traced is not None else None, name))
    return None


def _call_line(traced: "tracing.Traced | None", name: str) -> str:
    """``\n  at FILE:LINE in forward: code`` of the forward's first call of submodule
    ``name`` (of a module inside it, where fx traces through it), or of the forward's
    ``def`` for the model itself; "" where none is found."""
    if traced is None:
        return ""
    import inspect

    if not name:
        line = tracing._def_line(traced.forward)
        return f"\n  at {line}" if line else ""
    try:
        own = inspect.getsourcefile(traced.forward)
    except (TypeError, AttributeError):
        own = None
    for n in traced.graph.nodes:
        if n.op == "call_module" and (n.target == name or str(n.target).startswith(name + ".")):
            w = tracing.where(n, own)
            if w:
                return f"\n  at {w}"
    return ""


def _embedding_error(runner: "_Runner", args: tuple) -> TailError | None:
    """An integer x (token ids) that the forward looks up in an embedding (nn.Embedding,
    nn.EmbeddingBag, F.embedding): refused naming the lookup and its line (any other
    integer x is a TypeError: a Linear of it raises in torch)."""
    traced = _trace_of(runner, args)
    if traced is None:
        return None
    x = next((n for n in traced.graph.nodes if n.op == "placeholder"), None)
    root = traced.root
    for u in (x.users if x is not None else ()):
        emb = u.op == "call_function" and u.target in (torch.nn.functional.embedding,
                                                      torch.nn.functional.embedding_bag)
        if u.op == "call_module" and root is not None:
            try:
                emb = isinstance(root.get_submodule(u.target), (nn.Embedding, nn.EmbeddingBag))
            except AttributeError:
                emb = False
        if emb:
            try:
                own = __import__("inspect").getsourcefile(traced.forward)
            except (TypeError, AttributeError):
                own = None
            line = tracing.where(u, own)
            what = f"{u.target} ({type(root.get_submodule(u.target)).__name__})" \
                if u.op == "call_module" else u.target.__name__
            return TailError(f"{traced.name}: cannot fuse `{what}`: token ids (the integer input "
                             "x) looked up in an embedding: not fused (cupyfuse fuses Linear + "
                             "tail models); run the embedding outside and pass its output"
                             + (f"\n  at {line}" if line else ""))
    return None


def _trace_of(runner: "_Runner", args: tuple) -> "tracing.Traced | None":
    """The trace of the module's forward for a call with these arguments (its None / bool
    ones specialised), for a refusal's line: the one made already, else one made now (None
    where tracing fails)."""
    left = runner.left_at(args)
    if left in runner.traces:
        return runner.traces[left]
    try:
        return runner.trace_fn(runner.concrete(left))
    except Exception:   # noqa: BLE001 - the refusal goes out without a line then
        return None


def _structure_parts(mods: Sequence[nn.Module], root_called: bool) -> tuple[list, list, list]:
    """What :func:`_structure` reads of the watched modules, gathered once: their hook
    dicts (the root's left out where torch calls it), the live views of their
    children, parameters and buffers, and their attribute dicts (whose sizes tell an
    attribute added since: a ``forward`` set on an instance)."""
    hooks = [h for i, m in enumerate(mods) if i or not root_called
             for h in (m._forward_hooks, m._forward_pre_hooks)]
    views = [v for m in mods for v in (m._modules.values(), m._parameters.values(),
                                       m._buffers.values())]
    # (the root's own dict is read from the module each call: the runner holds none of
    # the root, see _Runner.remember)
    return hooks, views, [m.__dict__ for m in mods[1:]]


def _structure(parts: tuple[list, list, list], root: dict) -> tuple | None:
    """The identities of the watched modules' children, parameters and buffers (None
    slots included) and the sizes of their attribute dicts (``root``: the root module's
    ``__dict__``; the others' in ``parts``), for the prepared launches' key: a submodule
    swapped, a bias added, a parameter replaced or an attribute added (an instance
    ``forward``) misses it (the general path retraces or refuses). None where a forward
    hook is registered (the general path refuses). ~1 us for a small model."""
    if _tmod._global_forward_hooks or _tmod._global_forward_pre_hooks or any(parts[0]):
        return None
    return (tuple(map(id, itertools.chain.from_iterable(parts[1]))) + (len(root),)
            + tuple(map(len, parts[2])))


def _watched(v: Any) -> bool:
    """Whether a module attribute is a value fx bakes into a trace that the mode key and
    the prepared launches' snapshot follow by value (numbers, strings, None) or by
    identity (functions: ``self.act = torch.tanh`` rebound to torch.sigmoid)."""
    return isinstance(v, _SCALARS) or isinstance(v, _FUNCTIONS) or (
        type(v) is tuple and len(v) <= 8 and all(isinstance(x, _SCALARS) for x in v))


def _mode_key(module: nn.Module) -> tuple:
    """What the traced program depends on besides tensors: every submodule's type, its
    train/eval flag, which of its parameter and buffer slots are None (a Linear's bias
    added later) and its plain Python attributes (a scale factor, an eps, a pool size...,
    functions by identity), so that changing ``model.scale = 3.0`` or swapping
    ``model.act = nn.SiLU()`` after a call retraces instead of using the old program."""
    key = []
    for m in module.modules():
        # (values by type and repr: 0.0 and -0.0, 1 and 1.0 make different programs)
        attrs = tuple(sorted((k, tracing._value_key(v)) for k, v in m.__dict__.items()
                             if _watched(v) and not k.startswith("_")))
        d = m.__dict__
        # the parameters' and buffers' names and shapes (None slots included: a bias added,
        # a buffer registered, a (6,) buffer rebound as (6, 1) make another program)
        slots = tuple((k, None if v is None else tuple(v.shape))
                      for k, v in itertools.chain(d["_parameters"].items(),
                                                  d["_buffers"].items()))
        key.append((type(m), type(m).forward, tuple(d["_modules"]), m.training, attrs, slots))
    # and the module-level values its forwards read, and containers and plain objects
    # among its attributes (fx bakes them in too)
    key.append(tracing.global_values(tracing.global_reads(module)
                                     + tracing.attribute_reads(module)))
    return tuple(key)


#: the argument types a prepared launch's key holds (tensors by shape and strides, the
#: others by value)
_KEYED_ARGS = (bool, int, float, torch.Tensor)


class _Default:
    """A forward argument a keyword call leaves at its None or bool default before an
    argument it passes (``fm(x, y=t)`` of ``forward(self, x, flag=False, y=None)``)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _forward_params(forward: Any) -> list[tuple[str, Any]]:
    """(name, default) of a forward's arguments after self, in order, up to any *args or
    **kwargs (fx's placeholders, one per argument); the default is ``_NO_DEFAULT`` where
    there is none."""
    import inspect

    out = []
    for i, p in enumerate(inspect.signature(forward).parameters.values()):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            break
        if i:
            out.append((p.name, _NO_DEFAULT if p.default is p.empty else p.default))
    return out


_NO_DEFAULT = object()


class _Runner:
    """Per-module state: how to trace it, and its programs per (mode, input shapes).

    ``trace_fn(concrete)`` traces the forward specialised on ``concrete`` (argument name ->
    the None or bool a call leaves it at: torch.fx's concrete_args, so that a forward's
    ``if y is not None:`` or ``if flag:`` follows the call); ``forward`` is the function
    traced, whose signature says which arguments a call leaves at such a default."""

    def __init__(self, trace_fn: Callable[..., tracing.Traced], eager: bool = True,
                 mode: tuple | None = None, forward: Any = None) -> None:
        self.trace_fn = trace_fn
        self.forward = forward
        self._params: list[tuple[str, Any]] | None = None
        # the traces per specialisation (a tuple of (argument, value)), all of one mode
        self.traces: dict[tuple, tracing.Traced] = {}
        if eager:
            # the trace of a call with x alone (the None/bool defaults specialised); where
            # that fails (a forward that needs an argument it leaves at None), the general
            # one: only such calls raise then, at their first call
            left = self.left_at((None,))
            try:
                self.traces[left] = trace_fn(self.concrete(left))
            except TailError:
                if not left:
                    raise
                first = sys.exc_info()[1]
                try:
                    self.traces[()] = trace_fn({})
                except TailError:
                    raise first from None
            tracing.check_has_linear(next(iter(self.traces.values())))
        # the module's _mode_key when it was traced: a new program for the same mode
        # (other input shapes) reuses the trace
        self.traced_mode = mode if eager else None
        self.programs: dict[tuple, Program] = {}
        # prepared launches: (input shapes/strides, device, mode snapshot) -> entry
        self.fast: dict[tuple, Any] = {}
        # fast key -> (snapshot index, index in a module's tuple or -1, negative)
        self.zero_signs: dict[tuple, tuple] = {}
        self.watch: list[tuple[nn.Module, tuple[str, ...]]] = []
        # the outside values the module's trace read (tracing.global_reads and
        # attribute_reads; set by remember)
        self._globals: tuple = ()
        self._snap: list[tuple[dict, Callable[[dict], Any]]] = []
        # torch's __call__ runs the root module's own hooks (fused_class instances): only
        # its submodules' are refused (from_model's wrapped model: its own too)
        self.root_called = False
        self._parts: tuple[list, list, list] = ([], [], [])
        # the specialised call of the last entry hit twice in a row (fastpath.py), the
        # entry's key and ready plan it was built for, and the last entry hit
        self._spec: Callable[..., Any] | None = None
        # a FusedModel's runner: a weak reference to the FusedModel (the specialised call
        # checks its __call__'s conditions; a fused_class runner's module is its own)
        self.outer: Any = None
        self._spec_key: tuple | None = None
        self._spec_launches: Any = None
        self._hit_key: tuple | None = None

    def snapshot(self, module: nn.Module) -> tuple | None:
        """The cheap form of _mode_key of ``module`` (the root of the watch lists): the
        values of the scalar attributes (the train flag among them) of each submodule,
        then the keys of the outside values the trace read (``_globals``); None when an
        attribute is gone."""
        root = module.__dict__
        try:
            snap = tuple([get(root if d is None else d) for d, get in self._snap])
        except KeyError:
            return None
        st = _structure(self._parts, root)
        if st is None:
            return None
        snap += (st,)
        if self._globals:
            return snap + tracing.global_values(self._globals)
        return snap

    def fast_call(self, module: nn.Module, args: tuple, precision: str | None = None) -> Any:
        """The forward through a prepared launch; None when none applies. (The module's
        ``__call__`` tries the specialised call, ``self._spec``, before this.)"""
        fast = self.fast
        if not fast:
            return None
        shapes = []
        tens = []
        for a in args:
            if type(a) is torch.Tensor:
                if a.dtype is not _F32 or not a.is_cuda:
                    return None
                shapes.append((a.shape, a.stride()))
                tens.append(a)
            elif a is None or type(a) is bool:
                shapes.append(a)   # (the trace is specialised on it: part of the key)
            elif type(a) is float or type(a) is int:
                # a constant of the program: its value in the key, by type and repr
                # (1 and 1.0, 0.0 and -0.0 apart; a NaN never finds its entry)
                shapes.append((type(a), repr(a)))
            else:
                return None
        if not tens or tens[0] is not args[0]:
            return None
        dev = args[0].get_device()
        snap = self.snapshot(module)
        if snap is None:
            return None
        key = (tuple(shapes), dev, snap, gemm.dispatch_key())
        ent = fast.get(key)
        if ent is None:
            return None
        zs = self.zero_signs.get(key) if self.zero_signs else None
        if zs is not None:   # a float attribute that was a zero: the same sign of zero
            for i, j, neg in zs:
                v = snap[i] if j < 0 else snap[i][j]
                if (math.copysign(1.0, v) < 0) != neg:
                    return None
        pr, paths = ent
        srcs: list[Any] = []
        sptrs: list[int] = []
        for get, meta in paths:
            t = get(module)
            if meta is not None:   # (shape, strides, dtype) when prepared
                if not isinstance(t, torch.Tensor) or t.dtype is not meta[2] or \
                        t.get_device() != dev or t.shape != meta[0] or t.stride() != meta[1]:
                    return None
                sptrs.append(t.data_ptr())
            else:
                sptrs.append(0)
            srcs.append(t)
        stream = _stream_for(dev, False)
        if stream is None:
            return None
        hit = pr([a.data_ptr() for a in tens], sptrs, stream, False, srcs, precision)
        if hit is not None and config.FASTPATH:
            self._specialise(module, args, key, ent, dev, stream, precision)
        return hit

    def _specialise(self, module: nn.Module, args: tuple, key: tuple, ent: tuple, dev: int,
                    stream: int, precision: str | None) -> None:
        """After a hit of entry ``key``: the second hit in a row of the same entry on a
        ready plan builds its specialised call (fastpath.py), once per ready plan (one
        that declines or stops matching -- another thread, say -- is not rebuilt until
        the plan is)."""
        if key != self._hit_key:
            self._hit_key = key
            return
        rd = ent[0]._ready.get((stream, False))
        if rd is None or (key == self._spec_key and rd[4] is self._spec_launches):
            return
        outer = module if self.root_called else (self.outer() if self.outer else None)
        if outer is None:
            return
        self._spec_key, self._spec_launches = key, rd[4]
        self._spec = _fastpath.build(self, outer, module, args, ent, dev, stream, precision,
                                     _structure)

    def remember(self, module: nn.Module, prog: Program, args: tuple,
                 tens: Sequence[torch.Tensor], srcs: Sequence[Any]) -> None:
        """After a general-path GPU call: prepare the launches for the next call like it
        (tensor inputs used as they are, and None/bool arguments: see fast_call)."""
        targs = [a for a in args if type(a) is torch.Tensor]
        if len(targs) != len(tens) or any(a is not None and type(a) not in _KEYED_ARGS
                                          for a in args) \
                or any(a.data_ptr() != t.data_ptr() for a, t in zip(targs, tens)):
            return
        if _prep.usable(prog) is None:
            return   # (before the watch lists below: ~100 us a call of a large module)
        # (again each time: a submodule swapped since brings its own attributes). The
        # root is the module each call passes (None in the lists): a fused_class instance
        # holds its runner, and a runner holding the instance or its __dict__ would make
        # a cycle that only Python's cyclic collector frees, with the GPU memory of every
        # parameter (the submodules hold no runner: held as they are)
        mods = list(module.modules())
        self.watch = [(None if i == 0 else m,
                       tuple(sorted(k for k, v in m.__dict__.items()
                                    if _watched(v) and not k.startswith("_"))))
                      for i, m in enumerate(mods)]
        # (each module's attribute dict, read through the same dict object every call)
        self._snap = [(None if m is None else m.__dict__,
                       operator.itemgetter(*names) if names else _nothing)
                      for m, names in self.watch]
        self._parts = _structure_parts(mods, self.root_called)
        # (again each time: a plain object attribute rebound brings other attributes)
        self._globals = tracing.global_reads(module) + tracing.attribute_reads(module)
        dev = tens[0].get_device()
        snap = self.snapshot(module)
        if snap is None:
            return
        key = (tuple([(a.shape, a.stride()) if type(a) is torch.Tensor else
                      (type(a), repr(a)) if type(a) is float or type(a) is int else a
                      for a in args]),
               dev, snap, gemm.dispatch_key())
        if key in self.fast:
            return
        if len(self.fast) >= 16:
            oldest = next(iter(self.fast))
            del self.fast[oldest]
            self.zero_signs.pop(oldest, None)
        in_meta = [(tuple(t.shape), tuple(t.stride())) for t in tens]
        pr = _try_prepare(prog, tens[0].shape[0], dev, in_meta, srcs, allow_bn=True)
        if pr is None:
            self.fast[key] = None
            return
        # dtype too: float32 parameters, and BatchNorm's int64 num_batches_tracked (was:
        # float32 required of every source, so a training BatchNorm never hit its launches)
        paths = [(_getter(module, s),
                  _src_meta(t) + (t.dtype,) if isinstance(t, torch.Tensor) else None)
                 for s, t in zip(prog.sources, srcs)]
        self.fast[key] = (pr, paths)
        # the snapshot's values compare by ==: 0.0 and -0.0 find the same entry, so the
        # sign of a float zero is checked apart (rare; 1 and 1.0 are not told apart here)
        zs = tuple((i, j, math.copysign(1.0, v) < 0) for i, part in enumerate(snap)
                   for j, v in (enumerate(part) if type(part) is tuple else [(-1, part)])
                   if type(v) is float and v == 0.0)
        if zs:
            self.zero_signs[key] = zs

    def left_at(self, args: Sequence[Any]) -> tuple[tuple[int, Any], ...]:
        """(argument, value) of the forward's arguments a call with these inputs leaves at
        None or a bool, or passes as a bool: a None or a bool passed (a NumPy bool as the
        Python bool), a keyword call's ``_Default`` and the None/bool defaults after the
        last input (the trace is specialised on each: one trace and program per
        pattern, e.g. ``forward(x, return_probs=False)`` called both ways)."""
        if self._params is None:
            self._params = _forward_params(self.forward) if self.forward is not None else []
        out = [(i, a if a is None or type(a) is bool else
                bool(a) if isinstance(a, np.bool_) else a.value)
               for i, a in enumerate(args)
               if i and (a is None or type(a) in (bool, _Default) or isinstance(a, np.bool_))]
        out += [(i, d) for i, (_, d) in enumerate(self._params)
                if i >= len(args) and (d is None or type(d) is bool)]
        return tuple(out)

    def concrete(self, left: tuple[tuple[int, Any], ...]) -> dict[str, Any]:
        """``left`` by argument name: the trace's concrete_args."""
        params = self._params or []
        return {params[i][0]: v for i, v in left if i < len(params)}

    def program(self, module: nn.Module, inputs: Sequence[torch.Tensor],
                bools: tuple[int, ...] = (), numbers: tuple[tuple[int, Any], ...] = (),
                left: tuple[tuple[int, Any], ...] = (), ints: tuple[int, ...] = ()) -> Program:
        """The program for inputs of these shapes (``bools``: the inputs that are bool
        masks, passed as 0.0 / 1.0; ``ints``: the integer ones, passed as float32;
        ``numbers``: (argument, value) of the Python numbers passed, constants of the
        program: one program per value; ``left``: (argument, value) of the arguments left
        at None or a bool, see ``left_at``)."""
        mode = _mode_key(module)
        # (numbers by type and repr: 1 and 1.0, or 0.0 and -0.0, get programs of their
        # own; a NaN finds its program again)
        key = (mode, tuple(tuple(t.shape[1:]) for t in inputs), bools,
               tuple([(i, tracing._value_key(v)) for i, v in numbers]), left, ints,
               registry.generation())   # (an op added to or removed from the table)
        p = self.programs.get(key)
        if p is None:
            if len(self.programs) >= _MAX_PROGRAMS:   # a number that changes every call
                self.programs.pop(next(iter(self.programs)))
            if any(t.dim() == 0 for t in inputs):
                raise TailError(f"{type(module).__name__}: inputs must have a batch dimension")
            if self.traced_mode != mode:
                # the flags and plain attributes changed since the trace (fx bakes Python
                # scalars into the graph; the mode decides dropout/BatchNorm): retrace
                self.traces.clear()
                self.traced_mode = mode
            traced = self.traces.get(left)
            if traced is None:
                traced = self.traces[left] = self.trace_fn(self.concrete(left))
            p = translation.translate(traced, module, [tuple(t.shape) for t in inputs],
                                  bool_inputs=bools, numbers=numbers, specialized=left,
                                  int_inputs=ints)
            p = rewrite.rewrite(p.own_results())
            self.programs[key] = p
        return p


#: programs kept per fused module (oldest dropped first): a number passed to the forward
#: makes one per value
_MAX_PROGRAMS = 64


def _numbers(args: Sequence[Any]) -> tuple[tuple[int, int | float], ...]:
    """(argument, value) of the Python numbers (not bools) among inputs after x: each is a
    constant of the program (translated, and on the GPU compiled, per value). A NumPy
    scalar (np.float32(2.0), np.int64(3)) counts as the Python number of its value, as
    torch reads it (its own arithmetic in the forward then runs in Python's: a NumPy
    integer divided by zero or overflowing is refused where NumPy gives inf or wraps)."""
    return tuple([(i, int(a) if isinstance(a, (int, np.integer)) else float(a))
                  for i, a in enumerate(args) if i and isinstance(a, _NUMBER_TYPES)
                  and not isinstance(a, bool)])


#: what a forward input may be as a number (np.float64 is a float already; np.bool_ is
#: neither: a bool input is refused)
_NUMBER_TYPES = (int, float, np.integer, np.floating)


def _zero_d_array(a: Any, what: str, op: str) -> None:
    """Refuse a 0-d NumPy array input clearly (torch reads one as a 0-d tensor; cupyfuse's
    inputs have a batch dimension)."""
    if isinstance(a, np.ndarray) and a.ndim == 0:
        raise TypeError(f"{op}: {what} is a 0-d NumPy array ({describe(a)}), which cupyfuse "
                        "does not take: pass a Python number (`float(a)` or `a.item()`: a "
                        "constant of the program) or a tensor with a batch dimension")


#: torch's global module hooks (dicts torch fills and empties in place, never rebinds)
_GLOBAL_HOOKS = (_tmod._global_forward_hooks, _tmod._global_forward_pre_hooks,
                 _tmod._global_backward_hooks, _tmod._global_backward_pre_hooks)
_tracing_state = torch._C._get_tracing_state
#: torch's own _call_impl (Module.__call__ calls ``self._call_impl``: a class or instance
#: that replaces it is called through torch's __call__)
_TORCH_CALL_IMPL = nn.Module._call_impl


def _direct_call(m: nn.Module) -> bool:
    """Whether torch's ``Module.__call__`` would call ``m.forward`` straight away: no
    forward or backward hooks of ``m`` or global ones, no ``m.compile()``, no JIT trace, no
    ``forward`` set on the instance, torch's own ``_call_impl`` (not one of the class or
    the instance). Then a fused module's ``__call__`` runs its prepared launch itself
    (torch's two call frames and its forward's cost ~1.5 us a call)."""
    d = m.__dict__
    g = _GLOBAL_HOOKS
    return not (d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"]
                or d["_backward_pre_hooks"] or g[0] or g[1] or g[2] or g[3]
                or d.get("_compiled_call_impl") is not None or "forward" in d
                or "_call_impl" in d or type(m)._call_impl is not _TORCH_CALL_IMPL
                or _tracing_state())


def _run_module(module: nn.Module, runner: _Runner, args: tuple, precision: str | None) -> Any:
    hit = runner.fast_call(module, args, precision)
    if hit is not None:
        return hit
    err = _hooks_error(module, runner.root_called, lambda: _trace_of(runner, args))
    if err is not None:
        raise err
    name = type(module).__name__
    if not args:
        raise TypeError(f"{name}: forward needs at least one input")
    if any(isinstance(a, torch.fx.Proxy) for a in args):
        raise TailError(f"{name}: torch.fx traces through the fused forward, which runs "
                        "CUDA kernels, not torch ops: trace the original model, or make the "
                        "tracer keep this module a leaf (Tracer.is_leaf_module)")
    tens = []
    pos: list[int] = []   # the argument of each tensor in tens
    bools: list[int] = []
    ints: list[int] = []
    numbers = _numbers(args)
    left = runner.left_at(args)
    skip = dict(numbers + left)
    kind0 = None
    for i, a in enumerate(args):
        if i in skip:
            continue
        if i:
            _zero_d_array(a, f"input {i}", name)
        pos.append(i)
        t, kind = _as_torch(a, "x" if i == 0 else f"input {i}")
        if kind0 is None:
            kind0 = kind
        if t.dtype == torch.bool and i > 0:
            # a mask input: read as 0.0 / 1.0, where torch reads a bool (masked_fill,
            # where, arithmetic with a float tensor); a copy per call, never prepared
            bools.append(i)
            t = t.float()
        elif t.dtype in (torch.int64, torch.int32) and i > 0:
            # an integer input (an attention mask, labels): read as float32 where its uses
            # are exact whatever its values (translation._RawInt); a copy per call, never prepared
            ints.append(i)
            t = t.float()
        elif t.dtype != torch.float32:
            if i == 0 and not t.is_floating_point() and t.dtype != torch.bool:
                err = _embedding_error(runner, args)
                if err is not None:
                    raise err
            raise TypeError(f"{name}: input {i} must be float32"
                            + (" (or bool, after x)" if i > 0 else "") + f", got {describe(a)}")
        tens.append(t.detach())
    dev = tens[0].device
    for i, t in zip(pos[1:], tens[1:]):
        if t.device != dev:
            raise ValueError(f"{name}: input {i} must be on {dev} like x, got {describe(args[i])}")
    if tens[0].dim() < 1:
        raise ValueError(f"{name}: x must have a batch dimension, got {describe(args[0])}")
    prog = runner.program(module, tens, tuple(bools), numbers, left, tuple(ints))
    tens = prog.flat_rows(tens)   # inputs the forward flattens whole: (batch, P) rows
    prog.check_lead_batches([t.shape for t in tens], name, [f"input {i}" for i in pos])
    if not prog.lead:
        tens = _broadcast_rows(tens, prog, name)
    b0 = tens[0].shape[0]   # the batch itself (rows differ with leading dims)
    if prog.lead:   # (batch, seq, features) inputs: batch * seq rows (a view where it can),
        tens = _lead_rows(tens)
    srcs = []
    for s in prog.sources:
        # (a derived weight: the same tensor object while the tensors it reads are unchanged)
        t = _resolve(module, s) if isinstance(s, str) else \
            s.value(module) if isinstance(s, Derived) else s
        if isinstance(t, torch.Tensor):
            what = s if isinstance(s, (str, Derived)) else "a tensor"
            if t.is_floating_point() and t.dtype != torch.float32:
                raise TypeError(f"{name}: {what} must be float32, got {describe(t)}")
            if t.device != dev:
                raise ValueError(f"{name}: {what} must be on {dev} like x, got {describe(t)}")
        srcs.append(t)
    owners = list(srcs)
    if torch.is_grad_enabled() and (
            any(getattr(a, "requires_grad", False) for a in args) or
            any(isinstance(t, torch.Tensor) and t.requires_grad for t in owners) or
            any(isinstance(s, Derived) and s.requires_grad(module) for s in prog.sources)):
        warn_forward_only(f"{name} (fused by cupyfuse)")
    srcs = [t.detach() if isinstance(t, torch.Tensor) else t for t in srcs]
    call = Call(op=name, kind=kind0, device=dev, x=tens[0])
    if tens[0].shape[0] == 0:
        for n in prog.nodes:
            if n.kind == "bn":
                count_batch(n, srcs)
        prog.check_rows(0)
        if prog.outs_type is not None:
            return _results(call, empty_batch(prog, dev, b0 if prog.lead else None))
        return call.result(empty_batch(prog, dev, b0))
    if dev.type == "cpu":
        with torch.no_grad():
            return _results(call, run_cpu(prog, tens, srcs, owners=owners))
    # prepare the launches, and run this very call through them too (the first call
    # computes exactly what the next ones will); Python numbers passed are constants of
    # the program and in the prepared key by value (NumPy scalars: the general path)
    runner.remember(module, prog, args, tens, srcs)
    hit = runner.fast_call(module, args, precision)
    if hit is not None:
        return hit
    with call, torch.no_grad():
        return _results(call, run_gpu(prog, tens, srcs, precision, owners=owners))


def _results(call: Any, r: Any) -> Any:
    """A program's result (one tensor, or a forward's tuple/list/dict of them) in the
    caller's own type."""
    if isinstance(r, dict):
        return type(r)((k, call.result(t)) for k, t in r.items())
    if isinstance(r, (tuple, list)):
        return type(r)(call.result(t) for t in r)
    return call.result(r)


def _bound_inputs(bound: Any, name: str) -> tuple:
    """A keyword call's inputs in the forward's parameter order, as a positional call
    would pass them: defaults filled in only before the last argument passed (those after
    it are left to the trace, like a positional call's); a None or bool default before it
    goes in as a ``_Default`` (the trace is specialised on it, see ``_Runner.left_at``)."""
    import inspect

    params = list(bound.signature.parameters)
    last = max(params.index(p) for p in bound.arguments)
    passed = set(bound.arguments)
    bound.apply_defaults()
    out = []
    for p in params[:last + 1]:
        if p not in bound.arguments:
            continue
        d = bound.arguments[p]
        kind = bound.signature.parameters[p].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:   # *rest: as a positional call passes
            out.extend(d)
            continue
        if kind is inspect.Parameter.VAR_KEYWORD:
            if d:
                raise TailError(f"{name}: the call passes {', '.join(map(repr, d))} through "
                                f"the forward's `**{p}`: cupyfuse passes a forward's named "
                                "arguments (name them in the forward)")
            continue
        out.append(_Default(d) if p not in passed and (d is None or isinstance(d, bool)) else d)
    return tuple(out)


class FusedModel(nn.Module):
    """A fused copy of a Linear + tail model (made by :func:`from_model`).

    Holds the original module as ``.model`` (same parameters and buffers: its
    state_dict keys are the original's, prefixed ``model.``); ``forward`` runs the fused
    program. ``precision`` picks the GEMM precision (None follows torch's setting).
    """

    def __init__(self, model: nn.Module, precision: str | None = None) -> None:
        super().__init__()
        self.model = model
        self.precision = precision
        self._runner = _Runner(lambda c: tracing.trace(model, concrete=c),
                               mode=_mode_key(model), forward=type(model).forward)
        self._runner.outer = weakref.ref(self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self._modules["model"]
        if kwargs:  # keyword inputs, in the model forward's parameter order
            import inspect

            bound = inspect.signature(model.forward).bind(*args, **kwargs)
            args = _bound_inputs(bound, type(model).__name__)
        return _run_module(model, self._runner, args, self.precision)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # a repeated call torch would hand straight to forward: its specialised call (which
        # checks that itself), else its prepared launch, here
        if not kwargs:
            runner = self._runner
            spec = runner._spec
            if spec is not None:
                hit = spec(self, args)
                if hit is not None:
                    return hit
            if type(self).forward is FusedModel.forward and _direct_call(self):
                hit = runner.fast_call(self._modules["model"], args, self.precision)
                if hit is not None:
                    return hit
        return nn.Module.__call__(self, *args, **kwargs)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_runner", None)  # holds a traced graph and a closure: rebuilt on load
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        model = self.model
        self._runner = _Runner(lambda c: tracing.trace(model, concrete=c),
                               mode=_mode_key(model), forward=type(model).forward)
        self._runner.outer = weakref.ref(self)

    def program(self, *example_inputs: Any) -> Program:
        """The tail program for inputs like these (for inspection)."""
        numbers = _numbers(example_inputs)
        left = self._runner.left_at(example_inputs)
        skip = dict(numbers + left)
        kinds = [(i, getattr(a, "dtype", None)) for i, a in enumerate(example_inputs)
                 if i and i not in skip]
        return self._runner.program(self.model, [a for i, a in enumerate(example_inputs)
                                                 if i not in skip],
                                    tuple(i for i, d in kinds if d == torch.bool), numbers, left,
                                    tuple(i for i, d in kinds if d in (torch.int64, torch.int32)))


def _wrapper_precision(fm: FusedModel) -> str | None:
    return fm.precision


# (what a specialised call of a FusedModel reads its precision with: fastpath.build)
FusedModel.forward._cupyfuse_precision_of = _wrapper_precision   # type: ignore[attr-defined]


def from_model(model: nn.Module, precision: str | None = None) -> FusedModel:
    """Fuse any module whose forward is Linear + tail (or a chain of such stages).

    The forward is traced now (a forward fx cannot trace, or one without a Linear, raises
    :class:`TailError` at once); it is mapped onto the vocabulary at the first call, when
    the input shapes are known: an op outside the vocabulary raises :class:`TailError`
    then, naming the op and its source line. A Python number passed to the forward after
    x (``fm(x, 0.5)``) is a constant of the program: each value gets a program of its own
    (translated, and on a GPU compiled, at its first call; prepared launches per value
    for a Python int or float, the general path for a NumPy scalar).
    """
    return FusedModel(model, precision)


_class_cache: dict[tuple, type] = {}
_trace_lock = threading.RLock()


def fused_class(cls: type, precision: str | None = None) -> type:
    """A drop-in subclass of ``cls`` whose forward is fused.

    Same ``__init__`` (so the same seed gives the same parameters), parameters,
    buffers, state_dict keys and train/eval behaviour; ``ModelNew = fused_class(Model)``
    is a complete KernelBench submission. The forward is traced at the first call.
    ``precision`` picks the GEMM precision (None follows torch's setting); an instance's
    ``cupyfuse_precision`` attribute, where set, overrides it.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"fused_class: expected an nn.Module subclass, got {cls!r}")
    key = (cls, precision)
    hit = _class_cache.get(key)  # type: ignore[arg-type]
    if hit is not None:
        return hit
    orig_forward = cls.forward
    import inspect

    sig = inspect.signature(orig_forward)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if kwargs:  # keyword inputs, in the original forward's parameter order
            bound = sig.bind(self, *args, **kwargs)
            args = _bound_inputs(bound, type(self).__name__)[1:]
        runner = self.__dict__.get("_cupyfuse_runner")
        if runner is None:
            runner = _Runner(_original_tracer(self, cls), eager=False, forward=orig_forward)
            runner.root_called = True
            self.__dict__["_cupyfuse_runner"] = runner
        return _run_module(self, runner, args, precision_of(self))

    def precision_of(self: nn.Module) -> str | None:
        # (a missing attribute through nn.Module.__getattr__ costs an exception per call)
        prec = self.__dict__.get("cupyfuse_precision", _MISSING)
        return getattr(type(self), "cupyfuse_precision", precision) if prec is _MISSING \
            else prec

    def __reduce_ex__(self: nn.Module, protocol: int) -> tuple:
        # the generated class is no attribute of cls's module: pickle the recipe instead
        # (a subclass defined in a module, like cupyfuse.kernelbench.modules's named classes, by name)
        state = {k: v for k, v in self.__dict__.items() if k != "_cupyfuse_runner"}
        if type(self) is not new:
            return (_blank_instance, (type(self),), state)
        return (_new_fused_instance, (cls, precision), state)

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # a repeated call torch would hand straight to forward: its specialised call (which
        # checks that itself), else its prepared launch, here
        if not kwargs:
            runner = self.__dict__.get("_cupyfuse_runner")
            if runner is not None:
                spec = runner._spec
                if spec is not None:
                    hit = spec(self, args)
                    if hit is not None:
                        return hit
                if type(self).forward is forward and _direct_call(self):
                    hit = runner.fast_call(self, args, precision_of(self))
                    if hit is not None:
                        return hit
        return nn.Module.__call__(self, *args, **kwargs)

    # (what a specialised call of an instance reads its precision with: fastpath.build)
    forward._cupyfuse_precision_of = precision_of   # type: ignore[attr-defined]

    # (a class with a __call__ of its own keeps it: the shortcut only stands in for torch's)
    extra = {"__call__": __call__} if cls.__call__ is nn.Module.__call__ else {}
    new = type(f"{cls.__name__}Fused", (cls,), {**extra, "forward": forward,
                                                "__module__": cls.__module__,
                                                "__reduce_ex__": __reduce_ex__,
                                                "_cupyfuse_base": cls,
                                                "__doc__": f"{cls.__name__} with a fused forward "
                                                           "(cupyfuse.fused_class)."})
    _class_cache[key] = new  # type: ignore[index]
    return new


def _trace_original(self: nn.Module, cls: type, concrete: dict | None = None
                    ) -> tracing.Traced:
    """Trace ``cls.forward`` (the original's) over a :func:`fused_class` instance
    (``concrete``: see :func:`tracing.trace`)."""
    # torch.fx traces type(root).forward: point it at the original for the trace
    with _trace_lock:
        new_cls = type(self)
        had = "forward" in new_cls.__dict__
        fused_forward = new_cls.__dict__.get("forward")
        new_cls.forward = cls.forward  # type: ignore[method-assign]
        try:
            return tracing.trace(self, cls.__name__, concrete)
        finally:
            if had:
                new_cls.forward = fused_forward  # type: ignore[method-assign]
            else:
                del new_cls.forward


def _original_tracer(self: nn.Module, cls: type) -> Callable[[dict | None], tracing.Traced]:
    """The trace function of a fused_class instance's runner: it holds the instance by a
    weak reference (the instance holds its runner: a strong one would make a cycle that
    only Python's cyclic collector frees, with the GPU memory of the parameters)."""
    ref = weakref.ref(self)

    def trace(concrete: dict | None) -> tracing.Traced:
        module = ref()
        if module is None:
            raise ReferenceError("cupyfuse: the fused module is gone")
        return _trace_original(module, cls, concrete)
    return trace


def _new_fused_instance(cls: type, precision: str | None) -> nn.Module:
    """Unpickling helper of :func:`fused_class` instances (state is set afterwards)."""
    new = fused_class(cls, precision)
    return new.__new__(new)


def _blank_instance(cls: type) -> nn.Module:
    """Unpickling helper of subclasses of :func:`fused_class` classes (state set after)."""
    return cls.__new__(cls)


def fused_copy(model: nn.Module, cls: type | None = None, precision: str | None = None
               ) -> nn.Module:
    """A copy of ``model`` (its own parameters and buffers, deep-copied) whose forward is
    fused: an instance of ``fused_class(type(model))``, or of ``cls`` (a subclass of
    ``fused_class(C)`` whose original ``C`` the caller has checked computes what
    ``model``'s forward does). Same state_dict keys, train/eval flags and attributes as
    ``model``. The forward is traced now: one fx cannot trace, or one without a Linear,
    raises :class:`TailError` here.
    """
    base = getattr(type(model), "_cupyfuse_base", None)
    target = cls if cls is not None else (type(model) if base is not None else
                                          fused_class(type(model)))
    orig = getattr(target, "_cupyfuse_base", None)
    if orig is None:
        raise TypeError(f"fused_copy: {target!r} is not a fused_class class")
    # the copy's runner (if any) is dropped by fused instances' __reduce_ex__
    new = copy.deepcopy(model)
    new.__dict__.pop("_cupyfuse_runner", None)
    new.__class__ = target
    if precision is not None:
        new.__dict__["cupyfuse_precision"] = precision
    runner = _Runner(_original_tracer(new, orig), eager=True, mode=_mode_key(new),
                     forward=orig.forward)
    runner.root_called = True
    new.__dict__["_cupyfuse_runner"] = runner
    return new
