"""Forms of the outside corpus in cupyfuse's tail vocabulary (stack, norms of any order,
made tensors, distances, tensor exponents, window pooling, cumsum, one-hot scatters), each
against a float64 copy of the model at atol = rtol = 1e-4 (odd sizes, batch 1, NaN/inf
rows), on the CPU and (``gpu``: the ``[cuda]`` cases) on the GPU; and what stays refused,
with a message that names the op and the forward's line.

1. ``torch.stack(values, dim)``: after the batch a value with split features (the
   values' cat, a ``remap`` where the new dim is not the outermost feature dim); before
   the batch (dim 0) a stack that reductions over that dim and indexing take apart.
   1b. Vector norms of any order p (0: the count of nonzero elements, +-inf, and torch's
   (sum |v|^p)^(1/p)).
2. Tensors the forward makes: ``torch.zeros/ones/full`` and ``new_zeros/new_ones/new_full``
   of a fixed shape (a number, or an ``iota`` node: a constant along the features) or of
   a shape read from a value (``h.size(0)``: that value's rows), ``torch.arange`` of
   numbers, and Python's ``math`` functions of numbers and sizes (``math.log(h.shape[1])``).
3. ``F.cosine_similarity`` / ``nn.CosineSimilarity`` and ``F.pairwise_distance`` /
   ``nn.PairwiseDistance`` as torch's ATen computes them (each operand over its 2-norm
   clamped at eps, then the sum of products; ``norm(x1 - x2 + eps, p)`` over the last dim).
4. A tensor exponent (``x.pow(self.p)`` with a (1,), () or per-feature parameter or buffer:
   GeM pooling): torch's pow of two tensors.
5. 1-D pooling by torch's window rules (padding, ceil_mode, dilation, count_include_pad,
   adaptive windows of unequal sizes): the ``wpool`` node, of plain and (batch, C, L)
   values.
6. ``torch.cumsum`` / ``.cumsum`` along a feature dim: the ``scan`` node (chunks of 32 in
   order, sums in double; staged in shared memory or recomputed where read).
7. ArcFace's one-hot: ``torch.zeros(...).scatter_(1, labels.view(-1, 1).long(), 1)`` (a
   number scattered at integer labels: an ``iota`` compared with them; an index out of
   range makes its row NaN, where torch raises), in-place ops on a tensor the forward
   made (its out-of-place value from then on), integer casts of an integer input.

The generated kernels of these forms run through tests/emu/cuda.py's CPU emulation of
CUDA and compile with nvcc for sm_90a without spills (end of the file). The generated
tails of tests/gen/tails.py draw these ops too (tests/frontend/test_tails.py's property
tests).
"""
from __future__ import annotations

import copy
import math
import shutil
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

SETTINGS = settings(max_examples=examples(60), deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
THIS = "test_outside_forms.py"


def _check(model: nn.Module, inputs: tuple, device: str = "cpu", api: str = "from_model",
           calls: int = 2) -> None:
    """The fused model (from_model, or the fused_class twin) against float64 torch, on
    ``device``, ``calls`` times (the second call may take prepared launches)."""
    ref64, ref32 = _refs(model, inputs)
    if api == "from_model":
        fm = cupyfuse.from_model(copy.deepcopy(model).to(device))
    else:
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
    """NaN, +inf and -inf in rows 0, 1 and 2 (where the batch has them)."""
    x = x.clone()
    flat = x.reshape(x.shape[0], -1)
    flat[0, 0] = float("nan")
    if x.shape[0] > 2:
        flat[1, -1] = float("inf")
        flat[2, 0] = -float("inf")
    return flat.reshape(x.shape)


# emulated kernels and nvcc: (name, model, inputs) of every section, collected below
KERNEL_CASES: list = []


# ======================================================================================
# 1. torch.stack
# ======================================================================================
class Stacked(nn.Module):
    """Two (or three) heads of one input stacked along a new dim, then used."""

    def __init__(self, form: str, k: int = 7, n: int = 5) -> None:
        super().__init__()
        self.form = form
        self.a = nn.Linear(k, n)
        self.b = nn.Linear(k, n)
        self.p = nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.a(x), torch.tanh(self.b(x))
        f = self.form
        if f == "dim1":
            return torch.stack([a, b], dim=1)                          # (batch, 2, n)
        if f == "dim_last":
            return torch.stack([a, b], dim=-1)                         # (batch, n, 2)
        if f == "dim2_flat":
            return torch.stack([a, b, a * b], 2).flatten(1)            # interleaved
        if f == "rows":
            p = torch.sigmoid(a.sum(1))
            return torch.stack([1 - p, p], dim=1)                      # predict_proba
        if f == "moe":
            g = torch.softmax(a, dim=-1)[:, :2]
            return (g.unsqueeze(-1) * torch.stack([a, b], dim=1)).sum(dim=1)
        if f == "mean0":
            return torch.stack([a, b, a - b]).mean(0)                  # ensemble
        if f == "mean0_fn":
            return torch.mean(torch.stack([a, b], dim=0), dim=0)
        if f == "amax0_keep":
            return torch.stack([a, b], 0).amax(0, keepdim=True)
        if f == "max0":
            return torch.stack((a, b)).max(dim=0)[0] * self.p
        if f == "index0":
            return torch.stack([a, b])[1] + torch.stack([a, b]).select(0, 0)
        if f == "unbind0":
            u, v = torch.stack([a, b]).unbind(0)
            return u - v
        if f == "sigmoid0":
            return torch.stack([a, b]).sigmoid().logsumexp(0)
        if f == "var0":
            return torch.stack([a, b, b * 2]).var(dim=(0, 2))
        if f == "softmax_stack":
            return torch.stack([a, b], dim=-1).softmax(-1)[..., 0]
        if f == "chunks":
            return torch.stack(a.chunk(5, 1), -1).sum(-1)
        if f == "heads":
            h = torch.stack([a.view(-1, 5, 1), b.view(-1, 5, 1)], 2)    # (batch, 5, 2, 1)
            return h.squeeze(-1).logsumexp(1)
        if f == "one":
            return torch.stack([a], 1).sum(1)
        if f == "bools":
            return torch.stack([a > 0, b > 0], -1).float().sum(-1)
        raise AssertionError(f)


STACK_FORMS = ["dim1", "dim_last", "dim2_flat", "rows", "moe", "mean0", "mean0_fn",
               "amax0_keep", "max0", "index0", "unbind0", "sigmoid0", "var0",
               "softmax_stack", "chunks", "heads", "one", "bools"]


class StackedSeq(nn.Module):
    """Stacks of (batch, seq, n) values: after the sequence, and before the batch."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.a(x), F.gelu(self.b(x))
        if self.form == "last":
            return torch.stack([a, b], -1).amax(-1).mean(1)
        if self.form == "dim0":
            return torch.stack([a, b]).sum(0)
        if self.form == "seq_then":
            return torch.stack([a.mean(1), b.amax(1)], 1)
        raise AssertionError(self.form)


@pytest.mark.parametrize("form", STACK_FORMS)
@pytest.mark.parametrize("device", DEVICES)
def test_stack(device, form):
    torch.manual_seed(3)
    for batch in (1, 5):
        _check(Stacked(form), (_poison(torch.randn(batch, 7) * 2),), device)


@pytest.mark.parametrize("form", ["last", "dim0", "seq_then"])
@pytest.mark.parametrize("device", DEVICES)
def test_stack_of_sequences(device, form):
    torch.manual_seed(4)
    _check(StackedSeq(form), (_poison(torch.randn(3, 5, 6)),), device)


def test_stack_fused_class():
    torch.manual_seed(5)
    for form in ("moe", "mean0", "dim_last"):
        _check(Stacked(form), (torch.randn(4, 7),), api="fused_class")


class StackDraw(nn.Module):
    """A drawn stack: k values (of split or flat features) stacked at a drawn dim, then
    reduced over it, flattened back, or kept."""

    def __init__(self, k: int, n: int, heads: int, dim: int, then: str) -> None:
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(5, n * heads) for _ in range(k))
        self.n, self.heads, self.dim, self.then = n, heads, dim, then
        self.first = dim % (3 if heads == 1 else 4) == 0   # stacked before the batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vs = [torch.tanh(fc(x)) * (i + 1) for i, fc in enumerate(self.fcs)]
        if self.heads > 1:
            vs = [v.view(v.shape[0], self.heads, self.n) for v in vs]
        s = torch.stack(vs, dim=self.dim)
        if self.then == "sum":
            return s.sum(self.dim)
        if self.then == "mean":
            return s.mean(dim=self.dim, keepdim=True)
        if self.then == "amin":
            return s.amin(self.dim)
        if self.then == "flat" and not self.first:
            return s.flatten(1)
        if self.then == "lse":
            return torch.logsumexp(s, self.dim)
        return s if not self.first else s[-1]


@settings(SETTINGS, max_examples=examples(30))
@given(k=st.integers(1, 4), n=st.integers(1, 5), heads=st.integers(1, 3),
       dim=st.integers(-4, 3), then=st.sampled_from(["sum", "mean", "amin", "flat", "lse",
                                                    "keep"]),
       batch=st.sampled_from([1, 2, 5]), seed=st.integers(0, 2 ** 16))
def test_stack_drawn(k, n, heads, dim, then, batch, seed):
    nd = 2 if heads == 1 else 3   # the values' dims; the stack has one more
    if not -nd - 1 <= dim <= nd:
        dim = dim % (nd + 1)   # (in range, either sign)
    torch.manual_seed(seed)
    model = StackDraw(k, n, heads, dim, then)
    x = torch.randn(batch, 5) * 3
    if seed % 3 == 0:
        x = _poison(x)
    _check(model, (x,), calls=1)


class StackRefused(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a(x)
        f = self.form
        if f == "sizes":
            return torch.stack([a, self.b(x)], 1)
        if f == "returned0":
            return torch.stack([a, a * 2])
        if f == "other_op0":
            return torch.stack([a, a * 2]).softmax(-1).mean(0)
        if f == "keeps_dim0":
            return torch.stack([a, a * 2]).sum(-1)
        if f == "param":
            return torch.stack([a, self.a.bias.expand_as(a)], 1).sum(1)
        raise AssertionError(f)


STACK_REFUSALS = [("sizes", "stack expects each tensor to be equal size"),
                  ("returned0", "returns a stack along dim 0"),
                  ("other_op0", "an op on a stack along dim 0"),
                  ("keeps_dim0", "keeps the stacked dim"),
                  ("param", "torch.stack")]


@pytest.mark.parametrize("form, why", STACK_REFUSALS)
def test_stack_refusals(form, why):
    _refused(StackRefused(form), (torch.randn(4, 6),), why)


def test_stack_between_batch_and_sequence_is_refused():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 4)

        def forward(self, x):
            a = self.a(x)
            return torch.stack([a, a], 1).sum(-1)

    _refused(M(), (torch.randn(2, 3, 6),), "between the batch and a leading")


KERNEL_CASES += [(f"stack_{f}", Stacked(f), (_poison(torch.randn(6, 7)),))
                 for f in ("dim_last", "dim2_flat", "moe", "mean0", "var0", "heads")]
KERNEL_CASES += [("stack_seq_last", StackedSeq("last"), (_poison(torch.randn(5, 5, 6)),))]


# ======================================================================================
# 1b. vector norms of any order (NormZoo's torch.linalg.vector_norm(h, ord=3))
# ======================================================================================
ORDERS = [0, 0.5, 1, 2, 3, -1, -2.5, float("inf"), -float("inf")]


class Norms(nn.Module):
    def __init__(self, p: float, form: str) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 7)
        self.p, self.form = p, form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.form == "vector_norm":
            return torch.linalg.vector_norm(h, ord=self.p, dim=-1)
        if self.form == "method_keep":
            return h.norm(p=self.p, dim=1, keepdim=True)
        if self.form == "normalize":
            return F.normalize(h, p=self.p, dim=1)
        if self.form == "split_dims":
            return h.view(-1, 7, 1).norm(p=self.p, dim=(1, 2))
        if self.form == "heads":
            return torch.norm(h[:, :6].view(-1, 2, 3), p=self.p, dim=1)
        raise AssertionError(self.form)


@pytest.mark.parametrize("form", ["vector_norm", "method_keep", "normalize", "split_dims",
                                  "heads"])
@pytest.mark.parametrize("p", ORDERS, ids=[str(p) for p in ORDERS])
@pytest.mark.parametrize("device", DEVICES)
def test_norm_orders(device, p, form):
    torch.manual_seed(6)
    x = _poison(torch.randn(6, 5) * 3)
    x[3] = 0.0   # (a row of the bias alone)
    _check(Norms(p, form), (x,), device)


def test_matrix_norm_order_is_refused():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 6)

        def forward(self, x):
            return torch.norm(self.fc(x).view(-1, 2, 3), p="nuc", dim=(1, 2))

    _refused(M(), (torch.randn(3, 5),), "a norm of order 'nuc'")


KERNEL_CASES += [(f"norm_{f}_{p}", Norms(p, f), (_poison(torch.randn(6, 5)),))
                 for f, p in (("vector_norm", 3), ("normalize", 0.5), ("heads", -1),
                              ("method_keep", 0), ("vector_norm", -float("inf")))]


# ======================================================================================
# 2. tensors the forward makes: torch.zeros / ones / full / arange, new_*, math.* of sizes
# ======================================================================================
class Made(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(6, 5)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        f = self.form
        if f == "homogeneous":
            return self.out(torch.cat([torch.relu(h), h.new_ones(h.size(0), 1)], dim=1))
        if f == "zeros_size":
            return h + torch.zeros(h.size(), device=x.device)
        if f == "full_batch":
            return torch.cat([torch.full((x.shape[0], 2), 0.5), h], 1)
        if f == "full_int":
            return h + torch.full((h.shape[0], 1), 2)
        if f == "new_zeros_shape":
            return h.new_zeros(h.shape) - h
        if f == "new_full_inf":
            return torch.maximum(h, h.new_full((h.size(0), 5), -float("inf")))
        if f == "zeros_kw":
            return h + torch.zeros(size=(h.size(0), 5), dtype=h.dtype)
        if f == "arange":
            return h * torch.arange(5, dtype=torch.float32)
        if f == "arange_step":
            return h * torch.arange(0, 1, 0.2) + torch.arange(-2.0, 0.5, 0.5)
        if f == "arange_int_float":
            return torch.arange(5).float() * h - torch.arange(1, 6)
        if f == "freqs":   # diffusion timestep features
            half = 3
            fr = torch.exp(-math.log(10000) * torch.arange(start=0, end=half, dtype=x.dtype,
                                                           device=x.device) / half)
            a = h[:, :1] * fr[None]
            return torch.cat([torch.cos(a), torch.sin(a)], dim=-1)
        if f == "lse_pool":
            return (torch.logsumexp(2.0 * h, dim=1) - math.log(h.shape[1])) / 2.0
        if f == "sqrt_dk":
            return torch.softmax(h / math.sqrt(h.size(-1)), -1)
        if f == "ones_fixed":
            return h + torch.ones(5) + torch.ones(1, 5) * 2 - torch.zeros(1)
        if f == "split_shape":
            return (torch.ones((h.size(0), 5, 2)) * h.unsqueeze(-1)).sum(-1)
        if f == "bool_full":
            return torch.where(torch.full((h.size(0), 5), True), h, 0.0)
        raise AssertionError(f)


MADE_FORMS = ["homogeneous", "zeros_size", "full_batch", "full_int", "new_zeros_shape",
              "new_full_inf", "zeros_kw", "arange", "arange_step", "arange_int_float",
              "freqs", "lse_pool", "sqrt_dk", "ones_fixed", "split_shape", "bool_full"]


@pytest.mark.parametrize("form", MADE_FORMS)
@pytest.mark.parametrize("device", DEVICES)
def test_made_tensors(device, form):
    torch.manual_seed(7)
    for batch in (1, 5):
        _check(Made(form), (_poison(torch.randn(batch, 6) * 2),), device)


@pytest.mark.parametrize("form", ["arange", "arange_step", "arange_int_float", "ones_fixed"])
def test_constants_fx_made_are_program_constants(form):
    """torch.ones(5), torch.arange(0, 1, 0.2) of numbers alone are made by torch.fx at trace
    time (a `_tensor_constant` of the traced module, on the CPU): the program holds them
    as constants (iota nodes), no tensor source that would stay on the CPU."""
    prog = program_of(Made(form), torch.randn(3, 6))
    assert not any(isinstance(s, str) and "_tensor_constant" in s for s in prog.sources), \
        prog.sources
    assert any(n.kind == "iota" for n in prog.nodes), prog.describe()


class MadeSeq(nn.Module):
    """A (batch, seq, n) value: constants of its shape, and of the batch's after a
    reduction over the sequence."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        h = self.fc(x)
        if self.form == "seq_shape":
            return torch.cat([h, torch.ones(h.shape[:-1] + (1,))], -1)
        if self.form == "after_mean":
            m = h.mean(1)
            return torch.cat([m, m.new_zeros(m.size(0), 2)], -1)
        raise AssertionError(self.form)


@pytest.mark.parametrize("form", ["seq_shape", "after_mean"])
@pytest.mark.parametrize("device", DEVICES)
def test_made_tensors_of_sequences(device, form):
    torch.manual_seed(8)
    _check(MadeSeq(form), (_poison(torch.randn(3, 4, 4)),), device)


def test_made_tensors_in_a_tail_function():
    from cupyfuse import fused_linear

    torch.manual_seed(9)
    x, w, b = _poison(torch.randn(4, 6)), torch.randn(5, 6), torch.randn(5)

    def tail(h):
        return torch.cat([h, h.new_ones(h.size(0), 1)], 1) * torch.arange(6.0) \
            - math.log(h.shape[1])

    want = tail((x.double() @ w.double().t()) + b.double())
    got = _quiet(fused_linear, x, w, b, tail)
    assert_matches(got, want, tail(x @ w.t() + b), "tail function")


@SETTINGS
@given(n=st.integers(1, 9), start=st.integers(-5, 5), step=st.sampled_from([1, 2, 0.5, 0.25, -1]),
       fill=st.sampled_from([0.0, 1.0, -2.5, float("inf"), float("nan")]),
       batch=st.sampled_from([1, 3]), seed=st.integers(0, 2 ** 16))
def test_made_tensors_drawn(n, start, step, fill, batch, seed):
    """An arange of n drawn numbers and a fill, against a value of n features."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, n)

        def forward(self, x):
            h = self.fc(x)
            r = torch.arange(start, start + n * step, step, dtype=torch.float32)[:n]
            return h * r + torch.full((x.shape[0], n), fill) + torch.full((n,), fill)

    torch.manual_seed(seed)
    _check(M(), (_poison(torch.randn(batch, 3)),), calls=1)


class MadeRefused(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        h = self.fc(x)
        f = self.form
        if f == "empty":
            return h + torch.empty(h.shape)
        if f == "matrix":
            return (h.view(-1, 5, 1) * torch.ones((h.size(1), 3))).sum(-1)
        if f == "int_big":
            return h + torch.full((h.size(0), 1), 2 ** 25)
        if f == "arange_batch":
            return h + torch.arange(h.shape[0]).float()[:, None]
        if f == "math_tensor":
            return h + math.exp(h.sum(1, keepdim=True))
        if f == "math_raises":
            return h * math.log(h.shape[1] - 5)
        if f == "math_batch":
            return h * math.sqrt(h.shape[0])
        if f == "float64":
            return h + torch.zeros(h.shape, dtype=torch.float64)
        if f == "uneven":
            return h * torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0]).cumsum(0)
        raise AssertionError(f)


MADE_REFUSALS = [("empty", "an uninitialised tensor"),
                 ("matrix", "varying along two dims"),
                 ("int_big", "float32 holds integers exactly up to 2**24 only"),
                 ("arange_batch", "a range of the batch size"),
                 ("math_tensor", "of a tensor"),
                 ("math_raises", "Python raises ValueError"),
                 ("math_batch", "uses the batch size as a number"),
                 ("float64", "dtype=torch.float64")]


@pytest.mark.parametrize("form, why", MADE_REFUSALS)
def test_made_tensor_refusals(form, why):
    _refused(MadeRefused(form), (torch.randn(4, 6),), why)


def test_made_tensor_of_other_rows_is_refused():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 6)

        def forward(self, x):
            h = self.fc(x)
            return h + torch.zeros((x.size(0), 1, 6))   # the batch's rows, not (batch, seq)

    _refused(M(), (torch.randn(2, 3, 4),), "its batch and leading dims must be that value's")


KERNEL_CASES += [(f"made_{f}", Made(f), (_poison(torch.randn(6, 6)),))
                 for f in ("homogeneous", "full_batch", "arange_step", "freqs", "split_shape",
                           "new_full_inf")]
KERNEL_CASES += [("made_seq_after_mean", MadeSeq("after_mean"),
                  (_poison(torch.randn(5, 4, 4)),))]


# ======================================================================================
# 3. F.cosine_similarity, nn.CosineSimilarity, F.pairwise_distance, nn.PairwiseDistance
# ======================================================================================
class Similar(nn.Module):
    def __init__(self, form: str, scale: float = 1.0, bias: bool = True) -> None:
        super().__init__()
        self.form = form
        self.a = nn.Linear(6, 5, bias=bias)
        self.b = nn.Linear(6, 5, bias=bias)
        with torch.no_grad():
            self.a.weight.mul_(scale)
            self.b.weight.mul_(scale)
        self.v = nn.Parameter(torch.randn(5))
        self.cos = nn.CosineSimilarity(dim=-1, eps=1e-6)
        self.dist = nn.PairwiseDistance(p=1.0, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.a(x), self.b(x)
        f = self.form
        if f == "cos":
            return F.cosine_similarity(a, b, dim=-1)
        if f == "cos_same":
            return F.cosine_similarity(a, a)
        if f == "cos_param":
            return F.cosine_similarity(a, self.v, dim=1, eps=1e-3)
        if f == "cos_module":
            return self.cos(a, torch.tanh(b))
        if f == "cos_heads":
            return F.cosine_similarity(a[:, :4].view(-1, 2, 2), b[:, :4].view(-1, 2, 2), dim=2)
        if f == "cos_outer_heads":
            return F.cosine_similarity(a[:, :4].view(-1, 2, 2), b[:, :4].view(-1, 2, 2), dim=1)
        if f == "gate":   # a cosine gate on the features
            return a * F.cosine_similarity(a, b).unsqueeze(-1)
        if f == "pdist":
            return F.pairwise_distance(a, b)
        if f == "pdist_same":
            return F.pairwise_distance(a, a)
        if f == "pdist_module":
            return self.dist(a, b)
        if f == "pdist_p":
            return torch.pairwise_distance(a, self.v, p=3.0, eps=1e-3)
        if f == "pdist_inf":
            return F.pairwise_distance(a, b, p=float("inf"), keepdim=True)
        if f == "pdist_heads":
            return F.pairwise_distance(a[:, :4].view(-1, 2, 2), b[:, :4].view(-1, 2, 2))
        if f == "triplet":   # a triplet margin written out
            return torch.relu(F.pairwise_distance(a, b) - F.pairwise_distance(a, -b) + 1.0)
        raise AssertionError(f)


SIM_FORMS = ["cos", "cos_same", "cos_param", "cos_module", "cos_heads", "cos_outer_heads",
             "gate", "pdist", "pdist_same", "pdist_module", "pdist_p", "pdist_inf",
             "pdist_heads", "triplet"]


@pytest.mark.parametrize("form", SIM_FORMS)
@pytest.mark.parametrize("device", DEVICES)
def test_similarity(device, form):
    torch.manual_seed(10)
    for batch in (1, 5):
        _check(Similar(form), (_poison(torch.randn(batch, 6) * 2),), device)


@pytest.mark.parametrize("form", ["cos", "cos_same", "cos_param", "pdist", "pdist_same",
                                  "pdist_inf"])
@pytest.mark.parametrize("scale", [1e-12, 1e-9, 1.0])
def test_similarity_near_eps(form, scale):
    """Norms and differences around eps (torch clamps the norm of each operand at eps,
    and adds eps to the difference): tiny weights, and rows of zeros without a bias."""
    torch.manual_seed(11)
    x = torch.randn(6, 6)
    x[2] = 0.0
    x[4] *= 1e-3
    _check(Similar(form, scale=scale, bias=False), (x,), calls=1)


class PairSiamese(nn.Module):
    """Two inputs through one projection (a siamese head), distance and similarity."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(9, 5)
        self.dist = nn.PairwiseDistance(p=2)

    def forward(self, anchor, positive):
        a, p = self.proj(anchor), self.proj(positive)
        return self.dist(a, p) + F.cosine_similarity(a, p)


@pytest.mark.parametrize("device", DEVICES)
def test_similarity_of_two_inputs(device):
    torch.manual_seed(12)
    _check(PairSiamese(), (_poison(torch.randn(5, 9)), torch.randn(5, 9)), device)


@SETTINGS
@given(n=st.integers(1, 7), heads=st.integers(1, 3), which=st.sampled_from(["cos", "pdist"]),
       dim=st.integers(-3, 2), p=st.sampled_from([1.0, 2.0, 3.0, float("inf"), 0.0]),
       eps=st.sampled_from([1e-8, 1e-6, 1e-3, 0.5]), keep=st.booleans(),
       batch=st.sampled_from([1, 2, 5]), seed=st.integers(0, 2 ** 16))
def test_similarity_drawn(n, heads, which, dim, p, eps, keep, batch, seed):
    nd = 2 if heads == 1 else 3

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, n * heads)
            self.b = nn.Linear(4, n * heads)

        def forward(self, x):
            a, b = self.a(x), torch.tanh(self.b(x))
            if heads > 1:
                a, b = a.view(-1, heads, n), b.view(-1, heads, n)
            if which == "cos":
                return F.cosine_similarity(a, b, dim=1 + (dim % (nd - 1)), eps=eps)
            return F.pairwise_distance(a, b, p=p, eps=eps, keepdim=keep)

    torch.manual_seed(seed)
    x = torch.randn(batch, 4) * 3
    if seed % 3 == 0:
        x = _poison(x)
    _check(M(), (x,), calls=1)


def test_similarity_refusals():
    class M(nn.Module):
        def __init__(self, form):
            super().__init__()
            self.form = form
            self.a = nn.Linear(6, 5)

        def forward(self, x):
            a = self.a(x)
            if self.form == "batch":
                return F.cosine_similarity(a, a * 2, dim=0)
            if self.form == "broadcast":
                return F.cosine_similarity(a, a.sum(1, keepdim=True), dim=1)
            return F.pairwise_distance(a > 0, a < 0)

    x = torch.randn(4, 6)
    _refused(M("batch"), (x,), "the batch dimension")
    _refused(M("broadcast"), (x,), "broadcast along dim 1")
    _refused(M("bool"), (x,), "a boolean tensor operand")


KERNEL_CASES += [(f"sim_{f}", Similar(f), (_poison(torch.randn(6, 6)),))
                 for f in ("cos", "cos_param", "cos_heads", "gate", "pdist_module", "pdist_p",
                           "triplet")]


# ======================================================================================
# 4. a tensor exponent: x.pow(self.p) with a parameter p (GeM pooling)
# ======================================================================================
class GeM(nn.Module):
    """Generalized-mean pooling over the sequence (Kaggle's GeMText), and other learnable
    exponents."""

    def __init__(self, form: str, p: float = 3.0) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(6, 5)
        self.p = nn.Parameter(torch.ones(1) * p)
        self.q = nn.Parameter(torch.rand(5) + 0.5)
        self.s = nn.Parameter(torch.tensor(2.5))
        self.register_buffer("e", torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.softplus(self.fc(x))
        f = self.form
        if f == "gem_seq":
            return h.clamp(min=1e-6).pow(self.p).mean(1).pow(1.0 / self.p)
        if f == "gem_features":
            return F.avg_pool1d(h.clamp(min=1e-6).pow(self.p).unsqueeze(1),
                                h.size(-1)).pow(1.0 / self.p).squeeze(1)
        if f == "per_feature":
            return torch.pow(h, self.q)
        if f == "zero_dim":
            return (h - 1.0) ** self.s
        if f == "buffer":
            return torch.pow(self.fc(x), self.e)
        if f == "raw":
            return self.fc(x) ** self.p
        raise AssertionError(f)


@pytest.mark.parametrize("form", ["gem_seq", "gem_features", "per_feature", "zero_dim",
                                  "buffer", "raw"])
@pytest.mark.parametrize("device", DEVICES)
def test_tensor_exponent(device, form):
    torch.manual_seed(13)
    shape = (3, 4, 6) if form == "gem_seq" else (5, 6)
    _check(GeM(form), (_poison(torch.randn(*shape) * 2),), device)


@SETTINGS
@given(p=st.sampled_from([3.0, 1.0, 0.5, 2.0, -1.0, -2.5, 0.0, 4.25]),
       form=st.sampled_from(["gem_features", "zero_dim", "raw", "buffer"]),
       batch=st.sampled_from([1, 2, 5]), seed=st.integers(0, 2 ** 16))
def test_tensor_exponent_drawn(p, form, batch, seed):
    """Drawn exponents (negative, fractional, 0) of values of either sign, NaN/inf rows."""
    torch.manual_seed(seed)
    model = GeM(form, p)
    with torch.no_grad():
        model.s.fill_(p)
        model.e.fill_(p)
    _check(model, (_poison(torch.randn(batch, 6) * 2),), calls=1)


def test_tensor_exponent_after_an_edit():
    """The exponent is a parameter: an in-place edit is seen at the next call."""
    torch.manual_seed(14)
    m = GeM("gem_features")
    fm = cupyfuse.from_model(m)
    x = torch.randn(4, 6)
    for p in (3.0, 1.5):
        with torch.no_grad():
            m.p.fill_(p)
        ref64, ref32 = _refs(m, (x,))
        assert_matches(_quiet(fm, x), ref64, ref32, f"p={p}")


KERNEL_CASES += [(f"pow_{f}", GeM(f), (_poison(torch.randn(*((5, 4, 6) if f == "gem_seq"
                                                              else (6, 6)))),))
                 for f in ("gem_seq", "gem_features", "per_feature", "zero_dim")]


# ======================================================================================
# 5. pooling by torch's window rules: padding, ceil_mode, dilation, count_include_pad,
#    adaptive windows of unequal sizes
# ======================================================================================
class Pooled(nn.Module):
    """A pooling of a (batch, C, L) view (C = 1: h.unsqueeze(1)) of a Linear output."""

    def __init__(self, fn, c: int = 1, n: int = 13, k_in: int = 6) -> None:
        super().__init__()
        self.fn, self.c = fn, c
        self.fc = nn.Linear(k_in, n * c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        v = h.unsqueeze(1) if self.c == 1 else h.view(h.shape[0], self.c, -1)
        return self.fn(v).flatten(1)


POOL_FORMS = {
    "ceil_max": lambda v: F.max_pool1d(v, 3, 2, ceil_mode=True),
    "pad_avg": lambda v: F.avg_pool1d(v, 4, 2, padding=1),
    "pad_avg_excl": lambda v: F.avg_pool1d(v, 4, 2, padding=2, count_include_pad=False),
    "pad_ceil_avg": lambda v: F.avg_pool1d(v, 3, 2, 1, ceil_mode=True),
    "pad_ceil_avg_excl": lambda v: F.avg_pool1d(v, 5, 3, 2, True, False),
    "dilated_max": lambda v: F.max_pool1d(v, 3, 1, dilation=2),
    "dilated_pad_ceil": lambda v: F.max_pool1d(v, 2, 3, 1, dilation=3, ceil_mode=True),
    "pad_max": lambda v: F.max_pool1d(v, 5, 1, 2),
    "adaptive_max": lambda v: F.adaptive_max_pool1d(v, 4),
    "adaptive_avg": lambda v: F.adaptive_avg_pool1d(v, 5),
    "adaptive_up": lambda v: F.adaptive_avg_pool1d(v, 17),
    "adaptive_one": lambda v: F.adaptive_max_pool1d(v, 1),
}


@pytest.mark.parametrize("form", list(POOL_FORMS))
@pytest.mark.parametrize("c", [1, 3])
@pytest.mark.parametrize("device", DEVICES)
def test_window_pooling(device, c, form):
    torch.manual_seed(15)
    for batch in (1, 5):
        _check(Pooled(POOL_FORMS[form], c), (_poison(torch.randn(batch, 6) * 2),), device)


class PoolModules(nn.Module):
    """The corpus' forms: nn.MaxPool1d(ceil_mode=True), avg_pool1d with padding,
    nn.AdaptiveMaxPool1d to a size that does not divide the features, nn.AvgPool1d with
    count_include_pad=False; and pooling along the last dim of (batch, L, 1) and (batch,
    seq, F) values."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(7, 10)
        self.ceil = nn.MaxPool1d(kernel_size=3, stride=2, ceil_mode=True)
        self.ada = nn.AdaptiveMaxPool1d(4)
        self.excl = nn.AvgPool1d(3, 2, 1, ceil_mode=True, count_include_pad=False)

    def forward(self, x):
        h = self.fc(x)
        f = self.form
        if f == "ceil":
            return self.ceil(h.unsqueeze(1)).squeeze(1)
        if f == "padded_avg":
            return F.avg_pool1d(F.gelu(h).unsqueeze(1), kernel_size=4, stride=2,
                                padding=1).squeeze(1)
        if f == "adaptive":
            return self.ada(h[:, None, :]).flatten(1)
        if f == "excl":
            return self.excl(h.unsqueeze(1)).squeeze(1).softmax(-1)
        if f == "last_dim_one":   # torch reads (N, C=10, L=1)
            return F.max_pool1d(h.unsqueeze(-1), 1, 1, ceil_mode=True).squeeze(-1)
        if f == "seq":
            return F.avg_pool1d(h, 3, 2, 1, count_include_pad=False).mean(1)
        raise AssertionError(f)


@pytest.mark.parametrize("form", ["ceil", "padded_avg", "adaptive", "excl", "last_dim_one",
                                  "seq"])
@pytest.mark.parametrize("device", DEVICES)
def test_window_pooling_modules(device, form):
    torch.manual_seed(16)
    shape = (3, 4, 7) if form == "seq" else (5, 7)
    _check(PoolModules(form), (_poison(torch.randn(*shape)),), device)


@settings(SETTINGS, max_examples=examples(100))
@given(L=st.integers(1, 12), c=st.sampled_from([1, 2, 3]),
       kind=st.sampled_from(["max", "avg", "adaptive_max", "adaptive_avg"]),
       k=st.integers(1, 6), s=st.integers(1, 4), pad=st.integers(0, 3), dil=st.integers(1, 3),
       ceil=st.booleans(), incl=st.booleans(), out=st.integers(1, 14),
       batch=st.sampled_from([1, 2, 5]), seed=st.integers(0, 2 ** 16))
def test_window_pooling_drawn(L, c, kind, k, s, pad, dil, ceil, incl, out, batch, seed):
    """Any window rule torch accepts (and torch's error where it raises) against float64."""
    if kind == "adaptive_max":
        fn = (lambda v: F.adaptive_max_pool1d(v, out))
    elif kind == "adaptive_avg":
        fn = (lambda v: F.adaptive_avg_pool1d(v, out))
    elif kind == "max":
        fn = (lambda v: F.max_pool1d(v, k, s, pad, dil, ceil_mode=ceil))
    else:
        fn = (lambda v: F.avg_pool1d(v, k, s, pad, ceil_mode=ceil, count_include_pad=incl))
    torch.manual_seed(seed)
    model = Pooled(fn, c, L, 4)
    x = torch.randn(batch, 4) * 2
    if seed % 3 == 0:
        x = _poison(x)
    try:
        _refs(model, (x,))
    except RuntimeError:   # torch raises: the conversion refuses it (a TailError)
        _refused(model, (x,))
        return
    _check(model, (x,), calls=1)


KERNEL_CASES += [(f"pool_{f}_c{c}", Pooled(POOL_FORMS[f], c), (_poison(torch.randn(6, 6)),))
                 for f in POOL_FORMS for c in (1, 3)]
KERNEL_CASES += [(f"pool_{f}", PoolModules(f), (_poison(torch.randn(*((5, 4, 7) if f == "seq"
                                                                      else (6, 7)))),))
                 for f in ("excl", "last_dim_one", "seq")]


# ======================================================================================
# 6. torch.cumsum along the features (a row scan in a fixed order)
# ======================================================================================
class Cumsum(nn.Module):
    def __init__(self, form: str, n: int = 9) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(6, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        f = self.form
        if f == "plain":
            return torch.cumsum(h, dim=1)
        if f == "method":
            return h.cumsum(-1)
        if f == "quantiles":   # non-crossing quantiles: the first, plus positive increments
            first = h[:, :1]
            return torch.cat([first, first + torch.cumsum(F.softplus(h[:, 1:]), dim=1)], dim=1)
        if f == "cdf":
            return torch.softmax(h, -1).cumsum(1)
        if f == "heads_last":
            return h[:, :8].view(-1, 2, 4).cumsum(-1).flatten(1)
        if f == "heads_outer":
            return h[:, :8].view(-1, 2, 4).cumsum(1).flatten(1)
        if f == "size_one":
            return h.unsqueeze(-1).cumsum(-1).squeeze(-1)
        if f == "then_reduce":
            return torch.cumsum(h.abs(), 1).amax(1) - h.sum(1)
        raise AssertionError(f)


CUMSUM_FORMS = ["plain", "method", "quantiles", "cdf", "heads_last", "heads_outer",
                "size_one", "then_reduce"]


@pytest.mark.parametrize("form", CUMSUM_FORMS)
@pytest.mark.parametrize("device", DEVICES)
def test_cumsum(device, form):
    torch.manual_seed(17)
    for batch in (1, 5):
        _check(Cumsum(form), (_poison(torch.randn(batch, 6) * 2),), device)


@pytest.mark.parametrize("n", [31, 32, 33, 65, 300, 7000])
@pytest.mark.parametrize("device", DEVICES)
def test_cumsum_widths(device, n):
    """Chunk edges (32 features a chunk) and a row past the staged shared memory (each
    feature's sum recomputed where it is read, in the same order)."""
    torch.manual_seed(18)
    _check(Cumsum("cdf" if n > 1000 else "plain", n), (_poison(torch.randn(4, 6)),), device)


@SETTINGS
@given(dims=st.sampled_from([(9,), (2, 5), (3, 1, 4), (2, 3, 2), (40,), (2, 33)]),
       dim=st.integers(-3, 2), batch=st.sampled_from([1, 3]), seed=st.integers(0, 2 ** 16))
def test_cumsum_drawn(dims, dim, batch, seed):
    """A cumsum along any feature dim of a split value, against float64."""
    nd = len(dims) + 1
    if not -nd <= dim < nd or dim % nd == 0:
        dim = nd - 1

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, math.prod(dims))

        def forward(self, x):
            return self.fc(x).view(-1, *dims).cumsum(dim).flatten(1)

    torch.manual_seed(seed)
    x = torch.randn(batch, 4) * 3
    if seed % 3 == 0:
        x = _poison(x)
    _check(M(), (x,), calls=1)


def test_cumsum_refusals():
    class M(nn.Module):
        def __init__(self, form):
            super().__init__()
            self.form = form
            self.fc = nn.Linear(4, 5)

        def forward(self, x):
            h = self.fc(x)
            if self.form == "batch":
                return torch.cumsum(h, 0)
            if self.form == "seq":
                return h.cumsum(1)
            if self.form == "bool":
                return (h > 0).cumsum(1).float()
            return torch.cumsum(h, 1, dtype=torch.float64).float()

    _refused(M("batch"), (torch.randn(3, 4),), "adds up along the batch dimension")
    _refused(M("seq"), (torch.randn(3, 2, 4),), "adds up along a leading (sequence) dim")
    _refused(M("bool"), (torch.randn(3, 4),), "a cumulative sum of a boolean")
    _refused(M("dtype"), (torch.randn(3, 4),), "dtype=torch.float64")


def test_cumsum_program_order():
    """The CPU path adds in the kernels' order: chunks of SCAN_CHUNK, each chunk's running
    sum plus the sum of the chunks before, in double (program.scan_values)."""
    from cupyfuse.ir.program import SCAN_CHUNK, Node, scan_values

    torch.manual_seed(19)
    t = torch.randn(3, 100) * 1e3
    got = scan_values(t, Node("scan", "sum", (0,), (1, 100, 1), (-1, 100)))
    want = torch.empty(3, 100, dtype=torch.float64)
    for r in range(3):
        off = 0.0
        for c in range(0, 100, SCAN_CHUNK):
            run = 0.0
            for j in range(c, min(c + SCAN_CHUNK, 100)):
                run += float(t[r, j])
                want[r, j] = off + run
            off += run
    assert torch.equal(got, want.float())


KERNEL_CASES += [(f"cumsum_{f}", Cumsum(f), (_poison(torch.randn(6, 6)),))
                 for f in ("plain", "quantiles", "heads_last", "heads_outer", "then_reduce")]
KERNEL_CASES += [(f"cumsum_wide_{n}", Cumsum("cdf", n), (_poison(torch.randn(5, 6)),))
                 for n in (33, 65, 6000)]


# ======================================================================================
# 7. ArcFace's one-hot: in-place ops on a tensor the forward made, scatter of a number at
#    integer labels, integer casts of an integer input
# ======================================================================================
class ArcFace(nn.Module):
    """ronghuaiyang/arcface-pytorch's ArcMarginProduct, and variants of its one-hot."""

    def __init__(self, form: str = "arcface", n: int = 7, s: float = 30.0,
                 m: float = 0.5) -> None:
        super().__init__()
        self.form = form
        self.weight = nn.Parameter(torch.empty(n, 6))
        nn.init.xavier_uniform_(self.weight)
        self.s, self.m = s, m
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.th, self.mm = math.cos(math.pi - m), math.sin(math.pi - m) * m

    def forward(self, x: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        cosine = F.linear(F.normalize(x), F.normalize(self.weight))
        f = self.form
        if f == "arcface":
            sine = torch.sqrt((1.0 - torch.pow(cosine, 2)).clamp(0, 1))
            phi = cosine * self.cos_m - sine * self.sin_m
            phi = torch.where(cosine > self.th, phi, cosine - self.mm)
            one_hot = torch.zeros(cosine.size(), device=x.device)
            one_hot.scatter_(1, label.view(-1, 1).long(), 1)
            output = (one_hot * phi) + ((1.0 - one_hot) * cosine)
            output *= self.s
            return output
        if f == "cosface":
            one_hot = torch.zeros_like(cosine).scatter_(1, label.unsqueeze(1).long(), 1.0)
            return self.s * (cosine - self.m * one_hot)
        if f == "out_of_place":
            one_hot = cosine.new_zeros(cosine.shape).scatter(1, label.long()[:, None], 2.5)
            return one_hot - cosine
        if f == "full_base":
            t = torch.full(cosine.shape, -1.0).scatter_(1, label.view(-1, 1).to(torch.int64), 3)
            return t * cosine
        if f == "two_labels":   # (batch, 2) indices: two positions per row
            t = torch.zeros(cosine.size()).scatter_(1, label.long(), 1.0)
            return t + cosine
        if f == "chain":   # several in-place ops on the made tensor, one on its result
            t = torch.zeros(cosine.size())
            t.scatter_(1, label.view(-1, 1).long(), 1.0).mul_(self.s)
            F.relu(t, inplace=True)
            t.add_(cosine)
            return t
        raise AssertionError(f)


ARC_FORMS = ["arcface", "cosface", "out_of_place", "full_base", "two_labels", "chain"]


def _labels(batch: int, n: int, k: int = 1, dtype=torch.int64) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch * 7 + k)
    t = torch.randint(0, n, (batch, k) if k > 1 else (batch,), generator=g)
    return t.to(dtype)


@pytest.mark.parametrize("form", ARC_FORMS)
@pytest.mark.parametrize("device", DEVICES)
def test_one_hot(device, form):
    torch.manual_seed(20)
    for batch in (1, 5):
        lab = _labels(batch, 7, 2 if form == "two_labels" else 1)
        _check(ArcFace(form), (_poison(torch.randn(batch, 6)), lab), device)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_one_hot_label_dtypes(dtype):
    torch.manual_seed(21)
    _check(ArcFace("arcface"), (torch.randn(5, 6), _labels(5, 7, 1, dtype)), calls=1)


@pytest.mark.parametrize("device", DEVICES)
def test_one_hot_out_of_range_labels_give_nan_rows(device):
    """torch raises for an index outside [0, N); the fused scatter makes that row NaN (no
    host synchronisation on the GPU to raise there): never a silent one-hot."""
    torch.manual_seed(22)
    m = ArcFace("cosface").to(device)
    fm = cupyfuse.from_model(m)
    x = torch.randn(4, 6, device=device)
    out = _quiet(fm, x, torch.tensor([0, 7, -1, 6], device=device)).cpu()
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all(), out
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[3]).all(), out
    ref = _quiet(m, x, torch.tensor([0, 1, 2, 6], device=device)).cpu()
    torch.testing.assert_close(out[[0, 3]], ref[[0, 3]], atol=1e-4, rtol=1e-4)


class MadeInPlace(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        h = self.fc(x)
        f = self.form
        if f == "read_before":   # read (not a view) before the in-place op: the old value
            z = torch.ones(h.shape, dtype=h.dtype)
            y = z * 3
            z.mul_(h)
            return z + y
        if f == "chained":
            z = torch.zeros(h.shape, dtype=h.dtype)
            w = z.add_(h)
            w.mul_(3)
            return w + z
        if f == "bool_into_float":
            z = torch.zeros(h.shape, dtype=h.dtype)
            z.add_(h > 0)
            return z
        raise AssertionError(f)


@pytest.mark.parametrize("form", ["read_before", "chained", "bool_into_float"])
@pytest.mark.parametrize("device", DEVICES)
def test_in_place_ops_on_made_tensors(device, form):
    torch.manual_seed(23)
    _check(MadeInPlace(form), (_poison(torch.randn(5, 6)),), device)


class InPlaceRefused(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(6, 5)

    def forward(self, x, label):
        h = self.fc(x)
        f = self.form
        if f == "view_before":
            z = torch.zeros(h.shape, dtype=h.dtype)
            v = z[:, :2]
            z.add_(h)
            return v.sum(1, keepdim=True) + z
        if f == "float_into_int":
            z = torch.full((h.size(0), 5), 2)
            z.add_(h)
            return z.float()
        if f == "not_long":
            return torch.zeros(h.shape).scatter_(1, label.view(-1, 1), 1.0) + h
        if f == "src":
            return torch.zeros(h.shape).scatter_(1, label.view(-1, 1).long(), h) + h
        if f == "reduce":
            return torch.zeros(h.shape).scatter_(1, label.view(-1, 1).long(), 1.0,
                                                 reduce="add") + h
        if f == "batch_dim":
            return torch.zeros(h.shape).scatter_(0, label.view(1, -1).long(), 1.0) + h
        raise AssertionError(f)


IN_PLACE_REFUSALS = [("view_before", "an in-place op on a value that is read again later"),
                     ("float_into_int", "writing floats into an integer"),
                     ("not_long", "not cast to int64"),
                     ("src", "a scatter of a tensor (src)"),
                     ("reduce", "reduce='add'"),
                     ("batch_dim", "along dim 0")]


@pytest.mark.parametrize("form, why", IN_PLACE_REFUSALS)
def test_in_place_and_scatter_refusals(form, why):
    m = InPlaceRefused(form)
    x, lab = torch.randn(4, 6), torch.tensor([0, 3, 2, 1])
    if form != "float_into_int":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m(x, lab)   # torch computes it
    _refused(m, (x, lab), why)


KERNEL_CASES += [(f"onehot_{f}", ArcFace(f), (_poison(torch.randn(6, 6)),
                                             _labels(6, 7, 2 if f == "two_labels" else 1)))
                 for f in ("arcface", "two_labels", "chain")]


# ======================================================================================
# the generated kernels of these forms: CPU emulation of CUDA, and nvcc
# ======================================================================================
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not on PATH")
def test_new_kernels_emulated_on_the_cpu(tmp_path_factory, monkeypatch):
    """Every form through execute.run_gpu on CPU tensors (tests/emu/gpu.py: its levels,
    buffers and launches), each level's generated kernel compiled as C++ with threads for
    CUDA's (tests/emu/cuda.py) and run in place of the GPU; against float64 torch."""
    from emu import cuda as _cuda_emu
    from emu.gpu import run_gpu_emulated

    progs = [program_of(model, *inputs) for _, model, inputs in KERNEL_CASES]
    kernels = _cuda_emu.build_or_skip(progs, tmp_path_factory.mktemp("emu"), exact=True)
    for name, model, inputs in KERNEL_CASES:
        ref64, ref32 = _refs(model, inputs)
        with monkeypatch.context() as mp:
            got = run_gpu_emulated(model, list(inputs), mp, kernels)
        assert_matches(got, ref64, ref32, f"emulated {name}")


@pytest.mark.parametrize("name, model, inputs", KERNEL_CASES[::2],
                         ids=[c[0] for c in KERNEL_CASES[::2]])
def test_new_forms_emulated_node_by_node(name, model, inputs, monkeypatch):
    """The same through tests/emu/gpu.py's node-by-node emulation (no compiler needed)."""
    from emu.gpu import run_gpu_emulated

    ref64, ref32 = _refs(model, inputs)
    assert_matches(run_gpu_emulated(model, list(inputs), monkeypatch), ref64, ref32, name)


@pytest.mark.parametrize("name, model, inputs", KERNEL_CASES[1::2],
                         ids=[c[0] for c in KERNEL_CASES[1::2]])
def test_new_forms_prepared_emulated(name, model, inputs, monkeypatch):
    """prepared.prepare's launches of these forms (tests/emu/prepared.py: decoded from their
    parameter buffers and emulated; the full path, then the ready plan twice): bitwise
    the emulated general path, and close to float64 torch."""
    from emu import gpu as _gpuemu
    from emu import prepared as _prepemu

    prog, tens, srcs = _gpuemu.model_program(model, list(inputs))
    _prepemu.install(monkeypatch)
    prog = _prepemu.runnable(prog)
    general = _gpuemu.run_program_emulated(prog, tens, srcs, monkeypatch)
    pr = _prepemu.prepare(prog, tens, srcs)
    assert pr is not None, f"{name}: not prepared"
    ref64, ref32 = _refs(model, inputs)
    for i in range(3):
        out = _prepemu.call(pr, tens, srcs)
        assert _prepemu.same_bits(out, general), f"{name}: prepared call {i} differs"
    assert_matches(out, ref64, ref32, name)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_new_kernels_compile_with_nvcc(tmp_path):
    import re
    import subprocess

    from cupyfuse.backend import codegen, runtime

    bodies: dict[str, str] = {}
    for _, model, inputs in KERNEL_CASES:
        prog = program_of(model, *inputs)
        for lv in codegen.plan(prog).levels:
            if lv.kernel:
                bodies.setdefault(lv.name, lv.kernel.split("\n", 1)[1])
    assert bodies
    src = tmp_path / "outside_forms.cu"
    src.write_text(runtime.expand_source("tail_ops.cuh") + "\n" + "\n".join(bodies.values()))
    r = subprocess.run(["nvcc", "-cubin", "-o", str(tmp_path / "outside_forms.cubin"), "-std=c++17",
                        "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", str(src)],
                       capture_output=True, text=True, timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    entries = set(re.findall(r"Compiling entry function '(\w+)'", log))
    assert set(bodies) <= entries, set(bodies) - entries
    for name, stores in re.findall(r"Function properties for (\w+)\s*\n\s*\d+ bytes stack "
                                   r"frame, (\d+) bytes spill stores", log):
        assert int(stores) == 0, f"{name} spills {stores} bytes"
