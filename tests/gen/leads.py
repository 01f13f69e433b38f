"""Random Linear + tail models on (batch, seq..., features) inputs
(tests/frontend/test_sequence_inputs.py and test_sequence_inputs_gpu.py).

A drawn :class:`LeadSpec` is a model: ``Linear(K, N)`` (``nn.Linear`` or ``x @ W.t()``),
then 1..6 row-wise ops (activations, constants, per-feature parameters, softmax /
log_softmax / LayerNorm / F.normalize / reductions with keepdim along the last dim, a
second Linear, the input added back, a second input ``y`` of the full shape), and maybe a
final reduction that drops the last dim. The last dim is spelled ``-1`` or as a positive
index (``h.dim() - 1``, ``2`` for 3-D values), so the translator's mapping of torch's
dims is exercised both ways. ``bad`` specs put one op along a leading dim (the batch or
a sequence dim): cupyfuse must refuse them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

# (name, keeps the width) -- ops applied to h in the forward, all along the last dim
ROW_OPS = ("relu", "gelu", "gelu_tanh", "silu", "tanh", "sigmoid", "affine_const",
           "param_mul", "param_add", "softmax", "log_softmax", "layer_norm", "layer_norm_mod",
           "normalize", "sum_keep", "amax_keep", "lse_keep", "mean_keep", "center", "clamp",
           "linear2", "residual_x", "input_y", "dropout_eval")
FINALS = (None, "sum", "logsumexp", "amax", "mean")
#: ops along a leading dim (the batch, or a sequence dim of size > 1)
BAD_OPS = ("softmax_lead", "sum_lead", "amax_lead", "cat_lead", "index_lead", "view_merge",
           "batchnorm", "lse_lead")
#: of those, the ones cupyfuse computes over the sequence of a (batch, seq, features) input
#: (tests/frontend/test_sequence_reductions.py): refused where there are two leading dims
#: of size > 1
SEQ_OK = ("softmax_lead", "sum_lead", "index_lead", "lse_lead")


@dataclass
class LeadSpec:
    B: int
    lead: tuple[int, ...]
    K: int
    N: int
    ops: list[tuple[str, int]]      # (op, how its dim is spelled: 0 -> -1, 1 -> positive)
    final: str | None
    matmul: bool
    bad: str | None = None
    specials: list[tuple[tuple[int, ...], float]] = field(default_factory=list)

    @property
    def x_shape(self) -> tuple[int, ...]:
        return (self.B,) + self.lead + (self.K,)

    def __str__(self) -> str:
        return (f"x{self.x_shape} N={self.N} ops={self.ops} final={self.final} "
                f"matmul={self.matmul} bad={self.bad} specials={self.specials}")


def draw(d: Any, bad: bool = False) -> LeadSpec:
    """A spec from a draw interface with ``int(lo, hi)`` and ``choice(seq)``."""
    nlead = d.int(1, 2)
    lead = tuple(d.choice((1, 2, 3, 5, 7)) for _ in range(nlead))
    if sum(1 for s in lead if s > 1) == 0:
        lead = lead[:-1] + (3,)
    K = d.int(2, 20)
    N = d.choice((K, d.int(2, 24)))
    ops = [(d.choice(ROW_OPS), d.int(0, 1)) for _ in range(d.int(1, 6))]
    spec = LeadSpec(B=d.choice((1, 2, 3, 5)), lead=lead, K=K, N=N, ops=ops,
                    final=d.choice(FINALS), matmul=d.bool(0.3))
    if bad:
        spec.bad = d.choice(BAD_OPS)
        if spec.bad == "batchnorm":
            spec.final = None
        if spec.bad in SEQ_OK and sum(1 for s in lead if s > 1) < 2:
            # (one over the sequence of a (batch, seq, features) input is computed)
            spec.lead = tuple(s if s > 1 else 2 for s in lead) if len(lead) == 2 else lead + (2,)
    for _ in range(d.int(0, 2)):
        pos = tuple(d.int(0, s - 1) for s in spec.x_shape[:-1])
        spec.specials.append((pos, d.choice((float("nan"), float("inf"), float("-inf")))))
    return spec


class LeadModel(nn.Module):
    def __init__(self, spec: LeadSpec) -> None:
        super().__init__()
        self.spec = spec
        K, N = spec.K, spec.N
        if spec.matmul:
            self.w = nn.Parameter(torch.randn(N, K) / K ** 0.5)
        else:
            self.fc = nn.Linear(K, N)
        self.fc2 = nn.Linear(N, N)
        self.g = nn.Parameter(torch.rand(N) + 0.5)
        self.b = nn.Parameter(torch.randn(N))
        self.ln = nn.LayerNorm(N)
        self.drop = nn.Dropout(0.3)
        self.bn = nn.BatchNorm1d(spec.lead[0])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s = self.spec
        h = x @ self.w.t() if s.matmul else self.fc(x)
        width = s.N
        for op, pos in s.ops:
            last = -1 if pos == 0 else h.dim() - 1
            if op == "relu":
                h = torch.relu(h)
            elif op == "gelu":
                h = F.gelu(h)
            elif op == "gelu_tanh":
                h = F.gelu(h, approximate="tanh")
            elif op == "silu":
                h = F.silu(h)
            elif op == "tanh":
                h = torch.tanh(h)
            elif op == "sigmoid":
                h = torch.sigmoid(h)
            elif op == "affine_const":
                h = h * 0.75 - 0.5
            elif op == "param_mul" and width == s.N:
                h = h * self.g
            elif op == "param_add" and width == s.N:
                h = h + self.b
            elif op == "softmax":
                h = torch.softmax(h, dim=last)
            elif op == "log_softmax":
                h = F.log_softmax(h, dim=last)
            elif op == "layer_norm":
                h = F.layer_norm(h, h.shape[-1:])
            elif op == "layer_norm_mod" and width == s.N:
                h = self.ln(h)
            elif op == "normalize":
                h = F.normalize(h, dim=last)
            elif op == "sum_keep":
                h = h.sum(dim=last, keepdim=True)
                width = 1
            elif op == "amax_keep":
                h = torch.amax(h, dim=last, keepdim=True)
                width = 1
            elif op == "lse_keep":
                h = torch.logsumexp(h, dim=last, keepdim=True)
                width = 1
            elif op == "mean_keep":
                h = h.mean(dim=last, keepdim=True)
                width = 1
            elif op == "center":
                h = h - h.mean(dim=last, keepdim=True)
            elif op == "clamp":
                h = torch.clamp(h, -1.5, 2.0)
            elif op == "linear2" and width == s.N:
                h = self.fc2(h)
            elif op == "residual_x" and width in (s.K, 1) and s.K == s.N:
                h = h + x
                width = s.K
            elif op == "input_y" and width in (s.N, 1):
                h = h * y
                width = s.N
            elif op == "dropout_eval":
                h = self.drop(h) if not self.training else h
        ld = 1 + next(i for i, n in enumerate(s.lead) if n > 1)   # a leading dim of size > 1
        if s.bad == "softmax_lead":
            h = torch.softmax(h, dim=ld)
        elif s.bad == "sum_lead":
            h = h.sum(dim=ld, keepdim=True)
        elif s.bad == "amax_lead":
            h = h.amax(dim=0)
        elif s.bad == "lse_lead":
            h = torch.logsumexp(h, dim=ld - h.dim())
        elif s.bad == "cat_lead":
            h = torch.cat([h, h], dim=ld)
        elif s.bad == "index_lead":
            h = h[(slice(None),) * ld + (0,)]
        elif s.bad == "view_merge":   # (two features a row: (batch, seq, 1) -> (batch, seq)
            # is a view, which a reduction over the sequence may follow)
            h = torch.cat([h, h], -1).reshape(h.shape[0], -1)
        elif s.bad == "batchnorm":
            h = self.bn(h)
        if s.final == "sum":
            h = h.sum(-1)
        elif s.final == "logsumexp":
            h = torch.logsumexp(h, dim=h.dim() - 1)
        elif s.final == "amax":
            h = h.amax(-1)
        elif s.final == "mean":
            h = h.mean(dim=h.dim() - 1)
        return h


def inputs(spec: LeadSpec, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(spec.x_shape, generator=g) * 2
    for pos, v in spec.specials:
        x[pos] = v   # one whole row (batch, seq...) of NaN / inf
    y = torch.rand(spec.x_shape[:-1] + (spec.N,), generator=g) + 0.5
    return x, y


def build(spec: LeadSpec, seed: int) -> LeadModel:
    torch.manual_seed(seed)
    return LeadModel(spec).eval()
