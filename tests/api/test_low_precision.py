"""Calls cupyfuse's float32 kernels would not compute as torch does: under autocast (torch
picks each op's dtype) and with bf16/fp16 operands. They run torch's own ops -- a fused
module's original forward, fused_linear's ``tail(F.linear(...))`` -- with a warning once,
so the result (values, dtype, gradients) is eager's, not a float32 answer."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cupyfuse
from cupyfuse import runner


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 12)
        self.ln = nn.LayerNorm(12)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.softmax(self.ln(F.gelu(self.fc(x))) * scale, dim=-1)


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    runner._warned_torch.clear()


@pytest.mark.parametrize("make", ("from_model", "fused_class"))
def test_autocast_follows_torch(make: str) -> None:
    torch.manual_seed(0)
    model = Head()
    if make == "from_model":
        fm = cupyfuse.from_model(copy.deepcopy(model))
    else:
        fm = cupyfuse.fused_class(Head)()
        fm.load_state_dict(model.state_dict())
    x = torch.randn(5, 16)
    with torch.no_grad():
        fm(x)   # (a float32 call first: prepared state must not leak into autocast)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x, 2.0)
        with pytest.warns(UserWarning, match="autocast on cpu"):
            got = fm(x, 2.0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # once per class and reason
            again = fm(x, scale=2.0)
    assert got.dtype == want.dtype and torch.equal(got, want) and torch.equal(again, want)
    with torch.no_grad():   # outside autocast: the fused float32 call again
        assert fm(x).dtype == torch.float32


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_sixteen_bit_models_and_inputs(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    model = Head().to(dtype)
    fm = cupyfuse.from_model(copy.deepcopy(model))
    x = torch.randn(5, 16, dtype=dtype)
    with pytest.warns(UserWarning, match=str(dtype)):
        got = fm(x)
    assert got.dtype == dtype and torch.equal(got, model(x))
    runner._warned_torch.clear()   # (the warning above was this class's and reason's)
    f32 = cupyfuse.from_model(Head())   # a float32 model fed a 16-bit input: torch's error
    with pytest.raises(RuntimeError, match="dtype"), pytest.warns(UserWarning,
                                                                 match=f"a {dtype} input"):
        f32(x)


def test_autocast_training_gradients_are_eagers() -> None:
    torch.manual_seed(2)
    model = Head()
    ref = copy.deepcopy(model)
    fm = cupyfuse.from_model(model)
    x = torch.randn(6, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fm(x).float().pow(2).sum().backward()
            ref(x).float().pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_fused_linear_under_autocast_and_in_bf16() -> None:
    torch.manual_seed(3)
    x, w, b = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)

    def tail(h: torch.Tensor, t: float) -> torch.Tensor:
        return torch.logsumexp(h * t, dim=-1)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(UserWarning, match="autocast"):
            got = cupyfuse.fused_linear(x, w, b, tail, 0.5)
        want = tail(F.linear(x, w, b), 0.5)
    assert got.dtype == want.dtype and torch.equal(got, want)
    xb, wb, bb = (t.bfloat16() for t in (x, w, b))
    with pytest.warns(UserWarning, match="16-bit"):
        got = cupyfuse.fused_linear(xb, wb, bb, tail, 0.5)
    assert torch.equal(got, tail(F.linear(xb, wb, bb), 0.5))
    ct = cupyfuse.CudaTail(map="v", reduce="sum", identity="0.0f", reference=lambda h: h.sum(1))
    with pytest.raises(TypeError, match="CudaTail runs float32 only"):
        cupyfuse.fused_linear(xb, wb, bb, ct)
