"""linear_cross_entropy: the loss and the gradients of x, weight and bias against float64
autograd of ``F.cross_entropy(F.linear(...))`` for drawn shapes, chunkings, reductions,
class weights, label smoothing and ignored targets; the buffer shared with the weight's
gradient never overwrites logits still to be read; NaN/inf logits and bad targets; frozen
parameters; errors; the same bits run to run. On a GPU (marker gpu): the kernels in
float32, bfloat16 and float16 against float64 and against eager's own error, and the peak
memory of a training step."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import cupyfuse
from cupyfuse import lmhead
from helpers import DEVICES, property_settings


def _reference(x, W, b, y, cw, ls, red, ignore=-100):
    args = [t.detach().double().requires_grad_() for t in (x, W)]
    bb = b.detach().double().requires_grad_() if b is not None else None
    out = F.cross_entropy(F.linear(args[0], args[1], bb), y, weight=None if cw is None else cw.double(),
                          ignore_index=ignore, label_smoothing=ls, reduction=red)
    return out, args + ([bb] if bb is not None else [])


def _case(device, T, H, V, vc, red, ls, use_cw, use_b, frac_ignored, seed, dtype=torch.float32,
          scale=1.0, need=(True, True, True)):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * scale).to(device)
    W = (torch.randn(V, H, generator=g) * H ** -0.5).to(device)
    b = torch.randn(V, generator=g).to(device) if use_b else None
    y = torch.randint(0, V, (T,), generator=g)
    y[torch.rand(T, generator=g) < frac_ignored] = -100
    y = y.to(device)
    cw = (torch.rand(V, generator=g) + 0.25).to(device) if use_cw else None
    ref, rargs = _reference(x, W, b, y, cw, ls, red)
    cot = torch.randn(ref.shape, generator=g, dtype=torch.float64).to(device)
    # the gradients a torch loop would take (only the leaves that need one)
    want = [a for a, n in zip(rargs, need) if n]
    gref = torch.autograd.grad(ref, want, cot) if want else []
    ins = [t.detach().to(dtype).requires_grad_(n) for t, n in zip((x, W), need)]
    bb = b.detach().to(dtype).requires_grad_(need[2]) if b is not None else None
    out = lmhead.linear_cross_entropy(ins[0], ins[1], y, bb, label_smoothing=ls, reduction=red,
                                      class_weight=cw, chunk_rows=vc)
    leaves = [t for t in ins + ([bb] if bb is not None else []) if t.requires_grad]
    got = torch.autograd.grad(out, leaves, cot.to(out.dtype)) if leaves else []
    return out, ref, got, None, gref


def _close(a, ref, tol):
    a, ref = a.double(), ref.double()
    nan_ok = torch.equal(torch.isnan(a), torch.isnan(ref))
    fin = ~torch.isnan(ref)
    scale = max(1.0, ref[fin].abs().max().item()) if fin.any() else 1.0
    err = (a[fin] - ref[fin]).abs().max().item() / scale if fin.any() else 0.0
    return nan_ok and err <= tol, err


shapes = st.tuples(st.integers(1, 40), st.integers(1, 48), st.integers(2, 70))


@property_settings(40)
@given(shape=shapes, vc=st.sampled_from([8, 16, 24, None]), red=st.sampled_from(["mean", "sum", "none"]),
       ls=st.sampled_from([0.0, 0.1, 0.7]), use_cw=st.booleans(), use_b=st.booleans(),
       frac=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_drawn_heads_match_float64(shape, vc, red, ls, use_cw, use_b, frac, seed):
    T, H, V = shape
    out, ref, got, _, gref = _case("cpu", T, H, V, vc, red, ls, use_cw, use_b, frac, seed)
    ok, err = _close(out, ref, 1e-4)
    assert ok, (err, out, ref)
    for a, r in zip(got, gref):
        ok, err = _close(a, r, 1e-4)
        assert ok, err


@pytest.mark.parametrize("T,H", [(8, 64), (32, 32), (31, 32), (64, 16), (1, 5)])
@pytest.mark.parametrize("vc", [8, 24])
def test_every_layout_gives_the_separate_gradients(T, H, vc):
    """tokens < hidden, = hidden (the shared buffer), > hidden (apart), one token."""
    out, ref, got, _, gref = _case("cpu", T, H, 53, vc, "mean", 0.0, False, True, 0.1, 3)
    assert _close(out, ref, 1e-4)[0]
    for a, r in zip(got, gref):
        assert _close(a, r, 1e-4)[0]


@property_settings(200)
@given(T=st.integers(1, 200), H=st.integers(1, 200), V=st.integers(1, 500), vc8=st.integers(1, 40))
def test_shared_layout_never_overwrites_unread_logits(T, H, V, vc8):
    """The order backward writes dW in: chunk c's gradient [c vc H, c vc H + rows H) is
    written after chunks 0..c-1 were read; it must not touch chunk c..C-1's logits."""
    vc = min(V, vc8 * 8)
    kind, size, S = lmhead.layout(T, H, V, vc, True)
    if kind != "shared":
        assert T > H
        return
    assert size >= V * H and size >= S + V * T
    for v0 in range(0, V, vc):
        rows = min(vc, V - v0)
        write_end = (v0 + rows) * H
        unread_start = S + v0 * T
        assert write_end <= unread_start, (v0, rows, write_end, unread_start)


def test_no_grad_uses_a_scratch_chunk_and_matches():
    x, W = torch.randn(20, 16), torch.randn(45, 16)
    y = torch.randint(0, 45, (20,))
    with torch.no_grad():
        a = lmhead.linear_cross_entropy(x, W, y, chunk_rows=8)
    assert a.grad_fn is None
    assert torch.allclose(a.double(), F.cross_entropy(F.linear(x.double(), W.double()), y), atol=1e-5)


@pytest.mark.parametrize("need", [(True, False, False), (False, True, False), (False, False, True),
                                  (True, True, False)])
def test_frozen_parameters(need):
    out, ref, got, _, gref = _case("cpu", 12, 16, 30, 8, "mean", 0.1, True, True, 0.0, 5, need=need)
    assert len(got) == sum(need)
    for a, r in zip(got, gref):
        assert _close(a, r, 1e-4)[0]


def test_nan_and_inf_logits_follow_torch():
    torch.manual_seed(0)
    x, W = torch.randn(6, 8), torch.randn(20, 8)
    x[1, 0] = float("nan")          # a NaN row
    x[2, 3] = float("inf")          # +-inf logits
    y = torch.randint(0, 20, (6,))
    y[4] = -100
    out = lmhead.linear_cross_entropy(x, W, y, reduction="none")
    ref = F.cross_entropy(F.linear(x.double(), W.double()), y, reduction="none")
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), (out, ref)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    assert torch.allclose(out[fin].double(), ref[fin], atol=1e-5)


def test_all_minus_inf_column_and_a_bad_target():
    x = torch.zeros(3, 2)
    W = torch.randn(5, 2)
    b = torch.full((5,), -math.inf)
    y = torch.tensor([0, 7, -100])
    out = lmhead.linear_cross_entropy(x, W, y, b, reduction="none")
    ref = F.cross_entropy(F.linear(x, W, b), torch.tensor([0, 0, -100]), reduction="none")
    assert torch.isnan(out[0]) and torch.isnan(ref[0])    # -inf - (-inf)
    assert torch.isnan(out[1])                            # target 7 of 5 classes: NaN
    assert out[2] == 0 and ref[2] == 0                    # ignored


def test_second_backward_is_refused_and_bits_repeat():
    torch.manual_seed(1)
    x = torch.randn(10, 12, requires_grad=True)
    W = torch.randn(33, 12, requires_grad=True)
    y = torch.randint(0, 33, (10,))
    grads = []
    for _ in range(2):
        loss = lmhead.linear_cross_entropy(x, W, y, label_smoothing=0.2, chunk_rows=8)
        grads.append(torch.autograd.grad(loss, (x, W), retain_graph=True) + (loss.detach(),))
        with pytest.raises(RuntimeError, match="backward ran through this loss already"):
            loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_accumulates_into_grad_and_module_form():
    torch.manual_seed(2)
    x = torch.randn(3, 5, 16, requires_grad=True)
    lin = torch.nn.Linear(16, 40, bias=False)
    y = torch.randint(0, 40, (3, 5))
    crit = cupyfuse.LinearCrossEntropyLoss(label_smoothing=0.1)
    for _ in range(2):
        crit(x, lin.weight, y).backward()
    ref_lin = torch.nn.Linear(16, 40, bias=False).double()
    ref_lin.weight.data.copy_(lin.weight.data)
    xr = x.detach().double().requires_grad_()
    for _ in range(2):
        F.cross_entropy(ref_lin(xr).reshape(-1, 40), y.reshape(-1), label_smoothing=0.1).backward()
    assert torch.allclose(lin.weight.grad.double(), ref_lin.weight.grad, atol=1e-5)
    assert torch.allclose(x.grad.double(), xr.grad, atol=1e-5)


def test_reduction_none_keeps_target_shape():
    x, W = torch.randn(2, 3, 8), torch.randn(10, 8)
    y = torch.randint(0, 10, (2, 3))
    assert lmhead.linear_cross_entropy(x, W, y, reduction="none").shape == (2, 3)


def test_bf16_on_the_cpu_no_worse_than_eager():
    torch.manual_seed(3)
    x, W = torch.randn(16, 32), torch.randn(300, 32) * 0.2
    y = torch.randint(0, 300, (16,))
    ref, _ = _reference(x, W, None, y, None, 0.0, "mean")
    xb, Wb = x.bfloat16().requires_grad_(), W.bfloat16().requires_grad_()
    ours = lmhead.linear_cross_entropy(xb, Wb, y)
    assert ours.dtype == torch.bfloat16
    xe, We = x.bfloat16().requires_grad_(), W.bfloat16().requires_grad_()
    eager = F.cross_entropy(F.linear(xe, We), y)
    assert abs(ours.double() - ref).item() <= max(abs(eager.double() - ref).item(), 2 ** -8 * ref.abs().item())
    ref2, rargs = _reference(x, W, None, y, None, 0.0, "mean")
    gref = torch.autograd.grad(ref2, rargs)
    ours.backward(), eager.backward()
    for a, e, r in ((xb, xe, gref[0]), (Wb, We, gref[1])):
        assert _close(a.grad, r, 0)[1] <= 1.5 * _close(e.grad, r, 0)[1] + 2 ** -8


@pytest.mark.parametrize("bad,match", [
    (dict(target=torch.zeros(4)), "integer class indices"),
    (dict(weight=torch.randn(7, 9)), r"hidden = x.shape\[-1\]"),
    (dict(weight=torch.randn(7, 8).double()), "must have x's dtype"),
    (dict(target=torch.zeros(5, dtype=torch.long)), "shape x.shape"),
    (dict(reduction="avg"), "reduction must be one of"),
    (dict(label_smoothing=1.5), r"label_smoothing must be in \[0, 1\]"),
    (dict(bias=torch.randn(3)), r"bias must be \(7,\)"),
    (dict(class_weight=torch.ones(3)), r"class_weight must be a \(7,\) tensor"),
])
def test_errors_say_what_to_do(bad, match):
    kw = dict(x=torch.randn(4, 8), weight=torch.randn(7, 8), target=torch.zeros(4, dtype=torch.long))
    kw.update(bad)
    with pytest.raises((TypeError, ValueError), match=match):
        lmhead.linear_cross_entropy(**kw)


# -- the GPU ------------------------------------------------------------------------------
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@needs_gpu
@pytest.mark.parametrize("T,H,V,vc", [(64, 48, 1000, 256), (33, 40, 517, 64), (256, 128, 4099, None),
                                      (128, 128, 3000, 512), (1, 16, 77, 8)])
@pytest.mark.parametrize("red,ls,use_cw,use_b", [("mean", 0.0, False, False), ("sum", 0.1, True, True),
                                                 ("none", 0.3, False, True)])
def test_gpu_float32_matches_float64(T, H, V, vc, red, ls, use_cw, use_b):
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        out, ref, got, _, gref = _case("cuda", T, H, V, vc, red, ls, use_cw, use_b, 0.2, T + V)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    assert _close(out, ref, 1e-4)[0], _close(out, ref, 1e-4)
    for a, r in zip(got, gref):
        ok, err = _close(a, r, 1e-4)
        assert ok, err


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H,V", [(512, 256, 8192), (511, 256, 5001), (1024, 1024, 32000)])
def test_gpu_16bit_no_worse_than_eager(dtype, T, H, V):
    """The 16-bit loss and gradients within eager's own error of float64 (x 1.5 + one
    rounding of the value's scale)."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).cuda()
    W = (torch.randn(V, H, generator=g) * H ** -0.5).cuda()
    y = torch.randint(0, V, (T,), generator=g).cuda()
    ref, rargs = _reference(x, W, None, y, None, 0.0, "mean")
    gref = torch.autograd.grad(ref, rargs)
    errs = {}
    for name, fn in (("eager", lambda a, b: F.cross_entropy(F.linear(a, b), y)),
                     ("ours", lambda a, b: lmhead.linear_cross_entropy(a, b, y))):
        a, b = x.to(dtype).requires_grad_(), W.to(dtype).requires_grad_()
        loss = fn(a, b)
        assert loss.dtype == dtype
        loss.backward()
        errs[name] = [_close(loss, ref, 0)[1]] + [_close(t.grad, r, 0)[1] for t, r in zip((a, b), gref)]
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    for mine, theirs in zip(errs["ours"], errs["eager"]):
        assert mine <= 1.5 * theirs + eps, errs


@gpu
@needs_gpu
def test_gpu_kernels_match_their_cpu_arithmetic():
    torch.manual_seed(7)
    T, H, V = 301, 64, 2003
    x = torch.randn(T, H)
    W = torch.randn(V, H) * 0.2
    b = torch.randn(V)
    y = torch.randint(0, V, (T,))
    y[::7] = -100
    cw = torch.rand(V) + 0.5
    res = {}
    for dev in ("cpu", "cuda"):
        xs, Ws, bs = (t.detach().clone().to(dev).requires_grad_() for t in (x, W, b))
        loss = lmhead.linear_cross_entropy(xs, Ws, y.to(dev), bs, class_weight=cw.to(dev),
                                           label_smoothing=0.15, chunk_rows=256)
        loss.backward()
        res[dev] = [loss.detach().cpu(), xs.grad.cpu(), Ws.grad.cpu(), bs.grad.cpu()]
    for a, c in zip(res["cpu"], res["cuda"]):
        assert torch.allclose(a, c, rtol=1e-4, atol=1e-5), (a - c).abs().max()


@gpu
@needs_gpu
def test_gpu_step_memory_is_the_weight_gradient_and_a_chunk():
    """tokens = hidden: peak beyond the inputs <= dW + one chunk + dx + 1 MiB of stats."""
    T = H = 1024
    V = 32000
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    W = (torch.randn(V, H, device="cuda") * H ** -0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (T,), device="cuda")
    lmhead.linear_cross_entropy(x, W, y).backward()      # (kernels compiled, caches warm)
    x.grad = W.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lmhead.linear_cross_entropy(x, W, y).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    vc = lmhead.chunk_rows_for(T, H, 2, V)
    bound = V * H * 2 + vc * H * 2 + T * H * 2 + (2 << 20)   # + per-token statistics
    assert peak <= bound, (peak / 2**20, bound / 2**20)
    assert W.grad.shape == (V, H) and W.grad.dtype == torch.bfloat16


def test_autocast_casts_like_linear_and_returns_float32():
    torch.manual_seed(4)
    x = torch.randn(8, 16, requires_grad=True)
    W = torch.randn(50, 16, requires_grad=True)
    y = torch.randint(0, 50, (8,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = lmhead.linear_cross_entropy(x, W, y)
        eager = F.cross_entropy(F.linear(x, W), y)
    assert ours.dtype == eager.dtype == torch.float32
    ref = F.cross_entropy(F.linear(x.double(), W.double()), y)
    assert abs(ours.double() - ref).item() <= abs(eager.double() - ref).item() * 1.5 + 2 ** -8
    ours.backward()
    assert x.grad.dtype == torch.float32 and W.grad.dtype == torch.float32


@pytest.mark.parametrize("red", ["mean", "sum", "none"])
@pytest.mark.parametrize("use_cw", [False, True])
def test_z_loss_adds_the_squared_logsumexp(red, use_cw):
    g = torch.Generator().manual_seed(9)
    T, H, V, zl = 14, 10, 29, 0.05
    x, W = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g)
    y = torch.randint(0, V, (T,), generator=g)
    y[::3] = -100
    cw = torch.rand(V, generator=g) + 0.5 if use_cw else None
    xr, Wr = x.double().requires_grad_(), W.double().requires_grad_()
    z = F.linear(xr, Wr)
    valid = y != -100
    ce = F.cross_entropy(z, y, weight=None if cw is None else cw.double(), label_smoothing=0.1,
                         reduction=red)
    zsq = torch.where(valid, torch.logsumexp(z, 1) ** 2, 0.0)
    denom = (cw.double()[y.clamp(0)] * valid).sum() if cw is not None else valid.sum()
    ref = ce + zl * {"mean": zsq.sum() / denom, "sum": zsq.sum(), "none": zsq}[red]
    cot = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    gref = torch.autograd.grad(ref, (xr, Wr), cot)
    xs, Ws = x.clone().requires_grad_(), W.clone().requires_grad_()
    out = lmhead.linear_cross_entropy(xs, Ws, y, class_weight=cw, label_smoothing=0.1,
                                      reduction=red, z_loss=zl, chunk_rows=8)
    got = torch.autograd.grad(out, (xs, Ws), cot.float())
    assert _close(out, ref, 1e-4)[0]
    for a, r in zip(got, gref):
        assert _close(a, r, 1e-4)[0], _close(a, r, 1e-4)
    with pytest.raises(ValueError, match="z_loss must be a finite number"):
        lmhead.linear_cross_entropy(xs, Ws, y, z_loss=-1.0)


# -- fused modules whose forward is a head and its loss ----------------------------------
class _LMLoss(torch.nn.Module):
    def __init__(self, H=16, V=40):
        super().__init__()
        self.V = V
        self.lm_head = torch.nn.Linear(H, V, bias=False)
        self.smooth = 0.1

    def forward(self, h, labels):
        logits = self.lm_head(h)
        return F.cross_entropy(logits.view(-1, self.V), labels.view(-1), ignore_index=-100,
                               label_smoothing=self.smooth)


class _LMCrit(torch.nn.Module):
    def __init__(self, H=16, V=40):
        super().__init__()
        self.head = torch.nn.Linear(H, V)
        self.crit = torch.nn.CrossEntropyLoss(ignore_index=3, reduction="sum")

    def forward(self, h, y):
        return self.crit(self.head(h), y)


class _LMBoth(_LMLoss):
    def forward(self, h, labels):
        logits = self.lm_head(h)
        return F.cross_entropy(logits.view(-1, self.V), labels.view(-1)), logits


@pytest.mark.parametrize("make", ["from_model", "fused_class"])
@pytest.mark.parametrize("Model,shape", [(_LMLoss, (2, 5, 16)), (_LMCrit, (9, 16))])
def test_a_16bit_head_and_loss_module_takes_the_lm_head_path(make, Model, shape):
    torch.manual_seed(5)
    model = Model().bfloat16()
    fused = cupyfuse.from_model(model) if make == "from_model" else cupyfuse.fused_class(Model)().bfloat16()
    if make == "fused_class":
        fused.load_state_dict(model.state_dict())
    h = torch.randn(*shape).bfloat16().requires_grad_()
    y = torch.randint(0, 40, shape[:-1])
    out = fused(h, y)
    assert type(out.grad_fn).__name__ == "_LinearCrossEntropyBackward"
    h2 = h.detach().clone().requires_grad_()
    ref = Model().bfloat16()
    ref.load_state_dict(model.state_dict())
    expect = ref(h2, y)
    assert out.dtype == expect.dtype and abs(out.float() - expect.float()) <= 2e-2 * abs(expect.float()) + 1e-2
    out.backward(), expect.backward()
    assert torch.allclose(h.grad.float(), h2.grad.float(), atol=2e-2, rtol=5e-2)


def test_a_changed_attribute_is_seen_and_other_forms_run_torch():
    torch.manual_seed(6)
    model = _LMLoss().bfloat16()
    fused = cupyfuse.from_model(model)
    h, y = torch.randn(3, 4, 16).bfloat16(), torch.randint(0, 40, (3, 4))
    a = fused(h, y)
    model.smooth = 0.6                                    # baked into the trace: retraced
    b = fused(h, y)
    ref = F.cross_entropy(F.linear(h, model.lm_head.weight).view(-1, 40).float(), y.view(-1),
                          label_smoothing=0.6)
    assert abs(b.float() - ref) < 2e-2 and abs(a.float() - b.float()) > 1e-3
    both = cupyfuse.from_model(_LMBoth().bfloat16())
    with pytest.warns(UserWarning, match="runs its original forward"):
        loss, logits = both(h, y)
    assert logits.shape == (3, 4, 40)


def test_under_torch_compile_a_graph_break_with_the_same_result():
    torch.manual_seed(8)
    x = torch.randn(6, 12, requires_grad=True)
    W = torch.randn(30, 12, requires_grad=True)
    y = torch.randint(0, 30, (6,))

    def step(x, W):
        return lmhead.linear_cross_entropy(torch.tanh(x), W, y) * 2.0

    eager = step(x, W)
    ge = torch.autograd.grad(eager, (x, W))
    comp = torch.compile(step, backend="aot_eager")(x, W)
    gc = torch.autograd.grad(comp, (x, W))
    assert torch.equal(eager, comp) and all(torch.equal(a, b) for a, b in zip(ge, gc))
