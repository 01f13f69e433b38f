"""Generated tail kernels run on the CPU, for tests where no GPU is at hand.

The kernels' CUDA is compiled as C++20 with a small emulation of what they use: each
thread of a block is a fiber (``ucontext``) on the calling thread, run until it waits at
a barrier, then the next; ``__syncthreads`` a block barrier, ``__shfl_xor_sync`` an
exchange through a per-warp buffer between two warp barriers, ``__shared__`` a
function-static array (blocks run one after the other). :func:`run_program` runs a program level by level as
``execute.run_gpu`` does: each GEMM on the host (torch, float32), then the level's
generated kernel on the buffers, its arguments packed by ``execute._values``. Programs
with GEMV/fold rewrites or BatchNorm run their unrewritten form (those kernels are
hand-written, not generated). What this checks: the generated code's index arithmetic,
phases and combines give what the CPU path (``cpu.run_cpu``) gives.
"""
from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path
from typing import Any, Sequence

import torch

from cupyfuse.backend import execute
from cupyfuse.backend import codegen, runtime
from cupyfuse.ir.program import Program, shape_of

CXX = shutil.which("g++")

_HEAD = r"""
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <ucontext.h>
using std::isinf;
using std::isnan;
struct CfDim3 { int x = 0, y = 0, z = 0; };
// The threads of a block are fibers on the calling OS thread (ucontext): each runs until a
// barrier, then the next one runs (in order, or in reverse order for every other block);
// threadIdx is set for the fiber about to run.
static CfDim3 threadIdx, blockIdx, blockDim;
struct CfFiber { ucontext_t ctx; bool done = false; };
static std::vector<CfFiber> cf_fibers;
static std::vector<char*> cf_stacks;
static ucontext_t cf_sched;
static int cf_cur = 0;
static std::function<void()> cf_task;
static const size_t CF_STACK = size_t(1) << 18;
struct CfBarrier { int expected = 0, count = 0; long gen = 0; };
static CfBarrier cf_block_bar, cf_warp_bar[32];
inline void cf_arrive_and_wait(CfBarrier& b) {
    const long g = b.gen;
    if (++b.count == b.expected) { b.count = 0; ++b.gen; return; }
    while (b.gen == g) swapcontext(&cf_fibers[cf_cur].ctx, &cf_sched);
}
static void cf_trampoline() { cf_task(); cf_fibers[cf_cur].done = true; }
static void cf_run_block(int block) {
    blockDim.x = block;
    cf_block_bar = CfBarrier{block};
    for (int w = 0; w < 32; ++w) cf_warp_bar[w] = CfBarrier{block < 32 ? block : 32};
    cf_fibers.resize(block);
    while ((int)cf_stacks.size() < block) cf_stacks.push_back((char*)std::malloc(CF_STACK));
    for (int t = 0; t < block; ++t) {
        CfFiber& f = cf_fibers[t];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = cf_stacks[t];
        f.ctx.uc_stack.ss_size = CF_STACK;
        f.ctx.uc_link = &cf_sched;
        makecontext(&f.ctx, cf_trampoline, 0);
        f.done = false;
    }
    // every other block runs its fibers in reverse order: a read of another thread's
    // value without a barrier between sees it unwritten in one order or the other
    static long blocks_run = 0;
    const bool reverse = (blocks_run++ & 1) != 0;
    for (int live = block; live > 0;) {
        for (int i = 0; i < block; ++i) {
            const int t = reverse ? block - 1 - i : i;
            if (cf_fibers[t].done) continue;
            cf_cur = t;
            threadIdx.x = t;
            swapcontext(&cf_sched, &cf_fibers[t].ctx);
            if (cf_fibers[t].done) --live;
        }
    }
}
static double cf_xchg[32][32];
#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(...)
#define __restrict__
#define __shared__ static
inline void __syncthreads() { cf_arrive_and_wait(cf_block_bar); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int o) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    std::memcpy(&cf_xchg[warp][lane], &v, sizeof(T));
    cf_arrive_and_wait(cf_warp_bar[warp]);
    T r;
    std::memcpy(&r, &cf_xchg[warp][lane ^ o], sizeof(T));
    cf_arrive_and_wait(cf_warp_bar[warp]);
    return r;
}
"""


def _wrapper(lv: codegen.Level, cluster: bool = False) -> str:
    """``emu_<name>(grid, block, params...)``: the kernel's blocks one after the other.
    ``cluster``: the `_cl` entry, block b as the first block of row b's cluster -- run
    with block = split x split_threads threads (at most 1024), one emulated block covers
    the row as the cluster's blocks do (without a cluster, cf_row_parts() is 1 and the
    combines are the block's)."""
    names = ", ".join(p.split()[-1] for p in lv.params)
    entry, first = (lv.name + "_cl", f"b * {lv.split}") if cluster else (lv.name, "b")
    return "\n".join([
        f'extern "C" void emu_{entry}(int grid, int block, {", ".join(lv.params)}) {{',
        "  for (int b = 0; b < grid; ++b) {",
        f"    blockIdx.x = {first};",
        f"    cf_task = [=]() {{ {entry}({names}); }};",
        "    cf_run_block(block);",
        "  }",
        "}"])


def _runnable(prog: Program) -> Program:
    if any(n.kind in ("gemv", "bn") or n.kind == "gemm" and len(n.attrs) > 2
           for n in prog.nodes):
        prog = prog.unrewritten
    if prog is None or any(n.kind == "bn" for n in prog.nodes):
        raise ValueError("BatchNorm programs are not emulated")
    return prog


def build_or_skip(progs: Sequence[Program], tmp: Path, exact: bool = False) -> dict[str, Any]:
    """:func:`build`, or the calling test skipped where there is no g++."""
    if CXX is None:
        import pytest

        pytest.skip("no g++ to compile the emulated kernels")
    return build(progs, tmp, exact=exact)


def build(progs: Sequence[Program], tmp: Path, exact: bool = False) -> dict[str, Any]:
    """Compile every generated kernel of these programs into one library; returns
    {kernel name: callable(grid, block, *args)}. ``exact``: the programs' own kernels
    (for tests/emu/gpu.py, which runs execute.run_gpu: its GEMVs and folds on the host),
    not those of the forms :func:`run_program` runs."""
    kernels: dict[str, codegen.Level] = {}
    for prog in progs:
        for lv in codegen.plan(prog if exact else _runnable(prog)).levels:
            if lv.kernel:
                kernels.setdefault(lv.name, lv)
    ops = runtime.expand_source("tail_ops.cuh").replace("#pragma once", "")
    parts = [_HEAD, ops]
    for lv in kernels.values():
        parts.append(lv.kernel.split("\n", 1)[1])
        parts.append(_wrapper(lv))
        if lv.split:
            parts.append(_wrapper(lv, cluster=True))
    src = "\n".join(parts) + "\n"
    digest = hashlib.sha1(src.encode()).hexdigest()[:16]
    cpp, so = tmp / f"emu_{digest}.cpp", tmp / f"emu_{digest}.so"
    if not so.exists():
        cpp.write_text(src)
        r = subprocess.run([CXX, "-std=c++20", "-O0", "-shared", "-fPIC", "-pthread", "-o",
                            str(so), str(cpp)], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(r.stderr[-6000:])
    lib = ctypes.CDLL(str(so))
    out = {}
    for name, lv in kernels.items():
        for entry in (name, name + "_cl") if lv.split else (name,):
            fn = getattr(lib, f"emu_{entry}")
            fn.argtypes = [ctypes.c_int, ctypes.c_int] + [
                ctypes.c_void_p if "*" in p else ctypes.c_longlong for p in lv.params]
            out[entry] = fn
    return out


def run_program(prog: Program, inputs: Sequence[torch.Tensor], sources: Sequence[Any],
                kernels: dict[str, Any], cluster: bool = False) -> torch.Tensor:
    """The program's result with its generated kernels emulated (CPU tensors; inputs as
    the program runs them: rows first). ``cluster``: split levels run their `_cl` entry
    (its row function of fixed-stride loops and cached values, :func:`_wrapper`)."""
    prog = _runnable(prog)
    nodes = prog.nodes
    index = prog.index_values()
    batch = inputs[0].shape[0]
    bufs: dict[int, torch.Tensor] = {}

    def value(i: int) -> torch.Tensor:
        j = i
        while j not in bufs and nodes[j].kind == "view":
            j = nodes[j].args[0]
        t = bufs[j] if j in bufs else inputs[nodes[j].attrs[0]]
        return t if j == i else t.reshape(shape_of(nodes[i].dims, batch))

    for lv in codegen.plan(prog).levels:
        for g in lv.gemms:
            n = nodes[g]
            a = value(n.args[0]).reshape(batch, -1).contiguous()
            w = sources[n.attrs[0]]
            bufs[g] = (a @ (w if n.attrs[1] else w.t())).contiguous()
        if not lv.kernel:
            continue
        for t in lv.targets:   # (argmax/argmin targets: int64, -1 where never written)
            bufs[t] = torch.full(shape_of(nodes[t].dims, batch), -1, dtype=torch.int64) \
                if t in index else torch.full(shape_of(nodes[t].dims, batch), float("nan"))
        args = execute._values(lv.args, prog, batch, bufs, {}, inputs, sources)
        if cluster and lv.split:
            kernels[lv.name + "_cl"](batch, lv.split * lv.split_threads, *args)
        else:
            kernels[lv.name](batch, lv.threads, *args)
    out = bufs[prog.out]
    return out.reshape(prog.out_shape(batch)) if prog.lead or prog.lead_out else out
