"""A value times a 1-D parameter (`h @ q`, `torch.matmul(h, q)`, `h.matmul(q)`): torch
contracts h's last dim with q and drops it -- the row sums of ``h * q`` (lower.linear's
``matvec``), e.g. a learned query scoring each position of a sequence; and a parameter's
``.shape`` read as numbers (``q.shape[0] ** 0.5``). Against float64 torch on the CPU and
(marked ``gpu``) on the GPU, NaN rows and batch 1 included; the forms torch refuses are
refused."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import cupyfuse
from cupyfuse import TailError
from helpers import quiet, refs
from helpers import DEVICES
from gen.tails import assert_matches


class QueryPool(nn.Module):
    """Learned-query attention pooling over (batch, seq, d_in)."""

    def __init__(self, form: str, d_in: int = 13, d_k: int = 8) -> None:
        super().__init__()
        self.form = form
        self.key = nn.Linear(d_in, d_k)
        self.value = nn.Linear(d_in, d_in)
        self.query = nn.Parameter(torch.randn(d_k))
        self.register_buffer("qbuf", torch.randn(d_k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.key(x)
        f = self.form
        if f == "at":
            s = k @ self.query / (self.query.shape[0] ** 0.5)
        elif f == "matmul":
            s = torch.matmul(k, self.query) * self.query.size(0) ** -0.5
        elif f == "method":
            s = k.matmul(self.qbuf)
        elif f == "tanh":
            s = torch.tanh(k) @ self.query
        else:
            raise AssertionError(f)
        a = torch.softmax(s, dim=-1)
        return (a.unsqueeze(-1) * self.value(x)).sum(1)


class RowScore(nn.Module):
    """(batch, features) rows scored by a vector: one number per row."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(10, 7)
        self.v = nn.Parameter(torch.randn(7))
        self.w = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        if self.form == "score":
            return h @ self.v
        if self.form == "score_keep":
            return (h @ self.v).unsqueeze(-1) + h.sum(-1, keepdim=True)
        if self.form == "mm":          # torch.mm takes matrices only: torch raises
            return h.mm(self.v)
        if self.form == "mismatch":    # 7 features against a vector of 5: torch raises
            return h @ self.w
        raise AssertionError(self.form)


def _x(shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2
    if shape[0] > 2:
        x.view(-1, shape[-1])[1] = float("nan")
        x.view(-1, shape[-1])[-1, 0] = float("inf")
    return x


def _check(model: nn.Module, x: torch.Tensor, device: str, what: str) -> None:
    ref64, ref32 = refs(model, (x,))
    fm = cupyfuse.from_model(model.to(device))
    for _ in range(2 if device != "cpu" else 1):   # (the GPU: the general path, then prepared)
        out = quiet(fm, x.to(device))
        assert out.shape == ref64.shape, what
        assert_matches(out.cpu(), ref64, ref32, what=what)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["at", "matmul", "method", "tanh"])
@pytest.mark.parametrize("shape", [(5, 6, 13), (1, 1, 13), (3, 9, 13), (1, 4, 13)])
def test_query_pooling(form, shape, device):
    torch.manual_seed(0)
    _check(QueryPool(form).eval(), _x(shape, 1), device, f"{form} {shape}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["score", "score_keep"])
@pytest.mark.parametrize("batch", [1, 4, 37])
def test_row_scores(form, batch, device):
    torch.manual_seed(1)
    _check(RowScore(form).eval(), _x((batch, 10), 2), device, f"{form} {batch}")


@pytest.mark.parametrize("form,match", [("mm", "2-D parameter"), ("mismatch", "size mismatch")])
def test_forms_torch_refuses_are_refused(form, match):
    torch.manual_seed(1)
    m = RowScore(form).eval()
    with pytest.raises(Exception):
        quiet(m, torch.randn(3, 10))   # torch itself raises
    with pytest.raises(TailError, match=match) as e:
        quiet(cupyfuse.from_model(m), torch.randn(3, 10))
    assert "forward" in str(e.value) and "test_matvec.py" in str(e.value)
