"""Reductions over the sequence of (batch, seq, features) values: mean/sum/max
pooling, the first or last token, attention pooling, masked means, then more tail ops and
a classifier head. Every form against a float64 copy of the eager model (NaN/inf rows,
odd and unit sequence lengths, batch 1 and 0), on the CPU and (marked ``gpu``) on the
GPU, called twice there (the same bits both times: fixed-order reductions); forms drawn
with hypothesis; the generated kernels compile for sm_90a; the forms that stay refused
say why."""
from __future__ import annotations

import copy
import re
import shutil
import subprocess
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupyfuse
from cupyfuse.backend import codegen, prepared, runtime
from cupyfuse.ir.program import TailError

from helpers import DEVICES
from gen.tails import HypDraw, RandDraw, assert_matches
from helpers import program_of
from helpers import examples

K, D = 8, 12


def _run(fm: Any, *args: Any) -> Any:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return fm(*args)


# --- the forms, as people write them --------------------------------------------------
def _attention(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
    a = torch.softmax(m.score(h), dim=1)   # (B, S, 1): a weight per position
    return (a * h).sum(1)


def _weights(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return torch.softmax(m.score(h).squeeze(-1), dim=1)   # (B, S)


#: forms torch itself refuses for a (batch, 1, seq, features) input (3-D operands only)
THREE_D = {"bmm_pool", "einsum_pool", "matmul_pool"}

FORMS: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    "mean": lambda m, x: m.fc(x).mean(1),
    "mean_kw": lambda m, x: torch.relu(m.fc(x)).mean(dim=1),
    "mean_neg": lambda m, x: m.fc(x).mean(-2),
    "mean_keep": lambda m, x: m.fc(x).mean(1, keepdim=True),
    "torch_mean": lambda m, x: torch.mean(m.fc(x), dim=1),
    "sum": lambda m, x: m.fc(x).sum(1),
    "sum_tuple": lambda m, x: m.fc(x).sum(dim=(1,)),
    "amax": lambda m, x: m.fc(x).amax(1),
    "amin_keep": lambda m, x: torch.amin(m.fc(x), 1, keepdim=True),
    "max_values": lambda m, x: m.fc(x).max(1).values,
    "max_index0": lambda m, x: torch.max(m.fc(x), 1)[0],
    "min_values": lambda m, x: m.fc(x).min(dim=1).values,
    "max_keep": lambda m, x: torch.max(m.fc(x), dim=1, keepdim=True)[0],
    "first": lambda m, x: m.fc(x)[:, 0],
    "last": lambda m, x: m.fc(x)[:, -1],
    "last_full": lambda m, x: m.fc(x)[:, -1, :],
    "last_keep": lambda m, x: m.fc(x)[:, -1:],
    "first_ellipsis": lambda m, x: torch.tanh(m.fc(x))[..., 0, :],
    "narrow": lambda m, x: m.fc(x).narrow(1, 0, 1),
    "attention": lambda m, x: _attention(m, torch.tanh(m.fc(x))),
    "bmm_pool": lambda m, x: torch.bmm(_weights(m, m.fc(x)).unsqueeze(1), m.fc(x)).squeeze(1),
    "matmul_pool": lambda m, x: torch.softmax(m.score(m.fc(x)), 1).transpose(1, 2) @ m.fc(x),
    "einsum_pool": lambda m, x: torch.einsum("bs,bsd->bd", _weights(m, m.fc(x)), m.fc(x)),
    "attention_head": lambda m, x: m.head(torch.relu(_attention(m, m.fc(x)))),
    "head": lambda m, x: m.head(F.gelu(m.fc(x).mean(1))),
    "head_ln": lambda m, x: m.head(m.ln(m.fc(x).amax(1))),
    "mean_max": lambda m, x: torch.cat([m.fc(x).mean(1), m.fc(x).amax(1)], -1),
    "input_mean": lambda m, x: m.fc(x.mean(1)),
    "input_and_h": lambda m, x: m.fc(x).sum(1) / x.shape[-1] + x.mean(1).sum(-1, keepdim=True),
    "center": lambda m, x: m.fc(x) - m.fc(x).mean(1, keepdim=True),
    "seq_softmax": lambda m, x: torch.softmax(m.fc(x), dim=1),
    "log_softmax": lambda m, x: F.log_softmax(m.fc(x), dim=-2),
    "logsumexp": lambda m, x: torch.logsumexp(m.fc(x), 1),
    "var": lambda m, x: m.fc(x).var(1),
    "std_keep": lambda m, x: m.fc(x).std(1, unbiased=False, keepdim=True),
    "norm": lambda m, x: m.fc(x).norm(dim=1),
    "normalize": lambda m, x: F.normalize(m.fc(x), dim=1),
    "both_dims": lambda m, x: m.fc(x).mean((1, 2)),
    "pool_then_rows": lambda m, x: torch.softmax(m.fc(x).mean(1), -1) * m.fc(x).amax(1),
    "unsqueezed": lambda m, x: m.fc(x).unsqueeze(2).sum(1).squeeze(1),
    "twice": lambda m, x: torch.softmax(m.fc(x), 1).amax(1),
    "train_bn": lambda m, x: m.bn(m.fc(x).mean(1)),
}


class Pool(nn.Module):
    """Linear(K, D) + one of FORMS; a scoring Linear(D, 1), a head Linear(D, 3), a
    LayerNorm and a BatchNorm1d (train mode for "train_bn") for the forms to use."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(K, D)
        self.score = nn.Linear(D, 1)
        self.head = nn.Linear(D, 3)
        self.ln = nn.LayerNorm(D)
        self.bn = nn.BatchNorm1d(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FORMS[self.form](self, x)


class MaskedMean(nn.Module):
    """Masked pooling with a (batch, seq, 1) mask input, or a (batch, seq) one where
    ``seq_mask`` (0/1 floats, or booleans where ``bool_mask``), then a classifier head."""

    def __init__(self, how: str = "mean", bool_mask: bool = False,
                 seq_mask: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(K, D)
        self.head = nn.Linear(D, 3)
        self.score = nn.Linear(D, 1)
        self.how = how
        self.bool_mask = bool_mask
        self.seq_mask = seq_mask

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.seq_mask:
            mask = mask.unsqueeze(-1)
        off = ~mask if self.bool_mask else mask == 0   # the padding positions
        if self.how == "mean":
            pooled = (h * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        elif self.how == "masked_fill":   # padding positions excluded from a max pool
            pooled = h.masked_fill(off, float("-inf")).amax(1)
        else:   # attention over the unmasked positions
            s = self.score(h).masked_fill(off, float("-inf"))
            pooled = (torch.softmax(s, dim=1) * h).sum(1)
        return self.head(torch.tanh(pooled))


def _x(shape: tuple[int, ...], seed: int, specials: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2
    if specials and x.numel() and shape[0] > 1:
        rows = x.view(-1, shape[-1])
        rows[1] = float("nan")           # a whole (batch, seq) row
        if rows.shape[0] > 3:
            rows[-1, 0] = float("inf")   # one element
            rows[-2, 1] = float("-inf")
    return x


def _model(cls: type, *args: Any, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = cls(*args)
    return m.train() if args and args[0] == "train_bn" else m.eval()


def references(model: nn.Module, inputs: list[torch.Tensor]
               ) -> tuple[torch.Tensor, nn.Module, torch.Tensor]:
    """(float64 output, the float64 twin after the call, float32 torch output), on deep
    copies; a boolean mask stays boolean in the float64 run."""
    with torch.no_grad():
        m64 = copy.deepcopy(model).double()
        ref64 = m64(*[t.double() if t.is_floating_point() else t for t in inputs])
        ref32 = copy.deepcopy(model)(*inputs)
    return ref64, m64, ref32


def _check(model: nn.Module, inputs: list[torch.Tensor], device: str, what: str,
           calls: int = 2) -> None:
    """The fused model (from_model) against float64 torch; on the GPU ``calls`` calls
    giving the same bits (the first one prepares launches where they apply)."""
    ref64, m64, ref32 = references(model, inputs)
    fm = cupyfuse.from_model(model.to(device))
    outs = [_run(fm, *[t.to(device) for t in inputs]) for _ in range(calls if device != "cpu"
                                                                     else 1)]
    for out in outs:
        assert out.device.type == device
        assert_matches(out.cpu(), ref64, ref32, what=what)
    for o in outs[1:]:
        assert torch.equal(o.cpu().view(torch.int32), outs[0].cpu().view(torch.int32)), \
            f"{what}: two calls differ"
    if model.training and any(isinstance(mm, nn.BatchNorm1d) for mm in model.modules()) \
            and calls == 1:
        for k, v in m64.state_dict().items():   # running statistics updated as torch does
            torch.testing.assert_close(model.state_dict()[k].cpu().double(), v.double(),
                                       equal_nan=True)


SHAPES = [(3, 5, K), (2, 7, K), (1, 4, K), (4, 1, K), (2, 1, 6, K), (0, 5, K)]


def _form_shapes(forms, shapes):
    """(form, shape) pairs, without the 4-D shapes for forms torch.bmm / einsum take
    3-D operands only."""
    return [pytest.param(f, s, id=f"{f}-{'x'.join(map(str, s))}") for f in forms for s in shapes
            if not (f in THREE_D and len(s) > 3)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form,shape", _form_shapes(sorted(FORMS), SHAPES))
def test_forms_match_float64(device, form, shape):
    if form == "train_bn" and (shape[0] <= 1 or len(shape) > 3):
        # (torch raises at one row per channel: tested below; (2, 1, 6, 8) pools the
        # size-1 dim and gives BatchNorm1d(12) 6 channels: torch raises too)
        shape = (3,) + shape[-2:]
    model = _model(Pool, form)
    _check(model, [_x(shape, 1)], device, f"{form} x{shape}",
           calls=1 if form == "train_bn" else 2)


@pytest.mark.parametrize("device", DEVICES)
# (a boolean mask's sum is int64 in torch, refused: the mean form takes float masks only)
@pytest.mark.parametrize("how,as_bool", [("mean", False), ("masked_fill", False),
                                         ("masked_fill", True), ("attention", False),
                                         ("attention", True)])
@pytest.mark.parametrize("shape", [(3, 5, K), (1, 7, K), (2, 1, K)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("seq_mask", [False, True], ids=["bs1", "bs"])
def test_masked_pooling_with_a_mask_input(device, how, shape, as_bool, seq_mask):
    g = torch.Generator().manual_seed(3)
    mask = (torch.rand(shape[:-1] + (1,), generator=g) > 0.4).float()
    mask[0, 0] = 1.0   # (one position of the first sequence kept)
    if shape[0] > 1:
        mask[-1] = 0.0   # a sequence wholly masked: its mean is 0, its max -inf
    x = _x(shape, 2, specials=False)
    model = _model(MaskedMean, how, as_bool, seq_mask)
    m = mask.bool() if as_bool else mask
    m = m[..., 0] if seq_mask else m   # (batch, seq): one number per row
    _check(model, [x, m], device, f"masked {how} x{shape} bool={as_bool}")


@pytest.mark.parametrize("device", DEVICES)
def test_batchnorm_after_pooling_raises_like_torch_at_one_row(device):
    model = _model(Pool, "train_bn")
    x = torch.randn(1, 5, K, device=device)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        _run(cupyfuse.from_model(model.to(device)), x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["mean", "amax", "last", "attention_keep", "masked",
                                  "seq_mask"])
@pytest.mark.parametrize("shape", [(3, 5, K), (2, 1, K), (1, 9, K)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fused_linear_tails_over_the_sequence(device, name, shape):
    torch.manual_seed(4)
    x, w, b = _x(shape, 5), torch.randn(D, K), torch.randn(D)
    mask = (torch.rand(shape[:-1] + (1,)) > 0.3).float()
    mask[:, 0] = 1.0
    tails = {
        "mean": lambda h: torch.relu(h.mean(1)),
        "amax": lambda h: h.amax(1) - h.mean(dim=1),
        "last": lambda h: F.layer_norm(h[:, -1], h.shape[-1:]),
        "attention_keep": lambda h: (torch.softmax(h.sum(-1, keepdim=True), 1) * h).sum(
            1, keepdim=True),
        "masked": lambda h, m: (h * m).sum(1) / m.sum(1).clamp(min=1),
        "seq_mask": lambda h, m: (h * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True),
    }
    tail = tails[name]
    extra = [mask] if name == "masked" else [mask[..., 0]] if name == "seq_mask" else []
    h64 = x.double() @ w.double().t() + b.double()
    h32 = x @ w.t() + b
    ref64 = tail(h64, *[e.double() for e in extra])
    ref32 = tail(h32, *extra)
    for _ in range(2 if device != "cpu" else 1):
        out = cupyfuse.fused_linear(x.to(device), w.to(device), b.to(device), tail,
                                    *[e.to(device) for e in extra])
        assert_matches(out.cpu(), ref64, ref32, what=f"fused_linear {name} x{shape}")


@pytest.mark.parametrize("device", DEVICES)
def test_fused_class_pools(device):
    torch.manual_seed(6)
    model = Pool("attention_head").eval()
    New = cupyfuse.fused_class(Pool)
    torch.manual_seed(6)
    fm = New("attention_head").eval().to(device)
    x = _x((3, 6, K), 7)
    ref64, _, ref32 = references(model, [x])
    assert_matches(_run(fm, x.to(device)).cpu(), ref64, ref32, what="fused_class")


# --- drawn forms --------------------------------------------------------------------------
PRE = ("relu", "tanh", "gelu", "affine", "param_mul", "softmax_last", "layer_norm",
       "center_last", "input_y")
REDUCE = ("mean", "sum", "amax", "amin", "max_values", "first", "last", "logsumexp",
          "attention", "bmm_attention", "masked_mean", "seq_softmax", "var", "norm")
POST = ("relu", "tanh", "layer_norm", "head", "affine", "softmax_last", "sum_last")


class Drawn(nn.Module):
    """A drawn model: Linear(k, n), ``pre`` ops along the features, one ``reduce`` over
    the sequence (its dim spelled 1, -2 or dim=1; keepdim where ``keep``), ``post`` ops
    (a head Linear(n, 3) among them)."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.spec = spec
        n = spec["n"]
        self.fc = nn.Linear(spec["k"], n)
        self.score = nn.Linear(n, 1)
        self.head = nn.Linear(n, 3)
        self.g = nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = self.spec
        h = self.fc(x)
        width = s["n"]   # (tracked here: fx traces h.shape[-1] as a proxy, not a number)
        for op in s["pre"]:
            h, width = _row_op(self, op, h, width, y)
        dim = {"1": 1, "-2": -2}.get(s["dim"], 1)
        keep = s["keep"]
        r = s["reduce"]
        if r == "mean":
            h = h.mean(dim=dim, keepdim=keep) if s["dim"] == "kw" else h.mean(dim, keep)
        elif r == "sum":
            h = h.sum(dim, keepdim=keep)
        elif r == "amax":
            h = h.amax(dim, keepdim=keep)
        elif r == "amin":
            h = torch.amin(h, dim, keepdim=keep)
        elif r == "max_values":
            h = h.max(dim, keepdim=keep).values
        elif r == "first":
            h = h[:, :1] if keep else h[:, 0]
        elif r == "last":
            h = h[:, -1:] if keep else h[:, -1]
        elif r == "logsumexp":
            h = torch.logsumexp(h, dim, keepdim=keep)
        elif r == "attention":
            h = (torch.softmax(self.score(h), dim=dim) * h).sum(dim, keepdim=keep)
        elif r == "bmm_attention":   # (B, 1, S) @ (B, S, n)
            h = torch.bmm(torch.softmax(self.score(h).squeeze(-1), dim=1).unsqueeze(1), h)
            h = h if keep else h.squeeze(1)
        elif r == "masked_mean":
            h = (h * mask).sum(dim, keepdim=keep) / mask.sum(dim, keepdim=keep).clamp(min=1)
        elif r == "seq_softmax":
            h = torch.softmax(h, dim=dim)
        elif r == "var":
            h = h.var(dim, keepdim=keep)
        elif r == "norm":
            h = torch.linalg.vector_norm(h, dim=dim, keepdim=keep)
        for op in s["post"]:
            h, width = _row_op(self, op, h, width, None)
        return h


def _row_op(m: Drawn, op: str, h: torch.Tensor, width: int,
            y: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """An op along the features, and the width after it."""
    n = m.spec["n"]
    if op == "relu":
        return torch.relu(h), width
    if op == "tanh":
        return torch.tanh(h), width
    if op == "gelu":
        return F.gelu(h), width
    if op == "affine":
        return h * 0.5 - 0.25, width
    if op == "param_mul" and width == n:
        return h * m.g, width
    if op == "softmax_last":
        return torch.softmax(h, dim=-1), width
    if op == "layer_norm":
        return F.layer_norm(h, h.shape[-1:]), width
    if op == "center_last":
        return h - h.mean(-1, keepdim=True), width
    if op == "input_y" and y is not None and width == n:
        return h * y, width
    if op == "head" and width == n:
        return m.head(h), 3
    if op == "sum_last":
        return h.sum(-1, keepdim=True), 1
    return h, width


def draw_spec(d: Any) -> dict:
    return {"b": d.choice((1, 2, 3, 5)), "s": d.choice((1, 2, 3, 5, 7)), "k": d.int(2, 12),
            "n": d.int(2, 12), "pre": [d.choice(PRE) for _ in range(d.int(0, 3))],
            "reduce": d.choice(REDUCE), "dim": d.choice(("1", "-2", "kw")),
            "keep": d.bool(0.3), "post": [d.choice(POST) for _ in range(d.int(0, 3))],
            "specials": [(d.int(0, 4), d.int(0, 6), d.choice((float("nan"), float("inf"),
                                                                float("-inf"))))
                         for _ in range(d.int(0, 2))]}


def _drawn_inputs(spec: dict, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, s = spec["b"], spec["s"]
    x = torch.randn(b, s, spec["k"], generator=g) * 2
    for i, j, v in spec["specials"]:
        x[i % b, j % s] = v   # a whole (batch, seq) row of NaN / inf
    y = torch.rand(b, s, spec["n"], generator=g) + 0.5
    mask = (torch.rand(b, s, 1, generator=g) > 0.3).float()
    return [x, y, mask]


def _check_drawn(spec: dict, seed: int, device: str) -> None:
    torch.manual_seed(seed)
    model = Drawn(spec).eval()
    _check(model, _drawn_inputs(spec, seed), device, str(spec))


SETTINGS = settings(max_examples=examples(150), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.data(), st.integers(0, 10 ** 6))
def test_drawn_sequence_reductions_match_float64(data, seed):
    _check_drawn(draw_spec(HypDraw(data.draw)), seed, "cpu")


@pytest.mark.gpu
@pytest.mark.usefixtures("fp32_matmul")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seed", range(40))
def test_drawn_sequence_reductions_on_the_gpu(seed):
    _check_drawn(draw_spec(RandDraw(seed)), seed, "cuda")


@pytest.mark.gpu
@pytest.mark.usefixtures("fp32_matmul")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape,form", [((4, 300, 64), "mean"), ((3, 129, 1000), "amax"),
                                        ((70, 33, 256), "attention_head"),
                                        ((2, 512, 96), "last"), ((16, 64, 512), "head_ln")])
def test_larger_sizes_on_the_gpu(shape, form):
    """Long sequences, wide rows, many batch elements (the grid-stride loop of
    tail_seqred.cu; the tensor-core engine for the larger GEMMs)."""
    torch.manual_seed(8)
    model = Pool(form).eval()
    model.fc = nn.Linear(shape[-1], D)
    _check(model, [_x(shape, 9)], "cuda", f"{form} x{shape}", calls=3)


# --- the GPU path's plumbing, its launches emulated on the CPU (tests/emu/gpu.py) --------
@pytest.mark.parametrize("form,shape", _form_shapes(sorted(f for f in FORMS if f != "train_bn"),
                                                    [(3, 5, K), (1, 7, K), (2, 1, 6, K)]))
def test_gpu_path_emulated(form, shape, monkeypatch):
    """run_gpu's levels, row counts, buffers and addressing (the generated kernels' and
    tail_seqred.cu's, emulated) give torch's result: what can be checked of the GPU
    path without a GPU."""
    from emu.gpu import run_gpu_emulated

    model = _model(Pool, form)
    x = _x(shape, 1)
    ref64, _, ref32 = references(model, [x])
    out = run_gpu_emulated(model, [x], monkeypatch)
    assert_matches(out, ref64, ref32, what=f"emulated {form} x{shape}")


@pytest.mark.parametrize("how", ["mean", "masked_fill", "attention"])
@pytest.mark.parametrize("seq_mask", [False, True], ids=["bs1", "bs"])
def test_gpu_path_emulated_masked(how, seq_mask, monkeypatch):
    from emu.gpu import run_gpu_emulated

    model = _model(MaskedMean, how, False, seq_mask)
    x = _x((3, 5, K), 2)
    mask = (torch.rand(3, 5, 1, generator=torch.Generator().manual_seed(1)) > 0.4).float()
    mask[-1] = 0.0
    mask = mask[..., 0] if seq_mask else mask
    ref64, _, ref32 = references(model, [x, mask])
    assert_matches(run_gpu_emulated(model, [x, mask], monkeypatch), ref64, ref32,
                   what=f"emulated masked {how}")


@pytest.mark.parametrize("seed", range(30))
def test_gpu_path_emulated_drawn(seed, monkeypatch):
    from emu.gpu import run_gpu_emulated

    spec = draw_spec(RandDraw(seed))
    torch.manual_seed(seed)
    model = Drawn(spec).eval()
    args = _drawn_inputs(spec, seed)
    ref64, _, ref32 = references(model, args)
    assert_matches(run_gpu_emulated(model, args, monkeypatch), ref64, ref32, what=str(spec))


# --- what the programs look like ----------------------------------------------------------
def test_programs_reduce_batch_times_seq_rows_to_the_batch():
    prog = program_of(cupyfuse.from_model(_model(Pool, "attention_head")), torch.randn(3, 5, K))
    assert prog.lead == (5,) and prog.seq_group() == 5
    kinds = [(n.kind, n.op) for n in prog.nodes if n.kind == "seqred"]
    assert kinds == [("seqred", "max"), ("seqred", "sum"), ("seqred", "sum")]
    per = prog.per_batch()
    out = prog.out
    assert per[out] and not any(per[i] for i, n in enumerate(prog.nodes) if n.kind == "input")
    # the head's GEMM runs on the batch's rows
    heads = [i for i, n in enumerate(prog.nodes) if n.kind == "gemm" and per[i]]
    assert len(heads) == 1
    assert prog.out_shape(15) == (3, 3)
    pl = codegen.plan(prog)
    for lv in pl.levels:
        assert lv.per_batch == (lv.index % 2 == 0)
        assert lv.epi is None
        for i in lv.gemms + lv.seqreds + lv.targets:
            assert per[i] == lv.per_batch, (i, lv.index)
    assert prepared.usable(prog) == (prog, False)   # prepared (test_prepared_sequences.py)
    flat = program_of(cupyfuse.from_model(_model(Pool, "mean")), torch.randn(3, 1, K))
    assert flat.seq_group() == 0 and not any(n.kind == "seqred" for n in flat.nodes)


@pytest.mark.parametrize("form", ["center", "attention", "seq_softmax", "normalize"])
def test_per_batch_values_read_by_sequence_rows_are_loaded_at_their_batch_row(form):
    """In the generated CUDA: a (batch, seq) kernel reads each per-batch buffer at
    ``row / seq`` and every other value at ``row``; a per-batch kernel reads no
    (batch, seq) value. A reduction computed inside a (batch, seq) kernel (an
    attention's scores: codegen._inline_seqreds) reads the seq rows of batch element
    ``row / seq``, inside a per-batch kernel those of ``row``."""
    prog = program_of(cupyfuse.from_model(_model(Pool, form)), torch.randn(2, 7, K))
    pl = codegen.plan(prog)
    per = prog.per_batch()
    seen = 0
    for lv in pl.levels:
        for kind, i in lv.args:
            if kind == "seq_src":
                at = lv.kernel.index(f"sq{i} + ") + len(f"sq{i} + ")
                want = "row * 7LL" if lv.per_batch else "(row / 7LL) * 7LL"
                assert lv.kernel.startswith(want, at), (form, lv.index, i)
                seen += not lv.per_batch
            if kind != "buf":
                continue
            name = f"buf{i}["
            at = lv.kernel.index(name) + len(name)
            if per[i] and not lv.per_batch:
                assert lv.kernel.startswith("(row / 7LL)", at), (form, lv.index, i)
                seen += 1
            else:
                assert per[i] == lv.per_batch and lv.kernel.startswith("row", at) \
                    and not lv.kernel.startswith("row /", at), (form, lv.index, i)
    assert seen


@pytest.mark.parametrize("op", ["sum", "max", "min", "take"])
def test_cpu_reduction_keeps_torch_nan_and_inf(op):
    from cupyfuse.backend.cpu import seq_reduce_cpu

    v = torch.tensor([[1.0, float("nan"), -1.0], [float("inf"), 2.0, float("-inf")],
                      [float("-inf"), 0.5, float("inf")], [3.0, 4.0, -0.0]])   # (2 x 2, 3)
    got = seq_reduce_cpu(op, v, 2, 3, 1, lambda b: (b, 3))
    t = v.view(2, 2, 3)
    want = {"sum": t.sum(1), "max": t.amax(1), "min": t.amin(1), "take": t[:, 1]}[op]
    assert torch.equal(got.isnan(), want.isnan())
    fin = ~want.isnan()
    assert torch.equal(got[fin], want[fin])


# --- refusals ----------------------------------------------------------------------------
class _Fn(nn.Module):
    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fc = nn.Linear(K, D)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self, x)


REFUSED = [
    (lambda m, x: m.fc(x).mean(1), (2, 3, 4, K), "mean: works along one of several leading dims"),
    (lambda m, x: m.fc(x).amax(2), (2, 3, 4, K), "max: works along one of several leading dims"),
    (lambda m, x: m.fc(x)[:, 0], (2, 3, 4, K), "works along one of several leading dims"),
    (lambda m, x: torch.softmax(m.fc(x), 2), (2, 3, 4, K),
     "softmax: works along one of several leading dims"),
    (lambda m, x: m.fc(x).mean((1, 2)), (2, 3, 4, K), "one of several leading dims"),
    (lambda m, x: m.fc(x).sum(1), (2, 0, K), "a sequence of length 0"),
    (lambda m, x: m.fc(x)[:, 1:3], (2, 5, K), "positions 1:3"),
    (lambda m, x: m.fc(x)[:, 1:], (2, 5, K), "cupyfuse takes one position of a sequence"),
    (lambda m, x: m.fc(x).narrow(1, 0, 2), (2, 5, K), "positions [0, 2) of a sequence of 5"),
    (lambda m, x: m.fc(x)[:, 5], (2, 5, K), "index 5 out of range for a sequence of 5"),
    (lambda m, x: m.fc(x).mean(1) + m.fc(x), (2, 5, K),
     "broadcasts the batch dimension against a leading (sequence) dim"),
    (lambda m, x: F.adaptive_avg_pool1d(m.fc(x).transpose(1, 2), 2), (2, 5, K),
     "adaptive pooling of a sequence of 5 to 2"),
    (lambda m, x: m.fc(x).amax(0), (2, 5, K), "reduces over the batch dimension"),
    (lambda m, x: torch.cat([m.fc(x), m.fc(x)], 1), (2, 5, K), "cat: works along a leading dim"),
    (lambda m, x: m.fc(x).cumsum(1), (2, 5, K), "cumsum"),
    (lambda m, x: torch.bmm(m.fc(x).sum(-1, keepdim=True),
                            m.fc(x).sum(-1, keepdim=True).transpose(1, 2)), (2, 5, K),
     "nor attention pooling over the sequence"),   # (batch, seq, seq): an outer product
    (lambda m, x: torch.einsum("bs,bsd->bd", m.fc(x), m.fc(x)), (2, 5, K),
     "pools (batch, seq) weights and (batch, seq, n) values"),
]


@pytest.mark.parametrize("i", range(len(REFUSED)))
def test_forms_that_stay_refused_say_why(i):
    fn, shape, why = REFUSED[i]
    with pytest.raises(TailError, match=re.escape(why)) as ei:
        _run(cupyfuse.from_model(_Fn(fn)), torch.randn(shape))
    assert str(ei.value).startswith("_Fn: ") and "\n  at " in str(ei.value), str(ei.value)


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(K, D)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * mask).sum(1)   # a (batch, seq) mask not unsqueezed


def test_a_batch_seq_mask_must_be_unsqueezed():
    """torch pairs a (batch, seq) mask's batch with the sequence of a (batch, seq, n)
    value (it raises or mixes rows): refused, naming the broadcast."""
    with pytest.raises(TailError, match="broadcasts the batch dimension against a leading"):
        _run(cupyfuse.from_model(_Masked()), torch.randn(2, 5, K), torch.ones(2, 5))
    with pytest.raises(TailError, match=re.escape("input 1 has shape (2, 4)")):
        _run(cupyfuse.from_model(_Masked()), torch.randn(2, 5, K), torch.ones(2, 4))


def test_refusal_of_an_empty_sequence_in_a_tail_function():
    x, w = torch.randn(2, 0, K), torch.randn(D, K)
    with pytest.raises(TailError, match="a sequence of length 0"):
        cupyfuse.fused_linear(x, w, None, lambda h: h.amax(1))


# --- generated kernels compile (nvcc, sm_90a) ---------------------------------------------
NVCC = shutil.which("nvcc")
_PROPS_RE = re.compile(r"Function properties for (\w+)\s*\n\s*(\d+) bytes stack frame, "
                       r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_generated_kernels_compile_without_spills(tmp_path):
    """Every level kernel of every form (and of a few drawn ones), in three translation
    units compiled in parallel as tests/backend/test_tails_compile.py does; each kernel in
    ptxas' report with 0 bytes of spills."""
    plans = []
    for form in sorted(FORMS):
        plans.append(codegen.plan(program_of(cupyfuse.from_model(_model(Pool, form)),
            torch.randn(3, 5, K))))
    plans.append(codegen.plan(program_of(cupyfuse.from_model(_model(MaskedMean, "attention")),
        torch.randn(3, 5, K), torch.rand(3, 5, 1))))
    for seed in range(6):
        spec = draw_spec(RandDraw(seed))
        spec["s"] = max(spec["s"], 2)
        torch.manual_seed(seed)
        prog = program_of(cupyfuse.from_model(Drawn(spec).eval()), *_drawn_inputs(spec, seed))
        plans.append(codegen.plan(prog))
    kernels = {lv.name: lv.kernel for pl in plans for lv in pl.levels if lv.kernel}
    assert len(kernels) >= len(FORMS)
    head = next(iter(kernels.values())).split("\n", 1)[0]   # #include "tail_ops.cuh"
    bodies = [k.split("\n", 1)[1] for k in kernels.values()]
    procs = []
    for j in range(3):
        cu = tmp_path / f"seq{j}.cu"
        cu.write_text(runtime.expand_text(head + "\n" + "\n".join(bodies[j::3])))
        cmd = [NVCC, "-cubin", "-o", str(tmp_path / f"seq{j}.cubin"), "-std=c++17",
               "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", str(cu)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    seen = set()
    for p in procs:
        out, err = p.communicate(timeout=600)
        log = out + err
        assert p.returncode == 0, log
        for fn, stack, st_, ld in _PROPS_RE.findall(log):
            seen.add(fn)
            assert int(st_) == 0 and int(ld) == 0, f"{fn} spills\n{log}"
    assert seen >= set(kernels), set(kernels) - seen
