"""Head splits: a Linear's features viewed in several dims (``h.view(B, H, D)``).

A split view is the same (batch, H * D) program value with torch's dims kept beside it
(``values._Split``, ``cupyfuse/ir/splits.py``); ops along the split dims become group
reductions (``sred``: consecutive groups over the last dim, strided ones over the heads)
and gathers (``remap``: a (D,) parameter over H heads, a per-head statistic over its D
features, ``h.view(B, H, D)[:, :, j]``).

* Property tests (hypothesis, derandomized): whole random models drawn by
  :func:`draw_spec` -- a Linear, the split spelled six ways, 1..6 ops on the split value
  (activations, constants, parameters of every broadcastable shape, reductions over one
  or two split dims with and without keepdim, statistics applied back, softmax /
  log_softmax, F.normalize, LayerNorm, masks, residuals of another split of h, indexing
  by select / integers / slices / narrow / unbind / chunk, regrouping reshapes), then
  flattened back, reduced or returned split; odd sizes, sizes 1, (batch, seq, features)
  inputs, NaN/+inf/-inf in the input; against a float64 copy at atol = rtol = 1e-4.
* The common forms (GLU halves, sums, softmax, means over heads, flatten, normalize,
  indexing, select, unflatten, ``view(*h.shape[:-1], H, D)``), on the CPU and (``gpu``)
  on the GPU, also with (batch, seq, features) inputs; wide shapes for the kernels' group
  strategies (a warp per group, many groups, groups re-read past the shared-memory
  budget); GPU property tests with fixed seeds.
* The IR pieces (sred/remap against torch, remap's canonical forms), the generated
  kernels compiled with nvcc for sm_90a without spills, and the refusals (each says what
  to write instead).
* The generated kernels run on the CPU through a thread emulation of CUDA
  (tests/emu/cuda.py: barriers, warp shuffles, shared arrays) against the CPU path: the
  kernels' index arithmetic and phases checked where no GPU is at hand.
"""
from __future__ import annotations

import copy
import linecache
import math
import re
import shutil
import subprocess
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from cupyfuse import config
import cupyfuse
from cupyfuse.backend import codegen, runtime
from cupyfuse.api import fused_class
from cupyfuse.interop import cupy_available
from cupyfuse.ir.program import BATCH, Builder, Node, TailError, remap_index, remap_values, \
    sred_values
from helpers import DEVICES
from gen.tails import HypDraw, RandDraw, assert_matches
from helpers import program_of
from helpers import examples

THIS = "test_split_features.py"
HAS_GPU = torch.cuda.is_available() and cupy_available()
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU "
                                                "visible to both torch and CuPy")]


def _settings(n: int) -> settings:
    return settings(max_examples=examples(n), deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much,
                                           HealthCheck.large_base_example])


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    # var/std with one degree of freedom warn; so does every fused call under grad mode.
    # On a GPU (as tests/frontend/test_tails_gpu.py): NaN-filled op buffers (an element a kernel
    # fails to write shows) and full-float32 torch matmuls, restored afterwards.
    from cupyfuse import interop

    old = (interop.poison_outputs, torch.backends.cuda.matmul.allow_tf32)
    if HAS_GPU:
        interop.poison_outputs = True
        torch.backends.cuda.matmul.allow_tf32 = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
    interop.poison_outputs, torch.backends.cuda.matmul.allow_tf32 = old


# =================================================================================
# the generator
# =================================================================================
@dataclass
class HeadSpec:
    """A drawn model: ``Linear(K, W)``, its output split into ``fs`` (W = prod(fs)), ops on
    the split value, a final form. ``lead``: the sizes between the batch and the features
    of x ((batch, seq, K) inputs)."""

    name: str
    K: int
    fs: tuple[int, ...]
    lead: tuple[int, ...]
    source: str
    ops: list[str] = field(default_factory=list)
    _cls: Any = None

    def __repr__(self) -> str:
        return f"HeadSpec({self.name}: K={self.K} fs={self.fs} lead={self.lead} " \
               f"ops={self.ops})\n{self.source}"

    def model_class(self) -> type:
        if self._cls is None:
            fname = f"<headgen {self.name}>"
            linecache.cache[fname] = (len(self.source), None, self.source.splitlines(True),
                                      fname)
            ns: dict[str, Any] = {"torch": torch, "nn": nn, "F": F, "math": math,
                                  "__name__": "headgen_models"}
            exec(compile(self.source, fname, "exec"), ns)
            self._cls = ns[self.name]
        return self._cls

    def make_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return self.model_class()().eval()

    def make_input(self, batch: int, seed: int, n_special: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn((batch,) + self.lead + (self.K,), generator=g) * 2
        flat = x.view(-1)
        for k in range(n_special):
            i = int(torch.randint(flat.numel(), (1,), generator=g))
            flat[i] = (float("nan"), float("inf"), float("-inf"))[k % 3]
        return x


class _Gen:
    def __init__(self, d: Any, lead: tuple[int, ...] | None, n_ops: int | None) -> None:
        self.d = d
        self.lead = lead if lead is not None else d.choice([(), (), (), (3,), (2,)])
        nf = d.choice([2, 2, 2, 3])
        i = d.int(0, nf - 2)
        j = d.int(i + 1, nf - 1)   # two dims of size > 1: a split
        fs = [d.choice([2, 3, 4, 5, 7]) if k in (i, j) else d.choice([1, 2, 3, 5])
              for k in range(nf)]
        self.fs0 = tuple(fs)
        self.fs = list(fs)
        self.K = d.int(1, 12)
        self.n_ops = n_ops if n_ops is not None else d.int(1, 6)
        self.init: list[str] = []
        self.fwd: list[str] = []
        self.ops: list[str] = []
        self.count = 0
        self.nm = 1 + len(self.lead)   # the batch and leading dims before the features

    # --- helpers --------------------------------------------------------------------
    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"{stem}{self.count}"

    def dim(self, p: int) -> str:
        """Feature dim p spelled negative or positive."""
        return str(p - len(self.fs)) if self.d.bool(0.6) else str(self.nm + p)

    def rows(self) -> str:
        """The batch and leading dims of a view: sizes read from x, or -1 for the batch."""
        lead = [f"x.shape[{1 + i}]" if self.d.bool() else str(n)
                for i, n in enumerate(self.lead)]
        return ", ".join([self.d.choice(["x.shape[0]", "-1", "x.size(0)"])] + lead)

    def split_expr(self, src: str) -> str:
        fs = ", ".join(map(str, self.fs0))
        how = self.d.choice(["view", "reshape", "unflatten", "star", "tuple", "minus1"])
        if how in ("view", "reshape"):
            return f"{src}.{how}({self.rows()}, {fs})"
        if how == "unflatten":
            return f"{src}.unflatten(-1, ({fs},))"
        if how == "star":
            return f"{src}.view(*{src}.shape[:-1], {fs})"
        if how == "tuple":
            return f"{src}.reshape({src}.shape[:-1] + ({fs},))"
        # one feature size left to -1
        k = self.d.int(0, len(self.fs0) - 1)
        parts = [str(x) if i != k else "-1" for i, x in enumerate(self.fs0)]
        rows = ", ".join(["x.shape[0]"] + [str(n) for n in self.lead])
        return f"{src}.view({rows}, {', '.join(parts)})"

    def feature(self, big: bool = False) -> int | None:
        """A feature position (one of size > 1 if ``big``)."""
        ps = [p for p, x in enumerate(self.fs) if x > 1 or not big]
        return self.d.choice(ps) if ps else None

    def emit(self, expr: str, op: str) -> None:
        self.fwd.append(f"v = {expr}")
        self.ops.append(op)

    # --- ops --------------------------------------------------------------------------
    def op_act(self) -> bool:
        f = self.d.choice(["torch.relu(v)", "torch.tanh(v)", "torch.sigmoid(v)", "F.gelu(v)",
                           "F.silu(v)", "v.abs()", "F.leaky_relu(v, 0.1)", "v.clamp(-2.0, 3.0)"])
        self.emit(f, "act")
        return True

    def op_const(self) -> bool:
        c, s = self.d.float(-2, 2), self.d.float(0.5, 2)
        self.emit(self.d.choice([f"v * {s} + {c}", f"{c} - v", f"v / {s}"]), "const")
        return True

    def op_param(self) -> bool:
        n = len(self.fs)
        start = self.d.int(0, n - 1)
        shape = [x if self.d.bool(0.7) else 1 for x in self.fs[start:]]
        if self.d.bool(0.2):
            shape = [1] + shape
        p = self.fresh("p")
        kind = self.d.choice(["mul", "add"])
        init = "uniform_(-2.0, 2.0)" if kind == "mul" else "normal_()"
        self.init.append(f"self.{p} = nn.Parameter(torch.empty({tuple(shape)!r}).{init})")
        self.emit(f"v * self.{p}" if kind == "mul" else f"self.{p} + v", f"param{tuple(shape)}")
        return True

    def _axes(self) -> list[int]:
        p = self.feature()
        axes = [p]
        if len(self.fs) >= 2 and self.d.bool(0.3):
            q = self.feature()
            if q != p:
                axes.append(q)
        return sorted(axes)

    def op_reduce(self, keep: bool | None = None) -> bool:
        axes = self._axes()
        keep = keep if keep is not None else self.d.bool(0.6)
        if not keep and len(self.fs) - len(axes) < 1:
            keep = True
        kind = self.d.choice(["sum", "mean", "amax", "amin", "logsumexp", "norm", "var",
                              "std"])
        dims = self.dim(axes[0]) if len(axes) == 1 else \
            "(" + ", ".join(self.dim(p) for p in axes) + ")"
        kd = "True" if keep else "False"
        if kind == "norm":
            expr = f"torch.linalg.vector_norm(v, dim={dims}, keepdim={kd})"
        elif kind in ("var", "std"):
            expr = f"v.{kind}(dim={dims}, keepdim={kd}, correction={self.d.choice([0, 1])})"
        elif kind == "logsumexp":
            expr = f"torch.logsumexp(v, dim={dims}, keepdim={kd})"
        else:
            expr = f"v.{kind}(dim={dims}, keepdim={kd})"
        self.emit(expr, f"{kind}{axes}{'k' if keep else ''}")
        if keep:
            for p in axes:
                self.fs[p] = 1
        else:
            self.fs = [x for p, x in enumerate(self.fs) if p not in axes]
        return True

    def op_back(self) -> bool:
        """A statistic over some dims applied back to the value."""
        axes = self._axes()
        dims = "(" + ", ".join(self.dim(p) for p in axes) + ",)"
        self.emit(self.d.choice([f"v - v.mean(dim={dims}, keepdim=True)",
                                 f"v / (v.abs().amax(dim={dims}, keepdim=True) + 1.0)",
                                 f"v - torch.logsumexp(v, {dims}, keepdim=True)"]), "back")
        return True

    def op_softmax(self) -> bool:
        p = self.feature()
        f = self.d.choice(["torch.softmax(v, dim={})", "F.log_softmax(v, {})", "v.softmax({})",
                           "F.softmin(v, dim={})"])
        self.emit(f.format(self.dim(p)), f"softmax{p}")
        return True

    def op_normalize(self) -> bool:
        p = self.feature()
        self.emit(f"F.normalize(v, dim={self.dim(p)})", f"normalize{p}")
        return True

    def op_layernorm(self) -> bool:
        if self.d.bool():
            self.emit("F.layer_norm(v, v.shape[-1:])", "layernorm")
            return True
        m = self.fresh("ln")
        shape = tuple(self.fs[-2:]) if len(self.fs) >= 2 and self.d.bool(0.3) else (self.fs[-1],)
        self.init.append(f"self.{m} = nn.LayerNorm({shape!r})")
        self.init.append(f"nn.init.uniform_(self.{m}.weight, 0.5, 1.5)")
        self.init.append(f"nn.init.normal_(self.{m}.bias)")
        self.emit(f"self.{m}(v)", f"layernorm{shape}")
        return True

    def op_mask(self) -> bool:
        self.emit(self.d.choice(["v * (v > 0)", "torch.where(v > 0.5, v, 0.1 * v)",
                                 "v.masked_fill(v < -1.0, 0.25)", "v * ((v > 0) * 2 - 1)",
                                 "v * (~(v < 0.5) | (v > 2.0)).float()"]), "mask")
        return True

    def op_rowstat(self) -> bool:
        """A per-row value (no feature dims) against the split value."""
        ones = ", ".join(["1"] * len(self.fs))
        self.emit(f"v * torch.sigmoid(h2.mean(-1)).reshape(h2.shape[:-1] + ({ones},))",
                  "rowstat")
        return True

    def op_residual(self) -> bool:
        if len(self.fs) != len(self.fs0) or any(a != b and a != 1 for a, b in
                                                 zip(self.fs, self.fs0)):
            return False
        self.emit(f"v + {self.split_expr('h2')}", "residual")
        self.fs = list(self.fs0)
        return True

    def op_index(self) -> bool:
        if len(self.fs) < 2:
            return False
        p = self.feature(big=True)
        if p is None:
            return False
        n = self.fs[p]
        D = self.dim(p)
        how = self.d.choice(["select", "int", "slice", "narrow", "unbind", "chunk"])
        tail = ", :" * (len(self.fs) - p - 1)
        if how in ("select", "int", "unbind"):
            i = self.d.int(0, n - 1)
            expr = {"select": f"v.select({D}, {i})", "int": f"v[..., {i}{tail}]",
                    "unbind": f"v.unbind({D})[{i}]"}[how]
            self.fs.pop(p)
        elif how == "chunk":
            c = self.d.int(2, n)
            size = -(-n // c)
            pieces = [min(size, n - s) for s in range(0, n, size)]
            k = self.d.int(0, len(pieces) - 1)
            expr = f"v.chunk({c}, {D})[{k}]"
            self.fs[p] = pieces[k]
        else:
            a = self.d.int(0, n - 1)
            ln = self.d.int(1, n - a)
            expr = f"v[..., {a}:{a + ln}{tail}]" if how == "slice" else f"v.narrow({D}, {a}, {ln})"
            self.fs[p] = ln
        self.emit(expr, f"{how}{p}")
        return True

    def op_regroup(self) -> bool:
        """Features regrouped without moving data: two adjacent dims joined, or a size-1
        dim added."""
        if len(self.fs) >= 2 and self.d.bool():
            p = self.d.int(0, len(self.fs) - 2)
            self.emit(f"v.flatten({self.nm + p}, {self.nm + p + 1})", "flatten2")
            self.fs[p:p + 2] = [self.fs[p] * self.fs[p + 1]]
        else:
            p = self.d.int(0, len(self.fs))
            self.emit(f"v.unsqueeze({self.nm + p})", "unsqueeze")
            self.fs.insert(p, 1)
        return True

    OPS = ("act", "const", "param", "reduce", "back", "softmax", "normalize", "layernorm",
           "mask", "residual", "index", "regroup", "rowstat")

    def build(self, name: str) -> HeadSpec:
        self.init.append(f"self.fc = nn.Linear({self.K}, {math.prod(self.fs0)})")
        self.fwd.append("h = self.fc(x)")
        if self.d.bool(0.3):
            self.fwd.append("h2 = torch.tanh(h)")
        else:
            self.fwd.append("h2 = h")
        self.fwd.append(f"v = {self.split_expr('h')}")
        tries = 0
        while len(self.ops) < self.n_ops and tries < 50:
            tries += 1
            op = self.d.choice(self.OPS)
            getattr(self, f"op_{op}")()
        nm = self.nm
        final = self.d.choice(["flatten", "reduce", "split", "reshape"])
        if final == "flatten":
            self.fwd.append(f"return v.flatten({nm})")
        elif final == "reshape":
            rows = ", ".join(["x.shape[0]"] + [str(n) for n in self.lead])
            self.fwd.append(f"return v.reshape({rows}, -1)")
        elif final == "reduce":
            dims = tuple(range(nm, nm + len(self.fs)))
            self.fwd.append(f"return v.sum(dim={dims!r})" if len(dims) > 1 else
                            f"return v.sum(dim={dims[0]})")
        else:
            self.fwd.append("return v")
        self.ops.append(final)
        src = [f"class {name}(nn.Module):", "    def __init__(self):",
               "        super().__init__()"] + [f"        {s}" for s in self.init] + \
              ["", "    def forward(self, x):"] + [f"        {s}" for s in self.fwd]
        return HeadSpec(name, self.K, self.fs0, self.lead, "\n".join(src) + "\n", self.ops)


_N = [0]


def draw_spec(d: Any, lead: tuple[int, ...] | None = None, n_ops: int | None = None) -> HeadSpec:
    _N[0] += 1
    return _Gen(d, lead, n_ops).build(f"Heads{_N[0]}")


@dataclass
class HeadCase:
    spec: HeadSpec
    batch: int
    seed: int
    n_special: int
    api: str

    def __repr__(self) -> str:
        return f"HeadCase(batch={self.batch}, seed={self.seed}, n_special={self.n_special}, " \
               f"api={self.api!r})\n{self.spec!r}"


@st.composite
def head_cases(draw: Any, lead: tuple[int, ...] | None = None,
               specials: tuple[int, ...] = (0, 0, 0, 1, 2)) -> HeadCase:
    spec = draw_spec(HypDraw(draw), lead)
    return HeadCase(spec, draw(st.integers(1, 9)), draw(st.integers(0, 2 ** 20)),
                    draw(st.sampled_from(specials)),
                    draw(st.sampled_from(["from_model", "fused_class"])))


def seeded_case(seed: int, **kw: Any) -> HeadCase:
    d = RandDraw(seed)
    spec = draw_spec(d, **kw)
    return HeadCase(spec, d.int(1, 9), d.int(0, 2 ** 20), d.choice([0, 0, 1, 2]),
                    d.choice(["from_model", "fused_class"]))


def run_head_case(case: HeadCase, device: str = "cpu", calls: int = 1) -> None:
    spec = case.spec
    model = spec.make_model(case.seed)
    m64 = copy.deepcopy(model).double()
    if case.api == "fused_class":
        torch.manual_seed(case.seed)
        fused = fused_class(spec.model_class())().eval()
        fused.load_state_dict(model.state_dict())
        fused = fused.to(device)
    else:
        fused = cupyfuse.from_model(copy.deepcopy(model).to(device))
    for call in range(calls):
        x = spec.make_input(case.batch, case.seed + call, case.n_special)
        with torch.no_grad():
            ref64 = m64(x.double())
            ref32 = model(x)
            out = fused(x.to(device))
        assert out.device.type == torch.device(device).type
        assert_matches(out, ref64, ref32, f"call {call}")


# =================================================================================
# 1. property tests (CPU)
# =================================================================================
@_settings(120)
@given(head_cases())
def test_random_head_splits_match_float64(case: HeadCase) -> None:
    note(repr(case))
    run_head_case(case)


@_settings(50)
@given(head_cases(specials=(1, 2, 4)))
def test_random_head_splits_nonfinite_inputs(case: HeadCase) -> None:
    """NaN, +inf and -inf in x: placement as float64 torch's (or float32 torch's where the
    two differ)."""
    note(repr(case))
    run_head_case(case)


@_settings(50)
@given(head_cases(lead=(3,)))
def test_random_head_splits_with_a_sequence_dim(case: HeadCase) -> None:
    """(batch, seq, K) inputs: the split dims after the sequence dim."""
    note(repr(case))
    run_head_case(case)


def test_generator_draws_every_op() -> None:
    """The generator reaches every op family and split spelling over the seeds the GPU
    test uses (so the property tests cover them)."""
    seen: set[str] = set()
    text = ""
    for seed in range(300):
        spec = seeded_case(seed).spec
        seen |= {re.sub(r"(\[[\d, ]*\]k?|\([\d, ]*\)|\d+)$", "", o) for o in spec.ops}
        text += spec.source
    for op in ("act", "const", "param", "sum", "mean", "amax", "amin", "logsumexp", "norm",
               "var", "std", "back", "softmax", "normalize", "layernorm", "mask", "residual",
               "select", "int", "slice", "narrow", "unbind", "chunk", "flatten", "unsqueeze",
               "rowstat", "reduce", "split", "reshape"):
        assert op in seen, (op, sorted(seen))
    for form in (".unflatten(-1,", ".view(*h.shape[:-1]", ".reshape(h.shape[:-1] +",
                 ".view(-1,", "x.size(0)"):
        assert form in text, form


# =================================================================================
# 2. the forms, on the CPU and the GPU
# =================================================================================
H, D = 4, 6


class Heads(nn.Module):
    """Linear(K, W) and a tail ``fn(self, h, x)``; parameters of every broadcastable
    shape for it."""

    def __init__(self, fn: Any, k: int = 8, w: int = H * D, h: int = H, d: int = D) -> None:
        super().__init__()
        self.fc = nn.Linear(k, w)
        self.fn = fn
        self.w_d = nn.Parameter(torch.rand(d) + 0.5)
        self.b_d = nn.Parameter(torch.randn(d))
        self.w_hd = nn.Parameter(torch.randn(h, d))
        self.register_buffer("w_h1", torch.rand(h, 1) + 0.5)
        self.w_1hd = nn.Parameter(torch.randn(1, h, d))
        self.ln = nn.LayerNorm(d)
        self.ln2 = nn.LayerNorm((h, d))
        self.soft = nn.Softmax(dim=1)
        self.flat = nn.Flatten()
        self.unflat = nn.Unflatten(1, (h, d))
        self.glu = nn.GLU(dim=1)
        self.fc2 = nn.Linear(w, 12)
        with torch.no_grad():
            for m in (self.ln, self.ln2):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self, self.fc(x), x)


def _v(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return h.view(x.shape[0], H, D)


def _unbind_glu(m: Any, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    a, b = h.view(-1, 2, 12).unbind(1)
    return a * torch.sigmoid(b)


def _two_stages(m: Any, h: torch.Tensor) -> torch.Tensor:
    """split -> LayerNorm, softmax over heads -> flatten -> a second Linear -> split
    again -> cat along the outer split dim; (batch, K) or (batch, seq, K) inputs."""
    v = m.ln(h.view(*h.shape[:-1], H, D)).softmax(-2).flatten(-2)
    w = m.fc2(v).unflatten(-1, (3, 4))
    return torch.cat([w, w.amax(-2, keepdim=True)], -2).sum(-1)


FORMS: list[tuple[str, Any]] = [
    ("unbind_glu", _unbind_glu),
    ("sum_last", lambda m, h, x: h.reshape(x.shape[0], 4, 6).sum(-1)),
    ("softmax_back", lambda m, h, x: _v(h, x).softmax(-1).view(x.shape[0], -1)),
    ("mean_over_heads", lambda m, h, x: _v(h, x).mean(1)),
    ("flatten", lambda m, h, x: torch.relu(_v(h, x)).flatten(1)),
    ("normalize", lambda m, h, x: F.normalize(_v(h, x), dim=-1).reshape(x.shape[0], H * D)),
    ("index_head", lambda m, h, x: _v(h, x)[:, 0]),
    ("select_head", lambda m, h, x: _v(h, x).select(1, 2)),
    ("unflatten", lambda m, h, x: h.unflatten(-1, (H, D)).amax(-1)),
    ("unpacked_shape", lambda m, h, x: h.view(*h.shape[:-1], H, D).logsumexp(-1)),
    ("shape_plus_tuple", lambda m, h, x: h.view(h.shape[:-1] + (H, D)).amin(1)),
    ("param_d", lambda m, h, x: (_v(h, x) * m.w_d + m.b_d).sum(1)),
    ("param_hd", lambda m, h, x: (_v(h, x) + m.w_hd).amin(-1)),
    ("param_h1", lambda m, h, x: (_v(h, x) * m.w_h1).flatten(1)),
    ("param_1hd", lambda m, h, x: torch.tanh(_v(h, x) - m.w_1hd).mean(-1)),
    ("center", lambda m, h, x: (_v(h, x) - _v(h, x).mean(-1, keepdim=True)).flatten(1)),
    ("std_heads", lambda m, h, x: _v(h, x).std(1)),
    ("var_last", lambda m, h, x: _v(h, x).var(-1, keepdim=True, correction=0).flatten(1)),
    ("qk_norm", lambda m, h, x: m.ln(_v(h, x)).flatten(1)),
    ("layer_norm_hd", lambda m, h, x: m.ln2(_v(h, x)).sum(-1)),
    ("f_layer_norm", lambda m, h, x: F.layer_norm(_v(h, x), (D,), m.w_d, m.b_d).amax(1)),
    ("inner_index", lambda m, h, x: _v(h, x)[:, :, 2]),
    ("inner_slice", lambda m, h, x: _v(h, x)[:, 1:3, 2:5].flatten(1)),
    ("return_split", lambda m, h, x: torch.softmax(_v(h, x), dim=1)),
    ("norm", lambda m, h, x: _v(h, x).norm(dim=-1)),
    ("glu_inner", lambda m, h, x: F.glu(_v(h, x), dim=-1).sum(-1)),
    ("cat_outer", lambda m, h, x: torch.cat([_v(h, x), _v(h, x)[:, :1] * 2], 1).sum(1)),
    ("mask", lambda m, h, x: (_v(h, x) * (_v(h, x) > 0)).sum(-1)),
    ("where", lambda m, h, x: torch.where(_v(h, x) > 0.5, _v(h, x), m.w_d).flatten(1)),
    ("sum_all", lambda m, h, x: _v(h, x).sum((1, 2))),
    ("gemv_param_d", lambda m, h, x: (_v(h, x) * m.w_d + 1.0).sum((-2, -1))),
    ("gemv_param_hd", lambda m, h, x: (_v(h, x) * m.w_hd).sum(dim=(1, 2), keepdim=True)),
    ("lse_heads", lambda m, h, x: torch.logsumexp(_v(h, x), 1)),
    ("max_values", lambda m, h, x: _v(h, x).max(-1).values + _v(h, x).min(1)[0][:, :H]),
    ("three_dims", lambda m, h, x: h.view(-1, 2, 3, 4).sum((1, 3))),
    ("three_dims_softmax", lambda m, h, x: h.view(-1, 2, 3, 4).softmax(2).flatten(1)),
    ("three_dims_var", lambda m, h, x: h.view(-1, 2, 3, 4).var((1, 3))),
    ("chunk", lambda m, h, x: _v(h, x).chunk(2, dim=1)[1].sum(-1)),
    ("split_sizes", lambda m, h, x: torch.split(_v(h, x), [1, 3], dim=1)[1].mean(1)),
    ("stat_over_heads_back", lambda m, h, x: (_v(h, x) / _v(h, x).abs().amax(1, keepdim=True)
                                              ).flatten(1)),
    ("log_softmax_heads", lambda m, h, x: F.log_softmax(_v(h, x), dim=1).flatten(1)),
    ("softmin", lambda m, h, x: F.softmin(_v(h, x), dim=-1).sum(1)),
    ("unsqueeze_squeeze", lambda m, h, x: _v(h, x).unsqueeze(2).sum(-1).squeeze(2)),
    ("dtype_plumbing", lambda m, h, x: (_v(h, x).float().clone().contiguous() * 2)
     .type_as(h).flatten(1)),
    ("narrow_inner", lambda m, h, x: _v(h, x).narrow(-1, 1, 3).amax(-1)),
    ("residual_split", lambda m, h, x: (_v(h, x) + torch.tanh(h).unflatten(1, (H, D))).amax(2)),
    ("size_scaled", lambda m, h, x: (_v(h, x) / _v(h, x).shape[-1] ** 0.5).softmax(-1).sum(1)),
    ("heads_then_plain", lambda m, h, x: torch.sigmoid(_v(h, x).mean(-1)) * h[:, :H]),
    ("nn_modules", lambda m, h, x: m.flat(m.soft(m.unflat(h)))[:, :H * D // 2]
     + m.glu(_v(h, x)).flatten(1)),
    ("transpose_size1", lambda m, h, x: _v(h, x).unsqueeze(3).transpose(2, 3).sum(-1)
     .flatten(1)),
    ("two_stages", lambda m, h, x: _two_stages(m, h)),
]


def _check(model: nn.Module, x: torch.Tensor, device: str, calls: int = 1) -> torch.Tensor:
    with torch.no_grad():
        ref64 = copy.deepcopy(model).double()(x.double())
        ref32 = copy.deepcopy(model)(x)
        fused = cupyfuse.from_model(copy.deepcopy(model).to(device))
        for _ in range(calls):
            out = fused(x.to(device))
    assert_matches(out, ref64, ref32)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,fn", FORMS, ids=[f[0] for f in FORMS])
def test_forms_match_float64(name: str, fn: Any, device: str) -> None:
    torch.manual_seed(0)
    m = Heads(fn).eval()
    x = torch.randn(7, 8) * 2
    x[3, 1] = float("nan")
    x[5, 0] = float("inf")
    _check(m, x, device, calls=2)
    _check(m, torch.randn(1, 8), device)   # one row


def test_forms_keep_one_program_value() -> None:
    """A split is a relabelling: the (batch, H, D) result of return_split is the flat
    program value, with torch's dims kept in lead_out; reductions over heads are strided
    groups, over the last dim consecutive ones."""
    prog = program_of(Heads(dict(FORMS)["return_split"]), torch.randn(3, 8))
    assert prog.out_shape(3) == (3, H, D) and prog.nodes[prog.out].dims == (BATCH, H * D)
    assert [n.attrs[1:] for n in prog.nodes if n.kind == "sred"] == [(H, D), (H, D)]
    prog = program_of(Heads(dict(FORMS)["softmax_back"]), torch.randn(3, 8))
    assert [n.attrs[1:] for n in prog.nodes if n.kind == "sred"] == [(D, 1), (D, 1)]


def test_sum_over_all_split_dims_becomes_a_gemv() -> None:
    """A sum over every split dim is a row sum: the GEMV rewrite applies, with a (D,)
    parameter tiled over the heads as its coefficient (rewrite.static_value of a remap)."""
    prog = program_of(Heads(dict(FORMS)["gemv_param_d"]), torch.randn(3, 8))
    assert any(n.kind == "gemv" for n in prog.nodes) and not any(
        n.kind == "gemm" for n in prog.nodes)


class _SlicedParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.p = nn.Parameter(torch.randn(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * self.p[:6]).sum(1)


@pytest.mark.parametrize("device", DEVICES)
def test_gemv_of_a_sliced_parameter(device: str) -> None:
    """A batch-free slice as a GEMV coefficient: rewrite.static_value reads the slice (no
    ValueError)."""
    torch.manual_seed(0)
    _check(_SlicedParam(), torch.randn(5, 8), device)


# --- (batch, seq, features) inputs --------------------------------------------------
S = 3


def _vs(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return h.view(x.shape[0], x.shape[1], H, D)


LEAD_FORMS: list[tuple[str, Any]] = [
    ("view_softmax", lambda m, h, x: _vs(h, x).softmax(-1).flatten(2)),
    ("unpacked_shape", lambda m, h, x: h.view(*h.shape[:-1], H, D).sum(-1)),
    ("unflatten_param", lambda m, h, x: (h.unflatten(-1, (H, D)) * m.w_hd).mean(-2)),
    ("shape_plus_tuple", lambda m, h, x: h.view(h.shape[:-1] + (H, D)).amax(-1)),
    ("return_split", lambda m, h, x: F.normalize(h.unflatten(-1, (H, D)), dim=-1)),
    ("index_heads", lambda m, h, x: h.unflatten(-1, (H, D))[..., 1, :]),
    ("qk_norm", lambda m, h, x: m.ln(_vs(h, x)).reshape(x.shape[0], x.shape[1], -1)),
    ("minus1_batch", lambda m, h, x: h.view(-1, S, H, D).std(2).sum(-1)),
    ("unbind", lambda m, h, x: _vs(h, x).unbind(-2)[1] * torch.sigmoid(_vs(h, x)[:, :, 0])),
    ("var_over_both", lambda m, h, x: _vs(h, x).var(dim=(-2, -1), keepdim=True).squeeze(-1)),
    ("size1_lead_dim", lambda m, h, x: _vs(h, x).sum(-1).reshape(x.shape[0], S, -1)),
    ("two_stages", dict(FORMS)["two_stages"]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,fn", LEAD_FORMS, ids=[f[0] for f in LEAD_FORMS])
def test_forms_with_a_sequence_dim(name: str, fn: Any, device: str) -> None:
    torch.manual_seed(1)
    m = Heads(fn).eval()
    x = torch.randn(4, S, 8) * 2
    x[2, 1, 3] = float("-inf")
    _check(m, x, device, calls=2)


def test_a_last_dim_of_one_reshaped_with_minus_one() -> None:
    """(batch, seq, 1) reshaped to (batch, seq, -1): the -1 is the 1 (no data moves: not
    refused)."""
    m = Heads(lambda m, h, x: h.mean(-1, keepdim=True).reshape(x.shape[0], S, -1)).eval()
    _check(m, torch.randn(2, S, 8), "cpu")


def test_norm_over_several_dims_with_size_one_among_them() -> None:
    """A norm or logsumexp over several dims of which some are size 1: one statistic over
    their elements (not reduced one dim at a time, not refused)."""
    m = Heads(lambda m, h, x: torch.linalg.vector_norm(h.unsqueeze(1), dim=(1, 2)) +
              torch.logsumexp(h.unsqueeze(-1), dim=(-2, -1))).eval()
    _check(m, torch.randn(5, 8), "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_tail_function_with_a_split(device: str) -> None:
    """fused_linear with a tail function that splits the features."""
    torch.manual_seed(2)
    x, w, b = torch.randn(5, 8), torch.randn(H * D, 8), torch.randn(H * D)

    def tail(h: torch.Tensor) -> torch.Tensor:
        return F.normalize(h.view(h.shape[0], H, D), dim=-1).amax(1)
    want = tail(x.double() @ w.double().t() + b.double())
    out = cupyfuse.fused_linear(x.to(device), w.to(device), b.to(device), tail)
    assert out.shape == want.shape
    torch.testing.assert_close(out.cpu().double(), want, atol=1e-4, rtol=1e-4)


# --- wide shapes: the kernels' group strategies ---------------------------------------
WIDE: list[tuple[str, int, int, Any]] = [
    # (name, heads, dim, tail of v = h.view(B, heads, dim))
    ("warp_per_group", 2, 96, lambda v: v.softmax(-1).flatten(1)),
    ("warp_strided", 96, 3, lambda v: v.sum(1) + v.amax(1)),
    ("many_groups", 4096, 3, lambda v: v.softmax(-1).flatten(1)),
    ("past_max_groups", 9000, 2, lambda v: v.amax(-1) - v.mean(-1)),
    ("past_the_budget", 6000, 2, lambda v: v.softmax(-1).flatten(1)),
    ("two_long_heads", 2, 20000, lambda v: F.normalize(v, dim=-1).flatten(1)),
    ("long_groups_past_the_budget", 6000, 33, lambda v: v.softmax(-1).sum(1)),
]


def _wide(heads: int, dim: int, tail: Any) -> nn.Module:
    return Heads(lambda m, h, x: tail(h.view(x.shape[0], heads, dim)), k=4, w=heads * dim)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,heads,dim,tail", WIDE, ids=[w[0] for w in WIDE])
def test_wide_splits(name: str, heads: int, dim: int, tail: Any, device: str) -> None:
    torch.manual_seed(3)
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    _check(_wide(heads, dim, tail).eval(), x, device, calls=2)


# --- GPU: random models with fixed seeds ------------------------------------------------
@pytest.mark.parametrize("seed", range(40))
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU visible to both torch and CuPy")
def test_random_head_splits_on_the_gpu(seed: int) -> None:
    """The property tests' generator, fixed seeds, on CUDA (the second call runs the
    prepared launches at small batches); every fourth with a sequence dim."""
    case = seeded_case(seed, lead=(3,) if seed % 4 == 3 else None)
    try:
        run_head_case(case, "cuda", calls=2)
        torch.cuda.synchronize()
    except Exception as exc:   # the drawn model's source with the failure
        raise AssertionError(f"{type(exc).__name__}: {exc}\n{case!r}") from exc


# =================================================================================
# 3. refusals: each names the op, says why and what to write instead, and quotes the line
# =================================================================================
class _Refused(Heads):
    def __init__(self, fn: Any) -> None:
        super().__init__(fn)
        self.fc2 = nn.Linear(D, D)
        self.w_dd = nn.Parameter(torch.randn(D, D))


REFUSED: list[tuple[str, Any, str, list[str]]] = [
    # (id, tail, op, what the message says)
    ("transpose", lambda m, h, x: _v(h, x).transpose(1, 2).sum(-1), ".transpose()",
     ["reorders the dims of a (batch, 4, 6) value, which moves data within each row",
      "`.sum(1)` rather than `.transpose(1, 2).sum(-1)`"]),
    ("permute", lambda m, h, x: _v(h, x).permute(0, 2, 1).flatten(1), ".permute()",
     ["reorders the dims of a (batch, 4, 6) value"]),
    ("mT", lambda m, h, x: _v(h, x).mT.sum(1), ".mT", ["reorders the dims"]),
    ("movedim", lambda m, h, x: _v(h, x).movedim(1, 2).flatten(1), ".movedim()",
     ["reorders the dims"]),
    ("matmul_per_head", lambda m, h, x: (_v(h, x) @ m.w_dd).sum(-1), "matmul",
     ["a matmul of a value whose features are split into several dims (batch, 4, 6)",
      "a Linear per head is not fused: write it as one Linear of the whole row"]),
    ("linear_per_head", lambda m, h, x: m.fc2(_v(h, x)).sum(-1), "fc2 (Linear)",
     ["a Linear of a value whose features are split", "block-diagonal weight"]),
    ("heads_into_rows", lambda m, h, x: _v(h, x).reshape(-1, D).sum(-1), ".reshape()",
     ["a reshape of a (batch, 4, 6) value to (-1, 6)", "the batch and leading dims stay "
      "first", "e.g. `.flatten(1)`"]),
    ("reduce_batch", lambda m, h, x: _v(h, x).sum(0), ".sum()",
     ["reduces over the batch dimension (dim 0)"]),
    ("softmax_batch", lambda m, h, x: _v(h, x).softmax(0).flatten(1), ".softmax()",
     ["normalises over the batch dimension"]),
    ("index_batch", lambda m, h, x: _v(h, x)[0], "indexing/slicing a tensor",
     ["indexes the batch dimension"]),
    ("stepped_slice", lambda m, h, x: _v(h, x)[:, ::2].flatten(1), "indexing/slicing a tensor",
     ["only plain slices of the features"]),
    ("pool_indices", lambda m, h, x: F.max_pool1d(_v(h, x), 2, padding=1,
                                                  return_indices=True)[0].flatten(1),
     "max_pool1d_with_indices", ["pooling with indices (return_indices=True)"]),
    ("lp_pool", lambda m, h, x: F.lp_pool1d(_v(h, x), 2.0, 2).flatten(1), "lp_pool1d",
     ["split into several dims (batch, 4, 6)", "`.flatten(1)`"]),
    ("cat_inner", lambda m, h, x: torch.cat([_v(h, x), _v(h, x)], -1).flatten(1), "cat",
     ["an inner one of their split features", "join along their outermost feature dim"]),
    ("boolean_result", lambda m, h, x: _v(h, x) > 0, "a boolean result",
     ["the forward returns a boolean tensor"]),
    ("boolean_sum", lambda m, h, x: (_v(h, x) > 0).sum(-1), ".sum()",
     ["a reduction of a boolean tensor", "reduce `mask.float()` instead"]),
    ("squeeze_all", lambda m, h, x: _v(h, x).squeeze().flatten(1), ".squeeze()",
     ["squeeze() with no dim of a (batch, 4, 6) value", "give it the dims to drop"]),
    ("norm_nuc", lambda m, h, x: torch.norm(_v(h, x), p="nuc", dim=(1, 2)), "norm",
     ["a norm of order 'nuc'"]),
    ("unflatten_batch", lambda m, h, x: h.unflatten(0, (2, -1)).sum(-1), ".unflatten()",
     ["unflattens the batch dimension", "e.g. `.unflatten(-1, (H, D))`"]),
    ("batch_after_features", lambda m, h, x: h.view(2, x.shape[0], 12).sum(0), ".view()",
     ["puts one of them before the batch or a leading dim",
      "write the batch and leading dims first, e.g. `h.view(x.shape[0], H, D)`"]),
]


@pytest.mark.parametrize("key,fn,op,why", REFUSED, ids=[r[0] for r in REFUSED])
def test_refusals_say_what_to_write(key: str, fn: Any, op: str | None, why: list[str]) -> None:
    torch.manual_seed(0)
    m = _Refused(fn).eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        m(x)   # torch computes it
    with pytest.raises(TailError) as ei:
        cupyfuse.from_model(m)(x)
    msg = str(ei.value)
    if op is not None:
        assert f"cannot fuse `{op}`" in msg, msg
    for w in why:
        assert w in msg, msg
    assert f"{THIS}:" in msg, msg   # the line that did it


@pytest.mark.parametrize("fn,why", [
    (lambda m, h, x: h.unflatten(1, (5, 5)).sum(-1),
     "sizes (5, 5) don't multiply up to the size of dim 1 (24) (torch raises)"),
    (lambda m, h, x: _v(h, x).select(1, 4).sum(-1), "index 4 out of range for size 4 (torch "
     "raises)"),
    (lambda m, h, x: _v(h, x).narrow(2, 4, 3).sum(-1), "entries [4, 7) of 6 (torch raises)"),
])
def test_refusals_where_torch_raises(fn: Any, why: str) -> None:
    """What torch raises on is refused (never computed), saying torch raises."""
    with pytest.raises(TailError, match=re.escape(why)):
        cupyfuse.from_model(Heads(fn).eval())(torch.randn(4, 8))


@pytest.mark.parametrize("fn,why", [
    (lambda m, h, x: torch.cat([_vs(h, x), _vs(h, x)], 1).sum(-1),
     "joins along a leading (sequence) dim"),
    (lambda m, h, x: _vs(h, x).narrow(1, 0, 2).flatten(2), "a leading (sequence) dim"),
    (lambda m, h, x: _vs(h, x)[:, 0].flatten(1), "indexes a leading (sequence) dim"),
    (lambda m, h, x: _vs(h, x).flatten(1), "flattening the batch or a leading dim together "
     "with feature dims of a (batch, seq, 4, 6) value (write `.flatten(2)`"),
    (lambda m, h, x: _vs(h, x).reshape(x.shape[0], -1), "e.g. `.flatten(2)`"),
    (lambda m, h, x: _vs(h, x).transpose(-1, -2).flatten(2), "reorders the dims of a "
     "(batch, seq, 4, 6) value"),
])
def test_refusals_with_a_sequence_dim(fn: Any, why: str) -> None:
    m = Heads(fn).eval()
    x = torch.randn(2, S, 8)
    with pytest.raises(TailError, match=re.escape(why)):
        cupyfuse.from_model(m)(x)


def test_too_many_groups_for_one_block() -> None:
    """More group results than one block stages, in groups too long to re-read: refused
    when the program is built (CPU and GPU alike), not only by the code generator."""
    m = _wide(8193, 33, lambda v: v.sum(-1)).eval()
    with pytest.raises(TailError, match=r"8193 groups of 33 features is more than the 8192"):
        cupyfuse.from_model(m)(torch.randn(2, 4))


def test_non_contiguous_parameter_on_the_gpu_path() -> None:
    """An (H, D) parameter is read as H * D per-feature values with one stride: its
    elements must be evenly spaced (prepared.param_sf, used by both GPU paths)."""
    from cupyfuse.backend.prepared import param_sf

    t = torch.randn(H, D)
    assert param_sf((H * D,), t.shape, t.stride()) == 1
    t3 = torch.randn(1, H, D)
    assert param_sf((H * D,), t3.shape, t3.stride()) == 1
    c = torch.randn(5)
    assert param_sf((5, 1), c.shape, c.stride()) == 1   # (C,) read as (C, 1): stride 1 too
    ev = torch.randn(H, 2 * D)[:, ::2]   # evenly spaced: stride 2
    assert param_sf((H * D,), ev.shape, ev.stride()) == 2
    tt = torch.randn(D, H).t()
    with pytest.raises(TailError, match=r"must be evenly spaced in memory \(make it "
                                        r"contiguous: \.contiguous\(\)\)"):
        param_sf((H * D,), tt.shape, tt.stride())


# =================================================================================
# 4. the IR: sred and remap
# =================================================================================
@pytest.mark.parametrize("op", ["sum", "max", "min"])
@pytest.mark.parametrize("shape,axis", [((2, 3, 4), 0), ((2, 3, 4), 1), ((5, 2, 7, 3), 0),
                                        ((5, 2, 7, 3), 1), ((5, 2, 7, 3), 2), ((5, 1, 12), 1)])
def test_sred_values_against_torch(op: str, shape: tuple, axis: int) -> None:
    """sred over axis ``axis`` of features viewed as ``shape[1:]``: groups of that dim's
    size, the size of the dims after it apart."""
    torch.manual_seed(0)
    t = torch.randn(shape)
    t.view(-1)[3] = float("nan")
    feats = shape[1:]
    g = feats[axis]
    s = math.prod(feats[axis + 1:])
    n = Node("sred", op, (0,), (1, g, s), (BATCH, math.prod(feats) // g))
    got = sred_values(t.reshape(shape[0], -1), n)
    ref = {"sum": lambda u: u.double().sum(axis + 1).float(), "max": lambda u: u.amax(axis + 1),
           "min": lambda u: u.amin(axis + 1)}[op](t).reshape(shape[0], -1)
    torch.testing.assert_close(got, ref, equal_nan=True)


def test_remap_index_and_canonical_forms() -> None:
    b = Builder()
    v = b.input(0, (BATCH, 12))
    # a (3,) value broadcast over 4 heads: feature f reads f % 3
    p = b.param("p", (3,))
    r = b.remap(p, (4, 3), (0, 1))
    assert remap_index((4, 3), (0, 1), 0).tolist() == [f % 3 for f in range(12)]
    assert b.p.nodes[r].dims == (12,)
    # size-1 entries dropped, contiguous entries merged: the identity is v itself
    assert b.remap(v, (3, 1, 4), (4, 7, 1)) == v
    # broadcast entries merge too: (2, 3) of stride 0 is one entry of 6
    q = b.remap(b.param("q", (2,)), (2, 2, 3), (1, 0, 0))
    assert b.p.nodes[q].attrs[1:] == ((2, 6), (1, 0), 0)
    # a strided pick: (B, 4, 3)[:, :, 1]
    k = b.remap(v, (4,), (3,), 1)
    assert remap_index((4,), (3,), 1).tolist() == [1, 4, 7, 10]
    t = torch.arange(24.).reshape(2, 12)
    assert remap_values(t, b.p.nodes[k]).tolist() == [[1, 4, 7, 10], [13, 16, 19, 22]]
    with pytest.raises(AssertionError):
        b.remap(v, (4,), (3,), 3)   # reads past the row


def test_sred_special_cases() -> None:
    b = Builder()
    v = b.input(0, (BATCH, 12))
    assert b.p.nodes[b.sred("sum", v, 1, 4)].kind == "map"       # a sum of one: v + 0
    assert b.sred("max", v, 1, 4) == v
    assert b.p.nodes[b.sred("sum", v, 12, 1)].kind == "rred"     # the whole row
    n = b.p.nodes[b.sred("min", v, 3, 4)]
    assert (n.kind, n.attrs, n.dims) == ("sred", (1, 3, 4), (BATCH, 4))


def _plan_text(fn: Any, k: int = 8, w: int = H * D) -> str:
    prog = program_of(Heads(fn, k=k, w=w), torch.randn(2, k))
    return "\n".join(lv.kernel for lv in codegen.plan(prog).levels if lv.kernel)


def test_generated_group_strategies() -> None:
    """Small groups: a thread per group, staged; from 32 features a warp per group (a
    warp combine); past MAX_GROUPS (or the shared-memory budget) each result re-read
    where used; a remap reads its operand at a computed index."""
    small = _plan_text(lambda m, h, x: _v(h, x).amax(-1))
    assert "for (int q = threadIdx.x; q < 4; q += blockDim.x)" in small and \
        "__shared__ float ss" in small
    warp = _plan_text(lambda m, h, x: h.view(-1, 2, 64).sum(-1), w=128)
    assert "cf_warp_combine<double>" in warp and "for (int q = warp; q < 2; q += nw)" in warp
    strided = _plan_text(lambda m, h, x: h.view(-1, 40, 3).sum(1), w=120)
    assert "const int b0 = (q / 3) * 120 + q % 3;" in strided and "j * 3" in strided
    inline = _plan_text(lambda m, h, x: h.view(-1, 9000, 2).amax(-1), k=4, w=18000)
    assert "__shared__ float ss" not in inline and "auto v" in inline and \
        "for (int j = 0; j < 2; ++j)" in inline
    budget = _plan_text(lambda m, h, x: h.view(-1, 6000, 2).softmax(-1).flatten(1), k=4,
                        w=12000)
    assert budget.count("__shared__ float ss") == 1   # the second one past the budget
    long = _plan_text(lambda m, h, x: h.view(-1, 6000, 33).softmax(-1).sum(1), k=4,
                      w=198000)   # (groups longer than INLINE_GROUP: re-read all the same)
    assert "__shared__ float ss4[6000];" in long   # the max staged, the sum re-read:
    assert re.search(r"auto v\d+ = \[&\]\(int q\) -> float \{ const int b0 = q \* 33; "
                     r"double m = 0\.0; for \(int j = 0; j < 33; \+\+j\)", long), long[:3000]
    assert config.SHARED_BUDGET < 48 * 1024
    pick = _plan_text(lambda m, h, x: _v(h, x)[:, :, 2])
    assert "v3(2 + f * 6)" in pick or re.search(r"v\d+\(2 \+ f \* 6\)", pick), pick


# =================================================================================
# 5. the generated kernels compile (nvcc, sm_90a) without spills
# =================================================================================
NVCC = shutil.which("nvcc")
_ENTRY_RE = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PROPS_RE = re.compile(r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, "
                       r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _compile_programs() -> list[tuple[str, Any]]:
    out = []
    for name, fn in FORMS:
        torch.manual_seed(0)
        out.append((name, program_of(Heads(fn), torch.randn(4, 8))))
    for name, fn in LEAD_FORMS:
        torch.manual_seed(0)
        out.append((f"lead_{name}", program_of(Heads(fn), torch.randn(2, S, 8))))
    for name, heads, dim, tail in WIDE:
        out.append((f"wide_{name}", program_of(_wide(heads, dim, tail),
            torch.randn(2, 4))))
    for seed in range(12):
        case = seeded_case(seed)
        out.append((f"drawn{seed}", program_of(case.spec.make_model(0),
            case.spec.make_input(3, 0))))
    return out


def _nvcc(src: Any, out: Any) -> subprocess.Popen:
    return subprocess.Popen([NVCC, "-cubin", "-o", str(out), "-std=c++17",
                             "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", str(src)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every level kernel of the programs (three .cu files), and for a few of them the
    prepared launches' forms (the skinny GEMM with the tail in one launch, the tail
    reading split-K partial products), each in a file of its own."""
    tmp = tmp_path_factory.mktemp("heads_cu")
    header = runtime.expand_source("tail_ops.cuh")
    skinny = runtime.expand_source("gemm_skinny.cuh")
    bodies: dict[str, str] = {}
    singles: dict[str, str] = {}
    names: dict[str, list[str]] = {}
    kinds: set[str] = set()
    for case, prog in _compile_programs():
        kinds |= {n.kind for n in prog.nodes}
        names[case] = []
        for lv in codegen.plan(prog).levels:
            if not lv.kernel:
                continue
            bodies.setdefault(lv.name, lv.kernel.split("\n", 1)[1])
            names[case].append(lv.name)
            if case in ("softmax_back", "stat_over_heads_back", "wide_warp_strided") and \
                    len(lv.gemms) == 1 and not lv.bns:
                name, text = codegen.fused_skinny_source(lv, 16, skinny)
                singles[name] = header + text.split("\n", 1)[1]
                names[case].append(name)
                name, text = codegen.ksum_source(lv, 4, 1 << 20)
                define, _, body = text.split("\n", 2)
                singles[name] = define + "\n" + header + body
                names[case].append(name)
    files = [[] for _ in range(3)]
    for i, name in enumerate(sorted(bodies)):
        files[i % 3].append(name)
    procs = []
    for i, chunk in enumerate(files):
        src = tmp / f"heads_{i}.cu"
        src.write_text(header + "\n" + "\n".join(bodies[n] for n in chunk))
        procs.append(_nvcc(src, tmp / f"heads_{i}.cubin"))
    for name, text in singles.items():
        src = tmp / f"{name}.cu"
        src.write_text(text)
        procs.append(_nvcc(src, tmp / f"{name}.cubin"))
    logs = [p.communicate(timeout=900)[0] for p in procs]
    text = "\n".join(logs)
    return {"rc": [p.returncode for p in procs], "log": text, "names": names, "kinds": kinds,
            "entries": {m.group(1) for m in _ENTRY_RE.finditer(text)},
            "props": {m.group(1): int(m.group(3)) for m in _PROPS_RE.finditer(text)},
            "sources": "\n".join(list(bodies.values()) + list(singles.values()))}


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_head_split_kernels_compile_without_spills(compiled: dict[str, Any]) -> None:
    assert all(rc == 0 for rc in compiled["rc"]), compiled["log"][-6000:]
    assert {"sred", "remap", "slice", "rred", "gemv"} <= compiled["kinds"], compiled["kinds"]
    n = 0
    for case, names in compiled["names"].items():
        assert names, f"{case}: no kernel"
        for name in names:
            assert name in compiled["entries"], f"{case}: {name} not compiled"
            assert compiled["props"][name] == 0, f"{case}: {name} spills"
            n += 1
    assert n >= 80
    src = compiled["sources"]
    for what in ("cf_warp_combine<double>", "cf_warp_combine<float>", "__shared__ float ss",
                 "for (int q = threadIdx.x;", "cf_ksum("):
        assert what in src, what


# =================================================================================
# 6. the generated kernels run on the CPU (tests/emu/cuda.py: a thread emulation)
# =================================================================================
def _emulated_cases() -> list[tuple[str, nn.Module, torch.Tensor]]:
    out = []
    for name, fn in FORMS:
        torch.manual_seed(0)
        x = torch.randn(3, 8) * 2
        x[1, 2] = float("nan")
        out.append((name, Heads(fn).eval(), x))
    for name, fn in LEAD_FORMS:
        torch.manual_seed(0)
        out.append((f"lead_{name}", Heads(fn).eval(), torch.randn(2, S, 8)))
    for name, heads, dim, tail in WIDE:
        if heads * dim <= 20000:
            torch.manual_seed(0)
            out.append((f"wide_{name}", _wide(heads, dim, tail).eval(), torch.randn(2, 4)))
    for seed in range(40):
        case = seeded_case(seed, lead=(3,) if seed % 4 == 3 else None)
        out.append((f"drawn{seed}", case.spec.make_model(case.seed),
                    case.spec.make_input(min(case.batch, 3), case.seed)))
    return out


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not on PATH")
def test_generated_kernels_emulated_on_the_cpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every level kernel of the forms, the sequence-dim forms, the narrower wide shapes
    and 40 drawn models, compiled as C++ with threads standing in for CUDA's (barriers,
    warp shuffles, shared arrays) and run on the program's buffers: the same values as the
    CPU path (NaN placement exact, values within 1e-5)."""
    from emu import cuda as _cuda_emu
    from cupyfuse.backend.cpu import run_cpu
    from cupyfuse.runner import _resolve

    cases = []
    for name, model, x in _emulated_cases():
        prog = program_of(model, x)
        srcs = [_resolve(model, s).detach() if isinstance(s, str) else s
                for s in prog.sources]
        rows = x.reshape((-1,) + (1,) * (x.dim() - 2) + (x.shape[-1],)) if prog.lead else x
        cases.append((name, prog, rows, srcs))
    kernels = _cuda_emu.build_or_skip([c[1] for c in cases], tmp_path_factory.mktemp("emu"))
    for name, prog, rows, srcs in cases:
        with torch.no_grad():
            want = run_cpu(prog.unrewritten or prog, [rows], srcs)
            got = _cuda_emu.run_program(prog, [rows], srcs, kernels)
        assert got.shape == want.shape, name
        assert torch.equal(torch.isnan(got), torch.isnan(want)), name
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
