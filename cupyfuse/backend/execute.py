"""The general path: a tail program run on CUDA tensors, level by level.

Each level runs its GEMMs on the GEMM engine (:mod:`cupyfuse.backend.gemm`: a plain
GEMM, the level's tail as the GEMM's epilogue, a GEMV rewrite, a folded GEMM, a
certified row maximum), its batch statistics, its sequence reductions, then its
generated tail kernel (:mod:`cupyfuse.backend.codegen`). Repeated small calls run the
same launches prepared once (:mod:`cupyfuse.backend.prepared`).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.fx

from cupyfuse import config
from cupyfuse.ir import certify, rewrite
from cupyfuse.backend import codegen, gemm
from cupyfuse.backend import prepared as _prep
from cupyfuse.interop import describe
from cupyfuse.backend.cpu import empty_batch, own_tensors
from cupyfuse.ir.program import Program, check_batchnorm, shape_of


# ---------------------------------------------------------------------------------
# compiled kernels (runtime.generated_kernel; plans cached in codegen.compile_program)
from cupyfuse.backend.codegen import compile_program  # noqa: E402
from cupyfuse.backend import certified


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
    """For certified.run: the (pointer, feature stride) launch values of param nodes."""
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
            certified.run(prog, chain, x, wf, h, _param_values(prog, sources), bias=bf,
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
                certified.run(prog, chain, a, w, h, _param_values(prog, sources),
                            red_out=_red_out(prog, chain, lv, reds, rows, dev),
                            owner=owner if isinstance(owner, torch.Tensor) else None)
                bufs[g] = h
                continue
            epi = lv.epi
            if epi is not None and epi.gemm == g and gemm.epilogue_ok(
                    a, w, precision, owner if isinstance(owner, torch.Tensor) else None):
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
            eps, momentum, srcs = n.attrs[:3]
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


def _run_cuda_tail(tail: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
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


