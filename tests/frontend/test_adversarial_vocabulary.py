"""Adversarial models of the vocabulary (CPU only): stack, made tensors, cosine/pairwise
distance, tensor exponents, window pooling, cumsum, vector norms of any order, ArcFace's
one-hot, transposes keeping the batch first, several results -- against the float64 eager
model at atol = rtol = 1e-4, NaN/inf placement as torch. Every case is expected to pass:
the file holds no xfail.

Not a fusion error: ``vector_norm(h * 1e20, ord=2)`` (and ord=3 at 1e15) is +inf where
the float64 reference is finite: torch's own float32 result is +inf too (the powers
overflow float32), so it is the float32 range.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cupyfuse


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.double(), b.double()
    assert a.shape == b.shape, what
    assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{what}: NaN placement {a} vs {b}"
    ia, ib = torch.isinf(a), torch.isinf(b)
    assert torch.equal(ia, ib) and torch.equal(a[ia], b[ib]), f"{what}: inf {a} vs {b}"
    m = ~(torch.isnan(a) | ia)
    torch.testing.assert_close(a[m], b[m], atol=1e-4, rtol=1e-4, msg=what)


def _flat(o):
    if isinstance(o, torch.Tensor):
        return [o]
    return [t for x in o for t in _flat(x)]


def _check(model: nn.Module, *inputs, train: bool = False, edit=None, calls: int = 1):
    model.train(train)
    ref = copy.deepcopy(model).double()
    fm = cupyfuse.from_model(model)
    for call in range(calls):
        if edit is not None and call:
            with torch.no_grad():
                edit(model)
                edit(ref)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            got = fm(*[t.clone() for t in inputs])
            want = ref(*[t.double() if t.is_floating_point() else t for t in inputs])
        for i, (a, b) in enumerate(zip(_flat(got), _flat(want))):
            _same(a, b, f"call {call} result {i}")


def _x(b: int, n: int = 5) -> torch.Tensor:
    x = torch.randn(b, n, generator=torch.Generator().manual_seed(b))
    if b >= 4:
        x[1, 0] = float("nan")
        x[2, 1] = float("inf")
        x[3] = 0.0
    return x


class Tail(nn.Module):
    def __init__(self, f, n: int = 5, m: int = 7):
        super().__init__()
        self.fc = nn.Linear(n, m)
        self.w = nn.Parameter(torch.randn(m))
        self.bn = nn.BatchNorm1d(m)
        self.f = f

    def forward(self, x):
        return self.f(self, self.fc(x))


FORMS = {
    "norm_p0_relu": lambda s, h: torch.linalg.vector_norm(torch.relu(h), ord=0, dim=-1),
    "norm_pneg1_relu": lambda s, h: torch.linalg.vector_norm(torch.relu(h), ord=-1, dim=-1),
    "norm_pninf_relu": lambda s, h: torch.linalg.vector_norm(torch.relu(h), ord=float("-inf"), dim=-1),
    "norm_p05": lambda s, h: torch.linalg.vector_norm(h, ord=0.5, dim=-1),
    "cos_zero": lambda s, h: F.cosine_similarity(h * 0, h, dim=1),
    "cos_param_tiny": lambda s, h: F.cosine_similarity(h * 1e-10, s.w * 1e-5, dim=-1, eps=1e-8),
    "pdist_p0": lambda s, h: F.pairwise_distance(h, h * 2, p=0),
    "pdist_param_neg_eps": lambda s, h: F.pairwise_distance(h, s.w, p=1, eps=-1.0),
    "avg_ceil_s_gt_k_noinc": lambda s, h: F.avg_pool1d(h.unsqueeze(1), 2, 5, 1, ceil_mode=True,
                                                       count_include_pad=False).flatten(1),
    "max_window_eq_len": lambda s, h: F.max_pool1d(h.unsqueeze(1), 7, 1, 3).flatten(1),
    "adaptive_more_than_len": lambda s, h: F.adaptive_avg_pool1d(h.unsqueeze(1), 10).flatten(1),
    "cumsum_view_mid": lambda s, h: h[:, 1:].view(-1, 3, 2).cumsum(1).flatten(1),
    "stack_norm0": lambda s, h: torch.stack([h, h * s.w]).norm(dim=0),
    "stack_dim2_slice": lambda s, h: torch.stack([h, -h], 2)[:, 1:4].flatten(1),
    "arange_float_step": lambda s, h: h + torch.arange(-3.3, 3.7, 1.0),
    "gem_param": lambda s, h: h.abs().pow(s.w.abs()),
    "wpool_bn": lambda s, h: F.avg_pool1d(s.bn(h).unsqueeze(1), 3, 2, 1, ceil_mode=True,
                                          count_include_pad=False).squeeze(1),
    "cumsum_bn": lambda s, h: s.bn(h).cumsum(1),
}


def _edit(m: nn.Module) -> None:
    m.w.mul_(-2)
    m.bn.weight.add_(0.5)
    m.bn.running_var.fill_(3.0)
    m.fc.weight.mul_(-1)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", sorted(FORMS))
def test_v14_forms_with_edits_between_calls(name, train):
    torch.manual_seed(0)
    _check(Tail(FORMS[name]), _x(6), train=train, edit=_edit, calls=3)
    if not train:
        _check(Tail(FORMS[name]), _x(1), edit=_edit, calls=2)


@pytest.mark.parametrize("m", [31, 33, 65])
@pytest.mark.parametrize("pattern", ["inf_then_ninf", "nan_mid", "huge"])
def test_cumsum_across_chunks(m, pattern):
    torch.manual_seed(0)
    model = Tail(lambda s, h: h.cumsum(1), n=3, m=m)
    with torch.no_grad():
        model.fc.bias.zero_()
        if pattern == "inf_then_ninf":
            model.fc.bias[5] = float("inf")
            model.fc.bias[m - 2] = float("-inf")
        elif pattern == "nan_mid":
            model.fc.bias[m // 2] = float("nan")
        else:
            model.fc.bias[:] = 1e30
            model.fc.bias[m // 3] = -3e38
    for b in (1, 3):
        _check(model, torch.randn(b, 3))


class SeqBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        return torch.relu(self.bn(self.fc(x).transpose(1, 2))).sum(2)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_batchnorm_of_a_transpose_and_its_running_stats(train):
    torch.manual_seed(0)
    model = SeqBN()
    ref = copy.deepcopy(model).double().train(train)
    x = torch.randn(5, 3, 5)
    _check(model, x, train=train, calls=3)
    with torch.no_grad():
        for _ in range(3):
            ref(x.double())
    torch.testing.assert_close(model.bn.running_mean.double(), ref.bn.running_mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.bn.running_var.double(), ref.bn.running_var, atol=1e-5, rtol=1e-5)


class ArcOneHot(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 7)

    def forward(self, x, label):
        cosine = F.normalize(self.fc(x))
        one_hot = torch.ones(cosine.size())
        alias = one_hot.scatter_(1, label.view(-1, 1).long(), 0)
        alias.add_(1)
        return cosine * one_hot


def test_one_hot_through_an_alias_of_the_scatter_result():
    torch.manual_seed(0)
    _check(ArcOneHot(), _x(5), torch.tensor([6, 0, 3, 3, 1]))
