"""Common forms of the outside-written corpus (tests/corpus/outside/; tools/outside_survey.py
prints its table): forms people write that fuse, each against a float64 copy of the model
at atol = rtol = 1e-4 (NaN/inf rows included), on the CPU and (``gpu``) on the GPU; and
what stays refused, with a message that names the op and the forward's line.

1. An input flattened whole before its first Linear (``x.view(-1, 784)``,
   ``x.view(x.size(0), -1)``, ``x.flatten(1)``, ``nn.Flatten()`` of a (batch, C, H, W) or
   (batch, C, L) input): read as (batch, prod(dims)) rows (``Program.flat_inputs``);
   1b. a (batch, seq..., F) value viewed as (batch * seq..., F) rows (``h.view(-1, F)``,
   HF's GPT-2 Conv1D): Linears, elementwise ops and ops along F, a view back, or returned.
2. ``v, _ = torch.max(h, 1)``: max/min with a dim whose indices nothing reads.
3. ``h.select(1, k)`` of a (batch, seq, features) value: one position, as ``h[:, k]``.
4. Softmax without a dim: torch's legacy dim where it is a feature dim, refused where it is
   the batch.
5. Integer (int64/int32) inputs after x: read as float32 where every use is exact whatever
   the values; integer arithmetic, reductions, embedding lookups refused naming the input.
6. ``expand`` / ``expand_as`` / ``torch.broadcast_to``: a stride-0 gather along features;
   over the batch only where an elementwise op broadcasts it anyway.
7. A matrix parameter raised to a power in the tail: refused as what it is.
8. Refusals quote the forward's line: a module built in the forward, hooked submodules.

The kernels of these forms also run through tests/emu/cuda.py (expand) and compile with nvcc.
GPU tests (``gpu``: the ``[cuda]`` cases) run each form twice (the second call may take
prepared launches).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupyfuse
from cupyfuse import TailError
from helpers import quiet as _quiet, refs as _refs
from helpers import DEVICES
from gen.tails import assert_matches
from helpers import fused_copy, program_of
from helpers import examples

SETTINGS = settings(max_examples=examples(60), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
THIS = "test_common_forms.py"


def _check(model: nn.Module, inputs: tuple, device: str = "cpu", api: str = "from_model",
           calls: int = 2) -> None:
    """The fused model (from_model, or the fused_class twin) against float64 torch, on
    ``device``, ``calls`` times (the second call may take prepared launches)."""
    ref64, ref32 = _refs(model, inputs)
    if api == "from_model":
        fm = cupyfuse.from_model(copy.deepcopy(model).to(device))
    else:   # the drop-in class (same state), its forward traced at the first call
        fm = fused_copy(model).to(device)
    dev_in = tuple(t.to(device) for t in inputs)
    for _ in range(calls):
        out = _quiet(fm, *dev_in)
        assert_matches(out.cpu(), ref64, ref32.cpu(), what=f"{type(model).__name__} {device}")


def _refused(model: nn.Module, inputs: tuple, *needles: str) -> str:
    with pytest.raises(TailError) as ei:
        _quiet(cupyfuse.from_model(model), *inputs)
    msg = str(ei.value)
    assert f"{THIS}:" in msg, msg   # the forward's line
    for s in needles:
        assert s in msg, msg
    return msg


def _poison(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    flat = x.reshape(x.shape[0], -1)
    flat[0, 0] = float("nan")
    if x.shape[0] > 2:
        flat[1, -1] = float("inf")
        flat[2, 0] = -float("inf")
    return flat.reshape(x.shape)


# ======================================================================================
# 1. inputs flattened whole before the first Linear
# ======================================================================================
FLAT_FORMS = ["view_m1", "view_size0", "view_shape0", "view_size0_P", "reshape_size0",
              "torch_reshape", "flatten1", "torch_flatten", "flatten_kw", "nn_flatten",
              "contiguous_view", "view_tuple"]
VIEW_FORMS = ("view_m1", "view_size0", "view_shape0", "view_size0_P", "view_tuple")


class FlatNet(nn.Module):
    """MNIST-style: the input's dims after the batch flattened into the features, then
    Linear + tail (and a second Linear)."""

    def __init__(self, form: str, dims: tuple, n: int = 9, tail: str = "log_softmax"):
        super().__init__()
        self.form, self.tail, self.P = form, tail, 1
        for d in dims:
            self.P *= d
        self.fc1 = nn.Linear(self.P, n)
        self.fc2 = nn.Linear(n, 5)
        self.flat = nn.Flatten()

    def forward(self, x):
        f = self.form
        if f == "view_m1":
            h = x.view(-1, self.P)
        elif f == "view_size0":
            h = x.view(x.size(0), -1)
        elif f == "view_shape0":
            h = x.view(x.shape[0], -1)
        elif f == "view_size0_P":
            h = x.view(x.size(0), self.P)
        elif f == "reshape_size0":
            h = x.reshape(x.size(0), -1)
        elif f == "torch_reshape":
            h = torch.reshape(x, (x.shape[0], -1))
        elif f == "flatten1":
            h = x.flatten(1)
        elif f == "torch_flatten":
            h = torch.flatten(x, 1)
        elif f == "flatten_kw":
            h = x.flatten(start_dim=1)
        elif f == "nn_flatten":
            h = self.flat(x)
        elif f == "contiguous_view":
            h = x.contiguous().view(x.size(0), -1)
        else:
            h = x.view((-1, self.P))
        h = F.relu(self.fc1(h))
        h = self.fc2(h)
        if self.tail == "log_softmax":
            return F.log_softmax(h, dim=1)
        if self.tail == "layernorm":
            return F.layer_norm(h, (5,))
        return torch.sigmoid(h) * x.size(0) if self.tail == "batchsize" else h


@SETTINGS
@given(form=st.sampled_from(FLAT_FORMS),
       dims=st.lists(st.integers(1, 5), min_size=2, max_size=3).map(tuple),
       batch=st.sampled_from([1, 2, 3, 6]), tail=st.sampled_from(["log_softmax", "layernorm",
                                                                   "none"]),
       layout=st.sampled_from(["contiguous", "permuted", "batch_strided"]),
       poison=st.booleans(), seed=st.integers(0, 10 ** 6))
def test_flattened_inputs_match_float64(form, dims, batch, tail, layout, poison, seed):
    torch.manual_seed(seed)
    model = FlatNet(form, dims, tail=tail)
    x = torch.randn((batch,) + dims)
    if layout == "permuted":   # a non-contiguous input: copied (a view of it cannot be flat)
        x = torch.randn((batch,) + dims[::-1]).permute(0, *range(len(dims), 0, -1))
    elif layout == "batch_strided":   # rows further apart: still one view
        x = torch.randn((2 * batch,) + dims)[::2]
    if poison:
        x = _poison(x)
    if form in VIEW_FORMS and layout == "permuted" and not x.is_contiguous():
        try:
            x.view(x.shape[0], -1)
        except RuntimeError:   # torch's own view raises here: so must the fused model
            with pytest.raises(RuntimeError):
                _quiet(cupyfuse.from_model(model), x)
            return
    _check(model, (x,), calls=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", FLAT_FORMS)
def test_flattened_input_forms(device, form):
    torch.manual_seed(3)
    model = FlatNet(form, (1, 7, 7), n=45)
    _check(model, (_poison(torch.rand(5, 1, 7, 7)),), device)
    _check(model, (torch.rand(1, 1, 7, 7),), device)
    _check(model, (torch.rand(300, 1, 7, 7),), device)
    _check(model, (torch.rand(8, 1, 7, 7)[::2],), device)   # batch-strided: a view, no copy
    if form not in VIEW_FORMS:   # (.view raises on a transposed input, in torch too)
        _check(model, (torch.rand(4, 7, 7, 1).permute(0, 3, 2, 1),), device)   # transposed: copied


@pytest.mark.parametrize("device", DEVICES)
def test_flattened_input_empty_batch(device):
    """An empty batch: torch's view(x.size(0), -1) raises (the -1 is ambiguous), view(-1, P)
    and flatten(1) give (0, N)."""
    torch.manual_seed(0)
    x = torch.rand(0, 2, 3).to(device)
    with pytest.raises(RuntimeError, match="ambiguous"):
        _quiet(cupyfuse.from_model(FlatNet("view_size0", (2, 3)).to(device)), x)
    for form in ("view_m1", "flatten1", "nn_flatten"):
        out = _quiet(cupyfuse.from_model(FlatNet(form, (2, 3), tail="none").to(device)), x)
        assert out.shape == (0, 5)


class CNNHead(nn.Module):
    """A (batch, C, L) input flattened, with the batch size read for the view."""

    def __init__(self, c: int, length: int):
        super().__init__()
        self.fc = nn.Linear(c * length, 12)
        self.out = nn.Linear(12, 3)

    def forward(self, x):
        b = x.size(0)
        h = x.view(b, -1)
        return self.out(F.gelu(self.fc(h))).softmax(dim=-1)


@pytest.mark.parametrize("device", DEVICES)
def test_flattened_cnn_head(device):
    torch.manual_seed(1)
    _check(CNNHead(4, 6), (_poison(torch.randn(7, 4, 6)),), device)
    _check(CNNHead(4, 6), (torch.randn(1, 4, 6),), device)


def test_flattened_inputs_fused_class():
    torch.manual_seed(2)
    _check(FlatNet("view_m1", (1, 7, 7), n=45), (torch.rand(5, 1, 7, 7),), api="fused_class")
    _check(CNNHead(3, 5), (torch.randn(4, 3, 5),), api="fused_class")


class FlatPlusOther(nn.Module):
    """The input flattened, and read otherwise too: no (batch, P) reading."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.fc = nn.Linear(12, 6)

    def forward(self, x):
        h = self.fc(x.view(x.size(0), -1))
        if self.how == "sum":
            return h + x.sum(dim=(1, 2)).unsqueeze(1)
        if self.how == "size1":
            return h * x.size(1)
        return self.fc(x.reshape(-1, 12))   # "partial": x.view(-1, 12) of (B, 2, 3, 2)


def test_partly_flattened_inputs_stay_refused():
    _refused(FlatPlusOther("sum"), (torch.randn(3, 3, 4),), "flatten")
    _refused(FlatPlusOther("size1"), (torch.randn(3, 3, 4),), "flatten")


class MergesBatch(nn.Module):
    """x.view(-1, 7) of a (batch, 7, 7) input: the batch merged with the rows of 7."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(7, 4)

    def forward(self, x):
        return self.fc(x.view(-1, 7)).sum(-1, keepdim=True)


def test_view_that_merges_the_batch_is_not_a_flat_reading():
    m = MergesBatch()
    x = torch.randn(3, 7, 7)
    fm = cupyfuse.from_model(m)
    try:
        out = _quiet(fm, x)
    except TailError as e:
        assert f"{THIS}:" in str(e)
        return
    ref64, ref32 = _refs(m, (x,))
    assert_matches(out, ref64, ref32)


# --------------------------------------------------------------------------------------
# 1b. (batch, seq..., F) values viewed as (batch * seq..., F) rows: h.view(-1, F)
# --------------------------------------------------------------------------------------
class Conv1D(nn.Module):
    """HF's GPT-2 Conv1D: a weight stored (in, out), addmm on a (batch * seq, in) view."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class RowsNet(nn.Module):
    def __init__(self, form: str, d: int = 8, n: int = 12):
        super().__init__()
        self.form = form
        self.c_fc, self.c_proj = Conv1D(n, d), Conv1D(d, n)
        self.fc, self.fc2 = nn.Linear(d, n), nn.Linear(n, 5)
        self.ln = nn.LayerNorm(n)
        self.s = nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x):
        f = self.form
        if f == "gpt2_mlp":
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")) + x
        if f == "view_back":
            h = x.view(-1, x.size(-1))
            h = self.fc2(torch.relu(self.fc(h) * self.s))
            return h.view(x.size(0), x.size(1), -1)
        if f == "returned":   # token logits flattened for a loss: (batch * seq, 5)
            return self.fc2(F.gelu(self.fc(x.reshape(-1, x.shape[-1]))))
        if f == "flatten":
            return self.fc2(self.ln(self.fc(x.flatten(0, -2)))).log_softmax(dim=-1)
        if f == "along":
            h = self.fc(x.contiguous().view(-1, x.shape[-1]))
            a = F.softmax(h, dim=1) + F.normalize(h, dim=-1) - h.amax(1, keepdim=True)
            return (a + F.layer_norm(h, (h.shape[-1],))).sum(-1)   # (batch * seq,)
        if f == "split_back":
            h = self.fc(x.view(-1, x.size(-1)))
            return h.view(x.size(0), x.size(1), 3, 4).sum(-1)
        # refused
        if f == "over_rows":
            return self.fc(x.view(-1, x.size(-1))).sum(0)
        if f == "with_seq_value":   # (seq, n) + (1, seq, n): torch pairs the rows with seq
            return self.fc(x.view(-1, x.size(-1))) + self.fc(x)
        if f == "row_count":
            h = self.fc(x.view(-1, x.size(-1)))
            return h * h.shape[0]
        return self.fc(x.view(-1, x.size(-1)))[0]   # "index_row"


ROW_FORMS = ["gpt2_mlp", "view_back", "returned", "flatten", "along", "split_back"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ROW_FORMS)
def test_rows_views(device, form):
    torch.manual_seed(11)
    m = RowsNet(form)
    for shape in ((5, 7, 8), (1, 3, 8), (2, 1, 8)):
        _check(m, (_poison(torch.randn(*shape)),), device)


def test_rows_views_of_several_leading_dims():
    torch.manual_seed(12)
    for form in ("gpt2_mlp", "returned"):
        _check(RowsNet(form), (torch.randn(3, 2, 4, 8),))


@SETTINGS
@given(form=st.sampled_from(ROW_FORMS), batch=st.integers(1, 5), seq=st.integers(1, 6),
       seed=st.integers(0, 10 ** 6))
def test_rows_views_match_float64(form, batch, seq, seed):
    torch.manual_seed(seed)
    _check(RowsNet(form), (torch.randn(batch, seq, 8) * 2,), calls=1)


def test_rows_views_fused_class():
    torch.manual_seed(13)
    _check(RowsNet("gpt2_mlp"), (torch.randn(4, 5, 8),), api="fused_class")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tail", [lambda h: h.view(-1, 6),
                                  lambda h: F.softmax(h.reshape(-1, h.shape[-1]), -1),
                                  lambda h: h.flatten(0, 1).sum(1)])
def test_rows_views_in_tail_functions(device, tail):
    torch.manual_seed(14)
    x, w, b = _poison(torch.randn(3, 4, 8)), torch.randn(6, 8), torch.randn(6)
    want = tail(x.double() @ w.double().t() + b.double())
    want32 = tail(x @ w.t() + b)
    for _ in range(2):
        out = cupyfuse.fused_linear(x.to(device), w.to(device), b.to(device), tail)
        assert_matches(out.cpu(), want, want32)


@pytest.mark.parametrize("form, why", [
    ("over_rows", "dim 0"),
    ("with_seq_value", "a value of (batch, seq, 12)"),
    ("row_count", "row count"),
    ("index_row", "an op on a (batch * seq..., F) view"),
])
def test_rows_view_refusals(form, why):
    x = torch.randn(1 if form == "with_seq_value" else 3, 4, 8)
    _quiet(RowsNet(form), x)   # torch computes it
    _refused(RowsNet(form), (x,), why)


# ======================================================================================
# 2. max/min with a dim whose indices nothing reads
# ======================================================================================
class UnusedIndices(nn.Module):
    def __init__(self, form: str, k: int = 10, n: int = 12):
        super().__init__()
        self.form = form
        self.fc = nn.Linear(k, n)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        f = self.form
        if f == "max_feat":
            v, _ = torch.max(h, 1, keepdim=True)
            return h - v
        if f == "min_method":
            v, i = h.min(dim=-1)
            return v
        if f == "maxout":   # Maxout: groups of 2 features
            m, i = h.view(-1, 6, 2).max(dim=2)
            return self.out(m)
        if f == "seq_max":   # max over time of a (batch, seq, features) value
            pooled, _ = torch.max(h, dim=1)
            return pooled
        if f == "seq_min_kw":
            m, _ = h.min(dim=1, keepdim=True)
            return m.squeeze(1)
        v, i = torch.max(h, 1)   # "used": the indices read
        if f == "used_float":   # (converts: .float() of the positions)
            return v + i.float()
        return v + i   # (arithmetic on the int64 positions: refused)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["max_feat", "min_method", "maxout", "seq_max",
                                  "seq_min_kw"])
def test_max_min_with_unused_indices(device, form):
    torch.manual_seed(4)
    m = UnusedIndices(form)
    shape = (5, 7, 10) if form.startswith("seq") else (5, 10)
    _check(m, (_poison(torch.randn(*shape)),), device)
    _check(m, (torch.randn((1,) + shape[1:]),), device)


def test_max_indices_read_stay_refused():
    _refused(UnusedIndices("used"), (torch.randn(4, 10),), "uses the positions argmax/argmin",
             "return v + i")


def test_max_indices_read_as_float_convert():
    """``.float()`` of max's indices: a float32 value of the positions (tests/frontend/test_argmax.py
    for the positions themselves). The Linear's outputs on a grid of eighths, at most 5
    in size (their tanh distinct in float32): exact on every path, so no near-tie can
    move the position."""
    g = torch.Generator().manual_seed(3)
    m = UnusedIndices("used_float")
    with torch.no_grad():
        m.fc.weight.copy_(torch.randint(-2, 3, m.fc.weight.shape, generator=g) / 8.0)
        m.fc.bias.zero_()
    _check(m, (torch.randint(-2, 3, (4, 10), generator=g).float(),))


# ======================================================================================
# 3. select along the sequence dim (h[:, i])
# ======================================================================================
class SelectToken(nn.Module):
    def __init__(self, form: str, d: int = 9, n: int = 4):
        super().__init__()
        self.form = form
        self.drop = nn.Dropout(0.1)
        self.fc = nn.Linear(d, n)

    def forward(self, hidden):
        f = self.form
        if f == "first":
            cls = hidden.select(1, 0)
        elif f == "last":
            cls = hidden.select(1, -1)
        elif f == "torch_select":
            cls = torch.select(hidden, 1, 2)
        elif f == "neg_dim":
            cls = hidden.select(-2, 1)
        elif f == "after_linear":   # pick a token of the Linear's output
            return torch.relu(self.fc(hidden)).select(1, 3)
        else:
            cls = hidden.select(1, 99)
        return self.fc(self.drop(cls))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["first", "last", "torch_select", "neg_dim", "after_linear"])
def test_select_along_the_sequence(device, form):
    torch.manual_seed(5)
    m = SelectToken(form).eval()
    _check(m, (_poison(torch.randn(5, 6, 9)),), device)
    _check(m, (torch.randn(1, 4, 9),), device)


def test_select_out_of_range_is_refused():
    _refused(SelectToken("range").eval(), (torch.randn(2, 6, 9),), "out of range")


# ======================================================================================
# 4. softmax without a dim (torch's legacy choice: 0 for 0-, 1-, 3-dim values, else 1)
# ======================================================================================
class LegacySoftmaxes(nn.Module):
    def __init__(self, form: str, k: int = 8, n: int = 12):
        super().__init__()
        self.form = form
        self.fc = nn.Linear(k, n)
        self.sm, self.lsm, self.smin = nn.Softmax(), nn.LogSoftmax(), nn.Softmin()

    def forward(self, x):
        h = self.fc(x)
        f = self.form
        if f == "F.softmax":
            return F.softmax(h)
        if f == "F.log_softmax":
            return F.log_softmax(h) + F.softmin(h)
        if f == "modules":
            return self.sm(h) + self.lsm(h) * self.smin(h)
        if f == "split4d":   # (batch, 2, 3, 2): dim 1, over the heads
            return F.softmax(h.view(-1, 2, 3, 2)).flatten(1)
        if f == "split3d":   # (batch, 3, 4): dim 0, the batch
            return F.softmax(h.view(-1, 3, 4)).flatten(1)
        if f == "row":   # (batch,): dim 0
            return F.softmax(h.sum(1)).unsqueeze(1)
        return self.sm(h.unsqueeze(1)).squeeze(1)   # "3d_module"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["F.softmax", "F.log_softmax", "modules", "split4d"])
def test_softmax_without_dim(device, form):
    torch.manual_seed(6)
    m = LegacySoftmaxes(form)
    _check(m, (_poison(torch.randn(5, 8)),), device)
    _check(m, (torch.randn(1, 8),), device)


@pytest.mark.parametrize("form, line", [("split3d", "F.softmax(h.view(-1, 3, 4))"),
                                        ("row", "F.softmax(h.sum(1))"),
                                        ("3d_module", "self.sm(h.unsqueeze(1))")])
def test_softmax_without_dim_over_the_batch_is_refused(form, line):
    _refused(LegacySoftmaxes(form), (torch.randn(3, 8),), "without an explicit dim",
             "the batch", line)


class LegacySeq(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        return F.softmax(self.fc(x))


def test_softmax_without_dim_of_a_sequence_is_refused():
    """(batch, seq, features): torch's legacy dim is 0, the batch."""
    _refused(LegacySeq(), (torch.randn(3, 4, 8),), "dim 0", "F.softmax(self.fc(x))")


# ======================================================================================
# 7. a matrix parameter in the tail: the message says so
# ======================================================================================
class RBF(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.embed = nn.Linear(9, 6)
        self.centres = nn.Parameter(torch.randn(5, 6))
        self.s = nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x):
        z = self.embed(x)
        if self.form == "matrix":
            d2 = (z ** 2).sum(1, keepdim=True) - 2 * z @ self.centres.t() + \
                (self.centres ** 2).sum(1)
            return torch.exp(-0.5 * d2)
        if self.form == "vector":   # a (6,) parameter squared: fused
            return z * self.s ** 2 + torch.pow(self.s, 0.5)
        if self.form == "in tail":   # the squared matrix itself in the tail: refused
            return z.unsqueeze(-1) * self.centres.t() ** 2
        return 2.0 ** z


def test_matrix_parameter_power_message():
    msg = _refused(RBF("in tail"), (torch.randn(3, 9),), "uses a matrix parameter outside a "
                   "matmul", "z.unsqueeze(-1) * self.centres.t() ** 2")
    assert "a number raised to a tensor power" not in msg
    _refused(RBF("number"), (torch.randn(3, 9),), "a number raised to a tensor power")


@pytest.mark.parametrize("device", DEVICES)
def test_matrix_parameter_reduced_in_the_tail(device):
    """The centres' squared norms (a tensor computed from the matrix alone) are a derived
    source the tail reads: the RBF head converts."""
    torch.manual_seed(5)
    _check(RBF("matrix"), (_poison(torch.randn(4, 9)),), device)


@pytest.mark.parametrize("device", DEVICES)
def test_vector_parameter_power(device):
    torch.manual_seed(7)
    _check(RBF("vector"), (_poison(torch.randn(4, 9)),), device)


# ======================================================================================
# 8. refusals name the forward's line: a module built in the forward, hooked submodules
# ======================================================================================
class ReLUInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        h = self.fc(x)
        h = nn.ReLU()(h)
        return h


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        h = self.body(x)
        return self.head(h)


def test_module_built_in_forward_names_its_line():
    _refused(ReLUInForward(), (torch.randn(2, 6),), "nn.ReLU()(h)", "not a submodule")


@pytest.mark.parametrize("api", ["from_model", "fused_class"])
@pytest.mark.parametrize("which, line", [("head", "return self.head(h)"),
                                         ("body.2", "h = self.body(x)"),
                                         ("body", "h = self.body(x)")])
def test_hooked_submodule_refusal_names_its_line(api, which, line):
    m = Hooked()
    m.get_submodule(which).register_forward_pre_hook(lambda mod, args: None)
    fm = cupyfuse.from_model(m) if api == "from_model" else fused_copy(m)
    with pytest.raises(TailError) as ei:
        _quiet(fm, torch.randn(2, 6))
    msg = str(ei.value)
    assert f"submodule `{which}`" in msg and "hook" in msg, msg
    assert f"{THIS}:" in msg and line in msg, msg


def test_old_weight_norm_refusal_names_its_line():
    m = Hooked()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m.head = nn.utils.weight_norm(nn.Linear(3, 2))
    _refused(m, (torch.randn(2, 6),), "submodule `head`", "return self.head(h)")


# ======================================================================================
# 5. integer inputs after x (attention masks): read as float32 where every use is exact
# ======================================================================================
class IntMasked(nn.Module):
    """Uses of a tokenizer's (batch, seq) attention mask (int64 / int32) as people write
    them."""

    def __init__(self, form: str, d: int = 10, n: int = 12):
        super().__init__()
        self.form = form
        self.proj = nn.Linear(d, n)
        self.score = nn.Linear(n, 1)
        self.emb = nn.Embedding(50, n)

    def forward(self, x, mask):
        h = torch.tanh(self.proj(x))
        f = self.form
        if f == "mul":
            return (h * mask.unsqueeze(-1)).sum(1) / mask.unsqueeze(-1).float().sum(1)
        if f == "mean_pooling":
            e = mask.unsqueeze(-1).expand(h.size()).float()
            return torch.sum(h * e, 1) / torch.clamp(e.sum(1), min=1e-9)
        if f == "attention":
            w = self.score(h).squeeze(-1).masked_fill(mask == 0, float("-inf"))
            return torch.bmm(torch.softmax(w, dim=-1).unsqueeze(1), h).squeeze(1)
        if f == "casts":
            return (h * mask.to(h.dtype).unsqueeze(-1) + h * mask.unsqueeze(-1).type_as(h)
                    ).amax(1)
        if f == "bool":
            return h.masked_fill(~mask.bool().unsqueeze(-1), -1e4).amax(1)
        if f == "extended":   # HF: (1.0 - mask) * large negative, added to scores
            s = self.score(h).squeeze(-1) + (1.0 - mask.float()) * -1e4
            return torch.softmax(s, dim=1)
        if f == "compare":
            return h * (mask > 0).unsqueeze(-1) + h * (mask != 1).float().unsqueeze(-1) * 0.5
        if f == "float_math":   # int64 * float number, torch.where with a float branch
            return h * (mask * 0.5).unsqueeze(-1) + torch.where(mask.unsqueeze(-1) > 0, h, 2.0)
        # refused
        if f == "sum":
            return h.sum(1) / mask.sum(1, keepdim=True)
        if f == "int_mul":
            return h * (mask * 2).unsqueeze(-1)
        if f == "rsub":
            return h * (1 - mask).unsqueeze(-1)
        if f == "big_compare":
            return h * (mask == 16777217).unsqueeze(-1)
        if f == "embedding":
            return h + self.emb(mask)
        return h, mask   # "returned"


INT_FORMS = ["mul", "mean_pooling", "attention", "casts", "bool", "extended", "compare",
             "float_math"]


def _int_mask(batch: int, seq: int, dtype=torch.int64, big: bool = False) -> torch.Tensor:
    m = _mask(batch, seq).to(dtype)
    if big:   # values float32 cannot hold exactly: torch rounds them the same way
        m = m * (2 ** 30 + 1)
    return m


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("form", INT_FORMS)
def test_integer_mask_inputs(device, dtype, form):
    torch.manual_seed(10)
    m = IntMasked(form)
    for batch in (5, 1):
        _check(m, (_poison(torch.randn(batch, 6, 10)), _int_mask(batch, 6, dtype)), device)


@SETTINGS
@given(form=st.sampled_from(INT_FORMS), batch=st.integers(1, 5), seq=st.integers(1, 7),
       dtype=st.sampled_from([torch.int64, torch.int32]), big=st.booleans(),
       seed=st.integers(0, 10 ** 6))
def test_integer_mask_inputs_match_float64(form, batch, seq, dtype, big, seed):
    torch.manual_seed(seed)
    if big and form in ("attention", "bool", "compare", "float_math", "extended"):
        big = False   # (masks of 0/1 there: large values change nothing but the scale)
    _check(IntMasked(form), (torch.randn(batch, seq, 10) * 3, _int_mask(batch, seq, dtype, big)),
           calls=1)


@pytest.mark.parametrize("form, why", [
    ("sum", "a reduction, lookup or other op that torch computes in integers"),
    ("int_mul", "integer arithmetic"),
    ("rsub", "integer arithmetic"),
    ("big_compare", "a comparison with the integer 16777217"),
    ("embedding", "token ids (the integer input `mask`) looked up in an embedding"),
    ("returned", "returns the integer input `mask`"),
])
def test_integer_input_refusals(form, why):
    msg = _refused(IntMasked(form), (torch.randn(3, 6, 10), _int_mask(3, 6)), why)
    if form not in ("embedding", "returned"):
        assert "`mask`" in msg and "mask.float()" in msg, msg


class TokenIds(nn.Module):
    def __init__(self, bag: bool):
        super().__init__()
        self.emb = nn.EmbeddingBag(30, 8, mode="mean") if bag else nn.Embedding(30, 8)
        self.fc = nn.Linear(8, 3)

    def forward(self, text, offsets=None):
        if offsets is None:
            return self.fc(self.emb(text).mean(1))
        return self.fc(self.emb(text, offsets))


def test_token_ids_into_an_embedding_are_refused():
    """x of token ids looked up in an embedding (fastText, a bag of embeddings): a TailError
    naming the lookup and its line; an integer x into a Linear stays a TypeError (torch
    raises there too)."""
    _refused(TokenIds(True), (torch.randint(0, 30, (12,)), torch.arange(0, 12, 3)),
             "emb (EmbeddingBag)", "token ids", "self.emb(text, offsets)")
    _refused(TokenIds(False), (torch.randint(0, 30, (4, 5)),), "emb (Embedding)")
    with pytest.raises(TypeError, match="input 0 must be float32"):
        _quiet(cupyfuse.from_model(nn.Sequential(nn.Linear(4, 2))), torch.ones(3, 4).long())


# ======================================================================================
# 6. expand: a broadcast (no data)
# ======================================================================================
class Expanded(nn.Module):
    """Expands of masks, statistics and parameters, as people write them."""

    def __init__(self, form: str, d: int = 10, n: int = 12):
        super().__init__()
        self.form = form
        self.fc = nn.Linear(d, n)
        self.temperature = nn.Parameter(torch.ones(1) * 1.5)
        self.p = nn.Parameter(torch.randn(n))

    def forward(self, x, m=None):
        h = self.fc(x)
        f = self.form
        if f == "mask_size":   # h (batch, seq, n), m (batch, seq)
            return h * m.unsqueeze(-1).expand(h.size())
        if f == "mask_as":
            return (h * m.unsqueeze(-1).expand_as(h)).sum(1)
        if f == "mask_m1":
            return h * m.unsqueeze(-1).expand(-1, -1, h.shape[-1])
        if f == "mean_pooling":   # the Kaggle / sentence-transformers MeanPooling
            e = m.unsqueeze(-1).expand(h.size()).float()
            s = torch.sum(h * e, 1)
            return s / torch.clamp(e.sum(1), min=1e-9)
        if f == "bool_mask":
            return h.masked_fill((m > 0.5).unsqueeze(-1).expand_as(h), -1.0).amax(1)
        if f == "broadcast_to":
            return torch.broadcast_to(h.sum(-1, keepdim=True), h.shape) - h
        if f == "row_stat":   # (batch, 1) -> (batch, n), then a reduction of it
            return h.amax(1, keepdim=True).expand(-1, h.size(1)).sum(1, keepdim=True) + h
        if f == "temperature":   # gpleiss/temperature_scaling
            t = self.temperature.unsqueeze(1).expand(h.size(0), h.size(1))
            return h / t
        if f == "param_chain":   # expanded over the batch, through an op, then broadcast
            t = self.p.unsqueeze(0).expand(x.size(0), -1) * 2.0
            return torch.relu(t) + h
        if f == "heads":   # a per-head statistic spread over its features
            v = h.view(-1, 3, 4)
            s = v.sum(-1, keepdim=True).expand(-1, -1, 4)
            return (v - s).flatten(1)
        if f == "heads_as":
            v = h.view(-1, 3, 4)
            return (v * v.amax(1, keepdim=True).expand_as(v)).flatten(1)
        if f == "new_heads":   # (batch, 1, n) -> (batch, 3, n), summed over the copies
            return h.unsqueeze(1).expand(-1, 3, -1).sum(1)
        if f == "read_by_sum":   # refused: an expand over the batch read by a reduction
            return h * self.p.unsqueeze(0).expand(h.shape[0], -1).sum(1, keepdim=True)
        if f == "returned":   # refused: returned expanded over the batch
            return h, self.p.unsqueeze(0).expand(h.shape[0], -1)
        if f == "fixed_batch":
            return h * h.sum(1, keepdim=True).expand(4, -1)
        return h.expand(-1, 3, -1)   # "mismatch": (batch, n) to (batch, 3, n)? torch raises


SEQ_EXPANDS = ["mask_size", "mask_as", "mask_m1", "mean_pooling", "bool_mask"]
ROW_EXPANDS = ["broadcast_to", "row_stat", "temperature", "param_chain", "heads", "heads_as",
               "new_heads"]


def _mask(batch: int, seq: int) -> torch.Tensor:
    lens = torch.randint(1, seq + 1, (batch,))
    return (torch.arange(seq)[None, :] < lens[:, None]).float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", SEQ_EXPANDS + ROW_EXPANDS)
def test_expand(device, form):
    torch.manual_seed(8)
    m = Expanded(form)
    for batch in (5, 1):
        if form in SEQ_EXPANDS:
            x = torch.randn(batch, 6, 10)
            inputs = (_poison(x), _mask(batch, 6))
        else:
            inputs = (_poison(torch.randn(batch, 10)),)
        _check(m, inputs, device)


@SETTINGS
@given(form=st.sampled_from(SEQ_EXPANDS), batch=st.integers(1, 5), seq=st.integers(1, 7),
       seed=st.integers(0, 10 ** 6))
def test_expand_of_masks_match_float64(form, batch, seq, seed):
    torch.manual_seed(seed)
    _check(Expanded(form), (torch.randn(batch, seq, 10) * 3, _mask(batch, seq)), calls=1)


@pytest.mark.parametrize("form, why, line", [
    ("read_by_sum", "broadcasts it anyway", ".expand(h.shape[0], -1).sum(1, keepdim=True)"),
    ("returned", "returns a value expanded", "return h, self.p.unsqueeze(0)"),
    ("fixed_batch", "the batch varies", ".expand(4, -1)"),
])
def test_expand_refusals(form, why, line):
    _refused(Expanded(form), (torch.randn(4, 10),), why, line)


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="g++ is not on PATH")
def test_expand_kernels_emulated_on_the_cpu(tmp_path_factory):
    """The generated kernels of the expand forms (a one-feature value spread over the
    features is a stride-0 ``remap``) run through tests/emu/cuda.py's thread emulation of
    CUDA: the CPU path's values."""
    from emu import cuda as _cuda_emu
    from cupyfuse.backend.cpu import run_cpu
    from cupyfuse.runner import _resolve

    cases = []
    for form in ["mask_size", "mask_m1", "broadcast_to", "row_stat", "temperature",
                 "param_chain", "heads", "heads_as", "new_heads"]:
        torch.manual_seed(9)
        model = Expanded(form)
        if form.startswith("mask"):
            x, m = _poison(torch.randn(3, 5, 10)), _mask(3, 5)
            prog = program_of(model, x, m)
            ins = [x.reshape(-1, 1, 10), m.reshape(-1, 1)]
        else:
            x = _poison(torch.randn(3, 10))
            prog = program_of(model, x)
            ins = [x]
        assert any(n.kind == "remap" for n in prog.nodes) or form in (
            "temperature", "param_chain"), (form, prog.describe())
        srcs = [_resolve(model, s).detach() if isinstance(s, str) else s for s in prog.sources]
        cases.append((form, prog, ins, srcs))
    kernels = _cuda_emu.build_or_skip([c[1] for c in cases], tmp_path_factory.mktemp("emu"))
    for form, prog, ins, srcs in cases:
        with torch.no_grad():
            want = run_cpu(prog.unrewritten or prog, ins, srcs)
            got = _cuda_emu.run_program(prog, ins, srcs, kernels)
        assert got.shape == want.shape, form
        assert torch.equal(torch.isnan(got), torch.isnan(want)), form
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{form}: {m}")


# ======================================================================================
# the generated kernels of these forms compile with nvcc (sm_90a) without spills
# ======================================================================================
@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc is not on PATH")
def test_new_forms_compile_with_nvcc(tmp_path):
    import re
    import subprocess

    from cupyfuse.backend import codegen, runtime

    torch.manual_seed(15)
    progs = [("flat", program_of(FlatNet("view_size0", (1, 7, 7), n=45),
        torch.rand(4, 1, 7, 7)))]
    progs += [(f"rows_{f}", program_of(RowsNet(f), torch.randn(4, 5, 8)))
              for f in ("gpt2_mlp", "along", "returned")]
    progs += [(f"expand_{f}", program_of(Expanded(f), torch.randn(4, 10)))
              for f in ROW_EXPANDS]
    progs += [(f"expand_{f}", program_of(Expanded(f), torch.randn(4, 6, 10),
                                                              _mask(4, 6)))
              for f in ("mask_size", "mask_m1")]
    progs += [(f"int_{f}", program_of(IntMasked(f), torch.randn(4, 6, 10),
                                                            _int_mask(4, 6)))
              for f in ("mul", "compare", "bool", "float_math")]
    bodies: dict[str, str] = {}
    for _, prog in progs:
        for lv in codegen.plan(prog).levels:
            if lv.kernel:
                bodies.setdefault(lv.name, lv.kernel.split("\n", 1)[1])
    assert bodies
    src = tmp_path / "new_forms.cu"
    src.write_text(runtime.expand_source("tail_ops.cuh") + "\n" + "\n".join(bodies.values()))
    r = subprocess.run(["nvcc", "-cubin", "-o", str(tmp_path / "new_forms.cubin"),
                        "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                        str(src)], capture_output=True, text=True, timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    entries = set(re.findall(r"Compiling entry function '(\w+)'", log))
    assert set(bodies) <= entries, set(bodies) - entries
    for name, stores in re.findall(r"Function properties for (\w+)\s*\n\s*\d+ bytes stack "
                                   r"frame, (\d+) bytes spill stores", log):
        assert int(stores) == 0, f"{name} spills {stores} bytes"
