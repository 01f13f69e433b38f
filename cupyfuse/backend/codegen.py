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
  so is each split reduction (``sred``: one result per group), and a ``remap`` reads its
  operand's lambda at an index computed from f;
* finally the threads stride over the features writing each target.

Sums accumulate in double, max/min in float with NaN propagation (torch's rules).

A program with a sequence reduction (node ``seqred``: over the seq rows of each batch
element of a (batch, seq, features) value) has values of two row counts: batch * seq
rows, and batch rows after the reduction (:meth:`Program.per_batch`). Its levels
alternate between them (odd levels: batch * seq rows, even: batch rows), so each level's
kernel runs over one row count; a per-batch value read by a (batch, seq) kernel is
materialised and loaded at row ``row / seq``. The reductions run before their level's
kernel (``kernels_cu/tail_seqred.cu``: one thread per (batch element, feature), the seq
rows in order) or, where that kernel is elementwise and reads the reduction once per
element, inside it (the same loop: :func:`_inline_seqreds`); such programs have no GEMM
epilogues.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from cupyfuse import caches
from cupyfuse import config
from cupyfuse.ir.program import ARG_OPS, INLINE_GROUP, MAX_GROUPS, SCAN_CHUNK, Program
from cupyfuse.ops.registry import MAPS, REDUCTIONS, cuda_float

__all__ = ["Plan", "plan", "Level", "Epilogue", "kernel_source", "fused_skinny_source"]

#: argmax/argmin: each candidate's key (tail_ops.cuh: the largest key is torch's answer),
#: combined by cf_umax64 from the identity 0; the position comes back by cf_argkey_pos
ARG_KEYS = {"argmax": "cf_argmax_key", "argmin": "cf_argmin_key"}
_U64 = "unsigned long long"
_UMAX = f"[]({_U64} p, {_U64} q) {{ return cf_umax64(p, q); }}"

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
    split: int = 0                                     # blocks per row of the `_cl` entry (0: none)
    split_threads: int = 0                             # threads per block of the `_cl` entry
    name: str = ""
    args: list[tuple[str, Any]] = field(default_factory=list)  # the kernel's parameters
    threads: int = 256
    params: list[str] = field(default_factory=list)    # their C declarations
    row_source: str = ""     # the row function <name>_row(row, params...) the kernel calls
    width_max: int = 1       # the widest value the kernel computes
    epi: "Epilogue | None" = None   # the level as the GEMM's epilogue, where it can be
    seqreds: list[int] = field(default_factory=list)     # sequence reductions run first
    #: sequence reductions computed inside this level's kernel (:func:`_inline_seqreds`)
    seq_inline: list[int] = field(default_factory=list)
    #: the level's values have one row per batch element (after a sequence reduction):
    #: its GEMMs, statistics and kernel run over batch // seq rows
    per_batch: bool = False

    def launch(self, rows: int) -> tuple[str, int]:
        """(entry point, blocks) of this level's kernel over ``rows`` rows: the `_cl`
        entry, each row over a cluster of ``split`` blocks, for at most config.SPLIT_MAX_ROWS rows
        (a wide row in one block runs on one SM: at small batches the rest of the GPU
        idles); else one block per row."""
        if self.split and rows <= config.SPLIT_MAX_ROWS:
            return self.name + "_cl", rows * self.split
        return self.name, rows

    def block(self, entry: str) -> int:
        """Threads per block of an entry point of this level's kernel."""
        return self.split_threads if entry.endswith("_cl") else self.threads


@dataclass
class Plan:
    prog: Program
    levels: list[Level]
    level_of: list[int]
    materialized: set[int]
    out: int
    #: the rows a sequence reduction combines (Program.seq_group; 0: none) and, with
    #: one, which values have one row per batch element (Program.per_batch)
    seq: int = 0
    per_batch: list[bool] = field(default_factory=list)

    def rows(self, i: int, rows: int) -> int:
        """The rows of value ``i`` in a call on ``rows`` (batch * seq) rows."""
        return rows // self.seq if self.seq and self.per_batch[i] else rows

    def describe(self) -> str:
        out = []
        for lv in self.levels:
            out.append(f"level {lv.index}: gemms {lv.gemms} bn {lv.bns} writes {lv.targets}")
        return "\n".join(out)


def _levels(prog: Program, per: list[bool] | None = None) -> list[int]:
    """Each node's level: after its operands', past the GEMMs, statistics (and sequence
    reductions) it reads. With ``per`` (a program with a sequence reduction), the level
    of a value of the batch * seq rows is odd, of one of the batch rows even."""
    lv: list[int] = []
    for i, n in enumerate(prog.nodes):
        base = max((lv[a] for a in n.args), default=0)
        if n.kind in ("gemm", "gemv", "bn", "seqred"):
            base += 1
        if per is not None and prog.nodes[i].has_batch and base % 2 != (0 if per[i] else 1):
            base += 1
        lv.append(base)
    return lv


def plan(prog: Program) -> Plan:
    """Split a program into levels and generate each level's kernel source."""
    nodes = prog.nodes
    seq = prog.seq_group()
    per = prog.per_batch() if seq else None
    lvl = _levels(prog, per)
    users = prog.users()
    out = prog.out
    if not nodes[out].has_batch:
        from cupyfuse.ir.program import TailError

        raise TailError("the forward's result does not depend on the batch rows")
    mat: set[int] = set()

    def viewed(i: int) -> str:   # the kind of node a view (of a view ...) shows
        while nodes[i].kind == "view":
            i = nodes[i].args[0]
        return nodes[i].kind

    for i, n in enumerate(nodes):
        if not n.has_batch or n.kind in ("input", "gemm", "gemv", "seqred"):
            continue
        # a view of an input is read in place, through the input's strides, by GEMMs,
        # sequence reductions and later levels' kernels (no copy of a (batch, seq, K) x);
        # BatchNorm reads a buffer of its own. A
        # view of a GEMM's output (a Linear without bias) is read in place by a sequence
        # reduction (the GEMM's buffer, its rows)
        of = viewed(i) if n.kind == "view" else ""
        for u in users[i]:
            un = nodes[u]
            if (of == "input" and un.kind != "bn") or \
                    (of in ("gemm", "gemv") and un.kind == "seqred"):
                continue
            if un.kind in ("gemm", "gemv", "bn", "seqred") or lvl[u] > lvl[i]:
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
    for o in (out,) + prog.more_outs:
        if not nodes[o].has_batch:
            from cupyfuse.ir.program import TailError

            raise TailError("a result of the forward does not depend on the batch rows")
        if nodes[o].kind not in ("input",):
            mat.add(o)
    # GEMM/GEMV outputs and sequence reductions are buffers already (the engine or the
    # reduction wrote them): never kernel targets
    mat = {i for i in mat if nodes[i].kind not in ("gemm", "gemv", "seqred")}
    # an index value (argmax/argmin) is materialised only as a result, written as int64:
    # no later level may load it as a float32 buffer (capture lets views and ``.float()``
    # read one: those are computed in its level)
    for i in prog.index_values():
        if any(lvl[u] > lvl[i] for u in users[i]):
            from cupyfuse.ir.program import TailError

            raise TailError(f"argmax/argmin (value %{i}) read after a Linear or a batch "
                            "statistic: cupyfuse returns positions, it does not compute "
                            "with them")
    nlev = max(lvl) + 1
    levels = [Level(L, per_batch=per is not None and L % 2 == 0) for L in range(nlev)]
    for i, n in enumerate(nodes):
        if n.kind in ("gemm", "gemv"):
            levels[lvl[i]].gemms.append(i)
        elif n.kind == "bn":
            levels[lvl[i]].bns.append(i)
        elif n.kind == "seqred":
            levels[lvl[i]].seqreds.append(i)
    for i in sorted(mat):
        levels[lvl[i]].targets.append(i)
    inside = _inline_seqreds(prog, levels, lvl, mat, users)
    moved = {r for rs in inside.values() for r in rs}
    for lv in levels:
        lv.seq_inline = inside.get(lv.index, [])
        lv.seqreds = [r for r in lv.seqreds if r not in moved]
    for lv in levels:
        if lv.targets:
            _generate(prog, lv, lvl, mat, seq, per)
            # (the epilogue's parts buffer and row counters are the GEMM's rows: a
            # program of two row counts keeps its kernels separate)
            lv.epi = None if per is not None else _epilogue(prog, lv, lvl, mat, users)
    return Plan(prog, levels, lvl, mat, out, seq, per or [])



#: what a level kernel may evaluate for a sequence reduction to run inside it: values its
#: threads compute once per written element (no phases: a row reduction, pooling window
#: or scan would read the reduction several times per element)
_ELEMENTWISE = ("map", "view", "param", "const", "iota", "input", "cat", "slice", "seqred",
                "gemm", "gemv")




def _splittable(shared: list[str], body: list[str]) -> bool:
    """Whether a level kernel's phases are row reductions alone (cf_row_combine over its
    scratch of 32, one scratch per combine) and elementwise loops over CF_F0 / CF_FS: no
    other shared memory, no block barrier of its own."""
    scr = re.compile(r"__shared__ (float|double|unsigned long long) scr\d+\[32\];$")
    text = "\n".join(body)
    # (each scratch in one combine: cf_row_combine in a cluster reuses none)
    return all(scr.match(x) and text.count(f", {x.split()[-1].split('[')[0]});") == 1
               for x in shared) and "__syncthreads" not in text and "blockDim" not in text


def _unsplit(line: str) -> str:
    """A row function's line for one block per row: the row's stride and reductions as
    they were before rows could split (CF_F0 / CF_FS read the cluster rank in every loop,
    which made ptxas allocate worse in kernels that never split: 20 bytes spilled in a
    1024-thread split-reduction kernel)."""
    return (line.replace("CF_F0", "threadIdx.x").replace("CF_FS", "blockDim.x")
            .replace("cf_row_combine<", "cf_block_combine<")
            .replace("threadIdx.x == 0 && cf_row_part() == 0", "threadIdx.x == 0"))



_LOOP_RE = re.compile(r"(#pragma unroll[^\n]*\n)?for \(int f = CF_F0; f < (\d+); f \+= CF_FS\) ")
_CALL_RE = re.compile(r"\bv(\d+)\(")
_FCALL_RE = re.compile(r"\bv(\d+)\(f\)")
_ZCALL_RE = re.compile(r"\bv(\d+)\(0\)")
_LAMBDA_RE = re.compile(r"^auto v(\d+) = \[&\]\(int f\) -> float \{(.*)\};$", re.S)


def _statement_end(text: str, start: int) -> int:
    """The index just past the statement starting at ``start`` (its ``;`` outside
    parentheses and braces)."""
    depth = 0
    for k in range(start, len(text)):
        c = text[k]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == ";" and depth == 0:
            return k + 1
    raise AssertionError(f"no end of the statement at {text[start:start + 80]!r}")


def _cluster_row(body: list[str], fs: int, widths: dict[int, int]) -> list[str]:
    """A split level's row function body for its `_cl` entry, whose launch fixes the
    stride of every loop over the row (``fs`` = blocks x threads of the cluster): each
    loop runs a constant count of steps (unrolled fully: its loads in flight together),
    and a value a later loop reads again is kept in registers (``c<i>[step]``), filled by
    the first loop that computes it -- the phases after the first read no memory and
    recompute nothing (H100, 16 rows x 16384, GELU + softmax tail: 8.9 -> 6.1 us with
    the last-step guard below; a hand-written floor 5.8). ``widths``: the feature width of
    each value with a feature axis. Kept only where every value is read at its own feature (``v<i>(f)``:
    no slices, pools or gathers) and every loop runs over one width; at most
    config.CACHE_FLOATS floats per thread (the values filled first)."""
    text = "\n".join(body)
    stmts = []   # each loop's (item index, header match, statement end)
    deps: dict[int, set[int]] = {}
    for bi, b in enumerate(body):
        m = _LOOP_RE.search(b)
        if m:
            stmts.append((bi, m, _statement_end(b, m.end())))
        m = _LAMBDA_RE.match(b)
        if m:
            deps[int(m.group(1))] = {int(x) for x in _FCALL_RE.findall(m.group(2))}
    ws = {int(m.group(2)) for _, m, _ in stmts}
    nper = {w: -(-w // fs) for w in ws}
    calls = _CALL_RE.findall(text)
    fcalls, zcalls = _FCALL_RE.findall(text), _ZCALL_RE.findall(text)
    # (an item with a second loop keeps it as it is: CF_FS is right in any launch)
    cache = (len(ws) == 1 and len(calls) == len(fcalls) + len(zcalls)
             and not set(fcalls) & set(zcalls) and all(b.count("for (int f") <= 1 for b in body))
    fill: dict[int, int] = {}   # cached value -> the loop (its position in stmts) filling it
    if cache:
        (w,) = ws
        roots = [{int(x) for x in _FCALL_RE.findall(body[bi][m.end():e])} for bi, m, e in stmts]
        for k in range(len(stmts)):
            reach, stack = set(), list(roots[k])
            while stack:
                n = stack.pop()
                if n not in reach:
                    reach.add(n)
                    if n not in fill:
                        stack.extend(deps.get(n, ()))
            cand = {n for n in reach - set(fill) if n in deps and widths.get(n) == w}
            new: set[int] = set()
            for later in roots[k + 1:]:
                seen, stack = set(), list(later)
                while stack:
                    n = stack.pop()
                    if n in seen or n in fill:
                        continue
                    seen.add(n)
                    if n in cand:
                        new.add(n)
                    else:
                        stack.extend(deps.get(n, ()))
            fill.update((n, k) for n in new)
        # past the register budget: the values filled first (any subset is correct: a
        # value not kept is recomputed from its operands, kept or not)
        keep = sorted(fill, key=lambda n: (fill[n], n))[:config.CACHE_FLOATS // nper[w]]
        fill = {n: fill[n] for n in keep}
    out = ["int cj = 0;   // the step of the loop running (a cached value's slot)"] if fill else []
    loop_of = {bi: k for k, (bi, _, _) in enumerate(stmts)}
    for bi, b in enumerate(body):
        m = _LAMBDA_RE.match(b)
        if m and int(m.group(1)) in fill:
            i, n = int(m.group(1)), nper[next(iter(ws))]
            out.append(b.replace(f"auto v{i} =", f"auto v{i}_c =", 1))
            out.append(f"float c{i}[{n}];")
            out.append(f"auto v{i} = [&](int f) -> float {{ (void)f; return c{i}[cj]; }};")
            continue
        k = loop_of.get(bi)
        if k is None:
            out.append(b)
            continue
        _, hm, end = stmts[k]
        w = int(hm.group(2))
        fills = "".join(f"c{i}[cj] = v{i}_c(f); " for i in sorted(fill) if fill[i] == k)
        # only the last step can pass the row's end (f < fs: CF_F0's range); a guard on
        # every step cost 0.6 us of 6.8 (docs/measured/tail_floor_h100_2026-11-26.txt)
        guard = "true" if w % fs == 0 else f"s_ < {nper[w] - 1} || f < {w}"
        loop = (f"#pragma unroll\nfor (int s_ = 0; s_ < {nper[w]}; ++s_) {{ "
                + ("cj = s_; " if fill else "")
                + f"const int f = CF_F0 + s_ * {fs}; if ({guard}) {{ {fills}"
                + b[hm.end():end] + " } }")
        out.append(b[:hm.start()] + loop + b[end:])
    return out


def _threads(width: int) -> int:
    """A level kernel's threads per row: more for wide rows (at small batches a row's tail
    is latency-bound)."""
    return 1024 if width >= 16384 else (512 if width >= 4096 else (
        256 if width >= 1024 else (128 if width >= 256 else 64)))




def _inline_seqreds(prog: Program, levels: list[Level], lvl: list[int],
                    mat: set[int], users: list[list[int]]) -> dict[int, list[int]]:
    """The sequence reductions a level kernel computes itself (one seq_reduce launch and
    one buffer fewer each), by level index. A reduction moves where every value reading it
    is computed by one kernel that writes something, and either

    * its operand has one feature (an attention score): the kernel of its own level (the
      batch's rows) or of the next one (the batch * seq rows: each of the seq rows of a
      batch element reduces the same seq values) computes it once per thread, as a row
      scalar (``s<i>``) -- a softmax over the sequence (its max and its sum) and the
      weights of an attention pooling; or
    * the kernel of its own level is elementwise and evaluates the reduction's lambda at
      most once per element it writes (mean pooling followed by a Linear: the mean's
      division; a pooled result's copy).

    The loop runs over the seq rows of the (batch element, feature) in order, as
    tail_seqred.cu's seq_reduce does (sums in double from +0.0, max/min with NaN
    propagation): the same bits. At most :data:`config.SEQ_INLINE_LOADS` loads per thread and row:
    past it the launch's threads spread a small batch over the whole GPU."""
    out: dict[int, list[int]] = {}
    if not config.SEQ_INLINE:
        return out
    nodes = prog.nodes
    results = {prog.out, *prog.more_outs}
    need_of: dict[int, list[int]] = {}

    def need(k: int) -> list[int]:
        if k not in need_of:
            need_of[k] = _needed(prog, levels[k].targets, k, lvl, mat)
        return need_of[k]

    def leaf(i: int, k: int) -> bool:   # read from memory by level k's kernel
        n = nodes[i]
        return n.kind in ("input", "param", "const", "iota", "gemm", "gemv", "bn", "seqred") \
            or (lvl[i] < k and n.has_batch and i in mat)

    def calls(k: int) -> dict[int, int] | None:
        """How many times level k's kernel runs each value's lambda per element it writes
        (paths from its targets); None where a value is not elementwise."""
        nd = need(k)
        if any(not leaf(i, k) and nodes[i].kind not in _ELEMENTWISE for i in nd):
            return None
        c = {i: 0 for i in nd}
        for i in reversed(nd):   # (program order: users after their operands)
            c[i] += i in levels[k].targets
            if not leaf(i, k):
                for a in nodes[i].args:
                    if a in c:
                        c[a] += c[i]
        return c

    for r, n in enumerate(nodes):
        if n.kind != "seqred" or r in results or not users[r]:
            continue
        ks = {lvl[u] for u in users[r]}
        if len(ks) != 1:
            continue
        k = ks.pop()
        if k not in (lvl[r], lvl[r] + 1) or not levels[k].targets \
                or not all(u in need(k) for u in users[r]):
            continue
        s_len, width = n.attrs[1], nodes[n.args[0]].width
        if width == 1:
            if s_len <= config.SEQ_INLINE_LOADS:
                out.setdefault(k, []).append(r)
            continue
        if k != lvl[r]:
            continue
        threads = _threads(max(nodes[i].width for i in need(k)))
        c = calls(k)
        if c is not None and c[r] <= 1 and s_len * -(-width // threads) <= config.SEQ_INLINE_LOADS:
            out.setdefault(k, []).append(r)
    return out


def _needed(prog: Program, targets: list[int], level: int, lvl: list[int], mat: set[int],
            stop_rred: bool = False) -> list[int]:
    """Nodes this level's kernel evaluates for ``targets`` (in program order): not past
    inputs, parameters, constants, GEMM outputs, BatchNorm (it reads its materialised
    input and statistics) and earlier levels' buffers; nor past a row reduction where
    ``stop_rred`` (its result is a leaf)."""
    need: set[int] = set()
    stack = list(targets)
    while stack:
        i = stack.pop()
        if i in need:
            continue
        need.add(i)
        n = prog.nodes[i]
        if n.kind in ("input", "param", "const", "iota", "gemm", "gemv", "bn", "seqred"):
            continue
        if lvl[i] < level and n.has_batch and i in mat:
            continue  # loaded from its buffer
        if stop_rred and n.kind == "rred":
            continue
        stack.extend(n.args)
    return sorted(need)


class _Emitter:
    """The CUDA of a level's values: every program value becomes a device lambda
    ``v<i>(f)`` of the feature index (``body``), its operands' loads become parameters
    (``args``: (kind, node) for the host, ``params``: their C declarations), shared-memory
    arrays go to ``shared``.

    ``gemm_expr``: the GEMM output's expression where the level runs inside the GEMM's
    epilogue (``hval``, the element in registers) -- else a load of the GEMM's buffer.
    ``rred_code``: where a row reduction's result comes from another pass (the epilogue's
    parts), a function of (node, acc type, identity, combine) giving the statements that
    set ``r<i>``; else a block reduction over the row."""

    def __init__(self, prog: Program, level: int, lvl: list[int], mat: set[int],
                 gemm_expr: str | None = None, rred_code: Callable | None = None,
                 seq: int = 0, per: list[bool] | None = None,
                 seq_inline: list[int] | None = None) -> None:
        self.prog, self.level, self.lvl, self.mat = prog, level, lvl, mat
        self.seq_inline = seq_inline or []
        self.gemm_expr, self.rred_code = gemm_expr, rred_code
        #: a (batch, seq) kernel of a program with a sequence reduction: its per-batch
        #: buffers are read at row / seq
        self.seq = seq if per is not None and level % 2 == 1 else 0
        self.per = per
        self.args: list[tuple[str, Any]] = [("i64", "batch")]
        self.params: list[str] = ["long long batch"]
        self.body: list[str] = []
        self.shared: list[str] = []
        self.shared_bytes = 0
        self.width_max = 1
        #: the program's index values (argmax/argmin), read when a target is stored
        self.index: frozenset[int] | None = None

    def call(self, a: int) -> str:
        """A call of operand a's lambda: at f, or at 0 for a value without features
        (broadcast along the features, it must not be read at the broadcast index)."""
        return f"v{a}(f)" if self.prog.nodes[a].feature_axis() is not None else f"v{a}(0)"

    def add_arg(self, kind: str, what: Any, cdecl: str) -> None:
        if cdecl not in self.params:   # (a value read by two functions of one kernel)
            self.args.append((kind, what))
            self.params.append(cdecl)

    def node(self, i: int) -> None:
        nodes, lvl, mat, body = self.prog.nodes, self.lvl, self.mat, self.body
        add_arg, call = self.add_arg, self.call
        n = nodes[i]
        self.width_max = max(self.width_max, n.width)
        has_f = n.feature_axis() is not None
        loaded = (lvl[i] < self.level and n.has_batch and i in mat
                  and n.kind not in ("input", "gemm", "gemv"))
        if n.kind == "seqred" and i in self.seq_inline:
            body.append(self._seq_loop(i, n))
            return
        if loaded or n.kind in ("bn", "seqred"):
            src = n.args[0] if n.kind == "bn" else i
            add_arg("buf", src, f"const float* __restrict__ buf{i}")
            w = nodes[src].width
            # a per-batch value read by a (batch, seq) kernel: its batch element's row
            r = f"(row / {self.seq}LL)" if self.seq and self.per and self.per[i] else "row"
            idx = f"{r} * {w}LL + f" if nodes[src].feature_axis() is not None else r
            if n.kind == "bn" and len(n.attrs) > 3:   # "mean": the batch's mean itself
                add_arg("bn_mean", i, f"const double* __restrict__ mean{i}")
                expr = f"(float)mean{i}[f]"
            elif n.kind == "bn":
                add_arg("bn_mean", i, f"const double* __restrict__ mean{i}")
                add_arg("bn_invstd", i, f"const double* __restrict__ invstd{i}")
                # in double, like torch's own statistics: no overflow in v - mean
                expr = f"(float)(((double)buf{i}[{idx}] - mean{i}[f]) * invstd{i}[f])"
            else:
                expr = f"buf{i}[{idx}]"
        elif n.kind == "input":
            add_arg("input", i, f"const float* __restrict__ in{i}")
            add_arg("in_sb", i, f"long long in{i}_sb")
            add_arg("in_sf", i, f"long long in{i}_sf")
            expr = f"in{i}[row * in{i}_sb + (long long)f * in{i}_sf]" if has_f else f"in{i}[row * in{i}_sb]"
        elif n.kind in ("gemm", "gemv") and self.gemm_expr is not None:
            expr = self.gemm_expr
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
        elif n.kind == "iota":   # start + f * step in double, rounded (torch.arange's)
            start, _, step = n.attrs
            expr = cuda_float(start) if step == 0.0 else \
                f"(float)({start!r} + (double)f * {step!r})"
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
            return
        elif n.kind == "slice":   # features [start, start + length) of its operand
            body.append(f"auto v{i} = [&](int f) -> float {{ (void)f; "
                        f"return v{n.args[0]}(f + {n.attrs[1]}); }};")
            return
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
            return
        elif n.kind == "scan":   # a cumulative sum: a phase staging it, or re-read
            body.append(self._scan(i, n))
            return
        elif n.kind == "wpool":   # torch's windows: padding, ceil_mode, dilation, adaptive
            body.append(self._wpool(i, n))
            return
        elif n.kind == "rred" and n.op in ARG_OPS:
            # argmax/argmin: the largest key over the row (any order: a max of integers),
            # its position a float32 number (an index value; ``store`` writes it as int64)
            a = n.args[0]
            wa = nodes[a].width
            if self.rred_code is not None:   # pragma: no cover - _epilogue excludes them
                raise AssertionError("argmax/argmin in a GEMM epilogue")
            self.shared.append(f"__shared__ {_U64} scr{i}[32];")
            self.shared_bytes += 32 * 8
            body.append(f"float r{i};")
            body.append(f"{{ {_U64} acc = 0ull;\n{UNROLL}\n"
                        f"for (int f = CF_F0; f < {wa}; f += CF_FS) "
                        f"acc = cf_umax64(acc, {ARG_KEYS[n.op]}(v{a}(f), f)); "
                        f"acc = cf_row_combine<{_U64}>(acc, 0ull, {_UMAX}, scr{i}); "
                        f"r{i} = cf_argkey_pos(acc); }}")
            expr = f"r{i}"
        elif n.kind == "rred":
            a = n.args[0]
            ident, comb, acc = REDUCTIONS[n.op]
            body.append(f"float r{i};")
            if self.rred_code is not None:
                body.append(self.rred_code(i, acc, ident, comb))
            else:
                wa = nodes[a].width
                self.shared.append(f"__shared__ {acc} scr{i}[32];")
                self.shared_bytes += 32 * 8
                body.append(f"{{ {acc} acc = {ident};\n{UNROLL}\n"
                            f"for (int f = CF_F0; f < {wa}; f += CF_FS) "
                            f"acc = {comb}(acc, ({acc})v{a}(f)); "
                            f"acc = cf_row_combine<{acc}>(acc, ({acc}){ident}, "
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
                return
            if G > MAX_GROUPS:
                from cupyfuse.ir.program import TailError

                raise TailError(f"group_norm: {G} groups of {g} features is more than the "
                                f"{MAX_GROUPS} group sums one block holds")
            self.shared.append(f"__shared__ float sg{i}[{G}];")
            self.shared_bytes += 4 * G
            body.append(f"{{ const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, "
                        f"nw = blockDim.x >> 5; "
                        f"for (int gi = warp; gi < {G}; gi += nw) {{ double s = 0.0; "
                        f"for (int j = lane; j < {g}; j += 32) s += (double)v{a}(gi * {g} + j); "
                        f"s = cf_warp_combine<double>(s, [](double p, double q) {{ return p + q; }}); "
                        f"if (lane == 0) sg{i}[gi] = (float)s; }} __syncthreads(); }}")
            expr = f"sg{i}[f / {g}]"
        elif n.kind == "remap":   # a gather: feature f reads its operand at an index of f
            _, shape, strides, offset = n.attrs
            terms, inner = [], 1
            for k in reversed(range(len(shape))):
                if strides[k]:
                    q = "f" if inner == 1 else f"(f / {inner})"
                    if k > 0:   # (the outermost index is below its size: f < the width)
                        q = f"({q} % {shape[k]})"
                    terms.append(q if strides[k] == 1 else f"{q} * {strides[k]}")
                inner *= shape[k]
            idx = " + ".join(([str(offset)] if offset else []) + terms[::-1]) or "0"
            body.append(f"auto v{i} = [&](int f) -> float {{ (void)f; "
                        f"return v{n.args[0]}({idx}); }};")
            return
        elif n.kind == "sred":
            expr = self._sred(i, n)
            if not expr:
                return
        else:  # pragma: no cover
            raise AssertionError(n.kind)
        body.append(f"auto v{i} = [&](int f) -> float {{ (void)f; return {expr}; }};")

    def _seq_loop(self, i: int, n: Any) -> str:
        """A sequence reduction inside this kernel (:func:`_inline_seqreds`): its operand
        read in place (any strides, ``sq<i>``), the seq rows of this row's batch element
        (``row``, or ``row / seq`` in a kernel of the batch * seq rows) combined in order
        as tail_seqred.cu's seq_reduce does; an operand of one feature as a row scalar
        computed once per thread."""
        _, s_len, k = n.attrs
        self.add_arg("seq_src", i, f"const float* __restrict__ sq{i}")
        self.add_arg("seq_sb", i, f"long long sq{i}_sb")
        self.add_arg("seq_sf", i, f"long long sq{i}_sf")
        b = f"(row / {s_len}LL)" if self.seq else "row"
        if n.op == "sum":
            loop = (f"double a = 0.0; for (long long s = 0; s < {s_len}LL; ++s) "
                    f"a += (double)p[s * sq{i}_sb]; return (float)a;")
        elif n.op in ("max", "min"):
            fn, init = ("cf_nanmax", "-CF_INF") if n.op == "max" else ("cf_nanmin", "CF_INF")
            loop = (f"float m = {init}; for (long long s = 0; s < {s_len}LL; ++s) "
                    f"m = {fn}(m, p[s * sq{i}_sb]); return m;")
        elif n.op == "take":
            loop = f"return p[{k}LL * sq{i}_sb];"
        else:  # pragma: no cover - Builder.seq_reduce's ops
            raise AssertionError(n.op)
        base = f"sq{i} + {b} * {s_len}LL * sq{i}_sb"
        if self.prog.nodes[n.args[0]].width == 1:
            return (f"const float s{i} = [&]() -> float {{ const float* p = {base}; {loop} }}(); "
                    f"auto v{i} = [&](int f) -> float {{ (void)f; return s{i}; }};")
        return (f"auto v{i} = [&](int f) -> float {{ const float* p = {base} + "
                f"(long long)f * sq{i}_sf; {loop} }};")

    def _scan(self, i: int, n: Any) -> str:
        """A cumulative sum within groups of g features s apart, in program.scan_values'
        order (chunks of SCAN_CHUNK: each feature its chunk's running sum plus the sum of
        the chunks before, in double). Staged: a phase in which each thread runs one
        (group, chunk) and keeps the running sums, then one in which each group's chunk
        offsets are added up in order (``sc<i>``, ``so<i>``: doubles in shared memory);
        past config.SHARED_BUDGET each feature's sum is recomputed where it is read, in the same
        order (the same bits, slower)."""
        a = n.args[0]
        _, g, s = n.attrs
        C = SCAN_CHUNK
        W = self.prog.nodes[i].width
        G, q = W // g, -(-g // C)
        grp = f"(f / {g * s}) * {s} + f % {s}" if s > 1 else f"f / {g}"
        pos = f"(f / {s}) % {g}" if s > 1 else f"f % {g}"
        first = f"(gr / {s}) * {g * s} + gr % {s}" if s > 1 else f"gr * {g}"
        st = f" * {s}" if s > 1 else ""
        nbytes = 8 * W + 8 * G * q
        if self.shared_bytes + nbytes > config.SHARED_BUDGET:
            return (f"auto v{i} = [&](int f) -> float {{ const int gr = {grp}, p = {pos}; "
                    f"const int b0 = {first}; double o = 0.0; "
                    f"for (int c = 0; c < p / {C}; ++c) {{ double t = 0.0; "
                    f"for (int j = c * {C}; j < c * {C} + {C}; ++j) t += (double)v{a}(b0 + j{st}); "
                    f"o += t; }} double r = 0.0; "
                    f"for (int j = (p / {C}) * {C}; j <= p; ++j) r += (double)v{a}(b0 + j{st}); "
                    f"return (float)(o + r); }};")
        self.shared.append(f"__shared__ double sc{i}[{W}];")
        self.shared.append(f"__shared__ double so{i}[{G * q}];")
        self.shared_bytes += nbytes
        return (f"{{ for (int t = threadIdx.x; t < {G * q}; t += blockDim.x) {{ "
                f"const int gr = t / {q}, j0 = (t % {q}) * {C}; const int b0 = {first}; "
                f"const int j1 = j0 + {C} < {g} ? j0 + {C} : {g}; double r = 0.0; "
                f"for (int j = j0; j < j1; ++j) {{ r += (double)v{a}(b0 + j{st}); "
                f"sc{i}[b0 + j{st}] = r; }} }} __syncthreads(); "
                f"for (int gr = threadIdx.x; gr < {G}; gr += blockDim.x) {{ "
                f"const int b0 = {first}; double o = 0.0; "
                f"for (int c = 0; c < {q}; ++c) {{ so{i}[gr * {q} + c] = o; "
                f"const int e = c * {C} + {C} < {g} ? c * {C} + {C} : {g}; "
                f"o += sc{i}[b0 + (e - 1){st}]; }} }} __syncthreads(); }}\n"
                f"auto v{i} = [&](int f) -> float {{ const int gr = {grp}, p = {pos}; "
                f"return (float)(so{i}[gr * {q} + p / {C}] + sc{i}[f]); }};")

    @staticmethod
    def _wpool(i: int, n: Any) -> str:
        """The lambda of a ``wpool`` node: output feature f is window j = f % Lo of channel
        c = f / Lo (its positions at c * L of the operand), by torch's rules: fixed windows
        start at j * s - pad, their positions every dil, those outside [0, L) left out (max
        from -inf, NaN winning; avg from 0 in position order, over the window clipped to
        [-pad, L + pad) with count_include_pad, else over the positions inside; an empty
        one is 0); adaptive window j covers [floor(j * L / Lo), ceil((j + 1) * L / Lo))."""
        a = n.args[0]
        _, c, L, lo, k, s, pad, dil, _, incl, adaptive = n.attrs
        head = (f"auto v{i} = [&](int f) -> float {{ const int c = f / {lo}, j = f % {lo}; "
                f"const int base = c * {L}; ")
        if adaptive:
            win = (f"const int hs = (int)((long long)j * {L} / {lo}), "
                   f"he = (int)(((long long)j * {L} + {L} + {lo} - 1) / {lo}); ")
            if n.op == "max":
                return head + win + (f"float m = -CF_INF; for (int q = hs; q < he; ++q) "
                                     f"m = cf_nanmax(m, v{a}(base + q)); return m; }};")
            return head + win + (f"float m = 0.0f; for (int q = hs; q < he; ++q) "
                                 f"m += v{a}(base + q); return m / (float)(he - hs); }};")
        if n.op == "max":
            return head + (f"const int st = j * {s} - {pad}; float m = -CF_INF; "
                           f"for (int q = 0; q < {k}; ++q) {{ const int p = st + q * {dil}; "
                           f"if (p >= 0 && p < {L}) m = cf_nanmax(m, v{a}(base + p)); }} "
                           f"return m; }};")
        div = "(he0 - hs0)" if incl else "(he - hs)"
        return head + (f"const int hs0 = j * {s} - {pad}; "
                       f"const int he0 = hs0 + {k} < {L + pad} ? hs0 + {k} : {L + pad}; "
                       f"const int hs = hs0 > 0 ? hs0 : 0, he = he0 < {L} ? he0 : {L}; "
                       f"if (hs >= he) return 0.0f; float m = 0.0f; "
                       f"for (int q = hs; q < he; ++q) m += v{a}(base + q); "
                       f"return m / (float){div}; }};")

    def _sred(self, i: int, n: Any) -> str:
        """A split reduction (groups of g features s apart, one result per group): a phase
        staging the G results in shared memory (a thread per group for small groups, a
        warp per group from 32 features; fixed order either way), read back as ``ss<i>``;
        or, past MAX_GROUPS (groups of at most INLINE_GROUP features) or config.SHARED_BUDGET,
        each result recomputed where it is read. Returns the value's expression, or ""
        where the lambda was written here."""
        a = n.args[0]
        _, g, s = n.attrs
        G = self.prog.nodes[a].width // g
        base = f"(q / {s}) * {g * s} + q % {s}" if s > 1 else f"q * {g}"
        step = f" * {s}" if s > 1 else ""
        loop = f"v{a}(b0 + j{step})"
        if n.op in ARG_OPS:
            # argmax/argmin within each group: the keys of positions j (tail_ops.cuh), the
            # largest one's position as a float32 number
            ident, comb, acc, fin = "0ull", "cf_umax64", _U64, "cf_argkey_pos"
            loop = f"{ARG_KEYS[n.op]}({loop}, j)"
        else:
            ident, comb, acc = REDUCTIONS[n.op]
            fin = "(float)"
        if G > MAX_GROUPS or self.shared_bytes + 4 * G > config.SHARED_BUDGET:
            if G > MAX_GROUPS and g > INLINE_GROUP:   # (Builder.sred refuses these)
                from cupyfuse.ir.program import TailError

                raise TailError(f"{n.op}: {G} groups of {g} features is more than the "
                                "group results one block holds")
            # (past the budget, longer groups are re-read too: slower, never refused)
            self.body.append(f"auto v{i} = [&](int q) -> float {{ const int b0 = {base}; "
                             f"{acc} m = {ident}; for (int j = 0; j < {g}; ++j) "
                             f"m = {comb}(m, ({acc}){loop}); return {fin}(m); }};")
            return ""
        self.shared.append(f"__shared__ float ss{i}[{G}];")
        self.shared_bytes += 4 * G
        if g >= 32:
            self.body.append(
                f"{{ const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, "
                f"nw = blockDim.x >> 5; for (int q = warp; q < {G}; q += nw) {{ "
                f"const int b0 = {base}; {acc} m = {ident}; "
                f"for (int j = lane; j < {g}; j += 32) m = {comb}(m, ({acc}){loop}); "
                f"m = cf_warp_combine<{acc}>(m, []({acc} p, {acc} r) {{ return {comb}(p, r); }}); "
                f"if (lane == 0) ss{i}[q] = {fin}(m); }} __syncthreads(); }}")
        else:
            self.body.append(
                f"{{ for (int q = threadIdx.x; q < {G}; q += blockDim.x) {{ "
                f"const int b0 = {base}; {acc} m = {ident}; "
                f"for (int j = 0; j < {g}; ++j) m = {comb}(m, ({acc}){loop}); "
                f"ss{i}[q] = {fin}(m); }} __syncthreads(); }}")
        return f"ss{i}[f]"

    def store(self, t: int) -> str:
        """The statement writing target t at feature f (or once per row); an index value
        (argmax/argmin: a position held as a float32 number) as torch's int64."""
        n = self.prog.nodes[t]
        if self.index is None:
            self.index = self.prog.index_values()
        long = t in self.index
        self.add_arg("out", t, f"{'long long' if long else 'float'}* __restrict__ out{t}")
        self.add_arg("out_sb", t, f"long long out{t}_sb")
        cast = "(long long)" if long else ""
        if n.feature_axis() is not None:
            self.add_arg("out_sf", t, f"long long out{t}_sf")
            return f"out{t}[row * out{t}_sb + (long long)f * out{t}_sf] = {cast}v{t}(f);"
        return f"out{t}[row * out{t}_sb] = {cast}v{t}(0);"


def _generate(prog: Program, lv: Level, lvl: list[int], mat: set[int], seq: int = 0,
              per: list[bool] | None = None) -> None:
    nodes = prog.nodes
    em = _Emitter(prog, lv.index, lvl, mat, seq=seq, per=per, seq_inline=lv.seq_inline)
    for i in _needed(prog, lv.targets, lv.index, lvl, mat):
        em.node(i)
    args, params, body, shared = em.args, em.params, em.body, em.shared
    width_max = em.width_max

    for t in lv.targets:
        n = nodes[t]
        st = em.store(t)
        if n.feature_axis() is not None:
            body.append(f"{UNROLL}\nfor (int f = CF_F0; f < {n.width}; f += CF_FS) {st}")
        else:
            body.append(f"if (threadIdx.x == 0 && cf_row_part() == 0) {{ const int f = 0; (void)f; {st} }}")

    lv.threads = _threads(width_max)
    lv.width_max = width_max
    lv.split = config.SPLIT_PARTS if (config.SPLIT_PARTS > 1 and width_max >= config.SPLIT_MIN_WIDTH and not seq
                               and _splittable(shared, body)) else 0
    decl = ",\n    ".join(params)
    names = ", ".join(p.split()[-1] for p in params)

    def row_fn(suffix: str, lines: list[str]) -> str:
        row = [f"__device__ __forceinline__ void @NAME@_{suffix}(",
               f"    const long long row, {decl}) {{", "    (void)batch;"]
        row += ["    " + x for x in shared]
        row += ["    " + x for x in lines]
        row.append("}")
        return "\n".join(row) + "\n"

    # one block per row: the plain loops and combines (as before rows could split)
    row_text = row_fn("row", [_unsplit(b) for b in body])
    kern = [f"extern \"C\" __global__ void __launch_bounds__({lv.threads}) @NAME@(",
            f"    {decl}) {{",
            "    const long long row = blockIdx.x;",
            "    if (row >= batch) return;",
            "    cf_grid_dependency_wait();",
            f"    @NAME@_row(row, {names});",
            "}"]
    text_rows = row_text
    if lv.split:
        # the `_cl` entry: each row over a cluster of config.SPLIT_PARTS blocks (Level.launch),
        # its loops of a fixed stride and its values read again kept in registers; every
        # block waits for the others before it exits (cf_row_end: they read its scratch)
        lv.split_threads = min(lv.threads, config.SPLIT_THREADS)
        widths = {i: prog.nodes[i].width for i in range(len(prog.nodes))
                  if prog.nodes[i].feature_axis() is not None}
        text_rows += "\n" + row_fn("rowc", _cluster_row(body, lv.split * lv.split_threads, widths))
        kern += [f"extern \"C\" __global__ void CF_ROW_CLUSTER({lv.split}) "
                 f"__launch_bounds__({lv.split_threads}) @NAME@_cl(",
                 f"    {decl}) {{",
                 f"    const long long row = blockIdx.x / {lv.split};",
                 "    if (row >= batch) return;",
                 "    cf_grid_dependency_wait();",
                 f"    @NAME@_rowc(row, {names});",
                 "    cf_row_end();",
                 "}"]
    head = "#include \"tail_ops.cuh\"\n#ifndef CF_LDH\n#define CF_LDH(p) (*(p))\n#endif\n\n"
    text = head + text_rows + "\n" + "\n".join(kern) + "\n"
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    lv.name = f"cf_tail_L{lv.index}_{digest}"
    lv.kernel = text.replace("@NAME@", lv.name)
    lv.row_source = row_text.replace("@NAME@", lv.name)
    lv.params = list(params)
    lv.args = args


# ---------------------------------------------------------------------------------
# a level inside the GEMM: the epilogue of kernels_cu/gemm_sm90.cuh
@dataclass
class Epilogue:
    """A level run as the epilogue of the sm90 engine's 3xTF32 GEMM (one launch: the GEMM
    output is never written). ``kernel``: the source of kernel ``name``, whose parameters
    are the GEMM's (five tensor maps, M, N, K, the row-block counters and the parts
    buffer) followed by the level's own (``args``, as :attr:`Level.args` but without the
    GEMM output). ``nred`` row reductions leave one double per (reduction, row, 128-column
    tile) in the parts buffer."""

    name: str
    kernel: str
    args: list[tuple[str, Any]]
    nred: int
    gemm: int


#: the parameters every epilogue kernel starts with (gemm_sm90.cuh's mainloop, then its
#: epilogue's workspace)
EPI_GEMM_PARAMS = ("const __grid_constant__ CfTensorMap ta", "const __grid_constant__ CfTensorMap tb",
                   "const __grid_constant__ CfTensorMap tas", "const __grid_constant__ CfTensorMap tbs",
                   "const __grid_constant__ CfTensorMap tah", "int M", "int N", "int K",
                   "unsigned int* __restrict__ counters", "double* __restrict__ part")
_EPI_KINDS = {"input", "param", "const", "iota", "map", "view", "rred"}


def _epilogue(prog: Program, lv: Level, lvl: list[int], mat: set[int],
              users: list[list[int]]) -> Epilogue | None:
    """The level as its GEMM's epilogue, or None where it is not one: exactly one plain
    GEMM (no folded weight) read by this level only; every value elementwise in (row,
    column of the GEMM output) -- maps of the GEMM output, parameters, inputs, constants
    and earlier levels' buffers, all of the GEMM's width or none -- or a row value made
    from one-pass row reductions of such values (no reduction inside another's operand,
    no row statistic applied back to the row: those are T3 and keep their own kernel);
    and at most config.EPI_MAX_COST transcendental functions per element."""
    nodes = prog.nodes
    if not config.EPILOGUES or len(lv.gemms) != 1 or lv.bns or not lv.targets:
        return None
    if prog.index_values() & set(lv.targets):
        return None   # argmax/argmin: a reduction of keys (and an int64 store) of its own
    g = lv.gemms[0]
    gn = nodes[g]
    N = gn.width
    if gn.kind != "gemm" or len(gn.attrs) > 2 or g == prog.out or g in prog.more_outs or gn.feature_axis() is None:
        return None
    if any(lvl[u] != lv.index or nodes[u].kind in ("gemm", "gemv", "bn") for u in users[g]):
        return None
    feat = [t for t in lv.targets if nodes[t].feature_axis() is not None]
    rows = [t for t in lv.targets if nodes[t].feature_axis() is None]
    row_cone = _needed(prog, rows, lv.index, lvl, mat, stop_rred=True)
    reds = [i for i in row_cone if nodes[i].kind == "rred" and lvl[i] == lv.index]
    if rows and not reds:
        return None   # a row value without a reduction of this GEMM: nothing to finish it
    elem_cone = _needed(prog, feat + [nodes[r].args[0] for r in reds], lv.index, lvl, mat)
    def loaded(i: int) -> bool:   # an earlier level's buffer
        return lvl[i] < lv.index and nodes[i].has_batch and i in mat

    for i in set(elem_cone) | set(row_cone):
        n = nodes[i]
        if not loaded(i) and n.kind not in _EPI_KINDS and i != g:
            return None
        if n.feature_axis() is not None and n.width != N:
            return None
    if any(nodes[i].kind == "rred" and not loaded(i) for i in elem_cone):
        return None   # a reduction feeding an element (softmax, norms) or another reduction
    if any(nodes[r].op not in REDUCTIONS or nodes[nodes[r].args[0]].feature_axis() is None
           for r in reds):
        return None
    if sum(MAPS[nodes[i].op].cost for i in elem_cone if nodes[i].kind == "map") > config.EPI_MAX_COST:
        return None   # math-heavy: faster as its own kernel after the GEMM
    # the element function: the feature targets' values and the reductions' operands
    el = _Emitter(prog, lv.index, lvl, mat, gemm_expr="hval")
    for i in elem_cone:
        el.node(i)
    elem = list(el.body)
    for t in feat:
        elem.append(el.store(t))
    acc_fields, reset, lanes, parts = [], [], [], []
    for k, r in enumerate(reds):
        ident, comb, acc = REDUCTIONS[nodes[r].op]
        a = nodes[r].args[0]
        acc_fields.append(f"{acc} a{k};")
        reset.append(f"a.a{k} = {ident};")
        elem.append(f"acc.a{k} = {comb}(acc.a{k}, ({acc})v{a}(f));")
        lanes.append(f"a.a{k} = {comb}(a.a{k}, __shfl_xor_sync(0xffffffffu, a.a{k}, 1)); "
                     f"a.a{k} = {comb}(a.a{k}, __shfl_xor_sync(0xffffffffu, a.a{k}, 2));")
        parts.append(f"part[({k}LL * batch + row) * tiles_n + tn] = (double)a.a{k};")
    # the row function: the row targets from the reductions' parts, in tile order
    slot = {r: k for k, r in enumerate(reds)}
    el.body = []
    el.gemm_expr = None
    el.rred_code = lambda i, acc, ident, comb: (
        f"{{ {acc} a = {ident}; for (int t = 0; t < tiles_n; ++t) a = {comb}(a, ({acc})"
        f"__ldcg(part + ({slot[i]}LL * batch + row) * tiles_n + t)); r{i} = (float)a; }}")
    for i in row_cone:
        el.node(i)
    final = list(el.body) + ["const int f = 0; (void)f;"] + [el.store(t) for t in rows]
    if any(kind == "gemm" for kind, _ in el.args):   # pragma: no cover - excluded above
        raise AssertionError("an epilogue reads its own GEMM's buffer")
    members = [p.replace("__restrict__ ", "") + ";" for p in el.params]
    assign = " ".join(f"e.{p.split()[-1]} = {p.split()[-1]};" for p in el.params)
    decl = ",\n    ".join(EPI_GEMM_PARAMS + tuple(el.params))
    ind = "\n        "
    text = f"""#include "gemm_sm90.cuh"
#include "tail_ops.cuh"

struct @NAME@_epi {{
    struct Acc {{ {" ".join(acc_fields)} }};
    static constexpr bool kRows = {"true" if reds else "false"};
    unsigned int* counters;
    double* part;
    {(chr(10) + "    ").join(members)}
    __device__ __forceinline__ void begin_tile(int) const {{}}
    __device__ __forceinline__ void reset(Acc& a) const {{ (void)a; {" ".join(reset)} }}
    __device__ __forceinline__ void combine_lanes(Acc& a) const {{ (void)a; {" ".join(lanes)} }}
    __device__ __forceinline__ void elem(const long long row, const int f, const float hval, Acc& acc) const {{
        (void)batch; (void)acc; (void)hval;
        {ind.join(elem)}
    }}
    __device__ __forceinline__ void partial(const long long row, int tn, int tiles_n, const Acc& a) const {{
        (void)row; (void)tn; (void)tiles_n; (void)a;
        {" ".join(parts)}
    }}
    __device__ __forceinline__ void row_final(const long long row, const int tiles_n) const {{
        (void)row; (void)tiles_n;
        {ind.join(final) if rows else ""}
    }}
}};

extern "C" __global__ void __launch_bounds__(384, 1) @NAME@(
    {decl}) {{
    @NAME@_epi e;
    e.counters = counters; e.part = part; {assign}
    gemm_sm90_impl<@NAME@_epi>(&ta, &tb, &tas, &tbs, &tah, M, N, K, 1, e);
}}
"""
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    name = f"cf_epi_L{lv.index}_{digest}"
    return Epilogue(name, text.replace("@NAME@", name), list(el.args), len(reds), g)


def fused_skinny_source(lv: Level, mt: int, skinny_header: str) -> tuple[str, str]:
    """(name, source) of one kernel that runs the skinny GEMM (``skinny_header``: the
    expanded ``kernels_cu/gemm_skinny.cuh``, ``mt`` rows per tile) and then, in the last
    ``ntail`` blocks to finish, this level's tail (rows j, j + ntail, ...): the GEMM and
    its tail in one launch. Parameters: the skinny kernel's, ``done`` (two counters) and
    ``ntail``, then the level's. (16-row tiles: the tensor-core tile, with its entry
    point's block and launch bounds.)"""
    name = f"{lv.name}_sk{mt}"
    bounds = "SKW_WG * 128, SKW_MINB" if mt == 16 else "SK_WARPS * 32, SK_MINB"
    names = ", ".join(p.split()[-1] for p in lv.params)
    decl = ",\n    ".join(lv.params)
    gemm_args = "x, ldx, w, ldw, M, N, K, kspan, y, ldy, part, counters, done, ntail"

    def tile(vec: int) -> str:   # 16-row tiles run on the tensor cores (engine._SKINNY_FN)
        return f"skinny_tile_wg<{vec}>" if mt == 16 else f"skinny_tile<{mt}, SK_CPW, {vec}>"

    src = ["#include \"tail_ops.cuh\"", "#define CF_LDH(p) __ldcg(p)", skinny_header,
           lv.row_source,
           f"extern \"C\" __global__ void __launch_bounds__({bounds}) {name}(",
           "    const float* __restrict__ x, long long ldx, const float* __restrict__ w,",
           "    long long ldw, int M, int N, int K, int kspan, float* y, long long ldy,",
           "    float* __restrict__ part, unsigned int* __restrict__ counters, int vec,",
           f"    unsigned int* __restrict__ done, int ntail, {decl}) {{",
           f"    const int j = vec ? {tile(1)}({gemm_args})",
           f"                      : {tile(0)}({gemm_args});",
           "    if (j < 0) return;",
           "    for (long long row = j; row < batch; row += ntail) {",
           f"        {lv.name}_row(row, {names});",
           "        __syncthreads();",
           "    }",
           "}"]
    return name, "\n".join(src) + "\n"


def ksum_source(lv: Level, splits: int, split_stride: int) -> tuple[str, str]:
    """(name, source) of this level's tail kernel reading its GEMM's value as the sum of
    ``splits`` split-K partial products ``split_stride`` floats apart (tail_ops.cuh's
    cf_ksum, splitk_sum's order): the prepared launches' split-K GEMM without its
    splitk_sum launch."""
    name = f"{lv.name}_ks{splits}_{split_stride}"
    text = f"#define CF_LDH(p) cf_ksum((p), {splits}, {split_stride}LL)\n" + \
        lv.kernel.replace(lv.name, name)
    return name, text


_plans: dict[int, Plan] = caches.register("code generator plans", {})


def compile_program(prog: Program) -> Plan:
    """The plan (levels and generated kernel sources) of a program, cached by identity."""
    p = _plans.get(id(prog))
    if p is None or p.prog is not prog:
        p = plan(prog)
        _plans[id(prog)] = p
    return p


def kernel_source(p: Plan) -> str:
    """All generated kernels of a plan in one translation unit (for nvcc checks)."""
    parts = [lv.kernel for lv in p.levels if lv.kernel]
    if not parts:
        return ""
    head = parts[0].split("\n", 1)[0]
    return head + "\n" + "\n".join(x.split("\n", 1)[1] for x in parts)
