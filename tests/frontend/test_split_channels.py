"""Pooling, GroupNorm and InstanceNorm of a (batch, C, L) split; sequence reductions of a
split value.

A Linear's features viewed as channels and positions (``h.view(B, C, L)``, see
tests/frontend/test_split_features.py) are one program value of C * L features, channel c at
features [c * L, (c + 1) * L):

* 1-D pooling over L (``nn.MaxPool1d``/``AvgPool1d``, ``F.max_pool1d``/``avg_pool1d``,
  the adaptive forms whose windows are equal) is the flat pool with stride gcd(L, s)
  and a remap picking each channel's windows (lower.reductions._split_pool);
* GroupNorm's groups are consecutive features (``Builder.group_normalize``), its (C,)
  weight and bias laid out over the positions;
* InstanceNorm is a LayerNorm over each channel's positions (``splits.layer_norm``), or,
  with running statistics (eval mode with track_running_stats, F.instance_norm's
  use_input_stats=False), each channel's ``(v - mean) * rsqrt(var + eps)``;
* a reduction over the sequence dim of a (batch, seq, H, D) view (sum/mean/amax/var/
  logsumexp/norm..., softmax, F.normalize) is the flat value's sequence reduction
  (``seqred``) after any feature dims reduced with it (splits.reduce).

Tests: hypothesis property tests drawing whole models (the split spelled several ways,
chains of pooling/norm/activation ops with their parameters, sequence reductions over
the sequence and feature dims, NaN/inf inputs, batch 1) against float64 torch at
atol = rtol = 1e-4; hand-written forms on the CPU and (``gpu``) the GPU; wide shapes
for the kernels' strategies (``gpu``); the GPU path of the forms and drawn models run
on the CPU through ``execute.run_gpu`` with the generated kernels compiled as C++
(tests/emu/gpu.py + tests/emu/cuda.py); the generated kernels compiled with nvcc for
sm_90a without spills; a message test for every refused combination.
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

import cupyfuse
from cupyfuse.backend import codegen, runtime
from cupyfuse.api import fused_class
from cupyfuse.interop import cupy_available
from cupyfuse.ir.program import TailError
from helpers import DEVICES
from gen.tails import HypDraw, RandDraw, assert_matches
from helpers import program_of
from helpers import examples

THIS = "test_split_channels.py"
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
    # (as tests/frontend/test_split_features.py: NaN-poisoned op buffers and full-float32 torch
    # matmuls on a GPU; var/std with one degree of freedom and grad-mode calls warn)
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
# the generator: whole models as source text (a failure shows the model)
# =================================================================================
@dataclass
class ChanSpec:
    name: str
    K: int
    lead: tuple[int, ...]
    source: str
    ops: list[str] = field(default_factory=list)
    _cls: Any = None

    def __repr__(self) -> str:
        return f"ChanSpec({self.name}: K={self.K} lead={self.lead} ops={self.ops})\n" \
               f"{self.source}"

    def model_class(self) -> type:
        if self._cls is None:
            fname = f"<changen {self.name}>"
            linecache.cache[fname] = (len(self.source), None, self.source.splitlines(True),
                                      fname)
            ns: dict[str, Any] = {"torch": torch, "nn": nn, "F": F, "math": math,
                                  "__name__": "changen_models"}
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
    """Draws a model: ``Linear(K, C * prod(spatial))``, its output viewed as (batch, C,
    *spatial), a chain of 1..3 channel ops (pooling, GroupNorm, InstanceNorm,
    activations; each drawn only where torch computes it), a final form."""

    def __init__(self, d: Any, n_ops: int | None) -> None:
        self.d = d
        self.C = d.choice([1, 2, 2, 3, 4, 4, 5, 6])
        self.sp = [d.int(1, 9)] if d.bool(0.7) else [d.int(1, 4), d.int(1, 4)]
        self.K = d.int(1, 10)
        self.n_ops = n_ops if n_ops is not None else d.int(1, 3)
        self.init: list[str] = []
        self.fwd: list[str] = []
        self.ops: list[str] = []
        self.count = 0

    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"{stem}{self.count}"

    def split_expr(self) -> str:
        fs = ", ".join(map(str, [self.C] + self.sp))
        how = self.d.choice(["view", "reshape", "unflatten", "star", "minus1"])
        rows = self.d.choice(["x.shape[0]", "-1", "x.size(0)"])
        if how in ("view", "reshape"):
            return f"h.{how}({rows}, {fs})"
        if how == "unflatten":
            return f"h.unflatten(1, ({fs},))"
        if how == "star":
            return f"h.view(*h.shape[:-1], {fs})"
        parts = [str(x) for x in [self.C] + self.sp]
        parts[self.d.int(0, len(parts) - 1)] = "-1"
        return f"h.view(x.shape[0], {', '.join(parts)})"

    def emit(self, expr: str, op: str) -> None:
        self.fwd.append(f"v = {expr}")
        self.ops.append(op)

    # --- ops --------------------------------------------------------------------------
    def op_pool(self) -> bool:
        if len(self.sp) != 1:
            return False
        L = self.sp[0]
        mx = self.d.bool()
        how = self.d.choice(["module", "function", "kwargs", "adaptive", "adaptive_fn",
                             "window", "adaptive_any"])
        if how == "adaptive_any":   # any output size: torch's unequal windows too
            o = self.d.int(1, L + 2)
            fn = "F.adaptive_max_pool1d" if mx else "F.adaptive_avg_pool1d"
            self.emit(f"{fn}(v, {o})", f"adaptive_any{o}")
            self.sp = [o]
            return True
        if how == "window":   # padding, ceil_mode, dilation, count_include_pad
            k = self.d.int(1, L + 1)
            s = self.d.int(1, 3)
            pad = self.d.int(0, k // 2)
            ceil = self.d.bool()
            dil = self.d.int(1, 2) if mx else 1
            incl = self.d.bool()
            probe = torch.zeros(1, 1, L)
            try:
                lo = (F.max_pool1d(probe, k, s, pad, dil, ceil_mode=ceil) if mx else
                      F.avg_pool1d(probe, k, s, pad, ceil, incl)).shape[-1]
            except RuntimeError:
                return False
            if mx:
                if self.d.bool():
                    m = self.fresh("pool")
                    self.init.append(f"self.{m} = nn.MaxPool1d({k}, {s}, padding={pad}, "
                                     f"dilation={dil}, ceil_mode={ceil})")
                    self.emit(f"self.{m}(v)", f"MaxPool1d({k},{s},{pad},{dil},{ceil})")
                else:
                    self.emit(f"F.max_pool1d(v, {k}, {s}, {pad}, {dil}, ceil_mode={ceil})",
                              f"max_pool1d({k},{s},{pad},{dil},{ceil})")
            else:
                self.emit(f"F.avg_pool1d(v, {k}, {s}, padding={pad}, ceil_mode={ceil}, "
                          f"count_include_pad={incl})", f"avg_pool1d({k},{s},{pad},{ceil},{incl})")
            self.sp = [lo]
            return True
        if how.startswith("adaptive"):
            o = self.d.choice([q for q in range(1, L + 1) if L % q == 0])
            kind = "Max" if mx else "Avg"
            if how == "adaptive":
                m = self.fresh("pool")
                self.init.append(f"self.{m} = nn.Adaptive{kind}Pool1d({o})")
                self.emit(f"self.{m}(v)", f"adaptive_{kind.lower()}{o}")
            else:
                fn = self.d.choice(["F.adaptive_max_pool1d"] if mx else
                                   ["F.adaptive_avg_pool1d", "torch.adaptive_avg_pool1d"])
                self.emit(f"{fn}(v, {o})", f"adaptive_{kind.lower()}{o}")
            self.sp = [o]
            return True
        k = self.d.int(1, L)
        s = self.d.choice([None, 1, 2, 3, k, k + 1, L])
        if how == "module":
            m = self.fresh("pool")
            cls = "MaxPool1d" if mx else "AvgPool1d"
            self.init.append(f"self.{m} = nn.{cls}({k}" + ("" if s is None else f", {s}") + ")")
            self.emit(f"self.{m}(v)", f"{cls}({k},{s})")
        elif how == "function":
            fn = "F.max_pool1d" if mx else "F.avg_pool1d"
            self.emit(f"{fn}(v, {k}" + ("" if s is None else f", {s}") + ")", f"{fn}({k},{s})")
        else:
            fn = "F.max_pool1d" if mx else "F.avg_pool1d"
            self.emit(f"{fn}(v, kernel_size={k}" + ("" if s is None else f", stride={s}") + ")",
                      f"{fn}({k},{s})")
        s = k if s is None else s
        self.sp = [(L - k) // s + 1]
        return True

    def op_groupnorm(self) -> bool:
        per = math.prod(self.sp)
        gs = [g for g in range(1, self.C + 1) if self.C % g == 0 and self.C // g * per >= 2]
        if not gs:
            return False
        g = self.d.choice(gs)
        eps = self.d.choice([1e-5, 1e-3, 0.1])
        how = self.d.choice(["module", "module_plain", "function", "function_w", "function_0"])
        if how.startswith("module"):
            m = self.fresh("gn")
            aff = how == "module"
            self.init.append(f"self.{m} = nn.GroupNorm({g}, {self.C}, eps={eps}, affine={aff})")
            if aff:
                self.init.append(f"nn.init.uniform_(self.{m}.weight, 0.5, 1.5)")
                self.init.append(f"nn.init.normal_(self.{m}.bias)")
            self.emit(f"self.{m}(v)", f"GroupNorm({g},{self.C},{how})")
            return True
        if how == "function_0":
            self.emit(f"F.group_norm(v, {g}, eps={eps})", f"group_norm({g})")
            return True
        w, b = self.fresh("w"), self.fresh("b")
        self.init.append(f"self.{w} = nn.Parameter(torch.rand({self.C}) + 0.5)")
        self.init.append(f"self.{b} = nn.Parameter(torch.randn({self.C}))")
        bias = f"self.{b}" if how == "function" else "None"
        self.emit(f"F.group_norm(v, {g}, self.{w}, {bias}, {eps})", f"group_norm({g},w)")
        return True

    def op_instancenorm(self) -> bool:
        nsp = len(self.sp)
        per = math.prod(self.sp)
        eps = self.d.choice([1e-5, 1e-3, 0.1])
        how = self.d.choice(["module", "module_affine", "module_running", "function",
                             "function_wb", "function_running"])
        if per < 2 and "running" not in how:
            return False   # (torch raises: one spatial element; tested among the refusals)
        C = self.C
        if how.startswith("module"):
            m = self.fresh("inorm")
            aff = how != "module"
            run = how == "module_running"
            self.init.append(f"self.{m} = nn.InstanceNorm{nsp}d({C}, eps={eps}, affine={aff}, "
                             f"track_running_stats={run})")
            if aff:
                self.init.append(f"nn.init.uniform_(self.{m}.weight, 0.5, 1.5)")
                self.init.append(f"nn.init.normal_(self.{m}.bias)")
            if run:
                self.init.append(f"self.{m}.running_mean.normal_()")
                self.init.append(f"self.{m}.running_var.uniform_(0.5, 2.0)")
            self.emit(f"self.{m}(v)", f"InstanceNorm{nsp}d({how})")
            return True
        if how == "function":
            self.emit(f"F.instance_norm(v, eps={eps})", "instance_norm")
            return True
        w, b = self.fresh("w"), self.fresh("b")
        self.init.append(f"self.{w} = nn.Parameter(torch.rand({C}) + 0.5)")
        self.init.append(f"self.{b} = nn.Parameter(torch.randn({C}))")
        if how == "function_wb":
            self.emit(f"F.instance_norm(v, weight=self.{w}, bias=self.{b}, eps={eps})",
                      "instance_norm(w,b)")
            return True
        rm, rv = self.fresh("rm"), self.fresh("rv")
        self.init.append(f"self.register_buffer('{rm}', torch.randn({C}))")
        self.init.append(f"self.register_buffer('{rv}', torch.rand({C}) + 0.5)")
        self.emit(f"F.instance_norm(v, self.{rm}, self.{rv}, self.{w}, None, False, 0.1, "
                  f"{eps})", "instance_norm(running)")
        return True

    def op_act(self) -> bool:
        self.emit(self.d.choice(["torch.tanh(v)", "F.gelu(v)", "v * 1.5 - 0.25", "v.abs()",
                                 "torch.relu(v) + 0.5"]), "act")
        return True

    OPS = ("pool", "pool", "groupnorm", "instancenorm", "act")

    def build(self, name: str) -> ChanSpec:
        W = self.C * math.prod(self.sp)
        self.init.append(f"self.fc = nn.Linear({self.K}, {W})")
        self.fwd.append("h = self.fc(x)")
        self.fwd.append(f"v = {self.split_expr()}")
        tries = 0
        while len([o for o in self.ops if o != "act"]) < self.n_ops and tries < 40:
            tries += 1
            getattr(self, f"op_{self.d.choice(self.OPS)}")()
        final = self.d.choice(["flatten", "split", "sum", "softmax", "mean_channels"])
        if final == "flatten":
            self.fwd.append("return v.flatten(1)")
        elif final == "split":
            self.fwd.append("return v")
        elif final == "sum":
            self.fwd.append("return v.sum(-1)")
        elif final == "softmax":
            self.fwd.append("return v.softmax(-1).flatten(1)")
        else:
            self.fwd.append("return v.mean(1)")
        self.ops.append(final)
        return _spec(name, self.K, (), self.init, self.fwd, self.ops)


def _spec(name: str, K: int, lead: tuple[int, ...], init: list[str], fwd: list[str],
          ops: list[str]) -> ChanSpec:
    src = [f"class {name}(nn.Module):", "    def __init__(self):",
           "        super().__init__()"] + [f"        {s}" for s in init] + \
          ["", "    def forward(self, x):"] + [f"        {s}" for s in fwd]
    return ChanSpec(name, K, lead, "\n".join(src) + "\n", ops)


def _seq_spec(d: Any, name: str) -> ChanSpec:
    """A (batch, seq, K) input, its Linear's output viewed as (batch, seq, *fs), optional
    ops, then a reduction / softmax / normalisation over the sequence dim (dim 1; with a
    feature dim beside it for some), a final form."""
    S = d.int(1, 5)
    nf = d.choice([2, 2, 3])
    fs = [d.choice([1, 2, 3, 4, 5]) for _ in range(nf)]
    while sum(1 for x in fs if x > 1) < 2:
        fs[d.int(0, nf - 1)] = d.choice([2, 3, 4])
    K = d.int(1, 8)
    init = [f"self.fc = nn.Linear({K}, {math.prod(fs)})"]
    rows = d.choice(["x.shape[0], x.shape[1]", f"-1, {S}", "x.size(0), x.size(1)"])
    split = d.choice([f"h.view({rows}, {', '.join(map(str, fs))})",
                      f"h.unflatten(-1, ({', '.join(map(str, fs))},))",
                      f"h.view(*h.shape[:-1], {', '.join(map(str, fs))})"])
    fwd = ["h = self.fc(x)", f"v = {split}"]
    ops = []
    if d.bool(0.4):
        fwd.append("v = " + d.choice(["torch.tanh(v)", "v * 2.0 - 1.0", "F.silu(v)"]))
        ops.append("act")
    dims = [1] + list(range(2, 2 + nf))   # the seq dim, then the feature dims
    what = d.choice(["reduce", "reduce", "reduce", "softmax", "normalize", "center",
                     "scale", "lse_back"])
    keep = d.bool(0.4)
    axes = [1]
    if what == "reduce" and d.bool(0.4):
        axes.append(d.choice(dims[1:]))
    ax = axes[0] if len(axes) == 1 else tuple(axes)
    if what == "reduce":
        kind = d.choice(["sum", "mean", "amax", "amin", "max", "min", "logsumexp", "norm",
                         "var", "std", "nansum?"])
        kind = "sum" if kind == "nansum?" else kind
        if kind in ("max", "min"):
            axes = [1]
            fwd.append(f"v = v.{kind}(1, keepdim={keep}).values" if d.bool() else
                       f"v = torch.{kind}(v, 1, {keep})[0]")
        elif kind == "norm":
            fwd.append(f"v = torch.linalg.vector_norm(v, dim={ax!r}, keepdim={keep})")
        elif kind in ("var", "std"):
            fwd.append(f"v = v.{kind}({ax!r}, keepdim={keep}, correction={d.choice([0, 1])})")
        elif kind == "logsumexp":
            fwd.append(f"v = torch.logsumexp(v, {ax!r}, keepdim={keep})")
        else:
            fwd.append(f"v = v.{kind}(dim={ax!r}, keepdim={keep})")
        ops.append(f"{kind}{axes}{'k' if keep else ''}")
        left = len(dims) + 1 - (0 if keep else len(axes))   # the dims after the reduction
        seq_left = keep
    else:
        fwd.append("v = " + {
            "softmax": d.choice(["v.softmax(1)", "F.log_softmax(v, dim=1)",
                                 "F.softmin(v, 1)"]),
            "normalize": d.choice(["F.normalize(v, dim=1)", "F.normalize(v, p=1.0, dim=1)"]),
            "center": "v - v.mean(1, keepdim=True)",
            "scale": "v / (v.abs().amax(1, keepdim=True) + 1.0)",
            "lse_back": "v - torch.logsumexp(v, 1, keepdim=True)",
        }[what])
        ops.append(what)
        left = len(dims) + 1
        seq_left = True
    final = d.choice(["flatten", "split", "sum"])
    start = 2 if seq_left else 1
    if final == "flatten" and left > start + 1:
        fwd.append(f"return v.flatten({start})")
    elif final == "sum" and left > start:
        fwd.append("return v.sum(-1)")
    else:
        fwd.append("return v")
        final = "split"
    ops.append(final)
    return _spec(name, K, (S,), init, fwd, ops)


_N = [0]


def draw_spec(d: Any, family: str = "channels", n_ops: int | None = None) -> ChanSpec:
    _N[0] += 1
    if family == "seq":
        return _seq_spec(d, f"Seq{_N[0]}")
    return _Gen(d, n_ops).build(f"Chan{_N[0]}")


@dataclass
class ChanCase:
    spec: ChanSpec
    batch: int
    seed: int
    n_special: int
    api: str

    def __repr__(self) -> str:
        return f"ChanCase(batch={self.batch}, seed={self.seed}, n_special={self.n_special}, " \
               f"api={self.api!r})\n{self.spec!r}"


@st.composite
def chan_cases(draw: Any, family: str = "channels",
               specials: tuple[int, ...] = (0, 0, 0, 1, 2)) -> ChanCase:
    spec = draw_spec(HypDraw(draw), family)
    return ChanCase(spec, draw(st.integers(1, 6)), draw(st.integers(0, 2 ** 20)),
                    draw(st.sampled_from(specials)),
                    draw(st.sampled_from(["from_model", "fused_class"])))


def seeded_case(seed: int, family: str | None = None) -> ChanCase:
    d = RandDraw(seed)
    spec = draw_spec(d, family or ("seq" if seed % 3 == 2 else "channels"))
    return ChanCase(spec, d.int(1, 6), d.int(0, 2 ** 20), d.choice([0, 0, 1, 2]),
                    d.choice(["from_model", "fused_class"]))


def run_case(case: ChanCase, device: str = "cpu", calls: int = 1) -> None:
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
@_settings(150)
@given(chan_cases())
def test_random_channel_ops_match_float64(case: ChanCase) -> None:
    """Pooling, GroupNorm and InstanceNorm of (batch, C, *spatial) views, chained."""
    note(repr(case))
    run_case(case)


@_settings(50)
@given(chan_cases(specials=(1, 2, 4)))
def test_random_channel_ops_nonfinite_inputs(case: ChanCase) -> None:
    """NaN, +inf and -inf in x: placement as float64 torch's."""
    note(repr(case))
    run_case(case)


@_settings(120)
@given(chan_cases(family="seq"))
def test_random_sequence_reductions_of_splits_match_float64(case: ChanCase) -> None:
    """Reductions, softmax and normalisation over the sequence dim of (batch, seq, H,
    D[, E]) views, with a feature dim beside it for some."""
    note(repr(case))
    run_case(case)


def test_generator_draws_every_form() -> None:
    """The generators reach every op and spelling over the seeds the GPU tests use."""
    text = ""
    ops: set[str] = set()
    for seed in range(300):
        for fam in ("channels", "seq"):
            spec = seeded_case(seed, fam).spec
            text += spec.source
            ops |= set(spec.ops)
    for form in ("nn.MaxPool1d(", "nn.AvgPool1d(", "F.max_pool1d(v, kernel_size=",
                 "F.avg_pool1d(v, ", "nn.AdaptiveAvgPool1d(", "nn.AdaptiveMaxPool1d(",
                 "F.adaptive_max_pool1d(", "torch.adaptive_avg_pool1d(", "nn.GroupNorm(",
                 "affine=False)", "F.group_norm(v, ", "nn.InstanceNorm1d(",
                 "nn.InstanceNorm2d(", "track_running_stats=True", "F.instance_norm(v, eps",
                 "F.instance_norm(v, weight=", "F.instance_norm(v, self.rm", ".unflatten(1, (",
                 ".view(*h.shape[:-1]", "h.reshape(", ".view(x.shape[0], ",
                 ".softmax(1)", "F.log_softmax(v, dim=1)", "F.softmin(v, 1)",
                 "F.normalize(v, dim=1)", "v - v.mean(1, keepdim=True)",
                 "torch.logsumexp(v, 1, keepdim=True)", "torch.linalg.vector_norm(v, dim=(1,",
                 ".values", "torch.max(v, 1", ".var((1,", ".std(1,"):
        assert form in text, form
    for op in ("sum[1]", "mean[1]k", "amax[1]", "amin[1]", "logsumexp[1]", "norm[1]",
               "var[1]", "std[1]"):
        assert any(o.startswith(op) for o in ops), (op, sorted(ops))


# =================================================================================
# 2. the forms, on the CPU and the GPU
# =================================================================================
C, L = 4, 6
S = 3


class Chan(nn.Module):
    """Linear(k, w) and a tail ``fn(self, h, x)`` with the modules and tensors the forms
    use."""

    def __init__(self, fn: Any, k: int = 8, w: int = C * L, c: int = C) -> None:
        super().__init__()
        self.fc = nn.Linear(k, w)
        self.fn = fn
        self.mp = nn.MaxPool1d(3, 2)
        self.ap = nn.AvgPool1d(2)
        self.aap = nn.AdaptiveAvgPool1d(3)
        self.amp = nn.AdaptiveMaxPool1d(2)
        self.gn = nn.GroupNorm(2, c)
        self.gn1 = nn.GroupNorm(1, c, affine=False)
        self.inn = nn.InstanceNorm1d(c, affine=True)
        self.inn0 = nn.InstanceNorm1d(c)
        self.inr = nn.InstanceNorm1d(c, affine=True, track_running_stats=True)
        self.in2 = nn.InstanceNorm2d(c, affine=True)
        self.w = nn.Parameter(torch.rand(c) + 0.5)
        self.b = nn.Parameter(torch.randn(c))
        self.w1 = nn.Parameter(torch.rand(1) + 0.5)
        self.b1 = nn.Parameter(torch.randn(1))
        self.p_w1 = nn.Parameter(torch.randn(w, 1))   # per feature of a (batch, w, 1) view
        self.register_buffer("rm_w", torch.randn(w))
        self.register_buffer("rv_w", torch.rand(w) + 0.5)
        self.register_buffer("rm", torch.randn(c))
        self.register_buffer("rv", torch.rand(c) + 0.5)
        with torch.no_grad():
            for m in (self.gn, self.inn, self.inr, self.in2):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()
            self.inr.running_mean.normal_()
            self.inr.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self, self.fc(x), x)


def _v(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return h.view(x.shape[0], C, L)


def _vs(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return h.view(x.shape[0], x.shape[1], C, L)


FORMS: list[tuple[str, Any]] = [
    ("maxpool_module", lambda m, h, x: m.mp(_v(h, x)).flatten(1)),
    ("avgpool_module", lambda m, h, x: m.ap(_v(h, x))),
    ("adaptive_avg", lambda m, h, x: m.aap(_v(h, x)).sum(-1)),
    ("adaptive_max", lambda m, h, x: m.amp(_v(h, x)).flatten(1)),
    ("adaptive_to_one", lambda m, h, x: F.adaptive_avg_pool1d(_v(h, x), 1).squeeze(-1)),
    ("max_k4_s3", lambda m, h, x: F.max_pool1d(_v(h, x), 4, 3)),
    ("avg_k2_s4", lambda m, h, x: F.avg_pool1d(_v(h, x), 2, 4)),
    ("max_whole", lambda m, h, x: F.max_pool1d(_v(h, x), L).flatten(1)),
    ("avg_k1_s5", lambda m, h, x: F.avg_pool1d(_v(h, x), 1, 5)),
    ("max_overlapping", lambda m, h, x: F.max_pool1d(_v(h, x), 3, 1).flatten(1)),
    ("avg_kwargs", lambda m, h, x: F.avg_pool1d(_v(h, x), kernel_size=3, stride=3)),
    ("pool_of_unflatten", lambda m, h, x: F.max_pool1d(h.unflatten(1, (C, L)), 2).mean(1)),
    ("groupnorm_module", lambda m, h, x: m.gn(_v(h, x)).flatten(1)),
    ("groupnorm_one_group", lambda m, h, x: m.gn1(_v(h, x))),
    ("f_group_norm", lambda m, h, x: F.group_norm(_v(h, x), 4, m.w, m.b).sum(-1)),
    ("f_group_norm_plain", lambda m, h, x: F.group_norm(_v(h, x), 2, eps=1e-3)),
    ("group_norm_2d", lambda m, h, x: F.group_norm(h.view(-1, C, 2, 3), 2, m.w, m.b)
     .flatten(1)),
    ("instance_norm_affine", lambda m, h, x: m.inn(_v(h, x)).flatten(1)),
    ("instance_norm_plain", lambda m, h, x: m.inn0(_v(h, x))),
    ("instance_norm_running", lambda m, h, x: m.inr(_v(h, x))),
    ("f_instance_norm", lambda m, h, x: F.instance_norm(_v(h, x), weight=m.w, bias=m.b,
                                                         eps=1e-3)),
    ("f_instance_norm_running", lambda m, h, x: F.instance_norm(_v(h, x), m.rm, m.rv, m.w,
                                                                None, False)),
    ("instance_norm_2d", lambda m, h, x: m.in2(h.view(-1, C, 2, 3)).flatten(1)),
    ("instance_norm_unbatched", lambda m, h, x: F.instance_norm(h.view(-1, 1, 4, 6))
     .flatten(1)),
    ("chain", lambda m, h, x: F.max_pool1d(m.gn(torch.tanh(_v(h, x))), 2).softmax(-1)
     .flatten(1)),
    ("pool_then_norm", lambda m, h, x: m.inn(F.avg_pool1d(_v(h, x), 2, 1)).amax(1)),
    ("flat_group_norm_one_channel", lambda m, h, x: F.group_norm(h.unsqueeze(1), 1, m.w1,
                                                                 m.b1)),
    ("flat_pool_size1_stride2", lambda m, h, x: F.max_pool1d(h.unsqueeze(-1), 1, 2)
     .squeeze(-1)),
    ("flat_instance_norm_running", lambda m, h, x: F.instance_norm(
        h.unsqueeze(-1), m.rm_w, m.rv_w, use_input_stats=False, eps=1e-3).squeeze(-1)),
    ("gemv_through_a_view", lambda m, h, x: (h.unsqueeze(-1) * m.p_w1 - 1.0).sum((1, 2))),
]

SEQ_FORMS: list[tuple[str, Any]] = [
    ("mean_seq", lambda m, h, x: _vs(h, x).mean(1)),
    ("sum_seq_keep", lambda m, h, x: _vs(h, x).sum(1, keepdim=True)),
    ("amax_seq", lambda m, h, x: _vs(h, x).amax(1).flatten(1)),
    ("max_seq_values", lambda m, h, x: _vs(h, x).max(1).values.sum(-1)),
    ("min_seq_tuple", lambda m, h, x: torch.min(_vs(h, x), 1)[0]),
    ("var_seq_and_pos", lambda m, h, x: _vs(h, x).var((1, 3))),
    ("std_seq_and_pos_keep", lambda m, h, x: _vs(h, x).std((1, 3), keepdim=True).flatten(1)),
    ("logsumexp_seq", lambda m, h, x: torch.logsumexp(_vs(h, x), 1)),
    ("norm_seq", lambda m, h, x: torch.linalg.vector_norm(_vs(h, x), dim=1)),
    ("mean_everything", lambda m, h, x: _vs(h, x).mean((1, 2, 3))),
    ("mean_seq_channels", lambda m, h, x: _vs(h, x).mean((1, 2))),
    ("softmax_seq", lambda m, h, x: _vs(h, x).softmax(1).flatten(2)),
    ("log_softmax_seq", lambda m, h, x: F.log_softmax(_vs(h, x), 1)),
    ("normalize_seq", lambda m, h, x: F.normalize(_vs(h, x), dim=1)),
    ("center_seq", lambda m, h, x: (_vs(h, x) - _vs(h, x).mean(1, keepdim=True)).flatten(2)),
    ("flat_mean_keep_against_split", lambda m, h, x: (h.mean(1, keepdim=True).view(
        x.shape[0], 1, C, L) + _vs(h, x)).flatten(2)),
    ("instance_norm_of_seq_rows", lambda m, h, x: F.instance_norm(_vs(h, x)).mean(1)
     .flatten(1)),
    ("then_groupnorm", lambda m, h, x: m.gn(_vs(h, x).mean(1)).flatten(1)),
    ("then_pool", lambda m, h, x: F.max_pool1d(_vs(h, x).amax(1), 2)),
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
    m = Chan(fn).eval()
    x = torch.randn(7, 8) * 2
    x[3, 1] = float("nan")
    x[5, 0] = float("inf")
    _check(m, x, device, calls=2)
    _check(m, torch.randn(1, 8), device)   # one row


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,fn", SEQ_FORMS, ids=[f[0] for f in SEQ_FORMS])
def test_sequence_forms_match_float64(name: str, fn: Any, device: str) -> None:
    torch.manual_seed(1)
    m = Chan(fn).eval()
    x = torch.randn(4, S, 8) * 2
    x[2, 1, 3] = float("-inf")
    _check(m, x, device, calls=2)
    _check(m, torch.randn(1, 1, 8), device)   # batch 1, a sequence of one


@pytest.mark.parametrize("device", DEVICES)
def test_tail_function(device: str) -> None:
    """fused_linear with a tail that pools and normalises (batch, C, L) views."""
    torch.manual_seed(2)
    x, w, b = torch.randn(5, 8), torch.randn(C * L, 8), torch.randn(C * L)

    def tail(h: torch.Tensor) -> torch.Tensor:
        v = F.group_norm(h.view(h.shape[0], C, L), 2)
        return F.avg_pool1d(F.instance_norm(v), 3, 2).flatten(1)
    want = tail(x.double() @ w.double().t() + b.double())
    out = cupyfuse.fused_linear(x.to(device), w.to(device), b.to(device), tail)
    assert out.shape == want.shape
    torch.testing.assert_close(out.cpu().double(), want, atol=1e-4, rtol=1e-4)


def test_pool_program_is_one_flat_pool_and_a_pick() -> None:
    """L a multiple of the stride and windows no longer than it: the flat pool itself
    (no remap); otherwise the flat pool every gcd(L, s) features and one remap."""
    def nodes(fn: Any) -> list[Any]:
        prog = program_of(Chan(fn), torch.randn(3, 8))
        return [n for n in prog.nodes if n.kind in ("pool", "remap")]
    exact = nodes(lambda m, h, x: F.max_pool1d(_v(h, x), 2))
    assert [(n.kind, n.attrs[1:]) for n in exact] == [("pool", (2, 2))]
    picked = nodes(lambda m, h, x: F.max_pool1d(_v(h, x), 2, 4))   # gcd(6, 4) = 2
    assert [(n.kind, n.attrs[1:]) for n in picked] == [("pool", (2, 2)), ("remap",
                                                                          ((4, 2), (3, 2), 0))]


def test_groupnorm_is_the_flat_group_sum() -> None:
    """GroupNorm of a (batch, C, L) view: group sums over (C / G) * L consecutive
    features, the one node kind the flat GroupNorm has."""
    prog = program_of(Chan(lambda m, h, x: m.gn(_v(h, x)).flatten(1)),
        torch.randn(3, 8))
    assert {n.attrs[1] for n in prog.nodes if n.kind == "gred"} == {C // 2 * L}
    assert not any(n.kind == "sred" for n in prog.nodes)


def test_gemv_rewrite_through_a_view() -> None:
    """A sum of an affine form of the GEMM output across a (batch, C, 1) view: the GEMV
    rewrite (its coefficients viewed to the view's dims; no TailError)."""
    prog = program_of(Chan(dict(FORMS)["gemv_through_a_view"]), torch.randn(3, 8))
    assert any(n.kind == "gemv" for n in prog.nodes)
    assert not any(n.kind == "gemm" for n in prog.nodes)


def test_sequence_mean_of_a_split_is_a_sequence_reduction() -> None:
    prog = program_of(Chan(dict(SEQ_FORMS)["mean_seq"]), torch.randn(2, S, 8))
    assert [n.kind for n in prog.nodes if n.kind in ("seqred", "sred")] == ["seqred"]
    assert prog.out_shape(2 * S) == (2, C, L)


# --- wide shapes (GPU): the kernels' group strategies ---------------------------------
WIDE: list[tuple[str, int, Any]] = [
    # (name, width, tail of h)
    ("pool_many_channels", 512 * 40, lambda m, h, x: F.max_pool1d(h.view(-1, 512, 40), 5, 3)
     .flatten(1)),
    ("avg_pool_long", 3 * 7000, lambda m, h, x: F.avg_pool1d(h.view(-1, 3, 7000), 4).flatten(1)),
    ("groupnorm_32_of_256", 256 * 64, lambda m, h, x: F.group_norm(h.view(-1, 256, 64), 32)
     .flatten(1)),
    ("groupnorm_many_groups", 9000 * 2, lambda m, h, x: F.group_norm(h.view(-1, 9000, 2), 9000)
     .flatten(1)),
    ("instance_norm_warp_groups", 128 * 100, lambda m, h, x: F.instance_norm(
        h.view(-1, 128, 100)).flatten(1)),
    ("instance_norm_small_groups", 4096 * 3, lambda m, h, x: F.instance_norm(
        h.view(-1, 4096, 3)).amax(-1)),
]


@pytest.mark.parametrize("name,width,tail", WIDE, ids=[w[0] for w in WIDE])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU visible to both torch and CuPy")
def test_wide_shapes_on_the_gpu(name: str, width: int, tail: Any) -> None:
    torch.manual_seed(3)
    x = torch.randn(5, 16)
    x[1, 2] = float("nan")
    _check(Chan(tail, k=16, w=width).eval(), x, "cuda", calls=2)


def _long_sequence_tail(m: Any, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    v = h.view(x.shape[0], x.shape[1], 8, 64)
    return v.softmax(1).mean(1) + v.var((1, 3)).unsqueeze(-1) + F.normalize(v, dim=1).amax(1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU visible to both torch and CuPy")
@pytest.mark.parametrize("batch,seq", [(3, 17), (64, 5), (1, 1)])
def test_long_sequences_of_splits_on_the_gpu(batch: int, seq: int) -> None:
    torch.manual_seed(4)
    m = Chan(_long_sequence_tail, k=32, w=512).eval()
    _check(m, torch.randn(batch, seq, 32), "cuda", calls=2)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU visible to both torch and CuPy")
def test_random_cases_on_the_gpu(seed: int) -> None:
    """The property tests' generators, fixed seeds, on CUDA (every third a sequence
    reduction); two calls each."""
    case = seeded_case(seed)
    try:
        run_case(case, "cuda", calls=2)
        torch.cuda.synchronize()
    except Exception as exc:   # the drawn model's source with the failure
        raise AssertionError(f"{type(exc).__name__}: {exc}\n{case!r}") from exc


# =================================================================================
# 3. refusals: each names the op, says why, and quotes the line
# =================================================================================
class _Refused(Chan):
    def __init__(self, fn: Any) -> None:
        super().__init__(fn)
        self.mpi = nn.MaxPool1d(2, return_indices=True)
        self.gn6 = nn.GroupNorm(2, 6, affine=False)
        self.register_buffer("rm3", torch.randn(S))
        self.register_buffer("rv3", torch.rand(S) + 0.5)
        self.bn = nn.BatchNorm1d(C)
        self.inr_train = nn.InstanceNorm1d(C, track_running_stats=True)


def _train_stats(m: Any, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    m.inr_train.train()   # (a training-mode submodule of an eval model)
    return m.inr_train(_v(h, x))


REFUSED: list[tuple[str, Any, tuple, str, list[str]]] = [
    # (id, tail, x's shape, op, what the message says); torch computes each of these
    ("indices", lambda m, h, x: m.mpi(_v(h, x))[0], (4, 8), "mpi (MaxPool1d)",
     ["pooling with indices (return_indices=True)"]),
    ("adaptive_indices", lambda m, h, x: F.adaptive_max_pool1d(_v(h, x), 3, True)[0], (4, 8),
     "adaptive_max_pool1d_with_indices", ["pooling with indices (return_indices=True)"]),
    ("f_indices", lambda m, h, x: F.max_pool1d(_v(h, x), 2, return_indices=True)[0], (4, 8),
     "max_pool1d_with_indices", ["pooling with indices (return_indices=True)"]),
    ("integer_pool", lambda m, h, x: F.avg_pool1d((_v(h, x) > 0) * 3, 2).float(), (4, 8),
     "avg_pool1d", ["an integer tensor operand"]),
    ("groupnorm_channels", lambda m, h, x: m.gn6(_v(h, x)), (4, 8), "gn6 (GroupNorm)",
     ["needs its 6 channels in dim 1, got a value of shape (batch, 4, 6)"]),
    ("groupnorm_seq", lambda m, h, x: F.group_norm(_vs(h, x), 1).flatten(2), (2, S, 8),
     "group_norm", ["group_norm's channels (dim 1) are a leading (sequence) dim"]),
    ("instance_norm_training_stats", _train_stats, (4, 8), "inr_train (InstanceNorm1d)",
     ["track_running_stats=True in training mode", "call model.eval()"]),
    ("instance_norm_updating", lambda m, h, x: F.instance_norm(_v(h, x), m.rm, m.rv),
     (4, 8),
     "instance_norm", ["use_input_stats=True (it updates them from the batch)"]),
    ("instance_norm_unbatched_affine", lambda m, h, x: m.in2(_v(h, x)).flatten(1), (4, 8),
     "in2 (InstanceNorm2d)", ["torch reads it unbatched: its weight would go with the "
                              "rows"]),
    ("instance_norm_seq_channels", lambda m, h, x: F.instance_norm(
        _vs(h, x), m.rm3, m.rv3, use_input_stats=False), (2, S, 8), "instance_norm",
     ["InstanceNorm with running statistics of a value of shape (batch, seq, 4, 6)",
      "its weight would go with the rows"]),
    ("batchnorm", lambda m, h, x: m.bn(_v(h, x)).flatten(1), (4, 8), "bn (BatchNorm1d)",
     ["BatchNorm of a value whose features are split into several dims (batch, 4, 6)",
      "statistics across rows"]),
    ("f_batch_norm", lambda m, h, x: F.batch_norm(_v(h, x), m.rm, m.rv), (4, 8),
     "batch_norm", ["BatchNorm of a value whose features are split"]),
    ("seq_two_leading_dims", lambda m, h, x: h.view(*h.shape[:-1], C, L).sum(1).flatten(2),
     (2, 3, 2, 8), "sum", ["works along one of several leading dims"]),
    ("seq_index", lambda m, h, x: _vs(h, x)[:, 0].flatten(1), (2, S, 8),
     "indexing/slicing a tensor", ["indexes a leading (sequence) dim"]),
    ("seq_glu", lambda m, h, x: F.glu(h.view(x.shape[0], x.shape[1], C, L), 1).flatten(2),
     (2, 4, 8), "glu", ["halves a leading (sequence) dim"]),
    ("seq_layer_norm", lambda m, h, x: F.layer_norm(_vs(h, x), (S, C, L)), (2, S, 8),
     "layer_norm", ["normalized_shape (3, 4, 6) does not match the value's last dims "
                    "(batch, seq, 4, 6)"]),
    ("seq_indices", lambda m, h, x: _vs(h, x).max(1)[1].float(), (2, S, 8), ".max()",
     ["the indices of max/min along a leading (sequence) dim"]),
    ("seq_batch", lambda m, h, x: _vs(h, x).mean((0, 1)), (2, S, 8), ".mean()",
     ["reduces over the batch dimension (dim 0)"]),
]


@pytest.mark.parametrize("key,fn,shape,op,why", REFUSED, ids=[r[0] for r in REFUSED])
def test_refusals_say_why(key: str, fn: Any, shape: tuple, op: str, why: list[str]) -> None:
    torch.manual_seed(0)
    m = _Refused(fn).eval()
    x = torch.randn(shape)
    with torch.no_grad():
        m(x)   # torch computes it
    with pytest.raises(TailError) as ei:
        cupyfuse.from_model(m)(x)
    msg = str(ei.value)
    assert f"cannot fuse `{op}`" in msg or f"{op}: " in msg, msg
    for w in why:
        assert w in msg, msg
    assert f"{THIS}:" in msg, msg   # the line that did it


@pytest.mark.parametrize("fn,shape,why", [
    (lambda m, h, x: F.max_pool1d(_v(h, x), 7), (4, 8),
     "a window of 7 is longer than the 6 positions of each channel of a (batch, 4, 6) "
     "value (torch raises)"),
    (lambda m, h, x: F.max_pool1d(_v(h, x) > 0, 2), (4, 8), "a boolean tensor operand "
     "(torch raises)"),
    (lambda m, h, x: F.max_pool1d(h.view(-1, 2, 2, 6), 2).flatten(1), (4, 8),
     "1-D pooling of a 4-D value (batch, 2, 2, 6) (torch takes 2-D or 3-D input)"),
    (lambda m, h, x: F.group_norm(h.view(-1, 6, 4), 4), (4, 8),
     "6 channels (dim 1) do not split into 4 groups"),
    (lambda m, h, x: F.group_norm(h.view(-1, 6, 4), 2, m.w, None), (4, 8),
     "a weight or bias of 4 elements for 6 channels (torch raises RuntimeError)"),
    (lambda m, h, x: F.instance_norm(h.view(-1, 6, 4), weight=m.w), (4, 8),
     "of 4 elements for 6 channels (torch raises RuntimeError)"),
    (lambda m, h, x: F.instance_norm(_v(h, x), use_input_stats=False), (4, 8),
     "use_input_stats=False and no running_mean/running_var (torch raises)"),
    (lambda m, h, x: _vs(h, x).sum(1), (2, 0, 8), "a sequence of length 0"),
    (lambda m, h, x: F.max_pool1d(_v(h, x), 2, padding=2).flatten(1), (4, 8),
     "torch raises: max_pool1d() padding should be at most half of kernel size"),
    (lambda m, h, x: F.avg_pool1d(_v(h, x), 9, padding=1).flatten(1), (4, 8),
     "torch raises: "),
])
def test_refusals_where_torch_raises(fn: Any, shape: tuple, why: str) -> None:
    """What torch raises on (or where an empty sequence leaves nothing to reduce) is
    refused, never computed."""
    with pytest.raises(TailError, match=re.escape(why)):
        cupyfuse.from_model(_Refused(fn).eval())(torch.randn(shape))


def test_instance_norm_errors_as_torch() -> None:
    """torch's own ValueErrors: a 4-D value for InstanceNorm1d, one spatial element."""
    m = Chan(lambda m, h, x: m.inn0(_vs(h, x)).flatten(2)).eval()
    with pytest.raises(ValueError, match=re.escape("expected 2D or 3D input (got 4D input)")):
        cupyfuse.from_model(m)(torch.randn(2, S, 8))
    m = Chan(lambda m, h, x: F.instance_norm(h.view(-1, 24, 1)).flatten(1)).eval()
    with pytest.raises(ValueError, match="Expected more than 1 spatial element"):
        cupyfuse.from_model(m)(torch.randn(2, 8))


def test_instance_norm_running_statistics_follow_the_mode() -> None:
    """track_running_stats=True: the running statistics in eval mode (and nothing
    updated), refused in training mode (torch updates them there)."""
    torch.manual_seed(5)
    m = Chan(lambda m, h, x: m.inr(_v(h, x)).flatten(1)).eval()
    before = m.inr.running_mean.clone()
    _check(m, torch.randn(6, 8), "cpu")
    assert torch.equal(m.inr.running_mean, before)
    fm = cupyfuse.from_model(m)
    x = torch.randn(3, 8)
    with torch.no_grad():
        fm(x)
        m.train()
        with pytest.raises(TailError, match="track_running_stats=True in training mode"):
            fm(x)


# =================================================================================
# 4. the GPU path on the CPU: run_gpu with the generated kernels compiled as C++
# =================================================================================
def _emulated_cases() -> list[tuple[str, nn.Module, torch.Tensor]]:
    out = []
    for name, fn in FORMS:
        torch.manual_seed(0)
        x = torch.randn(3, 8) * 2
        x[1, 2] = float("nan")
        out.append((name, Chan(fn).eval(), x))
    for name, fn in SEQ_FORMS:
        torch.manual_seed(0)
        out.append((f"seq_{name}", Chan(fn).eval(), torch.randn(2, S, 8)))
    for name, width, tail in WIDE:
        if width <= 20000:
            torch.manual_seed(0)
            out.append((f"wide_{name}", Chan(tail, k=4, w=width).eval(), torch.randn(2, 4)))
    torch.manual_seed(0)
    out.append(("long_sequence", Chan(_long_sequence_tail, k=32, w=512).eval(),
                torch.randn(3, 17, 32)))
    for seed in range(30):
        case = seeded_case(seed)
        out.append((f"drawn{seed}", case.spec.make_model(case.seed),
                    case.spec.make_input(min(case.batch, 3), case.seed, case.n_special)))
    return out


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not on PATH")
def test_gpu_path_emulated_with_the_generated_kernels(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every form, sequence form, the narrower wide shapes, a long sequence and 30 drawn
    models through execute.run_gpu on CPU tensors: its levels, buffers and sequence
    reductions (tests/emu/gpu.py), each level's generated kernel compiled as C++ with
    threads for CUDA's (tests/emu/cuda.py); against float64 torch."""
    from emu import cuda as _cuda_emu
    from emu.gpu import run_gpu_emulated

    cases = [(name, model, x, program_of(model, x)) for name, model, x in
             _emulated_cases()]
    kernels = _cuda_emu.build_or_skip([c[3] for c in cases], tmp_path_factory.mktemp("emu"),
                                      exact=True)
    for name, model, x, _ in cases:
        with torch.no_grad():
            ref64 = copy.deepcopy(model).double()(x.double())
            ref32 = model(x)
            with monkeypatch.context() as mp:
                got = run_gpu_emulated(model, [x], mp, kernels)
        assert_matches(got, ref64, ref32, f"emulated {name}")


@pytest.mark.parametrize("name,fn", (FORMS + SEQ_FORMS)[::3],
                         ids=[f[0] for f in (FORMS + SEQ_FORMS)[::3]])
def test_gpu_path_emulated_node_by_node(name: str, fn: Any,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through tests/emu/gpu.py's node-by-node emulation (no compiler needed)."""
    from emu.gpu import run_gpu_emulated

    torch.manual_seed(0)
    model = Chan(fn).eval()
    x = torch.randn(2, S, 8) if (name, fn) in SEQ_FORMS else torch.randn(3, 8)
    with torch.no_grad():
        ref64 = copy.deepcopy(model).double()(x.double())
        assert_matches(run_gpu_emulated(model, [x], monkeypatch), ref64, model(x), name)


# =================================================================================
# 5. the generated kernels compile (nvcc, sm_90a) without spills
# =================================================================================
NVCC = shutil.which("nvcc")
_PROPS_RE = re.compile(r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, "
                       r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_generated_kernels_compile_without_spills(tmp_path: Any) -> None:
    """Every level kernel of the forms, the sequence forms, the wide shapes and 12 drawn
    models, in three translation units; each in ptxas' report with no spills."""
    plans = []
    for name, fn in FORMS:
        torch.manual_seed(0)
        plans.append(codegen.plan(program_of(Chan(fn).eval(), torch.randn(3, 8))))
    for name, fn in SEQ_FORMS:
        plans.append(codegen.plan(program_of(Chan(fn).eval(), torch.randn(2, S, 8))))
    for name, width, tail in WIDE:
        plans.append(codegen.plan(program_of(Chan(tail, k=4, w=width).eval(),
            torch.randn(2, 4))))
    plans.append(codegen.plan(program_of(Chan(_long_sequence_tail, k=32, w=512).eval(),
                                         torch.randn(3, 17, 32))))
    for seed in range(12):
        case = seeded_case(seed)
        plans.append(codegen.plan(program_of(case.spec.make_model(0),
            case.spec.make_input(3, 0))))
    kinds = {n.kind for pl in plans for n in pl.prog.nodes}
    assert {"pool", "gred", "sred", "remap", "seqred"} <= kinds, kinds
    kernels = {lv.name: lv.kernel for pl in plans for lv in pl.levels if lv.kernel}
    head = next(iter(kernels.values())).split("\n", 1)[0]   # #include "tail_ops.cuh"
    bodies = [k.split("\n", 1)[1] for k in kernels.values()]
    procs = []
    for j in range(3):
        cu = tmp_path / f"chan{j}.cu"
        cu.write_text(runtime.expand_text(head + "\n" + "\n".join(bodies[j::3])))
        cmd = [NVCC, "-cubin", "-o", str(tmp_path / f"chan{j}.cubin"), "-std=c++17",
               "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", str(cu)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    seen = set()
    for p in procs:
        out, err = p.communicate(timeout=900)
        log = out + err
        assert p.returncode == 0, log[-6000:]
        for fn, _, st_, ld in _PROPS_RE.findall(log):
            seen.add(fn)
            assert int(st_) == 0 and int(ld) == 0, f"{fn} spills\n{log[-6000:]}"
    assert seen >= set(kernels), set(kernels) - seen
    assert len(kernels) >= 40


# =================================================================================
# 6. prepared launches on the CPU (tests/emu/prepared.py): bitwise the general path
# =================================================================================
def _prepared_emulated(model: nn.Module, x: torch.Tensor, monkeypatch: Any,
                       what: str) -> None:
    """prepared.prepare's launches for this model and input (the full path, then the
    ready plan twice), decoded and emulated on the CPU: bitwise the emulated general
    path's result (run_gpu), and close to float64 torch."""
    from emu import gpu as _gpuemu
    from emu import prepared as _prepemu

    prog, tens, srcs = _gpuemu.model_program(model, [x])
    _prepemu.install(monkeypatch)
    prog = _prepemu.runnable(prog)
    general = _gpuemu.run_program_emulated(prog, tens, srcs, monkeypatch)
    pr = _prepemu.prepare(prog, tens, srcs)
    assert pr is not None, f"{what}: not prepared"
    with torch.no_grad():
        ref64 = copy.deepcopy(model).double()(x.double())
        ref32 = model(x)
    for i in range(3):
        out = _prepemu.call(pr, tens, srcs)
        assert _prepemu.same_bits(out, general), f"{what}: prepared call {i} differs"
    assert_matches(out, ref64, ref32, what)


@pytest.mark.parametrize("name,fn", FORMS + SEQ_FORMS, ids=[f[0] for f in FORMS + SEQ_FORMS])
def test_prepared_launches_emulated(name: str, fn: Any, monkeypatch: pytest.MonkeyPatch
                                    ) -> None:
    torch.manual_seed(0)
    model = Chan(fn).eval()
    x = torch.randn(3, S, 8) if (name, fn) in SEQ_FORMS else torch.randn(5, 8)
    x.view(-1)[7] = float("nan")
    _prepared_emulated(model, x, monkeypatch, name)


@pytest.mark.parametrize("seed", range(30))
def test_prepared_launches_of_drawn_models_emulated(seed: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    case = seeded_case(seed)
    try:
        _prepared_emulated(case.spec.make_model(case.seed),
                           case.spec.make_input(case.batch, case.seed, case.n_special),
                           monkeypatch, f"drawn {seed}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{case!r}") from exc
