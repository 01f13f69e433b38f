"""Every record's derivative (cupyfuse/ops/registry.py, ``derivative``) against torch's
autograd of the record's own ``torch_fn``.

For each primitive op, the program ``op(x[, y[, z]])`` is differentiated by
:func:`cupyfuse.ir.derivative.derivative` and its backward program run on the CPU path
(``run_cpu``); the gradients of every operand are compared, element for element, with
float64 autograd (within 1e-4) and for NaN / +-inf placement with float32 autograd, on
values that hit every branch: NaN, +-inf, +-0, the bounds of clamp-like ops and of
hardswish / hardsigmoid / relu6, ties of binary operands (maximum's halved gradient),
and random values. Then: an op without a formula for an operand (fmod's divisor)
declines the backward program, and such a call still gets torch's gradients (the
recompute); comparisons and ``detach`` pass no gradient.
"""
from __future__ import annotations

import math

import pytest
import torch

from cupyfuse.backend.cpu import run_cpu
from cupyfuse.ir.derivative import NoDerivative, derivative
from cupyfuse.ir.program import BATCH, Builder
from cupyfuse.ops.registry import MAPS
from gen.tails import assert_matches

W = 24   # features per row
#: attribute values where a record has no defaults (or where other values reach more
#: branches)
ATTRS = {"clamp": (-0.5, 0.7), "hardtanh": (-1.0, 1.0), "leaky_relu": (0.1,),
         "elu": (1.3,), "softplus": (2.0, 5.0)}
#: no gradient at all (masks, comparisons, the logsumexp shift)
NONE = {"gt", "lt", "ge", "le", "eq", "ne", "detach", "finite_or_zero"}


def _values(seed: int, op: str, pos: int) -> torch.Tensor:
    """(6, W) float32 operands: row 0 the special values (and the op's bounds), the
    others random (two rows of ties between the operands of a binary op)."""
    g = torch.Generator().manual_seed(seed * 7 + pos)
    t = torch.randn(6, W, generator=g) * 2.0
    attrs = [a for a in ATTRS.get(op, MAPS[op].defaults) if math.isfinite(a)]
    special = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 3.0, -3.0, 6.0, -6.0,
               0.5, -0.5, 2.0, 25.0, -25.0] + attrs + [a * 1.0001 for a in attrs]
    row = torch.tensor(special[:W] + [0.25] * (W - len(special[:W])))
    t[0] = row if pos == 0 else row.flip(0)
    if op == "where" and pos == 0:   # (a mask: 0 or 1, NaN counting as true)
        t = (t > 0).float()
        t[0, :3] = torch.tensor([math.nan, 0.0, 1.0])
    if op in ("log", "log1p", "log2", "sqrt", "rsqrt") and pos == 0:
        t[1:] = t[1:].abs()
    return t


def _program(op: str) -> tuple:
    rec = MAPS[op]
    b = Builder()
    ins = [b.input(i, (BATCH, W)) for i in range(rec.arity)]
    attrs = ATTRS.get(op, rec.defaults)
    b.p.out = b.map(op, *ins, attrs=attrs)
    b.p.n_inputs = rec.arity
    return b.p, attrs


def _torch_grads(op: str, xs: list[torch.Tensor], attrs: tuple, g: torch.Tensor,
                 dtype: torch.dtype, want: list[int]) -> list[torch.Tensor]:
    ts = [x.to(dtype).requires_grad_(i in want) for i, x in enumerate(xs)]
    y = MAPS[op].torch_fn(*ts, *attrs)
    got = torch.autograd.grad(y, [ts[i] for i in want], g.to(dtype), allow_unused=True)
    return [torch.zeros_like(ts[i]) if r is None else r for i, r in zip(want, got)]


def _wanted(op: str) -> list[int]:
    if op == "where":
        return [1, 2]
    if op == "fmod":
        return [0]
    return list(range(MAPS[op].arity))


def _backward(op: str, xs: list[torch.Tensor], g: torch.Tensor, want: list[int]) -> list:
    prog, attrs = _program(op)
    bw = derivative(prog, frozenset(want), frozenset())
    outs = run_cpu(bw.prog, xs + [g], [], training_updates=False)
    got = {j: torch.zeros_like(xs[j]) for j in want}
    for (kind, ref), v in zip(bw.outs, outs):
        assert kind == "in"
        got[ref] = got[ref] + v.reshape(xs[ref].shape)
    return [got[j] for j in want]


@pytest.mark.parametrize("op", sorted(set(MAPS) - NONE))
@pytest.mark.parametrize("seed", [0, 1])
def test_record_derivative_matches_torch(op: str, seed: int) -> None:
    rec = MAPS[op]
    xs = [_values(seed, op, i) for i in range(rec.arity)]
    if op in ("maximum", "minimum", "hypot", "atan2", "logaddexp"):
        xs[1][2:4] = xs[0][2:4]            # ties (maximum's halved gradient)
    if op == "pow":
        xs[1][1:] = xs[1][1:].round() / 2  # half-integer and integer exponents, 0 among them
    g = torch.randn(6, W, generator=torch.Generator().manual_seed(seed + 100))
    want = _wanted(op)
    _, attrs = _program(op)
    ours = _backward(op, xs, g, want)
    ref64 = _torch_grads(op, xs, attrs, g, torch.float64, want)
    ref32 = _torch_grads(op, xs, attrs, g, torch.float32, want)
    for j, o, r64, r32 in zip(want, ours, ref64, ref32):
        assert o.dtype == torch.float32
        assert_matches(o, r64, r32, f"d {op} / d operand {j}")


@pytest.mark.parametrize("op", sorted(NONE))
def test_masks_pass_no_gradient(op: str) -> None:
    prog, _ = _program(op)
    with pytest.raises(NoDerivative, match="no gradient"):
        derivative(prog, frozenset(range(MAPS[op].arity)), frozenset())


def test_an_operand_without_a_formula_declines() -> None:
    prog, _ = _program("fmod")
    with pytest.raises(NoDerivative, match="fmod"):
        derivative(prog, frozenset({0, 1}), frozenset())


def test_a_declined_program_still_differentiates() -> None:
    """fmod's divisor requires grad: the call takes torch's autograd of the recompute."""
    import torch.nn as nn

    from cupyfuse import from_model

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(5, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.fmod(self.fc(x), y)

    torch.manual_seed(0)
    m = M()
    x = torch.randn(3, 5, requires_grad=True)
    y = (torch.rand(3, 4) + 0.5).requires_grad_(True)
    out = from_model(m)(x, y)
    out.sum().backward()
    x2, y2 = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    torch.fmod(m.double().fc(x2), y2).sum().backward()
    torch.testing.assert_close(y.grad.double(), y2.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x.grad.double(), x2.grad, atol=1e-4, rtol=1e-4)
