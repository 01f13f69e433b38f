"""Values with their dims after the batch reordered: ``h.transpose(1, 2)``
of a (batch, seq, C) value is (batch, C, seq) in torch, the same storage in the program
(``values._Perm``): ops that read it in place run on the program's value with their
dims mapped. Time-series code's BatchNorm1d over the channels through transposes
(``bn(h.transpose(1, 2)).transpose(1, 2)``: statistics of each feature over every
(batch, seq) row), TextCNN-style pooling over a whole sequence (``F.max_pool1d(h,
h.size(2))``), reductions, softmax and normalize along the sequence written on the
transposed value, elementwise ops with per-channel (C, 1) parameters or (batch, 1, seq)
masks, ``h.transpose(1, 2) @ w`` attention pooling. Refused with what they need: a Linear
or convolution over the sequence (token mixing), products of two values (attention
scores), a transpose that moves the batch dim (``t.t()`` of a (batch, d) value), a
reshape of a transposed value, pooling windows within a sequence, returning one.

CPU: forms and hypothesis draws against float64 torch (NaN/inf rows, batch 1, odd
sizes; BatchNorm's running statistics after training calls), the GPU path with its
launches emulated on the CPU (tests/emu/gpu.py, BatchNorm's column statistics too), the
generated kernels through nvcc; ``gpu``: the forms on CUDA, two calls each.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupyfuse
from cupyfuse import TailError
from helpers import quiet as _quiet
from helpers import DEVICES
from gen.tails import assert_matches
from helpers import program_of
from helpers import examples

SETTINGS = settings(max_examples=examples(40), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
THIS = "test_transposes.py"


def _poison(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    flat = x.reshape(x.shape[0], -1)
    flat[0, 0] = float("nan")
    if x.shape[0] > 2:
        flat[1, -1] = float("inf")
        flat[2, flat.shape[1] // 2] = -float("inf")
    return flat.reshape(x.shape)


def _check(model: nn.Module, inputs: tuple, device: str = "cpu", calls: int = 2,
           buffers: bool = False) -> None:
    """The fused model against float64 torch (``calls`` calls: on CUDA the later ones may
    take prepared launches), and, with ``buffers``, the BatchNorm running statistics
    after each call against the float64 model's."""
    m64 = copy.deepcopy(model).double()
    m32 = copy.deepcopy(model)
    fm = cupyfuse.from_model(copy.deepcopy(model).to(device))
    for _ in range(calls):
        ref64 = _quiet(m64, *[t.double() for t in inputs])
        ref32 = _quiet(m32, *inputs)
        out = _quiet(fm, *[t.to(device) for t in inputs])
        assert_matches(out.cpu(), ref64, ref32, what=f"{type(model).__name__} {device}")
        if buffers:
            got = dict(fm.named_buffers())
            for k, b in m64.named_buffers():
                if b.is_floating_point():
                    torch.testing.assert_close(got[k].cpu().double(), b, atol=1e-4, rtol=1e-4,
                                               equal_nan=True, msg=lambda m: f"{k}: {m}")
                else:
                    assert torch.equal(got[k].cpu(), b), k


def _refused(model: nn.Module, inputs: tuple, *needles: str) -> str:
    with pytest.raises(TailError) as ei:
        _quiet(cupyfuse.from_model(model), *inputs)
    msg = str(ei.value)
    assert f"{THIS}:" in msg, msg   # the forward's line
    for s in needles:
        assert s in msg, msg
    return msg


# ======================================================================================
# BatchNorm over the channels of a transposed value
# ======================================================================================
BN_FORMS = ["transpose", "permute", "swapaxes", "movedim", "mT", "torch_transpose",
            "functional"]


class SeqBN(nn.Module):
    """Time-series style: Linear over the features, BatchNorm1d over the channels of the
    (batch, C, seq) transpose, back, an activation."""

    def __init__(self, form: str = "transpose", k: int = 8, c: int = 12, affine: bool = True,
                 track: bool = True, momentum: float | None = 0.1):
        super().__init__()
        self.form = form
        self.proj = nn.Linear(k, c)
        self.bn = nn.BatchNorm1d(c, affine=affine, track_running_stats=track,
                                 momentum=momentum)
        if affine:
            with torch.no_grad():
                self.bn.weight.uniform_(0.5, 1.5)
                self.bn.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        h = self.proj(x)
        f = self.form
        if f == "transpose":
            h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        elif f == "permute":
            h = self.bn(h.permute(0, 2, 1)).permute(0, 2, 1)
        elif f == "swapaxes":
            h = torch.swapaxes(self.bn(h.swapaxes(1, 2)), 2, 1)
        elif f == "movedim":
            h = self.bn(h.movedim(-1, 1)).movedim(1, -1)
        elif f == "mT":
            h = self.bn(h.mT).mT
        elif f == "torch_transpose":
            h = torch.transpose(self.bn(torch.transpose(h, -1, -2)), 1, 2).contiguous()
        else:   # F.batch_norm with the module's buffers (eval: running statistics)
            h = F.batch_norm(h.transpose(1, 2), self.bn.running_mean, self.bn.running_var,
                             self.bn.weight, self.bn.bias, False, 0.1,
                             self.bn.eps).transpose(1, 2)
        # (not F.gelu: torch's CPU float32 gelu(+inf) is NaN on a contiguous tensor and
        # +inf on the transposed one eager computes it on; the program's is contiguous)
        return F.relu(h) - 0.5 * torch.tanh(h)


class SeqBN2d(nn.Module):
    """(batch, H, W, K) -> Linear -> BatchNorm2d of the (batch, C, H, W) permute -> back."""

    def __init__(self, k: int = 5, c: int = 6):
        super().__init__()
        self.proj = nn.Linear(k, c)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        h = self.proj(x).permute(0, 3, 1, 2)
        return torch.tanh(self.bn(h).permute(0, 2, 3, 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", BN_FORMS)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_batchnorm_through_transposes(device, form, mode):
    if form == "functional" and mode == "train":
        pytest.skip("F.batch_norm with running statistics and training=False: eval only")
    torch.manual_seed(0)
    m = SeqBN(form).train(mode == "train")
    for shape in [(5, 6, 8), (1, 3, 8), (2, 1, 8), (3, 7, 8)]:
        _check(m, (_poison(torch.randn(shape) * 2) if shape[0] > 1 else
                   torch.randn(shape),), device, buffers=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_batchnorm2d_through_permutes(device, mode):
    torch.manual_seed(1)
    m = SeqBN2d().train(mode == "train")
    _check(m, (torch.randn(3, 4, 5, 5),), device, buffers=True)
    _check(m, (_poison(torch.randn(2, 3, 1, 5)),), device, buffers=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["no_affine", "no_track", "cumulative"])
def test_batchnorm_through_transposes_variants(device, variant):
    torch.manual_seed(2)
    kw = {"no_affine": {"affine": False}, "no_track": {"track": False},
          "cumulative": {"momentum": None}}[variant]
    for mode in ("train", "eval"):
        m = SeqBN(**kw).train(mode == "train")
        _check(m, (torch.randn(4, 5, 8),), device, calls=3, buffers=True)


def test_batchnorm_through_transposes_one_value_per_channel():
    """Training with one (batch, seq) row: torch raises, and so does the fused model."""
    m = SeqBN()
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        _quiet(m, torch.randn(1, 1, 8))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        _quiet(cupyfuse.from_model(m), torch.randn(1, 1, 8))


@SETTINGS
@given(batch=st.integers(1, 5), seq=st.integers(1, 7), k=st.integers(1, 9),
       c=st.integers(1, 11), form=st.sampled_from(BN_FORMS), train=st.booleans(),
       poison=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_batchnorm_through_transposes_drawn(batch, seq, k, c, form, train, poison, seed):
    torch.manual_seed(seed)
    train = train and form != "functional"
    m = SeqBN(form, k, c).train(train)
    x = torch.randn(batch, seq, k) * 3
    if poison and batch > 1:
        x = _poison(x)
    if train and batch * seq == 1:
        with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
            _quiet(cupyfuse.from_model(m), x)
        return
    _check(m, (x,), buffers=True)


# ======================================================================================
# pooling over a whole sequence; reductions, softmax, normalize along a transposed dim;
# elementwise ops; h.transpose(1, 2) @ w
# ======================================================================================
POOL_FORMS = ["max_size", "avg_int", "adaptive_avg", "adaptive_max", "maxpool_module",
              "avgpool_module"]
REDUCE_FORMS = ["mean", "amax_keep", "max_values", "min_unpack", "sum_kw", "logsumexp",
                "var", "std_keep", "norm", "softmax_back", "log_softmax_back",
                "softmin_back", "normalize_back", "softmax_channels"]
EW_FORMS = ["param_affine", "mask_mean", "compare_where", "unsqueeze_sum", "matmul_pool",
            "two_transposed", "twice", "identity_ops"]


class SeqOps(nn.Module):
    """Linear over (batch, seq, K), then ops on the (batch, C, seq) transpose, a head."""

    def __init__(self, form: str, k: int = 7, c: int = 10, seq: int = 6, n_out: int = 3):
        super().__init__()
        self.form, self.seq = form, seq
        self.fc = nn.Linear(k, c)
        self.score = nn.Linear(c, 1)
        self.head = nn.Linear(c, n_out)
        self.scale = nn.Parameter(torch.rand(c, 1) + 0.5)
        self.shift = nn.Parameter(torch.randn(c, 1))
        self.pool_max = nn.MaxPool1d(seq)
        self.pool_avg = nn.AvgPool1d(seq, stride=1)
        self.apool = nn.AdaptiveAvgPool1d(1)

    def forward(self, x, mask=None):
        h = torch.relu(self.fc(x))
        t = h.transpose(1, 2)   # (batch, C, seq)
        f = self.form
        # --- pooling over the whole sequence
        if f == "max_size":   # TextCNN's F.max_pool1d(h, h.size(2)).squeeze(2)
            return self.head(F.max_pool1d(t, t.size(2)).squeeze(2))
        if f == "avg_int":
            return self.head(F.avg_pool1d(t, self.seq).squeeze(-1))
        if f == "adaptive_avg":
            return self.head(self.apool(t).squeeze(-1))
        if f == "adaptive_max":
            return self.head(F.adaptive_max_pool1d(t, 1).flatten(1))
        if f == "maxpool_module":
            return self.pool_max(t).squeeze(2) * 2.0
        if f == "avgpool_module":
            return self.pool_avg(t)[:, :, 0]
        # --- reductions and ops along a dim
        if f == "mean":
            return self.head(t.mean(-1))
        if f == "amax_keep":
            return t.amax(2, keepdim=True).squeeze(-1)
        if f == "max_values":
            return torch.max(t, dim=-1).values
        if f == "min_unpack":
            v, _ = t.min(2)
            return v
        if f == "sum_kw":
            return torch.sum(t, dim=2, keepdim=True).transpose(1, 2)
        if f == "logsumexp":
            return torch.logsumexp(t, dim=-1)
        if f == "var":
            return t.var(2, unbiased=False)
        if f == "std_keep":
            return t.std(dim=-1, keepdim=True).squeeze(2)
        if f == "norm":
            return t.norm(dim=2)
        if f == "softmax_back":   # softmax over the sequence, written on the transpose
            return torch.softmax(t, dim=-1).transpose(1, 2)
        if f == "log_softmax_back":
            return F.log_softmax(t, dim=2).transpose(2, 1)
        if f == "softmin_back":
            return F.softmin(t, dim=-1).transpose(1, 2)
        if f == "normalize_back":
            return F.normalize(t, dim=2).transpose(1, 2)
        if f == "softmax_channels":   # along the features (dim 1 of the transpose)
            return t.softmax(1).transpose(1, 2)
        # --- elementwise ops and products
        if f == "param_affine":   # per-channel (C, 1) parameters, then back
            return F.silu(t * self.scale + self.shift).transpose(1, 2)
        if f == "mask_mean":   # a (batch, seq) mask as (batch, 1, seq)
            m = mask.unsqueeze(1)
            return self.head((t * m).sum(-1) / m.sum(-1).clamp(min=1.0))
        if f == "compare_where":
            return torch.where(t > 0.5, t, 0.1 * t).masked_fill(t < 0.1, -1.0).transpose(1, 2)
        if f == "unsqueeze_sum":
            return t.unsqueeze(1).sum(-1).squeeze(1)
        if f == "matmul_pool":   # attention pooling: (batch, C, seq) @ (batch, seq, 1)
            w = torch.softmax(self.score(h), dim=1)
            return self.head((t @ w).squeeze(-1))
        if f == "two_transposed":
            u = torch.sigmoid(t) * t + t.transpose(1, 2).transpose(2, 1)
            return u.permute(0, 2, 1)
        if f == "twice":   # back and forth twice, a reduction in between
            u = t.transpose(1, 2).transpose(1, 2).transpose(1, 2)
            return u.transpose(1, 2).mean(2) + t.shape[1]
        if f == "identity_ops":
            u = t.contiguous().float().clone().detach()
            return F.dropout(u, 0.3, training=False).transpose(1, 2) * u.size(1)
        raise AssertionError(f)


def _seq_inputs(form: str, batch: int, seq: int, k: int = 7, poison: bool = True) -> tuple:
    g = torch.Generator().manual_seed(batch * 31 + seq)
    x = torch.randn(batch, seq, k, generator=g) * 2
    if poison and batch > 2:
        x = _poison(x)
    if form == "mask_mean":
        mask = (torch.rand(batch, seq, generator=g) > 0.3).float()
        mask[:, 0] = 1.0
        return x, mask
    return (x,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", POOL_FORMS + REDUCE_FORMS + EW_FORMS)
def test_ops_on_a_transposed_value(device, form):
    torch.manual_seed(3)
    m = SeqOps(form).eval()
    for batch in (1, 4):
        _check(m, _seq_inputs(form, batch, 6), device)


@pytest.mark.parametrize("form", ["mean", "softmax_back", "max_size", "adaptive_avg",
                                  "matmul_pool", "param_affine"])
def test_ops_on_a_transposed_value_sequence_of_one(form):
    torch.manual_seed(4)
    _check(SeqOps(form, seq=1).eval(), _seq_inputs(form, 3, 1))


@SETTINGS
@given(batch=st.integers(1, 5), seq=st.integers(1, 7), k=st.integers(1, 8),
       c=st.integers(1, 9), form=st.sampled_from(POOL_FORMS + REDUCE_FORMS + EW_FORMS),
       poison=st.booleans())
def test_ops_on_a_transposed_value_drawn(batch, seq, k, c, form, poison):
    torch.manual_seed(batch + 10 * seq + 100 * k + 1000 * c)
    m = SeqOps(form, k, c, seq).eval()
    _check(m, _seq_inputs(form, batch, seq, k, poison), calls=1)


def test_transposed_value_in_fused_class():
    torch.manual_seed(5)
    cls = cupyfuse.fused_class(SeqBN)
    torch.manual_seed(6)
    ref = SeqBN()
    torch.manual_seed(6)
    fm = cls()
    x = torch.randn(4, 5, 8)
    for _ in range(2):
        torch.testing.assert_close(_quiet(fm, x), _quiet(ref, x), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(fm.bn.running_var, ref.bn.running_var)


# ======================================================================================
# refusals: what moves data across rows or needs a GEMM over a non-feature dim
# ======================================================================================
class Refused(nn.Module):
    def __init__(self, form: str, seq: int = 6, k: int = 7, c: int = 10):
        super().__init__()
        self.form = form
        self.fc = nn.Linear(k, c)
        self.q = nn.Linear(k, c)
        self.token = nn.Linear(seq, seq)
        self.conv = nn.Conv1d(c, c, 3, padding=1)
        self.ln = nn.LayerNorm(seq)
        self.bn2 = nn.BatchNorm2d(4)
        self.bn = nn.BatchNorm1d(c)
        self.pos = nn.Parameter(torch.randn(c, seq))

    def forward(self, x):
        h = self.fc(x)
        t = h.transpose(1, 2)
        f = self.form
        if f == "token_linear":   # MLP-Mixer token mixing
            return self.token(t).transpose(1, 2)
        if f == "conv":   # TextCNN
            return F.relu(self.conv(t)).amax(-1)
        if f == "attention":
            return torch.softmax(self.q(x) @ h.transpose(-2, -1), dim=-1) @ h
        if f == "batch_t":   # CLIP's logits
            a = F.normalize(h.mean(1), dim=-1)
            return a @ a.t()
        if f == "returned":
            return t * 2.0
        if f == "reshape":
            return t.reshape(x.shape[0], -1)
        if f == "flatten":
            return t.flatten(1)
        if f == "pool_window":
            return F.max_pool1d(t, 2).transpose(1, 2)
        if f == "layer_norm":
            return self.ln(t).transpose(1, 2)
        if f == "pos_param":   # a (C, seq) parameter: varies along the sequence
            return (t + self.pos).transpose(1, 2)
        if f == "bn_3d_of_4d":
            return self.bn(t.unsqueeze(-1)).squeeze(-1).transpose(1, 2)
        raise AssertionError(f)


REFUSALS = [
    ("token_linear", "a Linear or matmul over the last dim of a transposed value"),
    ("conv", "a convolution of a transposed value"),
    ("attention", "a product of two values of the batch"),
    ("batch_t", "moves the batch dim"),
    ("returned", "returns a transposed value"),
    ("reshape", "a reshape or join of a transposed value"),
    ("flatten", "a reshape or join of a transposed value"),
    ("pool_window", "pooling windows of 2 positions"),
    ("layer_norm", "a norm of a transposed value"),
    ("pos_param", "laid out in another order"),
    ("bn_3d_of_4d", "expected 2 or 3D input"),
]


@pytest.mark.parametrize("form,why", REFUSALS)
def test_refusals_of_transposed_values(form, why):
    torch.manual_seed(7)
    _refused(Refused(form), (torch.randn(3, 6, 7),), why)


class BN2dOverSeq(nn.Module):
    """(batch, H, W, K): BatchNorm2d whose channels are a leading dim (W)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.fc(x).permute(0, 2, 1, 3)).permute(0, 2, 1, 3)


def test_batchnorm_whose_channels_are_not_the_features_is_refused():
    _refused(BN2dOverSeq(), (torch.randn(2, 3, 4, 5),), "channels (dim 1) are not its features")


def test_transpose_of_a_flat_value_moving_the_batch_is_refused():
    class T(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return torch.relu(self.fc(x)).T.sum(0)

    _refused(T(), (torch.randn(5, 4),), "moves the batch dim: (batch, 3) to (3, batch)")


# ======================================================================================
# the GPU path on the CPU, and the generated kernels through nvcc
# ======================================================================================
def _emulated_cases():
    torch.manual_seed(8)
    out = []
    for form in ("transpose", "movedim"):
        for mode in ("train", "eval"):
            out.append((f"bn_{form}_{mode}", SeqBN(form).train(mode == "train"),
                        (_poison(torch.randn(4, 5, 8)),)))
    out.append(("bn2d_train", SeqBN2d().train(), (torch.randn(3, 2, 4, 5),)))
    for form in ("max_size", "adaptive_avg", "mean", "softmax_back", "matmul_pool",
                 "param_affine", "mask_mean", "normalize_back"):
        out.append((form, SeqOps(form).eval(), _seq_inputs(form, 4, 6)))
    return out


def test_gpu_path_emulated_on_the_cpu(monkeypatch):
    """execute.run_gpu on CPU tensors, its launches emulated (tests/emu/gpu.py, BatchNorm's
    column statistics included): the float64 model's values, the running statistics
    updated as torch updates them."""
    from emu import gpu as _gpuemu

    for name, model, ins in _emulated_cases():
        m64 = copy.deepcopy(model).double()
        ref64 = _quiet(m64, *[t.double() for t in ins])
        ref32 = _quiet(copy.deepcopy(model), *ins)
        mine = copy.deepcopy(model)
        got = _gpuemu.run_gpu_emulated(mine, ins, monkeypatch)
        if isinstance(got, torch.Tensor) and got.dim() != ref64.dim():
            got = got.reshape(ref64.shape)
        assert_matches(got, ref64, ref32, what=name)
        for k, b in m64.named_buffers():
            if b.is_floating_point():
                torch.testing.assert_close(dict(mine.named_buffers())[k].double(), b,
                                           atol=1e-4, rtol=1e-4, equal_nan=True,
                                           msg=lambda m: f"{name} {k}: {m}")


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc is not on PATH")
def test_transposed_forms_compile_with_nvcc(tmp_path):
    import re
    import subprocess

    from cupyfuse.backend import codegen, runtime

    bodies: dict[str, str] = {}
    for _, model, ins in _emulated_cases():
        prog = program_of(model, *ins)
        for lv in codegen.plan(prog).levels:
            if lv.kernel:
                bodies.setdefault(lv.name, lv.kernel.split("\n", 1)[1])
    assert bodies
    src = tmp_path / "transposed_forms.cu"
    src.write_text(runtime.expand_source("tail_ops.cuh") + "\n" + "\n".join(bodies.values()))
    r = subprocess.run(["nvcc", "-cubin", "-o", str(tmp_path / "transposed_forms.cubin"),
                        "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                        str(src)], capture_output=True, text=True, timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    entries = set(re.findall(r"Compiling entry function '(\w+)'", log))
    assert set(bodies) <= entries, set(bodies) - entries
    for name, stores in re.findall(r"Function properties for (\w+)\s*\n\s*\d+ bytes stack "
                                   r"frame, (\d+) bytes spill stores", log):
        assert int(stores) == 0, f"{name} spills {stores} bytes"


# ======================================================================================
# GPU: larger shapes (engine-sized GEMMs, many rows for the column statistics)
# ======================================================================================
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("shape", [(64, 32, 96), (300, 17, 96), (3, 1000, 96)])
def test_batchnorm_through_transposes_large_gpu(mode, shape):
    torch.manual_seed(9)
    m = SeqBN("transpose", k=shape[-1], c=200).train(mode == "train")
    _check(m, (_poison(torch.randn(shape)),), "cuda", calls=3, buffers=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", ["max_size", "mean", "softmax_back", "matmul_pool"])
def test_ops_on_a_transposed_value_large_gpu(form):
    torch.manual_seed(10)
    m = SeqOps(form, k=256, c=512, seq=48).eval()
    _check(m, _seq_inputs(form, 40, 48, 256), "cuda", calls=3)
