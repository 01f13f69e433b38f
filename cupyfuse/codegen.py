"""Tail programs to CUDA: the execution plan and the generated row kernels.

A program runs in *levels*. Level L starts when its GEMMs (nodes ``gemm`` whose input
is ready) and batch statistics (nodes ``bn``) are available; one generated kernel per
level computes every value of that level that is needed later (the program's output,
a GEMM's input, a BatchNorm input, a value read again after a later GEMM) and writes
it to a buffer. Between levels run the GEMM engine and the column-statistics kernels
(``kernels_cu/tail_colstat.cu``).

The generated kernel (one block per row, ``threads`` threads):

* every program value becomes a device lambda ``v<i>(f)`` of the feature index ``f``
  (values without a feature axis ignore it) -- maps are their vocabulary fragment
  applied to their operands' lambdas; inputs and parameters load with their strides;
  pooling loops over its window;
* each row reduction is a phase: the threads stride over the features, combine in a
  fixed order (warp shuffles, then warp 0 over the warps: deterministic), and every
  thread keeps the result in a register (``r<i>``);
* each group reduction is a phase in which warp w sums groups w, w + nwarps, ... into
  shared memory (or, for groups of at most 32, the group is re-read where it is used);
* finally the threads stride over the features writing each target.

Sums accumulate in double, max/min in float with NaN propagation (torch's rules).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from .program import Program
from .vocab import MAPS, REDUCTIONS, cuda_float

__all__ = ["Plan", "plan", "Level", "kernel_source", "fused_skinny_source"]

#: with more groups than fit in shared memory, groups at most this long are re-read
#: where used (the measured cost of re-reading: 62/88/94 at 5-10x slower than staging)
INLINE_GROUP = 32
#: the most group sums one block stages in shared memory
MAX_GROUPS = 8192
#: before each loop over a row's features: independent loads in flight together (a
#: row's reduction was a chain of L2 round trips: latency-bound on wide rows at small
#: batches)
UNROLL = "#pragma unroll 4"


@dataclass
class Level:
    index: int
    gemms: list[int] = field(default_factory=list)     # gemm nodes computed before the kernel
    bns: list[int] = field(default_factory=list)       # bn nodes whose statistics come first
    targets: list[int] = field(default_factory=list)   # values this level's kernel writes
    kernel: str = ""                                   # generated CUDA source ("" = no kernel)
    name: str = ""
    args: list[tuple[str, Any]] = field(default_factory=list)  # the kernel's parameters
    threads: int = 256
    params: list[str] = field(default_factory=list)    # their C declarations
    row_source: str = ""     # the row function <name>_row(row, params...) the kernel calls
    width_max: int = 1       # the widest value the kernel computes


@dataclass
class Plan:
    prog: Program
    levels: list[Level]
    level_of: list[int]
    materialized: set[int]
    out: int

    def describe(self) -> str:
        out = []
        for lv in self.levels:
            out.append(f"level {lv.index}: gemms {lv.gemms} bn {lv.bns} writes {lv.targets}")
        return "\n".join(out)


def _levels(prog: Program) -> list[int]:
    lv: list[int] = []
    for n in prog.nodes:
        base = max((lv[a] for a in n.args), default=0)
        if n.kind in ("gemm", "gemv", "bn"):
            base += 1
        lv.append(base)
    return lv


def plan(prog: Program) -> Plan:
    """Split a program into levels and generate each level's kernel source."""
    nodes = prog.nodes
    lvl = _levels(prog)
    users = prog.users()
    out = prog.out
    if not nodes[out].has_batch:
        from .program import TailError

        raise TailError("the forward's result does not depend on the batch rows")
    mat: set[int] = set()
    for i, n in enumerate(nodes):
        if not n.has_batch or n.kind in ("input", "gemm", "gemv"):
            continue
        for u in users[i]:
            un = nodes[u]
            if un.kind in ("gemm", "gemv", "bn") or lvl[u] > lvl[i]:
                mat.add(i)
    # a GEMM reads its input as a contiguous (batch, K) matrix: an input (or a view of
    # one) is read in place, anything else is materialised
    for i, n in enumerate(nodes):
        if n.kind in ("gemm", "gemv"):
            a = n.args[0]
            while nodes[a].kind == "view":
                a = nodes[a].args[0]
            if nodes[a].kind != "input":
                mat.add(n.args[0])
    if nodes[out].kind not in ("input",):
        mat.add(out)
    # GEMM/GEMV outputs are buffers already (the engine wrote them): never kernel targets
    mat = {i for i in mat if nodes[i].kind not in ("gemm", "gemv")}
    nlev = max(lvl) + 1
    levels = [Level(L) for L in range(nlev)]
    for i, n in enumerate(nodes):
        if n.kind in ("gemm", "gemv"):
            levels[lvl[i]].gemms.append(i)
        elif n.kind == "bn":
            levels[lvl[i]].bns.append(i)
    for i in sorted(mat):
        levels[lvl[i]].targets.append(i)
    for lv in levels:
        if lv.targets:
            _generate(prog, lv, lvl, mat)
    return Plan(prog, levels, lvl, mat, out)


def _needed(prog: Program, targets: list[int], level: int, lvl: list[int], mat: set[int]) -> list[int]:
    """Nodes this level's kernel evaluates (in program order)."""
    need: set[int] = set()
    stack = list(targets)
    while stack:
        i = stack.pop()
        if i in need:
            continue
        need.add(i)
        n = prog.nodes[i]
        if n.kind in ("input", "param", "const", "gemm", "gemv"):
            continue
        if n.kind == "bn":
            continue  # reads its materialised input and statistics
        if lvl[i] < level and n.has_batch and i in mat and i not in targets:
            continue  # loaded from its buffer
        for a in n.args:
            stack.append(a)
    return sorted(need)


def _generate(prog: Program, lv: Level, lvl: list[int], mat: set[int]) -> None:
    nodes = prog.nodes
    need = _needed(prog, lv.targets, lv.index, lvl, mat)
    args: list[tuple[str, Any]] = [("i64", "batch")]
    params: list[str] = ["long long batch"]
    body: list[str] = []
    shared: list[str] = []
    width_max = 1

    def call(a: int) -> str:
        """A call of operand a's lambda: at f, or at 0 for a value without features
        (broadcast along the features, it must not be read at the broadcast index)."""
        return f"v{a}(f)" if nodes[a].feature_axis() is not None else f"v{a}(0)"

    def add_arg(kind: str, what: Any, cdecl: str) -> None:
        args.append((kind, what))
        params.append(cdecl)

    for i in need:
        n = nodes[i]
        width_max = max(width_max, n.width)
        has_f = n.feature_axis() is not None
        loaded = (lvl[i] < lv.index and n.has_batch and i in mat
                  and n.kind not in ("input", "gemm", "gemv"))
        if loaded or (n.kind == "bn"):
            src = n.args[0] if n.kind == "bn" else i
            add_arg("buf", src, f"const float* __restrict__ buf{i}")
            w = nodes[src].width
            idx = f"row * {w}LL + f" if nodes[src].feature_axis() is not None else "row"
            if n.kind == "bn":
                add_arg("bn_mean", i, f"const float* __restrict__ mean{i}")
                add_arg("bn_invstd", i, f"const float* __restrict__ invstd{i}")
                expr = f"(buf{i}[{idx}] - mean{i}[f]) * invstd{i}[f]"
            else:
                expr = f"buf{i}[{idx}]"
        elif n.kind == "input":
            add_arg("input", i, f"const float* __restrict__ in{i}")
            add_arg("in_sb", i, f"long long in{i}_sb")
            add_arg("in_sf", i, f"long long in{i}_sf")
            expr = f"in{i}[row * in{i}_sb + (long long)f * in{i}_sf]" if has_f else f"in{i}[row * in{i}_sb]"
        elif n.kind in ("gemm", "gemv"):
            # CF_LDH: a plain load, or __ldcg where the GEMM runs in the same launch
            add_arg("gemm", i, f"const float* __restrict__ h{i}")
            expr = f"CF_LDH(h{i} + (row * {n.width}LL + f))" if has_f else f"CF_LDH(h{i} + row)"
        elif n.kind == "param":
            add_arg("param", i, f"const float* __restrict__ p{i}")
            if has_f:
                add_arg("param_sf", i, f"long long p{i}_sf")
                expr = f"p{i}[(long long)f * p{i}_sf]"
            else:
                expr = f"p{i}[0]"
        elif n.kind == "const":
            expr = cuda_float(n.attrs[0])
        elif n.kind == "map":
            entry = MAPS[n.op]
            ops = [call(a) for a in n.args]
            kw = {f"a{j}": cuda_float(x) for j, x in enumerate(n.attrs)}
            expr = entry.cuda.format(*ops, **kw)
        elif n.kind == "view":
            expr = call(n.args[0])
        elif n.kind == "cat":   # the operands' features one after the other
            parts, off = [], 0
            for a, w in zip(n.args, n.attrs[1:]):
                rd = f"v{a}(f - {off})" if nodes[a].feature_axis() is not None else f"v{a}(0)"
                parts.append(f"if (f < {off + w}) return {rd};")
                off += w
            body.append(f"auto v{i} = [&](int f) -> float {{ " + " ".join(parts[:-1])
                        + f" return {parts[-1].split('return ', 1)[1]} }};")
            continue
        elif n.kind == "slice":   # features [start, start + length) of its operand
            body.append(f"auto v{i} = [&](int f) -> float {{ (void)f; "
                        f"return v{n.args[0]}(f + {n.attrs[1]}); }};")
            continue
        elif n.kind == "pool":
            a = n.args[0]
            _, k, s = n.attrs
            if n.op == "max":
                body.append(f"auto v{i} = [&](int f) -> float {{ float m = v{a}(f * {s}); "
                            f"for (int j = 1; j < {k}; ++j) m = cf_nanmax(m, v{a}(f * {s} + j)); "
                            f"return m; }};")
            else:
                body.append(f"auto v{i} = [&](int f) -> float {{ float m = 0.0f; "
                            f"for (int j = 0; j < {k}; ++j) m += v{a}(f * {s} + j); "
                            f"return m / {k}.0f; }};")
            continue
        elif n.kind == "rred":
            a = n.args[0]
            ident, comb, acc = REDUCTIONS[n.op]
            wa = nodes[a].width
            shared.append(f"__shared__ {acc} scr{i}[32];")
            body.append(f"float r{i};")
            body.append(f"{{ {acc} acc = {ident};\n{UNROLL}\n"
                        f"for (int f = threadIdx.x; f < {wa}; f += blockDim.x) "
                        f"acc = {comb}(acc, ({acc})v{a}(f)); "
                        f"acc = cf_block_combine<{acc}>(acc, ({acc}){ident}, "
                        f"[]({acc} p, {acc} q) {{ return {comb}(p, q); }}, scr{i}); "
                        f"r{i} = (float)acc; }}")
            expr = f"r{i}"
        elif n.kind == "gred":
            a = n.args[0]
            _, g = n.attrs
            wa = nodes[a].width
            G = wa // g
            if G > MAX_GROUPS and g <= INLINE_GROUP:
                body.append(f"auto v{i} = [&](int f) -> float {{ const int g0 = (f / {g}) * {g}; "
                            f"double s = 0.0; for (int j = 0; j < {g}; ++j) s += (double)v{a}(g0 + j); "
                            f"return (float)s; }};")
                continue
            if G > MAX_GROUPS:
                from .program import TailError

                raise TailError(f"group_norm: {G} groups of {g} features is more than the "
                                f"{MAX_GROUPS} group sums one block holds")
            shared.append(f"__shared__ float sg{i}[{G}];")
            body.append(f"{{ const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, "
                        f"nw = blockDim.x >> 5; "
                        f"for (int gi = warp; gi < {G}; gi += nw) {{ double s = 0.0; "
                        f"for (int j = lane; j < {g}; j += 32) s += (double)v{a}(gi * {g} + j); "
                        f"s = cf_warp_combine<double>(s, [](double p, double q) {{ return p + q; }}); "
                        f"if (lane == 0) sg{i}[gi] = (float)s; }} __syncthreads(); }}")
            expr = f"sg{i}[f / {g}]"
        else:  # pragma: no cover
            raise AssertionError(n.kind)
        body.append(f"auto v{i} = [&](int f) -> float {{ (void)f; return {expr}; }};")

    for t in lv.targets:
        n = nodes[t]
        add_arg("out", t, f"float* __restrict__ out{t}")
        add_arg("out_sb", t, f"long long out{t}_sb")
        if n.feature_axis() is not None:
            add_arg("out_sf", t, f"long long out{t}_sf")
            body.append(f"{UNROLL}\nfor (int f = threadIdx.x; f < {n.width}; f += blockDim.x) "
                        f"out{t}[row * out{t}_sb + (long long)f * out{t}_sf] = v{t}(f);")
        else:
            body.append(f"if (threadIdx.x == 0) out{t}[row * out{t}_sb] = v{t}(0);")

    # wide rows: more threads per row (at small batches a row's tail is latency-bound)
    lv.threads = 1024 if width_max >= 16384 else (512 if width_max >= 4096 else (
        256 if width_max >= 1024 else (128 if width_max >= 256 else 64)))
    lv.width_max = width_max
    decl = ",\n    ".join(params)
    row = ["__device__ __forceinline__ void @NAME@_row(", f"    const long long row, {decl}) {{",
           "    (void)batch;"]
    row += ["    " + s for s in shared]
    row += ["    " + b for b in body]
    row.append("}")
    row_text = "\n".join(row) + "\n"
    names = ", ".join(p.split()[-1] for p in params)
    kern = [f"extern \"C\" __global__ void __launch_bounds__({lv.threads}) @NAME@(",
            f"    {decl}) {{",
            "    const long long row = blockIdx.x;",
            "    if (row >= batch) return;",
            f"    @NAME@_row(row, {names});",
            "}"]
    head = "#include \"tail_ops.cuh\"\n#ifndef CF_LDH\n#define CF_LDH(p) (*(p))\n#endif\n\n"
    text = head + row_text + "\n" + "\n".join(kern) + "\n"
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    lv.name = f"cf_tail_L{lv.index}_{digest}"
    lv.kernel = text.replace("@NAME@", lv.name)
    lv.row_source = row_text.replace("@NAME@", lv.name)
    lv.params = list(params)
    lv.args = args


def fused_skinny_source(lv: Level, mt: int, skinny_header: str) -> tuple[str, str]:
    """(name, source) of one kernel that runs the skinny GEMM (``skinny_header``: the
    expanded ``kernels_cu/gemm_skinny.cuh``, ``mt`` rows per tile) and then, in the last
    ``ntail`` blocks to finish, this level's tail (rows j, j + ntail, ...): the GEMM and
    its tail in one launch. Parameters: the skinny kernel's, ``done`` (two counters) and
    ``ntail``, then the level's."""
    name = f"{lv.name}_sk{mt}"
    names = ", ".join(p.split()[-1] for p in lv.params)
    decl = ",\n    ".join(lv.params)
    gemm_args = "x, ldx, w, ldw, M, N, K, kspan, y, ldy, part, counters, done, ntail"
    src = ["#include \"tail_ops.cuh\"", "#define CF_LDH(p) __ldcg(p)", skinny_header,
           lv.row_source,
           f"extern \"C\" __global__ void __launch_bounds__(SK_WARPS * 32, SK_MINB) {name}(",
           "    const float* __restrict__ x, long long ldx, const float* __restrict__ w,",
           "    long long ldw, int M, int N, int K, int kspan, float* y, long long ldy,",
           "    float* __restrict__ part, unsigned int* __restrict__ counters, int vec,",
           f"    unsigned int* __restrict__ done, int ntail, {decl}) {{",
           f"    const int j = vec ? skinny_tile<{mt}, SK_CPW, 1>({gemm_args})",
           f"                      : skinny_tile<{mt}, SK_CPW, 0>({gemm_args});",
           "    if (j < 0) return;",
           "    for (long long row = j; row < batch; row += ntail) {",
           f"        {lv.name}_row(row, {names});",
           "        __syncthreads();",
           "    }",
           "}"]
    return name, "\n".join(src) + "\n"


def kernel_source(p: Plan) -> str:
    """All generated kernels of a plan in one translation unit (for nvcc checks)."""
    parts = [lv.kernel for lv in p.levels if lv.kernel]
    if not parts:
        return ""
    head = parts[0].split("\n", 1)[0]
    return head + "\n" + "\n".join(x.split("\n", 1)[1] for x in parts)
