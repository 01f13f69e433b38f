"""Linear + tail on (batch, seq..., features) inputs on the GPU: seeded models from
tests/gen/leads.py (the CPU file draws them with hypothesis) against float64 torch, each
called three times (the first call runs the general path and prepares the launches, the
later ones run them), in grad mode with parameters requiring grad, sizes from launch-bound
to the tensor-core engine, NaN/inf rows included."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import cupyfuse
from cupyfuse.interop import cupy_available

from gen.leads import build, draw, inputs
from test_sequence_inputs import FFN, _TAILS, _OneRow
from gen.tails import RandDraw, assert_matches, references

pytestmark = [
    pytest.mark.usefixtures("fp32_matmul"),
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and cupy_available()),
                       reason="needs a CUDA GPU visible to both torch and CuPy"),
]


def _calls(fused_model: nn.Module, *args: torch.Tensor, n: int = 3) -> list[torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [fused_model(*args).cpu() for _ in range(n)]


@pytest.mark.parametrize("seed", range(40))
def test_seeded_row_wise_tails(seed):
    spec = draw(RandDraw(seed))
    model = build(spec, seed)
    x, y = inputs(spec, seed)
    ref64, _, ref32 = references(model, [x, y])
    fm = cupyfuse.from_model(model.cuda())
    for i, out in enumerate(_calls(fm, x.cuda(), y.cuda())):
        assert_matches(out, ref64, ref32, what=f"call {i}: {spec}")


@pytest.mark.parametrize("shape,hidden", [((2, 7, 64), 96), ((4, 128, 256), 512),
                                          ((1, 3, 1024), 2048), ((8, 64, 512), 2048)])
def test_transformer_ffn_block_all_paths(shape, hidden):
    """Small (skinny kernel), mid (prepared engine launches) and larger sizes (the first
    call runs the general path, the later ones the prepared launches where they apply)."""
    torch.manual_seed(0)
    model = FFN(shape[-1], hidden)
    x = torch.randn(shape)
    x[0, 1] = float("nan")
    ref64, _, ref32 = references(model, [x])
    fm = cupyfuse.fused_class(FFN)
    torch.manual_seed(0)
    m = fm(shape[-1], hidden).cuda()
    outs = _calls(m, x.cuda())
    for i, out in enumerate(outs):
        assert out.shape == shape
        assert_matches(out, ref64, ref32, what=f"FFN {shape} call {i}")


def test_non_contiguous_leading_dims_copy_once_and_stay_right():
    """A (seq, batch, K) tensor permuted to (batch, seq, K): its rows are not one stride
    apart, so the rows are copied (never read through the prepared launches' pointers)."""
    torch.manual_seed(1)
    model = FFN(32, 48)
    xs = torch.randn(6, 3, 32)
    x = xs.permute(1, 0, 2)
    ref64, _, ref32 = references(model, [x.contiguous()])
    fm = cupyfuse.from_model(model.cuda())
    for out in _calls(fm, xs.cuda().permute(1, 0, 2)):
        assert_matches(out, ref64, ref32, what="permuted x")


@pytest.mark.parametrize("name", ["identity", "softmax_gelu", "layer_norm", "lse_keep_pos",
                                  "sum", "pool_last"])
@pytest.mark.parametrize("shape", [(2, 5, 64), (3, 1, 4, 64), (4, 96, 512)])
@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_fused_linear_leading_dims(name, shape, kind):
    """fused_linear on (batch, seq..., K), torch and CuPy operands, three calls (the
    prepared launches from the second on), NaN rows included."""
    from test_sequence_inputs import TAILS

    if name == "pool_last" and len(shape) > 3:
        shape = shape[:1] + shape[2:]
    torch.manual_seed(len(shape) + shape[-1])
    K, N = shape[-1], 48
    x = torch.randn(shape) * 2
    x.view(-1, K)[1] = float("nan")
    w, b = torch.randn(N, K) / K ** 0.5, torch.randn(N)
    tail = TAILS[name]
    h64 = x.double() @ w.double().t() + b.double()
    h32 = x @ w.t() + b
    ref64 = h64 if tail is None else tail(h64)
    ref32 = h32 if tail is None else tail(h32)
    ops = [x.cuda(), w.cuda(), b.cuda()]
    if kind == "cupy":
        import cupy

        ops = [cupy.asarray(t) for t in ops]
    for i in range(3):
        out = cupyfuse.fused_linear(*ops, tail)
        out = torch.as_tensor(out.get()) if kind == "cupy" else out.cpu()
        assert_matches(out, ref64, ref32, what=f"{name} {shape} {kind} call {i}")


def test_fused_linear_leading_dims_strided_extra_is_copied_not_misread():
    """An extra input whose (batch, seq) rows are not one stride apart is copied each
    call; the prepared launches (which take the caller's address) must not read it."""
    torch.manual_seed(2)
    x, w, b = torch.randn(3, 6, 32).cuda(), torch.randn(40, 32).cuda(), torch.randn(40).cuda()
    ys = torch.rand(6, 3, 40).cuda()
    y = ys.permute(1, 0, 2)          # (3, 6, 40), not a view of (18, 40) rows

    def gated(h, y):
        return h * y

    want = gated(x.double() @ w.double().t() + b.double(), y.double())
    for _ in range(3):
        torch.testing.assert_close(cupyfuse.fused_linear(x, w, b, gated, y).double(), want,
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("how", ["fill", "where", "mul"])
def test_bool_mask_inputs_on_the_gpu(how):
    """Bool mask inputs run as 0/1 (a copy per call, the general path each call)."""
    from test_sequence_inputs import _Masked

    torch.manual_seed(7)
    m = _Masked(how).cuda()
    x, mask = torch.randn(2, 5, 8, device="cuda"), torch.rand(2, 5, 6, device="cuda") > 0.5
    with torch.no_grad():
        want = m(x, mask)
    fm = cupyfuse.from_model(m)
    for _ in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = fm(x, mask)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("how", ["mul", "sum", "softmax"])
@pytest.mark.parametrize("rows", [(7, 1), (1, 7), (40, 1)])
def test_one_row_inputs_broadcast_against_the_batch(how, rows):
    """A (1, N) input against a batch (and an x of one row against a batch of y): torch
    broadcasts; the kernels read every input by the batch's rows (the input's own rows
    would be read out of bounds)."""
    torch.manual_seed(8)
    m = _OneRow(how).cuda()
    fm = cupyfuse.from_model(m)
    x = torch.randn(rows[0], 32, device="cuda")
    y = torch.rand(rows[1], 24, device="cuda") + 0.5
    with torch.no_grad():
        want = m(x, y)
    w, b = m.fc.weight.detach(), m.fc.bias.detach()
    for _ in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = fm(x, y)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        got = cupyfuse.fused_linear(x, w, b, _TAILS[how], y)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
