"""The GPU path of a program (execute.run_gpu) run on CPU tensors, its launches emulated.

For checking, on a machine without a GPU, what run_gpu and the plan (codegen.plan) do
around the kernels: the levels and their row counts, which values are materialised,
the buffers each launch gets (execute._values: addresses and strides) and how a kernel
addresses them. A generated level kernel is emulated node by node as its CUDA reads and
writes memory (codegen._Emitter: loaded buffers at ``row * width + f``, a per-batch
buffer read by a (batch, seq) kernel at row ``row / seq``, inputs and outputs through
their strides); tail_seqred.cu's seq_reduce as its loop does (the seq rows in order,
sums in double). Memory is read and written through the tensors' addresses (CPU
tensors: ``data_ptr`` is a host address), so a wrong address, stride or row count in
run_gpu shows. GEMMs run as torch.mm; GEMVs and folded GEMMs (tail_rewrite.cu) as
the rewrites' torch forms; BatchNorm's column statistics (tail_colstat.cu) as its two
kernels compute them (double sums, the running statistics updated). Pooling, group sums, split reductions and remaps are emulated
with the CPU path's torch ops; or each level runs its *generated kernel* itself,
compiled as C++ by tests/emu/cuda.py (``kernels``): then what run_gpu does around the
kernels and what the kernels do are both checked."""
from __future__ import annotations

import ctypes
from typing import Any, Sequence

import numpy as np
import torch

from cupyfuse.backend import execute
from cupyfuse import runner
from cupyfuse.backend import codegen, gemm, runtime
from cupyfuse.ir import rewrite
from cupyfuse.backend.cpu import _pool_cpu
from cupyfuse.ir.program import (Node, iota_values, remap_values, scan_values, sred_values,
                              wpool_values)
from cupyfuse.ops.registry import MAPS
from helpers import program_of


def _mem(ptr: int, n: int) -> np.ndarray:
    """``n`` float32 values at host address ``ptr`` (a view: writes go to the tensor)."""
    return np.ctypeslib.as_array((ctypes.c_float * max(n, 1)).from_address(ptr))


def _lmem(ptr: int, n: int) -> np.ndarray:
    """``n`` int64 values at host address ``ptr`` (an index result's buffer: argmax/argmin
    values are written as int64)."""
    return np.ctypeslib.as_array((ctypes.c_int64 * max(n, 1)).from_address(ptr))


def _seq_reduce(args: tuple) -> None:
    src, sb, sf, seq, width, batch, op, k, out = args
    if batch * width == 0:
        return
    _mem(out, batch * width)[:] = _seq_values(src, sb, sf, seq, width, batch, op, k)


def _seq_values(src: int, sb: int, sf: int, seq: int, width: int, batch: int, op: int,
                k: int) -> np.ndarray:
    """tail_seqred.cu's seq_reduce loop (and a level kernel's own, codegen._seq_loop):
    the (batch, width) values, float32."""
    last = (batch * seq - 1) * sb + (width - 1) * sf
    mem = _mem(src, last + 1)
    res = np.empty(batch * width, dtype=np.float32)
    for b in range(batch):
        for f in range(width):
            p = b * seq * sb + f * sf
            vals = [mem[p + s * sb] for s in range(seq)]
            if op == 0:
                acc = 0.0
                for v in vals:
                    acc += float(v)
                r = np.float32(acc)
            elif op in (1, 2):
                r = np.float32(np.inf if op == 2 else -np.inf)
                for v in vals:
                    if np.isnan(r) or np.isnan(v):
                        r = np.float32(np.nan)
                    else:
                        r = max(r, v) if op == 1 else min(r, v)
            else:
                r = vals[k]
            res[b * width + f] = r
    return res


def _dmem(ptr: int, n: int) -> np.ndarray:
    """``n`` float64 values at host address ``ptr``."""
    return np.ctypeslib.as_array((ctypes.c_double * max(n, 1)).from_address(ptr))


def _colstat_partial(args: tuple) -> None:
    """tail_colstat.cu's colstat_partial: per chunk of rows and column, the sums of
    ``z - shift`` and its square in double (shift: the column's first value where finite);
    the batch counted where a counter is given."""
    z, rows, cols, per, psum, psq, nbt = args
    if nbt:
        ctypes.c_longlong.from_address(nbt).value += 1
    zm = _mem(z, rows * cols).reshape(rows, cols).astype(np.float64)
    chunks = -(-rows // per)
    ps, pq = _dmem(psum, chunks * cols), _dmem(psq, chunks * cols)
    shift = np.where(np.isfinite(zm[0]), zm[0], 0.0)
    for c in range(chunks):
        d = zm[c * per:min(rows, (c + 1) * per)] - shift
        ps[c * cols:(c + 1) * cols] = d.sum(0)
        pq[c * cols:(c + 1) * cols] = (d * d).sum(0)


def _colstat_finalize(args: tuple) -> None:
    """tail_colstat.cu's colstat_finalize: mean and 1 / sqrt(var + eps) per column (double),
    the running statistics updated with the momentum (or 1 / num_batches_tracked)."""
    z, psum, psq, chunks, rows, cols, eps, momentum, mean, invstd, rm, rv, nbt = args
    s = _dmem(psum, chunks * cols).reshape(chunks, cols).sum(0)
    q = _dmem(psq, chunks * cols).reshape(chunks, cols).sum(0)
    z0 = _mem(z, cols).astype(np.float64)
    shift = np.where(np.isfinite(z0), z0, 0.0)
    with np.errstate(all="ignore"):
        dm = s / rows
        var = np.maximum(q / rows - dm * dm, 0.0)
        var = np.where(np.isnan(q) | np.isnan(s), s - s + q, var)
        m = shift + dm
        _dmem(mean, cols)[:] = m
        _dmem(invstd, cols)[:] = 1.0 / np.sqrt(var + np.float64(np.float32(eps)))
        if rm:
            f = 1.0 / ctypes.c_longlong.from_address(nbt).value if momentum < 0 else momentum
            unb = var * rows / (rows - 1.0) if rows > 1 else var
            rmv, rvv = _mem(rm, cols), _mem(rv, cols)
            rmv[:] = ((1.0 - f) * rmv.astype(np.float64) + f * m).astype(np.float32)
            rvv[:] = ((1.0 - f) * rvv.astype(np.float64) + f * unb).astype(np.float32)


def _level(pl: codegen.Plan, lv: codegen.Level, rows: int, vals: tuple) -> None:
    """Level ``lv``'s kernel on ``rows`` rows, its parameters' values ``vals``."""
    prog = pl.prog
    nodes = prog.nodes
    arg = {(kind, what): v for (kind, what), v in zip(lv.args, vals)}
    assert arg[("i64", "batch")] == rows
    r = torch.arange(rows)
    seq = pl.seq if not lv.per_batch else 0
    need = codegen._needed(prog, lv.targets, lv.index, pl.level_of, pl.materialized)
    v: dict[int, torch.Tensor] = {}

    def feat(i: int) -> torch.Tensor:   # (rows, width), or (rows, 1) for a row value
        t = v[i]
        return t if t.dim() == 2 else t.reshape(1, -1) if t.dim() == 1 else t.reshape(1, 1)

    for i in need:
        n = nodes[i]
        w = n.width
        has_f = n.feature_axis() is not None
        loaded = (pl.level_of[i] < lv.index and n.has_batch and i in pl.materialized
                  and n.kind not in ("input", "gemm", "gemv"))
        if n.kind == "bn":   # its operand's buffer, normalised with the statistics (double)
            src = n.args[0]
            rr = r // seq if seq and pl.per_batch[i] else r
            m = torch.from_numpy(_mem(arg[("buf", src)], (int(rr.max()) + 1) * w).copy())
            mean = torch.from_numpy(_dmem(arg[("bn_mean", i)], w).copy())
            inv = torch.from_numpy(_dmem(arg[("bn_invstd", i)], w).copy())
            v[i] = ((m.view(-1, w)[rr].double() - mean) * inv).float()
        elif n.kind == "seqred" and i in lv.seq_inline:   # the kernel's own seq loop
            src = nodes[n.args[0]]
            # (a kernel of the batch * seq rows: each row reads its batch element's value)
            nb = rows // seq if seq else rows
            out = torch.from_numpy(_seq_values(
                arg[("seq_src", i)], arg[("seq_sb", i)], arg[("seq_sf", i)], n.attrs[1],
                src.width, nb, execute._SEQ_OPS[n.op], n.attrs[2])).view(nb, src.width)
            out = out[r // seq] if seq else out
            v[i] = out if has_f else out[:, :1]
        elif loaded or n.kind == "seqred":
            rr = r // seq if seq and pl.per_batch[i] else r
            m = torch.from_numpy(_mem(arg[("buf", i)], (int(rr.max()) + 1) * w).copy())
            v[i] = m.view(-1, w)[rr] if has_f else m.view(-1, w)[rr, :1]
        elif n.kind == "input":
            sb, sf = arg[("in_sb", i)], arg[("in_sf", i)]
            f = torch.arange(w) if has_f else torch.zeros(1, dtype=torch.long)
            idx = r[:, None] * sb + f[None, :] * sf
            m = torch.from_numpy(_mem(arg[("input", i)], int(idx.max()) + 1).copy())
            v[i] = m[idx]
        elif n.kind in ("gemm", "gemv"):
            m = torch.from_numpy(_mem(arg[("gemm", i)], rows * w).copy())
            v[i] = m.view(rows, w)
        elif n.kind == "param":
            if has_f:
                sf = arg[("param_sf", i)]
                m = torch.from_numpy(_mem(arg[("param", i)], (w - 1) * sf + 1).copy())
                v[i] = m[torch.arange(w) * sf]
            else:
                v[i] = torch.from_numpy(_mem(arg[("param", i)], 1).copy()).reshape(())
        elif n.kind == "const":
            v[i] = torch.tensor(n.attrs[0], dtype=torch.float32)
        elif n.kind == "iota":
            v[i] = iota_values(n)
        elif n.kind == "map":
            ops = [v[a].reshape(1, -1) if v[a].dim() == 1 else v[a] for a in n.args]
            v[i] = MAPS[n.op].torch_fn(*ops, *n.attrs).float()
        elif n.kind == "view":
            v[i] = v[n.args[0]]
        elif n.kind == "rred":
            a = feat(n.args[0])
            if n.op == "sum":
                v[i] = a.double().sum(1, keepdim=True).float()
            elif n.op in ("argmax", "argmin"):   # (the position, a float32 number)
                v[i] = (torch.argmax if n.op == "argmax" else torch.argmin)(
                    a, 1, keepdim=True).float()
            else:
                v[i] = (torch.amax if n.op == "max" else torch.amin)(a, 1, keepdim=True)
        elif n.kind == "slice":
            v[i] = feat(n.args[0])[:, n.attrs[1]:n.attrs[1] + n.attrs[2]]
        elif n.kind == "cat":
            v[i] = torch.cat([feat(a).expand(rows, -1) if nodes[a].feature_axis() is not None
                              else feat(a).expand(rows, 1) for a in n.args], 1)
        elif n.kind in ("sred", "remap"):   # (along the features: axis 1 of feat's view)
            one = Node(n.kind, n.op, n.args, (1,) + n.attrs[1:], n.dims)
            v[i] = (sred_values if n.kind == "sred" else remap_values)(feat(n.args[0]), one)
        elif n.kind == "pool":
            v[i] = _pool_cpu(n.op, feat(n.args[0]), n.attrs[1], n.attrs[2])
        elif n.kind == "scan":   # (along the features: axis 1 of feat's view)
            one = Node(n.kind, n.op, n.args, (1,) + n.attrs[1:], n.dims)
            v[i] = scan_values(feat(n.args[0]).expand(rows, -1), one)
        elif n.kind == "wpool":
            a = feat(n.args[0])
            v[i] = wpool_values(a.expand(rows, -1), n)
        elif n.kind == "gred":
            a = feat(n.args[0]).double()
            g = n.attrs[1]
            v[i] = a.reshape(a.shape[0], -1, g).sum(-1, keepdim=True).expand(
                a.shape[0], a.shape[1] // g, g).reshape(a.shape).float()
        else:
            raise NotImplementedError(f"emulating a {n.kind} node")
    index = prog.index_values()   # (argmax/argmin targets: stored as int64)
    for t in lv.targets:
        n = nodes[t]
        val = feat(t).expand(rows, -1)
        sb = arg[("out_sb", t)]
        if n.feature_axis() is not None:
            sf = arg[("out_sf", t)]
            idx = r[:, None] * sb + torch.arange(n.width)[None, :] * sf
        else:
            idx = (r * sb)[:, None]
            val = val[:, :1]
        if t in index:
            out = _lmem(arg[("out", t)], int(idx.max()) + 1)
            out[idx.numpy()] = val.numpy().astype(np.int64)
            continue
        out = _mem(arg[("out", t)], int(idx.max()) + 1)
        out[idx.numpy()] = val.numpy()


def run_gpu_emulated(model: torch.nn.Module, args: Sequence[torch.Tensor],
                     monkeypatch: Any, kernels: dict[str, Any] | None = None) -> Any:
    """A from_model call's program on ``args`` through execute.run_gpu on CPU tensors, its
    launches emulated (the inputs as runner._run_module passes them: booleans as 0/1
    floats, integers as floats, (batch, seq, features) as batch * seq rows). ``kernels``:
    the generated level kernels compiled by ``emu.cuda.build(..., exact=True)`` (by
    name), run in place of the node-by-node emulation."""
    prog, tens, sources = model_program(model, args)
    return run_program_emulated(prog, tens, sources, monkeypatch, kernels)


def model_program(model: torch.nn.Module, args: Sequence[torch.Tensor]
                  ) -> tuple[Any, list[torch.Tensor], list[Any]]:
    """A from_model call's (program, inputs as runner._run_module passes them, sources)."""
    import cupyfuse

    prog = program_of(cupyfuse.from_model(model), *args)
    # (booleans and integer inputs as the float32 copies runner._run_module passes)
    tens = [a.float() if a.dtype in (torch.bool, torch.int64, torch.int32) else a
            for a in args]
    if prog.lead:
        tens = runner._lead_rows(tens)
    from cupyfuse.ir.derived import Derived

    sources = [runner._resolve(model, s).detach() if isinstance(s, str) else
               s.value(model) if isinstance(s, Derived) else s for s in prog.sources]
    return prog, tens, sources


def run_program_emulated(prog: Any, tens: Sequence[torch.Tensor], sources: Sequence[Any],
                         monkeypatch: Any, kernels: dict[str, Any] | None = None) -> Any:
    """execute.run_gpu of ``prog`` on CPU tensors (rows first), its launches emulated
    (``kernels``: as run_gpu_emulated's)."""
    pl = codegen.compile_program(prog)

    def get_function(src: str, name: str, dev: int) -> tuple:
        return ("fixed", src, name)

    def launch(fn: Any, grid: Any, block: Any, args: tuple, *a: Any, **kw: Any) -> None:
        if isinstance(fn, codegen.Level) and kernels is not None:
            kernels[fn.name](int(grid), int(block), *args)
        elif isinstance(fn, codegen.Level):
            _level(pl, fn, grid, args)
        elif fn == ("fixed", "tail_seqred.cu", "seq_reduce"):
            _seq_reduce(args)
        elif fn == ("fixed", "tail_colstat.cu", "colstat_partial"):
            _colstat_partial(args)
        elif fn == ("fixed", "tail_colstat.cu", "colstat_finalize"):
            _colstat_finalize(args)
        else:
            raise NotImplementedError(f"emulating {fn}")

    def mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, **kw: Any) -> str:
        assert x.shape[1] == w.shape[1] and out.shape == (x.shape[0], w.shape[0])
        out.copy_(x.double() @ w.double().t())
        return "emulated"

    monkeypatch.setattr(runtime, "get_function", get_function)
    monkeypatch.setattr(runtime, "launch", launch)
    monkeypatch.setattr(execute, "_kernel", lambda level, dev: level)
    monkeypatch.setattr(gemm, "linear_nobias", mm)
    monkeypatch.setattr(execute, "_gemv", lambda prog, g, x, w, s, o, d:
                        rewrite.gemv_value(prog, g, x, w, s, o, d))

    def fold(prog: Any, g: int, x: torch.Tensor, w: torch.Tensor, s: Any, o: Any, d: Any,
             precision: Any, lv: Any = None, reds: Any = None) -> torch.Tensor:
        # (a folded GEMM: the rewrite's torch form; no certification, so no reduction
        # written for the level: its kernel runs)
        return rewrite.fold_value(prog, g, x, w, s, lambda xa, wf, out: out.copy_(
            xa.double() @ wf.double().t()), o, d)
    monkeypatch.setattr(execute, "_fold", fold)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with torch.no_grad():
        return execute.run_gpu(prog, tens, sources)
