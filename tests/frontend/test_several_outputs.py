"""Forwards that return several tensors (common in outside models, where a single-result
reading would refuse them): Gaussian heads ``(mean, var)``, ``(probs, log_probs)``, an
LSTM cell's ``(h, c)``, a result next to an intermediate or the GEMM output itself. One
program; every result is materialised and returned in the forward's container type.
Against a float64 copy of the eager model on the CPU and (marked ``gpu``) on the GPU, at
several batches including an empty one; NaN rows placed as torch places them. On the GPU
the second and third calls run the prepared launches (one buffer per result, each
allocated per call).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cupyfuse import fused_class, fused_linear, from_model
from cupyfuse.ir.program import TailError
from helpers import DEVICES
from helpers import runner_of
from helpers import examples



class GaussianHead(nn.Module):
    def __init__(self, k=30, out=7):
        super().__init__()
        self.fc = nn.Linear(k, 2 * out)

    def forward(self, x):
        mean, raw = torch.chunk(self.fc(x), 2, dim=-1)
        return mean, F.softplus(raw) + 1e-6


class ProbsLogProbs(nn.Module):
    def __init__(self, k=30, n=23):
        super().__init__()
        self.fc = nn.Linear(k, n)

    def forward(self, x):
        logits = self.fc(x)
        return [logits.softmax(-1), logits.log_softmax(-1), logits]


class HandLSTMCell(nn.Module):
    def __init__(self, inp=30, hid=24):
        super().__init__()
        self.ih = nn.Linear(inp, 4 * hid)
        self.hh = nn.Linear(hid, 4 * hid)

    def forward(self, x, h, c):
        gates = self.ih(x) + self.hh(h)
        i, f, g, o = gates.chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, c


class Chunks(nn.Module):
    """A chunk result returned as it is (a tuple of its pieces)."""

    def __init__(self, k=30, n=24):
        super().__init__()
        self.fc = nn.Linear(k, n)

    def forward(self, x):
        return torch.chunk(torch.tanh(self.fc(x)), 3, dim=-1)


class SumAndNorm(nn.Module):
    """A row reduction and a normalised row, and the input itself."""

    def __init__(self, k=30, n=40):
        super().__init__()
        self.fc = nn.Linear(k, n)
        self.ln = nn.LayerNorm(n)

    def forward(self, x):
        h = F.gelu(self.fc(x))
        return h.sum(-1, keepdim=True), self.ln(h), x


def _inputs(cls, batch, device):
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, 30, generator=g)
    if batch > 2:
        x[1, 3] = float("nan")
    if cls is HandLSTMCell:
        return [x.to(device), torch.randn(batch, 24, generator=g).to(device),
                torch.randn(batch, 24, generator=g).to(device)]
    return [x.to(device)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [GaussianHead, ProbsLogProbs, HandLSTMCell, SumAndNorm, Chunks])
@pytest.mark.parametrize("batch", [0, 1, 7, 300])
def test_several_outputs_match_float64(device, cls, batch):
    torch.manual_seed(0)
    m = cls().eval().to(device)
    ins = _inputs(cls, batch, device)
    fm = from_model(m)
    with torch.no_grad():
        ref = copy.deepcopy(m).cpu().double()(*[t.cpu().double() for t in ins])
        outs = []
        for _ in range(4):   # general path, then the prepared launches, then their ready plan
            out = fm(*ins)
            assert type(out) is type(ref) and len(out) == len(ref)
            outs.append(out)
        for out in outs:   # each call's results are its own (not overwritten by the next)
            for o, r in zip(out, ref):
                assert o.device.type == torch.device(device).type and o.dtype == torch.float32
                torch.testing.assert_close(o.cpu().double(), r, atol=1e-4, rtol=1e-4,
                                           equal_nan=True)
        given = {t.data_ptr() for t in ins}   # (SumAndNorm returns its input as it is)
        ptrs = [o.data_ptr() for out in outs for o in out if o.numel() and o.data_ptr() not in given]
        assert len(set(ptrs)) == len(ptrs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cls", [GaussianHead, ProbsLogProbs, HandLSTMCell])
def test_several_outputs_prepared(cls):
    """Several results run prepared launches after the first call: one result buffer
    each, the container as the forward builds it."""
    torch.manual_seed(2)
    m = cls().eval().cuda()
    ins = _inputs(cls, 9, "cuda")
    fm = from_model(m)
    with torch.no_grad():
        ref = m(*ins)
        for _ in range(3):
            out = fm(*ins)
            for o, r in zip(out, ref):
                torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4, equal_nan=True)
    prs = [e[0] for e in runner_of(fm).fast.values() if e is not None]
    assert prs and prs[0].outs_type is type(ref) and len(prs[0].more) == len(ref) - 1


@pytest.mark.parametrize("device", DEVICES)
def test_several_outputs_fused_class(device):
    torch.manual_seed(1)
    f = fused_class(GaussianHead)().to(device)
    m = GaussianHead().to(device)
    m.load_state_dict(f.state_dict())
    x = torch.randn(5, 30, device=device)
    with torch.no_grad():
        for o, r in zip(f(x), m(x)):
            torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)


class BoolSecond(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(30, 8)

    def forward(self, x):
        h = self.fc(x)
        return h, h > 0


class ConstSecond(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(30, 8)
        self.p = nn.Parameter(torch.rand(8))

    def forward(self, x):
        return self.fc(x), self.p * 2


def test_several_outputs_refusals():
    x = torch.randn(4, 30)
    with pytest.raises(TailError, match="one of which is not a float32 tensor"):
        from_model(BoolSecond())(x)
    with pytest.raises(TailError, match="does not depend on the batch rows"):
        from_model(ConstSecond())(x)
    w, b = torch.randn(8, 30), torch.randn(8)
    with pytest.raises(TailError, match="a tail function returns one tensor"):
        fused_linear(x, w, b, tail=lambda h: (h.relu(), h.sigmoid()))


class OneTuple(nn.Module):
    def __init__(self, as_list=False):
        super().__init__()
        self.fc = nn.Linear(30, 6)
        self.as_list = as_list

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return [h] if self.as_list else (h,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("as_list", [False, True])
@pytest.mark.parametrize("batch", [0, 1, 5])
def test_one_element_container_kept(device, as_list, batch):
    """``return (h,)`` gives a one-element tuple (not the bare tensor, whose rows ``(c,) =
    fm(x)`` would unpack)."""
    m = OneTuple(as_list).to(device)
    x = torch.randn(batch, 30, device=device)
    fm = from_model(m)
    with torch.no_grad():
        for _ in range(3):
            out, ref = fm(x), m(x)
            assert type(out) is type(ref) and len(out) == 1
            torch.testing.assert_close(out[0], ref[0], atol=1e-4, rtol=1e-4)


class OneRowResult(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(30, 6)

    def forward(self, x, y):
        return self.fc(x) + y, y * 2


def test_result_of_one_row_inputs_only_refused():
    """torch gives a result of one-row inputs only one row; broadcasting the inputs to
    the batch would return the batch's rows: refused, and fine when the rows match."""
    m = OneRowResult()
    fm = from_model(m)
    x, y = torch.randn(5, 30), torch.randn(1, 6)
    with pytest.raises(TailError, match="result 1 is computed from one-row inputs only"):
        fm(x, y)
    with torch.no_grad():
        y5 = torch.randn(5, 6)
        for o, r in zip(fm(x, y5), m(x, y5)):
            torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)


class DictHead(nn.Module):
    """A Hugging Face-style dict of results (string keys, in the forward's order)."""

    def __init__(self, k=30, n=12, one=False):
        super().__init__()
        self.fc = nn.Linear(k, n)
        self.one = one

    def forward(self, x):
        h = self.fc(x)
        if self.one:
            return {"logits": h}
        return {"probs": h.softmax(-1), "logits": h, "scores": torch.sigmoid(h).sum(-1)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("one", [False, True])
@pytest.mark.parametrize("batch", [0, 1, 6])
def test_dict_results(device, one, batch):
    torch.manual_seed(3)
    m = DictHead(one=one).eval().to(device)
    x = torch.randn(batch, 30, device=device)
    if batch > 2:
        x[2, 5] = float("nan")
    fm = from_model(m)
    with torch.no_grad():
        ref = copy.deepcopy(m).cpu().double()(x.cpu().double())
        for _ in range(3):   # (on the GPU: the prepared launches after the first call)
            out = fm(x)
            assert type(out) is dict and list(out) == list(ref)
            for key in ref:
                torch.testing.assert_close(out[key].cpu().double(), ref[key], atol=1e-4,
                                           rtol=1e-4, equal_nan=True)


class Nested(nn.Module):
    def __init__(self, first=False):
        super().__init__()
        self.fc = nn.Linear(30, 8)
        self.first = first

    def forward(self, x):
        h = self.fc(x)
        return ((h, h.relu()), h.sigmoid()) if self.first else (h, (h.relu(), h.sigmoid()))


class IntKeys(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(30, 8)

    def forward(self, x):
        h = self.fc(x)
        return {0: h, 1: h.relu()}


@pytest.mark.parametrize("model,match", [
    (Nested(), "a container inside its result"), (Nested(first=True), "a container inside"),
    (IntKeys(), "keys that are not strings")])
def test_result_container_refusals(model, match):
    with pytest.raises(TailError, match=match):
        from_model(model)(torch.randn(3, 30))


# ======================================================================================
# several results with their features split into several dims, or of a (batch, seq,
# features) input (neither refused as "one of which has its features split into several
# dims" nor as "several values from a (batch, seq, features) input")
# ======================================================================================
class SplitResults(nn.Module):
    """Distributional-RL and mixture heads: a (batch, H, D) view among the results."""

    def __init__(self, form: str, k: int = 9, h: int = 3, d: int = 5):
        super().__init__()
        self.form, self.h, self.d = form, h, d
        self.fc = nn.Linear(k, h * d)
        self.pi = nn.Linear(k, h)
        self.register_buffer("support", torch.linspace(-2.0, 2.0, d))

    def forward(self, x):
        B = x.shape[0]
        z = self.fc(x)
        f = self.form
        if f == "c51":   # (q, dist): dist a (batch, actions, atoms) softmax
            dist = F.softmax(z.view(-1, self.h, self.d), dim=-1).clamp(min=1e-3)
            return (dist * self.support).sum(2), dist
        if f == "qrdqn":   # (mean over quantiles, quantiles)
            q = z.reshape(B, self.h, self.d)
            return q.mean(dim=2), q
        if f == "capsules":   # (squashed capsules, their lengths): split first
            u = z.view(B, self.h, self.d)
            n2 = (u ** 2).sum(-1, keepdim=True)
            v = n2 / (1 + n2) * u / torch.sqrt(n2 + 1e-8)
            return v, v.norm(dim=-1)
        if f == "mdn":   # (pi, sigma, mu): two split results
            pi = F.softmax(self.pi(x), dim=1)
            return pi, torch.exp(z).view(-1, self.h, self.d), z.view(-1, self.h, self.d)
        if f == "dict":
            return {"dist": z.view(B, self.h, self.d).log_softmax(-1),
                    "value": torch.tanh(z).sum(-1, keepdim=True)}
        if f == "unflatten":   # three dims, a one-element container
            return [z.unflatten(-1, (self.h, self.d, 1))]
        if f == "chunks_split":   # chunks of a split value along its heads, as they are
            return z.view(B, self.h, self.d).chunk(self.h, 1)
        raise AssertionError(f)


SPLIT_FORMS = ["c51", "qrdqn", "capsules", "mdn", "dict", "unflatten", "chunks_split"]


class SeqResultsHead(nn.Module):
    """Several results of a (batch, seq, K) input: HAN's (context, alpha), NeRF's (rgb,
    sigma), per-row and pooled values, split heads per position."""

    def __init__(self, form: str, k: int = 7, n: int = 8):
        super().__init__()
        self.form = form
        self.fc = nn.Linear(k, n)
        self.v = nn.Linear(n, 1, bias=False)
        self.out = nn.Linear(n, 4)

    def forward(self, x, mask=None):
        h = torch.tanh(self.fc(x))
        f = self.form
        if f == "attention":
            alpha = F.softmax(self.v(h), dim=1)
            return (alpha * h).sum(dim=1), alpha.squeeze(-1)
        if f == "nerf":
            raw = self.out(h)
            return torch.sigmoid(raw[..., 1:]), F.relu(raw[..., 0])
        if f == "pooled_rows":
            return h.mean(1), self.out(h), h[:, -1]
        if f == "heads":   # a split value per position and its pooled heads
            q = h.view(x.shape[0], x.shape[1], 2, h.shape[-1] // 2)
            return q.softmax(-1), q.amax(1)
        if f == "masked":
            m = mask.unsqueeze(-1)
            return {"pooled": (h * m).sum(1) / m.sum(1).clamp(min=1.0), "h": h * m}
        if f == "rows":   # a (batch * seq, F) view among the results
            return h.view(-1, h.shape[-1]), h.sum(-1, keepdim=True)
        if f == "chunks":
            return self.out(h).chunk(2, -1)
        raise AssertionError(f)


SEQ_FORMS = ["attention", "nerf", "pooled_rows", "heads", "masked", "rows", "chunks"]


def _seq_args(form, batch, seq, k=7, poison=True):
    g = torch.Generator().manual_seed(batch * 13 + seq)
    x = torch.randn(batch, seq, k, generator=g)
    if poison and batch > 2:
        x[1, 0, 2] = float("nan")
        x[2, -1, 0] = float("inf")
    if form == "masked":
        m = (torch.rand(batch, seq, generator=g) > 0.4).float()
        m[:, 0] = 1.0
        return [x, m]
    return [x]


def _compare(out, ref64, ref32, what):
    from gen.tails import assert_matches

    assert type(out) is type(ref64), (what, type(out))
    if isinstance(ref64, dict):
        assert list(out) == list(ref64), what
        out, ref64, ref32 = list(out.values()), list(ref64.values()), list(ref32.values())
    assert len(out) == len(ref64), what
    for i, (o, r64, r32) in enumerate(zip(out, ref64, ref32)):
        assert_matches(o.cpu(), r64, r32, what=f"{what} result {i}")


def _check_several(model, args, device="cpu", calls=3, what=""):
    with torch.no_grad():
        ref64 = copy.deepcopy(model).double()(*[a.double() for a in args])
        ref32 = copy.deepcopy(model)(*args)
    fm = from_model(copy.deepcopy(model).to(device))
    outs = []
    with torch.no_grad():
        for _ in range(calls):   # (on the GPU: the prepared launches after the first)
            outs.append(fm(*[a.to(device) for a in args]))
    for out in outs:
        _compare(out, ref64, ref32, what or type(model).__name__)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", SPLIT_FORMS)
@pytest.mark.parametrize("batch", [0, 1, 6])
def test_split_results(device, form, batch):
    torch.manual_seed(4)
    x = torch.randn(batch, 9)
    if batch > 2:
        x[2, 1] = float("nan")
        x[3, 0] = float("-inf")
    _check_several(SplitResults(form).eval(), [x], device, what=form)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", SEQ_FORMS)
@pytest.mark.parametrize("shape", [(4, 5), (1, 3), (3, 1), (1, 1)])
def test_results_of_a_sequence(device, form, shape):
    torch.manual_seed(5)
    _check_several(SeqResultsHead(form).eval(), _seq_args(form, *shape), device, what=form)


@pytest.mark.parametrize("form", ["attention", "pooled_rows", "heads"])
def test_results_of_a_sequence_empty_batch(form):
    m = SeqResultsHead(form).eval()
    x = torch.randn(0, 4, 7)
    with torch.no_grad():
        ref, out = m(x), from_model(m)(x)
    assert type(out) is type(ref)
    assert [tuple(o.shape) for o in out] == [tuple(r.shape) for r in ref]
    # an empty sequence: torch raises (an index, amax) or gives empty values (softmax);
    # cupyfuse refuses a reduction over it (a TailError), or raises torch's error
    with pytest.raises((TailError, IndexError, RuntimeError)):
        with torch.no_grad():
            from_model(m)(torch.randn(3, 0, 7))


@settings(max_examples=examples(40), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(form=st.sampled_from(SPLIT_FORMS + SEQ_FORMS), batch=st.integers(1, 5),
       seq=st.integers(1, 6), h=st.integers(1, 4), d=st.integers(1, 5),
       poison=st.booleans())
def test_several_results_drawn(form, batch, seq, h, d, poison):
    torch.manual_seed(batch + 7 * seq + 49 * h + 343 * d)
    if form in SPLIT_FORMS:
        x = torch.randn(batch, 9) * 2
        if poison:
            x[0, 0] = float("nan")
        _check_several(SplitResults(form, 9, h, d).eval(), [x], calls=1, what=form)
        return
    _check_several(SeqResultsHead(form).eval(), _seq_args(form, batch, seq, poison=poison),
                   calls=1, what=form)


@pytest.mark.parametrize("form", SPLIT_FORMS + SEQ_FORMS)
def test_several_results_gpu_path_emulated(form, monkeypatch):
    """execute.run_gpu on CPU tensors, its launches emulated (tests/emu/gpu.py): each
    result in torch's shape, float64 torch's values."""
    from emu import gpu as _gpuemu

    torch.manual_seed(6)
    if form in SPLIT_FORMS:
        m, args = SplitResults(form).eval(), [torch.randn(5, 9)]
    else:
        m, args = SeqResultsHead(form).eval(), _seq_args(form, 4, 5)
    with torch.no_grad():
        ref64 = copy.deepcopy(m).double()(*[a.double() for a in args])
        ref32 = copy.deepcopy(m)(*args)
    got = _gpuemu.run_gpu_emulated(m, args, monkeypatch)
    _compare(got, ref64, ref32, form)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", SPLIT_FORMS + SEQ_FORMS)
def test_several_results_large_gpu(form):
    """Engine-sized GEMMs and many rows: three calls (general path, then prepared)."""
    torch.manual_seed(7)
    if form in SPLIT_FORMS:
        m, args = SplitResults(form, k=256, h=12, d=51).eval(), [torch.randn(300, 256)]
    else:
        m, args = SeqResultsHead(form, k=128, n=96).eval(), _seq_args(form, 40, 17, 128)
    _check_several(m, args, "cuda", what=form)
