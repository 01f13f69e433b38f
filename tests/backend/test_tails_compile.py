"""Generated tail kernels compile with nvcc for Hopper (sm_90a) without register spills.

~20 tails drawn with tests/gen/tails.py from fixed seeds (every op family: reductions,
softmax, LayerNorm, GroupNorm, BatchNorm in train and eval mode, pooling, a second
Linear, a second input, x added back, sums that become GEMVs), plus hand-written wide
ones (GroupNorm with staged and with re-read groups, 256-thread blocks), go through
``FusedModel.program`` and ``codegen.plan``, with the backward programs of those
the derivative covers (cupyfuse.ir.derivative; one tail of every op's derivative); every level's kernel is written after
``runtime.expand_source("tail_ops.cuh")`` into a few .cu files that nvcc compiles
(``-cubin -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v``) in parallel.
Each kernel must appear in ptxas' report with 0 bytes of spill stores.
``kernels_cu/tail_colstat.cu`` (BatchNorm's column statistics) likewise.

CPU only: skipped when nvcc is not on PATH.
"""
from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cupyfuse import config
from cupyfuse.backend import codegen, runtime
from cupyfuse.ir.derivative import NoDerivative, derivative
import cupyfuse
from gen.tails import TailSpec, seeded
from helpers import program_of

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")

_ENTRY_RE = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PROPS_RE = re.compile(r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, "
                       r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_FILES = 3  # .cu files compiled in parallel

# (name, generate() keywords, seed): the drawn tails
DRAWN: list[tuple[str, dict, int]] = (
    [(f"any{s}", {}, s) for s in range(8)]
    + [("bn_train", dict(mode="train", force=("batchnorm",)), 101),
       ("bn_train2", dict(mode="train", force=("batchnorm", "stage", "batchnorm")), 102),
       ("bn_eval", dict(mode="eval", force=("batchnorm",)), 103),
       ("groupnorm", dict(force=("groupnorm", "groupnorm")), 104),
       ("pool_softmax", dict(force=("pool", "softmax")), 105),
       ("reduce_stage", dict(force=("reduce", "stage")), 106),
       ("second_input", dict(has_y=True, force=("y", "layernorm")), 107),
       ("x_added", dict(K=24, N=24, force=("x",)), 108),
       ("affine_sum", dict(allow=("const", "param", "reduce"), force=("reduce",),
                           reduce_kinds=("sum", "mean")), 109),
       ("normalize_residual", dict(force=("normalize", "residual")), 110)]
)


class _Wide(nn.Module):
    """Hand-written wide tails: block sizes and group-sum strategies the drawn sizes miss."""

    def __init__(self, n: int, groups: int) -> None:
        super().__init__()
        self.fc = nn.Linear(8, n)
        self.gn = nn.GroupNorm(groups, n)
        self.p = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * self.p
        h = self.gn(h)
        return torch.softmax(h, dim=1) + h.amax(dim=1, keepdim=True)


class _EveryOp(nn.Module):
    """Every elementwise op of the vocabulary in one tail (each CUDA fragment compiles)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 32)
        self.prelu = nn.PReLU(32)
        self.p = nn.Parameter(torch.rand(32) + 0.5)

    def terms(self, h: torch.Tensor) -> list[torch.Tensor]:
        a = h.abs() + 1.0
        t = [h + self.p, h - 1.0, h * self.p, h / self.p, torch.maximum(h, -h),
             torch.minimum(h, self.p), a ** 1.5, -h, torch.relu(h), torch.sigmoid(h),
             torch.tanh(h), F.gelu(h), F.gelu(h, approximate="tanh"), F.silu(h), F.mish(h),
             torch.exp(h.clamp(max=5.0)), torch.log(a), torch.log1p(a), torch.sqrt(a),
             torch.rsqrt(a), torch.square(h), torch.reciprocal(a), F.hardswish(h),
             F.hardsigmoid(h), F.relu6(h), F.leaky_relu(h, 0.2), F.elu(h, 0.5),
             F.softplus(h, 2.0, 10.0), h.clamp(-1.0, 2.0), torch.erf(h), torch.sin(h),
             torch.cos(h), torch.expm1(h.clamp(max=5.0)), torch.log2(a), self.prelu(h),
             F.selu(h), F.celu(h, 0.7), F.softsign(h), F.tanhshrink(h), F.logsigmoid(h),
             F.rrelu(h, 0.1, 0.3, training=False), torch.where(h > 0, h, 0.1 * h),
             h * (h < 1.0), h.masked_fill((h >= 2.0) | (h <= -2.0), 0.5),
             torch.where((h == 0) & ~(h != h), 1.0, h), F.threshold(h, 0.1, 2.0),
             F.hardshrink(h, 0.4), F.softshrink(h, 0.3), torch.atan(h), torch.sinh(h.clamp(-3, 3)),
             torch.cosh(h.clamp(-3, 3)), torch.asinh(h), torch.hypot(h, a),
             torch.atan2(h, a), torch.logaddexp(h, -h), torch.fmod(h, 3.0)]
        return t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.terms(self.fc(x))
        out = t[0]
        for v in t[1:]:
            out = out + v
        a, b = out.chunk(2, dim=1)   # feature slices
        joined = torch.cat([a, torch.maximum(b, torch.zeros_like(b)), out.sum(1, keepdim=True)], 1)
        return torch.logsumexp(F.silu(a) * b + F.glu(out, dim=1) + out[:, 3:19], dim=1) \
            + joined.amax(1) + F.max_pool1d(out.unsqueeze(1), 3, 2).squeeze(1).mean(1)


class _EveryOpSum(_EveryOp):
    """The terms of _EveryOp summed: its backward program holds every op's derivative."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.terms(self.fc(x))
        out = t[0]
        for v in t[1:]:
            out = out + v
        return out


class _Arg(nn.Module):
    """argmax / argmin (tests/frontend/test_argmax.py): positions over a row (64-bit keys combined
    over the block), over split features (a group per thread, a warp per group, or
    re-read past the shared-memory budget), max/min's values beside their indices, int64
    stores next to float ones."""

    def __init__(self, n: int, heads: int) -> None:
        super().__init__()
        self.fc = nn.Linear(8, n)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> tuple:
        h = self.fc(x)
        v, i = h.max(-1)
        s = h.view(-1, self.heads, h.shape[1] // self.heads)
        return (h, i, v, torch.argmin(h, 1, keepdim=True), s.argmax(-1), s.min(1)[1],
                h.argmax(-1).float() * 2.0)


#: (case, features, heads): groups of 8 features (a thread per group), of 64 (a warp per
#: group), 20000 features in 10000 groups of 2 (re-read: past MAX_GROUPS), 1024 threads
ARG = [("arg_small", 24, 3), ("arg_warps", 1024, 16), ("arg_reread", 20000, 10000)]

WIDE = [("wide_gn_staged", 4096, 2), ("wide_gn_small_groups", 20000, 10000),
        ("wide_gn_many", 1000, 250), ("mid_128_threads", 300, 3)]

#: wide rows whose levels split over a cluster (their `_cl` entry: the fixed-stride row
#: function keeping values in registers, codegen._cluster_row): drawn tails at 8192 and
#: 20000 features (a partial last step), and softmax-like tails at 32768 (8 steps per
#: thread: the most kept values, config.CACHE_FLOATS)
SPLIT = [(f"split{s}_{n}", n, s) for s, n in ((3, 8192), (5, 20000), (6, 8192), (7, 8192))]


#: the cases whose backward programs compile too
BACKWARD = ("any1", "any3", "any6", "groupnorm", "second_input", "normalize_residual",
            "wide_gn_staged", "split5_20000", "split_softmaxes")


class _Softmaxes(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.fc = nn.Linear(8, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        a = torch.softmax(F.gelu(h), dim=1)
        c = (h - h.mean(dim=1, keepdim=True)) / (h.std(dim=1, keepdim=True) + 1e-5)
        return a * torch.sigmoid(c) + torch.logsumexp(c * a, dim=1, keepdim=True)


#: several results given nodes of their own (Program.own_results: a repeated value, an
#: input, a bias-free GEMM's output returned twice; tests/frontend/test_own_results.py)
OWN = [("own_repeated", ("h", "h.clone", "relu", "F.relu")),
       ("own_inputs", ("h", "x.clone", "m")),
       ("own_gemm", ("g", "g.clone", "g.slice", "x.unsqueeze"))]


def _programs() -> list[tuple[str, Any]]:
    out = []
    for name, kw, seed in DRAWN:
        spec: TailSpec = seeded(seed, **kw)
        model = spec.make_model(seed)
        inputs = spec.make_inputs(4, "rand", seed)
        out.append((name, program_of(model, *inputs)))
    for name, n, g in WIDE:
        torch.manual_seed(0)
        out.append((name, program_of(_Wide(n, g), torch.rand(4, 8))))
    torch.manual_seed(0)
    out.append(("every_op", program_of(_EveryOp(), torch.rand(4, 8))))
    for name, n, heads in ARG:
        torch.manual_seed(0)
        out.append((name, program_of(_Arg(n, heads), torch.rand(4, 8))))
    for name, n, seed in SPLIT:
        spec = seeded(seed, N=n)
        out.append((name, program_of(spec.make_model(seed),
            *spec.make_inputs(4, "rand", seed))))
    torch.manual_seed(0)
    out.append(("split_softmaxes", program_of(_Softmaxes(32768), torch.rand(4, 8))))
    from test_own_results import Several

    for name, forms in OWN:
        spec = {"k": 8, "n": 24, "lo": 3, "hi": 17, "mw": 5, "forms": forms,
                "container": "tuple"}
        torch.manual_seed(0)
        out.append((name, program_of(Several(spec), torch.rand(4, 8),
                                                            torch.rand(4, 5))))
    # backward programs (cupyfuse.ir.derivative): every op's derivative, and those of
    # drawn, wide and split tails
    torch.manual_seed(0)
    grads = [("every_op_sum", program_of(_EveryOpSum(), torch.rand(4, 8)))]
    grads += [(n, p) for n, p in out if n in BACKWARD]
    from test_derivative import _BnHead, _Heads, _Tokens   # (split reductions, pools,
    # sequences, batch statistics)

    torch.manual_seed(0)
    grads.append(("heads_pools", program_of(_Heads(), torch.rand(4, 10))))
    grads.append(("tokens", program_of(_Tokens(), torch.rand(4, 3, 6))))
    grads.append(("bn_head", program_of(_BnHead().train(), torch.rand(4, 6))))
    for name, prog in grads:
        p = prog.unrewritten if prog.unrewritten is not None else prog
        try:
            bw = derivative(p, frozenset(range(p.n_inputs)), frozenset(range(len(p.sources))))
        except NoDerivative:
            continue
        out.append(("bw_" + name, bw.prog))
    assert any(n == "bw_every_op_sum" for n, _ in out)
    return out


def _compile(src: Path, out: Path) -> subprocess.Popen:
    cmd = [NVCC, "-cubin", "-o", str(out), "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
           "-Xptxas", "-v", str(src)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Plan every program, compile all kernels (a few .cu files at once) and
    tail_colstat.cu; returns {"kernels": {case: [names]}, "props": {name: (stack,
    stores, loads)}, "entries": set, "logs": [...], "rc": [...]}."""
    tmp = tmp_path_factory.mktemp("tails_cu")
    header = runtime.expand_source("tail_ops.cuh")
    kernels: dict[str, list[str]] = {}
    bodies: dict[str, str] = {}
    for case, prog in _programs():
        pl = codegen.plan(prog)
        names = []
        for lv in pl.levels:
            if not lv.kernel:
                continue
            first, body = lv.kernel.split("\n", 1)
            assert first.strip() == '#include "tail_ops.cuh"', first
            assert lv.name in body, (lv.name, body[:200])
            bodies.setdefault(lv.name, body)
            names.append(lv.name)
        kernels[case] = names
    chunks: list[list[str]] = [[] for _ in range(_FILES)]
    for i, name in enumerate(sorted(bodies)):
        chunks[i % _FILES].append(name)
    procs = []
    for i, chunk in enumerate(chunks):
        if not chunk:
            continue
        src = tmp / f"tails_{i}.cu"
        src.write_text(header + "\n" + "\n".join(bodies[n] for n in chunk))
        procs.append((src, _compile(src, tmp / f"tails_{i}.cubin")))
    colstat = tmp / "tail_colstat.cu"
    colstat.write_text(runtime.expand_source("tail_colstat.cu"))
    procs.append((colstat, _compile(colstat, tmp / "tail_colstat.cubin")))
    logs, rcs = [], []
    for src, p in procs:
        log, _ = p.communicate(timeout=600)
        logs.append((src.name, log))
        rcs.append((src.name, p.returncode))
    text = "\n".join(log for _, log in logs)
    props = {m.group(1): tuple(int(m.group(i)) for i in (2, 3, 4)) for m in _PROPS_RE.finditer(text)}
    entries = {m.group(1) for m in _ENTRY_RE.finditer(text)}
    return {"kernels": kernels, "props": props, "entries": entries, "logs": logs, "rc": rcs,
            "sources": list(bodies.values())}


def _log(c: dict[str, Any], which: str) -> str:
    return "\n".join(log for name, log in c["logs"] if name.startswith(which))[-6000:]


def test_nvcc_succeeds(compiled: dict[str, Any]) -> None:
    for name, rc in compiled["rc"]:
        assert rc == 0, f"nvcc failed on {name}:\n{_log(compiled, name)}"


@pytest.mark.parametrize("case", [d[0] for d in DRAWN] + [w[0] for w in WIDE]
                         + [o[0] for o in OWN] + [a[0] for a in ARG])
def test_kernels_compile_without_spills(compiled: dict[str, Any], case: str) -> None:
    _check_spills(compiled, case, 0)


def _check_spills(compiled: dict[str, Any], case: str, most: int) -> None:
    """Every kernel of ``case`` compiled by ptxas, spilling at most ``most`` bytes."""
    names = compiled["kernels"][case]
    assert names, f"{case}: the plan generated no kernel"
    for name in names:
        assert name in compiled["entries"], (
            f"{case}: ptxas did not compile {name}:\n{_log(compiled, 'tails')}")
        stack, stores, loads = compiled["props"][name]
        assert stores <= most, \
            f"{case}: {name} spills {stores} bytes (stack frame {stack} bytes)"


@pytest.mark.parametrize("case", ["bw_every_op_sum", "bw_heads_pools", "bw_tokens", "bw_bn_head"]
                         + [f"bw_{n}" for n in BACKWARD])
def test_backward_kernels_compile(compiled: dict[str, Any], case: str) -> None:
    """Backward programs' kernels compile; a few spill a little (at most 32 bytes: the
    forward's values and their adjoints live together in one row function)."""
    _check_spills(compiled, case, 32)


@pytest.mark.parametrize("case", [c[0] for c in SPLIT] + ["split_softmaxes"])
def test_cluster_entries_compile_without_spills(compiled: dict[str, Any], case: str) -> None:
    """The `_cl` entries (rows over a cluster) of wide tails' levels: compiled, no spills;
    the softmax-like case's split level keeps values in registers."""
    pl = {lv.name: lv for _, prog in _programs() if _ == case for lv in codegen.plan(prog).levels}
    split = [lv for lv in pl.values() if lv.kernel and lv.split]
    if case == "split_softmaxes":
        assert split and any("float c" in lv.kernel.split("_rowc(")[1] for lv in split)
    for lv in split:
        name = lv.name + "_cl"
        assert name in compiled["entries"], f"{case}: ptxas did not compile {name}"
        stack, stores, loads = compiled["props"][name]
        assert stores == 0, f"{case}: {name} spills {stores} bytes (stack frame {stack} bytes)"


def test_colstat_compiles_without_spills(compiled: dict[str, Any]) -> None:
    assert dict(compiled["rc"])["tail_colstat.cu"] == 0, _log(compiled, "tail_colstat")
    log = _log(compiled, "tail_colstat")
    found = {m.group(1): int(m.group(3)) for m in _PROPS_RE.finditer(log)}
    assert {"colstat_partial", "colstat_finalize"} <= set(found), log
    assert all(v == 0 for v in found.values()), found


def test_every_vocabulary_fragment_is_compiled(compiled: dict[str, Any]) -> None:
    """Each map op's CUDA fragment (its function, where it calls one) is in a kernel that
    nvcc compiled: an op added to the op table (cupyfuse/ops/registry.py) is compiled
    here."""
    from cupyfuse.ops.registry import MAPS

    text = "\n".join(compiled["sources"])
    for name, op in MAPS.items():
        m = re.match(r"\s*(\w+)\(", op.cuda)
        if m:
            assert f"{m.group(1)}(" in text, f"the fragment of {name} ({op.cuda}) is never compiled"


def test_argmax_kernels_are_compiled(compiled: dict[str, Any]) -> None:
    """The argmax/argmin cases reach every form of the key reduction nvcc must compile: a
    block's (row), a warp's and a thread's (split groups), re-read groups, int64 stores."""
    text = "\n".join(compiled["sources"])
    for frag in ("cf_argmax_key(", "cf_argmin_key(", "cf_block_combine<unsigned long long>",
                 "cf_warp_combine<unsigned long long>", "long long* __restrict__ out",
                 "= (long long)v", "unsigned long long m = 0ull; for (int j = 0; j < 2; ++j)"):
        assert frag in text, frag


def test_every_op_model_matches_float64_on_cpu() -> None:
    torch.manual_seed(1)
    m = _EveryOp()
    x = torch.randn(6, 8)
    x[2, 3] = float("nan")
    x[4, 1] = float("inf")
    with torch.no_grad():
        want = copy.deepcopy(m).double()(x.double())
        got = cupyfuse.from_model(m)(x)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isnan(got), torch.isnan(want.float())), (got, want)
    torch.testing.assert_close(got[fin].double(), want[fin], atol=1e-4, rtol=1e-4)


def test_drawn_tails_cover_the_kernel_features(compiled: dict[str, Any]) -> None:
    """The drawn programs reach the kernel features this test is meant to compile."""
    kinds: set[str] = set()
    for _, prog in _programs():
        kinds |= {n.kind for n in prog.nodes}
    assert {"gemm", "gemv", "rred", "gred", "pool", "bn", "view", "param", "input"} <= kinds, kinds


# the skinny GEMM with a level's tail in the same launch (cupyfuse.backend.prepared, small batches)
FUSED_CASES = ("any0", "pool_softmax", "reduce_stage", "normalize_residual", "wide_gn_staged",
               "arg_small")


@pytest.fixture(scope="module")
def compiled_fused(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fused_cu")
    head = runtime.expand_source("tail_ops.cuh")
    skinny = runtime.expand_source("gemm_skinny.cuh")
    procs, names = [], []
    progs = dict(_programs())
    for case in FUSED_CASES:
        pl = codegen.plan(progs[case])
        lv = next((lv for lv in pl.levels if lv.kernel and len(lv.gemms) == 1 and not lv.bns), None)
        assert lv is not None, f"{case}: no level with one GEMM and a tail"
        for mt in (1, 16):   # 16: the tensor-core tile
            name, text = codegen.fused_skinny_source(lv, mt, skinny)
            first, body = text.split("\n", 1)
            assert first == '#include "tail_ops.cuh"'
            src = tmp / f"{name}.cu"
            src.write_text(head + body)
            names.append(name)
            procs.append((name, _compile(src, tmp / f"{name}.cubin")))
        # the tail reading a split-K GEMM's partial products (prepared engine launches)
        name, text = codegen.ksum_source(lv, 16, 128 * 1024)
        define, first, body = text.split("\n", 2)
        assert define.startswith("#define CF_LDH(p) cf_ksum(") and \
            first == '#include "tail_ops.cuh"'
        src = tmp / f"{name}.cu"
        src.write_text(define + "\n" + head + body)
        procs.append((name, _compile(src, tmp / f"{name}.cubin")))
    out = {}
    for name, p in procs:
        log, _ = p.communicate(timeout=600)
        out[name] = (p.returncode, log)
    return out


def test_fused_skinny_tails_compile_without_spills(compiled_fused: dict[str, Any]) -> None:
    assert len(compiled_fused) == 3 * len(FUSED_CASES)
    for name, (rc, log) in compiled_fused.items():
        assert rc == 0, f"nvcc failed on {name}:\n{log[-4000:]}"
        props = {m.group(1): tuple(int(m.group(i)) for i in (2, 3, 4))
                 for m in _PROPS_RE.finditer(log)}
        assert name in props, f"{name} is not an entry function:\n{log[-2000:]}"
        assert props[name][1] == 0, f"{name} spills {props[name][1]} bytes"


_ARG_CODES = {"i64": "q", "in_sb": "q", "in_sf": "q", "param_sf": "q", "out_sb": "q",
              "out_sf": "q", "buf": "P", "bn_mean": "P", "bn_invstd": "P", "input": "P",
              "gemm": "P", "param": "P", "out": "P", "seq_src": "P", "seq_sb": "q",
              "seq_sf": "q"}


def test_generated_kernels_launch_formats_follow_their_arguments() -> None:
    """The launch format read from a generated kernel's signature (runtime.kernel_formats)
    matches the arguments the general path and the prepared launches pass (codegen's
    Level.args), for every drawn program; the skinny-fused form takes the skinny kernel's
    parameters, the two tail counters and then the level's."""
    skinny = runtime.expand_source("gemm_skinny.cuh")
    sk_fmt = runtime.kernel_formats(runtime.expand_source("gemm_skinny.cu"))["gemm_skinny_1"]
    n = 0
    for case, prog in _programs():
        for lv in codegen.plan(prog).levels:
            if not lv.kernel:
                continue
            want = "".join(_ARG_CODES[kind] for kind, _ in lv.args)
            assert runtime.kernel_formats(lv.kernel)[lv.name] == want, (case, lv.name)
            if len(lv.gemms) == 1 and not lv.bns:
                name, text = codegen.fused_skinny_source(lv, 16, skinny)
                assert runtime.kernel_formats(text)[name] == sk_fmt + "Pi" + want, (case, name)
                name, text = codegen.ksum_source(lv, 4, 1 << 20)
                assert runtime.kernel_formats(text)[name] == want, (case, name)
            n += 1
    assert n >= 10


# ---------------------------------------------------------------------------------
# levels inside the GEMM: codegen.Epilogue kernels (gemm_sm90.cuh's mainloop + a tail)
class _T0(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 40)
        self.p = nn.Parameter(torch.rand(40) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(self.fc(x) * self.p - 0.5, 0.1)


class _T2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(x))
        return torch.sigmoid(h).sum(dim=1, keepdim=True) * 2.0 + h.amin(dim=1, keepdim=True)


class _RowBack(nn.Module):   # a row mean read back by every element (T3)
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.tanh(h) + h.mean(dim=1, keepdim=True)


class _T3(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc(x), dim=1)


class _LSE(nn.Module):   # a reduction inside another's operand (max, then sum of exp)
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(self.fc(x), dim=1)


class _Chain(nn.Module):   # the first level feeds a second GEMM: an elementwise target
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 40)
        self.b = nn.Linear(40, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.relu(self.a(x))).amax(dim=1)


class _Heavy(nn.Module):   # 6 transcendental functions per element (mish twice, as 29)
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.mish(F.mish(self.fc(x)))


def _epilogues(model: nn.Module) -> list[Any]:
    torch.manual_seed(0)
    pl = codegen.plan(program_of(model, torch.rand(4, 8)))
    return [lv.epi for lv in pl.levels if lv.kernel]


@pytest.mark.parametrize("model,want", [
    (_T0, [0]), (_T2, [2]), (_RowBack, [None]), (_T3, [None]), (_LSE, [None]), (_Chain, [0, 1]),
    (_Heavy, [None])])
def test_which_levels_become_epilogues(model: type, want: list) -> None:
    """Elementwise levels (T0) and one-pass row reductions (T2) run inside the GEMM (the
    number of reductions each); softmax and a row mean added back (row statistics applied
    back to the row), logsumexp (a reduction feeding another) keep their own kernel after
    the GEMM; so does a math-heavy elementwise tail (config.EPI_MAX_COST)."""
    got = [None if e is None else e.nred for e in _epilogues(model())]
    assert got == want


def test_drawn_programs_have_epilogues() -> None:
    """The generator draws models with and without eligible levels: both kinds occur, so
    the compile test below checks real epilogues of drawn tails."""
    levels = [lv for _, prog in _programs() for lv in codegen.plan(prog).levels if lv.kernel]
    epis = [lv.epi for lv in levels if lv.epi is not None]
    assert len(epis) >= 5 and len(epis) < len(levels)
    assert any(e.nred for e in epis) and any(not e.nred for e in epis)


def _epilogue_sources() -> dict[str, str]:
    out = {}
    for _, prog in _programs():
        for lv in codegen.plan(prog).levels:
            if lv.epi is not None:
                out[lv.epi.name] = lv.epi.kernel
    for cls in (_T0, _T2, _Chain):
        for e in _epilogues(cls()):
            if e is not None:
                out[e.name] = e.kernel
    return out


@pytest.fixture(scope="module")
def compiled_epilogues(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("epi_cu")
    srcs = _epilogue_sources()
    head = '#include "gemm_sm90.cuh"\n#include "tail_ops.cuh"\n'
    chunks: list[list[str]] = [[] for _ in range(_FILES)]
    for i, name in enumerate(sorted(srcs)):
        assert srcs[name].startswith(head), srcs[name][:200]
        chunks[i % _FILES].append(name)
    procs = []
    for i, chunk in enumerate(chunks):
        if chunk:
            src = tmp / f"epi_{i}.cu"
            src.write_text(runtime.expand_text(head + "\n".join(srcs[n][len(head):] for n in chunk)))
            procs.append(_compile(src, tmp / f"epi_{i}.cubin"))
    logs, rcs = [], []
    for p in procs:
        log, _ = p.communicate(timeout=900)
        logs.append(log)
        rcs.append(p.returncode)
    text = "\n".join(logs)
    props = {m.group(1): tuple(int(m.group(i)) for i in (2, 3, 4)) for m in _PROPS_RE.finditer(text)}
    return {"names": sorted(srcs), "props": props, "rc": rcs, "log": text}


def test_epilogues_compile_without_spills(compiled_epilogues: dict[str, Any]) -> None:
    c = compiled_epilogues
    assert all(rc == 0 for rc in c["rc"]), c["log"][-4000:]
    assert len(c["names"]) >= 8
    for name in c["names"]:
        assert name in c["props"], f"{name} is not an entry function"
        assert c["props"][name][1] == 0, f"{name} spills {c['props'][name][1]} bytes"


def test_epilogue_launch_formats_follow_their_arguments() -> None:
    """An epilogue kernel takes the GEMM's parameters (5 tensor maps, M, N, K, counters,
    parts) and then exactly its Epilogue.args, as engine.gemm_hybrid_epilogue passes them."""
    n = 0
    for _, prog in _programs():
        for lv in codegen.plan(prog).levels:
            e = lv.epi
            if e is None:
                continue
            want = "128s" * 5 + "iiiPP" + "".join(_ARG_CODES[kind] for kind, _ in e.args)
            assert runtime.kernel_formats(e.kernel)[e.name] == want, e.name
            assert all(kind != "gemm" for kind, _ in e.args), "an epilogue reads its GEMM's buffer"
            n += 1
    assert n >= 5
