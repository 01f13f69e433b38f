"""Linear + tail on (batch, seq..., features) inputs, CPU path: hypothesis draws whole
models (tests/gen/leads.py) and compares them with float64 torch, NaN/inf rows included;
ops along a leading dim must be refused, never computed."""
from __future__ import annotations

import copy
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupyfuse
from cupyfuse.ir.program import TailError

from gen.leads import build, draw, inputs
from gen.tails import HypDraw, assert_matches, references
from helpers import program_of, runner_of
from helpers import examples

SETTINGS = settings(max_examples=examples(120), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _fused(model: nn.Module, api: str) -> nn.Module:
    if api == "from_model":
        return cupyfuse.from_model(model)
    new = cupyfuse.fused_class(type(model))(model.spec)
    new.load_state_dict(model.state_dict())
    return new.train(model.training)


def _run(fused: nn.Module, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fused(*args, **kwargs)


@SETTINGS
@given(st.data(), st.sampled_from(["from_model", "fused_class"]), st.integers(0, 10 ** 6))
def test_row_wise_tails_match_float64(data, api, seed):
    spec = draw(HypDraw(data.draw))
    model = build(spec, seed)
    x, y = inputs(spec, seed)
    ref64, _, ref32 = references(model, [x, y])
    out = _run(_fused(model, api), x, y)
    assert_matches(out, ref64, ref32, what=str(spec))


@SETTINGS
@given(st.data(), st.integers(0, 10 ** 6))
def test_ops_along_a_leading_dim_are_refused(data, seed):
    spec = draw(HypDraw(data.draw), bad=True)
    model = build(spec, seed)
    x, y = inputs(spec, seed)
    with pytest.raises(TailError) as ei:
        _run(cupyfuse.from_model(model), x, y)
    msg = str(ei.value)
    assert msg.startswith("LeadModel: ") and "\n  at " in msg, msg


class FFN(nn.Module):
    """A transformer block's feed-forward half, as people write it."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.down(F.gelu(self.up(x))))


@pytest.mark.parametrize("shape", [(2, 7, 24), (1, 1, 24), (3, 1, 5, 24), (0, 4, 24)])
def test_transformer_ffn_block(shape):
    torch.manual_seed(0)
    model = FFN(24, 40).eval()
    x = torch.randn(shape) * 3
    ref64, _, ref32 = references(model, [x])
    out = _run(cupyfuse.from_model(model), x)
    assert_matches(out, ref64, ref32, what=f"FFN {shape}")
    New = cupyfuse.fused_class(FFN)
    torch.manual_seed(0)
    assert_matches(_run(New(24, 40).eval(), x), ref64, ref32, what=f"FFN class {shape}")


def test_program_runs_on_batch_times_seq_rows():
    prog = program_of(cupyfuse.from_model(FFN(8, 16)), torch.rand(3, 5, 8))
    assert prog.lead == (5,)
    assert prog.rows(3) == 15 and prog.out_shape(15) == (3, 5, 8)
    assert all(-2 not in n.dims for n in prog.nodes)   # LEAD lowered before anything runs
    flat = program_of(cupyfuse.from_model(FFN(8, 16)), torch.rand(3, 8))
    assert flat.lead == () and flat.out_shape(3) == (3, 8)


def test_linear_keeps_size_one_dims_like_torch():
    """(batch, 1, K) -> (batch, 1, N), as nn.Linear gives it (not (batch, N))."""
    lin = nn.Linear(8, 6)
    x = torch.rand(3, 1, 8)
    out = _run(cupyfuse.from_model(nn.Sequential(lin, nn.ReLU())), x)
    assert out.shape == (3, 1, 6)
    torch.testing.assert_close(out, torch.relu(lin(x)).detach())


class SeqMix(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.pos = nn.Parameter(torch.randn(5, 6))
        self.pcol = nn.Parameter(torch.randn(5, 1))
        self.how = how

    def forward(self, x):
        h = self.fc(x)
        if self.how == "pos":          # a (seq, features) parameter: varies along the seq
            return h + self.pos
        if self.how == "pos_col":      # (seq, 1): one value per sequence position
            return h * self.pcol
        if self.how == "seq_len":      # the sequence length as a number
            return h / x.shape[1]
        if self.how == "pool_4d":      # torch's 1-D pools refuse 4-D input
            return F.avg_pool1d(h.unsqueeze(2), 2)
        if self.how == "squeeze":
            return h.squeeze()
        return h.transpose(1, 2)


@pytest.mark.parametrize("how,why", [
    ("pos", "matrix parameter"), ("pos_col", "broadcasts a leading (sequence) dim"),
    ("seq_len", "leading (sequence) dim's size as a number"),
    ("pool_4d", "1-D pooling of a 4-D value"), ("squeeze", "squeeze() with no dim"),
    ("transpose", "returns a transposed value")])
def test_sequence_mixing_forms_are_refused(how, why):
    x = torch.rand(2, 5, 8)
    with pytest.raises(TailError, match=re.escape(why)):
        _run(cupyfuse.from_model(SeqMix(how)), x)


TAILS = {
    "identity": None,
    "softmax_gelu": lambda h: torch.softmax(F.gelu(h), dim=-1),
    "layer_norm": lambda h: F.layer_norm(h, h.shape[-1:]),
    "lse_keep_pos": lambda h: torch.logsumexp(h, dim=h.dim() - 1, keepdim=True) - h,
    "sum": lambda h: torch.tanh(h).sum(-1),
    "pool_last": lambda h: F.max_pool1d(h, 2),
}


@SETTINGS
@given(st.sampled_from(sorted(TAILS)), st.lists(st.sampled_from([1, 2, 3, 5]), min_size=1,
                                                  max_size=2),
       st.integers(0, 3), st.integers(2, 12), st.integers(2, 10), st.booleans(),
       st.integers(0, 10 ** 6))
def test_fused_linear_takes_leading_dims(name, lead, B, K, N, bias, seed):
    """The functional form on (batch, seq..., K): the same result as torch in float64,
    with NaN/inf rows."""
    if name == "pool_last":
        lead = lead[:1]   # torch's 1-D pools take 3-D input at most
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((B,) + tuple(lead) + (K,), generator=g) * 2
    if x.numel() and seed % 3 == 0:
        x.view(-1, K)[seed % x.view(-1, K).shape[0]] = float("nan")
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    tail = TAILS[name]
    h64 = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    h32 = x @ w.t() + (b if b is not None else 0)
    ref64 = h64 if tail is None else tail(h64)
    ref32 = h32 if tail is None else tail(h32)
    out = cupyfuse.fused_linear(x, w, b, tail)
    assert_matches(out, ref64, ref32, what=f"{name} x{tuple(x.shape)} N={N}")


def test_fused_linear_leading_dims_extra_inputs_and_refusals():
    torch.manual_seed(5)
    x, w, b = torch.randn(2, 5, 8), torch.randn(6, 8), torch.randn(6)
    y = torch.rand(2, 5, 6)

    def gated(h, y):
        return (h * torch.sigmoid(y)).sum(-1, keepdim=True)

    want = gated(x.double() @ w.double().t() + b.double(), y.double())
    torch.testing.assert_close(cupyfuse.fused_linear(x, w, b, gated, y).double(), want,
                               atol=1e-4, rtol=1e-4)
    with pytest.raises(TailError, match="input 1 has shape \\(5, 6\\)"):
        cupyfuse.fused_linear(x, w, b, gated, torch.rand(5, 6))
    torch.testing.assert_close(cupyfuse.fused_linear(x, w, b, lambda h: h.sum(1)).double(),
                               (x.double() @ w.double().t() + b.double()).sum(1),
                               atol=1e-4, rtol=1e-4)   # over the sequence
    with pytest.raises(TailError, match="cat: works along a leading dim"):
        cupyfuse.fused_linear(x, w, b, lambda h: torch.cat([h, h], 1))
    with pytest.raises(ValueError, match=r"for a CudaTail \(pass x\.reshape\(-1, K\)\)"):
        cupyfuse.fused_linear(x, w, b, cupyfuse.CudaTail(map="h", reduce="a + b",
                                                         identity="0"))


# --- adversarial leading dims: empty, size one, forms that mix the sequence ------------
class _Act(nn.Module):
    def __init__(self, fn=None) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.w = nn.Parameter(torch.randn(6, 8))
        self.fn = fn

    def forward(self, x):
        return self.fn(self, x)


def _gelu(h):
    return F.gelu(h)


@pytest.mark.parametrize("shape", [(3, 0, 8), (2, 5, 0, 8), (2, 0, 5, 8), (0, 5, 8), (2, 5, 1)])
def test_empty_and_size_one_leading_dims_give_torch_shapes(shape):
    """A leading dim of 0 stays 0 (x (2, 5, 0, 8) gives (2, 5, 0, 6), not (0, 5, 1, 6) nor a
    crash); (batch, seq, 1) with Linear(1, N) fuses."""
    k = shape[-1]
    model = nn.Sequential(nn.Linear(k, 6), nn.GELU())
    x = torch.randn(shape)
    with torch.no_grad():
        want = model(x)
    out = _run(cupyfuse.from_model(model), x)
    assert out.shape == want.shape
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    lin = model[0]
    out = cupyfuse.fused_linear(x, lin.weight.detach(), lin.bias.detach(), _gelu)
    assert out.shape == want.shape


@pytest.mark.parametrize("fn,why", [
    (lambda m, x: m.fc(x).sum(-1).unsqueeze(1) + m.fc(x).sum(-1, keepdim=True),
     "outer product over the leading"),
    (lambda m, x: torch.mm(x, m.w.t()), "a 3-dim operand (it takes matrices"),
    (lambda m, x: torch.addmm(m.fc.bias, x, m.w.t()[:, :6]), "3-dim operand"),
    (lambda m, x: torch.einsum("bi,oi->bo", x, m.w), "einsum 'bi,oi->bo' of a 3-dim"),
    (lambda m, x: m.fc(x).sum(5), "dim 5 out of range"),
    (lambda m, x: m.fc(x).sum((-1, 2)), "names a dim twice"),
    (lambda m, x: m.fc(x).unsqueeze(4), "dim 4 out of range"),
    (lambda m, x: m.fc(x).squeeze(5), "dim 5 out of range"),
    (lambda m, x: m.fc(x).transpose(2, 5), "dim 5 out of range"),
    (lambda m, x: m.fc(x).flatten(5), "dim 5 out of range"),
    (lambda m, x: m.fc(x).permute(0, 1), "a permutation of 2 dims of a 3-dim"),
    (lambda m, x: F.group_norm(m.fc(x), 5), "channels (dim 1) are a leading"),
])
def test_forms_torch_refuses_or_that_mix_the_sequence_are_refused(fn, why):
    """Forms where torch raises or where the sequence positions would mix: a TailError
    naming why (never a value, nor a crash inside cupyfuse)."""
    with pytest.raises(TailError, match=re.escape(why)):
        _run(cupyfuse.from_model(_Act(fn)), torch.randn(2, 5, 8))


def test_out_of_range_dims_are_refused_on_2d_values_too():
    with pytest.raises(TailError, match="dim 3 out of range"):
        _run(cupyfuse.from_model(_Act(lambda m, x: m.fc(x).sum(3))), torch.randn(4, 8))


def test_from_model_binds_keyword_inputs():
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 6)

        def forward(self, x, y):
            return self.fc(x) * y

    m = TwoInputs()
    x, y = torch.randn(2, 5, 8), torch.rand(2, 5, 6)
    with torch.no_grad():
        want = m(x, y)
    torch.testing.assert_close(_run(cupyfuse.from_model(m), x, y=y), want, atol=1e-4, rtol=1e-4)


def test_arithmetic_on_sizes_folds():
    """``h / h.size(-1) ** 0.5`` (attention-style scaling) fuses, not refused as "a number
    raised to a tensor power": sizes of feature dims are numbers of the forward."""
    m = _Act(lambda m, x: m.fc(x) / m.fc(x).size(-1) ** 0.5 + x.shape[-1] // 3)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        want = m(x)
    torch.testing.assert_close(_run(cupyfuse.from_model(m), x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", ["matmul", "mm"])
@pytest.mark.parametrize("shape", [(4, 8), (2, 5, 8)])
def test_matmul_method_forms_are_linears(form, shape):
    """``x.matmul(W.t())`` / ``x.mm(W.t())`` are Linears (not "no Linear layer"); ``mm``
    takes matrices only, as in torch."""
    m = _Act(lambda m, x: torch.relu(getattr(x, form)(m.w.t())))
    x = torch.randn(shape)
    if form == "mm" and len(shape) > 2:
        with pytest.raises(TailError, match="a 3-dim operand"):
            _run(cupyfuse.from_model(m), x)
        return
    with torch.no_grad():
        want = m(x)
    torch.testing.assert_close(_run(cupyfuse.from_model(m), x), want, atol=1e-5, rtol=1e-5)


def test_size_arithmetic_dividing_by_zero_gives_torchs_inf():
    m = _Act(lambda m, x: m.fc(x) / (m.fc(x).shape[-1] - 6))
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = m(x)
    torch.testing.assert_close(_run(cupyfuse.from_model(m), x), want)


class _Masked(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.how = how

    def forward(self, x, mask):
        h = self.fc(x)
        if self.how == "fill":
            return h.masked_fill(mask, -1e4).softmax(-1)
        if self.how == "where":
            return torch.where(mask, h, torch.zeros_like(h))
        if self.how == "not":
            return h.masked_fill(~mask, 0.0)
        if self.how == "mul":
            return h * mask
        return mask.sum(-1)


@pytest.mark.parametrize("how", ["fill", "where", "not", "mul"])
@pytest.mark.parametrize("shapes", [((2, 5, 8), (2, 5, 6)), ((3, 8), (3, 6)), ((3, 8), (3, 1))])
def test_bool_mask_inputs(how, shapes):
    """A bool mask as a forward input (not a TypeError asking for float32): read as 0/1
    where torch reads a bool; both APIs."""
    torch.manual_seed(7)
    m = _Masked(how)
    x, mask = torch.randn(shapes[0]), torch.rand(shapes[1]) > 0.5
    with torch.no_grad():
        want = m(x, mask)
    torch.testing.assert_close(_run(cupyfuse.from_model(m), x, mask), want, atol=1e-6, rtol=1e-6)
    twin = cupyfuse.fused_class(_Masked)(how)
    twin.load_state_dict(m.state_dict())
    torch.testing.assert_close(_run(twin, x, mask=mask), want, atol=1e-6, rtol=1e-6)


def test_bool_mask_reductions_and_bool_x_are_refused():
    with pytest.raises(TailError, match="a reduction of a boolean tensor"):
        _run(cupyfuse.from_model(_Masked("sum")), torch.randn(3, 8), torch.rand(3, 6) > 0.5)
    with pytest.raises(TypeError, match=r"input 0 must be float32, got"):
        _run(cupyfuse.from_model(_Masked("mul")), torch.rand(3, 8) > 0.5, torch.rand(3, 6) > 0.5)


# --- trailing size-1 dims, numbers of the forward, floats where torch wants ints ---------
class _Fn(nn.Module):
    def __init__(self, fn, k: int = 16, n: int = 32) -> None:
        super().__init__()
        self.fc = nn.Linear(k, n)
        self.fc1 = nn.Linear(1, 8)
        self.fn = fn

    def forward(self, x):
        return self.fn(self, x)


class _Fn2(_Fn):
    def forward(self, x, y):
        return self.fn(self, x, y)


@pytest.mark.parametrize("fn,shapes", [
    (lambda m, x: m.fc(x.squeeze(-1)), [(3, 16, 1)]),              # (batch, K, 1) inputs
    (lambda m, x: m.fc(x.view(x.size(0), -1)), [(3, 16, 1)]),
    (lambda m, x: m.fc(x[:, :, 0]), [(3, 16, 1)]),
    (lambda m, x, e: m.fc(x) + e.squeeze(-1), [(3, 16), (3, 32, 1)]),
    (lambda m, x: m.fc1(x), [(2, 5, 1)]),                          # (batch, seq, 1)
    (lambda m, x: m.fc(x)[:, m.fc(x).shape[1] // 2:], [(3, 16)]),   # computed slice bounds
    (lambda m, x: m.fc(x).softmax(-(m.fc(x).dim() - 1)), [(3, 16)]),  # a negated number
])
def test_both_readings_of_a_trailing_one_and_folded_numbers(fn, shapes):
    """(batch, n, 1) reads as n features (a squeeze first) or as n positions of one
    feature: the first reading is tried, then the second (the first is not refused);
    numbers of the forward in slices and negated."""
    torch.manual_seed(1)
    m = (_Fn2 if len(shapes) == 2 else _Fn)(fn)
    args = [torch.randn(s) for s in shapes]
    with torch.no_grad():
        want = m(*args)
    torch.testing.assert_close(_run(cupyfuse.from_model(m), *args), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fn,why", [
    (lambda m, x: m.fc(x).sum(m.fc(x).size(1) / 32), "is not an int"),
    (lambda m, x: m.fc(x).softmax(m.fc(x).size(1) / 32), "is not an int"),
    (lambda m, x: m.fc(x).narrow(1, 0, m.fc(x).size(1) / 2), "must be ints"),
    (lambda m, x: m.fc1(m.fc(x).sum(1)), "input features in the last dim"),
])
def test_forms_torch_raises_on_are_refused(fn, why):
    """A float where torch wants an int dim or size (refused, not rounded to an int and
    computed); Linear(1, N) of a (batch,) vector (torch multiplies (1, batch) there)."""
    with pytest.raises(TailError, match=re.escape(why)):
        _run(cupyfuse.from_model(_Fn(fn)), torch.randn(3, 16))


@pytest.mark.parametrize("fn", [lambda h, m: h - m, lambda h, m: h * (1 - m),
                                lambda h, m: h * -m, lambda h, m: m - h])
def test_subtracting_or_negating_a_bool_mask_is_refused(fn):
    model = _Fn2(lambda mm, x, mask: fn(mm.fc(x), mask))
    with pytest.raises(TailError, match="boolean tensor"):
        _run(cupyfuse.from_model(model), torch.randn(3, 16), torch.rand(3, 32) > 0.5)


# --- identity reshapes of (batch, seq..., features) values: views --------------------------
def _b_s_n(h):
    return h.reshape(h.shape[0], h.shape[1], -1)


@pytest.mark.parametrize("fn,shape", [
    (lambda m, x: torch.relu(_b_s_n(m.fc(x))), (2, 5, 16)),
    (lambda m, x: torch.relu(_b_s_n(m.fc(x))), (2, 1, 16)),
    (lambda m, x: m.fc(x).view(x.shape[0], x.shape[1], 32).softmax(-1), (2, 5, 16)),
    (lambda m, x: m.fc(x).view(x.size(0), -1, 32).sum(-1), (2, 5, 16)),
    (lambda m, x: m.fc(x).view(-1, x.shape[1], 32).relu(), (2, 5, 16)),
    (lambda m, x: m.fc(x).view(-1, 5, 32).relu(), (2, 5, 16)),           # the seq's number
    (lambda m, x: m.fc(x).view(m.fc(x).shape).relu(), (2, 5, 16)),
    (lambda m, x: torch.reshape(m.fc(x), m.fc(x).size()).relu(), (3, 2, 5, 16)),
    (lambda m, x: m.fc(x).reshape(x.shape[0], x.shape[1], x.shape[2], -1).tanh(), (3, 2, 5, 16)),
    (lambda m, x: m.fc(x).reshape(x.shape[0], x.shape[1], x.shape[2], -1).tanh(), (3, 1, 5, 16)),
    (lambda m, x: m.fc(x).view(x.shape[0], x.shape[1], 1, 32).softmax(-1), (2, 5, 16)),
    (lambda m, x: m.fc(x).view(x.shape[0], x.shape[1], 32), (0, 5, 16)),
    (lambda m, x, y: _b_s_n(m.fc(x)) * _b_s_n(y).sigmoid(), (2, 5, 16)),
])
def test_identity_reshapes_of_leading_dims_are_views(fn, shape):
    """``h.reshape(h.shape[0], h.shape[1], -1)`` / ``h.view(b, s, n)`` of a (batch, seq, n)
    value (a no-op) fuses, not refused as a reshape to a leading dim's size or as merging
    the batch; size-1 dims may come and go, the dims other than 1 keep their order."""
    torch.manual_seed(2)
    two = fn.__code__.co_argcount == 3
    m = (_Fn2 if two else _Fn)(fn)
    args = [torch.randn(shape)] + ([torch.randn(shape[:-1] + (32,))] if two else [])
    with torch.no_grad():
        want = fn(m.double(), *[a.double() for a in args])
    m.float()
    out = _run(cupyfuse.from_model(m), *args)
    assert out.shape == want.shape
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tail,shape", [
    (lambda h: torch.relu(_b_s_n(h) * 2), (2, 5, 8)),
    (lambda h: torch.relu(_b_s_n(h) * 2), (2, 1, 8)),
    (lambda h: h.view(h.shape[0], h.shape[1], 6).relu(), (0, 5, 8)),
    (lambda h: h.view(h.shape).relu() * 2, (3, 2, 5, 8)),
])
def test_fused_linear_tail_reshaping_to_its_own_shape(tail, shape):
    torch.manual_seed(3)
    x, w, b = torch.randn(shape), torch.randn(6, 8), torch.randn(6)
    want = tail(x.double() @ w.double().t() + b.double())
    out = cupyfuse.fused_linear(x, w, b, tail)
    assert out.shape == want.shape
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fn,shape,why", [
    (lambda m, x: m.fc(x).reshape(-1), (2, 5, 16), "merges the batch dimension"),
    (lambda m, x: m.fc(x).view(-1, 4, 32), (2, 5, 16), "merges the batch dimension"),
    (lambda m, x: m.fc(x).reshape(x.shape[0], -1), (2, 5, 16), "moves data between rows"),
    (lambda m, x: m.fc(x).view(x.shape[1], x.shape[0], 32), (2, 5, 16),
     "a reshape to a leading (sequence) dim's size"),
    (lambda m, x: m.fc(x).view(x.shape[0], x.shape[2], x.shape[1], 32), (2, 5, 3, 16),
     "a reshape to a leading (sequence) dim's size"),
    (lambda m, x: m.fc(x).view(x.shape[0], 3, 5, 32), (2, 5, 3, 16), "moves data between rows"),
    (lambda m, x: m.fc(x).view(x.shape[0], 4, x.shape[1], 8), (2, 5, 16),
     "a reshape to a leading (sequence) dim's size"),
    (lambda m, x: m.fc(x).reshape(x.shape[0], x.shape[1], -1), (2, 0, 16),
     "a leading dim of size 0 (torch raises"),
])
def test_reshapes_that_move_a_leading_dim_stay_refused(fn, shape, why):
    with pytest.raises(TailError, match=re.escape(why)):
        _run(cupyfuse.from_model(_Fn(fn)), torch.randn(shape))


# --- Python numbers as forward inputs -----------------------------------------------------
class _Scaled(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.how = how

    def forward(self, x, a, y, c=0.25):
        h = self.fc(x)
        if self.how == "mul":
            return torch.relu(h) * a + y * c
        if self.how == "leaky":
            return F.leaky_relu(h, a) + y
        if self.how == "pow":
            return h.abs() ** a - y
        if self.how == "clamp":
            return h.clamp(-a, a) * y
        return h.softmax(a) + y   # an int: a dim


def _twins(how: str, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    m = _Scaled(how)
    twin = cupyfuse.fused_class(_Scaled)(how)
    twin.load_state_dict(m.state_dict())
    return [m, cupyfuse.from_model(m), twin]


@pytest.mark.parametrize("how,values", [
    ("mul", [0.5, 2.0, 3, -1, 0.5, 1.0, 1, float("inf")]), ("leaky", [0.1, 0.3, 0.1]),
    ("pow", [2, 0.5, 3, 2.0]), ("clamp", [0.5, 1.5, 0.5]), ("dim", [-1, 1, -1])])
@pytest.mark.parametrize("shape", [(4, 8), (2, 3, 8)])
def test_python_numbers_as_forward_inputs(how, values, shape):
    """``fm(x, 0.5, y)`` (no TypeError asking for tensors): a number is a constant
    of the program, one program per value (a new value never reuses an old one's); both
    APIs, keyword inputs and a number's default value too."""
    m, *fused = _twins(how)
    x = torch.randn(shape) * 2
    y = torch.randn(shape[:-1] + (6,))
    m64 = _Scaled(how).double()
    m64.load_state_dict(m.state_dict())
    for fm in fused:
        for a in values:
            want = m64(x.double(), a, y.double())
            torch.testing.assert_close(_run(fm, x, a, y).double(), want, atol=1e-4, rtol=1e-4,
                                       equal_nan=True)   # relu(h) * inf
        want = m64(x.double(), values[0], y.double(), -3)
        torch.testing.assert_close(_run(fm, x, values[0], y, -3).double(), want, atol=1e-4,
                                   rtol=1e-4)
        torch.testing.assert_close(_run(fm, x, y=y, a=values[0], c=2).double(),
                                   m64(x.double(), values[0], y.double(), 2),
                                   atol=1e-4, rtol=1e-4)


def test_python_number_inputs_make_a_program_each_and_keep_a_bounded_number():
    m, fm, twin = _twins("mul")
    x, y = torch.randn(4, 8), torch.randn(4, 6)
    runner = runner_of(fm)
    for a in (0.5, 0.5, 2.0, 2, -0.0, 0.0, float("nan"), float("nan")):
        _run(fm, x, a, y)
    assert len(runner.programs) == 6   # 0.5, 2.0, 2, -0.0, 0.0, nan
    for i in range(100):   # a number that changes every call: the oldest programs go
        out = _run(fm, x, i / 7, y)
    torch.testing.assert_close(out, m(x, 99 / 7, y).detach())
    assert len(runner.programs) <= 64
    prog = program_of(fm, x, 3.0, y)
    assert prog.n_inputs == 2 and any(n.kind == "const" and n.attrs[0] == 3.0
                                      for n in prog.nodes)


def test_python_number_inputs_refusals():
    m, fm, twin = _twins("dim")
    with pytest.raises(TailError, match="softmax: works along one of several leading dims"):
        _run(fm, torch.randn(2, 3, 4, 8), 1, torch.randn(2, 3, 4, 6))
    for f in (fm, twin):
        # a bool passed specialises the trace; as a dim torch raises, and so does cupyfuse
        x4, y4 = torch.randn(4, 8), torch.randn(4, 6)
        with pytest.raises(TypeError, match="must be int, not bool"):
            m(x4, True, y4)
        with pytest.raises(TailError, match="softmax: dim True is not an int"):
            _run(f, x4, True, y4)
        with pytest.raises(TypeError, match="x must be a torch tensor"):
            _run(f, 0.5, torch.randn(4, 8), torch.randn(4, 6))

    for fn, why in [(lambda m, x, a: m.fc(x) + a.sigmoid(), "`.sigmoid()`: a tensor method of "
                     "a Python number (torch raises)"),
                    (lambda m, x, a: m.fc(x) * torch.exp(a), "`exp`: a Python number where "
                     "torch takes a tensor (torch raises)"),
                    (lambda m, x, a: m.fc(x) + torch.sqrt(m.fc(x).size(-1)), "`sqrt`: a Python "
                     "number where torch takes a tensor")]:
        with pytest.raises(TailError, match=re.escape(why)):
            _run(cupyfuse.from_model(_Fn2(fn)), torch.randn(3, 16), 0.5)

    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 6)

        def forward(self, x, s):
            h = self.fc(x)
            return h * 2 if s > 0 else h

    with pytest.raises(TailError, match="control flow"):
        cupyfuse.from_model(Branches())


def _scaled_tail(h, s, y, t):
    return torch.relu(h) * s + y * t


@pytest.mark.parametrize("shape", [(4, 8), (2, 5, 8)])
def test_fused_linear_takes_python_number_extras(shape):
    """A number among fused_linear's extras (no TypeError); one program per value (the
    same tail function object with new values never reuses an old program)."""
    torch.manual_seed(4)
    x, w, b = torch.randn(shape), torch.randn(6, 8), torch.randn(6)
    y = torch.randn(shape[:-1] + (6,))
    h64 = x.double() @ w.double().t() + b.double()
    for s, t in [(0.5, 1), (2.0, 1), (0.5, -2), (3, 0.25), (0.5, 1)]:
        out = cupyfuse.fused_linear(x, w, b, _scaled_tail, s, y, t)
        torch.testing.assert_close(out.double(), _scaled_tail(h64, s, y.double(), t),
                                   atol=1e-4, rtol=1e-4)
    out = cupyfuse.fused_linear(x, w, b, lambda h, d: h.softmax(d), -1)
    torch.testing.assert_close(out.double(), h64.softmax(-1), atol=1e-4, rtol=1e-4)
    with pytest.raises(TypeError, match="^fused_linear: extra\\[0\\] is a bool"):
        cupyfuse.fused_linear(x, w, b, lambda h, a: h * a, True)


@pytest.mark.parametrize("how,values", [
    ("mul", [np.float32(0.5), np.float64(2.5), np.int64(3), np.int32(-1), np.float16(1.5),
             np.uint8(2)]),
    ("leaky", [np.float32(0.1)]), ("pow", [np.int64(2), np.float32(0.5)]),
    ("clamp", [np.float32(1.5)]), ("dim", [np.int64(-1)])])
def test_numpy_scalars_as_forward_inputs(how, values):
    """NumPy scalars (np.float32(0.5), np.int64(3), ...) passed to the forward (not only
    np.float64, a float; no TypeError "must be a torch tensor ..."): torch reads them as
    the Python numbers of their values, and so does cupyfuse (both APIs, keyword inputs
    too), against a float64 reference."""
    m, *fused = _twins(how)
    x, y = torch.randn(4, 8) * 2, torch.randn(4, 6)
    m64 = _Scaled(how).double()
    m64.load_state_dict(m.state_dict())
    for fm in fused:
        for a in values:
            want = m64(x.double(), a, y.double())
            assert want.dtype == torch.float64
            torch.testing.assert_close(_run(fm, x, a, y).double(), want, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(_run(fm, x, y=y, a=a, c=np.float32(2.0)).double(),
                                       m64(x.double(), a, y.double(), np.float32(2.0)),
                                       atol=1e-4, rtol=1e-4)


def test_numpy_scalar_extras_and_refusals():
    """NumPy scalars among fused_linear's extras are numbers too; a 0-d NumPy array (torch
    reads it as a 0-d tensor) and a NumPy bool stay refused, with messages that say so."""
    torch.manual_seed(4)
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
    y = torch.randn(4, 6)
    h64 = x.double() @ w.double().t() + b.double()
    for s, t in [(np.float32(0.5), np.int64(1)), (np.float64(2.0), np.int16(-2))]:
        out = cupyfuse.fused_linear(x, w, b, _scaled_tail, s, y, t)
        torch.testing.assert_close(out.double(), _scaled_tail(h64, float(s), y.double(), int(t)),
                                   atol=1e-4, rtol=1e-4)
    with pytest.raises(TypeError, match=r"extra\[0\] is a 0-d NumPy array .* pass a Python "
                                        r"number"):
        cupyfuse.fused_linear(x, w, b, lambda h, a: h * a, np.array(2.0, dtype=np.float32))
    m, fm, twin = _twins("mul")
    for f in (fm, twin):
        with pytest.raises(TypeError, match=r"input 1 is a 0-d NumPy array .* pass a Python "
                                            r"number"):
            _run(f, torch.randn(4, 8), np.array(0.5, dtype=np.float32), torch.randn(4, 6))
        # a NumPy bool specialises the trace as the Python bool; arithmetic with a bool
        # is refused (torch reads it as 0 / 1: not taken here)
        with pytest.raises(TailError, match=r"cannot fuse `mul`: a boolean operand"):
            _run(f, torch.randn(4, 8), np.bool_(True), torch.randn(4, 6))


# --- inputs of another batch size than x -----------------------------------------------
class _PlusPos(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x, pos):
        return self.fc(x) + pos


@pytest.mark.parametrize("xs,ps", [((2, 3, 8), (1, 3, 6)), ((2, 3, 8), (1, 3, 1)),
                                   ((1, 3, 8), (2, 3, 6)), ((2, 3, 4, 8), (1, 3, 4, 6))])
def test_inputs_of_another_batch_size_than_x_with_leading_dims_are_refused(xs, ps):
    """A (1, seq, N) input broadcast against a (batch, seq, N) value (torch broadcasts
    it): its rows do not line up with x's batch * seq rows. Refused like a (seq, N) input
    (no crash in the CPU path), by from_model, fused_class and fused_linear, at every
    call (a program serves every batch size)."""
    torch.manual_seed(0)
    m = _PlusPos()
    x, pos = torch.randn(xs), torch.randn(ps)
    with torch.no_grad():
        m(x, pos)   # torch runs it
    twin = cupyfuse.fused_class(_PlusPos)()
    twin.load_state_dict(m.state_dict())
    for fm in (cupyfuse.from_model(m), twin):
        # the same shapes after the batch with equal batch sizes first: the program is found
        # again for the call that differs
        same = torch.randn((xs[0],) + ps[1:])
        torch.testing.assert_close(_run(fm, x, same), m(x, same).detach(), atol=1e-4, rtol=1e-4)
        with pytest.raises(TailError, match=re.escape(f"input 1 has shape {ps}") +
                           f".*x's batch size \\({xs[0]}\\)"):
            _run(fm, x, pos)
    w, b = m.fc.weight.detach(), m.fc.bias.detach()
    with pytest.raises(TailError, match=re.escape(f"input 1 has shape {ps}")):
        cupyfuse.fused_linear(x, w, b, lambda h, p: h + p, pos)
    with pytest.raises(TailError, match=re.escape(f"input 2 has shape {ps}")):
        cupyfuse.fused_linear(x, w, b, lambda h, s, p: h * s + p, 2.0, pos)


class _Defaults(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x, s: float = 3.0, y=None, verbose=False):
        return self.fc(x) * s


class _MiddleDefault(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x, y=None, s=1.0):
        return self.fc(x) * s


@pytest.mark.parametrize("shape", [(4, 8), (2, 3, 8)])
@pytest.mark.parametrize("api", ["from_model", "fused_class"])
def test_none_and_bool_defaults_left_off_stay_the_forwards(shape, api):
    """A forward with None / bool defaults its code never reads: fm(x) (not refused as
    "takes more tensor arguments") and fm(x, s=2.0) (no TypeError about an argument the
    caller never passed: a keyword call does not fill in every default) both fuse, like
    torch."""
    torch.manual_seed(1)
    m = _Defaults()
    fm = cupyfuse.from_model(m) if api == "from_model" else cupyfuse.fused_class(_Defaults)()
    if api == "fused_class":
        fm.load_state_dict(m.state_dict())
    x, y = torch.randn(shape), torch.randn(shape[:-1] + (6,))
    x64 = x.double()
    with torch.no_grad():
        for args, kw in [((x,), {}), ((x,), {"s": 2.0}), ((x, 2.0), {}), ((), {"x": x, "s": 0.5}),
                         ((x,), {"y": y}), ((x, 1.5, y), {})]:
            want = copy.deepcopy(m).double()(x64, *args[1:], **{k: v for k, v in kw.items() if k != "x"})
            torch.testing.assert_close(_run(fm, *args, **kw).double(), want, atol=1e-4, rtol=1e-4)
    # a None default before an argument passed by keyword (not refused as "left at its
    # default None while a later one is passed"): the trace is specialised on it
    mid = _MiddleDefault()
    twin = cupyfuse.fused_class(_MiddleDefault)()
    twin.load_state_dict(mid.state_dict())
    for fm in (cupyfuse.from_model(mid), twin):
        with torch.no_grad():
            for kw in ({"s": 2.0}, {}, {"s": -1.5, "y": None}):
                want = copy.deepcopy(mid).double()(x64, **kw)
                torch.testing.assert_close(_run(fm, x, **kw).double(), want, atol=1e-4, rtol=1e-4)


class _Optional(nn.Module):
    """A forward that tests its None / bool arguments (traced as fx inputs, `y is None`
    would be False and `if flag:` could not trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x, scale=None, flag=False, y=None, twice: bool = True):
        h = self.fc(x)
        if scale is not None:
            h = h * scale
        if flag:
            h = torch.relu(h)
        if y is not None:
            h = h + y
        return h * (2.0 if twice else 1.0) * (1.0 if y is None else 0.5)


@pytest.mark.parametrize("shape", [(4, 8), (2, 3, 8)])
@pytest.mark.parametrize("api", ["from_model", "fused_class"])
def test_none_and_bool_defaults_the_forward_tests_fuse(shape, api):
    """``forward(x, scale=None)`` called without scale, and a None/bool default left off
    before an argument passed by keyword (neither refused as "left at its default None,
    but the forward was traced with an input for it"): each call's trace is specialised on
    the None/bool values it leaves (torch.fx's concrete_args), one trace and program per
    pattern; an explicit None is the same as leaving it off. Against float64."""
    torch.manual_seed(2)
    m = _Optional()
    fm = cupyfuse.from_model(m) if api == "from_model" else cupyfuse.fused_class(_Optional)()
    if api == "fused_class":
        fm.load_state_dict(m.state_dict())
    x, y, s = torch.randn(shape), torch.randn(shape[:-1] + (6,)), torch.randn(shape[:-1] + (6,))
    m64 = copy.deepcopy(m).double()
    calls = [((), {}), ((s,), {}), ((None,), {}), ((), {"y": y}), ((s, None), {}),
             ((), {"scale": s, "y": y}), ((), {"y": None, "scale": s}), ((), {}),
             ((s,), {"y": y}), ((None,), {"y": y})]
    with torch.no_grad():
        for args, kw in calls:
            want = m64(x.double(), *[a.double() if isinstance(a, torch.Tensor) else a
                                     for a in args],
                       **{k: v.double() if isinstance(v, torch.Tensor) else v
                          for k, v in kw.items()})
            got = _run(fm, x, *args, **kw)
            torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    # a bool passed specialises the trace too (one program per pattern)
    with torch.no_grad():
        for args, kw in [((s, True), {}), ((), {"flag": True}), ((), {"y": y, "twice": False}),
                         ((s, False), {"y": y}), ((), {"flag": True, "twice": True})]:
            want = m64(x.double(), *[a.double() if isinstance(a, torch.Tensor) else a
                                     for a in args],
                       **{k: v.double() if isinstance(v, torch.Tensor) else v
                          for k, v in kw.items()})
            got = _run(fm, x, *args, **kw)
            torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


class _OptionalUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x, y=None):
        return self.fc(x) + y   # torch raises without y


def test_a_none_default_the_forward_computes_with_raises_like_torch():
    m = _OptionalUsed()
    x = torch.randn(4, 8)
    with pytest.raises(TypeError):
        m(x)
    with pytest.raises(TailError, match="`add`: an operand of type NoneType"):
        _run(cupyfuse.from_model(m), x)
    with torch.no_grad():
        y = torch.randn(4, 6)
        torch.testing.assert_close(_run(cupyfuse.from_model(m), x, y), m(x, y))


class _OneRow(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.fc = nn.Linear(32, 24)
        self.how = how

    def forward(self, x, y):
        h = self.fc(x)
        if self.how == "mul":
            return h * y
        if self.how == "sum":
            return h.sum(-1) / y.sum(-1)
        return torch.softmax(h + y, dim=-1)


_TAILS = {"mul": lambda h, y: h * y,
          "sum": lambda h, y: h.sum(-1) / y.sum(-1),
          "softmax": lambda h, y: torch.softmax(h + y, dim=-1)}


@pytest.mark.parametrize("how", ["mul", "sum", "softmax"])
@pytest.mark.parametrize("rows", [(7, 1), (1, 7)])
def test_one_row_inputs_broadcast_against_the_batch_cpu(how, rows):
    torch.manual_seed(8)
    m = _OneRow(how)
    fm = cupyfuse.from_model(m)
    x, y = torch.randn(rows[0], 32), torch.rand(rows[1], 24) + 0.5
    with torch.no_grad():
        want = m.double()(x.double(), y.double())
    m.float()
    w, b = m.fc.weight.detach(), m.fc.bias.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = fm(x, y)
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    got = cupyfuse.fused_linear(x, w, b, _TAILS[how], y)
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


class _NumberRaises(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.form = form

    def forward(self, x, a):
        h = self.fc(x)
        if self.form == "div0":
            return h * (1 / a)
        if self.form == "hardtanh":
            return F.hardtanh(h, -a, a)
        if self.form == "keepdim":
            return h.sum(-1, keepdim=a)
        if self.form == "unbiased":
            return h.std(-1, unbiased=a)
        if self.form == "overflow":
            return h * (a * a)
        return F.softshrink(h, a)


@pytest.mark.parametrize("form,a", [("div0", 0), ("div0", 0.0), ("hardtanh", -1.0),
                                    ("softshrink", -0.5), ("keepdim", 1), ("unbiased", 0),
                                    ("overflow", 2 ** 40)])
def test_numbers_torch_raises_on_are_refused(form, a):
    """Python numbers of the forward where eager raises (1 / 0, hardtanh with min > max,
    softshrink with a negative lambda, an int keepdim/unbiased, an int past int64):
    refused, not computed."""
    m = _NumberRaises(form)
    x = torch.randn(4, 8)
    with pytest.raises(Exception):
        m(x, a)
    with warnings.catch_warnings(), pytest.raises(cupyfuse.TailError, match="torch raises|Python raises"):
        warnings.simplefilter("ignore")
        cupyfuse.from_model(m)(x, a)
    with warnings.catch_warnings():   # a valid number still fuses
        warnings.simplefilter("ignore")
        good = {"div0": 2.0, "hardtanh": 1.0, "softshrink": 0.5, "overflow": 3}.get(form)
        if good is not None:   # (a bool input is refused by design: no good case there)
            with torch.no_grad():
                torch.testing.assert_close(cupyfuse.from_model(m)(x, good), m(x, good))


class _ReshapeMinusOne(nn.Module):
    def __init__(self, lead):
        super().__init__()
        self.fc = nn.Linear(8, 6)
        self.lead = lead

    def forward(self, x):
        h = self.fc(x)
        if self.lead:
            return h.reshape(x.shape[0], x.shape[1], -1).relu()
        return h.reshape(x.shape[0], -1).relu()


@pytest.mark.parametrize("lead", [True, False])
def test_empty_batch_reshape_with_minus_one_raises_like_torch(lead):
    """A -1 next to the batch size is ambiguous with 0 elements: torch raises, so do we
    (and a non-empty batch still fuses)."""
    m = _ReshapeMinusOne(lead)
    fm = cupyfuse.from_model(m)
    shape = (0, 3, 8) if lead else (0, 8)
    with pytest.raises(RuntimeError, match="ambiguous"):
        m(torch.randn(shape))
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="ambiguous"):
        warnings.simplefilter("ignore")
        fm(torch.randn(shape))
    x = torch.randn((2,) + shape[1:])
    with torch.no_grad():
        torch.testing.assert_close(fm(x), m(x))
