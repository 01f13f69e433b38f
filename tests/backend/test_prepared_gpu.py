"""GPU tests of prepared launches (cupyfuse/backend/prepared.py): a repeated small-batch
call runs through launches built once, and must give what the general path gives -- for
functions with torch and CuPy operands and for modules -- and must notice what changed
between calls: new parameter contents, a replaced parameter, a new scalar attribute value,
the train/eval mode, other shapes or strides, a non-default stream. Marked ``gpu``."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from cupyfuse.backend import execute
from cupyfuse import runner
from cupyfuse import config
import cupyfuse
from cupyfuse.backend import engine, prepared
from cupyfuse import interop
from cupyfuse.interop import cupy_available
from helpers import fused_copy, runner_of

pytestmark = [
    pytest.mark.usefixtures("fp32_matmul"),
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and cupy_available()),
                       reason="needs a CUDA GPU visible to both torch and CuPy"),
]

hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="prepared launches run the sm90 engine's skinny kernel")


def _ref64(x, w, b, tail):
    return tail((x.double() @ w.double().T) + b.double())


def tail_softmax_sum(h):
    return torch.softmax(h * 0.5, dim=1).max(dim=1, keepdim=True)[0] + torch.sigmoid(h).mean(1, keepdim=True)


def tail_gelu(h):
    return torch.nn.functional.gelu(h) * 2.0 - 1.0


@hopper
@pytest.mark.parametrize("fuse", [True, False], ids=["one_launch", "two_launches"])
@pytest.mark.parametrize("tail", [tail_softmax_sum, tail_gelu])
@pytest.mark.parametrize("M,N,K", [(1, 64, 96), (7, 300, 516), (16, 1000, 4096), (33, 130, 260),
                                   (2, 20000, 64),
                                   # 16-row tensor-core tiles (K unsplit: 8200 x 520)
                                   (16, 1100, 4096), (13, 8200, 520)])
def test_function_repeat_calls_use_prepared_launches(tail, M, N, K, fuse, monkeypatch):
    from cupyfuse.backend import prepared

    monkeypatch.setattr(config, "FUSE_TAIL", fuse)
    # the one-launch form on every width and batch (by default only narrow rows take it,
    # and only one row per tail block past 4 rows)
    monkeypatch.setattr(config, "FUSE_MAX_WIDTH", 1 << 30)
    monkeypatch.setattr(config, "FUSE_MAX_ROWS_PER_BLOCK", 1 << 30)
    cupyfuse.clear_cache()   # prepared launches made under the other setting are not reused
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    w = torch.randn(N, K, device="cuda", generator=g) / K ** 0.5
    b = torch.randn(N, device="cuda", generator=g)
    outs = []
    for i in range(3):
        x = torch.randn(M, K, device="cuda", generator=g)
        out = cupyfuse.fused_linear(x, w, b, tail)
        torch.testing.assert_close(out.double(), _ref64(x, w, b, tail), atol=1e-4, rtol=1e-4)
        outs.append(out)
    keys = [k for k in runner._fast_fn if k[0] is tail and k[1] == (M, K)]
    assert keys and runner._fast_fn[keys[0]] is not None, "no prepared launch was made"
    pr = runner._fast_fn[keys[0]][0]
    assert len(pr.steps) == (1 if fuse else 2), (fuse, len(pr.steps))
    plan = engine.skinny_plan(M, N, K, 132)
    if plan.mt == 16:   # the tensor-core tile, alone or with the tail in its launch
        assert pr.steps[0].fn.name.endswith("_sk16" if fuse else plan.fn), pr.steps[0].fn.name
        assert pr.steps[0].block == plan.threads
    # bitwise the same on a repeat with the same x (fixed-order sums, counters re-armed)
    x = torch.randn(M, K, device="cuda", generator=g)
    first = cupyfuse.fused_linear(x, w, b, tail)
    for _ in range(5):
        assert torch.equal(cupyfuse.fused_linear(x, w, b, tail), first)


@hopper
def test_function_prepared_with_cupy_operands_returns_cupy():
    import cupy

    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(200, 256, device="cuda", generator=g) / 16
    b = torch.randn(200, device="cuda", generator=g)
    wc, bc = cupy.asarray(w), cupy.asarray(b)
    for i in range(3):
        x = torch.randn(5, 256, device="cuda", generator=g)
        out = cupyfuse.fused_linear(cupy.asarray(x), wc, bc, tail_gelu)
        assert isinstance(out, cupy.ndarray) and out.shape == (5, 200)
        torch.testing.assert_close(torch.from_dlpack(out).double(), _ref64(x, w, b, tail_gelu),
                                   atol=1e-4, rtol=1e-4)
    # an in-place change of a CuPy weight is seen at once (no derived copies at this size)
    wc *= 2
    x = torch.randn(5, 256, device="cuda", generator=g)
    out = cupyfuse.fused_linear(cupy.asarray(x), wc, bc, tail_gelu)
    torch.testing.assert_close(torch.from_dlpack(out).double(),
                               _ref64(x, torch.from_dlpack(wc), b, tail_gelu), atol=1e-4, rtol=1e-4)


@hopper
def test_function_strided_x_is_not_taken_for_contiguous():
    g = torch.Generator(device="cuda").manual_seed(2)
    w = torch.randn(64, 128, device="cuda", generator=g)
    b = torch.zeros(64, device="cuda")
    x = torch.randn(4, 128, device="cuda", generator=g)
    cupyfuse.fused_linear(x, w, b, tail_gelu)
    cupyfuse.fused_linear(x, w, b, tail_gelu)
    big = torch.randn(4, 300, device="cuda", generator=g)
    xs = big[:, 7:135]            # same shape, other strides
    for _ in range(2):
        out = cupyfuse.fused_linear(xs, w, b, tail_gelu)
        torch.testing.assert_close(out.double(), _ref64(xs, w, b, tail_gelu), atol=1e-4, rtol=1e-4)


class Net(nn.Module):
    def __init__(self, k=96, n=64):
        super().__init__()
        self.linear = nn.Linear(k, n)
        self.bn = nn.BatchNorm1d(n)
        self.scale = 1.5

    def forward(self, x):
        return torch.relu(self.bn(self.linear(x)) * self.scale).sum(dim=1, keepdim=True)


@hopper
@pytest.mark.parametrize("api", ["from_model", "fused_class"])
def test_module_prepared_follows_changes(api):
    torch.manual_seed(0)
    if api == "from_model":
        orig = Net().cuda()
        f = cupyfuse.from_model(orig)
        model = orig
    else:
        f = cupyfuse.fused_class(Net)().cuda()
        model = f
    g = torch.Generator(device="cuda").manual_seed(3)

    def check(x):
        ref = Net().double()
        ref.load_state_dict({k: v.double().cpu() for k, v in model.state_dict().items()})
        ref.scale = model.scale
        ref.train(model.training)
        with torch.no_grad():
            want = ref(x.double().cpu())
        got = f(x)
        torch.testing.assert_close(got.double().cpu(), want, atol=1e-4, rtol=1e-4)
        # running statistics as the float64 twin has them after the same call
        torch.testing.assert_close(model.bn.running_mean.double().cpu(), ref.bn.running_mean,
                                   atol=1e-5, rtol=1e-4)
        assert int(model.bn.num_batches_tracked) == int(ref.bn.num_batches_tracked)

    for _ in range(3):        # train mode: batch statistics; calls 2, 3 prepared
        check(torch.randn(8, 96, device="cuda", generator=g))
    runner = runner_of(f)
    assert any(v is not None for v in runner.fast.values()), "no prepared launch was made"
    with torch.no_grad():
        model.linear.weight.mul_(-1.0)           # new contents, same tensor
    check(torch.randn(8, 96, device="cuda", generator=g))
    model.linear.weight = nn.Parameter(torch.randn(64, 96, device="cuda") * 0.1)   # replaced
    check(torch.randn(8, 96, device="cuda", generator=g))
    model.scale = -0.5                           # a plain attribute the forward reads
    check(torch.randn(8, 96, device="cuda", generator=g))
    check(torch.randn(8, 96, device="cuda", generator=g))
    model.eval()
    if api == "from_model":
        f.eval()
    check(torch.randn(8, 96, device="cuda", generator=g))
    check(torch.randn(8, 96, device="cuda", generator=g))
    check(torch.randn(3, 96, device="cuda", generator=g))   # another batch size


@hopper
def test_module_prepared_in_grad_mode_with_parameters_requiring_grad():
    torch.manual_seed(1)
    orig = nn.Sequential(nn.Linear(128, 256), nn.GELU()).cuda()
    f = cupyfuse.from_model(orig)
    x = torch.randn(16, 128, device="cuda")
    want = orig(x).detach()
    for _ in range(3):   # the general path, then the prepared launches under autograd
        out = f(x)
        assert out.requires_grad and out.grad_fn is not None
        torch.testing.assert_close(out.detach(), want, atol=1e-4, rtol=1e-4)
    assert any(v is not None for v in runner_of(f).fast.values())


@hopper
def test_prepared_launches_on_the_callers_stream():
    torch.manual_seed(2)
    w = torch.randn(512, 512, device="cuda") / 22
    b = torch.randn(512, device="cuda")
    x = torch.randn(32, 512, device="cuda")
    cupyfuse.fused_linear(x, w, b, tail_gelu)
    cupyfuse.fused_linear(x, w, b, tail_gelu)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)   # the stream is busy: our launches must queue behind
        x2 = x * 2.0
        out = cupyfuse.fused_linear(x2, w, b, tail_gelu)
    s.synchronize()
    torch.testing.assert_close(out.double(), _ref64(x * 2.0, w, b, tail_gelu), atol=1e-4, rtol=1e-4)


@hopper
def test_poisoned_buffers_still_fully_written():
    old = interop.poison_outputs
    interop.poison_outputs = True
    try:
        w = torch.randn(100, 64, device="cuda")
        b = torch.randn(100, device="cuda")
        for _ in range(3):
            x = torch.randn(9, 64, device="cuda")
            out = cupyfuse.fused_linear(x, w, b, tail_softmax_sum)
            assert torch.isfinite(out).all()
    finally:
        interop.poison_outputs = old


@hopper
@pytest.mark.parametrize("problem", ["55", "56", "98"])
@pytest.mark.parametrize("M", [1, 5, 16])
def test_named_ops_small_batches_become_prepared_generic_launches(problem, M):
    """After one call through the op, a small batch runs the generic program of the same
    math (prepared launches): every call must still match float64."""
    from cupyfuse.kernelbench import models, ops

    torch.manual_seed(M)
    init = {"55": (96, 70, 2, 0.5), "56": (96, 70), "98": (96, 64, 4, 2.0)}[problem]
    model = models.PROBLEMS[problem].model(*init).cuda()
    lin = next(m for m in model.modules() if isinstance(m, nn.Linear))
    w, b = lin.weight.detach(), lin.bias.detach()
    m64 = __import__("copy").deepcopy(model).double()
    fn = {"55": lambda x: ops.matmul_maxpool_sum_scale(x, w, b, init[2], init[3]),
          "56": lambda x: ops.matmul_sigmoid_sum(x, w, b),
          "98": lambda x: ops.matmul_avgpool_gelu_scale_max(x, w, b, init[2], init[3])}[problem]
    for i in range(3):
        x = torch.randn(M, 96, device="cuda") * (i + 1)
        if i == 2:
            x[0, 3] = float("inf")
        with torch.no_grad():
            want = m64(x.double())
        got = fn(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4, equal_nan=True)
    tail = ops._small_tail(problem, *(init[2:] if problem != "56" else ()))
    assert any(k[0] is tail and v is not None for k, v in runner._fast_fn.items())


@hopper
def test_named_module_small_batch_in_grad_and_no_grad():
    from cupyfuse.kernelbench import models
    from cupyfuse.kernelbench import modules as cnn

    torch.manual_seed(4)
    orig = models.PROBLEMS["56"].model(512, 512).cuda()
    f = fused_copy(orig)
    x = torch.rand(32, 512, device="cuda")
    want = orig(x).detach()
    for _ in range(3):
        torch.testing.assert_close(f(x), want, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        for _ in range(4):   # no_grad: the module's CUDA graph captures a prepared call
            torch.testing.assert_close(f(x), want, atol=1e-4, rtol=1e-4)


@hopper
def test_prepared_call_inside_a_callers_graph_capture():
    torch.manual_seed(5)
    w = torch.randn(256, 128, device="cuda") / 11
    b = torch.randn(256, device="cuda")
    x = torch.randn(8, 128, device="cuda")
    want = cupyfuse.fused_linear(x, w, b, tail_softmax_sum)   # prepared by now
    cupyfuse.fused_linear(x, w, b, tail_softmax_sum)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cupyfuse.fused_linear(x, w, b, tail_softmax_sum)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        static = cupyfuse.fused_linear(x, w, b, tail_softmax_sum)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, want)
    x.mul_(-1.0)                 # new contents at the captured address
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, cupyfuse.fused_linear(x, w, b, tail_softmax_sum))


@hopper
@pytest.mark.parametrize("M,N,K", [(65, 256, 512), (300, 1000, 1028), (500, 130, 4096)])
def test_engine_sized_calls_are_prepared_and_follow_weight_changes(M, N, K):
    """Batches past the skinny kernel: prepared launches of the 3xTF32 engine (x split into
    the workspace, the weight's split cached and rebuilt when the weight changes)."""
    g = torch.Generator(device="cuda").manual_seed(M)
    w = torch.randn(N, K, device="cuda", generator=g) / K ** 0.5
    b = torch.randn(N, device="cuda", generator=g)
    x = torch.randn(M, K, device="cuda", generator=g)
    first = cupyfuse.fused_linear(x, w, b, tail_softmax_sum)
    torch.testing.assert_close(first.double(), _ref64(x, w, b, tail_softmax_sum), atol=1e-4,
                               rtol=1e-4)
    key = next(k for k in runner._fast_fn if k[0] is tail_softmax_sum and k[1] == (M, K))
    pr = runner._fast_fn[key][0]
    assert pr is not None and pr.highest and any(st.eng for st in pr.steps)
    for _ in range(3):
        assert torch.equal(cupyfuse.fused_linear(x, w, b, tail_softmax_sum), first)
    with torch.no_grad():
        w.mul_(-0.5)              # in place: the cached split must be rebuilt
    out = cupyfuse.fused_linear(x, w, b, tail_softmax_sum)
    torch.testing.assert_close(out.double(), _ref64(x, w, b, tail_softmax_sum), atol=1e-4,
                               rtol=1e-4)
    # another precision than "highest" takes the general path (one TF32 pass)
    hi = cupyfuse.fused_linear(x, w, b, tail_softmax_sum, precision="high")
    torch.testing.assert_close(hi.double(), _ref64(x, w, b, tail_softmax_sum), atol=5e-3,
                               rtol=5e-3)


@hopper
def test_engine_sized_cupy_weight_prepared_handle_and_raw():
    import cupy

    g = torch.Generator(device="cuda").manual_seed(11)
    w = torch.randn(300, 512, device="cuda", generator=g) / 22
    b = torch.randn(300, device="cuda", generator=g)
    wc, bc = cupy.asarray(w), cupy.asarray(b)
    pw = cupyfuse.prepare_weight(wc)
    for weight in (pw, wc):
        for _ in range(3):
            x = torch.randn(200, 512, device="cuda", generator=g)
            out = cupyfuse.fused_linear(cupy.asarray(x), weight, bc, tail_gelu)
            assert isinstance(out, cupy.ndarray)
            torch.testing.assert_close(torch.from_dlpack(out).double(),
                                       _ref64(x, torch.from_dlpack(wc), b, tail_gelu),
                                       atol=1e-4, rtol=1e-4)
    wc *= 3.0                     # a raw CuPy weight is re-split every call: seen at once;
    pw.refresh()                  # the handle after refresh()
    x = torch.randn(200, 512, device="cuda", generator=g)
    for weight in (wc, pw):
        out = cupyfuse.fused_linear(cupy.asarray(x), weight, bc, tail_gelu)
        torch.testing.assert_close(torch.from_dlpack(out).double(),
                                   _ref64(x, torch.from_dlpack(wc), b, tail_gelu),
                                   atol=1e-4, rtol=1e-4)


@hopper
@pytest.mark.parametrize("problem", ["55", "56", "98"])
def test_named_ops_mid_batches_prepared(problem):
    from cupyfuse.kernelbench import models

    torch.manual_seed(7)
    init = {"55": (512, 1024, 2, 0.5), "56": (512, 1024), "98": (512, 1024, 16, 2.0)}[problem]
    model = models.PROBLEMS[problem].model(*init).cuda()
    lin = next(m for m in model.modules() if isinstance(m, nn.Linear))
    m64 = __import__("copy").deepcopy(model).double()
    f = fused_copy(model)
    for i in range(3):
        x = torch.randn(512, 512, device="cuda") * (i + 1)
        with torch.no_grad():
            want = m64(x.double())
        got = f(x)                                  # grad mode, parameters requiring grad
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    assert lin.weight.requires_grad


@hopper
def test_batches_past_engine_max_take_the_general_path():
    from cupyfuse.backend import prepared

    M = max(config.ENGINE_MAX_M, config.ENGINE_MAX_MK // 256) + 1
    N = config.ENGINE_MAX_MNK // (M * 256) + 8
    assert not prepared.engine_batch_ok(M, 256, N)
    assert prepared.engine_batch_ok(M, 256, 64)   # a narrow GEMM of the same x is prepared
    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(N, 256, device="cuda", generator=g) / 16
    b = torch.randn(N, device="cuda", generator=g)
    x = torch.randn(M, 256, device="cuda", generator=g)
    for _ in range(2):
        out = cupyfuse.fused_linear(x, w, b, tail_gelu)
        torch.testing.assert_close(out.double(), _ref64(x, w, b, tail_gelu), atol=1e-4, rtol=1e-4)
    key = next(k for k in runner._fast_fn if k[0] is tail_gelu and k[1] == (M, 256))
    assert runner._fast_fn[key] is None


@hopper
@pytest.mark.parametrize("M,N,K,variant", [
    (M, N, K, v) for M, N, K in [(1, 96, 70), (8, 96, 70), (64, 1024, 1024), (512, 1024, 512)]
    for v in ("train", "eval", "momentum_none", "frozen_bn")
    if M > 1 or v == "eval"])   # batch statistics of one row: torch raises (own-kernel tests)
def test_model39_module_small_and_mid_batches_generic(M, N, K, variant):
    """39's module at host-bound sizes runs the generic program of the original forward
    over its own submodules (prepared launches after the first call): outputs, running
    statistics and num_batches_tracked follow the original model call by call, in grad
    mode, and the module's state_dict keys are unchanged."""
    from cupyfuse.kernelbench import models

    torch.manual_seed(M + N)
    orig = models.GemmScaleBatchNorm(K, N, (N,), momentum=None if variant == "momentum_none"
                                     else 0.1).cuda()
    if variant == "eval":
        orig.eval()
    f = fused_copy(orig)
    if variant == "frozen_bn":
        orig.bn.eval()
        f.bn.eval()
    keys = set(f.state_dict())
    general = []
    real = execute.run_gpu

    def counting(*a, **k):
        general.append(1)
        return real(*a, **k)

    for i in range(4):
        x = torch.randn(M, K, device="cuda") * (i + 1)
        want = orig(x).detach()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(execute, "run_gpu", counting)
            got = f(x)                        # grad mode, parameters requiring grad
        if i > 0:   # the later calls: prepared launches only
            assert not general, f"call {i} ran the general path"
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(f.bn, name), getattr(orig.bn, name),
                                       atol=1e-5, rtol=1e-5, msg=f"{name} after call {i}")
    assert set(f.state_dict()) == keys
    runner = f.__dict__.get("_cupyfuse_runner")
    assert runner is not None and any(v is not None for v in runner.fast.values()), \
        "the generic program's launches were not prepared"
    bn = torch.nn.BatchNorm1d(N).cuda().train(variant not in ("eval", "frozen_bn"))
    f.bn = bn                                 # a reassigned submodule is seen
    orig.bn = __import__("copy").deepcopy(bn)
    x = torch.randn(M, K, device="cuda")
    torch.testing.assert_close(f(x), orig(x).detach(), atol=1e-4, rtol=1e-4)


@hopper
def test_general_path_frees_its_buffers_without_the_cyclic_gc(monkeypatch):
    """With prepared launches off, every call runs the general path; with Python's cyclic
    GC off, memory must stay where it was (a closure cycle holding the call's buffers
    until the GC runs shows as +27 KB a call)."""
    import gc

    from cupyfuse.kernelbench import models

    monkeypatch.setattr(runner, "_try_prepare", lambda *a, **k: None)
    monkeypatch.setattr(interop, "poison_outputs", False)
    torch.manual_seed(0)
    f = fused_copy(models.GemmScaleBatchNorm(96, 70, (70,)).cuda())
    g = fused_copy(models.MatmulSigmoidSum(96, 70).cuda())
    x = torch.rand(32, 96, device="cuda")
    with torch.no_grad():
        for m in (f, g):
            for _ in range(3):
                m(x)
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()
    try:
        before = torch.cuda.memory_allocated()
        with torch.no_grad():
            for _ in range(50):
                f(x)
                g(x)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
    finally:
        gc.enable()
    assert after == before, (before, after)


@hopper
def test_workspaces_kept_within_the_budget_and_given_back(monkeypatch):
    """A prepared engine call keeps its workspace for the next call (no allocations, no
    tensor-map encoding per call) while it fits WS_KEEP_BYTES and the WS_KEEP_TOTAL budget;
    cupyfuse.clear_cache() gives every kept workspace back; past the limits the buffers are
    allocated per call and the result is the same."""
    from cupyfuse.backend import prepared

    g = torch.Generator(device="cuda").manual_seed(11)
    M, K, N = 2048, 1024, 768
    w = torch.randn(N, K, device="cuda", generator=g) / 32
    b = torch.randn(N, device="cuda", generator=g)
    x = torch.randn(M, K, device="cuda", generator=g)
    ref = _ref64(x, w, b, tail_gelu)
    cupyfuse.clear_cache()
    assert prepared._kept_bytes[0] == 0
    for _ in range(3):
        out = cupyfuse.fused_linear(x, w, b, tail_gelu)
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    key = next(k for k in runner._fast_fn if k[0] is tail_gelu and k[1] == (M, K))
    pr = runner._fast_fn[key][0]
    assert len(pr._ws) == 1, "the workspace was not kept"
    size = next(iter(pr._wsb.values()))
    assert size >= 2 * M * K * 4 and prepared._kept_bytes[0] >= size
    ws_before = next(iter(pr._ws.values()))[1]
    cupyfuse.fused_linear(x, w, b, tail_gelu)
    assert next(iter(pr._ws.values()))[1] == ws_before   # the same buffers again
    cupyfuse.clear_cache()
    assert prepared._kept_bytes[0] == 0 and not pr._ws
    for limit, total in ((size - 1, 1 << 40), (1 << 40, size - 1)):
        monkeypatch.setattr(config, "WS_KEEP_BYTES", limit)
        monkeypatch.setattr(config, "WS_KEEP_TOTAL", total)
        for _ in range(3):
            out = cupyfuse.fused_linear(x, w, b, tail_gelu)
            torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
        pr = runner._fast_fn[next(k for k in runner._fast_fn
                                 if k[0] is tail_gelu and k[1] == (M, K))][0]
        assert not pr._ws and prepared._kept_bytes[0] == 0
        cupyfuse.clear_cache()


@hopper
def test_ready_plan_matches_the_full_path_and_follows_workspace_growth(monkeypatch):
    """A prepared call with no derived weights runs its ready plan (the kept workspace's
    addresses in place): bitwise the full path's result, on a second stream too, and
    rebuilt when the stream's skinny workspace is replaced by a bigger one."""
    from cupyfuse.backend import engine

    torch.manual_seed(3)
    small = nn.Sequential(nn.Linear(2048, 96), nn.GELU()).cuda()   # K split: a workspace
    f = cupyfuse.from_model(small)
    x = torch.randn(5, 2048, device="cuda")
    with torch.no_grad():
        first = f(x)
        f(x)
    (pr, _), = [v for v in runner_of(f).fast.values() if v is not None]
    assert pr.simple and pr._ready, "no ready plan after two calls"
    with torch.no_grad():
        ready = f(x)
        pr.simple = False
        pr._ready.clear()
        full = f(x)
        pr.simple = True
        f(x)                      # the full path once more: makes the plan again
        assert pr._ready
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            other = f(x)
        s.synchronize()
        # a bigger skinny workspace for this stream: the plan's addresses are stale
        # 16 rows x 128 outputs in 64 K splits: 131072 partial sums (the minimum is 65536),
        # added by the GEMM's last blocks (not left to the tail: config.SKINNY_KSUM)
        monkeypatch.setattr(config, "SKINNY_KSUM", False)
        big = cupyfuse.from_model(nn.Sequential(nn.Linear(65536, 128), nn.ReLU()).cuda())
        key = (torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        engine._skinny_ws.pop(key, None)   # a fresh, minimal one (earlier tests grew it)
        assert torch.equal(f(x), first)    # the plan made again over it
        before = engine._skinny_ws.get(key)
        big(torch.randn(16, 65536, device="cuda"))
        assert engine._skinny_ws.get(key) is not before, "the workspace did not grow"
        after = f(x)
    for name, t in (("ready", ready), ("full", full), ("other stream", other), ("after", after)):
        assert torch.equal(t, first), name
    torch.testing.assert_close(first, small(x).detach(), atol=1e-4, rtol=1e-4)


@hopper
@pytest.mark.parametrize("batch", [128, 512])   # x split into the workspace; x read itself
def test_engine_ready_plan_follows_the_weights(batch):
    """A prepared call with engine steps runs a ready plan too (the weight splits' maps in
    place): bitwise the full path's result, x at another address read through its own
    map, and the plan dropped when a weight changes in place, is replaced, or the
    precision is not "highest"."""
    from cupyfuse.backend import prepared

    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 512),
                          nn.Tanh()).cuda()
    f = cupyfuse.from_model(model)
    x = torch.randn(batch, 1024, device="cuda")

    def ref64(x):
        h = torch.nn.functional.gelu(x.double() @ model[0].weight.double().t()
                                     + model[0].bias.double())
        return torch.tanh(h @ model[2].weight.double().t() + model[2].bias.double())

    with torch.no_grad():
        first = f(x)
        f(x)
        (pr, paths), = [v for v in runner_of(f).fast.values() if v is not None]
        assert pr.simple and any(st.eng is not None for st in pr.steps)
        (ready,) = pr._ready.values()
        assert len(ready[2]) == 2, "the plan does not hold both engine weights"
        got = f(x)
        pr._ready.clear()
        pr.simple = False
        full = f(x)
        pr.simple = True
        assert torch.equal(got, full) and torch.equal(got, first)
        f(x)
        assert pr._ready
        x2 = x.clone()             # another address: the engine's x map per call
        assert torch.equal(f(x2), first)
        torch.testing.assert_close(first.double(), ref64(x), atol=1e-4, rtol=1e-4)
        # an in-place change of a weight: the plan's version check sends the call to the
        # full path, which rebuilds the split and the plan
        model[0].weight.mul_(0.5)
        torch.testing.assert_close(f(x).double(), ref64(x), atol=1e-4, rtol=1e-4)
        assert pr._ready and next(iter(pr._ready.values()))[2][0][2] == \
            model[0].weight._version
        torch.testing.assert_close(f(x).double(), ref64(x), atol=1e-4, rtol=1e-4)
        # a new Parameter of the same shape: identity differs
        model[2].weight = nn.Parameter(torch.randn(512, 1024, device="cuda") * 0.03)
        torch.testing.assert_close(f(x).double(), ref64(x), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(f(x).double(), ref64(x), atol=1e-4, rtol=1e-4)
        # precision "high": the engine's prepared launches decline (general path)
        srcs = [get(model) for get, _ in paths]
        sptrs = [t.data_ptr() if isinstance(t, torch.Tensor) else 0 for t in srcs]
        stream = prepared.torch_stream(torch.cuda.current_device())
        assert pr._ready
        assert pr([x.data_ptr()], sptrs, stream, False, srcs, "high") is None
        out = pr([x.data_ptr()], sptrs, stream, False, srcs, "highest")
        torch.testing.assert_close(out.double(), ref64(x), atol=1e-4, rtol=1e-4)


@hopper
def test_engine_ready_plan_of_fused_linear_follows_in_place_changes():
    """fused_linear at an engine batch: the ready plan, then the weight changed in place."""
    torch.manual_seed(5)
    x = torch.randn(96, 1024, device="cuda")
    w = torch.randn(768, 1024, device="cuda") * 0.03
    b = torch.randn(768, device="cuda")

    def tail(h):
        return torch.sigmoid(h).sum(dim=1)

    for step in range(6):
        if step == 3:
            w.add_(0.01)
        ref = torch.sigmoid(x.double() @ w.double().t() + b.double()).sum(dim=1)
        torch.testing.assert_close(cupyfuse.fused_linear(x, w, b, tail).double(), ref,
                                   atol=1e-4, rtol=1e-4)
    pr = runner._fast_fn[next(k for k in runner._fast_fn if k[0] is tail)][0]
    assert pr is not None and pr._ready and any(st.eng is not None for st in pr.steps)


@hopper
@pytest.mark.parametrize("tail", ["softmax", "gelu_sum", "chain"])
def test_split_k_sum_read_by_the_tail_is_bitwise_the_splitk_sum(monkeypatch, tail):
    """Prepared engine launches whose GEMM is split along K: the tail kernel reading the
    partial products itself (no splitk_sum launch) gives bitwise the result of the
    splitk_sum launch, and one launch fewer per such GEMM."""
    from cupyfuse.backend import prepared

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(1024, 1000)
            self.fc2 = nn.Linear(1000, 256)

        def forward(self, x):
            h = self.fc(x)
            if tail == "softmax":
                return torch.softmax(h, dim=1)
            if tail == "gelu_sum":
                return torch.nn.functional.gelu(h).sum(dim=1, keepdim=True) + h.amax(1, True)
            return torch.tanh(self.fc2(torch.relu(h)))

    torch.manual_seed(6)
    model = Net().cuda()
    x = torch.randn(96, 1024, device="cuda")
    x[3, 7] = float("nan")
    x[5, 2] = float("inf")
    outs, steps = {}, {}
    for on in (True, False):
        monkeypatch.setattr(config, "KSUM_IN_TAIL", on)
        f = cupyfuse.from_model(model)
        with torch.no_grad():
            for _ in range(3):
                outs[on] = f(x)
        (pr, _), = [v for v in runner_of(f).fast.values() if v is not None]
        steps[on] = [st.fn.name for st in pr.steps]
    assert any(st.endswith(tuple(f"_{96 * n}" for n in (1000, 256))) for st in steps[True])
    assert "splitk_sum" in steps[False] and "splitk_sum" not in steps[True], steps
    assert len(steps[True]) < len(steps[False])
    assert torch.equal(outs[True].isnan(), outs[False].isnan())
    assert torch.equal(torch.nan_to_num(outs[True]), torch.nan_to_num(outs[False]))
    with torch.no_grad():
        want = model.double()(x.double())
    model.float()
    torch.testing.assert_close(outs[True].double(), want, atol=1e-4, rtol=1e-4, equal_nan=True)


class _NumberArg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(96, 40)

    def forward(self, x, a, c=0.5):
        h = self.fc(x)
        return torch.softmax(h * a, dim=1) + torch.relu(h) * c


@hopper
def test_python_numbers_passed_get_prepared_launches_per_value():
    """A Python number passed to the forward (a constant of its program) gets prepared
    launches of its own per value, so calls alternating values must each get their own
    value's result (0.0 and -0.0, 1 and 1.0 apart; a NaN never finds an entry and takes
    the general path)."""
    torch.manual_seed(3)
    model = _NumberArg().cuda()
    twin = cupyfuse.fused_class(_NumberArg)().cuda()
    twin.load_state_dict(model.state_dict())
    m64 = _NumberArg().double().cuda()
    m64.load_state_dict(model.state_dict())
    x = torch.randn(12, 96, device="cuda")
    values = [0.5, 2.0, 2, -0.0, 0.0, float("nan"), float("inf"), 1, 1.0]
    with torch.no_grad():
        for f in (cupyfuse.from_model(model), twin):
            for _ in range(3):
                for a in values:
                    for c in (0.5, -2):
                        want = m64(x.double(), a, c)
                        got = f(x, a, c)
                        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4,
                                                   equal_nan=True)
            runner = runner_of(f)
            keyed = [k for k, v in runner.fast.items() if v is not None]
            assert len(keyed) >= 8, keyed   # the values' own prepared entries (16 kept)


@hopper
def test_fused_linear_number_extras_get_prepared_launches_per_value():
    def tail(h, y, s):
        return torch.tanh(h * s) + y

    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(9, 70, device="cuda", generator=g)
    w = torch.randn(33, 70, device="cuda", generator=g) / 8
    b = torch.randn(33, device="cuda", generator=g)
    y = torch.randn(9, 33, device="cuda", generator=g)
    runner._fast_fn.clear()
    for _ in range(3):
        for s in (0.5, 3, 3.0, -0.0, 0.0, 2.5):
            got = cupyfuse.fused_linear(x, w, b, tail, y, s)
            want = tail(x.double() @ w.double().T + b.double(), y.double(), s)
            torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    assert sum(1 for k, v in runner._fast_fn.items() if k[0] is tail and v) >= 5
